"""Checkpoint import: HF safetensors / PyTorch directories and GGUF files -> the jaxmodels format; export back to
Hugging Face (converters/hf_export.py)."""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from converters.hf import PREFIXES, Leaves, assemble, import_sharded, normalize, stream
from converters.quant import MXFP4Reader
from converters.safetensors_io import INDEX, CheckpointError, SafetensorsReader, TorchReader
from jaxmodels import checkpoint, families, files
from jaxmodels.checkpoint import FORMAT_VERSION
from jaxmodels.config import ModelConfig
from jaxmodels.tokenizer import Tokenizer

log = logging.getLogger(__name__)

RECYCLE = 512 << 20  # bytes of free tensor buffers kept for reuse during a conversion or import (see BufferPool)

__all__ = ["convert", "export", "read_source", "read_source_sharded", "open_source", "CheckpointError"]


def open_source(src: str | Path):
    """(config, reader, family, tokenizer or None) of a checkpoint; reads no tensor data."""
    src = files.locate(src)
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
    cfg, fam = families.config_from_hf(hf), families.get(families.model_type(hf))
    if fam.untie and cfg.tie_embeddings and "lm_head.weight" in {normalize(k, fam.renames or PREFIXES)
                                                                 for k in reader.keys()}:
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    return cfg, reader, fam, tok


def _plan_kw(fam) -> dict:
    return {"derived": fam.derived} | ({} if fam.renames is None else {"renames": fam.renames})


def source_items(cfg, reader, fam, tok, dtype: str = "float32", keep_quantized: bool = False,
                 skip_mtp: bool = False):
    """items(done, bar, into) -> the converted placements of an opened source as `hf.stream` items, leaving out
    the keys in `done` (into: see `hf.stream`). keep_quantized, skip_mtp: see `read_source`."""
    if keep_quantized and not fam.quantized:
        if not (isinstance(reader, MXFP4Reader) and reader.pairs):
            raise ValueError("keep_quantized applies to DeepSeek V4's FP8/FP4 and GPT-OSS's MXFP4 checkpoints; this "
                             f"{cfg.family} checkpoint holds no quantized tensors")
        reader = reader.kept()
    if not fam.quantized:
        return lambda done=frozenset(), bar=None, into=None: stream(reader, cfg, families.name_map(fam, cfg), dtype,
                                                                    fam.skip, done=done, bar=bar, into=into,
                                                                    **_plan_kw(fam))
    from converters import deepseek

    return lambda done=frozenset(), bar=None, into=None: deepseek.items(reader, cfg, tok, dtype, keep_quantized,
                                                                        skip_mtp, done, bar, into)


class ByteBar(tqdm):
    """Progress in bytes of the source read: done / total and the average rate in GB/s, on stderr, e.g.
    `convert:  45%|████▌     | 603MB/1.34GB [00:02<00:03, 0.26 GB/s]`. `total` grows as the readers plan their
    tensors (hf.stream adds each source's bytes before reading them)."""

    def __init__(self, desc: str, progress: bool | None, leave: bool):
        super().__init__(desc=desc, total=0, unit="B", unit_scale=True, unit_divisor=1000, leave=leave,
                         file=sys.stderr, disable=not shown(progress),
                         bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, "
                                    "{gbps} GB/s]")

    @property
    def format_dict(self):
        d = super().format_dict
        seconds = d.get("elapsed") or 0
        return {**d, "gbps": f"{d['n'] / seconds / 1e9:.3g}" if seconds > 0 and d["n"] else "?"}


def shown(progress: bool | None) -> bool:
    """Whether a progress bar is drawn: True / False as asked; None (the default) on a terminal (stderr a TTY) or in
    a notebook (tqdm.auto draws a widget there), never into a pipe or a log file."""
    if progress is not None:
        return bool(progress)
    from tqdm import autonotebook

    return autonotebook.tqdm.__module__ == "tqdm.notebook" or bool(getattr(sys.stderr, "isatty", lambda: False)())


def _bar(progress: bool | None, desc: str, leave: bool) -> ByteBar:
    return ByteBar(desc, progress, leave)


def read_source(src: str | Path, dtype: str = "float32", progress: bool | None = None, keep_quantized: bool = False,
                skip_mtp: bool = False) -> tuple[ModelConfig, dict, Tokenizer | None]:
    """Import a checkpoint into host memory: (config, numpy params, tokenizer or None), reading one tensor at a
    time: host memory peaks at the params plus about two tensors.

    keep_quantized keeps DeepSeek V4's FP8/FP4 weights and GPT-OSS's MXFP4 experts quantized in the params (decoded
    inside the matmul kernels on the GPU, expanded before the matmul elsewhere). DeepSeek V4:
    the MTP / DSpark weights (`mtp.*`) are loaded under params["mtp"] when the checkpoint has them, unless
    skip_mtp.
    """
    cfg, reader, fam, tok = open_source(src)
    items = source_items(cfg, reader, fam, tok, dtype, keep_quantized, skip_mtp)
    leaves = Leaves()
    with _bar(progress, "import", leave=False) as bar, checkpoint.recycling(RECYCLE):
        return cfg, assemble(items(bar=bar, into=leaves), leaves), tok


def read_source_sharded(src: str | Path, mesh, rules="tp", dtype: str = "float32"):
    """Import a checkpoint straight onto a mesh; each device reads only its slices where possible."""
    from jaxmodels import sharding

    cfg, reader, fam, tok = open_source(src)
    if fam.quantized:  # DeepSeek's FP8/FP4 layout: each device reads and dequantises only its blocks
        from converters import deepseek

        src = files.locate(src)
        return cfg, deepseek.import_sharded(src if src.is_dir() else src.parent, reader, cfg, tok, mesh, rules,
                                            dtype), tok
    params = import_sharded(reader, cfg, families.name_map(fam, cfg), sharding.shardings(cfg, mesh, rules), dtype,
                            fam.skip, **_plan_kw(fam))
    return cfg, params, tok


def convert(src: str | Path, dst: str | Path, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool | None = None, keep_quantized: bool = False, skip_mtp: bool = False) -> Path:
    """Convert a checkpoint into `dst` (params, config, tokenizer). Returns `dst`.

    Streaming: each tensor is read, converted and written into its place in the output before the next is read,
    so host memory stays at about two tensors whatever the model's size. Nothing is left at `dst` if anything
    fails. An interrupted conversion (Ctrl-C, a kill) resumes when run again with the same source, dst and
    options: the slices it had written are verified by their CRC32 and kept. overwrite replaces an earlier
    converted model (or an empty directory), nothing else; the destination is checked before any import work.
    keep_quantized, skip_mtp: see `read_source`. progress: a bar of the bytes read and GB/s on stderr (None: only
    when stderr is a terminal, or in a notebook; True / False: always / never).
    """
    from converters import orbax_io

    src = files.locate(src)
    orbax_io.check_destination(dst, src, overwrite)
    cfg, reader, fam, tok = open_source(src)
    items = source_items(cfg, reader, fam, tok, dtype, keep_quantized, skip_mtp)
    job = {"format_version": FORMAT_VERSION, "src": str(Path(src).resolve()), "files": _fingerprint(Path(src)),
           "dtype": dtype, "keep_quantized": keep_quantized, "skip_mtp": skip_mtp}
    with _bar(progress, "convert", leave=True) as bar, checkpoint.recycling(RECYCLE):
        out = orbax_io.write(dst, cfg, lambda done: items(done, bar), tok, overwrite=overwrite, src=src, job=job)
    log.info("converted %s -> %s", src, out)
    return out


def _fingerprint(src: Path) -> dict[str, list[int]]:
    """{file: [size, mtime_ns]} of the source's files: a resumed conversion must read the same checkpoint."""
    paths = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    return {p.name: [(st := p.stat()).st_size, st.st_mtime_ns] for p in paths}


def export(src, hf_dir: str | Path, dtype: str | None = None, overwrite: bool = False,
           max_shard_size: int | str = "5GB", progress: bool | None = None) -> Path:
    """Write a model back to a Hugging Face directory that `transformers.AutoModelForCausalLM.from_pretrained` loads:
    `model.safetensors` (above max_shard_size: shards + `model.safetensors.index.json`; bytes or "5GB"-style),
    config.json, generation_config.json and the tokenizer files. Returns `hf_dir`.

    src: a `jm.Model`, a converted directory, or a source checkpoint (anything `jm.load` reads; read in float32
    unless dtype). dtype: cast the floating parameters (those the plan keeps fp32 stay); None keeps the model's.
    The tensors are the exact inverse of the import (a lossless import exports its source bit for bit); GPT-OSS
    experts imported from MXFP4 are written dequantized, in HF's unquantized layout. As convert: everything is
    checked before any work, nothing is left at hf_dir if anything fails, and overwrite replaces only an earlier
    export (or an empty directory). DeepSeek V4 is written as HF's `DeepseekV4ForCausalLM` (its MTP blocks left out:
    the HF class has none; weights kept quantized are refused); V4.1, which transformers lacks, is refused.
    """
    from converters import hf_export
    from converters.hf import np_dtype
    from jaxmodels import checkpoint

    path = None if hasattr(src, "config") and hasattr(src, "params") else files.locate(src)
    if dtype is not None:
        np_dtype(dtype)
    hf_export.shard_bytes(max_shard_size)
    hf_export.check_destination(hf_dir, path, overwrite)
    generation = None
    if path is None:
        cfg, params, tok = src.config, src.params, src.tokenizer
    elif checkpoint.is_converted(path):
        cfg = checkpoint.load_config(path)
        hf_export.plan_export(cfg)  # an unsupported family fails before the restore
        params, tok = checkpoint.load_params(path, cfg), Tokenizer.from_dir(path)
    else:
        hf_export.plan_export(open_source(path)[0])
        cfg, params, tok = read_source(path, dtype or "float32", shown(progress))
        if path.is_dir() and (gen := files.find(path, "generation_config.json")) is not None:
            generation = files.read_json(gen, files.MAX_METADATA_BYTES)  # the source's sampling defaults
    out = hf_export.write(hf_dir, cfg, params, tok, dtype, overwrite, path, max_shard_size, generation,
                          shown(progress))
    log.info("exported %s -> %s", "the model" if path is None else src, out)
    return out
