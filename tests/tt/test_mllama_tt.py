"""Mllama (Llama 3.2 Vision) through the TT backend (issue #14 item 5): the tiled vision tower runs in JAX on the host,
the lowered cross-attention layers compute their image K/V on the (emulated) device once per request, keep them in
their paged caches through a cross page table and read them at every decode step.

The model is tests/parity/test_vision.py's tiny random Mllama (every weight non-trivial, both tanh gates 0.7, one
cross layer between two self-attention layers, 28-px tiles of 4 patches + CLS, 4 tiles an image), converted through
the public path. References are `jm.forward` / `jm.generate` of each request on its own with its images (parity-tested
against HF): user A's image token comes after two text tokens (those rows see no tile: HF attends them to every
image key and zeroes only their MLP update), user B has two images, user C none. Criteria as tests/tt uses them:
exact numerics equal jm.forward (max |diff| <= 1e-4; measured ~3e-6) and greedy tokens equal jm.generate; full TT
numerics ("performance" policy) PCC >= 0.99 at every step, teacher-forced.
"""
from __future__ import annotations

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import multimodal
from tests.parity.test_vision import _mllama, _picture
from tests.tt.test_deepseek_lowering import check_against_the_wheel
from tests.tt.test_emu_ops import comp_pcc
from tests.tt.test_multimodal import _convert
from tests.tt.test_tt_forward import tiny_model
from tt_backend import cross_attention as xa, generator as G, lowering
from tt_backend.emu.executor import Executor
from tt_backend.multimodal import VisionTower

BS, MAX_SEQ, STEPS, IMG = 32, 256, 3, 512
WIDTH = MAX_SEQ // BS
PROMPTS = [[1, 30, IMG, 31, 32, 33, 34], [IMG, 1, 40, 41, IMG, 42, 43], [1, 50, 51, 52, 53]]
PICS = [[_picture(30, 60, 7)], [_picture(60, 60, 8), _picture(20, 50, 9)], []]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _convert(tmp_path_factory, "mllama", _mllama)


def _forward(model, ids, pics):
    """jm.forward of one request (its own images) -> logits [T, vocab]."""
    ids = list(ids)
    if not pics:
        return np.asarray(jm.forward(model, np.asarray([ids])))[0]
    _, arrays = multimodal.prepare(model, [ids], [pics])
    return np.asarray(jm.forward(model, np.asarray([ids]), **arrays))[0]


@pytest.fixture(scope="module")
def refs(model):
    """Per user: jm.generate's greedy tokens (STEPS + 1) and jm.forward's logits at the prompt's last position and
    each decode position [STEPS + 1, vocab], each request on its own."""
    wants, logits = [], []
    for p, pics in zip(PROMPTS, PICS):
        want = jm.generate(model, [p], max_new_tokens=STEPS + 1, ignore_eos=True, images=[pics] if pics else None)
        wants.append(want.tokens[0])
        logits.append(_forward(model, p + wants[-1][:-1], pics)[len(p) - 1:])
    return wants, logits


def _generator(model, numerics, users=3, **kw):
    """A Mllama generator over shuffled blocks: each user WIDTH blocks for its tokens and 2 for its image K/V (20 or
    40 tokens: one or both). Every block starts with stale values (earlier requests'), so a read of a block a user
    did not write, a padding key that is not masked or a text-only user's cross output that is not dropped shows."""
    gen = G.MllamaForConditionalGeneration.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), users, MAX_SEQ,
                                                                 model=model, numerics=numerics, **kw)
    cfg = model.config
    n = users * (WIDTH + 2)
    kv = gen.allocate_kv_cache((n + 2, cfg.num_kv_heads, BS, cfg.head_dim), np.float32, cfg.num_layers)
    rng = np.random.default_rng(0)
    for a in (a for sub in kv for layer in sub for a in layer):
        a[...] = rng.standard_normal(a.shape)
    perm = rng.permutation(n + 2)[:n].astype(np.int32)
    return gen, kv, perm[:users * WIDTH].reshape(users, WIDTH), perm[users * WIDTH:].reshape(users, 2)


def _batch(prompts):
    tokens = np.zeros((len(prompts), max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens


def _cross_layer(cfg) -> int:
    return next(i for i, s in enumerate(cfg.layers) if s.attention.kind == "cross")


def test_prefill_equals_jm_forward_at_every_position(model):
    """The emulated prefill (exact numerics) from the tower's features equals jm.forward at every prompt position,
    including A's two rows that see no tile; the cross layer matters there (text-only logits differ), and so does
    HF's MLP row mask (the same run with it forced to 1 differs exactly on those rows)."""
    ex, tower = Executor(model, numerics="exact", max_seq_len=MAX_SEQ), VisionTower(model)
    for u, (p, pics) in enumerate(zip(PROMPTS[:2], PICS[:2])):
        ref, text = _forward(model, p, pics), _forward(model, p, [])
        states, tiles = tower.cross_inputs(p, pics)
        assert states.shape == (xa.cross_tokens(model.config, len(pics)), model.config.hidden_size)
        cross = xa.CrossPrefill(states, tiles, np.array([10 + 2 * u, 11 + 2 * u], np.int32))
        got = ex.prefill(p, np.arange(WIDTH, dtype=np.int32), ex.allocate_kv_cache(20), cross=cross)
        err = np.abs(got - ref).max()
        print(f"\nuser {u}: prefill max |TT exact - jm.forward| = {err:.2e} (|logits| <= {np.abs(ref).max():.2f})")
        assert err <= 1e-4
        assert np.abs(ref - text).max(axis=-1).min() > 1e-2  # every row, A's imageless rows too, reads the image
    # HF zeroes the MLP update of rows that see no tile (A's rows 0, 1): without that mask the cross layer's output
    # changes on exactly those rows, and so do their logits
    states, tiles = tower.cross_inputs(PROMPTS[0], PICS[0])
    tokens = np.asarray(PROMPTS[0])
    i, T = _cross_layer(model.config), len(tokens)
    prog, inputs = ex.prefill_inputs(tokens, 0, [np.arange(WIDTH, dtype=np.int32)[None]], None, None, T,
                                     cross=xa.CrossPrefill(states, tiles, np.array([10], np.int32)))
    runs = [ex.run(prog, dict(inputs, cross_mlp_keep=keep), ex.allocate_kv_cache(20))
            for keep in (inputs["cross_mlp_keep"], np.ones_like(inputs["cross_mlp_keep"]))]
    layer = np.abs(runs[0][f"l{i}.out"] - runs[1][f"l{i}.out"])[0, 0, :T].max(axis=-1)
    assert layer[:2].min() > 1e-2 and layer[2:].max() == 0
    logits = runs[1][prog.outputs[0]][0, 0, :T]
    assert np.abs(logits - _forward(model, PROMPTS[0], PICS[0])).max(axis=-1)[:2].min() > 1e-2


def _run(gen, kv, pt, xpt, feed=None):
    """prefill_forward in tt-metal's order (tokens, images, page_table, kv_cache, prompt_lens, cross_page_table),
    then STEPS decode steps fed `feed` (teacher forcing) or the greedy token; the last step swaps slots 0 and 1
    with slot_remap (inputs given in the new order) -> (tokens, logits [users, STEPS + 1, vocab]) in user order."""
    lens = np.asarray([len(p) for p in PROMPTS])
    logits = [gen.prefill_forward(_batch(PROMPTS), PICS, pt, kv, lens, xpt)[:, 0]]
    toks = [logits[0].argmax(-1)]
    for s in range(STEPS):
        fed = toks[-1] if feed is None else np.asarray([f[s] for f in feed])
        order = [1, 0, 2] if s == STEPS - 1 else [0, 1, 2]
        out = gen.decode_forward(fed[order], (lens + s)[order], page_table=pt[order], kv_cache=kv, enable_trace=False,
                                 cross_page_table=xpt[order], slot_remap=order if order[0] else None)[:, 0]
        logits.append(out[np.argsort(order)])
        toks.append(logits[-1].argmax(-1))
    return np.stack(toks, 1), np.stack(logits, 1)


def test_generator_greedy_equals_jm_generate(model, refs):
    """Users with one image, two images and none in one prefill_forward and one decode batch: greedy tokens equal
    jm.generate, every step's logits jm.forward (exact numerics). Decode reads the K/V the prefill kept: zeroing
    user A's image K/V blocks afterwards changes only A's next logits."""
    wants, ref = refs
    gen, kv, pt, xpt = _generator(model, "exact", max_images_per_prompt=2)
    assert gen.max_cross_attn_tokens == 40 and gen.cross_attn_tokens(1) == 20  # 4 tiles x (4 patches + CLS)
    toks, logits = _run(gen, kv, pt, xpt)
    for u in range(3):
        assert toks[u].tolist() == wants[u], f"user {u}: {toks[u].tolist()} != jm.generate {wants[u]}"
        err = np.abs(logits[u] - ref[u][:STEPS + 1]).max()
        print(f"\nuser {u}: max |TT exact - jm.forward| over prefill + {STEPS} decode steps = {err:.2e}")
        assert err <= 1e-4
    # one more step (slots are [B, A, C] after the remap), with and without A's image K/V
    lens = np.asarray([len(p) for p in PROMPTS]) + STEPS
    order = [1, 0, 2]
    step = lambda cache: gen.decode_forward(  # noqa: E731
        np.asarray([w[STEPS] for w in wants])[order], lens[order], page_table=pt[order], kv_cache=cache,
        enable_trace=False, cross_page_table=xpt[order])[:, 0][np.argsort(order)]
    copy = [[[a.copy() for a in layer] for layer in sub] for sub in kv]
    kept = step(copy)
    i = _cross_layer(model.config)
    for a in kv[0][i]:
        a[xpt[0]] = 0.0
    zeroed = step(kv)
    change = np.abs(zeroed - kept).max(axis=-1)
    print(f"zeroing A's image K/V changes its next logits by {change[0]:.3f}, B's by {change[1]:.1e}, C's "
          f"by {change[2]:.1e}")
    assert change[0] > 0.05 and change[1] < 1e-6 and change[2] < 1e-6


def test_full_tt_numerics_pcc(model, refs):
    """Full TT numerics, the "performance" policy (bfp8 K/V caches incl. the image K/V, measured per-layer weight
    dtypes): every prefill / decode step's logits PCC >= 0.99 against jm.forward, teacher-forced."""
    wants, ref = refs
    gen, kv, pt, xpt = _generator(model, "full", max_images_per_prompt=2)
    _, logits = _run(gen, kv, pt, xpt, feed=wants)
    pccs = [[comp_pcc(ref[u][s], logits[u, s])[1] for s in range(STEPS + 1)] for u in range(3)]
    print("\nfull TT numerics PCC per user and step (0 = prefill):", [[round(p, 5) for p in row] for row in pccs])
    assert min(min(row) for row in pccs) >= 0.99


def test_text_only_request(model):
    """A text-only Mllama request (no images, no cross page table) runs the self-attention layers only, as HF skips
    the cross layers without images: prefill and decode equal jm.forward; the programs have no cross inputs."""
    gen, kv, pt, _ = _generator(model, "exact", users=1)
    p = [1, 60, 61, 62, 63, 64]
    logits = [gen.prefill_forward(np.asarray([p]), None, pt, kv, [len(p)])[0, 0]]
    seq = list(p)
    for s in range(2):
        seq.append(int(logits[-1].argmax()))
        logits.append(gen.decode_forward(np.asarray([seq[-1]]), np.asarray([len(seq) - 1]), page_table=pt,
                                         kv_cache=kv, enable_trace=False)[0, 0])
    ref = np.asarray(jm.forward(model, np.asarray([seq])))[0, len(p) - 1:]
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4)
    progs = lowering.lower(model.config, prefill_len=8, batch=1, max_seq_len=MAX_SEQ)
    for prog in (progs.prefill, progs.decode):
        assert not set(prog.inputs) & {n for v in lowering.CROSS_INPUTS.values() for n in v}
        assert not any(f"kv.{_cross_layer(model.config)}.k" in c.refs() for c in prog.calls)


def test_processed_images_equal_raw_ones(model):
    """input_processor's processed images (vLLM's path), with or without their cross_attention_mask (then made from
    the tokens, as tt-metal's create_vision_mask does), give the prefill of the raw images."""
    gen, kv, pt, xpt = _generator(model, "exact", users=1)
    ids, arrays = gen.input_processor(PROMPTS[0], PICS[0])
    assert ids == PROMPTS[0] and arrays["pixel_values"].shape[:3] == (1, 1, 4)
    run = lambda entry: gen.prefill_forward(np.asarray([ids]), [entry], pt, kv, [len(ids)], xpt)[0, 0]  # noqa: E731
    raw = run(PICS[0])
    no_mask = {k: v for k, v in arrays.items() if k != "cross_attention_mask"}
    for entry in (arrays, no_mask):
        np.testing.assert_allclose(run(entry), raw, rtol=1e-6, atol=1e-6)


def test_bad_inputs(model):
    gen, kv, pt, xpt = _generator(model, "exact", users=2)
    pic = _picture(40, 40, 3)
    kw = dict(page_table=pt[:1], kv_cache=kv, cross_page_table=xpt[:1])
    with pytest.raises(ValueError, match=r"row 0: the prompt holds 0 image tokens \(id 512\) for 1 images"):
        gen.prefill_forward(np.asarray([[1, 30, 31]]), [[pic]], **kw)
    with pytest.raises(ValueError, match="row 0: 2 images, but the cross-attention caches keep 1 per request"):
        gen.prefill_forward(np.asarray([[IMG, IMG, 1, 30]]), [[pic, pic]], **kw)
    with pytest.raises(ValueError, match="need cross_page_table"):
        gen.prefill_forward(np.asarray([[IMG, 1, 30]]), [pic], page_table=pt[:1], kv_cache=kv)
    with pytest.raises(ValueError, match="Mllama takes images="):
        gen.prefill_forward(np.asarray([[IMG, 1, 30]]), pixel_values=[np.zeros((1, 4, 3, 28, 28))], **kw)
    with pytest.raises(ValueError, match="the cross page table must give 1 blocks for 20 image-feature tokens"):
        gen.prefill_forward(np.asarray([[IMG, 1, 30]]), [pic], page_table=pt[:1], kv_cache=kv,
                            cross_page_table=np.full((1, 2), -1, np.int32))
    with pytest.raises(ValueError, match="images must be a list with one entry"):
        gen.prefill_forward(np.asarray([[IMG, 1, 30]]), [pic, pic], **kw)
    gen.prefill_forward(np.asarray([[IMG, 1, 30]]), [pic], **kw)  # fine; its decode needs the cross page table
    with pytest.raises(ValueError, match="pass cross_page_table"):
        gen.decode_forward(np.asarray([5, 0]), np.asarray([3, -1]), page_table=pt, kv_cache=kv, enable_trace=False)
    g3 = G.Gemma3ForCausalLM.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), 1, MAX_SEQ,
                                                   model=tiny_model("gemma3"), numerics="exact")
    with pytest.raises(ValueError, match="cross_page_table is for cross-attention layers; this gemma3"):
        g3.prefill_forward(np.asarray([[1, 2]]), page_table=pt[:1], kv_cache=g3.allocate_kv_cache(
            (20, 2, BS, 32), np.float32, 2), cross_page_table=xpt[:1])


def test_programs_specs_and_capabilities(model):
    """The cross layer's calls: prefill projects the image features and fills the layer's cache through the cross
    page table, decode only reads it (no cache write); every call matches the ttnn wheel's signatures and passes
    check_program; the cross layer's cache is a CrossAttentionSpec; the capabilities say the tower runs in JAX."""
    cfg = model.config
    i = _cross_layer(cfg)
    progs = lowering.lower(cfg, prefill_len=8, batch=3, max_seq_len=MAX_SEQ, cross_tokens=40)
    pre, dec = progs.prefill, progs.decode
    assert set(lowering.CROSS_INPUTS["prefill"]) <= set(pre.inputs)
    assert set(lowering.CROSS_INPUTS["decode"]) <= set(dec.inputs)
    assert pre.tensors["cross_states"].shape == (1, 1, 128, cfg.hidden_size)  # 40 padded to 128
    assert dec.tensors["cross_mask"].shape == (1, 3, cfg.num_heads, 128)
    assert dec.tensors["cross_page_table"].shape == (3, 4)
    fills = [c for c in pre.calls if c.op == "ttnn.experimental.paged_fill_cache" and c.inputs[0] == f"kv.{i}.k"]
    assert [c.inputs[2] for c in fills] == ["cross_page_table"]
    assert not any(c.inputs and c.inputs[0].startswith(f"kv.{i}.") for c in dec.calls
                   if c.op == "ttnn.experimental.paged_update_cache")
    sdpa = [c for c in dec.calls if c.op == "ttnn.transformer.paged_scaled_dot_product_attention_decode"
            and c.inputs[1] == f"kv.{i}.k"]
    assert len(sdpa) == 1 and sdpa[0].kwargs["is_causal"] is False and sdpa[0].kwargs["attn_mask"].name == "cross_mask"
    for prog in (pre, dec):
        check_against_the_wheel(prog)
    w = xa.prepare(cfg, model.params, MAX_SEQ)
    gates = {k: float(np.ravel(v)[0]) for k, v in w.items() if k.endswith("_gate")}
    assert np.allclose(list(gates.values()), np.tanh(0.7)), gates  # tanh folded on the host
    assert f"layers.{i}.wqkv" not in w and w[f"layers.{i}.wkv"].shape == (1, 1, 64, 2 * cfg.num_kv_heads * 32)
    specs = G.kv_cache_specs(cfg, BS, "bfloat16")
    assert isinstance(specs[f"model.layers.{i}.cross_attn"], G.CrossAttentionSpec)
    assert f"model.layers.{i}.self_attn" not in specs and "model.layers.0.self_attn" in specs
    caps = G.MllamaForConditionalGeneration.model_capabilities
    assert caps["supports_multimodal"] and caps["vision_tower"] == "jax" and caps["image_inputs"] == "cross_attention"
    assert caps["supports_prefix_caching"] is False
