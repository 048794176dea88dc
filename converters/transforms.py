"""How a checkpoint tensor becomes a parameter: expected source shape and the mapping, per transform."""
import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jaxmodels.checkpoint import aligned_empty


def _prod(s):
    return math.prod(s)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="transpose")


def transpose(x: np.ndarray, dtype=None, tile: int = 256) -> np.ndarray:
    """x.T of a 2-D array as a new C-contiguous array of `dtype` (cast while copied): in square tiles, bands of
    columns in threads (numpy releases the GIL). The conversion's costliest step: np.ascontiguousarray(x.T) of a
    bf16 [4096, 14336] runs at 0.29 GB/s on 2 cores, this at 0.5 (one thread) to 0.85 GB/s."""
    dtype = np.dtype(dtype or x.dtype)
    if x.ndim != 2 or x.size < (1 << 18):
        return np.ascontiguousarray(x.T, dtype)
    rows, cols = x.shape
    out = aligned_empty((cols, rows), dtype)  # page-aligned: written to disk straight from this buffer (O_DIRECT)

    def band(j):
        for i in range(0, rows, tile):
            out[j:j + tile, i:i + tile] = x[i:i + tile, j:j + tile].T

    list(_pool().map(band, range(0, cols, tile)))
    return out


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
