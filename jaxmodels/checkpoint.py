"""The converted-model directory, read side: `jaxmodels.json` (format version, dtype, config), `params/`
(orbax), tokenizer files. `converters` writes it (converters/orbax_io.py)."""
from __future__ import annotations

import json
from pathlib import Path

from jaxmodels.config import ModelConfig

CONFIG_FILE = "jaxmodels.json"
FORMAT_VERSION = 2  # 2: every family on the one layer plan (DeepSeek's params stacked per kind)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def load_meta(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {CONFIG_FILE} is not valid JSON ({e})") from None


def load_config(path: str | Path) -> ModelConfig:
    meta = load_meta(path)
    version, cfg = meta.get("format_version"), meta.get("config") or {}
    # version 1 wrote the dense families exactly as today; DeepSeek had a config and layout of its own
    if version == 1 and cfg.get("family", "").startswith("deepseek"):
        raise ValueError(f"{path}: converted by an older jaxmodels (format 1, DeepSeek's own layout); "
                         f"convert the checkpoint again")
    if version not in (1, FORMAT_VERSION):
        raise ValueError(f"{path}: unsupported jaxmodels format version {version}")
    return ModelConfig.from_dict(cfg)


def load_params(path: str | Path, sharding_of=None) -> dict:
    """Restore params. sharding_of(param path) -> jax.sharding.Sharding: restore each leaf straight into it (each
    device reads only its shards); the stored shapes and dtypes come from the checkpoint's own metadata."""
    import jax
    import orbax.checkpoint as ocp

    ckpt, where = ocp.StandardCheckpointer(), Path(path).absolute() / "params"
    if sharding_of is None:
        return ckpt.restore(where)
    meta = ckpt.metadata(where)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)  # orbax >= 0.12.8 wraps the tree
    target = jax.tree_util.tree_map_with_path(
        lambda p, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of("/".join(str(k.key) for k in p))),
        meta, is_leaf=lambda m: hasattr(m, "shape"))
    return ckpt.restore(where, target)
