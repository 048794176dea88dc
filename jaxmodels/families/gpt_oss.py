"""GPT-OSS: alternating sliding (layer 0) / full layers, per-head sinks, YaRN, q/k/v/o biases,
top-k-then-softmax router with bias, clamped SwiGLU experts with interleaved gate/up columns.
Experts come unquantized ([E, in, out]) or as MXFP4 blocks + scales (converters.quant)."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if ".mlp." not in k},
    r"model\.layers\.{i}\.self_attn\.sinks": ("attn/sinks", "copy"),
    r"model\.layers\.{i}\.mlp\.router\.weight": ("mlp/router", "T"),
    r"model\.layers\.{i}\.mlp\.router\.bias": ("mlp/router_bias", "copy"),
    r"model\.layers\.{i}\.mlp\.experts\.gate_up_proj": (("mlp/w_gate", "even_cols"), ("mlp/w_up", "odd_cols")),
    r"model\.layers\.{i}\.mlp\.experts\.gate_up_proj_bias": (("mlp/b_gate", "even_cols"), ("mlp/b_up", "odd_cols")),
    r"model\.layers\.{i}\.mlp\.experts\.down_proj": ("mlp/w_down", "copy"),
    r"model\.layers\.{i}\.mlp\.experts\.down_proj_bias": ("mlp/b_down", "copy"),
}
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def config(hf: dict) -> ModelConfig:
    H, K, _ = c.heads(hf)
    d = hf.get("head_dim") or 64
    max_pos = hf.get("max_position_embeddings", 131072)
    rp = c.rope_params(hf)
    if rp.get("rope_type", "default") == "default" and "rope_scaling" not in hf and "rope_parameters" not in hf:
        rp = {**YARN, **rp}  # the class default
    rope = c.rope_spec(rp, 150000.0, max_pos)
    bias = hf.get("attention_bias", True)
    moe = MLPSpec(kind="moe", activation="swiglu_clamp", intermediate_size=hf.get("intermediate_size", 2880),
                  bias=True, clamp_alpha=hf.get("swiglu_alpha", 1.702), clamp_limit=hf.get("swiglu_limit", 7.0),
                  num_experts=hf.get("num_local_experts", hf.get("num_experts", 128)),
                  top_k=hf.get("num_experts_per_tok", hf.get("experts_per_token", 4)), router="topk_softmax",
                  router_bias=True)
    layers = tuple(
        LayerSpec(attention=AttentionSpec(window=hf.get("sliding_window", 128) if t == "sliding_attention" else None,
                                          rope=rope, qkv_bias=bias, out_bias=bias, sinks=True),
                  mlp=moe, norm="rms_fp32")
        for t in layer_types(hf))
    return ModelConfig(
        family="gpt_oss", vocab_size=hf.get("vocab_size", 201088), hidden_size=hf.get("hidden_size", 2880),
        num_heads=H, num_kv_heads=K, head_dim=d, layers=layers, norm="rms_fp32", norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False), max_position_embeddings=max_pos, **c.token_ids(hf),
    )
