"""Rotary position embeddings: frequency tables (host, fp32 like HF) and their application."""
import math

import jax.numpy as jnp
import numpy as np

from jaxmodels.config import RopeSpec

F32 = np.float32


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    # The same fp32 op sequence as HF: base ** (arange(0, dim, 2) / dim), then 1 / that.
    return (F32(1.0) / (F32(theta) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim)))).astype(F32)


def inv_freq(spec: RopeSpec, dim: int) -> tuple[np.ndarray, float]:
    """Returns (inv_freq [dim/2] float32, attention_factor) for a static RoPE spec."""
    base = _default_inv_freq(spec.theta, dim)
    if spec.kind in ("default", "dynamic"):  # dynamic is rescaled at run time (see cos_sin)
        return base, 1.0
    if spec.kind == "linear":
        return (base / F32(spec.factor)).astype(F32), 1.0
    if spec.kind == "llama3":
        f, lf, hf = F32(spec.factor), F32(spec.low_freq_factor), F32(spec.high_freq_factor)
        old = F32(spec.original_max_position)
        low_wavelen, high_wavelen = old / lf, old / hf
        wavelen = F32(2 * math.pi) / base
        scaled = np.where(wavelen > low_wavelen, base / f, base).astype(F32)
        smooth = ((old / wavelen - lf) / (hf - lf)).astype(F32)
        smoothed = ((F32(1) - smooth) * scaled / f + smooth * scaled).astype(F32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(F32), 1.0
    if spec.kind == "yarn":
        return _yarn(spec, dim)
    raise ValueError(f"unsupported rope kind {spec.kind!r}")


def _yarn(spec: RopeSpec, dim: int) -> tuple[np.ndarray, float]:
    f, theta = spec.factor, spec.theta

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    af = spec.attention_factor
    if af is None:
        af = mscale(f, spec.mscale) / mscale(f, spec.mscale_all_dim) if spec.mscale and spec.mscale_all_dim else mscale(f)

    def corr(rot):  # python float64, as HF
        return dim * math.log(spec.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr(spec.beta_fast), corr(spec.beta_slow)
    if spec.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(lo)) / F32(hi - lo), 0, 1).astype(F32)
    extrap = (F32(1) - ramp).astype(F32)
    pos_freqs = F32(theta) ** (np.arange(0, dim, 2, dtype=F32) / F32(dim))
    inv_extrap = F32(1) / pos_freqs
    inv_interp = F32(1) / (F32(f) * pos_freqs)
    return (inv_interp * (F32(1) - extrap) + inv_extrap * extrap).astype(F32), float(af)


def cos_sin(spec: RopeSpec, dim: int, positions, dtype, max_position: int | None = None, valid=None):
    """cos, sin of shape positions.shape + (dim/2,), scaled by the attention factor, cast to `dtype`.
    valid (bool, positions' shape): the real tokens, whose last position sets dynamic NTK's base (padding's
    positions must not stretch it, as HF's unpadded run would not)."""
    inv, af = inv_freq(spec, dim)
    inv = jnp.asarray(inv)
    if spec.kind == "dynamic":  # NTK: stretch the base once the sequence outgrows the trained length
        old = spec.original_max_position or max_position
        last = jnp.max(positions if valid is None else jnp.where(valid, positions, 0))
        seq = jnp.maximum(last + 1, old).astype(jnp.float32)
        base = spec.theta * ((spec.factor * seq / old) - (spec.factor - 1)) ** (dim / (dim - 2))
        inv = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    ang = positions.astype(jnp.float32)[..., None] * inv
    return (jnp.cos(ang) * af).astype(dtype), (jnp.sin(ang) * af).astype(dtype)


def apply(x, cos, sin, interleaved: bool, inverse: bool = False):
    """Rotate x by tables that broadcast against x[..., :d/2] (e.g. [B, T, 1, d/2] for x [B, T, heads, d]);
    inverse rotates by -angle.

    Halves (rotate_half) of all d channels, in the activation dtype, as HF. Interleaved pairs (2j, 2j+1) of the
    last 2 * cos.shape[-1] channels (all of them, or DeepSeek's RoPE tail), in fp32 and cast back (HF Cohere
    upcasts q/k for this rotation; DeepSeek's reference rotates in fp32).
    """
    if not interleaved and 2 * cos.shape[-1] != x.shape[-1]:
        raise ValueError(f"rotate_half RoPE covers all {x.shape[-1]} channels, got tables for {2 * cos.shape[-1]}")
    if inverse:
        sin = -sin
    if not interleaved:
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    rd = 2 * cos.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    c, s = cos.astype(jnp.float32), sin.astype(jnp.float32)
    xe, xo = tail[..., 0::2], tail[..., 1::2]
    rot = jnp.stack([xe * c - xo * s, xo * c + xe * s], axis=-1).reshape(tail.shape).astype(x.dtype)
    return rot if rd == x.shape[-1] else jnp.concatenate([head, rot], axis=-1)
