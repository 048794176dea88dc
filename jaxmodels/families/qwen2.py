"""Qwen2 / Qwen2.5: Llama's layout with biases on q/k/v (none on the output projection); optional sliding layers
(HF Qwen2Config: with use_sliding_window, layers i >= max_window_layers slide, unless layer_types says otherwise)."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = c.LLAMA_NAMES


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return ["full_attention"] * n
    mwl = hf.get("max_window_layers", 28)
    return ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]


def config(hf: dict) -> ModelConfig:
    H, K, d = c.heads(hf)
    max_pos = hf.get("max_position_embeddings", 32768)
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    rope = c.rope_spec(c.rope_params(hf), 10000.0, max_pos)
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"])
    layers = tuple(LayerSpec(attention=AttentionSpec(window=window if t == "sliding_attention" else None, rope=rope,
                                                     qkv_bias=True, out_bias=False), mlp=mlp)
                   for t in layer_types(hf))
    return ModelConfig(
        family="qwen2", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=d, layers=layers, norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False), max_position_embeddings=max_pos, **c.token_ids(hf),
    )
