"""Grouped matmul of expert-sorted rows, with `lax.ragged_dot`'s meaning: rows past every group come out zero.

XLA:GPU lowers `lax.ragged_dot` densely: every row through every expert behind an [E, rows, D] mask, E times the
FLOPs and memory that grows with experts x tokens (a GPT-OSS-20B prefill of 128 x 1024 tokens asked for 90 GB).
On Hopper, for half-precision operands whose widths tile, this runs JAX's own Pallas Mosaic GPU grouped GEMMs
instead (`jax.experimental.pallas.ops.gpu`: `ragged_dot_mgpu` forward and input gradient, `transposed_ragged_dot_mgpu`
weight gradient; wgmma kernels whose work follows the routed rows). Everywhere else `lax.ragged_dot` itself, which
is also the reference the GPU test compares the kernels with.
"""
import jax
import jax.numpy as jnp

HALF = (jnp.bfloat16, jnp.float16)
TILES = dict(block_m=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)  # block_n from the width
# The kernel unrolls its search for a tile's group over every group: 32 experts measured; 384 (DeepSeek V4.1-Flash,
# 5120 -> 2304) crashed LLVM inside the Mosaic GPU compile (H200, jax 0.11.2), so more experts take lax.ragged_dot
MAX_GROUPS = 32


def ragged_dot(x, w, sizes):
    """x [M, K] rows sorted by group, w [G, K, N], sizes [G] int32 (sum <= M) -> [M, N] in x's dtype."""
    if not _fits(x, w):
        return jax.lax.ragged_dot(x, w, sizes)
    return _mosaic(x, w, sizes)


def _hopper() -> bool:
    if jax.default_backend() != "gpu":
        return False
    return getattr(jax.devices()[0], "compute_capability", None) == "9.0"


def _block_n(n):
    return next((b for b in (128, 192, 64) if n % b == 0), None)


def _fits(x, w) -> bool:
    """Whether the forward kernel applies: Hopper, one half dtype, a contraction of whole k-blocks, a width of
    whole n-blocks, few enough groups."""
    if not (x.ndim == 2 and w.ndim == 3 and x.dtype == w.dtype and x.dtype in HALF and _hopper()):
        return False
    G, K, N = w.shape
    return G <= MAX_GROUPS and K % TILES["block_k"] == 0 and _block_n(N) is not None


def _forward(x, w, sizes, transpose_rhs=False):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    n = w.shape[1] if transpose_rhs else w.shape[2]
    y = ragged_dot_mgpu.ragged_dot(x, w, group_sizes=sizes, transpose_rhs=transpose_rhs, block_n=_block_n(n),
                                   **TILES)
    # The kernel writes only rows inside a group; lax.ragged_dot gives the others zeros
    return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def _mosaic(x, w, sizes):
    return _forward(x, w, sizes)


def _mosaic_fwd(x, w, sizes):
    return _forward(x, w, sizes), (x, w, sizes)


def _mosaic_bwd(res, g):
    x, w, sizes = res
    g = g.astype(x.dtype)
    K, N = w.shape[1:]
    if N % TILES["block_k"] == 0 and _block_n(K):  # dx = g @ w[e]^T: the same kernel reading w transposed
        dx = _forward(g, w, sizes, transpose_rhs=True)
    else:
        dx = jax.vjp(lambda a: jax.lax.ragged_dot(a, w, sizes), x)[1](g)[0]
    if K % TILES["block_m"] == 0 and _block_n(N):  # dw[e] = x_e^T @ g_e over each group's rows
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

        dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(x, g, group_sizes=sizes, block_n=_block_n(N), **TILES)
    else:
        dw = jax.vjp(lambda b: jax.lax.ragged_dot(x, b, sizes), w)[1](g)[0]
    return dx, dw.astype(w.dtype), None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)

