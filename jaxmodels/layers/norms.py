"""Normalisations, each in the exact cast order of its reference (specs/hf_families.md §2.2)."""
import jax.numpy as jnp

F32 = jnp.float32


def _rms(x32, eps):
    return x32 * jnp.reciprocal(jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


def norm(x, w, eps: float, kind: str):
    """Normalise over the last axis. `kind` names the reference variant:

    rms       HF RMS "A": statistics in fp32, cast back, then * w in the activation dtype (Llama, Qwen3).
    rms_fp32  HF RMS "B": fp32 statistics * fp32 weight, then cast (GPT-OSS).
    gemma     (1 + w) scaling in fp32, then cast (Gemma).
    layernorm mean/variance in fp32, * w, no bias, then cast (Cohere).
    """
    x32 = x.astype(F32)
    if kind == "rms":
        return w.astype(x.dtype) * _rms(x32, eps).astype(x.dtype)
    if kind == "rms_fp32":
        return (w.astype(F32) * _rms(x32, eps)).astype(x.dtype)
    if kind == "gemma":
        return (_rms(x32, eps) * (1.0 + w.astype(F32))).astype(x.dtype)
    if kind == "layernorm":
        c = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(c * c, axis=-1, keepdims=True)
        return (w.astype(F32) * (c * jnp.reciprocal(jnp.sqrt(var + eps)))).astype(x.dtype)
    raise ValueError(f"unknown norm kind {kind!r}")


def layer_norm(x, w, b, eps: float):
    """torch.nn.LayerNorm: statistics, scale and bias in fp32, then cast (the vision towers)."""
    x32 = x.astype(F32)
    c = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = c * jnp.reciprocal(jnp.sqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps))
    return (y * w.astype(F32) + b.astype(F32)).astype(x.dtype)
