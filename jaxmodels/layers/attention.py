"""Grouped-query attention: projections, qk-norm, RoPE, causal / sliding-window masks from absolute positions,
sinks and softcap, over the cache interface."""
import functools

import jax
import jax.numpy as jnp

from jaxmodels.layers import decode_attention, rope
from jaxmodels.layers.norms import norm

F32 = jnp.float32


def einsum_f32(eq: str, a, b):
    """einsum accumulated and returned in fp32. XLA:CPU has no f16 x f16 -> f32 dot: there float16 operands are
    widened first (exact, and only on the CPU)."""
    if jnp.float16 in (a.dtype, b.dtype) and jax.default_backend() == "cpu":
        a, b = a.astype(F32), b.astype(F32)
    return jnp.einsum(eq, a, b, preferred_element_type=F32)


def mask(q_pos, k_pos, window: int | None, k_valid=None, blocks=None, k_blocks=None):
    """Boolean [B, Tq, Tk]: key visible to query iff k <= q (and k > q - W for a window of W keys).

    A window of W means the query itself plus W-1 earlier tokens, as HF's `sliding_window_overlay`. blocks [B, Tq]
    and k_blocks [B, Tk] (default: blocks, queries and keys the same tokens): tokens of one block (>= 0) also see
    each other, later ones included; the window test stays one-sided (Gemma3's image tokens, specs/vision.md §1.5).
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    m = k <= q
    if blocks is not None:
        kb = blocks if k_blocks is None else k_blocks
        m |= (blocks[:, :, None] == kb[:, None, :]) & (blocks[:, :, None] >= 0)
    if window is not None:
        m &= k > q - window
    if k_valid is not None:
        m &= k_valid[:, None, :]
    return m


def attend(q, k, v, allowed, *, scale: float, softcap: float | None = None, sinks=None):
    """q [B, Tq, H, d], k/v [B, K, Tk, d] (heads before positions, the KV-cache layout),
    allowed [B, Tq, Tk] -> [B, Tq, H, d].

    Query head h reads kv head h // (H/K). Scores and softmax in fp32 (HF eager). `sinks` [H]: a
    per-head logit in the softmax denominator that carries no value (GPT-OSS).
    """
    b, tq, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, tq, kv, h // kv, d)
    s = einsum_f32("bqgrd,bgkd->bgrqk", qg, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(F32).min)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sk = jnp.broadcast_to(sinks.astype(F32).reshape(kv, h // kv)[None, :, :, None, None], s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :-1]
    # P·V in the value dtype, as HF's matmul (XLA accumulates in fp32); XLA:CPU also lacks bf16 x bf16 -> f32 here
    o = jnp.einsum("bgrqk,bgkd->bqgrd", p.astype(v.dtype), v)
    return o.reshape(b, tq, h, d).astype(q.dtype)


def _fused(q) -> bool:
    """cuDNN's fused kernel runs this query: on a GPU from Ampere on, for half types, a head width that is a
    multiple of 8 and at most 256 on Hopper or later, 128 on Ampere (cuDNN refuses the rest at trace time;
    `attend` runs those)."""
    if jax.default_backend() != "gpu" or q.dtype not in (jnp.bfloat16, jnp.float16):
        return False
    d = q.shape[-1]
    return d % 8 == 0 and d <= _cudnn_head_dim_limit()


@functools.cache
def _cudnn_head_dim_limit() -> int:
    """0 where cuDNN has no fused kernel: before Ampere, or a GPU that is not CUDA's (ROCm)."""
    device = jax.local_devices(backend="gpu")[0]
    try:
        major, minor = (int(x) for x in device.compute_capability.split("."))
    except (AttributeError, ValueError):  # ROCm names its GPUs "gfx90a", ...
        return 0
    return 256 if (major, minor) >= (9, 0) else 128 if major >= 8 else 0


def _on_mesh(ctx) -> bool:
    """The layer runs sharded over more than one device (a one-device mesh keeps the fused kernels)."""
    shard = ctx.get("shard")
    return shard is not None and shard.mesh.size > 1


def causal(q, k, v, *, scale: float, window: int | None = None, sinks=None):
    """Causal (optionally sliding-window) attention of a whole sequence with itself through
    `jax.nn.dot_product_attention`: cuDNN's fused kernel on GPU for bf16/fp16, XLA elsewhere.
    q [B, T, H, d], k/v [B, K, T, d] -> [B, T, H, d]. Same semantics as `attend` with `mask(pos, pos, window)`.
    sinks [H] (GPT-OSS): on the fused path cuDNN's output rescaled from its log-sum-exp; elsewhere `attend`."""
    if q.dtype == jnp.float16 and jax.default_backend() == "cpu":  # no f16 x f16 -> f32 dot there (einsum_f32)
        f = lambda t: None if t is None else t.astype(F32)  # noqa: E731
        return causal(f(q), f(k), f(v), scale=scale, window=window, sinks=f(sinks)).astype(q.dtype)
    fused = _fused(q)
    if sinks is not None:
        if fused:
            return _fused_sinks(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), sinks, None, scale, window)
        pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        return attend(q, k, v, mask(pos, pos, window), scale=scale, sinks=sinks)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="cudnn" if fused else None)


def masked(q, k, v, allowed, *, scale: float, softcap: float | None = None, sinks=None, sharded: bool = False):
    """`attend` (same arguments, same semantics) through cuDNN's fused kernel on GPU for half types without
    softcap: the fp32 [Tq, Tk] scores never reach HBM, only the mask does (as a [B, 1, Tq, Tk] bias). The engine's
    chunks (`extend`: a chunk over its row's whole cache) and Gemma3's image prefill take it; `attend` elsewhere,
    and on a mesh (sharded), where the chunk's keys (sharded) meet the cache's (laid out by the cache) and no GPU
    test has yet shown the kernel's partitioning right."""
    if softcap is not None or sharded or not _fused(q):
        return attend(q, k, v, allowed, scale=scale, softcap=softcap, sinks=sinks)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if sinks is not None:
        return _fused_sinks(q, k, v, sinks, allowed, scale, None)
    return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], scale=scale, implementation="cudnn")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _fused_sinks(q, k, v, sinks, allowed, scale, window):
    """Attention with sinks from cuDNN, k/v [B, T, K, d]: causal (with the window) when `allowed` is None, else the
    keys `allowed` [B, Tq, Tk] names. A sink adds exp(sink) to the softmax denominator and nothing to the
    numerator, so the output is cuDNN's times sigmoid(lse - sink), exactly. Gradients recompute `attend` (cuDNN's
    backward ignores the log-sum-exp's cotangent)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention  # fp32 [B, H, T] lse

    if allowed is None:
        o, lse = dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL,
                                       sliding_window_length=window, return_residual=True)
    else:
        o, lse = dot_product_attention(q, k, v, mask=allowed[:, None], scale=scale, return_residual=True)
    gate = jax.nn.sigmoid(lse.astype(F32) - sinks.astype(F32)[None, :, None]).transpose(0, 2, 1)
    return (o.astype(F32) * gate[..., None]).astype(q.dtype)


def _sinks_reference(q, k, v, sinks, allowed, scale, window):
    if allowed is None:
        pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
        allowed = mask(pos, pos, window)
    return attend(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed, scale=scale, sinks=sinks)


def _fused_sinks_bwd(scale, window, res, g):
    *diff, allowed = res
    return (*jax.vjp(lambda *a: _sinks_reference(*a, allowed, scale, window), *diff)[1](g), None)


_fused_sinks.defvjp(lambda q, k, v, sinks, allowed, scale, window: (
    _fused_sinks(q, k, v, sinks, allowed, scale, window), (q, k, v, sinks, allowed)), _fused_sinks_bwd)


def unordered(q, k, v, allowed=None, *, scale: float):
    """Attention without causal order (the vision towers): q [B, T, H, d], k/v [B, K, S, d], allowed [B, T, S]
    (None: every key) -> [B, T, H, d]. On GPU for half types cuDNN's fused kernel, whose score matrix never
    reaches HBM (an H200 SigLIP tower ran at 0.4x HF's sdpa with `attend`'s fp32 scores); `attend` elsewhere."""
    if allowed is None:
        if _fused(q):
            return jax.nn.dot_product_attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), scale=scale,
                                                implementation="cudnn")
        allowed = jnp.ones((q.shape[0], q.shape[1], k.shape[2]), bool)
    return masked(q, k, v, allowed, scale=scale)


def decode(q, cache, last, *, window, scale: float, softcap=None, sinks=None, sharded: bool = False):
    """One query token per row, q [B, 1, H, d] at positions last [B], over the slots of the layer's cache "k"
    and "v" (its token written already) -> [B, 1, H, d]. On the GPU the decode kernel, which reads only the slots
    each row holds, in place; elsewhere every slot, masked (the kernel's reference). sharded: on a mesh, where
    XLA would gather the whole cache to every device for the kernel (it has no partitioning rule), the XLA path."""
    k = cache.pages("k")
    if not sharded and decode_attention.fits(q, k):
        return decode_attention.decode(q[:, 0], k, cache.pages("v"), last, window=window, scale=scale,
                                       softcap=softcap, sinks=sinks)[:, None]
    return decode_reference(q, cache, last, window=window, scale=scale, softcap=softcap, sinks=sinks)


def decode_reference(q, cache, last, *, window, scale: float, softcap=None, sinks=None):
    """`decode` in XLA: every slot of the layer's cache read (paged: gathered through the block table), masked."""
    pos = last[:, None]
    k_pos = cache.positions("k", last)
    allowed = mask(pos, k_pos, window, k_valid=k_pos >= 0)
    return attend(q, cache.read("k").astype(q.dtype), cache.read("v").astype(q.dtype), allowed, scale=scale,
                  softcap=softcap, sinks=sinks)


def project(cfg, a, p, h, ctx):
    """h [B, T, D] (normed) -> q [B, T, H, d], k and v [B, T, K, d]: projections, biases, qk-norm, RoPE."""
    q, k, v = (jnp.tensordot(h, p[n], axes=1) for n in ("wq", "wk", "wv"))
    if a.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if a.qk_norm:
        q = norm(q, p["q_norm"], cfg.norm_eps, a.qk_norm)
        k = norm(k, p["k_norm"], cfg.norm_eps, a.qk_norm)
    if a.rope is not None:
        cos, sin = ctx["rope"][(a.rope, cfg.head_dim)]
        cos, sin = cos[:, :, None], sin[:, :, None]
        q, k = rope.apply(q, cos, sin, a.rope.interleaved), rope.apply(k, cos, sin, a.rope.interleaved)
    return q, k, v


def gqa(cfg, a, p, h, ctx, cache):
    """One layer's grouped-query attention: h [B, T, D] (normed) -> [B, T, D].

    ctx: positions [B, T], mode (full | prefill | extend | decode), lengths (prefill, extend), start (extend), rope
    tables. cache: this layer's `jaxmodels.cache.LayerCache` with slot caches "k" and "v" (None in full mode).
    Prefill attends within the chunk and writes it; extend attends the cache and the chunk, then writes it;
    decode writes its token, then attends every slot of the (ring) cache.
    """
    q, k, v = project(cfg, a, p, h, ctx)
    scale = a.scale if a.scale is not None else cfg.head_dim ** -0.5
    pos = ctx["positions"]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, d]: the cache layout
    if ctx["mode"] == "decode":
        cache.write_token("k", k[:, :, 0], pos[:, 0])
        cache.write_token("v", v[:, :, 0], pos[:, 0])
        o = decode(q, cache, pos[:, 0], window=a.window, scale=scale, softcap=a.softcap, sinks=p.get("sinks"),
                   sharded=_on_mesh(ctx))
    elif ctx["mode"] == "extend":  # a chunk after the start[b] positions the cache holds
        start, lengths = ctx["start"], ctx["lengths"]
        # the cache as it was (a ring may drop keys of this chunk's first queries when the chunk is written) + the chunk
        c_pos = cache.positions("k", start - 1)
        keys = jnp.concatenate([cache.read("k").astype(q.dtype), k], axis=2)
        values = jnp.concatenate([cache.read("v").astype(q.dtype), v], axis=2)
        k_pos = jnp.concatenate([c_pos, pos], axis=1)
        k_valid = jnp.concatenate([c_pos >= 0, jnp.arange(pos.shape[1]) < lengths[:, None]], axis=1)
        blocks = ctx.get("blocks")  # an image within this chunk (the cache holds no block of it)
        k_blocks = None if blocks is None else jnp.concatenate([jnp.full(c_pos.shape, -1, jnp.int32), blocks], 1)
        o = masked(q, keys, values, mask(pos, k_pos, a.window, k_valid=k_valid, blocks=blocks, k_blocks=k_blocks),
                   scale=scale, softcap=a.softcap, sinks=p.get("sinks"), sharded=_on_mesh(ctx))
        cache.write("k", k, lengths, start)
        cache.write("v", v, lengths, start)
    else:
        if ctx["mode"] == "prefill":
            cache.write("k", k, ctx["lengths"])
            cache.write("v", v, ctx["lengths"])
        if ctx.get("blocks") is not None:  # Gemma3 images: a token also sees later tokens of its own image
            o = masked(q, k, v, mask(pos, pos, a.window, blocks=ctx["blocks"]), scale=scale, softcap=a.softcap,
                       sinks=p.get("sinks"), sharded=_on_mesh(ctx))
        elif a.softcap is None:  # the whole sequence: the library's fused path
            o = causal(q, k, v, scale=scale, window=a.window, sinks=p.get("sinks"))
        else:
            o = attend(q, k, v, mask(pos, pos, a.window), scale=scale, softcap=a.softcap, sinks=p.get("sinks"))
    out = jnp.einsum("bthd,hdo->bto", o, p["wo"])
    return out + p["bo"] if a.out_bias else out


def cross(cfg, a, p, h, ctx, cache):
    """Mllama's cross-attention: text queries h [B, T, D] (normed) over the image features' keys and values ->
    (out [B, T, D], row [B, T]: whether a token sees any image tile). ctx["cross"] (forward / prefill): the
    features' "states" [B, S, D] and the tile "mask" [B, T, tiles] (HF cross_attention_mask, images x tiles
    flattened); a prefill keeps this layer's K/V and each row's last mask row in the cache, which decode reads.
    A row that sees no tile attends to every key (HF zeroes its mask, not its output; only the MLP is gated by
    `row`)."""
    d = cfg.head_dim
    q = norm(jnp.tensordot(h, p["wq"], axes=1), p["q_norm"], cfg.norm_eps, a.qk_norm)
    if ctx["mode"] == "decode":
        k, v, tiles = cache.get("cross_k"), cache.get("cross_v"), cache.get("cross_mask")[:, None]
    else:
        states, tiles = ctx["cross"]["states"], ctx["cross"]["mask"].astype(F32)
        k = norm(jnp.tensordot(states, p["wk"], axes=1), p["k_norm"], cfg.norm_eps, a.qk_norm).transpose(0, 2, 1, 3)
        v = jnp.tensordot(states, p["wv"], axes=1).transpose(0, 2, 1, 3)
        if cache is not None:
            cache.set("cross_k", k)
            cache.set("cross_v", v)
            last = ctx["lengths"] - 1 if ctx["lengths"] is not None else jnp.full(tiles.shape[:1], tiles.shape[1] - 1)
            cache.set("cross_mask", jnp.take_along_axis(tiles, last[:, None, None], axis=1)[:, 0])
    keys = jnp.repeat(tiles > 0, k.shape[2] // tiles.shape[-1], axis=-1)  # [B, T, S]: each tile's tokens
    row = jnp.any(keys, axis=-1)
    o = attend(q, k.astype(q.dtype), v.astype(q.dtype), keys | ~row[..., None], scale=d ** -0.5)
    return jnp.einsum("bthd,hdo->bto", o, p["wo"]), row
