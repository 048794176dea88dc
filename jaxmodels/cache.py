"""KV caches: one interface, two layouts.

What a layer kind keeps is declared once in the plan (`plan.cache_specs`): slot caches (token rings, full
caches, compressed entries) and per-sequence state. This module lays them out:

- contiguous (`generate()`): per (kind, slot spec) a buffer [layers, batch, heads, slots, width] — heads before
  slots, the layout attention contracts without a transpose;
- paged (the server, the TT generator): per pool a buffer [layers, blocks, heads, block_size, width] and per
  table group a block table [batch, blocks per sequence]. Logical slot s of sequence b lives in block
  table[b, s // block_size] at offset s % block_size: the same logical slots as contiguous (a ring of W slots
  cycles inside its ceil(W / block_size) blocks), so both layouts run the same arithmetic. Specs that address slots
  alike (same window / entries per token) share one table; buffers of different table groups whose entries
  agree (heads, width, dtype, layer count) share one pool, each group writing its own blocks (the
  `tensor_idx` sharing of vLLM's hybrid allocator and the TT generator).

Attention receives a `LayerCache` (one layer's view) and calls read / positions / write / write_token / fill /
get / set; it never knows which layout it has. Per-sequence state is [layers, batch, ...] in both layouts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.config import ModelConfig
from jaxmodels.plan import SlotSpec, StateSpec, cache_specs, model_state_specs, plan


@dataclass(frozen=True)
class Ref:
    """Where one slot spec of one kind lives: its buffer (or pool), table (paged) and logical slot count."""

    buffer: int
    table: int  # -1 when contiguous
    slots: int


@dataclass(frozen=True)
class Layout:
    block_size: int  # 0 = contiguous
    kinds: tuple[tuple[tuple[str, Ref], ...], ...]  # per kind: (slot spec name, Ref)

    @property
    def paged(self) -> bool:
        return self.block_size > 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Cache:
    buffers: tuple  # contiguous: [L, B, H, S, w] per (kind, slot spec); paged: [L, blocks, H, block_size, w] per pool
    tables: tuple  # paged: [B, blocks per sequence] int32 per table group; () when contiguous
    state: tuple  # per kind: {name: [L, B, *shape]}
    extra: dict  # model-level per-sequence state: {name: [B, *shape]}
    layout: Layout = field(metadata=dict(static=True))


def _dtype(spec, default):
    return jnp.dtype(getattr(spec, "dtype", None) or default)


def build(kind_specs, counts, batch: int, max_len: int, dtype, block_size: int = 0, tables=None,
          extra_specs=(), constrain=None) -> Cache:
    """A zero cache for `counts[k]` layers of each kind with the specs `kind_specs[k]`.

    block_size > 0: paged. tables: {(window, per): int32 [batch, blocks]} per table group (groups not given: each
    row its own consecutive blocks past those given, every group its own range); a pool holds max(table) + 1
    blocks. Groups that share a pool must use disjoint blocks (the block allocator's job).
    constrain(x, logical axes): optional sharding constraint for the buffers.
    """
    constrain = constrain or (lambda x, axes: x)
    groups: dict = {}  # (window, per) -> (table index, blocks per sequence)
    pools: list = []  # paged, per buffer: (entry, ordinal within its group, groups using it)
    seen: dict = {}  # (entry, group) -> buffers so far
    shapes: list = []
    refs, state = [], []
    for specs, n in zip(kind_specs, counts):
        kref, kstate = [], {}
        for s in specs:
            if isinstance(s, StateSpec):
                kstate[s.name] = jnp.full((n, batch, *s.shape), s.fill, _dtype(s, dtype))
                continue
            S, dt = s.slots(max_len), _dtype(s, dtype)
            if not block_size:
                kref.append((s.name, Ref(len(shapes), -1, S)))
                shapes.append(((n, batch, s.heads, S, s.width), dt))
                continue
            t, nb = groups.setdefault((s.window, s.per), (len(groups), -(-S // block_size)))
            entry = (s.heads, s.width, str(dt), n)
            o = seen[(entry, t)] = seen.get((entry, t), -1) + 1
            b = next((i for i, (e, oo, gs) in enumerate(pools) if (e, oo) == (entry, o) and t not in gs), None)
            if b is None:  # a new pool; buffers of other groups with the same entry may join it
                b = len(pools)
                pools.append((entry, o, set()))
                shapes.append(((n, None, s.heads, block_size, s.width), dt))
            pools[b][2].add(t)
            kref.append((s.name, Ref(b, t, S)))
        refs.append(tuple(kref))
        state.append(kstate)
    table_arrays = ()
    if block_size:
        tables = dict(tables or {})
        start = 1 + max((int(np.max(v)) for v in tables.values() if np.size(v)), default=-1)
        for key, (t, nb) in groups.items():
            if key not in tables:  # each row its own consecutive blocks, every group its own range
                tables[key] = start + np.arange(batch * nb, dtype=np.int32).reshape(batch, nb)
                start += batch * nb
            if np.shape(tables[key]) != (batch, nb):
                raise ValueError(f"the block table for window={key[0]}, per={key[1]} must be [{batch}, {nb}], "
                                 f"got {np.shape(tables[key])}")
        table_arrays = tuple(jnp.asarray(tables[key], jnp.int32) for key in groups)
        blocks = 1 + max((int(np.max(tables[key])) for key in groups if np.size(tables[key])), default=0)
        shapes = [((n, blocks, *rest), dt) for (n, _, *rest), dt in shapes]
    axes = ("layers", None if block_size else "batch", "kv_heads", None, "head_dim")
    buffers = tuple(constrain(jnp.zeros(shape, dt), axes) for shape, dt in shapes)
    extra = {s.name: jnp.full((batch, *s.shape), s.fill, _dtype(s, dtype)) for s in extra_specs}
    return Cache(buffers, table_arrays, tuple(state), extra, Layout(block_size, tuple(refs)))


# per-sequence state that is a ring of positions (plan.cache_specs / model_state_specs): lookahead enlarges these
RINGS = ("buf_kv", "buf_gate", "ibuf_kv", "ibuf_gate", "engram_history")


def roomier(spec, lookahead: int):
    """A cache spec whose ring (a sliding window's slots, a compressor's or Engram's state ring) holds `lookahead`
    more positions (speculative decoding's rejected drafts, see `model.init_cache`); other specs unchanged."""
    if not lookahead:
        return spec
    if isinstance(spec, SlotSpec) and spec.window:
        return dataclasses.replace(spec, window=spec.window + lookahead)
    if isinstance(spec, StateSpec) and spec.name in RINGS:
        return dataclasses.replace(spec, shape=(spec.shape[0] + lookahead, *spec.shape[1:]))
    return spec


def _kind_specs(cfg: ModelConfig, cross_tokens: int = 0, lookahead: int = 0) -> list[tuple]:
    return [tuple(roomier(s, lookahead) for s in cache_specs(cfg, spec, cross_tokens)) for spec in plan(cfg).kinds]


def init(cfg: ModelConfig, batch: int, max_len: int, dtype, block_size: int = 0, tables=None, constrain=None,
         cross_tokens: int = 0, lookahead: int = 0):
    """The model's cache: every layer kind's specs (plan.cache_specs) and the model-level state. cross_tokens:
    image-feature tokens a cross-attention layer keeps per sequence (Mllama; 0: a text-only cache). lookahead:
    spare ring slots (`roomier`)."""
    return build(_kind_specs(cfg, cross_tokens, lookahead), plan(cfg).counts, batch, max_len, dtype, block_size,
                 tables, tuple(roomier(s, lookahead) for s in model_state_specs(cfg)), constrain)


def table_groups(cfg: ModelConfig, max_len: int, block_size: int, lookahead: int = 0) -> dict:
    """{(window, per): blocks per sequence} of the model's paged caches: what a block allocator fills."""
    return {(s.window, s.per): -(-s.slots(max_len) // block_size)
            for specs in _kind_specs(cfg, lookahead=lookahead) for s in specs if isinstance(s, SlotSpec)}


def bytes_by_kind(cache: Cache) -> dict[int, int]:
    """Bytes each layer kind's buffers and state take (a pool shared by kinds counts for each)."""
    return {k: sum(int(cache.buffers[r.buffer].nbytes) for _, r in refs)
            + sum(int(v.nbytes) for v in cache.state[k].values()) for k, refs in enumerate(cache.layout.kinds)}


# ------------------------------------------------------------------------------------------ the interface
@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Pages:
    """One buffer of every layer as pages: page p of layer l, head h is buffer[(l * pages + p) * heads + h]
    [block_size, w]; row b's logical slot t lives in page table[b, t // block_size] (-1: unallocated) at
    t % block_size. A cache of `slots` slots holds position p in slot p % slots."""

    buffer: jax.Array  # [L * pages * heads, block_size, w]
    table: jax.Array  # [B, blocks per sequence] int32
    layer: jax.Array  # this layer's index (int32, traced in a scanned loop)
    pages: int = field(metadata=dict(static=True))
    heads: int = field(metadata=dict(static=True))
    slots: int = field(metadata=dict(static=True))


class LayerCache:
    """One layer's view of the cache inside a traced step. Writes are functional: they replace arrays of
    `self.cache`, which the executor takes back after the layer."""

    def __init__(self, cache: Cache, kind: int, layer):
        self.cache, self.kind, self.layer = cache, kind, layer
        self._refs = dict(cache.layout.kinds[kind])

    def slots(self, name: str) -> int:
        return self._refs[name].slots

    def read(self, name: str):
        """Every slot of this layer's buffer: [B, H, S, w] (paged: gathered through the block table)."""
        ref = self._refs[name]
        buf = self.cache.buffers[ref.buffer][self.layer]
        if not self.cache.layout.paged:
            return buf
        table = jnp.maximum(self.cache.tables[ref.table], 0)  # unallocated (-1) entries read block 0, masked
        g = buf[table]  # [B, nb, H, bs, w]
        B, nb, H, bs, w = g.shape
        return g.transpose(0, 2, 1, 3, 4).reshape(B, H, nb * bs, w)[:, :, :ref.slots]

    def pages(self, name: str) -> Pages:
        """This buffer's slots, every layer's, as pages for a kernel that reads them in place (no copy of this
        layer's slice). Contiguous: each row one page of all its slots."""
        ref = self._refs[name]
        buf = self.cache.buffers[ref.buffer]
        L, P, H, bs, w = buf.shape
        table = self.cache.tables[ref.table] if self.cache.layout.paged else jnp.arange(P, dtype=jnp.int32)[:, None]
        return Pages(buf.reshape(L * P * H, bs, w), table, jnp.asarray(self.layer, jnp.int32), P, H, ref.slots)

    def positions(self, name: str, last):
        """[B, S]: the position each slot holds once positions up to `last` [B] are written; -1 for none."""
        S = self.slots(name)
        p = last[:, None] - (last[:, None] - jnp.arange(S)) % S
        return jnp.where(p >= 0, p, -1)

    def write(self, name: str, x, lengths, start=0):
        """x [B, H, T, w] at positions start .. start+T-1 of each row, the first lengths[b] of them. A ring keeps
        the latest of the positions that share a slot."""
        S, T = self.slots(name), x.shape[2]
        lengths = jnp.asarray(lengths)
        start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), lengths.shape)
        if T <= S:  # consecutive positions fall into distinct slots
            t = jnp.broadcast_to(jnp.arange(T), (x.shape[0], T))
            slot = jnp.where(t < lengths[:, None], (start[:, None] + t) % S, -1)
        else:  # only the last S positions survive: for each slot, the latest position it receives
            t, ok = _latest(start, lengths, S, T)
            slot = jnp.where(ok, jnp.arange(S), -1)
            x = jnp.take_along_axis(x, t[:, None, :, None], axis=2)
        self._scatter(name, slot, x.transpose(0, 2, 1, 3))

    def write_token(self, name: str, x, pos):
        """x [B, H, w] at position (or entry index) pos [B]; rows with pos < 0 write nothing."""
        S = self.slots(name)
        self._scatter(name, jnp.where(pos >= 0, pos % S, -1)[:, None], x[:, None])

    def _scatter(self, name, slot, values):
        """values [B, n, H, w] into logical slots [B, n] (-1: dropped)."""
        ref = self._refs[name]
        buf = self.cache.buffers[ref.buffer]
        rows = jnp.arange(slot.shape[0])[:, None]
        values = values.astype(buf.dtype)
        if not self.cache.layout.paged:
            buf = buf.at[self.layer, rows, :, jnp.where(slot >= 0, slot, buf.shape[3])].set(values, mode="drop")
        else:
            bs = self.cache.layout.block_size
            table = self.cache.tables[ref.table]
            block = jnp.take_along_axis(table, jnp.maximum(slot, 0) // bs, axis=1)
            block = jnp.where((slot >= 0) & (block >= 0), block, buf.shape[1])  # out of range: dropped
            buf = buf.at[self.layer, block, :, slot % bs].set(values, mode="drop")
        buffers = list(self.cache.buffers)
        buffers[ref.buffer] = buf
        self.cache = dataclasses.replace(self.cache, buffers=tuple(buffers))

    # per-sequence state
    def get(self, name: str):
        return self.cache.state[self.kind][name][self.layer]

    def set(self, name: str, value):
        state = list(self.cache.state)
        old = state[self.kind][name]
        state[self.kind] = {**state[self.kind], name: old.at[self.layer].set(value.astype(old.dtype))}
        self.cache = dataclasses.replace(self.cache, state=tuple(state))

    def fill(self, name: str, values, lengths):
        """A state ring [B, size, ...] from a prefill's values [B, T, ...]: slot s keeps the latest position
        p < lengths[b] with p % size == s (zeros where none)."""
        t, ok = _latest(jnp.zeros_like(lengths), lengths, self.get(name).shape[1], values.shape[1])
        shape = t.shape + (1,) * (values.ndim - 2)
        self.set(name, jnp.where(ok.reshape(shape), jnp.take_along_axis(values, t.reshape(shape), axis=1), 0))


def _latest(start, lengths, S: int, T: int):
    """For each of S ring slots, the latest position p of start .. start+lengths-1 (per row) with p % S == s:
    its index p - start into the chunk of T, and whether there is one. [B, S] each."""
    last = (start + lengths - 1)[:, None]
    p = last - (last - jnp.arange(S)) % S
    return jnp.clip(p - start[:, None], 0, T - 1), (p >= start[:, None]) & (lengths[:, None] > 0)
