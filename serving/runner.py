"""The model runner: the engine's paged cache, and one jitted step per (kind, bucketed shape).

The cache has `rows` = max_num_seqs + 1 rows of per-sequence state (the last is scratch, for padded rows) and
pools of blocks shared by all rows. A step runs a few of the rows: it gathers their state, runs `M.extend`
(chunked prefill), `M.prefill` (DeepSeek, whole prompts) or `M.decode_step` on them with their block tables,
scatters the state back, and samples each row's next token with its own parameters. Row and token counts are
rounded up to powers of two, so the set of compiled shapes stays small; each new one is logged.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import cache as kv, model as M, sampling
from jaxmodels.layers import vision
from jaxmodels.cache import Cache
from serving.kv_pool import Group
from serving.request import MAX_LOGPROBS

log = logging.getLogger("jaxmodels.serving")
F32 = jnp.float32


def bucket(n: int, minimum: int = 1, cap: int | None = None) -> int:
    b = max(minimum, 1 << max(n - 1, 0).bit_length())
    return min(b, cap) if cap and n <= cap else b


def groups_of(cfg, max_len: int, block_size: int, dtype) -> tuple[list[Group], Cache, list[int], bool]:
    """The table groups, an abstract paged cache (layout, buffer shapes), each buffer's space, and whether the
    model keeps per-sequence state (no prefix caching then)."""
    tables = _no_tables(cfg, 1, max_len, block_size)
    keys = list(tables)
    abstract = jax.eval_shape(lambda: M.init_cache(cfg, 1, max_len, dtype, block_size, tables))
    parent = list(range(len(keys)))  # union-find over groups that share a buffer

    def root(t):
        while parent[t] != t:
            t = parent[t]
        return t

    users: dict = {}
    for refs in abstract.layout.kinds:
        for _, r in refs:
            users.setdefault(r.buffer, set()).add(r.table)
    for ts in users.values():
        ts = sorted(ts)
        for t in ts[1:]:
            parent[root(t)] = root(ts[0])
    roots = sorted({root(t) for t in range(len(keys))})
    space = [roots.index(root(t)) for t in range(len(keys))]
    stateful = any(abstract.state) or bool(abstract.extra)  # any kind's state dict, or model-level state
    groups = []
    for t, key in enumerate(keys):
        window, per = key
        slots = next(r.slots for refs in abstract.layout.kinds for _, r in refs if r.table == t)
        ring = per == 1 and slots < max_len
        cacheable = per == 1 and not stateful and (not ring or slots % block_size == 0)
        groups.append(Group(key, -(-slots // block_size), slots, space[t], ring, cacheable))
    buffer_space = [space[min(users[b])] for b in range(len(abstract.buffers))]
    return groups, abstract, buffer_space, stateful


def _no_tables(cfg, rows: int, max_len: int, block_size: int) -> dict:
    """Every table group's block table, all entries unallocated: a paged cache of 0 blocks."""
    return {k: np.full((rows, nb), -1, np.int32) for k, nb in kv.table_groups(cfg, max_len, block_size).items()}


def block_bytes(abstract: Cache, buffer_space: list[int]) -> list[int]:
    """Bytes one block takes in each space (all its buffers)."""
    out = [0] * (1 + max(buffer_space))
    for buf, s in zip(abstract.buffers, buffer_space):
        out[s] += int(np.prod(buf.shape[:1] + buf.shape[2:])) * buf.dtype.itemsize
    return out


def allocate(cfg, abstract: Cache, buffer_space: list[int], blocks: int, rows: int, max_len: int, dtype,
             block_size: int) -> Cache:
    """The engine's cache: every buffer with `blocks` blocks, per-sequence state for `rows` rows."""
    empty = M.init_cache(cfg, rows, max_len, dtype, block_size, _no_tables(cfg, rows, max_len, block_size))
    buffers = tuple(jnp.zeros((b.shape[0], blocks, *b.shape[2:]), b.dtype) for b in abstract.buffers)
    return Cache(buffers, (), empty.state, empty.extra, empty.layout)


def _rows(cache: Cache, rows, tables) -> Cache:
    state = tuple({n: a[:, rows] for n, a in kind.items()} for kind in cache.state)
    return Cache(cache.buffers, tables, state, {n: a[rows] for n, a in cache.extra.items()}, cache.layout)


def _merge(cache: Cache, sub: Cache, rows) -> Cache:
    state = tuple({n: a.at[:, rows].set(sub.state[k][n]) for n, a in kind.items()} for k, kind in enumerate(cache.state))
    extra = {n: a.at[rows].set(sub.extra[n]) for n, a in cache.extra.items()}
    return Cache(sub.buffers, (), state, extra, cache.layout)


def _filter(x, top_k, top_p, min_p):
    """Per-row top-k / min-p / top-p masks on temperature-scaled logits x [B, V] (0 / 0 / 1: off)."""
    V = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)
    kth = jnp.take_along_axis(desc, (jnp.where(top_k > 0, jnp.minimum(top_k, V), V) - 1)[:, None], axis=1)
    x = jnp.where(x < kth, -jnp.inf, x)
    probs = jax.nn.softmax(x, axis=-1)
    x = jnp.where(probs < min_p[:, None] * probs.max(-1, keepdims=True), -jnp.inf, x)
    desc = -jnp.sort(-x, axis=-1)
    p = jax.nn.softmax(desc, axis=-1)
    keep = jnp.maximum(jnp.sum(jnp.cumsum(p, axis=-1) - p < top_p[:, None], axis=-1), 1)  # mass before < top_p
    cut = x < jnp.take_along_axis(desc, (keep - 1)[:, None], axis=1)
    return jnp.where(cut & (top_p[:, None] < 1), -jnp.inf, x)  # top_p = 1: off (a rounded cumsum would cut a tail)


def _sample(logits, counts, rows, s, *, sampled: bool, filtered: bool, penalized: bool, top_n: int):
    """Next tokens [B] with per-row parameters s (arrays [B]); logprobs of the model's distribution."""
    raw = logits
    if penalized:
        c = counts[rows].astype(F32)
        logits = logits - s["frequency"][:, None] * c - s["presence"][:, None] * (c > 0)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampled:
        hot = s["temperature"] > 0
        x = sampling.scale(logits, jnp.where(hot, s["temperature"], 1.0)[:, None])
        if filtered:  # two sorts of the vocabulary: only when a row asks for top-k / top-p / min-p
            x = _filter(x, s["top_k"], s["top_p"], s["min_p"])
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(s["seed"], s["index"])
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        tok = jnp.where(hot, drawn, tok)
    if penalized:
        counts = counts.at[rows, tok].add(s["emit"].astype(counts.dtype))
    lp = jax.nn.log_softmax(raw.astype(F32), axis=-1)
    chosen = jnp.take_along_axis(lp, tok[:, None], axis=1)[:, 0]
    top = jax.lax.top_k(lp, top_n) if top_n else (jnp.zeros((tok.shape[0], 0), F32), jnp.zeros((tok.shape[0], 0), jnp.int32))
    return tok, chosen, top[1], top[0], counts


@functools.partial(jax.jit, static_argnames=("cfg", "how", "sampled", "filtered", "penalized", "top_n"),
                   donate_argnames=("cache", "counts"), compiler_options=M.COMPILER_OPTIONS)
def step(params, cache, counts, rows, tables, tokens, start, lengths, s, images=None, *, cfg, how, sampled,
         penalized, top_n, filtered=True):
    """Run rows [P] of the cache: tokens [P, T] (right-padded chunks of `lengths`, after `start` cached
    positions; decode: T = 1, start = its position) -> (cache, next token [P], its logprob [P],
    top ids [P, n], top logprobs [P, n], counts). images (extend): the chunks' image-token embeddings, as
    `M.hidden` takes them ("features", "valid", Gemma3's "token_type_ids")."""
    sub = _rows(cache, rows, tables)
    if how == "decode":
        logits, sub = M.decode_step(params, cfg, tokens[:, 0], start, sub)
    elif how == "extend":
        logits, sub = M.extend(params, cfg, tokens, start, lengths, sub, images=images)
    else:  # prefill from position 0 (models without extend)
        logits, sub = M.prefill(params, cfg, tokens, jnp.maximum(lengths, 1), sub)
    cache = _merge(cache, sub, rows)
    return (cache, *_sample(logits, counts, rows, s, sampled=sampled, filtered=filtered, penalized=penalized,
                            top_n=top_n))


@functools.partial(jax.jit, static_argnames=("cfg", "static"), compiler_options=M.COMPILER_OPTIONS)
def encode_images(params, images, *, cfg, static=()):
    """A request's processed images -> (image-token embeddings [M, D], valid [M])."""
    return vision.encode(cfg.vision, params["vision"], {**images, **dict(static)})


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_blocks(cache: Cache, src, dst) -> Cache:
    """Copy-on-write: block src[i] -> dst[i] in buffer i's arrays (src/dst per buffer, [N]; dst out of range: none)."""
    buffers = tuple(b.at[:, d].set(b[:, jnp.clip(s_, 0, b.shape[1] - 1)], mode="drop")
                    for b, s_, d in zip(cache.buffers, src, dst))
    return Cache(buffers, cache.tables, cache.state, cache.extra, cache.layout)


class Runner:
    """Holds the device state (params, cache, penalty counts) and runs scheduled pieces."""

    def __init__(self, model, groups, abstract, buffer_space, blocks: int, max_num_seqs: int, max_len: int,
                 block_size: int):
        self.model, self.cfg, self.groups = model, model.config, groups
        self.rows = max_num_seqs + 1
        self.buffer_space, self.block_size = buffer_space, block_size
        self.cache = allocate(self.cfg, abstract, buffer_space, blocks, self.rows, max_len, model.dtype, block_size)
        self.counts = jnp.zeros((1, 1), jnp.int32)  # [rows, vocab] once a request uses penalties
        self.shapes: set = set()
        self.extend_ok = self.cfg.mhc is None and self.cfg.engram is None and all(
            s.attention.kind == "gqa" for s in self.cfg.layers)

    def copy(self, copies) -> None:
        if not copies:
            return
        n = bucket(len(copies))
        src, dst = [], []
        for s in self.buffer_space:
            mine = [(a, b) for sp, a, b in copies if sp == s]
            src.append(np.array([a for a, _ in mine] + [0] * (n - len(mine)), np.int32))
            dst.append(np.array([b for _, b in mine] + [np.iinfo(np.int32).max] * (n - len(mine)), np.int32))
        self.cache = copy_blocks(self.cache, tuple(src), tuple(dst))

    def reset_counts(self, row: int, tokens: list[int]) -> None:
        """A request with penalties took `row`: its counts are its generated tokens so far."""
        if self.counts.shape[0] != self.rows:
            self.counts = jnp.zeros((self.rows, self.cfg.logits_size), jnp.int32)
        c = np.bincount(np.asarray(tokens, np.int64), minlength=self.cfg.logits_size).astype(np.int32)
        self.counts = self.counts.at[row].set(c)

    def run(self, how: str, pieces) -> list[tuple]:
        """pieces: [(request, start, n)] of one kind -> per piece (token, logprob, top ids, top logprobs)."""
        P = bucket(len(pieces), 8, cap=self.rows - 1)  # at least 8 rows: a decode step costs the same, fewer shapes
        T = 1 if how == "decode" else bucket(max(n for _, _, n in pieces), 16)
        rows = np.full(P, self.rows - 1, np.int32)
        tokens = np.zeros((P, T), np.int32)
        start = np.full(P, -1 if how == "decode" else 0, np.int32)
        lengths = np.zeros(P, np.int32)
        tables = [np.full((P, g.entries), -1, np.int32) for g in self.groups]
        s = {"temperature": np.zeros(P, np.float32), "top_k": np.zeros(P, np.int32), "top_p": np.ones(P, np.float32),
             "min_p": np.zeros(P, np.float32), "seed": np.zeros(P, np.uint32), "index": np.zeros(P, np.int32),
             "presence": np.zeros(P, np.float32), "frequency": np.zeros(P, np.float32), "emit": np.zeros(P, bool)}
        for i, (r, a, n) in enumerate(pieces):
            rows[i], start[i], lengths[i] = r.row, a, n
            tokens[i, :n] = r.tokens[a:a + n]
            for t, e in zip(tables, r.blocks.entries):
                t[i] = e
            p = r.params
            s["temperature"][i], s["top_k"][i], s["top_p"][i], s["min_p"][i] = \
                p.temperature, min(max(p.top_k, 0), self.cfg.logits_size), p.top_p, p.min_p
            s["seed"][i], s["index"][i] = r.seed, r.generated
            s["presence"][i], s["frequency"][i] = p.presence_penalty, p.frequency_penalty
            s["emit"][i] = a + n == len(r.tokens)
        sampled = any(not r.params.greedy for r, _, _ in pieces)
        filtered = any(not r.params.greedy and (r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0)
                       for r, _, _ in pieces)
        penalized = any(r.params.penalized for r, _, _ in pieces)
        want = max((r.params.logprobs or 0 for r, _, _ in pieces), default=0)
        top_n = 0 if want == 0 else MAX_LOGPROBS if want > 5 else 5
        images = self._images(pieces, P, T) if how == "extend" else None
        key = (how, P, T, sampled, filtered, penalized, top_n, None if images is None else len(images["valid"]))
        if key not in self.shapes:
            self.shapes.add(key)
            log.info("compiling step %s: %d rows x %d tokens (sampled=%s, penalties=%s, top_logprobs=%d); "
                     "%d shapes so far", how, P, T, sampled, penalized, top_n, len(self.shapes))
        if penalized and self.counts.shape[0] != self.rows:
            self.counts = jnp.zeros((self.rows, self.cfg.logits_size), jnp.int32)
        out = step(self.model.params, self.cache, self.counts, rows, tuple(tables), tokens, start, lengths, s,
                   images, cfg=self.cfg, how=how, sampled=sampled, filtered=filtered, penalized=penalized,
                   top_n=top_n)
        self.cache, tok, chosen, top_ids, top_lp, self.counts = out
        tok, chosen, top_ids, top_lp = map(np.asarray, (tok, chosen, top_ids, top_lp))
        return [(int(tok[i]), float(chosen[i]), top_ids[i], top_lp[i]) for i in range(len(pieces))]

    def _images(self, pieces, P: int, T: int) -> dict | None:
        """The image-token embeddings of the chunks' image tokens, piece by piece (rows bucketed, padding
        invalid), and Gemma3's token types; None when no chunk holds an image token."""
        v = self.cfg.vision
        if v is None or not any(r.features is not None for r, _, _ in pieces):
            return None
        rows, types = [], np.zeros((P, T), np.int32)
        for i, (r, a, n) in enumerate(pieces):
            if r.features is None:
                continue
            # the prompt's image tokens (a generated token of the same id is text)
            is_img = (np.asarray(r.tokens[a:a + n]) == v.image_token_id) & (np.arange(a, a + n) < len(r.prompt))
            before = sum(t == v.image_token_id for t in r.prompt[:a])
            if is_img.any():
                rows.append(r.features[before:before + int(is_img.sum())])
            types[i, :n] = is_img
        if not rows:
            return None
        feats = jnp.concatenate(rows)
        M_ = bucket(feats.shape[0], 16)
        out = {"features": jnp.pad(feats, ((0, M_ - feats.shape[0]), (0, 0))),
               "valid": np.arange(M_) < feats.shape[0], "image_mask": types.astype(bool)}
        if v.kind == "siglip":
            out["token_type_ids"] = types
        return out
