"""gemm.dot: tensordot's result, through two rows exactly where XLA's rule would strength-reduce one row."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import gemm


def padded(f, *args) -> bool:
    return "optimization_barrier" in str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("lead,w_shape,axes,pads", [
    ((1, 1), (64, 8, 16), 1, True),        # one decode row against a small k projection
    ((1,), (64, 32), 1, True),
    ((1, 1, 4, 16), (4, 16, 48), 2, True),  # an attention output: heads x head_dim contracted
    ((2, 1), (64, 8, 16), 1, False),       # two rows are a GEMM already
    ((1, 3), (64, 32), 1, False),
])
def test_equals_tensordot(lead, w_shape, axes, pads):
    rng = np.random.default_rng(len(lead) + axes)
    x_shape = lead if axes == 2 else (*lead, w_shape[0])
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    got = jax.jit(lambda x, w: gemm.dot(x, w, axes))(x, w)
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(w, np.float64), axes)
    assert got.shape == want.shape and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert padded(lambda x, w: gemm.dot(x, w, axes), x, w) == pads


def test_large_weights_stay_one_row():
    """(1 + columns) * depth at or over XLA's 1e7: one row is a GEMM there (Llama-8B's q: 4097 * 4096)."""
    x = jax.ShapeDtypeStruct((1, 1, 4096), jnp.bfloat16)
    assert not padded(gemm.dot, x, jax.ShapeDtypeStruct((4096, 32, 128), jnp.bfloat16))
    assert padded(gemm.dot, x, jax.ShapeDtypeStruct((4096, 8, 128), jnp.bfloat16))  # its k: 1025 * 4096
