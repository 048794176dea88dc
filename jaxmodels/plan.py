"""The plan contract, in pure Python: what executors, converters, sharding rules and lowerings read.

- `plan(cfg)`: the layer *kinds* (distinct `LayerSpec`s, each with one parameter stack) and the *runs* the
  executor scans: the layer sequence split into repeated bodies, nested, so that depth costs no compile time.
- `param_specs(cfg)`: one `ParamSpec` per parameter — shape, logical axes (for sharding), init and dtype
  policy — as a tree shaped like the params. Layer parameters are stacked per kind: `layers/<kind>/...`.
- `cache_specs(cfg, spec)`: what a layer kind's cache *is* (as vLLM's KVCacheSpec): slot caches (token rings
  or compressed entries) and per-sequence state; `jaxmodels.cache` lays them out, contiguous or paged.

Nothing here imports JAX.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jaxmodels.config import LayerSpec, ModelConfig


# ----------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Run:
    """Layers start .. start + period*repeats - 1: `body` (runs covering one period, in coordinates of the first
    repeat) executed `repeats` times. A run without a body is the single layer `start`."""

    start: int
    period: int
    repeats: int
    body: tuple["Run", ...] | None = None


@dataclass(frozen=True)
class Plan:
    kinds: tuple[LayerSpec, ...]  # distinct layer specs, in order of first appearance
    kind_of: tuple[int, ...]  # per layer
    rank_of: tuple[int, ...]  # per layer: index inside its kind's stack
    counts: tuple[int, ...]  # layers per kind
    runs: tuple[Run, ...]

    def bodies(self) -> int:
        """Layer bodies the executor traces (compile time grows with this, not with depth)."""
        return _cost(self.runs)


@functools.lru_cache(maxsize=256)
def plan(cfg: ModelConfig) -> Plan:
    kinds, kind_of, rank_of = [], [], []
    for spec in cfg.layers:
        if spec not in kinds:
            kinds.append(spec)
        k = kinds.index(spec)
        rank_of.append(kind_of.count(k))
        kind_of.append(k)
    counts = tuple(kind_of.count(k) for k in range(len(kinds)))
    return Plan(tuple(kinds), tuple(kind_of), tuple(rank_of), counts, _runs(tuple(kind_of), 0))


def _cost(runs) -> int:
    return sum(1 if r.body is None else _cost(r.body) for r in runs)


def _runs(seq: tuple[int, ...], offset: int) -> tuple[Run, ...]:
    """`seq` split into runs with the fewest layer bodies (ties: fewer runs), each repeated body split the same way;
    layer indices start at `offset`. Repeats are looked for at every position (a period p repeated r >= 2 times),
    so irregular plans (DeepSeek V4.1: 2 window layers, [source, 5 reuse] x 2, ..., [reindex, 3 reuse] x 4) scan
    their runs too."""
    return tuple(Run(offset + i, 1, 1) if p is None else Run(offset + i, p, r, _runs(seq[i: i + p], offset + i))
                 for i, p, r in _split(seq)[2])


@functools.lru_cache(maxsize=4096)
def _split(seq: tuple[int, ...]):
    """(bodies, runs, ((start, period or None, repeats), ...)) of the best split of `seq`, positions relative to it."""
    n = len(seq)
    best: list = [None] * n + [(0, 0, ())]  # best[i]: the best split of seq[i:]
    for i in range(n - 1, -1, -1):
        tail = best[i + 1]
        cands = [(1 + tail[0], 1 + tail[1], ((i, None, 1),) + tail[2])]
        for p in range(1, (n - i) // 2 + 1):
            r = 1
            while i + (r + 1) * p <= n and seq[i + r * p: i + (r + 1) * p] == seq[i: i + p]:
                r += 1
            body = _split(seq[i: i + p])[0] if r > 1 else 0
            for rr in range(2, r + 1):  # fewer repeats may let a better run start sooner
                tail = best[i + rr * p]
                cands.append((body + tail[0], 1 + tail[1], ((i, p, rr),) + tail[2]))
        best[i] = min(cands, key=lambda c: (c[0], c[1]))
    return best[0]


# ----------------------------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParamSpec:
    """One parameter: shape, logical axis names (sharding rules map them to mesh axes), init and dtype policy.

    init: normal (std * N(0, 1)) | ones | zeros | half (0.5) | expert_ids (uniform in [0, experts)) | classes
    (token id // 2: a stand-in Engram map). dtype: None follows the model dtype; "float32" stays fp32 whatever
    the model dtype (what checkpoint and reference keep fp32); "int32" for tables.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"
    dtype: str | None = None

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec: shape {self.shape} but axes {self.axes}")

    def stacked(self, n: int) -> "ParamSpec":
        return ParamSpec((n, *self.shape), ("layers", *self.axes), self.init, self.dtype)


def _p(shape, axes, init="normal", dtype=None) -> ParamSpec:
    return ParamSpec(tuple(shape), tuple(axes), init, dtype)


def _norm(dim: int, offset: bool = False) -> ParamSpec:
    return _p((dim,), ("norm",), "zeros" if offset else "ones")


def _gqa_specs(cfg: ModelConfig, spec: LayerSpec) -> dict:
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = spec.attention
    out = {"wq": _p((D, H, d), ("embed", "heads", "head_dim")), "wk": _p((D, K, d), ("embed", "kv_heads", "head_dim")),
           "wv": _p((D, K, d), ("embed", "kv_heads", "head_dim")), "wo": _p((H, d, D), ("heads", "head_dim", "embed"))}
    if a.qkv_bias:
        out |= {"bq": _p((H, d), ("heads", "head_dim")), "bk": _p((K, d), ("kv_heads", "head_dim")),
                "bv": _p((K, d), ("kv_heads", "head_dim"))}
    if a.out_bias:
        out["bo"] = _p((D,), ("norm",))
    if a.qk_norm:
        init = "zeros" if a.qk_norm == "gemma" else "ones"
        if a.qk_norm_per_head:
            out |= {"q_norm": _p((H, d), ("heads", "head_dim"), init), "k_norm": _p((K, d), ("kv_heads", "head_dim"), init)}
        else:
            out |= {"q_norm": _p((d,), ("norm",), init), "k_norm": _p((d,), ("norm",), init)}
    if a.sinks:
        out["sinks"] = _p((H,), ("heads",))
    return out


def _compressor(D: int, width: int, out: int, ratio: int, gate: bool, ape: bool) -> dict:
    c = {"wkv": _p((D, width), ("embed", None)), "norm": _norm(out)}
    if gate:
        c["wgate"] = _p((D, width), ("embed", None))
    if ape:  # V4's in-group position bias
        c["ape"] = _p((ratio, width), (None, None), dtype="float32")
    return c


def _mla_specs(cfg: ModelConfig, spec: LayerSpec) -> dict:
    D, H, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    m = spec.attention.mla
    G, Ro, Dq = m.o_groups, m.o_lora_rank, m.q_lora_rank
    out = {"wq_a": _p((D, Dq), ("embed", None)), "q_norm": _norm(Dq), "wq_b": _p((Dq, H * d), (None, "heads")),
           "wkv": _p((D, d), ("embed", None)), "kv_norm": _norm(d),
           "wo_a": _p((G, H * d // G, Ro), ("heads", None, None)), "wo_b": _p((G * Ro, D), ("heads", "embed")),
           "sinks": _p((H,), ("heads",), dtype="float32")}
    if m.compress:
        out["compressor"] = _compressor(D, 2 * d if m.overlap else d, d, m.ratio, m.compressor_gate, m.variant == "v4")
    if m.select == "indexer":
        HI, dI = m.index_heads, m.index_head_dim
        idx = {"wq_b": _p((Dq, HI * dI), (None, "heads")), "weights_proj": _p((D, HI), ("embed", "heads"))}
        if m.index_keys == "latent":
            idx |= {"wk": _p((d, dI), (None, None)), "k_norm": _norm(dI)}
        if m.index_keys == "compressor":
            idx["compressor"] = _compressor(D, 2 * dI, dI, m.ratio, True, True)
        out["indexer"] = idx
    return out


def _dense_mlp(D: int, I: int, bias: bool) -> dict:
    out = {"w_gate": _p((D, I), ("embed", "mlp")), "w_up": _p((D, I), ("embed", "mlp")),
           "w_down": _p((I, D), ("mlp", "embed"))}
    if bias:
        out |= {"b_gate": _p((I,), ("mlp",)), "b_up": _p((I,), ("mlp",)), "b_down": _p((D,), ("norm",))}
    return out


def mlp_param_specs(D: int, m, vocab_size: int = 0) -> dict:
    """The parameters of one MLP (gated, or MoE with its router) on a hidden size D."""
    I = m.intermediate_size
    if m.kind == "gated":
        return _dense_mlp(D, I, m.bias)
    E = m.num_experts
    experts = {k: ParamSpec((E, *v.shape), ("experts", *v.axes)) for k, v in _dense_mlp(D, I, m.bias).items()}
    out = {"router": _p((D, E), ("embed", None))} | {k: experts[k] for k in ("w_gate", "w_up", "w_down")}
    if m.router_bias:
        out["router_bias"] = _p((E,), (None,))
    out |= experts  # the expert biases
    if m.router == "hash":
        out["tid2eid"] = _p((vocab_size, m.top_k), (None, None), "expert_ids", "int32")
    if m.selection_bias:  # fp32: bf16 would flip near-tied picks
        out["selection_bias"] = _p((E,), (None,), dtype="float32")
    if m.shared_intermediate_size:
        out["shared"] = _dense_mlp(D, m.shared_intermediate_size, False)
    return out


def _hc(n: int, D: int, mixes: int) -> dict:
    return {"fn": _p((mixes, n * D), (None, None), dtype="float32"), "base": _p((mixes,), (None,), dtype="float32"),
            "scale": _p((3 if mixes > n else 1,), (None,), "half", "float32")}


def layer_param_specs(cfg: ModelConfig, spec: LayerSpec) -> dict:
    """The parameters of one layer of this spec (unstacked)."""
    D = cfg.hidden_size
    attn = _mla_specs(cfg, spec) if spec.attention.kind == "mla" else _gqa_specs(cfg, spec)
    norms = {"pre": ("attn_norm", "mlp_norm"), "parallel": ("attn_norm",),
             "sandwich": ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"),
             "post": ("post_attn_norm", "post_mlp_norm")}[spec.block]
    out = {"attn": attn, "mlp": mlp_param_specs(D, spec.mlp, cfg.vocab_size)} | {n: _norm(D, spec.norm == "gemma") for n in norms}
    if spec.attention.kind == "cross":  # Mllama: tanh gates on both residual branches
        out["attn"]["gate"], out["mlp_gate"] = _p((1,), (None,)), _p((1,), (None,))
    if spec.mhc is not None:
        n = spec.mhc.copies
        out |= {"hc_attn": _hc(n, D, (2 + n) * n), "hc_mlp": _hc(n, D, (2 + n) * n)}
    if spec.engram >= 0:
        e = cfg.engram
        cols, n = (e.max_ngram - 1) * e.n_heads, spec.mhc.copies if spec.mhc else 1
        out["engram"] = {"table": _p((e.rows[spec.engram], e.head_dim), ("table_rows", None)),
                         "wkv": _p((cols * e.head_dim, (n + 1) * D), (None, None)),
                         "q_weight": _p((n, D), (None, "embed"), "ones"), "k_weight": _p((n, D), (None, "embed"), "ones")}
    return out


def _tree_map(f, tree):
    """f over the leaves, keys sorted as jax.tree.map orders them (init_params draws layer parameters in this order)."""
    return {k: _tree_map(f, v) if isinstance(v, dict) else f(v) for k, v in sorted(tree.items())}


def _decoder_layer(cfg: ModelConfig, spec: LayerSpec) -> dict:
    """A decoder layer's parameters: `layer_param_specs`, plus DeepSeek V4.1's router bias for image tokens
    (`mlp/selection_bias_vl`, its checkpoint's `ffn.gate.bias_vl`) when the model sees images."""
    out = layer_param_specs(cfg, spec)
    if cfg.vision is not None and cfg.vision.kind == "deepseek_vit" and spec.mlp.selection_bias:
        out["mlp"]["selection_bias_vl"] = _p((spec.mlp.num_experts,), (None,), dtype="float32")
    return out


@functools.lru_cache(maxsize=256)
def param_specs(cfg: ModelConfig) -> dict:
    """Nested dict of every parameter's `ParamSpec`: the contract converters fill and check."""
    pl = plan(cfg)
    D, V = cfg.hidden_size, cfg.vocab_size
    out = {"embed": _p((V, D), ("vocab", "embed")),
           "layers": {str(k): _tree_map(lambda s, n=n: s.stacked(n), _decoder_layer(cfg, spec))
                      for k, (spec, n) in enumerate(zip(pl.kinds, pl.counts))},
           "final_norm": _norm(D, cfg.norm == "gemma")}
    if not cfg.tie_embeddings:
        out["lm_head"] = _p((D, cfg.head_vocab_size or V), ("embed", "vocab"))
    if cfg.mhc is not None and not cfg.mhc.delayed:  # V4: a learned final collapse
        out["hc_head"] = _hc(cfg.mhc.copies, D, cfg.mhc.copies)
    if cfg.engram is not None:
        out["engram_map"] = _p((V,), (None,), "classes", "int32")
    if cfg.vision is not None:
        out["vision"] = vision_param_specs(cfg.vision, D)
    return out


def vision_param_specs(v, D: int) -> dict:
    """The vision tower (its layers stacked: `vision/layers/...` [layers, ...]) and projector onto hidden size D.
    Replicated for now (no logical axes): the tower is small beside the decoder."""
    C, H, I, L = v.hidden_size, v.num_heads, v.intermediate_size, v.num_layers
    d, K = v.head_dim, v.num_kv_heads or v.num_heads
    r = lambda *shape, init="normal": _p(shape, (None,) * len(shape), init)  # noqa: E731
    stack = lambda tree: _tree_map(lambda s: s.stacked(L), tree)  # noqa: E731
    patch = 3 * v.patch_size ** 2 * v.temporal_patch_size
    if v.kind == "deepseek_vit":  # ViT (fused qkv, fused gate|up), aligner, the image spans' delimiter rows
        layer = {"norm1": r(C, init="ones"), "wqkv": r(C, 3 * C), "bqkv": r(3 * C), "wo": r(C, C), "bo": r(C),
                 "norm2": r(C, init="ones"), "w_gate_up": r(C, 2 * I), "w_down": r(I, C)}
        M = v.merge_size ** 2 * C
        return {"patch": r(patch, C), "patch_bias": r(C), "layers": stack(layer), "norm": r(C, init="ones"),
                "projector": {"w1": r(M, D), "b1": r(D), "w2": r(D, D), "b2": r(D)},
                "image_start": r(D), "image_end": r(D), "image_newline": r(D)}
    if v.kind == "siglip":
        ln = lambda: {"w": r(C, init="ones"), "b": r(C, init="zeros")}  # noqa: E731
        layer = {"ln1": ln(), "ln2": ln(), "wq": r(C, H, d), "bq": r(H, d), "wk": r(C, H, d), "bk": r(H, d),
                 "wv": r(C, H, d), "bv": r(H, d), "wo": r(H, d, C), "bo": r(C), "fc1": r(C, I), "b1": r(I),
                 "fc2": r(I, C), "b2": r(C)}
        side = v.image_size // v.patch_size
        return {"patch": r(patch, C), "patch_bias": r(C), "pos": r(side * side, C), "layers": stack(layer),
                "post_norm": ln(), "projector": {"norm": r(C, init="zeros"), "w": r(C, D)}}
    if v.kind == "pixtral":
        layer = {"attn_norm": r(C, init="ones"), "wq": r(C, H, d), "wk": r(C, H, d), "wv": r(C, H, d),
                 "wo": r(H, d, C), "mlp_norm": r(C, init="ones"), "w_gate": r(C, I), "w_up": r(C, I),
                 "w_down": r(I, C)}
        proj = {"norm": r(C, init="ones"), "merge": r(v.merge_size ** 2 * C, C), "w1": r(C, D), "w2": r(D, D)}
        if v.projector_bias:
            proj |= {"b1": r(D), "b2": r(D)}
        return {"patch": r(patch, C), "ln_pre": r(C, init="ones"), "layers": stack(layer), "projector": proj}
    if v.kind == "mllama":
        T, side = v.max_tiles, v.image_size // v.patch_size
        ln = lambda: {"w": r(C, init="ones"), "b": r(C, init="zeros")}  # noqa: E731
        layer = {"ln1": ln(), "ln2": ln(), "wq": r(C, H, d), "wk": r(C, H, d), "wv": r(C, H, d), "wo": r(H, d, C),
                 "fc1": r(C, I), "b1": r(I), "fc2": r(I, C), "b2": r(C)}
        glob = _tree_map(lambda s: s.stacked(v.global_layers), layer | {"gate_attn": r(1), "gate_ffn": r(1)})
        ratios = len(v.aspect_ratios) + 1  # id 0: no image
        tile = lambda: {"gate": r(1), "embedding": r(ratios, T * C)}  # noqa: E731
        return {"patch": r(patch, C), "class_embedding": r(C),
                "pos": {"gate": r(1), "embedding": r(side * side + 1, C), "tile": r(ratios, T * (side * side + 1) * C)},
                "pre_tile": tile(), "post_tile": tile(), "ln_pre": ln(), "ln_post": ln(), "layers": stack(layer),
                "global_layers": glob,
                "projector": {"w": r(C * (1 + len(v.intermediate_layers)), D), "b": r(D)}}
    M = v.merge_size ** 2 * C  # window_vit
    layer = {"norm1": r(C, init="ones"), "wqkv": r(C, (H + 2 * K) * d), "bqkv": r((H + 2 * K) * d),
             "wo": r(H * d, C), "bo": r(C), "norm2": r(C, init="ones"), "w_gate": r(C, I), "b_gate": r(I),
             "w_up": r(C, I), "b_up": r(I), "w_down": r(I, C), "b_down": r(C)}
    return {"patch": r(patch, C), "layers": stack(layer),
            "merger": {"norm": r(C, init="ones"), "w1": r(M, M), "b1": r(M), "w2": r(M, v.out_hidden_size),
                       "b2": r(v.out_hidden_size)}}


@functools.lru_cache(maxsize=256)
def mtp_param_specs(cfg: ModelConfig) -> dict:
    """{"mtp": {"0": {...}, ...}} of DeepSeek's MTP blocks (jaxmodels/deepseek_mtp.py), or {} without MTP.
    Each block is a layer of `cfg.mtp.layer` plus, V4.1 DSpark: main_proj/main_norm (first), norm + Markov and
    confidence heads (last); V4 classic: e_proj, h_proj, enorm, hnorm, norm, hc_head."""
    t = cfg.mtp
    if t is None or t.layers == 0:
        return {}
    D, V = cfg.hidden_size, cfg.vocab_size
    out = {}
    for m in range(t.layers):
        s = layer_param_specs(cfg, t.layer)
        if t.kind == "dspark":
            if m == 0:
                s |= {"main_proj": _p((len(t.target_layers) * D, D), (None, "embed")), "main_norm": _norm(D)}
            if m == t.layers - 1:
                R = t.markov_rank
                s |= {"norm": _norm(D), "markov_head": {"embed": _p((V, R), ("vocab", None)),
                                                        "head": _p((R, V), (None, "vocab"))},
                      "confidence_head": {"proj": _p((D + R, 1), (None, None))}}
        else:
            n = t.layer.mhc.copies
            s |= {"e_proj": _p((D, D), ("embed", None)), "h_proj": _p((D, D), ("embed", None)), "enorm": _norm(D),
                  "hnorm": _norm(D), "norm": _norm(D), "hc_head": _hc(n, D, n)}
        out[str(m)] = s
    return {"mtp": out}


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"layers/0/attn/wq": leaf, ...} of a nested dict."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out |= flatten(v, f"{prefix}{k}/")
        else:
            out[prefix + k] = v
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict of every parameter's shape."""
    return _tree_map(lambda s: s.shape, param_specs(cfg))


def flat_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {k: s.shape for k, s in flatten(param_specs(cfg)).items()}


def param_count(cfg: ModelConfig) -> int:
    return sum(math.prod(s.shape) for s in flatten(param_specs(cfg)).values())


# ----------------------------------------------------------------------------------------------- caches
@dataclass(frozen=True)
class SlotSpec:
    """A cache addressed by slot, [heads, slots, width] per sequence. Token caches (per=1) hold position p in
    slot p % slots: a ring of `window` slots for sliding layers, every position for full ones. Compressed
    caches hold entry j (tokens j*per .. j*per+per-1) in slot j. packed: bytes of one entry in the reference's
    packed record (DeepSeek's FP4 + scales), for capacity planning."""

    name: str
    heads: int
    width: int
    window: int | None = None
    per: int = 1
    packed: float | None = None

    def slots(self, max_len: int) -> int:
        return min(self.window, max_len) if self.window else max_len // self.per


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state that no position addresses (a compressor's partial group), [*shape] per sequence."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None = "float32"  # None: the cache's dtype
    fill: float = 0.0


def cache_specs(cfg: ModelConfig, spec: LayerSpec, cross_tokens: int = 0) -> tuple:
    """What one layer of `spec` keeps between steps. A cross-attention layer keeps the K/V of `cross_tokens`
    image-feature tokens and the tile mask its last text token had (decode steps repeat it), computed once at
    prefill; with none it keeps nothing and, as HF, runs only where images are given."""
    a = spec.attention
    if a.kind == "cross":
        if not cross_tokens:
            return ()
        K, d, v = cfg.num_kv_heads, cfg.head_dim, cfg.vision
        per_tile = (v.image_size // v.patch_size) ** 2 + 1
        return (StateSpec("cross_k", (K, cross_tokens, d), None), StateSpec("cross_v", (K, cross_tokens, d), None),
                StateSpec("cross_mask", (cross_tokens // per_tile,)))
    if a.kind == "gqa":
        K, d = cfg.num_kv_heads, cfg.head_dim
        return SlotSpec("k", K, d, a.window), SlotSpec("v", K, d, a.window)
    m, d = a.mla, cfg.head_dim
    out = [SlotSpec("kv", 1, d, a.window)]  # the window ring, K = V
    if m.compress:
        width, size = (2 * d, 2 * m.ratio) if m.overlap else (d, m.ratio)
        out += [SlotSpec("compressed", 1, d, None, m.ratio, d / 2 + d / 16),  # FP4 + E4M3 per 16
                StateSpec("buf_kv", (size, width)), StateSpec("buf_gate", (size, width))]
    if m.index_keys in ("latent", "compressor"):
        dI = m.index_head_dim
        out.append(SlotSpec("index_keys", 1, dI, None, m.ratio, dI / 2 + dI / 32))  # FP4 + E8M0 per 32
    if m.index_keys == "compressor":
        dI = m.index_head_dim
        out += [StateSpec("ibuf_kv", (2 * m.ratio, 2 * dI)), StateSpec("ibuf_gate", (2 * m.ratio, 2 * dI))]
    return tuple(out)


def model_state_specs(cfg: ModelConfig) -> tuple:
    """Per-sequence state of the whole model: Engram's compressed ids of the last max_ngram-1 positions."""
    if cfg.engram is None:
        return ()
    return (StateSpec("engram_history", (cfg.engram.max_ngram - 1,), "int32", -1),)


def mtp_cache_specs(cfg: ModelConfig) -> tuple:
    """DSpark: each stage keeps a window ring of main-KV (the reference's `window_kv_cache`)."""
    t = cfg.mtp
    if t is None or t.kind != "dspark":
        return ()
    return tuple(SlotSpec(f"stage{m}", 1, cfg.head_dim, t.layer.attention.window) for m in range(t.layers))


def cache_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2, packed: bool = False) -> dict:
    """Cache bytes that grow with the context (per token) and the fixed rings (per sequence). packed: the
    growing caches in their `packed` record where one is declared (890 B/token for DeepSeek V4.1-Flash)."""
    grow = ring = 0.0
    for spec in cfg.layers:
        for s in cache_specs(cfg, spec):
            if not isinstance(s, SlotSpec):
                continue
            entry = s.packed if packed and s.packed else s.heads * s.width * dtype_bytes
            if s.window:
                ring += s.window * entry
            else:
                grow += entry / s.per
    return {"per_token": grow, "window_per_sequence": ring}
