"""CRC32 of a file from the CRC32s of its pieces (zlib's crc32_combine, which Python's zlib does not expose): the
converter checksums each slice as it writes it and never reads its output back."""
from __future__ import annotations

import functools

_POLY = 0xEDB88320  # zlib's reflected CRC-32 polynomial


def _times(mat: tuple[int, ...], vec: int) -> int:
    """GF(2) matrix (32 column words) times a 32-bit vector."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec, i = vec >> 1, i + 1
    return out


def _product(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(a, col) for col in b)


@functools.lru_cache(maxsize=None)
def _zeros(nbytes: int) -> tuple[int, ...]:
    """The operator that advances a CRC register over `nbytes` zero bytes (by squaring: O(log n) products)."""
    op = tuple(1 << i for i in range(32))  # identity
    step = (_POLY, *(1 << i for i in range(31)))  # one zero bit
    for _ in range(3):
        step = _product(step, step)  # one zero byte
    while nbytes:
        if nbytes & 1:
            op = _product(step, op)
        nbytes >>= 1
        if nbytes:
            step = _product(step, step)
    return op


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(a + b) from crc32(a), crc32(b) and len(b)."""
    return _times(_zeros(len2), crc1) ^ crc2 if len2 else crc1
