"""Checkpoint import: HF safetensors / PyTorch directories and GGUF files -> the jaxmodels format."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from converters.hf import import_params
from converters.quant import MXFP4Reader
from converters.safetensors_io import CheckpointError, SafetensorsReader, TorchReader
from jaxmodels import families
from jaxmodels.config import ModelConfig
from jaxmodels.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["convert", "read_source", "CheckpointError"]


def read_source(src: str | Path, dtype: str = "float32", progress: bool = True
                ) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Import a checkpoint into memory: (config, numpy params, tokenizer or None)."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    if src.is_file() and src.suffix == ".gguf":
        from converters.gguf_io import GGUFReader

        reader = GGUFReader(src)
        cfg = families.config_from_hf(reader.hf_config)
        fam = families.get(reader.hf_config["model_type"])
        params = import_params(reader, cfg, families.name_map(fam, cfg), dtype, progress, skip=fam.skip)
        return cfg, params, reader.tokenizer()
    root = src if src.is_dir() else src.parent
    if not (root / "config.json").exists():
        raise CheckpointError(f"{root}: no config.json (expected an HF model directory or a .gguf file)")
    hf = json.loads((root / "config.json").read_text())
    cfg = families.config_from_hf(hf)
    has_st = any(root.glob("*.safetensors")) or (root / "model.safetensors.index.json").exists()
    reader = MXFP4Reader(SafetensorsReader(root) if has_st else TorchReader(src))
    fam = families.get(families.model_type(hf))
    params = import_params(reader, cfg, families.name_map(fam, cfg), dtype, progress, skip=fam.skip)
    return cfg, params, Tokenizer.from_dir(root)


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool = True) -> Path:
    """Convert a checkpoint into `dst` (orbax params + config + tokenizer). Returns `dst`.

    Nothing is left at `dst` if anything fails.
    """
    from converters import orbax_io

    cfg, params, tok = read_source(src, dtype, progress)
    out = orbax_io.save(dst, cfg, params, tok, overwrite=overwrite)
    log.info("converted %s -> %s", src, out)
    return out
