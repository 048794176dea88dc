"""Manifold-constrained hyper-connections (mHC, DeepSeek V4): the residual stream held as n copies.

Each sublayer reads a collapse of the copies (`pre` weights), and writes back `post * y` plus a
doubly-stochastic mix `comb` of the old copies (Sinkhorn). All mixing math is fp32 (specs/deepseek_v4.md §4);
the stream itself stays in its own dtype (bf16 in the reference). Differentiable throughout.
"""
import jax
import jax.numpy as jnp

F32 = jnp.float32


def mixes(X, p, *, norm_eps: float, hc_eps: float, iters: int):
    """X [..., n, D] -> (pre [..., n], post [..., n], comb [..., n, n]) from p = {fn [(2+n)n, nD], base, scale [3]}.

    comb[j, k] weighs source copy j into output copy k. Sinkhorn order as the reference: row softmax,
    +eps, column normalise, then (iters-1) x (row, column), eps inside every denominator.
    """
    n = X.shape[-2]
    xf = X.reshape(*X.shape[:-2], -1).astype(F32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)  # one RMS over all n*D values
    m = jnp.einsum("...i,oi->...o", xf, p["fn"].astype(F32)) * r
    base, scale = p["base"].astype(F32), p["scale"].astype(F32)
    pre = jax.nn.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    c = (m[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*m.shape[:-1], n, n)
    c = jax.nn.softmax(c, axis=-1) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)
    return pre, post, c


def head_pre(X, p, *, norm_eps: float, hc_eps: float):
    """V4's learned final collapse weights: p = {fn [n, nD], base [n], scale [1]} -> pre [..., n]."""
    xf = X.reshape(*X.shape[:-2], -1).astype(F32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    m = jnp.einsum("...i,oi->...o", xf, p["fn"].astype(F32)) * r
    return jax.nn.sigmoid(m * p["scale"].astype(F32)[0] + p["base"].astype(F32)) + hc_eps


def collapse(X, pre):
    """sum_k pre_k X_k in fp32, cast to the stream dtype: [..., n, D] -> [..., D]."""
    return jnp.einsum("...k,...kd->...d", pre.astype(F32), X.astype(F32)).astype(X.dtype)


def expand(y, R, post, comb):
    """out_k = post_k * y + sum_j comb[j, k] R_j, computed in fp32 and cast to R's dtype."""
    mixed = jnp.einsum("...jk,...jd->...kd", comb.astype(F32), R.astype(F32))
    return (post.astype(F32)[..., None] * y.astype(F32)[..., None, :] + mixed).astype(R.dtype)


def block(X, pre, p_attn, p_mlp, attn, mlp, spec, norm_eps: float):
    """One layer on the streams X [..., n, D] (MHCSpec `spec`); attn(h) and mlp(h) are its sublayers on the
    collapsed input [..., D]. Returns (X, the pre-mix of its FFN site).

    Delayed (V4.1): the attention input collapses with `pre` (the previous layer's FFN pre-mix; one-hot for the
    first layer), the FFN input with this layer's attention pre-mix. Otherwise (V4) each site its own.
    """
    hc = dict(norm_eps=norm_eps, hc_eps=spec.eps, iters=spec.sinkhorn_iters)
    pA, qA, cA = mixes(X, p_attn, **hc)
    X = expand(attn(collapse(X, pre if spec.delayed else pA)), X, qA, cA)
    pF, qF, cF = mixes(X, p_mlp, **hc)
    X = expand(mlp(collapse(X, pA if spec.delayed else pF)), X, qF, cF)
    return X, pF
