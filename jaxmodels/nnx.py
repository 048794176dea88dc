"""A Flax NNX view of a model: the same parameter arrays as an `nnx.Module` tree, the same pure functions.

    module = jaxmodels.nnx.from_model(model)          # no copy: every nnx variable holds model.params' array
    logits = module(tokens)                           # jaxmodels.model.forward on the module's current values
    graphdef, state = nnx.split(module)               # state paths are the param paths: layers/0/attn/wq ...
    model = jaxmodels.nnx.to_model(nnx.merge(graphdef, state))

The tree mirrors the params dict path for path, so that `nnx.state(module)` flattens to the same
"layers/0/attn/wq" paths as `jaxmodels.plan.flatten(model.params)` (and LoRA patterns, sharding rules and
checkpoints read both alike): `embed` [V, D], `layers` (one `Block` per layer kind, its parameters stacked
[layers of that kind, ...]), `final_norm` [D], `lm_head` [D, V] when untied, and whatever else the family
has (DeepSeek's `hc_head`, `engram_map`). Floating leaves are `nnx.Param`; integer tables (expert ids,
Engram's map) and kept-quantized bytes are `Table`, so `nnx.state(module, nnx.Param)` is what training
differentiates. The math is not re-expressed here (DESIGN §1: one executor): `__call__`, `hidden` and
`head` call `jaxmodels.model` on the parameters the module holds.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

import jaxmodels
from jaxmodels import model as executor, plan as plan_lib, sharding
from jaxmodels.config import LayerSpec, ModelConfig


class Table(nnx.Variable):
    """A non-trainable array: integer tables (expert ids, Engram's map) and kept-quantized weight bytes."""


def _variable(a) -> nnx.Variable:
    return nnx.Param(a) if jnp.issubdtype(a.dtype, jnp.floating) else Table(a)


def _node(v):
    if isinstance(v, nnx.Module):
        return v
    return Tree(v) if isinstance(v, dict) else _variable(v)


class Tree(nnx.Module):
    """A nested dict of arrays as attributes (keys may be digits: layer kinds, MTP blocks)."""

    def __init__(self, tree: dict):
        self.names = tuple(tree)  # static: the keys in the params' order
        for k, v in tree.items():
            setattr(self, k, _node(v))

    def to_dict(self) -> dict:
        """The current values as the nested params dict (the arrays themselves, no copies)."""
        out = {}
        for k in self.names:
            v = getattr(self, k)
            out[k] = v.to_dict() if isinstance(v, Tree) else v.get_value()
        return out


class Block(Tree):
    """The stacked parameters of one layer kind: `spec` is its LayerSpec, `count` the layers of that kind
    (the leading axis of every leaf), e.g. attn/wq [count, D, heads, head_dim], mlp/w_up [count, D, mlp]."""

    def __init__(self, tree: dict, spec: LayerSpec, count: int):
        super().__init__(tree)
        self.spec, self.count = spec, count


class Model(Tree):
    """The NNX view of a `jaxmodels.Model` (build it with `from_model`)."""

    def __init__(self, config: ModelConfig, params: dict, shard: sharding.Sharding | None = None):
        pl = plan_lib.plan(config)
        layers = Tree({k: Block(v, pl.kinds[int(k)], pl.counts[int(k)]) for k, v in params["layers"].items()})
        super().__init__({**params, "layers": layers})
        self.config, self.shard = config, shard

    def __call__(self, tokens, positions=None) -> jax.Array:
        """tokens int32 [B, T] (positions [B, T], default 0..T-1) -> float32 logits [B, T, vocab]."""
        params = self.to_dict()
        with self._mesh(params, tokens):
            return executor.forward(params, self.config, tokens, positions, shard=self.shard)

    def hidden(self, tokens, positions=None) -> jax.Array:
        """tokens int32 [B, T] -> the last layer's output [B, T, D], before the final norm (model.hidden)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        params = self.to_dict()
        with self._mesh(params, tokens):
            return executor.hidden(params, self.config, tokens, positions, "full", shard=self.shard)[0]

    def head(self, x) -> jax.Array:
        """[B, T, D] -> final norm -> float32 logits [B, T, vocab] (model.head)."""
        params = self.to_dict()
        with self._mesh(params, x):
            return executor.head(params, self.config, x, self.shard)

    def _mesh(self, *inputs):
        """The model's mesh as JAX's context mesh when called eagerly, as jm.forward does; under a trace
        (jit, grad) the caller's context stands (JAX refuses set_mesh inside jit)."""
        if any(isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(inputs)):
            return contextlib.nullcontext()
        return sharding.entered(self.shard)


def from_model(model: jaxmodels.Model) -> Model:
    """The NNX view of `model`; its variables hold model.params' arrays (no copy, same placement)."""
    return Model(model.config, model.params, model.sharding)


def to_model(module: Model, tokenizer=None) -> jaxmodels.Model:
    """Back to a `jaxmodels.Model` holding the module's current arrays (on the module's mesh, if any)."""
    if not isinstance(module, Model):
        raise TypeError(f"to_model expects a jaxmodels.nnx.Model (from from_model), got {type(module).__name__}")
    shard = module.shard
    if shard is None:
        return jaxmodels.Model(module.config, module.to_dict(), tokenizer)
    return jaxmodels.Model(module.config, module.to_dict(), tokenizer, shard.mesh, dict(shard.rules))
