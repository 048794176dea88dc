"""Multimodal parity (specs/vision.md): Gemma3 (SigLIP) and Mistral3 (Pixtral) with images, against HF
transformers 5.24 in fp32, through the public import and `jm.forward`."""
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import converters
import jaxmodels as jm
from tests.parity import hf_reference as ref

ATOL = 1e-4  # x max(1, |logit|)
L2 = dict(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
BOI, EOI, SOFT = 498, 499, 500  # Gemma3's tiny ids; Mistral3: [IMG] 10, [IMG_BREAK] 12, [IMG_END] 13


def _gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    cfg = Gemma3Config(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=56, patch_size=14, vision_use_head=False),
        text_config=dict(model_type="gemma3_text", vocab_size=512, hidden_size=64, intermediate_size=128,
                         query_pre_attn_scalar=32, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"], **L2),
        mm_tokens_per_image=4, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT)
    return ref.randomize(Gemma3ForConditionalGeneration(cfg), seed=1)


def _mistral3():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    cfg = Mistral3Config(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=84, patch_size=14, hidden_act="silu"),
        text_config=dict(model_type="mistral", vocab_size=512, hidden_size=64, intermediate_size=128,
                         sliding_window=None, **L2),
        image_token_index=10, spatial_merge_size=2, multimodal_projector_bias=True, tie_word_embeddings=False)
    return ref.randomize(Mistral3ForConditionalGeneration(cfg), seed=2)


def _imported(hf, tmp_path_factory, name: str):
    """(HF model, its save_pretrained directory, our fp32 model converted from it through the public path)."""
    src = tmp_path_factory.mktemp(name) / "hf"
    hf.save_pretrained(src)
    return hf, src, jm.load(converters.convert(src, src.parent / "out", dtype="float32", progress=False))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _imported(_gemma3(), tmp_path_factory, "gemma3")


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    return _imported(_mistral3(), tmp_path_factory, "mistral3")


def _hf(model, ids, **kw):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), **{k: torch.as_tensor(v) for k, v in kw.items()}).logits.numpy()


def _close(got, want):
    err = np.abs(np.asarray(got) - want).max() / max(1.0, np.abs(want).max())
    assert err <= ATOL, f"max |Δlogit| {err:.2e} (scaled)"


def _gemma_prompt(n_images: int, text=(20, 21, 22), lead=(2, 10)) -> list[int]:
    image = [108, BOI] + [SOFT] * 4 + [EOI, 108]
    return list(lead) + [t for _ in range(n_images) for t in (*image, *text)]


def _pixtral_tokens(rows: int, cols: int) -> list[int]:
    out = ([10] * cols + [12]) * rows
    out[-1] = 13
    return out


def test_gemma3_one_and_two_images(gemma3):
    hf, _, ours = gemma3
    rng = np.random.default_rng(0)
    for n in (1, 2):
        ids = np.asarray([_gemma_prompt(n)], np.int32)
        pv = rng.standard_normal((n, 3, 56, 56)).astype(np.float32)
        tt = (ids == SOFT).astype(np.int32)
        want = _hf(hf, ids, pixel_values=pv, token_type_ids=tt)
        _close(jm.forward(ours, ids, pixel_values=pv, token_type_ids=tt), want)
        # without token_type_ids both are plain causal: the bidirectional block must have mattered above
        plain = _hf(hf, ids, pixel_values=pv)
        _close(jm.forward(ours, ids, pixel_values=pv), plain)
        assert np.abs(plain - want).max() > 1e-3


def test_gemma3_batch_and_long_positions(gemma3):
    """Two rows (images fill rows in order), the second image past position 300 with a window of 4."""
    hf, _, ours = gemma3
    a = _gemma_prompt(1) + list(range(30, 330))
    b = [2] + list(range(40, 340)) + _gemma_prompt(1, lead=()) + [23]
    assert len(a) == len(b)
    ids = np.asarray([a, b], np.int32)
    n = int((ids == SOFT).sum()) // 4
    pv = np.random.default_rng(1).standard_normal((n, 3, 56, 56)).astype(np.float32)
    tt = (ids == SOFT).astype(np.int32)
    _close(jm.forward(ours, ids, pixel_values=pv, token_type_ids=tt), _hf(hf, ids, pixel_values=pv, token_type_ids=tt))


def test_gemma3_text_only(gemma3):
    hf, _, ours = gemma3
    ids = np.random.default_rng(2).integers(0, 498, (2, 40)).astype(np.int32)
    _close(jm.forward(ours, ids), _hf(hf, ids))


def test_mistral3_images_of_different_sizes(mistral3):
    """56x28 and 28x84 images zero-padded to 56x84 in one batch (each attends to itself only), and one alone."""
    hf, _, ours = mistral3
    rng = np.random.default_rng(3)
    pv = np.zeros((2, 3, 56, 84), np.float32)
    pv[0, :, :, :28] = rng.standard_normal((3, 56, 28))
    pv[1, :, :28, :] = rng.standard_normal((3, 28, 84))
    sizes = np.asarray([[56, 28], [28, 84]])
    ids = np.asarray([[1, 5] + _pixtral_tokens(2, 1) + [7, 8] + _pixtral_tokens(1, 3) + [9]], np.int32)
    _close(jm.forward(ours, ids, pixel_values=pv, image_sizes=sizes), _hf(hf, ids, pixel_values=pv, image_sizes=sizes))
    one = np.asarray([[1, 5] + _pixtral_tokens(3, 2) + [7]], np.int32)
    pv1 = rng.standard_normal((1, 3, 84, 56)).astype(np.float32)
    _close(jm.forward(ours, one, pixel_values=pv1), _hf(hf, one, pixel_values=pv1, image_sizes=[[84, 56]]))
    # a width of 5 patches: the tower sees all 5 columns, the 2x2 merger drops the odd one (as HF's unfold)
    odd = np.asarray([[1, 5] + _pixtral_tokens(3, 2) + [7]], np.int32)
    pv2 = np.zeros((1, 3, 84, 84), np.float32)
    pv2[..., :70] = rng.standard_normal((1, 3, 84, 70))
    _close(jm.forward(ours, odd, pixel_values=pv2, image_sizes=[[84, 70]]),
           _hf(hf, odd, pixel_values=pv2, image_sizes=[[84, 70]]))


def test_mistral3_text_only_and_untied_head(mistral3):
    hf, _, ours = mistral3
    assert not ours.config.tie_embeddings  # config.json says tied (the default) but lm_head is in the checkpoint
    ids = np.random.default_rng(4).integers(0, 512, (2, 300)).astype(np.int32)
    _close(jm.forward(ours, ids), _hf(hf, ids))


def test_gemma3_released_and_in_memory_names(gemma3, tmp_path):
    """`vision_tower.vision_model.` (the released hub layout) and v5's in-memory `model.` names load the same."""
    hf, src, ours = gemma3
    names = load_file(src / "model.safetensors")
    ids = np.asarray([_gemma_prompt(1)], np.int32)
    pv = np.random.default_rng(5).standard_normal((1, 3, 56, 56)).astype(np.float32)
    want = np.asarray(jm.forward(ours, ids, pixel_values=pv))
    for layout, rename in {"hub": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
                           "memory": lambda k: "model." + k.replace("language_model.model.", "language_model.")}.items():
        d = tmp_path / layout
        d.mkdir()
        save_file({rename(k): v for k, v in names.items()}, d / "model.safetensors")
        (d / "config.json").write_text((src / "config.json").read_text())
        np.testing.assert_array_equal(np.asarray(jm.forward(jm.load(d), ids, pixel_values=pv)), want)


def test_bad_vision_inputs(gemma3, mistral3):
    _, _, g = gemma3
    _, _, m = mistral3
    ids = np.asarray([_gemma_prompt(1)], np.int32)
    pv = np.zeros((1, 3, 56, 56), np.float32)
    with pytest.raises(ValueError, match="fill 8 image tokens .* hold 4"):
        jm.forward(g, ids, pixel_values=np.zeros((2, 3, 56, 56), np.float32))
    with pytest.raises(ValueError, match="must be 56x56 images"):
        jm.forward(g, ids, pixel_values=np.zeros((1, 3, 28, 28), np.float32))
    with pytest.raises(ValueError, match="takes pixel_values, token_type_ids, not image_sizes"):
        jm.forward(g, ids, pixel_values=pv, image_sizes=np.asarray([[56, 56]]))
    with pytest.raises(ValueError, match="floating point"):
        jm.forward(g, ids, pixel_values=pv.astype(np.uint8))
    with pytest.raises(ValueError, match="image_sizes must be"):
        jm.forward(m, [[10, 13]], pixel_values=np.zeros((1, 3, 28, 28), np.float32), image_sizes=[[28, 56]])
    with pytest.raises(ValueError, match="multiples of 28"):
        jm.forward(m, [[10, 13]], pixel_values=np.zeros((1, 3, 30, 28), np.float32))
    with pytest.raises(ValueError, match=r"token_type_ids must be 2-D integers starting with the tokens' \[1, 13\]"):
        jm.forward(g, ids, pixel_values=pv, token_type_ids=np.zeros((1, 3), np.int32))
    import dataclasses

    odd = dataclasses.replace(g, config=dataclasses.replace(
        g.config, vision=dataclasses.replace(g.config.vision, tokens_per_image=9)))  # 3 does not divide 4 patches
    with pytest.raises(ValueError, match="cannot take images: mm_tokens_per_image=9 is not a square whose side"):
        jm.forward(odd, ids, pixel_values=pv)
    text = jm.Model(jm.ModelConfig.from_dict({**g.config.to_dict(), "vision": None}), g.params)
    with pytest.raises(ValueError, match="has no vision tower"):
        jm.forward(text, ids, pixel_values=pv)


def test_missing_and_extra_vision_tensors(gemma3, tmp_path):
    _, src, _ = gemma3
    names = load_file(src / "model.safetensors")
    cases = {"missing": {k: v for k, v in names.items() if "encoder.layers.1.mlp.fc2.weight" not in k},
             "extra": {**names, "vision_tower.encoder.layers.2.mlp.fc2.weight": np.zeros((32, 64), np.float32)}}
    errors = {"missing": r"missing 1 tensors, e\.g\. vision_tower\.encoder\.layers\.1\.mlp\.fc2\.weight",
              "extra": r"unexpected tensor 'vision_tower\.encoder\.layers\.2\.mlp\.fc2\.weight': layer 2 of 2"}
    for case, tensors in cases.items():
        d = tmp_path / case
        d.mkdir()
        save_file(tensors, d / "model.safetensors")
        (d / "config.json").write_text((src / "config.json").read_text())
        with pytest.raises(converters.CheckpointError, match=errors[case]):
            converters.convert(d, tmp_path / f"{case}-out", dtype="float32", progress=False)


def _exaone4_5():
    from transformers.models.exaone4_5 import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

    cfg = Exaone4_5_Config(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, num_key_value_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], out_hidden_size=64),
        text_config=dict(model_type="exaone4", vocab_size=512, hidden_size=64, intermediate_size=128, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention"], **L2),
        image_token_id=67, video_token_id=68)
    return ref.randomize(Exaone4_5_ForConditionalGeneration(cfg), seed=4)


def test_exaone4_5_two_images(tmp_path):
    """Grids 4x6 (a partial window) and 8x8 in one prompt; the tower's windowed and full blocks."""
    hf = _exaone4_5()
    hf.save_pretrained(tmp_path / "hf")
    ours = jm.load(converters.convert(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False))
    thw = np.asarray([[1, 4, 6], [1, 8, 8]])
    pv = np.random.default_rng(6).standard_normal((24 + 64, 3 * 2 * 14 * 14)).astype(np.float32)
    ids = np.asarray([[1, 5, 73] + [67] * 6 + [74, 6, 73] + [67] * 16 + [74, 7]], np.int32)
    _close(jm.forward(ours, ids, pixel_values=pv, image_grid_thw=thw),
           _hf(hf, ids, pixel_values=pv, image_grid_thw=thw))
    ids2 = np.random.default_rng(7).integers(0, 512, (1, 40)).astype(np.int32)
    _close(jm.forward(ours, ids2), _hf(hf, ids2))


def _picture(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(np.clip(rgb + rng.integers(-20, 20, rgb.shape), 0, 255).astype(np.uint8))


def _hf_greedy(model, ids, n, **kw):
    with torch.no_grad():
        out = model.generate(input_ids=torch.as_tensor(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, **{k: torch.as_tensor(v) for k, v in kw.items()})
    return out[:, ids.shape[1]:].numpy()


def test_greedy_with_images_matches_hf_generate(gemma3, mistral3):
    """Prefill with the images, then cached decode: the same 24 tokens as HF `generate`."""
    from jaxmodels import multimodal

    g_hf, _, g = gemma3
    ids = np.asarray([_gemma_prompt(2)], np.int32)
    pics = [_picture(40, 90, 0), _picture(70, 30, 1)]
    pv = multimodal.process(g, pics)["pixel_values"]
    want = _hf_greedy(g_hf, ids, 24, pixel_values=pv, token_type_ids=(ids == SOFT).astype(np.int64))
    got = jm.generate(g, [ids[0].tolist()], max_new_tokens=24, ignore_eos=True, images=[pics]).tokens
    assert np.array_equal(np.asarray(got), want)

    m_hf, _, m = mistral3
    pics = [_picture(50, 80, 2)]
    out = multimodal.process(m, pics)
    rows, cols = out["token_grid"][0]
    ids = np.asarray([[1, 5] + _pixtral_tokens(int(rows), int(cols)) + [7, 8]], np.int32)
    want = _hf_greedy(m_hf, ids, 24, pixel_values=out["pixel_values"], image_sizes=out["image_sizes"])
    got = jm.generate(m, [ids[0].tolist()], max_new_tokens=24, ignore_eos=True, images=[pics]).tokens
    assert np.array_equal(np.asarray(got), want)


def _word_tokenizer():
    """A word-level tokenizer holding Gemma3's image tokens at the tiny model's ids (498-500), as
    `tokenizers` and transformers' fast tokenizer both read it."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(400)} | {"<pad>": 0, "<eos>": 1, "<bos>": 2}
    vocab |= {"<start_of_image>": BOI, "<end_of_image>": EOI, "<image_soft_token>": SOFT, "\n\n": 108}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tk.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in
                           ("<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>", "<eos>", "<pad>")])
    tk.add_tokens([tokenizers.AddedToken("\n\n")])
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tk


def test_gemma3_text_prompt_as_hf_processor(gemma3):
    """A text prompt with images: our ids, token types and pixels equal Gemma3Processor's (PIL backend), and the
    greedy continuation equals HF generate on them; a prompt without the placeholder gets the images in front."""
    import dataclasses

    import transformers

    hf, _, ours = gemma3
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_word_tokenizer(), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    proc = transformers.Gemma3Processor(image_processor=transformers.Gemma3ImageProcessorPil(
        size={"height": 56, "width": 56}), tokenizer=fast, image_seq_length=4)
    model = dataclasses.replace(ours, tokenizer=jm.Tokenizer(_word_tokenizer(), bos_token="<bos>", eos_token="<eos>"))
    pics = [_picture(30, 77, 3), _picture(64, 20, 4)]
    text = "w5 <start_of_image> w6 w7 <start_of_image> w8"
    want = proc(text=[text], images=[pics], return_tensors="np")
    got = jm.generate(model, [text], max_new_tokens=16, ignore_eos=True, images=[pics])
    # compared as token strings: transformers' wrapper may renumber an added token ("\n\n") within a session
    spelled = lambda ids: [model.tokenizer.tok.id_to_token(i) for i in ids]  # noqa: E731
    assert spelled(got.prompt_tokens[0]) == fast.convert_ids_to_tokens(want["input_ids"][0].tolist())
    from jaxmodels import multimodal

    ids, arrays = multimodal.prepare(model, [text], [pics])
    np.testing.assert_array_equal(arrays["pixel_values"], want["pixel_values"])
    ours_ids = np.asarray(ids, np.int64)
    np.testing.assert_array_equal(ours_ids == SOFT, want["token_type_ids"] == 1)
    ref_tokens = _hf_greedy(hf, ours_ids, 16, pixel_values=want["pixel_values"], token_type_ids=(ours_ids == SOFT) * 1)
    assert np.array_equal(np.asarray(got.tokens), ref_tokens)
    front = jm.generate(model, ["w5 w6"], max_new_tokens=2, images=[pics[:1]]).prompt_tokens[0]
    hf_front = proc(text=["<start_of_image>w5 w6"], images=[pics[:1]])["input_ids"][0]
    assert spelled(front) == fast.convert_ids_to_tokens(list(hf_front))
    with pytest.raises(ValueError, match="prompt 0 has 2 image placeholders .* for 1 images"):
        jm.generate(model, [text], images=[pics[:1]])
    with pytest.raises(ValueError, match="one list per prompt"):
        jm.generate(model, [text, text], images=[pics])
    with pytest.raises(ValueError, match="image 0: .*no network access"):
        jm.generate(model, ["w5"], images=[["https://example.com/a.png"]])


def _mllama():
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    cfg = MllamaConfig(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=2,
                           attention_heads=2, image_size=28, patch_size=14, max_num_tiles=4,
                           intermediate_layers_indices=[0, 1], vision_output_dim=96),
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, cross_attention_layers=[1],
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                              low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_position_embeddings=8192)),
        image_token_index=512)
    m = ref.randomize(MllamaForConditionalGeneration(cfg), seed=5)
    with torch.no_grad():  # the gates: HF zero-initialises them, and randomize leaves 1-D zeros at N(0, 0.5)
        for name, p in m.named_parameters():
            if "gate" in name:
                p.copy_(torch.full_like(p, 0.7))
    return m


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    hf, _, ours = _imported(_mllama(), tmp_path_factory, "mllama")
    return hf, ours


def _mllama_inputs(model, rows, ids):
    from jaxmodels import images, multimodal

    out = images.mllama(rows, {"size": {"height": 28, "width": 28}, "max_image_tiles": 4})
    mask = multimodal.cross_attention_mask(ids, out["num_tiles"], 512, 4)
    return {"pixel_values": out["pixel_values"], "aspect_ratio_ids": out["aspect_ratio_ids"],
            "aspect_ratio_mask": out["aspect_ratio_mask"], "cross_attention_mask": mask}


def test_mllama_images_text_only_and_mixed_batch(mllama):
    """Row 0: two images (1x2 and 2x2 tiles) at different positions; row 1: no image (its cross layer attends to
    everything, HF's rule); then text only, where the cross layer is skipped."""
    hf, ours = mllama
    a = [512, 1, 30, 31, 512, 32, 33, 34, 35]
    b = [1, 40, 41, 42, 43, 44, 45, 46, 47]
    kw = _mllama_inputs(ours, [[_picture(30, 60, 7), _picture(60, 60, 8)], []], [a, b])
    ids = np.asarray([a, b], np.int32)
    got = np.asarray(jm.forward(ours, ids, **kw))
    want = _hf(hf, ids, **kw)
    assert got.shape == want.shape == (2, 9, 512)  # the head has the vocabulary's rows, not the embedding's 520
    _close(got, want)
    _close(jm.forward(ours, ids), _hf(hf, ids))


def test_mllama_greedy_with_image_matches_hf_generate(mllama):
    hf, ours = mllama
    ids = [[512, 1, 30, 31, 32, 33]]
    pics = [[_picture(50, 20, 9)]]
    kw = _mllama_inputs(ours, pics, ids)
    want = _hf_greedy(hf, np.asarray(ids), 20, **kw)
    got = jm.generate(ours, ids, max_new_tokens=20, ignore_eos=True, images=pics).tokens
    assert np.array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match=r"prompt 0 has 0 image tokens \(512\) for 1 images"):
        jm.generate(ours, [[1, 30, 31]], images=pics)
    from jaxmodels import cli

    info = cli._vision(ours.config)  # what `jaxmodels inspect` prints
    assert info["kind"] == "mllama" and "cross-attention layers [1]" in info["tower"]


def test_bf16_with_images_within_bound(gemma3, mistral3):
    """bf16 weights and activations against HF in fp32: within 3% of the largest logit (measured: 1.4% Gemma3,
    1.1% Mistral3 on these inputs; fp32 parity is the tests above)."""
    rng = np.random.default_rng(8)
    for (hf, src, _), ids, kw in (
            (gemma3, np.asarray([_gemma_prompt(2)], np.int32), {}),
            (mistral3, np.asarray([[1, 5] + _pixtral_tokens(3, 2) + [7]], np.int32), {"image_sizes": [[84, 56]]})):
        ours = jm.load(converters.convert(src, src.parent / "bf16", dtype="bfloat16", progress=False))
        n = 2 if kw == {} else 1
        pv = rng.standard_normal((n, 3, 56, 56) if not kw else (1, 3, 84, 56)).astype(np.float32)
        extra = {"token_type_ids": (ids == SOFT).astype(np.int32)} if not kw else {}
        want = _hf(hf, ids, pixel_values=pv, **extra, **kw)
        got = np.asarray(jm.forward(ours, ids, pixel_values=pv, **extra))
        assert np.abs(got - want).max() <= 0.03 * np.abs(want).max()


def test_export_writes_the_text_model(gemma3, mistral3, tmp_path):
    """converters.export of a multimodal model: its text model (the tower left out), which transformers loads and
    which gives our text-only logits."""
    import transformers

    ids = np.random.default_rng(9).integers(0, 498, (1, 20)).astype(np.int32)
    for name, (_, _, ours) in (("gemma3", gemma3), ("mistral3", mistral3)):
        out = converters.export(ours, tmp_path / name, progress=False)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        _close(jm.forward(ours, ids), _hf(hf, ids))
