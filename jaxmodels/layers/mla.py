"""DeepSeek V4's sparse attention pieces: shared K=V latent, interleaved RoPE on the tail channels,
the compressor (gated pooling of r tokens into one entry), the lightning indexer (top-k over the
compressed entries), candidate blocks (V4.1) and attention over window + chosen entries with a sink.

Selections are kept as boolean masks over the compressed entries rather than index lists: the same
set of entries, and the attention stays dense matmuls (specs/deepseek_v4.md §5).
"""
import jax
import jax.numpy as jnp

F32 = jnp.float32
NEG = -jnp.inf


def rope_tail(x, cos, sin, inverse: bool = False):
    """Rotate the last 2*cos.shape[-1] channels of x as interleaved pairs (2i, 2i+1), in fp32.

    cos/sin [..., rd/2] broadcast against x[..., rd/2]; `inverse` rotates by -angle (undoes it).
    """
    rd = 2 * cos.shape[-1]
    head, tail = x[..., :-rd], x[..., -rd:].astype(F32)
    s = -sin if inverse else sin
    xe, xo = tail[..., 0::2], tail[..., 1::2]
    rot = jnp.stack([xe * cos - xo * s, xo * cos + xe * s], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rot.astype(x.dtype)], axis=-1)


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
    h = c // 2
    prev_kv = jnp.pad(kv[:, :-1, :, :h], ((0, 0), (1, 0), (0, 0), (0, 0)))
    prev_g = jnp.pad(gate[:, :-1, :, :h], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=NEG)
    return jnp.concatenate([prev_kv, kv[..., h:]], axis=2), jnp.concatenate([prev_g, gate[..., h:]], axis=2)


def visible(positions, n: int, r: int):
    """[..., n] bool: compressed entry t is complete (so visible) for a query at `positions` iff t < (pos+1)//r."""
    return jnp.arange(n) < ((positions + 1) // r)[..., None]


def index_scores(q, k, w):
    """sum_h relu(q_h . k_t) * w_h in fp32: q [B, T, HI, dI], k [B, N, dI], w [B, T, HI] -> [B, T, N]."""
    s = jnp.einsum("bthd,bnd->bthn", q.astype(F32), k.astype(F32))
    return jnp.einsum("bthn,bth->btn", jax.nn.relu(s), w.astype(F32))


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


def attend(q, kv_win, allow_win, kv_cmp, allow_cmp, sink, scale: float):
    """Softmax over the window keys, the allowed compressed entries and a per-head sink logit.

    q [B, T, H, d]; kv_win [B, W, d] with allow_win [B, T, W]; kv_cmp [B, N, d] with allow_cmp [B, T, N]
    (or None); sink [H] (unscaled, in the denominator only). K = V. A row with nothing allowed gives 0.
    """
    logits = [jnp.einsum("bthd,bsd->bhts", q, kv_win, preferred_element_type=F32) * scale]  # fp32 logits
    allow = [allow_win]
    values = [kv_win]
    if kv_cmp is not None:
        logits.append(jnp.einsum("bthd,bsd->bhts", q, kv_cmp, preferred_element_type=F32) * scale)
        allow.append(allow_cmp)
        values.append(kv_cmp)
    z = jnp.where(jnp.concatenate(allow, -1)[:, None], jnp.concatenate(logits, -1), NEG)
    sinks = jnp.broadcast_to(sink.astype(F32)[None, :, None, None], (*z.shape[:-1], 1))
    z = jnp.concatenate([z, sinks], axis=-1)
    p = jax.nn.softmax(z, axis=-1)[..., :-1]
    v = jnp.concatenate(values, axis=1)
    return jnp.einsum("bhts,bsd->bthd", p.astype(v.dtype), v)
