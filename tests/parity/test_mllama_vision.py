"""Llama 3.2 Vision's tiled encoder + projector (jaxmodels/layers/mllama_vision.py) against HF's
`MllamaForConditionalGeneration` (transformers 5.24, the tiny config of specs/vision.md §6, every parameter
randomised, the gates bounded away from 0): the `cross_attention_states` that `MllamaModel.forward` hands its
language model, in fp32 to 1e-5 x max(1, |x|)."""
import functools

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from jaxmodels.config import VisionSpec
from jaxmodels.layers import mllama_vision
from tests.parity import hf_reference as ref

# §6: 28-px tiles of 2x2 patches + CLS = 5 tokens, padded to 8; 2 local + 2 gated global layers; 4 tiles.
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=2, attention_heads=2,
            image_size=28, patch_size=14, max_num_tiles=4, intermediate_layers_indices=[0, 1], vision_output_dim=96)
# 3 local layers recorded out of order ([2, 0]: the interleave follows the list), a norm_eps the layers use and
# layernorm_pre/post do not.
DEEP = dict(TINY, num_hidden_layers=3, intermediate_layers_indices=[2, 0], norm_eps=1e-3)
D = 64


def _freeze(vc: dict) -> tuple:
    return tuple((k, tuple(x) if isinstance(x, list) else x) for k, x in vc.items())


@functools.lru_cache(maxsize=None)
def _hf(vision: tuple):
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    vision = {k: list(x) if isinstance(x, tuple) else x for k, x in vision}
    text = dict(vocab_size=512, hidden_size=D, intermediate_size=128, cross_attention_layers=[1], num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = MllamaConfig(vision_config=vision, text_config=text, image_token_index=512)
    model = MllamaForConditionalGeneration._from_config(cfg, attn_implementation="eager")
    assert model.model.vision_model.config._attn_implementation == "eager"
    model = ref.randomize(model, seed=3)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.split(".")[-1] in ("gate", "gate_attn", "gate_ffn"):  # |g| in [0.3, 0.9], either sign
                sign = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)
                t.copy_(sign * (0.3 + 0.6 * torch.rand(t.shape, generator=g)))
            elif "positional_embedding" in name:  # position and tile embeddings as large as the patch features
                t.copy_(0.5 * torch.randn(t.shape, generator=g))
    return model.eval()


def _spec(vc: dict, **over) -> VisionSpec:
    from transformers import MllamaVisionConfig

    hv = MllamaVisionConfig(**vc)
    kw = dict(kind="mllama", hidden_size=hv.hidden_size, num_layers=hv.num_hidden_layers,
              global_layers=hv.num_global_layers, num_heads=hv.attention_heads, intermediate_size=hv.intermediate_size,
              patch_size=hv.patch_size, image_size=hv.image_size, max_tiles=hv.max_num_tiles,
              aspect_ratios=tuple(map(tuple, hv.supported_aspect_ratios)),
              intermediate_layers=tuple(hv.intermediate_layers_indices), activation=hv.hidden_act,
              norm_eps=hv.norm_eps, image_token_id=512)
    return VisionSpec(**(kw | over))


def _params(model, v: VisionSpec) -> dict:
    """HF's `model.vision_model.*` + `model.multi_modal_projector.*` as the plan's tree (plan.vision_param_specs):
    matrices [in, out], heads split, layers stacked."""
    sd = {k[len("model."):]: t.detach().numpy() for k, t in model.state_dict().items()
          if k.startswith(("model.vision_model.", "model.multi_modal_projector."))}
    vm = lambda name: sd["vision_model." + name]  # noqa: E731
    C, H, d = v.hidden_size, v.num_heads, v.head_dim

    def layer(prefix: str, j: int, gated: bool) -> dict:
        t = lambda name: vm(f"{prefix}.layers.{j}.{name}")  # noqa: E731
        out = {"ln1": {"w": t("input_layernorm.weight"), "b": t("input_layernorm.bias")},
               "ln2": {"w": t("post_attention_layernorm.weight"), "b": t("post_attention_layernorm.bias")},
               **{f"w{n}": t(f"self_attn.{n}_proj.weight").T.reshape(C, H, d) for n in "qkv"},
               "wo": t("self_attn.o_proj.weight").T.reshape(H, d, C),
               "fc1": t("mlp.fc1.weight").T, "b1": t("mlp.fc1.bias"), "fc2": t("mlp.fc2.weight").T,
               "b2": t("mlp.fc2.bias")}
        return out | ({"gate_attn": t("gate_attn"), "gate_ffn": t("gate_ffn")} if gated else {})

    def stack(prefix: str, n: int, gated: bool) -> dict:
        return jax.tree.map(lambda *a: np.stack(a), *[layer(prefix, j, gated) for j in range(n)])

    ln = lambda name: {"w": vm(name + ".weight"), "b": vm(name + ".bias")}  # noqa: E731
    tile = lambda name: {"gate": vm(name + ".gate"), "embedding": vm(name + ".embedding.weight")}  # noqa: E731
    w = vm("patch_embedding.weight")  # [C, 3, p, p]
    return {"patch": w.reshape(w.shape[0], -1).T, "class_embedding": vm("class_embedding"),
            "pos": {"gate": vm("gated_positional_embedding.gate"),
                    "embedding": vm("gated_positional_embedding.embedding"),
                    "tile": vm("gated_positional_embedding.tile_embedding.weight")},
            "pre_tile": tile("pre_tile_positional_embedding"), "post_tile": tile("post_tile_positional_embedding"),
            "ln_pre": ln("layernorm_pre"), "ln_post": ln("layernorm_post"),
            "layers": stack("transformer", v.num_layers, False),
            "global_layers": stack("global_transformer", v.global_layers, True),
            "projector": {"w": sd["multi_modal_projector.weight"].T, "b": sd["multi_modal_projector.bias"]}}


def _want(model, pv, ids, mask) -> np.ndarray:
    """The cross_attention_states MllamaModel.forward passes to its language model ([B*N_img*T, NP, D] there),
    viewed [B, N_img*T*NP, D] as each cross-attention layer's k/v projection does."""
    seen = {}

    def grab(module, args, kwargs):
        seen["x"] = kwargs["cross_attention_states"].detach().clone()

    B, M = ids.shape
    hook = model.model.language_model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        tokens = torch.tensor([[1] + [512] * M + [30, 31]] * B)
        with torch.no_grad():
            model(input_ids=tokens, pixel_values=pv, aspect_ratio_ids=ids, aspect_ratio_mask=mask,
                  cross_attention_mask=torch.ones(B, tokens.shape[1], M, 4, dtype=torch.long))
    finally:
        hook.remove()
    x = seen["x"]
    NP = model.model.vision_model.num_patches
    assert tuple(x.shape) == (B * M * pv.shape[2], NP, D)
    return x.reshape(B, -1, D).numpy()


_encode = jax.jit(mllama_vision.encode, static_argnums=0)


def _err(got, want) -> float:
    return float((np.abs(got - want) / np.maximum(1.0, np.abs(want))).max())


def _run(v, p, pv, ids, mask) -> np.ndarray:
    return np.asarray(_encode(v, p, pv.numpy(), ids.numpy().astype(np.int32), mask.numpy().astype(np.int32)))


def _check(vc, pv, ids, mask):
    """-> (ours, HF's, spec, params); asserts the shape and the tolerance."""
    model = _hf(_freeze(vc))
    v = _spec(vc)
    p = _params(model, v)
    want = _want(model, pv, ids, mask)
    got = _run(v, p, pv, ids, mask)
    B, M, T = pv.shape[:3]
    assert got.shape == want.shape == (B, M * T * mllama_vision.tokens_per_tile(v), D)
    err = _err(got, want)
    assert err <= 1e-5, err
    return got, want, v, p


def _one_image():
    """§6: one 1x2-tile image (aspect id 2) and its 2 zero pad tiles."""
    pv = torch.randn(1, 1, 4, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    pv[:, :, 2:] = 0
    return pv, torch.tensor([[2]]), torch.tensor([[[1, 1, 0, 0]]])


def _processed(sizes, seed: int = 1):
    """HF's own Mllama image processor (PIL backend, 28-px tiles) on random images, a list of (h, w) per row."""
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    rng = np.random.default_rng(seed)
    images = [[Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in row] for row in sizes]
    out = MllamaImageProcessorPil(size={"height": 28, "width": 28}, max_image_tiles=4)(images=images,
                                                                                      return_tensors="pt")
    return out["pixel_values"].float(), out["aspect_ratio_ids"], out["aspect_ratio_mask"]


def test_one_image_of_two_tiles():
    pv, ids, mask = _one_image()
    _check(TINY, pv, ids, mask)


def test_batch_of_two_rows_with_mixed_aspect_ratios_and_a_missing_image():
    """Row 0: a 2x2-tile image (id 6, all 4 tiles) and a 1x3 one (id 3); row 1: a 3x1 one (id 7) and no second
    image (id 0, zero tiles, mask [1, 0, 0, 0]), all four as HF's processor packs them; run as one batch."""
    pv, ids, mask = _processed([[(50, 60), (20, 70)], [(70, 20)]])
    assert ids.tolist() == [[6, 3], [7, 0]]
    assert mask.tolist() == [[[1, 1, 1, 1], [1, 1, 1, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]]]
    assert not pv[1, 1].any()
    got, _, v, p = _check(TINY, pv, ids, mask)
    # one batch is the same as each row alone
    alone = _run(v, p, pv[1:], ids[1:], mask[1:])
    assert np.abs(alone - got[1:]).max() <= 1e-5


def test_deeper_stack_out_of_order_intermediates_and_layer_norm_eps():
    pv, ids, mask = _processed([[(50, 60), (20, 70)], [(70, 20)]], seed=2)
    got, want, v, p = _check(DEEP, pv, ids, mask)
    # what the comparison sees: the list order of the intermediates, and norm_eps in the layers only
    assert _err(_run(_spec(DEEP, intermediate_layers=(0, 2)), p, pv, ids, mask), want) > 1e-3
    assert _err(_run(_spec(DEEP, norm_eps=1e-5), p, pv, ids, mask), want) > 1e-5


def test_pad_tiles_are_read_by_valid_tokens_in_hf_and_here():
    """HF masks only invalid<->invalid pairs: a pixel of a pad tile moves the valid tiles' outputs. The same change
    must move ours by the same amount (and the new input must still match)."""
    pv, ids, mask = _one_image()
    got, want, v, p = _check(TINY, pv, ids, mask)
    pv2 = pv.clone()
    pv2[0, 0, 3, 1, 5, 7] = 3.0
    got2, want2, _, _ = _check(TINY, pv2, ids, mask)
    NP = mllama_vision.tokens_per_tile(v)
    valid = slice(0, 2 * NP)  # tiles 0 and 1
    moved_hf = np.abs(want2[:, valid] - want[:, valid]).max()
    moved = np.abs(got2[:, valid] - got[:, valid]).max()
    assert moved_hf > 1e-3
    assert abs(moved - moved_hf) <= 1e-5 * max(1.0, moved_hf)


@pytest.mark.parametrize("path", ["pre_tile/gate", "post_tile/gate", "pos/gate", "pos/tile", "class_embedding",
                                  "global_layers/gate_attn", "global_layers/gate_ffn", "projector/b", "ln_pre/b",
                                  "layers/b2"])
def test_every_part_moves_the_check(path):
    """Negative controls: a small change to any one parameter group (N(0, 0.1) added; not a constant, which the
    layer norms would absorb) fails the tolerance."""
    pv, ids, mask = _one_image()
    model = _hf(_freeze(TINY))
    v = _spec(TINY)
    p = _params(model, v)
    want = _want(model, pv, ids, mask)
    node = p
    *parents, leaf = path.split("/")
    for k in parents:
        node = node[k]
    node[leaf] = node[leaf] + 0.1 * np.random.default_rng(5).standard_normal(node[leaf].shape, np.float32)
    assert _err(_run(v, p, pv, ids, mask), want) > 1e-3


def test_wrong_aspect_ratio_or_mask_fails_the_check():
    pv, ids, mask = _one_image()
    model = _hf(_freeze(TINY))
    v = _spec(TINY)
    p = _params(model, v)
    want = _want(model, pv, ids, mask)
    assert _err(_run(v, p, pv, torch.tensor([[5]]), mask), want) > 1e-3  # (2, 1) instead of (1, 2)
    assert _err(_run(v, p, pv, ids, torch.tensor([[[1, 1, 1, 1]]])), want) > 1e-3  # pad tiles unmasked


def test_rejects_wrong_tile_count():
    v = _spec(TINY)
    p = _params(_hf(_freeze(TINY)), v)
    with pytest.raises(ValueError, match="pixel_values must be"):
        mllama_vision.encode(v, p, np.zeros((1, 1, 3, 3, 28, 28), np.float32), np.ones((1, 1), np.int32),
                             np.ones((1, 1, 3), np.int32))


def test_depth_does_not_grow_the_program():
    """Local and global layers run as two lax.scans: 2 and 8 local layers trace to the same program size."""
    def eqns(L):
        v = _spec(dict(TINY, num_hidden_layers=L, intermediate_layers_indices=[0, L - 1]))
        p = _params(_hf(_freeze(TINY)), _spec(TINY))
        p["layers"] = jax.tree.map(lambda a: np.zeros((L, *a.shape[1:]), a.dtype), p["layers"])
        args = (np.zeros((1, 1, 4, 3, 28, 28), np.float32), np.ones((1, 1), np.int32), np.ones((1, 1, 4), np.int32))
        return len(jax.make_jaxpr(lambda p, *a: mllama_vision.encode(v, p, *a))(p, *args).eqns)
    assert eqns(2) == eqns(8)


def test_cross_attention_layers_default_only_when_absent():
    """HF's MllamaTextConfig fills its default list only when the key is absent or null: [] means a text model
    without cross-attention layers (it was taken for absent)."""
    from transformers import MllamaConfig

    from jaxmodels.families import mllama

    def cross(text):
        cfg = mllama.config({"model_type": "mllama", "text_config": text})
        return [i for i, s in enumerate(cfg.layers) if s.attention.kind == "cross"]

    hf = MllamaConfig(text_config={"num_hidden_layers": 40}).text_config.cross_attention_layers
    assert cross({"num_hidden_layers": 40}) == sorted(hf)
    assert cross({"num_hidden_layers": 40, "cross_attention_layers": None}) == sorted(hf)
    assert cross({"num_hidden_layers": 40, "cross_attention_layers": []}) == []
    assert MllamaConfig(text_config={"cross_attention_layers": []}).text_config.cross_attention_layers == []
