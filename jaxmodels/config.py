"""The layer plan: a frozen, hashable description of a model that every executor reads.

`ModelConfig.layers` holds one `LayerSpec` per decoder layer. Layers with equal specs share one
parameter stack and one cache layout; `jaxmodels.model` scans over repeating runs of them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding of one layer kind (HF `modeling_rope_utils` semantics)."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | dynamic | llama3 | yarn
    factor: float = 1.0
    interleaved: bool = False  # pairs (2j, 2j+1) rotate (Cohere) instead of halves
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
class AttentionSpec:
    window: int | None = None  # sliding window W: the query and W-1 earlier keys; None = full causal
    rope: RopeSpec | None = field(default_factory=RopeSpec)  # None = NoPE
    qk_norm: str | None = None  # None | a norm kind (see NORM_KINDS), applied per head before RoPE
    qk_norm_per_head: bool = False  # Cohere: one weight row per head ([heads, head_dim])
    qkv_bias: bool = False
    out_bias: bool = False
    sinks: bool = False  # GPT-OSS: a learned per-head logit that absorbs probability mass
    scale: float | None = None  # None = head_dim ** -0.5
    softcap: float | None = None  # score = cap * tanh(score / cap)


@dataclass(frozen=True)
class MLPSpec:
    kind: str = "gated"  # gated: down(act(gate x) * up x) | moe: routed gated experts
    activation: str = "silu"  # silu | gelu_tanh | gelu | swiglu_clamp | silu_limit
    intermediate_size: int = 0  # per expert for moe
    bias: bool = False
    clamp_alpha: float = 1.702  # swiglu_clamp only
    clamp_limit: float = 7.0  # swiglu_clamp only
    # moe only
    num_experts: int = 0
    top_k: int = 0
    router: str = "softmax_topk"  # softmax_topk: softmax over all -> top-k (Qwen3-MoE) | topk_softmax: top-k
    #                               of the logits -> softmax over k (GPT-OSS)
    renormalize: bool = False  # softmax_topk: divide the k weights by their sum
    router_bias: bool = False  # a bias added to the router logits
    shared_intermediate_size: int = 0  # a shared (always-on) gated expert of this width; 0 = none

    def __post_init__(self):
        if self.kind not in ("gated", "moe"):
            raise ValueError(f"MLPSpec.kind must be 'gated' or 'moe', got {self.kind!r}")
        if self.kind == "moe" and not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"moe needs 0 < top_k <= num_experts, got {self.top_k} of {self.num_experts}")


NORM_KINDS = ("rms", "rms_fp32", "gemma", "layernorm")
BLOCK_KINDS = ("pre", "post", "sandwich", "parallel")


@dataclass(frozen=True)
class LayerSpec:
    attention: AttentionSpec = field(default_factory=AttentionSpec)
    mlp: MLPSpec = field(default_factory=MLPSpec)
    block: str = "pre"  # pre | post | sandwich | parallel (where the norms sit)
    norm: str = "rms"  # rms (HF RMS A) | rms_fp32 (RMS B) | gemma (1+w) | layernorm (no bias)
    residual: str = "plain"

    def __post_init__(self):
        if self.block not in BLOCK_KINDS:
            raise ValueError(f"LayerSpec.block must be one of {BLOCK_KINDS}, got {self.block!r}")
        if self.norm not in NORM_KINDS:
            raise ValueError(f"LayerSpec.norm must be one of {NORM_KINDS}, got {self.norm!r}")


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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["layers"] = tuple(_layer_from_dict(x) for x in d["layers"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls.from_dict(json.loads(text))


def _layer_from_dict(d: dict[str, Any]) -> LayerSpec:
    a = dict(d["attention"])
    a["rope"] = RopeSpec(**a["rope"]) if a.get("rope") else None
    return LayerSpec(
        attention=AttentionSpec(**a),
        mlp=MLPSpec(**d["mlp"]),
        **{k: v for k, v in d.items() if k not in ("attention", "mlp")},
    )
