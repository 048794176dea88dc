"""DeepSeek multi-token prediction as pure functions (specs/deepseek_v4.md §8): V4.1's DSpark drafter and
V4's classic MTP block, the drafters of speculative decoding (jaxmodels/speculative.py); the backbone
(jaxmodels/model.py) does not depend on any of this.

Params live under params["mtp"][str(m)] (jaxmodels.plan.mtp_param_specs), each a layer of `cfg.mtp.layer` (window-only
attention, MoE with the MTP's own expert counts, falling back to the backbone's as the reference's
`get_moe_config` does) plus, weights [in, out]:
  V4.1 DSpark  stage 0: main_proj [K*D, D], main_norm [D]   (K = len(cfg.dspark_target_layers))
               last stage: norm [D], markov_head {embed [V, R], head [R, V]}, confidence_head {proj [D+R, 1]}
  V4 MTP       e_proj, h_proj [D, D], enorm, hnorm, norm [D], hc_head {fn [n, nD], base [n], scale [1]}
`embed` and `lm_head` are the backbone's (the checkpoint's mtp.*.embed/head copies are dropped at import).

DSpark (REF41 `DSparkBlock` / `DSparkAttention` / `forward_spec`): after the backbone has processed the token at
`start_pos`, main_x = main_norm(main_proj(concat of the hc-means of the inputs of the target layers)). Every stage
keeps its own window (cfg.window slots, 128 in Flash) of KV computed from main_x (its own wkv / kv_norm, RoPE
at the backbone position, FP8 QDQ in reference numerics). The draft block [last_token, noise x (blk-1)] sits at
positions start_pos+1 .. start_pos+blk and attends that window plus the whole block (bidirectional), with sinks and the
ratio-0 RoPE (rope_theta, no YaRN). The stages chain through the hc stream with the delayed pre-mix; the last
one collapses, norms, applies the shared head, then per step adds the Markov bias of the previous id and picks
the next id greedily (the reference samples with its temperature; here greedy). Confidence =
proj(cat(x, markov_embed)) on the collapsed hidden BEFORE the final norm.

Entry points: `dspark_draft` (from the last `window` mains), or for serving the rings `dspark_init_cache` /
`dspark_prefill_cache` / `dspark_extend_cache` / `dspark_step_cache` / `dspark_draft_cached`; `mtp_forward` (V4), or
cached `mtp_init_cache` / `mtp_extend`; `backbone` (a full forward that also returns the mains and the final hc
stream). jaxmodels/speculative.py drafts with them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmodels import cache as kv, model
from jaxmodels.config import ModelConfig
from jaxmodels.layers import mhc, mla, moe, rope
from jaxmodels.layers.norms import norm
from jaxmodels.plan import cache_specs, mtp_cache_specs

F32 = jnp.float32


# ------------------------------------------------------------------------------------------ shared pieces
def _ctx(cfg, positions):
    """What the MTP layers' attention reads: ratio-0 RoPE (no YaRN) at `positions`, the numerics."""
    a = cfg.mtp.layer.attention
    return {"positions": positions, "mode": "full", "lengths": None,
            "act_block": cfg.quant_block if cfg.numerics == "reference" else None,
            "rope": {(a.rope, a.mla.rope_dim): rope.cos_sin(a.rope, a.mla.rope_dim, positions, F32)}}


def _block(cfg, lp, X, pre, attn, tokens, ctx):
    """One mHC block of the MTP layer spec with the given attention callable; returns (X, its FFN pre-mix)."""
    spec, eps = cfg.mtp.layer, cfg.norm_eps
    # the experts through the GPU kernels as the main layers' (`moe.lone`), but only on one device: the drafter is
    # not told of a mesh, and XLA would gather a sharded stack to every device for a kernel (no partitioning rule)
    stack = moe.lone(lp["mlp"]) if jax.device_count() == 1 else None
    ffn = lambda h: moe.sparse(spec.mlp, lp["mlp"], norm(h, lp["mlp_norm"], eps, spec.norm), None, tokens,  # noqa: E731
                               ctx["act_block"], stack)
    return mhc.block(X, pre, lp["hc_attn"], lp["hc_mlp"], lambda h: attn(norm(h, lp["attn_norm"], eps, spec.norm)),
                     ffn, spec.mhc, eps)



# ----------------------------------------------------------------------------------------------- backbone
def backbone(params, cfg: ModelConfig, tokens):
    """Full forward from position 0 that also returns what the MTP heads read: (logits [B, T, V] fp32,
    mains [B, T, K*D] (V4.1: the hc-means of the target layers' inputs, concatenated in target order; None
    otherwise), stream [B, T, n, D] (the final hc stream before the collapse, V4's MTP input))."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, _, aux = model.hidden(params, cfg, tokens, positions, "full", collect=True)
    return model.head(params, cfg, x), aux["mains"], aux["stream"]


# ------------------------------------------------------------------------------------------ V4.1 DSpark
def _dspark_attention(cfg, p, x, main_kv, main_ok, dpos):
    """Draft queries x [B, blk, D] at positions dpos [B, blk]: attend the stage's main-KV window main_kv
    [B, N, d] (rows allowed by main_ok [B, N]) plus every draft KV of the block (bidirectional), with sinks."""
    B, blk, _ = x.shape
    m = cfg.mtp.layer.attention.mla
    ctx = _ctx(cfg, dpos)
    cos, sin = next(iter(ctx["rope"].values()))
    q, _ = mla.project_q(cfg, m, p, x, ctx, cos, sin)
    keys = jnp.concatenate([main_kv.astype(x.dtype), mla.project_kv(cfg, m, p, x, ctx, cos, sin)], axis=1)
    allow = jnp.concatenate([jnp.broadcast_to(main_ok[:, None, :], (B, blk, main_ok.shape[1])),
                             jnp.ones((B, blk, blk), bool)], axis=-1)
    o = mla.attend(q, keys, allow, None, None, p["sinks"], cfg.head_dim ** -0.5)
    return mla.output(cfg, m, p, o, ctx, cos, sin, x.dtype)


def dspark_main_x(params, cfg: ModelConfig, mains):
    """main_x [..., D] = main_norm(main_proj(mains)) from the concatenated target-layer means [..., K*D]."""
    p0 = params["mtp"]["0"]
    ctx = _ctx(cfg, jnp.zeros(mains.shape[:-1], jnp.int32))
    return mla.rms(cfg, mla.linear(ctx, mains.astype(params["embed"].dtype), p0["main_proj"]), p0["main_norm"])


def dspark_window_kv(params, cfg: ModelConfig, mains, positions):
    """Each stage's window KV for backbone positions [B, T] (what the reference writes into the stage's ring,
    at prefill for the last W positions and at every decode step for the current one): {stage: [B, T, d]}."""
    main_x = dspark_main_x(params, cfg, mains)
    ctx = _ctx(cfg, positions)
    cos, sin = next(iter(ctx["rope"].values()))
    m = cfg.mtp.layer.attention.mla
    return {s: mla.project_kv(cfg, m, params["mtp"][s]["attn"], main_x, ctx, cos, sin)
            for s in sorted(params["mtp"], key=int)}


def dspark_draft(params, cfg: ModelConfig, mains, last_token, start_pos):
    """V4.1 DSpark draft after the backbone step at `start_pos` (int or [B]).

    mains [B, T, K*D]: the target-layer means of the backbone positions start_pos-T+1 .. start_pos (right-aligned;
    only the last min(window, start_pos+1) rows are read, so T = window suffices). last_token [B]: the token the
    backbone just produced for position start_pos+1. Returns (draft logits [B, blk, V] fp32 incl. the Markov bias,
    ids [B, blk+1] int32 = [last_token, greedy drafts], confidence [B, blk] fp32).
    """
    B, T = mains.shape[:2]
    W = cfg.mtp.layer.attention.window
    if isinstance(start_pos, int) and T < min(W, start_pos + 1):
        raise ValueError(f"the draft at position {start_pos} reads the last {min(W, start_pos + 1)} "
                         f"positions' mains; got {T}")
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), (B,))
    mpos = sp[:, None] - (T - 1) + jnp.arange(T)  # the rows' backbone positions
    ok = (mpos >= 0) & (mpos > sp[:, None] - W)  # the ring holds the last `window` positions
    window = dspark_window_kv(params, cfg, mains, jnp.maximum(mpos, 0))
    return dspark_draft_from_window(params, cfg, window, ok, last_token, sp)


def dspark_draft_from_window(params, cfg: ModelConfig, window_kv, window_ok, last_token, start_pos, pick=None):
    """The draft from each stage's main-KV window (a ring kept by the caller, or dspark_window_kv's rows):
    window_kv {stage: [B, N, d]}, window_ok [B, N] marks the filled slots (order is irrelevant). pick(i, row):
    the id of draft step i from its logits row [B, V] incl. the Markov bias (default: argmax, the greedy draft;
    speculative sampling draws from it)."""
    t = cfg.mtp
    dt = params["embed"].dtype
    blk, n, last = t.block_size, t.layer.mhc.copies, str(t.layers - 1)
    last_token = jnp.asarray(last_token, jnp.int32)
    B = last_token.shape[0]
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), (B,))
    ids = jnp.concatenate([last_token[:, None], jnp.full((B, blk - 1), t.noise_token, jnp.int32)], axis=1)
    dpos = sp[:, None] + 1 + jnp.arange(blk)
    x = params["embed"][ids].astype(dt)
    X = jnp.broadcast_to(x[:, :, None, :], (B, blk, n, x.shape[-1]))
    pre = jax.nn.one_hot(jnp.zeros((B, blk), jnp.int32), n, dtype=F32)
    ctx = _ctx(cfg, dpos)
    for m in range(t.layers):
        lp = params["mtp"][str(m)]
        attn = lambda h, lp=lp, m=m: _dspark_attention(cfg, lp["attn"], h, window_kv[str(m)], window_ok, dpos)  # noqa: E731
        X, pre = _block(cfg, lp, X, pre, attn, ids, ctx)
    pl = params["mtp"][last]
    h = mhc.collapse(X, pre)  # the last stage's FFN pre (no hc_head in V4.1)
    logits = jnp.einsum("btd,dv->btv", mla.rms(cfg, h, pl["norm"]).astype(F32), params["lm_head"].astype(F32))
    me, mh = pl["markov_head"]["embed"], pl["markov_head"]["head"].astype(F32)
    out, embeds, rows = [last_token], [], []
    for i in range(blk):  # the Markov bias of step i depends on the id picked at step i-1: sequential
        e = me[out[-1]].astype(F32)
        row = logits[:, i] + e @ mh
        rows.append(row)
        embeds.append(e)
        out.append(jnp.argmax(row, axis=-1).astype(jnp.int32) if pick is None else pick(i, row))
    logits = jnp.stack(rows, axis=1)
    feats = jnp.concatenate([h.astype(F32), jnp.stack(embeds, axis=1)], axis=-1)
    conf = (feats @ pl["confidence_head"]["proj"].astype(F32))[..., 0]
    return logits, jnp.stack(out, axis=1), conf


def dspark_init_cache(cfg: ModelConfig, batch: int, dtype, block_size: int = 0, tables=None) -> kv.Cache:
    """Per stage, the ring of main-KV the reference keeps (`window_kv_cache`, plan.mtp_cache_specs), contiguous
    or paged like the backbone's cache."""
    return kv.build([mtp_cache_specs(cfg)], (1,), batch, cfg.mtp.layer.attention.window, dtype, block_size, tables)


def dspark_prefill_cache(params, cfg: ModelConfig, cache, mains, lengths):
    """Fill the rings from a right-padded prefill: mains [B, T, K*D] of positions 0..T-1, `lengths` [B]
    (the reference's `forward_spec` at start_pos 0, which only seeds the window)."""
    return dspark_extend_cache(params, cfg, cache, mains, jnp.zeros_like(jnp.asarray(lengths)), lengths)


def dspark_extend_cache(params, cfg: ModelConfig, cache, mains, start, lengths):
    """Write the main-KV of backbone positions start[b] .. start[b]+lengths[b]-1: mains [B, T, K*D] of a chunk
    (a prefill from 0, or the accepted part of a speculative step's verified chunk)."""
    start, lengths = jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32)
    pos = start[:, None] + jnp.arange(mains.shape[1], dtype=jnp.int32)
    lc = kv.LayerCache(cache, 0, 0)
    for m, v in dspark_window_kv(params, cfg, mains, pos).items():
        lc.write(f"stage{m}", v[:, None], lengths, start)
    return lc.cache


def dspark_step_cache(params, cfg: ModelConfig, cache, mains, positions):
    """Write one decode step's main-KV: mains [B, 1, K*D] of the backbone step at positions [B]."""
    lc = kv.LayerCache(cache, 0, 0)
    for m, v in dspark_window_kv(params, cfg, mains, positions[:, None]).items():
        lc.write_token(f"stage{m}", v[:, :1], positions)
    return lc.cache


def dspark_draft_cached(params, cfg: ModelConfig, cache, last_token, start_pos, pick=None):
    """dspark_draft over the rings (after dspark_step_cache at `start_pos`, or a prefill ending there); pick: see
    dspark_draft_from_window."""
    lc = kv.LayerCache(cache, 0, 0)
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), (jnp.asarray(last_token).shape[0],))
    stages = [str(m) for m in range(cfg.mtp.layers)]
    wpos = lc.positions("stage0", sp)
    ok = (wpos >= 0) & (wpos > sp[:, None] - cfg.mtp.layer.attention.window)
    window = {m: lc.read(f"stage{m}")[:, 0] for m in stages}
    return dspark_draft_from_window(params, cfg, window, ok, last_token, start_pos, pick)


# ---------------------------------------------------------------------------------------- V4 classic MTP
def mtp_forward(params, cfg: ModelConfig, h_stream, tokens, depth: int = 0):
    """V4 classic MTP (§8.2, REF4 `MTPBlock`), full sequence from position 0.

    h_stream [B, T, n, D]: the hc stream entering this depth (depth 0: the backbone's final stream, before its
    hc_head); tokens [B, T]: the token at t+1+depth for each position t (the caller shifts). Returns
    (logits [B, T, V] fp32 predicting the token at t+2+depth, the block's output stream [B, T, n, D] for the
    next depth)."""
    B, T = tokens.shape
    ctx = _ctx(cfg, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    return _mtp_block(params, cfg, h_stream, tokens, ctx, None, depth)[:2]


def _mtp_block(params, cfg, h_stream, tokens, ctx, lc, depth):
    p = params["mtp"][str(depth)]
    dt = params["embed"].dtype
    e = mla.rms(cfg, params["embed"][tokens].astype(dt), p["enorm"])
    hs = mla.rms(cfg, h_stream.astype(dt), p["hnorm"])  # per copy, over D
    X = (mla.linear(ctx, e, p["e_proj"])[:, :, None, :] + mla.linear(ctx, hs, p["h_proj"])).astype(dt)
    attn = lambda h: mla.attention(cfg, cfg.mtp.layer, p["attn"], h, ctx, lc, {})[0]  # noqa: E731
    X, _ = _block(cfg, p, X, None, attn, tokens, ctx)
    pre = mhc.head_pre(X, p["hc_head"], norm_eps=cfg.norm_eps, hc_eps=cfg.mtp.layer.mhc.eps)
    h = mla.rms(cfg, mhc.collapse(X, pre), p["norm"])
    logits = jnp.einsum("btd,dv->btv", h.astype(F32), params["lm_head"].astype(F32))
    return logits, X, None if lc is None else lc.cache


def mtp_init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, lookahead: int = 0) -> kv.Cache:
    """V4 classic MTP's cache: each depth's window ring of KV (its layer's cache spec), with `lookahead` spare
    slots (see model.init_cache) for the positions a recursive draft writes and the next step overwrites."""
    specs = tuple(kv.roomier(s, lookahead) for s in cache_specs(cfg, cfg.mtp.layer))
    return kv.build([specs], (cfg.mtp.layers,), batch, max_len, dtype)


def mtp_extend(params, cfg: ModelConfig, cache, h_stream, tokens, start, lengths, depth: int = 0):
    """mtp_forward over a chunk continuing the cache: row b's inputs sit at positions start[b] + t and the first
    lengths[b] are written into the window ring (h_stream [B, T, n, D]: the stream at those positions; tokens
    [B, T]: the token after each). Returns (logits [B, T, V], output stream [B, T, n, D], cache)."""
    start, lengths = jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    ctx = {**_ctx(cfg, positions), "mode": "extend", "start": start, "lengths": lengths}
    return _mtp_block(params, cfg, h_stream, tokens, ctx, kv.LayerCache(cache, 0, depth), depth)
