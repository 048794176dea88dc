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


from converters import deepseek as dsc
from converters.hf import unflatten
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
    out, skipped = dsc.plan_tensors(
        reader, cfg, names, shapes, _match, lambda c: bool(SHARED.match(c) or SKIP.match(c)), what="MTP ",
        expert_hint=" (the MTP blocks' count is dspark_n_routed_experts, else n_routed_experts)",
        missing_hint=" (load without MTP to skip them)")
    if skipped:
        log.info("left out %d mtp.* tensors shared with the backbone (embed, head) or unused (bias_vl)", skipped)
    return out


def import_mtp(reader, cfg: DeepseekConfig, dtype: str = "float32", keep_quantized: bool = False) -> dict:
    """Host params {"mtp": {...}} (empty dict when the config has no MTP and the checkpoint none either).

    keep_quantized: FP8 linears and FP4 experts stay as their bytes, in the layout converters/deepseek.py's
    import_params uses ({"fp8"|"fp4": uint8, "scale": E8M0 uint8}, [out, in]), expanded inside the matmul."""
    shapes = dsc._flat(deepseek_mtp.mtp_param_shapes(cfg))
    return unflatten(dsc.load_tensors(reader, cfg, mtp_plan(reader, cfg), shapes, dtype, keep_quantized))
