"""Multimodal prefill through the TT generator (issue #14 item 5): the vision tower runs in JAX on the host, its
input embeddings enter the emulated TT text prefill, Gemma3's image soft tokens attend to each other through
prefill attention masks, decode is the text program (Mllama, whose images enter cross-attention layers instead:
tests/tt/test_mllama_tt.py).

The models are tests/parity/test_vision.py's tiny random Gemma3 (SigLIP, sliding window 4 < an image's 4 soft
tokens + its markers) and Mistral3 (Pixtral, images of different sizes), converted through the public path.
References are `jm.forward` of the whole sequence (prompt + generated tokens) with the same images, and
`jm.generate(..., images=)` for the greedy tokens. Criteria, as tests/tt uses them for text: at exact numerics
the logits equal jm.forward (rtol = atol = 1e-4, test_generator's emulated-program test) and the greedy tokens
equal jm.generate; at full TT numerics (the "performance" policy) every prefill / decode step's logits have
PCC >= 0.99 (teacher-forced with the reference tokens, so a bf16 near-tie cannot shift the comparison).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import converters
import jaxmodels as jm
from jaxmodels import multimodal
from tests.parity.test_vision import SOFT, _gemma3, _gemma_prompt, _mistral3, _picture, _pixtral_tokens
from tests.tt.test_emu_ops import comp_pcc
from tests.tt.test_tt_forward import tiny_config, tiny_model
from tt_backend import generator as G, lowering
from tt_backend.emu import ops
from tt_backend.emu.executor import Executor

BS, MAX_SEQ, STEPS = 32, 256, 3
WIDTH = MAX_SEQ // BS  # page-table columns per user


def _convert(tmp_path_factory, name, build):
    src = tmp_path_factory.mktemp(name) / "hf"
    build().save_pretrained(src)
    return jm.load(converters.convert(src, src.parent / "out", dtype="float32", progress=False))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _convert(tmp_path_factory, "gemma3", _gemma3)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return _convert(tmp_path_factory, "mistral3", _mistral3)


def _generator(cls, model, numerics, users=3, **kw):
    gen = cls.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), users, MAX_SEQ, model=model, numerics=numerics,
                                    **kw)
    kv = gen.allocate_kv_cache((users * WIDTH + 2, model.config.num_kv_heads, BS, model.config.head_dim), np.float32,
                               model.config.num_layers)
    perm = np.random.default_rng(0).permutation(users * WIDTH + 2)[: users * WIDTH].astype(np.int32)
    return gen, kv, perm.reshape(users, WIDTH)  # each user its own shuffled blocks


def _prompt_batch(prompts):
    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens


def _run(gen, kv, pt, prompts, feed=None, prefill=None, **image_kw):
    """Prefill every user (images by `image_kw`), then STEPS decode steps fed `feed[user]` (teacher forcing) or
    the greedy token -> (tokens [users, STEPS + 1], logits [users, STEPS + 1, vocab])."""
    lens = [len(p) for p in prompts]
    call = prefill or gen.prefill_forward
    logits = [call(_prompt_batch(prompts), page_table=pt, kv_cache=kv, prompt_lens=lens, **image_kw)[:, 0]]
    toks = [logits[0].argmax(-1)]
    for s in range(STEPS):
        fed = toks[-1] if feed is None else np.asarray([f[s] for f in feed])
        logits.append(gen.decode_forward(fed, np.asarray(lens) + s, page_table=pt, kv_cache=kv,
                                         enable_trace=False)[:, 0])
        toks.append(logits[-1].argmax(-1))
    return np.stack(toks, 1), np.stack(logits, 1)


def _batched_images(processed) -> dict:
    """All users' processed images as one batch's (images fill the rows in order): pixel_values zero-padded to
    the largest height and width, each image's own size in image_sizes (Pixtral reads only that part)."""
    rows = [a for a in processed if a]
    H, W = (max(a["pixel_values"].shape[d] for a in rows) for d in (2, 3))
    pv = np.concatenate([np.pad(a["pixel_values"], ((0, 0), (0, 0), (0, H - a["pixel_values"].shape[2]),
                                                    (0, W - a["pixel_values"].shape[3]))) for a in rows])
    out = {"pixel_values": pv}
    if "image_sizes" in rows[0]:
        out["image_sizes"] = np.concatenate([a["image_sizes"] for a in rows])
    return out


def _reference(model, prompts, wants, processed, bidirectional=True):
    """jm.forward of every user's whole sequence (prompt + generated tokens but the last), right-padded into one
    batch with all the images -> per user the logits at the prompt's last position and each decode position
    [STEPS + 1, vocab]. Right padding changes no earlier position (causal; padding is text)."""
    seqs = _prompt_batch([list(p) + list(w[:-1]) for p, w in zip(prompts, wants)])
    kw = _batched_images(processed)
    if bidirectional and model.config.vision.kind == "siglip":
        kw["token_type_ids"] = (seqs == SOFT).astype(np.int32)
    logits = np.asarray(jm.forward(model, seqs, **kw))
    return [logits[u, len(p) - 1:len(p) + STEPS] for u, p in enumerate(prompts)]


def _greedy(model, prompts, pics):
    """jm.generate's greedy tokens (prefill + STEPS decode steps) of each user with its images (one batch)."""
    out = jm.generate(model, prompts, max_new_tokens=STEPS + 1, ignore_eos=True, images=pics).tokens
    assert not any(model.config.vision.image_token_id in w for w in out)  # the reference forward sees no new image
    return out


def _check(model, prompts, wants, got_tokens, got_logits, processed, bidirectional, numerics):
    refs = _reference(model, prompts, wants, processed, bidirectional)
    for u, (ref, want) in enumerate(zip(refs, wants)):
        if numerics == "exact":
            assert got_tokens[u].tolist() == want, f"user {u}: greedy {got_tokens[u].tolist()} != jm.generate {want}"
            np.testing.assert_allclose(got_logits[u], ref, rtol=1e-4, atol=1e-4, err_msg=f"user {u}")
        else:
            for s in range(STEPS + 1):
                ok, pcc = comp_pcc(ref[s], got_logits[u, s], 0.99)
                assert ok, f"user {u} step {s} (0 = prefill): PCC {pcc:.5f} < 0.99"


def _gemma_users(gen):
    prompts = [_gemma_prompt(2), _gemma_prompt(1, text=(30, 31, 32, 33)), [2, 10, 40, 41, 42, 43, 44]]
    pics = [[_picture(40, 90, 0), _picture(70, 30, 1)], [_picture(56, 56, 2)], []]
    processed = []
    for p, row in zip(prompts, pics):
        ids, arrays = gen.input_processor(p, row)
        assert ids == p  # token-id prompts hold their image tokens already
        processed.append(arrays)
    return prompts, pics, processed


@pytest.mark.parametrize("numerics", ["exact", "full"])
def test_gemma3_images_prefill_and_decode(gemma3, numerics):
    """One user with two images, one with one, one text-only, in one prefill_forward; then batched decode.
    Exact: images given raw (processed here) and processed (a mapping); full: tt-metal's per-user pixel_values."""
    gen, kv, pt = _generator(G.Gemma3ForConditionalGeneration, gemma3, numerics)
    prompts, pics, processed = _gemma_users(gen)
    wants = _greedy(gemma3, prompts, pics)
    if numerics == "exact":
        toks, logits = _run(gen, kv, pt, prompts, images=[pics[0], processed[1], None])
        # the bidirectional image blocks mattered: plain causal attention gives other logits from the images on
        causal = _reference(gemma3, prompts, wants, processed, bidirectional=False)
        assert all(np.abs(causal[u][0] - logits[u, 0]).max() > 1e-3 for u in (0, 1))
    else:
        toks, logits = _run(gen, kv, pt, prompts, feed=wants,
                            pixel_values=[a["pixel_values"] if a else None for a in processed])
    _check(gemma3, prompts, wants, toks, logits, processed, True, numerics)


@pytest.mark.parametrize("numerics", ["exact", "full"])
def test_mistral3_images_prefill_and_decode(mistral3, numerics):
    """Two images of different sizes (zero-padded to one pixel_values with image_sizes), one image, text only.
    Exact: tt-metal's positional prefill_forward(tokens, images, page_table, kv_cache, prompt_lens); full:
    per-user pixel_values / image_sizes lists."""
    gen, kv, pt = _generator(G.Mistral3ForConditionalGeneration, mistral3, numerics)
    pics = [[_picture(50, 80, 3), _picture(84, 30, 4)], [_picture(60, 60, 5)], []]
    prompts, processed = [], []
    for j, row in enumerate(pics):
        grids = multimodal.process(mistral3, row)["token_grid"] if row else []
        p = [1, 5 + j] + [t for r, c in grids for t in (*_pixtral_tokens(int(r), int(c)), 7)] + [8, 9]
        ids, arrays = gen.input_processor(p, row)
        prompts.append(ids)
        processed.append(arrays)
    assert processed[0]["pixel_values"].shape[0] == 2 and len({tuple(s) for s in processed[0]["image_sizes"]}) == 2
    wants = _greedy(mistral3, prompts, pics)
    if numerics == "exact":
        toks, logits = _run(gen, kv, pt, prompts, images=[pics[0], processed[1], []],
                            prefill=lambda tokens, **kw: gen.prefill_forward(
                                tokens, kw.pop("images"), kw.pop("page_table"), kw.pop("kv_cache"),
                                kw.pop("prompt_lens")))
    else:
        toks, logits = _run(gen, kv, pt, prompts, feed=wants,
                            pixel_values=[a["pixel_values"] if a else None for a in processed],
                            image_sizes=[a["image_sizes"] if a else None for a in processed])
    _check(mistral3, prompts, wants, toks, logits, processed, False, numerics)


def test_gemma3_images_through_sliding_rings(gemma3):
    """The same through `tt_backend.executor_factory`'s VLLMExecutor with hybrid KV-cache groups: the sliding layer
    (window 4) keeps a ring of 64 tokens in its own blocks, the prompt (two images, then text) is longer than the
    ring, and the masked prefill fills it; logits equal jm.forward at exact numerics."""
    from tt_backend.emu.executor import executor_factory

    gen = G.Gemma3ForConditionalGeneration.initialize_vllm_model(
        gemma3.config, G.EmulatedMesh((1, 1)), 1, MAX_SEQ, model=gemma3, hybrid_kv_cache_groups=True,
        executor_factory=executor_factory(gemma3, numerics="exact"))
    assert gen.cache_position_modulo() == [64, None]
    kv = gen.allocate_kv_cache_per_layer([((20, 1, BS, 32), np.float32, 0), ((20, 1, BS, 32), np.float32, 1)])
    pics = [[_picture(40, 90, 0), _picture(70, 30, 1)]]
    prompts = [_gemma_prompt(2) + list(range(30, 90))]
    wants = _greedy(gemma3, prompts, pics)
    tables = [np.array([[3, 7]], np.int32), np.arange(10, 18, dtype=np.int32)[None]]
    ids, processed = gen.input_processor(prompts[0], pics[0])
    got = [gen.prefill_forward(np.asarray([ids]), kv_cache=kv, page_tables_per_layer=tables, images=[processed])]
    for s in range(STEPS):
        got.append(gen.decode_forward(np.array([wants[0][s]]), np.array([len(ids) + s]), kv_cache=kv,
                                      page_tables_per_layer=tables, enable_trace=False))
    ref = _reference(gemma3, prompts, wants, [processed])[0]
    np.testing.assert_allclose(np.concatenate(got)[:, 0], ref, rtol=1e-4, atol=1e-4)


def test_embeddings_input_equals_the_token_lookup():
    """The lowered prefill from input embeddings (the lookup and embed scale done on the host) equals the token
    path at exact numerics; Gemma3's text config has an embed scale, so a missing or doubled scale would show."""
    model = tiny_model("gemma3")
    ex = Executor(model, numerics="exact", max_seq_len=256)
    ids = np.random.default_rng(3).integers(0, 256, 40)
    emb = np.asarray(model.params["embed"])[ids] * model.config.embed_scale
    row = np.arange(8, dtype=np.int32)
    want = ex.prefill(ids, row, ex.allocate_kv_cache(8))
    got = ex.prefill(ids, row, ex.allocate_kv_cache(8), embeddings=emb)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # all-text image blocks: the masked program is the causal one
    np.testing.assert_allclose(ex.prefill(ids, row, ex.allocate_kv_cache(8), embeddings=emb,
                                          image_blocks=np.full(40, -1)), want, rtol=1e-5, atol=1e-5)


def test_masked_prefill_program():
    """embeddings=True replaces the token input and lookup; attention_mask=True gives one [1, 1, S, S] mask input
    per distinct window and non-causal SDPA reading it (the window moved into the mask); decode is unchanged."""
    cfg = tiny_config("gemma3")  # sliding (48) + full layers
    plain = lowering.lower(cfg, prefill_len=128, batch=2, max_seq_len=256)
    mm = lowering.lower(cfg, prefill_len=128, batch=2, max_seq_len=256, embeddings=True, attention_mask=True)
    pre = mm.prefill
    assert "tokens" not in pre.inputs and {"embeddings", "attn_mask", "attn_mask.w48"} <= set(pre.inputs)
    assert pre.tensors["attn_mask.w48"].shape == (1, 1, 128, 128) and pre.tensors["embeddings"].shape == (1, 1, 128, 64)
    assert not any(c.op == "ttnn.embedding" and c.inputs[1] == "embed" for c in pre.calls)
    sdpa = [c for c in pre.calls if c.op == "ttnn.transformer.scaled_dot_product_attention"]
    assert [c.kwargs["attn_mask"].name for c in sdpa] == ["attn_mask.w48", "attn_mask"]
    assert all(c.kwargs["is_causal"] is False and "sliding_window_size" not in c.kwargs for c in sdpa)
    assert [(c.op, c.inputs, c.kwargs) for c in mm.decode.calls] == [(c.op, c.inputs, c.kwargs)
                                                                     for c in plain.decode.calls]
    with pytest.raises(NotImplementedError, match="chunked_scaled_dot_product_attention takes no attention mask"):
        lowering.lower(cfg, prefill_len=128, max_seq_len=512, chunk_start=128, attention_mask=True)


def test_attention_mask_rule():
    """specs/vision.md §1.5: same block -> visible both ways; the sliding window is one-sided (a later token of
    the same image passes it); text stays causal; padding rows are text."""
    cfg = dataclasses.replace(tiny_config("gemma3"), layers=tuple(
        dataclasses.replace(s, attention=dataclasses.replace(s.attention, window=2 if s.attention.window else None))
        for s in tiny_config("gemma3").layers))
    blocks = [-1, 0, 0, 0, -1, 1, 1]
    m = {k: v[0, 0] == 0 for k, v in lowering.attention_masks(cfg, blocks, 8).items()}
    full, win = m["attn_mask"], m["attn_mask.w2"]
    assert full[1, 3] and full[3, 1] and not full[1, 5] and not full[4, 5] and full[5, 6] and full[7, 0]
    assert not full[0, 1] and not full[6, 7]  # text and padding never see later tokens
    assert win[1, 3]  # k > q - W holds for every later key: the image block passes the window
    assert not win[3, 1] and win[3, 2]  # but earlier keys of the same image still fall out of it
    assert not win[7, 0] and win[7, 6]
    with pytest.raises(ValueError, match="attn_mask needs is_causal=False"):
        ops.scaled_dot_product_attention(ops.Env("exact", lambda x, d: x), np.zeros((1, 1, 128, 32)),
                                         np.zeros((1, 1, 128, 32)), np.zeros((1, 1, 128, 32)), is_causal=True,
                                         attn_mask=np.zeros((1, 1, 128, 128)))


def test_bad_multimodal_inputs(gemma3):
    gen, kv, pt = _generator(G.Gemma3ForConditionalGeneration, gemma3, "exact", max_prefill_chunk_size=128)
    pic = _picture(56, 56, 6)
    text = np.asarray([[2, 10, 20, 21]], np.int32)
    one = np.asarray([_gemma_prompt(1)], np.int32)
    kw = dict(page_table=pt[:1], kv_cache=kv)
    with pytest.raises(ValueError, match=r"the images fill 4 image tokens \(id 500\) but the tokens hold 0"):
        gen.prefill_forward(text, images=[[pic]], **kw)
    with pytest.raises(ValueError, match=r"one entry \(or None\) per user \(1\), got 2 entries"):
        gen.prefill_forward(one, images=[[pic], None], **kw)
    with pytest.raises(ValueError, match="images or pixel_values/image_sizes, not both"):
        gen.prefill_forward(one, images=[[pic]], pixel_values=[None], **kw)
    with pytest.raises(ValueError, match="must be 56x56 images, got 28x28"):
        gen.prefill_forward(one, pixel_values=[np.zeros((1, 3, 28, 28), np.float32)], **kw)
    with pytest.raises(ValueError, match="must carry pixel_values"):
        gen.prefill_forward(one, images=[{"image_sizes": [[56, 56]]}], **kw)
    long = np.asarray([_gemma_prompt(1) + list(range(30, 70))], np.int32)
    with pytest.raises(NotImplementedError, match="images with a cached prefix"):
        gen.prefill_forward(long, images=[[pic]], start_pos=[32], **kw)
    longer = np.asarray([_gemma_prompt(1) + list(range(30, 160))], np.int32)  # pads to 256 > the 128 chunk
    with pytest.raises(NotImplementedError, match="no attention mask for the bidirectional image blocks"):
        gen.prefill_forward(longer, images=[[pic]], **kw)
    # a text-only request on the multimodal generator still runs (equal to jm.forward, no images)
    got = gen.prefill_forward(text, **kw)[0, 0]
    np.testing.assert_allclose(got, np.asarray(jm.forward(gemma3, text))[0, -1], rtol=1e-4, atol=1e-4)


def test_images_for_a_text_model_and_without_weights_are_refused(gemma3):
    model = tiny_model("llama")
    gen = G.LlamaForCausalLM.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), 1, MAX_SEQ, model=model,
                                                   numerics="exact")
    kv = gen.allocate_kv_cache((WIDTH, 2, BS, 32), np.float32, 2)
    tokens = np.asarray([[1, 2, 3]], np.int32)
    for kw in ({"images": [[_picture(20, 20, 0)]]}, {"pixel_values": [np.zeros((1, 3, 56, 56), np.float32)]}):
        with pytest.raises(ValueError, match="this llama model has no vision tower: it takes no images"):
            gen.prefill_forward(tokens, page_table=np.arange(WIDTH)[None], kv_cache=kv, **kw)
    gen.prefill_forward(tokens, page_table=np.arange(WIDTH)[None], kv_cache=kv, images=[None])  # text only: fine
    # a vision model behind a custom executor, without its weights: the tower cannot run
    bare = G.Gemma3ForConditionalGeneration.initialize_vllm_model(
        gemma3.config, G.EmulatedMesh((1, 1)), 1, MAX_SEQ,
        executor_factory=lambda cfg, *a: G.EmulatorExecutor(Executor(gemma3, numerics="exact", max_seq_len=MAX_SEQ)))
    assert bare.vision is None
    kv = bare.allocate_kv_cache((WIDTH, 1, BS, 32), np.float32, 2)
    with pytest.raises(ValueError, match="images need the vision tower's weights"):
        bare.prefill_forward(np.asarray([_gemma_prompt(1)]), page_table=np.arange(WIDTH)[None], kv_cache=kv,
                             images=[[_picture(56, 56, 0)]])


def test_capabilities_state_where_the_tower_runs():
    for cls in (G.Gemma3ForConditionalGeneration, G.Mistral3ForConditionalGeneration):
        caps = cls.model_capabilities
        assert caps["supports_multimodal"] and caps["vision_tower"] == "jax" and caps["image_inputs"] == "embeddings"
        assert caps["supports_prefix_caching"] is False
    assert G.Gemma3ForConditionalGeneration.model_capabilities["image_attention"] == "bidirectional"
    caps = G.MllamaForConditionalGeneration.model_capabilities  # tests/tt/test_mllama_tt.py runs it
    assert caps["supports_multimodal"] and caps["vision_tower"] == "jax" and caps["image_inputs"] == "cross_attention"
    assert "supports_multimodal" not in G.LlamaForCausalLM.model_capabilities
