"""Import a checkpoint into the parameter tree of a `ModelConfig`, driven by the family's name map."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Placement:
    """One checkpoint tensor going into (part of) one parameter."""

    name: str  # checkpoint tensor
    path: str  # parameter, e.g. layers/0/attn/wq
    index: tuple[int, ...]  # leading indices into the parameter: (layer rank,) or (layer rank, expert), or ()
    want: tuple[int, ...]  # the shape it fills: the parameter's shape after those leading indices
    transform: str | tuple


def plan_import(reader, cfg: ModelConfig, names: dict, skip: tuple[str, ...] = ()) -> list[Placement]:
    """Match every checkpoint tensor to its parameter and check names and shapes, reading no data.

    Raises CheckpointError naming the tensor for an unexpected or missing tensor or a wrong shape.
    `skip`: regexes of checkpoint entries to leave out on purpose (logged).
    """
    shapes = model.flat_shapes(cfg)
    pl = model.plan(cfg)
    rules = _compile(names)
    ignored = [re.compile(p + r"\Z") for p in (*_common.IGNORED, *skip)]
    out: list[Placement] = []
    filled: set[tuple[str, tuple[int, ...]]] = set()  # (param path, index into its leading axes)
    skipped = 0
    for name in reader.keys():
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
        for rel, transform in targets:
            path = prefix + rel
            if path not in shapes:
                raise CheckpointError(f"unexpected tensor {name!r}: this {cfg.family} config has no parameter {path}")
            full = shapes[path]
            if per_expert and index[-1] >= full[len(index) - 1]:
                raise CheckpointError(f"unexpected tensor {name!r}: expert {index[-1]} of {full[len(index) - 1]}")
            want = full[len(index):]
            src_shape, _ = _transform(transform)
            got = tuple(reader.shape(name))
            if got != tuple(src_shape(want)):
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {tuple(src_shape(want))}")
            if (path, index) in filled:
                raise CheckpointError(f"tensor {name!r} maps to {path} which was already filled")
            filled.add((path, index))
            out.append(Placement(name, path, index, tuple(want), transform))
    if skipped:
        log.info("left out %d checkpoint tensors this model does not use (e.g. vision, MTP)", skipped)
    missing = [(p, r) for p, s in shapes.items() for r in ([None] if not p.startswith("layers/") else range(s[0]))
               if not _complete(filled, p, r, s)]
    if missing:
        raise CheckpointError(f"missing {len(missing)} tensors, e.g. {_describe(missing[:3], pl, names)}")
    return out


def _transform(t):
    return TRANSFORMS[t] if isinstance(t, str) else t


def import_params(reader, cfg: ModelConfig, names: dict, dtype: str = "float32", progress: bool = True,
                  skip: tuple[str, ...] = ()) -> dict:
    """Host (NumPy) parameters: every tensor read once (memory-mapped), transformed, placed in its stack."""
    target = np_dtype(dtype)
    shapes = model.flat_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    cached: tuple[str, np.ndarray] | None = None  # one tensor may feed several parameters in a row
    for pm in tqdm(plan_import(reader, cfg, names, skip), desc="import", unit="tensor", disable=not progress,
                   leave=False):
        if cached is None or cached[0] != pm.name:
            cached = (pm.name, reader.get(pm.name))
        value = np.asarray(_transform(pm.transform)[1](cached[1], pm.want)).astype(target)
        if pm.index:
            if pm.path not in out:
                out[pm.path] = np.zeros(shapes[pm.path], target)
            out[pm.path][pm.index] = value
        else:
            out[pm.path] = value
    return unflatten(out)


def import_sharded(reader, cfg: ModelConfig, names: dict, shardings: dict, dtype: str = "float32",
                   skip: tuple[str, ...] = ()) -> dict:
    """Device parameters placed by `shardings` (a tree like the params): each device's slice is read from
    the checkpoint on its own, so no process holds whole tensors it does not need (for the transforms
    whose slices map to contiguous source ranges; others read the tensor, then slice)."""
    import jax

    target = np_dtype(dtype)
    shapes = model.flat_shapes(cfg)
    by_path: dict[str, list[Placement]] = {}
    for pm in plan_import(reader, cfg, names, skip):
        by_path.setdefault(pm.path, []).append(pm)
    flat_shardings = {"/".join(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}

    def fill(path, idx):
        full = shapes[path]
        idx = tuple(slice(*s.indices(n)) for s, n in zip(idx, full))
        out = np.zeros(tuple(s.stop - s.start for s in idx), target)
        for pm in by_path[path]:
            lead = idx[: len(pm.index)]
            if not all(s.start <= i < s.stop for s, i in zip(lead, pm.index)):
                continue
            at = tuple(i - s.start for s, i in zip(lead, pm.index))
            out[at] = read_slice(reader, pm, idx[len(pm.index):]).astype(target)
        return out

    flat = {path: jax.make_array_from_callback(shape, flat_shardings[path], lambda idx, p=path: fill(p, idx))
            for path, shape in shapes.items()}
    return unflatten(flat)


def read_slice(reader, pm: Placement, sub: tuple[slice, ...]) -> np.ndarray:
    """pm's target restricted to `sub`, reading only the source rows/columns it needs where the transform
    maps the slice to a contiguous source range (copy, reshape, T, T_out); else the whole tensor."""
    want = pm.want
    inner_full = all(s.start == 0 and s.stop == n for s, n in zip(sub[1:], want[1:]))
    shape = tuple(s.stop - s.start for s in sub)
    t = pm.transform
    if t == "copy":
        return reader.get_slice(pm.name, sub)
    if t == "reshape" and inner_full:  # [H*d] -> [H, d], split on heads
        k = int(np.prod(want[1:]))
        return reader.get_slice(pm.name, (slice(sub[0].start * k, sub[0].stop * k),)).reshape(shape)
    if t == "T" and all(s.start == 0 and s.stop == n for s, n in zip(sub[2:], want[2:])):
        k = int(np.prod(want[2:]))  # [prod(out), in] -> [in, out0, rest...], split on in and out0
        rows = slice(sub[1].start * k, sub[1].stop * k) if len(want) > 1 else slice(None)
        src = reader.get_slice(pm.name, (rows, sub[0]))
        return np.ascontiguousarray(src.T).reshape(shape)
    if t == "T_out" and all(s.start == 0 and s.stop == n for s, n in zip(sub[1:-1], want[1:-1])):
        k = int(np.prod(want[1:-1]))  # [out, prod(in)] -> [in0, rest..., out], split on in0 and out
        src = reader.get_slice(pm.name, (sub[-1], slice(sub[0].start * k, sub[0].stop * k)))
        return np.ascontiguousarray(src.T).reshape(shape)
    return np.asarray(_transform(t)[1](reader.get(pm.name), want))[sub]


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
