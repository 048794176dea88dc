"""DeepSeek V4 / V4.1 checkpoints -> jaxmodels params (specs/deepseek_v4.md §10).

Reads DeepSeek's own layout (`embed.weight`, `layers.N.attn.*`, `layers.N.ffn.experts.E.w{1,2,3}`, `hc_*`,
`engram.*`, `head.weight`) and the HF layout written by transformers' `save_pretrained` (the same leaf names
under `model.`). FP8 e4m3 weights with E8M0 block scales, MXFP4 experts (packed int8 + E8M0 per 32) and the
per-row FP8 Engram tables are dequantised tensor by tensor (converters/deepseek_quant.py); `wo_a` is rounded
to bf16 at load as the reference does. Vision weights, `bias_vl`, MTP (unless asked for) are left out with a
log line. Every name and shape is checked before any tensor data is read.
"""
from __future__ import annotations

import logging
import re

import numpy as np
from tqdm.auto import tqdm

from converters import deepseek_quant as dq
from converters.hf import np_dtype, unflatten
from converters.safetensors_io import CheckpointError
from jaxmodels import deepseek
from jaxmodels.families.deepseek_v4 import DeepseekConfig

log = logging.getLogger(__name__)

# HF / vLLM spellings -> DeepSeek's own names
RENAMES = ((r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^hc_head\.hc_", "hc_head_"),
           (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."), (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
           (r"\.e_score_correction_bias$", ".bias"), (r"\.weight_scale_inv$", ".scale"))

SKIP = (r"vision\..*", r"aligner\..*", r"image_(start|end|newline).*", r".*\.ffn\.gate\.bias_vl", r"mtp\..*")

L = r"layers\.(?P<i>\d+)\."
E = r"experts\.(?P<e>\d+)\."
RULES = [  # canonical name -> (param path, transform)
    (r"embed\.weight", "embed", "copy"),
    (r"head\.weight", "head", "T"),
    (r"norm\.weight", "norm", "copy"),
    (r"hc_head_(?P<x>fn|base|scale)", "hc_head/{x}", "copy"),
    (L + r"(?P<x>attn_norm|ffn_norm)\.weight", "layers/{i}/{x}", "copy"),
    (L + r"hc_(?P<s>attn|ffn)_(?P<x>fn|base|scale)", "layers/{i}/hc_{s}/{x}", "copy"),
    (L + r"attn\.(?P<x>wq_a|wq_b|wkv|wo_b)\.weight", "layers/{i}/attn/{x}", "T"),
    (L + r"attn\.(?P<x>q_norm|kv_norm)\.weight", "layers/{i}/attn/{x}", "copy"),
    (L + r"attn\.wo_a\.weight", "layers/{i}/attn/wo_a", "wo_a"),
    (L + r"attn\.attn_sink", "layers/{i}/attn/sink", "copy"),
    (L + r"attn\.(?P<c>(indexer\.)?compressor)\.(?P<x>wkv|wgate)\.weight", "layers/{i}/attn/{c}/{x}", "T"),
    (L + r"attn\.(?P<c>(indexer\.)?compressor)\.norm\.weight", "layers/{i}/attn/{c}/norm", "copy"),
    (L + r"attn\.(?P<c>(indexer\.)?compressor)\.ape", "layers/{i}/attn/{c}/ape", "copy"),
    (L + r"attn\.indexer\.(?P<x>wq_b|weights_proj|wk)\.weight", "layers/{i}/attn/indexer/{x}", "T"),
    (L + r"attn\.indexer\.k_norm\.weight", "layers/{i}/attn/indexer/k_norm", "copy"),
    (L + r"ffn\.gate\.weight", "layers/{i}/ffn/gate", "T"),
    (L + r"ffn\.gate\.bias", "layers/{i}/ffn/bias", "copy"),
    (L + r"ffn\.gate\.tid2eid", "layers/{i}/ffn/tid2eid", "int"),
    (L + r"ffn\." + E + r"w1\.weight", "layers/{i}/ffn/w_gate", "T"),
    (L + r"ffn\." + E + r"w3\.weight", "layers/{i}/ffn/w_up", "T"),
    (L + r"ffn\." + E + r"w2\.weight", "layers/{i}/ffn/w_down", "T"),
    (L + r"ffn\.shared_experts\.w1\.weight", "layers/{i}/ffn/shared/w_gate", "T"),
    (L + r"ffn\.shared_experts\.w3\.weight", "layers/{i}/ffn/shared/w_up", "T"),
    (L + r"ffn\.shared_experts\.w2\.weight", "layers/{i}/ffn/shared/w_down", "T"),
    (L + r"engram\.embed\.weight", "layers/{i}/engram/table", "copy"),
    (L + r"engram\.wkv\.weight", "layers/{i}/engram/wkv", "T"),
    (L + r"engram\.(?P<x>q_weight|k_weight)", "layers/{i}/engram/{x}", "copy"),
]
RULES = [(re.compile(rx + r"\Z"), path, t) for rx, path, t in RULES]
SKIP_RX = [re.compile(p + r"\Z") for p in SKIP]


def canonical(name: str) -> str:
    for rx, repl in RENAMES:
        name = re.sub(rx, repl, name)
    return name


def _match(name: str):
    for rx, path, t in RULES:
        m = rx.match(name)
        if m:
            g = m.groupdict()
            return path.format(**{k: (v or "").rstrip(".").replace(".", "/") for k, v in g.items()}), \
                int(g["e"]) if g.get("e") is not None else None, t
    return None


def plan(reader, cfg: DeepseekConfig) -> list[tuple[str, str | None, str, int | None, str]]:
    """[(weight name, scale name or None, param path, expert or None, transform)]; checks names and shapes."""
    names = {canonical(k): k for k in reader.keys()}
    out, skipped = plan_tensors(reader, cfg, names, _flat(deepseek.param_shapes(cfg)), _match,
                                lambda c: any(rx.match(c) for rx in SKIP_RX), ignore=("engram_map",))
    if skipped:
        log.info("left out %d checkpoint tensors a text-only %s does not use (vision, bias_vl, MTP)", skipped,
                 cfg.family)
    return out


def plan_tensors(reader, cfg: DeepseekConfig, names: dict, shapes: dict, match, skip, what: str = "",
                 expert_hint: str = "", missing_hint: str = "", ignore=()) -> tuple[list, int]:
    """The checks every DeepSeek importer runs before reading data (backbone here, MTP in deepseek_mtp.py).

    names: canonical -> checkpoint name; shapes: flat param path -> shape; match(canonical) -> (path, expert,
    transform) or None; skip(canonical): left out on purpose. Returns (placements as `plan`, number skipped);
    raises CheckpointError for unexpected, misshaped, duplicated or missing tensors (`what` names the kind)."""
    out, filled, skipped = [], set(), 0
    for canon, raw in names.items():
        if canon.endswith(".scale") and canon[: -len(".scale")] + ".weight" in names:
            continue  # consumed with its weight
        if skip(canon):
            skipped += 1
            continue
        m = match(canon)
        if m is None:
            raise CheckpointError(f"unexpected tensor {raw!r}: no {what}parameter of a {cfg.family} model takes it")
        path, expert, t = m
        if path not in shapes:
            raise CheckpointError(f"unexpected tensor {raw!r}: this {cfg.family} config has no {what}parameter {path}")
        want = shapes[path][1:] if expert is not None else shapes[path]
        if expert is not None and expert >= shapes[path][0]:
            raise CheckpointError(f"unexpected tensor {raw!r}: expert {expert} of {shapes[path][0]}{expert_hint}")
        scale = names.get(canon[: -len(".weight")] + ".scale") if canon.endswith(".weight") else None
        got = _logical_shape(reader, raw, scale)
        expect = _source_shape(t, want, cfg)
        if got != expect:
            raise CheckpointError(f"tensor {raw!r} has shape {got}, expected {expect}")
        if (path, expert) in filled:
            raise CheckpointError(f"tensor {raw!r} maps to {path} which was already filled")
        filled.add((path, expert))
        out.append((raw, scale, path, expert, t))
    missing = [p for p, s in shapes.items() if p not in ignore
               and not ((p, None) in filled or (p.endswith(("w_gate", "w_up", "w_down")) and "/shared/" not in p
                                                 and all((p, e) in filled for e in range(s[0]))))]
    if missing:
        raise CheckpointError(f"missing {len(missing)} {what}tensors, e.g. {', '.join(missing[:3])}{missing_hint}")
    return out, skipped


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = tuple(v)
    return out


def _logical_shape(reader, name, scale) -> tuple[int, ...]:
    shape = tuple(reader.shape(name))
    if scale is not None and len(shape) == 2 and _is_packed(reader, name, scale):
        return shape[0], shape[1] * 2  # two FP4 codes per byte
    return shape


def _is_packed(reader, name, scale) -> bool:
    """MXFP4 experts: int8 [O, I/2] with one scale per 32 of the I inputs."""
    w, s = tuple(reader.shape(name)), tuple(reader.shape(scale))
    return s[0] == w[0] and s[1] * 16 == w[1]


def _source_shape(t: str, want: tuple[int, ...], cfg: DeepseekConfig) -> tuple[int, ...]:
    if t == "T":
        return tuple(reversed(want))
    if t == "wo_a":  # [G, H*d/G, Ro] <- [G*Ro, H*d/G]
        return (want[0] * want[2], want[1])
    return tuple(want)


def _value(reader, name, scale, t, cfg: DeepseekConfig) -> np.ndarray:
    """The float32 (int32 for tables) value of one checkpoint tensor, dequantised if it has a scale."""
    w = reader.get(name)
    if scale is not None:
        s = reader.get(scale)
        if _is_packed(reader, name, scale):
            w = dq.dequant_fp4_experts(w, s)
        elif ".engram.embed." in canonical(name):
            w = dq.dequant_fp8_rows(w, s)
        elif t == "wo_a":
            w = dq.dequant_wo_a(w, s, _block(w, s))
        else:
            w = dq.dequant_fp8_blocks(w, s, _block(w, s))
    if t == "int":
        return np.asarray(w).astype(np.int32)
    w = np.asarray(w).astype(np.float32) if np.asarray(w).dtype != np.float32 else np.asarray(w)
    if t == "T":
        return w.T
    if t == "wo_a":
        G = cfg.o_groups
        return w.reshape(G, cfg.o_lora_rank, -1).transpose(0, 2, 1)
    return w


def _block(w, s) -> int:
    """The square block size implied by a weight and its scale grid (32 in V4.1, 128 in V4)."""
    for b in (32, 128, 64, 16):
        if (-(-w.shape[0] // b), -(-w.shape[1] // b)) == tuple(s.shape):
            return b
    raise CheckpointError(f"scale grid {tuple(s.shape)} does not tile a weight of shape {tuple(w.shape)}")


def import_params(reader, cfg: DeepseekConfig, dtype: str = "float32", progress: bool = True,
                  token_map: np.ndarray | None = None, keep_quantized: bool = False) -> dict:
    """Host params, each tensor read (memory-mapped), dequantised and placed once.

    keep_quantized: FP8 linears and FP4 experts stay as their bytes ({"fp8"|"fp4": uint8, "scale": E8M0 uint8},
    checkpoint [out, in] layout) and are expanded inside the matmul (jaxmodels.deepseek.dequant); Engram's wkv and
    tables stay FP8 as `wkv` + `wkv_scale`, `table` + `table_scale` (layers/engram.py); wo_a is dequantised.
    """
    placements = tqdm(plan(reader, cfg), desc="import", unit="tensor", disable=not progress, leave=False)
    out = load_tensors(reader, cfg, placements, _flat(deepseek.param_shapes(cfg)), dtype, keep_quantized)
    if cfg.engram_layer_ids:
        if token_map is None:
            raise CheckpointError("this model uses Engram, which needs the tokenizer (tokenizer.json) to build its "
                                  "compressed-vocabulary map; none was found")
        out["engram_map"] = np.asarray(token_map, np.int32)
    return unflatten(out)  # a kept-quantized param is itself a small dict under its path


def load_tensors(reader, cfg: DeepseekConfig, placements, shapes: dict, dtype: str, keep_quantized: bool) -> dict:
    """Read, dequantise (or keep as bytes) and stack the planned tensors: {param path: value} (see import_params)."""
    target = np_dtype(dtype)
    out: dict = {}
    for name, scale, path, expert, t in placements:
        if keep_quantized and scale is not None and path.endswith(("engram/wkv", "engram/table")):
            # engram_inject's own layout: FP8 bytes + E8M0 bytes beside them; the table rows are expanded after the
            # gather, so the 384M-row tables stay 1 byte per value
            out[path], out[path + "_scale"] = _raw(reader.get(name)), _raw(reader.get(scale))
            continue
        if keep_quantized and scale is not None and t == "T":
            q = {"fp4" if _is_packed(reader, name, scale) else "fp8": _raw(reader.get(name)),
                 "scale": _raw(reader.get(scale))}
            if expert is None:
                out[path] = q
            else:
                E = shapes[path][0]
                slot = out.setdefault(path, {k: np.zeros((E, *v.shape), np.uint8) for k, v in q.items()})
                for k, v in q.items():
                    slot[k][expert] = v
            continue
        v = _value(reader, name, scale, t, cfg)
        v = v.astype(np.int32 if t == "int" else (np.float32 if keeps_fp32(path) else target))
        if expert is None:
            out[path] = v
        else:
            if path not in out:
                out[path] = np.zeros(shapes[path], target)
            out[path][expert] = v
    return out


def keeps_fp32(path: str) -> bool:
    """Parameters the checkpoint and the reference keep in fp32 whatever the model dtype (spec §10): mHC
    mixes, attention sinks, the selection-only router bias (bf16 would flip near-tied picks), compressor `ape`."""
    leaf = path.rsplit("/", 1)[-1]
    return "/hc_" in path or path.startswith("hc_") or leaf in ("sink", "ape") or path.endswith("ffn/bias")


def _raw(a) -> np.ndarray:
    """The bytes of an FP8 / FP4 / E8M0 tensor as uint8, never numerically cast."""
    a = np.ascontiguousarray(a)
    if a.dtype.itemsize != 1:
        raise CheckpointError(f"expected a 1-byte quantized tensor, got {a.dtype}")
    return a.view(np.uint8)
