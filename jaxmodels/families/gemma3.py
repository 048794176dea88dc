"""Gemma3 text decoder (`gemma3_text`, and the text part of `gemma3` multimodal checkpoints).

5:1 sliding/full plan, local RoPE θ=1e4 and global RoPE with its own scaling, sandwich (1+w) RMS
norms, per-head (1+w) qk-norm, query_pre_attn_scalar, √hidden embedding scale rounded to the weight
dtype, and the final softcap of Gemma3ForCausalLM. HF never applies `attn_logit_softcapping` in
Gemma3 (specs §3.6), so neither do we.
"""
import dataclasses
import math

from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig, VisionSpec
from jaxmodels.families import _common as c

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if "post_attention_layernorm" not in k},
    r"model\.layers\.{i}\.post_attention_layernorm\.weight": ("post_attn_norm", "copy"),
    r"model\.layers\.{i}\.pre_feedforward_layernorm\.weight": ("mlp_norm", "copy"),
    r"model\.layers\.{i}\.post_feedforward_layernorm\.weight": ("post_mlp_norm", "copy"),
}
SKIP = (r"(model\.)?vision_tower\..*", r"(model\.)?multi_modal_projector\..*")

# The vision tower (specs/vision.md §1.6), after RENAMES: released `vision_tower.vision_model.`, v5
# `save_pretrained` `vision_tower.` and in-memory `model.vision_tower.` all read as `vision_tower.`.
_V = r"vision_tower\.encoder\.layers\.{v}\."
VISION_NAMES = {
    r"vision_tower\.embeddings\.patch_embedding\.bias": ("vision/patch_bias", "copy"),
    r"vision_tower\.embeddings\.position_embedding\.weight": ("vision/pos", "copy"),
    **{_V + rf"layer_norm{n}\.{w}": (f"vision/layers/ln{n}/{w[0]}", "copy") for n in (1, 2) for w in ("weight", "bias")},
    **{_V + rf"self_attn\.{x}_proj\.weight": (f"vision/layers/w{x}", "T") for x in "qkv"},
    **{_V + rf"self_attn\.{x}_proj\.bias": (f"vision/layers/b{x}", "reshape") for x in "qkv"},
    _V + r"self_attn\.out_proj\.weight": ("vision/layers/wo", "T_out"),
    _V + r"self_attn\.out_proj\.bias": ("vision/layers/bo", "copy"),
    **{_V + rf"mlp\.fc{n}\.weight": (f"vision/layers/fc{n}", "T") for n in (1, 2)},
    **{_V + rf"mlp\.fc{n}\.bias": (f"vision/layers/b{n}", "copy") for n in (1, 2)},
    **{rf"vision_tower\.post_layernorm\.{w}": (f"vision/post_norm/{w[0]}", "copy") for w in ("weight", "bias")},
    r"multi_modal_projector\.mm_soft_emb_norm\.weight": ("vision/projector/norm", "copy"),
    r"multi_modal_projector\.mm_input_projection_weight": ("vision/projector/w", "copy"),
}
RENAMES = (*c.PREFIXES, (r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."),
           (r"^vision_tower\.vision_model\.", "vision_tower."))
VISION_SKIP = (r"vision_tower\.head\..*",)  # SigLIP's attention-pool head: Gemma3 reads the last hidden state


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
    """Gemma3ForConditionalGeneration: the text config, no final softcap, top-level tying, and the SigLIP tower
    (missing vision fields take SiglipVisionConfig's defaults, as HF does; the release's are in config.json)."""
    text = dict(hf.get("text_config") or {})
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)  # the top level decides, as HF's
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k not in text and k in hf:
            text[k] = hf[k]
    vc = hf.get("vision_config") or {}
    vision = VisionSpec(
        kind="siglip", hidden_size=vc.get("hidden_size", 768), num_layers=vc.get("num_hidden_layers", 12),
        num_heads=vc.get("num_attention_heads", 12), intermediate_size=vc.get("intermediate_size", 3072),
        patch_size=vc.get("patch_size", 16), image_size=vc.get("image_size", 224),
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 262144)),
        activation=c.activation(vc.get("hidden_act", "gelu_pytorch_tanh")), norm_eps=vc.get("layer_norm_eps", 1e-6),
        tokens_per_image=hf.get("mm_tokens_per_image", 256), projector_eps=vc.get("layer_norm_eps", 1e-6),
        begin_token_id=hf.get("boi_token_index", hf.get("boi_token_id", 255999)),
        end_token_id=hf.get("eoi_token_index", hf.get("eoi_token_id", 256000)))
    return dataclasses.replace(config(text, causal_lm=False), vision=vision)


def names_multimodal(cfg: ModelConfig) -> dict:
    p = cfg.vision.patch_size
    return NAMES | VISION_NAMES | {
        r"vision_tower\.embeddings\.patch_embedding\.weight": ("vision/patch", c.conv_patches(3, p, p))}
