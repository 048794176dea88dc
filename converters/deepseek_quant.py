"""DeepSeek V4/V4.1 quantized weights <-> float arrays (NumPy + ml_dtypes), exactly as the references decode them.

Spec: specs/deepseek_v4.md §10.2.
- FP8 dense: `W[o,i] = f32(e4m3) * 2^(S[o//Bo, i//Bi] - 127)`, scale grid `[ceil(O/Bo), ceil(I/Bi)]`
  (32x32 in V4.1, 128x128 in V4).
- FP4 experts: int8 `[O, I/2]`, low nibble = element 2k, high = 2k+1, e2m1 with the sign in bit 3, one
  E8M0 per row per 32 along I.
- Engram tables: per row, one E8M0 per 32 channels.
- `wo_a`: dequantised to bf16 at load (CONV41).

E8M0 is read as raw bytes, never numerically cast: a numeric cast of a float8_e8m0fnu tensor (torch `copy_`,
`np.asarray(x, np.uint8)`) turns 2^-7 into 0 (spec §10.2 "E8M0 loading trap"). `safetensors.numpy` cannot
return F8_* tensors at all (it looks for `numpy.float8_*`), hence `read_safetensors_tensor` here, which moves
the raw bytes (tests/quant_encoders.py writes such files).

All decoders are exact: an e4m3 or e2m1 value times a power of two is representable in float32 (and in
bfloat16, which has the same exponent range and >= the 3 mantissa bits of e4m3), so no rounding happens.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmodels.layers import qdq

E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
FP8_MAX, FP4_MAX = qdq.FP8_MAX, qdq.FP4_MAX
FP4_TABLE = qdq.FP4_TABLE  # e2m1 code -> value (bit 3 = sign), CONV41's FP4_TABLE


def _raw(a, name: str, what: str, allowed: tuple[str, ...]) -> np.ndarray:
    """The uint8 bytes of 1-byte data (NumPy / ml_dtypes or torch) whose dtype is one of `allowed` or raw (u)int8:
    a view, never a numeric cast (a numeric array would be ambiguous: bytes or values?)."""
    dt = str(a.dtype).replace("torch.", "")
    if dt not in (*allowed, "uint8", "int8"):
        raise TypeError(f"{name}: {what} must be {' or '.join(allowed)} or raw (u)int8 bytes, got {dt}")
    if type(a).__module__.startswith("torch"):
        import torch

        return a.contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(a).view(np.uint8)


def e8m0_bytes(scale, name: str = "scale") -> np.ndarray:
    """Raw E8M0 exponent bytes (uint8) from uint8 / int8 / float8_e8m0fnu (NumPy or torch)."""
    return _raw(np.asarray(scale) if not hasattr(scale, "dtype") else scale, name, "E8M0 scales", ("float8_e8m0fnu",))


def e4m3_array(w, name: str = "weight") -> np.ndarray:
    """ml_dtypes.float8_e4m3fn view of e4m3 data given as float8_e4m3fn (NumPy or torch) or raw (u)int8 bytes."""
    return _raw(np.asarray(w) if not hasattr(w, "dtype") else w, name, "FP8 weights", ("float8_e4m3fn",)).view(E4M3)


def packed_fp4_bytes(w, name: str = "weight") -> np.ndarray:
    """uint8 view of packed FP4 (checkpoint I8, torch float4_e2m1fn_x2, or uint8)."""
    return _raw(np.asarray(w) if not hasattr(w, "dtype") else w, name, "packed FP4", ("float4_e2m1fn_x2",))


def e8m0_to_float(scale, name: str = "scale") -> np.ndarray:
    """2^(byte - 127) as float32 (byte 0 = 2^-127, a float32 subnormal; byte 255 = NaN)."""
    return qdq.e8m0_to_f32(e8m0_bytes(scale, name))


def dequant_fp8_blocks(w_e4m3, scale_e8m0, block=32, name: str = "weight") -> np.ndarray:
    """Block-scaled FP8 [..., O, I] + E8M0 grid [..., ceil(O/Bo), ceil(I/Bi)] -> float32 [..., O, I].

    `block` is an int (square blocks) or (Bo, Bi): 32 for V4.1, 128 for V4.
    """
    return qdq.dequant_fp8(e4m3_array(w_e4m3, name), e8m0_bytes(scale_e8m0, name + ".scale"), block, np.float32, name)


def dequant_fp4_experts(packed, scale_e8m0, block: int = 32, name: str = "weight") -> np.ndarray:
    """MXFP4 [..., O, I/2] (low nibble = element 2k) + E8M0 [..., O, I/32] -> float32 [..., O, I]."""
    return qdq.dequant_fp4(packed_fp4_bytes(packed, name), e8m0_bytes(scale_e8m0, name + ".scale"), block,
                           np.float32, name)


def dequant_fp8_rows(table_e4m3, scale_e8m0, block: int = 32, name: str = "engram.embed") -> np.ndarray:
    """Engram table: FP8 [R, C] + E8M0 [R, C/32] (per row, per 32 channels) -> float32 [R, C]."""
    w = e4m3_array(table_e4m3, name)
    if w.ndim != 2 or w.shape[1] % block:
        raise ValueError(f"{name}: table must be [R, C] with C a multiple of {block}, got {w.shape}")
    return dequant_fp8_blocks(w, scale_e8m0, (1, block), name)


def dequant_wo_a(w_e4m3, scale_e8m0, block: int = 32, name: str = "attn.wo_a") -> np.ndarray:
    """`wo_a` as CONV41 writes it: bf16(W.reshape(O/B, B, I/B, B).f32 * S[:, None, :, None]) -> bfloat16 [O, I]."""
    w = e4m3_array(w_e4m3, name)
    if w.ndim != 2 or w.shape[0] % block or w.shape[1] % block:
        raise ValueError(f"{name}: wo_a must be [O, I] with both multiples of {block}, got {w.shape}")
    return dequant_fp8_blocks(w, scale_e8m0, block, name).astype(ml_dtypes.bfloat16)


# ---- raw safetensors I/O for the F8 dtypes safetensors.numpy cannot handle ----

_ST_DTYPES = {
    "F8_E4M3": E4M3, "F8_E8M0": np.uint8,  # E8M0 comes back as raw bytes, see the module docstring
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "BOOL": np.bool_,
}

def read_safetensors_header(path) -> tuple[dict, int]:
    """(header dict, byte offset of the data). Cached per file version: a shard holds thousands of tensors."""
    st = Path(path).stat()
    return _header(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _header(path: str, mtime_ns: int, size: int) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        return json.loads(f.read(n)), 8 + n


def read_safetensors_tensor(path, name: str) -> np.ndarray:
    """One tensor, memory-mapped and copied; F8_E4M3 -> float8_e4m3fn, F8_E8M0 -> raw uint8 bytes."""
    header, base = read_safetensors_header(path)
    if name not in header:
        raise KeyError(f"{path}: no tensor {name!r}")
    meta = header[name]
    if meta["dtype"] not in _ST_DTYPES:
        raise TypeError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
    dt = np.dtype(_ST_DTYPES[meta["dtype"]])
    a, b = meta["data_offsets"]
    shape = tuple(meta["shape"])
    if b - a != math.prod(shape) * dt.itemsize:
        raise ValueError(f"{path}: tensor {name!r} holds {b - a} bytes, shape {shape} {meta['dtype']} needs "
                         f"{math.prod(shape) * dt.itemsize}")
    if base + b > Path(path).stat().st_size:
        raise ValueError(f"{path}: truncated safetensors file (tensor {name!r} ends at byte {base + b})")
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=base + a, shape=(b - a,)) if b > a else np.zeros(0, np.uint8)
    return np.array(mm).view(dt).reshape(shape)


# ---- byte-range reads: one block of a tensor without reading the rest (sharded import) ----

RUN_BYTES = 1 << 16  # runs at least this long are read one by one; shorter ones through covering spans
SPAN_BYTES = 1 << 24  # the largest covering span held at once


def read_block(path, offset: int, shape, dtype, index) -> np.ndarray:
    """Block `index` ((start, stop) per leading dimension; the rest whole) of a C-ordered tensor of `shape` stored
    at byte `offset` of `path`: only that block's bytes are read (pread, nothing mapped, so nothing but the
    result stays resident). Rows of at least RUN_BYTES are read one by one; shorter rows (a column block of a
    narrow matrix) through covering spans of at most SPAN_BYTES, from which the block is copied."""
    from jaxmodels.checkpoint import aligned_empty, read_into

    dt, shape = np.dtype(dtype), tuple(shape)
    index = tuple(index) + tuple((0, n) for n in shape[len(index):])
    ext = tuple(b - a for a, b in index)
    out = aligned_empty(ext, dt)
    if not out.size:
        return out
    k = len(shape)  # dims k.. are whole: each run is index[k-1] of them, contiguous
    while k > 0 and index[k - 1] == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        run, starts = out.nbytes, np.zeros(1, np.int64)
    else:
        inner = math.prod(shape[k:]) * dt.itemsize
        run = ext[k - 1] * inner
        starts = np.zeros((), np.int64) + index[k - 1][0] * inner
        for d in range(k - 2, -1, -1):
            stride = math.prod(shape[d + 1:]) * dt.itemsize
            starts = (np.arange(index[d][0], index[d][1], dtype=np.int64) * stride).reshape(
                (-1,) + (1,) * starts.ndim) + starts
        starts = starts.reshape(-1)
    rows = out.reshape(-1).view(np.uint8).reshape(len(starts), run)
    fd = os.open(path, os.O_RDONLY)
    try:
        if run >= RUN_BYTES or len(starts) == 1:
            for j, s in enumerate(starts):
                read_into(fd, rows[j], offset + int(s))
            return out
        j = 0
        while j < len(starts):
            m = max(j + 1, int(np.searchsorted(starts, starts[j] + SPAN_BYTES - run, side="right")))
            span = np.empty(int(starts[m - 1] - starts[j]) + run, np.uint8)
            read_into(fd, span, offset + int(starts[j]))
            rel = starts[j:m] - starts[j]
            step = np.diff(rel)
            if not step.size or (step == step[0]).all():  # evenly spaced runs (the rows of a matrix): a view
                rows[j:m] = np.lib.stride_tricks.as_strided(span, (m - j, run), (int(step[0]) if step.size else run, 1))
            else:
                rows[j:m] = span[rel[:, None] + np.arange(run)]
            j = m
    finally:
        os.close(fd)
    return out


class SafetensorsFiles:
    """Where each tensor of a safetensors checkpoint lies (file, dtype, shape, byte offset), from the headers
    (and the index's weight_map, as SafetensorsReader chooses); `read(name, index)` reads one block of it."""

    def __init__(self, root, names):
        root = Path(root)
        index = root / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        else:
            where = {}
            for path in sorted(root.glob("*.safetensors")):
                if not path.name.startswith("consolidated"):
                    where.update({k: path.name for k in read_safetensors_header(path)[0] if k != "__metadata__"})
        self._at = {}
        for name in names:
            path = root / where[name]
            header, base = read_safetensors_header(path)
            meta = header[name]
            if meta["dtype"] not in _ST_DTYPES:
                raise TypeError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
            self._at[name] = (path, base + meta["data_offsets"][0], tuple(meta["shape"]), _ST_DTYPES[meta["dtype"]])

    def __contains__(self, name):
        return name in self._at

    def shape(self, name) -> tuple[int, ...]:
        return self._at[name][2]

    def read(self, name, index) -> np.ndarray:
        """index: (start, stop) per leading dimension. F8_E4M3 as float8_e4m3fn, F8_E8M0 as raw bytes."""
        path, offset, shape, dt = self._at[name]
        return read_block(path, offset, shape, dt, index)
