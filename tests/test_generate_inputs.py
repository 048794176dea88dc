"""generate() refuses inputs that would give silently wrong results, and ends stop sequences on device (issue 17)."""
import dataclasses
import importlib
import re

import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

import jaxmodels as jm
from jaxmodels import families, model as M
from jaxmodels.sampling import Sampling

G = importlib.import_module("jaxmodels.generate")  # the module: jm.generate is the function
V = 97
HF = {"model_type": "mistral", "vocab_size": V, "hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
      "sliding_window": 6, "max_position_embeddings": 4096}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6]]
NEW = 16


def word_tokenizer(special=()):
    """Token i is the word "w{i}"; decode joins words with spaces."""
    tok = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(special))
    return jm.Tokenizer(tok)


@pytest.fixture(scope="module")
def tiny():
    cfg = families.config_from_hf(HF)
    return jm.Model(cfg, M.init_params(cfg, seed=1, std=0.3), word_tokenizer())


@pytest.fixture(scope="module")
def free(tiny):
    """The continuations without any stop: what the stop tests cut."""
    return jm.generate(tiny, PROMPTS, max_new_tokens=NEW, ignore_eos=True).tokens


@pytest.fixture
def calls(monkeypatch):
    """Decode steps and cache length of each jitted loop that generate() runs."""
    seen, real = [], G._generate

    def spy(*args, **kw):
        out, steps = real(*args, **kw)
        seen.append({"steps": int(steps), "max_len": kw["max_len"]})
        return out, steps

    monkeypatch.setattr(G, "_generate", spy)
    return seen


def _find(xs, seq):
    """Start of the first occurrence of seq in xs, else len(xs)."""
    return next((i for i in range(len(xs) - len(seq) + 1) if xs[i: i + len(seq)] == seq), len(xs))


# ------------------------------------------------------------------------------------------ prompt ids
@pytest.mark.parametrize("bad", [-1, V, 10**6, 2.0, np.float32(3), True, np.bool_(False)])
def test_bad_token_ids_are_refused_naming_prompt_and_id(tiny, bad):
    with pytest.raises(ValueError, match=rf"prompt 1\b.*{re.escape(repr(bad))}"):
        jm.generate(tiny, [[1, 2], [3, bad, 4]], max_new_tokens=2)


def test_float_array_bytes_and_empty_prompts_are_refused(tiny):
    with pytest.raises(ValueError, match="prompt 0.*3.0"):
        jm.generate(tiny, [np.array([3.0, 4.0])], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is bytes"):
        jm.generate(tiny, [[1], b"hi"], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 has no tokens"):
        jm.generate(tiny, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="no prompts"):
        jm.generate(tiny, [], max_new_tokens=2)


def test_integer_arrays_are_prompts(tiny, free):
    out = jm.generate(tiny, [np.asarray(p, np.int64) for p in PROMPTS], max_new_tokens=NEW, ignore_eos=True)
    assert out.tokens == free


# ------------------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("name, value", [
    ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", -1.0), ("temperature", "1"),
    ("top_k", 0), ("top_k", 2.5), ("top_k", True), ("top_p", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("min_p", float("nan")), ("min_p", -0.1), ("min_p", 1.1),
    ("seed", 1.5), ("seed", "0"), ("seed", -1), ("seed", 2**32)])
def test_bad_sampling_arguments_are_refused_by_name(tiny, name, value):
    kw = {"temperature": 1.0, name: value}
    with pytest.raises(ValueError, match=name):
        jm.generate(tiny, [[1, 2]], max_new_tokens=2, **kw)


def test_nan_temperature_is_refused_by_sampling():
    with pytest.raises(ValueError, match="temperature"):
        Sampling(float("nan"))


@pytest.mark.parametrize("temperature", [1e-40, 1e-37, 1e-30, 1e-8])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    """Tiny temperatures tend to greedy: logits / 1e-40 overflowed to inf, the softmax gave NaN and token 0
    came out every time. Both samplers (jm.generate's and the serving engine's per-row one) scale alike; the
    engine's takes float32 temperatures, where 1e-40 is subnormal (may read as 0: greedy), 1e-37 is not."""
    import jax

    from jaxmodels.sampling import sample
    from serving.runner import _sample

    logits = jax.numpy.asarray(np.random.default_rng(0).standard_normal((4, V)).astype(np.float32) * 30)
    want = np.argmax(np.asarray(logits), axis=-1)
    for seed in range(4):
        assert (np.asarray(sample(logits, jax.random.PRNGKey(seed), Sampling(temperature))) == want).all()
    rows = np.arange(4)
    s = {"temperature": np.full(4, temperature, np.float32), "seed": rows, "index": rows}
    tok = _sample(logits, None, rows, s, sampled=True, filtered=False, penalized=False, top_n=0)[0]
    assert (np.asarray(tok) == want).all()


def test_a_huge_temperature_is_uniform_not_nan():
    import jax

    from jaxmodels.sampling import sample

    logits = jax.numpy.asarray([[0.0, 5.0, -jax.numpy.inf, 1.0]] * 512)
    got = np.asarray(sample(logits, jax.random.PRNGKey(0), Sampling(1e300)))
    counts = np.bincount(got, minlength=4)
    assert counts[2] == 0 and all(c > 100 for c in counts[[0, 1, 3]])  # 1/3 each, never the -inf token


# ------------------------------------------------------------------------------------------ stops
def test_empty_and_malformed_stops_are_refused(tiny):
    for stop, what in (([""], "stop 0 is an empty string"), ("", "stop 0 is an empty string"),
                       ([[1], []], "stop 1 has no tokens"), ([5, 6], "stop must be"), ([[1.5]], "stop 0.*1.5"),
                       ([[V]], f"stop 0.*{V}"), ([b"w1"], "stop 0 is bytes")):
        with pytest.raises(ValueError, match=what):
            jm.generate(tiny, [[1, 2]], max_new_tokens=2, stop=stop)
    with pytest.raises(ValueError, match="no tokenizer"):
        jm.generate(jm.Model(tiny.config, tiny.params), [[1, 2]], max_new_tokens=2, stop=["w1"])


def test_token_stops_end_rows_on_device_and_others_go_on(tiny, free, calls):
    """Row 0 stops at a pair of its own tokens (absent from row 1), which continues to the end."""
    pair = free[0][3:5]
    assert _find(free[0], pair) == 3 and all(free[1][i: i + 2] != pair for i in range(NEW))
    out = jm.generate(tiny, PROMPTS, max_new_tokens=NEW, ignore_eos=True, stop=[pair])
    assert out.tokens == [free[0][:3], free[1]] and calls[-1]["steps"] == NEW
    # a stop for each row: the loop ends as soon as both have stopped
    stops = [[free[0][4]], free[1][1:3]]
    out = jm.generate(tiny, PROMPTS, max_new_tokens=NEW, ignore_eos=True, stop=stops)
    cut = [min(_find(r, s) for s in stops) for r in free]  # first start of any stop
    assert cut[0] < NEW and cut[1] < NEW
    assert out.tokens == [r[:c] for r, c in zip(free, cut)]
    ends = [min(_find(r, s) + len(s) for s in stops) for r in free]  # where the device saw each stop
    assert calls[-1]["steps"] == max(ends)


def test_a_bare_string_is_one_stop_sequence_ended_on_device(tiny, free, calls):
    k = next(k for k in range(2, NEW) if free[0][k] not in free[0][:k] and f"w{free[0][k]}" not in
             tiny.tokenizer.decode(free[0][:k]))  # a word whose first appearance in the text is at token k
    word = f"w{free[0][k]}"
    out = jm.generate(tiny, PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True, stop=word)
    assert out.tokens == [free[0][:k]] and out.texts == [tiny.tokenizer.decode(free[0][:k])]
    assert calls[-1]["steps"] == k + 1
    assert jm.generate(tiny, PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True, stop=[word]).tokens == out.tokens


def test_multi_token_string_stop_is_excluded_whole(tiny, free, calls):
    text = tiny.tokenizer.decode(free[0][7:9])  # "wA wB": two tokens
    k = _find(free[0], free[0][7:9])
    out = jm.generate(tiny, PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True, stop=[text])
    assert out.tokens == [free[0][:k]] and text not in out.texts[0]
    assert out.texts[0] == tiny.tokenizer.decode(free[0][:k]) and calls[-1]["steps"] == k + 2


def test_special_token_string_stop_ends_generation(tiny, free, calls):
    """A special token never shows in the decoded text: only its ids can find it."""
    special = free[0][6]
    m = jm.Model(tiny.config, tiny.params, word_tokenizer(special=[f"w{special}"]))
    out = jm.generate(m, PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True, stop=[f"w{special}"])
    k = free[0].index(special)
    assert out.tokens == [free[0][:k]] and calls[-1]["steps"] == k + 1


def test_string_stop_spelled_by_other_tokens_is_still_cut_on_the_host(tiny, free):
    """"w57 w9" is not a token sequence the model makes, but "w57 w91" contains it as text."""
    words = tiny.tokenizer.decode(free[0][:2])
    out = jm.generate(tiny, PROMPTS[:1], max_new_tokens=NEW, ignore_eos=True, stop=[words[:-1]])
    assert out.texts == [""] and out.tokens == [[]]


# ------------------------------------------------------------------------------------------ max_len
def test_max_len_is_bounded_by_the_context_and_must_be_an_int(tiny):
    with pytest.raises(ValueError, match="max_position_embeddings=4096"):
        jm.generate(tiny, [[1, 2]], max_new_tokens=2, max_len=4097)
    with pytest.raises(ValueError, match="max_len"):
        jm.generate(tiny, [[1, 2]], max_new_tokens=2, max_len=20.0)
    with pytest.raises(ValueError, match="max_len"):
        jm.generate(tiny, [[1, 2]], max_new_tokens=8, max_len=9)


def test_default_max_len_is_capped_at_the_context(tiny, calls):
    short = jm.Model(dataclasses.replace(tiny.config, max_position_embeddings=40), tiny.params)
    jm.generate(short, [[1, 2, 3, 4, 5]], max_new_tokens=30, ignore_eos=True)  # 35 would round up to 64
    assert calls[-1]["max_len"] == 40
    with pytest.raises(ValueError, match="max_position_embeddings=40"):
        jm.generate(short, [[1, 2, 3, 4, 5]], max_new_tokens=36)


def test_stop_lists_share_one_compilation(tiny):
    """The stop table is bucketed: no stops, one, two, and a three-token stop run the same program."""
    jm.generate(tiny, PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    before = G._generate._cache_size()
    for stop in ([[5]], [[5, 6]], [[5], [7]], [[9, 9, 9]]):
        jm.generate(tiny, PROMPTS, max_new_tokens=NEW, ignore_eos=True, stop=stop)
    assert G._generate._cache_size() == before
