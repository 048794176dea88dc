"""MXFP4 / E8M0 decoding (`converters/quant.py`) against transformers' own decoder and hand-made examples.

Spec: specs/hf_families.md §3.7 "MXFP4 decode": low nibble = element 2j, high nibble = element 2j+1; LUT
[+0, +.5, +1, +1.5, +2, +3, +4, +6, -0, -.5, ...]; each 16-byte group of 32 values x 2^(s - 127).
"""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations import mxfp4 as hf_mxfp4

from converters.quant import FP4_VALUES, MXFP4Reader, mxfp4_decode
from jaxmodels.layers.qdq import e8m0_to_f32 as e8m0_to_float  # the one E8M0 decoder, host and device

EXTREME_SCALES = [0, 1, 126, 127, 128, 254]
# 6 x 2^127 overflows to inf in float32, in HF's decoder as in ours
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def bits(a):
    """Bit patterns, so that -0.0 != +0.0 and inf/NaN compare exactly."""
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16}[a.dtype.itemsize])


def random_packed(shape, seed):
    """blocks [*shape, 16] uint8 holding every byte value, scales [*shape] holding the extreme exponents."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    flat = blocks.reshape(-1)
    assert flat.size >= 256
    flat[rng.permutation(flat.size)[:256]] = np.arange(256, dtype=np.uint8)
    scales = rng.integers(0, 255, shape, dtype=np.uint8)  # 0 .. 254
    sflat = scales.reshape(-1)
    sflat[: len(EXTREME_SCALES)] = EXTREME_SCALES
    assert set(np.unique(blocks)) == set(range(256)) and set(EXTREME_SCALES) <= set(np.unique(scales))
    return blocks, scales


def hf_decode(blocks, scales, dtype):
    """HF's decoder: [E, R, G, 16] + [E, R, G] -> [E, G*32, R] (it transposes the last two axes)."""
    return hf_mxfp4.convert_moe_packed_tensors(torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()),
                                               dtype=dtype)


def test_fp4_lut_equals_hf():
    want = np.asarray(hf_mxfp4.FP4_VALUES, np.float32)
    assert FP4_VALUES.dtype == np.float32 and FP4_VALUES.shape == (16,)
    np.testing.assert_array_equal(bits(FP4_VALUES), bits(want))  # incl. the -0.0 at code 8


def test_e8m0_to_float():
    s = np.arange(256, dtype=np.uint8)
    got = e8m0_to_float(s)
    assert got.dtype == np.float32 and got.shape == (256,)
    want = np.array([math.ldexp(1.0, int(v) - 127) for v in range(255)], np.float64)  # exact powers of two
    assert np.all(want.astype(np.float32).astype(np.float64) == want)  # all representable in fp32 (2^-127 subnormal)
    np.testing.assert_array_equal(bits(got[:255]), bits(want.astype(np.float32)))
    assert got[0] == 2.0 ** -127 and got[127] == 1.0 and got[128] == 2.0 and got[254] == 2.0 ** 127
    assert np.isnan(got[255])
    # any shape
    m = np.array([[127, 128], [0, 255]], np.uint8)
    out = e8m0_to_float(m)
    assert out.shape == (2, 2) and out[0, 0] == 1.0 and out[0, 1] == 2.0 and np.isnan(out[1, 1])


@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 64, 1), (1, 7, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decode_bitexact_vs_hf(shape, dtype):
    blocks, scales = random_packed(shape, seed=sum(shape))
    ours = mxfp4_decode(blocks, scales)
    E, R, G = shape
    assert ours.dtype == np.float32 and ours.shape == (E, R, G * 32)
    want = hf_decode(blocks, scales, dtype)
    assert tuple(want.shape) == (E, G * 32, R)
    ours_t = np.swapaxes(ours, 1, 2)
    if dtype == torch.float32:
        np.testing.assert_array_equal(bits(ours_t), bits(want.numpy()))
    else:  # every FP4 value x 2^k (k in -127..127) is exact in bf16 too; compare after the same cast
        want_bits = want.view(torch.int16).numpy().view(np.uint16)
        np.testing.assert_array_equal(bits(ours_t.astype(ml_dtypes.bfloat16)), want_bits)
    assert np.isinf(ours).any() and (ours == 0).any() and np.signbit(ours[ours == 0]).any()  # 6*2^127 overflows


def test_mxfp4_each_scale_times_each_code_vs_hf():
    """The full product table: 256 byte values x scales 0..254, one 16-byte group per (scale, row)."""
    scales = np.repeat(np.arange(255, dtype=np.uint8), 16).reshape(1, 255 * 16, 1)  # [E=1, R, G=1]
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (255, 1))[None, :, None, :]  # [1, R, 1, 16]
    ours = mxfp4_decode(blocks, scales)
    want = hf_decode(blocks, scales, torch.float32).numpy()
    np.testing.assert_array_equal(bits(np.swapaxes(ours, 1, 2)), bits(want))
    # and against the definition, in float64
    codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(1, 255 * 16, 32)
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    ref = (lut[codes] * np.ldexp(1.0, scales.astype(np.int64) - 127)).astype(np.float32)
    np.testing.assert_array_equal(bits(ours), bits(ref))


def test_nibble_order_and_group_scale_by_hand():
    """Byte 0x21: low nibble 1 (+0.5) is element 0, high nibble 2 (+1.0) element 1; 0xF7: +6 then -6;
    0x08: -0.0 then +0.0; 0xA3: +1.5 then -1.0. Group 0 has scale 128 (x2), group 1 scale 126 (x0.5)."""
    blocks = np.zeros((2, 16), np.uint8)
    blocks[0, :4] = [0x21, 0xF7, 0x08, 0xA3]
    blocks[1, 15] = 0x5C  # elements 62, 63 of the row: code 12 (-2.0) then code 5 (+3.0)
    scales = np.array([128, 126], np.uint8)
    out = mxfp4_decode(blocks, scales)
    assert out.shape == (64,)
    want = np.zeros(64, np.float32)
    want[:8] = np.array([0.5, 1.0, 6.0, -6.0, -0.0, 0.0, 1.5, -1.0]) * 2
    want[62:] = np.array([-2.0, 3.0]) * 0.5
    np.testing.assert_array_equal(out, want)
    assert np.signbit(out[4]) and not np.signbit(out[5])
    # HF agrees on the same bytes
    hf = hf_decode(blocks[None, None], scales[None, None], torch.float32).numpy()  # [1, 64, 1]
    np.testing.assert_array_equal(bits(hf[0, :, 0]), bits(out))


@pytest.mark.parametrize("blocks,scales", [
    ((2, 3, 16), (3,)),  # would broadcast silently
    ((2, 3, 16), (2, 4)),
    ((2, 3, 8), (2, 3)),  # not 16 bytes per group
    ((2, 3, 16), (2, 3, 1)),
])
def test_mxfp4_decode_rejects_mismatched_shapes(blocks, scales):
    with pytest.raises(ValueError, match="scales"):  # a clear message, not numpy's broadcast/reshape error
        mxfp4_decode(np.zeros(blocks, np.uint8), np.zeros(scales, np.uint8))


# ------------------------------------------------------------------ MXFP4Reader

class DictReader:
    """The reader interface of converters.safetensors_io: keys(), shape(name), get(name)."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.gets = []

    def keys(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def get(self, name):
        self.gets.append(name)
        return self.tensors[name]


E, I, Dm = 3, 64, 32  # experts, intermediate, hidden


def gpt_oss_tensors(sep="_", prefix="model.layers.0.mlp."):
    rng = np.random.default_rng(0)
    gu_b, gu_s = random_packed((E, 2 * I, Dm // 32), 1)
    dn_b, dn_s = random_packed((E, Dm, I // 32), 2)
    return {
        prefix + "router.weight": rng.normal(size=(E, Dm)).astype(np.float32),
        prefix + "router.bias": rng.normal(size=(E,)).astype(np.float32),
        prefix + f"experts.gate_up_proj{sep}blocks": gu_b,
        prefix + f"experts.gate_up_proj{sep}scales": gu_s,
        prefix + "experts.gate_up_proj_bias": rng.normal(size=(E, 2 * I)).astype(np.float32),
        prefix + f"experts.down_proj{sep}blocks": dn_b,
        prefix + f"experts.down_proj{sep}scales": dn_s,
        prefix + "experts.down_proj_bias": rng.normal(size=(E, Dm)).astype(np.float32),
    }


@pytest.mark.parametrize("sep", ["_", "."])  # HF `X_blocks`; OpenAI's original checkpoint `X.blocks`
def test_mxfp4_reader(sep):
    pre = "model.layers.0.mlp."
    raw = gpt_oss_tensors(sep, pre)
    inner = DictReader(raw)
    r = MXFP4Reader(inner)
    plain = [pre + n for n in ("router.weight", "router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias")]
    assert sorted(r.keys()) == sorted(plain + [pre + "experts.gate_up_proj", pre + "experts.down_proj"])
    assert len(r.keys()) == len(set(r.keys()))
    assert not any(k.endswith(("blocks", "scales")) for k in r.keys())
    # quantized pairs: one tensor, [E, in, out], equal to HF's decode (which also transposes) and ours transposed
    for name, shape in (("gate_up_proj", (E, Dm, 2 * I)), ("down_proj", (E, I, Dm))):
        key = pre + "experts." + name
        assert tuple(r.shape(key)) == shape
        got = r.get(key)
        assert got.shape == shape and got.dtype == np.float32
        b, s = raw[f"{key}{sep}blocks"], raw[f"{key}{sep}scales"]
        np.testing.assert_array_equal(bits(got), bits(np.swapaxes(mxfp4_decode(b, s), 1, 2)))
        np.testing.assert_array_equal(bits(got), bits(hf_decode(b, s, torch.float32).numpy()))
    # everything else passes through untouched
    for k in plain:
        assert tuple(r.shape(k)) == raw[k].shape
        assert r.get(k) is raw[k]
    # shapes are answered without reading any tensor data beyond what get() asked for
    inner.gets.clear()
    [r.shape(k) for k in r.keys()]
    assert inner.gets == []


def test_mxfp4_reader_without_quantized_tensors_is_transparent():
    raw = {"a.weight": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}
    r = MXFP4Reader(DictReader(raw))
    assert sorted(r.keys()) == ["a.weight", "b"]
    assert r.shape("a.weight") == (2, 3) and r.get("b") is raw["b"]


@pytest.mark.parametrize("sep", ["_", "."])
def test_mxfp4_reader_blocks_without_scales_raises(sep):
    raw = gpt_oss_tensors(sep)
    del raw[f"model.layers.0.mlp.experts.down_proj{sep}scales"]
    with pytest.raises(ValueError, match="down_proj"):
        r = MXFP4Reader(DictReader(raw))
        r.keys()
        r.get("model.layers.0.mlp.experts.down_proj")
