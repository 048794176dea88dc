"""Executes the layer plan of a `ModelConfig` with JAX: one executor for every family, DeepSeek included.

Parameters are nested dicts; layers with equal `LayerSpec`s form a *kind* whose parameters are stacked along a
leading axis (`layers/<kind>/attn/wq` has shape [layers of that kind, ...]). The plan's runs (`plan.Run`) are
executed with `lax.scan` over their repeats, nested, so compile time follows the number of distinct layer
bodies, not the depth. What a layer passes to later ones travels explicitly in the scan carry: the residual
stream (or mHC's n streams and pre-mix), the `state` DeepSeek's compressed layers publish (latest compressed
entries, indexer keys, top-k, candidate blocks), the cache, and on request the DSpark taps.

Caches are `jaxmodels.cache.Cache` (contiguous or paged); attention reads and writes them through a LayerCache.
Sharding is an argument: `shard` (a `jaxmodels.sharding.Sharding` or None) pins activations and splits experts.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import cache as kv
from jaxmodels.config import ModelConfig
from jaxmodels.layers import attention, engram, mhc, mla, mlp, moe, rope, vision
from jaxmodels.layers.norms import norm
from jaxmodels.plan import Plan, flatten, mtp_param_specs, param_specs, plan, unflatten

F32 = jnp.float32
# Options for jax.jit of the model's functions. XLA:GPU's Triton GEMM fusions read a scanned layer's weights
# through a copy of its slice of the stack, made on every step; cuBLAS GEMMs read the stack in place. Llama-8B
# shape decode on an H200: 11.6 -> 6.2 ms a step at batch 1 (BENCHMARKS.md). XLA's dot merger makes one GEMM of
# q/k/v by concatenating wq|wk|wv, a copy of those weights every step (Llama-8B B=32 decode: 6.53 -> 6.13 ms;
# prefill a little faster too).
COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False, "xla_disable_hlo_passes": "dot-merger"}


# ----------------------------------------------------------------------------------------------- parameters
def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02,
                fp4_experts: bool = False, mtp: bool = False) -> dict:
    """Random parameters at the config's shapes, by each ParamSpec's init and dtype (tests and benchmarks).
    fp4_experts: routed experts as random FP4 bytes with E8M0 scale 2^-6 (kept quantized, [E, out, in/2]).
    mtp: DeepSeek's MTP blocks too (params["mtp"], plan.mtp_param_specs)."""
    flat = flatten(param_specs(cfg) | (mtp_param_specs(cfg) if mtp else {}))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    out = {}
    for key, (path, s) in zip(keys, flat.items()):
        dt = jnp.dtype(s.dtype or dtype)
        routed = "/mlp/" in path and "/shared/" not in path and path.endswith(("w_gate", "w_up", "w_down"))
        if fp4_experts and routed and s.axes[1] == "experts":
            L, E, n_in, n_out = s.shape
            out[path] = {"fp4": jax.random.randint(key, (L, E, n_out, n_in // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                         "scale": jnp.full((L, E, n_out, n_in // 32), 121, jnp.uint8)}
        elif s.init == "normal":
            out[path] = (std * jax.random.normal(key, s.shape, F32)).astype(dt)
        elif s.init == "expert_ids":  # layers/<kind>/mlp/tid2eid
            experts = plan(cfg).kinds[int(path.split("/")[1])].mlp.num_experts
            out[path] = jax.random.randint(key, s.shape, 0, experts, jnp.int32)
        elif s.init == "classes":
            out[path] = jnp.arange(s.shape[0], dtype=jnp.int32) // 2
        else:
            out[path] = jnp.full(s.shape, {"ones": 1.0, "zeros": 0.0, "half": 0.5}[s.init], dt)
    return unflatten(out)


def cast(cfg: ModelConfig, params: dict, dtype) -> dict:
    """Params in `dtype`, except what the plan keeps fp32 or integer (ParamSpec.dtype) and quantized bytes."""
    specs = flatten(param_specs(cfg) | mtp_param_specs(cfg))

    def one(path, a):
        s = specs.get("/".join(str(getattr(p, "key", p)) for p in path))
        keep = s is not None and s.dtype is not None  # kept-quantized leaves are bytes, not floating
        return a if keep or not jnp.issubdtype(a.dtype, jnp.floating) else a.astype(dtype)

    return jax.tree_util.tree_map_with_path(one, params)


# ----------------------------------------------------------------------------------------------- one layer
def _layer(cfg: ModelConfig, spec, p, carry, ctx, lc):
    """One decoder layer: carry {x, state, [pre], [mains]} -> carry; lc: its LayerCache (or None)."""
    x, state, eps, nk = carry["x"], carry["state"], cfg.norm_eps, spec.norm
    out = {"state": state}

    if spec.attention.kind == "cross":  # Mllama: gated residuals; skipped without images (HF)
        if (ctx["cross"] is None) if ctx["mode"] != "decode" else (lc is None or "cross_k" not in lc.cache.state[lc.kind]):
            return carry
        a, row = attention.cross(cfg, spec.attention, p["attn"], norm(x, p["attn_norm"], eps, nk), ctx, lc)
        x = x + jnp.tanh(p["attn"]["gate"]).astype(x.dtype) * a
        m = mlp.gated(spec.mlp, p["mlp"], norm(x, p["mlp_norm"], eps, nk)) * row[..., None].astype(x.dtype)
        x = x + jnp.tanh(p["mlp_gate"]).astype(x.dtype) * m
        carry = {**carry, "x": x}
        if lc is not None:
            carry["cache"] = lc.cache
        return carry

    def attn(h):
        if spec.attention.kind == "mla":
            y, out["state"] = mla.attention(cfg, spec, p["attn"], h, ctx, lc, state)
            return y
        return attention.gqa(cfg, spec.attention, p["attn"], h, ctx, lc)

    image = ctx.get("image_mask")  # DeepSeek V4.1's image spans [B, T]: their own router bias, no Engram

    def ffn(h):
        if spec.mlp.kind == "moe":
            stack = (ctx["stacks"][ctx["kind"]]["mlp"], ctx["rank"])  # the experts of every layer of this kind
            pm = p["mlp"]
            if image is not None and "selection_bias_vl" in pm:  # a bias per token [B*T, E]
                pm = {**pm, "selection_bias": jnp.where(image.reshape(-1, 1), pm["selection_bias_vl"],
                                                        pm["selection_bias"])}
            return moe.sparse(spec.mlp, pm, h, ctx["shard"], ctx["tokens"], ctx["act_block"], stack)
        return mlp.gated(spec.mlp, p["mlp"], h, ctx["act_block"])

    if spec.engram >= 0:
        x = engram.engram_inject(p["engram"], x, ctx["engram"][:, :, spec.engram], None if image is None else ~image,
                                 eps, act_quant=ctx["act_block"] is not None)
    carry = dict(carry)
    if "mains" in carry:  # DSpark taps: the mean of the streams entering a target layer
        j = jnp.asarray(ctx["taps"])[ctx["layer"]]
        tap = jnp.mean(x.astype(F32), axis=2)
        updated = jax.lax.dynamic_update_slice_in_dim(carry["mains"], tap, jnp.maximum(j, 0) * tap.shape[-1], axis=2)
        carry["mains"] = jnp.where(j >= 0, updated, carry["mains"])
    if spec.mhc is not None:
        x, carry["pre"] = mhc.block(x, carry["pre"], p["hc_attn"], p["hc_mlp"],
                                    lambda h: attn(norm(h, p["attn_norm"], eps, nk)),
                                    lambda h: ffn(norm(h, p["mlp_norm"], eps, nk)), spec.mhc, eps)
    else:
        x = residual_block(spec, p, x, attn, ffn, eps)
    carry["x"], carry["state"] = x, out["state"]
    if lc is not None:
        carry["cache"] = lc.cache
    return carry


def residual_block(spec, p, x, attn, ffn, eps: float):
    """One layer's attention and MLP around the residual stream x by the spec's norm placement (pre | post |
    sandwich | parallel); attn and ffn map normed inputs to their outputs."""
    nk = spec.norm
    h = x if spec.block == "post" else norm(x, p["attn_norm"], eps, nk)
    a = attn(h)
    if spec.block == "parallel":
        return x + a + ffn(h)
    if spec.block == "pre":
        x = x + a
        return x + ffn(norm(x, p["mlp_norm"], eps, nk))
    if spec.block == "sandwich":
        x = x + norm(a, p["post_attn_norm"], eps, nk)
        return x + norm(ffn(norm(x, p["mlp_norm"], eps, nk)), p["post_mlp_norm"], eps, nk)
    x = x + norm(a, p["post_attn_norm"], eps, nk)  # post
    return x + norm(ffn(x), p["post_mlp_norm"], eps, nk)


def _execute(cfg: ModelConfig, pl: Plan, runs, stacks, carry, ctx, layer_off, rank_off):
    """Runs in coordinates of their first repeat. stacks[k] = (params of kind k, rank of their index 0);
    layer_off / rank_off[k]: what the enclosing repeats add to a layer's index and its rank in the cache."""
    for run in runs:
        if run.body is None:
            i = run.start
            k, r = pl.kind_of[i], pl.rank_of[i]
            params, base = stacks[k]
            p = jax.tree.map(lambda a: a[r - base], params)
            rank = r + rank_off[k]  # in the kind's stack of params and caches
            lc = None if carry.get("cache") is None else kv.LayerCache(carry["cache"], k, rank)
            carry = _layer(cfg, pl.kinds[k], p, carry, {**ctx, "layer": i + layer_off, "kind": k, "rank": rank}, lc)
            continue
        layers = range(run.start, run.start + run.period)
        per = {k: sum(pl.kind_of[j] == k for j in layers) for k in {pl.kind_of[j] for j in layers}}
        first = {k: next(pl.rank_of[j] for j in layers if pl.kind_of[j] == k) for k in per}
        xs = {k: jax.tree.map(lambda a, k=k: a[first[k] - stacks[k][1]: first[k] - stacks[k][1] + run.repeats * c]
                              .reshape(run.repeats, c, *a.shape[1:]), stacks[k][0]) for k, c in per.items()}

        def body(carry, inp, run=run, per=per, first=first):
            s, xs = inp
            inner = {k: (xs[k], first[k]) for k in per}
            offs = {k: rank_off[k] + s * per.get(k, 0) for k in rank_off}
            return _execute(cfg, pl, run.body, inner, carry, ctx, layer_off + s * run.period, offs), None

        inp = (jnp.arange(run.repeats), xs)
        if any(_publishes(pl.kinds[pl.kind_of[j]]) for j in layers):
            carry = _fit(carry, jax.eval_shape(lambda c: body(c, jax.tree.map(lambda a: a[0], inp))[0], carry))
        carry, _ = jax.lax.scan(body, carry, inp, unroll=ctx["unroll"])
    return carry


def _publishes(spec) -> bool:
    """Whether a layer publishes state for later layers (DeepSeek's compressed entries, keys, top-k, candidates)."""
    m = spec.attention.mla
    return m is not None and (m.compress or m.select == "indexer" or m.candidate_source)


def _fit(carry, want):
    """The carry with the published state a scanned body starts publishing (or reshapes) pre-filled: a scan
    carries what its body returns. The placeholder is overwritten before any layer of the body reads it: a
    layer reads what the latest source or indexer of its own ratio published (the family config checks the
    roles), and a key changes shape only where a source of another ratio publishes it."""
    state = {k: carry["state"][k] if k in carry["state"] and carry["state"][k].shape == w.shape
             and carry["state"][k].dtype == w.dtype else jnp.zeros(w.shape, w.dtype)
             for k, w in want["state"].items()}
    return {**carry, "state": state}


# ----------------------------------------------------------------------------------------------- the model
def _constrain(shard, x, names):
    return x if shard is None else shard.constrain(x, names)


def _rope_tables(cfg: ModelConfig, positions, dtype, valid=None) -> dict:
    """cos/sin per (RopeSpec, rotated width) the kinds use: GQA in the activation dtype, MLA in fp32. valid: the
    real (unpadded) tokens, or None for all."""
    out = {}
    for spec in plan(cfg).kinds:
        a = spec.attention
        if a.rope is None:
            continue
        dim, dt = (a.mla.rope_dim, F32) if a.kind == "mla" else (cfg.head_dim, dtype)
        if (a.rope, dim) not in out:
            out[(a.rope, dim)] = rope.cos_sin(a.rope, dim, positions, dt, cfg.max_position_embeddings, valid)
    return out


def _engram(cfg: ModelConfig, params, tokens, cache, mode, lengths, begin, dead=None):
    """Hash columns [B, T, engram layers, cols] of this step's tokens at positions begin[b] + t and the updated
    history: a ring of compressed ids, position p in slot p % size (size >= max_ngram - 1; decode and extend
    read the n-1 ids before `begin` from it). dead [B, T]: tokens that take no part in an n-gram (image spans)."""
    e = cfg.engram
    B, T = tokens.shape
    ids = params["engram_map"][tokens]
    if dead is not None:
        ids = jnp.where(dead, engram.DEAD, ids)
    cont = mode in ("decode", "extend")
    ring = cache.extra["engram_history"] if cache is not None else jnp.full((B, e.max_ngram - 1), engram.DEAD)
    S = ring.shape[1]
    hp = begin[:, None] - (e.max_ngram - 1) + jnp.arange(e.max_ngram - 1)
    hist = jnp.where(cont & (hp >= 0), jnp.take_along_axis(ring, hp % S, axis=1), engram.DEAD)
    layout = engram.EngramLayout.from_config(e.layer_ids, e.max_ngram, e.vocab_size, e.n_heads, e.compressed_vocab)
    cols = engram.ngram_hashes(ids, layout, params["engram_map"][e.pad_token], history=hist)
    n = lengths if mode != "decode" and lengths is not None else jnp.full((B,), T)
    last = (begin + n - 1)[:, None]
    p = last - (last - jnp.arange(S)) % S  # the latest position <= last in each slot
    new = jnp.take_along_axis(ids, jnp.clip(p - begin[:, None], 0, T - 1), axis=1)
    old = ring if cont else jnp.full_like(ring, engram.DEAD)
    return cols, jnp.where(p >= begin[:, None], new, old).astype(ring.dtype)


def hidden(params, cfg: ModelConfig, tokens, positions, mode: str, cache=None, lengths=None, unroll=1,
           shard=None, collect: bool = False, start=None, images=None):
    """Embeddings -> every layer -> the final hidden state [B, T, D] before the final norm, the updated cache, and
    (collect) what DeepSeek's MTP heads read: {"mains": the DSpark target layers' stream means [B, T, K*D] or None,
    "stream": the final mHC streams [B, T, n, D]}. mode: full (no cache) | prefill (from position 0, right-padded
    rows of `lengths`) | extend (rows continue after `start` cached positions) | decode (one token per row).
    images (full | prefill of a vision model): the processed images by their HF names (`pixel_values`, ...):
    their embeddings replace the image tokens'; Gemma3's `token_type_ids` make each image's tokens attend to
    each other."""
    pl = plan(cfg)
    x = params["embed"][tokens]
    if cfg.embed_scale is not None:  # rounded to the weight dtype, as HF
        x = x * jnp.asarray(cfg.embed_scale, params["embed"].dtype)
    blocks = cross = image = None
    if images:
        if mode == "decode":
            raise ValueError("images enter a forward, a prefill or an extend, not a decode step")
        images = dict(images)
        if "token_type_ids" in images:
            blocks = vision.image_blocks(images.pop("token_type_ids"))
        if "pixel_values" in images and cfg.vision.kind == "mllama":  # read by the cross-attention layers
            from jaxmodels.layers import mllama_vision

            cross = {"states": mllama_vision.encode(cfg.vision, params["vision"], images["pixel_values"],
                                                    images["aspect_ratio_ids"], images["aspect_ratio_mask"]),
                     "mask": images["cross_attention_mask"].reshape(*tokens.shape, -1)}
        elif "pixel_values" in images:
            features, valid = vision.encode(cfg.vision, params["vision"], images)
            x = vision.splice(x, tokens, cfg.vision.image_token_id, features, valid)
        elif "features" in images:  # encoded already (the server: the rows of this chunk's image tokens)
            x = vision.splice(x, images["image_mask"], None, images["features"], images["valid"])
        if cfg.vision.kind == "deepseek_vit" and ("pixel_values" in images or "features" in images):
            image = images["image_mask"] if "features" in images else tokens == cfg.vision.image_token_id
    x = _constrain(shard, x, ("batch", None, None))
    padded = mode in ("prefill", "extend") and lengths is not None
    real = jnp.arange(tokens.shape[1]) < lengths[:, None] if padded else None  # right-padded rows
    ctx = {"positions": positions, "mode": mode, "lengths": lengths, "start": start, "unroll": unroll, "shard": shard,
           "tokens": tokens, "rope": _rope_tables(cfg, positions, x.dtype, real), "blocks": blocks, "cross": cross,
           "act_block": cfg.quant_block if cfg.numerics == "reference" else None, "image_mask": image}
    carry = {"x": x, "state": {}, "cache": cache}
    if cfg.mhc is not None:
        B, T, D = x.shape
        carry["x"] = jnp.broadcast_to(x[:, :, None, :], (B, T, cfg.mhc.copies, D))
        carry["pre"] = jax.nn.one_hot(jnp.zeros((B, T), jnp.int32), cfg.mhc.copies, dtype=F32)
    if cfg.engram is not None:
        begin = start if mode == "extend" else positions[:, 0] if mode == "decode" else jnp.zeros_like(positions[:, 0])
        ctx["engram"], history = _engram(cfg, params, tokens, cache, mode, lengths, begin, image)
        if cache is not None:
            carry["cache"] = dataclasses.replace(cache, extra={**cache.extra, "engram_history": history})
    targets = cfg.mtp.target_layers if collect and cfg.mtp is not None else ()
    if targets:
        ctx["taps"] = np.array([targets.index(i) if i in targets else -1 for i in range(cfg.num_layers)], np.int32)
        carry["mains"] = jnp.zeros((*tokens.shape, len(targets) * cfg.hidden_size), F32)
    stacks = {k: (params["layers"][str(k)], 0) for k in range(len(pl.kinds))}
    ctx["stacks"] = {k: s for k, (s, _) in stacks.items()}
    carry = _execute(cfg, pl, pl.runs, stacks, carry, ctx, 0, {k: 0 for k in stacks})
    X = carry["x"]
    if cfg.mhc is not None:  # V4.1: collapse with the last FFN pre-mix; V4: a learned collapse
        pre = carry["pre"] if cfg.mhc.delayed else mhc.head_pre(X, params["hc_head"], norm_eps=cfg.norm_eps,
                                                                   hc_eps=cfg.mhc.eps)
        x = mhc.collapse(X, pre)
    else:
        x = X
    aux = {"mains": carry.get("mains"), "stream": X} if collect else None
    return x, carry["cache"], aux


def head(params, cfg: ModelConfig, x, shard=None):
    """Final norm and fp32 logits. For bf16 weights the bf16 x bf16 products are exact in fp32, so the matmul
    accumulates in fp32 without an fp32 copy of the [D, V] head."""
    h = norm(x, params["final_norm"], cfg.norm_eps, cfg.norm)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    if h.dtype == w.dtype and jax.default_backend() == "gpu" and math.prod(h.shape[:-1]) < 8:
        # XLA:GPU runs a one-row bf16 x bf16 -> fp32 product by converting the whole head to fp32 first (for
        # Llama-8B 1.25 of a 6.5 ms decode step, profiled); 8 rows (zero padding) take the bf16 GEMM
        rows = math.prod(h.shape[:-1])
        h8 = jnp.pad(h.reshape(rows, -1), ((0, 8 - rows), (0, 0)))
        logits = attention.einsum_f32("nd,dv->nv", h8, w)[:rows].reshape(*h.shape[:-1], -1)
    elif h.dtype == w.dtype:
        logits = attention.einsum_f32("...d,dv->...v", h, w)
    else:
        logits = jnp.einsum("...d,dv->...v", h.astype(F32), w.astype(F32))
    if cfg.logit_scale is not None:
        logits = logits * cfg.logit_scale
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return _constrain(shard, logits, ("batch", None, "vocab"))


def _compressed(cfg: ModelConfig) -> bool:
    return any(s.attention.kind == "mla" and s.attention.mla.ratio for s in cfg.layers)


def forward(params, cfg: ModelConfig, tokens, positions=None, shard=None, images=None):
    """tokens int32 [B, T] -> float32 logits [B, T, vocab]; no cache. images: see `hidden`."""
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    elif _compressed(cfg):  # compressor groups count from the sequence start
        raise ValueError(f"{cfg.family}'s forward runs from position 0; continue a sequence with prefill/decode_step")
    x, _, _ = hidden(params, cfg, tokens, positions, "full", shard=shard, images=images)
    return head(params, cfg, x, shard)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype, block_size: int = 0, tables=None, shard=None,
               cross_tokens: int = 0, lookahead: int = 0):
    """An empty cache for `batch` sequences of up to `max_len` tokens: contiguous, or paged with `block_size`
    (block tables as jaxmodels.cache.build takes them). cross_tokens: Mllama's image-feature tokens per sequence
    (see plan.cache_specs). lookahead: spare ring slots for `extend` chunks whose last `lookahead` tokens may be
    rejected and overwritten (speculative decoding with that many draft tokens): without them a rejected token
    evicts a position the next chunk still reads. Paged tables are then sized by the enlarged windows
    (`cache.table_groups(..., lookahead)`)."""
    constrain = None if shard is None else functools.partial(_constrain, shard)
    return kv.init(cfg, batch, max_len, dtype, block_size, tables, constrain, cross_tokens, lookahead)


def prefill(params, cfg: ModelConfig, tokens, lengths, cache, shard=None, images=None):
    """Right-padded prompts [B, T] with `lengths` [B] -> (last-token logits [B, vocab], filled cache). images: see
    `hidden`."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, cache, _ = hidden(params, cfg, tokens, positions, "prefill", cache, lengths, shard=shard, images=images)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return head(params, cfg, last, shard)[:, 0], cache


def extend(params, cfg: ModelConfig, tokens, start, lengths, cache, shard=None, images=None):
    """Continue cached sequences by a chunk (chunked prefill; a prompt whose prefix is already cached): row b's
    first lengths[b] tokens of the right-padded chunk [B, T] take positions start[b] .. start[b]+lengths[b]-1 after
    the start[b] positions its cache holds -> (logits of each row's last chunk token [B, vocab], cache). Rows
    with lengths[b] = 0 keep their cache (their logits mean nothing). Every family, DeepSeek included (window
    ring, compressor rings, compressed entries, indexer keys, Engram history). Cache positions at or past
    start[b] are never read: a chunk may be followed by one that starts inside it (its tail rejected) if the
    cache was made with `init_cache(..., lookahead)` >= the rejected tail. images: see `hidden` (an image's
    tokens attend to each other only within one chunk)."""
    if any(s.attention.kind == "cross" for s in cfg.layers):
        raise NotImplementedError(f"{cfg.family}: extend() does not support cross-attention layers")
    start, lengths = jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x, cache, _ = hidden(params, cfg, tokens, positions, "extend", cache, lengths, shard=shard, start=start,
                         images=images)
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    return head(params, cfg, last, shard)[:, 0], cache


def decode_step(params, cfg: ModelConfig, tokens, positions, cache, unroll: int | bool = 1, shard=None):
    """One new token per row: tokens [B], positions [B] -> (logits [B, vocab], cache).

    unroll: `lax.scan`'s unroll of the layer loops (True = fully unrolled: compile time grows with depth). Jit it
    with `compiler_options=COMPILER_OPTIONS` for GPU speed.
    """
    x, cache, _ = hidden(params, cfg, tokens[:, None], positions[:, None], "decode", cache, unroll=unroll,
                         shard=shard)
    return head(params, cfg, x, shard)[:, 0], cache
