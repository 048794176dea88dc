"""Generate tests/tt/golden/formats_golden.npz from the real ttnn wheel (see README.md here).

Run with the ttnn venv's interpreter (Python 3.12, ttnn==0.81.1, torch); it imports nothing from
the project, so the golden values are the wheel's output alone. Deterministic (fixed seeds).

Layout of the .npz: ``x:<case>`` input array (its own dtype: float32 unless the case tests another
input dtype); ``xdtype:<case>`` = "bfloat16" where ``x`` holds the uint16 bit patterns of a
``torch.bfloat16`` input (NumPy has no bfloat16; view them as ``ml_dtypes.bfloat16``);
``y:<case>:<dtype>`` the wheel's ``to_torch(from_torch(x, dtype, TILE))`` as float32;
``pad:<case>`` the ``pad_value`` passed (absent = None); ``b:<case>:<dtype>`` uint8 tile byte image
for some cases; ``meta`` a JSON string with versions.

Targets: bfloat16, bfloat8_b and bfloat4_b for every case (only the bfp two for the bf16 copies of
the float32 cases); float32 as well for most inputs that are not float32 (see FLOAT32_ALSO).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
import oracle  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(REPO, "tests", "tt", "golden", "formats_golden.npz")
DTYPES = ("bfloat16", "bfloat8_b", "bfloat4_b")
BFP = ("bfloat8_b", "bfloat4_b")
F32 = np.float32
# float32 as a target where it says something: every non-float32 input but the bf16 copies of the
# float32 cases and small ints (exact either way). The bf16 copies get only the bfp targets: to
# bfloat16 and float32 a bf16 input is the identity / exact widening (bf16in_random_bits etc. show it).
FLOAT32_ALSO = ("nonfinite", "random_bits", "shape_scalar")
NO_FLOAT32 = ("in_int32_small", "in_uint8", "in_int8", "in_int16", "in_uint16", "in_bool")


def f(bits):
    return np.asarray(bits, dtype=np.uint32).view(F32)


def cases():
    rng = np.random.default_rng(20261129)
    S = (32, 64)  # two tiles: 128 blocks per case
    n = S[0] * S[1]
    sgn = lambda shape: rng.choice([-1.0, 1.0], shape)  # noqa: E731
    c = {}
    c["normal"] = rng.standard_normal(S)
    c["uniform"] = rng.uniform(-1, 1, S)
    c["wide_e20"] = np.exp(rng.uniform(-20, 20, S)) * sgn(S)
    c["tiny_1e-30"] = rng.standard_normal(S) * 1e-30
    c["huge_1e37"] = rng.standard_normal(S) * 1e37
    c["outliers_x1000"] = rng.standard_normal(S) * np.where(rng.random(S) < 0.02, 1000.0, 1.0)
    c["one_outlier_per_block"] = rng.standard_normal(S) * np.where(
        (np.arange(S[1]) % 16 == rng.integers(0, 16, (S[0], 1))), 2.0 ** rng.integers(3, 12, (S[0], 1)), 1.0)
    z = rng.standard_normal(S)
    z[rng.random(S) < 0.3] = 0.0
    z[rng.random(S) < 0.1] = -0.0
    c["zeros30_negzero"] = z
    c["all_zero_blocks"] = np.where((np.arange(S[1]) // 16 % 2 == 0)[None, :], 0.0, -0.0) * np.ones(S)
    # Random finite FP32 bit patterns (every exponent, subnormals included).
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits = np.where((bits & 0x7F800000) == 0x7F800000, bits & 0xBFFFFFFF, bits)
    c["random_bits"] = f(bits).reshape(S)
    # Values at exact ties of the bfloat16 grid (both parities) and off by one ulp.
    b16 = (rng.integers(0x3C00, 0x4300, n).astype(np.uint32) << 16) | 0x8000
    b16 = b16 + rng.choice([0, 0, 1, 0xFFFFFFFF], n).astype(np.uint32)
    c["bf16_ties"] = (f(b16) * sgn(n)).reshape(S)
    # Ties of the bfp grids: each row-block has max in [1, 2) and elements on half-steps of the
    # bfp8 / bfp4 grid, some with low FP32 bits set (which the truncating alignment must ignore).
    for name, w in (("bfp8_ties", 7), ("bfp4_ties", 3)):
        step = 2.0 ** -(w - 1)
        k = rng.integers(0, 2**w, S) + 0.5
        v = k * step * 2.0 ** -rng.integers(0, 4, S)
        v = f(v.astype(F32).view(np.uint32) | rng.choice([0, 0, 1, 3], S).astype(np.uint32))
        v = v * sgn(S)
        v[:, ::16] = 1.0 + rng.integers(0, 2**w, (S[0], S[1] // 16)) * step  # block max, exponent 127
        c[name] = v
    # Block maxima just below a power of two: they round up and must saturate.
    sat = rng.standard_normal(S) * 0.5
    sat[:, ::16] = f(rng.integers(0x3FFE0000, 0x40000000, (S[0], S[1] // 16)).astype(np.uint32))
    c["saturation"] = sat * sgn(S)
    # Around the bottom of the normal range: decoded values below it flush to zero.
    e = rng.integers(1, 12, S).astype(np.uint32)
    c["near_min_normal"] = (f((e << 23) | rng.integers(0, 1 << 23, S).astype(np.uint32)) * sgn(S))
    sub = f(rng.integers(1, 1 << 23, S).astype(np.uint32)) * sgn(S)
    sub[rng.random(S) < 0.3] = f(0x00800000) * 3.0
    c["subnormals"] = sub
    # Non-finite values: ttnn defines them on the host (bf16: NaN -> 0x7FC00000; bfp: inf/NaN
    # takes exponent 255 and flushes the rest of its block).
    nf = (rng.standard_normal(S) * 1e30).astype(F32)  # float32 throughout: keep NaN payloads
    special = np.array([np.inf, -np.inf, np.nan, -np.nan, f(0x7F800001), f(0x7FBFFFFF), f(0xFFC00001),
                        f(0x7FFFFFFF), 3.4e38, -3.4e38], dtype=F32)
    m = rng.random(S) < 0.05
    nf[m] = special[rng.integers(0, len(special), int(m.sum()))]
    c["nonfinite"] = nf
    # Power-of-two scalings of one pattern (scale invariance must hold in the data).
    base = rng.standard_normal((4, 64))
    c["pow2_scaled"] = np.concatenate([base * 2.0**s for s in (-100, -7, 0, 1, 60, 100, 120, 126)], 0)
    out = {k: np.asarray(v, dtype=F32) for k, v in c.items()}
    # Odd shapes (1-D, N-D, non-multiples of 32), each row scaled differently.
    for shp in [(), (1,), (7,), (33,), (100,), (3, 5, 7), (1, 1, 31, 33), (65, 17), (2, 2, 40, 35), (2, 64, 32)]:
        x = rng.standard_normal(shp) * (np.exp(rng.uniform(-3, 3, shp[:-1] + (1,))) if len(shp) else 1.0)
        out["shape_" + "x".join(map(str, shp)) if shp else "shape_scalar"] = np.asarray(x, dtype=F32)
    # Other input dtypes (ttnn routes them through bfloat16).
    x = rng.standard_normal((32, 48))
    out["in_float64"] = x * np.exp(rng.uniform(-8, 8, x.shape))
    out["in_float64_doubleround"] = np.full((2, 32), 1 + 2.0**-8 + 2.0**-40) * np.array([[1.0], [-3.0]])
    out["in_float16"] = (x * 100).astype(np.float16)
    out["in_int32"] = rng.integers(-2**31, 2**31 - 1, (32, 48), dtype=np.int64).astype(np.int32)
    out["in_int32_small"] = rng.integers(-300, 300, (32, 48)).astype(np.int32)
    out["in_int64"] = rng.integers(-2**40, 2**40, (32, 48), dtype=np.int64)
    out["in_uint8"] = rng.integers(0, 256, (32, 48)).astype(np.uint8)
    out["in_int8"] = rng.integers(-128, 128, (32, 48)).astype(np.int8)
    out["in_int16"] = rng.integers(-2**15, 2**15, (32, 48)).astype(np.int16)
    out["in_uint16"] = rng.integers(0, 2**16, (32, 48)).astype(np.uint16)
    out["in_uint32"] = rng.integers(0, 2**32, (32, 48), dtype=np.uint64).astype(np.uint32)
    out["in_bool"] = rng.random((32, 48)) < 0.5
    return out


def bf16_bits(x):
    """float32 -> bfloat16 bit patterns (uint16): RNE; a NaN keeps its sign and top payload bits and is
    made quiet. (torch's own cast rewrites NaNs as 0xFFFF or 0x7FC0: no bf16 payloads to test.)"""
    u = np.asarray(x, dtype=F32).view(np.uint32)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 0x40, r).astype(np.uint16)


def _specials_at_positions(rng, base, specials):
    """Put ``specials`` (bit patterns) into ``base`` [R, C] (uint16 patterns) at positions that walk
    every place of a 16-value block, over every face of every tile: one special in most blocks, two
    in some, whole-NaN blocks, and the largest finite value next to an inf."""
    x = base.copy()
    R, C = x.shape
    for r in range(R):
        for b in range(C // 16):
            blk = x[r, 16 * b:16 * b + 16]
            k = r * (C // 16) + b
            if k % 7 == 6:
                continue  # some blocks stay finite
            p = (r * 7 + b * 5) % 16
            blk[p] = specials[k % len(specials)]
            if k % 5 == 0:
                blk[(p + 8) % 16] = specials[(k // 5) % len(specials)]
            if k % 23 == 3:
                blk[:] = specials[2]  # a block of NaN
            if k % 19 == 4:
                blk[(p + 1) % 16] = specials[-2]  # largest finite next to the special
    return x


BF16_FROM_F32 = ("normal", "wide_e20", "tiny_1e-30", "huge_1e37", "outliers_x1000", "one_outlier_per_block",
                 "zeros30_negzero", "bfp8_ties", "bfp4_ties", "saturation", "near_min_normal", "subnormals",
                 "nonfinite", "pow2_scaled", "shape_scalar", "shape_7", "shape_3x5x7", "shape_65x17")
BF16_SPECIALS = np.array([0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA0, 0xFFE0,
                          0x7F7F, 0xFF7F], dtype=np.uint16)
F16_SPECIALS = np.array([0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7DFF, 0xFFFF, 0x7D00, 0xFE01,
                         0x7BFF, 0xFBFF], dtype=np.uint16)


def bf16_cases(f32_cases):
    """bfloat16 inputs, as uint16 bit patterns: the float32 cases rounded to bf16, plus cases of
    their own (every bit pattern, subnormals, inf/NaN at every block position, exponent extremes)."""
    rng = np.random.default_rng(20261201)
    S = (32, 64)
    c = {"bf16in_" + name: bf16_bits(f32_cases[name]) for name in BF16_FROM_F32}
    c["bf16in_random_bits"] = rng.integers(0, 2**16, S).astype(np.uint16)  # inf/NaN included
    sign = lambda shape: (rng.random(shape) < 0.5).astype(np.uint16) << 15  # noqa: E731
    sub = rng.integers(1, 0x80, S).astype(np.uint16)  # exponent field 0
    normal = (rng.integers(1, 4, S).astype(np.uint16) << 7) | rng.integers(0, 0x80, S).astype(np.uint16)
    sub = np.where(rng.random(S) < 0.3, normal, sub)
    sub[:, 32:48] = rng.integers(1, 0x80, (S[0], 16))  # blocks of subnormals only
    c["bf16in_subnormal_bits"] = sub | sign(S)
    finite = bf16_bits(rng.standard_normal((64, 64)) * 1e3)
    c["bf16in_nonfinite_positions"] = _specials_at_positions(rng, finite, BF16_SPECIALS)
    # Each block: a top exponent field from the list, the others up to 12 below it (clipped at 0).
    top = np.array([254, 253, 200, 140, 127, 60, 12, 3, 2, 1])[rng.integers(0, 10, (S[0], S[1] // 16))]
    e = np.clip(np.repeat(top, 16, axis=1) - rng.integers(0, 13, S), 0, 254)
    e[:, ::16] = top
    c["bf16in_exponent_extremes"] = (e.astype(np.uint16) << 7) | rng.integers(0, 0x80, S).astype(np.uint16) | sign(S)
    return c


def f16_cases():
    """float16 inputs: every bit pattern, bf16 ties, subnormals, inf/NaN at every block position, and
    NaNs in torch's scalar tail (the last n % 8 elements of the flat array)."""
    rng = np.random.default_rng(20261202)
    S = (32, 64)
    sign = lambda shape: (rng.random(shape) < 0.5).astype(np.uint16) << 15  # noqa: E731
    h = lambda bits: np.asarray(bits, dtype=np.uint16).view(np.float16)  # noqa: E731
    c = {"f16in_random_bits": h(rng.integers(0, 2**16, S))}
    c["f16in_normal"] = (rng.standard_normal(S) * np.exp(rng.uniform(-12, 10, S))).astype(np.float16)
    # Ties of the bfloat16 grid (3 dropped mantissa bits = 100), both parities, and one off.
    low = rng.choice([4, 4, 3, 5], S).astype(np.uint16)
    c["f16in_bf16_ties"] = h((rng.integers(1, 31, S).astype(np.uint16) << 10)
                             | (rng.integers(0, 128, S).astype(np.uint16) << 3) | low | sign(S))
    sub = rng.integers(1, 1024, S).astype(np.uint16)
    sub = np.where(rng.random(S) < 0.3, (rng.integers(1, 4, S).astype(np.uint16) << 10) | sub, sub)
    c["f16in_subnormals"] = h(sub | sign(S))
    finite = (rng.standard_normal((64, 64)) * 100).astype(np.float16).view(np.uint16)
    c["f16in_nonfinite_positions"] = h(_specials_at_positions(rng, finite, F16_SPECIALS))
    nan_mix = F16_SPECIALS[rng.integers(0, len(F16_SPECIALS), (3, 37))]
    c["f16in_nan_tail"] = h(np.where(rng.random((3, 37)) < 0.8, nan_mix, 0x3C00 | sign((3, 37))))
    c["f16in_nan_1x7"] = h(F16_SPECIALS[:7].reshape(1, 7))
    return c


def f64_cases():
    """float64 inputs with inf/NaN: torch's cast to bf16 writes NaN differently in its scalar tail."""
    rng = np.random.default_rng(20261203)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 1e300, -1e300, 1e-300, 1e-40, 3.4e38,
                         1 + 2.0**-8 + 2.0**-40])
    x = rng.standard_normal((3, 37))
    m = rng.random((3, 37)) < 0.6
    x[m] = specials[rng.integers(0, len(specials), int(m.sum()))]
    x.view(np.uint64)[2, -4:] = [0x7FF0000000000001, 0xFFF8000000000001, 0x7FF4000000000000, 0x7FF8000000000000]
    y = rng.standard_normal((32, 64)) * 1e30
    m = rng.random((32, 64)) < 0.05
    y[m] = specials[rng.integers(0, len(specials), int(m.sum()))]
    return {"in_float64_nan_tail": x, "in_float64_nonfinite": y}


PAD_CASES = {  # case -> (shape, pad_value)
    "pad_1000": ((5, 20), 1000.0), "pad_-inf": ((5, 20), -np.inf), "pad_nan": ((3, 40), np.nan),
    "pad_0.5": ((33, 17), 0.5),
}
# Pad values that bfloat16 rounds across a binade or to inf, per input dtype: case -> (shape, pad, input)
PAD_INPUT_CASES = {
    "pad_f32_0.99999994": ((5, 20), 0x3F7FFFFF, "float32"), "pad_f32_f32max": ((5, 20), 0x7F7FFFFF, "float32"),
    "pad_bf16_0.99999994": ((5, 20), 0x3F7FFFFF, "bfloat16"), "pad_bf16_f32max": ((5, 20), 0x7F7FFFFF, "bfloat16"),
    "pad_bf16_0.1": ((33, 17), 0x3DCCCCCD, "bfloat16"), "pad_bf16_nan": ((3, 40), 0x7FC00000, "bfloat16"),
    "pad_f16_0.99999994": ((5, 20), 0x3F7FFFFF, "float16"), "pad_f64_0.99999994": ((5, 20), 0x3F7FFFFF, "float64"),
    "pad_f64_f32max": ((5, 20), 0x7F7FFFFF, "float64"),
}
BYTE_CASES = ("normal", "nonfinite", "zeros30_negzero", "shape_65x17")
BYTE_CASES_ALL_TARGETS = ("bf16in_nonfinite_positions", "bf16in_random_bits", "f16in_random_bits",
                          "f16in_nan_tail", "in_float64_nan_tail", "pad_f32_0.99999994", "pad_bf16_0.99999994",
                          "pad_bf16_nan")


def pad_input(rng, shape, kind):
    """Rows whose shared exponent shows the pad's: values just below 1, near the float32 maximum (for
    float16: near its own), ordinary, tiny."""
    R = shape[0]
    scale = np.array([1.0, 2e38 if kind != "float16" else 6e4, 1.0, 2.0**-100])[np.arange(R) % 4][:, None]
    x = np.where((np.arange(R) % 4 == 2)[:, None], rng.standard_normal(shape), rng.uniform(0.55, 1.0, shape)) * scale
    if kind == "bfloat16":
        return bf16_bits(x)
    return x.astype({"float32": F32, "float16": np.float16, "float64": np.float64}[kind])


def add_case(data, name, x, pad=None, bf16=False, targets=None):
    """Store input ``x`` (uint16 bit patterns if ``bf16``) and the wheel's outputs for ``targets``."""
    data["x:" + name] = x
    if bf16:
        data["xdtype:" + name] = np.array("bfloat16")
    if pad is not None:
        data["pad:" + name] = np.float32(pad)
    inp = oracle.bf16(x) if bf16 else x
    pv = None if pad is None else float(np.float32(pad))
    if targets is None:
        copy = name.startswith("bf16in_") and name[7:] in BF16_FROM_F32
        wanted = bf16 or x.dtype != F32 or name in FLOAT32_ALSO + BYTE_CASES_ALL_TARGETS
        f32 = wanted and not copy and name not in NO_FLOAT32
        targets = BFP if copy else DTYPES + (("float32",) if f32 else ())
    for d in targets:
        data[f"y:{name}:{d}"] = oracle.roundtrip(inp, d, pad_value=pv)
    byte_targets = ()
    if name in BYTE_CASES:
        byte_targets = DTYPES
    elif name in BYTE_CASES_ALL_TARGETS:
        byte_targets = ("float32",) + DTYPES
    for d in byte_targets:
        data[f"b:{name}:{d}"] = oracle.tile_bytes(inp, d, pad_value=pv)


def main():
    rng = np.random.default_rng(7)
    data = {}
    f32_cases = cases()
    for name, x in f32_cases.items():
        add_case(data, name, x)
    for name, (shp, pv) in PAD_CASES.items():
        add_case(data, name, (rng.standard_normal(shp) * 0.01).astype(F32), pad=pv, targets=DTYPES)
    for name, x in bf16_cases(f32_cases).items():
        add_case(data, name, x, bf16=True)
    for name, x in {**f16_cases(), **f64_cases()}.items():
        add_case(data, name, x)
    prng = np.random.default_rng(8)
    for name, (shp, pbits, kind) in PAD_INPUT_CASES.items():
        pv = np.uint32(pbits).view(F32)
        add_case(data, name, pad_input(prng, shp, kind), pad=pv, bf16=kind == "bfloat16")
    meta = dict(oracle.versions(), generator="tools/ttnn_oracle/gen_golden.py",
                cluster="tools/ttnn_oracle/wormhole_n150_mock.yaml")
    data["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT}: {len(data)} arrays, {os.path.getsize(OUT) / 1024:.0f} KiB, {meta}")


if __name__ == "__main__":
    main()
