"""Qwen3-MoE: Qwen3 attention; softmax over all experts -> top-k -> optional renormalisation.
Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
import dataclasses

from jaxmodels.config import LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c, qwen3

NAMES = {
    **c.LLAMA_NAMES,
    r"model\.layers\.{i}\.mlp\.gate\.weight": ("mlp/router", "T"),
    r"model\.layers\.{i}\.mlp\.experts\.{e}\.gate_proj\.weight": ("mlp/w_gate", "T"),
    r"model\.layers\.{i}\.mlp\.experts\.{e}\.up_proj\.weight": ("mlp/w_up", "T"),
    r"model\.layers\.{i}\.mlp\.experts\.{e}\.down_proj\.weight": ("mlp/w_down", "T"),
}


def config(hf: dict) -> ModelConfig:
    hf = {"max_position_embeddings": 32768, **hf}
    act = c.activation(hf.get("hidden_act", "silu"))
    dense = MLPSpec(activation=act, intermediate_size=hf.get("intermediate_size", 6144))
    E = hf.get("num_experts", hf.get("num_local_experts", 128))  # v5 writes num_local_experts
    sparse = MLPSpec(kind="moe", activation=act, intermediate_size=hf.get("moe_intermediate_size", 768),
                     num_experts=E, top_k=hf.get("num_experts_per_tok", 8), router="softmax_topk",
                     renormalize=hf.get("norm_topk_prob", False)) if E else None
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    # HF Qwen3-MoE: one window for every layer, set iff use_sliding_window (max_window_layers is not read)
    sliding = ["sliding_attention" if hf.get("use_sliding_window", False) else "full_attention"]
    attn = qwen3.attention_specs({**hf, "layer_types": sliding * hf["num_hidden_layers"]})
    layers = tuple(
        LayerSpec(attention=a, mlp=sparse if sparse and i not in only and (i + 1) % step == 0 else dense)
        for i, a in enumerate(attn))
    base = qwen3.config({**hf, "intermediate_size": dense.intermediate_size})
    return dataclasses.replace(base, family="qwen3_moe", layers=layers)
