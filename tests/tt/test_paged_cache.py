"""Paged KV cache semantics, checked exactly against a token-by-token dense reference.

The reference keeps each request's logical sequence in a dense array and places token p of page-table
row r at ``(page_table[r, p // block_size], p % block_size)``, one token at a time. The module under
test works in 32-row tiles, skips ring tiles up front and validates before writing, so agreement is
not by construction.
"""
import numpy as np
import pytest

from tt_backend import paged_cache as pc

BS, H, D = 32, 2, 8  # block size (one tile), kv heads, head dim
SENTINEL = -7.0  # untouched cache memory


def _cache(num_blocks, heads=H, dtype=np.float32):
    return np.full((num_blocks, heads, BS, D), SENTINEL, dtype)


def _reference_write(cache, pt_row, positions, values, modulo=0):
    """Token-level reference: values [heads, n, D] at logical positions (later writes win)."""
    out = cache.copy()
    for j, p in enumerate(positions):
        q = p % modulo if modulo else p
        b = pt_row[q // BS]
        if b != -1:
            out[b, :, q % BS] = values[:, j]
    return out


def _permuted_tables(rng, num_blocks, rows, width):
    perm = rng.permutation(num_blocks)
    return perm[: rows * width].reshape(rows, width).astype(np.int32)


# --------------------------------------------------------------------------------------- fill
def test_fill_matches_dense_reference_with_permuted_blocks():
    rng = np.random.default_rng(0)
    pt = _permuted_tables(rng, 24, 3, 4)  # 3 users x 4 blocks of a shuffled pool
    cache, ref = _cache(24), _cache(24)
    for user, S in [(0, 128), (2, 64), (1, 96)]:
        x = rng.standard_normal((1, H, S, D)).astype(np.float32)
        pc.paged_fill_cache(cache, x, pt, batch_idx=user)
        ref = _reference_write(ref, pt[user], range(S), x[0])
    np.testing.assert_array_equal(cache, ref)
    # reading back each user's sequence gives exactly what was written, in logical order
    x1 = cache[pt[1, 0], :, :]  # first block of user 1
    np.testing.assert_array_equal(pc.gather_sequence(cache, pt[1], 32), x1)


def test_fill_batch_idx_tensor_and_skip_entries():
    rng = np.random.default_rng(1)
    pt = _permuted_tables(rng, 16, 2, 3)
    pt[1, 1] = -1  # unallocated page: its tile must be skipped, not written to block -1 (= the last block)
    x = rng.standard_normal((2, H, 96, D)).astype(np.float32)
    cache, ref = _cache(16), _cache(16)
    pc.paged_fill_cache(cache, x, pt, batch_idx=[1, 0])  # input row 0 -> page-table row 1
    ref = _reference_write(ref, pt[1], range(96), x[0])
    ref = _reference_write(ref, pt[0], range(96), x[1])
    np.testing.assert_array_equal(cache, ref)
    seq = pc.gather_sequence(cache, pt[1], 96)
    assert (seq[:, 32:64] == 0).all()  # a -1 page reads as zeros
    np.testing.assert_array_equal(seq[:, :32], x[0, :, :32])


@pytest.mark.parametrize("bad, msg", [
    (dict(x_len=40), "multiple of the tile height"),
    (dict(dtype=np.float64), "without conversion"),
    (dict(x_len=160), "needs logical block 4"),
    (dict(batch_idx=5), "outside the page table"),
    (dict(x_batch=2), "scalar batch_idx"),
])
def test_fill_rejects_bad_input(bad, msg):
    pt = np.arange(8, dtype=np.int32).reshape(2, 4)
    x = np.ones((bad.get("x_batch", 1), H, bad.get("x_len", 64), D), bad.get("dtype", np.float32))
    cache = _cache(8)
    with pytest.raises(pc.PagedCacheError, match=msg):
        pc.paged_fill_cache(cache, x, pt, batch_idx=bad.get("batch_idx", 0))
    assert (cache == SENTINEL).all()


def test_page_table_entries_out_of_range_are_rejected():
    pt = np.array([[0, 9]], np.int32)
    with pytest.raises(pc.PagedCacheError, match="neither -1 nor a block"):
        pc.paged_fill_cache(_cache(8), np.ones((1, H, 64, D), np.float32), pt)


# ------------------------------------------------------------------------------------- update
def test_update_matches_dense_reference_and_skips():
    rng = np.random.default_rng(2)
    B, width = 4, 3
    pt = _permuted_tables(rng, 16, B, width)
    pt[3, 2] = -1
    cache, ref = _cache(16), _cache(16)
    dense = np.full((B, H, width * BS, D), SENTINEL, np.float32)  # each user's logical sequence
    pos = np.array([0, 5, 40, 63])
    for step in range(30):
        x = rng.standard_normal((1, B, 32, D)).astype(np.float32)  # heads padded to a tile
        idx = pos + step
        idx[1] = -1 if step % 3 == 0 else idx[1]  # -1 skips the user this step
        pc.paged_update_cache(cache, x, update_idxs=idx, page_table=pt)
        for b in range(B):
            if idx[b] != -1:
                ref = _reference_write(ref, pt[b], [idx[b]], x[0, b, :H, None])
                if pt[b, idx[b] // BS] != -1:
                    dense[b, :, idx[b]] = x[0, b, :H]
    np.testing.assert_array_equal(cache, ref)
    for b in range(3):
        n = pos[b] + 30
        np.testing.assert_array_equal(pc.gather_sequence(cache, pt[b], n)[:, pos[b]:], dense[b, :, pos[b]:n])
    # user 3 ran into its -1 page at position 64: those writes were dropped, nothing else touched
    assert (pc.gather_sequence(cache, pt[3], 93)[:, 64:] == 0).all()


def test_update_unpaged_and_quantize_hook():
    cache = np.zeros((2, H, 64, D), np.float32)
    x = np.arange(2 * 32 * D, dtype=np.float32).reshape(1, 2, 32, D)
    pc.paged_update_cache(cache, x, update_idxs_tensor=np.array([3, -1], np.int32), quantize=np.floor)
    np.testing.assert_array_equal(cache[0, :, 3], x[0, 0, :H])
    assert (cache[1] == 0).all() and np.count_nonzero(cache) == np.count_nonzero(x[0, 0, :H])


@pytest.mark.parametrize("kw, msg", [
    (dict(update_idxs=[70, 0]), "needs logical block 2"),
    (dict(update_idxs=[3, 3], same_block=True), "both write block"),
    (dict(update_idxs=[0]), "update indices for a batch of 2"),
    (dict(update_idxs=[0, 1], int_input=True), "float32 or bfloat16"),
    (dict(update_idxs=[0, 1], f64_input=True), "float32 or bfloat16"),
    (dict(update_idxs=[0, -2]), "negative position"),
])
def test_update_rejects_bad_input(kw, msg):
    pt = np.array([[0, 1], [2, 3]], np.int32)
    if kw.get("same_block"):
        pt = np.array([[0, 1], [0, 3]], np.int32)
    x = np.ones((1, 2, 32, D), np.int32 if kw.get("int_input") else np.float64 if kw.get("f64_input") else np.float32)
    cache = _cache(4)
    with pytest.raises(pc.PagedCacheError, match=msg):
        pc.paged_update_cache(cache, x, update_idxs=kw["update_idxs"], page_table=pt)
    assert (cache == SENTINEL).all()


def test_block_size_and_num_kv_heads_override_view_the_same_memory():
    """A 4-head/32-row view of a buffer allocated as 2 heads x 64 rows (hybrid kv-cache-group views)."""
    cache = np.zeros((3, 2, 64, D), np.float32)
    x = np.arange(4 * D, dtype=np.float32).reshape(1, 1, 4, D) + 1
    pc.paged_update_cache(cache, x, update_idxs=[33], page_table=np.array([[2, 1]], np.int32),
                          block_size=32, num_kv_heads=4)
    view = cache.reshape(3, 4, 32, D)
    np.testing.assert_array_equal(view[1, :, 1], x[0, 0])
    assert np.count_nonzero(cache) == 4 * D
    with pytest.raises(pc.PagedCacheError, match="elements per block"):
        pc.paged_update_cache(cache, x, update_idxs=[0], page_table=np.array([[0]], np.int32), num_kv_heads=4)


# --------------------------------------------------------------------------------------- ring
def test_ring_update_wraps_past_the_window():
    cap, steps = 64, 200  # two blocks of ring, three wraps
    pt = np.array([[5, 2]], np.int32)
    cache = np.zeros((6, H, BS, D), np.float32)
    rng = np.random.default_rng(3)
    hist = rng.standard_normal((steps, H, D)).astype(np.float32)
    for p in range(steps):
        x = np.zeros((1, 1, 32, D), np.float32)
        x[0, 0, :H] = hist[p]
        pc.paged_update_cache(cache, x, update_idxs=[p], page_table=pt, cache_position_modulo=cap)
        if p in (10, 63, 64, 130, steps - 1):
            kv, held = pc.gather_ring(cache, pt[0], p, cap)
            for s in range(cap):  # slot s holds the latest position <= p congruent to s
                want = np.zeros((H, D)) if held[s] < 0 else hist[held[s]]
                np.testing.assert_array_equal(kv[:, s], want)
            assert set(held[held >= 0]) == set(range(max(0, p - cap + 1), p + 1))
    assert np.count_nonzero(cache[[0, 1, 3, 4]]) == 0  # the ring never leaves its two blocks


def test_ring_fill_keeps_the_last_window_and_valid_seq_len_stops_at_the_prompt():
    rng = np.random.default_rng(4)
    cap, S = 64, 192
    pt = np.array([[3, 1]], np.int32)
    x = rng.standard_normal((1, H, S, D)).astype(np.float32)
    cache = _cache(4)
    pc.paged_fill_cache(cache, x, pt, cache_position_modulo=cap)
    np.testing.assert_array_equal(cache, _reference_write(_cache(4), pt[0], range(S), x[0], modulo=cap))
    kv, held = pc.gather_ring(cache, pt[0], S - 1, cap)
    np.testing.assert_array_equal(kv, x[0][:, held])
    # padded prefill of a 100-token prompt: without valid_seq_len the zero padding overwrites the ring
    xp = x.copy()
    xp[:, :, 100:] = 0
    padded = pc.paged_fill_cache(_cache(4), xp, pt, cache_position_modulo=cap)
    assert (pc.gather_ring(padded, pt[0], S - 1, cap)[0] == 0).all()
    capped = pc.paged_fill_cache(_cache(4), xp, pt, cache_position_modulo=cap, valid_seq_len=100)
    # the real length rounds up to a block (128): positions 64..127 survive, 100..127 are padding
    kv, held = pc.gather_ring(capped, pt[0], 127, cap)
    np.testing.assert_array_equal(kv, xp[0][:, held])
    assert sorted(held) == list(range(64, 128))


def test_valid_seq_len_caps_a_plain_fill():
    x = np.ones((1, H, 128, D), np.float32)
    cache = pc.paged_fill_cache(_cache(4), x, np.array([[0, 1, 2, 3]], np.int32), valid_seq_len=33)
    assert (cache[:2] == 1).all() and (cache[2:] == SENTINEL).all()


@pytest.mark.parametrize("modulo", [48, 160])
def test_bad_modulo_is_rejected(modulo):
    with pytest.raises(pc.PagedCacheError, match="cache_position_modulo"):
        pc.paged_update_cache(_cache(4), np.ones((1, 1, 32, D), np.float32), update_idxs=[0],
                              page_table=np.array([[0, 1]], np.int32), cache_position_modulo=modulo)


# ------------------------------------------------------------------------------ tensor_idx sharing
def test_shared_tensor_idx_buffers():
    shape = (8, H, BS, D)
    specs = [(shape, None, 0), (shape, None, 1), (shape, None, 0), (shape, None, 2), (shape, None, 0)]
    bufs = pc.allocate_shared_buffers(specs)
    assert bufs[0] is bufs[2] is bufs[4] and bufs[0][0] is bufs[4][0]
    assert bufs[1][0] is not bufs[0][0] and bufs[0][0] is not bufs[0][1]  # K and V are distinct
    # a write through layer 0 is visible through layer 4 and nowhere else; disjoint group page tables
    # keep the sharers' slots apart
    x = np.ones((1, 1, 32, D), np.float32)
    pc.paged_update_cache(bufs[0][0], x, update_idxs=[1], page_table=np.array([[6]], np.int32))
    pc.paged_update_cache(bufs[2][0], 2 * x, update_idxs=[1], page_table=np.array([[7]], np.int32))
    assert (bufs[4][0][6, :, 1] == 1).all() and (bufs[4][0][7, :, 1] == 2).all()
    assert not bufs[1][0].any() and not bufs[3][0].any() and not bufs[0][1].any()
    with pytest.raises(pc.PagedCacheError, match="element counts differ"):
        pc.allocate_shared_buffers([(shape, None, 0), ((4, H, BS, D), None, 0)])


# ------------------------------------------------------------------------------- data parallel
def test_dp_chunking_of_per_layer_page_tables():
    pts = [np.arange(8 * 3, dtype=np.int32).reshape(8, 3) + 100 * i for i in range(3)]
    per = pc.chunk_page_tables_per_layer([pts[0], None, pts[2]], 4)
    assert len(per) == 4 and all(len(s) == 3 for s in per)
    for s in range(4):
        np.testing.assert_array_equal(per[s][0], pts[0][2 * s:2 * s + 2])
        assert per[s][1] is None
        np.testing.assert_array_equal(per[s][2], pts[2][2 * s:2 * s + 2])
    assert pc.chunk_page_tables_per_layer(None, 2) is None
    with pytest.raises(pc.PagedCacheError, match="does not split evenly"):
        pc.chunk_page_tables_per_layer([np.zeros((5, 3), np.int32)], 4)


# --------------------------------------------------------------------------------- ownership
def _two_requests(num_blocks=8, seed=5):
    alloc = pc.BlockAllocator(num_blocks, order=np.random.default_rng(seed).permutation(num_blocks))
    alloc.allocate("a", 2)
    alloc.allocate("b", 3)
    return alloc


def test_pad_tail_into_a_foreign_block_raises():
    """#56324: a 40-token prompt padded to 128 tokens; the vLLM row holds a stale block of "b" past "a"'s two."""
    alloc = _two_requests()
    stale = alloc.blocks_of("b")[0]
    row = np.array(alloc.blocks_of("a") + [stale, -1], np.int32)
    owners = pc.RowOwners(alloc, ["a"])
    x = np.ones((1, H, 128, D), np.float32)
    cache = _cache(8)
    with pytest.raises(pc.BlockOwnershipError, match=f"block {stale}, a block of request 'b'"):
        pc.paged_fill_cache(cache, x, pc.raw_prefill_page_table(row, 128, BS), owners=owners)
    assert (cache == SENTINEL).all()  # nothing written before the check fired
    # the safe page table stops at the prompt's blocks: the tail is skipped and only "a"'s blocks change
    pc.paged_fill_cache(cache, x, pc.prefill_page_table(row, 40, 128, BS), owners=owners)
    written = {b for b in range(8) if (cache[b] != SENTINEL).any()}
    assert written == set(alloc.blocks_of("a"))


def test_update_into_foreign_or_free_block_raises():
    alloc = _two_requests()
    pt = alloc.page_table(["a", "b"], 4)
    assert (pt[0, 2:] == -1).all() and (pt[1, :3] == alloc.blocks_of("b")).all()
    owners = pc.RowOwners(alloc, ["a", "b"])
    x = np.ones((1, 2, 32, D), np.float32)
    pc.paged_update_cache(_cache(8), x, update_idxs=[63, 95], page_table=pt, owners=owners)  # both own theirs
    swapped = pt[::-1].copy()
    with pytest.raises(pc.BlockOwnershipError, match="request 'a'"):
        pc.paged_update_cache(_cache(8), x, update_idxs=[0, -1], page_table=swapped, owners=owners)
    alloc.release("b")
    with pytest.raises(pc.BlockOwnershipError, match="a free block"):
        pc.paged_update_cache(_cache(8), x, update_idxs=[-1, 0], page_table=pt, owners=owners)


def test_sliding_positions_collapsing_onto_block_zero_are_caught():
    """vLLM zero-pads a sliding group's page table; absolute positions past the window then hit block 0."""
    alloc = pc.BlockAllocator(6)
    alloc.allocate("other", 1)  # owns block 0
    alloc.allocate("s", 2)  # a 64-token ring
    ring = alloc.page_table(["s"], 2)
    padded = np.concatenate([ring, np.zeros((1, 2), np.int32)], 1)  # as vLLM pads it
    owners = pc.RowOwners(alloc, ["s"])
    x = np.ones((1, 1, 32, D), np.float32)
    with pytest.raises(pc.BlockOwnershipError, match="request 'other'"):
        pc.paged_update_cache(_cache(6), x, update_idxs=[70], page_table=padded, owners=owners)
    with pytest.raises(pc.PagedCacheError, match="needs logical block 2"):
        pc.paged_update_cache(_cache(6), x, update_idxs=[70], page_table=ring, owners=owners)
    cache = pc.paged_update_cache(_cache(6), x, update_idxs=[70], page_table=ring, owners=owners,
                                  cache_position_modulo=64)
    assert (cache[ring[0, 0], :1, 6] == 1).all()  # 70 % 64 = 6, first ring block


# --------------------------------------------------------------------------------- allocator
def test_allocator_exhaustion_release_and_page_tables():
    alloc = pc.BlockAllocator(5, order=[4, 2, 0, 3, 1])
    assert alloc.allocate("a", 2) == [4, 2]
    with pytest.raises(pc.BlockAllocatorExhausted, match="needs 4 more KV blocks but only 3 of 5"):
        alloc.allocate("b", 4)
    assert alloc.num_free == 3 and alloc.blocks_of("b") == []  # all or nothing
    assert alloc.ensure("b", 33, BS) == [0, 3]
    assert alloc.ensure("b", 64, BS) == [0, 3]  # already covered
    with pytest.raises(pc.PagedCacheError, match="more than the page table's 1 columns"):
        alloc.page_table(["a"], 1)
    np.testing.assert_array_equal(alloc.page_table(["b", None, "a"], 3), [[0, 3, -1], [-1, -1, -1], [4, 2, -1]])
    assert alloc.release("a") == [4, 2] and alloc.owner_of(4) is None and alloc.num_free == 3
    assert alloc.allocate("c", 3) == [1, 4, 2]  # released blocks go to the back of the free list
    with pytest.raises(KeyError, match="holds no blocks"):
        alloc.release("a")
    with pytest.raises(ValueError, match="permutation"):
        pc.BlockAllocator(3, order=[0, 0, 1])


def test_positions_past_4k_and_an_undersized_page_table():
    """Long contexts: positions past 4096 resolve through a wide page table; a table one block short of
    the position is refused (on the device it reads past the row: the >4K decode hangs, #21565)."""
    width = 5120 // BS
    pt = np.random.default_rng(9).permutation(width + 4)[:width].astype(np.int32)[None]
    cache = np.zeros((width + 4, H, BS, D), np.float32)
    written = {}
    for p in (0, 4095, 4096, 4097, 5119):
        x = np.full((1, 1, 32, D), p + 1, np.float32)
        pc.paged_update_cache(cache, x, update_idxs=[p], page_table=pt)
        written[p] = p + 1
    seq = pc.gather_sequence(cache, pt[0], 5120)
    assert {int(p) for p in np.flatnonzero(seq[0, :, 0])} == set(written)
    for p, v in written.items():
        assert (seq[:, p] == v).all()
    with pytest.raises(pc.PagedCacheError, match="position 4096 needs logical block 128"):
        pc.paged_update_cache(cache, np.ones((1, 1, 32, D), np.float32), update_idxs=[4096],
                              page_table=pt[:, :4096 // BS])
