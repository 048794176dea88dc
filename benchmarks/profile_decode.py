"""Where a decode step's time goes on the GPU: the kernels of a profiler trace of jitted `M.decode_step`, grouped
by name, against the step's wall time (the rest is launch gaps and host work).

    PYTHONPATH=. python3 benchmarks/profile_decode.py --out $OUT/profile_decode.json [--models llama,gpt_oss]
"""
import argparse
import collections
import glob
import gzip
import json
import os
import time

import jax
import jax.numpy as jnp

from benchmarks.bench_dense import LLAMA31_8B
from benchmarks.bench_moe import GPT_OSS_20B
from jaxmodels import families, model as M


def profile(cfg, params, B, context, slots, trace_dir, steps=8):
    step = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4, compiler_options=M.COMPILER_OPTIONS)
    cache = M.init_cache(cfg, B, slots, jnp.bfloat16)
    tok = jnp.zeros((B,), jnp.int32)
    pos = jnp.full((B,), context, jnp.int32)
    for _ in range(3):
        logits, cache = step(params, cfg, tok, pos, cache)
    jax.block_until_ready(logits)
    t = time.perf_counter()
    for _ in range(steps):
        logits, cache = step(params, cfg, tok, pos, cache)
    jax.block_until_ready(logits)
    wall = (time.perf_counter() - t) / steps
    jax.profiler.start_trace(trace_dir)
    for _ in range(steps):
        logits, cache = step(params, cfg, tok, pos, cache)
    jax.block_until_ready(logits)
    jax.profiler.stop_trace()
    return {"batch": B, "context": context, "slots": slots, "step_ms": round(wall * 1e3, 3)} | kernels(trace_dir, steps)


def kernels(trace_dir, steps, top=30):
    """The GPU kernels of the newest profiler trace under trace_dir (`steps` steps of one program), by name:
    device-busy ms a step, kernels a step, and the `top` names by time."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    ev = json.load(gzip.open(sorted(files, key=os.path.getmtime)[-1]))["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("dur") and "/device:GPU" in pids.get(e.get("pid"), "")
           and "Stream" in str(pids.get(e.get("pid")))]
    if not gpu:  # trace layouts differ between versions: every device-side event
        gpu = [e for e in ev if e.get("ph") == "X" and e.get("dur") and "GPU" in pids.get(e.get("pid"), "")]
    by = collections.defaultdict(lambda: [0.0, 0])
    for e in gpu:
        by[e["name"]][0] += e["dur"]
        by[e["name"]][1] += 1
    busy = sum(v[0] for v in by.values()) / steps
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return {"processes": sorted(set(pids.values()))[:20], "kernel_ms_per_step": round(busy / 1e3, 3),
            "kernels_per_step": round(sum(v[1] for v in by.values()) / steps),
            "top": [{"name": k[:120], "ms_per_step": round(v[0] / steps / 1e3, 4), "calls_per_step": v[1] / steps}
                    for k, v in ranked]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="profile_decode.json")
    ap.add_argument("--models", default="llama,gpt_oss")
    a = ap.parse_args()
    res = {"jax": jax.__version__, "runs": []}
    for name in a.models.split(","):
        cfg = families.config_from_hf(GPT_OSS_20B if name == "gpt_oss" else LLAMA31_8B)
        params = jax.jit(lambda: M.init_params(cfg, 0, dtype=jnp.bfloat16))()
        for B in ((1, 64) if name == "gpt_oss" else (1, 32)):
            r = {"model": name} | profile(cfg, params, B, 512, 1024, f"/tmp/trace_{name}_{B}")
            print(json.dumps({k: v for k, v in r.items() if k != "top"}), flush=True)
            for t in r["top"][:12]:
                print("   ", t, flush=True)
            res["runs"].append(r)
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)
        del params


if __name__ == "__main__":
    main()
