"""The generator_vllm contract of `tt_backend.generator`, driven through paged caches.

Logits are checked against ``jaxmodels``' cache-free ``forward`` on the whole sequence: the executor used
here keeps its K/V *only* in the paged caches (it rebuilds a contiguous cache from the pages before each
step and writes the new token back through ``paged_update_cache``), so a page-table, ring or sharing bug
shows up as wrong logits. Contract details (reload commands, DP splitting, trace replay, chunking) are
checked with a recording executor.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import families, model as M, plan
from tt_backend import VLLMExecutor, generator as G, paged_cache as pc

BS = 32
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 8}
GEMMA3 = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3, "head_dim": 8,
          "sliding_window": 40, "query_pre_attn_scalar": 8,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
MAX_LEN = 512  # the JAX executor's contiguous cache length (>= any position used here)

_prefill = jax.jit(M.prefill, static_argnums=1)
_decode = jax.jit(M.decode_step, static_argnums=1)
_forward = jax.jit(M.forward, static_argnums=1)


class JaxPagedExecutor:
    """A reference executor whose only K/V state is the paged caches.

    decode: for every layer and row, read the positions a contiguous `jaxmodels` cache would hold from the
    pages, run ``decode_step``, write the new token's K/V with ``paged_update_cache``. prefill at position 0:
    ``jaxmodels.prefill``, then ``paged_fill_cache`` of the padded prompt's K/V; a later chunk runs as
    single-token steps over the pages (the JAX model has no prefill-from-a-prefix).
    """

    PAD_BATCH = 2  # decode runs on a fixed batch width (TT pads to 32): one compile for every caller

    def __init__(self, cfg, params):
        self.config, self.params = cfg, params
        self.plan = plan.plan(cfg)

    def _layer_cache(self, caches, layer):
        """({"k", "v"} [L, B, K, S, d] of the layer's kind, its rank) from a contiguous jaxmodels Cache or
        its dicts (as `_dicts` gives them)."""
        if not isinstance(caches, list):
            caches = _dicts(caches)
        return caches[self.plan.kind_of[layer]], self.plan.rank_of[layer]

    def decode(self, tokens, positions, *, page_tables, kv_cache, cache_position_modulo, owners):
        cfg, n = self.config, len(tokens)
        B = max(n, self.PAD_BATCH)
        tokens = np.pad(np.asarray(tokens), (0, B - n))
        positions = np.pad(np.asarray(positions), (0, B - n), constant_values=-1)
        page_tables = [np.pad(t, ((0, B - n), (0, 0)), constant_values=-1) for t in page_tables]
        active = positions >= 0
        pos = np.where(active, positions, 0)
        empty = M.init_cache(cfg, B, MAX_LEN, jnp.float32)
        caches = _dicts(empty)
        for layer in range(cfg.num_layers):
            c, r = self._layer_cache(caches, layer)
            slots, m = c["k"].shape[3], cache_position_modulo[layer]
            for b in np.flatnonzero(active):
                p = pos[b] - 1  # the cache holds positions < pos[b]
                if p < 0:
                    continue
                s = np.arange(slots)
                q = p - (p - s) % slots  # latest position <= p in each slot, as jaxmodels' ring
                ok = q >= 0
                for kv_i, name in ((0, "k"), (1, "v")):
                    seq = pc.gather_sequence(kv_cache[layer][kv_i], page_tables[layer][b], m or p + 1)
                    c[name][r, b][:, ok] = seq[:, (q[ok] % m) if m else q[ok]]
        logits, new = _decode(self.params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(pos, jnp.int32),
                              _with_dicts(empty, caches))
        idx = np.where(active, positions, -1)
        for layer in range(cfg.num_layers):
            c, r = self._layer_cache(new, layer)
            slot = pos % c["k"].shape[3]
            for kv_i, name in ((0, "k"), (1, "v")):
                x = np.asarray(c[name][r])[np.arange(B), :, slot][None]  # [1, B, kv_heads, d]
                pc.paged_update_cache(kv_cache[layer][kv_i], x, update_idxs=idx, page_table=page_tables[layer],
                                      cache_position_modulo=cache_position_modulo[layer], owners=owners)
        return np.asarray(logits)[:n]

    def prefill(self, tokens, *, chunk_start, last_token_idx, valid_seq_len, page_tables, chunk_page_tables,
                kv_cache, cache_position_modulo, owners):
        cfg, S = self.config, tokens.shape[1]
        if chunk_start:
            out = None
            for j in range(valid_seq_len):
                lg = self.decode(tokens[0, j:j + 1], np.array([chunk_start + j]), page_tables=page_tables,
                                 kv_cache=kv_cache, cache_position_modulo=cache_position_modulo, owners=owners)
                out = lg[0] if j == last_token_idx else out
            return out
        assert last_token_idx == valid_seq_len - 1 or valid_seq_len == S
        n = valid_seq_len
        cache0 = M.init_cache(cfg, 1, S, jnp.float32)
        logits, cache = _prefill(self.params, cfg, jnp.asarray(tokens), jnp.array([n]), cache0)
        tables = chunk_page_tables or page_tables
        for layer in range(cfg.num_layers):
            c, r = self._layer_cache(cache, layer)
            slots, m = c["k"].shape[3], cache_position_modulo[layer]
            for kv_i, name in ((0, "k"), (1, "v")):
                held = np.asarray(c[name][r, 0])  # [kv_heads, slots, d]
                full = np.zeros((1, cfg.num_kv_heads, S, cfg.head_dim), np.float32)
                q = np.arange(max(0, n - slots), n)
                full[0][:, q] = held[:, q % slots]
                pc.paged_fill_cache(kv_cache[layer][kv_i], full, tables[layer], batch_idx=0,
                                    cache_position_modulo=m, valid_seq_len=n if m else None, owners=owners)
        return np.asarray(logits)[0]


def _dicts(cache):
    """A contiguous jaxmodels Cache as per-kind {slot spec name: NumPy [layers, batch, heads, slots, width]}."""
    return [{name: np.array(cache.buffers[r.buffer]) for name, r in refs} for refs in cache.layout.kinds]


def _with_dicts(cache, dicts):
    buffers = list(cache.buffers)
    for refs, d in zip(cache.layout.kinds, dicts):
        for name, r in refs:
            buffers[r.buffer] = jnp.asarray(d[name])
    return dataclasses.replace(cache, buffers=tuple(buffers))


class RecordingExecutor:
    """Records what the generator hands an executor; returns logits that encode (token, position)."""

    def __init__(self, cfg):
        self.config, self.calls = cfg, []

    def prefill(self, tokens, **kw):
        self.calls.append(("prefill", tokens.copy(), {k: _copy(v) for k, v in kw.items()}))
        out = np.zeros(self.config.vocab_size, np.float32)
        out[int(tokens[0, kw["last_token_idx"]]) % self.config.vocab_size] = 1
        return out

    def decode(self, tokens, positions, **kw):
        self.calls.append(("decode", (tokens.copy(), positions.copy()), {k: _copy(v) for k, v in kw.items()}))
        out = np.zeros((len(tokens), self.config.vocab_size), np.float32)
        out[np.arange(len(tokens)), (tokens + 1) % self.config.vocab_size] = 1  # greedy "next" = token + 1
        return out


def _copy(v):
    if isinstance(v, np.ndarray):
        return v.copy()
    if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
        return [x.copy() for x in v]
    return v


def _params(cfg, seed):
    """Random weights, norms included (NumPy: `init_params` dispatches op by op and takes seconds)."""
    rng = np.random.default_rng(seed)
    offset = cfg.norm == "gemma"  # (1 + w) norms
    shapes = plan.param_shapes(cfg)

    def leaf(path, shape):
        if "norm" in str(path[-1]):
            return jnp.asarray((0.0 if offset else 1.0) + 0.1 * rng.standard_normal(shape), jnp.float32)
        return jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, shapes, is_leaf=lambda x: isinstance(x, tuple))


@pytest.fixture(scope="module")
def llama():
    cfg = families.config_from_hf(LLAMA)
    return cfg, _params(cfg, 1)


@pytest.fixture(scope="module")
def gemma():
    cfg = families.config_from_hf(GEMMA3)
    return cfg, _params(cfg, 2)


def _generator(cls, cfg, executors, max_batch, **kw):
    return cls(executors, max_batch_size=max_batch, max_seq_len=MAX_LEN, **kw)


REF_LEN = 256


def _reference(cfg, params, seq):
    """Cache-free logits of every position of `seq` (one padded length: causal, so padding changes nothing)."""
    ids = np.zeros((1, REF_LEN), np.int32)
    ids[0, :len(seq)] = seq
    return np.asarray(_forward(params, cfg, jnp.asarray(ids)))[0, :len(seq)]


# --------------------------------------------------------------------------------- numerics
def test_prefill_and_decode_logits_equal_the_non_paged_reference(llama):
    """Two DP submeshes of two users; shuffled blocks; ownership checked on every write; 6 decode steps."""
    cfg, params = llama
    dp, B, W, steps = 2, 4, MAX_LEN // BS, 6
    gen = _generator(G.LlamaForCausalLM, cfg, [JaxPagedExecutor(cfg, params) for _ in range(dp)], B)
    kv = gen.allocate_kv_cache((20, cfg.num_kv_heads, BS, cfg.head_dim), np.float32, cfg.num_layers)
    allocs = [pc.BlockAllocator(20, order=np.random.default_rng(s).permutation(20)) for s in range(dp)]
    slots = ["r0", "r1", "r2", "r3"]
    gen.track_block_ownership(allocs, slots)
    rng = np.random.default_rng(0)
    lens = [5, 70, 33, 90]  # 90 pads to 128 tokens: a tile of padding past the prompt's last block
    seqs = [list(rng.integers(0, 64, n + steps)) for n in lens]
    for s, n in enumerate(lens):
        allocs[s // 2].ensure(slots[s], n + steps, BS)
    pt = np.concatenate([allocs[s // 2].page_table([slots[s]], W) for s in range(B)])
    tokens = np.zeros((B, max(lens)), np.int32)
    for s, n in enumerate(lens):
        tokens[s, :n] = seqs[s][:n]
    # prefill in a shuffled slot order
    order = [2, 0, 3, 1]
    logits = gen.prefill_forward(tokens[order], page_table=pt[order], kv_cache=kv,
                                 prompt_lens=[lens[s] for s in order], empty_slots=order)
    for row, s in enumerate(order):
        ref = _reference(cfg, params, seqs[s][:lens[s]])
        np.testing.assert_allclose(logits[row, 0], ref[-1], rtol=1e-4, atol=1e-4)
    for t in range(steps):
        pos = np.array([n + t for n in lens])
        tok = np.array([seqs[s][pos[s]] for s in range(B)])
        out = gen.decode_forward(tok, pos, page_table=pt, kv_cache=kv, enable_trace=True)
        assert out.shape == (B, 1, cfg.vocab_size)
        for s in range(B):
            ref = _reference(cfg, params, seqs[s][:pos[s] + 1])
            np.testing.assert_allclose(out[s, 0], ref[-1], rtol=1e-4, atol=1e-4)


def test_hybrid_rings_with_shared_tensor_idx(gemma):
    """Gemma3 S/F/S with hybrid groups: sliding layers are 96-token rings (window 40) sharing the full
    layer's buffers (HMA), decoded well past the ring; logits equal the full-sequence forward."""
    cfg, params = gemma
    gen = _generator(G.Gemma3ForCausalLM, cfg, [JaxPagedExecutor(cfg, params)], 2, hybrid_kv_cache_groups=True)
    shape = (24, cfg.num_kv_heads, BS, cfg.head_dim)
    kv = gen.allocate_kv_cache_per_layer([(shape, np.float32, 0), (shape, np.float32, 0), (shape, np.float32, 1)])
    assert kv[0][0] is kv[0][1] and kv[0][2] is not kv[0][0]
    ring = G.sliding_ring_capacity(40, BS)
    assert ring == 96 and gen.cache_position_modulo() == [96, None, 96]
    alloc = pc.BlockAllocator(24, order=np.random.default_rng(3).permutation(24))
    reqs = ["a", "b"]
    gen.track_block_ownership([alloc], reqs)
    lens, steps = [70, 150], 60  # 150 pads to 256: the ring prefill wraps and must stop at the prompt
    full_w = MAX_LEN // BS
    rows_full, rows_ring = [], []
    for r, n in zip(reqs, lens):  # each request: its full-group blocks, then its ring blocks
        full = alloc.allocate(r, -(-(n + steps) // BS))
        ring_blocks = alloc.allocate(r, ring // BS)
        rows_full.append(full + [-1] * (full_w - len(full)))
        rows_ring.append(ring_blocks + [0] * (full_w - len(ring_blocks)))  # vLLM zero-pads past the ring
    pt_full, pt_ring = np.array(rows_full, np.int32), np.array(rows_ring, np.int32)
    per_layer = [pt_ring, pt_full, pt_ring]
    rng = np.random.default_rng(4)
    seqs = [list(rng.integers(0, 64, n + steps)) for n in lens]
    tokens = np.zeros((2, 150), np.int32)
    for i, n in enumerate(lens):
        tokens[i, :n] = seqs[i][:n]
    logits = gen.prefill_forward(tokens, kv_cache=kv, prompt_lens=lens, page_tables_per_layer=per_layer)
    for i, n in enumerate(lens):
        np.testing.assert_allclose(logits[i, 0], _reference(cfg, params, seqs[i][:n])[-1], rtol=1e-4, atol=1e-4)
    for t in range(steps):
        pos = np.array(lens) + t
        tok = np.array([seqs[i][pos[i]] for i in range(2)])
        out = gen.decode_forward(tok, pos, kv_cache=kv, page_tables_per_layer=per_layer)
        if t % 10 == 0 or t == steps - 1:  # the rings wrap again during decode
            for i in range(2):
                ref = _reference(cfg, params, seqs[i][:pos[i] + 1])
                np.testing.assert_allclose(out[i, 0], ref[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="need their own tables"):
        gen.decode_forward(tok, pos, page_table=pt_full, kv_cache=kv)


def test_chunked_prefill_and_prefix_caching_match_the_reference(llama):
    cfg, params = llama
    gen = _generator(G.LlamaForCausalLM, cfg, [JaxPagedExecutor(cfg, params)], 1, max_prefill_chunk_size=128)
    kv = gen.allocate_kv_cache((16, cfg.num_kv_heads, BS, cfg.head_dim), np.float32, cfg.num_layers)
    alloc = pc.BlockAllocator(16, order=np.random.default_rng(5).permutation(16))
    gen.track_block_ownership([alloc], ["u"])
    seq = list(np.random.default_rng(6).integers(0, 64, 200))
    alloc.ensure("u", 201, BS)
    pt = alloc.page_table(["u"], MAX_LEN // BS)
    logits = gen.prefill_forward(np.array([seq[:150]]), page_table=pt, kv_cache=kv, prompt_lens=[150])
    np.testing.assert_allclose(logits[0, 0], _reference(cfg, params, seq[:150])[-1], rtol=1e-4, atol=1e-4)
    out = gen.decode_forward([seq[150]], [150], page_table=pt, kv_cache=kv, enable_trace=False)
    np.testing.assert_allclose(out[0, 0], _reference(cfg, params, seq[:151])[-1], rtol=1e-4, atol=1e-4)
    # prefix caching: the first 64 positions are resident; the prompt continues to 199
    logits = gen.prefill_forward(np.array([seq[:199]]), page_table=pt, kv_cache=kv, prompt_lens=[199],
                                 start_pos=[64])
    np.testing.assert_allclose(logits[0, 0], _reference(cfg, params, seq[:199])[-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        gen.prefill_forward(np.array([seq[:199]]), page_table=pt, kv_cache=kv, prompt_lens=[199], start_pos=[50])


# ------------------------------------------------------------------------------- page tables
def test_chunked_prefill_page_tables_stop_at_the_prompt():
    cfg = families.config_from_hf(LLAMA)
    ex = RecordingExecutor(cfg)
    gen = _generator(G.LlamaForCausalLM, cfg, [ex], 2, max_prefill_chunk_size=128)
    kv = gen.allocate_kv_cache((40, cfg.num_kv_heads, BS, cfg.head_dim), None, cfg.num_layers)
    row = np.arange(100, 116, dtype=np.int32) % 40  # a vLLM row: 16 entries, stale ones past the prompt
    gen.prefill_forward(np.zeros((1, 300), np.int32), page_table=np.stack([row, row])[:1], kv_cache=kv,
                        prompt_lens=[300], empty_slots=[1])
    calls = [c for c in ex.calls if c[0] == "prefill"]
    assert len(calls) == 3  # 300 pads to 384 (the lowering's rule) = 3 chunks of 128
    user = calls[0][2]["page_tables"][0]
    np.testing.assert_array_equal(user[0, :10], row[:10])  # ceil(300 / 32) = 10 blocks of the prompt
    assert (user[0, 10:] == -1).all() and user.shape == (1, 12)
    for c, (_, toks, kw) in enumerate(calls):
        assert kw["chunk_start"] == 128 * c and toks.shape == (1, 128)
        np.testing.assert_array_equal(kw["chunk_page_tables"][0], user[:, 4 * c:4 * c + 4])
    assert [kw["valid_seq_len"] for _, _, kw in calls] == [128, 128, 44]
    assert calls[-1][2]["last_token_idx"] == 299 - 256


def test_padded_prefill_tail_ownership(llama):
    """#56324: tt-metal's per-user page table sends the pad tail into the row's stale block of another
    request; the ownership check refuses it before anything is written. The safe table skips the tail."""
    cfg, params = llama
    gen = _generator(G.LlamaForCausalLM, cfg, [JaxPagedExecutor(cfg, params)], 2)
    kv = gen.allocate_kv_cache((8, cfg.num_kv_heads, BS, cfg.head_dim), np.float32, cfg.num_layers)
    alloc = pc.BlockAllocator(8)
    alloc.allocate("old", 4)  # blocks 0..3 hold another request's KV
    alloc.allocate("new", 2)  # blocks 4, 5
    gen.track_block_ownership([alloc], ["new", "old"])
    row = np.array([[4, 5, 2, 3]], np.int32)  # vLLM's row: 2 own blocks, then stale entries
    tokens = np.arange(40, dtype=np.int32)[None] % 64
    gen.prefill_page_table_mode = "tt"
    with pytest.raises(pc.BlockOwnershipError, match="request 'old'"):
        gen.prefill_forward(tokens, page_table=row, kv_cache=kv, prompt_lens=[40])
    assert all(not a.any() for layer in kv[0] for a in layer)
    gen.prefill_page_table_mode = "safe"
    gen.prefill_forward(tokens, page_table=row, kv_cache=kv, prompt_lens=[40])
    touched = {b for layer in kv[0] for a in layer for b in range(8) if a[b].any()}
    assert touched == {4, 5}


def test_per_layer_page_tables_are_split_per_dp_submesh():
    cfg = families.config_from_hf(LLAMA)
    exs = [RecordingExecutor(cfg) for _ in range(2)]
    gen = _generator(G.GptOssForCausalLM, cfg, exs, 4)
    kv = gen.allocate_kv_cache((8, cfg.num_kv_heads, BS, cfg.head_dim), None, cfg.num_layers)
    pts = [np.arange(16, dtype=np.int32).reshape(4, 4) + 10 * layer for layer in range(2)]
    pts = [p % 8 for p in pts]
    gen.decode_forward(np.array([1, 2, 3, 4]), np.array([0, 5, 9, -1]), kv_cache=kv, page_tables_per_layer=pts)
    for i, ex in enumerate(exs):
        _, (tok, pos), kw = ex.calls[-1]
        np.testing.assert_array_equal(tok, [1 + 2 * i, 2 + 2 * i])
        np.testing.assert_array_equal(pos, [[0, 5], [9, -1]][i])
        for layer in range(2):
            np.testing.assert_array_equal(kw["page_tables"][layer], pts[layer][2 * i:2 * i + 2])
        assert kw["kv_cache"] is kv[i]
    with pytest.raises(pc.PagedCacheError, match="does not split evenly"):
        gen.decode_forward(np.arange(3), np.arange(3), kv_cache=kv, page_tables_per_layer=[p[:3] for p in pts],
                           enable_trace=False)
    with pytest.raises(ValueError, match="2 layers"):
        gen.decode_forward(np.arange(4), np.arange(4), kv_cache=kv, page_tables_per_layer=pts[:1])


def test_tensor_idx_sharing_in_allocation():
    cfg = families.config_from_hf({**LLAMA, "num_hidden_layers": 4})
    gen = _generator(G.Generator, cfg, [RecordingExecutor(cfg) for _ in range(2)], 2)
    shape = (6, cfg.num_kv_heads, BS, cfg.head_dim)
    kv = gen.allocate_kv_cache_per_layer([(shape, None, 0), (shape, None, 1), (shape, None, 0), (shape, None, 1)])
    for sub in kv:
        assert sub[0] is sub[2] and sub[1] is sub[3] and sub[0] is not sub[1]
    assert kv[0][0][0] is not kv[1][0][0]  # each submesh has its own buffers
    uniform = gen.allocate_kv_cache(shape, None, 4)
    assert len({id(layer[0]) for layer in uniform[0]}) == 4 and uniform[0][0][0].shape == shape
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        gen.allocate_kv_cache((6, 3, BS, cfg.head_dim), None, 4)
    with pytest.raises(ValueError, match="3 per-layer specs"):
        gen.allocate_kv_cache_per_layer([(shape, None, 0)] * 3)


# ------------------------------------------------------------------------------ reload contract
def _recording_gen(dp=1, batch=2):
    cfg = families.config_from_hf(LLAMA)
    exs = [RecordingExecutor(cfg) for _ in range(dp)]
    gen = _generator(G.LlamaForCausalLM, cfg, exs, batch)
    kv = gen.allocate_kv_cache((8, cfg.num_kv_heads, BS, cfg.head_dim), None, cfg.num_layers)
    return gen, exs, kv


GREEDY = SimpleNamespace(temperature=[0.0, 0.0])
PT = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int32)


@pytest.mark.parametrize("flags, exc, msg", [
    (dict(reload_inputs=True, reload_page_table=True), G.ReloadContractError, "only valid without reload_inputs"),
    (dict(reload_inputs=False, reset_sampling_state=True), G.ReloadContractError, "requires reload_inputs"),
    (dict(reload_inputs=True, reload_sampling_params=True), G.ReloadContractError, "no device sampling"),
    (dict(reset_batch=True), TypeError, "reset_batch"),
    (dict(sampling_params=SimpleNamespace(temperature=0.7)), NotImplementedError, "only greedy"),
])
def test_illegal_reload_combinations_raise(flags, exc, msg):
    gen, exs, kv = _recording_gen()
    with pytest.raises(exc, match=msg):
        gen.decode_forward(np.array([1, 2]), np.array([3, 4]), page_table=PT, kv_cache=kv, **flags)
    assert not exs[0].calls


def test_resident_inputs_need_a_device_sampled_step():
    gen, exs, kv = _recording_gen()
    with pytest.raises(G.ReloadContractError, match="no resident decode inputs"):
        gen.decode_forward(None, None, kv_cache=kv, reload_inputs=False)
    gen.decode_forward(np.array([1, 2]), np.array([3, 4]), page_table=PT, kv_cache=kv)  # host sampling
    with pytest.raises(G.ReloadContractError, match="did not sample on device"):
        gen.decode_forward(None, None, kv_cache=kv, reload_inputs=False)
    gen.decode_forward(np.array([1, 2]), np.array([3, 4]), page_table=PT, kv_cache=kv, sampling_params=GREEDY)
    gen.decode_forward(None, None, kv_cache=kv, reload_inputs=False, sampling_params=GREEDY)  # steady: fine
    gen.prefill_forward(np.ones((1, 8), np.int32), page_table=PT[:1], kv_cache=kv, empty_slots=[1])
    with pytest.raises(G.ReloadContractError, match="a prefill came in between"):
        gen.decode_forward(None, None, kv_cache=kv, reload_inputs=False, sampling_params=GREEDY)


def test_steady_device_decode_and_page_table_only_refresh():
    gen, exs, kv = _recording_gen()
    out = gen.decode_forward(np.array([1, 10]), np.array([3, -1]), page_table=PT, kv_cache=kv,
                             sampling_params=GREEDY, reload_sampling_params=True, reset_sampling_state=True)
    np.testing.assert_array_equal(out, [2, 11])
    # steady: the host arguments are stale on purpose and must be ignored
    out = gen.decode_forward(np.array([99, 99]), np.array([77, 77]), page_table=PT[::-1], kv_cache=kv,
                             sampling_params=GREEDY, reload_inputs=False)
    np.testing.assert_array_equal(out, [3, 11])
    _, (tok, pos), kw = exs[0].calls[-1]
    np.testing.assert_array_equal(tok, [2, 10])  # fed back from the previous argmax (inactive row unchanged)
    np.testing.assert_array_equal(pos, [4, -1])  # advanced once; -1 stays inactive
    np.testing.assert_array_equal(kw["page_tables"][0], PT)  # no page-table copy was requested
    new_pt = PT + 0  # the scheduler moved user 0's blocks
    new_pt[0] = [3, 2, 1, 0]
    gen.decode_forward(np.array([99, 99]), np.array([77, 77]), page_table=new_pt, kv_cache=kv,
                       sampling_params=GREEDY, reload_inputs=False, reload_page_table=True)
    _, (tok, pos), kw = exs[0].calls[-1]
    np.testing.assert_array_equal(tok, [3, 10])  # token and position untouched by a page-table-only copy
    np.testing.assert_array_equal(pos, [5, -1])
    np.testing.assert_array_equal(kw["page_tables"][0], new_pt)


def test_page_table_only_refresh_with_the_real_cache(llama):
    """Blocks are moved between steps: refreshing only the page table keeps greedy decoding identical to
    the host-authoritative run; skipping the refresh writes into freed blocks and the ownership check fires."""
    cfg, params = llama

    def run(refresh: bool):
        gen = _generator(G.LlamaForCausalLM, cfg, [JaxPagedExecutor(cfg, params)], 1)
        kv = gen.allocate_kv_cache((12, cfg.num_kv_heads, BS, cfg.head_dim), np.float32, cfg.num_layers)
        alloc = pc.BlockAllocator(12)
        gen.track_block_ownership([alloc], ["u"])
        alloc.ensure("u", 64, BS)
        pt = alloc.page_table(["u"], 4)
        gen.prefill_forward(np.array([[5, 9, 1, 7, 3]]), page_table=pt, kv_cache=kv, prompt_lens=[5])
        toks = [int(gen.decode_forward([2], [5], page_table=pt, kv_cache=kv, sampling_params=GREEDY)[0])]
        toks.append(int(gen.decode_forward(None, None, kv_cache=kv, sampling_params=GREEDY, reload_inputs=False)[0]))
        # move the request: copy its blocks to fresh ones, free the old ones
        old = alloc.blocks_of("u")
        alloc.release("u")
        alloc.allocate("x", 2)  # someone else takes the old blocks
        new = alloc.allocate("u", 2)
        for layer in kv[0]:
            for a in layer:
                a[new] = a[old]
        pt2 = alloc.page_table(["u"], 4)
        for _ in range(3):
            toks.append(int(gen.decode_forward(None, None, page_table=pt2 if refresh else None, kv_cache=kv,
                                               sampling_params=GREEDY, reload_inputs=False,
                                               reload_page_table=refresh)[0]))
        return toks

    seq = [5, 9, 1, 7, 3, 2]
    want = []
    for _ in range(5):  # host-authoritative greedy reference on the full sequence
        nxt = int(np.argmax(_reference(cfg, params, seq)[-1]))
        want.append(nxt)
        seq.append(nxt)
    assert run(refresh=True) == want
    with pytest.raises(pc.BlockOwnershipError, match="would write physical block 0, a free block"):
        run(refresh=False)


def test_slot_remap():
    gen, exs, kv = _recording_gen(dp=2, batch=4)
    pt = np.arange(16, dtype=np.int32).reshape(4, 4) % 8
    gen.decode_forward(np.array([1, 2, 3, 4]), np.array([10, 20, 30, 40]), page_table=pt, kv_cache=kv,
                       sampling_params=GREEDY)
    gen.decode_forward(None, None, kv_cache=kv, sampling_params=GREEDY, reload_inputs=False,
                       slot_remap=[1, 0, 2, 3])
    np.testing.assert_array_equal(exs[0].calls[-1][1][0], [3, 2])  # slots 0 and 1 swapped, applied once
    np.testing.assert_array_equal(exs[0].calls[-1][1][1], [21, 11])
    np.testing.assert_array_equal(exs[1].calls[-1][1][0], [4, 5])
    with pytest.raises(ValueError, match="across data-parallel submesh 0"):
        gen.decode_forward(None, None, kv_cache=kv, sampling_params=GREEDY, reload_inputs=False,
                           slot_remap=[2, 1, 0, 3])
    with pytest.raises(ValueError, match="permutation"):
        gen.decode_forward(None, None, kv_cache=kv, sampling_params=GREEDY, reload_inputs=False,
                           slot_remap=[0, 0, 2, 3])


# ------------------------------------------------------------------------------------ trace
def test_trace_replay_refuses_shape_and_buffer_changes():
    gen, exs, kv = _recording_gen(batch=4)
    pt = np.arange(16, dtype=np.int32).reshape(4, 4) % 8
    gen.decode_forward(np.arange(4), np.arange(4), page_table=pt, kv_cache=kv)  # capture
    gen.decode_forward(np.arange(4), np.arange(4) + 1, page_table=pt, kv_cache=kv)  # replay, same shapes
    n = len(exs[0].calls)
    with pytest.raises(G.TraceReplayError, match=r"tokens as shape \(4,\), replayed with \(2,\)"):
        gen.decode_forward(np.arange(2), np.arange(2), page_table=pt[:2], kv_cache=kv)
    with pytest.raises(G.TraceReplayError, match=r"page_table\[0\] as shape \(4, 4\), replayed with \(4, 6\)"):
        gen.decode_forward(np.arange(4), np.arange(4), page_table=np.zeros((4, 6), np.int32), kv_cache=kv)
    other = gen.allocate_kv_cache((8, 2, BS, 8), None, 2)
    with pytest.raises(G.TraceReplayError, match="different KV-cache buffers"):
        gen.decode_forward(np.arange(4), np.arange(4), page_table=pt, kv_cache=other)
    assert len(exs[0].calls) == n  # refused before running
    gen.decode_forward(np.arange(2), np.arange(2), page_table=pt[:2], kv_cache=kv, enable_trace=False)  # untraced
    gen.release_trace()
    gen.decode_forward(np.arange(2), np.arange(2), page_table=pt[:2], kv_cache=other)  # a new capture
    with pytest.raises(G.TraceReplayError):
        gen.decode_forward(np.arange(4), np.arange(4), page_table=pt, kv_cache=other)


def test_page_table_too_narrow_for_the_position():
    gen, exs, kv = _recording_gen()
    with pytest.raises(ValueError, match="cannot address position 128"):
        gen.decode_forward(np.array([1, 2]), np.array([128, 3]), page_table=PT, kv_cache=kv)


# ------------------------------------------------------------------------- vLLM-facing surface
def test_kv_cache_spec_for_hybrid_models():
    vcfg = SimpleNamespace(model_config=SimpleNamespace(hf_config={"text_config": GEMMA3}, dtype="bfloat16"),
                           cache_config=SimpleNamespace(block_size=BS))
    specs = G.Gemma3ForCausalLM.get_kv_cache_spec(vcfg)
    assert list(specs) == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert all(type(s) is G.FullAttentionSpec for s in specs.values())  # tt-metal's current default
    assert specs["model.layers.0.self_attn"] == G.FullAttentionSpec(BS, 2, 8, "bfloat16")
    hybrid = G.Gemma3ForCausalLM.get_kv_cache_spec(vcfg, hybrid_kv_cache_groups=True)
    assert [type(s).__name__ for s in hybrid.values()] == ["SlidingWindowSpec", "FullAttentionSpec",
                                                            "SlidingWindowSpec"]
    assert hybrid["model.layers.2.self_attn"].sliding_window == 40
    assert hybrid["model.layers.1.self_attn"].page_size_bytes == 2 * BS * 2 * 8 * 2  # K and V, bf16
    groups = G.kv_cache_groups(hybrid)  # derived: one group per distinct spec
    assert [names for _, names in groups] == [["model.layers.0.self_attn", "model.layers.2.self_attn"],
                                              ["model.layers.1.self_attn"]]
    dense = SimpleNamespace(model_config=SimpleNamespace(hf_config=LLAMA), cache_config=vcfg.cache_config)
    specs = G.LlamaForCausalLM.get_kv_cache_spec(dense, hybrid_kv_cache_groups=True)  # no layer_types needed
    assert set(specs.values()) == {G.FullAttentionSpec(BS, 2, 8, "bfloat16")} and len(specs) == 2


def test_initialize_capabilities_and_token_budgets():
    made = []

    def factory(cfg, submesh, max_batch_size, max_seq_len, optimizations):
        made.append((submesh.get_num_devices(), max_batch_size, optimizations))
        return RecordingExecutor(cfg)

    gen = G.LlamaForCausalLM.initialize_vllm_model(LLAMA, G.EmulatedMesh((1, 4)), 64, 4096, n_layers=1,
                                                   tt_data_parallel=2, executor_factory=factory)
    assert made == [(2, 32, "performance")] * 2 and gen.data_parallel == 2 and gen.config.num_layers == 1
    with pytest.raises(ValueError, match="does not split"):
        G.LlamaForCausalLM.initialize_vllm_model(LLAMA, G.EmulatedMesh((1, 4)), 63, 4096, tt_data_parallel=2,
                                                 executor_factory=factory)
    with pytest.raises(ValueError, match="executor_factory"):
        G.LlamaForCausalLM.initialize_vllm_model(LLAMA, G.EmulatedMesh((1, 1)), 1, 4096)
    with pytest.raises(ValueError, match="3 data-parallel submeshes"):
        G.create_submeshes(G.EmulatedMesh((1, 4)), 3)
    assert G.LlamaForCausalLM.decode_input_update_contract == 1
    # the emulated TT program prefills from a cached prefix; sliding models do not advertise it (rings cannot)
    for cls in (G.LlamaForCausalLM, G.QwenForCausalLM):
        assert cls.model_capabilities["supports_prefix_caching"] is True
    for cls in (G.Gemma3ForCausalLM, G.GptOssForCausalLM):
        assert cls.model_capabilities["supports_prefix_caching"] is False
    for caps in (G.LlamaForCausalLM.model_capabilities, G.GptOssForCausalLM.model_capabilities):
        assert not caps.get("supports_async_decode") and not caps.get("supports_sample_on_device")
    assert G.LlamaForCausalLM.get_max_tokens_all_users("meta-llama/Llama-3.1-8B-Instruct", 1, 1) == 32_768
    assert G.LlamaForCausalLM.get_max_tokens_all_users("meta-llama/Llama-3.1-8B-Instruct", 2, 1) == 131_072
    assert G.MistralForCausalLM.get_max_tokens_all_users("Mistral-7B-Instruct-v0.3", 2, 2) == 65_536
    assert G.Gemma3ForCausalLM.get_max_tokens_all_users("google/gemma-3-4b-it", 4, 2) == 65_536
    assert G.QwenForCausalLM.get_max_tokens_all_users("Qwen/Qwen3-8B", 1, 1, is_wormhole=False) == 131_072


def test_padded_prefill_lengths():
    """One rule: the generator pads prompts exactly as the lowering builds its prefill programs."""
    from tt_backend.lowering import TTConstraintError, padded_prefill_len

    lens = (1, 128, 129, 300, 1024, 1025, 3000, 4100)
    assert [G.get_padded_prefill_len(n) for n in lens] == [128, 128, 256, 384, 1024, 1152, 3072, 4224]
    assert [G.get_padded_prefill_len(n) for n in lens] == [padded_prefill_len(n) for n in lens]
    with pytest.raises(TTConstraintError, match="at least one token"):
        G.get_padded_prefill_len(0)
    assert G.get_max_prefill_chunk_size(512, 128) == 128
    assert G.get_max_prefill_chunk_size(384, 256) == 128  # 256 does not divide 384
    assert G.get_max_prefill_chunk_size(100, 128) == 100
    with pytest.raises(ValueError, match="multiples of 128"):
        G.get_max_prefill_chunk_size(300, 128)




# ------------------------------------------------------------------------ emulated TT program
LLAMA32 = {**LLAMA, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def test_emulated_tt_program_through_the_generator():
    """The default executor (the NumPy emulation of the lowered TT program, exact numerics) behind two DP
    submeshes: prefill and decode logits equal jm.forward (tests/tt/test_generator_paged.py: per-layer tables,
    rings, prefix caching)."""
    import jaxmodels as jm

    cfg = families.config_from_hf(LLAMA32)
    params = _params(cfg, 7)
    gen = G.LlamaForCausalLM.initialize_vllm_model(LLAMA32, G.EmulatedMesh((1, 2)), 4, 256, tt_data_parallel=2,
                                                   model=jm.Model(cfg, params), numerics="exact")
    assert all(isinstance(m, VLLMExecutor) for m in gen.model)
    kv = gen.allocate_kv_cache((16, 1, BS, 32), np.float32, 2)
    allocs = [pc.BlockAllocator(16, order=np.random.default_rng(8 + s).permutation(16)) for s in range(2)]
    reqs = ["p", "q", "r", "s"]
    gen.track_block_ownership(allocs, reqs)
    lens, steps = [20, 50, 7, 33], 3
    seqs = [list(np.random.default_rng(20 + i).integers(0, 64, n + steps)) for i, n in enumerate(lens)]
    for s, n in enumerate(lens):
        allocs[s // 2].ensure(reqs[s], n + steps, BS)
    pt = np.concatenate([allocs[s // 2].page_table([reqs[s]], 8) for s in range(4)])
    tokens = np.zeros((4, 50), np.int32)
    for s, n in enumerate(lens):
        tokens[s, :n] = seqs[s][:n]
    logits = gen.prefill_forward(tokens, page_table=pt, kv_cache=kv, prompt_lens=lens)
    refs = [_reference(cfg, params, seqs[s]) for s in range(4)]
    for s, n in enumerate(lens):
        np.testing.assert_allclose(logits[s, 0], refs[s][n - 1], rtol=1e-4, atol=1e-4)
    for t in range(steps):
        pos = np.array(lens) + t
        out = gen.decode_forward(np.array([seqs[s][pos[s]] for s in range(4)]), pos, page_table=pt, kv_cache=kv)
        for s in range(4):
            np.testing.assert_allclose(out[s, 0], refs[s][pos[s]], rtol=1e-4, atol=1e-4)
    # the older name wraps an emulator already built into the same executor
    assert isinstance(G.EmulatorExecutor(gen.model[0].executor), VLLMExecutor)


def test_layers_sharing_a_buffer_must_not_share_blocks():
    cfg = families.config_from_hf(LLAMA)
    gen = _generator(G.Generator, cfg, [RecordingExecutor(cfg)], 2)
    shape = (8, cfg.num_kv_heads, BS, cfg.head_dim)
    kv = gen.allocate_kv_cache_per_layer([(shape, None, 0), (shape, None, 0)])
    a = np.array([[0, 1], [2, 3]], np.int32)
    b = np.array([[4, 5], [6, 7]], np.int32)
    gen.decode_forward(np.array([1, 2]), np.array([3, 40]), kv_cache=kv, page_tables_per_layer=[a, b])
    with pytest.raises(pc.PagedCacheError, match="layers 0 and 1 share a KV buffer"):
        gen.decode_forward(np.array([1, 2]), np.array([3, 40]), page_table=a, kv_cache=kv, enable_trace=False)
    with pytest.raises(pc.PagedCacheError, match="both write block 1"):
        gen.prefill_forward(np.ones((1, 40), np.int32), kv_cache=kv, page_tables_per_layer=[a[:1], b[:1] * 0 + 1])
    gen.prefill_forward(np.ones((1, 40), np.int32), kv_cache=kv, page_tables_per_layer=[a[:1], b[:1]])
