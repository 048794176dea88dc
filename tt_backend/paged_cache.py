"""Paged KV cache with ttnn's semantics, in NumPy: allocator, page tables, fill/update/gather.

Layout (tt_transformers `attention.py: init_kv_cache`, paged): one K and one V buffer per layer,
``[num_blocks, num_kv_heads, block_size, head_dim]``. A page table is int32 ``[batch, max_blocks]``;
entry ``-1`` means "no block" (writes skip it, reads see zeros).

The two write ops follow ``ttnn.experimental.paged_fill_cache`` / ``paged_update_cache`` as their
docstrings (``paged_cache_nanobind.cpp``) and dataflow kernels (``writer_fill_cache_interleaved.cpp``,
``writer_update_cache_interleaved_start_id.cpp``) in tenstorrent/tt-metal describe them:

* fill copies whole 32-row tiles of a prefill ``[input_batch, heads, S, head_dim]`` through one
  page-table row; ``cache_position_modulo`` wraps the tile index into a ring (only the last
  ``modulo`` tokens survive, earlier tiles are dropped, not written); a ``-1`` entry skips the tile;
  an optional ``valid_seq_len`` (newer kernels) stops writing at the real length rounded up to a
  block instead of at the padded end. Without it the padded tail *is* written: the #56324 pad-tail
  hazard that the ownership check below exists to catch.
* update writes one token row per user at ``update_idxs[b]`` (``-1`` skips the user), after
  ``idx %= cache_position_modulo`` when given, resolved through that user's page-table row.

Both mutate the cache in place, as the device ops do. That is deliberate: layers that share a
``tensor_idx`` share one buffer (the HMA layout of ``allocate_vllm_kv_cache_per_layer``) and must see
each other's writes. Every check runs before the first write, so a raised error leaves the cache
untouched.

Ownership: a `BlockAllocator` records which request owns each physical block. Pass
``owners=RowOwners(allocator, request_of_row)`` to a write op and any write that would land in a
block its row's request does not own raises `BlockOwnershipError` — including the padded prefill
tail and a sliding-window position collapsing onto a foreign block.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np

TILE_HEIGHT = 32  # ttnn tiles are 32x32; cache blocks and fill inputs are whole tiles along the sequence
SKIP = -1  # page-table entry / update index meaning "skip"


class PagedCacheError(ValueError):
    """A paged-cache call that ttnn would reject, hang on, or silently get wrong."""


class BlockOwnershipError(PagedCacheError):
    """A write would land in a physical block that the writing request does not own."""


class BlockAllocatorExhausted(RuntimeError):
    """Not enough free blocks for an allocation (nothing was allocated)."""


# ------------------------------------------------------------------------------------ allocator
class BlockAllocator:
    """Free list of physical blocks with per-request ownership.

    ``order`` fixes the order in which free blocks are handed out (tests pass a random permutation, as
    tt-metal's own paged tests shuffle physical blocks). Released blocks go to the back of the list.
    """

    def __init__(self, num_blocks: int, order: Sequence[int] | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        order = list(range(num_blocks)) if order is None else [int(b) for b in order]
        if sorted(order) != list(range(num_blocks)):
            raise ValueError(f"order must be a permutation of range({num_blocks})")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(order)
        self._owner: dict[int, Hashable] = {}
        self._blocks: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, request_id: Hashable, n: int) -> list[int]:
        """Append `n` blocks to `request_id`'s blocks and return the new ones; all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise BlockAllocatorExhausted(
                f"request {request_id!r} needs {n} more KV blocks but only {len(self._free)} of "
                f"{self.num_blocks} are free")
        new = [self._free.popleft() for _ in range(n)]
        for b in new:
            self._owner[b] = request_id
        self._blocks.setdefault(request_id, []).extend(new)
        return new

    def ensure(self, request_id: Hashable, num_tokens: int, block_size: int) -> list[int]:
        """Grow `request_id` to cover `num_tokens` tokens; returns all its blocks."""
        have = len(self._blocks.get(request_id, ()))
        self.allocate(request_id, max(0, -(-num_tokens // block_size) - have))
        return self.blocks_of(request_id)

    def release(self, request_id: Hashable) -> list[int]:
        if request_id not in self._blocks:
            raise KeyError(f"request {request_id!r} holds no blocks")
        blocks = self._blocks.pop(request_id)
        for b in blocks:
            del self._owner[b]
        self._free.extend(blocks)
        return blocks

    def blocks_of(self, request_id: Hashable) -> list[int]:
        return list(self._blocks.get(request_id, ()))

    def owner_of(self, block: int) -> Hashable | None:
        return self._owner.get(int(block))

    def page_table(self, request_ids: Sequence[Hashable | None], max_blocks: int) -> np.ndarray:
        """int32 [len(request_ids), max_blocks]: each request's blocks in logical order, -1 after them."""
        pt = np.full((len(request_ids), max_blocks), SKIP, np.int32)
        for row, rid in enumerate(request_ids):
            blocks = [] if rid is None else self._blocks.get(rid, [])
            if len(blocks) > max_blocks:
                raise PagedCacheError(
                    f"request {rid!r} holds {len(blocks)} blocks, more than the page table's {max_blocks} columns")
            pt[row, : len(blocks)] = blocks
        return pt


@dataclass(frozen=True)
class RowOwners:
    """Which request writes through each page-table row, checked against an allocator's ownership."""

    allocator: BlockAllocator
    request_of_row: Sequence[Hashable | None]

    def check(self, row: int, block: int, what: str) -> None:
        if row >= len(self.request_of_row):
            raise BlockOwnershipError(f"{what}: page-table row {row} has no request assigned")
        want, have = self.request_of_row[row], self.allocator.owner_of(block)
        if have is None or have != want:
            held = "a free block" if have is None else f"a block of request {have!r}"
            raise BlockOwnershipError(
                f"{what}: row {row} (request {want!r}) would write physical block {block}, {held}")


# ------------------------------------------------------------------------------------- buffers
def cache_shape(num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int, int]:
    """The paged layout tt_transformers allocates: [num_blocks, num_kv_heads, block_size, head_dim]."""
    return (num_blocks, num_kv_heads, block_size, head_dim)


def allocate_shared_buffers(per_layer_specs, dtype=np.float32) -> list[list[np.ndarray]]:
    """[layer][k|v] zero buffers; layers with one `tensor_idx` get *the same* arrays.

    per_layer_specs: ``(kv_cache_shape, dtype_or_None, tensor_idx)`` per layer, in layer order. As in
    ``allocate_vllm_kv_cache_per_layer``, the first layer with a given tensor_idx fixes the buffer;
    a later sharer whose shape differs in element count is an error (its page-table view would
    address memory the buffer does not have).
    """
    buffers: dict[Hashable, list[np.ndarray]] = {}
    out = []
    for layer, (shape, dt, tensor_idx) in enumerate(per_layer_specs):
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4:
            raise PagedCacheError(f"layer {layer}: kv_cache_shape must be [blocks, kv_heads, block_size, head_dim], "
                                  f"got {shape}")
        if tensor_idx in buffers:
            have = buffers[tensor_idx][0].shape
            if int(np.prod(have)) != int(np.prod(shape)):
                raise PagedCacheError(f"layer {layer} shares tensor_idx {tensor_idx} with a buffer of shape {have} "
                                      f"but asks for {shape}: element counts differ")
        else:
            buffers[tensor_idx] = [np.zeros(shape, dt or dtype), np.zeros(shape, dt or dtype)]
        out.append(buffers[tensor_idx])
    return out


# ---------------------------------------------------------------------------------- validation
def _block_size(cache: np.ndarray, block_size: int | None) -> int:
    bs = cache.shape[2] if block_size is None else int(block_size)
    if bs <= 0 or bs % TILE_HEIGHT:
        raise PagedCacheError(f"block_size must be a positive multiple of the tile height {TILE_HEIGHT}, got {bs}")
    return bs


def _check_cache(cache: np.ndarray) -> None:
    if not isinstance(cache, np.ndarray) or cache.ndim != 4:
        raise PagedCacheError(f"cache must be a 4-D array [blocks, kv_heads, block_size, head_dim], "
                              f"got {getattr(cache, 'shape', type(cache))}")


def _check_page_table(page_table: np.ndarray, num_blocks: int) -> np.ndarray:
    pt = np.asarray(page_table)
    if pt.ndim != 2 or not np.issubdtype(pt.dtype, np.integer):
        raise PagedCacheError(f"page_table must be an integer [batch, max_blocks] array, got {pt.dtype} {pt.shape}")
    bad = (pt != SKIP) & ((pt < 0) | (pt >= num_blocks))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise PagedCacheError(f"page_table[{r}, {c}] = {pt[r, c]} is neither -1 nor a block in [0, {num_blocks})")
    return pt


def _check_modulo(modulo: int | None, block_size: int, width: int) -> int:
    if modulo is None or modulo == 0:
        return 0
    if modulo < 0 or modulo % block_size or modulo > width * block_size:
        raise PagedCacheError(f"cache_position_modulo={modulo} must be a positive multiple of block_size={block_size} "
                              f"and <= page_table width * block_size = {width * block_size}")
    return int(modulo)


# ---------------------------------------------------------------------------------------- fill
def paged_fill_cache(cache: np.ndarray, input_tensor: np.ndarray, page_table: np.ndarray, *,
                     batch_idx: int | Sequence[int] = 0, block_size: int | None = None,
                     cache_position_modulo: int | None = None, valid_seq_len: int | None = None,
                     owners: RowOwners | None = None) -> np.ndarray:
    """Copy a prefill's K or V ``[input_batch, heads, S, head_dim]`` into `cache` in place; returns `cache`.

    batch_idx: the page-table row of each input batch row (an int needs input_batch == 1; a sequence
    is ttnn's ``batch_idx_tensor``). S must be whole tiles (ttnn pads prefill to tiles); every tile is
    written, padding included, unless `valid_seq_len` caps it. No dtype conversion: the input dtype
    must equal the cache dtype (ttnn typecasts prefill K/V to the cache dtype first).
    """
    _check_cache(cache)
    x = np.asarray(input_tensor)
    if x.ndim != 4:
        raise PagedCacheError(f"input_tensor must be [input_batch, heads, seq, head_dim], got {x.shape}")
    nb = cache.shape[0]
    bs = _block_size(cache, block_size)
    nh, d = x.shape[1], x.shape[3]
    if nh * bs * d != int(np.prod(cache.shape[1:])):
        raise PagedCacheError(f"input heads/head_dim {nh}/{d} with block_size={bs} do not preserve the "
                              f"{int(np.prod(cache.shape[1:]))} elements per block of the cache {cache.shape}")
    if x.dtype != cache.dtype:
        raise PagedCacheError(f"paged_fill_cache copies tiles without conversion: input dtype {x.dtype} "
                              f"!= cache dtype {cache.dtype}")
    S = x.shape[2]
    if S % TILE_HEIGHT:
        raise PagedCacheError(f"prefill length {S} is not a multiple of the tile height {TILE_HEIGHT}")
    rows = [int(batch_idx)] * x.shape[0] if np.isscalar(batch_idx) else [int(b) for b in batch_idx]
    if np.isscalar(batch_idx) and x.shape[0] != 1:
        raise PagedCacheError(f"a scalar batch_idx needs input_batch == 1, got {x.shape[0]} (pass one index per row)")
    if len(rows) != x.shape[0]:
        raise PagedCacheError(f"{len(rows)} batch indices for an input batch of {x.shape[0]}")
    pt = _check_page_table(page_table, nb)
    for r in rows:
        if not 0 <= r < pt.shape[0]:
            raise PagedCacheError(f"batch_idx {r} is outside the page table's {pt.shape[0]} rows")
    modulo = _check_modulo(cache_position_modulo, bs, pt.shape[1])

    view = cache.reshape(nb, nh, bs, d)  # the block_size override reinterprets the same memory
    tiles, bst = S // TILE_HEIGHT, bs // TILE_HEIGHT
    end = tiles
    if valid_seq_len:  # real length, rounded up to whole tiles, then whole blocks (as the kernel does)
        v = -(-int(valid_seq_len) // TILE_HEIGHT)
        v = -(-v // bst) * bst
        end = v if 0 < v < tiles else tiles
    cap = modulo // TILE_HEIGHT
    first = end - cap if cap and end > cap else 0  # earlier ring tiles would be overwritten anyway

    writes = []  # (input row, tile, physical block, row tile in block), all checked before any write
    for i, r in enumerate(rows):
        for t in range(first, end):
            vt = t % cap if cap else t
            vb = vt // bst
            if vb >= pt.shape[1]:
                raise PagedCacheError(f"prefill tile {t} (tokens {t * TILE_HEIGHT}..) needs logical block {vb} but "
                                      f"page-table row {r} has only {pt.shape[1]} entries")
            phys = int(pt[r, vb])
            if phys == SKIP:
                continue
            if owners is not None:
                owners.check(r, phys, f"paged_fill_cache tokens {t * TILE_HEIGHT}..{(t + 1) * TILE_HEIGHT - 1}")
            writes.append((i, t, phys, vt % bst))
    for i, t, phys, bt in writes:
        view[phys, :, bt * TILE_HEIGHT:(bt + 1) * TILE_HEIGHT] = x[i, :, t * TILE_HEIGHT:(t + 1) * TILE_HEIGHT]
    return cache


# -------------------------------------------------------------------------------------- update
def paged_update_cache(cache: np.ndarray, input_tensor: np.ndarray, *, update_idxs: Sequence[int] | None = None,
                       update_idxs_tensor: np.ndarray | None = None, page_table: np.ndarray | None = None, block_size: int | None = None,
                       num_kv_heads: int | None = None, cache_position_modulo: int | None = None,
                       owners: RowOwners | None = None,
                       quantize: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Write one token per user into `cache` in place; returns `cache`.

    input_tensor: ``[1, B, heads_padded, head_dim]`` (decode K or V, heads padded to a tile); the first
    `num_kv_heads` (default: the cache's) rows are written. update_idxs [B]: the position of each
    user's token, ``-1`` skips the user (ttnn takes it as a list or as ``update_idxs_tensor``; give one).
    Paged (page_table given): position p (after ``p %= cache_position_modulo``) goes to block
    ``page_table[b, p // block_size]``, row ``p % block_size``; a ``-1`` entry skips the write (tt-metal
    PR #45079; the update kernels without that change have no such check and write out of bounds).
    Unpaged: `cache` is ``[B, heads, max_seq, head_dim]`` and p goes to ``cache[b, :, p]``.
    quantize: the cache dtype's packing of one token row (the op repacks into the cache dtype; rows are
    independent blocks, so other tokens are untouched); None stores the values as they are.
    """
    _check_cache(cache)
    x = np.asarray(input_tensor)
    if x.ndim != 4 or x.shape[0] != 1:
        raise PagedCacheError(f"input_tensor must be [1, batch, heads_padded, head_dim], got {x.shape}")
    if x.dtype != np.float32 and str(x.dtype) != "bfloat16":
        raise PagedCacheError(f"paged_update_cache input must be float32 or bfloat16 (the op repacks into the "
                              f"cache dtype), got {x.dtype}")
    if (update_idxs is None) == (update_idxs_tensor is None):
        raise PagedCacheError("give exactly one of update_idxs and update_idxs_tensor")
    B = x.shape[1]
    idxs = np.asarray(update_idxs if update_idxs is not None else update_idxs_tensor).reshape(-1)
    if idxs.shape[0] != B:
        raise PagedCacheError(f"{idxs.shape[0]} update indices for a batch of {B}")
    nh = cache.shape[1] if num_kv_heads is None else int(num_kv_heads)
    if x.shape[2] < nh:
        raise PagedCacheError(f"input has {x.shape[2]} head rows, fewer than num_kv_heads={nh}")

    writes = []  # (user, block or batch row, row in block)
    if page_table is None:
        if cache_position_modulo:
            raise PagedCacheError("cache_position_modulo applies to paged caches only")
        if cache.shape[0] < B or cache.shape[1] != nh or x.shape[3] != cache.shape[3]:
            raise PagedCacheError(f"unpaged cache {cache.shape} does not fit a batch of {B}, {nh} heads, "
                                  f"head_dim {x.shape[3]}")
        for b, p in enumerate(idxs.tolist()):
            if p == SKIP:
                continue
            if not 0 <= p < cache.shape[2]:
                raise PagedCacheError(f"user {b}: position {p} outside the cache's {cache.shape[2]} positions")
            writes.append((b, b, p))
        view = cache
    else:
        nb = cache.shape[0]
        bs = _block_size(cache, block_size)
        per_block = cache.shape[1] * cache.shape[2] * cache.shape[3]
        if nh * bs * x.shape[3] != per_block:
            raise PagedCacheError(f"view ({nh} heads, block_size {bs}, head_dim {x.shape[3]}) does not preserve "
                                  f"the cache's {per_block} elements per block")
        pt = _check_page_table(page_table, nb)
        if pt.shape[0] < B:
            raise PagedCacheError(f"page table has {pt.shape[0]} rows for a batch of {B}")
        modulo = _check_modulo(cache_position_modulo, bs, pt.shape[1])
        view = cache.reshape(nb, nh, bs, x.shape[3])
        for b, p in enumerate(idxs.tolist()):
            if p == SKIP:
                continue
            if p < 0:
                raise PagedCacheError(f"user {b}: negative position {p} (only -1, skip, is allowed)")
            q = p % modulo if modulo else p
            vb = q // bs
            if vb >= pt.shape[1]:  # the kernel would read past the row (the >4K decode hangs, #21565)
                raise PagedCacheError(f"user {b}: position {p} needs logical block {vb} but the page table has "
                                      f"{pt.shape[1]} columns ({pt.shape[1] * bs} tokens)")
            phys = int(pt[b, vb])
            if phys == SKIP:
                continue
            if owners is not None:
                owners.check(b, phys, f"paged_update_cache position {p}")
            writes.append((b, phys, q % bs))
    seen = {}
    for b, blk, row in writes:  # two users on one slot would race on the device
        if (blk, row) in seen:
            raise PagedCacheError(f"users {seen[(blk, row)]} and {b} both write block {blk} row {row}")
        seen[(blk, row)] = b
    for b, blk, row in writes:
        vals = x[0, b, :nh]
        view[blk, :, row] = quantize(vals) if quantize is not None else vals
    return cache


# -------------------------------------------------------------------------------------- gather
def gather_sequence(cache: np.ndarray, page_table_row: np.ndarray, length: int,
                    block_size: int | None = None) -> np.ndarray:
    """One user's logical positions ``0..length-1`` as ``[heads, length, head_dim]``; -1 blocks read as zeros."""
    _check_cache(cache)
    bs = _block_size(cache, block_size)
    row = np.asarray(page_table_row).reshape(-1)
    n = -(-length // bs)
    if n > row.shape[0]:
        raise PagedCacheError(f"{length} positions need {n} blocks but the page-table row has {row.shape[0]}")
    nb, nh, _, d = cache.shape
    view = cache.reshape(nb, -1, bs, d)
    out = np.zeros((view.shape[1], n * bs, d), cache.dtype)
    for j in range(n):
        b = int(row[j])
        if b != SKIP:
            if not 0 <= b < nb:
                raise PagedCacheError(f"page-table entry {b} is not a block in [0, {nb})")
            out[:, j * bs:(j + 1) * bs] = view[b]
    return out[:, :length]


def ring_positions(position: int, capacity: int) -> np.ndarray:
    """Logical position held by each slot of a ring after writing `position`; -1 for a never-written slot."""
    s = np.arange(capacity)
    p = position - (position - s) % capacity
    return np.where(p >= 0, p, -1)


def gather_ring(cache: np.ndarray, page_table_row: np.ndarray, position: int, capacity: int,
                block_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A sliding layer's ring (``cache_position_modulo=capacity``) as of `position`.

    Returns ``([heads, capacity, head_dim], positions [capacity])``: slot s holds the latest position
    ``p <= position`` with ``p % capacity == s`` (-1 if none yet).
    """
    kv = gather_sequence(cache, page_table_row, capacity, block_size)
    return kv, ring_positions(position, capacity)


# ------------------------------------------------------------------------------ data parallel
def chunk_batch(x: np.ndarray, dp: int) -> list[np.ndarray]:
    """Split along batch into `dp` equal parts, one per data-parallel submesh.

    tt-metal uses ``torch.chunk(x, dp, 0)``, which silently returns uneven or *fewer* chunks when the
    batch is not a multiple of dp (5 rows over 4 submeshes gives 3 chunks); here that is an error.
    """
    x = np.asarray(x)
    if dp <= 0:
        raise ValueError(f"data parallel degree must be positive, got {dp}")
    if x.shape[0] % dp:
        raise PagedCacheError(f"batch {x.shape[0]} does not split evenly over {dp} data-parallel submeshes")
    return list(np.split(x, dp, axis=0))


def chunk_page_tables_per_layer(page_tables_per_layer: Sequence[np.ndarray | None] | None,
                                dp: int) -> list[list[np.ndarray | None]] | None:
    """Per-layer global page tables -> one per-layer list per submesh; None entries pass through."""
    if page_tables_per_layer is None:
        return None
    per_submesh: list[list] = [[] for _ in range(dp)]
    for pt in page_tables_per_layer:
        parts = [None] * dp if pt is None else chunk_batch(pt, dp)
        for s, part in zip(per_submesh, parts):
            s.append(part)
    return per_submesh


def num_blocks_in_seq(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def prefill_page_table(row: np.ndarray, prompt_len: int, padded_len: int, block_size: int) -> np.ndarray:
    """The page-table row one user's padded prefill should write through: ``[1, ceil(padded_len / block_size)]``.

    Only the blocks covering `prompt_len` come from `row`; the padded tail's are -1, so the fill skips
    it. (tt-metal's ``_get_prefill_user_page_table`` instead slices ``row`` to the *padded* length when
    tracing, so the tail lands in whatever the vLLM row holds there: stale blocks of other requests,
    #56324. `raw_prefill_page_table` reproduces that.)
    """
    row = np.asarray(row).reshape(-1)
    need, total = num_blocks_in_seq(prompt_len, block_size), num_blocks_in_seq(padded_len, block_size)
    if need > row.shape[0]:
        raise PagedCacheError(f"a {prompt_len}-token prompt needs {need} blocks but the page-table row has "
                              f"{row.shape[0]}")
    out = np.full((1, max(total, need)), SKIP, np.int32)
    out[0, :need] = row[:need]
    return out


def raw_prefill_page_table(row: np.ndarray, num_tokens: int, block_size: int) -> np.ndarray:
    """tt-metal's ``_get_prefill_user_page_table``: the row's first ceil(num_tokens / block_size) entries, -1-padded."""
    row = np.asarray(row, np.int32).reshape(-1)
    n = num_blocks_in_seq(num_tokens, block_size)
    out = np.full((1, n), SKIP, np.int32)
    k = min(n, row.shape[0])
    out[0, :k] = row[:k]
    return out
