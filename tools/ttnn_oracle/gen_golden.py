"""Generate tests/tt/golden/formats_golden.npz from the real ttnn wheel (see README.md here).

Run with the ttnn venv's interpreter (Python 3.12, ttnn==0.81.1, torch); it imports nothing from
the project, so the golden values are the wheel's output alone. Deterministic (fixed seeds).

Layout of the .npz: ``x:<case>`` input array (its own dtype: float32 unless the case tests another
input dtype); ``y:<case>:<dtype>`` the wheel's ``to_torch(from_torch(x, dtype, TILE))`` as float32;
``pad:<case>`` the ``pad_value`` passed (absent = None); ``b:<case>:<dtype>`` uint8 tile byte image
for some float32 cases; ``meta`` a JSON string with versions.
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
F32 = np.float32


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


PAD_CASES = {  # case -> (shape, pad_value)
    "pad_1000": ((5, 20), 1000.0), "pad_-inf": ((5, 20), -np.inf), "pad_nan": ((3, 40), np.nan),
    "pad_0.5": ((33, 17), 0.5),
}
BYTE_CASES = ("normal", "nonfinite", "zeros30_negzero", "shape_65x17")


def main():
    rng = np.random.default_rng(7)
    data = {}
    for name, x in cases().items():
        data["x:" + name] = x
        for d in DTYPES:
            data[f"y:{name}:{d}"] = oracle.roundtrip(x, d)
        if name in BYTE_CASES:
            for d in DTYPES:
                data[f"b:{name}:{d}"] = oracle.tile_bytes(x, d)
    for name, (shp, pv) in PAD_CASES.items():
        x = (rng.standard_normal(shp) * 0.01).astype(F32)
        data["x:" + name] = x
        data["pad:" + name] = np.float32(pv)
        for d in DTYPES:
            data[f"y:{name}:{d}"] = oracle.roundtrip(x, d, pad_value=float(pv))
    meta = dict(oracle.versions(), generator="tools/ttnn_oracle/gen_golden.py",
                cluster="tools/ttnn_oracle/wormhole_n150_mock.yaml")
    data["meta"] = np.array(json.dumps(meta))
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT}: {len(data)} arrays, {os.path.getsize(OUT) / 1024:.0f} KiB, {meta}")


if __name__ == "__main__":
    main()
