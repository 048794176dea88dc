"""DeepSeek V4 / V4.1 served through the vLLM-style generator (`generator.DeepseekV4ForCausalLM`, its default
executor `deepseek_emu.DeepSeekVLLMExecutor`) over hybrid paged caches: every cache (window ring, CSA / HCA entries,
indexer keys, compressor state) has its own page table over blocks handed out in a shuffled order, and caches of
one kv_cache_group share one buffer (tensor_idx), so a cache reading another's table or a row off by one reads
someone else's rows.

Request a (245 tokens) is prefilled whole: its window ring (64 tokens) wraps inside the prefill, its first HCA-128
entry and its CSA / HCA-8 entries come from the prefill, its second HCA-128 entry completes in decode. Request b
(70 tokens) is prefilled as its first token and fed the rest of its prompt through decode_forward while a's row
idles (position -1), so every prompt position of b goes through the generator and its ring wraps in decode; then
both decode greedily with their slots swapped (slot_remap: the Engram history and resident inputs follow the
requests). At `exact` numerics the logits at every position equal jm.forward's and the greedy tokens
jm.generate's.

At the performance policy (TT numerics), fed the same tokens: with the exact run's discrete choices (indexer top-k,
candidate blocks, experts) every layer's streams and the logits keep PCC >= 0.99 against the exact run. Left free,
near-tied top-k choices flip (random weights: the k-th and (k+1)-th index scores lie a few % of the scores' spread
apart; the reference's own indexer scores in FP8), and each flip swaps a selected entry: that compounding is
reported by a slower test with a lower floor."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import model as M
from jaxmodels.families import deepseek_v4
from tests.oracles import deepseek_ckpt
from tests.parity.test_deepseek_v4 import V4_TINY
from tests.tt.test_deepseek_lowering import V41_NARROW
from tt_backend import generator as G, paged_cache as pc
from tt_backend.deepseek_emu import DeepSeekVLLMExecutor

BS, MAX_LEN, NEW = 32, 320, 17
LENS = (245, 70)  # a: its prefill wraps the ring (64), decode completes an HCA-128 entry; b: past the ring


def _config(name):
    if name == "v4":  # SWA, CSA 4 (with its own index compressor), HCA 8, HCA 128, CSA 4; hash routing; hc_head
        return deepseek_v4.config({**V4_TINY, "model_type": "deepseek_v4", "compress_ratios": [0, 4, 8, 128, 4]})
    # V4.1: a ratio-4 kv + index source and its reuse layer, a ratio-1 candidate source, a reuse layer and a
    # candidate-filtered reindex; Engram on layers 0 and 1
    return deepseek_v4.config(deepseek_ckpt.tiny_config("v4.1", quantized=False, **V41_NARROW,
                                                        compress_ratios=[0, 4, 4, 1, 1, 1, 0]))


@pytest.fixture(scope="module", params=["v4", "v41"])
def case(request):
    cfg = _config(request.param)
    model = jm.Model(cfg, M.init_params(cfg, 0, std=0.1))
    prompts = [[int(t) for t in np.random.default_rng(1).integers(3, cfg.vocab_size, n)] for n in LENS]
    gen, pool = _generator(model, "exact")
    calls = _record(gen)
    seqs, logits = _serve(gen, pool, prompts)
    return request.param, model, prompts, seqs, logits, calls, pool


def _generator(model, numerics, seed=2):
    cls = G.DeepseekV41ForCausalLM if model.config.engram else G.DeepseekV4ForCausalLM
    gen = cls.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), 2, MAX_LEN, model=model, numerics=numerics,
                                    block_size=BS)
    assert all(isinstance(m, DeepSeekVLLMExecutor) for m in gen.model)
    return gen, Pool(gen, 400, seed)


class Pool:
    """Each cache its own blocks for each request, from one block-id space handed out in a shuffled order; caches of
    one kv_cache_group share a buffer. Rings get their ring's blocks, entry caches one row per `ratio` tokens."""

    def __init__(self, gen, num_blocks, seed):
        specs = G.kv_cache_specs(gen.config, BS, "bfloat16")
        group = {spec: i for i, (spec, _) in enumerate(G.kv_cache_groups(specs))}
        assert len(group) < len(specs)  # some caches do share a buffer
        self.kv = gen.allocate_kv_cache_per_layer(
            {n: ((num_blocks, s.num_kv_heads, BS, s.head_size), np.float32, group[s]) for n, s in specs.items()})
        self.alloc = pc.BlockAllocator(num_blocks, order=np.random.default_rng(seed).permutation(num_blocks))
        self.caches = list(zip(gen.cache_names(), gen.cache_position_modulo(), gen.tokens_per_entry()))
        self.rows: dict = {}

    def add(self, request, tokens):
        self.rows[request] = {n: self.alloc.allocate(request, m // BS if m else -(-(tokens // r) // BS))
                              for n, m, r in self.caches}

    def tables(self, requests):
        """{cache name: int32 [len(requests), W]}, -1 past each request's blocks."""
        out = {}
        for n, m, r in self.caches:
            entries = -(-MAX_LEN // r)
            t = np.full((len(requests), m // BS if m else -(-entries // BS)), -1, np.int32)
            for i, req in enumerate(requests):
                t[i, :len(self.rows[req][n])] = self.rows[req][n]
            out[n] = t
        return out


def _serve(gen, pool, prompts, forced=None):
    """The run the module docstring describes. Returns each request's sequence (prompt + NEW greedy tokens) and
    {position: logits} for every position the generator returned. forced: sequences to feed instead of the argmax."""
    (a, b), reqs = prompts, ["a", "b"]
    for r, p in zip(reqs, prompts):
        pool.add(r, len(p) + NEW)
    gen.track_block_ownership([pool.alloc], reqs)  # reads reqs at each call: the swap below moves them
    tokens = np.zeros((2, len(a)), np.int32)
    tokens[0], tokens[1, 0] = a, b[0]
    out = gen.prefill_forward(tokens, kv_cache=pool.kv, prompt_lens=[len(a), 1],
                              page_tables_per_layer=pool.tables(reqs))[:, 0]
    logits = {"a": {len(a) - 1: out[0]}, "b": {0: out[1]}}
    for p in range(1, len(b)):  # the rest of b's prompt through decode; a's row idles
        out = gen.decode_forward(np.array([0, b[p]]), np.array([-1, p]), kv_cache=pool.kv,
                                 page_tables_per_layer=pool.tables(reqs))[:, 0]
        logits["b"][p] = out[1]
    seqs = {"a": list(a), "b": list(b)}

    def pick(r):
        n = len(seqs[r])
        return forced[r][n] if forced else int(np.argmax(logits[r][n - 1]))

    reqs[:] = ["b", "a"]  # slot 0 now serves b: slot_remap[new] = old
    for step in range(NEW):
        for r in reqs:
            seqs[r].append(pick(r))
        if step == NEW - 1:
            break
        out = gen.decode_forward(np.array([seqs[r][-1] for r in reqs]), np.array([len(seqs[r]) - 1 for r in reqs]),
                                 kv_cache=pool.kv, page_tables_per_layer=pool.tables(reqs),
                                 slot_remap=[1, 0] if step == 0 else None)[:, 0]
        for r, x in zip(reqs, out):
            logits[r][len(seqs[r]) - 1] = x
    return seqs, logits


DISCRETE = re.compile(r"l\d+\.(idx\.sel|cand\.mask|moe\.chosen)$")  # top-k entries, candidate blocks, experts


def _record(gen, pin=None):
    """Every program run's layer outputs (streams after each layer) and logits on the rows that are real, and its
    discrete choices. pin: an earlier run's records, whose discrete choices replace this run's (call by call)."""
    emu, calls = gen.model[0].emu, []
    run = emu._run

    def spy(prog, host, *args, **kw):
        if pin is not None:
            kw["override"] = pin[len(calls)]["choices"]
        t = run(prog, host, *args, **kw)
        rows = (np.flatnonzero(host["cur_pos"] >= 0) if prog.mode == "decode" else
                np.arange(int(host["valid_seq_len"][0])))
        rec = {k: np.asarray(t[k]).reshape(-1, t[k].shape[-1] if k == "logits" else t[k].shape[-2] * t[k].shape[-1])
               [rows] for k in [*prog.meta["layer_outputs"], "logits"]}
        calls.append(rec | {"choices": {k: v for k, v in t.items() if DISCRETE.match(k)}})
        return t

    emu._run = spy
    return calls


def _pcc(a, b):
    return float(np.corrcoef(np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64))[0, 1])


def test_exact_equals_jm_forward_and_generate(case):
    """Logits at every position the generator returned (all of b's prompt, a's last, every decode step) equal
    jm.forward's on the whole sequence; the greedy tokens equal jm.generate's, and they vary."""
    name, model, prompts, seqs, logits, _, pool = case
    want = [list(t) for t in jm.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True).tokens]
    got = [seqs[r][len(p):] for r, p in zip("ab", prompts)]
    assert got == want
    assert all(len(set(g)) >= 4 for g in got), got
    assert sorted(logits["b"]) == list(range(LENS[1] + NEW - 1))  # every prompt position of b
    batch = np.zeros((2, max(map(len, seqs.values())) - 1), np.int32)  # causal: the shorter row's padding is inert
    for i, r in enumerate("ab"):
        batch[i, :len(seqs[r]) - 1] = seqs[r][:-1]
    ref = np.asarray(jm.forward(model, batch))
    err = 0.0
    for i, r in enumerate("ab"):
        pos = sorted(logits[r])
        have = np.stack([logits[r][p] for p in pos])
        np.testing.assert_allclose(have, ref[i, pos], rtol=1e-4, atol=1e-4)
        err = max(err, float(np.abs(have - ref[i, pos]).max()))
    print(f"\n{name}: max |generator - jm.forward| over {sum(map(len, logits.values()))} positions: {err:.2e}")
    # the compressed kinds did fill: the first block of every compressed cache a request has entries in
    buffers = {n: kv[0] for (n, _, _), kv in zip(pool.caches, pool.kv[0])}
    for n, _, r in pool.caches:
        for req, length in zip("ab", LENS):
            if r > 1 and (length + NEW - 1) // r:
                assert np.abs(buffers[n][pool.rows[req][n][0]]).max() > 0, (n, req)


def _tt_numerics(case, pinned: bool):
    """PCC per layer and of the logits (and top-1 agreement) of a performance-policy run through the generator,
    fed the exact run's tokens, against the exact run."""
    name, model, prompts, seqs, _, exact, _ = case
    gen, pool = _generator(model, "full")
    full = _record(gen, exact if pinned else None)
    _serve(gen, pool, prompts, forced=seqs)
    assert len(full) == len(exact)
    cat = lambda calls, k: np.concatenate([c[k] for c in calls])  # noqa: E731
    per_layer = [_pcc(cat(full, f"l{i}.out"), cat(exact, f"l{i}.out")) for i in range(model.config.num_layers)]
    logits = _pcc(cat(full, "logits"), cat(exact, "logits"))
    top1 = float((cat(full, "logits").argmax(-1) == cat(exact, "logits").argmax(-1)).mean())
    flips = [float(np.mean([np.abs(f["choices"][k] - e["choices"][k]).sum(-1).astype(bool).mean()
                            for f, e in zip(full, exact)])) for k in sorted(exact[0]["choices"])]
    print(f"\n{name} TT numerics through the generator ({'discrete choices pinned' if pinned else 'free'}): PCC per "
          f"layer {[round(p, 5) for p in per_layer]}, logits {logits:.5f}, top-1 agreement {top1:.3f}; mean share of "
          f"flipped rows in {sorted(exact[0]['choices'])}: {np.round(flips, 3).tolist()}")
    return per_layer, logits


def test_tt_numerics_pcc_per_layer(case):
    """The performance policy (bf16 activations, bfp8 weights and KV, the fidelity model) with the exact run's
    discrete choices: PCC >= 0.99 for every layer's streams and for the logits."""
    per_layer, logits = _tt_numerics(case, pinned=True)
    assert min(per_layer) >= 0.99 and logits >= 0.99


@pytest.mark.slow
def test_tt_numerics_free_running(case):
    """The same run with its own discrete choices: near-tied top-k choices flip and the error compounds with depth
    (measured: V4 >= 0.995 per layer and logits; V4.1, 6 layers and three indexers, 0.981), so the floor is lower.

    Why no precision choice lifts V4.1 to 0.99 (seed 0, min layer PCC free-running): performance-deepseek 0.9813;
    indexer scores, q/k and its key cache in fp32 at HiFi4 0.9827; bf16 KV 0.9821; HiFi4 SDPA 0.9828; every weight
    bf16 and every matmul HiFi4 0.9875; fp32 activations and weights (HiFi4) 0.9895; and even at `storage`
    numerics (fp32 arithmetic; only wqkv rounded to bf16) 0.9926. At the l1 indexer (prefill, 245 tokens) the gap
    between the 8th and 9th score is a median 5.8 % of the scores' spread (10 % of rows: 0.75 %) while the
    performance run's score noise is 4.4 % of it (layer 0's output is off by 2.3 %, bfp8 experts and bf16
    activations): 41 % of rows have a gap under the noise. Every flip swaps an attended entry, and layers 3 / 5
    read those choices again (candidate blocks, reindexing). The reference itself scores its indexer in FP8
    (DeepSeek's inference code quantizes q and k to e4m3), so its selections are not the float32 ones either;
    jm.forward in bf16 against float32 on the same weights gives logits PCC 0.994 on the 245-token prompt."""
    per_layer, logits = _tt_numerics(case, pinned=False)
    assert min(per_layer) >= 0.97 and logits >= 0.97


# ------------------------------------------------------------------------------------------------- bad inputs
@pytest.fixture(scope="module")
def small():
    """A V4 generator over fresh caches (nothing runs until a check passes)."""
    model = jm.Model(_config("v4"), M.init_params(_config("v4"), 0, std=0.1))
    gen, pool = _generator(model, "exact")
    pool.add("a", 100)
    pool.add("b", 100)
    return gen, pool


def _prefill(gen, pool, n=60, **kw):
    kw = {"kv_cache": pool.kv, "prompt_lens": [n], "page_tables_per_layer": {k: t[:1] for k, t in
                                                                           pool.tables(["a"]).items()}} | kw
    return gen.prefill_forward(np.full((1, n), 5, np.int32), **kw)


def _decode(gen, pool, positions=(60, 50), tables=None):
    return gen.decode_forward(np.array([5, 6]), np.array(positions), kv_cache=pool.kv,
                              page_tables_per_layer=pool.tables(["a", "b"]) if tables is None else tables)


def test_page_tables_are_checked_per_cache(small):
    gen, pool = small
    names, tables = gen.cache_names(), pool.tables(["a", "b"])
    window, hca = names[0], next(n for n in names if n.endswith("layers.3.self_attn.compressor"))
    with pytest.raises(ValueError, match="addressed per kind"):  # one table cannot address entry caches
        gen.decode_forward(np.array([5, 6]), np.array([60, 50]), page_table=tables[window], kv_cache=pool.kv)
    with pytest.raises(ValueError, match=r"missing \[.*layers\.3\.self_attn\.compressor"):
        _decode(gen, pool, tables={k: t for k, t in tables.items() if k != hca})
    with pytest.raises(ValueError, match=f"page table {window}: must be an integer \\[batch, blocks\\]"):
        _decode(gen, pool, tables=tables | {window: tables[window][0]})
    with pytest.raises(ValueError, match="as many rows"):
        _decode(gen, pool, tables=tables | {hca: tables[hca][:1]})
    with pytest.raises(ValueError, match=f"{window}: a page table of 1 blocks of 32 cannot address a ring of 64"):
        _decode(gen, pool, tables=tables | {window: tables[window][:, :1]})
    cstate = next(n for n in names if n.endswith("layers.1.self_attn.compressor.state.a"))  # token-indexed
    with pytest.raises(ValueError, match=f"{cstate}: a page table of 1 blocks of 32 cannot address position 60"):
        _decode(gen, pool, tables=tables | {cstate: tables[cstate][:, :1]})
    holed = tables[cstate].copy()
    holed[1, 0] = -1  # b's first block unallocated: its decode would gather another request's rows
    with pytest.raises(ValueError, match=r"kv\.1\.cstate\.a \(compressor_state\): row 1 needs blocks for 51 tokens"):
        _decode(gen, pool, tables=tables | {cstate: holed})
    with pytest.raises(ValueError, match=r"kv\.1\.cstate\.a \(compressor_state\): row 0 needs blocks for 60 tokens"):
        _prefill(gen, pool, page_tables_per_layer={k: t[:1] for k, t in (tables | {cstate: holed[::-1]}).items()})


def test_prompts_and_positions_out_of_reach_are_refused(small):
    gen, pool = small
    with pytest.raises(ValueError, match=f"max_seq_len\\) = {MAX_LEN}"):
        _prefill(gen, pool, n=MAX_LEN + 1)
    with pytest.raises(ValueError, match="start_pos 20 is not a multiple of the block size 32"):
        _prefill(gen, pool, start_pos=[20])
    with pytest.raises(ValueError, match="20 is not a multiple of 32"):
        gen.prefix_blocks(20)
    with pytest.raises(ValueError, match=f"decode position {MAX_LEN} >= max_seq_len={MAX_LEN}"):
        _decode(gen, pool, positions=(MAX_LEN, 50))


def test_deepseek_needs_its_generator_class_and_caches_by_name(small):
    gen, pool = small
    with pytest.raises(ValueError, match="served by DeepseekV4ForCausalLM"):
        G.Generator(gen.model, max_batch_size=2, max_seq_len=MAX_LEN)
    with pytest.raises(ValueError, match="allocate_kv_cache_per_layer"):
        gen.allocate_kv_cache((10, 1, BS, 64), np.float32, 5)
    specs = G.kv_cache_specs(gen.config, BS, "bfloat16")
    shapes = {n: ((10, 1, BS, s.head_size), np.float32, i) for i, (n, s) in enumerate(specs.items())}
    with pytest.raises(ValueError, match="allocated by name"):
        gen.allocate_kv_cache_per_layer(list(shapes.values()))
    name = gen.cache_names()[1]
    with pytest.raises(ValueError, match=f"{name}: kv_cache_shape .* must be \\[num_blocks, 1, 32, "):
        gen.allocate_kv_cache_per_layer(shapes | {name: ((10, 1, BS, 7), np.float32, 1)})
    with pytest.raises(ValueError, match="one \\[buffer\\] per cache"):
        _decode(gen, SimpleNamespace(kv=[pool.kv[0][:-1]], tables=pool.tables))
