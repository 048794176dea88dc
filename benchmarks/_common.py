"""Shared pieces of the GPU benchmarks (bench.py, bench_dense.py, bench_moe.py, ...): timing, ceilings, the JAX
decode / prefill / generate measurements (the executor's functions, and the public `jm.generate`), the HLO inventory,
and the driver that runs each stage in its own process and merges their JSON. The HF peer is in hf_peer.py."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def src_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((REPO / "jaxmodels").rglob("*.py")):
        h.update(str(p.relative_to(REPO)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def log(*a):
    print(*a, flush=True)


def median_time(fn, reps: int) -> tuple[float, list[float]]:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def save_part(out, name, d, save):
    out["jax"][name] = {str(k): v for k, v in d.items()}
    save()


def hlo_report(compiled, min_mb: float = 64) -> dict:
    """Big instructions of an optimized HLO module: copies, (dynamic-)slices, transposes, fusions.
    (XLA's cost_analysis counts a while/scan body once, so its bytes are not per-step totals.)"""
    import re
    txt = compiled.as_text()
    sizes = {"bf16": 2, "f32": 4, "s32": 4, "pred": 1, "f16": 2, "u32": 4, "s8": 1, "u8": 1}
    big = []
    for line in txt.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (\S+?)\(", line)
        if not m:
            continue
        name, dt, dims, op = m.groups()
        n = 1
        for d_ in filter(None, dims.split(",")):
            n *= int(d_)
        mb = n * sizes.get(dt, 4) / 2**20
        if mb >= min_mb and op not in ("parameter", "get-tuple-element", "bitcast", "tuple"):
            kind = re.search(r"kind=(\w+)", line)
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            big.append({"name": name, "op": op, "shape": f"{dt}[{dims}]", "MB": round(mb, 1),
                        "kind": kind.group(1) if kind else None, "calls": calls.group(1) if calls else None})
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        cost = {k: float(v) for k, v in ca.items() if k in ("bytes accessed", "flops")}
    except Exception as e:  # noqa: BLE001
        cost = {"error": repr(e)}
    return {"cost_analysis": cost, "big_instructions": big, "hlo_chars": len(txt)}, txt


# ------------------------------------------------------------------------------------ JAX
def jax_ceilings(S: dict) -> dict:
    """HBM bandwidth (elementwise x+1, reduction) and the bf16 matmul rate, measured with JAX."""
    import jax
    import jax.numpy as jnp

    bf16 = jnp.bfloat16
    key = jax.random.PRNGKey(0)
    out = {"jax": {}}
    # ---- ceilings
    n = S["bw_bytes"] // 2
    x = jax.random.normal(key, (n,), bf16)
    add = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    red = jax.jit(lambda a: jnp.max(a))
    add(x).block_until_ready(); red(x).block_until_ready()

    def loop(f, a, k=10):
        def run():
            for _ in range(k):
                r = f(a)
            r.block_until_ready()
        t, _ = median_time(run, 5)
        return t / k

    t_add, t_red = loop(add, x), loop(red, x)
    del x
    N = S["mm"]
    a = jax.random.normal(key, (N, N), bf16)
    b = jax.random.normal(jax.random.PRNGKey(1), (N, N), bf16)
    mm = jax.jit(lambda p, q: p @ q)
    mm(a, b).block_until_ready()

    def run_mm():
        for _ in range(10):
            r = mm(a, b)
        r.block_until_ready()
    t_mm, _ = median_time(run_mm, 5)
    t_mm /= 10
    del a, b
    out["jax"]["ceilings"] = {
        "elementwise_rw_GBps": 2 * S["bw_bytes"] / t_add / 1e9, "reduce_read_GBps": S["bw_bytes"] / t_red / 1e9,
        "matmul_bf16_TFLOPs": 2 * N**3 / t_mm / 1e12, "bw_array_bytes": S["bw_bytes"], "matmul_n": N}
    log(f"[jax] ceilings {out['jax']['ceilings']}")
    return out["jax"]["ceilings"]


def jax_decode(S: dict, cfg, params, rng, out: dict, save, on_compiled=None):
    """Decode tokens/s through a jitted, cache-donating M.decode_step at each batch size;
    `on_compiled(B, executable)` may return extra fields for that batch."""
    import jax
    import jax.numpy as jnp

    from jaxmodels import model as M
    bf16 = jnp.dtype(S.get("jax_dtype", "bfloat16"))  # tiny CPU smoke tests may use float32
    V = cfg.vocab_size

    # decode: one jitted step, cache donated; positions prompt .. prompt+steps-1 over a random cache
    dec = {}
    step = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4)
    for B in S["batches"]:
        cache = M.init_cache(cfg, B, S["cache_len"], bf16)
        cache = jax.tree.map(lambda c, k=jax.random.PRNGKey(B): jax.random.normal(k, c.shape, c.dtype), cache)
        tok = jnp.asarray(rng.integers(0, V, B), jnp.int32)
        nsteps = S["decode_steps"]
        pos = [jnp.full((B,), S["prompt"] + i, jnp.int32) for i in range(nsteps)]
        t0 = time.perf_counter()
        compiled = step.lower(params, cfg, tok, pos[0], cache).compile()
        tc = time.perf_counter() - t0
        extra = on_compiled(B, compiled) if on_compiled else {}
        state = {"cache": cache}
        del cache

        def run(k=nsteps):
            c = state["cache"]
            for i in range(k):
                logits, c = compiled(params, tok, pos[i], c)
            logits.block_until_ready()
            state["cache"] = c
            return logits

        lg = run(4)
        finite = bool(jnp.isfinite(lg).all())
        t, ts = median_time(run, S["reps"])
        st = t / nsteps
        ctx = S["prompt"] + (nsteps - 1) / 2
        dec[B] = {"batch": B, "steps": nsteps, "step_ms": st * 1e3, "tokens_per_s": B / st, "compile_s": tc,
                  "rep_s": ts, "mean_context": ctx, "cache_slots": S["cache_len"], "logits_finite": finite,
                  "cache_bytes": int(sum(v.nbytes for v in jax.tree.leaves(state["cache"]))), **extra}
        log(f"[jax] decode_step B={B}: {st * 1e3:.3f} ms/step, {B / st:.1f} tok/s (compile {tc:.1f} s)")
        del state
        save_part(out, "decode_step", dec, save)


def jax_prefill(S: dict, cfg, params, rng, out: dict, save):
    """Prefill tokens/s through M.prefill, batch 1, T=prefill_len."""
    import jax
    import jax.numpy as jnp

    from jaxmodels import model as M
    bf16 = jnp.dtype(S.get("jax_dtype", "bfloat16"))  # tiny CPU smoke tests may use float32
    V = cfg.vocab_size

    # prefill: [1, T] through M.prefill into a cache of T slots
    T = S["prefill_len"]
    pf = jax.jit(M.prefill, static_argnums=1, donate_argnums=4)
    toks = jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32)
    lens = jnp.asarray([T], jnp.int32)
    cache = M.init_cache(cfg, 1, T, bf16)
    t0 = time.perf_counter()
    compiled = pf.lower(params, cfg, toks, lens, cache).compile()
    tc = time.perf_counter() - t0
    state = {"cache": cache}
    del cache

    def run_pf(k=3):
        c = state["cache"]
        for _ in range(k):
            lg, c = compiled(params, toks, lens, c)
        lg.block_until_ready()
        state["cache"] = c
    run_pf(1)
    t, ts = median_time(run_pf, S["reps"])
    t /= 3
    out["jax"]["prefill"] = {"batch": 1, "T": T, "ms": t * 1e3, "tokens_per_s": T / t, "compile_s": tc, "rep_s": ts}
    log(f"[jax] prefill T={T}: {t * 1e3:.2f} ms, {T / t:.0f} tok/s (compile {tc:.1f} s)")
    del state
    save()


def jax_generate(S: dict, cfg, params, rng, out: dict, save):
    """Decode tokens/s through the library's jitted loop generate._generate (difference of two max_new)."""
    import jax
    import jax.numpy as jnp

    from jaxmodels import model as M
    bf16 = jnp.dtype(S.get("jax_dtype", "bfloat16"))  # tiny CPU smoke tests may use float32
    V = cfg.vocab_size
    from jaxmodels.generate import _generate
    from jaxmodels.sampling import Sampling
    key = jax.random.PRNGKey(0)

    # the library's generate loop: same prompt length and cache length, greedy, no EOS
    gen = {}
    n1, n2 = S["gen_new"]
    eos = jnp.asarray([-1], jnp.int32)
    for B in S["batches"]:
        toks = jnp.asarray(rng.integers(0, V, (B, S["prompt"])), jnp.int32)
        lens = jnp.full((B,), S["prompt"], jnp.int32)
        r = {"batch": B, "max_new": [n1, n2], "max_len": S["cache_len"]}
        times = {}
        for nn in (n1, n2):
            def call(nn=nn):
                o, steps = _generate(params, toks, lens, key, eos, cfg=cfg, max_new=nn, sampling=Sampling(),
                                     max_len=S["cache_len"])
                o.block_until_ready()
                return int(steps)
            t0 = time.perf_counter()
            steps = call()
            first = time.perf_counter() - t0
            t, ts = median_time(call, 3)
            times[nn] = t
            r[f"first_call_s_{nn}"], r[f"median_s_{nn}"], r[f"steps_{nn}"] = first, t, steps
        per = (times[n2] - times[n1]) / (n2 - n1)
        r["step_ms"], r["tokens_per_s"] = per * 1e3, B / per
        r["incl_prefill_tokens_per_s"] = B * n2 / times[n2]
        gen[B] = r
        log(f"[jax] generate B={B}: {per * 1e3:.3f} ms/step, {B / per:.1f} tok/s")
        save_part(out, "generate", gen, save)


def jax_public_decode(model, B: int, context: int, max_len: int, new: tuple[int, int], reps: int, rng) -> dict:
    """Decode tokens/s through the public `jm.generate` (greedy, ignore_eos) from B random prompts of `context` tokens
    in a cache of `max_len` slots: the best of `reps` calls at each of two lengths new = (lo, hi), after one call at
    each that compiles it; tok/s = B * (hi - lo) / (t_hi - t_lo), so prefill, dispatch and compile cancel
    (decode_probe.py's method). The steps measured see contexts context + lo .. context + hi - 1."""
    import jaxmodels as jm

    prompts = rng.integers(0, model.config.vocab_size, (B, context)).tolist()

    def call(n):
        t0 = time.perf_counter()
        out = jm.generate(model, prompts, max_new_tokens=n, ignore_eos=True, max_len=max_len)
        dt = time.perf_counter() - t0
        assert all(len(x) == n for x in out.tokens), "generate stopped early"
        return dt

    lo, hi = new
    first = {n: call(n) for n in (lo, hi)}
    ts = {n: [call(n) for _ in range(reps)] for n in (lo, hi)}
    step = (min(ts[hi]) - min(ts[lo])) / (hi - lo)
    r = {"batch": B, "context": context, "max_len": max_len, "new_tokens": [lo, hi], "first_call_s": first[lo],
         "first_call_s_hi": first[hi], "rep_s": {str(n): v for n, v in ts.items()}, "step_ms": step * 1e3,
         "tokens_per_s": B / step, "mean_context": context + (lo + hi - 1) / 2}
    log(f"[jax] jm.generate B={B} context {context} cache {max_len}: {step * 1e3:.3f} ms/step, {B / step:.1f} tok/s "
        f"(first call {first[lo]:.1f} s)")
    return r


def jax_public_prefill(cfg, params, T: int, reps: int, rng, dtype) -> dict:
    """Prefill tokens/s of one random [1, T] prompt into a T-slot cache through
    `jax.jit(M.prefill, compiler_options=M.COMPILER_OPTIONS)` (what `jm.generate` runs): best of `reps` after one
    call that compiles it."""
    import jax
    import jax.numpy as jnp

    from jaxmodels import model as M
    pre = jax.jit(M.prefill, static_argnums=1, compiler_options=M.COMPILER_OPTIONS)
    cache = M.init_cache(cfg, 1, T, dtype)
    toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
    lens = jnp.asarray([T], jnp.int32)
    t0 = time.perf_counter()
    jax.block_until_ready(pre(params, cfg, toks, lens, cache))
    first = time.perf_counter() - t0
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(pre(params, cfg, toks, lens, cache))
        ts.append(time.perf_counter() - t0)
    t = min(ts)
    log(f"[jax] prefill T={T}: {t * 1e3:.2f} ms, {T / t:.0f} tok/s (first call {first:.1f} s)")
    return {"batch": 1, "T": T, "ms": t * 1e3, "tokens_per_s": T / t, "first_call_s": first, "rep_s": ts}


# ------------------------------------------------------------------------------------ torch
def torch_ceilings(S: dict, out: dict):
    import torch
    dev = "cuda"
    n = S["bw_bytes"] // 2
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def cuda_time(fn, k=10):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(k):
                fn()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3 / k)
        return statistics.median(ts)

    t_copy = cuda_time(lambda: y.copy_(x))
    t_red = cuda_time(lambda: x.amax())
    del x, y
    N = S["mm"]
    a = torch.randn(N, N, device=dev, dtype=torch.bfloat16)
    b = torch.randn(N, N, device=dev, dtype=torch.bfloat16)
    t_mm = cuda_time(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return {"copy_rw_GBps": 2 * S["bw_bytes"] / t_copy / 1e9, "reduce_read_GBps": S["bw_bytes"] / t_red / 1e9,
            "matmul_bf16_TFLOPs": 2 * N**3 / t_mm / 1e12}


def sync(dev):
    import torch
    if dev == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------ driver
def run_stage(stages: dict, name: str, args, S: dict):
    out_path = Path(args.out) / f"stage_{name}.json"
    out: dict = {"_out": str(args.out)}

    def save():
        out_path.write_text(json.dumps(out, indent=1, default=str))

    try:
        stages[name](S, out, save)
        out["ok"] = True
    except Exception as e:  # record the failure precisely, then fail the stage
        import traceback
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
        save()
        raise
    save()


def drive(script: str, result_name: str, args, S: dict, summarize, stage_env: dict | None = None,
          budget_s: float | None = None) -> dict:
    """Run each of args.stages in its own process (`script --stage NAME`) under its time limit, merge the
    stage JSONs into <out>/<result_name>, and print summarize(res, S). With `budget_s`, the whole run stays within
    that many seconds: a stage's limit is cut to what is left, and a stage with under 20 s left is skipped."""
    limits = dict(kv.split("=") for kv in args.timeouts.split(","))
    t_start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    res = {"settings": {k: v for k, v in S.items() if k != "hf"}, "hf_config": S["hf"], "tiny": args.tiny,
           "commit": args.commit, "jaxmodels_src_sha256_12": src_hash(), "host": platform.node(),
           "python": sys.version.split()[0], "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {}}
    for name in args.stages.split(","):
        t0 = time.perf_counter()
        limit = float(limits.get(name, 600))
        if budget_s is not None:
            left = budget_s - (t0 - t_start)
            if left < 20:
                res["stages"][name] = {"rc": "skipped: run budget spent", "wall_s": 0.0}
                log(f"== stage {name}: skipped, {left:.0f} s of the {budget_s:.0f} s budget left")
                continue
            limit = min(limit, left)
        cmd = [sys.executable, script, "--stage", name, "--out", args.out] + (["--tiny"] if args.tiny else [])
        log(f"== stage {name} (limit {limit:.0f} s)")
        try:
            rc = subprocess.run(cmd, env=env | (stage_env or {}).get(name, {}), timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res["stages"][name] = {"rc": rc, "wall_s": time.perf_counter() - t0}
        p = Path(args.out) / f"stage_{name}.json"
        res[f"stage_{name}"] = json.loads(p.read_text()) if p.exists() else {}
        log(f"== stage {name}: rc={rc} in {res['stages'][name]['wall_s']:.1f} s")
    table = summarize(res, S)
    res["table"] = table
    (Path(args.out) / result_name).write_text(json.dumps(res, indent=1, default=str))
    log("\n" + table)
    return res
