"""The GPU kernels against the pure-JAX paths they replace (run on the GPU machine; skipped elsewhere).

    JAX_PLATFORMS=cuda python -m pytest tests/gpu -q      # on a machine with a Hopper GPU (tests/conftest.py
                                                          # defaults JAX_PLATFORMS to the CPU)
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import attention, grouped

BF16, F = jnp.bfloat16, jnp.float32
pytestmark = pytest.mark.skipif(not grouped._hopper(),
                                reason="needs a Hopper GPU (the Mosaic GPU kernels) and JAX_PLATFORMS=cuda")


def _sizes(rng, G, M, rows):
    """Random group sizes over `rows` of the M rows (the rest belong to no group), some groups empty."""
    cuts = np.sort(rng.integers(0, rows + 1, G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [rows]]))
    sizes[rng.integers(0, G, max(1, G // 4))] = 0
    sizes[-1] += rows - sizes.sum()
    return jnp.asarray(sizes, jnp.int32)


def _close(got, want, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.abs(want).max()) or 1.0
    assert np.all(np.isfinite(got)), "non-finite values"
    np.testing.assert_allclose(got, want, atol=rel * scale, rtol=0)


@pytest.mark.parametrize("M,G,K,N,rows", [(256, 32, 2880, 2880, 256), (8192, 32, 2880, 5760, 8192),
                                         (1000, 8, 128, 192, 700), (3072, 384, 512, 2304, 3072), (40, 4, 64, 64, 40)])
def test_grouped_matmul_equals_ragged_dot(M, G, K, N, rows):
    rng = np.random.default_rng(M + G)
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), BF16)
    w = (jax.random.normal(kw, (G, K, N), F) * K ** -0.5).astype(BF16)
    sizes = _sizes(rng, G, M, rows)
    assert grouped._fits(x, w) == (G <= grouped.MAX_GROUPS)  # more groups: lax.ragged_dot (same result)
    ref = jax.jit(lambda x, w, s: jax.lax.ragged_dot(x, w, s, preferred_element_type=F))(x, w, sizes)
    got = jax.jit(grouped.ragged_dot)(x, w, sizes)
    assert got.dtype == BF16 and got.shape == (M, N)
    _close(got, ref, 1e-2)
    assert not np.asarray(got[rows:]).any(), "rows past every group must be zero"

    g = jax.random.normal(kg, (M, N), BF16)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.vdot(grouped.ragged_dot(x, w, sizes).astype(F), g.astype(F)),
                              argnums=(0, 1)))(x, w)
    rx, rw = jax.jit(jax.grad(lambda x, w: jnp.vdot(jax.lax.ragged_dot(x.astype(F), w.astype(F), sizes), g.astype(F)),
                              argnums=(0, 1)))(x, w)
    _close(dx, rx, 2e-2)
    _close(dw, rw, 2e-2)


@pytest.mark.parametrize("window", [None, 128])
def test_causal_with_sinks_equals_attend(window):
    B, T, H, K, d = 2, 640, 16, 4, 64
    kq, kk, kv, ks, kg = jax.random.split(jax.random.key(1), 5)
    q = jax.random.normal(kq, (B, T, H, d), BF16)
    k, v = (jax.random.normal(t, (B, K, T, d), BF16) for t in (kk, kv))
    sinks = (jax.random.normal(ks, (H,)) * 2).astype(BF16)
    scale = d ** -0.5
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))

    def ref(q, k, v, sinks):
        return attention.attend(q.astype(F), k.astype(F), v.astype(F),
                                attention.mask(pos, pos, window), scale=scale, sinks=sinks)

    fused = lambda q, k, v, s: attention.causal(q, k, v, scale=scale, window=window, sinks=s)  # noqa: E731
    _close(jax.jit(fused)(q, k, v, sinks), jax.jit(ref)(q, k, v, sinks), 1e-2)
    g = jax.random.normal(kg, (B, T, H, d), F)
    loss = lambda f: lambda *a: jnp.vdot(f(*a).astype(F), g)  # noqa: E731
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for a, b in zip(got, want):
        _close(a, b, 2e-2)


@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (128, True), (64, False)])
def test_masked_equals_attend_on_an_extend_step(window, sinks):
    """The engine's chunk: each row's queries over its cache (empty slots marked -1) and its chunk, padded queries
    past a row's chunk, and a padded row seeing nothing. `masked` (cuDNN) equals `attend` on every query that sees a key and stays finite on
    the rest (the engine drops those); with sinks, its gradients equal `attend`'s too."""
    B, T, S, H, K, d = 3, 48, 200, 8, 2, 64
    kq, kk, kv, ks, kg = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(kq, (B, T, H, d), BF16)
    k, v = (jax.random.normal(t, (B, K, S + T, d), BF16) for t in (kk, kv))
    sink = (jax.random.normal(ks, (H,)) * 2).astype(BF16) if sinks else None
    # the last row is padding, as the engine pads: start 0 (every cache slot -1), no tokens: its queries see nothing
    starts, lengths = jnp.array([0, 150, 0]), jnp.array([48, 20, 0])
    c_pos = jnp.where(jnp.arange(S)[None] < starts[:, None], jnp.arange(S)[None], -1)
    pos = starts[:, None] + jnp.arange(T)[None]
    k_valid = jnp.concatenate([c_pos >= 0, jnp.arange(T)[None] < lengths[:, None]], axis=1)
    allowed = attention.mask(pos, jnp.concatenate([c_pos, pos], 1), window, k_valid=k_valid)
    scale = d ** -0.5

    def ref(q, k, v, s):
        return attention.attend(q.astype(F), k.astype(F), v.astype(F), allowed, scale=scale, sinks=s)

    fused = lambda q, k, v, s: attention.masked(q, k, v, allowed, scale=scale, sinks=s)  # noqa: E731
    got, want = jax.jit(fused)(q, k, v, sink), jax.jit(ref)(q, k, v, sink)
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    seen = np.asarray(allowed.any(-1))
    assert not seen[2].any() and seen[:2].all()  # the padded row's queries see no key (their output is dropped)
    _close(np.asarray(got, np.float32)[seen], np.asarray(want)[seen], 1e-2)
    if sinks:
        g = jax.random.normal(kg, (B, T, H, d), F) * seen[..., None, None]
        loss = lambda f: lambda *a: jnp.vdot(f(*a).astype(F), g)  # noqa: E731
        grads = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2, 3)))(q, k, v, sink)
        wants = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3)))(q, k, v, sink)
        for a, b in zip(grads, wants):
            _close(a, b, 2e-2)


@pytest.mark.parametrize("d", [100, 320])
def test_head_widths_cudnn_refuses_run_in_xla(d):
    """cuDNN takes head widths that are multiples of 8 up to 256 (Hopper): others go through `attend` instead of
    failing at trace time (which would also have turned the engine's chunked prefill off)."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 24, 4, d), BF16) for i in range(3))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    allowed = attention.mask(pos, pos, None)
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    want = attention.attend(q, kt, vt, allowed, scale=d ** -0.5)
    _close(jax.jit(lambda *a: attention.masked(*a, allowed, scale=d ** -0.5))(q, kt, vt), want, 0)
    _close(jax.jit(lambda *a: attention.causal(*a, scale=d ** -0.5))(q, kt, vt), want, 1e-2)  # XLA's own path


@pytest.mark.parametrize("H,K,d,window,block_size,sinks", [(32, 8, 128, None, 0, False), (64, 8, 64, 128, 0, True),
                                                           (32, 8, 128, None, 16, False), (8, 4, 256, 512, 16, False)])
def test_decode_kernel_equals_reference(H, K, d, window, block_size, sinks):
    """The compiled decode kernel against the XLA path it replaces (fp32 reference from the same bf16 cache)."""
    from tests.test_decode_attention import written_cache
    from jaxmodels import cache as kv
    from jaxmodels.layers import decode_attention

    lasts = [0, 511, 700, 2047] if window is None else [3, window - 1, window + 9, 2047]
    lc, lasts = written_cache(4, K, d, window, 2048, lasts, BF16, block_size)
    q = jax.random.normal(jax.random.key(3), (4, 1, H, d), BF16)
    s = jax.random.normal(jax.random.key(4), (H,), F) if sinks else None
    kw = dict(window=window, scale=d ** -0.5, sinks=s)
    assert decode_attention.fits(q, lc.pages("k"))
    view = lambda c: kv.LayerCache(c, lc.kind, lc.layer)  # noqa: E731
    got = jax.jit(lambda q, c: attention.decode(q, view(c), lasts, **kw))(q, lc.cache)
    f32 = dataclasses.replace(lc.cache, buffers=tuple(b.astype(F) for b in lc.cache.buffers))
    want = jax.jit(lambda q, c: attention.decode_reference(q.astype(F), view(c), lasts, **kw))(q, f32)
    _close(got, want, 1e-2)


def test_decode_step_with_kernel_equals_without(monkeypatch):
    """A whole bf16 decode step of a small Llama-shaped model (scanned layers, contiguous cache): logits with the
    kernel equal those of the XLA path to bf16 rounding."""
    from jaxmodels import families, model as M
    from jaxmodels.layers import decode_attention

    cfg = families.config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                                   "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                                   "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
                                   "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096})
    params = M.init_params(cfg, 0, dtype=BF16, std=0.1)
    B, T = 3, 300
    toks = jax.random.randint(jax.random.key(5), (B, T), 0, 512)
    lens = jnp.asarray([T, 17, 200], jnp.int32)

    def run():
        cache = M.init_cache(cfg, B, 1024, BF16)
        _, cache = jax.jit(M.prefill, static_argnums=1)(params, cfg, toks, lens, cache)
        step = jax.jit(M.decode_step, static_argnums=1, compiler_options=M.COMPILER_OPTIONS)
        return step(params, cfg, toks[:, 0], lens, cache)[0]

    got = run()
    monkeypatch.setattr(decode_attention, "fits", lambda *a: False)
    want = run()
    _close(got, want, 2e-2)


@pytest.mark.parametrize("n,G,K,N", [(4, 32, 2880, 2880), (32, 32, 2880, 5760), (8, 384, 4096, 2048), (6, 8, 48, 96)])
def test_gathered_matmul_equals_einsum(n, G, K, N):
    """The gathered-experts GEMV against the XLA gather + einsum (fp32 accumulation of the same bf16 operands)."""
    from jaxmodels.layers import gathered

    kx, kw, ki = jax.random.split(jax.random.key(n + G), 3)
    x = jax.random.normal(kx, (n, K), BF16)
    w = (jax.random.normal(kw, (G, K, N), F) * K ** -0.5).astype(BF16)
    ids = jax.random.randint(ki, (n,), 0, G)
    assert gathered.fits(x, w)
    got = jax.jit(gathered.matmul)(x, w, ids)
    want = jax.jit(lambda x, w, i: jnp.einsum("nk,nkf->nf", x.astype(F), w[i].astype(F)))(x, w, ids)
    assert got.dtype == BF16 and got.shape == (n, N)
    _close(got, want, 1e-2)
    if G * K * N > 1e9:  # the gradient of a whole stack this size: minutes, checked on the smaller shapes
        return
    g = jax.random.normal(kx, (n, N), F)
    grads = lambda f: jax.jit(jax.grad(lambda x, w: jnp.vdot(f(x, w, ids).astype(F), g), argnums=(0, 1)))  # noqa
    for a, b in zip(grads(gathered.matmul)(x, w), grads(gathered.reference)(x, w)):
        _close(a, b, 2e-2)


if __name__ == "__main__":  # the GPU machine may lack pytest
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
