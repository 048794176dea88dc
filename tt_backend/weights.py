"""jaxmodels params -> the host tensors a TT program reads, and the precision policy.

What changes on the way (tt_transformers `load_checkpoints.py`, `model_config.py`):
- Q/K projections of HF half-split RoPE families are permuted to TT's interleaved ("Meta") layout,
  because `rotary_embedding_llama` rotates adjacent pairs (spec §2.3). Families whose checkpoints
  are already interleaved (Cohere: `RopeSpec.interleaved`) are left alone: permuting them scrambled
  Cohere's weights in a real bring-up. The same permutation applies to q/k biases and to q/k-norm
  weights, which act per head-dim element. V is not rotated, so it is never permuted.
- Q, K and V are fused into one `wqkv` [D, (H + 2K) d] (one matmul, then `nlp_create_qkv_heads`).
- Gemma's (1 + w) norm weights are precomputed, so the device runs a plain `rms_norm`.
- Weights are [in, out] matrices with two leading unit dims ([1, 1, in, out]), as ttnn stores them.

Returned arrays are float32; their storage dtype (bf16 / bfloat8_b / bfloat4_b) is decided by the
precision policy and applied by the executor (host packing, as `ttnn.as_tensor` does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmodels.config import LayerSpec, ModelConfig
from jaxmodels.layers.rope import inv_freq

# ------------------------------------------------------------------------------ precision policy
FIDELITIES = ("LoFi", "HiFi2", "HiFi3", "HiFi4")


@dataclass(frozen=True)
class OpConfig:
    """A `WormholeComputeKernelConfig`: these four fields change the numbers (spec §3.4)."""

    math_fidelity: str = "HiFi2"
    math_approx_mode: bool = False
    fp32_dest_acc_en: bool = True
    packer_l1_acc: bool = True

    def kwargs(self) -> dict:
        return {"type": "ttnn.WormholeComputeKernelConfig", "math_fidelity": f"ttnn.MathFidelity.{self.math_fidelity}",
                "math_approx_mode": self.math_approx_mode, "fp32_dest_acc_en": self.fp32_dest_acc_en,
                "packer_l1_acc": self.packer_l1_acc}


LOFI = OpConfig("LoFi", True, False, True)
HIFI2 = OpConfig("HiFi2", True, True, True)
HIFI2_FP16 = OpConfig("HiFi2", True, False, True)
HIFI4 = OpConfig("HiFi4", False, True, True)


@dataclass(frozen=True)
class Precision:
    """tt_transformers' `DecodersPrecision`: a dtype per TensorGroup, a compute config per OpGroup."""

    name: str
    ff1_3: str  # w1 / w3 (gate / up)
    ff2: str  # w2 (down)
    wqkv: str
    wo: str
    kv_cache: str
    lm_head: str
    activation: str = "ttnn.bfloat16"
    li_ff1_3: OpConfig = HIFI2
    li_ff2: OpConfig = HIFI2
    li_qkv: OpConfig = HIFI2
    li_o: OpConfig = HIFI2
    sdpa: OpConfig = HIFI2
    lm_head_op: OpConfig = HIFI2
    norm: OpConfig = HIFI2  # models/common/rmsnorm.py: HiFi2 with fp32 accumulation
    rope: OpConfig = HIFI4
    router: OpConfig = OpConfig("HiFi3", False, True, True)  # GPT-OSS topk.py: HiFi3, fp32 accumulation


POLICIES = {
    # bfp4 MLP gate/up with LoFi, bfp8 elsewhere (tt_transformers' default "performance" decoder)
    "performance": Precision("performance", ff1_3="ttnn.bfloat4_b", ff2="ttnn.bfloat8_b", wqkv="ttnn.bfloat8_b",
                             wo="ttnn.bfloat8_b", kv_cache="ttnn.bfloat8_b", lm_head="ttnn.bfloat8_b",
                             li_ff1_3=LOFI, li_ff2=HIFI2_FP16),
    # bfp8 MLP, bf16 attention weights, HiFi4 attention matmuls ("accuracy")
    "accuracy": Precision("accuracy", ff1_3="ttnn.bfloat8_b", ff2="ttnn.bfloat8_b", wqkv="ttnn.bfloat16",
                          wo="ttnn.bfloat16", kv_cache="ttnn.bfloat8_b", lm_head="ttnn.bfloat16",
                          li_qkv=HIFI4, li_o=HIFI4, sdpa=HIFI4, lm_head_op=HIFI4),
}


@dataclass(frozen=True)
class DecodersPrecision:
    """A `Precision` per decoder layer (tt_transformers' `DecodersPrecision`): `base` holds the
    model-wide settings (KV-cache dtype, LM head, norms, RoPE, router) and `layers[i]` layer i's
    weight dtypes and matmul fidelities. `tt_backend.precision.choose` fills it from measured
    sensitivities; every layer must keep the base's KV-cache dtype (the caches share one dtype)."""

    name: str
    base: Precision
    layers: tuple[Precision, ...]

    def __post_init__(self):
        bad = [i for i, p in enumerate(self.layers) if p.kv_cache != self.base.kv_cache]
        if bad:
            raise ValueError(f"layers {bad}: the KV-cache dtype is model-wide ({self.base.kv_cache})")

    def layer(self, i: int) -> Precision:
        return self.layers[i]

    # model-wide fields read through the base (lm_head, kv_cache, norm, ...)
    def __getattr__(self, item):
        if item in Precision.__dataclass_fields__:
            return getattr(self.base, item)
        raise AttributeError(item)


def layer_policy(p: "Precision | DecodersPrecision", i: int) -> Precision:
    """Layer i's settings: the per-layer entry of a DecodersPrecision, else the uniform policy."""
    return p.layer(i) if isinstance(p, DecodersPrecision) else p


def policy(p: "str | Precision | DecodersPrecision") -> "Precision | DecodersPrecision":
    if isinstance(p, (Precision, DecodersPrecision)):
        return p
    try:
        return POLICIES[p]
    except KeyError:
        raise ValueError(f"unknown precision policy {p!r}; one of {sorted(POLICIES)}") from None


# ------------------------------------------------------------------------------- RoPE layout
def needs_meta_permutation(spec: LayerSpec) -> bool:
    """HF half-split (rotate_half) RoPE layers must be permuted to TT's adjacent-pair layout;
    already-interleaved checkpoints (Cohere) and NoPE layers must not be."""
    r = spec.attention.rope
    return r is not None and not r.interleaved


def meta_permutation(head_dim: int) -> np.ndarray:
    """Index map within one head: new[2j] = old[j], new[2j + 1] = old[j + d/2]
    (tt_transformers' `reverse_permute`, written as a gather)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


def rope_tables(rope, head_dim: int, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [max_seq_len, head_dim] in the Meta layout: each frequency duplicated pairwise
    (tt_transformers `gather_cos_sin`), scaled by the rope kind's attention factor."""
    if rope.kind == "dynamic":
        raise NotImplementedError("dynamic NTK RoPE rescales its base with the sequence length at run time; "
                                  "TT rope tables are fixed at load time")
    inv, af = inv_freq(rope, head_dim)
    ang = np.arange(max_seq_len, dtype=np.float32)[:, None] * inv[None, :].astype(np.float32)
    cos, sin = (np.cos(ang) * np.float32(af)).astype(np.float32), (np.sin(ang) * np.float32(af)).astype(np.float32)
    return np.repeat(cos, 2, axis=1), np.repeat(sin, 2, axis=1)


def trans_mat() -> np.ndarray:
    """The 32x32 tile T with x @ T = (-x1, x0, -x3, x2, ...): swaps adjacent pairs with a sign
    (tt_transformers `get_rot_transformation_mat`)."""
    t = np.zeros((32, 32), np.float32)
    t[np.arange(1, 32, 2), np.arange(0, 32, 2)] = -1.0
    t[np.arange(0, 32, 2), np.arange(1, 32, 2)] = 1.0
    return t


# ---------------------------------------------------------------------------------- weights
def _np(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _mat(w) -> np.ndarray:
    return _np(w)[None, None]


def layer_weights(cfg: ModelConfig, spec: LayerSpec, p: dict) -> dict[str, np.ndarray]:
    """One decoder layer's params (unstacked: jaxmodels' per-kind stacks indexed by rank) -> TT tensors."""
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a, attn = spec.attention, p["attn"]
    perm = meta_permutation(d) if needs_meta_permutation(spec) else np.arange(d)
    wq, wk, wv = _np(attn["wq"])[..., perm], _np(attn["wk"])[..., perm], _np(attn["wv"])
    out = {"wqkv": _mat(np.concatenate([wq.reshape(D, H * d), wk.reshape(D, K * d), wv.reshape(D, K * d)], 1)),
           "wo": _mat(_np(attn["wo"]).reshape(H * d, D))}
    if a.qkv_bias:
        b = np.concatenate([_np(attn["bq"])[..., perm].reshape(-1), _np(attn["bk"])[..., perm].reshape(-1),
                            _np(attn["bv"]).reshape(-1)])
        out["bqkv"] = b[None, None, None]
    if a.out_bias:
        out["bo"] = _np(attn["bo"])[None, None, None]
    if a.qk_norm:
        for n in ("q_norm", "k_norm"):
            w = _np(attn[n])[..., perm]
            w = 1.0 + w if a.qk_norm == "gemma" else w
            # per-head weights [heads, d] multiply [.., heads, .., d] activations after a weightless norm
            out[n] = w[None, :, None, :] if a.qk_norm_per_head else w[None, None, None, :]
    if a.sinks:
        out["sinks"] = _np(attn["sinks"])[None, None, None, :]
    m = p["mlp"]
    vec = lambda v: _np(v)[None, None, None]  # noqa: E731
    if spec.mlp.kind == "moe":  # router + one w1/w3/w2 (+ biases) per expert
        out |= {"router": _mat(m["router"])} | ({"router_bias": vec(m["router_bias"])} if spec.mlp.router_bias else {})
        for e in range(spec.mlp.num_experts):
            out |= {f"e{e}.w1": _mat(m["w_gate"][e]), f"e{e}.w3": _mat(m["w_up"][e]), f"e{e}.w2": _mat(m["w_down"][e])}
            if spec.mlp.bias:
                out |= {f"e{e}.b1": vec(m["b_gate"][e]), f"e{e}.b3": vec(m["b_up"][e]), f"e{e}.b2": vec(m["b_down"][e])}
    else:
        out |= {"w1": _mat(m["w_gate"]), "w3": _mat(m["w_up"]), "w2": _mat(m["w_down"])}
        if spec.mlp.bias:
            out |= {"b1": vec(m["b_gate"]), "b3": vec(m["b_up"]), "b2": vec(m["b_down"])}
    for n in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        if n in p:
            w = _np(p[n])
            out[n] = (1.0 + w if spec.norm == "gemma" else w)[None, None, None]
    return out


def prepare(cfg: ModelConfig, params: dict, max_seq_len: int) -> dict[str, np.ndarray]:
    """All host tensors of a model, named as the lowered programs name them."""
    from jaxmodels.plan import plan  # the layer -> (kind, rank) map of the param tree

    pl = plan(cfg)
    out: dict[str, np.ndarray] = {"embed": _np(params["embed"])}
    for i, spec in enumerate(cfg.layers):
        k, r = pl.kind_of[i], pl.rank_of[i]
        p = _index(params["layers"][str(k)], r)
        for n, v in layer_weights(cfg, spec, p).items():
            out[f"layers.{i}.{n}"] = v
    fn = _np(params["final_norm"])
    out["final_norm"] = (1.0 + fn if cfg.norm == "gemma" else fn)[None, None, None]
    out["lm_head"] = _mat(_np(params["embed"]).T if cfg.tie_embeddings else params["lm_head"])
    for name, rope in rope_specs(cfg).items():
        cos, sin = rope_tables(rope, cfg.head_dim, max_seq_len)
        out[f"{name}.cos"], out[f"{name}.sin"] = cos, sin
    out["rope.trans_mat"] = trans_mat()[None, None]
    return out


def rope_specs(cfg: ModelConfig) -> dict:
    """A name per distinct RopeSpec ("rope0", "rope1", ...): Gemma3 has a local and a global table."""
    out = {}
    for spec in cfg.layers:
        r = spec.attention.rope
        if r is not None and r not in out.values():
            out[f"rope{len(out)}"] = r
    return out


def _index(tree, r):
    return {k: _index(v, r) for k, v in tree.items()} if isinstance(tree, dict) else tree[r]
