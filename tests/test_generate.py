"""generate(), sampling filters and the KV cache layout, on small random models (no reference needed)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import cache as kv, families, model as M
from jaxmodels.plan import plan
from jaxmodels.config import ModelConfig
from jaxmodels.sampling import Sampling, filter_logits, sample

HF = {"model_type": "mistral", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "sliding_window": 6, "max_position_embeddings": 4096}


@pytest.fixture(scope="module")
def tiny():
    cfg = families.config_from_hf(HF)
    return jm.Model(cfg, M.init_params(cfg, seed=1, std=0.3))


# ---------------------------------------------------------------------------------------- sampling
def _probs(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_top_k_keeps_exactly_the_k_largest():
    x = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), Sampling(1.0, top_k=5))))
    assert (kept.sum(-1) == 5).all()
    assert (kept == (x >= np.sort(x, -1)[:, -5:-4])).all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    x = np.random.default_rng(1).normal(size=(4, 40)).astype(np.float32) * 2
    for p in (0.1, 0.5, 0.9):
        kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), Sampling(1.0, top_p=p))))
        for row, k in zip(x, kept):
            order = np.argsort(-row)
            cum = np.cumsum(_probs(row)[order])
            n = int(np.searchsorted(cum, p) + 1)  # first index where the mass reaches p, inclusive
            assert set(np.nonzero(k)[0]) == set(order[:n])


def test_min_p_drops_tokens_below_fraction_of_max():
    x = np.random.default_rng(2).normal(size=(2, 30)).astype(np.float32) * 3
    kept = np.isfinite(np.asarray(filter_logits(jnp.asarray(x), Sampling(1.0, min_p=0.2))))
    pr = _probs(x)
    assert (kept == (pr >= 0.2 * pr.max(-1, keepdims=True))).all()


def test_sampling_follows_the_distribution_and_the_seed():
    logits = jnp.asarray(np.log([[0.5, 0.3, 0.15, 0.05]] * 4000), jnp.float32)
    draws = np.asarray(sample(logits, jax.random.PRNGKey(0), Sampling(1.0)))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    again = np.asarray(sample(logits, jax.random.PRNGKey(0), Sampling(1.0)))
    other = np.asarray(sample(logits, jax.random.PRNGKey(1), Sampling(1.0)))
    assert (draws == again).all() and (draws != other).any()


def test_bad_sampling_arguments_are_rejected():
    for kw in ({"temperature": -1}, {"top_k": 0}, {"top_p": 1.5}, {"min_p": -0.1}):
        with pytest.raises(ValueError):
            Sampling(**kw)


# --------------------------------------------------------------------------------------- generate
def test_batch_rows_are_independent(tiny):
    """Prompts of different lengths in one batch give what each gives alone."""
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    batch = jm.generate(tiny, prompts, max_new_tokens=12, ignore_eos=True).tokens
    for p, row in zip(prompts, batch):
        assert jm.generate(tiny, [p], max_new_tokens=12, ignore_eos=True).tokens[0] == row


def test_greedy_equals_argmax_of_full_forward(tiny):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = jm.generate(tiny, [prompt], max_new_tokens=16, ignore_eos=True).tokens[0]
    logits = np.asarray(jm.forward(tiny, [prompt + out]))[0]
    assert list(logits[len(prompt) - 1:-1].argmax(-1)) == out


def test_eos_and_stop_sequences_end_generation(tiny):
    prompt = [[3, 1, 4, 1, 5]]
    free = jm.generate(tiny, prompt, max_new_tokens=20, ignore_eos=True).tokens[0]
    eos = free[5]
    m = jm.Model(dataclasses.replace(tiny.config, eos_token_ids=(eos,)), tiny.params)
    assert jm.generate(m, prompt, max_new_tokens=20).tokens[0] == free[: free.index(eos)]
    assert jm.generate(tiny, prompt, max_new_tokens=20, ignore_eos=True, stop=[free[7:9]]).tokens[0] == \
        free[: _find(free, free[7:9])]


def _find(xs, seq):
    return next(i for i in range(len(xs)) if xs[i: i + len(seq)] == seq)


def test_sampled_generation_depends_on_seed_only(tiny):
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=20, ignore_eos=True)
    a = jm.generate(tiny, [[1, 2, 3]], seed=7, **kw).tokens
    assert a == jm.generate(tiny, [[1, 2, 3]], seed=7, **kw).tokens
    assert a != jm.generate(tiny, [[1, 2, 3]], seed=8, **kw).tokens


def test_over_long_prompt_is_refused(tiny):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        jm.generate(tiny, [[1] * 4000], max_new_tokens=200)


# ------------------------------------------------------------------------------------------ cache
def test_sliding_layers_keep_a_window_sized_ring():
    """Cache bytes of sliding-window layers do not grow with the context; full layers do."""
    cfg = families.config_from_hf({**HF, "model_type": "cohere2", "num_hidden_layers": 4, "layer_norm_eps": 1e-5})
    small, large = M.init_cache(cfg, 1, 64, jnp.float32), M.init_cache(cfg, 1, 4096, jnp.float32)
    sliding, full = 0, 1  # kinds in order of first appearance: LLLG
    assert plan(cfg).kinds[sliding].attention.window == 6
    assert kv.bytes_by_kind(small)[sliding] == kv.bytes_by_kind(large)[sliding] == 2 * 3 * 6 * 2 * 8 * 4
    assert kv.bytes_by_kind(large)[full] == 64 * kv.bytes_by_kind(small)[full]


# ------------------------------------------------------------------------------------------- plan
def test_plan_scans_whole_periods_and_the_tail():
    from jaxmodels.plan import Run

    cfg = families.config_from_hf({**HF, "model_type": "cohere2", "num_hidden_layers": 10, "layer_norm_eps": 1e-5})
    pl = plan(cfg)
    one = lambda i: Run(i, 1, 1)  # noqa: E731
    # LLLG LLLG LL: two repeats of (3 sliding layers scanned, the global one), then the 2 sliding layers scanned
    assert pl.runs == (Run(0, 4, 2, (Run(0, 1, 3, (one(0),)), one(3))), Run(8, 1, 2, (one(8),)))
    assert pl.bodies() == 3 and pl.counts == (8, 2)
    assert pl.kind_of == (0, 0, 0, 1) * 2 + (0, 0)
    assert pl.rank_of == (0, 1, 2, 0, 3, 4, 5, 1, 6, 7)


def test_config_round_trips_through_json():
    cfg = families.config_from_hf({**HF, "model_type": "cohere", "use_qk_norm": True})
    assert ModelConfig.from_json(cfg.to_json()) == cfg


def test_bf16_batched_generation_runs_and_is_greedy(tiny):
    """bf16 params (the converter's default dtype) decode a batch on the CPU backend too."""
    m = jm.Model(tiny.config, jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny.params))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    out = jm.generate(m, prompts, max_new_tokens=6, ignore_eos=True).tokens
    for p, row in zip(prompts, out):
        logits = np.asarray(jm.forward(m, [p + row]))[0]
        assert len(row) == 6 and list(logits[len(p) - 1:-1].argmax(-1))[:1] == row[:1]
