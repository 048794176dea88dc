"""The windowed grouped matmul (`windowed`): its layout against a NumPy construction, and the kernel (Pallas'
interpreter on the CPU; the compiled one in tests/gpu) against what it replaces: `lax.ragged_dot` over the experts
(dequantised first when kept in FP4) with float64 products, for bf16 and FP4 experts, group sizes with empty,
split and hot groups, rows past the groups, a layer's experts read from every layer's stack, special scale bytes
and gradients; then `moe.sparse` through it against `moe.dense`."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import moe, qdq, windowed
from tests.test_gathered_quantized import fp4_experts
from tests.test_moe import forced, spec_of

F32, BF16 = jnp.float32, jnp.bfloat16
SIZES = [[0, 5, 0, 40, 1, 0], [17, 0, 0, 0, 0, 16], [0, 0, 0, 0, 0, 0], [70, 0, 0, 0, 0, 0], [3, 9, 1, 12, 33, 7]]


def np_layout(sizes, W):
    """(expert, first row, rows) of every used window, in order."""
    out, start = [], 0
    for e, n in enumerate(sizes):
        out += [(e, start + i, min(W, n - i)) for i in range(0, n, W)]
        start += n
    return out


@pytest.mark.parametrize("W", [1, 4, 16])
@pytest.mark.parametrize("sizes", SIZES)
def test_layout_is_each_group_cut_in_windows(sizes, W):
    M = 70
    lay = windowed.layout(jnp.asarray(sizes, jnp.int32), M, W)
    e, start, count = (np.asarray(a) for a in (lay.expert, lay.start, lay.count))
    assert len(e) == len(sizes) + -(-M // W) and lay.W == W
    used = count > 0
    assert list(zip(e[used], start[used], count[used])) == np_layout(sizes, W)
    assert not used[used.sum():].any()  # the used windows come first


@pytest.mark.parametrize("sizes", SIZES)
def test_spread_then_collect_gives_the_rows_back(sizes):
    M, W = 70, 16
    lay = windowed.layout(jnp.asarray(sizes, jnp.int32), M, W)
    x = jnp.arange(M * 3, dtype=F32).reshape(M, 3) + 1
    xw = windowed.spread(x, lay)
    assert xw.shape == (lay.expert.shape[0] * W, 3)
    back = np.asarray(windowed.collect(xw, lay, M))
    n = sum(sizes)
    np.testing.assert_array_equal(back[:n], np.asarray(x)[:n])
    assert not back[n:].any()  # rows past the groups: zero
    assert np.count_nonzero(np.asarray(xw).any(axis=1)) == n  # unused slots: zero


def want(x, w, sizes, first):
    """float64 grouped products over experts first .. of w (dequantised if kept in FP4); rows past the groups 0."""
    E = len(sizes)
    if isinstance(w, dict):
        w = np.swapaxes(np.asarray(qdq.dequant(jax.tree.map(lambda v: v[first:first + E], w), F32)), -1, -2)
    else:
        w = np.asarray(w[first:first + E], np.float64)
    x, out, start = np.asarray(x, np.float64), np.zeros((x.shape[0], w.shape[2])), 0
    for e, n in enumerate(sizes):
        out[start:start + n] = x[start:start + n] @ w[e]
        start += n
    return out


def run(x, w, sizes, first, W=16, interpret=True):
    lay = windowed.layout(jnp.asarray(sizes, jnp.int32), x.shape[0], W)
    f = jax.jit(lambda x, w, first: windowed.collect(
        windowed.matmul(windowed.spread(x, lay), w, lay, first, interpret=interpret), lay, x.shape[0]))
    return np.asarray(f(x, w, first), np.float64)


def check(got, ref, tol):
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("sizes", SIZES[:4])
@pytest.mark.parametrize("K,N,W", [(64, 32, 16), (96, 64, 32), (128, 48, 16)])
def test_bf16_kernel_equals_grouped_products(sizes, K, N, W):
    rng = np.random.default_rng(K + N)
    x = jnp.asarray(rng.normal(size=(70, K)), BF16)
    w = jnp.asarray(rng.normal(size=(3 * 6, K, N)), BF16)  # three layers' experts: this one is the second
    ref = want(x, w, sizes, 6)
    check(run(x, w, sizes, 6, W), ref, 1e-2)  # bf16 output rounding
    check(run(x, w, sizes, 6, W, interpret=False), ref, 1e-2)  # `reference`, the path off the GPU


@pytest.mark.parametrize("sizes", SIZES[:2] + SIZES[3:])
@pytest.mark.parametrize("K,N", [(256, 32), (384, 16), (128, 64),  # 8, 12 (steps of 4) and 4 scale blocks
                                 (320, 16), (96, 32)])  # 10 and 3: a last step masked past the row (GPT-OSS: 90)
def test_fp4_kernel_equals_dequant_then_grouped_products(sizes, K, N):
    rng = np.random.default_rng(K * N + sum(sizes))
    x = jnp.asarray(rng.normal(size=(70, K)), BF16)
    w = fp4_experts(rng, 2 * 6, N, K)  # every e2m1 code, scales 2^-9 .. 2^4
    ref = want(x, w, sizes, 6)
    check(run(x, w, sizes, 6), ref, 1e-2)
    check(run(x, w, sizes, 6, interpret=False), ref, 1e-2)


@pytest.mark.parametrize("bn,nbk,N", [(64, 8, 80), (128, 16, 48), (32, 4, 48), (16, 8, 48)])
def test_fp4_kernel_at_other_tilings(monkeypatch, bn, nbk, N):
    """Column blocks N does not fill (the last one's columns past N masked, then cut) and steps of nbk scale
    blocks that 10 blocks leave a rest of (16: no whole step), as `tiling` picks at GPT-OSS's 2880."""
    monkeypatch.setattr(windowed, "tiling", lambda N_, blocks=None, W=None: (bn, nbk, 4, 3))
    rng = np.random.default_rng(bn + nbk + N)
    sizes, K = SIZES[4], 320
    x = jnp.asarray(rng.normal(size=(70, K)), BF16)
    w = fp4_experts(rng, 2 * 6, N, K)
    got = run(x, w, sizes, 6)
    assert got.shape == (70, N)
    check(got, want(x, w, sizes, 6), 1e-2)


def test_fp4_kernel_special_scale_bytes():
    """Scale bytes 0 (2^-127), 1, 254 (2^127: codes past 1.5 overflow bf16 to inf) and 255 (NaN): the kernel's
    non-finite outputs (inf, or NaN from inf - inf) where the dequantised reference's are, its finite ones equal."""
    rng = np.random.default_rng(5)
    sizes, K, N = [20, 30, 20], 128, 32
    w = fp4_experts(rng, 3, N, K)
    scale = np.array(w["scale"])
    scale[0] = rng.choice([0, 1, 127], size=scale[0].shape)
    scale[1, :4] = 254
    scale[2, 5, 1] = 255
    w["scale"] = jnp.asarray(scale)
    x = jnp.asarray(rng.normal(size=(70, K)), BF16)
    got, ref = run(x, w, sizes, 0), run(x, w, sizes, 0, interpret=False)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    assert not np.isfinite(ref[20:50, :4]).any() and np.isnan(ref[50:, 5]).all()  # expert 1's inf weights, 2's NaN
    ok = np.isfinite(ref)
    np.testing.assert_allclose(got[ok], ref[ok], atol=1e-2 * np.abs(ref[ok]).max(), rtol=0)


@pytest.mark.parametrize("fmt", ["bf16", "fp4"])
def test_gradients_equal_the_grouped_products(fmt):
    """Through spread, the kernel (this layer's experts 4..7 of a stack of 8) and collect: dx (and dw for bf16
    experts: nonzero only on this layer's experts) equal `lax.ragged_dot`'s over the same (dequantised) experts in
    float32, and the reference loop's exactly (the kernel's backward is the loop's)."""
    rng = np.random.default_rng(7)
    sizes, K, N, first = jnp.asarray([9, 0, 30, 2], jnp.int32), 128, 32, 4
    w = fp4_experts(rng, 8, N, K) if fmt == "fp4" else jnp.asarray(rng.normal(size=(8, K, N)), BF16)
    x = jnp.asarray(rng.normal(size=(45, K)), BF16)
    g = jnp.asarray(rng.normal(size=(45, N)), F32)
    lay = windowed.layout(sizes, 45, 16)
    argnums = (0,) if fmt == "fp4" else (0, 1)

    def grads(**kw):
        def loss(x, w):
            y = windowed.collect(windowed.matmul(windowed.spread(x, lay), w, lay, first, **kw), lay, 45)
            return jnp.vdot(y.astype(F32), g)
        return jax.jit(jax.grad(loss, argnums=argnums))(x, w)

    def dense(x, w):
        we = (jnp.swapaxes(qdq.dequant(jax.tree.map(lambda v: v[first:first + 4], w), F32), -1, -2)
              if fmt == "fp4" else w[first:first + 4].astype(F32))
        return jnp.vdot(jax.lax.ragged_dot(x.astype(F32), we, sizes), g)

    want_ = jax.grad(dense, argnums=argnums)(x, w)
    got, loop = grads(interpret=True), grads()
    for a, b, c in zip(got, loop, want_):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        c = np.asarray(c, np.float64)
        check(np.asarray(a, np.float64), c, 2e-2)
    if fmt == "bf16":
        assert not np.asarray(got[1][:first], np.float32).any() and np.asarray(got[1][first:], np.float32).any()


def test_widths_it_does_not_tile_take_the_reference(monkeypatch):
    """FP4 with 8 columns (the kernel's blocks hold 16) or float32 rows: `matmul(interpret=True)` runs the
    reference loop."""
    rng = np.random.default_rng(8)
    calls = []
    monkeypatch.setattr(windowed, "_kernel_matmul", lambda *a: calls.append(1))
    for x, w in [(jnp.ones((8, 192), BF16), fp4_experts(rng, 2, 8, 192)),
                 (jnp.ones((8, 64), F32), jnp.ones((2, 64, 32), F32))]:
        lay = windowed.layout(jnp.asarray([3, 5], jnp.int32), 8, 16)
        assert windowed.matmul(windowed.spread(x, lay), w, lay, interpret=True).shape[0] == lay.expert.shape[0] * 16
    assert not calls and not windowed.fits(jnp.ones((8, 64), BF16), jnp.ones((2, 64, 32), BF16))  # CPU: never


def kernel_in_moe(monkeypatch, few_experts_too=True):
    """moe's windows through the interpreted kernel (as on the GPU), counting its calls; few_experts_too: for
    bf16 experts at counts `grouped` takes too (FP4 experts take the windows there anyway)."""
    calls, inner = [], windowed.matmul
    if few_experts_too:
        monkeypatch.setattr(moe, "WINDOWED_EXPERTS", 0)
    monkeypatch.setattr(moe.windowed, "fits", windowed._tiles)
    monkeypatch.setattr(moe.windowed, "matmul", lambda *a: calls.append(1) or inner(*a, interpret=True))
    return calls


@pytest.mark.parametrize("fmt", ["bf16", "fp4", "fp4 (8 experts)"])
def test_moe_through_the_kernel_equals_dense(monkeypatch, fmt):
    """`moe.sparse` (bf16 rows, hot and empty experts, expert biases) through the kernel, this layer read from
    every layer's stack: equal to `moe.dense` over the same (dequantised) experts in float32. FP4 experts take it
    at 8 experts too, where `grouped` would expand every expert (GPT-OSS's 32)."""
    calls = kernel_in_moe(monkeypatch, few_experts_too=fmt != "fp4 (8 experts)")
    fmt = fmt.split()[0]
    E, D, I = 8, 128, 128
    spec = spec_of(E, 2, "softmax_topk", True, router_bias=True, bias=True, shared=16, I=I)
    p, x = forced(spec, [30.0 if e in (1, 6) else -30.0 if e in (0, 7) else 0.0 for e in range(E)], n=23, d=D)
    rng = np.random.default_rng(11)
    if fmt == "fp4":
        q = functools.partial(fp4_experts, rng, scales=(118, 123))  # weights ~ N(0, 1/8): bf16 activations stay O(1)
        layers = [{"w_gate": q(E, I, D), "w_up": q(E, I, D), "w_down": q(E, D, I)} for _ in range(2)]
        mine = {k: jnp.swapaxes(qdq.dequant(v, F32), -1, -2) for k, v in layers[1].items()}
    else:
        layers = [{k: jnp.asarray(rng.normal(size=p[k].shape) / 8, BF16) for k in ("w_gate", "w_up", "w_down")}
                  for _ in range(2)]
        mine = {k: v.astype(F32) for k, v in layers[1].items()}
    pb = jax.tree.map(lambda a: a.astype(BF16) if a.dtype == F32 else a, p)
    stack = (jax.tree.map(lambda *a: jnp.stack(a), *layers), jnp.int32(1))
    decoy = pb | layers[0]  # p holds layer 0's experts: the stack's layer 1 must be read
    got = jax.jit(functools.partial(moe.sparse, spec))(decoy, x.astype(BF16), stack=stack)
    assert len(calls) == 3
    ref = moe.dense(spec, jax.tree.map(lambda a: a.astype(F32), pb) | mine, x.astype(BF16).astype(F32))
    check(np.asarray(got, np.float64), np.asarray(ref, np.float64), 2e-2)
