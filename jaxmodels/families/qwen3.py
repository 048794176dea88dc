"""Qwen3 (dense): per-head RMS qk-norm before RoPE, explicit head_dim, optional sliding layers."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = c.LLAMA_NAMES


def layer_types(hf: dict) -> list[str]:
    """HF: layers i >= max_window_layers slide (despite the name), when sliding is on at all."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    if not hf.get("use_sliding_window", False):
        return ["full_attention"] * n
    mwl = hf.get("max_window_layers", 28)
    return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]


def attention_specs(hf: dict) -> list[AttentionSpec]:
    max_pos = hf.get("max_position_embeddings", 32768)
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    rope = c.rope_spec(c.rope_params(hf), 10000.0, max_pos)
    bias = hf.get("attention_bias", False)
    return [AttentionSpec(window=window if t == "sliding_attention" else None, rope=rope, qk_norm="rms",
                          qkv_bias=bias, out_bias=bias) for t in layer_types(hf)]


def config(hf: dict) -> ModelConfig:
    H, K, _ = c.heads(hf)
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"])
    return ModelConfig(
        family="qwen3", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=hf.get("head_dim") or 128, layers=tuple(LayerSpec(attention=a, mlp=mlp) for a in attention_specs(hf)),
        norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 32768), **c.token_ids(hf),
    )
