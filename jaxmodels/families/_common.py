"""Helpers that read HF config.json dicts and the name map shared by Llama-style checkpoints."""
from __future__ import annotations

import numpy as np

from jaxmodels.config import RopeSpec

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu": "gelu"}


def activation(name: str) -> str:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported hidden activation {name!r}") from None


def heads(hf: dict) -> tuple[int, int, int]:
    """(num_heads, num_kv_heads, head_dim); kv heads fall back to heads, head_dim to hidden / heads, when absent
    (ModelConfig refuses what is out of range)."""
    H = hf["num_attention_heads"]
    K = H if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"]
    d = hf.get("head_dim") or (hf["hidden_size"] // H if H else 0)
    return H, K, d


def rope_params(hf: dict, layer_type: str | None = None) -> dict:
    """The rope dict of a config.json in either spelling: v5 `rope_parameters` (maybe per layer type)
    or v4 `rope_scaling` + top-level `rope_theta`."""
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and layer_type is not None and layer_type in rp:
        rp = rp[layer_type]
    if isinstance(rp, dict) and ("rope_type" in rp or "rope_theta" in rp):
        return dict(rp)
    out = dict(hf.get("rope_scaling") or {})
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    if "rope_theta" in hf:
        out["rope_theta"] = hf["rope_theta"]
    return out


def rope_spec(rp: dict, default_theta: float, max_position: int, interleaved: bool = False) -> RopeSpec:
    kind = rp.get("rope_type", "default")
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_type {kind!r}")
    return RopeSpec(
        theta=float(rp.get("rope_theta", default_theta)),
        kind=kind,
        factor=float(rp.get("factor", 1.0)),
        interleaved=interleaved,
        low_freq_factor=float(rp.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rp.get("high_freq_factor", 4.0)),
        # HF's dynamic NTK rescales against max_position_embeddings, never the "original" field
        original_max_position=max_position if kind == "dynamic" else rp.get("original_max_position_embeddings"),
        beta_fast=float(rp.get("beta_fast") or 32.0),
        beta_slow=float(rp.get("beta_slow") or 1.0),
        truncate=bool(rp.get("truncate", True)),
        attention_factor=rp.get("attention_factor"),
        mscale=rp.get("mscale"),
        mscale_all_dim=rp.get("mscale_all_dim"),
    )


def eos_ids(hf: dict) -> tuple[int, ...]:
    e = hf.get("eos_token_id")
    return () if e is None else tuple(e) if isinstance(e, (list, tuple)) else (e,)


def token_ids(hf: dict, bos=None, eos=(), pad=None) -> dict:
    """bos/eos/pad ids, falling back to the HF config class defaults."""
    return {"bos_token_id": hf.get("bos_token_id", bos), "eos_token_ids": eos_ids(hf) or tuple(eos),
            "pad_token_id": hf.get("pad_token_id", pad)}


# HF checkpoint name -> (param path, transform). "{i}" marks a decoder layer's index; layer paths are
# relative to that layer. Transforms are defined in converters/transforms.py.
LLAMA_NAMES = {
    r"model\.embed_tokens\.weight": ("embed", "copy"),
    r"model\.norm\.weight": ("final_norm", "copy"),
    r"lm_head\.weight": ("lm_head", "T"),
    r"model\.layers\.{i}\.self_attn\.q_proj\.weight": ("attn/wq", "T"),
    r"model\.layers\.{i}\.self_attn\.k_proj\.weight": ("attn/wk", "T"),
    r"model\.layers\.{i}\.self_attn\.v_proj\.weight": ("attn/wv", "T"),
    r"model\.layers\.{i}\.self_attn\.o_proj\.weight": ("attn/wo", "T_out"),
    r"model\.layers\.{i}\.self_attn\.q_proj\.bias": ("attn/bq", "reshape"),
    r"model\.layers\.{i}\.self_attn\.k_proj\.bias": ("attn/bk", "reshape"),
    r"model\.layers\.{i}\.self_attn\.v_proj\.bias": ("attn/bv", "reshape"),
    r"model\.layers\.{i}\.self_attn\.o_proj\.bias": ("attn/bo", "copy"),
    r"model\.layers\.{i}\.self_attn\.q_norm\.weight": ("attn/q_norm", "copy"),
    r"model\.layers\.{i}\.self_attn\.k_norm\.weight": ("attn/k_norm", "copy"),
    r"model\.layers\.{i}\.mlp\.gate_proj\.weight": ("mlp/w_gate", "T"),
    r"model\.layers\.{i}\.mlp\.up_proj\.weight": ("mlp/w_up", "T"),
    r"model\.layers\.{i}\.mlp\.down_proj\.weight": ("mlp/w_down", "T"),
    r"model\.layers\.{i}\.mlp\.gate_proj\.bias": ("mlp/b_gate", "copy"),
    r"model\.layers\.{i}\.mlp\.up_proj\.bias": ("mlp/b_up", "copy"),
    r"model\.layers\.{i}\.mlp\.down_proj\.bias": ("mlp/b_down", "copy"),
    r"model\.layers\.{i}\.input_layernorm\.weight": ("attn_norm", "copy"),
    r"model\.layers\.{i}\.post_attention_layernorm\.weight": ("mlp_norm", "copy"),
}

# Multimodal and v5 wrappers put the text model under another prefix (specs/hf_families.md §5): the renames
# (regex, replacement) every family's checkpoint names go through unless it declares its own.
PREFIXES = ((r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
            (r"^language_model\.lm_head\.", "lm_head."))


def conv_patches(channels: int, *kernel: int) -> tuple:
    """The transform of a patchify conv [C, channels, *kernel] (kernel = stride, no padding): the matmul weight
    [channels * prod(kernel), C] of patches flattened in (channel, *kernel) order (specs/vision.md conventions)."""
    return (lambda t: (t[-1], channels, *kernel), lambda x, t: np.ascontiguousarray(x.reshape(x.shape[0], -1).T))


# Checkpoint entries that carry no parameters.
IGNORED = (r".*\.rotary_emb\.inv_freq",)
