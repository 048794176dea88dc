"""The engine's host side: the overlap of host work with the device step (async scheduling) changes no output —
stop strings, stop ids, max_tokens, aborts and preemption stay exact, and a request that finished gets no extra
token —, step N+1 is dispatched before step N's tokens are read, and only the token ids come back; a waiting
request that cannot be admitted is looked up once (digests kept, hit rates honest, LRU order untouched); the engine
on a device mesh equals the engine on one device; the KV pool sized from a memory fraction."""
import functools
import hashlib

import jax
import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import model as M, sharding
from serving import Engine, EngineConfig, SamplingParams
from serving import engine as engine_lib, kv_pool, runner as R
from serving.kv_pool import Group, KVPool
from serving.request import Request
from serving.scheduler import Scheduler
from tests.serving.conftest import ENGINE
from tests.test_paged_cache import _config


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _model(name):
    cfg = _config(name)
    return jm.Model(cfg, M.init_params(cfg, seed=1, std=0.05))


def _drive(engine, requests, abort_after=None):
    """Run requests [(id, prompt, params)] to the end; abort_after {id: m}: abort once m tokens came out. Checks
    that nothing comes out for a request after it finished or was aborted, and that every block is free at the
    end. -> ({id: tokens}, {id: text}, {id: finish reason})."""
    abort_after = abort_after or {}
    tokens, text, reason = {r[0]: [] for r in requests}, {r[0]: "" for r in requests}, {}
    for rid, prompt, params in requests:
        engine.add(rid, prompt, params)
    while engine.has_work():
        for o in engine.step():
            assert o.request_id not in reason, f"{o.request_id} got {o.token_ids} after it {reason[o.request_id]}"
            tokens[o.request_id] += o.token_ids
            text[o.request_id] += o.text
            if o.finished:
                reason[o.request_id] = o.finish_reason
        for rid, m in abort_after.items():
            if len(tokens[rid]) >= m and rid not in reason:
                assert engine.abort(rid)
                reason[rid] = "abort"
    assert all(engine.pool.used(s) == 0 for s in range(len(engine.pool.spaces))), "blocks leaked"
    assert not engine.requests and not engine.inflight
    return tokens, text, reason


def test_stops_max_tokens_and_aborts_are_exact_with_the_overlap(model):
    """Stop strings, stop ids, max_tokens and an abort, on the tokenizer model: the overlapped engine gives what
    the engine without overlap gives, token for token, and what jm.generate's greedy tokens imply."""
    rng = np.random.default_rng(7)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, n))) for n in (5, 12, 30, 9, 17, 3)]
    want = jm.generate(model, prompts, max_new_tokens=20, ignore_eos=True).tokens
    tok = model.tokenizer
    ctx = lambda i, ids: tok.decode(prompts[i][-5:] + ids)[len(tok.decode(prompts[i][-5:])):]  # noqa: E731
    stop_text = ctx(0, want[0][:8])[-3:]  # ends with what token 8 decodes to: found at token 8 at the latest
    assert stop_text.strip(), "pick a stop string with visible text"
    stop_id = want[1][6]
    greedy = dict(temperature=0, ignore_eos=True)
    requests = [("stop-str", prompts[0], SamplingParams(max_tokens=20, stop=(stop_text,), **greedy)),
                ("stop-id", prompts[1], SamplingParams(max_tokens=20, stop_token_ids=(stop_id,), **greedy)),
                ("len-3", prompts[2], SamplingParams(max_tokens=3, **greedy)),
                ("abort", prompts[3], SamplingParams(max_tokens=20, **greedy)),
                ("len-20", prompts[4], SamplingParams(max_tokens=20, **greedy)),
                ("len-1", prompts[5], SamplingParams(max_tokens=1, **greedy))]
    runs = {}
    for overlap in (False, True):
        engine = Engine(model, EngineConfig(**{**ENGINE.__dict__, "max_num_seqs": 4, "async_scheduling": overlap}))
        runs[overlap] = _drive(engine, requests, abort_after={"abort": 4})
    assert runs[True] == runs[False]
    tokens, text, reason = runs[True]
    k = len(tokens["stop-str"])  # the token that completed the stop string is the last one
    assert tokens["stop-str"] == want[0][:k] and reason["stop-str"] == "stop"
    assert stop_text in ctx(0, want[0][:k]) and stop_text not in ctx(0, want[0][:k - 1])
    assert stop_text not in text["stop-str"]
    assert tokens["stop-id"] == want[1][:want[1].index(stop_id)] and reason["stop-id"] == "stop"
    assert tokens["len-3"] == want[2][:3] and tokens["len-1"] == want[5][:1] and tokens["len-20"] == want[4]
    assert reason["len-3"] == reason["len-1"] == reason["len-20"] == "length"
    assert tokens["abort"] == want[3][:4] and reason["abort"] == "abort"


@pytest.mark.parametrize("name,block,opts", [("llama", 4, {"kv_blocks": 24}), ("gemma3", 3, {})])
def test_the_overlap_gives_the_same_tokens(name, block, opts):
    """Greedy and seeded sampling, with preemption (llama's tiny pool) and sliding-window copy-on-write (gemma3):
    the same tokens with and without the overlap, greedy ones equal to jm.generate."""
    model = _model(name)
    rng = np.random.default_rng(3)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, n))) for n in (4, 19, 33, 7, 26, 12)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10, ignore_eos=True)
              for i in range(len(prompts))]
    requests = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    config = {"max_num_seqs": 4, "max_model_len": 64, "kv_blocks": 96, "block_size": block,
              "max_num_batched_tokens": 24, **opts}
    runs, preempted = {}, {}
    for overlap in (False, True):
        engine = Engine(model, EngineConfig(**config, async_scheduling=overlap))
        runs[overlap] = _drive(engine, requests)[0]
        preempted[overlap] = engine.stats()["preemptions"]
    assert runs[True] == runs[False]
    want = jm.generate(model, prompts[1::2], max_new_tokens=10, ignore_eos=True).tokens
    assert [runs[True][str(i)] for i in range(1, len(prompts), 2)] == want
    if "kv_blocks" in opts:
        assert preempted[True] > 0 and preempted[False] > 0, "the tiny pool was meant to force preemption"


def test_the_next_step_is_dispatched_before_the_tokens_are_read(monkeypatch):
    """With the overlap, each step's tokens are read after the next step is dispatched (the host works while the
    device runs); without it, right after. Only the token ids come back when nobody asks for logprobs. (A step may
    dispatch several launches, `row_groups`: each of its fetches must come after a launch of the next step.)"""
    model = _model("llama")
    events, step_of = [], {}
    run, fetch, launch = R.Runner.run, R.Launched.fetch, Engine._launch

    def recorded_launch(self, batch):
        steps = len({*step_of.values()})
        out = launch(self, batch)
        for x in out:
            step_of[id(x)] = steps
        return out

    def recorded_run(self, *a, **kw):
        launched = run(self, *a, **kw)
        events.append(("run", launched))
        assert len(launched.out) == 1 and launched.out[0].dtype == np.int32 and launched.out[0].ndim == 1
        return launched

    def recorded_fetch(self):
        events.append(("fetch", self))
        return fetch(self)

    monkeypatch.setattr(R.Runner, "run", recorded_run)
    monkeypatch.setattr(R.Launched, "fetch", recorded_fetch)
    monkeypatch.setattr(Engine, "_launch", recorded_launch)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, 6))) for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for overlap in (True, False):
        events.clear()
        step_of.clear()
        engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=32, kv_blocks=32, block_size=4,
                                            async_scheduling=overlap))
        _drive(engine, [(str(i), p, greedy) for i, p in enumerate(prompts)])
        late = {}  # step -> for each of its fetches, whether a later step was dispatched before it
        for j, (kind, x) in enumerate(events):
            if kind == "fetch":
                s = step_of[id(x)]
                late.setdefault(s, []).append(any(step_of[id(y)] > s for k, y in events[:j] if k == "run"))
        assert len(late) >= 8 and set(late) == set(step_of.values())
        last = max(late)
        if overlap:  # every fetch but the last step's waits until the next step is on its way
            assert all(all(v) for s, v in late.items() if s != last) and not any(late[last]), late
        else:
            assert not any(any(v) for v in late.values()), late


def test_a_waiting_request_is_looked_up_once_per_admission(monkeypatch):
    """A request that waits for blocks for several steps: each block is hashed once (its digests are kept), the
    lookups count once (at the admission that holds), and the cached blocks its failed attempts touched keep their
    place in the LRU order (they were refreshed, and so outlived older blocks, each step)."""
    hashed = []
    real = hashlib.sha256

    def sha256(data):
        hashed.append(data)
        return real(data)

    monkeypatch.setattr(kv_pool.hashlib, "sha256", sha256)
    bs = 4
    pool = KVPool([Group((None, 1), 10, 40, 0, False, True)], blocks=14, block_size=bs, rows=3)
    sched = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=40)
    eos = frozenset()

    def request(rid, tokens, max_tokens):
        return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=max_tokens), eos)

    def step():
        """Schedule, then what the engine does with the results: a token for every piece that ends its sequence,
        and finished requests register their blocks and leave."""
        batch = sched.schedule()
        for req, start, n in batch.pieces:
            if start + n == len(req.tokens):
                req.append(7)
                if len(req.output) >= req.params.max_tokens:
                    pool.register(req.blocks, req.tokens, req.computed)
                    sched.finish(req)
        return batch

    prefix = list(range(100, 116))
    for req in (request("c", prefix + [1], 1), request("d", list(range(200, 209)), 1)):  # cache 4 + 2 blocks
        sched.add(req)
        step()
    sp = pool.spaces[0]
    idle_order = lambda: [b for b in sp.lru if sp.refs[b] == 0]  # noqa: E731
    before = idle_order()
    assert len(before) == 6 and sp.idle == 6
    a = request("a", list(range(300, 325)), 4)  # 7 blocks; its decodes stay in its 7th block
    b = request("b", prefix + list(range(400, 413)), 1)  # 4 cached blocks + 4 new ones: 1 + 6 - 4 < 4 available
    sched.add(a)
    sched.add(b)
    for _ in range(4):  # a prefills and decodes 3 times; b cannot be admitted meanwhile
        batch = step()
        assert b in sched.waiting and b.blocks is None and [r for r, _, _ in batch.pieces] == [a]
        assert pool.queries[0] == 4 + 2 + 6 and pool.hits[0] == 0
        assert idle_order()[:len(before)] == before  # a's blocks join the LRU after them when it ends
    assert a not in sched.running  # a left; b goes in now
    batch = step()
    assert [r for r, _, _ in batch.pieces] == [b] and b.cached == 16
    assert pool.queries[0] == 4 + 2 + 6 + 7 and pool.hits[0] == 4
    assert len(hashed) == 4 + 2 + 7 + 7, "a request hashed a block twice"  # c, d, a (its 7th at the end), b


@pytest.mark.parametrize("name,block", [("llama", 4), ("gemma3", 3)])
def test_the_engine_on_a_mesh_equals_one_device(name, block):
    """The engine over 8 devices (tensor=2 x data=4: parameters by the rules, KV pools split by kv head) gives the
    unsharded engine's tokens, greedy and seeded (gemma3: sliding-window rings, copy-on-write of cached blocks)."""
    model = _model(name)
    mesh = sharding.make_mesh("data=4,tensor=2")
    sharded = jm.Model(model.config, sharding.shard_params(model.params, model.config, mesh), None, mesh)
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, model.config.vocab_size, n))) for n in (3, 17, 29, 8, 11)]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=8, ignore_eos=True) if i == 2 else
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) for i in range(len(prompts))]
    requests = [(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    requests += [("again", prompts[2], params[1])]  # a cached prefix (gemma3: wraps onto cached ring blocks)
    config = EngineConfig(max_num_seqs=4, max_model_len=64, kv_blocks=80, block_size=block, max_num_batched_tokens=24)
    runs, copies = {}, []
    for label, m in (("one", model), ("mesh", sharded)):
        engine = Engine(m, config)
        take = engine.pool.take_copies
        engine.pool.take_copies = lambda: copies.append(take()) or copies[-1]
        runs[label] = _drive(engine, requests)[0]
    for buf in engine.runner.cache.buffers:  # [L, blocks, kv heads, block, width]
        assert buf.sharding.spec[2] == "tensor" and len(buf.sharding.device_set) == 8
    assert runs["mesh"] == runs["one"]
    assert (name == "gemma3") == any(copies), "gemma3's rings were meant to copy cached blocks"


def test_kv_blocks_from_a_memory_fraction():
    blocks = engine_lib.kv_blocks_for_memory
    assert blocks([100], [{"bytes_limit": 10_000, "bytes_in_use": 1_000}], 0.5) == 40  # (5000 - 1000) // 100
    assert blocks([100, 100], [{"bytes_limit": 10_000, "bytes_in_use": 1_000},
                               {"bytes_limit": 10_000, "bytes_in_use": 3_050}], 0.9) == 59  # the tightest device
    with pytest.raises(ValueError, match="cpu:0 reports no memory statistics.*kv_blocks"):
        blocks([100], [None], 0.9, ["cpu:0"])
    with pytest.raises(ValueError, match="memory_fraction=0.1 .* no room for one KV block"):
        blocks([100], [{"bytes_limit": 10_000, "bytes_in_use": 1_000}], 0.1)


def test_the_engine_sizes_its_pool_from_device_memory(monkeypatch):
    """The pool's blocks from each device's memory, a block counted at its share on each device (the pools split by
    kv head over tensor=2); a device that reports no memory is refused when a fraction is asked for."""
    model = _model("llama")
    cfg = model.config
    with pytest.raises(ValueError, match="reports no memory statistics"):  # the CPU reports none
        Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4, memory_fraction=0.5))
    assert Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4)).blocks == 2 * 32 // 4
    # one block of every pool: [layers, 1, kv heads, block, head_dim] for K and V, float32
    block = 2 * len(cfg.layers) * cfg.num_kv_heads * 4 * cfg.head_dim * 4
    limit = 1000 * block
    monkeypatch.setattr(engine_lib, "memory_stats", lambda devices: [{"bytes_limit": limit, "bytes_in_use": 0}
                                                                     for _ in devices])
    assert Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4,
                                      memory_fraction=0.5)).blocks == 500
    assert Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4)).blocks == 900  # 0.9
    mesh = sharding.make_mesh("data=4,tensor=2")
    sharded = jm.Model(cfg, sharding.shard_params(model.params, cfg, mesh), None, mesh)
    assert Engine(sharded, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4,
                                        memory_fraction=0.5)).blocks == 1000  # half a block per device
