"""DeepSeek V4's attention (specs/deepseek_v4.md §5, §13) as one pure function over the cache interface.

Low-rank queries, one shared K=V latent head with interleaved RoPE on its last rope_dim channels, a sliding
window, and on compressed layers (ratio r > 0) entries that pool r tokens each: built by the layer's own
compressor (gated pooling; V4 CSA overlaps the previous group), selected by a lightning indexer's top-k (or
all, or the top-k an earlier indexer published), V4.1's candidate blocks restricting later indexers. Output:
attention over window + chosen entries with a per-head sink, inverse RoPE, grouped low-rank wo_a, then wo_b.

What a layer publishes for later ones (the latest compressed entries, indexer keys, top-k, candidate blocks)
lives in `state`, a dict the executor carries across layers. Selections are boolean masks over the entries:
the same set, with dense matmuls. `reference` numerics (ctx["act_block"] set) add the reference's simulated
quantisation: FP8 activations before FP8 linears, FP8 window KV, FP4 compressed KV and indexer q/k.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import qdq, rope
from jaxmodels.layers.attention import einsum_f32
from jaxmodels.layers.norms import norm

F32 = jnp.float32
NEG = -jnp.inf


def rms(cfg, x, w):
    """DeepSeek's RMSNorm: fp32 statistics times the fp32 weight, cast back (every norm of the model)."""
    return norm(x, w, cfg.norm_eps, "rms_fp32")


def linear(ctx, x, w, fp8: bool = True):
    """FP8 linears take the reference's activation QDQ in reference numerics; bf16 ones (weights_proj, wk) do not."""
    return qdq.linear(x, w, ctx["act_block"] if fp8 else None)


# ------------------------------------------------------------------------------------- quantisation (reference)
def kv_qdq(m, ctx, kv):
    """The window KV is stored FP8: V4.1 all channels per 32; V4 the non-RoPE ones per 64."""
    if not ctx["act_block"]:
        return kv
    if m.variant == "v4.1":
        return qdq.act_quant_fp8(kv, 32)
    rd = m.rope_dim
    return jnp.concatenate([qdq.act_quant_fp8(kv[..., :-rd], 64), kv[..., -rd:]], axis=-1)


def _latent_qdq(m, ctx, x):
    """Compressed KV is FP4 with E4M3 scales per 16 (V4.1); V4 keeps it FP8 on the non-RoPE part."""
    if not ctx["act_block"]:
        return x
    return qdq.fp4_act_quant(x, 16, "e4m3") if m.variant == "v4.1" else kv_qdq(m, ctx, x)


def _index_qdq(m, ctx, x):
    """Indexer q/k are FP4 with E8M0 scales per 32 (V4 rotates them by a Hadamard first; being orthogonal and
    applied to both, the rotation changes nothing without the quantisation)."""
    if not ctx["act_block"]:
        return x
    if m.variant == "v4":
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


# --------------------------------------------------------------------------------------------- math pieces
def pool(kv, gate):
    """Gated pooling over the slot axis -2: kv, gate [..., slots, c] -> [..., c]; softmax over slots in fp32."""
    w = jax.nn.softmax(gate.astype(F32), axis=-2)
    return jnp.sum(kv.astype(F32) * w, axis=-2).astype(kv.dtype)


def group_slots(kv, gate, r: int, overlap: bool):
    """Projections [B, T, c] of consecutive tokens -> pooling slots of each complete group of r.

    Returns (kv, gate) [B, N, slots, c'] with N = T // r. Without overlap: slots = the group's r tokens.
    With overlap (V4 CSA, projections 2d wide): entry j pools the previous group's first-half channels and
    its own group's second half (2r slots); group 0's previous half has gate -inf (weight 0).
    """
    B, T, c = kv.shape
    N = T // r
    kv, gate = kv[:, :N * r].reshape(B, N, r, c), gate[:, :N * r].reshape(B, N, r, c)
    if not overlap:
        return kv, gate
    h = c // 2  # each group's previous one: shifted by a group of padding (N may be 0: a chunk shorter than r)
    prev_kv = jnp.pad(kv[..., :h], ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :N]
    prev_g = jnp.pad(gate[..., :h], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=NEG)[:, :N]
    return jnp.concatenate([prev_kv, kv[..., h:]], axis=2), jnp.concatenate([prev_g, gate[..., h:]], axis=2)


def visible(positions, n: int, r: int):
    """[..., n] bool: compressed entry t is complete (so visible) for a query at `positions` iff t < (pos+1)//r."""
    return jnp.arange(n) < ((positions + 1) // r)[..., None]


def index_scores(q, k, w, dtype=F32):
    """sum_h relu(q_h . k_t) * w_h: q [B, T, HI, dI], k [B, N, dI], w [B, T, HI] -> [B, T, N] (fp32).

    dtype bfloat16 rounds where the reference's bf16 einsums do (spec §5.4, §15), so that near-ties pick what
    it picks: q.k (fp32 accumulation) to bf16, w to bf16, their product to bf16, the head sum to bf16."""
    if dtype == F32:
        s = jnp.einsum("bthd,bnd->bthn", q.astype(F32), k.astype(F32))
        return jnp.einsum("bthn,bth->btn", jax.nn.relu(s), w.astype(F32))
    s = jnp.einsum("bthd,bnd->bthn", q.astype(dtype), k.astype(dtype), preferred_element_type=F32).astype(dtype)
    prod = jax.nn.relu(s) * w.astype(dtype)[..., None]
    return jnp.sum(prod.astype(F32), axis=2).astype(dtype).astype(F32)


def top_k_mask(scores, k: int):
    """The k best finite entries per row as a boolean mask over the last axis (-inf picks dropped)."""
    k = min(k, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, k)
    hit = jnp.zeros(scores.shape, bool)
    rows = jnp.indices(idx.shape[:-1])
    return hit.at[(*[r[..., None] for r in rows], idx)].set(vals > NEG)  # indices are distinct per row


def candidate_blocks(scores, vis, n_blocks: int, block: int):
    """V4.1 candidate blocks: per row, the n_blocks blocks of `block` entries with the best max score;
    the block of the newest visible entry is always kept; blocks with no finite score are dropped.
    scores [B, T, N] (invisible entries -inf), vis [B, T, N] -> candidate mask [B, T, N]."""
    B, T, N = scores.shape
    nb = -(-N // block)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, nb * block - N)), constant_values=NEG)
    bscore = jnp.max(padded.reshape(B, T, nb, block), axis=-1)
    count = jnp.sum(vis, axis=-1)
    newest = (count - 1) // block
    bscore = jnp.where((jnp.arange(nb) == newest[..., None]) & (count[..., None] > 0), jnp.inf, bscore)
    keep = top_k_mask(bscore, n_blocks)
    return jnp.repeat(keep, block, axis=-1)[..., :N]


def attend(q, kv_win, allow_win, kv_cmp, allow_cmp, sinks, scale: float):
    """Softmax over the window keys, the allowed compressed entries and a per-head sink logit.

    q [B, T, H, d]; kv_win [B, W, d] with allow_win [B, T, W]; kv_cmp [B, N, d] with allow_cmp [B, T, N]
    (or None); sinks [H] (unscaled, in the denominator only). K = V. A row with nothing allowed gives 0.
    """
    logits = [einsum_f32("bthd,bsd->bhts", q, kv_win) * scale]  # fp32 logits
    allow = [allow_win]
    values = [kv_win]
    if kv_cmp is not None:
        logits.append(einsum_f32("bthd,bsd->bhts", q, kv_cmp) * scale)
        allow.append(allow_cmp)
        values.append(kv_cmp)
    z = jnp.where(jnp.concatenate(allow, -1)[:, None], jnp.concatenate(logits, -1), NEG)
    sk = jnp.broadcast_to(sinks.astype(F32)[None, :, None, None], (*z.shape[:-1], 1))
    p = jax.nn.softmax(jnp.concatenate([z, sk], axis=-1), axis=-1)[..., :-1]
    v = jnp.concatenate(values, axis=1)
    return jnp.einsum("bhts,bsd->bthd", p.astype(v.dtype), v)


# ------------------------------------------------------------------------------------------ projections
def project_q(cfg, m, p, x, ctx, cos, sin):
    """(q [B, T, H, d] RoPE'd, qr [B, T, Dq] the normed low-rank query the indexer reads)."""
    B, T, _ = x.shape
    qr = rms(cfg, linear(ctx, x, p["wq_a"]), p["q_norm"])
    q = linear(ctx, qr, p["wq_b"]).reshape(B, T, cfg.num_heads, cfg.head_dim)
    if m.variant == "v4":  # an unweighted per-head RMS after wq_b
        q = q * jax.lax.rsqrt(jnp.mean(q.astype(F32) ** 2, axis=-1, keepdims=True) + cfg.norm_eps).astype(q.dtype)
    return rope.apply(q, cos[:, :, None], sin[:, :, None], True), qr


def project_kv(cfg, m, p, x, ctx, cos, sin):
    """The window KV a layer writes for inputs x: RoPE'd kv_norm(wkv(x)), FP8-QDQ'd in reference numerics."""
    return kv_qdq(m, ctx, rope.apply(rms(cfg, linear(ctx, x, p["wkv"]), p["kv_norm"]), cos, sin, True))


def output(cfg, m, p, o, ctx, cos, sin, dtype):
    """Inverse RoPE of the attention output [B, T, H, d], grouped low-rank wo_a, then wo_b."""
    B, T = o.shape[:2]
    o = rope.apply(o, cos[:, :, None], sin[:, :, None], True, inverse=True).astype(dtype)
    u = jnp.einsum("btgi,gir->btgr", o.reshape(B, T, m.o_groups, -1), p["wo_a"].astype(o.dtype))
    return linear(ctx, u.reshape(B, T, -1), p["wo_b"])


# ------------------------------------------------------------------------------------------- attention
def attention(cfg, spec, p, x, ctx, cache, state):
    """One layer's attention: x [B, T, D] (normed) -> ([B, T, D], state).

    ctx: positions [B, T], mode (full | prefill | extend | decode), lengths (prefill, extend), start (extend: the
    positions each row's cache holds), rope tables, act_block. cache: this layer's `jaxmodels.cache.LayerCache`
    (None in full mode); state: what earlier layers published.

    Extend attends the cache's window ring and the chunk, builds every compressed entry the chunk completes (the
    group's earlier tokens come from the compressor rings) and writes the chunk. Positions at or past `start` in
    the cache are never read, so a chunk whose tail is later rejected is simply overwritten by the next extend,
    provided the rings hold `lookahead` spare slots (`model.init_cache`): the rejected tokens' writes then only
    evict positions no later query reads. Entries a rejected token completed stay in the cache but are invisible
    until the group is completed again, which rewrites them.
    """
    a, m = spec.attention, spec.attention.mla
    state = dict(state)
    pos, mode, W = ctx["positions"], ctx["mode"], a.window
    cos, sin = ctx["rope"][(a.rope, m.rope_dim)]
    q, qr = project_q(cfg, m, p, x, ctx, cos, sin)
    kv = project_kv(cfg, m, p, x, ctx, cos, sin)
    if mode == "decode":
        p0 = pos[:, 0]
        cache.write_token("kv", kv[:, None, 0], p0)
        kv_win, wpos = cache.read("kv")[:, 0], cache.positions("kv", p0)
        allow_win = ((wpos >= 0) & (wpos > p0[:, None] - W))[:, None, :]
    elif mode == "extend":  # the ring as it was (positions < start) + the chunk
        start, n = ctx["start"], ctx["lengths"]
        c_pos = cache.positions("kv", start - 1)
        kv_win = jnp.concatenate([cache.read("kv")[:, 0].astype(kv.dtype), kv], axis=1)
        kp = jnp.concatenate([c_pos, pos], axis=1)[:, None, :]
        ok = jnp.concatenate([c_pos >= 0, jnp.arange(x.shape[1]) < n[:, None]], axis=1)[:, None, :]
        qp = pos[:, :, None]
        allow_win = ok & (kp <= qp) & (kp > qp - W)
        cache.write("kv", kv[:, None], n, start)
    else:
        if mode == "prefill":
            cache.write("kv", kv[:, None], ctx["lengths"])
        kv_win = kv
        qp, kp = pos[:, :, None], pos[:, None, :]
        allow_win = (kp <= qp) & (kp > qp - W)
    kv_cmp = allow_cmp = None
    if m.ratio:
        if m.compress:
            state["kv"], state["latent"] = _compressed(cfg, m, a.rope, p["compressor"], x, ctx, cache)
        kv_cmp = state["kv"]
        vis = visible(pos, kv_cmp.shape[1], m.ratio)
        if m.select == "all":
            allow_cmp = vis
        elif m.select == "indexer":
            allow_cmp = state["topk"] = _indexer(cfg, m, a.rope, p["indexer"], x, qr, ctx, cache, state, vis)
        else:  # reuse the latest top-k
            allow_cmp = state["topk"]
        state.pop("latent", None)  # read only by this layer's own indexer
    o = attend(q, kv_win, allow_win, kv_cmp, allow_cmp, p["sinks"], cfg.head_dim ** -0.5)
    return output(cfg, m, p, o, ctx, cos, sin, x.dtype), state


# --------------------------------------------------------------------------------------------- compressor
def _project(cp, x, positions, ratio):
    """Compressor projections (kv, gate) [B, T, c] with V4's in-group position bias; fp32 when ratio > 1."""
    xin = x.astype(F32) if ratio > 1 else x
    a = jnp.einsum("...i,io->...o", xin, cp["wkv"].astype(xin.dtype))
    g = jnp.einsum("...i,io->...o", xin, cp["wgate"].astype(xin.dtype)) if "wgate" in cp else jnp.zeros_like(a)
    if "ape" in cp:
        g = g + cp["ape"].astype(g.dtype)[positions % ratio]
    return a, g


def _finish(cfg, cp, pooled, j, ratio, rope_spec, rope_dim, quant):
    """Pooled [B, N, c] -> normed latent (pre-RoPE), and the RoPE'd, quantised entry of position j*r."""
    latent = rms(cfg, pooled, cp["norm"])
    cos, sin = rope.cos_sin(rope_spec, rope_dim, j * ratio, F32)
    return latent, quant(rope.apply(latent, cos, sin, True))


def _compress(cfg, cp, x, ctx, cache, names, ratio, overlap, rope_spec, rope_dim, quant):
    """A compressor over this step's tokens: (latent, entries) [B, N, c] (full / prefill: every complete group
    of the chunk; prefill also keeps each row's partial group), or in decode / extend the entries from index j0
    [B] on with `emitted` = (j0, count [B]): the first count of them are complete (decode: the group ending at
    this token, count 0 or 1). names: the cache's (kv ring, gate ring)."""
    pos, mode = ctx["positions"], ctx["mode"]
    a, g = _project(cp, x, pos, ratio)
    if mode == "extend":
        kv, gate, emitted = _extend_groups(cache, names, a, g, ctx, ratio, overlap)
        pooled = pool(kv, gate).astype(x.dtype)
        j = emitted[0][:, None] + jnp.arange(pooled.shape[1])
        return _finish(cfg, cp, pooled, j, ratio, rope_spec, rope_dim, quant), emitted
    if mode != "decode":
        kv, gate = group_slots(a, g, ratio, overlap)
        pooled = pool(kv, gate).astype(x.dtype)
        j = jnp.broadcast_to(jnp.arange(pooled.shape[1]), pooled.shape[:2])
        if mode == "prefill":
            cache.fill(names[0], a, ctx["lengths"])
            cache.fill(names[1], g, ctx["lengths"])
        return _finish(cfg, cp, pooled, j, ratio, rope_spec, rope_dim, quant), None
    p0 = pos[:, 0]
    bufs = []
    for name, v in zip(names, (a, g)):  # the token's projections into the ring, then the group ending here
        buf = cache.get(name)
        buf = buf.at[jnp.arange(x.shape[0]), p0 % buf.shape[1]].set(v[:, 0].astype(buf.dtype))
        cache.set(name, buf)
        bufs.append(buf)
    size = bufs[0].shape[1]
    take = lambda t, start: jnp.take_along_axis(t, ((start[:, None] + jnp.arange(ratio)) % size)[..., None], 1)  # noqa: E731
    cur_kv, cur_g = take(bufs[0], p0 - ratio + 1), take(bufs[1], p0 - ratio + 1)
    if overlap:
        h = cur_kv.shape[-1] // 2
        prev_kv, prev_g = take(bufs[0], p0 - 2 * ratio + 1), take(bufs[1], p0 - 2 * ratio + 1)
        prev_g = jnp.where((p0 >= ratio)[:, None, None], prev_g, NEG)
        cur_kv = jnp.concatenate([prev_kv[..., :h], cur_kv[..., h:]], axis=1)
        cur_g = jnp.concatenate([prev_g[..., :h], cur_g[..., h:]], axis=1)
    pooled = pool(cur_kv, cur_g).astype(x.dtype)[:, None]
    j = p0 // ratio
    emitted = (j, ((p0 + 1) % ratio == 0).astype(jnp.int32))
    return _finish(cfg, cp, pooled, j[:, None], ratio, rope_spec, rope_dim, quant), emitted


def _extend_groups(cache, names, a, g, ctx, ratio, overlap):
    """Extend: the pooling slots (kv, gate) [B, G, slots, c'] of the groups from j0 = start // r on (the first
    `count` complete by the chunk's end), each group's tokens before `start` read from the rings (which must
    reach back to the previous group's start with overlap); then the chunk's projections into the rings."""
    start, n = ctx["start"], ctx["lengths"]
    B, T, _ = a.shape
    ov = int(overlap)
    j0 = start // ratio
    first = (j0 - ov) * ratio  # the frame starts at a group boundary (overlap: the previous group's)
    p = first[:, None] + jnp.arange(-(-((ov + 1) * ratio + T) // ratio) * ratio)  # [B, F] positions
    cached = (p < start[:, None])[..., None]
    frame = []
    for name, v in zip(names, (a, g)):
        buf = cache.get(name)
        ring = jnp.take_along_axis(buf, (p % buf.shape[1])[..., None], axis=1)
        new = jnp.take_along_axis(v.astype(buf.dtype), jnp.clip(p - start[:, None], 0, T - 1)[..., None], axis=1)
        frame.append(jnp.where(cached, ring, new))
        _ring_write(cache, name, v, start, n)
    gate = jnp.where((p >= 0)[..., None], frame[1], NEG)  # before the sequence start: weight 0
    kv, gate = group_slots(frame[0], gate, ratio, overlap)
    return kv[:, ov:], gate[:, ov:], (j0, (start + n) // ratio - j0)


def _ring_write(cache, name, v, start, n):
    """Positions start .. start+n-1 of v [B, T, c] into the state ring `name` [B, S, c] (slot p % S; where
    the chunk is longer than the ring, each slot keeps its latest position)."""
    buf = cache.get(name)
    S, T = buf.shape[1], v.shape[1]
    last = (start + n - 1)[:, None]
    p = last - (last - jnp.arange(S)) % S  # the latest position <= last in each slot
    new = jnp.take_along_axis(v.astype(buf.dtype), jnp.clip(p - start[:, None], 0, T - 1)[..., None], axis=1)
    cache.set(name, jnp.where((p >= start[:, None])[..., None], new, buf))


def _store(cache, name, entries, ctx, ratio, emitted):
    """Write a compressor's entries into the cache; return what attention reads: this chunk's entries, or in
    decode / extend the whole cache (the complete entries written from index j0 on)."""
    if ctx["mode"] == "prefill":
        cache.write(name, entries[:, None], ctx["lengths"] // ratio)
    if ctx["mode"] not in ("decode", "extend"):
        return entries
    j0, count = emitted
    cache.write(name, entries[:, None], count, j0)
    return cache.read(name)[:, 0]


def _compressed(cfg, m, rope_spec, cp, x, ctx, cache):
    """This layer's compressed entries (what attention reads) and the latent its indexer keys come from."""
    (latent, entry), emitted = _compress(cfg, cp, x, ctx, cache, ("buf_kv", "buf_gate"), m.ratio, m.overlap,
                                         rope_spec, m.rope_dim, lambda e: _latent_qdq(m, ctx, e))
    return _store(cache, "compressed", entry, ctx, m.ratio, emitted), (latent, emitted)


# ------------------------------------------------------------------------------------------------- indexer
def _indexer(cfg, m, rope_spec, ip, x, qr, ctx, cache, state, vis):
    """Top-k mask over the compressed entries for each query (+ candidate blocks on the candidate source)."""
    B, T, _ = x.shape
    HI, dI = m.index_heads, m.index_head_dim
    quant = lambda e: _index_qdq(m, ctx, e)  # noqa: E731
    if m.index_keys == "latent":  # V4.1 kv source: keys from the pre-RoPE latent
        latent, emitted = state["latent"]
        j = (emitted[0][:, None] + jnp.arange(latent.shape[1]) if emitted
             else jnp.broadcast_to(jnp.arange(latent.shape[1]), latent.shape[:2]))
        k = rms(cfg, linear(ctx, latent, ip["wk"], fp8=False), ip["k_norm"])
        cos, sin = rope.cos_sin(rope_spec, m.rope_dim, j * m.ratio, F32)
        state["index_k"] = _store(cache, "index_keys", quant(rope.apply(k, cos, sin, True)), ctx, m.ratio, emitted)
    elif m.index_keys == "compressor":  # V4: its own overlapped compressor at index_head_dim
        (_, k), emitted = _compress(cfg, ip["compressor"], x, ctx, cache, ("ibuf_kv", "ibuf_gate"), m.ratio, True,
                                    rope_spec, m.rope_dim, quant)
        state["index_k"] = _store(cache, "index_keys", k, ctx, m.ratio, emitted)
    cos, sin = ctx["rope"][(rope_spec, m.rope_dim)]
    qi = linear(ctx, qr, ip["wq_b"]).reshape(B, T, HI, dI)
    qi = quant(rope.apply(qi, cos[:, :, None], sin[:, :, None], True))
    w = linear(ctx, x, ip["weights_proj"], fp8=False).astype(F32) * (dI ** -0.5 * HI ** -0.5)
    # reference numerics over bf16 activations score as the reference does: in bf16
    dtype = x.dtype if ctx["act_block"] and x.dtype == jnp.bfloat16 else F32
    scores = jnp.where(vis, index_scores(qi, state["index_k"], w, dtype), NEG)
    if m.candidate_source:
        state["candidates"] = candidate_blocks(scores, vis, m.candidate_blocks, m.candidate_block_size)
    if m.candidate_filter:
        scores = jnp.where(state["candidates"], scores, NEG)
    return top_k_mask(scores, m.index_topk)
