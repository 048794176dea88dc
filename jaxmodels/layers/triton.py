"""What our Pallas kernels on the Triton backend share (`decode_attention`, `gathered`)."""
from jax.experimental import pallas as pl


def whole(a):
    """A block of the whole array: the kernel indexes it itself (gathers through tables, a layer's offset)."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def params(num_warps: int = 4, num_stages: int = 2) -> dict:
    """pallas_call's compiler_params for the GPU (imported only there)."""
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
