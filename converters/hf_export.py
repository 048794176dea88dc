"""Export back to Hugging Face, write side of `converters.export`: a model's parameters as HF safetensors (sharded
with `model.safetensors.index.json` above a size), config.json, generation_config.json and the tokenizer files.

The tensors are the exact inverse of the import. Their names come from the family's own name map (one table, read in
both directions; its alternatives such as `attn\\.(?P<x>wq_a|wkv)` written out), spelled as HF's save_pretrained
writes them (DeepSeek V4: its own names under `model.`), and which parameter slices each name holds, through which
transform, is what `converters.hf.plan_import` says it would import from them: the export plan *is* the import plan,
run on the names and shapes the export is about to write. Each parameter goes back through the inverse of its
transform (`INVERSES`, beside the forward ones of converters/transforms.py) and is checked by running the forward
transform again, so that importing the export gives every parameter back bit for bit. config.json is built from the
ModelConfig per family (`HF_EXPORTS`) and checked the same way: the family's import must read it back as this very
config.

Output appears atomically, with convert's rules (converters/orbax_io.py): a temporary sibling `.<name>.*.partial`
(with orbax_io's owner file, so an interrupted export's leftovers are removed by the next one), renamed at the end;
overwrite replaces only an earlier export (its safetensors carry `EXPORT_MARK`) or an empty directory.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm.auto import tqdm

from converters.hf import NAN_BITS, Placement, check_values, np_dtype, plan_import
from converters.safetensors_io import INDEX, CheckpointError
from converters.transforms import TRANSFORMS
from jaxmodels import families, files
from jaxmodels.checkpoint import ST_NAMES
from jaxmodels.config import ModelConfig, RopeSpec
from jaxmodels.families import _common
from jaxmodels.plan import flatten, param_specs, plan

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"
EXPORT_MARK = {"exported_by": "jaxmodels"}  # in every safetensors header (and the index) we write
DEFAULT_SHARD_SIZE = "5GB"

# ----------------------------------------------------------------------------------------------- tensors
# transform name -> scatter(out, x): parameter (slice) x written back into `out`, the checkpoint tensor (of the
# transform's source shape). The inverse of each forward transform of converters/transforms.py.
INVERSES: dict[str, Callable[[np.ndarray, np.ndarray], None]] = {
    "copy": lambda out, x: np.copyto(out, x),
    "T": lambda out, x: np.copyto(out, x.reshape(x.shape[0], -1).T),  # [in, out...] -> [prod(out), in]
    "T_out": lambda out, x: np.copyto(out, x.reshape(-1, x.shape[-1]).T),  # [in..., out] -> [out, prod(in)]
    "reshape": lambda out, x: np.copyto(out, x.reshape(out.shape)),
    "even_cols": lambda out, x: np.copyto(out[..., 0::2], x),
    "odd_cols": lambda out, x: np.copyto(out[..., 1::2], x),
    "wo_a": lambda out, x: np.copyto(out, x.transpose(0, 2, 1).reshape(out.shape)),  # [G, Hd/G, Ro] -> [G*Ro, Hd/G]
}


@dataclass(frozen=True)
class Tensor:
    """One checkpoint tensor to write: its name, shape, dtype and the parameter slices it holds (as imported)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    parts: tuple[Placement, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Shapes:
    """Names and shapes, no data: all that plan_import reads."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self._shapes = shapes

    def keys(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]


def _targets(t) -> list[tuple[str, object]]:
    return [t] if isinstance(t[0], str) else list(t)


def _source_shape(transform, want) -> tuple[int, ...]:
    return tuple((TRANSFORMS[transform] if isinstance(transform, str) else transform)[0](want))


_ESCAPED = re.compile(r"\\(.)")
_GROUP = re.compile(r"\(\?P<(\w+)>((?:\w|\\\.|\|)+)\)")  # a named group of plain alternatives: (?P<x>a|b\.c)


def _spellings(pattern: str, targets: list) -> list[tuple[str, list]]:
    """The (pattern, targets) entries a name-map entry stands for: each named group of plain alternatives
    (`attn\\.(?P<x>wq_a|wkv)\\.weight` -> `attn/{x}`) written out, its value put into the parameter paths."""
    m = _GROUP.search(pattern)
    if m is None:
        return [(pattern, targets)]
    out = []
    for alt in m.group(2).split("|"):
        value = _ESCAPED.sub(r"\1", alt)
        out += _spellings(pattern[:m.start()] + alt + pattern[m.end():],
                          [(rel.replace("{" + m.group(1) + "}", value), tr) for rel, tr in targets])
    return out


def _literal(pattern: str) -> str | None:
    """The checkpoint name a name-map pattern spells (`{i}` / `{e}` left in), or None for a real regex."""
    bare = _ESCAPED.sub("", pattern).replace("{i}", "").replace("{e}", "")
    return None if re.search(r"[.^$*+?()\[\]{}|]", bare) else _ESCAPED.sub(r"\1", pattern)


def _names(cfg: ModelConfig, names: dict) -> dict[str, tuple[int, ...]]:
    """{checkpoint name: shape}: every name-map entry whose parameters this config has, per layer and per expert,
    in the order of an HF state dict (the embedding, the layers, the rest). A per-expert entry (`{e}`) applies to
    parameters stacked over experts only. Where the map spells one parameter several ways (a family's own entries
    after the shared Llama ones it starts from: Qwen3-MoE's per-expert names for its experts), the later entry wins."""
    pl, specs = plan(cfg), flatten(param_specs(cfg))
    entries = [(order, pattern, _literal(pattern), targets) for order, (pattern, targets) in
               enumerate(e for p, t in names.items() for e in _spellings(p, _targets(t)))]
    found: list[tuple[tuple, str, tuple[int, ...]]] = []
    for i in [None] + list(range(cfg.num_layers)):
        prefix, index = ("", ()) if i is None else (f"layers/{pl.kind_of[i]}/", (pl.rank_of[i],))
        fits = []  # (order, name, paths, shape, experts) of the entries this layer (or the top level) can take
        for order, pattern, name, targets in entries:
            experts = "{e}" in pattern
            if name is None or ("{i}" in pattern) != (i is not None):  # name None: a regex, no name to spell
                continue
            paths = [prefix + rel.replace(".", "/") for rel, _ in targets]
            if not all(p in specs for p in paths):
                continue
            if experts and not all("experts" in specs[p].axes[len(index):len(index) + 1] for p in paths):
                continue
            shapes = {_source_shape(tr, specs[p].shape[len(index) + experts:]) for p, (_, tr) in zip(paths, targets)}
            if len(shapes) > 1:
                raise ValueError(f"{cfg.family}: {name}'s parameters {paths} give different tensor shapes {shapes}")
            fits.append((order, name, paths, shapes.pop(), experts))
        last = {p: order for order, _, paths, _, _ in fits for p in paths}
        for order, name, paths, shape, experts in fits:
            if any(last[p] != order for p in paths):
                log.debug("%s: not written, a later name-map entry spells %s", name, paths)
                continue
            at = cfg.num_layers if i is None and "embed" not in paths else -1 if i is None else i
            for e in range(specs[paths[0]].shape[len(index)]) if experts else (0,):
                found.append(((at, order, e), name.replace("{i}", str(i)).replace("{e}", str(e)), shape))
    return {n: shape for _, n, shape in sorted(found, key=lambda f: f[0])}


def plan_export(cfg: ModelConfig, params: dict | None = None, dtype: str | None = None) -> list[Tensor]:
    """The tensors of an export, every name and shape checked, no data read: the names `_names` spells, each with
    the parameter slices plan_import would fill from it, in the spelling of HF's own save (`HFExport.spell`).
    Raises NotImplementedError for a family without an export (DeepSeek V4.1) or weights kept quantized,
    ValueError if the names would not import back exactly. params: their dtypes decide the tensors' (else the
    float32 plan); dtype: floating parameters cast to it (those the plan keeps fp32 stay); the family's
    `HFExport.dtypes` are written as the transformers class stores them, whatever the model's dtype."""
    cfg, params = text_part(cfg, params)
    exp = _export_of(cfg)
    fam = families.get(exp.model_type)
    names = families.name_map(fam, cfg)
    shapes = {exp.spell(n): s for n, s in _names(cfg, names).items()}
    kw = {"derived": fam.derived} | ({} if fam.renames is None else {"renames": fam.renames})
    try:
        placed = plan_import(_Shapes(shapes), cfg, names, fam.skip, **kw)
    except CheckpointError as e:
        raise ValueError(f"{cfg.family}: the exported tensors would not import back: {e}") from None
    specs = flatten(param_specs(cfg))
    flat = flatten(params) if params is not None else {}
    parents = {k.rsplit("/", 1)[0] for k in flat}  # a weight kept quantized: {path}/fp8 + {path}/scale
    if quantized := sorted({pm.path for pm in placed if pm.path not in flat and pm.path in parents}):
        raise NotImplementedError(f"{cfg.family}: {quantized[0]} (and {len(quantized) - 1} more) are kept quantized; "
                                  f"export writes dequantized weights: convert without keep_quantized")
    if params is not None and "mtp" in params:
        log.info("export leaves out the %s MTP blocks: transformers' %s has none", cfg.family, exp.architecture)
    target = None if dtype is None else np.dtype(np_dtype(dtype))

    def dtype_of(pm: Placement) -> np.dtype:
        dt = np.dtype(flat[pm.path].dtype) if pm.path in flat else np.dtype(specs[pm.path].dtype or np.float32)
        if (fixed := next((d for rx, d in exp.dtypes if re.search(rx, pm.path)), None)) is not None:
            return np.dtype(fixed)
        return target if target is not None and specs[pm.path].dtype is None and _floating(dt) else dt

    parts: dict[str, list[Placement]] = {}
    for pm in placed:
        parts.setdefault(pm.name, []).append(pm)
    out = []
    for name, shape in shapes.items():
        dts = {dtype_of(pm) for pm in parts[name]}
        if len(dts) > 1:
            raise ValueError(f"{name}: its parameters {[pm.path for pm in parts[name]]} have different dtypes {dts}")
        out.append(Tensor(name, shape, dts.pop(), tuple(parts[name])))
    return out


def _floating(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt in NAN_BITS


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a).reshape(-1)
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.itemsize in (1, 2, 4, 8) else a


def _leaf(params: dict, path: str):
    node = params
    for k in path.split("/"):
        node = node[k]
    return node


def tensor_value(t: Tensor, params: dict) -> np.ndarray:
    """The checkpoint tensor `t`, built from its parameter slices by the inverse transforms (cast to t.dtype, values
    checked as the import checks them) and verified: the import's own transform gives every slice back bit for bit."""
    out = np.zeros(t.shape, t.dtype)
    parts = []
    for pm in t.parts:
        leaf = _leaf(params, pm.path)
        x = np.asarray(leaf[pm.index] if pm.index else leaf)
        if x.shape != pm.want:
            raise ValueError(f"{pm.path}{list(pm.index) if pm.index else ''}: shape {x.shape}, the config gives "
                             f"{pm.want}")
        with np.errstate(over="ignore"):  # an overflow is check_values' error
            y = x if x.dtype == t.dtype else x.astype(t.dtype)
        check_values(t.name, x, y)
        inverse = INVERSES.get(pm.transform) if isinstance(pm.transform, str) else None
        if inverse is None:
            raise NotImplementedError(f"{t.name}: the transform {pm.transform!r} of {pm.path} has no inverse")
        inverse(out, y)
        parts.append((pm, y))
    for pm, y in parts:
        back = np.asarray((TRANSFORMS[pm.transform])[1](out, pm.want))
        if back.shape != y.shape or not np.array_equal(_bits(back), _bits(y)):
            raise AssertionError(f"{t.name}: importing it would not give {pm.path} back (the inverse of "
                                 f"{pm.transform!r} is wrong)")
    return out


# ----------------------------------------------------------------------------------------------- safetensors
SIZE_UNITS = {"": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
              "TIB": 2**40}


def shard_bytes(size: int | str) -> int:
    """A shard size in HF's spelling: bytes, or "5GB" / "500MB" (powers of 10) / "2GiB" (powers of 2)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]i?b)?\s*", size, re.I) if isinstance(size, str) else None
    n = (int(m.group(1)) * SIZE_UNITS[(m.group(2) or "").upper()] if m else
         size if isinstance(size, int) and not isinstance(size, bool) else 0)
    if n <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a size such as '5GB', got {size!r}")
    return n


def shards(tensors: list[Tensor], max_bytes: int) -> list[list[Tensor]]:
    """Consecutive tensors grouped into shards of at most max_bytes, as huggingface_hub splits a state dict: a new
    shard when the next tensor would overflow this one; a tensor larger than max_bytes alone."""
    out: list[list[Tensor]] = []
    cur: list[Tensor] = []
    size = 0
    for t in tensors:
        if t.nbytes > max_bytes:
            out.append([t])
            continue
        if cur and size + t.nbytes > max_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    return out + [cur] if cur or not out else out


def write_safetensors(path: Path, tensors: list[Tensor], value: Callable[[Tensor], np.ndarray]) -> None:
    """A safetensors file, streamed: the header (every shape and dtype is known before any data), then each tensor's
    bytes as value(t) builds it; one tensor in memory at a time."""
    header: dict = {"__metadata__": {"format": "pt", **EXPORT_MARK}}
    offset = 0
    for t in tensors:
        if t.dtype not in ST_NAMES:
            raise ValueError(f"{t.name}: dtype {t.dtype} has no safetensors code")
        header[t.name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            a = np.ascontiguousarray(value(t), t.dtype.newbyteorder("<") if t.dtype.byteorder == ">" else None)
            f.write(memoryview(a.reshape(-1).view(np.uint8)))


def is_export(path: str | Path) -> bool:
    """An earlier export (what overwrite may replace): a config.json and safetensors (or an index) with our mark."""
    path = Path(path)
    if path.is_symlink() or not (path / "config.json").is_file():
        return False
    try:
        if (path / INDEX).is_file():
            meta = files.read_json(path / INDEX, files.MAX_INDEX_BYTES).get("metadata") or {}
        else:
            from safetensors import safe_open

            with safe_open(str(path / SINGLE), framework="np") as f:
                meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - unreadable, missing or not safetensors: not ours
        return False
    return isinstance(meta, dict) and all(meta.get(k) == v for k, v in EXPORT_MARK.items())


# ----------------------------------------------------------------------------------------------- config.json
@dataclass(frozen=True)
class HFExport:
    model_type: str  # the registry key whose name map and config mapping the export is the inverse of
    architecture: str  # the transformers class config.json names
    config: Callable[[ModelConfig], dict]  # the family's config.json fields
    spell: Callable[[str], str] = lambda name: name  # a name-map name -> the one HF's save_pretrained writes
    dtypes: tuple[tuple[str, str], ...] = ()  # (parameter path regex, dtype) the HF class stores at any dtype


_HF_ACT = {ours: hf for hf, ours in reversed(_common.ACTIVATIONS.items())}  # the first HF spelling of each
_ROPE_KEYS = {"factor": "factor", "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
              "original_max_position": "original_max_position_embeddings", "beta_fast": "beta_fast",
              "beta_slow": "beta_slow", "truncate": "truncate", "attention_factor": "attention_factor",
              "mscale": "mscale", "mscale_all_dim": "mscale_all_dim"}
_ROPE_KIND_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
                   "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position"),
                   "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position", "truncate")}


def _rope(r: RopeSpec | None, cfg: ModelConfig) -> dict | None:
    """HF's rope dict of a RopeSpec: the kind's usual keys, and any other field the import would read differently."""
    if r is None:
        return None
    base = _common.rope_spec({"rope_type": r.kind}, r.theta, cfg.max_position_embeddings, r.interleaved)
    keys = [f for f in _ROPE_KEYS if f in _ROPE_KIND_KEYS.get(r.kind, ()) or getattr(r, f) != getattr(base, f)]
    if r.kind == "dynamic":  # derived from max_position_embeddings
        keys = [f for f in keys if f != "original_max_position"]
    return {"rope_type": r.kind, "rope_theta": r.theta, **{_ROPE_KEYS[f]: getattr(r, f) for f in keys}}


def _first_rope(cfg: ModelConfig, kind: str | None = None) -> dict | None:
    return next((_rope(L.attention.rope, cfg) for L, t in zip(cfg.layers, _layer_types(cfg))
                 if L.attention.rope is not None and kind in (None, t)), None)


def _layer_types(cfg: ModelConfig) -> list[str]:
    return ["sliding_attention" if L.attention.window else "full_attention" for L in cfg.layers]


def _window(cfg: ModelConfig, default=None):
    return next((L.attention.window for L in cfg.layers if L.attention.window), default)


def _base(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_ids
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else list(eos) or None,
            "pad_token_id": cfg.pad_token_id}


def _dense(cfg: ModelConfig) -> dict:
    L = cfg.layers[0]
    return _base(cfg) | {"intermediate_size": L.mlp.intermediate_size, "hidden_act": _HF_ACT.get(L.mlp.activation),
                         "rms_norm_eps": cfg.norm_eps, "rope_parameters": _first_rope(cfg)}


def _llama(cfg: ModelConfig) -> dict:
    return _dense(cfg) | {"attention_bias": cfg.layers[0].attention.qkv_bias, "mlp_bias": cfg.layers[0].mlp.bias}


def _mistral(cfg: ModelConfig) -> dict:
    return _dense(cfg) | {"sliding_window": cfg.layers[0].attention.window}


def _qwen2(cfg: ModelConfig) -> dict:
    """Qwen2's q/k/v biases are not a config field (always there, none on o_proj). layer_types spell the plan; where
    its sliding layers are the tail (or none), max_window_layers says the same to a reader without layer_types."""
    w, types = _window(cfg), _layer_types(cfg)
    out = _dense(cfg) | {"use_sliding_window": w is not None, "sliding_window": w, "layer_types": types}
    first = types.index("sliding_attention") if w is not None else cfg.num_layers
    if all(t == "sliding_attention" for t in types[first:]):
        out["max_window_layers"] = first
    return out


def _qwen3(cfg: ModelConfig) -> dict:
    w = _window(cfg)
    return _dense(cfg) | {"attention_bias": cfg.layers[0].attention.qkv_bias, "use_sliding_window": w is not None,
                          "sliding_window": w, "layer_types": _layer_types(cfg)}


def _sparse_step(moe: set[int], n: int) -> tuple[int, list[int]]:
    """(decoder_sparse_step, mlp_only_layers) that make exactly the layers `moe` sparse, the shortest list first."""
    best = None
    for step in range(1, n + 2):
        every = [i for i in range(n) if (i + 1) % step == 0]
        if moe <= set(every) and (best is None or len(every) - len(moe) < len(best[1])):
            best = (step, [i for i in every if i not in moe])
    return best


def _qwen3_moe(cfg: ModelConfig) -> dict:
    """Qwen3-MoE has one window for every layer (set iff use_sliding_window; no layer_types, no max_window_layers)."""
    moe = [i for i, L in enumerate(cfg.layers) if L.mlp.kind == "moe"]
    dense = [L.mlp for L in cfg.layers if L.mlp.kind != "moe"]
    w = _window(cfg)
    if any(L.attention.window != w for L in cfg.layers):
        raise ValueError("Qwen3-MoE has one attention window for every layer; this model's layers differ")
    out = _dense(cfg) | {"attention_bias": cfg.layers[0].attention.qkv_bias, "use_sliding_window": w is not None,
                         "sliding_window": w}
    if dense:
        out["intermediate_size"] = dense[0].intermediate_size
    else:
        del out["intermediate_size"]  # not kept by the import when no layer is dense: HF's default
    step, only = _sparse_step(set(moe), cfg.num_layers)
    out |= {"decoder_sparse_step": step, "mlp_only_layers": only, "num_local_experts": 0}
    if moe:
        m = cfg.layers[moe[0]].mlp
        out |= {"moe_intermediate_size": m.intermediate_size, "num_local_experts": m.num_experts,
                "num_experts_per_tok": m.top_k, "norm_topk_prob": m.renormalize}
    return out


def _cohere(cfg: ModelConfig) -> dict:
    """Cohere's head_dim is always hidden / heads (HF derives it, so does the import)."""
    a = cfg.layers[0].attention
    out = _dense(cfg) | {"layer_norm_eps": cfg.norm_eps, "logit_scale": cfg.logit_scale, "attention_bias": a.qkv_bias,
                         "use_qk_norm": a.qk_norm == "layernorm"}
    for k in ("rms_norm_eps", "head_dim"):
        del out[k]
    return out


def _cohere2(cfg: ModelConfig) -> dict:
    out = _cohere(cfg) | {"sliding_window": _window(cfg, 4096), "layer_types": _layer_types(cfg)}
    del out["use_qk_norm"]
    return out


# HF's defaults for a layer type the model does not have (Gemma3TextConfig wants both)
_GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}


def _gemma3(cfg: ModelConfig) -> dict:
    L = cfg.layers[0]
    a = L.attention
    q = None if a.scale is None else a.scale ** -2  # scale = query_pre_attn_scalar ** -0.5
    if q is not None and round(q) ** -0.5 == a.scale:
        q = round(q)
    out = _base(cfg) | {
        "intermediate_size": L.mlp.intermediate_size, "hidden_activation": _HF_ACT.get(L.mlp.activation),
        "rms_norm_eps": cfg.norm_eps, "query_pre_attn_scalar": q, "sliding_window": _window(cfg, 4096),
        "layer_types": _layer_types(cfg), "final_logit_softcapping": cfg.final_softcap, "attn_logit_softcapping": None,
        "attention_bias": a.qkv_bias,
        "rope_parameters": {t: _first_rope(cfg, t) or d for t, d in _GEMMA_ROPE.items()}}
    return out


def _gpt_oss(cfg: ModelConfig) -> dict:
    L = cfg.layers[0]
    m = L.mlp
    return _base(cfg) | {
        "intermediate_size": m.intermediate_size, "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "sliding_window": _window(cfg, 128), "layer_types": _layer_types(cfg), "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": _first_rope(cfg), "swiglu_limit": m.clamp_limit, "swiglu_alpha": m.clamp_alpha,
        "attention_bias": L.attention.qkv_bias}


def _exaone4(cfg: ModelConfig) -> dict:
    """A window makes EXAONE's full layers NoPE; without one, every layer has RoPE."""
    nope = any(L.attention.rope is None for L in cfg.layers)
    return _dense(cfg) | {"sliding_window": _window(cfg, 4096 if nope else None), "layer_types": _layer_types(cfg)}


_V4_ATTENTION = {"none": "sliding_attention", "indexer": "compressed_sparse_attention",
                 "all": "heavily_compressed_attention"}  # MLASpec.select -> HF's layer type


def _deepseek_v4(cfg: ModelConfig) -> dict:
    """HF's DeepseekV4Config: layer_types + compress_rates spell each layer's compression (sliding, CSA with its
    indexer, HCA), mlp_layer_types the hash-routed layers; rope_parameters nested (main / compress) as HF saves
    them. One shared expert of the routed experts' width, one KV head (HF's only layout)."""
    L, mla = cfg.layers[0], [s.attention.mla for s in cfg.layers]
    a, m, h = mla[0], L.mlp, L.mhc
    types = [_V4_ATTENTION[x.select] for x in mla]
    rates = {t: x.ratio for t, x in reversed(list(zip(types, mla))) if x.ratio}  # the first layer's of each type
    ropes = {bool(x.ratio): s.attention.rope for x, s in reversed(list(zip(mla, cfg.layers)))}
    rope_dim = {"partial_rotary_factor": a.rope_dim / cfg.head_dim}
    main = ropes.get(False) or RopeSpec(theta=10000.0)
    compress = ropes.get(True) or RopeSpec(theta=160000.0)
    yarn = {} if compress.kind != "yarn" else {
        "factor": compress.factor, "original_max_position_embeddings": compress.original_max_position,
        "beta_fast": compress.beta_fast, "beta_slow": compress.beta_slow, "attention_factor": 1.0}
    return _base(cfg) | {
        "num_key_value_heads": 1, "q_lora_rank": a.q_lora_rank, "o_groups": a.o_groups, "o_lora_rank": a.o_lora_rank,
        "qk_rope_head_dim": a.rope_dim, **rope_dim, "sliding_window": L.attention.window,
        "index_n_heads": a.index_heads, "index_head_dim": a.index_head_dim, "index_topk": a.index_topk,
        "layer_types": types, "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128,
                                                 **rates},
        "mlp_layer_types": ["hash_moe" if s.mlp.router == "hash" else "moe" for s in cfg.layers],
        "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": m.intermediate_size,
        "n_shared_experts": 1, "scoring_func": m.score_func, "routed_scaling_factor": m.route_scale,
        "norm_topk_prob": m.renormalize, "swiglu_limit": m.clamp_limit, "hidden_act": "silu",
        "hc_mult": h.copies, "hc_sinkhorn_iters": h.sinkhorn_iters, "hc_eps": h.eps, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": main.theta, "compress_rope_theta": compress.theta,
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": main.theta, **rope_dim},
                            "compress": {"rope_type": compress.kind, "rope_theta": compress.theta, **yarn, **rope_dim}},
        "num_nextn_predict_layers": 0 if cfg.mtp is None else cfg.mtp.layers}


def _deepseek_v4_name(name: str) -> str:
    """DeepSeek's own tensor name (the name map's) -> HF's saved one: deepseek_v4.RENAMES undone (`model.` on all
    but the head, `embed_tokens`, `hc_head.hc_*`, the attention's KV norm as `attn.norm`)."""
    if name == "head.weight":
        return name
    for rx, repl in ((r"^embed\.", "embed_tokens."), (r"^hc_head_", "hc_head.hc_"),
                     (r"\.attn\.kv_norm\.weight$", ".attn.norm.weight")):
        name = re.sub(rx, repl, name)
    return "model." + name


# ModelConfig.family -> what its export writes. Multimodal checkpoints (gemma3, exaone4_5, mistral3: `text_part`)
# come back as their text model; GPT-OSS's original layout and MXFP4 experts as HF's unquantized layout.
HF_EXPORTS = {
    "llama": HFExport("llama", "LlamaForCausalLM", _llama),
    "mistral": HFExport("mistral", "MistralForCausalLM", _mistral),
    "qwen2": HFExport("qwen2", "Qwen2ForCausalLM", _qwen2),
    "qwen3": HFExport("qwen3", "Qwen3ForCausalLM", _qwen3),
    "qwen3_moe": HFExport("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe),
    "cohere": HFExport("cohere", "CohereForCausalLM", _cohere),
    "cohere2": HFExport("cohere2", "Cohere2ForCausalLM", _cohere2),
    "gemma3": HFExport("gemma3_text", "Gemma3ForCausalLM", _gemma3),
    "gpt_oss": HFExport("gpt_oss", "GptOssForCausalLM", _gpt_oss),
    "exaone4": HFExport("exaone4", "Exaone4ForCausalLM", _exaone4),
    # HF's _keep_in_fp32_modules_strict keeps every norm fp32 (the plan keeps the rest of that list fp32 too);
    # the hash-routing table is a torch.long buffer. V4.1 has no transformers class.
    "deepseek_v4": HFExport("deepseek_v4", "DeepseekV4ForCausalLM", _deepseek_v4, _deepseek_v4_name,
                            ((r"norm$", "float32"), (r"/tid2eid$", "int64"))),
}


def text_part(cfg: ModelConfig, params: dict | None = None):
    """A multimodal model as the text model its export writes: the vision tower left out (logged)."""
    if cfg.vision is None:
        return cfg, params
    log.info("export writes the text model: the %s vision tower is left out", cfg.vision.kind)
    cfg = dataclasses.replace(cfg, vision=None, family="mistral" if cfg.family == "mistral3" else cfg.family)
    return cfg, None if params is None else {k: v for k, v in params.items() if k != "vision"}


def _export_of(cfg: ModelConfig) -> HFExport:
    try:
        return HF_EXPORTS[cfg.family]
    except KeyError:
        raise NotImplementedError(f"export to Hugging Face is not supported for {cfg.family} models yet (supported: "
                                  f"{', '.join(sorted(HF_EXPORTS))})") from None


def _diff(a, b, at: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a for d in _diff(a[k], b.get(k), f"{at}.{k}" if at else k)]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at} {a!r} (read back as {b!r})"]


TOKEN_FIELDS = ("bos_token_id", "eos_token_ids", "pad_token_id")


def hf_config(cfg: ModelConfig, dtype: str | None = None) -> dict:
    """The config.json of `cfg` in its family's HF spelling, checked: the family's import reads it back as `cfg`
    (token ids aside: a family default the config cannot express is logged). ValueError naming the fields an HF
    config of this family cannot express (e.g. a layer plan its layer_types cannot spell)."""
    exp = _export_of(cfg)
    out = {"architectures": [exp.architecture], "model_type": exp.model_type, **exp.config(cfg)}
    if dtype is not None:
        out["dtype"] = dtype
    try:
        back = families.config_from_hf(out, "the exported config.json")
    except ValueError as e:
        raise ValueError(f"this {cfg.family} model cannot be written as a {exp.model_type} config.json: {e}") from None
    ids = {f: getattr(cfg, f) for f in TOKEN_FIELDS}
    if (got := dataclasses.replace(back, **ids)) != cfg:
        d = _diff(cfg.to_dict(), got.to_dict())
        raise ValueError(f"this {cfg.family} model cannot be written as a {exp.model_type} config.json: "
                         f"{'; '.join(d[:3])}" + (f" and {len(d) - 3} more" if len(d) > 3 else ""))
    if any(getattr(back, f) != v for f, v in ids.items()):
        log.warning("the exported config.json reads back with other token ids (%s) than the model's (%s)",
                    {f: getattr(back, f) for f in TOKEN_FIELDS}, ids)
    return out


def generation_config(cfg: ModelConfig) -> dict:
    eos = cfg.eos_token_ids
    ids = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else list(eos) or None,
           "pad_token_id": cfg.pad_token_id}
    return {k: v for k, v in ids.items() if v is not None}


# ----------------------------------------------------------------------------------------------- tokenizer
def save_tokenizer(tok, directory: Path, pad_token_id: int | None = None) -> None:
    """tokenizer.json and an HF tokenizer_config.json (PreTrainedTokenizerFast) that tokenize as `tok` does: a BOS
    that our Tokenizer prepends itself (add_bos) is put into the tokenizer's post-processor, where HF looks for it."""
    import tokenizers
    from tokenizers import processors

    t = tokenizers.Tokenizer.from_str(tok.tok.to_str())
    bos, bos_id = tok.bos_token, tok.bos_id
    if tok.add_bos and bos_id is not None and t.encode("").ids[:1] != [bos_id]:
        add = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                            special_tokens=[(bos, bos_id)])
        t.post_processor = add if t.post_processor is None else processors.Sequence([t.post_processor, add])
    t.save(str(directory / "tokenizer.json"))
    pad = None if pad_token_id is None else t.id_to_token(pad_token_id)
    meta = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": tok.eos_token,
            "pad_token": pad, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template}
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None},
                                                                indent=1))


# ----------------------------------------------------------------------------------------------- the directory
def check_destination(dst: str | Path, src: str | Path | None = None, overwrite: bool = False) -> Path:
    """convert's rules (orbax_io.check_destination) for an export: the absolute destination if writing there loses
    nothing, else FileExistsError / ValueError naming why. Never the source or a directory that contains it; an
    existing destination only with overwrite, and then only an earlier export or an empty directory."""
    from converters import orbax_io

    dst = Path(dst).absolute()
    try:
        return orbax_io.check_destination(dst, src)  # absent; the source or a directory around it: ValueError
    except FileExistsError:
        pass
    if not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --force to replace an earlier export)")
    if dst.is_symlink() or not dst.is_dir():
        raise FileExistsError(f"{dst} is not a directory; --force replaces only an earlier export or an empty "
                              f"directory")
    if any(dst.iterdir()) and not is_export(dst):
        raise FileExistsError(f"{dst} is a non-empty directory that is not an earlier export: --force replaces only "
                              f"an earlier export or an empty directory")
    return dst


def write(dst: str | Path, cfg: ModelConfig, params: dict, tokenizer=None, dtype: str | None = None,
          overwrite: bool = False, src: str | Path | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE,
          generation: dict | None = None, progress: bool = True) -> Path:
    """Write the HF directory `dst` of a model (config, params as imported, tokenizer or None). Everything is
    checked (config, names, shapes) before the first byte; nothing is left at dst if anything fails.
    generation: the generation_config.json to write (default: the model's token ids)."""
    from converters import orbax_io
    from jaxmodels import checkpoint

    max_bytes = shard_bytes(max_shard_size)
    cfg, params = text_part(cfg, params)
    tensors = plan_export(cfg, params, dtype)
    dtypes = sorted({str(t.dtype) for t in tensors}, key=[str(t.dtype) for t in tensors].count)
    config = hf_config(cfg, dtype or dtypes[-1])
    checkpoint.check_shapes(cfg, {p: (a.shape, str(a.dtype)) for p, a in flatten(params).items()})
    groups = shards(tensors, max_bytes)
    names = [SINGLE] if len(groups) == 1 else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                                               for k in range(len(groups))]
    dst = check_destination(dst, src, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    orbax_io.remove_stale(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        os.chmod(tmp, 0o777 & ~orbax_io.umask())  # mkdtemp makes it 0700; the output follows the umask
        (tmp / orbax_io.OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        with tqdm(total=len(tensors), desc="export", unit="tensor", disable=not progress, leave=False) as bar:
            def value(t: Tensor) -> np.ndarray:
                bar.update()
                return tensor_value(t, params)

            for name, group in zip(names, groups):
                write_safetensors(tmp / name, group, value)
        if len(groups) > 1:
            index = {"metadata": {"total_parameters": sum(math.prod(t.shape) for t in tensors),
                                  "total_size": sum(t.nbytes for t in tensors), **EXPORT_MARK},
                     "weight_map": dict(sorted((t.name, n) for n, g in zip(names, groups) for t in g))}
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(cfg) if generation is None
                                                               else generation, indent=2))
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp, cfg.pad_token_id)
        (tmp / orbax_io.OWNER).unlink()
        orbax_io.sync(tmp)
        orbax_io.move_in(tmp, dst, (lambda d: check_destination(d, src, True)) if overwrite else None, "exporting")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
