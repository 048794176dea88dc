"""What our Pallas kernels on the Triton backend share (`decode_attention`, `gathered`)."""
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl


def whole(a):
    """A block of the whole array: the kernel indexes it itself (gathers through tables, a layer's offset)."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def params(num_warps: int = 4, num_stages: int = 2) -> dict:
    """pallas_call's compiler_params for the GPU (imported only there)."""
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def offsets_fit(*arrays) -> bool:
    """Whether Pallas' Triton lowering addresses every element of these kernel operands. It indexes an operand
    with 32-bit offsets (in elements) unless the operand spans more than 2^32 bytes, and Triton adds them to the
    pointer as signed values: past 2^31 elements and within 2^32 bytes (1-byte elements: FP4 / FP8 expert bytes,
    E8M0 scales) the upper part is reached through negative offsets, i.e. outside the buffer (jax 0.10-0.11,
    `pallas/triton/lowering.py` `_compute_offsets_from_indices`; tests/test_gathered_quantized.py pins it)."""
    def fit(a):
        n = math.prod(a.shape)
        return n <= 2 ** 31 or n * jnp.dtype(a.dtype).itemsize > 2 ** 32
    return all(fit(a) for a in arrays)
