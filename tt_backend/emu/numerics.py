"""TT numerics for the emulator: storage rounding, matmul fidelity and accumulation.

Levels (one per executor run):
- `exact`:   fp32 semantics. Nothing is rounded; matmuls are fp32. For checking op semantics.
- `storage`: every stored tensor takes its declared dtype through the host packer
             (`formats.quantize(..., mode="host")`, bit-exact with ttnn's host conversion);
             compute stays fp32.
- `full`:    weights host-packed; op outputs and cache writes device-packed (`mode="device"`,
             modelled from the ISA docs, not verified on hardware); matmuls keep only the operand
             bits each fidelity phase multiplies (spec §3.4) and accumulate in fp32 or bf16 Dst.

The bfp formats themselves live in `tt_backend.formats` (engineer A); this module never packs bits.
"""
from __future__ import annotations

import numpy as np

LEVELS = ("exact", "storage", "full")
_PASSTHROUGH = ("ttnn.float32", "ttnn.uint32", "ttnn.int32", "ttnn.uint16")


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"numerics must be one of {LEVELS}, got {level!r}")
    return level


def quantize(x: np.ndarray, dtype: str, mode: str) -> np.ndarray:
    """Round `x` to what a tensor of ttnn `dtype` holds (float32 values), by host or device packing."""
    if dtype in _PASSTHROUGH:
        return np.asarray(x, np.float32) if dtype == "ttnn.float32" else x
    from tt_backend import formats

    return np.asarray(formats.quantize(np.asarray(x, np.float32), dtype.removeprefix("ttnn."), mode=mode), np.float32)


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16, nearest-even (the host conversion and the value Dst holds in bf16 mode)."""
    return quantize(x, "ttnn.bfloat16", "host")


def keep_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """Keep the top `bits` significant bits (hidden bit included) of each fp32 value, truncating."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    mask = np.uint32((0xFFFFFFFF << (24 - bits)) & 0xFFFFFFFF)
    return (u & mask).view(np.float32)


# (weight bits, activation bits) of each phase's product; the phases' products are summed (spec §3.4)
_PHASES = {
    "LoFi": [((0, 5), (0, 7))],
    "HiFi2": [((0, 5), (0, 7)), ((5, 10), (0, 7))],
    "HiFi3": [((0, 5), (0, 7)), ((5, 10), (0, 7)), ((0, 5), (7, 11))],
    "HiFi4": [((0, 5), (0, 7)), ((5, 10), (0, 7)), ((0, 5), (7, 11)), ((5, 10), (7, 11))],
}


def _slice(x: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Significand bits lo..hi (counted from the hidden bit) of x, as a value."""
    return keep_bits(x, hi) - (keep_bits(x, lo) if lo else 0.0)


def fidelity_operands(a: np.ndarray, w: np.ndarray, fidelity: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (activation, weight) operand pairs whose products a matmul of this fidelity sums.

    Phases that share an activation slice are merged by adding their weight slices (the slices
    are disjoint bit ranges, so their fp32 sum is exact): HiFi2 is one product, a_hi @ w[:10 bits].
    """
    name = fidelity.rsplit(".", 1)[-1]
    if name not in _PHASES:
        raise ValueError(f"unknown math fidelity {fidelity!r}")
    by_act: dict[tuple, list] = {}
    for wb, ab in _PHASES[name]:
        by_act.setdefault(ab, []).append(wb)
    out = []
    for ab, wbs in by_act.items():
        lo, hi = min(b[0] for b in wbs), max(b[1] for b in wbs)  # contiguous in every phase table
        out.append((_slice(a, *ab), _slice(w, lo, hi)))
    return out


def matmul(a: np.ndarray, w: np.ndarray, level: str, cfg: dict | None) -> np.ndarray:
    """a [..., M, K] @ w [..., K, N] as the matrix engine computes it at `level`.

    in0 (activations) sits in SrcB (7 bits per phase), in1 (weights) in SrcA (5 bits per phase).
    With fp32_dest_acc_en the sum is fp32; otherwise Dst is bf16 and the running sum is rounded
    after each 16-deep slice of K, the depth one MVMUL adds into Dst.
    """
    a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
    if level != "full" or cfg is None:
        return np.matmul(a, w)
    pairs = fidelity_operands(a, w, cfg["math_fidelity"])
    if cfg.get("fp32_dest_acc_en", True):
        return sum(np.matmul(x, y) for x, y in pairs).astype(np.float32)
    K = a.shape[-1]
    acc = None
    for k0 in range(0, K, 16):
        part = sum(np.matmul(x[..., k0:k0 + 16], y[..., k0:k0 + 16, :]) for x, y in pairs)
        acc = bf16(part if acc is None else acc + part)
    return acc
