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
import numpy as np

from jaxmodels import checkpoint, files, model as _model, multimodal, sharding
from jaxmodels.layers import vision as _vision
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
    preprocessor: dict | None = None  # a vision model's image processor settings (preprocessor_config.json)

    @property
    def dtype(self):
        return self.params["embed"].dtype

    @property
    def sharding(self) -> sharding.Sharding | None:
        """Hashable mesh + rules for jitted code, or None when unsharded."""
        return sharding.Sharding.of(self.mesh, self.rules)


def load(path: str | Path, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
         rules: str | dict = "tp", verify: bool = True, keep_quantized: bool = False) -> Model:
    """Load a converted directory, or import a source checkpoint (HF dir, .gguf) directly into memory.

    mesh: place the parameters on this mesh (axes among data, fsdp, tensor, expert) by `rules` (a preset
    name of `jaxmodels.sharding.RULES` or a dict); a converted directory is restored straight into
    that sharding, each device reading only its shards. dtype: cast the floating parameters (those the plan
    keeps fp32, e.g. mHC mixes and sinks, stay fp32). verify: check a converted directory's files against the
    checksums written at conversion (one more read of the files, on process 0; a few % of the restore when the
    page cache holds them). path may also be a Hugging Face repo id in the local hub cache (`files.locate`).
    keep_quantized: a source checkpoint's DeepSeek FP8/FP4 weights or GPT-OSS MXFP4 experts stay quantized
    (`converters.read_source`; one mesh or none; a converted directory holds them as it was converted).
    """
    path = files.locate(path)
    if checkpoint.is_converted(path):
        cfg = checkpoint.load_config(path)
        # on a mesh, every leaf by the rules: MTP blocks and the parts of weights kept quantized too
        where = None if mesh is None else sharding.placement(cfg, mesh, rules)
        params = checkpoint.load_params(path, cfg, verify=verify, placement=where)
        params = jax.tree.map(jnp.asarray, params) if mesh is None else params
        tok = Tokenizer.from_dir(path)
    else:
        from converters import read_source, read_source_sharded

        if mesh is None:
            cfg, params, tok = read_source(path, dtype or "float32", keep_quantized=keep_quantized)
            params = jax.tree.map(lambda a: jax.device_put(a, may_alias=True), params)  # adopt the fresh buffers
        elif keep_quantized:
            raise ValueError("keep_quantized with a mesh: convert the checkpoint first (`jaxmodels convert "
                             "--keep-quantized`), then load the converted directory onto the mesh")
        else:
            cfg, params, tok = read_source_sharded(path, mesh, rules, dtype or "float32")
    if dtype is not None:
        params = _model.cast(cfg, params, dtype)
    settings = multimodal.read_settings(path if path.is_dir() else path.parent) if cfg.vision is not None else None
    return Model(cfg, params, tok, mesh, rules, settings)


@functools.partial(jax.jit, static_argnums=(1, 3, 5), compiler_options=_model.COMPILER_OPTIONS)
def _forward(params, cfg, tokens, shard, images, static_images):
    return _model.forward(params, cfg, tokens, shard=shard, images={**images, **dict(static_images)})


def forward(model: Model, tokens, **vision_inputs) -> jax.Array:
    """tokens int32 [B, T] -> float32 logits [B, T, vocab] (no cache).

    vision_inputs: a multimodal model's images as its HF processor returns them, by their HF names
    (`pixel_values`, `image_sizes`, `image_grid_thw`, `token_type_ids`; `jaxmodels.images` makes them), whose
    embeddings replace the prompt's image tokens."""
    tokens = jnp.asarray(tokens, jnp.int32)
    images, static = _vision.inputs(model.config, np.asarray(tokens), vision_inputs)
    with sharding.entered(model.sharding):
        return _forward(model.params, model.config, tokens, model.sharding, images, static)


def __getattr__(name):  # the research modules (flax / optax / orbax), loaded on first use: jm.nnx, jm.train, ...
    if name in ("nnx", "train", "lora", "interpret"):
        import importlib

        return importlib.import_module(f"jaxmodels.{name}")
    raise AttributeError(f"module 'jaxmodels' has no attribute {name!r}")
