"""FP8 / FP4 encoders and a raw safetensors writer, for tests that write DeepSeek-layout checkpoints (the library
only reads them: converters/deepseek_quant.py)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from converters.deepseek_quant import E4M3, E8M0, FP4_MAX, FP8_MAX
from jaxmodels.layers.qdq import e2m1_codes


def _pow2_exponent(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest integer e with qmax * 2^e >= amax (amax > 0), clipped to the E8M0 range [-127, 127]."""
    a = amax.astype(np.float64)
    e = np.ceil(np.log2(a / qmax)).astype(np.int64)
    e = np.where(np.ldexp(qmax, e - 1) >= a, e - 1, e)  # log2 rounding can be one off either way
    e = np.where(np.ldexp(qmax, e) < a, e + 1, e)
    return np.clip(e, -127, 127)


def quantize_fp8_blocks(w, block=32) -> tuple[np.ndarray, np.ndarray]:
    """float [..., O, I] -> (float8_e4m3fn [..., O, I], E8M0 bytes uint8 [..., ceil(O/Bo), ceil(I/Bi)]).

    Each block's scale is the smallest power of two that puts its amax within +-448 (an all-zero block
    gets 2^0); values are rounded to nearest even. Decoding with `dequant_fp8_blocks` gives the e4m3
    rounding of w.
    """
    w = np.asarray(w, np.float32)
    bo, bi = (block, block) if isinstance(block, (int, np.integer)) else tuple(block)
    *lead, o, i = w.shape
    go, gi = -(-o // bo), -(-i // bi)
    pad = np.zeros((*lead, go * bo, gi * bi), np.float32)
    pad[..., :o, :i] = w
    amax = np.abs(pad.reshape(*lead, go, bo, gi, bi)).max(axis=(-3, -1))
    e = np.where(amax > 0, _pow2_exponent(np.where(amax > 0, amax, 1), FP8_MAX), 0)
    s = np.ldexp(np.float32(1), e.astype(np.int32)).astype(np.float32)
    grid = np.repeat(np.repeat(s, bo, axis=-2)[..., :o, :], bi, axis=-1)[..., :i]
    q = np.clip(w / grid, -FP8_MAX, FP8_MAX).astype(E4M3)
    return q, (e + 127).astype(np.uint8)


def quantize_fp4_experts(w, block: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """float [..., O, I] -> (packed int8 [..., O, I/2], low nibble = element 2k; E8M0 bytes uint8 [..., O, I/32])."""
    w = np.asarray(w, np.float32)
    *lead, o, i = w.shape
    if i % block or i % 2:
        raise ValueError(f"FP4 row length {i} must be a multiple of the block {block}")
    g = w.reshape(*lead, o, i // block, block)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, _pow2_exponent(np.where(amax > 0, amax, 1), FP4_MAX), 0)
    s = np.ldexp(np.float32(1), e.astype(np.int32)).astype(np.float32)
    codes = e2m1_codes(np.clip(g / s[..., None], -FP4_MAX, FP4_MAX)).reshape(*lead, o, i)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8).view(np.int8), (e + 127).astype(np.uint8)


_NP_TO_ST = {np.dtype(E4M3): "F8_E4M3", np.dtype(E8M0): "F8_E8M0", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
             np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8", np.dtype(np.int16): "I16",
             np.dtype(np.int32): "I32", np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """Write NumPy arrays (incl. ml_dtypes float8_e4m3fn / float8_e8m0fnu / bfloat16) as a safetensors file."""
    header, offset, chunks = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NP_TO_ST:
            raise TypeError(f"{name}: cannot write dtype {arr.dtype} to safetensors")
        data = arr.tobytes()
        header[name] = {"dtype": _NP_TO_ST[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)
    tmp.replace(path)
