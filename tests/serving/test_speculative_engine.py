"""Speculative decoding in the serving engine (issue #13 §3) against the paths it replaces: a speculating engine's
greedy output equals `jm.generate`'s plain decoding token for token (many concurrent requests of different lengths,
chunked prefill, preemption, rows reaching max_model_len), with the models' own drafters (DeepSeek V4's classic MTP,
V4.1's DSpark: random weights, nearly every draft rejected) and with an oracle drafter whose drafts are mostly right
(runs of accepted drafts, the bonus token, stops inside a run); sampled output has the target's exact distribution
(chi-square); logprobs match the full forward; requests with penalties decode plainly, as a plain engine does."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import model as M, speculative as S
from jaxmodels.sampling import Sampling
from serving import Engine, EngineConfig, SamplingParams, runner as R
from serving.metrics import Metrics
from tests.test_speculative import (ALPHA, _chi2_pvalue, continuations_fit, exact_continuations, v4_config,
                                    v41_config)

NEW = 12
CONFIGS = {"v4": v4_config, "v41": v41_config}
# one engine shape per version, so that the tests share compiled steps (a tiny DeepSeek step compiles in ~9 s on a
# CPU): V4's pool holds about two of its requests (preemption and recompute in every run), V4.1's step budget makes
# chunks of a few tokens beside verify rows, and its max_model_len is short enough that the long prompts reach it
ENGINES = {"v4": dict(max_num_seqs=4, max_model_len=64, kv_blocks=12, block_size=4, max_num_batched_tokens=24,
                      num_speculative_tokens=3),
           "v41": dict(max_num_seqs=4, max_model_len=32, kv_blocks=200, block_size=4, max_num_batched_tokens=7,
                       num_speculative_tokens=2)}
pytestmark = [pytest.mark.usefixtures("fast_compiles"), pytest.mark.slow]  # tests/conftest.py: nearly all of this module is XLA


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _model(name, std=0.05, seed=1):
    cfg = CONFIGS[name]()
    return jm.Model(cfg, M.init_params(cfg, seed=seed, std=std, mtp=True))


def _prompts(vocab):
    """Lengths from 1 token to past the window (6) and the compression groups (4, 8), and one chunk budget."""
    rng = np.random.default_rng(4)
    return [list(map(int, rng.integers(3, vocab, n))) for n in (5, 11, 1, 17, 30, 2, 9)]


@functools.lru_cache(maxsize=None)
def _plain(name) -> list[list[int]]:
    """Plain greedy decoding of the prompts, a few tokens past NEW (the oracle drafts ahead)."""
    model = _model(name)
    return jm.generate(model, _prompts(model.config.vocab_size), max_new_tokens=NEW + 4, ignore_eos=True).tokens


def _want(name, max_tokens=NEW):
    """What the engine must give: plain decoding, up to max_tokens or max_model_len."""
    limit = ENGINES[name]["max_model_len"]
    prompts = _prompts(_model(name).config.vocab_size)
    return [a[:min(max_tokens, limit - len(p))] for p, a in zip(prompts, _plain(name))]


def _run(engine, prompts, params):
    got = {}
    for i, p in enumerate(prompts):
        engine.add(str(i), p, params[i] if isinstance(params, list) else params)
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).append(o)
    assert all(engine.pool.used(s) == 0 for s in range(len(engine.pool.spaces))), "blocks leaked"
    assert not engine.requests and not engine.scheduler.running
    return [[t for o in got.get(str(i), []) for t in o.token_ids] for i in range(len(prompts))], got


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def _recorded_drafts(monkeypatch) -> list:
    """Every proposal's (token, position, drafts, draft logits) per row, recorded from inside the traced steps
    (the verify step's and speculative.generate's traces are dropped so that they call the recorder)."""
    events, own = [], S.propose

    def record(*arrays):
        events.extend(zip(*(np.asarray(a) for a in arrays)))

    def propose(params, cfg, dcache, dstate, token, pos, k, pick):
        drafts, logits, dcache = own(params, cfg, dcache, dstate, token, pos, k, pick)
        jax.debug.callback(record, token, pos, drafts, logits)
        return drafts, logits, dcache

    R.verify_step.clear_cache()
    S.generate.clear_cache()
    monkeypatch.setattr(S, "propose", propose)
    return events


@pytest.mark.parametrize("name", list(ENGINES))
def test_greedy_speculating_engine_equals_generate(name, monkeypatch):
    """Tokens equal plain decoding's; and every draft the engine's drafter proposes (from its per-row cache,
    through chunked prefill, preemption and reused rows) equals the draft `jm.generate`'s speculative loop (its own
    contiguous caches) proposes at the same position after the same token."""
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    events = _recorded_drafts(monkeypatch)
    try:
        jm.generate(model, prompts, max_new_tokens=NEW, ignore_eos=True, num_speculative_tokens=ENGINES[name][
            "num_speculative_tokens"])
        reference, events[:] = list(events), []
        engine = Engine(model, EngineConfig(**ENGINES[name]))
        got, _ = _run(engine, prompts, GREEDY)
    finally:
        R.verify_step.clear_cache()
        S.generate.clear_cache()
    for i, (g, w) in enumerate(zip(got, _want(name))):
        assert g == w, f"request {i} (prompt {len(prompts[i])} tokens)"
    drafts = {}
    for tok, pos, d, logits in reference:
        drafts.setdefault((int(pos), int(tok)), []).append((d, logits))
    proposed = [e for e in events if e[1] > 0]  # padding rows propose at position 0
    assert len(proposed) >= engine.stats()["spec_steps"]
    for tok, pos, d, logits in proposed:
        assert any((d == rd).all() and np.allclose(logits, rl, atol=1e-4) for rd, rl in drafts[(int(pos), int(tok))]), \
            f"the drafts after token {tok} at position {pos}"
    s = engine.stats()
    assert 0 < s["spec_draft_tokens"] <= engine.k * s["spec_steps"]
    assert s["spec_steps"] <= s["spec_emitted_tokens"] <= sum(map(len, got))  # a step gives one token or more
    if name == "v4":
        assert s["preemptions"] > 0, "the small pool was meant to force preemption"


def _oracle_table(name, k, length):
    """[length, vocab, k]: the k tokens plain greedy decoding puts after token t at position p in some request
    (-1 where none is known, or where two requests disagree)."""
    model = _model(name)
    table = np.full((length, model.config.vocab_size, k), -2, np.int32)
    for p, a in zip(_prompts(model.config.vocab_size), _plain(name)):
        seq = p + a
        for pos in range(len(p) - 1, min(len(seq) - k, length)):
            row, nxt = table[pos, seq[pos]], seq[pos + 1: pos + 1 + k]
            table[pos, seq[pos]] = nxt if row[0] == -2 or list(row) == nxt else -1
    return jnp.asarray(np.maximum(table, -1))


def _oracle_drafter(monkeypatch, table, wrong):
    """The drafter's proposals replaced by the table's (off by one where `wrong(pos [P, 1], depth [k])` says, or
    where the table knows none); the drafter still runs, so its cache updates are exercised. The verify step's
    traces are dropped so that it sees the replacement."""
    own = S.propose

    def propose(params, cfg, dcache, dstate, token, pos, k, pick):
        _, logits, dcache = own(params, cfg, dcache, dstate, token, pos, k, pick)
        right = table[jnp.clip(pos, 0, table.shape[0] - 1), token]
        off = (right < 0) | wrong(pos[:, None], jnp.arange(k))
        return jnp.where(off, (jnp.maximum(right, 0) + 1) % cfg.vocab_size, right), logits, dcache

    R.verify_step.clear_cache()
    monkeypatch.setattr(S, "propose", propose)


@pytest.mark.parametrize("name,wrong", [("v4", "some"), ("v41", "never")])
def test_accepted_runs_equal_plain_decoding(name, wrong, monkeypatch):
    """Drafts that are mostly right make a step emit several tokens: positions advance by the accepted run, the
    drafter's cache follows it, the bonus token is used, and a request ends inside a run (max_tokens, a stop id).
    Output equals plain decoding; with the oracle never wrong, most drafts are kept."""
    model = _model(name)
    prompts = _prompts(model.config.vocab_size)
    k = ENGINES[name]["num_speculative_tokens"]
    want = _want(name)
    stop_id = want[1][5]  # ends request 1 at its first occurrence
    params = [GREEDY] * len(prompts)
    params[1] = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[stop_id])
    params[3] = SamplingParams(temperature=0, max_tokens=NEW - 5, ignore_eos=True)
    want[1] = want[1][:want[1].index(stop_id)]
    want[3] = want[3][:NEW - 5]
    rule = {"never": lambda pos, d: jnp.zeros_like(pos + d, bool),
            "some": lambda pos, d: (pos * 7 + d * 3) % 5 == 0}[wrong]
    _oracle_drafter(monkeypatch, _oracle_table(name, k, ENGINES[name]["max_model_len"]), rule)
    try:
        engine = Engine(model, EngineConfig(**ENGINES[name]))
        got, outs = _run(engine, prompts, params)
    finally:
        R.verify_step.clear_cache()
    assert got == want
    assert outs["1"][-1].finish_reason == "stop" and outs["3"][-1].finish_reason == "length"
    s = engine.stats()
    rate, per_step = s["spec_accepted_tokens"] / s["spec_draft_tokens"], s["spec_emitted_tokens"] / s["spec_steps"]
    assert any(len(o.token_ids) > 1 for o in outs["0"]), "a step emitted several tokens"
    if wrong == "never":
        assert rate > 0.8 and per_step > 2, (rate, per_step)  # drafts past max_model_len cannot be kept
    else:
        assert 0.2 < rate < 0.9 and per_step > 1.3, (rate, per_step)
    text, _ = Metrics(engine.stats).render()
    assert f"jaxmodels_spec_decode_acceptance_rate {rate}".encode() in text
    assert f"jaxmodels_spec_decode_draft_tokens_total {float(s['spec_draft_tokens'])}".encode() in text


def test_the_per_row_rule_preserves_each_rows_distribution():
    """`draw_draft` + `accept_rows` (what `verify_step` runs) on a known target: a Markov chain p(next | prev) over
    8 tokens and a different drafter q. 20000 rows at temperature 1.3 with top-k 5, top-p 0.9 and min-p 0.05, each
    with its own seed, draw 3 drafts and run the rule; the first two emitted tokens (a second plain draw where only
    one came out) against the exact joint of the filtered target (`jaxmodels.sampling`'s filters), chi-square at
    ALPHA. Greedy rows in the same call keep the target's argmax chain. A rule that resamples from p instead of
    the residual fails this test (run by hand)."""
    n, k, V = 20000, 3, 8
    rng = np.random.default_rng(0)
    logp = jnp.log(jnp.asarray(rng.dirichlet(np.ones(V) * 0.7, V), jnp.float32))
    logq = jnp.log(jnp.asarray(rng.dirichlet(np.ones(V) * 0.7, V), jnp.float32))
    greedy = np.arange(n) % 10 == 0
    s = {"temperature": jnp.where(greedy, 0.0, 1.3), "top_k": jnp.full(n, 5), "top_p": jnp.full(n, 0.9),
         "min_p": jnp.full(n, 0.05), "seed": jnp.arange(n, dtype=jnp.uint32), "index": jnp.zeros(n, jnp.int32)}
    flags = dict(sampled=True, filtered=True)

    @jax.jit
    def run(s):
        keys, prev, drafts = R._keys(s), jnp.zeros(n, jnp.int32), []
        for i in range(k):
            prev = R.draw_draft(i, logq[prev], s, keys, **flags)
            drafts.append(prev)
        drafts = jnp.stack(drafts, axis=1)
        ctx = jnp.concatenate([jnp.zeros((n, 1), jnp.int32), drafts], axis=1)
        tokens, count = R.accept_rows(logp[ctx], drafts, logq[ctx[:, :-1]], s, keys, **flags)
        after = s | {"index": s["index"] + 1}  # the next draw of each row: a plain sample from the target
        more = R.draw_draft(0, logp[tokens[:, 0]], after, R._keys(after), **flags)
        return tokens, count, jnp.where(count > 1, tokens[:, 1], more)

    tokens, count, second = (np.asarray(a) for a in run(s))
    best = np.asarray(jnp.argmax(logp, axis=-1))
    assert (tokens[greedy, 0] == best[0]).all() and (second[greedy] == best[best[0]]).all()
    assert 0.2 < (count[~greedy] > 1).mean() < 0.9, "about half the first drafts accepted"
    p = np.asarray(S.probabilities(logp, Sampling(1.3, 5, 0.9, 0.05)))  # [prev, next]
    exact = (p[0][:, None] * p).reshape(-1)
    counts = np.bincount(tokens[~greedy, 0] * V + second[~greedy], minlength=V * V)
    assert _chi2_pvalue(counts, exact) > ALPHA


def _mixture_drafter(monkeypatch, probs, vocab, temperature):
    """A drafter that proposes from q = (the target's p + uniform over p's support) / 2 wherever it knows the
    target's prefix (a one-token prompt: at position 0 and 1), and from uniform elsewhere. Drafts are drawn by the
    engine's own `pick` (its keys, temperature and top-k), so that most drafts are kept and the rest exercise the
    residual."""
    q = np.full((3, vocab, vocab, vocab), 1.0 / vocab, np.float32)  # q[depth, t1, t2]: the next token's
    for c, pc in probs.items():
        if len(c) < 3:
            row = np.array([probs.get(c + (t,), 0.0) / pc for t in range(vocab)])
            q[(len(c), *c, 0, 0)[:3]] = (row + (row > 0) / np.count_nonzero(row)) / 2
    with np.errstate(divide="ignore"):
        logq = jnp.asarray(temperature * np.log(q))  # `pick` divides by the temperature
    own = S.propose

    def propose(params, cfg, dcache, dstate, token, pos, k, pick):
        _, _, dcache = own(params, cfg, dcache, dstate, token, pos, k, pick)
        ids, rows = [], []
        for i in range(k):  # the prefix before draft i: the token (t1 at position 1) and the drafts before it
            depth = pos + i
            t1 = jnp.where(pos == 0, ids[0] if ids else 0, token)
            t2 = jnp.where(pos == 0, ids[1] if i > 1 else 0, ids[0] if ids else 0)
            known = (pos <= 1) & (depth < 3)
            row = jnp.where(known[:, None], logq[jnp.minimum(depth, 2), t1, t2], jnp.log(1.0 / vocab))
            ids.append(pick(i, row))
            rows.append(row)
        return jnp.stack(ids, axis=1), jnp.stack(rows, axis=1), dcache

    R.verify_step.clear_cache()
    monkeypatch.setattr(S, "propose", propose)


@pytest.mark.usefixtures("optimised_compiles")
def test_sampled_speculating_engine_has_the_target_distribution(monkeypatch):
    """V4 at k=2: 1024 requests of a one-token prompt (every token from verify steps), each with its own seed,
    sample 3 tokens with top_k=3 at temperature 1.5, their drafts drawn by the engine from a distribution near the
    target's (`_mixture_drafter`); the joint frequencies of the 27 continuations against the target's exact
    distribution (full forwards), chi-square at ALPHA. The rows of a step have one shape (8 rows): one compile."""
    model = _model("v4", std=0.3, seed=2)
    cfg, prompt, T = model.config, [7], 1.5
    probs = exact_continuations(model.params, cfg, prompt, Sampling(temperature=T, top_k=3), 3)
    hot = [SamplingParams(temperature=T, top_k=3, seed=i, max_tokens=3, ignore_eos=True) for i in range(1024)]
    _mixture_drafter(monkeypatch, probs, cfg.vocab_size, T)
    try:
        engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=8, kv_blocks=80, block_size=4,
                                            num_speculative_tokens=2))
        got, _ = _run(engine, [prompt] * len(hot), hot)
    finally:
        R.verify_step.clear_cache()
    s = engine.stats()
    assert 0.5 < s["spec_accepted_tokens"] / s["spec_draft_tokens"] < 0.95
    assert continuations_fit(got, probs)


def test_seeds_logprobs_and_penalties_in_a_speculating_engine():
    """A seeded request samples the same tokens alone or beside others; a greedy request's logprobs (and top 3)
    equal the full forward's; a request with penalties decodes plainly, each token the argmax of the forward's
    logits less its penalties."""
    model = _model("v41")
    cfg, prompts = model.config, _prompts(model.config.vocab_size)
    engine = Engine(model, EngineConfig(**ENGINES["v41"]))
    hot = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=s, max_tokens=NEW, ignore_eos=True)
           for s in range(4)]
    together, _ = _run(engine, prompts[:4], hot)
    for i in range(4):  # whatever the steps' composition (how the prompt split into chunks, who ran beside it)
        assert _run(engine, prompts[i:i + 1], hot[i:i + 1])[0] == [together[i]], f"request {i}"
    assert len({tuple(t) for t in together}) == 4

    lp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=3)
    pen = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, presence_penalty=0.7, frequency_penalty=1.3)
    (got_lp, got_pen), outs = _run(engine, [prompts[0], prompts[5]], [lp, pen])
    width = ENGINES["v41"]["max_model_len"]
    forward = jax.jit(lambda seq: jax.nn.log_softmax(M.forward(model.params, cfg, seq)[0]))  # causal: pads after

    def logits(seq):
        return np.asarray(forward(jnp.asarray([seq + [0] * (width - len(seq))])))[len(seq) - 1]

    seq, counts = list(prompts[5]), np.zeros(cfg.vocab_size)
    for t in got_pen:
        assert t == int(np.argmax(logits(seq) - 1.3 * counts - 0.7 * (counts > 0)))
        seq.append(t)
        counts[t] += 1
    assert got_pen != _want("v41")[5], "the penalties change the output"
    seq = list(prompts[0])
    logprobs = [x for o in outs["0"] for x in o.logprobs]
    assert len(logprobs) == len(got_lp) == NEW
    for t, x in zip(got_lp, logprobs):
        ref = logits(seq)
        assert t == int(np.argmax(ref)) and abs(x.logprob - ref[t]) < 1e-4
        assert [i for i, _ in x.top] == list(np.argsort(-ref)[:3])
        seq.append(t)


def test_bad_speculative_settings_are_refused():
    from tests.test_paged_cache import _config

    cfg = _config("llama")
    with pytest.raises(ValueError, match="MTP draft heads"):
        Engine(jm.Model(cfg, M.init_params(cfg)), EngineConfig(max_model_len=32, kv_blocks=64,
                                                                num_speculative_tokens=2))
    v41 = _model("v41")
    with pytest.raises(ValueError, match="DSpark block size"):
        Engine(v41, EngineConfig(max_model_len=32, kv_blocks=64, num_speculative_tokens=5))
    with pytest.raises(ValueError, match="MTP draft heads"):  # loaded without its mtp.* tensors
        Engine(jm.Model(v41.config, {n: a for n, a in v41.params.items() if n != "mtp"}),
               EngineConfig(max_model_len=32, kv_blocks=64, num_speculative_tokens=2))
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="cannot hold one speculative step"):
        EngineConfig(max_num_batched_tokens=3, num_speculative_tokens=3)


@pytest.mark.parametrize("mesh", ["data=2,tensor=4", pytest.param("explicit tensor=8", marks=pytest.mark.heavy)])
def test_a_speculating_engine_on_a_mesh_equals_generate(mesh):
    """The pools split by kv head, the drafter's rows replicated: greedy tokens as one device gives them (an
    `Explicit`-axes mesh from jax.make_mesh too)."""
    from jaxmodels import sharding

    model = _model("v4")
    mesh = jax.make_mesh((8,), ("tensor",)) if mesh.startswith("explicit") else sharding.make_mesh(mesh)
    placed = jm.Model(model.config, sharding.shard_params(model.params, model.config, mesh), None, mesh)
    prompts = _prompts(model.config.vocab_size)[:4]
    engine = Engine(placed, EngineConfig(**ENGINES["v4"]))
    got, _ = _run(engine, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert got == [w[:8] for w in _want("v4")[:4]]
    assert engine.stats()["spec_steps"] > 0
