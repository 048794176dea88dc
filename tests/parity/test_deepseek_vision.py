"""DeepSeek V4.1 sees images (issue #14): the ViT + aligner + span merge, bias_vl routing and Engram's dead image
spans against the float64 oracle written from the upstream reference (tests/oracles/deepseek_v41_vision.py), the
reference's preprocessing against hand computations, cached decode with images against the full forward, the
public convert / load / generate path, and the errors of bad inputs.

The model is small on purpose (CI budget): the spec's tiny V4.1 text config cut to two window-only layers with
Engram on layer 1 (compressed attention is untouched by images), and a 2-layer ViT of width 32 on 4-px patches.
"""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from PIL import Image

import converters
import jaxmodels as jm
from converters import deepseek_quant as dq
from converters.safetensors_io import CheckpointError
from jaxmodels import images as im, model as M, multimodal
from jaxmodels.layers import deepseek_vision, vision
from tests import quant_encoders as enc
from tests.oracles import deepseek_ckpt as ck, deepseek_v41 as oracle, deepseek_v41_vision as vo

TOL = 1e-4  # x max(1, |reference|)
IMG = 500  # the tiny model's image token id
TEXT = dict(num_hidden_layers=1, compress_ratios=[0], kv_source_layer_ids=[], index_source_layer_ids=[],
            candidate_source_layer_id=-1, num_nextn_predict_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
            engram_layer_ids=[0])
VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48, patch_size=4,
              rope_theta=10000.0, downsample_ratio=3, max_image_tokens=64, min_pixels=256, max_wh_ratio=None)


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


def _vision_tensors(rng, C, I, L, p, r, D) -> dict:
    """The reference's vision tensors (upstream names, all BF16), every one non-trivial."""
    bf = lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
    lin = lambda o, i: bf(rng.standard_normal((o, i)) * i ** -0.5)  # noqa: E731
    vec = lambda n, s=0.1, m=0.0: bf(m + s * rng.standard_normal(n))  # noqa: E731
    t = {"vision.patch_embed.proj.weight": lin(C, 3 * p * p), "vision.patch_embed.proj.bias": vec(C),
         "vision.norm.weight": vec(C, 0.1, 1.0), "aligner.w1.weight": lin(D, C * r * r), "aligner.w1.bias": vec(D),
         "aligner.w2.weight": lin(D, D), "aligner.w2.bias": vec(D),
         "image_start": vec(D, 0.3), "image_end": vec(D, 0.3), "image_newline": vec(D, 0.3)}
    for b in range(L):
        v = f"vision.blocks.{b}."
        t |= {v + "norm1.weight": vec(C, 0.1, 1.0), v + "norm2.weight": vec(C, 0.1, 1.0),
              v + "attn.wqkv.weight": lin(3 * C, C), v + "attn.wqkv.bias": vec(3 * C),
              v + "attn.wo.weight": lin(C, C), v + "attn.wo.bias": vec(C),
              v + "mlp.w1.weight": lin(2 * I, C), v + "mlp.w2.weight": lin(C, I)}
    return t


def _write(path, seed: int = 0) -> dict:
    """A tiny V4.1 with a vision tower in DeepSeek's own layout (FP8/FP4 text weights, BF16 tower) + tokenizer."""
    hf = ck.tiny_config("v4.1", **TEXT)
    hf["vision_config"], hf["image_token_id"] = dict(VISION), IMG
    ck.write_checkpoint(str(path), hf, seed=seed)
    ck.write_word_tokenizer(path, hf["text_config"]["vocab_size"])
    st = path / "model.safetensors"
    hdr = json.loads(st.read_bytes()[8:8 + int.from_bytes(st.read_bytes()[:8], "little")])
    tensors = {k: dq.read_safetensors_tensor(st, k) for k in hdr if k != "__metadata__" and not k.startswith("vision.")}
    for k in tensors:  # read back as their bytes: written as E8M0 again
        if hdr[k]["dtype"] == "F8_E8M0":
            tensors[k] = tensors[k].view(ml_dtypes.float8_e8m0fnu)
    rng = np.random.default_rng(seed + 1)
    for k in [k for k in tensors if k.endswith("gate.bias_vl")]:  # far from `bias`: image tokens pick other experts
        tensors[k] = rng.standard_normal(tensors[k].shape).astype(np.float32)
    enc.write_safetensors(st, tensors)
    t = hf["text_config"]
    ck.save_safetensors(path / "vision.safetensors", _vision_tensors(
        rng, VISION["hidden_size"], VISION["intermediate_size"], VISION["num_hidden_layers"], VISION["patch_size"],
        VISION["downsample_ratio"], t["hidden_size"]))
    return hf


def _pictures():
    """Three RGB images of different shapes (noise over gradients): 30x20, 9x17 (scaled up to min_pixels), 40x40."""
    rng = np.random.default_rng(7)
    out = []
    for w, h in ((30, 20), (9, 17), (40, 40)):
        ramp = np.linspace(0, 255, w)[None, :, None] * np.array([1.0, 0.5, 0.2])
        out.append(Image.fromarray(np.clip(ramp + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)))
    return out


def _layout(spans):
    """Token ids [2, T] and reference token types: row 0 = 5 text, image 0, 3 text, image 1, 14 text; row 1 = 2 text,
    image 2, then text to the same length."""
    rng = np.random.default_rng(8)
    rows = [[("t", 5), ("i", 0), ("t", 3), ("i", 1), ("t", 14)], [("t", 2), ("i", 2)]]
    ids, types = [], []
    for row in rows:
        r_ids, r_types = [], []
        for kind, n in row:
            if kind == "t":
                r_ids += list(rng.integers(3, IMG, n))
                r_types += [vo.TEXT] * n
            else:
                types_i = spans[n][1]
                r_ids += [IMG] * len(types_i)
                r_types += types_i
        ids.append(r_ids)
        types.append(r_types)
    T = max(map(len, ids))
    for r_ids, r_types in zip(ids, types):
        r_types += [vo.TEXT] * (T - len(r_ids))
        r_ids += list(rng.integers(3, IMG, T - len(r_ids)))
    return np.asarray(ids), np.asarray(types)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """(checkpoint dir, cfg, fp32 params, processed images, ids [2, T], oracle span rows, oracle logits)."""
    path = tmp_path_factory.mktemp("v41vl") / "ckpt"
    path.mkdir()
    _write(path)
    cfg, params, _ = converters.read_source(path, progress=False)
    params = jax.tree.map(jnp.asarray, params)
    v = cfg.vision
    out = im.deepseek_v41(_pictures(), v.patch_size, v.merge_size, v.max_image_tokens, v.min_pixels, v.max_wh_ratio)
    W = vo.load_vision(str(path))
    spans, first = [], 0
    for h, w in out["image_grid_hw"]:
        spans.append(vo.span_rows(W, out["pixel_values"][first:first + h * w].astype(np.float64), h, w,
                                  VISION["num_attention_heads"], VISION["downsample_ratio"]))
        first += h * w
    ids, types = _layout(spans)
    ck_ = oracle.load_checkpoint(str(path))
    ref = vo.backbone(ck_, ids, types, [s for s, _ in spans], ck.stub_token_map(cfg.vocab_size))
    return SimpleNamespace(path=path, cfg=cfg, params=params, images=out, ids=ids, types=types, spans=spans, ck=ck_,
                           ref=ref)


def _inputs(t):
    return {"pixel_values": t.images["pixel_values"], "image_grid_hw": t.images["image_grid_hw"]}


def _forward(t, params):
    arrays, static = vision.inputs(t.cfg, t.ids, _inputs(t))
    fwd = jax.jit(lambda p, ids, a: M.forward(p, t.cfg, ids, images={**a, **dict(static)}))
    return np.asarray(fwd(params, jnp.asarray(t.ids, jnp.int32), arrays))


@pytest.fixture(scope="module")
def full(v41):
    """Our jitted fp32 forward of the fixture's batch with its three images."""
    return _forward(v41, v41.params)


def test_config_and_import(v41):
    """vision_config -> the deepseek_vit tower; the checkpoint's tower, aligner, delimiters and each router's bias_vl
    land where the plan says, bit for bit (BF16 -> fp32)."""
    cfg, p = v41.cfg, v41.params
    v = cfg.vision
    assert (v.kind, v.num_layers, v.hidden_size, v.num_heads, v.merge_size, v.image_token_id, v.norm_eps,
            v.max_image_tokens, v.min_pixels) == ("deepseek_vit", 2, 32, 2, 3, IMG, 1e-6, 64, 256)
    W = vo.load_vision(str(v41.path))
    pv = p["vision"]
    assert np.array_equal(pv["layers"]["w_gate_up"][1], W["vision.blocks.1.mlp.w1.weight"].T)
    assert np.array_equal(pv["layers"]["wqkv"][0], W["vision.blocks.0.attn.wqkv.weight"].T)
    assert np.array_equal(pv["projector"]["w1"], W["aligner.w1.weight"].T)
    assert np.array_equal(pv["image_newline"], W["image_newline"])
    assert np.array_equal(p["layers"]["0"]["mlp"]["selection_bias_vl"][0], v41.ck.w["layers.0.ffn.gate.bias_vl"])


def test_tower_aligner_and_merge_match_oracle(v41):
    """Each image's whole span (start, aligner rows with a newline after each row, end) from our encode equals the
    oracle's float64 ViT + aligner + merge; three images of different grids run as one padded batch."""
    images = {"pixel_values": jnp.asarray(v41.images["pixel_values"]),
              "image_grid_hw": tuple(map(tuple, v41.images["image_grid_hw"].tolist()))}
    rows, valid = jax.jit(lambda p: vision.encode(v41.cfg.vision, p, images))(v41.params["vision"])
    ref = np.concatenate([s for s, _ in v41.spans])
    assert valid.all() and rows.shape == ref.shape == (10 + 6 + 22, v41.cfg.hidden_size)
    assert np.abs(np.asarray(rows) - ref).max() <= TOL * max(1.0, np.abs(ref).max())


def test_logits_match_oracle(v41, full):
    """fp32 logits of a batch with images (bias_vl routing and dead Engram on every span position) equal the float64
    oracle's; routing the image tokens with the text bias, or letting Engram see them, would be far off."""
    ref = v41.ref
    scale = max(1.0, np.abs(ref).max())
    assert np.abs(full - ref).max() <= TOL * scale
    rows = [s for s, _ in v41.spans]
    stub = ck.stub_token_map(v41.cfg.vocab_size)
    for kw in ({"route_images": False}, {"engram_images": False}):
        other = vo.backbone(v41.ck, v41.ids, v41.types, rows, stub, **kw)
        assert np.abs(other - ref).max() > 100 * TOL * scale, kw


def test_bf16_within_bound(v41):
    """bf16 parameters and activations (the tower's norms and RoPE in fp32 as the reference): within 2% of the
    largest logit of the float64 oracle (measured 0.75%)."""
    out = _forward(v41, M.cast(v41.cfg, v41.params, jnp.bfloat16))
    assert np.abs(out - v41.ref).max() <= 2e-2 * np.abs(v41.ref).max()


def test_cached_decode_with_images_equals_full_forward(v41, full):
    """Prefill with the images (ragged rows, padded as generate() pads them), then decode the rest one token at a
    time: every step's logits equal the full forward's at that position (Engram's history keeps the spans dead)."""
    cfg, params, ids = v41.cfg, v41.params, v41.ids
    lengths = np.array([ids.shape[1] - 5, 27])  # every image span inside the prefill of both rows
    P = int(lengths.max()) + 3
    assert all((np.flatnonzero(v41.types[b] >= 0) < lengths[b]).all() for b in range(2))
    arrays, static = vision.inputs(cfg, ids[:, :P], _inputs(v41))
    cache = M.init_cache(cfg, 2, 64, jnp.float32)
    prefill = jax.jit(lambda p, t, n, c, a: M.prefill(p, cfg, t, n, c, images={**a, **dict(static)}))
    logits, cache = prefill(params, jnp.asarray(ids[:, :P], jnp.int32), jnp.asarray(lengths, jnp.int32), cache, arrays)
    rows = np.arange(2)
    errs = [np.abs(np.asarray(logits) - full[rows, lengths - 1]).max()]
    step = jax.jit(M.decode_step, static_argnums=1)
    pos = lengths.copy()
    for _ in range(4):
        logits, cache = step(params, cfg, jnp.asarray(ids[rows, pos], jnp.int32), jnp.asarray(pos, jnp.int32), cache)
        errs.append(np.abs(np.asarray(logits) - full[rows, pos]).max())
        pos = pos + 1
    assert max(errs) <= TOL * max(1.0, np.abs(full).max())


def test_convert_load_generate_with_images(v41, tmp_path):
    """Public path: convert -> jm.load -> `jaxmodels inspect` shows the tower; jm.generate(images=...) with one image
    token per image in an id prompt (expanded to the spans as the reference's prepare_vl_inputs does): its greedy
    tokens, prefilled with the images then decoded from the cache, are the argmax of the oracle's full forward over
    the prompt and what it generated, given the same images."""
    from jaxmodels.cli import describe

    dst = converters.convert(v41.path, tmp_path / "out", dtype="float32", progress=False)
    info = describe(dst)["vision"]
    assert (info["kind"], info["layers"], info["hidden"], info["merge"], info["image_token_id"]) == (
        "deepseek_vit", 2, 32, 3, IMG)
    model = jm.load(dst)
    pictures = _pictures()[:2]  # the fixture's images 0 and 1
    prompt = [7, 8, IMG, 9, 10, IMG, 11]
    out = jm.generate(model, [prompt], images=[pictures], max_new_tokens=6, ignore_eos=True)
    ids, arrays = multimodal.prepare(model, [prompt], [pictures])
    assert ids[0] == [7, 8] + [IMG] * 10 + [9, 10] + [IMG] * 6 + [11]
    assert np.array_equal(arrays["pixel_values"], v41.images["pixel_values"][:40 + 18])
    seq = np.array([ids[0] + out.tokens[0]])
    types = np.full(seq.shape, vo.TEXT)
    types[0, 2:12], types[0, 14:20] = v41.spans[0][1], v41.spans[1][1]
    ref = vo.backbone(v41.ck, seq, types, [v41.spans[0][0], v41.spans[1][0]], ck.stub_token_map(v41.cfg.vocab_size))
    ref = ref[0, len(ids[0]) - 1:-1]
    top2 = np.sort(ref, -1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0]).min() > 1e-3  # no near-tie for fp32 to flip
    assert out.tokens[0] == list(ref.argmax(-1))


# ----------------------------------------------------------------------------------------------- preprocessing
# (width, height, max_wh_ratio) -> (token rows, token columns, pixel height, pixel width) with patch 4, r = 3, at most
# 64 tokens, min_pixels 256, worked by hand from the reference's plan_image_grid / safe_resize / solve_resize_ratio:
PLANS = {
    (28, 14, None): (2, 3, 16, 28),  # 392 px: kept; height 14 -> 16; grid 4 x 7 -> ceil 2 x 3 tokens (10)
    (10, 6, None): (1, 2, 12, 20),  # 60 px < 256: x sqrt(256/60) = 2.066 -> int 20 x 12; grid 3 x 5 -> 1 x 2
    (8, 60, None): (5, 1, 60, 8),  # tall: grid 15 x 2 -> 5 x 1 (12 tokens)
    # 25 x 50 patches -> 9 x 17 = 164 tokens > 64: columns sqrt(62 / 0.5 + 1/4) - 1/2 = 10.65, rows 5.32;
    # scale min(10 * 12 / 200, 5 * 12 / 100) = 0.6 -> 60 x 120 px, 5 x 10 tokens (57)
    (200, 100, None): (5, 10, 60, 120),
    # 1 x 84 tokens = 87 > 64; rows 0.496 < 1: one row of (64 - 3) = 61 cells of 12 px -> 12 x 732 px (64 tokens)
    (1000, 4, None): (1, 61, 12, 732),
    (100, 10, 4): (1, 4, 12, 40),  # wider than 4:1: planned as 40 x 10 -> 12 x 40 px, 3 x 10 patches, 1 x 4 tokens
}


@pytest.mark.parametrize("size", PLANS)
def test_resize_plan_by_hand(size):
    w, h, ratio = size
    assert im.deepseek_v41_plan(w, h, 4, 3, 64, 256, ratio) == PLANS[size]


def _value(v):
    """(v / 255 - 0.5) / 0.5 in float32, rounded to bfloat16: the reference's pixel value of a uint8 v."""
    x = (np.float32(v) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    return np.float32(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16))


def _unpatch(pv, grid, p):
    (h, w), = grid
    return pv.reshape(h, w, 3, p, p).transpose(0, 3, 1, 4, 2).reshape(h * p, w * p, 3)


def test_preprocessing_pixels_by_hand():
    """Patches are row-major, each (channel, row, column); an image already of its planned width is centred on grey
    127 rows (ImageOps.pad), one narrower is resized keeping its aspect ratio; values are bf16 of (v/255 - 0.5)/0.5;
    a wider-than-max_wh_ratio image is stretched, not padded; RGBA drops its alpha as convert("RGB") does."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (14, 28, 3), np.uint8)  # 28 x 14: planned 28 x 16, pasted at row round(2 * 0.5) = 1
    out = im.deepseek_v41([Image.fromarray(a)], 4, 3, 64, 256)
    assert out["image_grid_hw"].tolist() == [[4, 7]] and out["token_grid"].tolist() == [[2, 3]]
    assert out["num_image_tokens"].tolist() == [2 * 4 + 2] and out["pixel_values"].shape == (28, 3, 4, 4)
    px = _unpatch(out["pixel_values"], out["image_grid_hw"], 4)
    assert (px[0] == _value(127)).all() and (px[15] == _value(127)).all()
    assert np.array_equal(px[1:15], np.vectorize(_value)(a))
    # a tall image: 8 x 60 is its own plan (no resize, no padding); as RGBA the alpha is dropped
    t = rng.integers(0, 256, (60, 8, 4), np.uint8)
    out = im.deepseek_v41([im.load_image_plain(t)], 4, 3, 64, 256)
    assert out["image_grid_hw"].tolist() == [[15, 2]]
    assert np.array_equal(_unpatch(out["pixel_values"], out["image_grid_hw"], 4), np.vectorize(_value)(t[..., :3]))
    # 100 x 10 with max_wh_ratio 4: stretched to 40 x 12 by a bicubic resize
    s = rng.integers(0, 256, (10, 100, 3), np.uint8)
    out = im.deepseek_v41([Image.fromarray(s)], 4, 3, 64, 256, 4)
    want = np.asarray(Image.fromarray(s).resize((40, 12), Image.Resampling.BICUBIC))
    assert np.array_equal(_unpatch(out["pixel_values"], out["image_grid_hw"], 4), np.vectorize(_value)(want))
    # several images: patches one image after another, a grid each
    out = im.deepseek_v41([Image.fromarray(a), Image.fromarray(t[..., :3])], 4, 3, 64, 256)
    assert out["image_grid_hw"].tolist() == [[4, 7], [15, 2]] and out["pixel_values"].shape == (28 + 30, 3, 4, 4)


def test_placeholder_expansion_and_spans():
    """One image token per image in a prompt becomes the image's span; the layout is the reference's token types."""
    v = dataclasses.replace(_cfg().vision)
    model = SimpleNamespace(config=_cfg(), tokenizer=None, preprocessor=None)
    pics = [Image.new("RGB", (28, 14), (200, 10, 10)), Image.new("RGB", (8, 60), (0, 90, 0))]
    ids, arrays = multimodal.prepare(model, [[1, IMG, 2, IMG, 3]], [pics])
    assert ids == [[1] + [IMG] * 10 + [2] + [IMG] * 12 + [3]]
    assert arrays["image_grid_hw"].tolist() == [[4, 7], [15, 2]]
    lay = deepseek_vision.layout(v.merge_size, ((4, 7), (15, 2)))
    starts, ends, newline = 0, 1, 2
    img0 = [starts] + [3, 4, 5, newline, 6, 7, 8, newline] + [ends]  # aligner rows 0..5 follow the 3 delimiters
    assert lay.span[:10].tolist() == img0 and len(lay.span) == 22
    kept, _ = multimodal.prepare(model, ids, [pics])  # already expanded: kept
    assert kept == ids


def _cfg():
    from jaxmodels import families

    hf = ck.tiny_config("v4.1", **TEXT)
    hf["vision_config"], hf["image_token_id"] = dict(VISION), IMG
    return families.config_from_hf(hf)


# ----------------------------------------------------------------------------------------------- errors
def test_bad_inputs_are_one_clear_error(tmp_path):
    cfg = _cfg()
    pics = [Image.new("RGB", (28, 14)), Image.new("RGB", (8, 60))]
    out = im.deepseek_v41(pics, 4, 3, 64, 256)
    good = {"pixel_values": out["pixel_values"], "image_grid_hw": out["image_grid_hw"]}
    ids = np.array([[1] + [IMG] * 10 + [2] + [IMG] * 12 + [3]])
    vision.inputs(cfg, ids, good)  # fine
    cases = [
        (ids, {**good, "pixel_values": out["pixel_values"][:, :, :2]}, r"pixel_values must be \[58, 3, 4, 4\]"),
        (ids, {"pixel_values": out["pixel_values"]}, "takes image_grid_hw"),
        (ids, {**good, "image_grid_hw": np.array([[4, 7], [16, 2]])}, r"pixel_values must be \[60, 3, 4, 4\]"),
        (ids, {**good, "image_grid_hw": np.array([[4.0, 7.0], [15.0, 2.0]])}, "image_grid_hw must be"),
        (ids[:, :-3], good, "fill 22 image tokens .* hold 20"),
        (np.array([[1] + [IMG] * 10 + [IMG] * 5 + [2] + [IMG] * 7 + [3]]), good,
         r"image 1's span of 12 image tokens .* broken by token 2 at row 0 position 16"),
        (ids, {**good, "image_sizes": np.array([[1, 1]])}, "takes pixel_values, image_grid_hw, not image_sizes"),
    ]
    for tokens, given, why in cases:
        with pytest.raises(ValueError, match=why):
            vision.inputs(cfg, tokens, given)
    with pytest.raises(ValueError, match="has no vision tower"):
        vision.inputs(dataclasses.replace(cfg, vision=None), ids, good)
    model = SimpleNamespace(config=cfg, tokenizer=None, preprocessor=None)
    with pytest.raises(ValueError, match="prompt 0 has 1 image tokens .* for 2 images"):
        multimodal.prepare(model, [[1, IMG, 2]], [pics])
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(ValueError, match=r"^image 1: (not a readable image|cannot decode the image)"):
        multimodal.prepare(model, [[1, IMG, 2, IMG]], [[pics[0], str(bad)]])
    with pytest.raises(ValueError, match="zero-size image"):
        im.load_image_plain(np.zeros((0, 4, 3), np.uint8))


def test_missing_and_misshapen_vision_tensors(tmp_path):
    """Names and shapes are checked before any data is read: a missing tower tensor is named, a misshapen one gives
    the shape it needs, a block past the tower's is refused; without vision_config they are all left out."""
    src = tmp_path / "src"
    src.mkdir()
    hf = _write(src)
    tower = {k: dq.read_safetensors_tensor(src / "vision.safetensors", k) for k in
             json.loads((src / "vision.safetensors").read_bytes()[8:8 + int.from_bytes(
                 (src / "vision.safetensors").read_bytes()[:8], "little")]) if k != "__metadata__"}

    def attempt(mutate, config=hf):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        t = dict(tower)
        mutate(t)
        enc.write_safetensors(d / "vision.safetensors", t)
        (d / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
        (d / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
        (d / "config.json").write_text(json.dumps(config))
        return converters.read_source(d, progress=False)

    def error(mutate):
        with pytest.raises(CheckpointError) as e:
            attempt(mutate)
        return str(e.value)

    assert "vision.blocks.1.mlp.w1.weight" in error(lambda t: t.pop("vision.blocks.1.mlp.w1.weight"))
    assert "image_end" in error(lambda t: t.pop("image_end"))
    msg = error(lambda t: t.update({"aligner.w1.weight": t["aligner.w1.weight"][:, :100]}))
    assert "aligner.w1.weight" in msg and "(256, 288)" in msg
    extra = lambda t: t.update({"vision.blocks.2.norm1.weight": t["vision.blocks.0.norm1.weight"]})  # noqa: E731
    assert "layer 2 of 2" in error(extra)
    text_only = {k: v for k, v in hf.items() if k != "vision_config"}
    cfg, params, _ = attempt(lambda t: None, text_only)
    assert cfg.vision is None and "vision" not in params
    assert "selection_bias_vl" not in params["layers"]["0"]["mlp"]
