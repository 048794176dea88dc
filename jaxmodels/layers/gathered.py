"""Each row through its own expert: y[i] = x[i] @ w[ids[i]], reading only the chosen experts' weights.

Decode routes few rows (tokens x top-k <= experts), so its MoE cost is the routed experts' bytes. The grouped GEMM
(`grouped.py`) computes tiles for every expert whatever the group sizes (GPT-OSS-20B at batch 1 on an H200: 7.1 of
an 11.3 ms step, reading all 32 experts per layer), and XLA's gather of w[ids] materialises the chosen slabs at
~300 GB/s before its matmul. This kernel (Pallas, Triton backend) is a GEMV per (row, column block, split of the
contraction) that reads its expert's slab in place: give it every layer's experts ([L * E, K, N], ids offset by
the layer), since XLA copies a scanned layer's slice of the stack before a Triton call (18 of a 23.6 ms GPT-OSS
step when it was given the slice). The XLA gather + einsum is the reference, run everywhere the kernel does not.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxmodels.layers import triton

F32 = jnp.float32
HALF = (jnp.bfloat16, jnp.float16)
TARGET_PROGRAMS = 528  # ~4 programs per SM of an H200


def _tiles(x, w) -> bool:
    return x.ndim == 2 and getattr(w, "ndim", 0) == 3 and w.shape[1] % 16 == 0 and w.shape[2] % 32 == 0


def fits(x, w) -> bool:
    """Whether the kernel runs: on the GPU, half-precision operands of one dtype, widths it tiles."""
    return jax.default_backend() == "gpu" and x.dtype == w.dtype and x.dtype in HALF and _tiles(x, w)


def reference(x, w, ids):
    """The XLA path: the chosen slabs gathered, then one batched matmul."""
    return jnp.einsum("nk,nkf->nf", x, w[ids], preferred_element_type=F32).astype(x.dtype)


def matmul(x, w, ids, *, interpret: bool = False):
    """x [n, K], w [G, K, N], ids [n] int -> [n, N] in x's dtype, accumulated in fp32. Differentiable (the backward
    is the reference's). interpret: run the kernel in Pallas' interpreter wherever its widths tile (CPU tests)."""
    if not (fits(x, w) or interpret and _tiles(x, w)):
        return reference(x, w, ids)
    return _kernel_matmul(x, w, ids, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_matmul(x, w, ids, interpret):
    n, (G, K, N) = x.shape[0], w.shape
    bk = next(b for b in (64, 32, 16) if K % b == 0)
    bn = 64 if N % 64 == 0 else 32
    steps = K // bk
    # split K until ~4 programs an SM: at decode sizes (4 rows) the columns alone give too few
    splits = next((s for s in range(1, steps + 1) if steps % s == 0 and n * (N // bn) * s >= TARGET_PROGRAMS), steps)
    parts = pl.pallas_call(
        functools.partial(_kernel, steps=steps // splits, bk=bk, bn=bn), grid=(n, N // bn, splits),
        in_specs=[triton.whole(x), triton.whole(w), triton.whole(ids)],
        out_specs=pl.BlockSpec((None, None, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, n, N), F32), interpret=interpret, name="gathered_matmul",
        **({} if interpret else triton.params(num_stages=4)),
    )(x, w, ids.astype(jnp.int32))
    return jnp.sum(parts, axis=0).astype(x.dtype)


def _kernel_matmul_fwd(x, w, ids, interpret):
    return _kernel_matmul(x, w, ids, interpret), (x, w, ids)


def _kernel_matmul_bwd(interpret, res, g):
    x, w, ids = res
    dx, dw = jax.vjp(lambda x, w: reference(x, w, ids), x, w)[1](g)
    return dx, dw, None


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


def _kernel(x_ref, w_ref, ids_ref, o_ref, *, steps: int, bk: int, bn: int):
    """Row i, columns j*bn .. of its expert's matrix, over split s of the contraction (steps blocks of bk)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ids_ref[i]

    def body(t, acc):
        k0 = (s * steps + t) * bk
        xb = x_ref[i, pl.ds(k0, bk)].astype(F32)
        wb = w_ref[e, pl.ds(k0, bk), pl.ds(j * bn, bn)].astype(F32)
        return acc + jnp.sum(xb[:, None] * wb, axis=0)

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn,), F32))
