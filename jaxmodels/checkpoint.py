"""The converted-model directory, read side: `jaxmodels.json` (format version, dtype, config), `params/`
(orbax), tokenizer files. `converters` writes it (converters/orbax_io.py)."""
from __future__ import annotations

import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from jaxmodels import files, plan
from jaxmodels.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "jaxmodels.json"
FORMAT_VERSION = 2  # 2: every family on the one layer plan (DeepSeek's params stacked per kind)


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def load_meta(path: str | Path) -> dict:
    where = files.find(path, CONFIG_FILE)
    if where is None:
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a converted model)")
    return files.read_json(where, files.MAX_METADATA_BYTES)


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


def checksums(params_dir: str | Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file under `params_dir`, hashed in threads (zlib releases the
    GIL): 0.4-0.7 s beside a 4-4.5 s restore of SmolLM2-135M fp32 (333 MB) on 2 CPU cores."""
    root = Path(params_dir)
    files = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        return dict(zip(files, ex.map(lambda f: _crc(root / f), files)))


def _crc(path: Path) -> list[int]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return [size, crc]


def verify_files(path: str | Path) -> None:
    """The params files are those written at conversion, byte for byte (sizes and CRC32s in jaxmodels.json)."""
    recorded = load_meta(path).get("files")
    if recorded is None:
        log.warning("%s: no checksums recorded (converted by an older jaxmodels); its files are not verified", path)
        return
    where = Path(path) / "params"
    if not isinstance(recorded, dict) or not all(
            isinstance(n, str) and ".." not in Path(n).parts and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, int) for x in v) for n, v in recorded.items()):
        raise ValueError(f"{path}: the checksums in {CONFIG_FILE} are malformed (convert the model again)")
    for name in recorded:
        if not (where / name).is_file():
            raise ValueError(f"{where / name}: missing (the converted model is incomplete; convert it again)")
    got = checksums(where)
    for name, (size, crc) in recorded.items():
        if got[name][0] != size:
            raise ValueError(f"{where / name}: {got[name][0]} bytes, {size} written at conversion (truncated or "
                             f"modified; convert it again)")
        if got[name][1] != crc:
            raise ValueError(f"{where / name}: checksum differs from the one written at conversion (the file is "
                             f"corrupted or was modified; convert it again)")


def _verify_once(path: str | Path) -> None:
    """`verify_files` on process 0 only (every other process would read the whole model again); its verdict is
    shared, so every process fails alike."""
    import jax

    if jax.process_count() == 1:
        return verify_files(path)
    import numpy as np
    from jax.experimental import multihost_utils

    error = None
    if jax.process_index() == 0:
        try:
            verify_files(path)
        except ValueError as e:
            error = e
    if multihost_utils.broadcast_one_to_all(np.int32(error is not None)):
        raise error or ValueError(f"{path}: process 0 found the params files corrupted (its log says which)")


QUANTIZED_PARTS = ("/fp8", "/fp4", "/scale", "_scale")  # kept-quantized DeepSeek weights (converters/deepseek.py)


def check_shapes(cfg: ModelConfig, stored: dict) -> None:
    """The stored leaves ({path: (shape, dtype)}) are the parameters the config's plan declares: none missing,
    none extra, each of its planned shape (a kept-quantized weight: its layer count). MTP weights are optional."""
    want = plan.flatten(plan.param_specs(cfg))
    if any(p.startswith("mtp/") for p in stored):
        want |= plan.flatten(plan.mtp_param_specs(cfg))
    base = {p: next((p[: -len(s)] for s in QUANTIZED_PARTS if p.endswith(s) and p[: -len(s)] in want), p)
            for p in stored}
    extra = sorted(p for p, b in base.items() if b not in want)
    missing = sorted(set(want) - set(base.values()))
    if extra or missing:
        raise ValueError(f"the stored parameters do not match the config in {CONFIG_FILE}: "
                         + "; ".join(x for x in (missing and f"missing {_few(missing)}", extra and f"not in the "
                                                 f"config {_few(extra)}") if x))
    for p, (shape, dtype) in stored.items():
        spec, shape = want[base[p]], tuple(shape)
        if p == base[p] and (dtype in FLOATS or dtype == spec.dtype):  # as planned: the whole shape
            ok = shape == spec.shape
        else:  # kept-quantized bytes or scales: a layout of their own, the same layer count
            ok = not p.startswith("layers/") or shape[:1] == spec.shape[:1]
        if not ok:
            raise ValueError(f"params/{p}: stored shape {shape}, the config in {CONFIG_FILE} gives {spec.shape}")


FLOATS = ("float32", "bfloat16", "float16")


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def load_params(path: str | Path, cfg: ModelConfig, sharding_of=None, verify: bool = True) -> dict:
    """Restore params, after checking the files against their checksums (`verify`) and the stored shapes against
    the config. sharding_of(param path) -> jax.sharding.Sharding: restore each leaf straight into it (each device
    reads only its shards); the stored shapes and dtypes come from the checkpoint's own metadata."""
    import jax
    import orbax.checkpoint as ocp

    if verify:
        _verify_once(path)
    ckpt, where = ocp.StandardCheckpointer(), Path(path).absolute() / "params"
    meta = ckpt.metadata(where)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)  # orbax >= 0.12.8 wraps the tree
    leaf = lambda m: hasattr(m, "shape")  # noqa: E731
    check_shapes(cfg, {p: (m.shape, str(m.dtype)) for p, m in plan.flatten(_plain(meta, leaf)).items()})
    if sharding_of is None:
        return ckpt.restore(where)
    target = jax.tree_util.tree_map_with_path(
        lambda p, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of("/".join(str(k.key) for k in p))),
        meta, is_leaf=leaf)
    return ckpt.restore(where, target)


def _plain(tree, leaf) -> dict:
    """orbax's metadata tree as nested plain dicts."""
    return {k: v if leaf(v) else _plain(v, leaf) for k, v in tree.items()}
