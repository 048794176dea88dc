"""Qwen2 / Qwen2.5: Llama's layout with biases on q/k/v (none on the output projection); optional sliding layers.

Windows as transformers' Qwen2Config (5.24) reads them: sliding_window (4096 when the key is absent) counts only with
use_sliding_window (default false); layer_types, when absent, slide the layers i >= max_window_layers (default 28)
if a window is left; a sliding layer takes that window. Qwen's released config.json files keep sliding_window with
use_sliding_window false: no layer slides. layer_types marking sliding layers without a window (use_sliding_window
false) run as full attention, the window transformers' attention layers take (its mask builder refuses the model)."""
from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = c.LLAMA_NAMES


def window(hf: dict) -> int | None:
    return hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    mwl = hf.get("max_window_layers", 28)
    return ["sliding_attention" if window(hf) is not None and i >= mwl else "full_attention" for i in range(n)]


def config(hf: dict) -> ModelConfig:
    H, K, d = c.heads(hf)
    max_pos = hf.get("max_position_embeddings", 32768)
    w = window(hf)
    rope = c.rope_spec(c.rope_params(hf), 10000.0, max_pos)
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"])
    layers = tuple(LayerSpec(attention=AttentionSpec(window=w if t == "sliding_attention" else None, rope=rope,
                                                     qkv_bias=True, out_bias=False), mlp=mlp)
                   for t in layer_types(hf))
    return ModelConfig(
        family="qwen2", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=d, layers=layers, norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False), max_position_embeddings=max_pos, **c.token_ids(hf),
    )
