"""Multimodal prefill for the TT generator: the vision tower runs in JAX, its embeddings enter the TT text prefill.

What runs where (the choice the generator's ``model_capabilities["vision_tower"] = "jax"`` states):
- on the host, jitted JAX: the family's image processor when raw images are given (`jaxmodels.multimodal`, equal
  to HF's), the tower and projector (`jaxmodels.layers.vision.encode`: SigLIP + avg-pool for Gemma3, Pixtral + patch
  merger for Mistral3, the windowed ViT for EXAONE 4.5), the embedding lookup with the family's scale and the
  splice of the image features into the image tokens' rows (`vision.splice`), exactly as `jaxmodels.model.hidden`
  does before its first layer;
- on the device, the lowered text program: its prefill starts from those input embeddings (the "embeddings" input
  of ``lowering.lower(embeddings=True)``, [1, 1, S, D] bf16) instead of the token lookup; Gemma3's soft tokens
  of one image attend to each other (``lowering.lower(attention_mask=True)`` with masks from
  ``lowering.attention_masks``). Decode is the text program unchanged: generated tokens are text.

Mllama's images do not enter the embeddings: `cross_inputs` runs its tiled encoder and projector (here, in JAX)
and returns the image features with the prompt's tile mask; the lowered cross-attention layers compute their K/V
from those features on the device (`tt_backend.cross_attention`).

    tower = VisionTower(model)                          # a jaxmodels.Model with a vision tower
    ids, images = tower.process_prompt(prompt, [img])   # token ids with the image tokens expanded + HF arrays
    emb, blocks = tower.prefill_inputs(ids, images)     # float32 [T, D], int32 [T] (Gemma3) or None
    states, tiles = tower.cross_inputs(ids, images)     # Mllama: float32 [Sx, D], int [T, images x tiles]
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import vision

# the HF processor outputs each tower reads (vision.ACCEPTED without Gemma3's token_type_ids, which becomes the mask)
IMAGE_FIELDS = ("pixel_values", "image_sizes", "image_grid_thw")
MLLAMA_FIELDS = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")


@functools.partial(jax.jit, static_argnums=(0, 4))
def _embeddings(cfg, embed, tower, tokens, static, images):
    """tokens [1, T] -> the input embeddings [T, D] with the images' features in the image tokens' rows (the
    first lines of `jaxmodels.model.hidden`: lookup, the scale rounded to the weight dtype as HF, the splice)."""
    x = embed[tokens]
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, embed.dtype)
    features, valid = vision.encode(cfg.vision, tower, {**images, **dict(static)})
    return vision.splice(x, tokens, cfg.vision.image_token_id, features, valid)[0].astype(jnp.float32)


@functools.partial(jax.jit, static_argnums=0)
def _cross_states(v, tower, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
    """One prompt's processed images -> its cross_states [N_img * T * NP, D] (`mllama_vision.encode`)."""
    from jaxmodels.layers import mllama_vision

    return mllama_vision.encode(v, tower, pixel_values, aspect_ratio_ids, aspect_ratio_mask)[0].astype(jnp.float32)


class VisionTower:
    """The host half of a multimodal TT prefill, over a `jaxmodels.Model`'s weights (embedding table and tower)."""

    def __init__(self, model):
        cfg = model.config
        if cfg.vision is None:
            raise ValueError(f"this {cfg.family} model has no vision tower: it takes no images")
        self.model, self.config = model, cfg
        self.bidirectional = cfg.vision.kind == "siglip"  # Gemma3: each image's soft tokens see each other

    def process_prompt(self, prompt, images: list) -> tuple[list[int], dict]:
        """vLLM's input processor: a prompt (text, or token ids holding the image tokens already) and its images
        (PIL images, paths, bytes, data: URIs, arrays) -> (token ids with each image's placeholder expanded, the
        processed images by their HF names), as the family's HF processor makes them."""
        from jaxmodels import multimodal

        ids, arrays = multimodal.prepare(self.model, [prompt], [list(images)])
        return list(ids[0]), arrays

    def images_of(self, entry) -> dict | None:
        """One user's images as the generator receives them -> the processed arrays (HF names), or None for none:
        None / [] (text only); a mapping or an object with those attributes (a processor's BatchFeature, vLLM's
        multimodal kwargs: `pixel_values`, `image_sizes`, ...; Gemma3's `token_type_ids` is kept for the mask); an
        array (pixel_values); a list of raw images (run through the family's processor here: the prompt must hold
        their image tokens already, as vLLM's input processor writes them)."""
        if entry is None:
            return None
        if isinstance(entry, np.ndarray) or hasattr(entry, "__array__") and not isinstance(entry, (list, tuple)):
            return {"pixel_values": np.asarray(entry)}
        if isinstance(entry, (list, tuple)):
            if not entry:
                return None
            from jaxmodels import multimodal

            out = multimodal.process(self.model, list(entry))
            return {k: out[k] for k in IMAGE_FIELDS if k in out}
        get = entry.get if isinstance(entry, Mapping) else lambda k: getattr(entry, k, None)
        out = {k: np.asarray(get(k)) for k in (*IMAGE_FIELDS, "token_type_ids") if get(k) is not None}
        if "pixel_values" not in out:
            raise ValueError(f"a user's images must carry pixel_values (the {self.config.family} processor's "
                             f"output), got {type(entry).__name__} without them")
        return out

    def prefill_inputs(self, tokens, images: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray | None]:
        """One user's prompt token ids [T] and processed images -> (input embeddings float32 [T, D], the
        bidirectional image block of each token int32 [T] for Gemma3, else None). Inputs are checked as
        `jm.forward` checks them (`vision.inputs`: names, shapes, image token counts)."""
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        given = dict(images)
        types = given.pop("token_type_ids", None)
        arrays, static = vision.inputs(self.config, tokens[None], given)
        T = tokens.shape[0]
        padded = -(-T // 128) * 128  # one compile per 128-token bucket; the padding rows are dropped
        ids = np.zeros((1, padded), np.int32)
        ids[0, :T] = tokens
        if self.config.vision.image_token_id == 0:
            ids[0, T:] = 1  # padding must not count as image tokens
        p = self.model.params
        emb = np.asarray(_embeddings(self.config, p["embed"], p["vision"], jnp.asarray(ids), static, arrays))[:T]
        if not self.bidirectional:
            return emb, None
        if types is None:  # as jm.generate: the processor marks exactly the soft tokens
            types = tokens == self.config.vision.image_token_id
        types = np.asarray(types).reshape(-1)
        if types.shape != (T,):
            raise ValueError(f"token_type_ids must hold one entry per prompt token ({T}), got {types.shape[0]}")
        return emb, np.asarray(vision.image_blocks(types.astype(np.int32)[None]))[0]

    def cross_inputs(self, tokens, entry, max_images: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Mllama: one user's prompt token ids [T] and its images -> (the image features float32 [Sx, D], image,
        tile, token order; the tiles each token sees int [T, images x max_tiles]). `entry`: raw images (a list, or
        one image as tt-metal's generator_vllm passes it), run through the Mllama processor here; or the processed
        inputs (a mapping / BatchFeature with pixel_values, aspect_ratio_ids, aspect_ratio_mask and optionally
        cross_attention_mask, which is otherwise made from the tokens as the HF processor makes it: from an image's
        token to the next image's). Checked before the tower runs: one <|image|> token per image, at most
        `max_images`, and the arrays as `jm.forward` checks them."""
        from jaxmodels import multimodal

        v = self.config.vision
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        get = entry.get if isinstance(entry, Mapping) else lambda k: getattr(entry, k, None)
        processed = isinstance(entry, Mapping) or get("pixel_values") is not None
        if processed:
            a = {k: np.asarray(get(k)) for k in MLLAMA_FIELDS if get(k) is not None}
            missing = [k for k in MLLAMA_FIELDS[:3] if k not in a]
            if missing:
                raise ValueError(f"Mllama's processed images need {', '.join(MLLAMA_FIELDS[:3])}; missing "
                                 f"{', '.join(missing)}")
            if a["pixel_values"].ndim == 5:  # one prompt's arrays without the batch axis
                a = {k: x[None] for k, x in a.items()}
            n = a["pixel_values"].shape[1]
        elif isinstance(entry, np.ndarray):
            raise ValueError("Mllama takes raw images or the processor's outputs (pixel_values with aspect_ratio_ids "
                             "and aspect_ratio_mask), not a bare pixel array")
        else:
            images = list(entry) if isinstance(entry, (list, tuple)) else [entry]
            n = len(images)
        have = int(np.sum(tokens == v.image_token_id))
        if have != n:
            raise ValueError(f"the prompt holds {have} image tokens (id {v.image_token_id}) for {n} images: each "
                             f"image needs its <|image|> token")
        if max_images is not None and n > max_images:
            raise ValueError(f"{n} images, but the cross-attention caches keep {max_images} per request "
                             f"(max_images_per_prompt; tt-metal serves 1)")
        if not processed:
            _, a = multimodal.prepare(self.model, [tokens.tolist()], [images])
        if "cross_attention_mask" not in a:
            tiles = np.asarray(a["aspect_ratio_mask"])[0].sum(-1).tolist()
            a["cross_attention_mask"] = multimodal.cross_attention_mask([tokens.tolist()], [tiles], v.image_token_id,
                                                                        v.max_tiles)
        arrays, _ = vision.inputs(self.config, tokens[None], a)
        states = _cross_states(v, self.model.params["vision"], arrays["pixel_values"], arrays["aspect_ratio_ids"],
                               arrays["aspect_ratio_mask"])
        return np.asarray(states), np.asarray(a["cross_attention_mask"])[0].reshape(tokens.shape[0], -1)
