"""GPT-OSS-20B shape on 2 GPUs: tensor parallel (tensor=2, preset tp) and expert parallel (expert=2, preset
ep) vs one GPU, through the library's own sharding (jm.Model(mesh=...)); decode tokens/s at batch 1 and 64,
prefill at T=2048, and the time share of collectives (all-reduce etc., from a profiler trace of decode).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_sharded.py --out $OUT
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        .venv/bin/python benchmarks/bench_sharded.py --tiny --out /tmp/bs       # CPU smoke test
"""
import argparse
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.bench_moe import GPT_OSS_20B  # noqa: E402
from jaxmodels import families, model as M, sharding  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_local_experts": 4}


def _timed(fn, *args, n):
    out = fn(*args)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def collective_share(fn, args, trace_dir) -> dict:
    """Share of device time in collective kernels (nccl / all-reduce / all-gather ...) over a few steps."""
    jax.profiler.start_trace(trace_dir)
    for _ in range(5):
        out = fn(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {}
    ev = json.load(gzip.open(sorted(files)[-1]))["traceEvents"]
    kern = [e for e in ev if e.get("ph") == "X" and e.get("dur") and "args" in e and
            any(k in str(e.get("args")) for k in ("device_id", "stream", "correlation"))]
    total = sum(e["dur"] for e in kern)
    coll = sum(e["dur"] for e in kern if any(s in e["name"].lower() for s in
                                             ("nccl", "all-reduce", "allreduce", "all_reduce", "all-gather",
                                              "reduce-scatter", "all-to-all", "collective")))
    return {"kernel_us": total, "collective_us": coll, "share": coll / total if total else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    hf = GPT_OSS_20B | (TINY if a.tiny else {})
    cfg = families.config_from_hf(hf)
    dtype = jnp.float32 if a.tiny else jnp.bfloat16
    n = 3 if a.tiny else 20
    res = {"devices": [d.device_kind for d in jax.devices()], "jax": jax.__version__, "runs": []}
    plans = [("1 device", None, None), ("tensor=2", "tensor=2", "tp"), ("expert=2", "expert=2", "ep")]
    for label, spec, rules in plans:
        mesh = sharding.make_mesh(spec) if spec else None
        shard = sharding.Sharding.of(mesh, rules)
        params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dtype),
                         out_shardings=sharding.shardings(cfg, mesh, rules) if mesh else None)()
        for B in (1, 64):
            def make_cache(B=B):
                return M.init_cache(cfg, B, 1024, dtype, shard=shard)

            def step(p, t, pos, c):
                return M.decode_step(p, cfg, t, pos, c, shard=shard)

            f = jax.jit(step, donate_argnums=3)
            cache = jax.jit(make_cache)()
            tok, pos = jnp.zeros((B,), jnp.int32), jnp.full((B,), 512, jnp.int32)
            logits, cache = f(params, tok, pos, cache)
            holder = {"c": cache}

            def call():
                lg, holder["c"] = f(params, tok, pos, holder["c"])
                return lg

            t = _timed(call, n=n)
            hlo = f.lower(params, tok, pos, holder["c"]).compile().as_text()
            colls = {op: hlo.count(f" {op}(") + hlo.count(f" {op}-start(") for op in
                     ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")}
            share = collective_share(call, (), f"/tmp/jaxmodels_trace_{label.replace('=', '')}_{B}") if mesh else {}
            r = {"plan": label, "batch": B, "step_ms": round(t * 1e3, 3), "tok_s": round(B / t, 1),
                 "hlo_collectives": colls, **share}
            print(r, flush=True)
            res["runs"].append(r)
            del holder, cache
        T = 64 if a.tiny else 2048

        def fwd(p, x):
            return M.forward(p, cfg, x, shard=shard)

        g = jax.jit(fwd)
        x = jnp.zeros((1, T), jnp.int32)
        t = _timed(g, params, x, n=max(1, n // 4))
        r = {"plan": label, "prefill_T": T, "ms": round(t * 1e3, 2), "tok_s": round(T / t, 1)}
        print(r, flush=True)
        res["runs"].append(r)
        del params
    with open(os.path.join(a.out, "bench_sharded.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
