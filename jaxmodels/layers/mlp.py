"""Gated MLPs: down(act(gate x) * up x) and GPT-OSS's clamped SwiGLU."""
import jax
import jax.numpy as jnp

from jaxmodels.config import MLPSpec


def _dot(x, w):
    return jnp.einsum("...d,df->...f", x, w)


def activate(spec: MLPSpec, g, u):
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


def gated(spec: MLPSpec, p, x):
    g, u = _dot(x, p["w_gate"]), _dot(x, p["w_up"])
    if spec.bias:
        g, u = g + p["b_gate"], u + p["b_up"]
    y = _dot(activate(spec, g, u), p["w_down"])
    return y + p["b_down"] if spec.bias else y
