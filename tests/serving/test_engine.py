"""The engine against `jm.generate` (the path it replaces): many concurrent requests of different lengths give the
same greedy tokens, with prefix caching on and off, chunked prefill on and off, and with preemption forced by a tiny
pool; prefix caching hits in every cache group, sliding windows included; seeded sampling is reproducible whatever
else runs; penalties and logprobs match a reference computed from `jm.forward`; every block is free at the end."""
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import model as M, sampling
from serving import Engine, EngineConfig, LLM, SamplingParams
from serving.runner import _filter
from tests.test_paged_cache import _config

NEW = 10


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _model(name):
    cfg = _config(name)
    return jm.Model(cfg, M.init_params(cfg, seed=1, std=0.05))


def _prompts(vocab, seed=0):
    """Lengths around the tiny configs' windows (6) and block sizes; most share a 24-token prefix (prefix hits)."""
    rng = np.random.default_rng(seed)
    shared = list(map(int, rng.integers(0, vocab, 24)))
    out = [shared + list(map(int, rng.integers(0, vocab, n))) for n in (1, 9, 30, 5)]
    out += [list(map(int, rng.integers(0, vocab, n))) for n in (3, 17, 41)]
    return out + [shared[:13], shared + out[2][24:40]]


def _run(engine, prompts, params):
    got = {}
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params[i] if isinstance(params, list) else params)
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert all(engine.pool.used(s) == 0 for s in range(len(engine.pool.spaces))), "blocks leaked"
    return [got.get(str(i), []) for i in range(len(prompts))]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
CASES = [  # (family, block size, engine options)
    ("llama", 4, {}),
    ("llama", 4, {"enable_prefix_caching": False}),
    ("llama", 4, {"enable_chunked_prefill": False, "max_num_batched_tokens": 16}),
    ("llama", 4, {"kv_blocks": 24}),  # fewer than the requests need at once: preemption
    ("llama", 4, {"async_scheduling": False}),  # no host/device overlap (the others overlap)
    ("gemma3", 3, {}),  # window 6: rings of 2 blocks wrap, and copy-on-write
    ("gemma3", 3, {"enable_chunked_prefill": False}),
    ("gpt_oss", 2, {"max_num_batched_tokens": 7}),  # sinks; sliding and full layers share one pool
    ("gpt_oss", 2, {"max_num_batched_tokens": 21}),  # 3 chunks in a launch of 4 rows: a padded row of length 0
    ("deepseek_v4", 4, {}),  # compressed + indexer + window groups; no prefix caching (per-sequence state)
    # chunks of at most 5 tokens where M.extend runs DeepSeek (whole prompts where it does not); off; preemption
    ("deepseek_v4", 4, {"max_num_batched_tokens": 5}),
    ("deepseek_v4", 4, {"max_num_batched_tokens": 48}),  # a padded row of length 0 beside rows with state
    ("deepseek_v4", 4, {"enable_chunked_prefill": False}),
    ("deepseek_v4", 4, {"kv_blocks": 16}),
]


@pytest.mark.parametrize("name,block,opts", CASES, ids=[f"{n}-{'-'.join(o) or 'default'}" for n, _, o in CASES])
def test_greedy_equals_generate(name, block, opts):
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    if name.startswith("deepseek"):  # whole prompts (no chunks): short ones keep to one compiled shape
        prompts = [p[-16:] for p in prompts]
    want = jm.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True).tokens
    config = {"max_num_seqs": 4, "max_model_len": 96, "kv_blocks": 160, "block_size": block,
              "max_num_batched_tokens": 24, **opts}
    engine = Engine(model, EngineConfig(**config))
    got = _run(engine, prompts, GREEDY)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"request {i} (prompt {len(prompts[i])} tokens)"
    stats = engine.stats()
    if "kv_blocks" in opts:
        assert stats["preemptions"] > 0, "the tiny pool was meant to force preemption"
    if engine.pool.prefix_caching and engine.scheduler.chunked:  # whole prompts write over their own ring blocks
        assert all(rate > 0 for rate in stats["prefix_hit_rate"].values()), stats["prefix_hit_rate"]
        assert stats["cached_prompt_tokens"] > 0
    assert (name != "deepseek_v4") == engine.pool.prefix_caching or not config.get("enable_prefix_caching", True)


@pytest.mark.parametrize("name,block,opts", [("llama", 4, {}), ("gemma3", 3, {"enable_chunked_prefill": False})])
def test_preemption_recomputes_the_same_tokens(name, block, opts):
    """Four requests that each grow to 50 tokens in a pool that holds about two of them."""
    model = _model(name)
    prompts = [p[:10] for p in _prompts(model.config.vocab_size)[4:8]]
    want = jm.generate(model, prompts, max_new_tokens=40, ignore_eos=True).tokens
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=56, kv_blocks=-(-56 // block) + 12,
                                        block_size=block, **opts))
    got = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert engine.stats()["preemptions"] > 0
    assert got == want


def test_sliding_groups_keep_their_prefix_hits():
    """A prompt longer than the window that repeats an earlier one is served from the cache in both groups (a
    known failure of hybrid allocators: hits drop to 0 once the window has moved on)."""
    model = _model("gemma3")
    prompt = list(map(int, np.random.default_rng(3).integers(0, model.config.vocab_size, 40)))
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=96, kv_blocks=64, block_size=3))
    first = _run(engine, [prompt], GREEDY)
    before = list(engine.pool.hits)
    second = _run(engine, [prompt], GREEDY)
    assert first == second
    assert engine.stats()["cached_prompt_tokens"] == 39 // 3 * 3
    ring = [i for i, g in enumerate(engine.pool.groups) if g.ring]
    assert ring and all(engine.pool.hits[i] - before[i] == engine.pool.groups[i].entries for i in ring)


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it():
    model = _model("llama")
    prompts = _prompts(model.config.vocab_size)
    hot = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=s, max_tokens=NEW, ignore_eos=True)
           for s in range(len(prompts))]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=96, kv_blocks=160, block_size=4))
    together = _run(engine, prompts, hot)
    alone = _run(engine, prompts[2:3], hot[2:3])
    mixed = _run(engine, prompts[:4], [GREEDY, GREEDY, hot[2], GREEDY])
    assert together[2] == alone[0] == mixed[2]
    other = _run(engine, prompts[2:3], [SamplingParams(temperature=0.9, seed=99, max_tokens=NEW, ignore_eos=True)])
    assert other[0] != alone[0]
    assert len({tuple(t) for t in together}) == len(prompts)


def test_row_filters_equal_the_reference_filters():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1, 64)) * 3, jnp.float32)
    for k, p, m in [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (10, 0.8, 0.05), (0, 1.0, 0.0)]:
        want = sampling.filter_logits(x, sampling.Sampling(1.0, k or None, p if p < 1 else None, m or None))
        got = _filter(x, jnp.array([k]), jnp.array([p]), jnp.array([m]))
        np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=f"top_k={k} top_p={p} min_p={m}")


def test_penalties_and_logprobs_match_the_full_forward():
    model = _model("llama")
    cfg, prompt = model.config, _prompts(model.config.vocab_size)[2]
    p = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, presence_penalty=0.7, frequency_penalty=1.3,
                       logprobs=3)
    llm = LLM(model, max_num_seqs=2, max_model_len=96, kv_blocks=64, block_size=4)
    out = llm.generate([prompt, prompt[:7]], [p, GREEDY], use_tqdm=False)[0].outputs[0]
    seq, counts = list(prompt), np.zeros(cfg.vocab_size)
    for t, lp in zip(out.token_ids, out.logprobs):
        logits = np.asarray(M.forward(model.params, cfg, jnp.asarray([seq])))[0, -1]
        want = int(np.argmax(logits - 1.3 * counts - 0.7 * (counts > 0)))
        assert t == want
        ref = np.asarray(jax.nn.log_softmax(logits))
        assert abs(lp.logprob - ref[t]) < 1e-4
        assert [i for i, _ in lp.top] == list(np.argsort(-ref)[:3])
        seq.append(t)
        counts[t] += 1
    assert len(out.token_ids) == NEW and out.finish_reason == "length"


def test_abort_frees_every_block_and_bad_requests_are_refused():
    model = _model("llama")
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=64, kv_blocks=64, block_size=4))
    prompts = _prompts(model.config.vocab_size)
    for i, pr in enumerate(prompts[:3]):
        engine.add(str(i), pr, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.pool.used(0) > 0
    assert engine.abort("0") and engine.abort("2") and not engine.abort("nope")
    while engine.has_work():
        engine.step()
    assert engine.pool.used(0) == 0 and not engine.requests
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add("long", [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add("bad", [model.config.vocab_size], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="kv_blocks"):
        Engine(model, EngineConfig(max_model_len=64, kv_blocks=3, block_size=4))


def test_compiled_shapes_stay_bounded():
    model = _model("llama")
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=96, kv_blocks=160, block_size=4))
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, n))) for n in rng.integers(1, 60, 24)]
    from serving.runner import bucket, chunk_width, row_groups

    steps, run, launch = [], engine.runner.run, engine._launch
    engine._launch = lambda batch: steps.append([]) or launch(batch)
    engine.runner.run = lambda how, pieces, table: steps[-1].append((how, list(pieces))) or run(how, pieces, table)
    _run(engine, prompts, GREEDY)
    chunk_shapes, grouped = set(), 0
    for launches in steps:  # each step's chunks launched as `row_groups` split them, each at its row bucket
        chunks = [pieces for how, pieces in launches if how == "extend"]
        assert chunks == row_groups([p for g in chunks for p in g], cap=4, max_tokens=engine.launch_tokens)
        chunk_shapes |= {("extend", bucket(len(g), 1, 4), chunk_width(max(k for *_, k in g))) for g in chunks}
        grouped += len(chunks) > 1 or any(len(g) > 1 for g in chunks)
    assert grouped > 3, f"only {grouped} steps launched several chunks: too few to test the grouping"
    shapes = {(how, P, T) for how, P, T, *_ in engine.runner.shapes}
    assert {s for s in shapes if s[0] == "extend"} == chunk_shapes
    # chunks: 1, 2 or 4 rows (at most max_num_seqs) x 16, 32 or 64 tokens; decode: 4 rows (the minimum bucket of 8,
    # capped at max_num_seqs)
    bound = {("extend", P, T) for P in (1, 2, 4) for T in (16, 32, 64)} | {("decode", 4, 1)}
    assert shapes <= bound, shapes
    assert 0 < engine.runner.compile_s < engine.runner.dispatch_s  # the first call of each shape, not every call


def _partitions(items):
    """Every set partition of items (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


@pytest.mark.parametrize("n,cap,max_tokens", [(1, None, None), (2, None, None), (3, None, None), (5, 4, None),
                                              (6, None, None), (6, 6, None), (7, 6, None), (7, 3, None),
                                              (5, None, 1024), (6, 6, 512), (7, 3, 2048)])
def test_row_groups_find_the_cheapest_launches_of_all_groupings(n, cap, max_tokens):
    """Against every way to split the chunks into launches of at most cap rows and, with several rows, at most
    max_tokens padded tokens (not just runs of the sorted order); cap need not be a power of two, and may be below
    the chunk count."""
    from serving.runner import bucket, chunk_width, launch_cost, row_groups

    def allowed(g):
        padded = bucket(len(g), 1, cap) * chunk_width(max(p[2] for p in g))
        return len(g) <= (cap or n) and (len(g) == 1 or not max_tokens or padded <= max_tokens)

    for seed in range(12):
        rng = np.random.default_rng(100 * n + seed)
        pieces = [(f"r{i}", 0, int(k)) for i, k in enumerate(rng.integers(1, 600, n))]
        groups = row_groups(pieces, cap, max_tokens)
        assert sorted(p for g in groups for p in g) == sorted(pieces)
        assert all(map(allowed, groups))
        best = min(sum(launch_cost(g, cap) for g in part) for part in _partitions(pieces) if all(map(allowed, part)))
        assert sum(launch_cost(g, cap) for g in groups) == best


@pytest.mark.parametrize("rows,budget,max_chunk", [(64, 2048, 2048), (64, 2048, 113), (6, 512, 512), (1, 64, 64)])
def test_launch_shapes_hold_every_launch_of_every_step(rows, budget, max_chunk):
    """Random steps (chunks under the budget, at most max_chunk tokens each, at most `rows` of them), grouped as the
    engine groups them: every launch's shape is one `launch_shapes` lists (what `Engine.warmup` compiles)."""
    from serving.runner import bucket, chunk_width, launch_shapes, row_groups

    max_tokens = 2 * chunk_width(budget)
    shapes = launch_shapes(rows, max_chunk, max_tokens)
    chunk, seen = set(shapes["chunk"]), set()
    rng = np.random.default_rng(rows + budget)
    for _ in range(3000):
        left, pieces = budget, []
        while left > 0 and len(pieces) < rows:  # a step's chunks: long, short or a mix, as the budget allows
            k = int(min(left, max_chunk, rng.integers(1, rng.choice([16, 200, max_chunk]) + 1)))
            pieces.append((len(pieces), 0, k))
            left -= k
            if rng.random() < 0.2:
                break
        for g in row_groups(pieces, cap=rows, max_tokens=max_tokens):
            seen.add((bucket(len(g), 1, rows), chunk_width(max(p[2] for p in g))))
    assert seen <= chunk, seen - chunk
    assert len(seen) > len(chunk) // 2, "too few shapes met to test the bound"


@pytest.mark.parametrize("name,mesh", [("llama", None), ("gemma3", None), ("gemma3", "data=4,tensor=2")])
def test_warmup_compiles_every_step_a_run_meets(caplog, name, mesh):
    """After `Engine.warmup`, a run of greedy and sampled requests of many lengths, a request with penalties
    among them, compiles (and traces) no step and no copy-on-write of text rows: JAX's own compile log shows only
    the penalized steps (gemma3: sliding-window rings, whose cached blocks are copied; on a mesh too)."""
    from jaxmodels import sharding

    model = _model(name)
    if mesh:
        mesh = sharding.make_mesh(mesh)
        model = jm.Model(model.config, sharding.shard_params(model.params, model.config, mesh), None, mesh)
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=96, kv_blocks=160, max_num_batched_tokens=32,
                                        block_size=3 if name == "gemma3" else 4))  # gemma3: its window of 6
    with pytest.raises(ValueError, match="warm-up sampling must be among"):
        engine.warmup(("greedy", "hot"))
    ticks = []
    n = engine.warmup(("greedy", "sampled"), progress=lambda done, total: ticks.append((done, total)))
    assert n == 2 * len(engine.launch_shapes()) + len(engine.copy_sizes()) and ticks[-1] == (n, n)
    assert len(engine.runner.shapes) == 2 * len(engine.launch_shapes())
    assert engine.warmup("greedy") == 0  # compiled once
    rng = np.random.default_rng(5)
    shared = list(map(int, rng.integers(0, model.config.vocab_size, 20)))  # prefix hits: cached ring blocks
    prompts = [shared[:int(k)] + list(map(int, rng.integers(0, model.config.vocab_size, int(n))))
               for k, n in zip(rng.integers(0, 21, 16), rng.integers(1, 60, 16))]
    hot = SamplingParams(temperature=0.8, max_tokens=NEW, seed=3, ignore_eos=True)
    penalized = SamplingParams(temperature=0, max_tokens=NEW, presence_penalty=0.5, ignore_eos=True)
    params = [penalized if i == 2 else GREEDY if i % 3 else hot for i in range(len(prompts))]
    copies, take = [], engine.pool.take_copies
    engine.pool.take_copies = lambda: copies.append(take()) or copies[-1]
    with caplog.at_level(logging.INFO), jax.log_compiles():
        _run(engine, prompts, params)
    ours = [r.getMessage() for r in caplog.records if r.name == "jaxmodels.serving" and "compiling" in r.getMessage()]
    assert ours and all("penalties=True" in m for m in ours), ours  # only the penalized request's steps were new
    compiled = [m for r in caplog.records if (m := r.getMessage()).startswith(("Compiling jit(step)",
                                                                                  "Compiling jit(copy_blocks)"))]
    assert len(compiled) == len(ours), compiled  # JAX compiled those, once each, and nothing else
    assert (name == "gemma3") == any(copies), "gemma3's rings were meant to copy cached blocks"


@pytest.mark.parametrize("n", [8, 18, 31, 64, 200])
def test_row_groups_launch_every_piece_once_never_worse_than_power_of_two_runs(n):
    from serving.runner import launch_cost, row_groups

    rng = np.random.default_rng(n)
    pieces = [(f"r{i}", 0, int(k)) for i, k in enumerate(rng.integers(1, 2048, n))]
    groups = row_groups(pieces)
    assert sorted(p for g in groups for p in g) == sorted(pieces)
    lengths = [p[2] for g in groups for p in g]
    assert lengths == sorted(lengths, reverse=True)  # a launch's chunks are alike in length
    ordered, runs, i = sorted(pieces, key=lambda p: -p[2]), [], 0
    while i < n:  # the split it replaced: the largest power of two left, longest first
        runs.append(ordered[i:i + (1 << (n - i).bit_length() - 1)])
        i += len(runs[-1])
    assert sum(map(launch_cost, groups)) <= sum(map(launch_cost, runs))


def test_row_groups_keep_a_long_chunk_apart_from_short_ones():
    from serving.runner import row_groups

    pieces = [("a", 0, 1900), ("b", 0, 100), ("c", 0, 48)]
    assert [[p[2] for p in g] for g in row_groups(pieces)] == [[1900], [100, 48]]
    assert [len(g) for g in row_groups([(str(i), 0, 100) for i in range(18)])] == [16, 2]


def test_a_pool_of_one_sequence_never_stalls_on_copy_on_write():
    """Sliding and full groups in one space (GPT-OSS), a pool of exactly one sequence's blocks: wrapping onto a
    cached ring block trades it for its copy, so a lone sequence always finds its next block."""
    from serving.kv_pool import Group, KVPool

    groups = [Group((8, 1), 2, 8, 0, True, True), Group((None, 1), 4, 16, 0, False, True)]
    pool = KVPool(groups, blocks=6, block_size=4)
    seq, tokens = pool.new(), list(range(16))
    for pos in range(16):
        pool.allocate(seq, pos, pos + 1)
        pool.register(seq, tokens, pos + 1)
    assert pool.take_copies(), "the wrap should have copied the cached ring blocks"
    pool.release(seq)
    assert pool.used(0) == 0


def test_a_finished_request_leaves_its_prompt_cached():
    model = _model("llama")
    prompt = _prompts(model.config.vocab_size)[1]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=96, kv_blocks=160, block_size=4))
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    assert _run(engine, [prompt], one) == _run(engine, [prompt], one)
    assert engine.stats()["cached_prompt_tokens"] == (len(prompt) - 1) // 4 * 4
