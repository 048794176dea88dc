"""Gemma3 text decoder (`gemma3_text`, and the text part of `gemma3` multimodal checkpoints).

5:1 sliding/full plan, local RoPE θ=1e4 and global RoPE with its own scaling, sandwich (1+w) RMS
norms, per-head (1+w) qk-norm, query_pre_attn_scalar, √hidden embedding scale rounded to the weight
dtype, and the final softcap of Gemma3ForCausalLM. HF never applies `attn_logit_softcapping` in
Gemma3 (specs §3.6), so neither do we.
"""
import math

from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if "post_attention_layernorm" not in k},
    r"model\.layers\.{i}\.post_attention_layernorm\.weight": ("post_attn_norm", "copy"),
    r"model\.layers\.{i}\.pre_feedforward_layernorm\.weight": ("mlp_norm", "copy"),
    r"model\.layers\.{i}\.post_feedforward_layernorm\.weight": ("post_mlp_norm", "copy"),
}
SKIP = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])[:n]
    pattern = hf.get("sliding_window_pattern", 6)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def _rope(hf: dict, layer_type: str, max_pos: int):
    rp = hf.get("rope_parameters")
    if isinstance(rp, dict) and layer_type in rp:  # v5: nested per layer type
        return c.rope_spec(rp[layer_type], 10000.0, max_pos)
    if layer_type == "sliding_attention":  # v4 keys: local base, never scaled
        return c.rope_spec({"rope_theta": hf.get("rope_local_base_freq", 10000.0)}, 10000.0, max_pos)
    return c.rope_spec(c.rope_params(hf), 1000000.0, max_pos)


def config(hf: dict, causal_lm: bool = True) -> ModelConfig:
    H, K, _ = c.heads(hf)
    d = hf.get("head_dim") or 256
    D = hf["hidden_size"]
    max_pos = hf.get("max_position_embeddings", 131072)
    scale = hf.get("query_pre_attn_scalar", 256) ** -0.5
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"),
                  intermediate_size=hf["intermediate_size"])
    bias = hf.get("attention_bias", False)
    layers = []
    for t in layer_types(hf):
        sliding = t == "sliding_attention"
        attn = AttentionSpec(window=hf.get("sliding_window", 4096) if sliding else None, rope=_rope(hf, t, max_pos),
                             qk_norm="gemma", qkv_bias=bias, out_bias=bias, scale=scale)
        layers.append(LayerSpec(attention=attn, mlp=mlp, block="sandwich", norm="gemma"))
    return ModelConfig(
        family="gemma3", vocab_size=hf["vocab_size"], hidden_size=D, num_heads=H, num_kv_heads=K, head_dim=d,
        layers=tuple(layers), norm="gemma", norm_eps=hf.get("rms_norm_eps", 1e-6),
        embed_scale=math.sqrt(max(D, 0)), tie_embeddings=hf.get("tie_word_embeddings", True),  # D <= 0: refused
        final_softcap=hf.get("final_logit_softcapping") if causal_lm else None,
        max_position_embeddings=max_pos, **c.token_ids(hf, bos=2, eos=(1,), pad=0),
    )


def config_multimodal(hf: dict) -> ModelConfig:
    """Gemma3ForConditionalGeneration: the text config, no final softcap, top-level tying."""
    text = dict(hf.get("text_config") or {})
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k not in text and k in hf:
            text[k] = hf[k]
    return config(text, causal_lm=False)
