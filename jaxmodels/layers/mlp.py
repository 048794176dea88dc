"""Gated MLPs: down(act(gate x) * up x), with GPT-OSS's clamped SwiGLU and DeepSeek's clamped SiLU."""
import jax
import jax.numpy as jnp

from jaxmodels.config import MLPSpec
from jaxmodels.layers.qdq import linear

F32 = jnp.float32


def _act(spec: MLPSpec, g, u):
    if spec.activation == "silu":
        return jax.nn.silu(g) * u
    if spec.activation == "gelu_tanh":
        return jax.nn.gelu(g, approximate=True) * u
    if spec.activation == "gelu":
        return jax.nn.gelu(g, approximate=False) * u
    if spec.activation == "silu_limit":  # DeepSeek V4: gate clamped from above, up on both sides
        return jax.nn.silu(jnp.minimum(g, spec.clamp_limit)) * jnp.clip(u, -spec.clamp_limit, spec.clamp_limit)
    if spec.activation == "swiglu_clamp":  # gate clamped from above, up on both sides, (up + 1)
        g = jnp.minimum(g, spec.clamp_limit)
        u = jnp.clip(u, -spec.clamp_limit, spec.clamp_limit)
        return (u + 1) * (g * jax.nn.sigmoid(spec.clamp_alpha * g))
    raise ValueError(f"unknown activation {spec.activation!r}")


def activate(spec: MLPSpec, g, u, weight=None):
    """act(g) * u in g's dtype. With spec.activation_fp32 computed in fp32 (DeepSeek's experts); a routing
    `weight` then multiplies before the cast back, as the reference applies it before w2."""
    dt = g.dtype
    if spec.activation_fp32:
        g, u = g.astype(F32), u.astype(F32)
    h = _act(spec, g, u)
    if weight is not None:
        h = h * weight
    return h.astype(dt)


def gated(spec: MLPSpec, p, x, act_block: int | None = None, weight=None):
    """One gated MLP (or expert). act_block: reference numerics' FP8 linears (activation QDQ per block)."""
    g, u = linear(x, p["w_gate"], act_block), linear(x, p["w_up"], act_block)
    if spec.bias:
        g, u = g + p["b_gate"], u + p["b_up"]
    y = linear(activate(spec, g, u, weight), p["w_down"], act_block)
    return y + p["b_down"] if spec.bias else y
