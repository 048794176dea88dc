"""Routed rows through one V4.1-Flash layer's 384 FP4 experts (one matrix, 2.26e9 bytes), three ways, by row count:

    PYTHONPATH=. python benchmarks/windowed_probe.py --out windowed.json

`windowed` (the kernel over expert-sorted windows, spread and collect included), `gathered` (an expert read per
row: moe's path while rows <= experts), `loop` (`windowed.reference`: the XLA loop `moe._windows` runs, one window
a step). Rows routed uniformly; GB/s counts the bytes of the distinct experts used once. Also a Qwen3-MoE-width
bf16 case (128 experts, 2048 -> 768), and GPT-OSS-20B's experts (32, 2880 -> 2880) in FP4 and in bf16 (`grouped`:
the Mosaic GPU grouped GEMM moe takes for bf16 there). `--tilings` times the kernel at other tilings.

`--decode` picks the FP4 kernels' e2m1 decode: `asm` (the default path, PTX two codes to a 32-bit op), `bits`
(`gathered.e2m1_bits`, one code to an fp32 lane: JAXMODELS_ASM_DECODE=0), `cheap` (a bare int -> float conversion:
wrong values, no checks; the time FP4 paths would take if decoding cost nothing).
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import gathered, grouped, moe, windowed

BF16 = jnp.bfloat16


def ms(f, *a, reps=20):
    jax.block_until_ready(f(*a))
    t = time.perf_counter()
    for _ in range(reps):
        y = f(*a)
    jax.block_until_ready(y)
    return (time.perf_counter() - t) / reps * 1e3


def fp4(G, N, K):
    kw, ks = jax.random.split(jax.random.key(0))
    words = jax.random.bits(kw, (G, N, K // 8), jnp.uint32)
    return {"fp4": jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(G, N, K // 2),
            "scale": jax.random.randint(ks, (G, N, K // 32), 118, 132, jnp.int32).astype(jnp.uint8)}


def paths(w, E, first=0, W=None):
    def win(x, w, sizes):
        lay = windowed.layout(sizes, x.shape[0], W or min(moe._window(x.shape[0], E), windowed.MAX_WINDOW))
        return windowed.collect(windowed.matmul(windowed.spread(x, lay), w, lay, first), lay, x.shape[0])

    def loop(x, w, sizes):
        lay = windowed.layout(sizes, x.shape[0], moe._window(x.shape[0], E))
        return windowed.collect(windowed.reference(windowed.spread(x, lay), w, lay, first), lay, x.shape[0])

    def gat(x, w, sizes):
        ids = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=x.shape[0])
        return gathered.matmul(x, w, ids + first)

    def grp(x, w, sizes):  # bf16 experts, <= 32 of them: the Mosaic GPU grouped GEMM moe takes there
        return grouped.ragged_dot(x, w[first:first + E], sizes)

    return {"windowed": jax.jit(win), "gathered": jax.jit(gat), "loop": jax.jit(loop), "grouped": jax.jit(grp)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="windowed.json")
    ap.add_argument("--rows", default="48,192,384,768,1536,3072,12288")
    ap.add_argument("--loop-rows", default="768,3072", help="rows at which the slow XLA loop is timed too")
    ap.add_argument("--sweep", default="", help="W,W,...: also time the kernel with these window sizes")
    ap.add_argument("--cases", default="0,1,2", help="which of the three cases to run")
    ap.add_argument("--decode", default="asm", choices=("asm", "bits", "cheap"))
    ap.add_argument("--tilings", default="", help="bn:nbk:warps:stages,...: also time the kernel with these tilings "
                    "(nbk: FP4 scale blocks a step; bf16 cases take only column blocks bn that divide N)")
    a = ap.parse_args()
    os.environ["JAXMODELS_ASM_DECODE"] = "1" if a.decode == "asm" else "0"
    if a.decode == "cheap":
        gathered.e2m1_bits = lambda c: c.astype(jnp.float32)
    loop_rows = {int(r) for r in a.loop_rows.split(",")}
    rows = []
    cases = [("flash fp4 gate-up", 384, fp4(384, 2304, 5120), 5120, 2304, 0.5 + 1 / 32),
             ("flash fp4 down", 384, fp4(384, 5120, 2304), 2304, 5120, 0.5 + 1 / 32),
             ("qwen3-moe bf16 gate", 128, (jax.random.normal(jax.random.key(1), (128, 2048, 768)) / 32).astype(BF16),
              2048, 768, 2),
             ("gpt-oss fp4", 32, fp4(32, 2880, 2880), 2880, 2880, 0.5 + 1 / 32),  # 90 scale blocks: a masked step
             ("gpt-oss bf16", 32, (jax.random.normal(jax.random.key(2), (32, 2880, 2880)) / 32).astype(BF16),
              2880, 2880, 2)]
    for c in sorted(set(range(len(cases))) - set(map(int, a.cases.split(","))), reverse=True):
        del cases[c]
    sweep = [int(v) for v in a.sweep.split(",") if v]
    for name, E, w, K, N, bpe in cases:
        f = paths(w, E)
        for M in map(int, a.rows.split(",")):
            ids = jax.random.randint(jax.random.key(M), (M,), 0, E)
            sizes = jnp.bincount(ids, length=E).astype(jnp.int32)
            x = jax.random.normal(jax.random.key(M + 1), (M, K)).astype(BF16)
            used = int((sizes > 0).sum())
            r = {"case": name, "rows": M, "experts_used": used, "decode": a.decode}
            y = np.asarray(f["windowed"](x, w, sizes), np.float32)
            for k in ("windowed", "gathered", "loop", "grouped"):
                if k == "loop" and M not in loop_rows or k == "gathered" and M > 3072 or k == "grouped" and (
                        isinstance(w, dict) or E > grouped.MAX_GROUPS):
                    continue
                if k != "windowed" and a.decode != "cheap":
                    ref = np.asarray(f[k](x, w, sizes), np.float32)
                    r[f"max_diff_vs_{k}"] = float(np.abs(y - ref).max() / np.abs(ref).max())
                r[f"{k}_ms"] = ms(f[k], x, w, sizes)
            for W in sweep:
                r[f"windowed_W{W}_ms"] = ms(paths(w, E, W=W)["windowed"], x, w, sizes)
            for t in filter(None, a.tilings.split(",")):
                bn, nbk, warps, stages = map(int, t.split(":"))
                if N % bn and not isinstance(w, dict):
                    continue
                default, windowed.tiling = windowed.tiling, lambda N, b=None, W=None, t=(bn, nbk, warps, stages): t
                key = f"windowed_{bn}x{nbk}x{warps}x{stages}_ms"
                try:
                    g = paths(w, E)["windowed"]
                    r[key] = ms(g, x, w, sizes)
                    yt = np.asarray(g(x, w, sizes), np.float32)  # the same sums in another order: bf16 rounding apart
                    r[key.replace("_ms", "_diff")] = float(np.abs(yt - y).max() / np.abs(y).max())
                except Exception as e:  # noqa: BLE001 - a tiling Triton refuses (registers, shared memory)
                    r[key] = f"{type(e).__name__}: {str(e)[:120]}"
                finally:
                    windowed.tiling = default
            r["windowed_GBps"] = used * N * K * bpe / r["windowed_ms"] / 1e6
            print(json.dumps(r), flush=True)
            rows.append(r)
        del w, f
    with open(a.out, "w") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
