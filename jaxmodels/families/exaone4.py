"""EXAONE 4.0 and 4.5 (text): post-norm blocks on the raw residual, per-head RMS qk-norm, LLLG plan
with NoPE full layers when hybrid. 4.5 wraps the text model (`model.language_model.`), lists one
extra layer type for its MTP layer, and ships `mtp.*` and vision weights, which are skipped."""
import logging

from jaxmodels.config import AttentionSpec, LayerSpec, MLPSpec, ModelConfig
from jaxmodels.families import _common as c

log = logging.getLogger(__name__)

NAMES = {
    **{k: v for k, v in c.LLAMA_NAMES.items() if "layernorm" not in k},
    r"model\.layers\.{i}\.post_attention_layernorm\.weight": ("post_attn_norm", "copy"),
    r"model\.layers\.{i}\.post_feedforward_layernorm\.weight": ("post_mlp_norm", "copy"),
}
SKIP = (r"mtp\..*", r"(model\.)?visual\..*")


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
    text = dict(hf.get("text_config") or hf)
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", False)  # the top level decides for VLMs
    return config(text)
