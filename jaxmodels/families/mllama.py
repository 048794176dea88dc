"""MllamaForConditionalGeneration (Llama 3.2 Vision): a Llama decoder with gated cross-attention layers that read a
tiled image encoder's features (specs/vision.md §3). The embedding has 8 rows past the head's (the image token
<|image|> is the first of them and is embedded, not spliced); without images the cross layers are skipped."""
import dataclasses

from jaxmodels.config import AttentionSpec, ModelConfig, VisionSpec
from jaxmodels.families import _common as c, llama

ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))
EXTRA_ROWS = 8  # MllamaTextModel's embedding: vocab_size + 8 rows

_X = r"model\.layers\.{i}\.cross_attn\."
TEXT_NAMES = {
    **{_X + rf"{x}_proj\.weight": (f"attn/w{x}", "T") for x in "qkv"},
    _X + r"o_proj\.weight": ("attn/wo", "T_out"),
    _X + r"q_norm\.weight": ("attn/q_norm", "copy"),
    _X + r"k_norm\.weight": ("attn/k_norm", "copy"),
    r"model\.layers\.{i}\.cross_attn_attn_gate": ("attn/gate", "copy"),
    r"model\.layers\.{i}\.cross_attn_mlp_gate": ("mlp_gate", "copy"),
}


def _stack(hf: str, ours: str) -> dict:
    """One encoder stack's layers (the global one adds its two gates)."""
    return {
        **{hf + rf"{n}\.{w}": (f"{ours}{m}/{w[0]}", "copy")
           for n, m in (("input_layernorm", "ln1"), ("post_attention_layernorm", "ln2")) for w in ("weight", "bias")},
        **{hf + rf"self_attn\.{x}_proj\.weight": (f"{ours}w{x}", "T") for x in "qkv"},
        hf + r"self_attn\.o_proj\.weight": (f"{ours}wo", "T_out"),
        **{hf + rf"mlp\.fc{n}\.weight": (f"{ours}fc{n}", "T") for n in (1, 2)},
        **{hf + rf"mlp\.fc{n}\.bias": (f"{ours}b{n}", "copy") for n in (1, 2)},
        **{hf + rf"gate_{g}": (f"{ours}gate_{g}", "copy") for g in ("attn", "ffn")},
    }


VISION_NAMES = {
    r"vision_model\.class_embedding": ("vision/class_embedding", "copy"),
    r"vision_model\.gated_positional_embedding\.gate": ("vision/pos/gate", "copy"),
    r"vision_model\.gated_positional_embedding\.embedding": ("vision/pos/embedding", "copy"),
    r"vision_model\.gated_positional_embedding\.tile_embedding\.weight": ("vision/pos/tile", "copy"),
    **{rf"vision_model\.{t}_tile_positional_embedding\.gate": (f"vision/{t}_tile/gate", "copy") for t in ("pre", "post")},
    **{rf"vision_model\.{t}_tile_positional_embedding\.embedding\.weight": (f"vision/{t}_tile/embedding", "copy")
       for t in ("pre", "post")},
    **{rf"vision_model\.layernorm_{t}\.{w}": (f"vision/ln_{t}/{w[0]}", "copy") for t in ("pre", "post")
       for w in ("weight", "bias")},
    **{k: v for hf, ours in (("transformer", "layers"), ("global_transformer", "global_layers"))
       for k, v in _stack(rf"vision_model\.{hf}\.layers\.{{v}}\.", f"vision/{ours}/").items()},
    r"multi_modal_projector\.weight": ("vision/projector/w", "T"),
    r"multi_modal_projector\.bias": ("vision/projector/b", "copy"),
}
RENAMES = (*c.PREFIXES, (r"^model\.(vision_model|multi_modal_projector)\.", r"\1."))


def _given(d: dict, key: str, default):
    """d[key], or HF's default only when the key is absent or null (an empty list means none)."""
    value = d.get(key)
    return default if value is None else value


def config(hf: dict) -> ModelConfig:
    text = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": 128001,
            "pad_token_id": 128004, **(hf.get("text_config") or {})}
    cross = set(_given(text, "cross_attention_layers", (3, 8, 13, 18, 23, 28, 33, 38)))
    if not cross <= set(range(text["num_hidden_layers"])):
        raise ValueError(f"cross_attention_layers {sorted(cross)} name layers past the {text['num_hidden_layers']}")
    base = llama.config(text)
    x = dataclasses.replace(base.layers[0], attention=AttentionSpec(kind="cross", rope=None, qk_norm="rms"))
    layers = tuple(x if i in cross else base.layers[0] for i in range(base.num_layers))
    vc = {"hidden_size": 1280, "hidden_act": "gelu", "num_hidden_layers": 32, "num_global_layers": 8,
          "attention_heads": 16, "intermediate_size": 5120, "image_size": 448, "patch_size": 14, "norm_eps": 1e-5,
          "max_num_tiles": 4, **(hf.get("vision_config") or {})}
    vision = VisionSpec(
        kind="mllama", hidden_size=vc["hidden_size"], num_layers=vc["num_hidden_layers"],
        num_heads=vc["attention_heads"], intermediate_size=vc["intermediate_size"], patch_size=vc["patch_size"],
        image_token_id=hf.get("image_token_index", hf.get("image_token_id", 128256)), image_size=vc["image_size"],
        activation=c.activation(vc["hidden_act"]), norm_eps=vc["norm_eps"], global_layers=vc["num_global_layers"],
        max_tiles=vc["max_num_tiles"],
        aspect_ratios=tuple(map(tuple, _given(vc, "supported_aspect_ratios", ASPECT_RATIOS))),
        intermediate_layers=tuple(_given(vc, "intermediate_layers_indices", (3, 7, 15, 23, 30))))
    out = vc.get("vision_output_dim", vision.hidden_size * (1 + len(vision.intermediate_layers)))
    if out != vision.hidden_size * (1 + len(vision.intermediate_layers)):
        raise ValueError(f"vision_output_dim {out} is not hidden_size x (1 + intermediate layers)")
    return dataclasses.replace(base, family="mllama", layers=layers, vocab_size=base.vocab_size + EXTRA_ROWS,
                               head_vocab_size=base.vocab_size, vision=vision)


def names(cfg: ModelConfig) -> dict:
    p = cfg.vision.patch_size
    return (llama.NAMES | TEXT_NAMES | VISION_NAMES
            | {r"vision_model\.patch_embedding\.weight": ("vision/patch", c.conv_patches(3, p, p))})
