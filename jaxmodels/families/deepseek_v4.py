"""DeepSeek V4 and V4.1: HF config.json -> `ModelConfig` on the shared layer plan, and the checkpoint name map.

Each layer is a `LayerSpec` with attention kind `mla` (its role spelled out in `MLASpec`: specs/deepseek_v4.md
§1.3, §13), a MoE with DeepSeek's router (`biased_topk`, or `hash` on V4's first layers), mHC residual streams,
and Engram as a layer extra (V4.1):
  V4   every ratio>0 layer compresses its own KV; CSA layers (ratio 4) run an indexer with its own overlapped
       compressor, HCA layers (ratio 128) attend every visible compressed entry.
  V4.1 only the kv-source layers compress; the other ratio>0 layers reuse the latest source's compressed KV
       and top-k; index sources score against their own (or the latest) indexer keys, and the layers after the
       candidate source only rescore inside its candidate blocks.

V4.1 with a `vision_config` sees images (kind `deepseek_vit`, jaxmodels/layers/deepseek_vision.py): the ViT and
aligner (`vision.*`, `aligner.*`), the learned `image_start` / `image_end` / `image_newline` rows and each router's
`ffn.gate.bias_vl` for image tokens are imported (VISION_NAMES); without one they are left out, as before.

Checkpoints come in DeepSeek's own layout (`layers.N.attn.*`, `layers.N.ffn.experts.E.w{1,2,3}`, `hc_*`,
`engram.*`, FP8/FP4 with `.scale` beside the weight; converters/deepseek.py decodes them) or HF's saved layout
(the same leaves under `model.`, renamed by RENAMES first).
"""
from __future__ import annotations

from jaxmodels.config import (AttentionSpec, EngramSpec, LayerSpec, MHCSpec, MLASpec, MLPSpec, ModelConfig,
                              MTPSpec, RopeSpec, VisionSpec)

V4, V41 = "deepseek_v4", "deepseek_v41"

# HF / vLLM spellings -> DeepSeek's own names (applied before the name map)
RENAMES = ((r"^model\.", ""), (r"^embed_tokens\.", "embed."), (r"^lm_head\.", "head."), (r"^hc_head\.hc_", "hc_head_"),
           (r"\.self_attn\.", ".attn."), (r"^(?!vision\.)(.*?)\.mlp\.", r"\1.ffn."),  # the ViT's blocks keep `mlp`
           (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"), (r"\.e_score_correction_bias$", ".bias"),
           (r"\.weight_scale_inv$", ".scale"))
VISION_SKIP = (r"vision\..*", r"aligner\..*", r"image_(start|end|newline).*", r".*\.ffn\.gate\.bias_vl")
SKIP = (*VISION_SKIP, r"mtp\..*")
DERIVED = ("engram_map",)  # built from the tokenizer, not read from the checkpoint

# one layer's tensors (relative to `layers.N.` or `mtp.N.`) -> (param path, transform)
LAYER_NAMES = {
    r"(?P<x>attn_norm)\.weight": ("{x}", "copy"),
    r"ffn_norm\.weight": ("mlp_norm", "copy"),
    r"hc_attn_(?P<x>fn|base|scale)": ("hc_attn/{x}", "copy"),
    r"hc_ffn_(?P<x>fn|base|scale)": ("hc_mlp/{x}", "copy"),
    r"attn\.(?P<x>wq_a|wq_b|wkv|wo_b)\.weight": ("attn/{x}", "T"),
    r"attn\.(?P<x>q_norm|kv_norm)\.weight": ("attn/{x}", "copy"),
    r"attn\.wo_a\.weight": ("attn/wo_a", "wo_a"),
    r"attn\.attn_sink": ("attn/sinks", "copy"),
    r"attn\.(?P<c>compressor|indexer\.compressor)\.(?P<x>wkv|wgate)\.weight": ("attn/{c}/{x}", "T"),
    r"attn\.(?P<c>compressor|indexer\.compressor)\.(?P<x>norm)\.weight": ("attn/{c}/{x}", "copy"),
    r"attn\.(?P<c>compressor|indexer\.compressor)\.ape": ("attn/{c}/ape", "copy"),
    r"attn\.indexer\.(?P<x>wq_b|weights_proj|wk)\.weight": ("attn/indexer/{x}", "T"),
    r"attn\.indexer\.k_norm\.weight": ("attn/indexer/k_norm", "copy"),
    r"ffn\.gate\.weight": ("mlp/router", "T"),
    r"ffn\.gate\.bias": ("mlp/selection_bias", "copy"),
    r"ffn\.gate\.tid2eid": ("mlp/tid2eid", "copy"),
    r"ffn\.experts\.{e}\.w1\.weight": ("mlp/w_gate", "T"),
    r"ffn\.experts\.{e}\.w3\.weight": ("mlp/w_up", "T"),
    r"ffn\.experts\.{e}\.w2\.weight": ("mlp/w_down", "T"),
    r"ffn\.shared_experts\.w1\.weight": ("mlp/shared/w_gate", "T"),
    r"ffn\.shared_experts\.w3\.weight": ("mlp/shared/w_up", "T"),
    r"ffn\.shared_experts\.w2\.weight": ("mlp/shared/w_down", "T"),
    r"engram\.embed\.weight": ("engram/table", "copy"),
    r"engram\.wkv\.weight": ("engram/wkv", "T"),
    r"engram\.(?P<x>q_weight|k_weight)": ("engram/{x}", "copy"),
}
NAMES = {
    r"embed\.weight": ("embed", "copy"),
    r"head\.weight": ("lm_head", "T"),
    r"norm\.weight": ("final_norm", "copy"),
    r"hc_head_(?P<x>fn|base|scale)": ("hc_head/{x}", "copy"),
    **{r"layers\.{i}\." + k: v for k, v in LAYER_NAMES.items()},
}
# the MTP blocks (params["mtp"]): layer-style tensors plus their own; mtp.N.embed/head are the backbone's
MTP_NAMES = {
    **{r"mtp\.{i}\." + k: v for k, v in LAYER_NAMES.items()},
    r"mtp\.{i}\.main_proj\.weight": ("main_proj", "T"),  # V4.1 DSpark stage 0
    r"mtp\.{i}\.(?P<x>main_norm|norm|enorm|hnorm)\.weight": ("{x}", "copy"),
    r"mtp\.{i}\.markov_head\.embed\.weight": ("markov_head/embed", "copy"),  # [V, R], looked up by id
    r"mtp\.{i}\.markov_head\.head\.weight": ("markov_head/head", "T"),
    r"mtp\.{i}\.confidence_head\.proj\.weight": ("confidence_head/proj", "T"),
    r"mtp\.{i}\.(?P<x>e_proj|h_proj)\.weight": ("{x}", "T"),  # V4 classic MTP
    r"mtp\.{i}\.hc_head_(?P<x>fn|base|scale)": ("hc_head/{x}", "copy"),
}
MTP_SKIP = (r"mtp\.\d+\.(embed|embed_tokens|head|lm_head)\.weight", r"mtp\.\d+\.ffn\.gate\.bias_vl")

# V4.1's vision tower in DeepSeek's own names (upstream inference/vision.py + model.py: 266 tensors in the release, all
# BF16) and the routers' image-token bias. nn.Linear weights [out, in] -> [in, out]; the MLP's w1 is [gate | up].
_VB = r"vision\.blocks\.{v}\."
VISION_NAMES = {
    r"vision\.patch_embed\.proj\.weight": ("vision/patch", "T"),
    r"vision\.patch_embed\.proj\.bias": ("vision/patch_bias", "copy"),
    _VB + r"norm1\.weight": ("vision/layers/norm1", "copy"),
    _VB + r"attn\.wqkv\.weight": ("vision/layers/wqkv", "T"),
    _VB + r"attn\.wqkv\.bias": ("vision/layers/bqkv", "copy"),
    _VB + r"attn\.wo\.weight": ("vision/layers/wo", "T"),
    _VB + r"attn\.wo\.bias": ("vision/layers/bo", "copy"),
    _VB + r"norm2\.weight": ("vision/layers/norm2", "copy"),
    _VB + r"mlp\.w1\.weight": ("vision/layers/w_gate_up", "T"),
    _VB + r"mlp\.w2\.weight": ("vision/layers/w_down", "T"),
    r"vision\.norm\.weight": ("vision/norm", "copy"),
    r"aligner\.w1\.weight": ("vision/projector/w1", "T"),
    r"aligner\.w1\.bias": ("vision/projector/b1", "copy"),
    r"aligner\.w2\.weight": ("vision/projector/w2", "T"),
    r"aligner\.w2\.bias": ("vision/projector/b2", "copy"),
    r"image_start": ("vision/image_start", "copy"),
    r"image_end": ("vision/image_end", "copy"),
    r"image_newline": ("vision/image_newline", "copy"),
    r"layers\.{i}\.ffn\.gate\.bias_vl": ("mlp/selection_bias_vl", "copy"),
}


def import_names(cfg: ModelConfig) -> tuple[dict, tuple[str, ...]]:
    """(the backbone's name map, the checkpoint entries it leaves out): the vision tower's and bias_vl join the map
    when the config sees images, else they are skipped."""
    if cfg.vision is None:
        return NAMES, SKIP
    return NAMES | VISION_NAMES, tuple(x for x in SKIP if x not in VISION_SKIP)


def _vision(hf: dict) -> VisionSpec | None:
    """V4.1's `vision_config` (specs/deepseek_v4.md §1.1; the reference's `vision_*` ModelArgs) -> the tower, or
    None without one or with 0 layers (the reference's `vision_n_layers == 0` turns vision off). Defaults are the
    reference's ModelArgs; the tower's RMSNorm eps is its hard-coded 1e-6, not the text model's."""
    vc = hf.get("vision_config") or {}
    if not vc.get("num_hidden_layers"):
        return None
    text = hf.get("text_config") or {}
    ratio = vc.get("max_wh_ratio")
    return VisionSpec(
        kind="deepseek_vit", hidden_size=vc.get("hidden_size", 1024), num_layers=vc["num_hidden_layers"],
        num_heads=vc.get("num_attention_heads", 16), intermediate_size=vc.get("intermediate_size", 2816),
        patch_size=vc.get("patch_size", 14), image_token_id=int(hf.get("image_token_id", text.get("image_token_id",
                                                                                                   129264))),
        activation="silu", norm_eps=1e-6, rope_theta=float(vc.get("rope_theta", 10000.0)),
        merge_size=vc.get("downsample_ratio", 3), max_image_tokens=vc.get("max_image_tokens", 1024),
        min_pixels=vc.get("min_pixels", 544 * 544), max_wh_ratio=None if ratio is None else float(ratio))


def _yarn(t: dict, theta: float) -> RopeSpec:
    rs = dict(t.get("rope_scaling") or {})
    rp = t.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):  # HF V4's nested form
        rs, theta = rp["compress"], rp["compress"].get("rope_theta", theta)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind not in ("yarn", "default"):
        raise ValueError(f"DeepSeek V4 compressed layers use YaRN; got rope type {kind!r}")
    if kind == "default":
        return RopeSpec(theta=float(theta), interleaved=True)
    return RopeSpec(theta=float(theta), kind="yarn", factor=float(rs.get("factor", 1.0)), interleaved=True,
                    original_max_position=int(rs.get("original_max_position_embeddings", 0)),
                    beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)),
                    attention_factor=1.0)  # no mscale anywhere (spec §2)


def _ratios_v4(t: dict, n: int) -> list[int]:
    if t.get("layer_types"):
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(t.get("compress_rates") or {})}
        unknown = sorted(set(t["layer_types"][:n]) - {"sliding_attention", *rates})
        if unknown:
            raise ValueError(f"unknown layer_types {unknown}; known: sliding_attention, {', '.join(rates)}")
        return [0 if x == "sliding_attention" else int(rates[x]) for x in t["layer_types"][:n]]
    if t.get("compress_ratios") is not None:
        return [int(r) for r in t["compress_ratios"][:n]]
    return [128] * min(n, 2) + [4 if i % 2 else 128 for i in range(max(n - 2, 0))]  # HF's V4-Pro default


def _hash_layers(t: dict, n: int) -> int:
    if t.get("mlp_layer_types"):
        return sum(x == "hash_moe" for x in t["mlp_layer_types"][:n])
    return int(t.get("num_hash_layers", 3))


def _roles_v41(t: dict, n: int) -> list[dict]:
    ratios = [int(r) for r in t["compress_ratios"]][:n]
    kv_src = set(t.get("kv_source_layer_ids") or ())
    idx_src = set(t.get("index_source_layer_ids") or ())
    cand = int(t.get("candidate_source_layer_id", -1))
    out = []
    for i, r in enumerate(ratios):
        if r and not kv_src & set(range(i + 1)):
            raise ValueError(f"layer {i} has compress ratio {r} but no kv source at or before it")
        own, indexer = i in kv_src, i in idx_src
        out.append(dict(ratio=r, compress=own, select="none" if not r else ("indexer" if indexer else "reuse"),
                        index_keys="latent" if own and indexer else ("shared" if indexer else "none"),
                        candidate_source=i == cand, candidate_filter=indexer and 0 <= cand < i))
    return out


def _roles_v4(t: dict, n: int) -> list[dict]:
    types = t.get("layer_types") or [None] * n
    out = []
    for r, kind in zip(_ratios_v4(t, n), types):
        # CSA (overlapped compressor + indexer) by its layer type when named, else by the reference's ratio 4
        csa = kind == "compressed_sparse_attention" if kind else r == 4
        out.append(dict(ratio=r, compress=r > 0, select="none" if not r else ("indexer" if csa else "all"),
                        index_keys="compressor" if csa else "none"))
    return out


def config(hf: dict) -> ModelConfig:
    """HF config.json (V4 flat, or V4.1 composite with `text_config`) -> ModelConfig."""
    t = dict(hf.get("text_config") or hf)
    v41 = hf.get("model_type") == V41 or t.get("model_type") == V41
    n = t["num_hidden_layers"]
    d = t.get("head_dim", 512)
    rope_dim = t.get("qk_rope_head_dim") or int(round(d * t.get("partial_rotary_factor", 64 / 512)))
    window = t.get("sliding_window", 128)
    main_rope = RopeSpec(theta=float(t.get("rope_theta", 10000.0)), interleaved=True)
    compress_rope = _yarn(t, t.get("compress_rope_theta", 160000.0))
    mla = dict(q_lora_rank=t["q_lora_rank"], o_groups=t.get("o_groups", 8), o_lora_rank=t.get("o_lora_rank", 1024),
               rope_dim=rope_dim, variant="v4.1" if v41 else "v4", index_heads=t.get("index_n_heads", 0),
               index_head_dim=t.get("index_head_dim", 0), index_topk=t.get("index_topk", 0),
               candidate_blocks=t.get("candidate_topk_blocks", 0), candidate_block_size=t.get("candidate_block_size", 0))
    k, E = t.get("num_experts_per_tok", 0), t.get("n_routed_experts", t.get("num_local_experts", 0))
    norm_topk = bool(t.get("norm_topk_prob", True))
    moe = dict(kind="moe", activation="silu_limit", intermediate_size=t.get("moe_intermediate_size", 0),
               clamp_limit=float(t.get("swiglu_limit", 10.0)), activation_fp32=True,
               score_func=t.get("scoring_func", "sqrtsoftplus"), route_scale=float(t.get("routed_scaling_factor", 1.0)),
               shared_intermediate_size=t.get("moe_intermediate_size", 0))
    mhc = MHCSpec(copies=t.get("hc_mult", 4), sinkhorn_iters=t.get("hc_sinkhorn_iters", 20),
                  eps=float(t.get("hc_eps", 1e-6)), delayed=v41)

    def mlp(experts, top_k, hashed=False):  # V4.1 renormalises only for k > 1; V4 (HF) whatever k is
        return MLPSpec(**moe, num_experts=experts, top_k=top_k, router="hash" if hashed else "biased_topk",
                       selection_bias=not hashed, renormalize=norm_topk and (top_k > 1 or not v41))

    def layer(role, mlp_spec, engram=-1):
        attn = AttentionSpec(kind="mla", window=window, rope=compress_rope if role["ratio"] else main_rope,
                             sinks=True, mla=MLASpec(**mla, **role))
        return LayerSpec(attention=attn, mlp=mlp_spec, norm="rms_fp32", mhc=mhc, engram=engram)

    engram_ids = tuple(t.get("engram_layer_ids") or ())
    n_hash = 0 if v41 else _hash_layers(t, n)
    layers = tuple(layer(role, mlp(E, k, i < n_hash), engram_ids.index(i) if i in engram_ids else -1)
                   for i, role in enumerate((_roles_v41 if v41 else _roles_v4)(t, n)))
    engram = None
    if engram_ids:
        engram = EngramSpec(layer_ids=engram_ids, max_ngram=t.get("engram_max_ngram_size", 0),
                            vocab_size=t.get("engram_vocab_size", 0), n_heads=t.get("engram_n_heads", 0),
                            head_dim=t.get("engram_head_dim", 0), compressed_vocab=t.get("engram_compressed_vocab_size", 0),
                            pad_token=int(t.get("engram_pad_token_id", t.get("engram_pad_id", 2))),
                            rows=tuple(t.get("engram_num_embeddings") or ()))
    n_mtp, mtp = int(t.get("num_nextn_predict_layers", 0)), None
    if n_mtp and (not v41 or t.get("dspark_block_size", 0)):  # V4.1's DSpark is built only with a block size
        role = dict(ratio=0, compress=False, select="none", index_keys="none")
        e_mtp = (t.get("dspark_n_routed_experts", 0) if v41 else 0) or E
        k_mtp = (t.get("dspark_num_experts_per_tok", 0) if v41 else 0) or k
        mtp = MTPSpec(kind="dspark" if v41 else "classic", layers=n_mtp, layer=layer(role, mlp(e_mtp, k_mtp)),
                      block_size=t.get("dspark_block_size", 0) if v41 else 0,
                      noise_token=t.get("dspark_noise_token_id", 0) if v41 else 0,
                      target_layers=tuple(t.get("dspark_target_layer_ids") or ()) if v41 else (),
                      markov_rank=t.get("dspark_markov_rank", 0) if v41 else 0)
    q = hf.get("quantization_config") or t.get("quantization_config") or {}
    eos = t.get("eos_token_id", hf.get("eos_token_id", 1))
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=V41 if v41 else V4, vocab_size=t.get("vocab_size", 129280), hidden_size=t["hidden_size"],
        num_heads=t["num_attention_heads"], num_kv_heads=1, head_dim=d, layers=layers, norm="rms_fp32",
        norm_eps=float(t.get("rms_norm_eps", 1e-20 if v41 else 1e-6)),
        max_position_embeddings=t.get("max_position_embeddings", 1 << 20),
        bos_token_id=t.get("bos_token_id", hf.get("bos_token_id", 0)), eos_token_ids=eos,
        pad_token_id=t.get("pad_token_id", hf.get("pad_token_id")),
        quant_block=int((q.get("weight_block_size") or [32 if v41 else 128])[0]), engram=engram, mtp=mtp,
        vision=_vision(hf) if v41 else None)
