"""jaxmodels.images against transformers 5.24's PIL-backend image processors, the independent reference: HF gets
the raw input (an RGBA / palette / grey PIL image, a numpy array), we get `load_image` of the same input."""
import base64
import io

import numpy as np
import pytest
from PIL import Image

from jaxmodels import images

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    MllamaImageProcessorPil,
    PixtralImageProcessorPil,
    Qwen2VLImageProcessorPil,
)
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb  # noqa: E402
from transformers.image_utils import load_image as hf_load_image  # noqa: E402

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
TOL = 1e-6


def photo(width: int, height: int, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients plus noise (uint8 HxWx3): resampling filters differ visibly on it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    smooth = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                       127.5 + 120 * np.sin((x + 2 * y) / 9)], axis=-1)
    return np.clip(smooth + rng.normal(0, 18, smooth.shape), 0, 255).astype(np.uint8)


def with_alpha(rgb: np.ndarray) -> np.ndarray:
    h, w = rgb.shape[:2]
    alpha = np.clip(np.add.outer(np.arange(h) * 255 // max(h, 1), np.arange(w) * 97 % 256), 0, 255)
    return np.concatenate([rgb, alpha[..., None].astype(np.uint8)], axis=-1)


def palette_with_transparency(rgb: np.ndarray) -> Image.Image:
    p = Image.fromarray(rgb).quantize(32)
    p.info["transparency"] = 3
    return p


# Raw inputs: odd aspect ratios, tiny and large sizes, and every colour conversion load_image does.
RAW = [
    Image.fromarray(photo(37, 211, 1)),
    Image.fromarray(photo(1000, 300, 2)),
    Image.fromarray(photo(1, 1, 3)),
    Image.fromarray(photo(3, 5, 4)),
    Image.fromarray(photo(2000, 1500, 5)),
    Image.fromarray(with_alpha(photo(90, 60, 6))),  # PIL RGBA: alpha_composite on white
    with_alpha(photo(50, 70, 7)),  # numpy RGBA: float blend on white, rounded
    Image.fromarray(photo(64, 48, 8)).convert("L"),
    photo(40, 30, 9)[..., :1],  # numpy HxWx1
    Image.fromarray(photo(81, 33, 10)).quantize(16),  # palette
    palette_with_transparency(photo(45, 45, 11)),
    Image.fromarray(photo(30, 90, 12)).convert("CMYK"),
    Image.fromarray(with_alpha(photo(33, 22, 13))).convert("LA"),
]


def ours(raw):
    return [images.load_image(x, where=f"image {i}") for i, x in enumerate(raw)]


def assert_same(got: dict, ref, keys, tol: float = TOL) -> float:
    """Same shapes, float32 pixels within tol, ints exactly; returns the max pixel difference."""
    diff = 0.0
    for key in keys:
        want = np.asarray(ref[key])
        have = got[key]
        assert have.shape == want.shape, (key, have.shape, want.shape)
        if key == "pixel_values":
            assert have.dtype == np.float32
            diff = float(np.abs(have.astype(np.float64) - want.astype(np.float64)).max())
            assert diff <= tol, (key, diff)
        else:
            assert have.dtype == np.int64 and want.dtype == np.int64, (key, have.dtype, want.dtype)
            np.testing.assert_array_equal(have, want, err_msg=key)
    return diff


# ---------------------------------------------------------------------------------------------- Gemma3

@pytest.mark.parametrize("resample", [0, 1, 2, 3, 4, 5])
def test_gemma3_matches_hf(resample):
    settings = {"size": {"height": 40, "width": 56}, "resample": resample}
    ref = Gemma3ImageProcessorPil(**settings)(RAW, return_tensors="np")
    assert_same(images.gemma3(ours(RAW), settings), ref, ["pixel_values", "num_crops"])


@pytest.mark.parametrize("steps", [
    {"do_rescale": False},
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
    {"rescale_factor": 1 / 127.5, "image_mean": 0.25, "image_std": [0.2, 0.3, 0.4]},
])
def test_gemma3_rescale_normalize_switches_match_hf(steps):
    settings = {"size": {"height": 24, "width": 24}, **steps}
    ref = Gemma3ImageProcessorPil(**settings)(RAW[:4], return_tensors="np")
    assert_same(images.gemma3(ours(RAW[:4]), settings), ref, ["pixel_values"])


PAN_RAW = [Image.fromarray(photo(w, h, i)) for i, (w, h) in  # 500x200: ratio 2.5 rounds half up, to 3 crops
           enumerate([(1000, 300), (300, 1000), (600, 500), (500, 500), (2000, 300), (520, 250), (299, 1), (500, 200)])]


@pytest.mark.parametrize("pan", [
    {},  # Gemma3Processor's defaults fill the nulls of preprocessor_config.json
    {"pan_and_scan_min_crop_size": 100, "pan_and_scan_max_num_crops": 3, "pan_and_scan_min_ratio_to_activate": 1.5},
])
def test_gemma3_pan_and_scan_matches_hf(pan):
    hf_kwargs = {**Gemma3Processor.images_kwargs, **pan, "do_pan_and_scan": True}
    ref = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})(PAN_RAW, return_tensors="np", **hf_kwargs)
    assert ref["num_crops"].max() >= 2 and ref["num_crops"].min() == 0  # both branches are exercised
    got = images.gemma3(ours(PAN_RAW), {"size": {"height": 32, "width": 32}, "do_pan_and_scan": True, **pan})
    assert_same(got, ref, ["pixel_values", "num_crops"])


def test_rescale_then_normalize_is_bit_identical_to_hf():
    """HF rescales in float64 and casts, then normalizes in float32; doing either in the other precision moves
    some pixels by an ulp, which the 1e-6 tolerance would not see."""
    settings = {"size": {"height": 64, "width": 64}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    ref = Gemma3ImageProcessorPil(**settings)(RAW, return_tensors="np")
    assert_same(images.gemma3(ours(RAW), settings), ref, ["pixel_values"], tol=0.0)


# ---------------------------------------------------------------------------------------------- Pixtral

@pytest.mark.parametrize("settings, patch, merge", [
    ({"size": {"longest_edge": 64}}, 4, 2),
    ({"size": {"height": 48, "width": 80}, "resample": 2}, 3, 2),
    ({"size": {"longest_edge": 40}, "do_resize": False}, 2, 1),
])
def test_pixtral_matches_hf(settings, patch, merge):
    raw = RAW if settings.get("do_resize", True) else RAW[2:4] + RAW[5:]
    # PixtralProcessor hands patch_size * spatial_merge_size to the image processor
    ref = PixtralImageProcessorPil(**settings)(raw, return_tensors="np", patch_size=patch * merge)
    got = images.pixtral(ours(raw), settings, patch, merge)
    assert_same(got, ref, ["pixel_values", "image_sizes"])
    # PixtralProcessor.replace_image_token: rows = height // patch, cols = width // patch
    np.testing.assert_array_equal(got["token_grid"], ref["image_sizes"] // (patch * merge))


# ---------------------------------------------------------------------------------------------- Mllama

@pytest.mark.parametrize("max_tiles", [1, 2, 4, 6])
def test_mllama_matches_hf(max_tiles):
    rows = [RAW[0:3], RAW[3:4], [], RAW[4:]]  # ragged, with an image-less row
    settings = {"size": {"height": 28, "width": 28}, "max_image_tiles": max_tiles,
                "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    ref = MllamaImageProcessorPil(**settings)(rows, return_tensors="np")
    got = images.mllama([ours(row) for row in rows], settings)
    assert_same(got, ref, ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"])
    assert got["num_tiles"] == ref["num_tiles"]


def test_mllama_canvas_choices_match_hf():
    """Shapes that land on every arrangement of 4 tiles, including the upscale and area tie-breaks."""
    raw = [Image.fromarray(photo(w, h, i)) for i, (w, h) in enumerate(
        [(20, 20), (28, 28), (29, 28), (56, 28), (28, 56), (84, 20), (20, 84), (112, 10), (10, 112), (60, 50),
         (200, 150), (57, 29)])]
    settings = {"size": {"height": 28, "width": 28}}
    ref = MllamaImageProcessorPil(**settings)([raw], return_tensors="np")
    assert len(set(ref["aspect_ratio_ids"][0].tolist())) == 8
    assert_same(images.mllama([ours(raw)], settings), ref, ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"])


# ---------------------------------------------------------------------------------------------- Qwen2-VL

@pytest.mark.parametrize("settings", [
    {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 20},
    {"size": {"shortest_edge": 144, "longest_edge": 4000}, "patch_size": 4, "merge_size": 3,
     "temporal_patch_size": 3, "resample": 2},
    {"size": {"shortest_edge": 3136, "longest_edge": 9000}, "min_pixels": 1000},  # top-level min_pixels wins
])
def test_qwen2_vl_matches_hf(settings):
    hf = Qwen2VLImageProcessorPil(**settings)
    ref = hf(RAW, return_tensors="np")
    got = images.qwen2_vl(ours(RAW), settings)
    assert_same(got, ref, ["pixel_values", "image_grid_thw"])
    # Exaone4_5_Processor._get_num_multimodal_tokens: patches // merge_size**2
    merge = settings.get("merge_size", 2)
    want = [hf.get_number_of_image_patches(im.height, im.width) // merge**2 for im in ours(RAW)]
    np.testing.assert_array_equal(got["num_image_tokens"], want)


def test_qwen2_vl_refuses_aspect_ratio_over_200_like_hf():
    thin = [Image.fromarray(photo(201, 1))]
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessorPil()(thin, return_tensors="np")
    with pytest.raises(ValueError, match=r"qwen2_vl: image 0 \(201x1\) has an aspect ratio above 200"):
        images.qwen2_vl(thin, {})


# ---------------------------------------------------------------------------------------------- defaults, release

def test_empty_settings_are_the_hf_class_defaults():
    raw = [Image.fromarray(photo(300, 200)), Image.fromarray(with_alpha(photo(70, 130, 1)))]
    assert_same(images.gemma3(ours(raw), {}), Gemma3ImageProcessorPil()(raw, return_tensors="np"),
                ["pixel_values", "num_crops"])
    # PixtralProcessor's own defaults: patch_size 16, spatial_merge_size 1
    assert_same(images.pixtral(ours(raw), {}, 16, 1),
                PixtralImageProcessorPil()(raw, return_tensors="np", patch_size=16), ["pixel_values", "image_sizes"])
    assert_same(images.mllama([ours(raw)], {}), MllamaImageProcessorPil()([raw], return_tensors="np"),
                ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"])
    assert_same(images.qwen2_vl(ours(raw), {}), Qwen2VLImageProcessorPil()(raw, return_tensors="np"),
                ["pixel_values", "image_grid_thw"])


# preprocessor_config.json as the hub ships it (nulls and bookkeeping keys included)
RELEASE = {
    "gemma3": {"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
               "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor",
               "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
               "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
               "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
               "size": {"height": 896, "width": 896}},
    "pixtral": {"crop_size": None, "do_center_crop": None, "do_convert_rgb": True, "do_normalize": True,
                "do_rescale": True, "do_resize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                "image_processor_type": "PixtralImageProcessorFast", "patch_size": {"height": 14, "width": 14},
                "processor_class": "PixtralProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
                "size": {"longest_edge": 1540}},
    "mllama": {"do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
               "image_mean": CLIP_MEAN, "image_processor_type": "MllamaImageProcessor", "image_std": CLIP_STD,
               "max_image_tiles": 4, "resample": 2, "rescale_factor": 0.00392156862745098,
               "size": {"height": 560, "width": 560}},
    "qwen2_vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3,
                 "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"},
}


@pytest.mark.parametrize("name", sorted(RELEASE))
def test_release_settings_match_hf(name):
    raw = [Image.fromarray(photo(2000, 1500))]
    settings = RELEASE[name]
    if name == "gemma3":
        ref = Gemma3ImageProcessorPil.from_dict(settings)(raw, return_tensors="np", **Gemma3Processor.images_kwargs)
        assert ref["pixel_values"].shape == (1, 3, 896, 896)
        assert_same(images.gemma3(ours(raw), settings), ref, ["pixel_values", "num_crops"])
    elif name == "pixtral":  # Mistral-Small-3.1: vision patch 14, spatial_merge_size 2
        ref = PixtralImageProcessorPil.from_dict(settings)(raw, return_tensors="np", patch_size=28)
        assert ref["image_sizes"].tolist() == [[1176, 1540]]  # 1500 / (2000 / 1540) = 1155, up to 42 * 28
        assert_same(images.pixtral(ours(raw), settings, 14, 2), ref, ["pixel_values", "image_sizes"])
    elif name == "mllama":
        ref = MllamaImageProcessorPil.from_dict(settings)([raw], return_tensors="np")
        assert ref["pixel_values"].shape == (1, 1, 4, 3, 560, 560)
        got = images.mllama([ours(raw)], settings)
        assert_same(got, ref, ["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"])
        assert got["num_tiles"] == ref["num_tiles"] == [[4]]
    else:
        ref = Qwen2VLImageProcessorPil.from_dict(settings)(raw, return_tensors="np")
        got = images.qwen2_vl(ours(raw), settings)
        assert_same(got, ref, ["pixel_values", "image_grid_thw"])
        assert got["num_image_tokens"].tolist() == [int(ref["image_grid_thw"][0].prod()) // 4]


# ---------------------------------------------------------------------------------------------- load_image

def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **save)
    return buf.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def test_load_image_sources_agree(tmp_path):
    rgb = photo(23, 17)
    png = encoded(Image.fromarray(rgb))
    (tmp_path / "a.png").write_bytes(png)
    for source in [tmp_path / "a.png", str(tmp_path / "a.png"), png, bytearray(png), memoryview(png),
                   data_uri(png), Image.fromarray(rgb), rgb, rgb / 255, (rgb / 255).astype(np.float32)]:
        got = images.load_image(source)
        assert got.mode == "RGB"
        np.testing.assert_array_equal(np.asarray(got), rgb)


def test_load_image_grey_array_is_replicated():
    grey = photo(9, 7)[..., 0]
    np.testing.assert_array_equal(np.asarray(images.load_image(grey)), np.repeat(grey[..., None], 3, axis=-1))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_load_image_applies_exif_orientation_like_hf(tmp_path, orientation):
    im = Image.fromarray(photo(40, 24))
    exif = im.getexif()
    exif[0x0112] = orientation
    jpeg = encoded(im, "JPEG", exif=exif.tobytes())
    (tmp_path / "a.jpg").write_bytes(jpeg)
    want = np.asarray(hf_load_image(str(tmp_path / "a.jpg")))
    assert want.shape == ((40, 24, 3) if orientation in (6, 8) else (24, 40, 3))
    np.testing.assert_array_equal(np.asarray(images.load_image(tmp_path / "a.jpg")), want)
    np.testing.assert_array_equal(np.asarray(images.load_image(data_uri(jpeg, "image/jpeg"))), want)


@pytest.mark.parametrize("image", [Image.fromarray(with_alpha(photo(31, 19))), palette_with_transparency(photo(20, 20)),
                                   Image.fromarray(with_alpha(photo(12, 9))).convert("LA")])
def test_load_image_transparent_files_composite_on_white_like_hf(image):
    data = encoded(image)
    want = hf_convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    np.testing.assert_array_equal(np.asarray(images.load_image(data)), want)
    assert (want == 255).any()  # the white background shows through somewhere


def test_load_image_rgba_array_blends_like_hf():
    rgba = with_alpha(photo(16, 11))
    np.testing.assert_array_equal(np.asarray(images.load_image(rgba)), hf_convert_to_rgb(rgba, return_numpy=True))


PNG = encoded(Image.fromarray(photo(64, 64)))


@pytest.mark.parametrize("source, problem", [
    (b"not an image", "not a readable image"),
    (PNG[:len(PNG) // 2], "cannot decode the image (image file is truncated)"),
    (b"", "empty image data"),
    (np.zeros((0, 5, 3), np.uint8), "zero-size image"),
    (Image.new("RGB", (0, 4)), "zero-size image (0x4)"),
    ("/nonexistent/dir/cat.png", "no such file: '/nonexistent/dir/cat.png'"),
    ("http://example.com/cat.png", "no network access at run time; pass the image bytes or a data: URI"),
    ("HTTPS://example.com/cat.png", "no network access at run time"),
    ("ftp://example.com/cat.png", "unsupported URL scheme 'ftp'"),
    (np.zeros((3, 32, 32), np.uint8), "array shape (3, 32, 32) is not HxW, HxWx3 or HxWx4"),
    (np.zeros((4, 4, 2), np.uint8), "array shape (4, 4, 2)"),
    (np.zeros((2, 4, 4, 3), np.uint8), "array shape (2, 4, 4, 3)"),
    (np.zeros((4, 4, 3), np.int64), "unsupported array dtype int64"),
    (np.zeros((4, 4), bool), "unsupported array dtype bool"),
    (np.full((4, 4, 3), 1.5), "float pixel values must be finite and in [0, 1]"),
    (np.full((4, 4, 3), np.nan, np.float32), "float pixel values must be finite"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type 'text/plain' is not image/*"),
    ("data:image/png,rawbytes", "only base64 data: URIs"),
    ("data:image/png;base64", "malformed data: URI"),
    (data_uri(b"GIF89a-but-not-really"), "not a readable image"),
    (12345, "unsupported image type int"),
])
def test_load_image_rejects_bad_input_in_one_line(source, problem):
    with pytest.raises(ValueError) as e:
        images.load_image(source, where="image 7")
    message = str(e.value)
    assert message.startswith("image 7: ") and problem in message and "\n" not in message, message


def test_load_image_rejects_a_directory(tmp_path):
    with pytest.raises(ValueError, match=r"^image 0: '.*' is a directory, not an image file$"):
        images.load_image(tmp_path)


# ---------------------------------------------------------------------------------------------- bad settings

SMALL = [Image.fromarray(photo(20, 12))]


@pytest.mark.parametrize("call, problem", [
    (lambda: images.gemma3(SMALL, {"size": {"height": -1, "width": 4}}), "gemma3 settings: size must be"),
    (lambda: images.gemma3(SMALL, {"size": {"shortest_edge": 4}}), "gemma3 settings: size must be"),
    (lambda: images.gemma3(SMALL, {"image_mean": [0.5, 0.5]}), "gemma3 settings: image_mean must be"),
    (lambda: images.gemma3(SMALL, {"image_std": [0.5, 0.0, 0.5]}), "gemma3 settings: image_std must be"),
    (lambda: images.gemma3(SMALL, {"resample": 9}), "gemma3 settings: resample must be a PIL filter id 0..5"),
    (lambda: images.gemma3(SMALL, {"rescale_factor": -1.0}), "gemma3 settings: rescale_factor must be"),
    (lambda: images.gemma3(SMALL, {"do_resize": "yes"}), "gemma3 settings: do_resize must be true or false"),
    (lambda: images.gemma3(SMALL, {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0}),
     "pan_and_scan_max_num_crops must be an integer >= 1"),
    (lambda: images.gemma3(SMALL, [("size", 4)]), "gemma3 settings must be a dict"),
    (lambda: images.gemma3([], {}), "gemma3: no images"),
    (lambda: images.gemma3([Image.new("RGBA", (4, 4))], {}), "image 0 is a RGBA image; pass it through load_image"),
    (lambda: images.gemma3([np.zeros((4, 4, 3), np.uint8)], {}), "image 0 is ndarray"),
    (lambda: images.gemma3(SMALL + [Image.new("RGB", (5, 5))], {"do_resize": False}), "must share one size"),
    (lambda: images.pixtral(SMALL, {}, 14, 0), "pixtral: merge_size must be an integer >= 1"),
    (lambda: images.pixtral(SMALL, {"size": {"longest_edge": 0}}, 14, 2), "pixtral settings: size must be"),
    (lambda: images.pixtral([Image.new("RGB", (5000, 1))], {"size": {"longest_edge": 1540}}, 14, 2),
     "image 0 (5000x1) is too thin"),
    (lambda: images.mllama([SMALL], {"size": {"height": 28, "width": 56}}), "square (height == width)"),
    (lambda: images.mllama([SMALL], {"do_pad": False}), "do_resize and do_pad must be true"),
    (lambda: images.mllama([SMALL], {"max_image_tiles": 0}), "max_image_tiles must be an integer >= 1"),
    (lambda: images.mllama([[], []], {}), "mllama: no images in any row"),
    (lambda: images.mllama(SMALL, {}), "row 0: expected a list of images"),
    (lambda: images.qwen2_vl(SMALL, {"size": {"shortest_edge": 10}}), "qwen2_vl settings: size must be"),
    (lambda: images.qwen2_vl(SMALL, {"patch_size": 0}), "qwen2_vl settings: patch_size must be an integer >= 1"),
    (lambda: images.qwen2_vl(SMALL, {"do_resize": False}), "must have sides divisible by"),
])
def test_bad_settings_and_images_are_clear_value_errors(call, problem):
    with pytest.raises(ValueError) as e:
        call()
    assert problem in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_pixtral_unimplemented_branches_say_so():
    with pytest.raises(NotImplementedError, match="do_center_crop"):
        images.pixtral(SMALL, {"do_center_crop": True, "crop_size": {"height": 8, "width": 8}}, 4, 2)
    with pytest.raises(NotImplementedError, match="do_pad"):
        images.pixtral(SMALL, {"do_pad": False}, 4, 2)


def test_registry_names_the_processors():
    assert images.PROCESSORS == {"gemma3": images.gemma3, "pixtral": images.pixtral, "mllama": images.mllama,
                                 "qwen2_vl": images.qwen2_vl}
