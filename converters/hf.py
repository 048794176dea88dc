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


# Multimodal and v5 wrappers put the text model under another prefix (specs/hf_families.md §5).
PREFIXES = ((r"model\.language_model\.", "model."), (r"language_model\.model\.", "model."),
            (r"language_model\.lm_head\.", "lm_head."))


def normalize(name: str) -> str:
    for prefix, repl in PREFIXES:
        if re.match(prefix, name):
            return repl + name[re.match(prefix, name).end():]
    return name


def _compile(names: dict) -> list[tuple[re.Pattern, list[tuple[str, str]], bool, bool]]:
    """(regex, [(param path, transform), ...], has layer index, has expert index) per name-map entry.
    One checkpoint tensor may feed several parameters (e.g. GPT-OSS's interleaved gate/up)."""
    out = []
    for pattern, targets in names.items():
        targets = [targets] if isinstance(targets[0], str) else list(targets)
        rx = pattern.replace("{i}", r"(?P<i>\d+)").replace("{e}", r"(?P<e>\d+)")
        out.append((re.compile(rx + r"\Z"), targets, "{i}" in pattern, "{e}" in pattern))
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
    filled: set[tuple[str, tuple[int, ...]]] = set()  # (param path, index into its leading axes)
    skipped = 0
    for name in tqdm(reader.keys(), desc="import", unit="tensor", disable=not progress, leave=False):
        canon = normalize(name)
        match = next(((m, targets, li, ei) for rx, targets, li, ei in rules if (m := rx.match(canon))), None)
        if match is None:
            if any(rx.match(canon) or rx.match(name) for rx in ignored):
                log.debug("skipping %s", name)
                skipped += 1
                continue
            raise CheckpointError(f"unexpected tensor {name!r}: no parameter of a {cfg.family} model takes it")
        m, targets, layered, per_expert = match
        index: tuple[int, ...] = ()
        prefix = ""
        if layered:
            i = int(m.group("i"))
            if i >= cfg.num_layers:
                raise CheckpointError(f"unexpected tensor {name!r}: the model has {cfg.num_layers} layers")
            prefix, index = f"layers/{pl.kind_of[i]}/", (pl.rank_of[i],)
        if per_expert:
            index += (int(m.group("e")),)
        source = None
        for rel, transform in targets:
            path = prefix + rel
            if path not in shapes:
                raise CheckpointError(f"unexpected tensor {name!r}: this {cfg.family} config has no parameter {path}")
            full = shapes[path]
            if per_expert and index[-1] >= full[len(index) - 1]:
                raise CheckpointError(f"unexpected tensor {name!r}: expert {index[-1]} of {full[len(index) - 1]}")
            want = full[len(index):]
            src_shape, fn = TRANSFORMS[transform] if isinstance(transform, str) else transform
            got = tuple(reader.shape(name))
            if got != tuple(src_shape(want)):
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {tuple(src_shape(want))}")
            if (path, index) in filled:
                raise CheckpointError(f"tensor {name!r} maps to {path} which was already filled")
            source = reader.get(name) if source is None else source
            value = np.asarray(fn(source, want)).astype(target)
            filled.add((path, index))
            if index:
                if path not in out:
                    out[path] = np.zeros(full, target)
                out[path][index] = value
            else:
                out[path] = value
    if skipped:
        log.info("left out %d checkpoint tensors this model does not use (e.g. vision, MTP)", skipped)
    missing = [(p, r) for p, s in shapes.items() for r in ([None] if not p.startswith("layers/") else range(s[0]))
               if not _complete(filled, p, r, s)]
    if missing:
        raise CheckpointError(f"missing {len(missing)} tensors, e.g. {_describe(missing[:3], pl, names)}")
    return unflatten(out)


def _complete(filled, path, rank, shape) -> bool:
    """A parameter slot is complete when filled whole, or (per-expert tensors) expert by expert."""
    if rank is None:
        return (path, ()) in filled
    return (path, (rank,)) in filled or (len(shape) > 1 and all((path, (rank, e)) in filled for e in range(shape[1])))


def _describe(missing, pl, names) -> str:
    """'model.layers.1.mlp.up_proj.weight (layer 1: mlp/w_up)' for each missing (path, rank)."""
    out = []
    for path, rank in missing:
        layer, rel = None, path
        if rank is not None:
            kind, rel = path.split("/", 2)[1:]
            layer = next(i for i, (k, r) in enumerate(zip(pl.kind_of, pl.rank_of)) if k == int(kind) and r == rank)
        source = next((pat for pat, t in names.items() if rel in ([t[0]] if isinstance(t[0], str) else [x[0] for x in t])), None)
        where = rel if layer is None else f"layer {layer}: {rel}"
        if source is None:
            out.append(where)
        else:
            out.append(f"{source.replace(chr(92), '').replace('{i}', str(layer)).replace('{e}', '*')} ({where})")
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
