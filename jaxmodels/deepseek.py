"""DeepSeek V4 / V4.1 as pure functions: full forward, prefill and cached decode (specs/deepseek_v4.md).

The residual stream is [B, T, hc_mult, D] (mHC). Layers run unrolled in Python: their roles differ
(compressor sources, reuse layers, indexers, Engram, hash routing), and the state they share within
one step — the latest compressed KV, indexer keys, top-k and candidate masks — is a Python dict
threaded through the loop, in layer order, exactly as the reference publishes it.

Params (weights [in, out], like the rest of jaxmodels):
  embed [V, D], norm [D], head [D, V], hc_head {fn, base, scale} (V4), engram_map [V] int32
  layers/<i>/  attn_norm, ffn_norm [D]; hc_attn, hc_ffn {fn [(2+n)n, nD], base, scale [3]}
    attn/  wq_a [D, Dq], q_norm, wq_b [Dq, H*d], wkv [D, d], kv_norm, wo_a [G, H*d/G, Ro], wo_b [G*Ro, D],
           sink [H], compressor {wkv, wgate, ape, norm}, indexer {wq_b, weights_proj, wk, k_norm | compressor}
    ffn/   gate [D, E], bias [E] | tid2eid [V, k] int32, w_gate/w_up [E, D, I], w_down [E, I, D], shared {...}
    engram {table, wkv, q_weight, k_weight}   (layers carrying Engram)

Numerics: `plain` computes in the parameters' dtype; `reference` adds the reference's simulated quantisation
(FP8 activations per block before FP8 linears, FP8 window KV, FP4 compressed KV and indexer q/k; FP8 linears
accumulate in fp32 over the dequantised weight). With bf16 params that approximates the reference's own
arithmetic (bf16 stream and activations; the index scores stay fp32 where the reference uses bf16 einsums);
with fp32 params it isolates the quantisation steps (what the tests check against the float64 oracle).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.config import MLPSpec
from jaxmodels.families.deepseek_v4 import DeepseekConfig, DSLayer
from jaxmodels.layers import mhc, mla, mlp, moe, qdq, rope
from jaxmodels.layers.norms import norm as _norm

F32 = jnp.float32


# ----------------------------------------------------------------------------------------------- params
def _layer_shapes(cfg: DeepseekConfig, L: DSLayer) -> dict:
    D, H, d, Dq, G, Ro = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    n, E, I = cfg.hc_mult, cfg.num_experts, cfg.moe_intermediate_size
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    hc = {"fn": ((2 + n) * n, n * D), "base": ((2 + n) * n,), "scale": (3,)}
    attn = {"wq_a": (D, Dq), "q_norm": (Dq,), "wq_b": (Dq, H * d), "wkv": (D, d), "kv_norm": (d,),
            "wo_a": (G, H * d // G, Ro), "wo_b": (G * Ro, D), "sink": (H,)}
    if L.compress:
        c = 2 * d if L.overlap else d
        comp = {"wkv": (D, c), "norm": (d,)}
        if L.ratio > 1 or not cfg.v41:
            comp["wgate"] = (D, c)
        if not cfg.v41:
            comp["ape"] = (L.ratio, c)
        attn["compressor"] = comp
    if L.select == "indexer":
        idx = {"wq_b": (Dq, HI * dI), "weights_proj": (D, HI)}
        if L.index_keys == "latent":
            idx |= {"wk": (d, dI), "k_norm": (dI,)}
        if L.index_keys == "compressor":
            idx["compressor"] = {"wkv": (D, 2 * dI), "wgate": (D, 2 * dI), "ape": (L.ratio, 2 * dI), "norm": (dI,)}
        attn["indexer"] = idx
    ffn = {"gate": (D, E), "w_gate": (E, D, I), "w_up": (E, D, I), "w_down": (E, I, D),
           "shared": {"w_gate": (D, I), "w_up": (D, I), "w_down": (I, D)}}
    ffn |= {"tid2eid": (cfg.vocab_size, cfg.top_k)} if L.hash_moe else {"bias": (E,)}
    out = {"attn_norm": (D,), "ffn_norm": (D,), "hc_attn": hc, "hc_ffn": dict(hc), "attn": attn, "ffn": ffn}
    if L.engram >= 0:
        cols = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
        out["engram"] = {"table": (cfg.engram_rows[L.engram], cfg.engram_head_dim),
                         "wkv": (cols * cfg.engram_head_dim, (n + 1) * D), "q_weight": (n, D), "k_weight": (n, D)}
    return out


def param_shapes(cfg: DeepseekConfig) -> dict:
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    out = {"embed": (V, D), "layers": {str(i): _layer_shapes(cfg, L) for i, L in enumerate(cfg.layers)},
           "norm": (D,), "head": (D, V)}
    if not cfg.v41:
        out["hc_head"] = {"fn": (n, n * D), "base": (n,), "scale": (1,)}
    if cfg.engram_layer_ids:
        out["engram_map"] = (V,)
    return out


def init_params(cfg: DeepseekConfig, seed: int = 0, dtype=F32, std: float = 0.02, fp4_experts: bool = False) -> dict:
    """Random parameters for tests and benchmarks: norms 1, hc/ape/biases small, routing tables random.
    fp4_experts: routed experts as random FP4 bytes with E8M0 scale 2^-6 (kept quantized, [E, out, in/2])."""
    flat = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = "/".join(p.key for p in path)
        leaf = name.rsplit("/", 1)[-1]
        if fp4_experts and leaf in ("w_gate", "w_up", "w_down") and "/shared/" not in name:
            E, n_in, n_out = shape
            leaves.append({"fp4": jax.random.randint(k, (E, n_out, n_in // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                           "scale": jnp.full((E, n_out, n_in // 32), 121, jnp.uint8)})
            continue
        if leaf == "tid2eid":
            v = jax.random.randint(k, shape, 0, cfg.num_experts, jnp.int32)
        elif leaf == "engram_map":
            v = jnp.arange(shape[0], dtype=jnp.int32) // 2
        elif leaf.endswith("norm") or leaf in ("q_weight", "k_weight"):
            v = jnp.ones(shape, dtype)
        elif leaf == "scale" and "hc_" in name:
            v = jnp.full(shape, 0.5, dtype)
        else:
            v = (std * jax.random.normal(k, shape, F32)).astype(dtype)
        leaves.append(v)
    return jax.tree.unflatten(jax.tree.structure(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple)), leaves)


# ------------------------------------------------------------------------------------------ numerics
def _reference(cfg) -> bool:
    return cfg.numerics == "reference"


def _lin(cfg, x, w, fp8: bool = True):
    """x @ w. Reference numerics: FP8 linears quantise their input per block (UE8M0), then compute in fp32
    over the dequantised weight; the rest multiply in the weight's dtype. `w` is [in, out], or a weight kept
    quantized in the checkpoint's [out, in] layout (`dequant`), expanded here inside the computation."""
    if _reference(cfg) and fp8:
        x = qdq.act_quant_fp8(x, cfg.quant_block)
        if isinstance(w, dict):
            return jnp.einsum("...i,oi->...o", x.astype(F32), dequant(w, F32)).astype(x.dtype)
        return jnp.einsum("...i,io->...o", x.astype(F32), w.astype(F32)).astype(x.dtype)
    if isinstance(w, dict):
        return jnp.einsum("...i,oi->...o", x, dequant(w, x.dtype))
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype))


def dequant(w: dict, dtype):
    """A kept-quantized weight -> dtype [..., out, in]: {"fp8": e4m3 bytes [.., O, I], "scale": E8M0 block grid}
    (32x32 or 128x128 blocks, read off the grid) or {"fp4": packed e2m1 [.., O, I/2], "scale": E8M0 [.., O, I/32]}."""
    if "fp4" in w:
        return qdq.dequant_fp4(w["fp4"], w["scale"], 32, dtype)
    o, i = w["fp8"].shape[-2:]
    block = next(b for b in (32, 128, 64, 16) if w["scale"].shape[-2:] == (-(-o // b), -(-i // b)))
    return qdq.dequant_fp8(w["fp8"], w["scale"], block, dtype)


def _rms(cfg, x, w):
    return _norm(x, w, cfg.norm_eps, "rms_fp32")


def _kv_qdq(cfg, kv):
    """Reference: the window KV is stored FP8 (V4.1 all channels per 32; V4 the non-RoPE ones per 64)."""
    if not _reference(cfg):
        return kv
    if cfg.v41:
        return qdq.act_quant_fp8(kv, 32)
    rd = cfg.rope_dim
    return jnp.concatenate([qdq.act_quant_fp8(kv[..., :-rd], 64), kv[..., -rd:]], axis=-1)


def _latent_qdq(cfg, x):
    """Reference: compressed KV is FP4 with E4M3 scales per 16 (V4.1); V4 keeps it FP8 on the non-RoPE part."""
    if not _reference(cfg):
        return x
    return qdq.fp4_act_quant(x, 16, "e4m3") if cfg.v41 else _kv_qdq(cfg, x)


def _index_qdq(cfg, x):
    """Reference: indexer q/k are FP4 with E8M0 scales per 32 (V4 rotates them by a Hadamard first; being
    orthogonal and applied to both, the rotation changes nothing without the quantisation)."""
    if not _reference(cfg):
        return x
    if not cfg.v41:
        x = jnp.einsum("...i,ij->...j", x.astype(F32), jnp.asarray(_hadamard(x.shape[-1]))).astype(x.dtype)
    return qdq.fp4_act_quant(x, 32, "e8m0")


def _hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order n (a power of two), scaled by n^-0.5 (orthogonal)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != n:
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {n}")
    return (h / np.sqrt(n)).astype(np.float32)


# --------------------------------------------------------------------------------------- compressor
def _project(cfg, cp, x, positions, ratio):
    """Compressor projections (kv, gate) [B, T, c] with the in-group position bias; fp32 when ratio > 1."""
    xin = x.astype(F32) if ratio > 1 else x
    a = jnp.einsum("...i,io->...o", xin, cp["wkv"].astype(xin.dtype))
    g = jnp.einsum("...i,io->...o", xin, cp["wgate"].astype(xin.dtype)) if "wgate" in cp else jnp.zeros_like(a)
    if "ape" in cp:
        g = g + cp["ape"].astype(g.dtype)[positions % ratio]
    return a, g


def _finish(cfg, cp, pooled, j, ratio, spec, qdq_fn=None):
    """Pooled [B, N, d] -> normed latent (pre-RoPE), and the RoPE'd (and quantised) entry at position j*r."""
    latent = _rms(cfg, pooled, cp["norm"])
    cos, sin = rope.cos_sin(spec, cfg.rope_dim, j * ratio, F32)
    entry = mla.rope_tail(latent, cos, sin)
    return latent, (qdq_fn(cfg, entry) if qdq_fn else entry)


def _compress_full(cfg, cp, x, positions, ratio, overlap, spec, qdq_fn):
    a, g = _project(cfg, cp, x, positions, ratio)
    kv, gate = mla.group_slots(a, g, ratio, overlap)
    pooled = mla.pool(kv, gate).astype(x.dtype)
    j = jnp.broadcast_to(jnp.arange(pooled.shape[1]), pooled.shape[:2])
    latent, entry = _finish(cfg, cp, pooled, j, ratio, spec, qdq_fn)
    return latent, entry, (a, g)


def _compress_step(cfg, cp, x, pos, buf, ratio, overlap, spec, qdq_fn):
    """One decode token: store its projections in the ring `buf` (2r slots with overlap, else r) and pool
    the group that ends here. Returns (latent, entry) [B, 1, d], emitted [B], entry index [B], new buf."""
    a, g = _project(cfg, cp, x, pos[:, None], ratio)
    size = buf["kv"].shape[1]
    b = jnp.arange(x.shape[0])
    buf = {"kv": buf["kv"].at[b, pos % size].set(a[:, 0]), "gate": buf["gate"].at[b, pos % size].set(g[:, 0])}
    take = lambda t, start: jnp.take_along_axis(t, ((start[:, None] + jnp.arange(ratio)) % size)[..., None], 1)  # noqa: E731
    cur_kv, cur_g = take(buf["kv"], pos - ratio + 1), take(buf["gate"], pos - ratio + 1)
    if overlap:
        h = cur_kv.shape[-1] // 2
        prev_kv, prev_g = take(buf["kv"], pos - 2 * ratio + 1), take(buf["gate"], pos - 2 * ratio + 1)
        prev_g = jnp.where((pos >= ratio)[:, None, None], prev_g, -jnp.inf)
        cur_kv = jnp.concatenate([prev_kv[..., :h], cur_kv[..., h:]], axis=1)
        cur_g = jnp.concatenate([prev_g[..., :h], cur_g[..., h:]], axis=1)
    pooled = mla.pool(cur_kv, cur_g).astype(x.dtype)[:, None]
    j = pos // ratio
    latent, entry = _finish(cfg, cp, pooled, j[:, None], ratio, spec, qdq_fn)
    return latent, entry, (pos + 1) % ratio == 0, j, buf


def _write_rows(cache, rows, at, when):
    """cache [B, N, c]; rows [B, 1, c] written at index at [B] where `when` [B] (else out of range: dropped;
    N may be 0 when the cache is shorter than the ratio)."""
    b = jnp.arange(cache.shape[0])
    return cache.at[b, jnp.where(when, at, cache.shape[1])].set(rows[:, 0].astype(cache.dtype), mode="drop")


def _ring_fill(values, lengths, slots):
    """Prefill -> ring: slot s holds the latest position p < length with p % slots == s (or nothing).
    values [B, T, ...] -> ([B, slots, ...], positions [B, slots] with -1 for empty slots)."""
    s = jnp.arange(slots)
    last = lengths[:, None] - 1
    src = last - (last - s) % slots
    ok = src >= 0
    src = jnp.clip(src, 0, values.shape[1] - 1)
    gathered = jnp.take_along_axis(values, src.reshape(src.shape + (1,) * (values.ndim - 2)), axis=1)
    return gathered, jnp.where(ok, src, -1)


# --------------------------------------------------------------------------------------------- attention
def _attention(cfg, L: DSLayer, p, x, ctx, shared, cache):
    B, T, _ = x.shape
    H, d, G = cfg.num_heads, cfg.head_dim, cfg.o_groups
    pos, mode = ctx["positions"], ctx["mode"]
    spec = cfg.rope_for(L)
    cos, sin = ctx["rope"][L.ratio > 0]
    qr = _rms(cfg, _lin(cfg, x, p["wq_a"]), p["q_norm"])
    q = _lin(cfg, qr, p["wq_b"]).reshape(B, T, H, d)
    if not cfg.v41:  # V4: an unweighted per-head RMS after wq_b
        q = q * jax.lax.rsqrt(jnp.mean(q.astype(F32) ** 2, axis=-1, keepdims=True) + cfg.norm_eps).astype(q.dtype)
    q = mla.rope_tail(q, cos[:, :, None], sin[:, :, None])
    kv = _kv_qdq(cfg, mla.rope_tail(_rms(cfg, _lin(cfg, x, p["wkv"]), p["kv_norm"]), cos, sin))
    new = {}
    W = cfg.window
    if mode == "decode":
        p0 = pos[:, 0]
        b = jnp.arange(B)
        slots = cache["win"].shape[1]
        win = cache["win"].at[b, p0 % slots].set(kv[:, 0])
        wpos = cache["win_pos"].at[b, p0 % slots].set(p0)
        new |= {"win": win, "win_pos": wpos}
        kv_win = win
        allow_win = ((wpos >= 0) & (wpos <= p0[:, None]) & (wpos > p0[:, None] - W))[:, None, :]
    else:
        kv_win = kv
        qp, kp = pos[:, :, None], pos[:, None, :]
        allow_win = (kp <= qp) & (kp > qp - W)
        if mode == "prefill":
            slots = cache["win"].shape[1]
            win, wpos = _ring_fill(kv, ctx["lengths"], slots)
            new |= {"win": win, "win_pos": wpos}
    kv_cmp = allow_cmp = None
    if L.ratio:
        if L.compress:
            entry, latent = _compressed(cfg, L, p, x, ctx, cache, new, spec)
            shared["kv"], shared["latent"] = entry, latent
        kv_cmp = shared["kv"]
        vis = mla.visible(pos, kv_cmp.shape[1], L.ratio)
        if L.select == "all":
            allow_cmp = vis
        elif L.select == "indexer":
            allow_cmp = _indexer(cfg, L, p["indexer"], x, qr, ctx, shared, cache, new, vis, spec)
            shared["topk"] = allow_cmp
        else:  # reuse the latest top-k
            allow_cmp = shared["topk"]
    o = mla.attend(q, kv_win, allow_win, kv_cmp, allow_cmp, p["sink"], d ** -0.5)
    o = mla.rope_tail(o, cos[:, :, None], sin[:, :, None], inverse=True).astype(x.dtype)
    u = jnp.einsum("btgi,gir->btgr", o.reshape(B, T, G, -1), p["wo_a"].astype(o.dtype)).reshape(B, T, -1)
    return _lin(cfg, u, p["wo_b"]), new


def _compressed(cfg, L, p, x, ctx, cache, new, spec):
    """This layer's compressed KV entries ([B, N, d], N = T//r; in decode the whole updated cache) and what its
    indexer keys are made from: the pre-RoPE latent (in decode: (latent [B, 1, d], emitted [B], entry index [B]))."""
    cp, r, pos = p["compressor"], L.ratio, ctx["positions"]
    if ctx["mode"] == "decode":
        latent, entry, emit, j, buf = _compress_step(cfg, cp, x, pos[:, 0], cache["buf"], r, L.overlap, spec,
                                                     _latent_qdq)
        new["buf"] = buf
        new["kv"] = _write_rows(cache["kv"], entry, j, emit)
        return new["kv"], (latent, emit, j)
    latent, entry, (a, g) = _compress_full(cfg, cp, x, pos, r, L.overlap, spec, _latent_qdq)
    if ctx["mode"] == "prefill":
        size = cache["buf"]["kv"].shape[1]
        new["buf"] = {"kv": _ring_fill(a, ctx["lengths"], size)[0], "gate": _ring_fill(g, ctx["lengths"], size)[0]}
        new["kv"] = jax.lax.dynamic_update_slice_in_dim(cache["kv"], entry.astype(cache["kv"].dtype), 0, axis=1)
    return entry, latent


def _indexer(cfg, L, ip, x, qr, ctx, shared, cache, new, vis, spec):
    """Top-k mask over the compressed entries for each query (+ candidate blocks on the candidate source)."""
    B, T, _ = x.shape
    HI, dI = cfg.index_n_heads, cfg.index_head_dim
    cos, sin = ctx["rope"][True]
    mode = ctx["mode"]
    if L.index_keys == "latent":  # V4.1 kv source: keys from the pre-RoPE latent
        latent = shared["latent"]
        if mode == "decode":
            latent, emit, j = latent
            k = _key_from_latent(cfg, ip, latent, j[:, None], L.ratio, spec)
            shared["index_k"] = new["index_k"] = _write_rows(cache["index_k"], k, j, emit)
        else:
            n = latent.shape[1]
            k = _key_from_latent(cfg, ip, latent, jnp.broadcast_to(jnp.arange(n), latent.shape[:2]), L.ratio, spec)
            shared["index_k"] = k
            if mode == "prefill":
                new["index_k"] = jax.lax.dynamic_update_slice_in_dim(cache["index_k"], k.astype(cache["index_k"].dtype),
                                                                     0, axis=1)
    elif L.index_keys == "compressor":  # V4: its own overlapped compressor at index_head_dim
        cp, pos = ip["compressor"], ctx["positions"]
        if mode == "decode":
            _, k, emit, j, buf = _compress_step(cfg, cp, x, pos[:, 0], cache["ibuf"], L.ratio, True, spec, _index_qdq)
            new["ibuf"] = buf
            shared["index_k"] = new["index_k"] = _write_rows(cache["index_k"], k, j, emit)
        else:
            _, k, (a, g) = _compress_full(cfg, cp, x, pos, L.ratio, True, spec, _index_qdq)
            shared["index_k"] = k
            if mode == "prefill":
                size = cache["ibuf"]["kv"].shape[1]
                new["ibuf"] = {"kv": _ring_fill(a, ctx["lengths"], size)[0],
                               "gate": _ring_fill(g, ctx["lengths"], size)[0]}
                new["index_k"] = jax.lax.dynamic_update_slice_in_dim(cache["index_k"],
                                                                     k.astype(cache["index_k"].dtype), 0, axis=1)
    keys = shared["index_k"]
    qi = _lin(cfg, qr, ip["wq_b"]).reshape(B, T, HI, dI)
    qi = _index_qdq(cfg, mla.rope_tail(qi, cos[:, :, None], sin[:, :, None]))
    w = _lin(cfg, x, ip["weights_proj"], fp8=False).astype(F32) * (dI ** -0.5 * HI ** -0.5)
    scores = jnp.where(vis, mla.index_scores(qi, keys, w), -jnp.inf)
    if L.candidate_source:
        shared["candidates"] = mla.candidate_blocks(scores, vis, cfg.candidate_topk_blocks, cfg.candidate_block_size)
    if L.candidate_filter:
        scores = jnp.where(shared["candidates"], scores, -jnp.inf)
    return mla.top_k_mask(scores, cfg.index_topk)


def _key_from_latent(cfg, ip, latent, j, ratio, spec):
    k = _rms(cfg, _lin(cfg, latent, ip["wk"], fp8=False), ip["k_norm"])
    cos, sin = rope.cos_sin(spec, cfg.rope_dim, j * ratio, F32)
    return _index_qdq(cfg, mla.rope_tail(k, cos, sin))


# -------------------------------------------------------------------------------------------------- MoE
def _route(cfg, L, p, xt, tokens):
    s = jnp.einsum("nd,de->ne", xt.astype(F32), p["gate"].astype(F32))
    if cfg.score_func == "sqrtsoftplus":
        s = jnp.sqrt(jax.nn.softplus(s))
    elif cfg.score_func == "softmax":
        s = jax.nn.softmax(s, axis=-1)
    elif cfg.score_func == "sigmoid":
        s = jax.nn.sigmoid(s)
    else:
        raise ValueError(f"unknown scoring_func {cfg.score_func!r}")
    if L.hash_moe:
        idx = p["tid2eid"][tokens.reshape(-1)]
    else:  # the bias only picks the experts; the weights are the unbiased scores
        idx = jax.lax.top_k(s + p["bias"].astype(F32), cfg.top_k)[1]
    w = jnp.take_along_axis(s, idx, axis=-1)
    if cfg.norm_topk_prob and (cfg.top_k > 1 or not cfg.v41):  # V4 (HF) renormalises whatever k is
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.route_scale, idx


def _moe(cfg, L, p, x, tokens):
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    w, idx = _route(cfg, L, p, xt, tokens)
    spec = MLPSpec(kind="moe", activation="silu_limit", clamp_limit=cfg.swiglu_limit,
                   intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts, top_k=cfg.top_k)
    if _reference(cfg):
        return _moe_reference(cfg, spec, p, xt, w, idx).reshape(shape)
    if isinstance(p["w_gate"], dict):
        out = _routed_quantized(spec, p, xt, w.astype(x.dtype), idx)
    else:
        out = moe._routed(spec, p, xt, w.astype(x.dtype), idx, 0)
    return (out + _expert(cfg, spec, p["shared"], xt).astype(x.dtype)).reshape(shape)


def _routed_quantized(spec, p, xt, w, idx):
    """Experts kept quantized ([E, out, in] FP4/FP8 + scales). Decode (tokens * top_k <= experts) gathers the
    chosen experts' packed bytes and expands only those; otherwise every expert is expanded once and the
    dropless grouped path runs."""
    names = ("w_gate", "w_up", "w_down")
    if xt.shape[0] * spec.top_k > spec.num_experts:
        full = {n: jnp.swapaxes(dequant(p[n], xt.dtype), -1, -2) for n in names}
        return moe._routed(spec, full, xt, w, idx, 0)
    e = idx.reshape(-1)
    W = {n: dequant({k: v[e] for k, v in p[n].items()}, xt.dtype) for n in names}  # [N*k, out, in]
    rows = jnp.repeat(xt, spec.top_k, axis=0)
    g, u = jnp.einsum("nd,nfd->nf", rows, W["w_gate"]), jnp.einsum("nd,nfd->nf", rows, W["w_up"])
    y = jnp.einsum("nf,ndf->nd", mlp.activate(spec, g, u), W["w_down"])
    return jnp.sum(y.reshape(xt.shape[0], spec.top_k, -1) * w[..., None], axis=1).astype(xt.dtype)


def _expert(cfg, spec, p, x, weight=None):
    """One gated expert (the shared one, or routed ones in reference numerics), activation in fp32."""
    g = _lin(cfg, x, p["w_gate"]).astype(F32)
    u = _lin(cfg, x, p["w_up"]).astype(F32)
    h = mlp.activate(spec, g, u)
    if weight is not None:  # the routing weight multiplies before w2 (and so before its activation QDQ)
        h = h * weight
    return _lin(cfg, h.astype(x.dtype), p["w_down"]).astype(F32)


def _moe_reference(cfg, spec, p, xt, w, idx):
    """Every expert on every token (tiny models), accumulated in fp32 in ascending expert order."""
    y = jnp.zeros(xt.shape, F32)
    for e in range(cfg.num_experts):
        we = jnp.sum(jnp.where(idx == e, w, 0.0), axis=-1, keepdims=True)
        pe = {k: jax.tree.map(lambda t: t[e], p[k]) for k in ("w_gate", "w_up", "w_down")}
        y = y + jnp.where(we > 0, _expert(cfg, spec, pe, xt, we), 0.0)
    return (y + _expert(cfg, spec, p["shared"], xt)).astype(xt.dtype)


# --------------------------------------------------------------------------------------------- the model
def _dtype(cfg, params):
    return params["embed"].dtype


def _engram_columns(cfg, params, tokens, hist):
    """Hash columns [B, T, n_engram_layers, cols] of every position; `hist` [B, n-1] holds the compressed ids of
    the positions just before `tokens` (-1 = before the sequence start)."""
    from jaxmodels.layers import engram

    ids = params["engram_map"][tokens]
    n = cfg.engram_max_ngram
    seq = jnp.concatenate([hist, ids], axis=1)  # the token at offset t of `tokens` sits at column t + n - 1
    window = jnp.stack([seq[:, n - 1 - s: n - 1 - s + tokens.shape[1]] for s in range(n)], axis=-1)
    pad = params["engram_map"][cfg.engram_pad_token]
    return engram.hash_window(window, pad, _layout(cfg))


def _layout(cfg):
    from jaxmodels.layers import engram

    return engram.EngramLayout.from_config(cfg.engram_layer_ids, cfg.engram_max_ngram, cfg.engram_vocab_size,
                                           cfg.engram_n_heads, cfg.engram_compressed_vocab)


def _stream(params, cfg: DeepseekConfig, tokens, positions, mode, cache=None, lengths=None, collect=False):
    """Embeddings -> all layers -> the final collapsed hidden state [B, T, D] (+ the new cache).
    collect: also return what the MTP heads read (jaxmodels/deepseek_mtp.py): the DSpark target layers' input
    means and the final hc stream."""
    dt = _dtype(cfg, params)
    B, T = tokens.shape
    n = cfg.hc_mult
    x = params["embed"][tokens].astype(dt)
    X = jnp.broadcast_to(x[:, :, None, :], (B, T, n, x.shape[-1]))
    ctx = {"positions": positions, "mode": mode, "lengths": lengths,
           "rope": {False: rope.cos_sin(cfg.main_rope, cfg.rope_dim, positions, F32),
                    True: rope.cos_sin(cfg.compress_rope, cfg.rope_dim, positions, F32)}}
    new_cache = {"layers": {}}
    if cfg.engram_layer_ids:
        hist = cache["engram"] if mode == "decode" else jnp.full((B, cfg.engram_max_ngram - 1), -1, jnp.int32)
        cols = _engram_columns(cfg, params, tokens, hist)
        ids = params["engram_map"][tokens]
        if mode == "decode":
            new_cache["engram"] = jnp.concatenate([hist, ids], axis=1)[:, 1:]
        elif mode == "prefill":
            seq = jnp.concatenate([hist, ids], axis=1)
            at = lengths[:, None] + jnp.arange(cfg.engram_max_ngram - 1)  # the n-1 ids before position `length`
            new_cache["engram"] = jnp.take_along_axis(seq, at, axis=1)
    hc = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_iters)
    pre = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), n, dtype=F32)
    shared: dict = {}
    mains = []
    for i, L in enumerate(cfg.layers):
        lp = params["layers"][str(i)]
        lc = cache["layers"][str(i)] if cache is not None else None
        if L.engram >= 0:
            from jaxmodels.layers import engram

            X = engram.engram_inject(lp["engram"], X, cols[:, :, L.engram], None, cfg.norm_eps,
                                     act_quant=_reference(cfg))
        if i in cfg.dspark_target_layers:
            mains.append(jnp.mean(X.astype(F32), axis=2))
        pA, qA, cA = mhc.mixes(X, lp["hc_attn"], **hc)
        h = _rms(cfg, mhc.collapse(X, pre if cfg.v41 else pA), lp["attn_norm"])
        y, lnew = _attention(cfg, L, lp["attn"], h, ctx, shared, lc)
        new_cache["layers"][str(i)] = lnew
        X = mhc.expand(y, X, qA, cA)
        pF, qF, cF = mhc.mixes(X, lp["hc_ffn"], **hc)
        h = _rms(cfg, mhc.collapse(X, pA if cfg.v41 else pF), lp["ffn_norm"])
        X = mhc.expand(_moe(cfg, L, lp["ffn"], h, tokens), X, qF, cF)
        pre = pF
    if not cfg.v41:  # V4: a learned collapse; V4.1: the last FFN pre-mix
        pre = mhc.head_pre(X, params["hc_head"], norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)
    x = mhc.collapse(X, pre)
    if collect:
        return x, new_cache, {"mains": jnp.concatenate(mains, axis=-1) if mains else None, "stream": X}
    return x, new_cache


def _head(cfg, params, x):
    """fp32 logits. The reference keeps the head in fp32; for bf16 weights the bf16 x bf16 products are exact in
    fp32, so the matmul accumulates in fp32 without an fp32 copy of the [D, V] head each step."""
    h = _rms(cfg, x, params["norm"])
    head = params["head"]
    if h.dtype == head.dtype:
        return jnp.einsum("...d,dv->...v", h, head, preferred_element_type=F32)
    return jnp.einsum("...d,dv->...v", h.astype(F32), head.astype(F32))


def forward(params, cfg: DeepseekConfig, tokens, positions=None):
    """tokens [B, T] from position 0 -> float32 logits [B, T, vocab] (no cache). Compressor groups count from
    the sequence start, so other positions are refused (use prefill + decode_step to continue a sequence)."""
    if positions is not None:
        raise ValueError("DeepSeek V4's forward runs from position 0; continue a sequence with prefill/decode_step")
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, _ = _stream(params, cfg, tokens, positions, "full")
    return _head(cfg, params, x)


# --------------------------------------------------------------------------------------------- KV cache
def init_cache(cfg: DeepseekConfig, batch: int, max_len: int, dtype) -> dict:
    """Per layer: the window ring (+ slot positions); per compressing layer: its compressed entries, the
    projection ring of the group being built, and indexer keys. Engram: the last n-1 compressed ids."""
    dt = dtype
    d, W = cfg.head_dim, min(cfg.window, max_len)
    out = {"layers": {}}
    for i, L in enumerate(cfg.layers):
        c = {"win": jnp.zeros((batch, W, d), dt), "win_pos": jnp.full((batch, W), -1, jnp.int32)}
        n = max_len // L.ratio if L.ratio else 0
        if L.compress:
            width = 2 * d if L.overlap else d
            size = L.ratio * (2 if L.overlap else 1)
            c["kv"] = jnp.zeros((batch, n, d), dt)
            c["buf"] = {"kv": jnp.zeros((batch, size, width), F32), "gate": jnp.zeros((batch, size, width), F32)}
        if L.index_keys in ("latent", "compressor"):
            c["index_k"] = jnp.zeros((batch, n, cfg.index_head_dim), dt)
        if L.index_keys == "compressor":
            w2 = 2 * cfg.index_head_dim
            c["ibuf"] = {"kv": jnp.zeros((batch, 2 * L.ratio, w2), F32), "gate": jnp.zeros((batch, 2 * L.ratio, w2), F32)}
        out["layers"][str(i)] = c
    if cfg.engram_layer_ids:
        out["engram"] = jnp.full((batch, cfg.engram_max_ngram - 1), -1, jnp.int32)
    return out


def cache_bytes_per_token(cfg: DeepseekConfig, dtype_bytes: int = 2, packed: bool = False) -> dict:
    """Growing cache bytes per token (compressed KV + indexer keys of the layers that own them) and the fixed
    window bytes per sequence. As stored here: `dtype_bytes` per value. packed=True: the reference's records,
    FP4 values + an E4M3 scale per 16 (compressed KV) or an E8M0 scale per 32 (index keys) — the spec's
    arithmetic (890 B/token for V4.1-Flash)."""
    d, dI = cfg.head_dim, cfg.index_head_dim
    kv, ik = (d / 2 + d / 16, dI / 2 + dI / 32) if packed else (d * dtype_bytes, dI * dtype_bytes)
    grow = sum((kv * L.compress + ik * (L.index_keys in ("latent", "compressor"))) / L.ratio
               for L in cfg.layers if L.ratio)
    return {"per_token": grow, "window_per_sequence": cfg.num_layers * cfg.window * d * dtype_bytes}


def _merge(cache, new):
    """The cache with every entry this step produced replaced (layers keep what they did not touch)."""
    out = {"layers": {i: {**c, **new["layers"].get(i, {})} for i, c in cache["layers"].items()}}
    if "engram" in cache:
        out["engram"] = new.get("engram", cache["engram"])
    return jax.tree.map(lambda old, v: v.astype(old.dtype), cache, out)


def prefill(params, cfg: DeepseekConfig, tokens, lengths, cache):
    """Right-padded prompts [B, T] with `lengths` [B] -> (last-token logits [B, vocab], filled cache)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, new = _stream(params, cfg, tokens, positions, "prefill", cache, lengths)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return _head(cfg, params, last)[:, 0], _merge(cache, new)


def decode_step(params, cfg: DeepseekConfig, tokens, positions, cache, unroll=1):
    """tokens [B] at positions [B] -> (logits [B, vocab], cache). `unroll` is accepted for the common
    signature and ignored: the layers already run unrolled."""
    x, new = _stream(params, cfg, tokens[:, None], positions[:, None], "decode", cache)
    return _head(cfg, params, x)[:, 0], _merge(cache, new)
