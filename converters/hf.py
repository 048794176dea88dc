"""Import a checkpoint into the parameter tree of a `ModelConfig`, driven by the family's name map: one planner
(every name and shape checked before any data is read, one set of errors) for every family and for DeepSeek's
MTP blocks."""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from converters.safetensors_io import CheckpointError
from converters.transforms import TRANSFORMS, transpose
from jaxmodels.config import ModelConfig
from jaxmodels.families import _common
from jaxmodels.plan import flatten, param_specs, plan, unflatten

log = logging.getLogger(__name__)

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def np_dtype(name: str):
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


PREFIXES = _common.PREFIXES


def normalize(name: str, renames=PREFIXES) -> str:
    """A checkpoint name in the spelling the name map is written in: each (regex, replacement) applied in turn."""
    for rx, repl in renames:
        name = re.sub(rx, repl, name)
    return name


class Quantized(dict):
    """A weight kept as its bytes ({path suffix: uint8 array}, the checkpoint's [out, in] layout): what a
    quantized reader returns when asked to keep it; placed as is, under the parameter's path + each suffix."""


def _compile(names: dict) -> list[tuple[re.Pattern, list[tuple[str, str]], bool, bool]]:
    """(regex, [(param path, transform), ...], has layer index, has slot index) per name-map entry.
    One checkpoint tensor may feed several parameters (e.g. GPT-OSS's interleaved gate/up); a path may name
    the pattern's groups ("attn/{x}"). A slot index indexes the parameter's next stacked axis: "{e}" an expert,
    "{v}" a layer of a stack outside the decoder (the vision tower's `vision/layers/...`)."""
    out = []
    for pattern, targets in names.items():
        targets = [targets] if isinstance(targets[0], str) else list(targets)
        rx = pattern.replace("{i}", r"(?P<i>\d+)").replace("{e}", r"(?P<e>\d+)").replace("{v}", r"(?P<e>\d+)")
        out.append((re.compile(rx + r"\Z"), targets, "{i}" in pattern, "{e}" in pattern or "{v}" in pattern))
    return out


@dataclass(frozen=True)
class Placement:
    """One checkpoint tensor going into (part of) one parameter."""

    name: str  # checkpoint tensor
    path: str  # parameter, e.g. layers/0/attn/wq
    index: tuple[int, ...]  # leading indices into the parameter: (layer rank,) or (layer rank, expert), or ()
    want: tuple[int, ...]  # the shape it fills: the parameter's shape after those leading indices
    transform: str | tuple


def plan_import(reader, cfg: ModelConfig, names: dict, skip: tuple[str, ...] = (), *, renames=PREFIXES,
                specs: dict | None = None, layer=None, derived: tuple[str, ...] = (), what: str = "",
                hint: str = "") -> list[Placement]:
    """Match every checkpoint tensor to its parameter and check names and shapes, reading no data.

    Raises CheckpointError naming the tensor for an unexpected or missing tensor or a wrong shape.
    skip: regexes of checkpoint entries to leave out on purpose (logged). renames: applied before matching.
    specs: flat parameter path -> ParamSpec (default: the model's); layer(i) -> (path prefix, leading index) for
    a name's `{i}` (default: `layers/<kind>/` at the layer's rank); derived: parameters built elsewhere, not
    read; what / hint: the kind of tensor named in errors ("MTP ") and a hint appended to the missing error.
    """
    pl = plan(cfg)
    specs = flatten(param_specs(cfg)) if specs is None else specs
    if layer is None:
        def layer(i):
            if i >= cfg.num_layers:
                raise CheckpointError(f"the model has {cfg.num_layers} layers")
            return f"layers/{pl.kind_of[i]}/", (pl.rank_of[i],)
    rules = _compile(names)
    ignored = [re.compile(p + r"\Z") for p in (*_common.IGNORED, *skip)]
    out: list[Placement] = []
    filled: set[tuple[str, tuple[int, ...]]] = set()  # (param path, index into its leading axes)
    skipped = 0
    for name in reader.keys():
        canon = normalize(name, renames)
        match = next(((m, targets, li, ei) for rx, targets, li, ei in rules if (m := rx.match(canon))), None)
        if match is None and any(rx.match(canon) or rx.match(name) for rx in ignored):
            log.debug("skipping %s", name)
            skipped += 1
            continue
        if match is None:
            raise CheckpointError(f"unexpected tensor {name!r}: no {what}parameter of a {cfg.family} model takes it")
        m, targets, layered, per_expert = match
        groups = {k: v for k, v in m.groupdict().items() if k not in ("i", "e")}
        index: tuple[int, ...] = ()
        prefix = ""
        if layered:
            try:
                prefix, index = layer(int(m.group("i")))
            except CheckpointError as e:
                raise CheckpointError(f"unexpected tensor {name!r}: {e}") from None
        if per_expert:
            index += (int(m.group("e")),)
        for rel, transform in targets:
            rel = rel.format(**groups).replace(".", "/")
            path = prefix + rel
            where = f"{rel} in layer {m.group('i')}" if layered and path.startswith("layers/") else path
            if path not in specs:
                raise CheckpointError(f"unexpected tensor {name!r}: this {cfg.family} config has no {what}"
                                      f"parameter {where}")
            s = specs[path]
            if per_expert and index[-1] >= s.shape[len(index) - 1]:
                slot = "expert" if s.axes[len(index) - 1] == "experts" else "layer"
                raise CheckpointError(f"unexpected tensor {name!r}: {slot} {index[-1]} of {s.shape[len(index) - 1]}")
            want = s.shape[len(index):]
            src_shape, _ = _transform(transform)
            got = tuple(reader.shape(name))
            if got != tuple(src_shape(want)):
                stack = (f" ({where} stacks {want[0]} experts: one tensor per expert, or one for all)"
                         if "experts" in s.axes[len(index):len(index) + 1] else "")
                raise CheckpointError(f"tensor {name!r} has shape {got}, expected {tuple(src_shape(want))}{stack}")
            if (path, index) in filled:
                raise CheckpointError(f"tensor {name!r} maps to {where} which was already filled")
            filled.add((path, index))
            out.append(Placement(name, path, index, tuple(want), transform))
    if skipped:
        log.info("left out %d checkpoint tensors this model does not use (e.g. vision, MTP)", skipped)
    missing = [x for p, s in specs.items() if p not in derived
               for r in (range(s.shape[0]) if p.startswith("layers/") else (None,)) for x in _missing(filled, p, r, s)]
    if missing:
        raise CheckpointError(f"missing {len(missing)} {what}tensors, e.g. {_describe(missing[:3], pl, names)}{hint}")
    return out


def _transform(t):
    return TRANSFORMS[t] if isinstance(t, str) else t


def _floating(dt) -> bool:
    dt = np.dtype(dt)
    return np.issubdtype(dt, np.floating) or (dt.type.__module__ == "ml_dtypes" and "float" in dt.name)


def _nan_bits(t) -> int:
    fi = ml_dtypes.finfo(t)
    return ((1 << fi.nexp) - 1) << fi.nmant  # IEEE: exponent all ones = inf or NaN


# dtype -> bits that are all set exactly in its NaN/Inf codes (e4m3fn: S.1111.111 is NaN; e8m0: 0xff is NaN)
NAN_BITS = {**{np.dtype(t): _nan_bits(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                                   ml_dtypes.float8_e5m2)},
            np.dtype(ml_dtypes.float8_e4m3fn): 0x7F, np.dtype(ml_dtypes.float8_e8m0fnu): 0xFF}


def nonfinite(a: np.ndarray, chunk: int = 1 << 20) -> int:
    """How many NaN/Inf values `a` holds: one pass in chunks (bounded memory), by their bits where NAN_BITS knows
    the dtype."""
    flat = a.reshape(-1)
    if (mask := NAN_BITS.get(flat.dtype)) is not None:
        flat = flat.view(f"u{flat.dtype.itemsize}")
    n = 0
    for i in range(0, flat.size, chunk):
        c = flat[i:i + chunk]
        n += np.count_nonzero((c & mask) == mask) if mask is not None else c.size - np.count_nonzero(np.isfinite(c))
    return n


# casts that keep every value, NaN and Inf included: the source counts the same non-finite values in fewer bytes
EXACT_WIDENING = {(np.dtype(a), np.dtype(b)) for a, b in ((ml_dtypes.bfloat16, np.float32),
                                                          (np.float16, np.float32))}


def check_values(name: str, src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`out`, checkpoint tensor `name` (`src` as read) transformed and cast, or CheckpointError naming the tensor:
    a source that is not floating-point for a float parameter (not integer for an integer one), NaN/Inf values,
    values past the range of out's dtype (float32 1e6 -> float16 inf)."""
    src = np.asarray(src)
    if not _floating(out.dtype):
        if not np.issubdtype(src.dtype, np.integer):
            raise CheckpointError(f"{name} is {src.dtype}, expected an integer tensor")
        info = np.iinfo(out.dtype)
        if src.size and (src.min() < info.min or src.max() > info.max):
            raise CheckpointError(f"{name} overflows {out.dtype} (values {src.min()} .. {src.max()})")
        return out
    if not _floating(src.dtype):
        raise CheckpointError(f"{name} is {src.dtype}, expected a floating-point tensor")
    if nonfinite(src if src.size == out.size and (src.dtype, out.dtype) in EXACT_WIDENING else out):
        if bad := nonfinite(src):
            raise CheckpointError(f"{name}: {bad} non-finite values (NaN/Inf)")
        big = max(abs(float(src.max())), abs(float(src.min())))
        raise CheckpointError(f"{name} overflows {out.dtype} (max |x| = {big:g})")
    return out


@dataclass(frozen=True)
class Part:
    """A converted value for one slot of one leaf: leaf[index] = value, where the leaf stacks `lead` slots
    (index and lead () for an unstacked leaf). What `stream` yields and the converted-model writer takes."""

    leaf: str
    lead: tuple[int, ...]
    index: tuple[int, ...]
    value: np.ndarray


def source_bytes(reader, name: str) -> int:
    """Bytes of checkpoint tensor `name` as stored (for progress), 0 where the reader cannot tell."""
    return reader.nbytes(name) if hasattr(reader, "nbytes") else 0


def read_bytes(reader, name: str) -> int:
    """Bytes `reader.get(name)` holds in memory: what a decoding (dequantising) reader says, else as stored."""
    return reader.held_bytes(name) if hasattr(reader, "held_bytes") else source_bytes(reader, name)


def stream(reader, cfg: ModelConfig, names: dict, dtype: str = "float32", skip: tuple[str, ...] = (), *,
           done=frozenset(), bar=None, into: Leaves | None = None, **plan_kw):
    """Every checkpoint tensor read once (in turn; read ahead in a thread, up to READ_AHEAD bytes and no more than
    the largest tensor's), transformed and cast: an iterator of (key, [Part]), key = (param path, index) per
    placement. Each parameter takes `dtype` unless its ParamSpec keeps fp32 or int32; Quantized values stay bytes
    (a Part per suffix). Every converted tensor is checked (`check_values`): finite, representable, of a fitting
    kind. Placements whose key is in `done` are left out and their tensors not read. bar: a tqdm advanced by the
    bytes read. into: the Leaves that `assemble` fills: a transposed tensor is written straight into its slot.
    plan_kw: as plan_import (checked before the first item)."""
    target = np_dtype(dtype)
    specs = plan_kw.setdefault("specs", flatten(param_specs(cfg)))
    todo = [pm for pm in plan_import(reader, cfg, names, skip, **plan_kw) if (pm.path, pm.index) not in done]
    if bar is not None:
        bar.total = (bar.total or 0) + sum(source_bytes(reader, n) for n in dict.fromkeys(pm.name for pm in todo))
        bar.refresh()
    runs = [(name, list(pms)) for name, pms in itertools.groupby(todo, lambda pm: pm.name)]  # a tensor may feed
    sizes = [read_bytes(reader, name) for name, _ in runs]  # several in a row
    budget = min(READ_AHEAD, max(sizes, default=0))
    # closed on any exit (an error here or in the caller): the read thread and what it read ahead go with it
    with contextlib.closing(prefetched(reader.get, [name for name, _ in runs], sizes, budget)) as values:
        for name, pms in runs:
            value = next(values)
            if bar is not None:
                bar.update(source_bytes(reader, name))
            for pm in pms:
                lead, dt = specs[pm.path].shape[:len(pm.index)], np.dtype(specs[pm.path].dtype or target)
                slot = None if into is None else functools.partial(into.slot, pm.path, lead, pm.index, pm.want, dt)
                yield (pm.path, pm.index), [Part(pm.path + suffix, lead, pm.index, v)
                                            for suffix, v in _convert(pm, value, dt, slot)]
            del value  # freed before the next is waited for (and read ahead past it)


READ_AHEAD = 256 << 20  # bytes of source tensors read ahead at most (and at most the largest one's: see stream)


def prefetched(get, names: list, sizes: list[int] | None = None, budget: int = 0):
    """get(name) for each name in turn, read in a thread, and read ahead while the caller works on one as long as
    those read ahead come to at most `budget` bytes (sizes: what each holds; unknown sizes are not read ahead).
    The reads (O_DIRECT: the disk's time, not the CPU's) overlap the transforms, and the disk stays busy through a
    slow one; what is held beyond the caller's tensor stays within the budget."""
    sizes = sizes or [0] * len(names)
    with ThreadPoolExecutor(1, thread_name_prefix="read") as pool:
        ahead, queued = collections.deque(), 0  # futures of names[k:queued] while the caller waits for name k

        def read_ahead(k):  # names[k], then those after it that fit the budget
            nonlocal queued
            while queued < len(names) and (queued <= k or sizes[queued] > 0 and sum(sizes[k + 1:queued + 1]) <= budget):
                ahead.append(pool.submit(get, names[queued]))
                queued += 1

        try:
            for k in range(len(names)):
                read_ahead(k)
                value = ahead.popleft().result()
                read_ahead(k)
                yield value
                del value
        finally:
            for f in ahead:  # the caller stopped (an error): reads not started are dropped
                f.cancel()


# Transforms of a weight kept as bytes ([..., out, in] layout: the parameter's columns are its rows): DeepSeek's
# transposed linears stay as stored; GPT-OSS's interleaved gate/up columns are every other row
QUANTIZED_TRANSFORMS = {"T": lambda a: a, "copy": lambda a: a,
                        "even_cols": lambda a: np.ascontiguousarray(a[..., 0::2, :]),
                        "odd_cols": lambda a: np.ascontiguousarray(a[..., 1::2, :])}


def _convert(pm: Placement, value, dt, slot=None) -> list[tuple[str, np.ndarray]]:
    """[(path suffix, value)] of one placement: the tensor transformed and cast, or a Quantized weight's bytes.
    slot() -> where a transposed value goes (C-contiguous, pm.want), or None: a new array."""
    if isinstance(value, Quantized):  # kept in the checkpoint's [out, in] layout: only nn.Linear-style weights
        rows = {v.shape[-2] for k, v in value.items() if k in ("/fp4", "/scale")}  # a scale a row: rows select
        if pm.transform not in QUANTIZED_TRANSFORMS or pm.transform.endswith("_cols") and len(rows) != 1:
            raise CheckpointError(f"{pm.name}: a weight kept quantized cannot take the {pm.transform!r} transform")
        return [(k, QUANTIZED_TRANSFORMS[pm.transform](v)) for k, v in value.items()]
    with np.errstate(over="ignore"):  # an overflow is check_values' error, not a warning
        if pm.transform in ("T", "T_out"):  # cast while transposing: no copy in the source dtype
            src, out = np.asarray(value), None if slot is None else slot()
            v = transpose(src, dt, None if out is None else out.reshape(src.shape[::-1])).reshape(pm.want)
        else:
            v = np.asarray(_transform(pm.transform)[1](value, pm.want)).astype(dt, copy=False)
            if not v.flags.writeable:  # a view of the source (GGUF's read-only file map): own it
                v = v.copy()
    return [("", check_values(pm.name, value, v))]


class Leaves(dict):
    """{leaf path: array} of the parameters being assembled; a stacked leaf is allocated on first use (page-aligned,
    so that jax adopts it without a copy) and filled slot by slot."""

    def slot(self, leaf: str, lead: tuple[int, ...], index: tuple[int, ...], shape: tuple[int, ...],
             dtype) -> np.ndarray | None:
        """leaf[index] (C-contiguous, `shape`), for a stacked leaf; None for a whole one (its value becomes it)."""
        from jaxmodels.checkpoint import aligned_empty

        if not index:
            return None
        if leaf not in self:
            self[leaf] = aligned_empty(lead + tuple(shape), dtype)
        return self[leaf][index]


def assemble(items, leaves: Leaves | None = None) -> dict:
    """The parameter tree of `stream`'s items, in `leaves` (the `into` of the stream, whose transposes are then
    already in place: no copy, and the leaves' first touch, a page fault per page, is spread over the transposing
    threads)."""
    out = Leaves() if leaves is None else leaves
    for _, parts in items:
        while parts:  # popped: no name keeps a value (and the buffer it was read into) past its placement
            p = parts.pop()
            if p.index:
                slot = out.slot(p.leaf, p.lead, p.index, p.value.shape, p.value.dtype)
                if slot.ctypes.data != p.value.ctypes.data:
                    slot[...] = p.value
            else:
                out[p.leaf] = p.value if p.value.ctypes.data % 64 == 0 else _aligned_copy(p.value)
            del p
    return unflatten(dict(out))


def _aligned_copy(a: np.ndarray) -> np.ndarray:
    """a in a page-aligned buffer: jax adopts only 64-byte aligned host memory (else copies it again), and a tensor
    read with O_DIRECT starts where it starts in its file."""
    from jaxmodels.checkpoint import aligned_empty

    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def import_params(reader, cfg: ModelConfig, names: dict, dtype: str = "float32", progress: bool = True,
                  skip: tuple[str, ...] = (), **plan_kw) -> dict:
    """Host (NumPy) parameters: `stream`'s items assembled in memory. plan_kw: as plan_import."""
    with tqdm(desc="import", unit="B", unit_scale=True, unit_divisor=1000, disable=not progress,
              leave=False) as bar:
        leaves = Leaves()
        return assemble(stream(reader, cfg, names, dtype, skip, bar=bar, into=leaves, **plan_kw), leaves)


def import_sharded(reader, cfg: ModelConfig, names: dict, shardings: dict, dtype: str = "float32",
                   skip: tuple[str, ...] = (), **plan_kw) -> dict:
    """Device parameters placed by `shardings` (a tree like the params): each device's slice is read from
    the checkpoint on its own, so no process holds whole tensors it does not need (for the transforms
    whose slices map to contiguous source ranges; others read the tensor, then slice)."""
    import jax

    target = np_dtype(dtype)
    specs = flatten(param_specs(cfg))
    by_path: dict[str, list[Placement]] = {}
    for pm in plan_import(reader, cfg, names, skip, **plan_kw):
        by_path.setdefault(pm.path, []).append(pm)
    flat_shardings = {"/".join(k.key for k in path): s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}

    def fill(path, idx):
        full = specs[path].shape
        idx = tuple(slice(*s.indices(n)) for s, n in zip(idx, full))
        out = np.zeros(tuple(s.stop - s.start for s in idx), np.dtype(specs[path].dtype or target))
        for pm in by_path.get(path, ()):
            lead = idx[: len(pm.index)]
            if not all(s.start <= i < s.stop for s, i in zip(lead, pm.index)):
                continue
            at = tuple(i - s.start for s, i in zip(lead, pm.index))
            with np.errstate(over="ignore"):
                out[at] = src = read_slice(reader, pm, idx[len(pm.index):])
            check_values(pm.name, src, out[at])
        return out

    flat = {path: jax.make_array_from_callback(s.shape, flat_shardings[path], lambda idx, p=path: fill(p, idx))
            for path, s in specs.items() if path not in plan_kw.get("derived", ())}
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


def _missing(filled, path, rank, spec) -> list[tuple[str, int | None, int | None]]:
    """[(path, layer rank, expert)] of a parameter slot not filled: filled whole, or (per-expert tensors) expert by
    expert — then each missing expert (expert None: the whole slot)."""
    base = () if rank is None else (rank,)
    if (path, base) in filled:
        return []
    per_expert = spec.axes[len(base):len(base) + 1] in (("experts",), ("layers",))  # filled slot by slot
    gaps = [e for e in range(spec.shape[len(base)]) if (path, (*base, e)) not in filled] if per_expert else [None]
    return [] if not gaps else [(path, rank, None)] if len(gaps) == spec.shape[len(base)] else \
        [(path, rank, e) for e in gaps]


def _describe(missing, pl, names) -> str:
    """'model.layers.1.mlp.experts.5.up_proj.weight (layer 1: mlp/w_up, expert 5)' for each missing slot."""
    out = []
    for path, rank, expert in missing:
        layer, rel = None, path
        if rank is not None:
            kind, rel = path.split("/", 2)[1:]
            layer = next(i for i, (k, r) in enumerate(zip(pl.kind_of, pl.rank_of)) if k == int(kind) and r == rank)
        moe = pl.kinds[pl.kind_of[layer]].mlp.kind == "moe" if layer is not None else False
        sources = [pat for pat, t in names.items() if "(?P<" not in pat
                   and rel in ([t[0]] if isinstance(t[0], str) else [x[0] for x in t])]
        source = next((pat for pat in sources if ("{e}" in pat) == (moe and rel.startswith("mlp/w_"))),
                      sources[0] if sources else None)
        slot = "expert" if layer is not None else "layer"
        where = (rel if layer is None else f"layer {layer}: {rel}") + ("" if expert is None else f", {slot} {expert}")
        if source is None:
            out.append(where)
        else:
            e = "*" if expert is None else str(expert)
            out.append(f"{source.replace(chr(92), '').replace('{i}', str(layer)).replace('{e}', e).replace('{v}', e)}"
                       f" ({where})")
    return ", ".join(out)
