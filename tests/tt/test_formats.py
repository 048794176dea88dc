"""tt_backend.formats: bit-exact against the ttnn 0.81.1 wheel (committed golden data), plus
properties that hold independently of the implementation, plus an optional live-oracle test.

Expected values come from the wheel (tests/tt/golden/formats_golden.npz, written by
tools/ttnn_oracle/gen_golden.py; float32, bfloat16, float16, float64 and integer inputs) or from
independent formulas written out in the tests.
"""
import json
import os
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tt_backend import formats as F

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "tt" / "golden" / "formats_golden.npz"
ORACLE = ROOT / "tools" / "ttnn_oracle" / "oracle.py"
BFP = ("bfloat8_b", "bfloat4_b")
ALL = ("bfloat16",) + BFP


def bits(a):
    return np.require(np.asarray(a, dtype=np.float32), requirements="C").view(np.uint32)


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN, allow_pickle=False)


def _cases(g, prefix):
    return sorted(k for k in g.files if k.startswith(prefix))


def _input(g, case):
    """A golden case's input as the wheel got it: bf16 inputs are stored as uint16 bit patterns."""
    x = g["x:" + case]
    return x.view(ml_dtypes.bfloat16) if "xdtype:" + case in g.files else x


def _pad(g, case):
    return float(g["pad:" + case]) if "pad:" + case in g.files else None


def _flat_tail(shape, step):
    n = int(np.prod(shape))
    return np.arange(n) >= n - n % step


# ---------------------------------------------------------------------------------------------
# Golden data from the wheel
# ---------------------------------------------------------------------------------------------

def test_golden_file_records_its_source(golden):
    meta = json.loads(str(golden["meta"]))
    assert meta["ttnn"] == "0.81.1"
    # Enough coverage that a wrong rounding rule cannot slip through: distributions, shapes, dtypes.
    cases = {k.split(":")[1] for k in _cases(golden, "y:")}
    for must in ("bf16_ties", "bfp8_ties", "bfp4_ties", "saturation", "subnormals", "nonfinite",
                 "near_min_normal", "random_bits", "shape_scalar", "shape_2x2x40x35", "in_float64", "pad_1000",
                 "bf16in_random_bits", "bf16in_nonfinite_positions", "bf16in_subnormal_bits",
                 "bf16in_exponent_extremes",
                 "bf16in_bfp8_ties", "f16in_random_bits", "f16in_bf16_ties", "f16in_nonfinite_positions",
                 "f16in_nan_tail", "in_float64_nan_tail", "pad_bf16_0.99999994", "pad_f16_0.99999994"):
        assert must in cases
    # every target for bf16 and f16 inputs, and enough of them
    targets = {(_input(golden, c).dtype.name, k.split(":")[2]) for k in _cases(golden, "y:") for c in [k.split(":")[1]]}
    for src in ("bfloat16", "float16", "float32", "float64"):
        for d in ("float32",) + ALL:
            assert (src, d) in targets, (src, d)
    assert sum(k.split(":")[1].startswith("bf16in_") for k in _cases(golden, "y:")) >= 40


def test_roundtrip_bit_exact_against_ttnn(golden):
    bad = []
    for key in _cases(golden, "y:"):
        _, case, dtype = key.split(":")
        x = _input(golden, case)
        want = golden[key]
        got = F.roundtrip(x, dtype, pad_value=_pad(golden, case))
        assert got.dtype == np.float32 and got.shape == want.shape == x.shape, key
        n = int((bits(got) != bits(want)).sum())
        if n:
            bad.append(f"{key}: {n}/{want.size} differ")
    assert not bad, "\n".join(bad)


def test_tile_bytes_bit_exact_against_ttnn(golden):
    keys = _cases(golden, "b:")
    assert len(keys) >= 40
    for key in keys:
        _, case, dtype = key.split(":")
        x = _input(golden, case)
        want = golden[key]
        pv = _pad(golden, case)
        got = F.encode_tiles(x, dtype, pad_value=0.0 if pv is None else pv)
        assert got.reshape(-1).shape == want.shape, key
        assert np.array_equal(got.reshape(-1), want), key
        # decoding ttnn's own bytes gives ttnn's own round trip
        dec = F.decode_tiles(want, x.shape, dtype)
        assert np.array_equal(bits(dec), bits(golden[f"y:{case}:{dtype}"])), key


def test_golden_shows_the_documented_rules(golden):
    """The rules in formats' docstring, read straight off the wheel's output (no formats code)."""
    # bf16: every NaN becomes +0x7FC00000
    x, y = golden["x:nonfinite"], golden["y:nonfinite:bfloat16"]
    assert np.all(bits(y)[np.isnan(x)] == 0x7FC00000)
    # bfp: no -0 anywhere; FP32 subnormal inputs are 0 whatever their block
    for d in BFP:
        for case in ("zeros30_negzero", "subnormals", "random_bits"):
            assert not np.any(bits(golden[f"y:{case}:{d}"]) == 0x80000000)
        xs, ys = golden["x:subnormals"], golden[f"y:subnormals:{d}"]
        assert np.all(ys[(bits(xs) & 0x7F800000) == 0] == 0)
    # bfp8 of a block whose max is just below 2 saturates at 127/64, not 2
    xs, ys = golden["x:saturation"], golden["y:saturation:bfloat8_b"]
    big = np.abs(xs[:, ::16]) >= 1.9921875 * (1 + 2**-9)
    assert big.any() and np.all(np.abs(ys[:, ::16])[big] == 127 / 64)


def test_golden_shows_the_input_dtype_rules(golden):
    """bf16 / f16 / f64 input rules, read straight off the wheel's output (no formats code)."""
    widen = lambda u16: u16.astype(np.uint32) << 16  # noqa: E731
    # bf16 input: to bfloat16 the identity and to float32 the widening, NaN payloads and signs kept
    for case in ("bf16in_random_bits", "bf16in_nonfinite_positions", "bf16in_subnormal_bits"):
        u = golden["x:" + case]
        assert np.any((u & 0x7FFF) > 0x7F80) or case == "bf16in_subnormal_bits"
        for d in ("bfloat16", "float32"):
            assert np.array_equal(bits(golden[f"y:{case}:{d}"]), widen(u)), (case, d)
    # float16 input: to bfloat16 every NaN is +0x7FC00000 (ttnn's rule, not torch's)
    for case in ("f16in_random_bits", "f16in_nonfinite_positions", "f16in_nan_tail"):
        x, y = golden["x:" + case], golden[f"y:{case}:bfloat16"]
        assert np.isnan(x).any() and np.all(bits(y)[np.isnan(x)] == 0x7FC00000)
    # float16 -> float32 through torch: quiet NaN in vector steps of 8, 0x7FFFFFFF in the scalar tail
    x, y = golden["x:f16in_nan_tail"], bits(golden["y:f16in_nan_tail:float32"])
    tail, nan = _flat_tail(x.shape, 8).reshape(x.shape), np.isnan(x)
    assert (nan & tail).any() and np.all(y[nan & tail] == 0x7FFFFFFF)
    h = x.view(np.uint16).astype(np.uint32)
    quiet = ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x1FF) << 13)
    assert np.array_equal(y[nan & ~tail], quiet[nan & ~tail])
    # float64 -> bfloat16 through torch: NaN -> 0xFFFF in vector steps of 16, 0x7FC0 in the tail
    x, y = golden["x:in_float64_nan_tail"], bits(golden["y:in_float64_nan_tail:bfloat16"])
    tail, nan = _flat_tail(x.shape, 16).reshape(x.shape), np.isnan(x)
    assert (nan & tail).any() and np.all(y[nan & tail] == 0x7FC00000) and np.all(y[nan & ~tail] == 0xFFFF0000)


@pytest.mark.parametrize("case", ["pad_bf16_0.99999994", "pad_bf16_f32max", "pad_f16_0.99999994",
                                  "pad_f64_0.99999994", "pad_f64_f32max"])
def test_pad_is_rounded_to_bf16_for_bf16_held_tensors(golden, case):
    """The golden data tells the two pad rules apart: the same bf16 values held as float32 (so padded
    with the float32 value) would give other bfp results (0.99999994 -> 1.0 lifts the exponent)."""
    x, pv = _input(golden, case), _pad(golden, case)
    held = F.roundtrip(x, "bfloat16")  # the bf16 values the wheel holds, as a float32 array
    differs = [not np.array_equal(bits(F.roundtrip(held, d, pad_value=pv)), bits(golden[f"y:{case}:{d}"])) for d in BFP]
    assert any(differs)


@pytest.mark.parametrize("dtype", BFP)
def test_bf16_input_packs_like_its_float32_widening(golden, dtype):
    """The wheel's bf16 -> bfp is the (verified) float32 rule on the widened values: no second
    rounding, NaN payloads go in as they are (every bf16 golden case, no padding)."""
    n = 0
    for key in _cases(golden, "y:bf16in_"):
        _, case, d = key.split(":")
        if d != dtype:
            continue
        wide = _input(golden, case).astype(np.float32)  # ml_dtypes widens exactly, payloads kept
        assert np.array_equal(bits(F.roundtrip(wide, dtype)), bits(golden[key])), key
        n += 1
    assert n >= 20


def test_bf16_and_f16_inputs_exhaustive_properties():
    """Every bf16 / f16 bit pattern (no golden needed): bf16 -> bfloat16 is the identity; f16 ->
    bfloat16 is the float32 rule on the exact widening."""
    u = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(64, 1024)
    x = u.view(ml_dtypes.bfloat16)
    assert np.array_equal(bits(F.roundtrip(x, "bfloat16")), u.astype(np.uint32) << 16)
    assert np.array_equal(bits(F.roundtrip(x, "float32")), u.astype(np.uint32) << 16)
    h = u.view(np.float16)
    assert np.array_equal(bits(F.roundtrip(h, "bfloat16")), bits(F.bf16_round(h.astype(np.float32))))


def test_jax_arrays_take_the_same_path():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2**16, (40, 50)).astype(np.uint16)
    x = u.view(ml_dtypes.bfloat16)
    for d in ("float32",) + ALL:
        assert np.array_equal(bits(F.roundtrip(jnp.asarray(x), d)), bits(F.roundtrip(x, d))), d
    h = rng.standard_normal((40, 50)).astype(np.float16)
    assert np.array_equal(bits(F.roundtrip(jnp.asarray(h), "bfloat8_b")), bits(F.roundtrip(h, "bfloat8_b")))


# ---------------------------------------------------------------------------------------------
# Independent reference for the host rule (scalar Python, written from the rule, not the code)
# ---------------------------------------------------------------------------------------------

def _ref_block(vals, w):
    """One 16-value block, the host rule spelled out with Python ints."""
    us = [int(np.float32(v).view(np.uint32)) for v in vals]
    E = max((u >> 23) & 0xFF for u in us)
    out = []
    for u in us:
        e = (u >> 23) & 0xFF
        if e == 0:
            out.append(0.0)
            continue
        a = ((u & 0x7FFFFF) | 0x800000) >> min(E - e, 31)
        q, rem, half = a >> (24 - w), a & ((1 << (24 - w)) - 1), 1 << (23 - w)
        q += rem > half or (rem == half and q & 1)
        q = min(q, (1 << w) - 1)
        v = q * 2.0 ** (E - 127 - (w - 1))
        v = 0.0 if v < 2.0**-126 else v
        out.append(-v if (u >> 31 and v) else v)
    return out


@pytest.mark.parametrize("dtype", BFP)
def test_host_packing_matches_scalar_reference(dtype):
    w = F.BFP_BITS[dtype]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 64)) * np.exp(rng.uniform(-6, 6, (8, 64)))).astype(np.float32)
    got = F.quantize(x, dtype)
    ref = np.array([_ref_block(x[r, b:b + 16], w) for r in range(8) for b in range(0, 64, 16)], np.float32)
    assert np.array_equal(got, ref.reshape(8, 4, 16).reshape(8, 64))


def test_bf16_round_ties_to_even_on_hand_values():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3.4e38], np.float32)
    want = np.array([1.0, 1 + 2**-6, 1 + 2**-7, -1.0, np.inf], np.float32)
    assert np.array_equal(F.bf16_round(x), want)


# ---------------------------------------------------------------------------------------------
# Properties (seeded random inputs)
# ---------------------------------------------------------------------------------------------

def _rand(seed, shape=(64, 96)):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-10, 10, shape))).astype(np.float32)


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("mode", ["host", "device"])
def test_idempotent(dtype, mode):
    for seed in range(3):
        q = F.quantize(_rand(seed), dtype, mode)
        assert np.array_equal(bits(F.quantize(q, dtype, mode)), bits(q))


@pytest.mark.parametrize("dtype", BFP)
def test_blocks_are_independent(dtype):
    x = _rand(4)
    q = F.quantize(x, dtype)
    y = x.copy()
    y[5, 16:32] *= 1e6  # one face row of one tile
    qy = F.quantize(y, dtype)
    changed = np.argwhere(qy != q)
    assert changed.size and np.all(changed[:, 0] == 5) and np.all((changed[:, 1] >= 16) & (changed[:, 1] < 32))


@pytest.mark.parametrize("dtype", ALL)
def test_sign_symmetry(dtype):
    x = _rand(5)
    q, qn = F.quantize(x, dtype), F.quantize(-x, dtype)
    assert np.array_equal(qn, -q)  # as values (bfp never stores -0, so 0 == -0 here is right)
    if dtype in BFP:
        assert np.any(q == 0) and not np.any(bits(qn) == 0x80000000)
    else:
        assert np.array_equal(bits(qn), bits(q) ^ np.uint32(0x80000000))


@pytest.mark.parametrize("dtype", ALL)
def test_power_of_two_scale_invariance(dtype):
    x = np.random.default_rng(6).standard_normal((32, 64)).astype(np.float32)
    q = F.quantize(x, dtype)
    for s in (-60, -3, 5, 90):
        assert np.array_equal(F.quantize(x * np.float32(2.0**s), dtype), q * np.float32(2.0**s))


@pytest.mark.parametrize("dtype", BFP)
def test_error_bound_and_saturation(dtype):
    w = F.BFP_BITS[dtype]
    x = _rand(7)
    q = F.quantize(x, dtype)
    blk = np.abs(x).reshape(64, 6, 16).max(-1, keepdims=True)
    step = 2.0 ** (np.floor(np.log2(blk)) - (w - 1))  # one unit of the block's grid
    err = np.abs(q - x).reshape(64, 6, 16)
    assert np.all(err <= step)  # half a step, or a full one where the max saturates
    assert np.all(np.abs(q).reshape(64, 6, 16) <= (2**w - 1) * step)
    # codes never exceed w magnitude bits
    _, codes = F.bfp_pack_host(F.pad_to_tile(x), w)
    assert int((codes & ((1 << w) - 1)).max()) == 2**w - 1 and int(codes.max()) < 2 ** (w + 1)


@pytest.mark.parametrize("shape", [(), (5,), (33,), (3, 5, 7), (2, 1, 40, 70), (64, 32)])
def test_tile_layout_round_trip_and_face_order(shape):
    x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 1
    t = F.tilize(x, pad_value=-7.0)
    ps = F.padded_shape(shape)
    assert t.shape[-1] == 1024 and t.shape[-2] == ps[-2] // 32 * ps[-1] // 32
    assert np.array_equal(F.untilize(t, shape), x)
    assert np.sum(t == -7.0) == int(np.prod(ps)) - x.size  # pads carry the pad value
    # face order, by an independent index formula: tile (0,0), face f, row r, col c
    xp = F.pad_to_tile(x, -7.0).reshape(-1, ps[-2], ps[-1])[0]
    for f, r, c in [(0, 0, 1), (1, 0, 0), (1, 3, 15), (2, 0, 0), (3, 15, 15)]:
        assert t.reshape(-1, t.shape[-2], 1024)[0, 0, f * 256 + r * 16 + c] == xp[16 * (f // 2) + r, 16 * (f % 2) + c]


def test_padded_shape_matches_ttnn_examples():
    assert F.padded_shape((40, 70)) == (64, 96)  # spec §3.1, verified on the wheel
    assert F.padded_shape(()) == (32, 32) and F.padded_shape((33,)) == (32, 64)
    assert F.padded_shape((2, 3, 5)) == (2, 32, 32)


def test_pad_value_changes_shared_exponent():
    x = np.full((1, 20), 1e-3, np.float32)
    assert np.all(F.roundtrip(x, "bfloat8_b") != 0)
    y = F.roundtrip(x, "bfloat8_b", pad_value=1000.0)
    assert np.all(y[0, :16] != 0) and np.all(y[0, 16:] == 0)  # block 16..31 shares with the pads


@pytest.mark.parametrize("dtype", BFP)
def test_device_model_differs_only_by_rounding_direction(dtype):
    """Modelled device packing (NOT verified): ties go away from zero, bfp4 truncates from bfp8."""
    w = F.BFP_BITS[dtype]
    step = 2.0 ** -(w - 1)
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 1.0
    x[0, 1] = 2.5 * step  # tie between 2 and 3 steps (exact in bf16)
    host = F.quantize(x, dtype, "host")[0, 1] / step
    dev = F.quantize(x, dtype, "device")[0, 1] / step
    assert host == 2.0 and dev == (3.0 if w == 7 else 2.0)
    # bfp4 on device = bfp8 on device with the low 4 magnitude bits dropped
    r = _rand(9, (32, 64))
    d8 = F.quantize(r, "bfloat8_b", "device")
    d4 = F.quantize(r, "bfloat4_b", "device")
    trunc = (bits(r) & np.uint32(0xFFFF0000)).view(np.float32)  # the model narrows to BF16 by truncation
    blk = np.exp2(np.floor(np.log2(np.abs(trunc).reshape(32, 4, 16).max(-1, keepdims=True))))
    m8 = np.round(np.abs(d8).reshape(32, 4, 16) / blk * 64)
    assert np.array_equal(np.abs(d4).reshape(32, 4, 16), np.floor(m8 / 16) * 4 * blk / 16)


def test_fast_on_a_million_elements():
    import time
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    t = time.perf_counter()
    for d in ALL:
        F.roundtrip(x, d)
    assert time.perf_counter() - t < 3.0


def test_errors_are_clear():
    with pytest.raises(F.FormatError, match="unknown TT dtype 'bfloat8'"):
        F.roundtrip(np.zeros(3, np.float32), "bfloat8")
    with pytest.raises(F.FormatError, match="unknown quantize mode"):
        F.quantize(np.zeros(3, np.float32), "bfloat16", mode="chip")
    with pytest.raises(F.FormatError, match="real numeric"):
        F.roundtrip(np.array(["a"]), "bfloat16")
    with pytest.raises(F.FormatError, match="real numeric"):
        F.roundtrip(np.zeros(3, np.complex64), "bfloat16")
    with pytest.raises(F.FormatError, match="real numeric.*float8_e4m3fn"):
        F.roundtrip(np.zeros(3, ml_dtypes.float8_e4m3fn), "bfloat8_b")
    with pytest.raises(F.FormatError, match="do not hold"):
        F.decode_tiles(np.zeros(100, np.uint8), (32, 32), "bfloat8_b")


# ---------------------------------------------------------------------------------------------
# Live oracle (optional): fresh random inputs through the real wheel in its own venv
# ---------------------------------------------------------------------------------------------

ORACLE_PY = os.environ.get("TTNN_ORACLE_PYTHON", "/work/ttnn-venv/bin/python")


def test_live_oracle_fresh_random_inputs(tmp_path):
    if not os.path.exists(ORACLE_PY):
        pytest.skip(f"no ttnn oracle interpreter at {ORACLE_PY} (set TTNN_ORACLE_PYTHON; see tools/ttnn_oracle/README.md)")
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    inputs = {
        "x:mixed": (rng.standard_normal((3, 37, 50)) * np.exp(rng.uniform(-15, 15, (3, 37, 50)))).astype(np.float32),
        "x:bits": rng.integers(0, 2**32, (40, 48), dtype=np.uint64).astype(np.uint32).view(np.float32),
        "x:f64": rng.standard_normal((33, 20)),
        "x:f16bits": rng.integers(0, 2**16, (5, 37, 19)).astype(np.uint16).view(np.float16),  # NaN in the tail
        "bf16:bf16bits": rng.integers(0, 2**16, (2, 45, 70)).astype(np.uint16),  # bit patterns of a bf16 input
    }
    inputs["x:f64"][rng.random((33, 20)) < 0.1] = np.nan  # 660 = 41 * 16 + 4: NaN in torch's tail too
    src, dst = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(src, **inputs)
    r = subprocess.run([ORACLE_PY, str(ORACLE), str(src), str(dst)], capture_output=True, text=True, timeout=120)
    if r.returncode and "No module named" in r.stderr:  # one interpreter start: imports are slow (torch)
        pytest.skip(f"{ORACLE_PY} cannot run the oracle: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    out = np.load(dst)
    for name, x in inputs.items():
        kind, _, case = name.partition(":")
        x = x.view(ml_dtypes.bfloat16) if kind == "bf16" else x
        for d in ("float32",) + ALL:
            key = f"{case}:{d}"
            assert np.array_equal(bits(F.roundtrip(x, d)), bits(out[key])), key
            assert np.array_equal(F.encode_tiles(x, d).reshape(-1), out[key + ":bytes"]), key
