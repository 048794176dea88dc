"""Checkpoint import: HF safetensors / PyTorch directories and GGUF files -> the jaxmodels format."""
from __future__ import annotations

import logging
from pathlib import Path

from converters.hf import import_params, import_sharded
from converters.quant import MXFP4Reader
from converters.safetensors_io import INDEX, CheckpointError, SafetensorsReader, TorchReader
from jaxmodels import families, files
from jaxmodels.config import ModelConfig
from jaxmodels.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["convert", "read_source", "read_source_sharded", "open_source", "CheckpointError"]


def open_source(src: str | Path):
    """(config, reader, family, tokenizer or None) of a checkpoint; reads no tensor data."""
    src = Path(src)
    if not src.exists():
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    if src.suffix == ".gguf" and not src.is_dir():  # a FIFO or device too: GGUFFile names it
        from converters.gguf_io import GGUFReader

        reader = GGUFReader(src)
        hf, tok = reader.hf_config, reader.tokenizer()
    else:
        root = src if src.is_dir() else src.parent
        if (config := files.find(root, "config.json")) is None:
            raise CheckpointError(f"{root}: no config.json (expected an HF model directory or a .gguf file)")
        hf = files.read_json(config, files.MAX_METADATA_BYTES)
        has_st = any(root.glob("*.safetensors")) or (root / INDEX).exists()
        reader, tok = MXFP4Reader(SafetensorsReader(root) if has_st else TorchReader(src)), Tokenizer.from_dir(root)
    return families.config_from_hf(hf), reader, families.get(families.model_type(hf)), tok


def _plan_kw(fam) -> dict:
    return {"derived": fam.derived} | ({} if fam.renames is None else {"renames": fam.renames})


def read_source(src: str | Path, dtype: str = "float32", progress: bool = True, keep_quantized: bool = False,
                skip_mtp: bool = False) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Import a checkpoint into host memory: (config, numpy params, tokenizer or None).

    DeepSeek V4: keep_quantized keeps FP8/FP4 weights quantized in the params (expanded inside the matmul);
    the MTP / DSpark weights (`mtp.*`) are loaded under params["mtp"] when the checkpoint has them, unless
    skip_mtp.
    """
    cfg, reader, fam, tok = open_source(src)
    if keep_quantized and not fam.quantized:
        raise ValueError(f"keep_quantized applies to DeepSeek V4's FP8/FP4 checkpoints, not to {cfg.family}")
    if not fam.quantized:
        return cfg, import_params(reader, cfg, families.name_map(fam, cfg), dtype, progress, fam.skip,
                                  **_plan_kw(fam)), tok
    from converters import deepseek

    token_map = deepseek.engram_map(tok, cfg) if cfg.engram is not None and tok is not None else None
    params = deepseek.import_backbone(reader, cfg, dtype, progress, token_map, keep_quantized)
    if deepseek.has_mtp_tensors(reader):
        if skip_mtp:
            log.info("left out the MTP / DSpark weights (skip_mtp)")
        else:
            params |= deepseek.import_mtp(reader, cfg, dtype, keep_quantized)
    return cfg, params, tok


def read_source_sharded(src: str | Path, mesh, rules="tp", dtype: str = "float32"):
    """Import a checkpoint straight onto a mesh; each device reads only its slices where possible."""
    from jaxmodels import sharding

    cfg, reader, fam, tok = open_source(src)
    if fam.quantized:
        raise NotImplementedError(f"{cfg.family}: importing onto a mesh is not supported yet; load it without "
                                  f"a mesh")
    params = import_sharded(reader, cfg, families.name_map(fam, cfg), sharding.shardings(cfg, mesh, rules), dtype,
                            fam.skip, **_plan_kw(fam))
    return cfg, params, tok


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool = True, keep_quantized: bool = False, skip_mtp: bool = False) -> Path:
    """Convert a checkpoint into `dst` (orbax params + config + tokenizer). Returns `dst`.

    Nothing is left at `dst` if anything fails. overwrite replaces an earlier converted model (or an empty
    directory), nothing else; the destination is checked before any import work. keep_quantized, skip_mtp: see
    `read_source`.
    """
    from converters import orbax_io

    orbax_io.check_destination(dst, src, overwrite)
    cfg, params, tok = read_source(src, dtype, progress, keep_quantized, skip_mtp)
    out = orbax_io.save(dst, cfg, params, tok, overwrite=overwrite, src=src)
    log.info("converted %s -> %s", src, out)
    return out
