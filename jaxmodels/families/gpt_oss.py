"""GPT-OSS: alternating sliding (layer 0) / full layers, per-head sinks, YaRN, q/k/v/o biases,
top-k-then-softmax router with bias, clamped SwiGLU experts with interleaved gate/up columns.
Experts come unquantized ([E, in, out]) or as MXFP4 blocks + scales (converters.quant), in HF's
layout or in OpenAI's original one (`original/`: fused qkv, `block.N.*` names, its own config keys)."""
import numpy as np

from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if r"\.mlp\." not in k},  # the keys are regexes
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


# --- OpenAI's original checkpoint (gpt_oss/torch/weights.py; the mapping of convert_gpt_oss_weights_to_hf.py)
def is_original(cfg_json: dict) -> bool:
    return "model_type" not in cfg_json and "rope_ntk_alpha" in cfg_json


def config_original(o: dict) -> ModelConfig:
    yarn = {"rope_type": "yarn", "factor": o.get("rope_scaling_factor", 32.0), "beta_fast": o.get("rope_ntk_beta", 32.0),
            "beta_slow": o.get("rope_ntk_alpha", 1.0), "truncate": False,
            "original_max_position_embeddings": o.get("initial_context_length", 4096)}
    n = o["num_hidden_layers"]
    hf = {**o, "rope_scaling": yarn, "rope_theta": o.get("rope_theta", 150000.0),
          "num_local_experts": o["num_experts"], "num_experts_per_tok": o["experts_per_token"],
          "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]}
    return config(hf)


def original_names(cfg: ModelConfig) -> dict:
    H, K, d, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    qkv_rows = (H + 2 * K) * d
    bounds = {"q": (0, H * d), "k": (H * d, K * d), "v": ((H + K) * d, K * d)}

    def weight(part):  # [(H+2K)d, D] rows -> [D, heads, d]
        lo, n = bounds[part]
        return (lambda t: (qkv_rows, D), lambda x, t: np.ascontiguousarray(x[lo: lo + n].T).reshape(t))

    def bias(part):
        lo, n = bounds[part]
        return (lambda t: (qkv_rows,), lambda x, t: x[lo: lo + n].reshape(t))

    b = r"block\.{i}\."
    return {
        r"embedding\.weight": ("embed", "copy"),
        r"unembedding\.weight": ("lm_head", "T"),
        r"norm\.scale": ("final_norm", "copy"),
        b + r"attn\.norm\.scale": ("attn_norm", "copy"),
        b + r"attn\.qkv\.weight": tuple((f"attn/w{p}", weight(p)) for p in "qkv"),
        b + r"attn\.qkv\.bias": tuple((f"attn/b{p}", bias(p)) for p in "qkv"),
        b + r"attn\.sinks": ("attn/sinks", "copy"),
        b + r"attn\.out\.weight": ("attn/wo", "T_out"),
        b + r"attn\.out\.bias": ("attn/bo", "copy"),
        b + r"mlp\.norm\.scale": ("mlp_norm", "copy"),
        b + r"mlp\.gate\.weight": ("mlp/router", "T"),
        b + r"mlp\.gate\.bias": ("mlp/router_bias", "copy"),
        b + r"mlp\.mlp1_weight": (("mlp/w_gate", "even_cols"), ("mlp/w_up", "odd_cols")),
        b + r"mlp\.mlp1_bias": (("mlp/b_gate", "even_cols"), ("mlp/b_up", "odd_cols")),
        b + r"mlp\.mlp2_weight": ("mlp/w_down", "copy"),
        b + r"mlp\.mlp2_bias": ("mlp/b_down", "copy"),
    }
