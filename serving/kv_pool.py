"""Paged KV blocks for the engine: allocation per block space, refcounts, and prefix caching.

The model's paged cache (`jaxmodels.cache`) has *table groups* — specs that address slots alike: full
attention, one sliding-window ring per window size, DeepSeek's compressed and indexer entries — each indexed by a
block table per sequence, and *pools* (buffers) that groups with the same entry shape share. Groups that share a
buffer share its block ids: they form one **space** here, with one free list (vLLM's hybrid allocator; the TT
seed's `tensor_idx`). Every space holds `blocks` blocks.

Logical block i of a sequence holds positions i*bs .. i*bs+bs-1. A full group keeps it in table entry i. A ring of
S slots (S % bs == 0) keeps it in entry i % (S / bs): the ring is a rolling window of physical blocks, so a ring's
full blocks can be cached and shared like a full group's. A sequence that wraps onto an entry whose block is
shared or cached first gets a private copy of it (copy-on-write: the old positions still in the window stay
readable, and the cached block stays intact). The scheduler keeps prefill chunks within S - bs + 1 tokens, so
that no chunk writes over a ring block of its own before the block is cached.

Prefix caching: a full block is named by a chain digest of every token up to its end (sha256: a collision would
silently reuse wrong keys). A new sequence reuses the longest prefix P (whole blocks, at most its length - 1, so
that at least one token runs and gives logits) that *every* cacheable group can serve: blocks 0 .. P/bs-1 for
a full group, only the last S/bs of them for a ring — which is why hybrid models keep their hits. Blocks whose
refcount drops to 0 stay cached, evicted least recently used first. A group that cannot be cached (a compressed
group, a ring not a multiple of the block size, per-sequence state) disables prefix caching for the model.

A block is published as soon as the device has been asked to write it and its tokens are known (the scheduler
registers before each step): device steps run in order, so a later step that reuses it reads what the earlier one
wrote, whether or not that step has finished. An admission that fails (no blocks) is undone without a trace: its
lookups are not counted and the cached blocks it touched keep their place in the LRU order.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


class OutOfBlocks(Exception):
    """Not enough free blocks for a request's next chunk (the scheduler preempts or waits)."""


@dataclass(frozen=True)
class Group:
    """One table group: key (window, per) as `jaxmodels.cache.table_groups` names it."""

    key: tuple
    entries: int  # table entries per sequence (blocks per sequence)
    slots: int  # logical slots per sequence
    space: int  # the block space it allocates from
    ring: bool  # a window ring shorter than the sequence: logical block i lives in entry i % entries
    cacheable: bool  # its full blocks can be shared by prefix

    @property
    def name(self) -> str:
        window, per = self.key
        return "full" if window is None and per == 1 else f"sliding_{window}" if per == 1 else f"compressed_{per}"


@dataclass
class Space:
    blocks: int
    refs: np.ndarray = None  # per block
    free: list = field(default_factory=list)  # uncached free blocks (a stack)
    # cached blocks by time of release, oldest first; a block taken again keeps its (stale) entry until eviction
    # passes it or it is released again, so that an undone admission leaves the order as it was
    lru: OrderedDict = field(default_factory=OrderedDict)
    digest: dict = field(default_factory=dict)  # cached block -> (group index, digest)
    idle: int = 0  # cached blocks with refcount 0 (evictable)

    def __post_init__(self):
        self.refs = np.zeros(self.blocks, np.int32)
        self.free = list(range(self.blocks - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self.free) + self.idle


@dataclass
class SeqBlocks:
    """One sequence's tables: per group, its table entries (-1: none yet)."""

    entries: list  # per group: np.int32 [entries] (a view of its row of the pool's `table` when it has a row)
    digests: list = field(default_factory=list)  # chain digest of each full logical block of its tokens
    registered: int = 0  # logical blocks [0, registered) are in the prefix cache (or not cacheable)
    salt: bytes = b""  # starts the digest chain: what besides the tokens the cache depends on (the images)
    lookup: tuple = ()  # the prefix-cache lookup of its admission: (blocks asked for, hits per group)


class KVPool:
    """rows > 0: the block tables of sequences that hold a row live in `table` [rows, entries of every group],
    one row per sequence and the groups side by side (`offsets`), so that a step's tables are one gather."""

    def __init__(self, groups: list[Group], blocks: int, block_size: int, prefix_caching: bool = True,
                 rows: int = 0):
        self.groups, self.block_size = groups, block_size
        self.offsets = np.cumsum([0] + [g.entries for g in groups]).tolist()
        self.table = np.full((rows, self.offsets[-1]), -1, np.int32)
        self.spaces = [Space(blocks) for _ in range(1 + max(g.space for g in groups))]
        self.prefix_caching = prefix_caching and all(g.cacheable for g in groups)
        self.cached = [dict() for _ in groups]  # per group: digest -> block
        self.queries = [0] * len(groups)  # prefix-cache lookups (blocks asked for) and hits, per group
        self.hits = [0] * len(groups)
        self.pending_copies: list[tuple[int, int, int]] = []  # (space, src, dst) to run before the next step

    # ------------------------------------------------------------------------------------------- blocks
    def _take(self, s: int) -> int:
        sp = self.spaces[s]
        if sp.free:
            b = sp.free.pop()
        elif sp.idle:  # evict the least recently used cached block nobody holds
            while True:
                b, _ = sp.lru.popitem(last=False)
                if sp.refs[b] == 0:
                    break
            g, d = sp.digest.pop(b)
            del self.cached[g][d]
            sp.idle -= 1
        else:
            raise OutOfBlocks(s)
        sp.refs[b] = 1
        return b

    def _ref(self, s: int, b: int) -> None:
        sp = self.spaces[s]
        if sp.refs[b] == 0:  # a cached block nobody held: its LRU entry stays, stale, until eviction or release
            sp.idle -= 1
        sp.refs[b] += 1

    def _unref(self, s: int, b: int, touch: bool = True) -> None:
        """touch: the block was used, it becomes the most recently used; otherwise (an undone admission) it
        keeps its place."""
        sp = self.spaces[s]
        sp.refs[b] -= 1
        if sp.refs[b] == 0:
            if b in sp.digest:
                sp.idle += 1
                if touch:
                    sp.lru.pop(b, None)
                    sp.lru[b] = None
                elif b not in sp.lru:
                    sp.lru[b] = None
            else:
                sp.free.append(b)

    def used(self, space: int) -> int:
        """Blocks held by sequences (cached blocks nobody holds count as free)."""
        return int(np.count_nonzero(self.spaces[space].refs))

    def free_blocks(self) -> list[int]:
        return [sp.available for sp in self.spaces]

    # ---------------------------------------------------------------------------------------- sequences
    def new(self, salt: bytes = b"", digests: list | None = None, row: int | None = None) -> SeqBlocks:
        """A sequence with no blocks. digests: its chain digests so far (kept by the request across admissions,
        extended in place). row: its row of `table`."""
        if row is None:
            entries = [np.full(g.entries, -1, np.int32) for g in self.groups]
        else:
            self.table[row] = -1
            entries = [self.table[row, a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]
        return SeqBlocks(entries, [] if digests is None else digests, salt=salt)

    def digests(self, seq: SeqBlocks, tokens: list[int], upto: int | None = None) -> list[bytes]:
        """Extend seq.digests to every full block of `tokens` (the sequence's tokens so far) [among the first
        `upto`]."""
        bs = self.block_size
        n = len(tokens) if upto is None else min(upto, len(tokens))
        d = seq.digests
        for i in range(len(d), n // bs):
            d.append(hashlib.sha256((d[-1] if d else seq.salt) + np.asarray(tokens[i * bs:(i + 1) * bs], np.int64)
                                    .tobytes()).digest())
        return d

    def reuse(self, seq: SeqBlocks, tokens: list[int]) -> int:
        """Attach the longest cached prefix of `tokens` to a new sequence; returns its length (a multiple of the
        block size, < len(tokens)). The lookup is counted in the hit rates by `count` once the admission holds."""
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        d = self.digests(seq, tokens)[: (len(tokens) - 1) // bs]
        n = len(d)
        for gi, g in enumerate(self.groups):
            if not g.ring:  # blocks 0 .. n-1, consecutive from the first
                n = min(n, next((i for i, x in enumerate(d) if x not in self.cached[gi]), len(d)))
        while n > 0 and not all(all(x in self.cached[gi] for x in d[max(0, n - g.entries): n])
                                for gi, g in enumerate(self.groups) if g.ring):
            n -= 1
        hits = []
        for gi, g in enumerate(self.groups):
            first = max(0, n - g.entries) if g.ring else 0
            for i in range(first, n):
                b = self.cached[gi][d[i]]
                self._ref(g.space, b)
                seq.entries[gi][i % g.entries] = b
            hits.append(n - first)
        seq.registered = n
        seq.lookup = (len(d), hits)
        return n * bs

    def count(self, seq: SeqBlocks) -> None:
        """Add an admitted sequence's prefix lookup to the hit rates (once per admission)."""
        if seq.lookup:
            asked, hits = seq.lookup
            for gi, h in enumerate(hits):
                self.queries[gi] += asked
                self.hits[gi] += h
            seq.lookup = ()

    def allocate(self, seq: SeqBlocks, start: int, end: int) -> None:
        """Blocks for positions start .. end-1 of `seq` in every group (copy-on-write for shared ring blocks).
        All or nothing: raises OutOfBlocks with nothing changed."""
        plan = []  # (group, entry, copy from or -1)
        for gi, g in enumerate(self.groups):
            window, per = g.key
            if end - start == 1:  # a decode: one slot (the common case, without NumPy's overheads)
                slot = start // per
                if g.ring:
                    slot %= g.slots
                elif slot >= g.slots:
                    continue
                touched = (slot // self.block_size,)
            else:
                slot = np.arange(max(start, end - g.slots) if g.ring else start, end) // per
                slot = slot % g.slots if g.ring else slot[slot < g.slots]  # a compressed entry past the cache: none
                touched = np.unique(slot // self.block_size).tolist()
            for e in touched:
                b = seq.entries[gi][e]
                if b < 0:
                    plan.append((gi, e, -1))
                elif self.spaces[g.space].refs[b] > 1 or b in self.spaces[g.space].digest:
                    plan.append((gi, e, int(b)))  # shared or cached: write a private copy
        need = [0] * len(self.spaces)
        for gi, _, src in plan:
            g = self.groups[gi]
            # a copy of a block only this sequence holds frees that block (to the cached LRU) as it takes one
            need[g.space] += 0 if src >= 0 and self.spaces[g.space].refs[src] == 1 else 1
        if any(n > sp.available for n, sp in zip(need, self.spaces)):
            raise OutOfBlocks(need)
        for gi, e, src in plan:
            g = self.groups[gi]
            if src >= 0:
                self._unref(g.space, src)
            b = self._take(g.space)
            if src >= 0 and b != src:  # b == src: the source was evicted to make room, nothing left to keep
                self.pending_copies.append((g.space, src, b))
            seq.entries[gi][e] = b

    def register(self, seq: SeqBlocks, tokens: list[int], computed: int) -> None:
        """Publish seq's full blocks among its first `computed` positions to the prefix cache: positions whose
        writes the device has been asked for (`computed`, in flight or done) and whose tokens are known."""
        if not self.prefix_caching:
            return
        full = min(computed, len(tokens)) // self.block_size
        if full <= seq.registered:
            return
        d = self.digests(seq, tokens, full * self.block_size)
        for i in range(seq.registered, full):
            for gi, g in enumerate(self.groups):
                if g.ring and i + g.entries <= (computed - 1) // self.block_size:
                    continue  # a chunk longer than the window already wrote over it
                b = int(seq.entries[gi][i % g.entries if g.ring else i])
                if d[i] in self.cached[gi] or b < 0:
                    continue
                sp = self.spaces[g.space]
                if b in sp.digest:  # the block already names an earlier block (cannot happen without a wrap)
                    continue
                self.cached[gi][d[i]] = b
                sp.digest[b] = (gi, d[i])
        seq.registered = max(seq.registered, full)

    def release(self, seq: SeqBlocks, touch: bool = True) -> None:
        """Drop every block the sequence holds (finished, aborted or preempted; touch=False: an admission undone,
        the cached blocks it took keep their LRU place)."""
        for gi, g in enumerate(self.groups):
            for b in seq.entries[gi][seq.entries[gi] >= 0].tolist():
                self._unref(g.space, b, touch)
            seq.entries[gi][:] = -1

    def take_copies(self) -> list[tuple[int, int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    def hit_rates(self) -> dict[str, float]:
        return {g.name: (self.hits[i] / self.queries[i] if self.queries[i] else 0.0) for i, g in enumerate(self.groups)}
