"""MoE speed on one GPU: jaxmodels vs HF transformers (PyTorch) at GPT-OSS-20B shape, bf16 experts.

Random bf16 weights at real shapes (speed does not depend on the values, except through which experts
the router picks: see `routing`). Same structure and helpers as bench_dense.py (benchmarks/_common.py):

  jax        ceilings (HBM bandwidth, bf16 matmul); decode tokens/s through a jitted, cache-donating
             M.decode_step at batch 1 and 64 (+ the optimized HLO's big instructions and custom calls);
             routing: the distinct experts each layer's router picks in those decode steps (counted with a
             debug callback on a second, instrumented compile); prefill T=2048 batch 1; the library's
             generate._generate loop; diag: one layer's MoE alone (moe.sparse / moe.dense / a gather of
             the k chosen experts' weights) and the whole decode step with the MoE swapped for those
  hf_eager   GptOssForCausalLM (eager attention: it has no sdpa), bf16, DynamicCache: prefill 2048 and
             decode at batch 1 / 64; records transformers' experts implementation (grouped_mm / eager)
  hf_compile StaticCache + torch.compile(mode="reduce-overhead", fullgraph=True) decode; falls back to
             fullgraph=False, then to eager StaticCache, and records which one ran and why
             (both HF stages: benchmarks/hf_peer.py, shared with bench_dense.py and bench.py)

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_moe.py --out $OUT --commit $(git rev-parse --short HEAD)
    .venv/bin/python benchmarks/bench_moe.py --tiny --out /tmp/bench_moe_tiny     # CPU smoke test
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_peer  # noqa: E402
from _common import (drive, hlo_report, jax_ceilings, jax_decode, jax_generate, jax_prefill, log,  # noqa: E402
                     median_time, run_stage)

GPT_OSS_20B = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_local_experts": 32, "num_experts_per_tok": 4,
    "experts_per_token": 4, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "initial_context_length": 4096,
    "tie_word_embeddings": False, "attention_bias": True, "swiglu_limit": 7.0, "hidden_act": "silu",
    "attention_dropout": 0.0, "router_aux_loss_coef": 0.9, "output_router_logits": False,
    "bos_token_id": 199998, "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
}
TINY = GPT_OSS_20B | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
                      "num_local_experts": 8, "num_experts_per_tok": 2, "experts_per_token": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8,
                      "layer_types": ["sliding_attention", "full_attention"] * 2,
                      "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def settings(tiny: bool) -> dict:
    if tiny:
        # float32 in JAX: XLA:CPU (jax 0.10.2) cannot run the bf16 x bf16 -> f32 batched attention dots at B >= 2
        return dict(hf=TINY, prompt=16, cache_len=64, batches=[1, 4], decode_steps=8, hf_steps=4, reps=2,
                    hf_reps=2, prefill_len=64, gen_new=(4, 12), bw_bytes=1 << 24, mm=256, budget_s=600,
                    jax_dtype="float32")
    return dict(hf=GPT_OSS_20B, prompt=512, cache_len=1024, batches=[1, 64], decode_steps=64, hf_steps=32, reps=5,
                hf_reps=3, prefill_len=2048, gen_new=(32, 128), bw_bytes=4 << 30, mm=8192,
                budget_s=115)  # the jax stage skips its diagnostics past this many seconds


# ------------------------------------------------------------------------------------ counting
def count(hf: dict) -> dict:
    """Parameter and byte counts of a GPT-OSS-shaped config (bf16 weights and cache)."""
    D, I, L, V = hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"]
    H, K, d = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    E, k = hf["num_local_experts"], hf["num_experts_per_tok"]
    attn_w = D * H * d * 2 + D * K * d * 2  # q, o, k, v
    attn = attn_w + H * d + 2 * K * d + D + H  # + q/k/v/o biases + sinks
    router = D * E + E
    expert_w = 3 * D * I
    expert = expert_w + 2 * I + D  # + gate/up/down biases
    types = hf["layer_types"][:L]
    n_sl = sum(t == "sliding_attention" for t in types)
    head = D * V
    total = L * (attn + router + E * expert + 2 * D) + D + head + V * D * (0 if hf["tie_word_embeddings"] else 1)
    return dict(attn_params=attn, attn_matmul_params=attn_w, router_params=router, expert_params=expert,
                expert_matmul_params=expert_w, lm_head_params=head, total_params=total, layers=L, experts=E,
                top_k=k, hidden=D, heads=H, head_dim=d, n_sliding=n_sl, n_full=L - n_sl, window=hf["sliding_window"],
                non_expert_step_params=L * (attn + router + 2 * D) + D + head,
                active_params_per_token=L * (attn + router + k * expert + 2 * D) + D + head,
                kv_bytes_per_token_layer=2 * K * d * 2)


def expected_distinct(E: int, k: int, batch: int) -> float:
    """Distinct experts one layer touches for `batch` tokens, each picking k of E uniformly at random."""
    return E * (1 - (1 - k / E) ** batch)


def decode_bytes(c: dict, batch: int, ctx: float, experts_per_layer: float, full_slots: float | None = None) -> float:
    """Fewest bytes one decode step must read: non-expert weights + the experts the step touches + B embedding
    rows + the KV each row needs (full layers: ctx positions, or `full_slots` if the code reads all slots;
    sliding layers: min(window, ctx))."""
    w = 2 * (c["non_expert_step_params"] + c["layers"] * experts_per_layer * c["expert_params"])
    kv_pos = c["n_full"] * (ctx if full_slots is None else full_slots) + c["n_sliding"] * min(c["window"], ctx)
    return w + batch * 2 * c["hidden"] + batch * kv_pos * c["kv_bytes_per_token_layer"]


def prefill_cost(c: dict, T: int) -> tuple[float, float]:
    """(useful FLOPs, fewest bytes) of a causal prefill of T tokens, batch 1: top-k experts per token,
    causal attention (full layers T(T+1)/2 keys, sliding layers min(t+1, window)), lm_head on the last
    token; bytes = every weight once (T*k >> E, so all experts are touched) + writing the cache."""
    per_tok = c["layers"] * (c["attn_matmul_params"] + c["router_params"] + c["top_k"] * c["expert_matmul_params"])
    keys = c["n_full"] * T * (T + 1) / 2 + c["n_sliding"] * sum(min(t + 1, c["window"]) for t in range(T))
    flops = 2 * per_tok * T + 2 * 2 * c["heads"] * c["head_dim"] * keys + 2 * c["lm_head_params"]
    return flops, 2 * c["total_params"] + T * c["layers"] * c["kv_bytes_per_token_layer"]


# ------------------------------------------------------------------------------------ JAX stage
def gathered_moe(spec, p, x):
    """The k chosen experts' weights gathered per token, then plain batched matmuls: reads only
    N*k experts (every routed expert once at N=1). Same maths as moe.sparse (shared experts aside)."""
    import jax.numpy as jnp

    from jaxmodels.layers import mlp, moe
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    w, idx = moe.route(spec, p, xt)
    g = jnp.einsum("nd,nkdf->nkf", xt, p["w_gate"][idx]) + p["b_gate"][idx]
    u = jnp.einsum("nd,nkdf->nkf", xt, p["w_up"][idx]) + p["b_up"][idx]
    y = jnp.einsum("nkf,nkfd->nkd", mlp.activate(spec, g, u), p["w_down"][idx]) + p["b_down"][idx]
    return jnp.einsum("nk,nkd->nd", w, y).astype(x.dtype).reshape(shape)


def stage_jax(S: dict, out: dict, save):
    import collections
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, model as M, plan
    from jaxmodels.layers import moe

    t_start = time.perf_counter()
    bf16 = jnp.dtype(S.get("jax_dtype", "bfloat16"))  # tiny CPU smoke tests may use float32
    dev = jax.devices()[0]
    out["jax"] = {"version": jax.__version__, "device": str(dev), "device_kind": dev.device_kind,
                  "backend": jax.default_backend()}
    log(f"[jax] {jax.__version__} on {dev.device_kind} ({jax.default_backend()})")
    out["jax"]["ceilings"] = jax_ceilings(S)
    save()

    cfg = families.config_from_hf(S["hf"])
    t0 = time.perf_counter()
    params = M.init_params(cfg, 0, dtype=bf16)
    jax.block_until_ready(params)
    nbytes = sum(v.nbytes for v in jax.tree.leaves(params))
    out["jax"]["init_params_s"] = time.perf_counter() - t0
    out["jax"]["param_bytes"] = int(nbytes)
    log(f"[jax] params {nbytes / 1e9:.2f} GB in {out['jax']['init_params_s']:.1f} s; plan runs "
        f"{plan.plan(cfg).runs}, kinds {len(plan.plan(cfg).kinds)}")
    rng = np.random.default_rng(0)
    odir = Path(out["_out"])

    def on_compiled(B, compiled):  # what XLA made of the decode step: big instructions, library calls
        rep, txt = hlo_report(compiled)
        (odir / f"hlo_decode_b{B}.txt").write_text(txt)
        rep["custom_calls"] = dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', txt)))
        rep["ragged_dot_lines"] = sum("ragged-dot" in ln for ln in txt.splitlines())
        log(f"[jax] decode B={B} HLO: custom calls {rep['custom_calls']}, ragged-dot lines {rep['ragged_dot_lines']}, "
            f"big {[(b['op'], b['shape']) for b in rep['big_instructions']][:10]}")
        return {"hlo": rep}

    jax_decode(S, cfg, params, rng, out, save, on_compiled=on_compiled)

    # routing: distinct experts per layer call in decode steps over the same kind of random cache
    spec = plan.plan(cfg).kinds[0].mlp
    hits: list[int] = []
    orig_route = moe.route

    def route_rec(spec_, p, x, tokens=None):
        w, idx = orig_route(spec_, p, x, tokens)
        jax.debug.callback(lambda i: hits.append(int(np.unique(np.asarray(i)).size)), idx)
        return w, idx

    rt = {}
    moe.route = route_rec
    try:
        for B in S["batches"]:
            f = jax.jit(lambda p, t, q, c: M.decode_step(p, cfg, t, q, c), donate_argnums=3)
            cache = M.init_cache(cfg, B, S["cache_len"], bf16)
            cache = jax.tree.map(lambda c, k=jax.random.PRNGKey(B): jax.random.normal(k, c.shape, c.dtype), cache)
            tok = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
            hits.clear()
            for i in range(4):
                lg, cache = f(params, tok, jnp.full((B,), S["prompt"] + i, jnp.int32), cache)
                tok = jnp.argmax(lg, -1).astype(jnp.int32)  # greedy, so the tokens (and routes) change
            jax.block_until_ready(lg)
            jax.effects_barrier()
            rt[str(B)] = {"calls": len(hits), "mean_distinct_per_layer": float(np.mean(hits)), "min": min(hits),
                          "max": max(hits), "uniform_expectation": expected_distinct(spec.num_experts, spec.top_k, B)}
            log(f"[jax] routing B={B}: {rt[str(B)]}")
            del cache
    finally:
        moe.route = orig_route
    out["jax"]["routing"] = rt
    save()

    jax_prefill(S, cfg, params, rng, out, save)
    jax_generate(S, cfg, params, rng, out, save)
    if time.perf_counter() - t_start > S["budget_s"]:
        log("[jax] past the stage budget: diagnostics skipped")
        return

    # diag 1: one layer's MoE alone, three ways
    p1 = jax.tree.map(lambda a: a[0], params["layers"]["0"]["mlp"])
    impls = {"sparse": moe.sparse, "dense": moe.dense, "gather": gathered_moe}
    dg = out["jax"].setdefault("moe_layer", {})
    for N in S["batches"]:
        x = (jax.random.normal(jax.random.PRNGKey(N), (N, cfg.hidden_size), jnp.float32)).astype(bf16)
        ref = None
        for name, fn in impls.items():
            if name == "gather" and N > 8:
                continue  # gathers N*k copies of expert weights: only sensible for a few tokens
            jf = jax.jit(functools.partial(fn, spec))
            y = jf(p1, x)
            ref = y if ref is None else ref

            def run(k=20, jf=jf):
                for _ in range(k):
                    r = jf(p1, x)
                r.block_until_ready()
            run(2)
            t, _ = median_time(run, 5)
            dg[f"{name}_N{N}"] = {"us": t / 20 * 1e6,
                                  "max_abs_diff_vs_sparse": float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))}
            log(f"[diag] one-layer MoE {name} N={N}: {t / 20 * 1e6:.1f} us, |d| {dg[f'{name}_N{N}']['max_abs_diff_vs_sparse']:.3g}")
        save()

    # diag 2: the whole decode step with the MoE swapped (gather at B=1, dense at every B)
    orig_sparse = moe.sparse
    ds = out["jax"].setdefault("decode_step_moe_swapped", {})
    try:
        for name, fn, batches in (("gather", gathered_moe, [b for b in S["batches"] if b <= 8]),
                                  ("dense", moe.dense, S["batches"])):
            moe.sparse = lambda spec_, p, x, *_, fn=fn: fn(spec_, p, x)  # the executor also passes shard, tokens, ...
            for B in batches:
                if time.perf_counter() - t_start > S["budget_s"] + 15:
                    log("[diag] out of time")
                    return
                f = jax.jit(lambda p, t, q, c: M.decode_step(p, cfg, t, q, c), donate_argnums=3)
                cache = M.init_cache(cfg, B, S["cache_len"], bf16)
                cache = jax.tree.map(lambda c, k=jax.random.PRNGKey(B): jax.random.normal(k, c.shape, c.dtype), cache)
                tok = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
                n = S["decode_steps"]
                pos = [jnp.full((B,), S["prompt"] + i, jnp.int32) for i in range(n)]
                t0 = time.perf_counter()
                comp = f.lower(params, tok, pos[0], cache).compile()
                tc = time.perf_counter() - t0
                st = {"c": cache}
                del cache

                def run(k=n):
                    c = st["c"]
                    for i in range(k):
                        lg, c = comp(params, tok, pos[i], c)
                    lg.block_until_ready()
                    st["c"] = c
                run(3)
                t, _ = median_time(run, 3)
                ds[f"{name}_B{B}"] = {"step_ms": t / n * 1e3, "tokens_per_s": B * n / t, "compile_s": tc}
                log(f"[diag] decode_step with MoE={name} B={B}: {t / n * 1e3:.3f} ms/step ({B * n / t:.1f} tok/s)")
                del st
                save()
    finally:
        moe.sparse = orig_sparse


# ------------------------------------------------------------------------------------ torch stages
# GptOss has no sdpa path; flash/flex kernels are not on the machine
stage_hf_eager = functools.partial(hf_peer.stage_eager, attn="eager")
stage_hf_compile = functools.partial(hf_peer.stage_compile, attn="eager")


STAGES = {"jax": stage_jax, "hf_eager": stage_hf_eager, "hf_compile": stage_hf_compile}


# ------------------------------------------------------------------------------------ summary
def summarize(res: dict, S: dict) -> str:
    c = count(S["hf"])
    jx = res.get("stage_jax", {}).get("jax", {})
    he = res.get("stage_hf_eager", {}).get("hf_eager", {})
    hc = res.get("stage_hf_compile", {}).get("hf_compile", {})
    ceil = {f"jax_{k}": v for k, v in jx.get("ceilings", {}).items()}
    ceil.update({f"torch_{k}": v for k, v in he.get("ceilings", {}).items()})
    nan = float("nan")
    bw = max([v for k, v in ceil.items() if k.endswith("GBps")] or [nan]) * 1e9
    fl = max([v for k, v in ceil.items() if k.endswith("TFLOPs")] or [nan]) * 1e12
    roof = {"bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": fl / 1e12, "counts": c, "decode": {}, "prefill": {}}
    E, k = c["experts"], c["top_k"]
    lines = [f"ceilings (best measured): HBM {bw / 1e9:.0f} GB/s, bf16 matmul {fl / 1e12:.0f} TFLOP/s; "
             f"{c['total_params'] / 1e9:.2f} B params, active/token {c['active_params_per_token'] / 1e9:.2f} B",
             f"{'workload':<24}{'experts/L':>10}{'GB/step':>9}{'roofline':>10}{'jax step':>10}{'jax gen()':>10}"
             f"{'hf eager':>10}{'hf comp.':>10}{'jax/roof':>9}{'jax/hfbest':>11}"]
    for B in S["batches"]:
        ctx = S["prompt"] + (S["decode_steps"] - 1) / 2
        meas = jx.get("routing", {}).get(str(B), {}).get("mean_distinct_per_layer")
        ex = meas if meas is not None else expected_distinct(E, k, B)
        by = decode_bytes(c, B, ctx, ex)
        rt = B / (by / bw)
        get = lambda d: d.get(str(B), {}).get("tokens_per_s", nan)  # noqa: E731
        js, jg = get(jx.get("decode_step", {})), get(jx.get("generate", {}))
        he_, hc_ = get(he.get("decode", {})), get(hc.get("decode", {}))
        best_hf = max([v for v in (he_, hc_) if v == v] or [nan])
        roof["decode"][str(B)] = {
            "experts_per_layer": ex, "experts_from": "measured routing" if meas is not None else "uniform expectation",
            "bytes_per_step": by, "roofline_tokens_per_s": rt, "roofline_step_ms": by / bw * 1e3,
            "bytes_all_experts": decode_bytes(c, B, ctx, E),
            "bytes_as_implemented_kv": decode_bytes(c, B, ctx, ex, full_slots=S["cache_len"]),
            "jax_step_frac": js / rt, "jax_generate_frac": jg / rt, "jax_over_best_hf": js / best_hf,
            "jax_generate_over_best_hf": jg / best_hf, "hf_compiled_mode": hc.get("decode", {}).get(str(B), {}).get("mode")}
        lines.append(f"{f'decode B={B} tok/s':<24}{ex:>10.2f}{by / 1e9:>9.2f}{rt:>10.1f}{js:>10.1f}{jg:>10.1f}"
                     f"{he_:>10.1f}{hc_:>10.1f}{js / rt:>9.2f}{js / best_hf:>11.2f}")
    T = S["prefill_len"]
    f, byp = prefill_cost(c, T)
    tr = max(f / fl, byp / bw)
    jp = jx.get("prefill", {}).get("tokens_per_s", nan)
    hp = he.get("prefill", {}).get("tokens_per_s", nan)
    roof["prefill"] = {"flops": f, "bytes": byp, "roofline_tokens_per_s": T / tr, "jax_frac": jp / (T / tr),
                       "jax_over_hf": jp / hp}
    lines.append(f"{f'prefill T={T} tok/s':<24}{'all':>10}{byp / 1e9:>9.2f}{T / tr:>10.0f}{jp:>10.0f}{'':>10}"
                 f"{hp:>10.0f}{'':>10}{jp / (T / tr):>9.2f}{jp / hp:>11.2f}")
    for kk, v in jx.get("moe_layer", {}).items():
        lines.append(f"diag one-layer MoE {kk}: {v['us']:.1f} us")
    for kk, v in jx.get("decode_step_moe_swapped", {}).items():
        lines.append(f"diag decode_step, MoE swapped for {kk}: {v['step_ms']:.3f} ms/step, {v['tokens_per_s']:.1f} tok/s")
    for a in hc.get("attempts", []):
        lines.append(f"hf compile attempt: {a}")
    res["roofline"] = roof
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny config, for a CPU smoke test")
    ap.add_argument("--out", default="benchmarks/results/tmp")
    ap.add_argument("--stage", choices=list(STAGES), help="run one stage in this process (used by the driver)")
    ap.add_argument("--stages", default="jax,hf_eager,hf_compile")
    ap.add_argument("--timeouts", help="seconds per stage (default jax=160,hf_eager=90,hf_compile=150; tiny: 400 "
                                       "each, torch.compile on a CPU takes minutes)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    args.timeouts = args.timeouts or ("jax=400,hf_eager=400,hf_compile=400" if args.tiny else
                                      "jax=160,hf_eager=90,hf_compile=150")
    S = settings(args.tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(STAGES, args.stage, args, S)
    drive(__file__, "bench_moe.json", args, S, summarize)


if __name__ == "__main__":
    main()
