"""DeepSeek QDQ (`jaxmodels/layers/qdq.py`) and FP8/FP4/E8M0 codecs (`converters/deepseek_quant.py`).

Expected values come from formulas written here, on a different code path from the implementation:
the e4m3 / e2m1 grids are enumerated from their bit layouts and rounded by nearest-grid-point search with
an explicit ties-to-even-code rule, scales come from frexp rather than fp32 bit fiddling, and (when torch
is importable) from a torch transcription of REF41-ker's formulas, which uses torch's own float8 casts.
Spec: specs/deepseek_v4.md §2, §10.2, §12 trap 9.
"""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from converters import deepseek_quant as dq
from jaxmodels.layers import qdq
from tests import quant_encoders as enc

BF16 = ml_dtypes.bfloat16
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
# jitted once per shape: eager op-by-op dispatch is slow on a loaded CI machine
act_quant = jax.jit(qdq.act_quant_fp8, static_argnames=("block", "return_scale"))
fp4_quant = jax.jit(qdq.fp4_act_quant, static_argnames=("block", "scale_fmt", "return_codes"))


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def assert_same_floats(got, want):
    """Bit-identical, except that NaNs only need to be NaN in the same places (their sign is meaningless)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(bits(got)[~nan], bits(want)[~nan])


# ---- independent reference formulas ----

def e4m3_value(byte: int) -> float:
    """e4m3fn from its bit layout: s eeee mmm, bias 7, subnormals at e=0, S.1111.111 = NaN, no inf."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return math.nan
    mag = math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7)
    return -mag if s else mag


E4M3_VALUES = np.array([e4m3_value(b) for b in range(256)])  # float64
E4M3_POS = E4M3_VALUES[:127]  # codes 0..126: 0 .. 448, increasing
E2M1_POS = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
E2M1_VALUES = np.concatenate([E2M1_POS, -E2M1_POS])


def round_to_grid(v, grid):
    """Nearest grid point (grid ascending, codes 0..n-1 non-negative); a tie goes to the even code."""
    v = np.asarray(v, np.float64)
    mag = np.abs(v)
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = mag - grid[lo], grid[hi] - mag
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.where(np.signbit(v), -grid[pick], grid[pick]), pick


def pow2ceil_ref(p):
    """2^ceil(log2 p) for positive float32 p, via frexp (p = m 2^k, m in [0.5, 1))."""
    m, k = np.frexp(np.asarray(p, np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, k - 1, k))


def act_quant_ref(x_bf16, block=32):
    x = x_bf16.astype(np.float32).reshape(*x_bf16.shape[:-1], -1, block)
    amax = np.maximum(np.abs(x).max(-1), np.float32(1e-4))
    s = pow2ceil_ref(amax * np.float32(1 / 448))  # fp32 multiply by the fp32 reciprocal, as the kernel
    v = np.clip(x.astype(np.float64) / s[..., None], -448, 448)  # exact: s is a power of two
    q, _ = round_to_grid(v, E4M3_POS)
    y = (q * s[..., None]).astype(np.float32).astype(BF16)
    return y.reshape(x_bf16.shape), q.reshape(x_bf16.shape), s


def fp4_quant_ref(x_bf16, block, scale_fmt):
    x = x_bf16.astype(np.float32).reshape(*x_bf16.shape[:-1], -1, block)
    amax = np.abs(x).max(-1)
    if scale_fmt == "e4m3":
        amax = np.maximum(amax, np.float32(6 * 2.0 ** -9))
        s, _ = round_to_grid(np.clip(amax / np.float32(6), -448, 448), E4M3_POS)  # fp32 division, as the kernel
    else:
        amax = np.maximum(amax, np.float32(6 * 2.0 ** -126))
        s = pow2ceil_ref(amax * np.float32(1 / 6))
    v = np.clip(x / s[..., None].astype(np.float32), -6, 6)  # fp32 division (s e4m3 need not be a power of two)
    q, code = round_to_grid(v, E2M1_POS)
    code = code | (np.signbit(v) << 3)
    y = (q * s[..., None]).astype(np.float32).astype(BF16)
    return y.reshape(x_bf16.shape), code.reshape(x_bf16.shape), s


# ---- test data ----

def many_scales(rng, rows, n, block):
    """bf16 [rows, n] with per-block magnitudes from 2^-118 to 2^120, zero blocks, zeros, signed zeros,
    and exact e4m3 / e2m1 ties (values on the rounding midpoints, in units of the block's scale)."""
    x = rng.standard_normal((rows, n)) * np.exp2(rng.integers(-118, 120, (rows, n // block))).repeat(block, -1)
    x[rng.random((rows, n)) < 0.05] = 0.0
    x[0, :block] = 0.0  # an all-zero block: amax floor
    x[1, :block] = -0.0
    x[2, :block] *= 1e-30  # a block of tiny (normal bf16) values
    x[2, :block] = np.where(np.abs(x[2, :block]) < 2.0 ** -120, 2.0 ** -120, x[2, :block])
    x[3, :block] = rng.standard_normal(block) * 1e37  # huge
    return x


def fp8_ties(rng, rows, block):
    """Blocks whose amax is 300*2^k, so the scale is 2^k, filled with e4m3 midpoints * 2^k (bf16-exact)."""
    mids = (E4M3_POS[1:] + E4M3_POS[:-1]) / 2
    k = rng.integers(-40, 40, (rows, 1))
    x = rng.choice(mids[mids < 300], (rows, block)) * rng.choice([-1, 1], (rows, block))
    x[:, 0] = 300
    return (x * np.exp2(k)).astype(BF16)


def fp4_ties(rng, rows, block):
    """Blocks with amax 5.5*2^k (e8m0 scale 2^k) filled with e2m1 midpoints * 2^k."""
    mids = (E2M1_POS[1:] + E2M1_POS[:-1]) / 2
    k = rng.integers(-40, 40, (rows, 1))
    x = rng.choice(mids, (rows, block)) * rng.choice([-1, 1], (rows, block))
    x[:, 0] = 5.5
    return (x * np.exp2(k)).astype(BF16)


def test_reference_grids_are_right():
    """The enumerated grids agree with ml_dtypes' e4m3fn decoding (a third code path) and the spec's ties."""
    np.testing.assert_array_equal(
        E4M3_VALUES[~np.isnan(E4M3_VALUES)],
        np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)[~np.isnan(E4M3_VALUES)])
    assert E4M3_POS[-1] == 448 and E4M3_POS[1] == 2.0 ** -9 and np.all(np.diff(E4M3_POS) > 0)
    # spec §2: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    got, _ = round_to_grid([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0], E2M1_POS)
    np.testing.assert_array_equal(got, [0, 1, 1, 2, 2, 4, 4, -4])


def test_pow2ceil_and_e4m3_rne_helpers():
    rng = np.random.default_rng(0)
    p = np.concatenate([np.exp2(np.arange(-126, 128)), (1 + rng.random(5000)) * np.exp2(rng.integers(-126, 120, 5000)),
                        np.nextafter(np.exp2(np.arange(-120, 120.0)), np.inf)]).astype(np.float32)
    got = np.asarray(jax.jit(qdq.pow2ceil)(p))
    np.testing.assert_array_equal(got, pow2ceil_ref(p).astype(np.float32))
    # every e4m3 midpoint, its fp32 neighbours, and random values, both signs
    mids = ((E4M3_POS[1:] + E4M3_POS[:-1]) / 2).astype(np.float32)
    v = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e3)), E4M3_POS,
                        rng.uniform(-448, 448, 20000), rng.standard_normal(20000) * 1e-3]).astype(np.float32)
    v = np.concatenate([v, -v])
    want, _ = round_to_grid(v, E4M3_POS)
    np.testing.assert_array_equal(bits(np.asarray(jax.jit(qdq.e4m3_rne)(v))), bits(want.astype(np.float32)))
    # and ml_dtypes' own RNE cast
    np.testing.assert_array_equal(want, v.astype(ml_dtypes.float8_e4m3fn).astype(np.float64))


def test_div_short_is_one_ieee_rounding():
    """x / d for every positive e4m3 divisor (and 6), against NumPy's IEEE fp32 division."""
    rng = np.random.default_rng(13)
    d = np.concatenate([E4M3_POS[1:], [6.0]]).astype(np.float32)
    x = (rng.standard_normal((d.size, 400)) * np.exp2(rng.integers(-60, 60, (d.size, 400)))).astype(np.float32)
    x[:, :20] = ((E2M1_POS[1:] + E2M1_POS[:-1]) / 2).repeat(3)[:20] * d[:, None]  # exact ties of the quotient
    x[:, 20:40] = np.nextafter(x[:, :20], np.float32(np.inf))
    x[:, 40] = 0.0
    x[:, 41] = -0.0
    x[:, 42] = -x[:, 43]
    want = x / d[:, None]
    got = np.asarray(jax.jit(qdq._div_short)(x, d[:, None]))
    normal = np.abs(want) >= 2.0 ** -126
    np.testing.assert_array_equal(bits(got)[normal], bits(want)[normal])
    np.testing.assert_array_equal(got[~normal], 0.0)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_e2m1_codes_all_midpoints():
    mids = ((E2M1_POS[1:] + E2M1_POS[:-1]) / 2).astype(np.float32)
    v = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(7)),
                        E2M1_POS.astype(np.float32), np.linspace(0, 6, 1001, dtype=np.float32)])
    v = np.concatenate([v, -v])
    _, code = round_to_grid(v, E2M1_POS)
    want = code | (np.signbit(v) << 3)
    np.testing.assert_array_equal(np.asarray(jax.jit(qdq.e2m1_codes)(v)), want)
    np.testing.assert_array_equal(qdq.e2m1_codes(np.asarray(v, np.float32)), want)  # the host (NumPy) path


@pytest.mark.parametrize("seed", [0, 1])
def test_act_quant_fp8_bit_exact(seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([many_scales(rng, 64, 256, 32).astype(BF16),
                        fp8_ties(rng, 16, 32).reshape(2, 256)]).reshape(2, 33, 256)
    want_y, want_q, want_s = act_quant_ref(x)
    y = jax.jit(qdq.act_quant_fp8)(jnp.asarray(x))
    assert y.dtype == jnp.bfloat16 and y.shape == x.shape
    np.testing.assert_array_equal(bits(np.asarray(y)), bits(want_y))
    q, s = jax.jit(lambda a: qdq.act_quant_fp8(a, 32, return_scale=True))(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want_q)
    np.testing.assert_array_equal(np.signbit(np.asarray(q).astype(np.float32)), np.signbit(want_q))
    np.testing.assert_array_equal(np.asarray(s), want_s.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(qdq.e8m0_byte(s)), np.log2(want_s).astype(int) + 127)
    # the ties really are ties and were exercised
    tie_rows = x.reshape(-1, 256)[-2:].astype(np.float64).reshape(-1, 32)
    assert np.isin(np.abs(tie_rows[:, 1:]) / (tie_rows[:, :1] / 300),
                   (E4M3_POS[1:] + E4M3_POS[:-1]) / 2).all()


@pytest.mark.parametrize("scale_fmt,block", [("e8m0", 32), ("e4m3", 16)])
def test_fp4_act_quant_bit_exact(scale_fmt, block):
    rng = np.random.default_rng(7)
    x = np.concatenate([many_scales(rng, 64, 128, block).astype(BF16),
                        fp4_ties(rng, 32, 32).reshape(8, 128)]).reshape(4, 18, 128)
    if scale_fmt == "e4m3":  # e4m3 scales of amax/6: keep amax inside e4m3's range (2^-9 .. 448) * 6
        x = (x.astype(np.float32) * np.float32(2.0 ** -100)).astype(BF16)
        x = np.where(np.abs(x.astype(np.float32)) > 2000, BF16(2000), x)
    want_y, want_code, want_s = fp4_quant_ref(x, block, scale_fmt)
    f = jax.jit(lambda a: qdq.fp4_act_quant(a, block, scale_fmt))
    y = f(jnp.asarray(x))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(np.asarray(y)), bits(want_y))
    codes, s = jax.jit(lambda a: qdq.fp4_act_quant(a, block, scale_fmt, return_codes=True))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(codes), want_code)
    np.testing.assert_array_equal(np.asarray(s), want_s.astype(np.float32))


def test_fp4_e4m3_scale_ties_need_a_true_division():
    """e2m1 ties under non-power-of-two e4m3 scales: x / s must be one IEEE division (x * (1/s) misses ties)."""
    rng = np.random.default_rng(12)
    mids = (E2M1_POS[1:] + E2M1_POS[:-1]) / 2
    s = rng.choice(E4M3_POS[(E4M3_POS > 2.0 ** -6) & (E4M3_POS < 64)], (256, 1))
    x = rng.choice(mids, (256, 16)) * rng.choice([-1, 1], (256, 16)) * s
    x[:, 0] = 6 * s[:, 0]  # amax / 6 = s exactly
    x = x.astype(BF16)
    assert np.array_equal(x.astype(np.float64)[:, 1:] / s, np.round(x.astype(np.float64)[:, 1:] / s * 4) / 4)
    xf = x.astype(np.float32)
    assert np.any(xf * (np.float32(1) / s.astype(np.float32)) != xf / s.astype(np.float32))  # the trap is live
    want_y, want_code, want_s = fp4_quant_ref(x, 16, "e4m3")
    np.testing.assert_array_equal(want_s, s)
    codes, _ = jax.jit(lambda a: qdq.fp4_act_quant(a, 16, "e4m3", return_codes=True))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(codes), want_code)
    np.testing.assert_array_equal(bits(np.asarray(jax.jit(lambda a: qdq.fp4_act_quant(a, 16, "e4m3"))(x))),
                                  bits(want_y))


def test_fp4_e4m3_scale_path_with_small_and_clamped_amax():
    """All-zero / tiny blocks hit the 6*2^-9 floor; a block whose x/s exceeds 6 after rounding s down clamps."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    x[0] = 0
    x[1] *= 1e-6
    x[2, :16] = np.float32(6.2)  # amax/6 = 1.0333 rounds down to e4m3 1.0 -> x/s = 6.2 > 6, clamps
    x = x.astype(BF16)
    want_y, want_code, _ = fp4_quant_ref(x, 16, "e4m3")
    np.testing.assert_array_equal(bits(np.asarray(fp4_quant(jnp.asarray(x), 16, "e4m3"))), bits(want_y))
    assert (want_code[2, :16] & 7 == 7).all() and (want_code[0] == 0).all()


def test_against_torch_transcription_of_the_kernel():
    """REF41-ker's formulas transcribed with torch's own float8 casts (a third rounding implementation)."""
    torch = pytest.importorskip("torch")
    fp8_inv = torch.tensor(1.0 / 448, dtype=torch.float32)
    fp4_inv = torch.tensor(1.0 / 6, dtype=torch.float32)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    tie_up = torch.tensor([False, True, False, True, False, True, False])
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    table = torch.cat([table, -table])

    def frs(amax, inv):
        b = (amax.float() * inv).contiguous().view(torch.int32)
        e = ((b >> 23) & 0xFF) - 127 + ((b & ((1 << 23) - 1)) != 0).to(torch.int32)
        return ((e + 127) << 23).view(torch.float32)

    def t_act(x, bs=32):
        xg = x.float().unflatten(-1, (-1, bs))
        s = frs(xg.abs().amax(-1).clamp_min(1e-4), fp8_inv)
        q = (xg / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
        return (q.float() * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)

    def t_fp4(x, bs, fmt):
        xg = x.float().unflatten(-1, (-1, bs))
        amax = xg.abs().amax(-1)
        if fmt == "e4m3":
            s = (amax.clamp_min(6 * 2 ** -9) / 6.0).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        else:
            s = frs(amax.clamp_min(6 * 2 ** -126), fp4_inv)
        v = (xg / s.unsqueeze(-1)).clamp(-6, 6)
        mag = v.abs().unsqueeze(-1)
        code = (mag > mids).sum(-1) + ((mag == mids) & tie_up).sum(-1)
        code = code | (torch.signbit(v).long() << 3)
        return (table[code] * s.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)

    def to_np(t):
        return t.view(torch.int16).numpy().view(np.uint16)

    rng = np.random.default_rng(11)
    x = np.concatenate([many_scales(rng, 32, 128, 32).astype(BF16), fp8_ties(rng, 4, 32).reshape(1, 128),
                        fp4_ties(rng, 4, 32).reshape(1, 128)])
    xt = torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    np.testing.assert_array_equal(bits(np.asarray(act_quant(jnp.asarray(x)))), to_np(t_act(xt)))
    np.testing.assert_array_equal(bits(np.asarray(fp4_quant(jnp.asarray(x), 32, "e8m0"))),
                                  to_np(t_fp4(xt, 32, "e8m0")))
    xs = (x.astype(np.float32) * np.float32(2.0 ** -100)).clip(-2000, 2000).astype(BF16)
    xst = torch.from_numpy(xs.view(np.int16).copy()).view(torch.bfloat16)
    np.testing.assert_array_equal(bits(np.asarray(fp4_quant(jnp.asarray(xs), 16, "e4m3"))),
                                  to_np(t_fp4(xst, 16, "e4m3")))


def test_qdq_rejects_ragged_blocks():
    with pytest.raises(ValueError, match="multiple of the quantisation block"):
        qdq.act_quant_fp8(jnp.zeros((2, 48), jnp.bfloat16), 32)


# ---- checkpoint codecs ----

SCALE_BYTES = np.array([0, 1, 9, 100, 119, 120, 126, 127, 128, 135, 200, 254], np.uint8)


def test_e8m0_reads_raw_bytes_from_every_container():
    torch = pytest.importorskip("torch")
    b = np.arange(255, dtype=np.uint8)
    want = np.array([math.ldexp(1.0, int(v) - 127) for v in b]).astype(np.float32)
    for s in (b, b.view(np.int8), b.view(ml_dtypes.float8_e8m0fnu),
              torch.from_numpy(b.copy()).view(torch.float8_e8m0fnu)):
        np.testing.assert_array_equal(bits(dq.e8m0_to_float(s)), bits(want))
    assert np.isnan(dq.e8m0_to_float(np.array([255], np.uint8)))[0]
    # the trap the raw view avoids: a numeric cast of 2^-7 to uint8 gives 0
    assert np.asarray(b[120:121].view(ml_dtypes.float8_e8m0fnu), np.uint8)[0] == 0
    with pytest.raises(TypeError, match="E8M0"):
        dq.e8m0_bytes(want)


@pytest.mark.parametrize("block", [32, 128])
def test_dequant_fp8_all_bytes_bit_exact(block):
    """Every e4m3 byte under every listed scale byte, against the bit-layout formula; ragged edge blocks."""
    o, i = block + 5, 256 * 2 + 7  # ceil-divided scale grid
    rng = np.random.default_rng(block)
    w = np.tile(np.arange(256, dtype=np.uint8), (o * i) // 256 + 1)[: o * i]
    w = rng.permutation(w).reshape(o, i)
    w[0, :256] = np.arange(256)
    grid = rng.choice(SCALE_BYTES, (-(-o // block), -(-i // block))).astype(np.uint8)
    grid.flat[: len(SCALE_BYTES)] = SCALE_BYTES
    s_el = np.repeat(np.repeat(grid, block, 0), block, 1)[:o, :i].astype(np.int64)
    want = (E4M3_VALUES[w] * np.ldexp(1.0, s_el - 127)).astype(np.float32)
    for wq in (w, w.view(ml_dtypes.float8_e4m3fn)):
        got = dq.dequant_fp8_blocks(wq, grid.view(ml_dtypes.float8_e8m0fnu), block)
        assert got.dtype == np.float32 and got.shape == (o, i)
        assert_same_floats(got, want)
    got = dq.dequant_fp8_blocks(w, grid, (block, block))
    assert_same_floats(got, want)
    # JAX dequant inside params: bit-exact where the product is a normal float32 (XLA:CPU flushes subnormals)
    normal = np.isfinite(want) & ((np.abs(want) >= 2.0 ** -126) | (want == 0)) & (s_el > 0)  # 2^-127: subnormal
    jdq = jax.jit(lambda a, b: qdq.dequant_fp8(a, b, block))
    for wq, sc in ((w.view(ml_dtypes.float8_e4m3fn), grid), (w, grid.view(ml_dtypes.float8_e8m0fnu))):
        jgot = np.asarray(jdq(wq, sc))  # e4m3 as itself or raw bytes; E8M0 as bytes or float8_e8m0fnu
        np.testing.assert_array_equal(bits(jgot)[normal], bits(want)[normal])
    with pytest.raises(TypeError, match="raw bytes"):
        qdq.dequant_fp8(w.view(ml_dtypes.float8_e4m3fn), grid.astype(np.float32), block)


def test_dequant_fp8_shape_errors():
    w = np.zeros((64, 96), np.uint8)
    with pytest.raises(ValueError, match=r"scale shape \(2, 2\).*expected \(2, 3\)"):
        dq.dequant_fp8_blocks(w, np.zeros((2, 2), np.uint8), 32)
    with pytest.raises(TypeError, match="FP8"):
        dq.dequant_fp8_blocks(w.astype(np.float32), np.zeros((2, 3), np.uint8), 32)
    with pytest.raises(ValueError, match="expected"):
        dq.dequant_fp4_experts(np.zeros((4, 16), np.int8), np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="expected"):
        dq.dequant_fp8_rows(np.zeros((4, 64), np.uint8), np.zeros((4, 3), np.uint8))
    with pytest.raises(ValueError, match="expected"):
        qdq.dequant_fp8(jnp.zeros((64, 96), jnp.float8_e4m3fn), jnp.zeros((2, 2), jnp.uint8), 32)


def test_dequant_fp4_all_bytes_bit_exact():
    o, i = 12, 1024
    rng = np.random.default_rng(5)
    p = rng.integers(0, 256, (o, i // 2)).astype(np.uint8)
    p[0, :256] = np.arange(256)
    sc = rng.choice(SCALE_BYTES, (o, i // 32)).astype(np.uint8)
    codes = np.empty((o, i), np.int64)
    codes[:, 0::2], codes[:, 1::2] = p & 15, p >> 4  # low nibble = even element
    want = (E2M1_VALUES[codes] * np.ldexp(1.0, np.repeat(sc, 32, 1).astype(np.int64) - 127)).astype(np.float32)
    want[codes == 8] = -0.0
    for packed in (p, p.view(np.int8)):
        got = dq.dequant_fp4_experts(packed, sc)
        assert_same_floats(got, want)
    normal = ((np.abs(want) >= 2.0 ** -126) | (want == 0)) & (np.repeat(sc, 32, 1) > 0)
    jgot = np.asarray(jax.jit(qdq.dequant_fp4)(p.view(np.int8), sc))
    np.testing.assert_array_equal(bits(jgot)[normal], bits(want)[normal])
    # stacked experts [E, O, I/2]
    got = dq.dequant_fp4_experts(np.stack([p, p[::-1]]), np.stack([sc, sc[::-1]]))
    np.testing.assert_array_equal(bits(got[1]), bits(want[::-1]))


def test_dequant_rows_and_wo_a():
    rng = np.random.default_rng(9)
    t = rng.integers(0, 256, (40, 256)).astype(np.uint8)
    t[(t & 0x7F) == 0x7F] = 0  # no NaNs
    sr = rng.integers(100, 150, (40, 8)).astype(np.uint8)
    want = (E4M3_VALUES[t] * np.ldexp(1.0, np.repeat(sr, 32, 1).astype(np.int64) - 127)).astype(np.float32)
    np.testing.assert_array_equal(bits(dq.dequant_fp8_rows(t.view(ml_dtypes.float8_e4m3fn), sr)), bits(want))
    w = rng.integers(0, 256, (64, 96)).astype(np.uint8)
    w[(w & 0x7F) == 0x7F] = 1
    sg = rng.integers(110, 140, (2, 3)).astype(np.uint8)
    want = (E4M3_VALUES[w] * np.ldexp(1.0, np.repeat(np.repeat(sg, 32, 0), 32, 1).astype(np.int64) - 127))
    got = dq.dequant_wo_a(w, sg)
    assert got.dtype == BF16
    np.testing.assert_array_equal(bits(got), bits(want.astype(np.float32).astype(BF16)))


def test_quantize_fp8_blocks_round_trip():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((70, 100)) * np.exp2(rng.integers(-20, 20, (70, 1)))).astype(np.float32)
    w[:32, :32] = 0  # an all-zero block
    q, s = enc.quantize_fp8_blocks(w, 32)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == np.uint8 and s.shape == (3, 4)
    # independent: each block's scale is the smallest 2^e with amax <= 448 * 2^e, values e4m3-rounded
    for bo in range(3):
        for bi in range(4):
            blk = w[bo * 32:(bo + 1) * 32, bi * 32:(bi + 1) * 32].astype(np.float64)
            amax = np.abs(blk).max()
            e = 0
            if amax > 0:
                e = -130
                while 448 * 2.0 ** e < amax:
                    e += 1
            assert s[bo, bi] == e + 127
            want, _ = round_to_grid(blk / 2.0 ** e, E4M3_POS)
            got = dq.dequant_fp8_blocks(q, s, 32)[bo * 32:(bo + 1) * 32, bi * 32:(bi + 1) * 32]
            np.testing.assert_array_equal(got, (want * 2.0 ** e).astype(np.float32))
    # encoding already-representable values is lossless
    d = dq.dequant_fp8_blocks(q, s, 32)
    np.testing.assert_array_equal(dq.dequant_fp8_blocks(*enc.quantize_fp8_blocks(d, 32), 32), d)
    q128, s128 = enc.quantize_fp8_blocks(w, 128)
    assert s128.shape == (1, 1) and np.max(np.abs(dq.dequant_fp8_blocks(q128, s128, 128) - w)) <= np.abs(w).max() / 16


def test_quantize_fp4_experts_round_trip():
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((3, 16, 128)) * np.exp2(rng.integers(-10, 10, (3, 16, 1)))).astype(np.float32)
    p, s = enc.quantize_fp4_experts(w)
    assert p.dtype == np.int8 and p.shape == (3, 16, 64) and s.shape == (3, 16, 4)
    g = w.reshape(3, 16, 4, 32).astype(np.float64)
    amax = np.abs(g).max(-1)
    e = np.ceil(np.log2(amax / 6))
    e = np.where(6 * 2.0 ** (e - 1) >= amax, e - 1, e)
    assert np.all(6 * 2.0 ** e >= amax) and np.all(6 * 2.0 ** (e - 1) < amax)
    np.testing.assert_array_equal(s, (e + 127).astype(np.uint8))
    want, _ = round_to_grid(g / 2.0 ** e[..., None], E2M1_POS)
    np.testing.assert_array_equal(dq.dequant_fp4_experts(p, s), (want * 2.0 ** e[..., None]).reshape(w.shape))
    # packing: low nibble of byte k is element 2k
    u = p.view(np.uint8)
    _, c0 = round_to_grid(g[0, 0, 0, 0] / 2.0 ** e[0, 0, 0], E2M1_POS)
    assert (u[0, 0, 0] & 15) & 7 == c0


def test_safetensors_raw_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    q, s = enc.quantize_fp8_blocks(rng.standard_normal((64, 64)).astype(np.float32), 32)
    p, s4 = enc.quantize_fp4_experts(rng.standard_normal((8, 64)).astype(np.float32))
    tensors = {"a.weight": q, "a.scale": s.view(ml_dtypes.float8_e8m0fnu), "e.weight": p, "e.scale": s4.view(
        ml_dtypes.float8_e8m0fnu), "n.weight": rng.standard_normal(8).astype(BF16)}
    path = tmp_path / "m.safetensors"
    enc.write_safetensors(path, tensors)
    header, _ = dq.read_safetensors_header(path)
    assert header["a.weight"]["dtype"] == "F8_E4M3" and header["a.scale"]["dtype"] == "F8_E8M0"
    assert header["e.weight"]["dtype"] == "I8"
    for k, v in tensors.items():
        got = dq.read_safetensors_tensor(path, k)
        assert got.shape == v.shape
        np.testing.assert_array_equal(bits(got), bits(v))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated"):
        dq.read_safetensors_tensor(cut, "n.weight")
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file  # an independent reader

    t = load_file(str(path))
    assert t["a.scale"].dtype == torch.float8_e8m0fnu and t["a.weight"].dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(dq.dequant_fp8_blocks(t["a.weight"], t["a.scale"], 32),
                                  dq.dequant_fp8_blocks(q, s, 32))


# ---- keep-quantized matmuls ----

def test_linear_over_kept_fp8_equals_dequant_matmul():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((96, 160)).astype(np.float32) * 0.1
    q, s = enc.quantize_fp8_blocks(w, 32)
    wd = dq.dequant_fp8_blocks(q, s, 32)
    x = rng.standard_normal((2, 5, 160)).astype(np.float32)
    hi = jax.lax.Precision.HIGHEST
    f = jax.jit(lambda x, q, s: qdq.linear(x, {"fp8": q, "scale": s}))
    y = f(x, q.view(np.uint8), s)
    want = jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32, precision=hi)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ wd.T.astype(np.float64), rtol=1e-5, atol=1e-5)
    # reference mode: FP8 activations per 32, bf16 out
    xb = x.astype(BF16)
    y = jax.jit(lambda x, q, s: qdq.linear(x, {"fp8": q, "scale": s}, 32))(xb, q.view(np.uint8), s)
    xq, _, _ = act_quant_ref(xb)
    want = jnp.einsum("...i,oi->...o", jnp.asarray(xq), jnp.asarray(wd).astype(jnp.bfloat16),
                      preferred_element_type=jnp.float32, precision=hi).astype(jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(np.asarray(y)), bits(np.asarray(want)))
    # 128x128 blocks, ragged edges
    q2, s2 = enc.quantize_fp8_blocks(w[:, :150], 128)
    y2 = jax.jit(lambda x, q, s: qdq.linear(x, {"fp8": q, "scale": s}))(x[..., :150], q2.view(np.uint8), s2)
    np.testing.assert_allclose(np.asarray(y2), x[..., :150] @ dq.dequant_fp8_blocks(q2, s2, 128).T, rtol=1e-5,
                               atol=1e-5)


def test_linear_over_kept_fp4_equals_dequant_matmul():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    p, s = enc.quantize_fp4_experts(w)
    wd = dq.dequant_fp4_experts(p, s)
    x = rng.standard_normal((7, 128)).astype(np.float32)
    y = jax.jit(lambda x, p, s: qdq.linear(x, {"fp4": p, "scale": s}))(x, p, s)
    want = jnp.einsum("...i,oi->...o", x, wd, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    np.testing.assert_allclose(np.asarray(y), x.astype(np.float64) @ wd.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    yb = jax.jit(lambda x, p, s: qdq.linear(x, {"fp4": p, "scale": s}, 32))(x.astype(BF16), p.view(np.uint8), s)
    assert yb.dtype == jnp.bfloat16
    want = jnp.einsum("...i,oi->...o", jnp.asarray(act_quant_ref(x.astype(BF16))[0]), jnp.asarray(wd).astype(
        jnp.bfloat16), preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(yb).view(np.uint16), np.asarray(want).view(np.uint16))
