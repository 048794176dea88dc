"""The gathered FP4 kernel reading words (issue #13, `49d156c`) on the GPU: equal to XLA's gather + dequant, and
its time beside XLA's and, where its offsets fit, beside the kernel that read bytes (a copy of fb8c568's module):

    git show fb8c568:jaxmodels/layers/gathered.py > /tmp/old_gathered.py
    PYTHONPATH=. python benchmarks/gathered_words_probe.py --out words.json [--old /tmp/old_gathered.py]

Stacks: GPT-OSS-20B's 24 layers x 32 experts (2880 x 2880), V4.1-Flash's 364 experts (the largest the bytes
could address) and one Flash layer's 384 (2.26e9 bytes: issue #13's stack), random FP4 codes, the last expert
among the ids. Also lists any copy or bitcast-convert left in the compiled HLO (the int32 view must be free).
"""
import argparse
import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import gathered, triton

CASES = [("gptoss-24x32 2880x2880", (768, 2880, 2880), (4, 32)),
         ("flash-364 gate-up", (364, 2304, 5120), (6, 48)),
         ("flash-384 gate-up", (384, 2304, 5120), (6, 48)),
         ("flash-384 down", (384, 5120, 2304), (6, 48))]


def stack(G, N, K, seed=0):
    """Random FP4 bytes drawn as words (a uint32 a byte would need 4x the memory) and E8M0 scales."""
    kw, ks = jax.random.split(jax.random.key(seed))
    words = jax.random.bits(kw, (G, N, K // 8), jnp.uint32)
    return {"fp4": jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(G, N, K // 2),
            "scale": jax.random.randint(ks, (G, N, K // 32), 120, 131, jnp.int32).astype(jnp.uint8)}


def ms(f, *a, reps=50):
    f(*a).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        y = f(*a)
    y.block_until_ready()
    return (time.perf_counter() - t) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="words.json")
    ap.add_argument("--old", help="a copy of the byte-reading module (see the docstring)")
    a = ap.parse_args()
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("old_gathered", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    new = jax.jit(lambda x, w, ids: gathered._kernel_matmul(x, w, ids, False))
    ref = jax.jit(gathered.reference)
    rows = []
    for name, (G, N, K), ns in CASES:
        w = stack(G, N, K)
        for n in ns:
            x = jax.random.normal(jax.random.key(n), (n, K), jnp.bfloat16)
            ids = jax.random.randint(jax.random.key(n + 1), (n,), 0, G).at[-1].set(G - 1)
            got, want = np.asarray(new(x, w, ids), np.float32), np.asarray(ref(x, w, ids), np.float32)
            hlo = new.lower(x, w, ids).compile().as_text()
            r = {"case": name, "rows": n, "rel_err": float(np.abs(got - want).max() / np.abs(want).max()),
                 "words_ms": ms(new, x, w, ids), "xla_ms": ms(ref, x, w, ids),
                 "hlo_copies": [ln.strip()[:160] for ln in hlo.splitlines()
                                if "bitcast-convert" in ln or " copy" in ln]}
            if old is not None and triton.offsets_fit(*jax.tree.leaves(w)):
                r["bytes_ms"] = ms(jax.jit(lambda x, w, ids: old._kernel_matmul(x, w, ids, False)), x, w, ids)
            r["GBps"] = len(set(np.asarray(ids).tolist())) * N * (K // 2 + K // 32) / r["words_ms"] / 1e6
            print(json.dumps(r), flush=True)
            rows.append(r)
        del w
    with open(a.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
