"""The MoE grouped matmul on the GPU: `grouped.ragged_dot` (the Mosaic GPU kernel) against `lax.ragged_dot` and one
plain matmul of the same rows (the rate a grouped GEMM can reach), plus a sweep of the kernel's tile sizes.

    PYTHONPATH=. python3 benchmarks/grouped_matmul_probe.py --out $OUT/grouped_matmul.json
"""
import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import grouped

BF16 = jnp.bfloat16
# (name, routed rows, experts, K, N): GPT-OSS-20B expert matrices (2880 -> 2880) at prefill 2048 x top-4, at decode
# B=64 x top-4 and at 128 prompts x 1024 tokens x top-4; DeepSeek V4.1-Flash (5120 -> 2304, 384 experts) at 512 x 6
SHAPES = [("gpt_oss_prefill_2048", 8192, 32, 2880, 2880), ("gpt_oss_decode_b64", 256, 32, 2880, 2880),
          ("gpt_oss_prefill_128x1024", 524288, 32, 2880, 2880), ("deepseek_prefill_512", 3072, 384, 5120, 2304)]


def timed(f, *a, reps=10):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="grouped_matmul.json")
    ap.add_argument("--sweep", default="gpt_oss_prefill_2048,gpt_oss_decode_b64,deepseek_prefill_512")
    a = ap.parse_args()
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "tiles": grouped.TILES, "shapes": []}
    rng = np.random.default_rng(0)
    for name, M, G, K, N in SHAPES:
        x = jax.random.normal(jax.random.key(0), (M, K), BF16)
        w = (jax.random.normal(jax.random.key(1), (G, K, N)) * K ** -0.5).astype(BF16)
        sizes = jnp.asarray(np.bincount(rng.integers(0, G, M), minlength=G), jnp.int32)  # uniform routing
        flop = 2 * M * K * N
        r = {"name": name, "rows": M, "experts": G, "K": K, "N": N, "distinct_experts": int((sizes > 0).sum())}
        r["kernel_ms"] = timed(jax.jit(grouped.ragged_dot), x, w, sizes)
        r["plain_matmul_ms"] = timed(jax.jit(lambda x, w: x @ w[0]), x, w)
        if M * G * max(K, N) * 2 < 40e9:  # XLA's dense lowering: [E, rows, width] temporaries
            r["lax_ragged_dot_ms"] = timed(jax.jit(jax.lax.ragged_dot), x, w, sizes)
        ref = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x[:4096], w, jnp.minimum(jnp.cumsum(s), 4096) -
                                                         jnp.minimum(jnp.cumsum(s) - s, 4096)))(x, w, sizes)
        got = jax.jit(grouped.ragged_dot)(x[:4096], w, jnp.minimum(jnp.cumsum(sizes), 4096) -
                                          jnp.minimum(jnp.cumsum(sizes) - sizes, 4096))
        r["max_abs_diff_vs_lax_4096_rows"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
        r["kernel_tflops"] = flop / r["kernel_ms"] / 1e9
        r["weight_read_floor_ms"] = r["distinct_experts"] * K * N * 2 / 4.4e12 * 1e3
        print(r, flush=True)
        if name in a.sweep.split(","):
            sweep = []
            for bm, bn, steps, gbn in itertools.product((64, 128), (64, 128, 192, 256), (2, 4, 6), (1, 4)):
                if N % bn or (N // bn) % gbn:
                    continue
                f = jax.jit(lambda x, w, s, bm=bm, bn=bn, steps=steps, gbn=gbn: ragged_dot_mgpu.ragged_dot(
                    x, w, group_sizes=s, block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=steps,
                    grid_block_n=gbn))
                try:
                    ms = timed(f, x, w, sizes, reps=5)
                except Exception as e:  # shared memory exceeded, unsupported tiling
                    sweep.append({"block_m": bm, "block_n": bn, "steps": steps, "grid_block_n": gbn,
                                  "error": str(e).splitlines()[0][:200]})
                    continue
                sweep.append({"block_m": bm, "block_n": bn, "steps": steps, "grid_block_n": gbn, "ms": ms})
            ok = sorted((s for s in sweep if "ms" in s), key=lambda s: s["ms"])
            r["sweep_best"] = ok[:5]
            r["sweep"] = sweep
            print(name, "best", ok[:3], flush=True)
        res["shapes"].append(r)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
