"""Mistral3ForConditionalGeneration (Mistral Small 3.1 and kin): a Mistral decoder that reads images through the
Pixtral tower (2-D RoPE, images of any size) and a 2x2 patch merger (specs/vision.md §2). HF-format shards only:
Mistral's native `consolidated.safetensors` names are not read."""
import dataclasses

from jaxmodels.config import ModelConfig, VisionSpec
from jaxmodels.families import _common as c, mistral

# Mistral3Config's sub-config defaults (the Mistral Small 3.1 sizes): used when config.json has no such section.
# A section that is present takes the sub-config class defaults for the fields it lacks, as HF does.
TEXT_DEFAULTS = {"model_type": "mistral", "head_dim": 128, "hidden_size": 5120, "intermediate_size": 32768,
                 "max_position_embeddings": 131072, "num_attention_heads": 32, "num_hidden_layers": 40,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
                 "vocab_size": 131072}
VISION_DEFAULTS = {"intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14, "image_size": 1540,
                   "num_hidden_layers": 24, "num_attention_heads": 16, "hidden_act": "gelu"}
PIXTRAL_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "image_size": 1024, "patch_size": 16, "hidden_act": "gelu"}

_V = r"vision_tower\.transformer\.layers\.{v}\."
VISION_NAMES = {
    r"vision_tower\.ln_pre\.weight": ("vision/ln_pre", "copy"),
    _V + r"attention_norm\.weight": ("vision/layers/attn_norm", "copy"),
    _V + r"ffn_norm\.weight": ("vision/layers/mlp_norm", "copy"),
    **{_V + rf"attention\.{x}_proj\.weight": (f"vision/layers/w{x}", "T") for x in "qkv"},
    _V + r"attention\.o_proj\.weight": ("vision/layers/wo", "T_out"),
    **{_V + rf"feed_forward\.{x}_proj\.weight": (f"vision/layers/w_{x}", "T") for x in ("gate", "up", "down")},
    r"multi_modal_projector\.norm\.weight": ("vision/projector/norm", "copy"),
    r"multi_modal_projector\.patch_merger\.merging_layer\.weight": ("vision/projector/merge", "T"),
    r"multi_modal_projector\.linear_1\.weight": ("vision/projector/w1", "T"),
    r"multi_modal_projector\.linear_2\.weight": ("vision/projector/w2", "T"),
    r"multi_modal_projector\.linear_1\.bias": ("vision/projector/b1", "copy"),
    r"multi_modal_projector\.linear_2\.bias": ("vision/projector/b2", "copy"),
}
RENAMES = (*c.PREFIXES, (r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."))


def config(hf: dict) -> ModelConfig:
    text = dict(TEXT_DEFAULTS) if hf.get("text_config") is None else {"sliding_window": 4096, **hf["text_config"]}
    if text.get("model_type", "mistral") != "mistral":
        raise ValueError(f"text_config.model_type {text['model_type']!r} is not supported (mistral)")
    # the released model has its own lm_head although the top level says tied: the loader unties (Family.untie)
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    vc = dict(VISION_DEFAULTS) if hf.get("vision_config") is None else {**PIXTRAL_DEFAULTS, **hf["vision_config"]}
    rope = c.rope_params(vc)
    layer = hf.get("vision_feature_layer", -1)
    if not isinstance(layer, int):
        raise ValueError(f"vision_feature_layer {layer!r}: only a single layer index is supported (HF 5.24 fails "
                         f"on the list form too)")
    vision = VisionSpec(
        kind="pixtral", hidden_size=vc["hidden_size"], num_layers=vc["num_hidden_layers"],
        num_heads=vc["num_attention_heads"], intermediate_size=vc["intermediate_size"], patch_size=vc["patch_size"],
        image_size=vc["image_size"], image_token_id=hf.get("image_token_index", hf.get("image_token_id", 10)),
        activation=c.activation(vc["hidden_act"]), norm_eps=1e-5, rope_theta=float(rope.get("rope_theta", 10000.0)),
        merge_size=hf.get("spatial_merge_size", 2), feature_layer=layer,
        projector_bias=hf.get("multimodal_projector_bias", False), projector_eps=text.get("rms_norm_eps", 1e-6))
    if c.activation(hf.get("projector_hidden_act", "gelu")) != "gelu":
        raise ValueError(f"projector_hidden_act {hf['projector_hidden_act']!r} is not supported (gelu)")
    if not -vision.num_layers - 1 <= layer <= vision.num_layers:
        raise ValueError(f"vision_feature_layer {layer} is outside the {vision.num_layers}-layer tower")
    return dataclasses.replace(mistral.config(text), family="mistral3", vision=vision)


def names(cfg: ModelConfig) -> dict:
    p = cfg.vision.patch_size
    return mistral.NAMES | VISION_NAMES | {r"vision_tower\.patch_conv\.weight": ("vision/patch", c.conv_patches(3, p, p))}
