"""How a checkpoint tensor becomes a parameter: expected source shape and the mapping, per transform."""
import functools
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np

from jaxmodels.checkpoint import scratch


def _prod(s):
    return math.prod(s)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="transpose")


TILE = 256  # a tile of TILE x TILE (bf16: 128 KiB) and its staged copy stay in a core's L2
PAD = 16  # elements past each staged row, so that their stride is no multiple of 4 KiB (see _band)
WIDENS = {(np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))}  # casts that put the source's bits in the high half


def transpose(x: np.ndarray, dtype=None, out: np.ndarray | None = None) -> np.ndarray:
    """x.T of a 2-D array as a C-contiguous array of `dtype` (cast while copied), byte for byte
    np.ascontiguousarray(x.T, dtype): in `out` (C-contiguous) or a new page-aligned array; in tiles, bands of TILE
    output rows in threads (numpy releases the GIL).
    The conversion's costliest step: numpy's own runs at 0.28 GB/s on a bf16 [5632, 2048], this at ~2 GB/s a core.
    bf16 -> float32 moves 16-bit values into the high halves of a zeroed output (the low halves of an exact
    widening are zero): 20% faster than ml_dtypes' cast in the copy. The output is `scratch` (recycled in a
    conversion)."""
    dtype = np.dtype(dtype or x.dtype)
    if out is not None and (out.shape != x.shape[::-1] or out.dtype != dtype or not out.flags.c_contiguous):
        raise ValueError(f"transpose: out is {out.dtype}{list(out.shape)}, needs C-contiguous "
                         f"{dtype}{list(x.shape[::-1])}")
    if x.ndim != 2 or x.size < (1 << 18):
        if out is None:
            return np.ascontiguousarray(x.T, dtype)
        out[...] = x.T
        return out
    rows, cols = x.shape
    widen = (x.dtype, dtype) in WIDENS and sys.byteorder == "little"
    if out is None:
        out = scratch((cols, rows), dtype)  # page-aligned: written straight to disk (O_DIRECT)
    src, dst = (x.view(np.uint16), out.view(np.uint16)[:, 1::2]) if widen else (x, out)
    zero = out.view(np.uint32) if widen else None
    list(_pool().map(functools.partial(_band, src, dst, zero, np.geterr()), range(0, cols, TILE)))
    return out


def _band(x: np.ndarray, out: np.ndarray, zero: np.ndarray | None, errors: dict, j: int) -> None:
    """out[j:j + TILE] = x[:, j:j + TILE].T, a tile at a time through a staged copy (zero[j:j + TILE] zeroed first:
    the low halves of a widening). numpy's transposed copy reads down a column of its source for each output row;
    where the source rows are a power of two of bytes apart (hidden 2048, 4096: most weights) those reads all fall
    into one L1 cache set and miss: 3x slower. The staged rows are TILE + PAD elements apart. errors: the caller's
    np.errstate (it is per thread)."""
    w = min(TILE, x.shape[1] - j)
    if zero is not None:
        zero[j:j + w] = 0  # a memset of the band, in cache when its high halves are written
    stage = np.empty((TILE, TILE + PAD), x.dtype)
    with np.errstate(**errors):
        for i in range(0, x.shape[0], TILE):
            h = min(TILE, x.shape[0] - i)
            stage[:h, :w] = x[i:i + h, j:j + w]
            out[j:j + w, i:i + h] = stage[:h, :w].T


# name -> (source shape for a target shape, function(source, target shape) -> target)
TRANSFORMS = {
    "copy": (lambda t: tuple(t), lambda x, t: x),
    # nn.Linear [out, in] -> [in, out...] (q/k/v/gate/up/down/lm_head; out may split into heads)
    "T": (lambda t: (_prod(t[1:]), t[0]), lambda x, t: transpose(x).reshape(t)),
    # o_proj [D, heads*d] -> [heads, d, D]
    "T_out": (lambda t: (t[-1], _prod(t[:-1])), lambda x, t: transpose(x).reshape(t)),
    # a bias [heads*d] -> [heads, d]
    "reshape": (lambda t: (_prod(t),), lambda x, t: x.reshape(t)),
    # GPT-OSS fused gate_up [..., 2I] with gate in the even and up in the odd columns
    "even_cols": (lambda t: (*t[:-1], 2 * t[-1]), lambda x, t: np.ascontiguousarray(x[..., 0::2])),
    "odd_cols": (lambda t: (*t[:-1], 2 * t[-1]), lambda x, t: np.ascontiguousarray(x[..., 1::2])),
    # DeepSeek's grouped low-rank output wo_a [G*Ro, H*d/G] -> [G, H*d/G, Ro]
    "wo_a": (lambda t: (t[0] * t[2], t[1]), lambda x, t: np.ascontiguousarray(x.reshape(t[0], t[2], t[1]).transpose(0, 2, 1))),
}
