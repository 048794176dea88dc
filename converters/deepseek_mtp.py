"""DeepSeek V4 MTP / V4.1 DSpark checkpoint tensors (`mtp.N.*`) -> params["mtp"] (specs/deepseek_v4.md §8, §10.1).

The backbone importer (converters/deepseek.py) leaves `mtp.*` out; this reads it, in DeepSeek's bare names or
HF's `model.mtp.*` spelling, with the same renames, FP8/FP4 dequantisation and checks. A block's layer-style
tensors (`mtp.N.attn.*`, `mtp.N.ffn.*`, `mtp.N.hc_*`, norms) follow the backbone's rules as if they were
`layers.N.*`; the MTP-only ones are listed in RULES below. `mtp.N.embed/head` are the backbone's own (CONV41
drops them) and are skipped, as is `ffn.gate.bias_vl` (vision routing). Every name and shape is checked before
any tensor data is read.
"""
from __future__ import annotations

import logging
import re

import numpy as np

from converters import deepseek as dsc
from converters.hf import np_dtype, unflatten
from converters.safetensors_io import CheckpointError
from jaxmodels import deepseek_mtp
from jaxmodels.families.deepseek_v4 import DeepseekConfig

log = logging.getLogger(__name__)

M = r"mtp\.(?P<m>\d+)\."
RULES = [(re.compile(rx + r"\Z"), path, t) for rx, path, t in [  # MTP-only tensors -> (param path, transform)
    (M + r"main_proj\.weight", "mtp/{m}/main_proj", "T"),  # V4.1 DSpark stage 0
    (M + r"(?P<x>main_norm|norm|enorm|hnorm)\.weight", "mtp/{m}/{x}", "copy"),
    (M + r"markov_head\.embed\.weight", "mtp/{m}/markov_head/embed", "copy"),  # [V, R], looked up by id
    (M + r"markov_head\.head\.weight", "mtp/{m}/markov_head/head", "T"),
    (M + r"confidence_head\.proj\.weight", "mtp/{m}/confidence_head/proj", "T"),
    (M + r"(?P<x>e_proj|h_proj)\.weight", "mtp/{m}/{x}", "T"),  # V4 classic MTP
    (M + r"hc_head_(?P<x>fn|base|scale)", "mtp/{m}/hc_head/{x}", "copy"),
]]
SHARED = re.compile(M + r"(embed|embed_tokens|head|lm_head)\.weight\Z")  # the backbone's embed / head
SKIP = re.compile(M + r"ffn\.gate\.bias_vl\Z")


def _match(canon: str):
    """Param path, expert index (or None) and transform of one canonical mtp.* name, or None."""
    for rx, path, t in RULES:
        m = rx.match(canon)
        if m:
            return path.format(**m.groupdict()), None, t
    inner = dsc._match("layers." + canon[len("mtp."):])  # layer-style tensors: the backbone's rules
    if inner is None:
        return None
    path, expert, t = inner
    return "mtp/" + path[len("layers/"):], expert, t


def mtp_plan(reader, cfg: DeepseekConfig) -> list[tuple[str, str | None, str, int | None, str]]:
    """[(weight name, scale name or None, param path, expert or None, transform)] of the mtp.* tensors;
    raises CheckpointError for unexpected, misshaped, duplicated or missing ones."""
    shapes = dsc._flat(deepseek_mtp.mtp_param_shapes(cfg))
    names = {c: k for k in reader.keys() if (c := dsc.canonical(k)).startswith("mtp.")}
    if names and not shapes:
        raise CheckpointError(f"the checkpoint has {len(names)} mtp.* tensors (e.g. {next(iter(names.values()))!r}) "
                              f"but this {cfg.family} config has no MTP layers"
                              + (" (DSpark needs dspark_block_size > 0)" if cfg.v41 and cfg.mtp_layers else ""))
    out, filled, skipped = [], set(), 0
    for canon, raw in names.items():
        if canon.endswith(".scale") and canon[: -len(".scale")] + ".weight" in names:
            continue  # consumed with its weight
        if SHARED.match(canon) or SKIP.match(canon):
            skipped += 1
            continue
        mt = _match(canon)
        if mt is None:
            raise CheckpointError(f"unexpected tensor {raw!r}: no MTP parameter of a {cfg.family} model takes it")
        path, expert, t = mt
        if path not in shapes:
            raise CheckpointError(f"unexpected tensor {raw!r}: this {cfg.family} config has no MTP parameter {path}")
        want = shapes[path][1:] if expert is not None else shapes[path]
        if expert is not None and expert >= shapes[path][0]:
            raise CheckpointError(f"unexpected tensor {raw!r}: expert {expert} of {shapes[path][0]} "
                                  "(the MTP blocks' count is dspark_n_routed_experts, else n_routed_experts)")
        scale = names.get(canon[: -len(".weight")] + ".scale") if canon.endswith(".weight") else None
        got = dsc._logical_shape(reader, raw, scale)
        expect = dsc._source_shape(t, want, cfg)
        if got != expect:
            raise CheckpointError(f"tensor {raw!r} has shape {got}, expected {expect}")
        if (path, expert) in filled:
            raise CheckpointError(f"tensor {raw!r} maps to {path} which was already filled")
        filled.add((path, expert))
        out.append((raw, scale, path, expert, t))
    missing = [p for p, s in shapes.items()
               if not ((p, None) in filled or (p.endswith(("w_gate", "w_up", "w_down")) and "/shared/" not in p
                                               and all((p, e) in filled for e in range(s[0]))))]
    if missing:
        raise CheckpointError(f"missing {len(missing)} MTP tensors, e.g. {', '.join(missing[:3])} "
                              "(load without MTP to skip them)")
    if skipped:
        log.info("left out %d mtp.* tensors shared with the backbone (embed, head) or unused (bias_vl)", skipped)
    return out


def import_mtp(reader, cfg: DeepseekConfig, dtype: str = "float32", keep_quantized: bool = False) -> dict:
    """Host params {"mtp": {...}} (empty dict when the config has no MTP and the checkpoint none either).

    keep_quantized: FP8 linears and FP4 experts stay as their bytes, in the layout converters/deepseek.py's
    import_params uses ({"fp8"|"fp4": uint8, "scale": E8M0 uint8}, [out, in]), expanded inside the matmul."""
    target = np_dtype(dtype)
    shapes = dsc._flat(deepseek_mtp.mtp_param_shapes(cfg))
    out: dict = {}
    for name, scale, path, expert, t in mtp_plan(reader, cfg):
        if keep_quantized and scale is not None and t == "T":
            q = {"fp4" if dsc._is_packed(reader, name, scale) else "fp8": dsc._raw(reader.get(name)),
                 "scale": dsc._raw(reader.get(scale))}
            if expert is None:
                out[path] = q
            else:
                slot = out.setdefault(path, {k: np.zeros((shapes[path][0], *v.shape), np.uint8) for k, v in q.items()})
                for k, v in q.items():
                    slot[k][expert] = v
            continue
        v = dsc._value(reader, name, scale, t, cfg)
        v = v.astype(np.float32 if dsc.keeps_fp32(path) else target)  # as in the backbone
        if expert is None:
            out[path] = v
        else:
            if path not in out:
                out[path] = np.zeros(shapes[path], target)
            out[path][expert] = v
    return unflatten(out)
