"""Next-token selection from logits: greedy, or temperature with top-k / top-p / min-p filters."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp

NEG = -jnp.inf


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        _check("temperature", self.temperature, lambda v: 0 <= v < math.inf, "a finite number >= 0")
        if self.top_k is not None and not (is_int(self.top_k) and self.top_k >= 1):
            raise ValueError(f"top_k must be an int >= 1, got {self.top_k!r}")
        if self.top_p is not None:
            _check("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        if self.min_p is not None:
            _check("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_int(x) -> bool:
    """Python/numpy integers and 0-d integer arrays; not bools or floats (int() would silently truncate those)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, numbers.Integral) or (getattr(x, "ndim", None) == 0 and jnp.issubdtype(x.dtype, jnp.integer))


def _check(name: str, value, ok, want: str) -> None:
    # NaN fails every comparison in `ok`, so it is refused here rather than sampling token 0 forever
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not ok(value):
        raise ValueError(f"{name} must be {want}, got {value!r}")


def filter_logits(logits, s: Sampling):
    """Mask (to -inf) every token the filters exclude; logits [B, V] float32, already temperature-scaled."""
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, NEG, logits)
    if s.min_p is not None:
        probs = jax.nn.softmax(logits, axis=-1)
        logits = jnp.where(probs < s.min_p * probs.max(-1, keepdims=True), NEG, logits)
    if s.top_p is not None and s.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        drop_sorted = cum - jax.nn.softmax(sorted_logits, axis=-1) >= s.top_p  # mass before this token
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, NEG, logits)
    return logits


def scale(logits, temperature):
    """logits [B, V] / temperature (a scalar or [B, 1]) in float32 without overflow: each row is shifted so
    that its largest logit is 0 first (a temperature of 1e-40 would otherwise make them inf, and the softmax
    NaN), and the temperature is kept within [1e-30, 1e30] (1e300 would become inf in float32, 1e-38 is
    subnormal, flushed to 0 on CPU/GPU; either way -inf or 0 logits would turn NaN)."""
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    if isinstance(temperature, numbers.Real):  # clipped before float32 sees it (1e300 would warn as it overflows)
        temperature = min(max(float(temperature), 1e-30), 1e30)
    t = jnp.clip(jnp.asarray(temperature, jnp.float32), 1e-30, 1e30)  # reciprocals stay normal (no FTZ)
    return (x - jnp.where(jnp.isfinite(top), top, 0.0)) / t


def sample(logits, key, s: Sampling):
    """logits [B, V] -> token ids [B] int32."""
    if s.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = filter_logits(scale(logits, s.temperature), s)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
