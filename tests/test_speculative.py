"""Speculative decoding for DeepSeek V4 / V4.1 (issue #13 §3).

`M.extend` continues a DeepSeek cache by chunks (window ring, compressor rings, compressed entries, indexer keys,
mHC, Engram history): chunks of any split equal the full forward, and a chunk whose tail is rejected, followed by
a chunk of other tokens starting inside it, equals the forward of the accepted sequence. Configs are tiny, with
short windows and small compression ratios so that chunks cross group boundaries and wrap the rings, and an
indexer top-k below the visible entries so that the selection matters.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import model as M, speculative as S
from jaxmodels.sampling import Sampling
from jaxmodels.families import deepseek_v4
from tests.oracles import deepseek_ckpt
from tests.parity.test_deepseek_v4 import V4_TINY

TOL = 2e-5
NEW = 12
pytestmark = [pytest.mark.usefixtures("fast_compiles"), pytest.mark.slow]  # DeepSeek compiles: the slow set


def v4_config():
    """V4 with CSA ratio 4, HCA ratio 8, a window of 6 and top-k 2: chunks cross groups of both ratios."""
    return deepseek_v4.config({**V4_TINY, "model_type": "deepseek_v4", "compress_ratios": [0, 4, 8, 4, 0],
                               "sliding_window": 6, "index_topk": 2, "num_nextn_predict_layers": 1})


def v41_config(block: int = 4):
    """The spec's tiny V4.1 (every role, Engram with 4-grams, DSpark) at narrow widths, window 6."""
    return deepseek_v4.config(deepseek_ckpt.tiny_config(
        "v4.1", quantized=False, hidden_size=64, moe_intermediate_size=32, q_lora_rank=32, o_lora_rank=32,
        index_head_dim=32, engram_head_dim=16, index_topk=3, sliding_window=6, dspark_block_size=block))


CONFIGS = {"v4": v4_config, "v41": v41_config}


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@functools.lru_cache(maxsize=None)
def _tiny(name):
    cfg = CONFIGS[name]()
    return cfg, M.init_params(cfg, seed=1, std=0.05, mtp=True)


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request):
    return _tiny(request.param)


def _prompts(vocab):
    rng = np.random.default_rng(4)
    return [rng.integers(3, vocab, n).tolist() for n in (5, 11, 2)]


@functools.lru_cache(maxsize=None)
def _plain(name):
    """Plain greedy decoding of `_prompts`, 4 tokens past NEW (the oracle drafter reads up to k + 1 ahead): one
    compile of plain generate per config for the tests below (greedy decoding is causal: its first NEW tokens are
    what max_new_tokens=NEW gives)."""
    import jaxmodels as jm

    cfg, params = _tiny(name)
    return jm.generate(_model(cfg, params), _prompts(cfg.vocab_size), max_new_tokens=NEW + 4, ignore_eos=True)


_forward = jax.jit(M.forward, static_argnums=1)
_extend = jax.jit(M.extend, static_argnums=1)
_verify = jax.jit(lambda p, c, t, s, cache: S.verify(p, c, t, s, cache)[:2], static_argnums=1)


def _chunk(seq, start, lengths, width):
    out = np.zeros((len(seq), width), np.int32)
    for b in range(len(seq)):
        out[b, :lengths[b]] = seq[b][start[b]: start[b] + lengths[b]]
    return jnp.asarray(out)


def test_extend_in_chunks_equals_the_forward(tiny):
    """Ragged chunks per row (1 to 14 tokens: inside a group, across groups of 4 and 8, longer than the window),
    then decode steps after them."""
    cfg, params = tiny
    T = 40
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
    full = np.asarray(_forward(params, cfg, jnp.asarray(seq)))
    splits = [[0, 3, 4, 11, 25, 33], [0, 1, 9, 10, 23, 30]]
    cache = M.init_cache(cfg, 2, 64, jnp.float32)
    for i in range(len(splits[0]) - 1):
        start = np.array([s[i] for s in splits])
        lengths = np.array([s[i + 1] for s in splits]) - start
        logits, cache = _extend(params, cfg, _chunk(seq, start, lengths, 16), jnp.asarray(start),
                                jnp.asarray(lengths), cache)
        np.testing.assert_allclose(logits, full[[0, 1], start + lengths - 1], atol=TOL, rtol=0, err_msg=f"chunk {i}")
    pos = np.array([33, 30])
    step = jax.jit(M.decode_step, static_argnums=1)
    for _ in range(5):
        logits, cache = step(params, cfg, jnp.asarray(seq[[0, 1], pos]), jnp.asarray(pos), cache)
        np.testing.assert_allclose(logits, full[[0, 1], pos], atol=TOL, rtol=0, err_msg=f"decode at {pos}")
        pos = pos + 1


def test_a_forward_shorter_than_a_compression_group(tiny):
    """A one-token forward (no complete group of 4 or 8: no compressed entry) gives the first position of a longer
    one (V4's overlapping CSA groups used to fail to concatenate there)."""
    cfg, params = tiny
    seq = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    np.testing.assert_allclose(_forward(params, cfg, seq[:, :1]), _forward(params, cfg, seq)[:, :1], atol=TOL, rtol=0)


@pytest.mark.parametrize("k", [3])
def test_a_rejected_tail_is_overwritten(tiny, k):
    """Each round extends k+1 tokens of which only the first a+1 are the true sequence (the rest: other random
    tokens, as rejected drafts are); the next round starts right after the accepted ones. Every accepted
    position's logits equal the forward of the true sequence, through groups of 4 and 8, Engram 4-grams and
    the window of 6, with a cache of `lookahead` = k spare ring slots."""
    cfg, params = tiny
    rng = np.random.default_rng(k)
    T = 48
    seq = rng.integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
    full = np.asarray(_forward(params, cfg, jnp.asarray(seq)))
    cache = M.init_cache(cfg, 2, 64, jnp.float32, lookahead=k)
    pos = np.array([5, 2])
    _, cache = _extend(params, cfg, _chunk(seq, [0, 0], pos, 8), jnp.zeros(2, jnp.int32), jnp.asarray(pos), cache)
    while pos.max() < T - k - 1:
        a = rng.integers(0, k + 1, 2)  # accepted drafts per row; a = k: nothing rejected
        chunk = rng.integers(0, cfg.vocab_size, (2, k + 1)).astype(np.int32)
        for b in range(2):
            chunk[b, :a[b] + 1] = seq[b, pos[b]: pos[b] + a[b] + 1]
        logits, cache = _verify(params, cfg, jnp.asarray(chunk), jnp.asarray(pos), cache)
        for b in range(2):
            np.testing.assert_allclose(logits[b, :a[b] + 1], full[b, pos[b]: pos[b] + a[b] + 1], atol=TOL, rtol=0,
                                       err_msg=f"row {b} at {pos[b]}, accepted {a[b]} of {k}")
        pos = pos + a + 1


# ----------------------------------------------------------------------------------------------- generate
def _model(cfg, params):
    import jaxmodels as jm

    return jm.Model(cfg, params)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculative_equals_plain_decoding(tiny, k, request):
    """Batch of 3 prompts of different lengths with the model's own drafter (random weights: it is wrong at
    nearly every step, so this checks the rejection path and the drafter's cache updates)."""
    import jaxmodels as jm

    cfg, params = tiny
    plain = _plain(request.node.callspec.params["tiny"])
    model = _model(cfg, params)
    spec = jm.generate(model, _prompts(cfg.vocab_size), max_new_tokens=NEW, ignore_eos=True, num_speculative_tokens=k)
    assert spec.tokens == [a[:NEW] for a in plain.tokens]
    assert plain.acceptance_rate is None and 0 <= spec.acceptance_rate <= 1
    assert 1 <= spec.tokens_per_step <= k + 1


def _oracle_drafter(monkeypatch, answers, lengths, wrong):
    """Replace the drafter's proposals by the plain decoding's tokens (`answers` [B, N], generated part), except
    where wrong(pos [B], depth [k]) says: there the proposal is off by one. The drafter itself still runs (its
    cache updates are exercised); the loop's jit cache is dropped so that its trace sees the replacement."""
    table, lengths, own = jnp.asarray(answers, jnp.int32), jnp.asarray(lengths, jnp.int32), S.propose

    def propose(params, cfg, dcache, dstate, token, pos, k, pick):
        _, logits, dcache = own(params, cfg, dcache, dstate, token, pos, k, pick)
        idx = jnp.clip(pos[:, None] + 1 + jnp.arange(k) - lengths[:, None], 0, table.shape[1] - 1)
        right = table[jnp.arange(table.shape[0])[:, None], idx]
        return jnp.where(wrong(pos[:, None], jnp.arange(k)), (right + 1) % cfg.vocab_size, right), logits, dcache

    S.generate.clear_cache()
    monkeypatch.setattr(S, "propose", propose)


@pytest.mark.parametrize("name,k,wrong", [("v4", 3, "some"), ("v41", 1, "never")])
def test_greedy_speculative_with_accepted_drafts_equals_plain_decoding(name, k, wrong, monkeypatch):
    """Drafts that are right (all, or all but a pattern of wrong ones) make each step emit several tokens: the
    positions advance by the accepted run, the drafter's cache follows it, the bonus token is used, and a row stops
    inside an accepted run at max_new or at a stop string. Output equals plain decoding; with every draft right the
    counters are exact: every draft accepted, and 11 tokens after the first in ceil(11 / (k+1)) steps a row."""
    import jaxmodels as jm

    cfg, params = _tiny(name)
    prompts = _prompts(cfg.vocab_size)
    model = _model(cfg, params)
    new = NEW
    answers = _plain(name).tokens  # new + 4 >= new + k + 1 tokens
    stop = [answers[1][3:5]]  # ends row 1 (and any row where the pair occurs) early
    plain = jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True, stop=stop)
    assert len(plain.tokens[1]) < new
    rule = {"never": lambda pos, d: jnp.zeros_like(pos + d, bool),
            "some": lambda pos, d: (pos * 7 + d * 3) % 5 == 0}[wrong]
    _oracle_drafter(monkeypatch, answers, [len(p) for p in prompts], rule)
    try:
        spec = jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True, num_speculative_tokens=k)
        assert spec.tokens == [a[:new] for a in answers]
        if wrong == "never":
            steps = -(-(new - 1) // (k + 1))
            assert spec.acceptance_rate == 1.0
            assert spec.tokens_per_step == pytest.approx((new - 1) / steps)
        else:
            assert 0 < spec.acceptance_rate < 1 and spec.tokens_per_step > 1
        spec = jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True, stop=stop, num_speculative_tokens=k)
        assert spec.tokens == plain.tokens
    finally:
        S.generate.clear_cache()


# ------------------------------------------------------------------------------ sampling: the rejection rule
ALPHA = 1e-3  # significance of each chi-square test (fixed seeds: the outcome is deterministic)


def _chi2_pvalue(counts, probs):
    """Pearson's chi-square p-value of observed counts against probabilities (cells of expectation < 5 merged)."""
    from scipy import stats

    n = counts.sum()
    exp = probs * n
    small = exp < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(exp[~small], exp[small].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


def _markov_run(rule, n, seed, k=3, V=6):
    """A known target: a Markov chain over V tokens, p(next | prev) and a different drafter q(next | prev).
    Runs one speculative step per sample from token 0 and returns the emitted tokens' first two (always
    emitted: the step is repeated until two are out). Returns the exact target probabilities of those pairs
    and the samples' pair counts."""
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(V) * 0.7, V).astype(np.float32)
    Q = rng.dirichlet(np.ones(V) * 0.7, V).astype(np.float32)
    logp, logq = jnp.log(jnp.asarray(P)), jnp.log(jnp.asarray(Q))
    s = Sampling(temperature=1.0)

    def one(key):
        kd, ka, key = jax.random.split(key, 3)
        prev, drafts = jnp.int32(0), []
        for i in range(k):
            prev = jax.random.categorical(jax.random.fold_in(kd, i), logq[prev]).astype(jnp.int32)
            drafts.append(prev)
        drafts = jnp.stack(drafts)
        ctx = jnp.concatenate([jnp.zeros(1, jnp.int32), drafts])  # the target predicts after each chunk token
        tokens, count = rule(logp[ctx][None], drafts[None], logq[ctx[:-1]][None], ka, s)
        # a second step when only one token came out: from the emitted token, plain target sampling
        t2 = jax.random.categorical(key, logp[tokens[0, 0]]).astype(jnp.int32)
        return tokens[0, 0], jnp.where(count[0] > 1, tokens[0, 1], t2)

    a, b = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(seed), n))
    counts = np.bincount(np.asarray(a) * V + np.asarray(b), minlength=V * V)
    exact = (P[0][:, None] * P).reshape(-1)
    return exact, counts


def test_rejection_rule_preserves_a_known_target_distribution():
    """20000 samples of the first two emitted tokens of a speculative step against the exact joint distribution
    of a Markov target (36 cells), chi-square at ALPHA; the drafter differs from the target, so about half the
    drafts are rejected. A broken rule (accept every draft, or resample from p instead of the residual) fails
    this test: see _broken_rules (run by hand)."""
    exact, counts = _markov_run(S.accept, 20000, seed=1)
    assert _chi2_pvalue(counts, exact) > ALPHA


@pytest.mark.usefixtures("optimised_compiles")
def test_sampled_speculative_generate_has_the_target_distribution():
    """End to end on tiny V4 (classic MTP drafts): 1536 rows of one prompt sample 3 tokens with top_k=3 and
    temperature 1.5
    (27 possible continuations); their joint frequencies against the target's exact distribution (from full
    forwards of every continuation), chi-square at ALPHA."""
    import jaxmodels as jm

    cfg = v4_config()
    params = M.init_params(cfg, seed=2, std=0.3, mtp=True)
    prompt = [7, 3, 11, 5]
    s = Sampling(temperature=1.5, top_k=3)
    model = _model(cfg, params)
    rows = []
    for seed in range(3):
        out = jm.generate(model, [prompt] * 512, max_new_tokens=3, temperature=1.5, top_k=3, ignore_eos=True,
                          seed=seed, num_speculative_tokens=2)
        rows += out.tokens
    assert 0 < out.acceptance_rate < 1
    assert continuations_fit(rows, exact_continuations(params, cfg, prompt, s, 3))


def exact_continuations(params, cfg, prompt, s: Sampling, depth: int) -> dict:
    """{continuation (t1, ..): its probability under the target} for every continuation of 1 to `depth` tokens
    that `s` can sample after `prompt`: p(t1) p(t2 | t1) ... from full forwards of every prefix."""
    probs = {(): 1.0}
    for d in range(depth):
        prefixes = [c for c in probs if len(c) == d]
        logits = _forward(params, cfg, jnp.asarray([prompt + list(c) for c in prefixes], jnp.int32))[:, -1]
        for c, row in zip(prefixes, np.asarray(S.probabilities(logits, s))):
            for t in np.nonzero(row)[0]:
                probs[c + (int(t),)] = probs[c] * row[t]
    return probs


def continuations_fit(rows, probs) -> bool:
    """Sampled continuations (all of one length) are in the target's support and their frequencies pass the
    chi-square test at ALPHA against the exact probabilities."""
    cells = sorted(c for c in probs if len(c) == len(rows[0]))
    index = {c: i for i, c in enumerate(cells)}
    assert all(tuple(r) in index for r in rows), "a continuation outside the target's support"
    counts = np.bincount([index[tuple(r)] for r in rows], minlength=len(cells))
    return _chi2_pvalue(counts, np.array([probs[c] for c in cells])) > ALPHA


def _broken_rules():
    """The check that the test above can fail (not part of the suite): each broken rule gives p < ALPHA."""
    def always(t, d, q, key, s):  # accept every draft
        tokens, _ = S.accept(t, d, q, key, s)
        return jnp.concatenate([d, tokens[:, -1:]], axis=1), jnp.full(d.shape[:1], d.shape[1] + 1)

    return {name: _chi2_pvalue(*_markov_run(rule, 20000, seed=1)[::-1]) for name, rule in
            (("accept always", always), ("resample from p", _resample_p), ("correct", S.accept))}


def _resample_p(target, drafts, dlogits, key, s):
    p, q = S.probabilities(target, s), S.probabilities(dlogits, s)
    B, k = drafts.shape
    ku, kr = jax.random.split(key)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    a = jnp.sum(jnp.cumprod(jax.random.uniform(ku, (B, k)) * qd < pd, axis=1), axis=1)
    pa = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]
    last = jax.random.categorical(kr, jnp.log(pa), axis=-1).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(k + 1) < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), last[:, None])
    return tokens, a + 1
