"""Look inside a forward pass: the residual stream around every layer, attention probabilities, router choices,
mHC mixing matrices and DeepSeek indexer selections. For notebooks and research, not for speed.

    from jaxmodels import interpret
    tr = interpret.trace(model, tokens)      # tokens int32 [B, T]; one forward, layer by layer
    tr.residual[i]        # the stream entering layer i: [B, T, D] (mHC: the n streams [B, T, n, D]);
                          # tr.residual[L] is the last layer's output, before the final norm
    tr.attention[i]       # [B, H, T, T] float32 attention probabilities of a grouped-query attention layer
    tr.routing[i]         # (weights [B, T, k], experts [B, T, k]) of a MoE layer's router
    tr.mhc[i]             # {"attn": Mix, "mlp": Mix}: the mHC pre [B, T, n], post [B, T, n], comb [B, T, n, n]
    tr.selected[i]        # [B, T, N] bool: the compressed entries a DeepSeek compressed layer attends
    tr.logits             # [B, T, V]: what jm.forward returns
    lens = interpret.logit_lens(model, tr)   # [L + 1, B, T, V]: the final norm and head on every residual

The executor (`jaxmodels.model`) scans the layers and keeps no intermediate; here they run one at a time (each
layer kind jitted once), calling the same public layer functions as the executor (`attention.gqa`,
`mla.attention`, `moe.sparse`, `mlp.gated`, `mhc.mixes` / `collapse` / `expand`, `norms.norm`) and the executor's
`model.head`. What is recorded is recomputed from a layer's own input with those pieces: attention probabilities
go through `attention.attend` itself (values = the identity, so its mask, softcap and sinks apply unchanged), the
routing through `moe.route`. tests/test_interpret.py checks that the logits equal `jm.forward` for every family
and that residuals, attention probabilities and router choices equal transformers' own (`output_hidden_states`,
`output_attentions`, `output_router_logits`).

Text only: no images, no Mllama cross-attention layers, no Engram (DeepSeek V4.1's n-gram tables); those raise
NotImplementedError. Runs on one device (no mesh).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import model as executor, plan as plan_lib
from jaxmodels.config import LayerSpec, ModelConfig
from jaxmodels.layers import attention, mhc, mla, mlp, moe, rope
from jaxmodels.layers.norms import norm

F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pre", "post", "comb"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Mix:
    """One mHC site's mixes (jaxmodels.layers.mhc.mixes): pre [B, T, n] collapses the n streams into the
    sublayer's input, post [B, T, n] spreads its output over them, comb [B, T, n, n] (comb[j, k]: stream j into
    stream k, doubly stochastic) mixes the old streams."""

    pre: jax.Array
    post: jax.Array
    comb: jax.Array


@dataclasses.dataclass(frozen=True)
class Trace:
    """What `trace` recorded; dicts are keyed by layer index (only the layers of that kind appear)."""

    config: ModelConfig
    residual: list  # L + 1 arrays: the stream entering each layer, then the last layer's output
    attention: dict  # layer -> [B, H, T, T] float32 probabilities (grouped-query attention layers)
    routing: dict  # layer -> (weights [B, T, k], expert ids [B, T, k])
    mhc: dict  # layer -> {"attn": Mix, "mlp": Mix}
    selected: dict  # layer -> [B, T, N] bool, compressed entries attended (DeepSeek ratio > 0 layers)
    logits: jax.Array  # [B, T, vocab] float32


def _check(cfg: ModelConfig):
    if cfg.engram is not None or any(s.engram >= 0 for s in cfg.layers):
        raise NotImplementedError(f"{cfg.family}: interpret does not run Engram layers yet")
    if any(s.attention.kind == "cross" for s in cfg.layers):
        raise NotImplementedError(f"{cfg.family}: interpret does not run cross-attention layers (images) yet")


def _ctx(cfg: ModelConfig, spec: LayerSpec, tokens, positions, dtype) -> dict:
    """The context a layer function reads in a cacheless forward ("full" mode), with this layer's RoPE table."""
    a = spec.attention
    tables = {}
    if a.rope is not None:
        dim, dt = (a.mla.rope_dim, F32) if a.kind == "mla" else (cfg.head_dim, dtype)
        tables[(a.rope, dim)] = rope.cos_sin(a.rope, dim, positions, dt, cfg.max_position_embeddings)
    return {"positions": positions, "mode": "full", "lengths": None, "start": None, "unroll": 1, "shard": None,
            "tokens": tokens, "rope": tables, "blocks": None, "cross": None,
            "act_block": cfg.quant_block if cfg.numerics == "reference" else None}


def attention_probs(cfg: ModelConfig, a, p, h, ctx) -> jax.Array:
    """The attention probabilities of a grouped-query attention layer (AttentionSpec `a`, its params `p`) on its
    normed input h [B, T, D] -> float32 [B, H, T, T] (query, key). q and k as `attention.gqa` builds them (biases,
    qk-norm, RoPE); the softmax is `attention.attend`'s own (mask with the layer's window, softcap, sinks: a row
    then sums to less than 1) applied to identity values, in fp32."""
    q, k, _ = attention.project(cfg, a, p, h, ctx)
    # values: key s carries one-hot(s); q and k zero-padded to that width (the scores do not change) since
    # attend's output has the width of q
    B, T, K, d = k.shape
    n = max(d, T)
    q, k = (jnp.pad(t.astype(F32), ((0, 0), (0, 0), (0, 0), (0, n - d))) for t in (q, k))
    eye = jnp.broadcast_to(jnp.eye(T, n, dtype=F32), (B, K, T, n))
    pos = ctx["positions"]
    scale = a.scale if a.scale is not None else cfg.head_dim ** -0.5
    sinks = p.get("sinks")
    probs = attention.attend(q, k.transpose(0, 2, 1, 3), eye, attention.mask(pos, pos, a.window), scale=scale,
                             softcap=a.softcap, sinks=None if sinks is None else sinks.astype(F32))[..., :T]
    return probs.transpose(0, 2, 1, 3)  # [B, Tq, H, Tk] -> [B, H, Tq, Tk]


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "probs"))
def _layer(stack, rank, carry, tokens, positions, *, cfg: ModelConfig, spec: LayerSpec, probs: bool):
    """One decoder layer as jaxmodels.model runs it in a cacheless forward, with what it computed on the side.
    stack: its kind's stacked params; rank: its index there. carry {x, state[, pre]} -> (carry, seen)."""
    p = jax.tree.map(lambda a: a[rank], stack)
    x, state = carry["x"], carry["state"]
    eps, nk = cfg.norm_eps, spec.norm
    ctx = _ctx(cfg, spec, tokens, positions, x.dtype)
    seen, out = {}, {"state": state}

    def attn(h):
        if spec.attention.kind == "mla":
            y, out["state"] = mla.attention(cfg, spec, p["attn"], h, ctx, None, state)
            if spec.attention.mla.ratio:  # the entries this layer attended: all visible, or the top-k
                m = spec.attention.mla
                seen["selected"] = (out["state"]["topk"] if m.select != "all" else
                                    mla.visible(positions, out["state"]["kv"].shape[1], m.ratio))
            return y
        if probs:
            seen["attention"] = attention_probs(cfg, spec.attention, p["attn"], h, ctx)
        return attention.gqa(cfg, spec.attention, p["attn"], h, ctx, None)

    def ffn(h):
        if spec.mlp.kind == "moe":
            w, e = moe.route(spec.mlp, p["mlp"], h.reshape(-1, h.shape[-1]), tokens)
            seen["routing"] = (w.reshape(*h.shape[:-1], -1), e.reshape(*h.shape[:-1], -1))
            return moe.sparse(spec.mlp, p["mlp"], h, None, tokens, ctx["act_block"])
        return mlp.gated(spec.mlp, p["mlp"], h, ctx["act_block"])

    carry = dict(carry)
    if spec.mhc is not None:  # mhc.block, with its mixes kept
        hc = dict(norm_eps=eps, hc_eps=spec.mhc.eps, iters=spec.mhc.sinkhorn_iters)
        pA, qA, cA = mhc.mixes(x, p["hc_attn"], **hc)
        x = mhc.expand(attn(norm(mhc.collapse(x, carry["pre"] if spec.mhc.delayed else pA), p["attn_norm"], eps, nk)),
                       x, qA, cA)
        pF, qF, cF = mhc.mixes(x, p["hc_mlp"], **hc)
        x = mhc.expand(ffn(norm(mhc.collapse(x, pA if spec.mhc.delayed else pF), p["mlp_norm"], eps, nk)), x, qF, cF)
        carry["pre"] = pF
        seen["mhc"] = {"attn": Mix(pA, qA, cA), "mlp": Mix(pF, qF, cF)}
    else:
        x = executor.residual_block(spec, p, x, attn, ffn, eps)
    carry["x"], carry["state"] = x, out["state"]
    return carry, seen


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params, tokens, *, cfg: ModelConfig):
    x = params["embed"][tokens]
    if cfg.embed_scale is not None:  # rounded to the weight dtype, as the executor
        x = x * jnp.asarray(cfg.embed_scale, params["embed"].dtype)
    carry = {"x": x, "state": {}}
    if cfg.mhc is not None:
        B, T, D = x.shape
        carry["x"] = jnp.broadcast_to(x[:, :, None, :], (B, T, cfg.mhc.copies, D))
        carry["pre"] = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), cfg.mhc.copies, dtype=F32)
    return carry


@functools.partial(jax.jit, static_argnames=("cfg",))
def _final(params, carry, *, cfg: ModelConfig):
    x = carry["x"]
    if cfg.mhc is not None:  # V4.1: collapse with the last FFN pre-mix; V4: a learned collapse
        pre = carry["pre"] if cfg.mhc.delayed else mhc.head_pre(x, params["hc_head"], norm_eps=cfg.norm_eps,
                                                                  hc_eps=cfg.mhc.eps)
        x = mhc.collapse(x, pre)
    return executor.head(params, cfg, x)


def _layers(cfg: ModelConfig, which, what: str) -> set[int]:
    if which is True:
        return set(range(cfg.num_layers))
    if which is False or which is None:
        return set()
    out = {int(i) for i in which}
    if bad := sorted(i for i in out if not 0 <= i < cfg.num_layers):
        raise ValueError(f"interpret.trace: {what} layers {bad} outside 0..{cfg.num_layers - 1}")
    return out


def trace(model, tokens, *, attention=True) -> Trace:
    """Run `model` (a jm.Model, or anything with .config and .params) on tokens int32 [B, T] from position 0,
    recording each layer's input and what it computed (module docstring). attention: record the probabilities of
    every grouped-query attention layer (True), none (False), or of the layers listed (they cost B*H*T*T floats
    each)."""
    cfg, params = model.config, model.params
    _check(cfg)
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"interpret.trace: tokens must be [batch, time], got shape {tuple(tokens.shape)}")
    if not np.all((np.asarray(tokens) >= 0) & (np.asarray(tokens) < cfg.vocab_size)):
        raise ValueError(f"interpret.trace: token ids must lie in [0, {cfg.vocab_size})")
    want = _layers(cfg, attention, "attention")
    pl = plan_lib.plan(cfg)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    carry = _embed(params, tokens, cfg=cfg)
    residual, attn, routing, mixes, selected = [carry["x"]], {}, {}, {}, {}
    for i in range(cfg.num_layers):
        k = pl.kind_of[i]
        carry, seen = _layer(params["layers"][str(k)], jnp.int32(pl.rank_of[i]), carry, tokens, positions,
                             cfg=cfg, spec=pl.kinds[k], probs=i in want)
        residual.append(carry["x"])
        for name, d in (("attention", attn), ("routing", routing), ("mhc", mixes), ("selected", selected)):
            if name in seen:
                d[i] = seen[name]
    return Trace(cfg, residual, attn, routing, mixes, selected, _final(params, carry, cfg=cfg))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _lens(params, x, *, cfg: ModelConfig):
    return executor.head(params, cfg, x)


def logit_lens(model, tr: Trace, layers=None) -> jax.Array:
    """The logit lens (nostalgebraist, 2020): the model's final norm and head applied to the residual stream
    entering each layer -> float32 [len(layers), B, T, vocab] (default: all L + 1 residuals, the last being the
    model's own logits). Not for mHC models (their streams collapse through learned weights)."""
    if model.config.mhc is not None:
        raise NotImplementedError("logit_lens: an mHC model's n streams have no single residual to read")
    layers = range(len(tr.residual)) if layers is None else layers
    return jnp.stack([_lens(model.params, tr.residual[i], cfg=model.config) for i in layers])
