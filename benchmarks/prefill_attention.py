"""Prefill attention on GPU: cuDNN path (attention.causal) vs the einsum path, and Llama-8B-shape prefill time.

    PYTHONPATH=. python3 benchmarks/prefill_attention.py
"""
import time

import jax
import jax.numpy as jnp

from jaxmodels import families, model as M
from jaxmodels.layers import attention
from benchmarks.bench_dense import LLAMA31_8B
k = jax.random.split(jax.random.PRNGKey(0), 3)
for W in (None, 128):
    q = jax.random.normal(k[0], (2, 512, 32, 128), jnp.bfloat16)
    kk = jax.random.normal(k[1], (2, 8, 512, 128), jnp.bfloat16)
    v = jax.random.normal(k[2], (2, 8, 512, 128), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(512), (2, 512))
    a = attention.causal(q, kk, v, scale=128**-0.5, window=W)
    b = attention.attend(q, kk, v, attention.mask(pos, pos, W), scale=128**-0.5)
    print("window", W, "max|diff|", float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max()), flush=True)
    print(jax.jit(lambda q, kk, v: attention.causal(q, kk, v, scale=0.1, window=W)).lower(q, kk, v).compile().as_text().count("cudnn"), "cudnn mentions")
cfg = families.config_from_hf(LLAMA31_8B)
params = M.init_params(cfg, 0, dtype=jnp.bfloat16)
toks = jnp.zeros((1, 2048), jnp.int32)
f = jax.jit(lambda p, t: M.forward(p, cfg, t)[:, -1])
jax.block_until_ready(f(params, toks))
ts = []
for _ in range(5):
    t0 = time.perf_counter(); jax.block_until_ready(f(params, toks)); ts.append(time.perf_counter() - t0)
t = sorted(ts)[2]
print(f"prefill T=2048 B=1 forward: {t*1e3:.1f} ms, {2048/t:.0f} tok/s", flush=True)
