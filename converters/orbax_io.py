"""The converted-model directory, write side (read side: jaxmodels/checkpoint.py): `jaxmodels.json` (config),
`params/` (orbax), tokenizer files.

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

from jaxmodels.checkpoint import CONFIG_FILE, FORMAT_VERSION
from jaxmodels.config import ModelConfig


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

