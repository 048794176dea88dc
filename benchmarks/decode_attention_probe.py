"""Decode attention alone on the GPU: does its cost follow the valid context or the cache length?

Llama-3.1-8B attention shapes (32 query heads, 8 kv heads, d 128, bf16), one query token per row, a cache of
`--cache` slots in our layout [B, K, S, d]. Variants:
  attend   jaxmodels.layers.attention.attend with a validity mask (what decode runs today)
  cudnn    jax.nn.dot_product_attention(implementation="cudnn", key_value_seq_lengths=...) on the same cache,
           transposed to its [B, S, K, d] layout inside the jitted step (does XLA fold the transpose?)
  cudnn_bsk the same on a cache already stored [B, S, K, d] (no transpose: the layout cuDNN wants)
Writes JSON (median ms per call, HBM-roofline ms for the valid KV bytes) to --out.

  python benchmarks/decode_attention_probe.py --out results/decode_attention_h200.json
"""
import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers.attention import attend

HBM = 4.8e12  # H200 bytes/s


def timed(f, *args, n=20):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=int, default=32768)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--out", default="decode_attention.json")
    a = ap.parse_args()
    H, K, d, S = 32, 8, 128, a.cache
    scale = d ** -0.5
    rows = []
    for B in map(int, a.batches.split(",")):
        key = jax.random.PRNGKey(0)
        q = jax.random.normal(key, (B, 1, H, d), jnp.bfloat16)
        k = jax.random.normal(jax.random.fold_in(key, 1), (B, K, S, d), jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 2), (B, K, S, d), jnp.bfloat16)
        kt, vt = jnp.asarray(k.transpose(0, 2, 1, 3)), jnp.asarray(v.transpose(0, 2, 1, 3))

        @jax.jit
        def masked(q, k, v, n):
            return attend(q, k, v, (jnp.arange(S) < n[:, None])[:, None, :], scale=scale)

        @jax.jit
        def cudnn(q, k, v, n):
            return jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale,
                                                key_value_seq_lengths=n, implementation="cudnn")

        @jax.jit
        def cudnn_bsk(q, k, v, n):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=n,
                                                implementation="cudnn")

        for ctx in map(int, a.contexts.split(",")):
            n = jnp.full((B,), ctx, jnp.int32)
            row = {"batch": B, "context": ctx, "cache": S,
                   "roofline_ms": 2 * B * K * ctx * d * 2 / HBM * 1e3}
            ref = masked(q, k, v, n)
            row["attend_ms"] = timed(masked, q, k, v, n)
            for name, f, kk, vv in (("cudnn", cudnn, k, v), ("cudnn_bsk", cudnn_bsk, kt, vt)):
                try:
                    out = f(q, kk, vv, n)
                    row[name + "_ms"] = timed(f, q, kk, vv, n)
                    row[name + "_maxdiff"] = float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max())
                except Exception as e:  # noqa: BLE001 (a probe: record why a variant cannot run)
                    row[name + "_error"] = str(e).splitlines()[0][:300]
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
