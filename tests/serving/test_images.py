"""The engine with images against `jm.generate` with the same images (the path it replaces): Gemma3 (an image's
soft tokens attend to each other, so a chunk never splits them) and Mistral3 (images of different sizes), chunked
prefill with small budgets, preemption, and prefix caching that shares blocks only between requests with the same
images; DeepSeek V4.1 (span rows, bias_vl routing, dead Engram spans) and Mllama (cross-attention K/V kept per row)
through whole-prompt prefill, with preemption and rows reused; the OpenAI server's image_url parts for each family
and its 400s; offline LLM; Mllama's text with penalties (its head is narrower than its embedding)."""
import base64
import dataclasses
import io

import jax
import pytest

import converters
import jaxmodels as jm
from jaxmodels import multimodal
from serving import Engine, EngineConfig, SamplingParams
from tests.parity.test_vision import _gemma_prompt, _picture, _pixtral_tokens, gemma3, mistral3  # noqa: F401
from tests.serving.conftest import serve

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


def _serve(model, requests, block_size=4, **options):
    engine = Engine(model, EngineConfig(**{"max_num_seqs": 4, "block_size": block_size, "max_model_len": 64, **options}))
    for i, (ids, images) in enumerate(requests):
        engine.add(str(i), ids, GREEDY, images)
    got = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    assert all(engine.pool.used(s) == 0 for s in range(len(engine.pool.spaces))), "blocks leaked"
    return [got[str(i)] for i in range(len(requests))], engine


def _reference(model, ids, pics):
    return jm.generate(model, [ids], max_new_tokens=8, ignore_eos=True, images=[pics]).tokens[0]


@pytest.mark.parametrize("options", [{"max_num_batched_tokens": 12}, {"enable_prefix_caching": False, "max_num_batched_tokens": 9},
                                     {"kv_blocks": 72, "max_num_batched_tokens": 16}])
def test_gemma3_engine_equals_generate(gemma3, options):  # noqa: F811
    _, _, model = gemma3
    pics = [[_picture(40, 50, i)] for i in range(3)] + [[_picture(30, 30, 5), _picture(60, 20, 6)]]
    prompts = [_gemma_prompt(1) + [30 + i] * (3 + 4 * i) for i in range(3)] + [_gemma_prompt(2)]
    requests = [(p, multimodal.prepare(model, [p], [pic])[1]) for p, pic in zip(prompts, pics)]
    # block size 1: the tiny model's window of 4 caps prefix-cached chunks at 4 - bs + 1 tokens
    got, engine = _serve(model, requests, block_size=1, **options)
    assert got == [_reference(model, p, pic) for p, pic in zip(prompts, pics)]
    assert ("kv_blocks" in options) == (engine.scheduler.preemptions > 0)


def test_prefix_cache_shares_only_same_images(gemma3):  # noqa: F811
    _, _, model = gemma3
    p = _gemma_prompt(1) + list(range(30, 50))
    a, b = [_picture(40, 50, 1)], [_picture(40, 50, 2)]
    arrays = {k: multimodal.prepare(model, [p], [v])[1] for k, v in (("a", a), ("b", b))}
    got, engine = _serve(model, [(p, arrays["a"]), (p, arrays["a"]), (p, arrays["b"]), (p, None)],
                         block_size=1, max_num_batched_tokens=64, max_num_seqs=1)
    assert got[0] == got[1] == _reference(model, p, a) and got[2] == _reference(model, p, b)
    assert got[3] == jm.generate(model, [p], max_new_tokens=8, ignore_eos=True).tokens[0]
    assert engine.counters["cached_prompt_tokens"] == 32  # only the second request hit: 8 full blocks of 4


def test_mistral3_engine_equals_generate(mistral3):  # noqa: F811
    _, _, model = mistral3
    pics = [[_picture(50, 80, 1)], [_picture(90, 30, 2), _picture(28, 28, 3)]]
    prompts = []
    for row in pics:
        out = multimodal.process(model, row)
        ids = [1, 5]
        for r, c in out["token_grid"]:
            ids += _pixtral_tokens(int(r), int(c)) + [7]
        prompts.append(ids)
    requests = [(p, multimodal.prepare(model, [p], [pic])[1]) for p, pic in zip(prompts, pics)]
    got, _ = _serve(model, requests, max_num_batched_tokens=8)
    assert got == [_reference(model, p, pic) for p, pic in zip(prompts, pics)]


def test_bad_images_are_refused(gemma3):  # noqa: F811
    _, _, model = gemma3
    p = _gemma_prompt(1)
    arrays = multimodal.prepare(model, [p], [[_picture(40, 50, 1)]])[1]
    engine = Engine(model, EngineConfig(max_num_seqs=2, block_size=1, max_num_batched_tokens=3))
    with pytest.raises(ValueError, match=r"an image takes 4 tokens, more than a prefill chunk holds \(3\)"):
        engine.add("x", p, GREEDY, arrays)
    with pytest.raises(ValueError, match="fill 4 image tokens .* hold 0"):
        engine.add("y", [1, 2, 3], GREEDY, arrays)


TEMPLATE = ("{% for m in messages %}<bos>{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
            "{% endfor %}")


def test_openai_image_url_parts(gemma3):  # noqa: F811
    """`image_url` parts with data: URIs through the official client equal jm.generate with the same image;
    http(s) URLs and images for a text-only model are refused with a 400 naming the part."""
    import base64
    import dataclasses
    import io

    import openai

    from serving.api import build_app
    from tests.parity.test_vision import _word_tokenizer
    from tests.serving.conftest import serve

    _, _, model = gemma3
    model = dataclasses.replace(model, tokenizer=jm.Tokenizer(_word_tokenizer(), TEMPLATE, "<bos>", "<eos>"))
    pic = _picture(40, 50, 3)
    buf = io.BytesIO()
    pic.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "text", "text": "w5 "}, {"type": "image_url", "image_url": {"url": uri}},
               {"type": "text", "text": " w6 w7"}]
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "w5 "}, {"type": "image"}, {"type": "text", "text": " w6 w7"}]}])
    ids, _ = multimodal.prepare(model, [text], [[pic]], templated=True)
    want = jm.generate(model, ids, max_new_tokens=8, ignore_eos=True, images=[[pic]])
    engine = Engine(model, EngineConfig(max_num_seqs=2, block_size=1, max_model_len=64))
    with serve(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                             max_tokens=8, temperature=0, logprobs=True,
                                             extra_body={"ignore_eos": True})
        # token by token (a word-level decoder joins words with spaces, which incremental text cannot reproduce)
        assert [t.token for t in got.choices[0].logprobs.content] == [
            model.tokenizer.decode([i], skip_special_tokens=False) for i in want.tokens[0]]
        assert len(want.tokens[0]) == 8
        assert got.usage.prompt_tokens == len(ids[0])
        bad = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
        refused = r"messages\[0\]\.content\[0\]: image_url must be a data: URI .* the server fetches nothing"
        with pytest.raises(openai.BadRequestError, match=refused):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": bad}], max_tokens=2)
        local = [{"type": "image_url", "image_url": {"url": "/etc/hostname"}}]  # never a path on the server
        with pytest.raises(openai.BadRequestError, match=r"content\[0\]: image_url must be a data: URI"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": local}], max_tokens=2)
        broken = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": broken}], max_tokens=2)
    text_only = dataclasses.replace(model, config=dataclasses.replace(model.config, vision=None),
                                    params={k: v for k, v in model.params.items() if k != "vision"})
    with serve(build_app(Engine(text_only, EngineConfig(max_num_seqs=2, max_model_len=64)), "t")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model="t", messages=[{"role": "user", "content": content}], max_tokens=2)


def test_offline_llm_with_images(gemma3):  # noqa: F811
    from serving import LLM

    _, _, model = gemma3
    pics = [[_picture(40, 50, 7)], []]
    prompts = [_gemma_prompt(1) + [33, 34], [2, 40, 41]]
    llm = LLM(model, max_num_seqs=2, block_size=1, max_model_len=64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, images=pics)]
    assert got == [_reference(model, prompts[0], pics[0]),
                   jm.generate(model, [prompts[1]], max_new_tokens=8, ignore_eos=True).tokens[0]]


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    """The tiny Mllama of tests/parity/test_vision.py (one cross-attention layer, 28-px tiles, up to 4), imported."""
    from tests.parity.test_vision import _mllama

    path = tmp_path_factory.mktemp("mllama")
    _mllama().save_pretrained(path / "hf")
    return jm.load(converters.convert(path / "hf", path / "out", dtype="float32", progress=False))


@pytest.fixture(scope="module")
def deepseek41(tmp_path_factory):
    """The tiny DeepSeek V4.1 with a vision tower of tests/parity/test_deepseek_vision.py (mHC, Engram, MoE with
    bias_vl), imported."""
    from tests.parity.test_deepseek_vision import _write

    path = tmp_path_factory.mktemp("v41")
    (path / "ckpt").mkdir()
    _write(path / "ckpt")
    return jm.load(converters.convert(path / "ckpt", path / "out", dtype="float32", progress=False))


def _requests(model, prompts, pics):
    """(prompt ids with the images' tokens expanded, processed images or None) per request."""
    return [(ids[0], arrays) for ids, arrays in
            (multimodal.prepare(model, [p], [row]) if row else ([p], None) for p, row in zip(prompts, pics))]


def _references(model, prompts, pics):
    return [_reference(model, p, row) if row else
            jm.generate(model, [p], max_new_tokens=8, ignore_eos=True).tokens[0] for p, row in zip(prompts, pics)]


@pytest.mark.parametrize("options", [{}, {"kv_blocks": 5}, {"max_num_batched_tokens": 7}],
                         ids=["default", "preempted", "chunks"])
def test_deepseek_v41_engine_equals_generate(deepseek41, options, monkeypatch):
    """Two images of different sizes in one prompt (each image token expanded to its span), one in another, a
    text-only request beside them: the engine's greedy tokens equal jm.generate's, preempted requests included
    (recomputed with their images), and with a budget of 7 tokens a step the image spans prefill in several
    chunks through M.extend."""
    from serving.runner import Runner
    from tests.parity.test_deepseek_vision import IMG, _pictures

    model = deepseek41
    a, b, c = _pictures()
    prompts = [[7, 8, IMG, 9, 10, IMG, 11], [5, IMG, 6, 12], [12, 13, 14]]
    pics = [[a, b], [c], []]
    requests = _requests(model, prompts, pics)
    run, chunks = Runner.run, []

    def recorded(self, how, pieces, table):
        chunks.extend((how, r.id, start, n) for r, start, n in pieces if how != "decode")
        return run(self, how, pieces, table)

    monkeypatch.setattr(Runner, "run", recorded)
    got, engine = _serve(model, requests, **{"max_num_batched_tokens": 64, **options})
    assert got == _references(model, [p for p, _ in requests], pics)
    assert engine.runner.extend_ok and {how for how, *_ in chunks} == {"extend"}
    later = {rid for _, rid, start, _ in chunks if start > 0}  # requests prefilled in more than one chunk
    if "max_num_batched_tokens" in options:  # spans longer than the step's budget of 7 tokens
        assert {"0", "1"} <= later, chunks
    assert ("kv_blocks" in options) == (engine.scheduler.preemptions > 0)


@pytest.mark.parametrize("options", [{}, {"kv_blocks": 8, "max_model_len": 32}, {"max_num_seqs": 1}],
                         ids=["default", "preempted", "one-row"])
def test_mllama_engine_equals_generate(mllama, options):
    """Images before, after and without text, and a text-only request: equal to jm.generate. The cross-attention
    K/V are computed by the prefill and kept in the row (decode reads them); preempted requests recompute them;
    with one row, a text-only request takes the row an image request left (its K/V must not leak)."""
    prompts = [[512, 1, 30, 31, 32, 33], [1, 40, 512, 41, 42], [1, 50, 51, 52, 53, 54, 55], [512, 1, 60]]
    pics = [[_picture(50, 20, 9)], [_picture(30, 60, 3)], [], [_picture(60, 60, 4)]]
    got, engine = _serve(model := mllama, _requests(model, prompts, pics), **options)
    assert got == _references(model, prompts, pics)
    assert ("kv_blocks" in options) == (engine.scheduler.preemptions > 0)


def test_mllama_image_slots(mllama):
    """max_images_per_prompt sizes each row's kept K/V: two images fill two slots (equal to jm.generate), a third
    is refused, and the default (one) refuses a second."""
    prompts = [[512, 1, 30, 512, 31, 32], [1, 40, 41]]
    pics = [[_picture(50, 20, 1), _picture(20, 60, 2)], []]
    got, _ = _serve(mllama, _requests(mllama, prompts, pics), max_images_per_prompt=2)
    assert got == _references(mllama, prompts, pics)
    three = multimodal.prepare(mllama, [[512, 512, 512, 1]], [[_picture(30, 30, i) for i in range(3)]])[1]
    with pytest.raises(ValueError, match=r"the prompt has 3 images; this engine takes at most 2 per prompt "
                                         r"\(max_images_per_prompt\)"):
        Engine(mllama, EngineConfig(max_num_seqs=1, max_model_len=32, max_images_per_prompt=2)).add(
            "x", [512, 512, 512, 1], GREEDY, three)
    with pytest.raises(ValueError, match="has 2 images; this engine takes at most 1"):
        Engine(mllama, EngineConfig(max_num_seqs=1, max_model_len=32)).add("y", prompts[0], GREEDY,
                                                                           _requests(mllama, prompts, pics)[0][1])


def test_mllama_text_with_penalties(mllama):
    """Penalty counts are as wide as the head (V), not the embedding (V + 8)."""
    model = mllama
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, presence_penalty=0.5)
    got, _ = _serve(model, [([1, 30, 31, 32], None)], **{})
    engine = Engine(model, EngineConfig(max_num_seqs=2, block_size=4, max_model_len=64))
    engine.add("p", [1, 30, 31, 32], params)
    out = []
    while engine.has_work():
        for o in engine.step():
            out += o.token_ids
    assert len(out) == 6 and max(out) < 512 and got[0] == jm.generate(model, [[1, 30, 31, 32]], max_new_tokens=8,
                                                                          ignore_eos=True).tokens[0]


def _words(vocab: int, special: dict):
    """A word-level tokenizer naming every id (w<id>) but the special ones, so that each token's text is its own."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    ids = set(special.values())
    tk = tokenizers.Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab) if i not in ids} | special,
                                               unk_token="w3"))
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special])
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tk


def _uri(picture, fmt="PNG") -> str:
    buf = io.BytesIO()
    picture.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("family", ["deepseek_v41", "mllama"])
def test_openai_image_url_deepseek_and_mllama(family, request):
    """A data: URI image through the official client equals jm.generate with the same image; a corrupt image, an
    http URL and more images than the engine takes are 400s naming the part or the limit, and the server stays
    healthy."""
    import openai

    from serving.api import build_app

    model = request.getfixturevalue("deepseek41" if family == "deepseek_v41" else "mllama")
    mark = {"deepseek_v41": "<｜deepseek_image｜>", "mllama": "<|image|>"}[family]
    template = ("{% for m in messages %}<bos>{% if m.content is string %}{{ m.content }}{% else %}"
                "{% for p in m.content %}{% if p.type == 'image' %}" + mark + "{% else %}{{ p.text }}{% endif %}"
                "{% endfor %}{% endif %}{% endfor %}")
    tk = _words(model.config.vocab_size, {"<bos>": 1, "<eos>": 2, mark: model.config.vision.image_token_id})
    model = dataclasses.replace(model, tokenizer=jm.Tokenizer(tk, template, "<bos>", "<eos>"))
    pic = _picture(40, 30, 11)
    parts = [{"type": "text", "text": "w5 "}, {"type": "image"}, {"type": "text", "text": " w6 w7"}]
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    ids, _ = multimodal.prepare(model, [text], [[pic]], templated=True)
    want = jm.generate(model, ids, max_new_tokens=8, ignore_eos=True, images=[[pic]]).tokens[0]
    content = [{"type": "text", "text": "w5 "}, {"type": "image_url", "image_url": {"url": _uri(pic)}},
               {"type": "text", "text": " w6 w7"}]
    engine = Engine(model, EngineConfig(max_num_seqs=2, block_size=4, max_model_len=96, max_images_per_prompt=1))
    with serve(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

        def chat(content, **kw):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True}, **kw)

        got = chat(content, logprobs=True)
        assert [t.token for t in got.choices[0].logprobs.content] == [f"w{i}" for i in want]
        assert got.usage.prompt_tokens == len(ids[0]) and got.usage.completion_tokens == 8
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
            b"\x89PNG\r\n\x1a\n not a png").decode()}}
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[1\]: not a readable image"):
            chat([content[0], broken])
        remote = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]: image_url must be a "
                                                         r"data: URI .* the server fetches nothing"):
            chat([remote])
        with pytest.raises(openai.BadRequestError, match=r"the prompt has 2 images; this engine takes at most 1"):
            chat([content[1], content[1], content[2]])
        assert chat(content).choices[0].message.content == got.choices[0].message.content  # still serving
