"""Dense-model speed on one GPU: jaxmodels vs HF transformers (PyTorch) at Llama-3.1-8B shape.

Random bf16 weights at real shapes (speed does not depend on the values). Measures, in one run:

  ceilings   HBM bandwidth (JAX elementwise / reduction, torch copy / reduction) and the bf16 matmul
             rate (8192^3, JAX and torch), so the roofline uses this machine's numbers
  jax        compile time of decode_step and forward, 2-layer vs full-depth config (lower + compile);
             decode tokens/s through a jitted, cache-donating M.decode_step at batch 1 and 32;
             prefill tokens/s through M.prefill at T=2048, batch 1;
             decode tokens/s through the library's jitted loop generate._generate (difference of two
             max_new values, so prefill and the first token are excluded)
  hf_eager   LlamaForCausalLM, sdpa, bf16, DynamicCache, eager: prefill 2048 and decode at batch 1 / 32
  hf_compile the same model with a StaticCache and torch.compile(mode="reduce-overhead") decode
             (both HF stages: benchmarks/hf_peer.py, shared with bench_moe.py and bench.py)

Each stage runs in its own process (JAX preallocates GPU memory; torch gets the card to itself after),
with its own time limit, and writes <out>/stage_<name>.json; the driver merges them into
<out>/bench_dense.json and prints a table.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_dense.py --out /tmp/bench
    .venv/bin/python benchmarks/bench_dense.py --tiny --out /tmp/bench_tiny     # CPU smoke test
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_peer  # noqa: E402
from _common import (drive, hlo_report, jax_ceilings, jax_decode, jax_generate, jax_prefill, log,  # noqa: E402
                     median_time, run_stage)

LLAMA31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TINY = LLAMA31_8B | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                     "bos_token_id": 1, "eos_token_id": 2}


def settings(tiny: bool) -> dict:
    if tiny:
        return dict(hf=TINY, prompt=16, cache_len=64, batches=[1, 4], decode_steps=8, reps=2, prefill_len=64,
                    gen_new=(4, 12), bw_bytes=1 << 24, mm=256, small_layers=2,
                    jax_dtype="float32")  # XLA:CPU cannot run the bf16 x bf16 -> f32 batched attention dots at B >= 2
    return dict(hf=LLAMA31_8B, prompt=512, cache_len=1024, batches=[1, 32], decode_steps=64, reps=5,
                prefill_len=2048, gen_new=(64, 320), bw_bytes=4 << 30, mm=8192, small_layers=2)


# ------------------------------------------------------------------------------------ counting
def count(hf: dict) -> dict:
    """Parameter and byte counts of a Llama-shaped config (bf16 weights and cache)."""
    D, I, L, V = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    H, K, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    per_layer_mm = D * H * d * 2 + D * K * d * 2 + 3 * D * I  # q, o, k, v, gate, up, down
    layer_mm = L * per_layer_mm
    head = D * V
    total = layer_mm + head + V * D * (0 if hf["tie_word_embeddings"] else 1) + L * 2 * D + D
    return dict(layer_matmul_params=layer_mm, lm_head_params=head, total_params=total,
                kv_bytes_per_token=L * 2 * K * d * 2,  # K and V, all layers, bf16
                layers=L, heads=H, head_dim=d)


def decode_bytes(c: dict, batch: int, ctx: float) -> float:
    """Fewest bytes one decode step must read: every matmul weight once (the embedding gather reads B
    rows only) + the valid part of the KV cache of every row."""
    return 2 * (c["layer_matmul_params"] + c["lm_head_params"]) + batch * ctx * c["kv_bytes_per_token"]


def prefill_flops(c: dict, T: int, batch: int = 1) -> float:
    """Useful FLOPs of a causal prefill: 2*matmul params per token + causal attention (QK^T and PV,
    half of the T x T square) + the lm_head for the last token."""
    mm = 2 * c["layer_matmul_params"] * T
    attn = 2 * 2 * c["layers"] * c["heads"] * c["head_dim"] * T * T / 2
    return batch * (mm + attn + 2 * c["lm_head_params"])



# ------------------------------------------------------------------------------------ JAX stage
def stage_jax(S: dict, out: dict, save):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, model as M

    bf16 = jnp.dtype(S.get("jax_dtype", "bfloat16"))  # tiny CPU smoke tests use float32
    dev = jax.devices()[0]
    out["jax"] = {"version": jax.__version__, "device": str(dev), "device_kind": dev.device_kind,
                  "backend": jax.default_backend()}
    log(f"[jax] {jax.__version__} on {dev.device_kind} ({jax.default_backend()})")
    key = jax.random.PRNGKey(0)

    out["jax"]["ceilings"] = jax_ceilings(S)
    save()

    cfg_full = families.config_from_hf(S["hf"])
    cfg_small = families.config_from_hf(S["hf"] | {"num_hidden_layers": S["small_layers"]})

    # ---- compile time: lower + compile of decode_step (B=1) and forward ([1, prefill_len]), by depth
    # XLA caches gemm autotuning in-process and both depths share the matmul shapes, so the first
    # compile pays the autotuning: compile small, full, then small again and report all three.
    comp = {}
    for name, cfg in (("small", cfg_small), ("full", cfg_full), ("small_again", cfg_small)):
        p_shapes = jax.eval_shape(lambda c=cfg: M.init_params(c, 0, dtype=bf16))
        c_shapes = jax.eval_shape(lambda c=cfg: M.init_cache(c, 1, S["cache_len"], bf16))
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        r = {"layers": cfg.num_layers}
        t0 = time.perf_counter()
        lo = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4).lower(p_shapes, cfg, i32(1), i32(1), c_shapes)
        t1 = time.perf_counter()
        lo.compile()
        t2 = time.perf_counter()
        r["decode_step_lower_s"], r["decode_step_compile_s"] = t1 - t0, t2 - t1
        t0 = time.perf_counter()
        lo = jax.jit(M.forward, static_argnums=1).lower(p_shapes, cfg, i32(1, S["prefill_len"]))
        t1 = time.perf_counter()
        lo.compile()
        t2 = time.perf_counter()
        r["forward_lower_s"], r["forward_compile_s"] = t1 - t0, t2 - t1
        comp[name] = r
        log(f"[jax] compile {name}: {r}")
    out["jax"]["compile"] = comp
    save()

    # ---- full model
    cfg = cfg_full
    t0 = time.perf_counter()
    params = M.init_params(cfg, 0, dtype=bf16)
    jax.block_until_ready(params)
    nbytes = sum(v.nbytes for v in jax.tree.leaves(params))
    out["jax"]["init_params_s"] = time.perf_counter() - t0
    out["jax"]["param_bytes"] = int(nbytes)
    log(f"[jax] params {nbytes / 1e9:.2f} GB in {out['jax']['init_params_s']:.1f} s")
    rng = np.random.default_rng(0)
    V = cfg.vocab_size

    jax_decode(S, cfg, params, rng, out, save)
    jax_prefill(S, cfg, params, rng, out, save)
    jax_generate(S, cfg, params, rng, out, save)


# ------------------------------------------------------------------------------------ diagnostics
def stage_compile(S: dict, out: dict, save, depth: str):
    """Lower + compile time of decode_step (B=1) and forward ([1, prefill_len]) in a fresh process,
    so no in-process cache (lowering, executable, gemm autotuning) is warm."""
    import jax
    import jax.numpy as jnp

    from jaxmodels import families, model as M

    bf16 = jnp.bfloat16
    hf = S["hf"] if depth == "full" else S["hf"] | {"num_hidden_layers": S["small_layers"]}
    cfg = families.config_from_hf(hf)
    jax.jit(lambda a: a + 1)(jnp.ones(4)).block_until_ready()  # backend start-up stays out
    p_shapes = jax.eval_shape(lambda: M.init_params(cfg, 0, dtype=bf16))
    c_shapes = jax.eval_shape(lambda: M.init_cache(cfg, 1, S["cache_len"], bf16))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    r = {"layers": cfg.num_layers}
    for name, fn, args, kw in (
            ("decode_step", M.decode_step, (p_shapes, cfg, i32(1), i32(1), c_shapes), dict(donate_argnums=4)),
            ("forward", M.forward, (p_shapes, cfg, i32(1, S["prefill_len"])), {})):
        t0 = time.perf_counter()
        lo = jax.jit(fn, static_argnums=1, **kw).lower(*args)
        t1 = time.perf_counter()
        lo.compile()
        t2 = time.perf_counter()
        r[f"{name}_lower_s"], r[f"{name}_compile_s"] = t1 - t0, t2 - t1
    out["compile_fresh"] = r
    log(f"[jax] fresh-process compile ({depth}): {r}")



def stage_diag(S: dict, out: dict, save):
    """Why decode is slow: optimized-HLO inventory of the library's decode_step (layers scanned), next to the
    same public decode_step fully unrolled (unroll=True: every layer reads its weights through static slices).
    Plus the T=2048 attention core alone: the library's attend vs jax.nn.dot_product_attention (cuDNN)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, model as M
    from jaxmodels.layers import attention

    bf16 = jnp.bfloat16
    cfg = families.config_from_hf(S["hf"])
    params = M.init_params(cfg, 0, dtype=bf16)
    rng = np.random.default_rng(0)
    d = out.setdefault("diag", {})
    for B in S["batches"]:
        tok = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
        nsteps = S["decode_steps"]
        pos = [jnp.full((B,), S["prompt"] + i, jnp.int32) for i in range(nsteps)]
        r, first = {}, {}
        for name, unroll in (("scan", 1), ("unrolled", True)):
            cache = M.init_cache(cfg, B, S["cache_len"], bf16)
            cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(B), c.shape, c.dtype), cache)
            t0 = time.perf_counter()
            comp = jax.jit(M.decode_step, static_argnums=(1, 5), donate_argnums=4).lower(
                params, cfg, tok, pos[0], cache, unroll).compile()
            r[f"{name}_compile_s"] = time.perf_counter() - t0
            rep, txt = hlo_report(comp)
            r[f"{name}_hlo"] = rep
            (Path(out["_out"]) / f"hlo_decode_{name}_b{B}.txt").write_text(txt)
            state = {"c": cache}
            del cache

            def run(k=nsteps, comp=comp, state=state):
                c = state["c"]
                for i in range(k):
                    lg, c = comp(params, tok, pos[i], c)
                lg.block_until_ready()
                state["c"] = c
                return lg
            first[name] = np.asarray(run(1))  # position prompt+0, the same random cache for both
            run(3)
            t, _ = median_time(run, S["reps"])
            r[f"{name}_step_ms"] = t / nsteps * 1e3
            del state
        r["unrolled_vs_scan_max_abs_logit_diff_first_step"] = float(np.max(np.abs(first["unrolled"] - first["scan"])))
        d[str(B)] = r
        log(f"[diag] B={B}: scan {r['scan_step_ms']:.3f} ms (cost bytes {r['scan_hlo']['cost_analysis']}), "
            f"unrolled {r['unrolled_step_ms']:.3f} ms (cost bytes {r['unrolled_hlo']['cost_analysis']}); "
            f"big ops scan: {[(b['op'], b['shape'], b['kind']) for b in r['scan_hlo']['big_instructions']][:12]}")
        save()
    del params

    # attention core at T=2048, one layer: library attend (fp32 scores materialized) vs cuDNN flash
    T = S["prefill_len"]
    H, K, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    q = jax.random.normal(ks[0], (1, T, H, dh), bf16)
    k = jax.random.normal(ks[1], (1, T, K, dh), bf16)
    v = jax.random.normal(ks[2], (1, T, K, dh), bf16)
    posn = jnp.arange(T, dtype=jnp.int32)[None]
    lib = jax.jit(lambda q, k, v: attention.attend(q, k, v, attention.mask(posn, posn, None), scale=dh**-0.5))
    a = {}
    o_lib = lib(q, k, v).block_until_ready()

    def tm(f):
        def run():
            for _ in range(20):
                o = f(q, k, v)
            o.block_until_ready()
        t, _ = median_time(run, 5)
        return t / 20 * 1e3
    a["library_attend_ms_per_layer"] = tm(lib)
    for impl in ("cudnn", "xla"):
        try:
            f = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                 implementation=impl))
            o = f(q, k, v).block_until_ready()
            a[f"{impl}_ms_per_layer"] = tm(f)
            a[f"{impl}_max_abs_diff_vs_library"] = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o_lib.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001
            a[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    d["attention_T2048"] = a
    log(f"[diag] attention T={T}: {a}")
    save()


def stage_diag_dsf(S: dict, out: dict, save):
    """The library's scan decode with XLA's dynamic-slice fusion on (flag set by the driver)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, model as M

    bf16 = jnp.bfloat16
    cfg = families.config_from_hf(S["hf"])
    params = M.init_params(cfg, 0, dtype=bf16)
    step = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4)
    r = out.setdefault("diag_dsf", {"XLA_FLAGS": os.environ.get("XLA_FLAGS")})
    for B in S["batches"]:
        tok = jnp.asarray(np.arange(B) % cfg.vocab_size, jnp.int32)
        pos = [jnp.full((B,), S["prompt"] + i, jnp.int32) for i in range(S["decode_steps"])]
        cache = M.init_cache(cfg, B, S["cache_len"], bf16)
        cache = jax.tree.map(lambda c: jax.random.normal(jax.random.PRNGKey(B), c.shape, c.dtype), cache)
        comp = step.lower(params, cfg, tok, pos[0], cache).compile()
        rep, _ = hlo_report(comp)
        state = {"c": cache}
        del cache

        def run(k=S["decode_steps"]):
            c = state["c"]
            for i in range(k):
                lg, c = comp(params, tok, pos[i], c)
            lg.block_until_ready()
            state["c"] = c
        run(3)
        t, _ = median_time(run, S["reps"])
        r[str(B)] = {"step_ms": t / S["decode_steps"] * 1e3, "hlo": rep}
        log(f"[diag_dsf] B={B}: {r[str(B)]['step_ms']:.3f} ms/step, cost {rep['cost_analysis']}")
        del state
        save()


# ------------------------------------------------------------------------------------ torch stages
stage_hf_eager = functools.partial(hf_peer.stage_eager, attn="sdpa")
stage_hf_compile = functools.partial(hf_peer.stage_compile, attn="sdpa")


STAGES = {"jax": stage_jax, "hf_eager": stage_hf_eager, "hf_compile": stage_hf_compile,
          "compile_small": lambda S, o, s: stage_compile(S, o, s, "small"),
          "compile_full": lambda S, o, s: stage_compile(S, o, s, "full"),
          "diag": stage_diag, "diag_dsf": stage_diag_dsf}
STAGE_ENV = {"diag_dsf": {"XLA_FLAGS": "--xla_gpu_enable_dynamic_slice_fusion=true"}}


# ------------------------------------------------------------------------------------ driver

def summarize(res: dict, S: dict) -> str:
    c = count(S["hf"])
    jx = res.get("stage_jax", {}).get("jax", {})
    he = res.get("stage_hf_eager", {}).get("hf_eager", {})
    hc = res.get("stage_hf_compile", {}).get("hf_compile", {})
    ceil = {}
    ceil.update({f"jax_{k}": v for k, v in jx.get("ceilings", {}).items()})
    ceil.update({f"torch_{k}": v for k, v in he.get("ceilings", {}).items()})
    bw = max([v for k, v in ceil.items() if k.endswith("GBps")] or [float("nan")]) * 1e9
    fl = max([v for k, v in ceil.items() if k.endswith("TFLOPs")] or [float("nan")]) * 1e12
    roof = {"bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": fl / 1e12, "counts": c, "decode": {}, "prefill": {}}
    lines = [f"ceilings (best measured): HBM {bw / 1e9:.0f} GB/s, bf16 matmul {fl / 1e12:.0f} TFLOP/s",
             f"{'workload':<26}{'roofline':>12}{'jax step':>12}{'jax gen()':>12}{'hf eager':>12}{'hf compiled':>12}"
             f"{'jax/roof':>10}{'jax/hf best':>12}"]
    for B in S["batches"]:
        ctx = S["prompt"] + (S["decode_steps"] - 1) / 2
        by = decode_bytes(c, B, ctx)
        rt = B / (by / bw)
        get = lambda d, k="tokens_per_s": d.get(str(B), {}).get(k, float("nan"))
        js, jg = get(jx.get("decode_step", {})), get(jx.get("generate", {}))
        he_, hc_ = get(he.get("decode", {})), get(hc.get("decode", {}))
        best_hf = max([v for v in (he_, hc_) if v == v] or [float("nan")])
        roof["decode"][str(B)] = {"bytes_per_step": by, "roofline_tokens_per_s": rt, "jax_step_frac": js / rt,
                                  "jax_generate_frac": jg / rt, "jax_over_best_hf": js / best_hf}
        lines.append(f"{f'decode B={B} tok/s':<26}{rt:>12.1f}{js:>12.1f}{jg:>12.1f}{he_:>12.1f}{hc_:>12.1f}"
                     f"{js / rt:>10.2f}{js / best_hf:>12.2f}")
    T = S["prefill_len"]
    f = prefill_flops(c, T)
    rt = T / (f / fl)
    jp = jx.get("prefill", {}).get("tokens_per_s", float("nan"))
    hp = he.get("prefill", {}).get("tokens_per_s", float("nan"))
    roof["prefill"] = {"flops": f, "roofline_tokens_per_s": rt, "jax_frac": jp / rt, "jax_over_hf": jp / hp}
    lines.append(f"{f'prefill T={T} tok/s':<26}{rt:>12.0f}{jp:>12.0f}{'':>12}{hp:>12.0f}{'':>12}"
                 f"{jp / rt:>10.2f}{jp / hp:>12.2f}")
    for name, r in jx.get("compile", {}).items():
        lines.append(f"compile in one process, {name} ({r['layers']} layers; caches warm after the first): decode_step lower {r['decode_step_lower_s']:.2f} s + "
                     f"compile {r['decode_step_compile_s']:.2f} s; forward lower {r['forward_lower_s']:.2f} s + "
                     f"compile {r['forward_compile_s']:.2f} s")
    for depth in ("small", "full"):
        r = res.get(f"stage_compile_{depth}", {}).get("compile_fresh")
        if r:
            lines.append(f"compile, fresh process, {r['layers']} layers: decode_step lower {r['decode_step_lower_s']:.2f} s"
                         f" + compile {r['decode_step_compile_s']:.2f} s; forward lower {r['forward_lower_s']:.2f} s +"
                         f" compile {r['forward_compile_s']:.2f} s")
    dg = res.get("stage_diag", {}).get("diag", {})
    for B in S["batches"]:
        r = dg.get(str(B))
        if r:
            lines.append(f"diag decode B={B}: library scan {r['scan_step_ms']:.3f} ms/step, same layers unrolled "
                         f"{r['unrolled_step_ms']:.3f} ms/step (unrolled compile {r['unrolled_compile_s']:.1f} s)")
    if "attention_T2048" in dg:
        lines.append(f"diag attention core T={S['prefill_len']}, one layer: {dg['attention_T2048']}")
    for B, r in res.get("stage_diag_dsf", {}).get("diag_dsf", {}).items():
        if B != "XLA_FLAGS":
            lines.append(f"diag decode B={B} with --xla_gpu_enable_dynamic_slice_fusion=true: {r['step_ms']:.3f} ms/step")
    res["roofline"] = roof
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny config, for a CPU smoke test")
    ap.add_argument("--out", default="benchmarks/results/tmp")
    ap.add_argument("--stage", choices=list(STAGES), help="run one stage in this process (used by the driver)")
    ap.add_argument("--stages", default="compile_small,compile_full,jax,hf_eager,hf_compile",
                    help="also: diag, diag_dsf (why decode is slow)")
    ap.add_argument("--timeouts", default="compile_small=60,compile_full=60,jax=300,hf_eager=120,hf_compile=170,"
                                          "diag=200,diag_dsf=90", help="seconds per stage")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    S = settings(args.tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(STAGES, args.stage, args, S)
    drive(__file__, "bench_dense.json", args, S, summarize, STAGE_ENV)


if __name__ == "__main__":
    main()
