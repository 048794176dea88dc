"""mHC (layers/mhc.py) against the float64 oracle's transcription of the spec (§4), and its gradients."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.test_util import check_grads

from jaxmodels.layers import mhc
from tests.oracles import deepseek_v41 as oracle

N, D = 4, 32
MIX = (2 + N) * N


def _params(rng):
    return {"fn": rng.normal(size=(MIX, N * D)) * 0.3, "base": rng.normal(size=MIX) * 0.5,
            "scale": np.array([0.7, 1.3, 2.0])}


def test_mixes_collapse_expand_match_the_oracle():
    rng = np.random.default_rng(0)
    X, y, p = rng.normal(size=(2, 5, N, D)), rng.normal(size=(2, 5, D)), _params(rng)
    pre, post, comb = mhc.mixes(jnp.asarray(X, jnp.float32), jax.tree.map(jnp.asarray, p), norm_eps=1e-20,
                                hc_eps=1e-6, iters=20)
    opre, opost, ocomb = oracle.mixes_sinkhorn(X, p["fn"], p["base"], p["scale"], N, 20, 1e-6, 1e-20)
    for ours, ref in ((pre, opre), (post, opost), (comb, ocomb)):
        np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-6)
    assert not np.allclose(ocomb, np.swapaxes(ocomb, -1, -2), atol=1e-3)  # orientation matters: comb is not symmetric
    np.testing.assert_allclose(np.asarray(mhc.collapse(jnp.asarray(X, jnp.float32), pre)),
                               oracle.hc_collapse(X, opre), atol=1e-5)
    out = mhc.expand(jnp.asarray(y, jnp.float32), jnp.asarray(X, jnp.float32), post, comb)
    np.testing.assert_allclose(np.asarray(out), oracle.hc_expand(y, X, opost, ocomb), atol=1e-5)


def test_gradients_flow_through_sinkhorn():
    rng = np.random.default_rng(1)
    X, y, p = rng.normal(size=(3, N, D)), rng.normal(size=(3, D)), _params(rng)

    def block(X, y, fn, base):
        pre, post, comb = mhc.mixes(X, {"fn": fn, "base": base, "scale": jnp.asarray(p["scale"], jnp.float32)},
                                    norm_eps=1e-6, hc_eps=1e-6, iters=20)
        return jnp.sum(jnp.tanh(mhc.expand(y * mhc.collapse(X, pre)[..., :1], X, post, comb)))

    args = tuple(jnp.asarray(a, jnp.float32) for a in (X, y, p["fn"], p["base"]))
    check_grads(block, args, order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)
    g = jax.grad(block, argnums=(2, 3))(*args)
    assert all(float(jnp.abs(x).max()) > 0 for x in g)
