"""Cohere (Command-R) and Cohere2 (Command-R7B / A): parallel blocks with one bias-free LayerNorm,
interleaved RoPE, logit_scale, tied head. Cohere2 adds 3:1 sliding/full layers with NoPE full layers."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = {k: v for k, v in c.LLAMA_NAMES.items() if "post_attention_layernorm" not in k}


def _config(hf: dict, family: str, attn: list[AttentionSpec]) -> ModelConfig:
    H, K, d = c.heads({**hf, "head_dim": None})  # always hidden / heads
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"])
    return ModelConfig(
        family=family, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=d,
        layers=tuple(LayerSpec(attention=a, mlp=mlp, block="parallel", norm="layernorm") for a in attn),
        norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-5), tie_embeddings=hf.get("tie_word_embeddings", True),
        logit_scale=hf.get("logit_scale", 0.0625), max_position_embeddings=hf.get("max_position_embeddings", 8192),
        **c.token_ids(hf, bos=5, eos=(255001,), pad=0),
    )


def _rope(hf: dict):
    return c.rope_spec(c.rope_params(hf), 500000.0 if hf.get("model_type") == "cohere" else 10000.0,
                       hf.get("max_position_embeddings", 8192), interleaved=True)


def config(hf: dict) -> ModelConfig:
    bias = hf.get("attention_bias", False)
    qk = "layernorm" if hf.get("use_qk_norm", False) else None
    a = AttentionSpec(rope=_rope(hf), qk_norm=qk, qk_norm_per_head=True, qkv_bias=bias, out_bias=bias)
    return _config(hf, "cohere", [a] * hf["num_hidden_layers"])


def config2(hf: dict) -> ModelConfig:
    n, bias, rope = hf["num_hidden_layers"], hf.get("attention_bias", False), _rope(hf)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % hf.get("sliding_window_pattern", 4) else "full_attention" for i in range(n)]
    attn = [AttentionSpec(window=hf.get("sliding_window", 4096), rope=rope, qkv_bias=bias, out_bias=bias)
            if t == "sliding_attention" else AttentionSpec(rope=None, qkv_bias=bias, out_bias=bias)
            for t in types[:n]]
    return _config(hf, "cohere2", attn)
