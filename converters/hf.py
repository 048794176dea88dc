"""Import a checkpoint into the parameter tree of a `ModelConfig`, driven by the family's name map."""
from __future__ import annotations

import logging
import re

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from converters.safetensors_io import CheckpointError
from converters.transforms import TRANSFORMS
from jaxmodels import model
from jaxmodels.config import ModelConfig
from jaxmodels.families import _common

log = logging.getLogger(__name__)

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def np_dtype(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def _compile(names: dict) -> list[tuple[re.Pattern, str, str, bool]]:
    out = []
    for pattern, (path, transform) in names.items():
        layered = "{i}" in pattern
        out.append((re.compile(pattern.replace("{i}", r"(\d+)") + r"\Z"), path, transform, layered))
    return out


def import_params(reader, cfg: ModelConfig, names: dict, dtype: str = "float32", progress: bool = True,
                  skip: tuple[str, ...] = ()) -> dict:
    """Read every tensor once (memory-mapped), transform it and place it into its stacked parameter.

    Raises CheckpointError naming the tensor for an unexpected or missing tensor or a wrong shape.
    `skip`: regexes of checkpoint entries to leave out on purpose (logged).
    """
    target = np_dtype(dtype)
    shapes = model.flat_shapes(cfg)
    pl = model.plan(cfg)
    rules = _compile(names)
    ignored = [re.compile(p + r"\Z") for p in (*_common.IGNORED, *skip)]
    out: dict[str, np.ndarray] = {}
    filled: set[tuple[str, int]] = set()
    for name in tqdm(reader.keys(), desc="import", unit="tensor", disable=not progress, leave=False):
        for rx, rel, transform, layered in rules:
            m = rx.match(name)
            if m:
                break
        else:
            if any(rx.match(name) for rx in ignored):
                log.info("skipping %s", name)
                continue
            raise CheckpointError(f"unexpected tensor {name!r}: no parameter of a {cfg.family} model takes it")
        if layered:
            i = int(m.group(1))
            if i >= cfg.num_layers:
                raise CheckpointError(f"unexpected tensor {name!r}: the model has {cfg.num_layers} layers")
            path, rank = f"layers/{pl.kind_of[i]}/{rel}", pl.rank_of[i]
        else:
            path, rank = rel, None
        if path not in shapes:
            raise CheckpointError(f"unexpected tensor {name!r}: this {cfg.family} config has no parameter {path}")
        full = shapes[path]
        want = full[1:] if layered else full
        src_shape, fn = TRANSFORMS[transform]
        got = reader.shape(name)
        if tuple(got) != tuple(src_shape(want)):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(got)}, expected {tuple(src_shape(want))}")
        value = np.asarray(fn(reader.get(name), want)).astype(target)
        if (path, rank) in filled:
            raise CheckpointError(f"tensor {name!r} maps to {path} which was already filled")
        filled.add((path, rank))
        if layered:
            if path not in out:
                out[path] = np.zeros(full, target)
            out[path][rank] = value
        else:
            out[path] = value
    missing = [(p, r) for p, s in shapes.items() for r in ([None] if not p.startswith("layers/") else range(s[0]))
               if (p, r) not in filled]
    if missing:
        raise CheckpointError(f"missing {len(missing)} tensors, e.g. {_describe(missing[:3], pl, names)}")
    return unflatten(out)


def _describe(missing, pl, names) -> str:
    """'model.layers.1.mlp.up_proj.weight (layer 1: mlp/w_up)' for each missing (path, rank)."""
    out = []
    for path, rank in missing:
        layer, rel = None, path
        if rank is not None:
            kind, rel = path.split("/", 2)[1:]
            layer = next(i for i, (k, r) in enumerate(zip(pl.kind_of, pl.rank_of)) if k == int(kind) and r == rank)
        source = next((pat for pat, (target, _) in names.items() if target == rel), None)
        where = rel if layer is None else f"layer {layer}: {rel}"
        if source is None:
            out.append(where)
        else:
            out.append(f"{source.replace(chr(92), '').replace('{i}', str(layer))} ({where})")
    return ", ".join(out)


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree
