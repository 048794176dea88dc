"""DeepSeek V4 and V4.1: HF config.json -> `DeepseekConfig`, with each layer's role spelled out.

The layer roles (specs/deepseek_v4.md §1.3, §13) decide what a layer computes:
  V4   every ratio>0 layer compresses its own KV; ratio-4 layers (CSA) run an indexer with its own
       overlapped compressor, ratio-128 layers (HCA) attend every visible compressed entry.
  V4.1 only the kv-source layers compress; the other ratio>0 layers reuse the latest source's compressed
       KV and top-k; index sources score against their own (or the latest) indexer keys, and the layers
       after the candidate source only rescore inside its candidate blocks.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from jaxmodels.config import RopeSpec

V4, V41 = "deepseek_v4", "deepseek_v41"


@dataclass(frozen=True)
class DSLayer:
    ratio: int = 0  # compress ratio; 0 = sliding window only
    compress: bool = False  # runs a compressor and publishes its compressed KV
    select: str = "none"  # compressed entries attended: none | all (V4 HCA) | indexer (own top-k) | reuse (published)
    index_keys: str = "none"  # indexer keys: compressor (V4, own overlapped compressor) | latent (V4.1 kv source:
    #                           wk of the pre-RoPE latent) | shared (V4.1: the latest published keys)
    candidate_source: bool = False  # publishes candidate blocks (V4.1)
    candidate_filter: bool = False  # rescores only inside the published candidate blocks (V4.1)
    engram: int = -1  # index into the engram layers, -1 = none
    hash_moe: bool = False  # V4: experts picked by token id (tid2eid)

    @property
    def overlap(self) -> bool:  # V4 CSA: each entry pools the previous group too, through 2x-wide projections
        return self.select == "indexer" and self.index_keys == "compressor"


@dataclass(frozen=True)
class DeepseekConfig:
    family: str  # deepseek_v4 | deepseek_v41
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int  # = the shared K=V latent width
    rope_dim: int  # RoPE on the last rope_dim channels (interleaved pairs)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    layers: tuple[DSLayer, ...]
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    rope_theta: float = 10000.0
    compress_rope: RopeSpec = field(default_factory=RopeSpec)  # ratio>0 layers: theta 160000 + YaRN, no mscale
    norm_eps: float = 1e-6
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    score_func: str = "sqrtsoftplus"
    route_scale: float = 1.0
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_iters: int = 20
    hc_eps: float = 1e-6
    engram_max_ngram: int = 0
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_layer_ids: tuple[int, ...] = ()
    engram_compressed_vocab: int = 0  # classes of the normalised vocabulary (the hash multipliers depend on it)
    engram_pad_token: int = 2  # a raw token id; its compressed class pads the n-grams
    engram_rows: tuple[int, ...] = ()
    mtp_layers: int = 0  # V4: classic MTP blocks; V4.1: DSpark blocks
    mtp_num_experts: int = 0
    mtp_top_k: int = 0
    dspark_block_size: int = 0
    dspark_noise_token: int = 0
    dspark_target_layers: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    quant_block: int = 32  # FP8 weight/activation block (V4.1: 32, V4: 128)
    numerics: str = "plain"  # plain | reference (the reference's simulated FP8/FP4 quantisation)
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.numerics not in ("plain", "reference"):
            raise ValueError(f"numerics must be 'plain' or 'reference', got {self.numerics!r}")
        if self.rope_dim % 2 or self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim={self.rope_dim} must be even and <= head_dim={self.head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"heads*head_dim is not divisible by o_groups={self.o_groups}")
        if any(L.candidate_filter for L in self.layers) and (
                self.candidate_topk_blocks * self.candidate_block_size - (self.candidate_block_size - 1)
                < self.index_topk):
            # below this, the reference may attend visible entries outside the candidates; we keep top-k inside
            raise ValueError("candidate_topk_blocks * candidate_block_size - (block - 1) must be >= index_topk")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def v41(self) -> bool:
        return self.family == V41

    @property
    def main_rope(self) -> RopeSpec:
        return RopeSpec(theta=self.rope_theta, interleaved=True)

    def rope_for(self, layer: DSLayer) -> RopeSpec:
        return self.compress_rope if layer.ratio else self.main_rope

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekConfig":
        d = dict(d)
        d["layers"] = tuple(DSLayer(**x) for x in d["layers"])
        d["compress_rope"] = RopeSpec(**d["compress_rope"])
        for k in ("eos_token_ids", "engram_layer_ids", "engram_rows", "dspark_target_layers"):
            d[k] = tuple(d.get(k) or ())
        return cls(**d)


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
        return [0 if x == "sliding_attention" else int(rates[x]) for x in t["layer_types"][:n]]
    if t.get("compress_ratios") is not None:
        return [int(r) for r in t["compress_ratios"][:n]]
    return [128] * min(n, 2) + [4 if i % 2 else 128 for i in range(max(n - 2, 0))]  # HF's V4-Pro default


def _hash_layers(t: dict, n: int) -> int:
    if t.get("mlp_layer_types"):
        return sum(x == "hash_moe" for x in t["mlp_layer_types"][:n])
    return int(t.get("num_hash_layers", 3))


def config(hf: dict) -> DeepseekConfig:
    """HF config.json (V4 flat, or V4.1 composite with `text_config`) -> DeepseekConfig."""
    mt = hf.get("model_type")
    t = dict(hf.get("text_config") or hf)
    family = V41 if mt == V41 or t.get("model_type") == V41 else V4
    n = t["num_hidden_layers"]
    n_mtp = int(t.get("num_nextn_predict_layers", 0))
    d = t.get("head_dim", 512)
    rope_dim = t.get("qk_rope_head_dim") or int(round(d * t.get("partial_rotary_factor", 64 / 512)))
    engram_ids = tuple(t.get("engram_layer_ids") or ())
    layers = []
    if family == V41:
        ratios = [int(r) for r in t["compress_ratios"]][:n]
        kv_src = set(t.get("kv_source_layer_ids") or ())
        idx_src = set(t.get("index_source_layer_ids") or ())
        cand = int(t.get("candidate_source_layer_id", -1))
        for i, r in enumerate(ratios):
            if r and not kv_src & set(range(i + 1)):
                raise ValueError(f"layer {i} has compress ratio {r} but no kv source at or before it")
            own = i in kv_src
            indexer = i in idx_src
            layers.append(DSLayer(
                ratio=r, compress=own,
                select="none" if not r else ("indexer" if indexer else "reuse"),
                index_keys="latent" if own and indexer else ("shared" if indexer else "none"),
                candidate_source=i == cand, candidate_filter=indexer and 0 <= cand < i,
                engram=engram_ids.index(i) if i in engram_ids else -1))
    else:
        n_hash = _hash_layers(t, n)
        types = t.get("layer_types") or [None] * n
        for i, (r, kind) in enumerate(zip(_ratios_v4(t, n), types)):
            # CSA (overlapped compressor + indexer) by its layer type when named, else by the reference's ratio 4
            csa = kind == "compressed_sparse_attention" if kind else r == 4
            layers.append(DSLayer(ratio=r, compress=r > 0, select="none" if not r else ("indexer" if csa else "all"),
                                  index_keys="compressor" if csa else "none", hash_moe=i < n_hash))
    q = hf.get("quantization_config") or t.get("quantization_config") or {}
    block = (q.get("weight_block_size") or [128 if family == V4 else 32])[0]
    eos = t.get("eos_token_id", hf.get("eos_token_id", 1))
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    dspark = family == V41
    return DeepseekConfig(
        family=family, vocab_size=t.get("vocab_size", 129280), hidden_size=t["hidden_size"],
        num_heads=t["num_attention_heads"], head_dim=d, rope_dim=rope_dim, q_lora_rank=t["q_lora_rank"],
        o_groups=t.get("o_groups", 8), o_lora_rank=t.get("o_lora_rank", 1024), window=t.get("sliding_window", 128),
        layers=tuple(layers), index_n_heads=t.get("index_n_heads", 0), index_head_dim=t.get("index_head_dim", 0),
        index_topk=t.get("index_topk", 0), candidate_topk_blocks=t.get("candidate_topk_blocks", 0),
        candidate_block_size=t.get("candidate_block_size", 0), rope_theta=float(t.get("rope_theta", 10000.0)),
        compress_rope=_yarn(t, t.get("compress_rope_theta", 160000.0)),
        norm_eps=float(t.get("rms_norm_eps", 1e-20 if family == V41 else 1e-6)),
        num_experts=t.get("n_routed_experts", t.get("num_local_experts", 0)), top_k=t.get("num_experts_per_tok", 0),
        moe_intermediate_size=t.get("moe_intermediate_size", 0), score_func=t.get("scoring_func", "sqrtsoftplus"),
        route_scale=float(t.get("routed_scaling_factor", 1.0)), norm_topk_prob=bool(t.get("norm_topk_prob", True)),
        swiglu_limit=float(t.get("swiglu_limit", 10.0)), hc_mult=t.get("hc_mult", 4),
        hc_iters=t.get("hc_sinkhorn_iters", 20), hc_eps=float(t.get("hc_eps", 1e-6)),
        engram_max_ngram=t.get("engram_max_ngram_size", 0) if engram_ids else 0,
        engram_vocab_size=t.get("engram_vocab_size", 0), engram_n_heads=t.get("engram_n_heads", 0),
        engram_head_dim=t.get("engram_head_dim", 0), engram_layer_ids=engram_ids,
        engram_compressed_vocab=t.get("engram_compressed_vocab_size", 0),
        engram_pad_token=int(t.get("engram_pad_token_id", t.get("engram_pad_id", 2))),
        engram_rows=tuple(t.get("engram_num_embeddings") or ()),
        mtp_layers=n_mtp, mtp_num_experts=t.get("dspark_n_routed_experts", 0) if dspark else 0,
        mtp_top_k=t.get("dspark_num_experts_per_tok", 0) if dspark else 0,
        dspark_block_size=t.get("dspark_block_size", 0) if dspark else 0,
        dspark_noise_token=t.get("dspark_noise_token_id", 0) if dspark else 0,
        dspark_target_layers=tuple(t.get("dspark_target_layer_ids") or ()) if dspark else (),
        dspark_markov_rank=t.get("dspark_markov_rank", 0) if dspark else 0,
        quant_block=int(block), max_position_embeddings=t.get("max_position_embeddings", 1 << 20),
        bos_token_id=t.get("bos_token_id", hf.get("bos_token_id", 0)), eos_token_ids=eos,
        pad_token_id=t.get("pad_token_id", hf.get("pad_token_id")),
    )
