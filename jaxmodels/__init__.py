"""jaxmodels: open LLM families as pure JAX functions over parameter pytrees.

    import jaxmodels as jm, converters
    model = jm.load(converters.convert(src, dst))
    logits = jm.forward(model, tokens)
    out = jm.generate(model, ["Hello"], max_new_tokens=32)
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxmodels import model as _model, sharding
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig, RopeSpec
from jaxmodels.generate import GenerateOutput, generate
from jaxmodels.tokenizer import Tokenizer

__all__ = ["Model", "load", "forward", "generate", "GenerateOutput", "ModelConfig", "LayerSpec", "AttentionSpec",
           "MLPSpec", "RopeSpec", "Tokenizer"]


@dataclass
class Model:
    config: ModelConfig
    params: dict
    tokenizer: Tokenizer | None = None
    mesh: jax.sharding.Mesh | None = None  # params are placed on it by `rules` when set
    rules: str | dict = "tp"

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def sharding(self) -> tuple | None:
        """Hashable (mesh, rules) for jitted code, or None when unsharded."""
        if self.mesh is None:
            return None
        rules = sharding.RULES[self.rules] if isinstance(self.rules, str) else self.rules
        return self.mesh, tuple(sorted((k, v if isinstance(v, str) else tuple(v)) for k, v in rules.items()))


def load(path: str | Path, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
         rules: str | dict = "tp") -> Model:
    """Load a converted directory, or import a source checkpoint (HF dir, .gguf) directly into memory.

    mesh: place the parameters on this mesh (axes among data, fsdp, tensor, expert) by `rules` (a preset
    name of `jaxmodels.sharding.RULES` or a dict); a converted directory is restored straight into
    that sharding, each device reading only its shards.
    """
    from converters import orbax_io, read_source, read_source_sharded

    path = Path(path)
    if orbax_io.is_converted(path):
        cfg = orbax_io.load_config(path)
        target = None
        if mesh is not None:
            meta = orbax_io.load_meta(path)
            target = jax.tree.map(lambda shape, s: jax.ShapeDtypeStruct(shape, meta["dtype"], sharding=s),
                                  _model.param_shapes(cfg), sharding.shardings(cfg, mesh, rules),
                                  is_leaf=lambda x: isinstance(x, tuple))
        params = orbax_io.load_params(path, target)
        params = jax.tree.map(jnp.asarray, params) if mesh is None else params
        tok = Tokenizer.from_dir(path)
    else:
        if mesh is None:
            cfg, params, tok = read_source(path, dtype or "float32")
            params = jax.tree.map(jnp.asarray, params)
        else:
            cfg, params, tok = read_source_sharded(path, mesh, rules, dtype or "float32")
    if dtype is not None:  # floating leaves only: routing and token tables stay integer
        params = jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
    return Model(cfg, params, tok, mesh, rules)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _forward(params, cfg, tokens, shard):
    with sharding.use(*shard) if shard else contextlib.nullcontext():
        return _model.forward(params, cfg, tokens)


def forward(model: Model, tokens) -> jax.Array:
    """tokens int32 [B, T] -> float32 logits [B, T, vocab] (no cache)."""
    return _forward(model.params, model.config, jnp.asarray(tokens, jnp.int32), model.sharding)
