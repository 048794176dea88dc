"""Image input for the vision families, in NumPy + Pillow so serving needs no torch.

`load_image` turns whatever a caller holds into an upright RGB `PIL.Image`. One function per HF image processor
then reproduces transformers 5.24's PIL backend (`Gemma3ImageProcessorPil`, `PixtralImageProcessorPil`,
`MllamaImageProcessorPil`, `Qwen2VLImageProcessorPil`) bit for bit: Pillow resizes the uint8 image, rescale runs in
float64 and is cast to float32, normalize runs in float32, in HF's order. Each returns HF's output names plus what a
prompt needs to expand its image placeholders.

DeepSeek V4.1 has no HF processor: `deepseek_v41` follows its reference `inference/image_processor.py` (and
`load_image_plain` opens images as that file does).
"""
from __future__ import annotations

import base64
import binascii
import io
import math
import numbers
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

__all__ = ["load_image", "load_image_plain", "gemma3", "pixtral", "mllama", "qwen2_vl", "deepseek_v41", "PROCESSORS"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


# ---------------------------------------------------------------------------------------------- loading

def load_image(x, where: str = "image 0") -> Image.Image:
    """An RGB image from a PIL image, a file path, encoded bytes, a base64 `data:image/...` URI or a channels-last
    array (HxW, HxWx1, HxWx3, HxWx4; uint8 or float in [0, 1]).

    The EXIF orientation is applied (as HF's `load_image` does) and transparency is composited on white (as HF's
    `convert_to_rgb` does). Every failure is a one-line `ValueError` that starts with `where`.
    """
    if isinstance(x, Image.Image):
        return _to_rgb(x, where)
    if isinstance(x, np.ndarray):
        return _from_array(x, where)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return _decode(bytes(x), where)
    if isinstance(x, str):
        if x[:5].lower() == "data:":
            return _decode(_data_uri(x, where), where)
        if m := _URL.match(x):
            if m.group(1).lower() in ("http", "https"):
                raise ValueError(f"{where}: {_short(x)} is a URL; no network access at run time; "
                                 "pass the image bytes or a data: URI")
            raise ValueError(f"{where}: unsupported URL scheme {m.group(1)!r}; pass a file path, the image bytes "
                             "or a data: URI")
    if isinstance(x, (str, os.PathLike)):
        return _decode(_read_file(x, where), where)
    raise ValueError(f"{where}: unsupported image type {type(x).__name__}; pass a PIL image, a file path, bytes, "
                     "a data: URI or a numpy array")


def _to_rgb(image: Image.Image, where: str) -> Image.Image:
    """HF `convert_to_rgb` for PIL images: a mode with alpha, or a palette/colour-key transparency, is laid over
    opaque white; every other mode (L, P, CMYK, I, ...) is Pillow's `convert("RGB")`."""
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where}: zero-size image ({image.width}x{image.height})")
    try:
        image = ImageOps.exif_transpose(image)  # loads the pixels too, so decode errors surface here
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            white = Image.new("RGBA", image.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
        return image.convert("RGB")
    except Exception as e:  # Pillow raises OSError, SyntaxError, ValueError, struct.error, ... on hostile files
        raise ValueError(f"{where}: cannot decode the image ({_one_line(e)})") from e


def _from_array(a: np.ndarray, where: str) -> Image.Image:
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if not (a.ndim == 2 or (a.ndim == 3 and a.shape[-1] in (3, 4))):
        raise ValueError(f"{where}: array shape {a.shape} is not HxW, HxWx3 or HxWx4 (channels last)")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{where}: zero-size image (array shape {a.shape})")
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            raise ValueError(f"{where}: float pixel values must be finite and in [0, 1], found NaN or inf")
        if a.min() < 0 or a.max() > 1:
            raise ValueError(f"{where}: float pixel values must be finite and in [0, 1], got [{a.min()}, {a.max()}]")
        a = np.rint(a.astype(np.float64) * 255).astype(np.uint8)  # rint, so uint8 -> /255 -> here is lossless
    elif a.dtype != np.uint8:
        raise ValueError(f"{where}: unsupported array dtype {a.dtype}; pass uint8, or float in [0, 1]")
    if a.ndim == 3 and a.shape[-1] == 4:
        # HF convert_to_rgb on arrays: float64 blend onto white, then round
        alpha = a[..., 3:] / 255
        a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a)).convert("RGB")


def _decode(data: bytes, where: str) -> Image.Image:
    if not data:
        raise ValueError(f"{where}: empty image data")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ValueError(f"{where}: not a readable image (no image format Pillow knows)") from None
    except Exception as e:
        raise ValueError(f"{where}: not a readable image ({_one_line(e)})") from e
    return _to_rgb(image, where)


def _data_uri(uri: str, where: str) -> bytes:
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ValueError(f"{where}: malformed data: URI (no ',' before the payload)")
    media, *params = header[5:].split(";")
    if not media.lower().startswith("image/"):
        raise ValueError(f"{where}: data: URI media type {media!r} is not image/*")
    if "base64" not in (p.strip().lower() for p in params):
        raise ValueError(f"{where}: only base64 data: URIs are supported (data:image/...;base64,...)")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except binascii.Error as e:
        raise ValueError(f"{where}: data: URI payload is not valid base64 ({e})") from e


def _read_file(path: str | os.PathLike, where: str) -> bytes:
    shown = _short(os.fspath(path))
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file: {shown!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{where}: {shown!r} is a directory, not an image file") from None
    except (OSError, ValueError) as e:  # ValueError: an embedded NUL byte
        raise ValueError(f"{where}: cannot read {shown!r} ({_one_line(e)})") from e


def _short(s: str, limit: int = 80) -> str:
    """Keep a megabyte of base64 passed as a "path" out of the error message."""
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s)} chars)"


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------------------------------------- settings

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN / _STD in transformers.image_utils
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN / _STD
_BILINEAR, _BICUBIC = int(Image.Resampling.BILINEAR), int(Image.Resampling.BICUBIC)
_PIXEL_DEFAULTS = {"do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True}


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class _Pixels:
    """uint8 HWC -> float32 HWC as HF's PIL backend does: `rescale` multiplies in float64 and casts to float32,
    `normalize` subtracts and divides in float32 (an un-rescaled uint8 image is cast to float32 first)."""

    rescale_factor: float | None
    mean: np.ndarray | None  # float32 [3]
    std: np.ndarray | None

    def __call__(self, hwc: np.ndarray) -> np.ndarray:
        x = hwc
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32, copy=False)
        if self.mean is not None:
            x = (x - self.mean) / self.std
        return x


class _Settings:
    """A checkpoint's preprocessor_config.json over the HF class defaults. A missing or null key takes the default
    (HF's `_set_attributes` treats None the same way); keys the processor does not read are ignored; a bad value
    is a ValueError naming the processor, the key and the value."""

    def __init__(self, processor: str, settings: Mapping, defaults: Mapping):
        if not isinstance(settings, Mapping):
            raise ValueError(f"{processor} settings must be a dict (preprocessor_config.json), "
                             f"got {type(settings).__name__}")
        self.processor = processor
        self.values = {**_PIXEL_DEFAULTS, **defaults}
        self.values.update({k: v for k, v in settings.items() if k in self.values and v is not None})

    def bad(self, key: str, want: str) -> ValueError:
        return ValueError(f"{self.processor} settings: {key} must be {want}, got {self.values[key]!r}")

    def flag(self, key: str) -> bool:
        if not isinstance(self.values[key], (bool, np.bool_)):
            raise self.bad(key, "true or false")
        return bool(self.values[key])

    def integer(self, key: str) -> int:
        v = self.values[key]
        if not _is_int(v) or v < 1:
            raise self.bad(key, "an integer >= 1")
        return int(v)

    def positive(self, key: str) -> float:
        v = self.values[key]
        if not _is_real(v) or not 0 < v < math.inf:
            raise self.bad(key, "a finite number > 0")
        return float(v)

    def resample(self) -> int:
        """A PIL filter id (NEAREST 0, LANCZOS 1, BILINEAR 2, BICUBIC 3, BOX 4, HAMMING 5), as the json stores it."""
        if not _is_int(self.values["resample"]) or not 0 <= self.values["resample"] <= 5:
            raise self.bad("resample", "a PIL filter id 0..5")
        return int(self.values["resample"])

    def channels(self, key: str, positive: bool) -> np.ndarray:
        v = self.values[key]
        values = [v] * 3 if _is_real(v) else list(v) if isinstance(v, (list, tuple)) else []
        ok = len(values) == 3 and all(_is_real(c) and math.isfinite(c) and (c > 0 or not positive) for c in values)
        if not ok:
            raise self.bad(key, f"one {'positive ' if positive else ''}number or 3 of them (R, G, B)")
        return np.asarray(values, np.float32)

    def pixels(self) -> _Pixels:
        rescale = self.positive("rescale_factor") if self.flag("do_rescale") else None
        if not self.flag("do_normalize"):
            return _Pixels(rescale, None, None)
        return _Pixels(rescale, self.channels("image_mean", positive=False), self.channels("image_std", positive=True))

    def size(self, *shapes: tuple[str, ...]) -> dict[str, int]:
        """`size` as HF's `get_size_dict` reads it for a square-default processor (an int is height = width, a
        pair is (height, width)), restricted to the key sets this processor's resize understands."""
        v = self.values["size"]
        if _is_int(v):
            v = {"height": v, "width": v}
        elif isinstance(v, (list, tuple)) and len(v) == 2:
            v = {"height": v[0], "width": v[1]}
        if (not isinstance(v, Mapping) or tuple(sorted(v)) not in [tuple(sorted(s)) for s in shapes]
                or not all(_is_int(x) and x >= 1 for x in v.values())):
            raise self.bad("size", " or ".join("{" + ", ".join(f"{k!r}: int >= 1" for k in s) + "}" for s in shapes))
        return {k: int(x) for k, x in v.items()}


def _rgb_images(images, processor: str, label: str = "image {}", allow_empty: bool = False) -> list[Image.Image]:
    if isinstance(images, Image.Image) or not isinstance(images, Sequence):
        raise ValueError(f"{processor}: expected a list of images, got {type(images).__name__}")
    if not images and not allow_empty:
        raise ValueError(f"{processor}: no images")
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image) or image.mode != "RGB":
            got = f"a {image.mode} image" if isinstance(image, Image.Image) else type(image).__name__
            raise ValueError(f"{processor}: {label.format(i)} is {got}; pass it through load_image first")
        if image.width == 0 or image.height == 0:
            raise ValueError(f"{processor}: {label.format(i)} has zero size {image.size}")
    return list(images)


def _resized(image: Image.Image | np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """HF's PIL-backend resize: Pillow on the uint8 image, (height, width) in, HWC uint8 out."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.ascontiguousarray(image))
    return np.asarray(image.resize((width, height), resample=resample))


def _chw(hwc: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(hwc.transpose(2, 0, 1))


# ---------------------------------------------------------------------------------------------- Gemma3

_GEMMA3_DEFAULTS = {
    "size": {"height": 224, "width": 224}, "resample": _BILINEAR, "image_mean": _HALF, "image_std": _HALF,
    # the image processor's own defaults are None; these are Gemma3Processor.images_kwargs
    "do_pan_and_scan": False, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def gemma3(images: Sequence[Image.Image], settings: Mapping) -> dict[str, np.ndarray]:
    """Gemma3ImageProcessorPil as Gemma3Processor calls it: every image is stretched to size (aspect ratio not
    kept). With do_pan_and_scan, a wide or tall image is followed by its crops, each resized the same way.

    Gemma3Processor passes its own pan-and-scan defaults (off, 256, 4, 1.2) as call arguments, which override
    the json's; here the settings keys play the part of those call arguments, and missing or null ones take them.

    Returns pixel_values [N, 3, H, W] float32 (image 0, its crops, image 1, ...) and num_crops [n_images] int64:
    image i takes one soft-token block, plus num_crops[i] more when it has crops.
    """
    s = _Settings("gemma3", settings, _GEMMA3_DEFAULTS)
    images = _rgb_images(images, "gemma3")
    size = s.size(("height", "width"))
    do_resize, resample, pixels = s.flag("do_resize"), s.resample(), s.pixels()
    pan = s.flag("do_pan_and_scan")
    crop_args = (s.integer("pan_and_scan_min_crop_size"), s.integer("pan_and_scan_max_num_crops"),
                 s.positive("pan_and_scan_min_ratio_to_activate"))
    out, num_crops = [], []
    for image in images:
        hwc = np.asarray(image)
        crops = _pan_and_scan(hwc, *crop_args) if pan else []
        num_crops.append(len(crops))
        for part in [hwc, *crops]:
            if do_resize:
                part = _resized(part, size["height"], size["width"], resample)
            out.append(_chw(pixels(part)))
    if len({x.shape for x in out}) > 1:
        raise ValueError(f"gemma3: with do_resize false the images must share one size, got "
                         f"{sorted({x.shape[1:] for x in out})}")
    return {"pixel_values": np.stack(out), "num_crops": np.asarray(num_crops, np.int64)}


def _pan_and_scan(hwc: np.ndarray, min_crop: int, max_crops: int, min_ratio: float) -> list[np.ndarray]:
    """HF's `pan_and_scan`: 2..max_crops equal crops along the long side when it is at least min_ratio times the
    short one; none if a crop would be narrower than min_crop. The last crop is clipped at the edge."""
    height, width = hwc.shape[:2]
    landscape = width >= height
    long, short = (width, height) if landscape else (height, width)
    if long / short < min_ratio:
        return []
    n = min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop)))
    n = min(max_crops, max(2, n))
    n_h, n_w = (1, n) if landscape else (n, 1)
    crop_w, crop_h = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
    if min(crop_w, crop_h) < min_crop:
        return []
    return [hwc[i * crop_h:(i + 1) * crop_h, j * crop_w:(j + 1) * crop_w] for i in range(n_h) for j in range(n_w)]


# ---------------------------------------------------------------------------------------------- Pixtral

_PIXTRAL_DEFAULTS = {"size": {"longest_edge": 1024}, "resample": _BICUBIC, "image_mean": _CLIP_MEAN,
                     "image_std": _CLIP_STD, "do_pad": True, "do_center_crop": False}


def pixtral(images: Sequence[Image.Image], settings: Mapping, patch_size: int,
            merge_size: int) -> dict[str, np.ndarray]:
    """PixtralImageProcessorPil as PixtralProcessor (and so Mistral3) calls it: with patch_size * merge_size as
    the processor's patch, which overrides the `patch_size` in settings.

    An image larger than size is scaled down (floor) to fit, then stretched up to the next multiple of the
    patch on each side; the batch is zero-padded bottom/right after normalization. Returns pixel_values
    [N, 3, Hmax, Wmax] float32, image_sizes [N, 2] int64 (the resized H, W) and token_grid [N, 2] int64: image i
    is token_grid[i, 0] rows of token_grid[i, 1] [IMG] tokens, each row ended by [IMG_BREAK] except the last,
    which ends with [IMG_END].
    """
    s = _Settings("pixtral", settings, _PIXTRAL_DEFAULTS)
    images = _rgb_images(images, "pixtral")
    for name, value in (("patch_size", patch_size), ("merge_size", merge_size)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"pixtral: {name} must be an integer >= 1, got {value!r}")
    patch = patch_size * merge_size
    size = s.size(("longest_edge",), ("height", "width"))
    max_hw = (size["longest_edge"],) * 2 if "longest_edge" in size else (size["height"], size["width"])
    do_resize, resample, pixels = s.flag("do_resize"), s.resample(), s.pixels()
    if s.flag("do_center_crop"):
        raise NotImplementedError("pixtral: do_center_crop is not implemented")
    if not s.flag("do_pad"):
        raise NotImplementedError("pixtral: do_pad false (a ragged batch) is not implemented")
    out = []
    for i, image in enumerate(images):
        hwc = np.asarray(image)
        if do_resize:
            h, w = _pixtral_size(image.height, image.width, *max_hw, patch)
            if h == 0 or w == 0:
                raise ValueError(f"pixtral: image {i} ({image.width}x{image.height}) is too thin to fit in "
                                 f"{max_hw[0]}x{max_hw[1]}: it would resize to {w}x{h}")
            hwc = _resized(image, h, w, resample)
        out.append(_chw(pixels(hwc)))
    sizes = np.asarray([x.shape[1:] for x in out], np.int64)
    pixel_values = np.zeros((len(out), 3, *sizes.max(0)), np.float32)
    for padded, x in zip(pixel_values, out):
        padded[:, :x.shape[1], :x.shape[2]] = x
    return {"pixel_values": pixel_values, "image_sizes": sizes, "token_grid": sizes // patch}


def _pixtral_size(height: int, width: int, max_height: int, max_width: int, patch: int) -> tuple[int, int]:
    """HF pixtral `get_resize_output_image_size`: floor-downscale to fit, then round each side up to the patch."""
    ratio = max(height / max_height, width / max_width)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // patch + 1) * patch, ((width - 1) // patch + 1) * patch


# ---------------------------------------------------------------------------------------------- Mllama

_MLLAMA_DEFAULTS = {"size": {"height": 224, "width": 224}, "resample": _BILINEAR, "image_mean": _HALF,
                    "image_std": _HALF, "do_pad": True, "max_image_tiles": 4}


def mllama(images_per_row: Sequence[Sequence[Image.Image]], settings: Mapping) -> dict:
    """MllamaImageProcessorPil: each image picks a canvas of n_h x n_w tiles, is resized to fit it (never
    upscaled past what the canvas needs), zero-padded in uint8 (so the pad normalizes to -mean/std), normalized
    and cut into row-major tiles. Rows may hold different numbers of images (zero included).

    Returns pixel_values [B, N_max, max_image_tiles, 3, S, S] float32 (missing tiles and images are 0),
    aspect_ratio_ids [B, N_max] int64 (1 + the arrangement's index; 0 for no image), aspect_ratio_mask
    [B, N_max, max_image_tiles] int64 (tile 0 is always 1, as in HF) and num_tiles (list of lists). Each image
    is one <|image|> token; num_tiles feeds the cross-attention mask.
    """
    s = _Settings("mllama", settings, _MLLAMA_DEFAULTS)
    if isinstance(images_per_row, Image.Image) or not isinstance(images_per_row, Sequence):
        raise ValueError(f"mllama: expected a list of rows (lists of images), got {type(images_per_row).__name__}")
    for r, row in enumerate(images_per_row):
        if isinstance(row, Image.Image) or not isinstance(row, Sequence):
            raise ValueError(f"mllama: row {r}: expected a list of images, got {type(row).__name__}")
    rows = [_rgb_images(row, "mllama", f"row {r} image {{}}", allow_empty=True) for r, row in enumerate(images_per_row)]
    if not any(rows):
        raise ValueError("mllama: no images in any row")
    size = s.size(("height", "width"))
    if size["height"] != size["width"]:
        raise s.bad("size", "square (height == width)")
    if not s.flag("do_resize") or not s.flag("do_pad"):
        raise ValueError("mllama settings: do_resize and do_pad must be true (MllamaImageProcessor refuses false)")
    tile, max_tiles, resample, pixels = size["height"], s.integer("max_image_tiles"), s.resample(), s.pixels()
    arrangements = _tile_arrangements(max_tiles)
    n_max = max(len(row) for row in rows)
    pixel_values = np.zeros((len(rows), n_max, max_tiles, 3, tile, tile), np.float32)
    ids = np.zeros((len(rows), n_max), np.int64)
    mask = np.zeros((len(rows), n_max, max_tiles), np.int64)
    mask[:, :, 0] = 1
    num_tiles = [[] for _ in rows]
    for r, row in enumerate(rows):
        for k, image in enumerate(row):
            n_h, n_w = _mllama_canvas(image.height, image.width, arrangements, tile)
            h, w = _fit_to_canvas(image.height, image.width, n_h * tile, n_w * tile, tile)
            canvas = np.zeros((n_h * tile, n_w * tile, 3), np.uint8)
            canvas[:h, :w] = _resized(image, h, w, resample)
            tiles = pixels(canvas).reshape(n_h, tile, n_w, tile, 3).transpose(0, 2, 4, 1, 3)
            pixel_values[r, k, :n_h * n_w] = tiles.reshape(n_h * n_w, 3, tile, tile)
            ids[r, k] = arrangements.index((n_h, n_w)) + 1
            mask[r, k, :n_h * n_w] = 1
            num_tiles[r].append(n_h * n_w)
    return {"pixel_values": pixel_values, "aspect_ratio_ids": ids, "aspect_ratio_mask": mask, "num_tiles": num_tiles}


def _tile_arrangements(max_tiles: int) -> list[tuple[int, int]]:
    """(n_h, n_w) with n_h * n_w <= max_tiles, in HF's order (HF calls the pair (width, height) but uses the first
    as the canvas height)."""
    return [(a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1) if a * b <= max_tiles]


def _mllama_canvas(height: int, width: int, arrangements: list[tuple[int, int]], tile: int) -> tuple[int, int]:
    """HF `get_optimal_tiled_canvas`: the smallest upscale >= 1 if any canvas allows one, else the largest
    downscale; ties go to the smallest canvas area, then to the first in the list."""
    scales = [min(n_h * tile / height, n_w * tile / width) for n_h, n_w in arrangements]
    up = [x for x in scales if x >= 1]
    best = min(up) if up else max(scales)
    chosen = [a for a, x in zip(arrangements, scales) if x == best]
    return min(chosen, key=lambda a: a[0] * a[1])


def _fit_to_canvas(height: int, width: int, canvas_h: int, canvas_w: int, tile: int) -> tuple[int, int]:
    """HF `get_image_size_fit_to_canvas`: each side clipped to [tile, canvas], aspect ratio kept by the tighter
    side, floor, at least 1."""
    target_w, target_h = min(max(width, tile), canvas_w), min(max(height, tile), canvas_h)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


# ---------------------------------------------------------------------------------------------- Qwen2-VL

_QWEN2_VL_DEFAULTS = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, "resample": _BICUBIC,
                      "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "min_pixels": None, "max_pixels": None,
                      "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}


def qwen2_vl(images: Sequence[Image.Image], settings: Mapping) -> dict[str, np.ndarray]:
    """Qwen2VLImageProcessorPil, the image processor EXAONE 4.5 (and Qwen2/2.5-VL) use: `smart_resize` to a
    multiple of patch * merge with min_pixels <= H*W <= max_pixels, then patches in merge x merge block-major order,
    each flattened as (C, T, p, p) with the still image repeated over T.

    Returns pixel_values [sum of h*w, C*T*p*p] float32, image_grid_thw [N, 3] int64 = (1, h, w) in patches and
    num_image_tokens [N] int64 = h*w / merge_size**2 placeholder tokens per image.
    """
    s = _Settings("qwen2_vl", settings, _QWEN2_VL_DEFAULTS)
    images = _rgb_images(images, "qwen2_vl")
    min_pixels, max_pixels = _qwen_pixel_range(s)
    patch, merge, temporal = s.integer("patch_size"), s.integer("merge_size"), s.integer("temporal_patch_size")
    do_resize, resample, pixels = s.flag("do_resize"), s.resample(), s.pixels()
    factor = patch * merge
    out, grids = [], []
    for i, image in enumerate(images):
        hwc = np.asarray(image)
        if do_resize:
            h, w = _smart_resize(image.height, image.width, factor, min_pixels, max_pixels, f"image {i}")
            hwc = _resized(image, h, w, resample)
        elif image.height % factor or image.width % factor:
            raise ValueError(f"qwen2_vl: with do_resize false, image {i} ({image.width}x{image.height}) must have "
                             f"sides divisible by patch_size * merge_size = {factor}")
        x = pixels(hwc)
        gh, gw = x.shape[0] // patch, x.shape[1] // patch
        x = x.reshape(gh // merge, merge, patch, gw // merge, merge, patch, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
        out.append(x.reshape(gh * gw, 3 * temporal * patch * patch))
        grids.append((1, gh, gw))
    grid_thw = np.asarray(grids, np.int64)
    return {"pixel_values": np.concatenate(out), "image_grid_thw": grid_thw,
            "num_image_tokens": grid_thw.prod(-1) // merge**2}


def _qwen_pixel_range(s: _Settings) -> tuple[int, int]:
    """(min_pixels, max_pixels): size's shortest_edge / longest_edge, overridden by top-level min_pixels /
    max_pixels as Qwen2VLImageProcessor.__init__ does."""
    size = s.values["size"]
    if not isinstance(size, Mapping):
        raise s.bad("size", "{'shortest_edge': min_pixels, 'longest_edge': max_pixels}")
    size = dict(size)
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if s.values[key] is not None:
            size[edge] = s.integer(key)
            size.pop(key, None)
    if set(size) != {"shortest_edge", "longest_edge"} or not all(_is_int(v) and v >= 1 for v in size.values()):
        raise ValueError(f"qwen2_vl settings: size must be {{'shortest_edge': min_pixels, 'longest_edge': "
                         f"max_pixels}} (or give min_pixels and max_pixels), got {size!r}")
    return int(size["shortest_edge"]), int(size["longest_edge"])


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, where: str):
    """HF qwen2_vl `smart_resize`: round (Python's, half to even) each side to the factor, then rescale both
    sides by one factor into [min_pixels, max_pixels] (floor when shrinking, ceil when growing)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"qwen2_vl: {where} ({width}x{height}) has an aspect ratio above 200, which Qwen2-VL refuses")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


# ---------------------------------------------------------------------------------------------- DeepSeek V4.1

def load_image_plain(x, where: str = "image 0") -> Image.Image:
    """An RGB image as DeepSeek V4.1's reference processor opens one (upstream `inference/image_processor.py`
    `load_image`: Pillow's `convert("RGB")`): no EXIF rotation, and an alpha channel dropped rather than laid over
    white as HF's `load_image` does. The same sources as `load_image` (PIL images, paths, bytes, data: URIs,
    channels-last arrays) and the same one-line ValueErrors starting with `where`."""
    if isinstance(x, np.ndarray):
        if x.ndim == 3 and x.shape[-1] == 4:
            x = x[..., :3]  # convert("RGB") of an RGBA image keeps the colour channels as they are
        return _from_array(x, where)
    if isinstance(x, (bytes, bytearray, memoryview)):
        data = bytes(x)
    elif isinstance(x, str) and x[:5].lower() == "data:":
        data = _data_uri(x, where)
    elif isinstance(x, str) and _URL.match(x):
        return load_image(x, where)  # refused there, with the reason
    elif isinstance(x, (str, os.PathLike)):
        data = _read_file(x, where)
    elif isinstance(x, Image.Image):
        return _plain_rgb(x, where)
    else:
        return load_image(x, where)  # an unsupported type: its error
    if not data:
        raise ValueError(f"{where}: empty image data")
    try:
        image = Image.open(io.BytesIO(data))
    except Image.UnidentifiedImageError:
        raise ValueError(f"{where}: not a readable image (no image format Pillow knows)") from None
    except Exception as e:
        raise ValueError(f"{where}: not a readable image ({_one_line(e)})") from e
    return _plain_rgb(image, where)


def _plain_rgb(image: Image.Image, where: str) -> Image.Image:
    if image.width == 0 or image.height == 0:
        raise ValueError(f"{where}: zero-size image ({image.width}x{image.height})")
    try:
        return image.convert("RGB")  # loads the pixels too, so decode errors surface here
    except Exception as e:
        raise ValueError(f"{where}: cannot decode the image ({_one_line(e)})") from e


def _v41_grid(height: int, width: int, patch: int, r: int) -> tuple[int, int]:
    """The aligner's token grid for a patch-multiple pixel size: ceil((side / patch) / r) each."""
    return -(-(height // patch) // r), -(-(width // patch) // r)


def _v41_fit(height, width, patch: int, r: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-keeping pixel size (multiples of the patch) whose span fits max_tokens (the reference's
    `solve_resize_ratio`): w token columns and h = w * height / width rows solve h * (w + 1) + 2 = max_tokens;
    degenerate shapes collapse to one column or one row."""
    ratio = height / width
    cols = math.sqrt((max_tokens - 2) / ratio + 0.25) - 0.5
    rows = cols * ratio
    cell = patch * r
    if cols < 1.0:  # very tall
        return (max_tokens - 2) // 2 * cell, cell
    if rows < 1.0:  # very wide
        return cell, (max_tokens - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / patch) * patch, math.floor(width * scale / patch) * patch


def deepseek_v41_plan(width: int, height: int, patch_size: int, downsample_ratio: int, max_image_tokens: int,
                      min_pixels: int, max_wh_ratio: float | None = None) -> tuple[int, int, int, int]:
    """(token rows, token columns, pixel height, pixel width) of an image of this size (the reference's
    `plan_image_grid` + `safe_resize`): a wider-than-max_wh_ratio image is planned as that ratio; one under
    min_pixels scaled up to about it (each side truncated); each side rounded up to the patch; if the span would
    exceed max_image_tokens, the largest aspect-keeping size that fits."""
    p, r = patch_size, downsample_ratio
    if max_wh_ratio is not None and width > height * max_wh_ratio:
        width = height * max_wh_ratio
    if 0 < width * height < min_pixels:
        scale = (min_pixels / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    best_w, best_h = math.ceil(width / p) * p, math.ceil(height / p) * p
    rows, cols = _v41_grid(best_h, best_w, p, r)
    if rows * (cols + 1) + 2 > max_image_tokens:
        best_h, best_w = _v41_fit(height, width, p, r, max_image_tokens)
        rows, cols = _v41_grid(best_h, best_w, p, r)
        if rows * (cols + 1) + 2 > max_image_tokens or min(best_h, best_w) < p:
            raise ValueError(f"deepseek_v41: no size of a {width}x{height} image fits {max_image_tokens} tokens")
    return rows, cols, int(best_h), int(best_w)


def deepseek_v41(images: Sequence[Image.Image], patch_size: int = 14, downsample_ratio: int = 3,
                 max_image_tokens: int = 1024, min_pixels: int = 544 * 544,
                 max_wh_ratio: float | None = None) -> dict[str, np.ndarray]:
    """DeepSeek V4.1's reference image processor (upstream `inference/image_processor.py` `load_image`): each image
    (RGB, as `load_image_plain` opens it) is planned by `deepseek_v41_plan`, fitted into that size keeping its
    aspect ratio and centred on grey (127, 127, 127) by Pillow's `ImageOps.pad` (bicubic; an image wider than
    max_wh_ratio is stretched to it by `resize` instead), scaled to [-1, 1] as float32 (x / 255 - 0.5) / 0.5 and
    rounded to bfloat16 (the reference hands the tower bf16 patches), then cut into patches.

    Returns pixel_values [sum of n_h * n_w, 3, p, p] float32 (bf16 values; each image's patches row-major, image
    after image), image_grid_hw [N, 2] int64 (the patch grid n_h, n_w), token_grid [N, 2] int64 (the aligner's
    rows and columns) and num_image_tokens [N] int64 (the span: rows * (columns + 1) + 2 image tokens).
    """
    import ml_dtypes

    images = _rgb_images(images, "deepseek_v41")
    for name, value in (("patch_size", patch_size), ("downsample_ratio", downsample_ratio),
                        ("max_image_tokens", max_image_tokens)):
        if not _is_int(value) or value < (4 if name == "max_image_tokens" else 1):
            raise ValueError(f"deepseek_v41: {name} must be an integer >= {4 if name == 'max_image_tokens' else 1}, "
                             f"got {value!r}")
    p = patch_size
    out, grids, tokens = [], [], []
    for image in images:
        rows, cols, h, w = deepseek_v41_plan(image.width, image.height, p, downsample_ratio, max_image_tokens,
                                             min_pixels, max_wh_ratio)
        if max_wh_ratio is not None and image.width >= max_wh_ratio * image.height:
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        else:
            image = ImageOps.pad(image, (w, h), color=(127, 127, 127))
        x = np.asarray(image, dtype=np.float32) / np.float32(255)
        x = ((x - np.float32(0.5)) / np.float32(0.5)).astype(ml_dtypes.bfloat16).astype(np.float32)
        x = x.reshape(h // p, p, w // p, p, 3).transpose(0, 2, 4, 1, 3)  # [n_h, n_w, c, kh, kw]
        out.append(x.reshape(-1, 3, p, p))
        grids.append((h // p, w // p))
        tokens.append((rows, cols))
    token_grid = np.asarray(tokens, np.int64)
    return {"pixel_values": np.concatenate(out), "image_grid_hw": np.asarray(grids, np.int64),
            "token_grid": token_grid, "num_image_tokens": token_grid[:, 0] * (token_grid[:, 1] + 1) + 2}


PROCESSORS = {"gemma3": gemma3, "pixtral": pixtral, "mllama": mllama, "qwen2_vl": qwen2_vl}
"""HF image processor name -> function; the signatures differ (pixtral takes the patch, mllama rows of images)."""
