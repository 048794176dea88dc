"""jaxmodels: open LLM families as pure JAX functions over parameter pytrees.

    import jaxmodels as jm, converters
    model = jm.load(converters.convert(src, dst))
    logits = jm.forward(model, tokens)
    out = jm.generate(model, ["Hello"], max_new_tokens=32)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxmodels import model as _model
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

    @property
    def dtype(self):
        return self.params["embed"].dtype


def load(path: str | Path, dtype: str | None = None) -> Model:
    """Load a converted directory, or import a source checkpoint (HF dir, .gguf) directly into memory."""
    from converters import orbax_io, read_source

    path = Path(path)
    if orbax_io.is_converted(path):
        cfg = orbax_io.load_config(path)
        params = jax.tree.map(jnp.asarray, orbax_io.load_params(path))
        if dtype is not None:
            params = jax.tree.map(lambda a: a.astype(dtype), params)
        return Model(cfg, params, Tokenizer.from_dir(path))
    cfg, params, tok = read_source(path, dtype or "float32")
    return Model(cfg, jax.tree.map(jnp.asarray, params), tok)


@functools.partial(jax.jit, static_argnums=1)
def _forward(params, cfg, tokens):
    return _model.forward(params, cfg, tokens)


def forward(model: Model, tokens) -> jax.Array:
    """tokens int32 [B, T] -> float32 logits [B, T, vocab] (no cache)."""
    return _forward(model.params, model.config, jnp.asarray(tokens, jnp.int32))
