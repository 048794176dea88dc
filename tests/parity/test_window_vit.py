"""EXAONE 4.5's windowed vision tower (jaxmodels/layers/window_vit.py) against HF's `Exaone4_5_ForConditionalGeneration`
(transformers 5.24, tiny config of specs/vision.md §6, every parameter randomised): the merged features that
`get_image_features` returns and the model splices, in fp32 to 1e-5 x max(1, |x|)."""
import functools

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from jaxmodels.config import VisionSpec
from jaxmodels.layers import window_vit
from tests.parity import hf_reference as ref

# §6: GQA 4 q / 2 kv heads, a 56-px window (2x2 merge units) smaller than the images, block 1 full, blocks 0, 2
# windowed (the scan switches both ways).
TINY = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, num_key_value_heads=2, patch_size=14,
            spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
            out_hidden_size=64)
# Non-square GQA (6 q heads share 2 kv heads, d = 8), one time slice per patch, a full block first.
GQA3 = dict(TINY, hidden_size=48, num_heads=6, num_key_value_heads=2, temporal_patch_size=1,
            fullatt_block_indexes=[0])


def _freeze(vc: dict) -> tuple:  # a hashable key for _hf's cache
    return tuple((k, tuple(x) if isinstance(x, list) else x) for k, x in vc.items())


@functools.lru_cache(maxsize=None)
def _hf(vision: tuple):
    from transformers.models.exaone4_5 import Exaone4_5_Config, Exaone4_5_ForConditionalGeneration

    text = dict(model_type="exaone4", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    vision = {k: list(x) if isinstance(x, tuple) else x for k, x in vision}
    cfg = Exaone4_5_Config(vision_config=vision, text_config=text, image_token_id=67, video_token_id=68)
    return ref.randomize(Exaone4_5_ForConditionalGeneration(cfg), seed=1).float().eval()


def _spec(vc: dict, **over) -> VisionSpec:
    kw = dict(kind="window_vit", hidden_size=vc["hidden_size"], num_layers=vc["depth"], num_heads=vc["num_heads"],
              num_kv_heads=vc["num_key_value_heads"], intermediate_size=vc["intermediate_size"],
              patch_size=vc["patch_size"], image_size=vc["window_size"], image_token_id=67, activation="silu",
              norm_eps=1e-6, rope_theta=10000.0, temporal_patch_size=vc["temporal_patch_size"],
              merge_size=vc["spatial_merge_size"], window_size=vc["window_size"],
              full_blocks=tuple(vc["fullatt_block_indexes"]), out_hidden_size=vc["out_hidden_size"])
    return VisionSpec(**(kw | over))


def _params(model, depth: int) -> dict:
    """HF's `model.visual.*` state dict as the plan's tree: matrices [in, out], layers stacked."""
    sd = {k[len("model.visual."):]: t.detach().numpy() for k, t in model.state_dict().items()
          if k.startswith("model.visual.")}
    w = sd["patch_embed.proj.weight"]  # [C, 3, T, p, p]
    names = {"norm1": ("norm1.weight", False), "wqkv": ("attn.qkv.weight", True), "bqkv": ("attn.qkv.bias", False),
             "wo": ("attn.proj.weight", True), "bo": ("attn.proj.bias", False), "norm2": ("norm2.weight", False),
             "w_gate": ("mlp.gate_proj.weight", True), "b_gate": ("mlp.gate_proj.bias", False),
             "w_up": ("mlp.up_proj.weight", True), "b_up": ("mlp.up_proj.bias", False),
             "w_down": ("mlp.down_proj.weight", True), "b_down": ("mlp.down_proj.bias", False)}
    layers = {ours: np.stack([sd[f"blocks.{j}.{hf}"].T if t else sd[f"blocks.{j}.{hf}"] for j in range(depth)])
              for ours, (hf, t) in names.items()}
    merger = {"norm": sd["merger.ln_q.weight"], "w1": sd["merger.mlp.0.weight"].T, "b1": sd["merger.mlp.0.bias"],
              "w2": sd["merger.mlp.2.weight"].T, "b2": sd["merger.mlp.2.bias"]}
    return {"patch": w.reshape(w.shape[0], -1).T, "layers": layers, "merger": merger}


def _pixels(vc: dict, sizes, seed: int = 0):
    """HF's own Qwen2-VL image processor (PIL backend) on random images of these (height, width) pixel sizes."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    proc = Qwen2VLImageProcessorPil(patch_size=vc["patch_size"], temporal_patch_size=vc["temporal_patch_size"],
                                    merge_size=vc["spatial_merge_size"], min_pixels=28 * 28, max_pixels=1 << 20)
    out = proc(images=images, return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def _want(model, pv, thw) -> np.ndarray:
    with torch.no_grad():
        feats = model.model.get_image_features(pv, thw).pooler_output  # the per-image splits that get spliced
    return torch.cat(feats).numpy()


@functools.partial(jax.jit, static_argnums=(0, 3))
def _encode(v, p, pv, grid):
    return window_vit.encode(v, p, pv, grid)


def _check(vc: dict, pv, thw, **over) -> float:
    """Max of |got - want| / max(1, |want|); asserts the shape, and the value when `over` is empty."""
    model = _hf(_freeze(vc))
    want = _want(model, pv, thw)
    grid = tuple(map(tuple, thw.tolist()))
    got = np.asarray(_encode(_spec(vc, **over), _params(model, vc["depth"]), pv.numpy(), grid))
    assert got.shape == want.shape == (int(thw.prod(-1).sum()) // vc["spatial_merge_size"] ** 2,
                                       vc["out_hidden_size"])
    err = float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())
    if not over:
        assert err <= 1e-5, err
    return err


def test_one_image_56x84():
    pv, thw = _pixels(TINY, [(56, 84)])
    assert thw.tolist() == [[1, 4, 6]] and pv.shape == (24, 3 * 2 * 14 * 14)
    _check(TINY, pv, thw)


def test_two_images_of_different_sizes_partial_and_exact_windows():
    """4x6 patches = 2x3 merge units: windows of 2x2 and a partial 2x1; 8x8 = 4x4 units: exactly 2x2 windows.
    Attending over whole images instead of windows, or across the two images, would be far off."""
    pv, thw = _pixels(TINY, [(56, 84), (112, 112)], seed=1)
    assert thw.tolist() == [[1, 4, 6], [1, 8, 8]]
    _check(TINY, pv, thw)
    assert _check(TINY, pv, thw, full_blocks=(0, 1, 2)) > 1e-3  # the windows matter here
    assert _check(TINY, pv, thw, full_blocks=()) > 1e-3  # and so does the full block


def test_non_square_gqa_and_a_two_frame_input():
    """6 q heads on 2 kv heads; an 84x196 image (3x7 merge units: partial windows on both sides) with a
    processor-made layout, then a 2-frame input (each frame its own segment in the full block) beside it."""
    pv, thw = _pixels(GQA3, [(84, 196)], seed=2)
    assert thw.tolist() == [[1, 6, 14]]
    _check(GQA3, pv, thw)
    video = torch.randn(2 * 4 * 4, pv.shape[1], generator=torch.Generator().manual_seed(3))
    pv2, thw2 = torch.cat([pv, video]), torch.tensor([[1, 6, 14], [2, 4, 4]])
    _check(GQA3, pv2, thw2)


def test_grid_must_divide_into_merge_blocks():
    v = _spec(TINY)
    with pytest.raises(ValueError, match="multiples of merge_size"):
        window_vit.layout(v.merge_size, 2, ((1, 3, 4),))


def test_depth_does_not_grow_the_program():
    """The blocks run in one lax.scan (a lax.cond picks windows or frames): 3 and 12 blocks trace alike."""
    def eqns(depth):
        vc = dict(TINY, depth=depth, fullatt_block_indexes=[1, depth - 1])
        p = _params(_hf(_freeze(TINY)), 3)
        p["layers"] = jax.tree.map(lambda a: np.zeros((depth, *a.shape[1:]), a.dtype), p["layers"])
        jaxpr = jax.make_jaxpr(lambda p, x: window_vit.encode(_spec(vc), p, x, ((1, 4, 6),)))(p, np.zeros((24, 1176)))
        return len(jaxpr.eqns), str(jaxpr).count("cond[")
    assert eqns(3) == eqns(12) and eqns(3)[1] == 1
