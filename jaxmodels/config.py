"""The layer plan's vocabulary: frozen, hashable specs that every executor reads.

`ModelConfig.layers` holds one `LayerSpec` per decoder layer: its attention (GQA, or DeepSeek's latent
attention `mla` with compressor / indexer roles), its MLP (gated, or MoE with a router kind), where the
norms sit, its residual kind (plain, or mHC's n streams) and extras (Engram). Layers with equal specs share
one parameter stack and one cache layout; `jaxmodels.plan` groups them, `jaxmodels.model` executes them.
Every choice is validated at construction and named in the message.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any

NORM_KINDS = ("rms", "rms_fp32", "gemma", "layernorm")
BLOCK_KINDS = ("pre", "post", "sandwich", "parallel")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swiglu_clamp", "silu_limit")
# softmax_topk: softmax over all -> top-k (Qwen3-MoE) | topk_softmax: top-k logits -> softmax over k (GPT-OSS) |
# biased_topk: scores = score_func(logits) in fp32, experts picked on scores + a selection-only bias, weighted by
# the unbiased scores (DeepSeek) | hash: the same scores, experts looked up by token id (DeepSeek V4's first layers)
ROUTERS = ("softmax_topk", "topk_softmax", "biased_topk", "hash")
SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
MLA_SELECT = ("none", "all", "indexer", "reuse")
INDEX_KEYS = ("none", "compressor", "latent", "shared")
MLA_VARIANTS = ("v4", "v4.1")
NUMERICS = ("plain", "reference")


class ConfigError(ValueError):
    """A config number out of range: `field` (a ModelConfig or spec field, e.g. "norm_eps", "theta"), its `value`
    and what it must be; `where` says which part holds it ("layer 3: ")."""

    def __init__(self, field: str, value, want: str, where: str = ""):
        super().__init__(f"{where}{field} must be {want}, got {value!r}")
        self.field, self.value, self.want, self.where = field, value, want, where


def _size(field: str, value, where: str = "", least: int = 1) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < least:
        raise ConfigError(field, value, "a positive integer" if least == 1 else f"an integer >= {least}", where)


def _positive(field: str, value, where: str = "") -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ConfigError(field, value, "a positive finite number", where)


def _one_of(owner: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind (HF `modeling_rope_utils` semantics)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    interleaved: bool = False  # pairs (2j, 2j+1) rotate (Cohere, DeepSeek) instead of halves
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int | None = None  # llama3, yarn, dynamic
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek V4's attention (specs/deepseek_v4.md §5, §13): low-rank queries, one shared K=V latent head of
    head_dim, RoPE on its last rope_dim channels, a grouped low-rank output, and the roles of compressed layers.

    ratio > 0 layers also attend compressed entries (one per `ratio` tokens): `compress` layers build and publish
    them; `select` says which they attend (all | their own indexer's top-k | the top-k published by an earlier
    indexer); `index_keys` where the indexer's keys come from (V4: its own overlapped compressor; V4.1: the
    kv source's latent, or the keys published last). V4.1's candidate source publishes candidate blocks that
    later indexers rescore inside.
    """

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rope_dim: int
    variant: str = "v4.1"  # v4: per-head q RMS, compressor position bias, its quantisation recipe
    ratio: int = 0
    compress: bool = False
    select: str = "none"
    index_keys: str = "none"
    candidate_source: bool = False
    candidate_filter: bool = False
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    candidate_blocks: int = 0
    candidate_block_size: int = 0

    def __post_init__(self):
        _one_of("MLASpec", "variant", self.variant, MLA_VARIANTS)
        _one_of("MLASpec", "select", self.select, MLA_SELECT)
        _one_of("MLASpec", "index_keys", self.index_keys, INDEX_KEYS)
        if (self.ratio > 0) != (self.select != "none"):
            raise ValueError(f"MLASpec: ratio={self.ratio} needs select != 'none' exactly when ratio > 0")
        if (self.select == "indexer") != (self.index_keys != "none"):
            raise ValueError("MLASpec: an indexer (select='indexer') needs index_keys, and only it")
        if self.compress and self.select == "reuse":
            raise ValueError("MLASpec: a compressing layer attends its own entries, it cannot reuse a top-k")
        if self.candidate_filter and (self.candidate_blocks * self.candidate_block_size
                                      - (self.candidate_block_size - 1) < self.index_topk):
            # below this, the reference may attend visible entries outside the candidates; we keep top-k inside
            raise ValueError("candidate_blocks * candidate_block_size - (block - 1) must be >= index_topk")

    @property
    def overlap(self) -> bool:
        """V4 CSA: each entry pools the previous group too, through 2x-wide projections."""
        return self.select == "indexer" and self.index_keys == "compressor"

    @property
    def compressor_gate(self) -> bool:
        return self.ratio > 1 or self.variant == "v4"


@dataclass(frozen=True)
class AttentionSpec:
    kind: str = "gqa"  # gqa (grouped-query attention, incl. MHA/MQA) | mla (DeepSeek V4, see `mla`) | cross
    #                    (Mllama: queries from the text, keys and values from the image features; no RoPE)
    window: int | None = None  # sliding window W: the query and W-1 earlier keys; None = full causal
    rope: RopeSpec | None = field(default_factory=RopeSpec)  # None = NoPE
    qk_norm: str | None = None  # None | a norm kind (see NORM_KINDS), applied per head before RoPE
    qk_norm_per_head: bool = False  # Cohere: one weight row per head ([heads, head_dim])
    qkv_bias: bool = False
    out_bias: bool = False
    sinks: bool = False  # a learned per-head logit that absorbs probability mass (GPT-OSS, DeepSeek)
    scale: float | None = None  # None = head_dim ** -0.5
    softcap: float | None = None  # score = cap * tanh(score / cap)
    mla: MLASpec | None = None

    def __post_init__(self):
        _one_of("AttentionSpec", "kind", self.kind, ("gqa", "mla", "cross"))
        if (self.kind == "mla") != (self.mla is not None):
            raise ValueError("AttentionSpec: kind='mla' needs an MLASpec (and only it)")


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "gated"  # gated: down(act(gate x) * up x) | moe: routed gated experts
    activation: str = "silu"
    intermediate_size: int = 0  # per expert for moe
    bias: bool = False
    clamp_alpha: float = 1.702  # swiglu_clamp only
    clamp_limit: float = 7.0  # swiglu_clamp, silu_limit
    activation_fp32: bool = False  # the activation and gating product in fp32 (DeepSeek's experts)
    # moe only
    num_experts: int = 0
    top_k: int = 0
    router: str = "softmax_topk"  # see ROUTERS
    score_func: str = "softmax"  # biased_topk / hash: see SCORE_FUNCS
    renormalize: bool = False  # divide the k weights by their sum (+1e-20)
    router_bias: bool = False  # a bias added to the router logits (GPT-OSS)
    selection_bias: bool = False  # biased_topk: a bias that only picks the experts
    route_scale: float = 1.0  # the routing weights are multiplied by this
    shared_intermediate_size: int = 0  # a shared (always-on) gated expert of this width; 0 = none

    def __post_init__(self):
        _one_of("MLPSpec", "kind", self.kind, ("gated", "moe"))
        _one_of("MLPSpec", "activation", self.activation, ACTIVATIONS)
        _one_of("MLPSpec", "router", self.router, ROUTERS)
        _one_of("MLPSpec", "score_func", self.score_func, SCORE_FUNCS)
        if self.kind == "moe":
            _size("num_experts", self.num_experts)
            _size("top_k", self.top_k)
            if self.top_k > self.num_experts:
                raise ConfigError("top_k", self.top_k, f"at most num_experts={self.num_experts}")


@dataclass(frozen=True)
class MHCSpec:
    """Manifold-constrained hyper-connections (DeepSeek V4): the residual stream as `copies` streams mixed by
    Sinkhorn-normalised matrices. delayed (V4.1): each sublayer collapses its input with the previous
    sublayer's pre-mix, the model's output with the last one; otherwise (V4) each site collapses with its own
    and a learned `hc_head` collapses the output."""

    copies: int = 4
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    delayed: bool = True


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    mlp: MLPSpec = field(default_factory=MLPSpec)
    block: str = "pre"  # pre | post | sandwich | parallel (where the norms sit)
    norm: str = "rms"  # rms (HF RMS A) | rms_fp32 (RMS B) | gemma (1+w) | layernorm (no bias)
    mhc: MHCSpec | None = None  # residual kind: mHC streams, else a plain residual
    engram: int = -1  # Engram: index of this layer's table among the model's engram layers; -1 = none

    def __post_init__(self):
        _one_of("LayerSpec", "block", self.block, BLOCK_KINDS)
        _one_of("LayerSpec", "norm", self.norm, NORM_KINDS)
        if self.mhc is not None and self.block != "pre":
            raise ValueError(f"LayerSpec: mHC layers norm before each sublayer (block 'pre'), got {self.block!r}")

    @property
    def residual(self) -> str:
        return "plain" if self.mhc is None else "mhc"


@dataclass(frozen=True)
class EngramSpec:
    """DeepSeek V4.1's n-gram hash lookups (specs/deepseek_v4.md §7): hashing is shared by all engram layers."""

    layer_ids: tuple[int, ...]
    max_ngram: int
    vocab_size: int
    n_heads: int
    head_dim: int
    compressed_vocab: int  # classes of the normalised vocabulary (the hash multipliers depend on it)
    pad_token: int = 2  # a raw token id; its compressed class pads the n-grams
    rows: tuple[int, ...] = ()  # table rows per engram layer


@dataclass(frozen=True)
class MTPSpec:
    """DeepSeek's multi-token prediction blocks (jaxmodels/deepseek_mtp.py): V4's classic MTP or V4.1's DSpark."""

    kind: str  # classic | dspark
    layers: int
    layer: LayerSpec  # the spec every block's attention + MoE runs with (window only; its own expert count)
    block_size: int = 0  # dspark
    noise_token: int = 0
    target_layers: tuple[int, ...] = ()
    markov_rank: int = 0

    def __post_init__(self):
        _one_of("MTPSpec", "kind", self.kind, ("classic", "dspark"))


VISION_KINDS = ("siglip", "pixtral", "window_vit", "mllama", "deepseek_vit")


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower and its projector (specs/vision.md): images become `image_token_id` embeddings of the decoder.

    kind: siglip (Gemma3: SigLIP, avg-pool projector, each image's soft tokens attend to each other in prefill) |
    pixtral (Mistral3: Pixtral with 2-D RoPE, images of any size, 2x2 patch merger) | window_vit (EXAONE 4.5:
    Qwen2.5-VL's windowed ViT with GQA, 2x2 merger) | mllama (Llama 3.2 Vision: a tiled encoder whose features the
    decoder's cross-attention layers read) | deepseek_vit (DeepSeek V4.1: a ViT with 2-D RoPE over each image's
    own patch grid, a merge_size x merge_size aligner, learned image start/end/newline rows; image tokens route with
    the router's bias_vl and take no part in Engram). Sizes are the tower's; the projector maps to the decoder's
    hidden size."""

    kind: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    image_token_id: int
    image_size: int = 0  # siglip: the input side; pixtral: the longest edge; window_vit: unused (any size)
    activation: str = "gelu_tanh"
    norm_eps: float = 1e-6
    num_kv_heads: int = 0  # window_vit: GQA (0: num_heads)
    rope_theta: float = 10000.0  # pixtral, window_vit
    tokens_per_image: int = 0  # siglip: soft tokens per image after pooling
    merge_size: int = 1  # pixtral, window_vit: merged tokens are merge x merge patches
    feature_layer: int = -1  # pixtral: the hidden state the projector reads (HF vision_feature_layer)
    projector_bias: bool = False  # pixtral
    projector_eps: float = 1e-6  # the projector's RMS norm
    temporal_patch_size: int = 1  # window_vit
    window_size: int = 0  # window_vit: attention windows of this many pixels a side
    full_blocks: tuple[int, ...] = ()  # window_vit: blocks that attend over the whole image
    out_hidden_size: int = 0  # window_vit: the merger's output width
    begin_token_id: int | None = None  # siglip: <start_of_image>, the prompt's placeholder, and <end_of_image>
    end_token_id: int | None = None
    global_layers: int = 0  # mllama: the gated global encoder after the num_layers local ones
    max_tiles: int = 0  # mllama
    aspect_ratios: tuple[tuple[int, int], ...] = ()  # mllama: (height tiles, width tiles), ids 1.. in this order
    intermediate_layers: tuple[int, ...] = ()  # mllama: local layers whose outputs join the features
    max_image_tokens: int = 0  # deepseek_vit: the most tokens an image's span may take (its resize plan)
    min_pixels: int = 0  # deepseek_vit: smaller images are scaled up to about this many pixels
    max_wh_ratio: float | None = None  # deepseek_vit: wider images are squeezed to this width / height

    def __post_init__(self):
        _one_of("VisionSpec", "kind", self.kind, VISION_KINDS)
        _one_of("VisionSpec", "activation", self.activation, ACTIVATIONS)
        for f in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size"):
            _size(f, getattr(self, f), "vision: ")
        if self.kind not in ("window_vit", "deepseek_vit"):
            _size("image_size", self.image_size, "vision: ")
        _size("image_token_id", self.image_token_id, "vision: ", least=0)
        _positive("norm_eps", self.norm_eps, "vision: ")
        _positive("projector_eps", self.projector_eps, "vision: ")
        if self.hidden_size % self.num_heads:
            raise ConfigError("num_heads", self.num_heads, f"a divisor of the vision hidden size {self.hidden_size}",
                              "vision: ")
        _size("tokens_per_image", self.tokens_per_image, "vision: ", least=0)
        if self.kind == "window_vit":
            kv = self.num_kv_heads or self.num_heads
            if self.num_heads % kv:
                raise ConfigError("num_kv_heads", kv, f"a divisor of the {self.num_heads} vision heads", "vision: ")
            _size("out_hidden_size", self.out_hidden_size, "vision: ")
            _size("window_size", self.window_size, "vision: ")
        if self.kind == "mllama":
            _size("max_tiles", self.max_tiles, "vision: ")
            if not self.aspect_ratios or any(h * w > self.max_tiles or h < 1 or w < 1 for h, w in self.aspect_ratios):
                raise ConfigError("aspect_ratios", self.aspect_ratios, f"tile grids of at most {self.max_tiles} tiles",
                                  "vision: ")
            if any(not 0 <= i < self.num_layers for i in self.intermediate_layers):
                raise ConfigError("intermediate_layers", self.intermediate_layers,
                                  f"indices of the {self.num_layers} local layers", "vision: ")
        if self.kind == "deepseek_vit":
            if self.head_dim % 4:
                raise ConfigError("num_heads", self.num_heads, f"a count giving a head width divisible by 4 (the 2-D "
                                  f"RoPE rotates half of each head per axis pair), not {self.head_dim}", "vision: ")
            _size("max_image_tokens", self.max_image_tokens, "vision: ", least=4)
            _size("min_pixels", self.min_pixels, "vision: ", least=0)
            if self.max_wh_ratio is not None:
                _positive("max_wh_ratio", self.max_wh_ratio, "vision: ")
        _size("merge_size", self.merge_size, "vision: ")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def problem(self) -> str | None:
        """Why this tower cannot take images, or None. Checked when images come, not at load: HF's own default
        Gemma3Config (SigLIP 224/16: 14 patches a side, 256 tokens) loads and runs text, and fails on an image."""
        if self.kind == "siglip":
            side, per = self.image_size // self.patch_size, math.isqrt(self.tokens_per_image)
            if per * per != self.tokens_per_image or not per or side % per:
                return (f"mm_tokens_per_image={self.tokens_per_image} is not a square whose side divides the "
                        f"{side} patches a side of the vision tower")
        return None


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerSpec, ...]
    norm: str = "rms"  # kind of the final norm
    norm_eps: float = 1e-6
    embed_scale: float | None = None  # Gemma: sqrt(hidden), rounded to the weight dtype
    tie_embeddings: bool = False
    logit_scale: float | None = None  # Cohere: logits *= scale
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    numerics: str = "plain"  # plain | reference (DeepSeek: the reference's simulated FP8/FP4 quantisation)
    quant_block: int = 32  # reference numerics: FP8 activation block (V4.1: 32, V4: 128)
    engram: EngramSpec | None = None
    mtp: MTPSpec | None = None
    vision: VisionSpec | None = None  # multimodal models: the image tower and projector
    head_vocab_size: int | None = None  # the head's rows when fewer than the embedding's (Mllama: its image token)

    def __post_init__(self):
        validate(self)
        _one_of("ModelConfig", "numerics", self.numerics, NUMERICS)
        _one_of("ModelConfig", "norm", self.norm, NORM_KINDS)
        if len({L.mhc for L in self.layers}) > 1:
            raise ValueError("ModelConfig: every layer needs the same residual kind (mHC streams or plain)")
        n_engram = len(self.engram.layer_ids) if self.engram else 0
        if any(L.engram >= n_engram for L in self.layers):
            raise ValueError(f"ModelConfig: a layer uses an engram table beyond the {n_engram} configured")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def logits_size(self) -> int:
        """The head's width: the vocabulary a token is sampled from (Mllama's embedding has more rows)."""
        return self.head_vocab_size or self.vocab_size

    @property
    def mhc(self) -> MHCSpec | None:
        return self.layers[0].mhc if self.layers else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        return _from_dict(cls, d)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


def validate(cfg: ModelConfig) -> None:
    """Every number of a config in range, or ConfigError naming the field and the value (ModelConfig runs it on
    construction): sizes positive integers, eps / theta / factors / scales / caps positive and finite."""
    for f in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
        _size(f, getattr(cfg, f))
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError("num_kv_heads", cfg.num_kv_heads, f"a divisor of the {cfg.num_heads} attention heads")
    if cfg.head_dim % 2:
        raise ConfigError("head_dim", cfg.head_dim, "even (RoPE rotates pairs)")
    _size("num_layers", cfg.num_layers)
    _positive("norm_eps", cfg.norm_eps)
    for f in ("embed_scale", "logit_scale", "final_softcap"):
        if getattr(cfg, f) is not None:
            _positive(f, getattr(cfg, f))
    layers: dict[LayerSpec, str] = {}  # each distinct spec once, named by its first layer
    for i, L in enumerate(cfg.layers):
        layers.setdefault(L, f"layer {i}: ")
    if cfg.mtp is not None:
        _size("layers", cfg.mtp.layers, "mtp: ")
        layers.setdefault(cfg.mtp.layer, "mtp: ")
    for L, where in layers.items():
        _validate_layer(L, cfg.head_dim, where)
    if cfg.mhc is not None:
        _size("copies", cfg.mhc.copies, "mhc: ")
        _size("sinkhorn_iters", cfg.mhc.sinkhorn_iters, "mhc: ")
        _positive("eps", cfg.mhc.eps, "mhc: ")
    if cfg.engram is not None:
        for f in ("max_ngram", "vocab_size", "n_heads", "head_dim"):
            _size(f, getattr(cfg.engram, f), "engram: ")
        for r in cfg.engram.rows:
            _size("rows", r, "engram: ")


def _validate_layer(L: LayerSpec, head_dim: int, where: str) -> None:
    a, m = L.attention, L.mlp
    if a.window is not None:
        _size("window", a.window, where)
    for f in ("scale", "softcap"):
        if getattr(a, f) is not None:
            _positive(f, getattr(a, f), where)
    if (r := a.rope) is not None:
        _positive("theta", r.theta, where)
        _positive("factor", r.factor, where)
        if r.kind in ("llama3", "yarn") or r.original_max_position is not None:
            _size("original_max_position", r.original_max_position, where)
        if r.kind == "llama3":
            _positive("low_freq_factor", r.low_freq_factor, where)
            _positive("high_freq_factor", r.high_freq_factor, where)
        if r.kind == "yarn":
            for f in ("beta_fast", "beta_slow", "attention_factor"):
                if getattr(r, f) is not None:
                    _positive(f, getattr(r, f), where)
    if (mla := a.mla) is not None:
        for f in ("q_lora_rank", "o_groups", "o_lora_rank", "rope_dim"):
            _size(f, getattr(mla, f), where)
        if mla.rope_dim > head_dim or mla.rope_dim % 2:
            raise ConfigError("rope_dim", mla.rope_dim, f"even and at most head_dim={head_dim}", where)
        if mla.select == "indexer":
            for f in ("index_heads", "index_head_dim", "index_topk"):
                _size(f, getattr(mla, f), where)
    _size("intermediate_size", m.intermediate_size, where)
    _size("shared_intermediate_size", m.shared_intermediate_size, where, least=0)
    if m.activation in ("swiglu_clamp", "silu_limit"):
        _positive("clamp_limit", m.clamp_limit, where)
    if m.kind == "moe":
        _positive("route_scale", m.route_scale, where)


LEGACY_KEYS = {"residual"}  # written by format version 1 (derived now)


def _from_dict(cls, d: dict):
    """A (nested) spec from its `dataclasses.asdict` form, typed by the field annotations."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names - LEGACY_KEYS
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**{k: _decode(hints[k], v) for k, v in d.items() if k in names})


def _decode(tp, v):
    if v is None:
        return None
    if dataclasses.is_dataclass(tp):
        return _from_dict(tp, v)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _decode(next(a for a in args if a is not type(None)), v)
    if origin is tuple:
        return tuple(_decode(args[0], x) for x in v)
    return v
