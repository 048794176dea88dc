"""DeepSeek V4.1's simulated quantisation (QDQ) and block-scaled quantized matmuls, in jit-able JAX.

Spec: specs/deepseek_v4.md §2, §12 trap 9. The code follows REF41-ker (tenstorrent/tt-metal
`models/demos/deepseek_v3_d_p/reference/deepseek_v41/kernel_cpu.py`, a bit-exact torch port of the upstream
tilelang kernels, `K41:<line>` = upstream kernel.py) operation for operation:

- `act_quant_fp8` (K41:41-113): amax over blocks of 32 in fp32 floored at 1e-4; scale = pow2ceil(amax * fp32(1/448))
  (a multiply by the float32 reciprocal, not a division); q = e4m3 round-to-nearest-even of clamp(x / s, +-448).
- `fp4_act_quant` (K41:116-199): e8m0 scales: amax floored at 6*2^-126, s = pow2ceil(amax * fp32(1/6));
  e4m3 scales: amax floored at 6*2^-9, s = e4m3(amax / 6) (a true division here, as in the kernel);
  then v = clamp(x / s, +-6), e2m1 round-to-nearest-even (ties to the even code), output e2m1(v) * s.

Rounding is done explicitly (grid step from the fp32 exponent, `round` half-to-even), not by a float8 convert,
so the result does not depend on how a backend implements f32->f8 conversion. Division by a power-of-two scale
is a multiply by its exact reciprocal. The e4m3-scale path's two real divisions (amax / 6, x / s) are computed
with integer arithmetic (`_div_short`), because neither XLA:CPU (reciprocal rewrite) nor XLA:GPU (non-IEEE
fp32 divide) rounds `a / b` once, and those last bits decide e2m1/e4m3 ties.

Known limit: XLA:CPU flushes float32 subnormals to zero. Inputs whose magnitude is below 2^-126 (bf16/fp32
subnormals) can therefore differ from the torch kernel in the e8m0 FP4 path, and E8M0 scale bytes below
~10 (scales under 2^-117) can flush dequantised weights. Real activations and checkpoints stay far from both.

Weights kept quantized (`linear` on {"fp8"|"fp4", "scale"}) stay as stored ([O, I] e4m3 or packed e2m1, E8M0
bytes as uint8) and are dequantised inside the jitted computation. An e4m3 or e2m1 value times a power of two
is exactly representable in bf16 as well as fp32, so dequantising to the compute dtype loses nothing and the
result equals dequant-then-matmul. The decoders serve host import (NumPy in, NumPy out) and device alike.
"""
from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

F32 = jnp.float32
FP8_MAX = 448.0
FP4_MAX = 6.0
# the kernels multiply by the reciprocal rounded to float32 (K41:47,138)
FP8_MAX_INV = np.float32(1.0 / FP8_MAX)
FP4_MAX_INV = np.float32(1.0 / FP4_MAX)
ACT_AMAX_FLOOR = 1e-4
FP4_E8M0_AMAX_FLOOR = 6 * 2.0 ** -126
FP4_E4M3_AMAX_FLOOR = 6 * 2.0 ** -9
# e2m1 code -> value, bit 3 = sign (CONV41 FP4_TABLE)
FP4_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)  # a tie rounds up only onto an even code


def _bits(x):
    return lax.bitcast_convert_type(x.astype(F32), jnp.int32)


def _from_bits(b):
    return lax.bitcast_convert_type(b.astype(jnp.int32), F32)


def pow2ceil(x):
    """2^ceil(log2 x) from the fp32 bits, as `fast_round_scale` (K41:22-38): exponent + (mantissa != 0)."""
    b = _bits(x)
    e = ((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).astype(jnp.int32)
    return _from_bits((e + 127) << 23)


def e8m0_byte(s):
    """Power-of-two fp32 scale -> its E8M0 byte (uint8)."""
    return ((_bits(s) >> 23) & 0xFF).astype(jnp.uint8)


def e4m3_rne(v):
    """fp32 values with |v| <= 448 -> the nearest e4m3fn value (ties to even), still as fp32.

    The e4m3 step is 2^(floor(log2|v|) - 3) for normal values and 2^-9 below 2^-6; v / step is exact.
    """
    e = jnp.maximum(((_bits(v) >> 23) & 0xFF) - 127, -6)
    step = _from_bits((e - 3 + 127) << 23)
    return jnp.round(v * _recip_pow2(step)) * step  # exact scaling; jnp.round is half-to-even


def e2m1_codes(v):
    """fp32 values in [-6, 6] -> 4-bit e2m1 codes (uint8, bit 3 = sign), round-to-nearest-even (as REF41-ker).
    NumPy in, NumPy out (host encoders); JAX in, JAX out."""
    xp = _xp(v)
    mag = xp.abs(v)
    code = xp.zeros(v.shape, np.int32)
    for mid, up in zip(_E2M1_MIDS, _E2M1_TIE_UP):
        code = code + (mag > mid) + ((mag == mid) & up)
    return (code | (xp.signbit(v).astype(np.int32) << 3)).astype(np.uint8)


def _recip_pow2(s):
    """1/s for power-of-two fp32 s in [2^-126, 2^126], exact, from the exponent bits."""
    return _from_bits((254 - ((_bits(s) >> 23) & 0xFF)) << 23)


def _div_short(x, d):
    """fl(x / d) rounded once to nearest even, for fp32 x and a positive normal fp32 divisor d with at most
    4 significant bits (an e4m3 value, or 6). Results below 2^-126 come back as a signed zero.

    Neither `a / b` nor `a * (1/b)` gives this on every backend: XLA rewrites division by a broadcast or a
    constant into a multiply by the reciprocal (two roundings), and XLA:GPU's fp32 division is not IEEE
    (~30% of random quotients differ in the last bit). Those last bits decide e2m1 / e4m3 ties, so the
    mantissa quotient is computed with integer division instead.
    """
    xb = _bits(x)
    db = jnp.broadcast_to(_bits(d), xb.shape)
    ex = (xb >> 23) & 0xFF
    mx = (xb & 0x7FFFFF) | 0x800000  # 24-bit significand
    md = ((db & 0x7FFFFF) | 0x800000) >> 20  # 4-bit significand, 8..15
    n = mx << 6  # < 2^30
    q, r = n // md, n % md  # q in [2^25, 2^27): x/d = (q + r/md) * 2^(ex - ed - 26)
    drop = 2 + (q >= (1 << 26)).astype(jnp.int32)  # bits below the 24 kept
    keep = q >> drop
    low = q & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    up = (low > half) | ((low == half) & ((r != 0) | ((keep & 1) == 1)))
    m = keep + up.astype(jnp.int32)
    carry = m >> 24  # rounding overflowed to 2^24
    m = m >> carry
    eb = ex - ((db >> 23) & 0xFF) + 124 + drop + carry  # biased exponent of the result
    mag = jnp.where((ex == 0) | (eb <= 0), 0, (jnp.minimum(eb, 255) << 23) | (m & 0x7FFFFF))
    return _from_bits(mag | (xb & jnp.int32(-0x80000000)))


def _blocked(x, block):
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dim {n} is not a multiple of the quantisation block {block}")
    return x.astype(F32).reshape(*x.shape[:-1], n // block, block)


def act_quant_fp8(x, block: int = 32, return_scale: bool = False):
    """FP8 e4m3 QDQ along the last dim in blocks of `block`, UE8M0 (power-of-two) scales.

    Default: the QDQ'd values in x.dtype (the kernel's `inplace=True`: bf16(fp32(q) * s)).
    return_scale=True: (q float8_e4m3fn [..., N], s fp32 [..., N/block]) (the kernel's non-inplace result;
    `e8m0_byte(s)` gives the scale bytes).
    """
    xg = _blocked(x, block)
    amax = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), np.float32(ACT_AMAX_FLOOR))
    s = pow2ceil(amax * FP8_MAX_INV)
    q = e4m3_rne(jnp.clip(xg * _recip_pow2(s)[..., None], -FP8_MAX, FP8_MAX))
    if return_scale:
        return q.astype(jnp.float8_e4m3fn).reshape(x.shape), s
    return (q * s[..., None]).reshape(x.shape).astype(x.dtype)


def fp4_act_quant(x, block: int = 32, scale_fmt: str = "e8m0", return_codes: bool = False):
    """FP4 e2m1 QDQ along the last dim in blocks of `block`.

    scale_fmt "e8m0": power-of-two scales (indexer q/k, block 32); "e4m3": e4m3 scales (compressed KV, block 16).
    Default: QDQ'd values in x.dtype. return_codes=True: (codes uint8 [..., N] unpacked, s fp32 [..., N/block]).
    """
    xg = _blocked(x, block)
    amax = jnp.max(jnp.abs(xg), axis=-1)
    if scale_fmt == "e4m3":
        amax = jnp.maximum(amax, np.float32(FP4_E4M3_AMAX_FLOOR))  # K41:158-161
        s = e4m3_rne(jnp.clip(_div_short(amax, np.float32(FP4_MAX)), -FP8_MAX, FP8_MAX))
    elif scale_fmt == "e8m0":
        amax = jnp.maximum(amax, np.float32(FP4_E8M0_AMAX_FLOOR))  # K41:163-164
        s = pow2ceil(amax * FP4_MAX_INV)
    else:
        raise ValueError(f"scale_fmt must be 'e8m0' or 'e4m3', got {scale_fmt!r}")
    v = _div_short(xg, s[..., None]) if scale_fmt == "e4m3" else xg * _recip_pow2(s)[..., None]
    codes = e2m1_codes(jnp.clip(v, -FP4_MAX, FP4_MAX))
    if return_codes:
        return codes.reshape(x.shape), s
    return (jnp.asarray(FP4_TABLE)[codes] * s[..., None]).reshape(x.shape).astype(x.dtype)


# ---- block-scaled weights: one decoder for host import (NumPy) and device (jit), the same arithmetic ----

def _host(a) -> bool:
    return isinstance(a, np.ndarray)


def _xp(a):
    return np if _host(a) else jnp


def _bitcast(x, dtype):
    return np.ascontiguousarray(x).view(dtype) if _host(x) else lax.bitcast_convert_type(x, dtype)


def _as_u8(b):
    """Raw bytes of E8M0 scales / packed FP4: reinterpreted, never numerically cast (2^-7 would become 0)."""
    b = b if _host(b) else jnp.asarray(b)
    if b.dtype == np.uint8:
        return b
    if b.dtype in (np.int8, ml_dtypes.float8_e8m0fnu):
        return _bitcast(b, np.uint8)
    raise TypeError(f"expected raw bytes (uint8 / int8 / float8_e8m0fnu), got {b.dtype}")


def _as_e4m3(w):
    w = w if _host(w) else jnp.asarray(w)
    if w.dtype in (np.uint8, np.int8):
        return _bitcast(w, ml_dtypes.float8_e4m3fn)
    if w.dtype != ml_dtypes.float8_e4m3fn:
        raise TypeError(f"expected float8_e4m3fn weights (or their raw bytes), got {w.dtype}")
    return w


def e8m0_to_f32(b):
    """E8M0 bytes -> 2^(b-127) in fp32; byte 0 is the subnormal 2^-127, byte 255 NaN."""
    xp = _xp(b)
    b = _as_u8(b).astype(np.int32)
    return _bitcast(xp.where(b == 0, 0x00400000, xp.where(b == 255, 0x7FC00000, b << 23)).astype(np.int32), np.float32)


def _block_pair(block):
    return (block, block) if isinstance(block, (int, np.integer)) else tuple(block)


def dequant_fp8(w_q, w_scale, block=32, dtype=F32, name: str = "weight"):
    """e4m3 [..., O, I] (float8_e4m3fn or its bytes) + E8M0 bytes [..., ceil(O/Bo), ceil(I/Bi)] -> dtype [..., O, I].

    block: an int (square blocks: 32 in V4.1, 128 in V4) or (Bo, Bi), e.g. (1, 32) for Engram's per-row scales.
    Exact: an e4m3 value times a power of two is representable in fp32 and bf16.
    """
    xp = _xp(w_q)
    bo, bi = _block_pair(block)
    w_q = _as_e4m3(w_q)
    if w_q.ndim < 2:
        raise ValueError(f"{name}: FP8 weight must be at least 2-D [O, I], got shape {tuple(w_q.shape)}")
    o, i = w_q.shape[-2:]
    want = (*w_q.shape[:-2], -(-o // bo), -(-i // bi))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"{name}: FP8 scale shape {tuple(w_scale.shape)} does not match weight {tuple(w_q.shape)} "
                         f"with {bo}x{bi} blocks (expected {want})")
    s = e8m0_to_f32(w_scale)
    s = xp.repeat(xp.repeat(s, bo, axis=-2)[..., :o, :], bi, axis=-1)[..., :i]
    return (w_q.astype(np.float32) * s).astype(dtype)


def dequant_fp4(w_packed, w_scale, block: int = 32, dtype=F32, name: str = "weight"):
    """Packed e2m1 [..., O, I/2] (low nibble = element 2k) + E8M0 bytes [..., O, I/block] -> dtype [..., O, I].
    Also MXFP4 (GPT-OSS): blocks [..., G, 16] reshaped to [..., G*16] with scales [..., G]."""
    xp = _xp(w_packed)
    b = _as_u8(w_packed)
    if b.ndim < 2:
        raise ValueError(f"{name}: packed FP4 weight must be at least 2-D [O, I/2], got shape {tuple(b.shape)}")
    *lead, o, half = b.shape
    if (2 * half) % block or tuple(w_scale.shape) != (*lead, o, 2 * half // block):
        raise ValueError(f"{name}: FP4 scale shape {tuple(w_scale.shape)} does not match packed weight "
                         f"{tuple(b.shape)} (expected {(*lead, o, 2 * half // block)}: one scale per {block} values)")
    codes = xp.stack([b & 0x0F, b >> 4], axis=-1).reshape(*lead, o, 2 * half)
    s = xp.repeat(e8m0_to_f32(w_scale), block, axis=-1)
    return (xp.asarray(FP4_TABLE)[codes] * s).astype(dtype)


def dequant(w: dict, dtype, name: str = "weight"):
    """A weight kept quantized in the params -> dtype [..., out, in]: {"fp8": e4m3 bytes [.., O, I], "scale": E8M0
    block grid} (the square block read off the grid) or {"fp4": packed e2m1 [.., O, I/2], "scale": E8M0 [.., O, I/32]}."""
    if "fp4" in w:
        return dequant_fp4(w["fp4"], w["scale"], 32, dtype, name)
    o, i = w["fp8"].shape[-2:]
    block = next((b for b in (32, 128, 64, 16) if tuple(w["scale"].shape[-2:]) == (-(-o // b), -(-i // b))), None)
    if block is None:
        raise ValueError(f"{name}: scale grid {tuple(w['scale'].shape)} does not tile a weight of shape "
                         f"{tuple(w['fp8'].shape)} in square blocks")
    return dequant_fp8(w["fp8"], w["scale"], block, dtype, name)


def linear(x, w, act_block: int | None = None):
    """x @ w for w [in, out], or for a weight kept quantized ({"fp8"|"fp4", "scale"}, [out, in]) expanded here.

    act_block: the reference's FP8 linear — activations QDQ'd per block (UE8M0) first, then fp32 math over the
    dequantised weight, result in x's dtype. Otherwise the product runs in x's dtype.
    """
    if act_block:
        x = act_quant_fp8(x, act_block)
        xw = x.astype(F32)
        wt = dequant(w, F32) if isinstance(w, dict) else w.astype(F32)
    else:
        xw = x
        wt = dequant(w, x.dtype) if isinstance(w, dict) else w.astype(x.dtype)
    out = jnp.einsum("...i,oi->...o" if isinstance(w, dict) else "...i,io->...o", xw, wt)
    return out.astype(x.dtype)
