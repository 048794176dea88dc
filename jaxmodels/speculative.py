"""Speculative decoding with DeepSeek's own draft heads (issue #13 §3): V4.1's DSpark block drafter and V4's
classic MTP layer (applied recursively for k > 1), both cached (jaxmodels/deepseek_mtp.py).

One step for a row whose cache holds positions < L and whose next token t_L is known but not yet processed:
  1. propose: the drafter gives k tokens d_1..d_k for positions L+1..L+k and the logits they were drawn from;
  2. verify: the target extends its cache by [t_L, d_1..d_k] at positions L..L+k (`M.extend` semantics, every
     position's logits);
  3. accept (`accept`): greedy keeps the drafts while they equal the target's argmax, then the target's own
     token; sampling accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)), and at the first rejection draws
     from norm(max(p_i - q_i, 0)); if all k are accepted, a bonus token from p_{k+1}. The emitted tokens are
     distributed exactly as the target's (Leviathan et al. 2023, Chen et al. 2023), whatever the drafter.
  4. the row advances by the a+1 emitted tokens; the drafter's cache follows (`observe`). The target's cache
     keeps the rejected drafts' entries past the new length: the next extend starts there and overwrites them;
     the rings hold k spare slots (`M.init_cache(lookahead=k)`) so that those writes evict nothing still read.

`generate` (the loop, jitted) is what `jaxmodels.generate.generate(..., num_speculative_tokens=k)` runs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxmodels import deepseek_mtp as dm, model as M
from jaxmodels.sampling import Sampling, filter_logits, sample, scale


# ------------------------------------------------------------------------------------------------ target
def prefill(params, cfg, tokens, lengths, cache, shard=None):
    """M.prefill that also returns what the drafters read (model.hidden's collect): (last logits [B, V], cache,
    aux {"mains", "stream"} of every position)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, cache, aux = M.hidden(params, cfg, tokens, positions, "prefill", cache, lengths, shard=shard, collect=True)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return M.head(params, cfg, last, shard)[:, 0], cache, aux


def verify(params, cfg, tokens, start, cache, lengths=None, shard=None):
    """M.extend with every position's logits: tokens [B, T] at positions start[b] + t, the first lengths[b]
    (default all) written -> (logits [B, T, V] fp32, cache, aux {"mains", "stream"})."""
    B, T = tokens.shape
    start = jnp.asarray(start, jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)
    x, cache, aux = M.hidden(params, cfg, tokens, positions, "extend", cache, lengths, shard=shard, start=start,
                             collect=True)
    return M.head(params, cfg, x, shard), cache, aux


def chunk(params, cfg, tokens, start, lengths, cache, shard=None, images=None):
    """M.extend that also returns what the drafters read (a prefill chunk of a speculating engine): (logits of each
    row's last chunk token [B, V], cache, aux {"mains", "stream"} of every position)."""
    start, lengths = jnp.asarray(start, jnp.int32), jnp.asarray(lengths, jnp.int32)
    positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x, cache, aux = M.hidden(params, cfg, tokens, positions, "extend", cache, lengths, shard=shard, start=start,
                             collect=True, images=images)
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    return M.head(params, cfg, last, shard)[:, 0], cache, aux


# ------------------------------------------------------------------------------------------------ drafters
def drafter_cache(cfg, batch: int, max_len: int, dtype, k: int):
    """The drafter's cache: DSpark's per-stage main-KV rings (only accepted positions are written), or the
    classic MTP layer's window ring (k spare slots: a recursive draft writes ahead)."""
    if cfg.mtp.kind == "dspark":
        return dm.dspark_init_cache(cfg, batch, dtype)
    return dm.mtp_init_cache(cfg, batch, max_len, dtype, lookahead=k)


def drafter_state(cfg, batch: int, dtype):
    """What `observe` returns beside the cache, zeros: classic MTP's first-draft logits [B, V] fp32 and output
    stream [B, n, D]; None for DSpark (its drafts read only the rings)."""
    if cfg.mtp.kind == "dspark":
        return None
    return (jnp.zeros((batch, cfg.logits_size), jnp.float32),
            jnp.zeros((batch, cfg.mtp.layer.mhc.copies, cfg.hidden_size), dtype))


def observe(params, cfg, dcache, aux, next_tokens, start, lengths):
    """After the target processed a chunk (positions start[b] .. start[b]+lengths[b]-1, aux from prefill or
    verify; next_tokens [B, T]: the token after each position): the drafter's cache follows. Returns (dcache,
    dstate): classic MTP's logits and output stream at each row's last position (its first draft), else None."""
    if cfg.mtp.kind == "dspark":
        return dm.dspark_extend_cache(params, cfg, dcache, aux["mains"], start, lengths), None
    logits, X, dcache = dm.mtp_extend(params, cfg, dcache, aux["stream"], next_tokens, start, lengths)
    last = jnp.maximum(lengths - 1, 0)
    return dcache, (jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0],
                    jnp.take_along_axis(X, last[:, None, None, None], axis=1)[:, 0])


def propose(params, cfg, dcache, dstate, token, pos, k: int, pick):
    """k drafts after `token` at positions pos [B] (the target's cache holds positions < pos): (ids [B, k],
    their logits [B, k, V] fp32, dcache). pick(i, logits [B, V]) -> ids [B] draws draft i."""
    if cfg.mtp.kind == "dspark":
        if k > cfg.mtp.block_size:
            raise ValueError(f"DSpark drafts at most its block size ({cfg.mtp.block_size}) tokens, asked {k}")
        logits, ids, _ = dm.dspark_draft_cached(params, cfg, dcache, token, pos - 1, pick)
        return ids[:, 1:k + 1], logits[:, :k], dcache
    row, X = dstate  # classic MTP: position t reads (stream at t, token t+1) and predicts token t+2
    ids, rows = [], []
    one = jnp.ones_like(pos)
    for i in range(k):
        if i:  # recursively: its own output stream at the previous position, the previous draft
            logits, Xs, dcache = dm.mtp_extend(params, cfg, dcache, X[:, None], ids[-1][:, None], pos + i - 1, one)
            row, X = logits[:, 0], Xs[:, 0]
        rows.append(row)
        ids.append(pick(i, row))
    return jnp.stack(ids, axis=1), jnp.stack(rows, axis=1), dcache


# ------------------------------------------------------------------------------------------------ accept
def probabilities(logits, s: Sampling):
    """The distribution `sampling.sample` draws from: logits [..., V] -> probabilities [..., V] fp32."""
    shape = logits.shape
    flat = filter_logits(scale(logits.reshape(-1, shape[-1]), s.temperature), s)
    return jax.nn.softmax(flat, axis=-1).reshape(shape)


def accept(target_logits, drafts, draft_logits, key, s: Sampling):
    """The acceptance rule. target_logits [B, k+1, V] (position i predicts the token after chunk token i),
    drafts [B, k], draft_logits [B, k, V] (the logits each draft was drawn from, by the same `s`) -> (tokens
    [B, k+1], count [B]): each row emits its first count = a+1 tokens (a accepted drafts, then the target's
    correction or bonus token)."""
    if s.greedy:
        return accept_greedy(target_logits, drafts)
    return rejection(probabilities(target_logits, s), drafts, probabilities(draft_logits, s), key)


def accept_greedy(target_logits, drafts):
    """Greedy acceptance: the drafts while they equal the target's argmax, then the target's own token."""
    k = drafts.shape[1]
    best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    a = jnp.sum(jnp.cumprod(drafts == best[:, :k], axis=1), axis=1)
    return best, (a + 1).astype(jnp.int32)


def rejection(p, drafts, q, key):
    """The rejection rule on distributions: p [B, k+1, V] the target's, q [B, k, V] the ones the drafts [B, k]
    were drawn from -> (tokens [B, k+1], count [B]) as `accept`. One key draws every row."""
    B, k = drafts.shape
    ku, kr = jax.random.split(key)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = jax.random.uniform(ku, (B, k)) * qd < pd  # u < p/q, i.e. accepted with probability min(1, p/q)
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    # after a accepted: the residual of position a, or (a = k) the bonus from the target's last position
    resid = jnp.concatenate([jnp.maximum(p[:, :k] - q, 0.0), p[:, k:]], axis=1)
    r = jnp.take_along_axis(resid, a[:, None, None], axis=1)[:, 0]
    pa = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    r = jnp.where(jnp.sum(r, axis=-1, keepdims=True) > 0, r, pa)  # p == q there: nothing to correct
    last = jax.random.categorical(kr, jnp.log(r), axis=-1).astype(jnp.int32)
    i = jnp.arange(k + 1)
    tokens = jnp.where(i < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
    return tokens, (a + 1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------ the loop
def stopped(tail, stops):
    """tail [B, L] last generated ids (-2 before the first), stops [S, L] -> [B] bool: a row ends with a stop."""
    hit = (stops[None] == tail[:, None]) | (stops[None] == -1)
    return jnp.any(jnp.all(hit, axis=-1), axis=-1)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "sampling", "max_len", "k", "shard"),
                   compiler_options=M.COMPILER_OPTIONS)
def generate(params, tokens, lengths, key, eos, stops, *, cfg, max_new, sampling, max_len, k, shard=None):
    """Right-padded prompts [B, T] with `lengths` -> (out [B, max_new] (zeros past each row's end), tokens
    emitted by the longest row, stats [4] int32 summed over rows: verify steps, drafts proposed, drafts the rule
    accepted, tokens emitted (fewer than accepted + 1 where EOS, a stop or max_new ends a row inside an accepted
    run)). eos [E], stops [S, L]: as jaxmodels.generate's."""
    B, P = tokens.shape
    dtype = params["embed"].dtype
    rows = jnp.arange(B)
    cache = M.init_cache(cfg, B, max_len, dtype, shard=shard, lookahead=k)
    logits, cache, aux = prefill(params, cfg, tokens, lengths, cache, shard)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    following = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1).at[rows, lengths - 1].set(first)
    dcache, dstate = observe(params, cfg, drafter_cache(cfg, B, max_len, dtype, k), aux, following,
                             jnp.zeros_like(lengths), lengths)
    out = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(first)
    tail = jnp.full((B, stops.shape[1]), -2, jnp.int32).at[:, -1].set(first)
    done = jnp.isin(first, eos) | stopped(tail, stops)

    def cond(state):
        n, done = state[2], state[4]
        return ~jnp.all(done | (n >= max_new))

    def body(state):
        tok, pos, n, tail, done, out, cache, dcache, dstate, key, stats = state
        key, kd, ka = jax.random.split(key, 3)
        pick = ((lambda i, row: jnp.argmax(row, axis=-1).astype(jnp.int32)) if sampling.greedy
                else lambda i, row: sample(row, jax.random.fold_in(kd, i), sampling))
        drafts, dlogits, dcache = propose(params, cfg, dcache, dstate, tok, pos, k, pick)
        active = ~done & (n < max_new)
        chunk = jnp.concatenate([tok[:, None], drafts], axis=1)
        logits, cache, aux = verify(params, cfg, chunk, pos, cache, jnp.where(active, k + 1, 0), shard)
        emitted, count = accept(logits, drafts, dlogits, ka, sampling)
        count = jnp.where(active, count, 0)
        n_before = n
        for i in range(k + 1):  # emit one token at a time: a row ends at its first EOS / stop / max_new
            live = (i < count) & ~done & (n < max_new)
            t = emitted[:, i]
            out = out.at[rows, jnp.where(live, n, max_new)].set(t, mode="drop")
            tail = jnp.where(live[:, None], jnp.concatenate([tail[:, 1:], t[:, None]], axis=1), tail)
            n = n + live
            done = done | (live & (jnp.isin(t, eos) | stopped(tail, stops)))
        stats = stats + jnp.stack([jnp.sum(active), k * jnp.sum(active), jnp.sum(count - active),
                                   jnp.sum(n - n_before)])
        dcache, dstate = observe(params, cfg, dcache, aux, emitted, pos, count)
        tok = jnp.where(count > 0, jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0],
                        tok)
        return tok, pos + count, n, tail, done, out, cache, dcache, dstate, key, stats

    state = (first, lengths, jnp.ones((B,), jnp.int32), tail, done, out, cache, dcache, dstate, key,
             jnp.zeros((4,), jnp.int32))
    state = jax.lax.while_loop(cond, body, state)
    return state[5], jnp.max(state[2]), state[10]
