"""The GPU kernels against the pure-JAX paths they replace (run on the GPU machine; skipped elsewhere).

    python -m pytest tests/gpu -q      # on a machine with a Hopper GPU
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import attention, grouped

BF16, F = jnp.bfloat16, jnp.float32
pytestmark = pytest.mark.skipif(not grouped._hopper(), reason="needs a Hopper GPU (the Mosaic GPU kernels)")


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


if __name__ == "__main__":  # the GPU machine may lack pytest
    import sys

    sys.exit(pytest.main([__file__, "-q"]))
