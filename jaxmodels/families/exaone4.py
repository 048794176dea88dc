"""EXAONE 4.0 and 4.5: post-norm blocks on the raw residual, per-head RMS qk-norm, LLLG plan
with NoPE full layers when hybrid. 4.5 wraps the text model (`model.language_model.`), lists one
extra layer type for its MTP layer and ships `mtp.*` weights (skipped), and reads images through a windowed ViT
(jaxmodels/layers/window_vit.py)."""
import dataclasses
import logging

from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig, VisionSpec
from jaxmodels.families import _common as c

log = logging.getLogger(__name__)

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if "layernorm" not in k},
    r"model\.layers\.{i}\.post_attention_layernorm\.weight": ("post_attn_norm", "copy"),
    r"model\.layers\.{i}\.post_feedforward_layernorm\.weight": ("post_mlp_norm", "copy"),
}
SKIP = (r"mtp\..*", r"(model\.)?visual\..*")
SKIP45 = (r"mtp\..*",)

# EXAONE 4.5's vision tower (specs/vision.md §4.5): one spelling, in memory and on disk.
_V = r"model\.visual\.blocks\.{v}\."
VISION_NAMES = {
    **{_V + rf"norm{n}\.weight": (f"vision/layers/norm{n}", "copy") for n in (1, 2)},
    _V + r"attn\.qkv\.weight": ("vision/layers/wqkv", "T"),
    _V + r"attn\.qkv\.bias": ("vision/layers/bqkv", "copy"),
    _V + r"attn\.proj\.weight": ("vision/layers/wo", "T"),
    _V + r"attn\.proj\.bias": ("vision/layers/bo", "copy"),
    **{_V + rf"mlp\.{x}_proj\.weight": (f"vision/layers/w_{x}", "T") for x in ("gate", "up", "down")},
    **{_V + rf"mlp\.{x}_proj\.bias": (f"vision/layers/b_{x}", "copy") for x in ("gate", "up", "down")},
    r"model\.visual\.merger\.ln_q\.weight": ("vision/merger/norm", "copy"),
    r"model\.visual\.merger\.mlp\.0\.weight": ("vision/merger/w1", "T"),
    r"model\.visual\.merger\.mlp\.0\.bias": ("vision/merger/b1", "copy"),
    r"model\.visual\.merger\.mlp\.2\.weight": ("vision/merger/w2", "T"),
    r"model\.visual\.merger\.mlp\.2\.bias": ("vision/merger/b2", "copy"),
}


def layer_types(hf: dict) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        types = list(hf["layer_types"])
        if len(types) > n:
            log.info("using the first %d of %d layer_types (the rest describe MTP layers)", n, len(types))
        return types[:n]
    if hf.get("sliding_window") is None:
        return ["full_attention"] * n
    pattern = hf.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):  # "LLLG": one letter per layer, repeated (HF itself crashes here)
        return ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(n)]
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def config(hf: dict) -> ModelConfig:
    H, K, d = c.heads(hf)
    max_pos = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window")
    rope = c.rope_spec(c.rope_params(hf), 10000.0, max_pos)
    mlp = MLPSpec(activation=c.activation(hf.get("hidden_act", "silu")), intermediate_size=hf["intermediate_size"])
    layers = []
    for t in layer_types(hf):
        sliding = t == "sliding_attention"
        # RoPE everywhere without a window; with one, full layers are NoPE
        attn = AttentionSpec(window=window if sliding else None, rope=rope if window is None or sliding else None,
                             qk_norm="rms")
        layers.append(LayerSpec(attention=attn, mlp=mlp, block="post", norm="rms"))
    return ModelConfig(
        family="exaone4", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_heads=H, num_kv_heads=K,
        head_dim=d, layers=tuple(layers), norm="rms", norm_eps=hf.get("rms_norm_eps", 1e-5),
        tie_embeddings=hf.get("tie_word_embeddings", False), max_position_embeddings=max_pos,
        **c.token_ids(hf, bos=0, eos=(2,)),
    )


def config45(hf: dict) -> ModelConfig:
    """Exaone4_5_ForConditionalGeneration: the text config (the top level decides the tying) and the windowed
    ViT (missing fields take Exaone4_5_VisionConfig's defaults, as HF does)."""
    text = dict(hf.get("text_config") or hf)
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)
    cfg = config(text)
    vc = hf.get("vision_config") or {}
    heads = vc.get("num_heads", vc.get("num_attention_heads", 16))
    vision = VisionSpec(
        kind="window_vit", hidden_size=vc.get("hidden_size", 3584), num_layers=vc.get("depth", 32), num_heads=heads,
        num_kv_heads=vc.get("num_key_value_heads", 8), intermediate_size=vc.get("intermediate_size", 3420),
        patch_size=vc.get("patch_size", 14), image_token_id=hf.get("image_token_id", 67),
        activation=c.activation(vc.get("hidden_act", "silu")), norm_eps=1e-6,  # hard-coded in HF, not config
        rope_theta=float(c.rope_params(vc).get("rope_theta", 10000.0)), merge_size=vc.get("spatial_merge_size", 2),
        temporal_patch_size=vc.get("temporal_patch_size", 2), window_size=vc.get("window_size", 112),
        full_blocks=tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
        out_hidden_size=vc.get("out_hidden_size", 3584))
    if vision.out_hidden_size != cfg.hidden_size:
        raise ValueError(f"vision_config.out_hidden_size {vision.out_hidden_size} differs from the text hidden size "
                         f"{cfg.hidden_size}")
    return dataclasses.replace(cfg, vision=vision)


def names45(cfg: ModelConfig) -> dict:
    v = cfg.vision
    conv = c.conv_patches(3, v.temporal_patch_size, v.patch_size, v.patch_size)
    return NAMES | VISION_NAMES | {r"model\.visual\.patch_embed\.proj\.weight": ("vision/patch", conv)}
