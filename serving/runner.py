"""The model runner: the engine's paged cache, and one jitted step per (kind, bucketed shape).

The cache has `rows` = max_num_seqs + 1 rows of per-sequence state (the last is scratch, for padded rows) and
pools of blocks shared by all rows. A step runs a few of the rows: it gathers their state, runs `M.extend`
(chunked prefill), `M.prefill` (models without extend, whole prompts) or `M.decode_step` on them with their block
tables, scatters the state back, and samples each row's next token with its own parameters. Row and token counts
are rounded up to powers of two, so the set of compiled shapes stays small; each new one is logged.

Speculative decoding (k draft tokens, DeepSeek's own draft heads): the runner also keeps the drafter's cache, one
contiguous row per engine row; prefill chunks update it (`step` with `draft`), and `verify_step` replaces a
decode step: propose k tokens, verify them in one target pass over k + 1 positions, keep an accepted run.
"""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxmodels import cache as kv, model as M, sampling, sharding, speculative as S
from jaxmodels.layers import vision
from jaxmodels.cache import Cache
from serving.kv_pool import Group
from serving.request import MAX_LOGPROBS

log = logging.getLogger("jaxmodels.serving")
F32 = jnp.float32


def bucket(n: int, minimum: int = 1, cap: int | None = None) -> int:
    b = max(minimum, 1 << max(n - 1, 0).bit_length())
    return min(b, cap) if cap and n <= cap else b


def groups_of(cfg, max_len: int, block_size: int, dtype, cross_tokens: int = 0, lookahead: int = 0
              ) -> tuple[list[Group], Cache, list[int], bool]:
    """The table groups, an abstract paged cache (layout, buffer shapes, per-row state), each buffer's space, and
    whether the model keeps per-sequence state (no prefix caching then). cross_tokens: Mllama's image-feature
    tokens per row, lookahead: spare ring slots for rejected drafts (`M.init_cache`)."""
    tables = _no_tables(cfg, 1, max_len, block_size, lookahead)
    keys = list(tables)
    abstract = jax.eval_shape(lambda: M.init_cache(cfg, 1, max_len, dtype, block_size, tables,
                                                   cross_tokens=cross_tokens, lookahead=lookahead))
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


def _no_tables(cfg, rows: int, max_len: int, block_size: int, lookahead: int = 0) -> dict:
    """Every table group's block table, all entries unallocated: a paged cache of 0 blocks."""
    return {k: np.full((rows, nb), -1, np.int32)
            for k, nb in kv.table_groups(cfg, max_len, block_size, lookahead).items()}


def block_bytes(abstract: Cache, buffer_space: list[int]) -> list[int]:
    """Bytes one block takes in each space (all its buffers)."""
    out = [0] * (1 + max(buffer_space))
    for buf, s in zip(abstract.buffers, buffer_space):
        out[s] += int(np.prod(buf.shape[:1] + buf.shape[2:])) * buf.dtype.itemsize
    return out


def allocate(cfg, abstract: Cache, buffer_space: list[int], blocks: int, rows: int, max_len: int, dtype,
             block_size: int, shard: sharding.Sharding | None = None, cross_tokens: int = 0,
             lookahead: int = 0) -> Cache:
    """The engine's cache: every buffer with `blocks` blocks, per-sequence state for `rows` rows. shard: the pools
    placed by the rules (kv heads over the tensor axis, where it divides them), the per-row state replicated."""
    empty = M.init_cache(cfg, rows, max_len, dtype, block_size, _no_tables(cfg, rows, max_len, block_size, lookahead),
                         cross_tokens=cross_tokens, lookahead=lookahead)
    shapes = [((b.shape[0], blocks, *b.shape[2:]), b.dtype) for b in abstract.buffers]
    if shard is None:
        return Cache(tuple(jnp.zeros(*s) for s in shapes), (), empty.state, empty.extra, empty.layout)
    mesh, rules = shard.mesh, dict(shard.rules)
    buffers = tuple(jnp.zeros(shape, dt, device=NamedSharding(mesh, _trimmed(sharding.spec_for(BUFFER_AXES, shape,
                                                                                               mesh, rules))))
                    for shape, dt in shapes)
    state, extra = jax.device_put((empty.state, empty.extra), NamedSharding(mesh, PartitionSpec()))
    return Cache(buffers, (), state, extra, empty.layout)


def _trimmed(spec: PartitionSpec) -> PartitionSpec:
    """The spec without its trailing Nones: as jit writes the sharding of the buffers `step` returns. JAX tells
    P(None, 'tensor', None) from P(None, 'tensor'), so an untrimmed buffer would miss every program compiled for
    the buffers of the step before (a warm-up's included) and compile each shape again."""
    parts = list(spec)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def draft_state(cfg, rows: int, max_len: int, dtype, k: int, shard: sharding.Sharding | None = None):
    """The drafter's cache and state for every row (contiguous: a few window rings a row), replicated over the
    mesh: (cache, state) as `speculative.observe` returns them."""
    draft = (S.drafter_cache(cfg, rows, max_len, dtype, k), S.drafter_state(cfg, rows, dtype))
    return draft if shard is None else jax.device_put(draft, NamedSharding(shard.mesh, PartitionSpec()))


def _rows(cache: Cache, rows, tables=()) -> Cache:
    """The rows' view of the cache: their state (and buffers, when contiguous), with their block tables."""
    buffers = cache.buffers if cache.layout.paged else tuple(b[:, rows] for b in cache.buffers)
    state = tuple({n: a[:, rows] for n, a in kind.items()} for kind in cache.state)
    return Cache(buffers, tables, state, {n: a[rows] for n, a in cache.extra.items()}, cache.layout)


CROSS = ("cross_k", "cross_v", "cross_mask")  # Mllama's kept image K/V and tile mask: written by prefill only


def _merge(cache: Cache, sub: Cache, rows, keep=()) -> Cache:
    """The rows' state back into the cache; the state named in `keep` is left as it was (unchanged by the step)."""
    buffers = sub.buffers if cache.layout.paged else tuple(b.at[:, rows].set(s_) for b, s_ in
                                                            zip(cache.buffers, sub.buffers))
    state = tuple({n: a if n in keep else a.at[:, rows].set(sub.state[k][n]) for n, a in kind.items()}
                  for k, kind in enumerate(cache.state))
    extra = {n: a.at[rows].set(sub.extra[n]) for n, a in cache.extra.items()}
    return Cache(buffers, (), state, extra, cache.layout)


def _draft_rows(draft, rows):
    cache, state = draft
    return _rows(cache, rows), jax.tree.map(lambda a: a[rows], state)


def _draft_merge(draft, sub, rows):
    (cache, state), (sub_cache, sub_state) = draft, sub
    return _merge(cache, sub_cache, rows), jax.tree.map(lambda a, b: a.at[rows].set(b), state, sub_state)


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


def _distribution(logits, s, filtered: bool):
    """What a sampled row draws from: logits [B, V] or [B, K, V] scaled by each row's temperature, and with
    `filtered` cut by its top-k / min-p / top-p (two sorts of the vocabulary: only when a row asks for them)."""
    hot = s["temperature"] > 0
    t = jnp.where(hot, s["temperature"], 1.0)
    x = sampling.scale(logits, t.reshape(-1, *(1,) * (logits.ndim - 1)))
    if not filtered:
        return x
    cut = lambda x: _filter(x, s["top_k"], s["top_p"], s["min_p"])  # noqa: E731
    return cut(x) if x.ndim == 2 else jax.vmap(cut, in_axes=1, out_axes=1)(x)


def _keys(s):
    """Each row's key for its next sample: its seed, folded with the samples it has drawn."""
    return jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(s["seed"], s["index"])


def _logprobs(raw, tok, top_n: int) -> tuple:
    """The model's log-probabilities (raw logits [..., V]) of the tokens tok [...], and the top_n best [..., n]."""
    lp = jax.nn.log_softmax(raw.astype(F32), axis=-1)
    chosen = jnp.take_along_axis(lp, tok[..., None], axis=-1)[..., 0]
    if not top_n:
        return chosen, jnp.zeros((*tok.shape, 0), jnp.int32), jnp.zeros((*tok.shape, 0), F32)
    top_lp, top_ids = jax.lax.top_k(lp, top_n)
    return chosen, top_ids, top_lp


def _sample(logits, counts, rows, s, *, sampled: bool, filtered: bool, penalized: bool, top_n: int,
            logprobs: bool = True):
    """Next tokens [B] with per-row parameters s (arrays [B]); logprobs of the model's distribution (None
    without `logprobs`)."""
    raw = logits
    if penalized:
        c = counts[rows].astype(F32)
        logits = logits - s["frequency"][:, None] * c - s["presence"][:, None] * (c > 0)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sampled:
        drawn = jax.vmap(jax.random.categorical)(_keys(s), _distribution(logits, s, filtered)).astype(jnp.int32)
        tok = jnp.where(s["temperature"] > 0, drawn, tok)
    if penalized:
        counts = counts.at[rows, tok].add(s["emit"].astype(counts.dtype))
    if not logprobs:
        return tok, None, None, None, counts
    return (tok, *_logprobs(raw, tok, top_n), counts)


# the rows of the packed per-step inputs (one host-to-device transfer each)
I_ROW, I_START, I_LEN, I_TOP_K, I_SEED, I_INDEX, I_EMIT, I_FEED, I_NEXT = range(9)  # int32 [9, P]
F_TEMP, F_TOP_P, F_MIN_P, F_PRESENCE, F_FREQUENCY = range(5)  # float32 [5, P]
BUFFER_AXES = ("layers", None, "kv_heads", None, "head_dim")  # a paged pool [L, blocks, H, block_size, w]


def _row_params(ints, floats) -> dict:
    """The rows' sampling parameters from the packed inputs."""
    return {"temperature": floats[F_TEMP], "top_k": ints[I_TOP_K], "top_p": floats[F_TOP_P],
            "min_p": floats[F_MIN_P], "seed": jax.lax.bitcast_convert_type(ints[I_SEED], jnp.uint32),
            "index": ints[I_INDEX], "presence": floats[F_PRESENCE], "frequency": floats[F_FREQUENCY],
            "emit": ints[I_EMIT] > 0}


def _pools_placed(cache: Cache, shard) -> Cache:
    """The pools keep the sharding they were allocated with (and their donation)."""
    if shard is None:
        return cache
    return Cache(tuple(shard.constrain(b, BUFFER_AXES) for b in cache.buffers), cache.tables, cache.state,
                 cache.extra, cache.layout)


@functools.partial(jax.jit, static_argnames=("cfg", "how", "sampled", "filtered", "penalized", "top_n", "logprobs",
                                             "splits", "shard"),
                   donate_argnames=("cache", "draft", "counts", "last"), compiler_options=M.COMPILER_OPTIONS)
def step(params, cache, draft, counts, last, ints, floats, tables, tokens, images=None, *, cfg, how, sampled,
         filtered, penalized, top_n, logprobs, splits, shard=None):
    """Run rows [P] of the cache and sample each row's next token.

    ints [9, P] / floats [5, P]: the per-row inputs packed (rows I_ROW, ... / F_TEMP, ...): cache row, start
    (cached positions before the chunk; decode: the token's position, -1 for padding), chunk length, top-k, seed
    (uint32 bits), sample index, emit (the chunk ends the known sequence: its token counts for penalties and becomes
    the row's `last`), feed (decode: the input token is `last[row]`, the token the previous step sampled, which the
    host has not read), next (a chunk that does not end the known sequence: the token after it). tables [P, entries
    of every group] split at `splits`. tokens [P, T] (right-padded chunks). images (extend, prefill): the chunks'
    image-token embeddings as `M.hidden` takes them (Mllama: the rows' processed images, each row with images).
    draft (extend of a speculating engine, else None): the drafter's (cache, state) of every row, which follows
    the chunks (`speculative.observe`).
    -> (cache, draft, counts, last, (next token [P], and with `logprobs` its logprob [P], top ids [P, n], top
    logprobs))."""
    rows = ints[I_ROW]
    s = _row_params(ints, floats)
    start, lengths = ints[I_START], ints[I_LEN]
    sub = _rows(cache, rows, tuple(tables[:, a:b] for a, b in zip(splits[:-1], splits[1:])))
    aux = None
    if how == "decode":
        tok_in = jnp.where(ints[I_FEED] > 0, last[rows], tokens[:, 0])
        logits, sub = M.decode_step(params, cfg, tok_in, start, sub, shard=shard)
    elif how == "extend" and draft is not None:
        logits, sub, aux = S.chunk(params, cfg, tokens, start, lengths, sub, shard=shard, images=images)
    elif how == "extend":
        logits, sub = M.extend(params, cfg, tokens, start, lengths, sub, shard=shard, images=images)
    else:  # prefill from position 0 (models without extend)
        logits, sub = M.prefill(params, cfg, tokens, jnp.maximum(lengths, 1), sub, shard=shard, images=images)
    cache = _pools_placed(_merge(cache, sub, rows, CROSS if how == "decode" else ()), shard)
    tok, chosen, top_ids, top_lp, counts = _sample(logits, counts, rows, s, sampled=sampled, filtered=filtered,
                                                   penalized=penalized, top_n=top_n, logprobs=logprobs)
    if aux is not None:  # the drafter reads each position with the token after it: the chunk's next, or `tok`
        after = jnp.where(s["emit"], tok, ints[I_NEXT])
        following = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1))).at[jnp.arange(tokens.shape[0]),
                                                                jnp.maximum(lengths - 1, 0)].set(after)
        draft = _draft_merge(draft, S.observe(params, cfg, _draft_rows(draft, rows)[0], aux, following, start,
                                              lengths), rows)
    last = last.at[rows].set(jnp.where(s["emit"], tok, last[rows]))
    return cache, draft, counts, last, ((tok, chosen, top_ids, top_lp) if logprobs else (tok,))


def draw_draft(i: int, logits, s, keys, *, sampled: bool, filtered: bool):
    """Draft i of each row from its logits [P, V]: the argmax for greedy rows, else drawn from the row's own
    sampling distribution (`_distribution`) with key i of the row's step (`keys` [P]: the step's key per row)."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return best
    sub = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
    drawn = jax.vmap(jax.random.categorical)(sub, _distribution(logits, s, filtered)).astype(jnp.int32)
    return jnp.where(s["temperature"] > 0, drawn, best)


def accept_rows(target, drafts, draft_logits, s, keys, *, sampled: bool, filtered: bool):
    """The acceptance rule per row: target logits [P, k+1, V], drafts [P, k] drawn by `draw_draft` from
    draft_logits [P, k, V] -> (tokens [P, k+1], count [P]). Greedy rows keep drafts while they are the target's
    argmax; sampled rows take the rejection rule on their own distributions with key k of their step (keys [P])."""
    emitted, count = S.accept_greedy(target, drafts)
    if not sampled:
        return emitted, count
    k = drafts.shape[1]
    p = jax.nn.softmax(_distribution(target, s, filtered), axis=-1)
    q = jax.nn.softmax(_distribution(draft_logits, s, filtered), axis=-1)
    one = lambda p, d, q, key: S.rejection(p[None], d[None], q[None], key)  # noqa: E731
    drawn, n = jax.vmap(one)(p, drafts, q, jax.vmap(jax.random.fold_in, (0, None))(keys, k))
    hot = s["temperature"] > 0
    return jnp.where(hot[:, None], drawn[:, 0], emitted), jnp.where(hot, n[:, 0], count)


@functools.partial(jax.jit, static_argnames=("cfg", "k", "sampled", "filtered", "top_n", "logprobs", "splits",
                                             "shard"),
                   donate_argnames=("cache", "draft", "last"), compiler_options=M.COMPILER_OPTIONS)
def verify_step(params, cache, draft, last, ints, floats, tables, tokens, *, cfg, k, sampled, filtered, top_n,
                logprobs, splits, shard=None):
    """A speculative decode step of rows [P] (`jaxmodels.speculative`): the drafter proposes k tokens after each
    row's last token (drawn from the row's own sampling distribution), one target pass over the k + 1 positions
    verifies them, and the rejection rule (greedy rows: the target's argmax) keeps a run of a drafts and adds the
    target's own next token; the drafter's cache follows the a + 1 positions kept. Penalties are not applied (a
    request with penalties decodes plainly).

    ints / floats / tables / tokens [P, 1] as `step`'s for decode, except I_LEN: the positions a row may write
    (k + 1, fewer near the end of its cache; 0 for padding rows, which write nothing).
    -> (cache, draft, last, (tokens [P, k+1], count [P]: a row emits its first count tokens, and with `logprobs`
    each token's logprob [P, k+1], top ids [P, k+1, n], top logprobs))."""
    rows = ints[I_ROW]
    s = _row_params(ints, floats)
    pos, width = ints[I_START], ints[I_LEN]
    sub = _rows(cache, rows, tuple(tables[:, a:b] for a, b in zip(splits[:-1], splits[1:])))
    dcache, dstate = _draft_rows(draft, rows)
    tok = jnp.where(ints[I_FEED] > 0, last[rows], tokens[:, 0])
    keys, flags = _keys(s), dict(sampled=sampled, filtered=filtered)
    pick = lambda i, row: draw_draft(i, row, s, keys, **flags)  # noqa: E731
    drafts, dlogits, dcache = S.propose(params, cfg, dcache, dstate, tok, pos, k, pick)
    logits, sub, aux = S.verify(params, cfg, jnp.concatenate([tok[:, None], drafts], axis=1), pos, sub, width, shard)
    emitted, count = accept_rows(logits, drafts, dlogits, s, keys, **flags)
    count = jnp.minimum(count, width)
    draft = _draft_merge(draft, S.observe(params, cfg, dcache, aux, emitted, pos, count), rows)
    cache = _pools_placed(_merge(cache, sub, rows, CROSS), shard)
    newest = jnp.take_along_axis(emitted, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
    last = last.at[rows].set(jnp.where(count > 0, newest, last[rows]))
    return cache, draft, last, ((emitted, count, *_logprobs(logits, emitted, top_n)) if logprobs else (emitted, count))


@functools.partial(jax.jit, static_argnames=("cfg", "static"), compiler_options=M.COMPILER_OPTIONS)
def encode_images(params, images, *, cfg, static=()):
    """A request's processed images -> (image-token embeddings [M, D], valid [M])."""
    return vision.encode(cfg.vision, params["vision"], {**images, **dict(static)})


@functools.partial(jax.jit, donate_argnames=("cache",))
def clear_cross(cache: Cache, row) -> Cache:
    """Zero a row's Mllama cross-attention K/V: a request without images decodes through them as through no
    image (a row that sees no tile attends to every key, and zero values give zero)."""
    state = tuple({n: a.at[:, row].set(0) if n in CROSS else a for n, a in kind.items()} for kind in cache.state)
    return Cache(cache.buffers, cache.tables, state, cache.extra, cache.layout)


@functools.partial(jax.jit, static_argnames=("shard",), donate_argnames=("cache",))
def copy_blocks(cache: Cache, src, dst, shard=None) -> Cache:
    """Copy-on-write: block src[i] -> dst[i] in buffer i's arrays (src/dst per buffer, [N]; dst out of range: none)."""
    buffers = tuple(b.at[:, d].set(b[:, jnp.clip(s_, 0, b.shape[1] - 1)], mode="drop")
                    for b, s_, d in zip(cache.buffers, src, dst))
    if shard is not None:
        buffers = tuple(shard.constrain(b, BUFFER_AXES) for b in buffers)
    return Cache(buffers, cache.tables, cache.state, cache.extra, cache.layout)


def extends(model, abstract: Cache) -> bool:
    """Whether `M.extend` runs this model (chunked prefill, prefix caching; without it whole prompts prefill from
    position 0), found by tracing it once on the abstract cache: a family gains chunks as soon as the model
    supports it."""
    def one(params, cache):
        one_row = jnp.ones(1, jnp.int32)
        return M.extend(params, model.config, jnp.zeros((1, 1), jnp.int32), one_row, one_row, cache)

    one_block = tuple(jax.ShapeDtypeStruct((b.shape[0], 1, *b.shape[2:]), b.dtype) for b in abstract.buffers)
    try:
        with sharding.entered(model.sharding):
            jax.eval_shape(one, model.params, Cache(one_block, abstract.tables, abstract.state, abstract.extra,
                                                    abstract.layout))
    except NotImplementedError:
        return False
    return True


LAUNCH_TOKENS = 128  # a chunk launch's fixed cost in prefill tokens: it reads the weights once more (Llama-8B on
# an H200: 16 GB at 4.8 TB/s, 3.3 ms, ~128 tokens at its ~37k tok/s prefill)


def chunk_width(n: int) -> int:
    """The padded token count of a chunk launch whose longest chunk holds n tokens (few shapes to compile)."""
    return bucket(n, 16)


def launch_cost(pieces, cap: int | None = None) -> int:
    """What one chunk launch of these pieces costs, in tokens: its rows (a power of two, at most cap) x the width
    of its longest chunk, plus `LAUNCH_TOKENS`."""
    return bucket(len(pieces), 1, cap) * chunk_width(max(k for _, _, k in pieces)) + LAUNCH_TOKENS


def row_groups(pieces, cap: int | None = None, max_tokens: int | None = None) -> list[list]:
    """Chunk pieces [(request, start, n)] as launches of the least total `launch_cost`: padded rows and tokens
    against launches. Chunks of 1900, 100 and 48 tokens run as [1900] + [100, 48] (1 x 2048 + 2 x 128 tokens in two
    launches), not as one launch of 4 x 2048 rows x tokens; 18 alike chunks as 16 + 2 rows, not 32. A launch holds
    at most `cap` rows and, when it has more than one, at most `max_tokens` padded tokens (rows x width): that
    bounds the shapes a step compiles to `launch_shapes`.

    Longest first, a launch takes the next pieces in that order (its width is its first piece's, so a cheaper
    split of the same pieces is never interleaved), and for a row bucket B the most pieces it holds (the rest only
    gets cheaper): a dynamic program over where each launch ends, O(n^2 log n) (the cost of a launch reads its
    pieces)."""
    pieces = sorted(pieces, key=lambda p: -p[2])
    n = len(pieces)
    best = [(0, n)] * (n + 1)  # best[j]: the least cost of pieces j.., and where its first launch ends
    for j in range(n - 1, -1, -1):
        sizes = {1 << b for b in range((n - j).bit_length() + 1)}
        ends = {j + min(size, cap or size, n - j) for size in sizes}  # a launch holds at most cap rows
        if max_tokens:
            ends = {e for e in ends if e == j + 1 or bucket(e - j, 1, cap) * chunk_width(pieces[j][2]) <= max_tokens}
        cost, end = min((launch_cost(pieces[j:e], cap) + best[e][0], -e) for e in ends)  # ties: fewer launches
        best[j] = (cost, -end)
    groups, j = [], 0
    while j < n:
        groups.append(pieces[j:best[j][1]])
        j = best[j][1]
    return groups


def launch_shapes(max_rows: int, max_chunk: int, max_tokens: int) -> dict[str, list[tuple[int, int]]]:
    """Every (rows, tokens) shape `Runner.run` may launch: decode steps of up to max_rows rows, and chunk launches
    whose chunks hold up to max_chunk tokens, at most max_tokens padded tokens when they have several rows (as
    `row_groups(cap=max_rows, max_tokens=...)` builds them)."""
    decode = sorted({bucket(n, 8, max_rows) for n in range(1, max_rows + 1)})
    rows = sorted({bucket(n, 1, max_rows) for n in range(1, max_rows + 1)})
    widths = sorted({chunk_width(n) for n in range(1, max_chunk + 1)})
    return {"decode": [(P, 1) for P in decode],
            "chunk": [(P, T) for P in rows for T in widths if P == 1 or P * T <= max_tokens]}


WARM_SAMPLING = {"greedy": (False, False), "sampled": (True, False), "filtered": (True, True)}  # (sampled, filtered)


class Launched:
    """A step dispatched to the device: its kind, its pieces, which of them sample a token, and the device arrays
    of the results, already on their way to the host (`copy_to_host_async`). `fetch` waits for them."""

    def __init__(self, how: str, pieces, emit: list[bool], out: tuple):
        self.how, self.pieces, self.emit, self.out = how, pieces, emit, out
        for x in out:
            x.copy_to_host_async()

    def fetch(self) -> tuple:
        """(tokens [P], and when asked for: logprobs [P], top ids [P, n], top logprobs [P, n]) as NumPy arrays;
        verify: (tokens [P, k+1], counts [P], and when asked for logprobs [P, k+1], top ids / logprobs [P, k+1, n])."""
        return tuple(np.asarray(x) for x in self.out)


class Runner:
    """Holds the device state (params, cache, penalty counts, each row's last sampled token) and the per-row
    sampling parameters (set at admission), and dispatches scheduled pieces without waiting for them."""

    def __init__(self, model, groups, abstract, buffer_space, blocks: int, max_num_seqs: int, max_len: int,
                 block_size: int, cross_tokens: int = 0, k: int = 0):
        """k > 0: speculative decoding with k draft tokens (`abstract` made with lookahead k)."""
        self.model, self.cfg, self.groups = model, model.config, groups
        self.shard = model.sharding
        self.rows = max_num_seqs + 1  # the last: scratch, for padded rows
        self.buffer_space, self.block_size, self.max_len, self.k = buffer_space, block_size, max_len, k
        self.splits = tuple(np.cumsum([0] + [g.entries for g in groups]).tolist())
        with sharding.entered(self.shard):
            self.cache = allocate(self.cfg, abstract, buffer_space, blocks, self.rows, max_len, model.dtype,
                                  block_size, self.shard, cross_tokens, k)
            self.draft = draft_state(self.cfg, self.rows, max_len, model.dtype, k, self.shard) if k else None
        self.cross = cross_tokens > 0
        self.counts = None  # [rows, vocab], from when a request first uses penalties
        self.no_counts = self._zeros((1, 1))  # what steps without penalties take: their shape never changes
        self.last = self._zeros((self.rows,))  # each row's latest sampled token, for the next decode
        # per row: top-k, seed (int32 bits), logprobs asked for (-1: none) / temperature, top-p, min-p, penalties
        self.row_ints = np.zeros((self.rows, 3), np.int32)
        self.row_floats = np.zeros((self.rows, 5), np.float32)
        self.row_ints[:, 2] = -1
        self.row_floats[:, F_TOP_P] = 1
        self.shapes: set = set()
        self.copies_compiled: set = set()  # copy_blocks sizes compiled
        self.dispatch_s = 0.0  # seconds in the jitted step's call (dispatch; on a CPU maybe part of the work)
        self.compile_s = 0.0  # of which the first calls of each shape (trace and compile)
        self.extend_ok = extends(model, abstract)

    def _zeros(self, shape) -> jax.Array:
        """int32 zeros, replicated over the mesh when there is one."""
        return jnp.zeros(shape, jnp.int32, device=None if self.shard is None else
                         NamedSharding(self.shard.mesh, PartitionSpec()))

    def admit(self, req) -> None:
        """A request took its row: its sampling parameters, and its penalty counts when it has penalties."""
        p, row = req.params, req.row
        seed = np.array(req.seed, np.uint32).view(np.int32)
        self.row_ints[row] = (min(max(p.top_k, 0), self.cfg.logits_size), seed,
                              -1 if p.logprobs is None else p.logprobs)
        self.row_floats[row] = (p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty)
        if p.penalized:  # the row's counts: this request's generated tokens so far
            self.reset_counts(row, req.output)
        if self.cross and req.cross is None:  # an earlier request's image K/V must not reach this one
            with sharding.entered(self.shard):
                self.cache = clear_cross(self.cache, row)

    def copy(self, copies) -> None:
        if not copies:
            return
        n = bucket(len(copies))
        if n not in self.copies_compiled:
            self.copies_compiled.add(n)
            log.info("compiling copy_blocks: %d blocks", n)
        src, dst = [], []
        for s in self.buffer_space:
            mine = [(a, b) for sp, a, b in copies if sp == s]
            src.append(np.array([a for a, _ in mine] + [0] * (n - len(mine)), np.int32))
            dst.append(np.array([b for _, b in mine] + [np.iinfo(np.int32).max] * (n - len(mine)), np.int32))
        with sharding.entered(self.shard):
            self.cache = copy_blocks(self.cache, tuple(src), tuple(dst), shard=self.shard)

    def _ensure_counts(self) -> None:
        """The [rows, vocab] penalty counts, allocated when a request first uses penalties."""
        if self.counts is None:
            self.counts = self._zeros((self.rows, self.cfg.logits_size))

    def reset_counts(self, row: int, tokens: list[int]) -> None:
        """A request with penalties took `row`: its counts are its generated tokens so far."""
        self._ensure_counts()
        c = np.bincount(np.asarray(tokens, np.int64), minlength=self.cfg.logits_size).astype(np.int32)
        with sharding.entered(self.shard):
            self.counts = self.counts.at[row].set(c)

    def run(self, how: str, pieces, table: np.ndarray) -> Launched:
        """Dispatch pieces [(request, start, n)] of one kind (their rows' block tables in `table`, the pool's
        [rows, entries]); returns without waiting for the device. A piece that ends its request's known tokens
        samples a token: the request's `pending` counts it until the engine reads it back. how: decode | verify
        (a speculative decode step, its pieces decode pieces) | extend | prefill."""
        n = len(pieces)
        decode = how in ("decode", "verify")
        # a decode step: at least 8 rows (it costs the same, fewer shapes); chunks: as `row_groups` grouped them
        P = bucket(n, 8 if decode else 1, cap=self.rows - 1)
        T = 1 if decode else chunk_width(max(k for _, _, k in pieces))
        ints = np.zeros((9, P), np.int32)
        rows, tokens = ints[I_ROW], np.zeros((P, T), np.int32)
        reqs = [r for r, _, _ in pieces]  # the only per-row Python: what lives on the request
        starts = [a for _, a, _ in pieces]
        known = [len(r.tokens) for r in reqs]
        emit = [a + k == kn + r.pending for (r, a, k), kn in zip(pieces, known)]
        ints[I_INDEX, :n] = [r.draws for r in reqs]  # each draw's key: the request's seed and draws so far
        draws = self.k + 1 if how == "verify" else 1  # a verify step draws k drafts and its accepted run
        for r, e in zip(reqs, emit):
            r.pending += e
            r.draws += draws * e
        rows[:n] = [r.row for r in reqs]
        rows[n:] = self.rows - 1
        ints[I_START, :n] = starts
        ints[I_LEN, :n] = [k for _, _, k in pieces]
        ints[I_EMIT, :n] = emit
        if decode:
            ints[I_START, n:] = -1 if how == "decode" else 0
            feed = [a >= kn for a, kn in zip(starts, known)]  # sampled by a step in flight: the device feeds it
            ints[I_FEED, :n] = feed
            tokens[:n, 0] = [0 if f else r.tokens[a] for r, a, f in zip(reqs, starts, feed)]
            if how == "verify":  # the positions each row may write: k + 1 drafts and token, within its cache
                ints[I_LEN, :n] = np.minimum(self.k + 1, self.max_len - np.asarray(starts))
        else:
            for i, (r, a, k) in enumerate(pieces):
                assert a + k <= known[i], "a chunk's tokens are known"
                tokens[i, :k] = r.tokens[a:a + k]
                ints[I_NEXT, i] = r.tokens[a + k] if a + k < known[i] else 0
        params = self.row_ints[rows]
        ints[I_TOP_K], ints[I_SEED] = params[:, 0], params[:, 1]
        floats = np.ascontiguousarray(self.row_floats[rows].T)
        hot = floats[F_TEMP] > 0
        sampled = bool(hot.any())
        filtered = bool((hot & ((ints[I_TOP_K] > 0) | (floats[F_TOP_P] < 1) | (floats[F_MIN_P] > 0))).any())
        penalized = bool(floats[F_PRESENCE].any() or floats[F_FREQUENCY].any())
        want = int(params[:, 2].max())
        top_n = 0 if want <= 0 else MAX_LOGPROBS if want > 5 else 5
        images = None if decode else self._images(pieces, P, T)
        if penalized:
            self._ensure_counts()
        key = self._key(how, P, T, sampled, filtered, penalized, top_n, want >= 0, images)
        new = key not in self.shapes
        if new:
            self.shapes.add(key)
            log.info("compiling step %s: %d rows x %d tokens (sampled=%s, penalties=%s, logprobs=%s, "
                     "top_logprobs=%d); %d shapes so far", how, P, T, sampled, penalized, want >= 0, top_n,
                     len(self.shapes))
        t = time.perf_counter()
        with sharding.entered(self.shard):
            if how == "verify":
                assert not penalized, "a request with penalties decodes plainly"
                self.cache, self.draft, self.last, out = verify_step(
                    self.model.params, self.cache, self.draft, self.last, ints, floats, table[rows], tokens,
                    cfg=self.cfg, k=self.k, sampled=sampled, filtered=filtered, top_n=top_n, logprobs=want >= 0,
                    splits=self.splits, shard=self.shard)
            else:
                draft = self.draft if how == "extend" else None  # the drafter follows every chunk
                self.cache, draft, counts, self.last, out = step(
                    self.model.params, self.cache, draft, self.counts if penalized else self.no_counts, self.last,
                    ints, floats, table[rows], tokens, images, cfg=self.cfg, how=how, sampled=sampled,
                    filtered=filtered, penalized=penalized, top_n=top_n, logprobs=want >= 0, splits=self.splits,
                    shard=self.shard)
                if penalized:
                    self.counts = counts
                else:
                    self.no_counts = counts
                if draft is not None:
                    self.draft = draft
        t = time.perf_counter() - t
        self.dispatch_s += t
        self.compile_s += t if new else 0.0
        return Launched(how, pieces, emit, out)

    def _key(self, how, P, T, sampled, filtered, penalized, top_n, logprobs, images) -> tuple:
        """What tells compiled steps apart (beside the model, fixed for the runner)."""
        return (how, P, T, sampled, filtered, penalized, top_n, logprobs,
                None if images is None else tuple(sorted((k, np.shape(a)) for k, a in images.items())))

    def lower(self, how: str, P: int, T: int, sampling: str = "greedy"):
        """The step of P rows x T tokens for rows that are `sampling` (WARM_SAMPLING; no penalties, logprobs or
        images), traced and lowered for `jax.stages.Lowered.compile`: once compiled, the `run` that meets this
        shape finds it in JAX's caches instead of compiling while requests wait. None if it is compiled already.
        Lower in the thread that runs the engine (tracing reads its JAX config, e.g. a matmul precision context);
        compiling may take other threads (XLA compiles without the GIL). Returns (the shape's key, for `shapes`
        once it compiled; the lowered step)."""
        sampled, filtered = WARM_SAMPLING[sampling]
        key = self._key(how, P, T, sampled, filtered, False, 0, False, None)
        if key in self.shapes:
            return None
        ints, floats = np.zeros((9, P), np.int32), np.zeros((5, P), np.float32)
        tables, tokens = np.zeros((P, self.splits[-1]), np.int32), np.zeros((P, T), np.int32)
        flags = dict(cfg=self.cfg, sampled=sampled, filtered=filtered, top_n=0, logprobs=False, splits=self.splits,
                     shard=self.shard)
        with sharding.entered(self.shard):
            if how == "verify":
                return key, verify_step.lower(self.model.params, self.cache, self.draft, self.last, ints, floats,
                                              tables, tokens, k=self.k, **flags)
            return key, step.lower(self.model.params, self.cache, self.draft if how == "extend" else None,
                                   self.no_counts, self.last, ints, floats, tables, tokens, None, how=how,
                                   penalized=False, **flags)

    def lower_copy(self, n: int):
        """copy_blocks of n (a power of two) blocks per buffer, lowered as `copy` will call it."""
        src = tuple(np.zeros(n, np.int32) for _ in self.cache.buffers)
        with sharding.entered(self.shard):
            return copy_blocks.lower(self.cache, src, src, shard=self.shard)

    def _images(self, pieces, P: int, T: int) -> dict | None:
        """The image-token embeddings of the chunks' image tokens, piece by piece (rows bucketed, padding
        invalid), and Gemma3's token types; None when no chunk holds an image token."""
        v = self.cfg.vision
        if v is not None and v.kind == "mllama":
            return self._mllama(pieces, P, T)
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

    def _mllama(self, pieces, P: int, T: int) -> dict | None:
        """Mllama's processed images of the pieces (all with images, or none: the engine runs them apart) as the
        prefill takes them; padding rows repeat the first row's images (their results are dropped). A token past
        the prompt (recomputed after a preemption) sees the tiles the prompt's last token sees, as decode does."""
        if pieces[0][0].cross is None:
            return None
        out = {k: np.stack([r.cross[k] for r, _, _ in pieces] + [pieces[0][0].cross[k]] * (P - len(pieces)))
               for k in ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")}
        m = pieces[0][0].cross["cross_attention_mask"]
        out["cross_attention_mask"] = mask = np.zeros((P, T, *m.shape[1:]), m.dtype)
        for i, (r, a, n) in enumerate(pieces):
            m = r.cross["cross_attention_mask"]
            mask[i, :n] = m[np.minimum(np.arange(a, a + n), len(m) - 1)]
        return out
