"""Llama 3.x (and any `llama` checkpoint: SmolLM2, TinyLlama, ...)."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = c.LLAMA_NAMES


def config(hf: dict) -> ModelConfig:
    H, K, d = c.heads(hf)
    max_pos = hf.get("max_position_embeddings", 2048)
    bias = hf.get("attention_bias", False)
    layer = LayerSpec(
        attention=AttentionSpec(rope=c.rope_spec(c.rope_params(hf), 10000.0, max_pos), qkv_bias=bias, out_bias=bias),
        mlp=MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"],
                    bias=hf.get("mlp_bias", False)),
    )
    return ModelConfig(
        family="llama", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=d, layers=(layer,) * hf["num_hidden_layers"], norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False), max_position_embeddings=max_pos,
        **c.token_ids(hf, bos=1, eos=(2,)),
    )
