"""DeepSeek multi-token prediction as pure functions (specs/deepseek_v4.md §8): V4.1's DSpark drafter and
V4's classic MTP block. Used later for speculative decoding; the backbone (jaxmodels/deepseek.py) does not
depend on any of this.

Params live under params["mtp"][str(m)], each a backbone-style layer (see deepseek.py's docstring: window-only
attention, MoE sized by cfg.mtp_num_experts / mtp_top_k, falling back to the backbone's counts as the
reference's `get_moe_config` does) plus, weights [in, out]:
  V4.1 DSpark  stage 0: main_proj [K*D, D], main_norm [D]   (K = len(cfg.dspark_target_layers))
               last stage: norm [D], markov_head {embed [V, R], head [R, V]}, confidence_head {proj [D+R, 1]}
  V4 MTP       e_proj, h_proj [D, D], enorm, hnorm, norm [D], hc_head {fn [n, nD], base [n], scale [1]}
`embed` and `head` are the backbone's (the checkpoint's mtp.*.embed/head copies are dropped at import).

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
`dspark_prefill_cache` / `dspark_step_cache` / `dspark_draft_cached`; `mtp_forward` (V4); `backbone` (a full
forward that also returns the mains and the final hc stream).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxmodels import deepseek as ds
from jaxmodels.families.deepseek_v4 import DeepseekConfig, DSLayer
from jaxmodels.layers import mhc, mla, rope

F32 = jnp.float32
MTP_LAYER = DSLayer()  # compress ratio 0 (window only), no indexer, bias routing: every V4/V4.1 MTP layer


# ----------------------------------------------------------------------------------------------- params
def has_mtp(cfg: DeepseekConfig) -> bool:
    """Whether the config carries MTP weights: V4 classic MTP, or V4.1 DSpark (built only with a block size)."""
    return cfg.mtp_layers > 0 and (not cfg.v41 or cfg.dspark_block_size > 0)


def mtp_config(cfg: DeepseekConfig) -> DeepseekConfig:
    """The config the MTP blocks run with: their own expert counts (DSpark: 128 experts top-3 in V4.1-Flash)."""
    return dataclasses.replace(cfg, num_experts=cfg.mtp_num_experts or cfg.num_experts,
                               top_k=cfg.mtp_top_k or cfg.top_k)


def mtp_param_shapes(cfg: DeepseekConfig) -> dict:
    """{"mtp": {"0": {...}, ...}} shapes, or {} when the config has no MTP."""
    if not has_mtp(cfg):
        return {}
    D, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    mc, last = mtp_config(cfg), cfg.mtp_layers - 1
    out = {}
    for m in range(cfg.mtp_layers):
        s = ds._layer_shapes(mc, MTP_LAYER)
        if cfg.v41:
            if m == 0:
                s |= {"main_proj": (len(cfg.dspark_target_layers) * D, D), "main_norm": (D,)}
            if m == last:
                R = cfg.dspark_markov_rank
                s |= {"norm": (D,), "markov_head": {"embed": (V, R), "head": (R, V)},
                      "confidence_head": {"proj": (D + R, 1)}}
        else:
            s |= {"e_proj": (D, D), "h_proj": (D, D), "enorm": (D,), "hnorm": (D,), "norm": (D,),
                  "hc_head": {"fn": (n, n * D), "base": (n,), "scale": (1,)}}
        out[str(m)] = s
    return {"mtp": out}


# ------------------------------------------------------------------------------------------ shared pieces
def _block(cfg, lp, X, pre, attn, tokens):
    """One mHC block with the given attention callable; returns (X, pF). V4.1: delayed pre (attention collapses
    with `pre`, the FFN with this block's attention pre); V4: each sublayer collapses with its own pre."""
    hc = dict(norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps, iters=cfg.hc_iters)
    pA, qA, cA = mhc.mixes(X, lp["hc_attn"], **hc)
    h = ds._rms(cfg, mhc.collapse(X, pre if cfg.v41 else pA), lp["attn_norm"])
    X = mhc.expand(attn(h), X, qA, cA)
    pF, qF, cF = mhc.mixes(X, lp["hc_ffn"], **hc)
    h = ds._rms(cfg, mhc.collapse(X, pA if cfg.v41 else pF), lp["ffn_norm"])
    X = mhc.expand(ds._moe(cfg, MTP_LAYER, lp["ffn"], h, tokens), X, qF, cF)
    return X, pF


def _out_proj(cfg, p, o, cos, sin, dtype):
    """Inverse RoPE of the attention output, grouped low-rank wo_a, then wo_b (as deepseek._attention)."""
    B, T = o.shape[:2]
    o = mla.rope_tail(o, cos[:, :, None], sin[:, :, None], inverse=True).astype(dtype)
    u = jnp.einsum("btgi,gir->btgr", o.reshape(B, T, cfg.o_groups, -1), p["wo_a"].astype(o.dtype))
    return ds._lin(cfg, u.reshape(B, T, -1), p["wo_b"])


def _window_kv(cfg, p, x, cos, sin):
    """The window KV a layer writes for inputs x: RoPE'd kv_norm(wkv(x)), FP8-QDQ'd in reference numerics."""
    return ds._kv_qdq(cfg, mla.rope_tail(ds._rms(cfg, ds._lin(cfg, x, p["wkv"]), p["kv_norm"]), cos, sin))


# ----------------------------------------------------------------------------------------------- backbone
def backbone(params, cfg: DeepseekConfig, tokens):
    """Full forward from position 0 that also returns what the MTP heads read: (logits [B, T, V] fp32,
    mains [B, T, K*D] (V4.1: the hc-means of the target layers' inputs, concatenated in target order; None
    otherwise), stream [B, T, n, D] (the final hc stream before the collapse, V4's MTP input))."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, _, aux = ds._stream(params, cfg, tokens, positions, "full", collect=True)
    return ds._head(cfg, params, x), aux["mains"], aux["stream"]


# ------------------------------------------------------------------------------------------ V4.1 DSpark
def _dspark_attention(cfg, p, x, main_kv, main_ok, dpos):
    """Draft queries x [B, blk, D] at positions dpos [B, blk]: attend the stage's main-KV window main_kv
    [B, N, d] (rows allowed by main_ok [B, N]) plus every draft KV of the block (bidirectional), with sinks."""
    B, blk, _ = x.shape
    H, d = cfg.num_heads, cfg.head_dim
    cos, sin = rope.cos_sin(cfg.main_rope, cfg.rope_dim, dpos, F32)  # MTP layers have ratio 0: no YaRN
    qr = ds._rms(cfg, ds._lin(cfg, x, p["wq_a"]), p["q_norm"])
    q = mla.rope_tail(ds._lin(cfg, qr, p["wq_b"]).reshape(B, blk, H, d), cos[:, :, None], sin[:, :, None])
    keys = jnp.concatenate([main_kv.astype(x.dtype), _window_kv(cfg, p, x, cos, sin)], axis=1)
    allow = jnp.concatenate([jnp.broadcast_to(main_ok[:, None, :], (B, blk, main_ok.shape[1])),
                             jnp.ones((B, blk, blk), bool)], axis=-1)
    o = mla.attend(q, keys, allow, None, None, p["sink"], d ** -0.5)
    return _out_proj(cfg, p, o, cos, sin, x.dtype)


def dspark_main_x(params, cfg: DeepseekConfig, mains):
    """main_x [..., D] = main_norm(main_proj(mains)) from the concatenated target-layer means [..., K*D]."""
    p0 = params["mtp"]["0"]
    return ds._rms(cfg, ds._lin(cfg, mains.astype(params["embed"].dtype), p0["main_proj"]), p0["main_norm"])


def dspark_window_kv(params, cfg: DeepseekConfig, mains, positions):
    """Each stage's window KV for backbone positions [B, T] (what the reference writes into the stage's ring,
    at prefill for the last W positions and at every decode step for the current one): {stage: [B, T, d]}."""
    main_x = dspark_main_x(params, cfg, mains)
    cos, sin = rope.cos_sin(cfg.main_rope, cfg.rope_dim, positions, F32)
    return {m: _window_kv(cfg, params["mtp"][m]["attn"], main_x, cos, sin) for m in sorted(params["mtp"], key=int)}


def dspark_draft(params, cfg: DeepseekConfig, mains, last_token, start_pos):
    """V4.1 DSpark draft after the backbone step at `start_pos` (int or [B]).

    mains [B, T, K*D]: the target-layer means of the backbone positions start_pos-T+1 .. start_pos (right-aligned;
    only the last min(window, start_pos+1) rows are read, so T = window suffices). last_token [B]: the token the
    backbone just produced for position start_pos+1. Returns (draft logits [B, blk, V] fp32 incl. the Markov bias,
    ids [B, blk+1] int32 = [last_token, greedy drafts], confidence [B, blk] fp32).
    """
    B, T = mains.shape[:2]
    if isinstance(start_pos, int) and T < min(cfg.window, start_pos + 1):
        raise ValueError(f"the draft at position {start_pos} reads the last {min(cfg.window, start_pos + 1)} "
                         f"positions' mains; got {T}")
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), (B,))
    mpos = sp[:, None] - (T - 1) + jnp.arange(T)  # the rows' backbone positions
    ok = (mpos >= 0) & (mpos > sp[:, None] - cfg.window)  # the ring holds the last `window` positions
    kv = dspark_window_kv(params, cfg, mains, jnp.maximum(mpos, 0))
    return dspark_draft_from_window(params, cfg, kv, ok, last_token, sp)


def dspark_draft_from_window(params, cfg: DeepseekConfig, window_kv, window_ok, last_token, start_pos):
    """The draft from each stage's main-KV window (a ring kept by the caller, or dspark_window_kv's rows):
    window_kv {stage: [B, N, d]}, window_ok [B, N] marks the filled slots (order is irrelevant)."""
    mc = mtp_config(cfg)
    dt = params["embed"].dtype
    blk, n, last = cfg.dspark_block_size, cfg.hc_mult, str(cfg.mtp_layers - 1)
    last_token = jnp.asarray(last_token, jnp.int32)
    B = last_token.shape[0]
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), (B,))
    ids = jnp.concatenate([last_token[:, None], jnp.full((B, blk - 1), cfg.dspark_noise_token, jnp.int32)], axis=1)
    dpos = sp[:, None] + 1 + jnp.arange(blk)
    x = params["embed"][ids].astype(dt)
    X = jnp.broadcast_to(x[:, :, None, :], (B, blk, n, x.shape[-1]))
    pre = jax.nn.one_hot(jnp.zeros((B, blk), jnp.int32), n, dtype=F32)
    for m in range(cfg.mtp_layers):
        lp = params["mtp"][str(m)]
        X, pre = _block(mc, lp, X, pre,
                        lambda h, lp=lp, m=m: _dspark_attention(mc, lp["attn"], h, window_kv[str(m)], window_ok, dpos),
                        ids)
    pl = params["mtp"][last]
    h = mhc.collapse(X, pre)  # the last stage's FFN pre (no hc_head in V4.1)
    logits = jnp.einsum("btd,dv->btv", ds._rms(cfg, h, pl["norm"]).astype(F32), params["head"].astype(F32))
    me, mh = pl["markov_head"]["embed"], pl["markov_head"]["head"].astype(F32)
    out, embeds, rows = [last_token], [], []
    for i in range(blk):  # the Markov bias of step i depends on the id picked at step i-1: sequential
        e = me[out[-1]].astype(F32)
        row = logits[:, i] + e @ mh
        rows.append(row)
        embeds.append(e)
        out.append(jnp.argmax(row, axis=-1).astype(jnp.int32))
    logits = jnp.stack(rows, axis=1)
    feats = jnp.concatenate([h.astype(F32), jnp.stack(embeds, axis=1)], axis=-1)
    conf = (feats @ pl["confidence_head"]["proj"].astype(F32))[..., 0]
    return logits, jnp.stack(out, axis=1), conf


def dspark_init_cache(cfg: DeepseekConfig, batch: int, dtype) -> dict:
    """Per stage, the ring of main-KV the reference keeps (`window_kv_cache`), and the position in each slot."""
    W, d = cfg.window, cfg.head_dim
    return {"win": {str(m): jnp.zeros((batch, W, d), dtype) for m in range(cfg.mtp_layers)},
            "win_pos": jnp.full((batch, W), -1, jnp.int32)}


def dspark_prefill_cache(params, cfg: DeepseekConfig, cache, mains, lengths):
    """Fill the rings from a right-padded prefill: mains [B, T, K*D] of positions 0..T-1, `lengths` [B]
    (the reference's `forward_spec` at start_pos 0, which only seeds the window)."""
    B, T = mains.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slots = cache["win_pos"].shape[1]
    kv = dspark_window_kv(params, cfg, mains, pos)
    win = {m: ds._ring_fill(v, lengths, slots)[0].astype(cache["win"][m].dtype) for m, v in kv.items()}
    return {"win": win, "win_pos": ds._ring_fill(pos[..., None], lengths, slots)[1]}


def dspark_step_cache(params, cfg: DeepseekConfig, cache, mains, positions):
    """Write one decode step's main-KV: mains [B, 1, K*D] of the backbone step at positions [B]."""
    b = jnp.arange(mains.shape[0])
    slot = positions % cache["win_pos"].shape[1]
    kv = dspark_window_kv(params, cfg, mains, positions[:, None])
    win = {m: cache["win"][m].at[b, slot].set(v[:, 0].astype(cache["win"][m].dtype)) for m, v in kv.items()}
    return {"win": win, "win_pos": cache["win_pos"].at[b, slot].set(positions)}


def dspark_draft_cached(params, cfg: DeepseekConfig, cache, last_token, start_pos):
    """dspark_draft over the rings (after dspark_step_cache at `start_pos`, or a prefill ending there)."""
    sp = jnp.broadcast_to(jnp.asarray(start_pos, jnp.int32), cache["win_pos"].shape[:1])[:, None]
    wpos = cache["win_pos"]
    ok = (wpos >= 0) & (wpos <= sp) & (wpos > sp - cfg.window)
    return dspark_draft_from_window(params, cfg, cache["win"], ok, last_token, start_pos)


# ---------------------------------------------------------------------------------------- V4 classic MTP
def mtp_forward(params, cfg: DeepseekConfig, h_stream, tokens, depth: int = 0):
    """V4 classic MTP (§8.2, REF4 `MTPBlock`), full sequence from position 0.

    h_stream [B, T, n, D]: the hc stream entering this depth (depth 0: the backbone's final stream, before its
    hc_head); tokens [B, T]: the token at t+1+depth for each position t (the caller shifts). Returns
    (logits [B, T, V] fp32 predicting the token at t+2+depth, the block's output stream [B, T, n, D] for the
    next depth)."""
    mc = mtp_config(cfg)
    p = params["mtp"][str(depth)]
    dt = params["embed"].dtype
    B, T = tokens.shape
    e = ds._rms(cfg, params["embed"][tokens].astype(dt), p["enorm"])
    hs = ds._rms(cfg, h_stream.astype(dt), p["hnorm"])  # per copy, over D
    X = (ds._lin(cfg, e, p["e_proj"])[:, :, None, :] + ds._lin(cfg, hs, p["h_proj"])).astype(dt)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    ctx = {"positions": positions, "mode": "full", "lengths": None,
           "rope": {False: rope.cos_sin(cfg.main_rope, cfg.rope_dim, positions, F32)}}
    attn = lambda h: ds._attention(mc, MTP_LAYER, p["attn"], h, ctx, {}, None)[0]  # noqa: E731
    X, _ = _block(mc, p, X, None, attn, tokens)
    pre = mhc.head_pre(X, p["hc_head"], norm_eps=cfg.norm_eps, hc_eps=cfg.hc_eps)
    h = ds._rms(cfg, mhc.collapse(X, pre), p["norm"])
    return jnp.einsum("btd,dv->btv", h.astype(F32), params["head"].astype(F32)), X
