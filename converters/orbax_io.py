"""The converted-model directory: `jaxmodels.json` (config), `params/` (orbax), tokenizer files.

Written into a temporary sibling directory and renamed at the end, so a failed conversion leaves
nothing behind at the destination.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxmodels.config import ModelConfig

CONFIG_FILE = "jaxmodels.json"
FORMAT_VERSION = 1


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def save(dst: str | Path, cfg: ModelConfig, params: dict, tokenizer=None, overwrite: bool = False) -> Path:
    dst = Path(dst).absolute()
    if dst.exists() and not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --force to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp / "params", params)
        ckpt.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save(tmp)
        dtypes = sorted({str(a.dtype) for a in jax.tree.leaves(params)})
        meta = {"format_version": FORMAT_VERSION, "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
                "config": cfg.to_dict()}
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def load_config(path: str | Path) -> ModelConfig:
    meta = json.loads((Path(path) / CONFIG_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported jaxmodels format version {meta.get('format_version')}")
    return config_from_dict(meta["config"])


def config_from_dict(d: dict):
    """ModelConfig, or DeepseekConfig for the DeepSeek V4 families (their own config class)."""
    from jaxmodels.families.deepseek_v4 import V4, V41, DeepseekConfig

    return DeepseekConfig.from_dict(d) if d.get("family") in (V4, V41) else ModelConfig.from_dict(d)


def load_meta(path: str | Path) -> dict:
    return json.loads((Path(path) / CONFIG_FILE).read_text())


def load_params(path: str | Path, target=None) -> dict:
    """Restore params; `target` (a tree of jax.ShapeDtypeStruct, possibly sharded) places them directly."""
    ckpt = ocp.StandardCheckpointer()
    return ckpt.restore(Path(path).absolute() / "params", target)
