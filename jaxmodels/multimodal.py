"""Prompts with images: each family's image processor (`jaxmodels.images`, equal to HF's) and the placeholder
expansion its HF processor does, so that `jm.generate`, the CLI and the server feed a vision model exactly as
`transformers` would.

A prompt marks each image with its family's placeholder (Gemma3 `<start_of_image>`, Mistral3 `[IMG]`, EXAONE 4.5
`<|image_pad|>`, DeepSeek V4.1 `<｜deepseek_image｜>`, the token of its image_token_id); the chat template writes them
for `{"type": "image"}` content parts. A prompt with no placeholder gets one per image in front of its text.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmodels import files, images as img

SETTINGS_FILE = "preprocessor_config.json"
PROCESSOR = {"siglip": "gemma3", "pixtral": "pixtral", "window_vit": "qwen2_vl"}


def read_settings(directory: str | Path) -> dict | None:
    """The image processor settings of a checkpoint or converted directory (its preprocessor_config.json)."""
    if not Path(directory).is_dir() or (path := files.find(directory, SETTINGS_FILE)) is None:
        return None
    return files.read_json(path, files.MAX_METADATA_BYTES)


def _token(tok, i: int | None, what: str) -> str:
    s = None if i is None else tok.tok.id_to_token(i)
    if s is None:
        raise ValueError(f"the tokenizer has no {what} token (id {i})")
    return s


def _named(tok, s: str) -> str:
    if tok.tok.token_to_id(s) is None:
        raise ValueError(f"the tokenizer has no {s} token")
    return s


def placeholder(model) -> str:
    """The text that marks an image in a prompt."""
    v = model.config.vision
    return _token(model.tokenizer, v.begin_token_id if v.kind == "siglip" else v.image_token_id, "image placeholder")


def load(model, x, where: str = "image 0"):
    """One image (as `process` takes them) opened as the model's processor opens it: DeepSeek V4.1 as its reference
    (`images.load_image_plain`), the others as HF's `load_image`. ValueError starting with `where`."""
    v = model.config.vision
    return (img.load_image_plain if v is not None and v.kind == "deepseek_vit" else img.load_image)(x, where)


def process(model, images: list) -> dict:
    """Images (PIL images, paths, bytes, data: URIs, arrays) -> the model's processor outputs (HF names, numpy)."""
    v, settings = model.config.vision, dict(getattr(model, "preprocessor", None) or {})
    if v.kind == "deepseek_vit":  # no HF processor: the reference's own, its settings in the model config
        pil = [img.load_image_plain(x, f"image {i}") for i, x in enumerate(images)]
        return img.deepseek_v41(pil, v.patch_size, v.merge_size, v.max_image_tokens, v.min_pixels, v.max_wh_ratio)
    pil = [img.load_image(x, f"image {i}") for i, x in enumerate(images)]
    if v.kind == "siglip":
        settings.setdefault("size", {"height": v.image_size, "width": v.image_size})
        return img.gemma3(pil, settings)
    if v.kind == "pixtral":
        settings.setdefault("size", {"longest_edge": v.image_size})
        return img.pixtral(pil, settings, v.patch_size, v.merge_size)
    settings.setdefault("patch_size", v.patch_size)
    settings.setdefault("merge_size", v.merge_size)
    settings.setdefault("temporal_patch_size", v.temporal_patch_size)
    return img.qwen2_vl(pil, settings)


def _expansion(model, out: dict, i: int) -> str:
    """The text image i of `out` (process's result) stands for, as the family's HF processor writes it."""
    v, tok = model.config.vision, model.tokenizer
    if v.kind == "siglip":
        seq = (f"\n\n{_token(tok, v.begin_token_id, 'begin-of-image')}{_token(tok, v.image_token_id, 'image') * v.tokens_per_image}"
               f"{_token(tok, v.end_token_id, 'end-of-image')}\n\n")
        crops = int(out.get("num_crops", np.zeros(i + 1, int))[i])
        if not crops:
            return seq
        return f"Here is the original image {seq} and here are some crops to help you see better " + " ".join([seq] * crops)
    if v.kind == "pixtral":
        rows, cols = (int(x) for x in out["token_grid"][i])
        row = _token(tok, v.image_token_id, "image") * cols + _named(tok, "[IMG_BREAK]")
        return (row * rows)[: -len("[IMG_BREAK]")] + _named(tok, "[IMG_END]")
    n = int(np.prod(out["image_grid_thw"][i])) // v.merge_size ** 2
    return _token(tok, v.image_token_id, "image") * n


def prepare(model, prompts: list, images: list[list], templated: bool = False) -> tuple[list[list[int]], dict]:
    """(each prompt's token ids with its image placeholders expanded, the processed images of all prompts in
    order by their HF names). A prompt of token ids is kept as it is: it must hold its images' tokens already.
    templated: the texts are chat-templated already (they hold any BOS)."""
    cfg = model.config
    if cfg.vision is None:
        raise ValueError(f"this {cfg.family} model has no vision tower: it takes no images")
    if len(images) != len(prompts):
        raise ValueError(f"images: one list per prompt ({len(prompts)}), got {len(images)}")
    tok = model.tokenizer
    if any(isinstance(p, str) for p in prompts) and tok is None:
        raise ValueError("this model has no tokenizer: pass token ids")
    if cfg.vision.kind == "mllama":
        return _prepare_mllama(model, prompts, images, templated)
    if cfg.vision.kind == "deepseek_vit":
        return _prepare_deepseek(model, prompts, images, templated)
    mark = placeholder(model) if tok is not None else None
    flat = [x for row in images for x in row]
    out = process(model, flat) if flat else {}
    ids, k = [], 0
    for j, (text, row) in enumerate(zip(prompts, images)):
        if isinstance(text, str):
            ids.append(tok.encode(_expand(model, out, k, text, row, mark, j, templated),
                                  add_special_tokens=not templated))
        else:  # token ids hold the image tokens already (the forward checks the count)
            ids.append(text)
        k += len(row)
    return ids, {name: out[name] for name in ("pixel_values", "image_sizes", "image_grid_thw") if name in out}


def _expand(model, out: dict, k: int, text: str, row: list, mark: str, j: int, templated: bool) -> str:
    """Prompt j's text with its images (k, k+1, ... of `out`) expanded; placeholders put in front if it has none
    (not into a chat-templated text: a template that writes none is an error)."""
    n = text.count(mark)
    if n == 0 and row and not templated:
        text, n = mark * len(row) + text, len(row)
    if n != len(row):
        raise ValueError(f"prompt {j} has {n} image placeholders ({mark}) for {len(row)} images")
    parts = text.split(mark)
    return parts[0] + "".join(_expansion(model, out, k + i) + part for i, part in enumerate(parts[1:]))


def _prepare_deepseek(model, prompts, images, templated: bool):
    """DeepSeek V4.1 (the reference's `prepare_vl_inputs`): each prompt is tokenized with one image token per image
    and each of those tokens is then replaced, in token ids, by the image's whole span (rows * (columns + 1) + 2
    copies of the image token id). A prompt of ids may hold one image token per image (expanded here) or the
    expanded spans already (kept)."""
    v, tok = model.config.vision, model.tokenizer
    flat = [x for row in images for x in row]
    out = process(model, flat) if flat else {}
    spans = [int(n) for n in out.get("num_image_tokens", ())]
    ids, k = [], 0
    for j, (p, row) in enumerate(zip(prompts, images)):
        if isinstance(p, str):
            mark = placeholder(model)
            if row and mark not in p and not templated:
                p = mark * len(row) + p
            p = tok.encode(p, add_special_tokens=not templated)
        p = list(p)
        n = p.count(v.image_token_id)
        mine = spans[k:k + len(row)]
        if n == len(row):  # one placeholder per image: expand each to its span
            it = iter(mine)
            p = [x for t in p for x in ([t] * next(it) if t == v.image_token_id else [t])]
        elif n != sum(mine):
            raise ValueError(f"prompt {j} has {n} image tokens ({v.image_token_id}) for {len(row)} images: one per "
                             f"image, or their {sum(mine)} span tokens")
        ids.append(p)
        k += len(row)
    return ids, {name: out[name] for name in ("pixel_values", "image_grid_hw") if name in out}


def _prepare_mllama(model, prompts, images, templated: bool):
    """Mllama: one <|image|> token per image, nothing expanded; images go by row, and the cross-attention mask
    says which tiles each token sees (the processor's rules: from an image's token to the next image's, the
    last image and runs of adjacent ones to the end)."""
    v, tok = model.config.vision, model.tokenizer
    settings = dict(getattr(model, "preprocessor", None) or {})
    settings.setdefault("size", {"height": v.image_size, "width": v.image_size})
    settings.setdefault("max_image_tiles", v.max_tiles)
    rows = [[img.load_image(x, f"prompt {j} image {i}") for i, x in enumerate(r)] for j, r in enumerate(images)]
    ids = []
    for j, (p, row) in enumerate(zip(prompts, rows)):
        if not isinstance(p, str):
            ids.append(list(p))
            if (n := ids[-1].count(v.image_token_id)) != len(row):
                raise ValueError(f"prompt {j} has {n} image tokens ({v.image_token_id}) for {len(row)} images")
            continue
        mark = _token(tok, v.image_token_id, "<|image|>")
        if row and mark not in p and not templated:
            p = mark * len(row) + p
        bos = tok.bos_token
        if not templated and bos and bos not in p:  # HF's build_string_from_input: leading images before BOS
            lead = 0
            while p.startswith(mark, lead):
                lead += len(mark)
            p = p[:lead] + bos + p[lead:]
        ids.append(tok.encode(p, add_special_tokens=False))
        if (n := ids[-1].count(v.image_token_id)) != len(row):
            raise ValueError(f"prompt {j} has {n} image tokens for {len(row)} images")
    if not any(rows):
        return ids, {}
    out = img.mllama(rows, settings)
    return ids, {"pixel_values": out["pixel_values"], "aspect_ratio_ids": out["aspect_ratio_ids"],
                 "aspect_ratio_mask": out["aspect_ratio_mask"],
                 "cross_attention_mask": cross_attention_mask(ids, out["num_tiles"], v.image_token_id,
                                                              out["pixel_values"].shape[2])}


def cross_attention_mask(ids: list[list[int]], num_tiles: list[list[int]], image_token_id: int,
                         max_tiles: int) -> np.ndarray:
    """Mllama's [B, longest prompt, images, tiles] 0/1 mask: token t of row b sees tile k of image i (HF's
    get_cross_attention_token_mask + convert_sparse_cross_attention_mask_to_dense)."""
    B, T = len(ids), max(map(len, ids))
    out = np.zeros((B, T, max(map(len, num_tiles)), max_tiles), np.int64)
    for b, (row, tiles) in enumerate(zip(ids, num_tiles)):
        at = [t for t, x in enumerate(row) if x == image_token_id]
        ends = at[1:] + [len(row)]
        for i in range(len(at) - 2, -1, -1):  # adjacent image tokens all see what the last of them sees
            if ends[i] == at[i] + 1:
                ends[i] = ends[i + 1]
        for i, (start, end) in enumerate(zip(at, ends)):
            if i < len(tiles):
                out[b, start:end, i, :tiles[i]] = 1
    return out
