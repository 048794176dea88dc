"""The gathered-experts GEMV on experts kept quantized (`gathered.matmul` on {"fp4"|"fp8", "scale"} leaves), run by
Pallas' interpreter on the CPU, against the path it replaces: `qdq.dequant` of the chosen experts, then the XLA
einsum in fp32. Codes and scale bytes are random over their whole range, so every e2m1 code and a wide range of
E8M0 scales meet; rows repeat experts and leave some unused; shapes with one scale block, an odd number of them,
column blocks of 16, K split over several programs; every layer's stack indexed by its rank (through
`moe.sparse`, the way the model calls it). The GPU test at the end runs the compiled kernel (skipped elsewhere)."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import gathered, moe, qdq
from tests.test_moe import ATOL, forced, np_moe, spec_of

F32, BF16 = jnp.float32, jnp.bfloat16


def fp4_experts(rng, G, N, K, scales=(118, 132)):
    """Random packed e2m1 bytes [G, N, K/2] (every code) and E8M0 bytes [G, N, K/32] in `scales`."""
    return {"fp4": jnp.asarray(rng.integers(0, 256, (G, N, K // 2)), jnp.uint8),
            "scale": jnp.asarray(rng.integers(*scales, (G, N, K // 32)), jnp.uint8)}


def fp8_experts(rng, G, N, K, block):
    """Random e4m3 bytes [G, N, K] (NaN codes 0x7f / 0xff replaced) and an E8M0 grid [G, ceil(N/B), ceil(K/B)]."""
    b = rng.integers(0, 256, (G, N, K))
    b[(b & 0x7F) == 0x7F] = 0x7E
    grid = (G, -(-N // block), -(-K // block))
    return {"fp8": jnp.asarray(b, jnp.uint8), "scale": jnp.asarray(rng.integers(120, 134, grid), jnp.uint8)}


def want(x, w, ids):
    """The replaced path in NumPy: dequantised chosen experts ([n, N, K], qdq), float64 products."""
    wq = np.asarray(qdq.dequant({k: v[ids] for k, v in w.items()}, F32), np.float64)
    return np.einsum("nk,nfk->nf", np.asarray(x, np.float64), wq)


def check(x, w, ids, tol=1e-5):
    got = gathered.matmul(x, w, ids, interpret=True)
    assert got.shape == (x.shape[0], jax.tree.leaves(w)[0].shape[1]) and got.dtype == x.dtype
    ref = want(x, w, ids)
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, atol=tol * scale, rtol=tol)
    # and the XLA reference (what runs off the GPU) agrees with it
    np.testing.assert_allclose(np.asarray(gathered.reference(x, w, ids), np.float64), ref, atol=tol * scale, rtol=tol)


def test_e2m1_values_are_qdq_table_bit_for_bit():
    got = np.asarray(gathered.e2m1_bits(jnp.arange(16, dtype=jnp.int32)))
    np.testing.assert_array_equal(got.view(np.uint32), qdq.FP4_TABLE.view(np.uint32))  # -0.0 included


@pytest.mark.parametrize("n,G,N,K", [
    (1, 4, 16, 32),      # one scale block, one column block of 16
    (5, 8, 48, 96),      # an odd number of scale blocks (one a load), column blocks of 16
    (12, 3, 192, 320),   # 64-column blocks, two scale blocks a load, K split over 5 programs
    (2, 4, 32, 384),     # two scale blocks a load, three loads a step
    (4, 96, 64, 2880),   # GPT-OSS widths: 90 scale blocks, 15 steps of 3 loads, split over several programs
])
def test_fp4_kernel_equals_dequant_then_matmul(n, G, N, K):
    rng = np.random.default_rng(n * 100 + G)
    w = fp4_experts(rng, G, N, K)
    ids = jnp.asarray(np.r_[rng.integers(0, G, n - 1), 0][:n], jnp.int32)  # repeats; most experts unused
    x = jnp.asarray(rng.standard_normal((n, K)), F32)
    assert gathered._tiles(x, w)
    check(x, w, ids)


def test_fp4_kernel_special_scale_bytes():
    """E8M0 byte 255 is NaN and 254 is 2^127 (values >= 2 overflow to inf): NaN / inf where the dequantised weights
    give them; bytes 1 (2^-126) and 252 (6 * 2^125) the extremes that stay finite."""
    rng = np.random.default_rng(3)
    w = fp4_experts(rng, 4, 32, 64, scales=(126, 129))
    s = np.asarray(w["scale"]).copy()
    s[1, 3, 0], s[0, 0, 1], s[2, 5, 1], s[2, 7, 1], s[2, 9, 0] = 255, 255, 254, 1, 252
    w["scale"] = jnp.asarray(s)
    x = jnp.asarray(rng.standard_normal((3, 64)) * 1e-3, F32)
    ids = jnp.asarray([1, 2, 3], jnp.int32)
    got = np.asarray(gathered.matmul(x, w, ids, interpret=True), np.float64)
    ref = want(x, w, ids)
    assert np.isnan(ref[0, 3]) and not np.isfinite(ref[1, 5]) and np.isfinite(ref[1, 9]) and abs(ref[1, 9]) > 1e30
    finite = np.isfinite(ref)
    assert finite.sum() == ref.size - 2
    np.testing.assert_array_equal(got[~finite], ref[~finite])  # the same NaN / inf
    np.testing.assert_allclose(got[finite], ref[finite], rtol=1e-5, atol=1e-5 * np.abs(ref[1, 9]))


def test_fp4_kernel_bf16_activations():
    """bf16 activations (the model's dtype): products and sums in fp32, one rounding to bf16 at the end."""
    rng = np.random.default_rng(4)
    w = fp4_experts(rng, 6, 128, 256)
    x = jnp.asarray(rng.standard_normal((4, 256)), BF16)
    ids = jnp.asarray([5, 0, 5, 2], jnp.int32)
    got = gathered.matmul(x, w, ids, interpret=True)
    ref = gathered.reference(x, w, ids)
    assert got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got, np.float64), want(x, w, ids), rtol=2 ** -8, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(ref, np.float64), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("n,G,N,K,block", [(3, 4, 64, 128, 128), (5, 6, 48, 96, 32), (2, 3, 96, 64, 16),
                                           (4, 5, 80, 256, 64)])
def test_fp8_kernel_equals_dequant_then_matmul(n, G, N, K, block):
    """Square E8M0 scale blocks; N a multiple of 16 but not of the block (a partial last row of blocks) too."""
    rng = np.random.default_rng(n + G + block)
    w = fp8_experts(rng, G, N, K, block)
    ids = jnp.asarray(rng.integers(0, G, n), jnp.int32)
    x = jnp.asarray(rng.standard_normal((n, K)), F32)
    assert gathered._tiles(x, w)
    check(x, w, ids)
    as_float8 = {"fp8": jax.lax.bitcast_convert_type(w["fp8"], jnp.float8_e4m3fn), "scale": w["scale"]}
    np.testing.assert_array_equal(np.asarray(gathered.matmul(x, as_float8, ids, interpret=True)),
                                  np.asarray(gathered.matmul(x, w, ids, interpret=True)))


@pytest.mark.parametrize("fmt,N,K", [("fp4", 24, 64), ("fp8", 64, 48)])
def test_widths_the_kernel_does_not_tile_go_through_the_reference(fmt, N, K):
    """Columns not a multiple of 16 (FP4), a contraction not a multiple of the FP8 block: the XLA path, same result."""
    rng = np.random.default_rng(5)
    w = fp4_experts(rng, 3, N, K) if fmt == "fp4" else fp8_experts(rng, 3, N, K, 32)
    x = jnp.asarray(rng.standard_normal((2, K)), F32)
    ids = jnp.asarray([2, 0], jnp.int32)
    assert not gathered._tiles(x, w)
    check(x, w, ids)


def test_the_kernel_can_be_switched_off(monkeypatch):
    """On a GPU backend the kernel takes tiled half-precision calls, unless JAXMODELS_GATHERED_KERNEL=0."""
    rng = np.random.default_rng(7)
    w, x = fp4_experts(rng, 3, 32, 64), jnp.zeros((2, 64), BF16)
    monkeypatch.setattr(gathered.jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv("JAXMODELS_GATHERED_KERNEL", raising=False)
    assert gathered.fits(x, w)
    monkeypatch.setenv("JAXMODELS_GATHERED_KERNEL", "0")
    assert not gathered.fits(x, w)
    monkeypatch.setenv("JAXMODELS_GATHERED_KERNEL", "1")
    assert gathered.fits(x, w)


FLASH_FP4 = lambda G: {"fp4": jax.ShapeDtypeStruct((G, 2304, 2560), jnp.uint8),  # noqa: E731  (V4.1-Flash gate/up)
                        "scale": jax.ShapeDtypeStruct((G, 2304, 160), jnp.uint8)}


@pytest.mark.parametrize("w,runs", [
    (FLASH_FP4(384), True),  # one Flash layer's experts, 2.26e9 bytes: as words, 5.7e8 offsets (issue #13)
    (FLASH_FP4(768), True),  # two layers
    (FLASH_FP4(15 * 384), True),  # the largest kind of V4.1-Flash's plan: its scales, 2.12e9 bytes, just fit
    (FLASH_FP4(18 * 384), False),  # 18 layers' scales: 2.5e9 bytes, 32-bit offsets wrap
    ({"fp8": jax.ShapeDtypeStruct((256, 2048, 5120), jnp.uint8),  # FP8 bytes, 2.7e9: they wrap too
      "scale": jax.ShapeDtypeStruct((256, 16, 40), jnp.uint8)}, False),
    ({"fp8": jax.ShapeDtypeStruct((512, 2048, 5120), jnp.uint8),  # 5.4e9 bytes: 64-bit offsets
      "scale": jax.ShapeDtypeStruct((512, 16, 40), jnp.uint8)}, True),
    (jax.ShapeDtypeStruct((384, 5120, 2304), jnp.bfloat16), True),  # 2-byte elements: past 2^31 means past 2^32 B
], ids=["fp4-384", "fp4-768", "fp4-15-layers", "fp4-18-layers", "fp8-256", "fp8-512", "bf16-384"])
def test_weights_the_lowering_cannot_address_take_the_reference(monkeypatch, w, runs):
    """The kernel runs only on operands Pallas' Triton lowering addresses right (`triton.offsets_fit`)."""
    monkeypatch.setattr(gathered.jax, "default_backend", lambda: "gpu")
    assert gathered.fits(jax.ShapeDtypeStruct((24, 5120), BF16), w) is runs


def _triton_ir(monkeypatch, fn, *args) -> str:
    """The Triton IR of the one Pallas kernel in fn, lowered for CUDA on the CPU (nothing is allocated)."""
    from jax._src.lib.mlir import ir

    texts, write = [], ir.Operation.write_bytecode
    monkeypatch.setattr(ir.Operation, "write_bytecode", lambda op, buf, *a, **k: texts.append(str(op)) or
                        write(op, buf, *a, **k))
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    assert len(texts) == 1 and "tt.load" in texts[0]
    return texts[0]


@pytest.mark.parametrize("shape,dtype", [
    ((384, 2304, 2560), jnp.uint8),  # 2.26e9 elements and bytes: 32-bit offsets, which wrap
    ((768, 2304, 2560), jnp.uint8),  # 4.5e9 bytes: 64-bit
    ((384, 2304, 640), jnp.int32),  # the same bytes as words: 5.7e8 offsets, 32-bit and right
    ((384, 5120, 2304), jnp.bfloat16),  # 4.5e9 elements, 9.1e9 bytes: 64-bit
])
def test_offsets_fit_is_the_pallas_lowering_rule(monkeypatch, shape, dtype):
    """What `triton.offsets_fit` stands for, pinned on the JAX in use: a kernel reading one element of an operand
    lowers with 64-bit offsets, or its 32-bit offsets cover the operand (< 2^31 elements), exactly where
    offsets_fit says so; the 2.26e9-byte case is the illegal address of issue #13. If JAX changes its threshold,
    this fails: then revise `offsets_fit`."""
    from jax.experimental import pallas as pl

    from jaxmodels.layers import triton

    w, i = jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct((1,), jnp.int32)

    def kernel(w_ref, i_ref, o_ref):
        o_ref[...] = w_ref[i_ref[0], pl.ds(0, 16), pl.ds(0, 16)].astype(F32)

    text = _triton_ir(monkeypatch, lambda w, i: pl.pallas_call(
        kernel, in_specs=[triton.whole(w), triton.whole(i)], out_shape=jax.ShapeDtypeStruct((16, 16), F32),
        name="probe", **triton.params())(w, i), w, i)
    wide, count = "i64" in text, math.prod(shape)
    assert (wide or count <= 2 ** 31) is triton.offsets_fit(w)
    assert wide is (count * jnp.dtype(dtype).itemsize > 2 ** 32)  # JAX's threshold, 2^32 bytes


def test_fp4_kernel_over_one_flash_layer_indexes_words(monkeypatch):
    """The FP4 kernel over one Flash layer's experts (2.26e9 bytes, issue #13's stack) reads 32-bit words: its IR
    loads i32, not i8, and its offsets are 32-bit, which cover the words' 5.7e8 elements."""
    x, ids = jax.ShapeDtypeStruct((24, 5120), BF16), jax.ShapeDtypeStruct((24,), jnp.int32)
    text = _triton_ir(monkeypatch, lambda x, w, ids: gathered._quantized_call(x, w, ids, False), x, FLASH_FP4(384),
                      ids)
    assert "i64" not in text  # 32-bit offsets, and loads through i32 pointers (words) and i8 ones (the scales) only
    assert {"tensor<64x2x4x!tt.ptr<i32>>", "tensor<64x2x!tt.ptr<i8>>"} <= set(re.findall(r"tensor<[^<>]*<i\d+>>", text))
    assert not re.search(r"tensor<64x2x16x!tt.ptr<i8>>", text)  # no byte loads of the packed codes
    assert gathered._addressed(FLASH_FP4(384))["fp4"].shape == (384, 2304, 640)  # what `fits` checks: the words


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_gradient_is_the_references(fmt):
    """d/dx through the kernel equals d/dx of dequant-then-matmul; the bytes get no cotangent."""
    rng = np.random.default_rng(6)
    w = fp4_experts(rng, 4, 64, 128) if fmt == "fp4" else fp8_experts(rng, 4, 64, 128, 32)
    x = jnp.asarray(rng.standard_normal((3, 128)), F32)
    ids = jnp.asarray([3, 1, 3], jnp.int32)
    g = jnp.asarray(rng.standard_normal((3, 64)), F32)
    dx = jax.grad(lambda x: jnp.vdot(gathered.matmul(x, w, ids, interpret=True), g))(x)
    wq = np.asarray(qdq.dequant({k: v[ids] for k, v in w.items()}, F32), np.float64)
    np.testing.assert_allclose(np.asarray(dx), np.einsum("nf,nfk->nk", np.asarray(g, np.float64), wq),
                               rtol=1e-5, atol=1e-5 * np.abs(wq).max())


def quantize_like(rng, p, layers=3, rank=1):
    """p's routed experts replaced by random FP4 bytes ([E, out, in/2], scales near 2^-3); returns (params kept
    quantized, the same dequantised in p's [E, in, out] layout, a stack of `layers` layers holding them at `rank`)."""
    pq, pd, stack = dict(p), dict(p), {}
    for name in ("w_gate", "w_up", "w_down"):
        E, K, N = p[name].shape
        layer = [fp4_experts(rng, E, N, K, scales=(122, 126)) for _ in range(layers)]
        pq[name] = layer[rank]
        pd[name] = jnp.swapaxes(qdq.dequant(layer[rank], F32), -1, -2)
        stack[name] = {k: jnp.stack([q[k] for q in layer]) for k in ("fp4", "scale")}
    stack |= {k: jnp.stack([p[k] * (i + 1) for i in range(layers)]) for k in ("b_gate", "b_up", "b_down")}
    return pq, pd, (stack, jnp.int32(rank))


@pytest.mark.parametrize("n", [1, 4])
def test_moe_decode_with_fp4_experts_reads_the_stack(monkeypatch, n):
    """`moe.sparse` at decode sizes with FP4 experts and every layer's stack (this layer rank 1 of 3): the quantized
    kernel (interpreted) runs for all three matrices and the block equals dense over the dequantised experts."""
    kernel, calls = gathered.matmul, []
    monkeypatch.setattr(moe.gathered, "matmul", lambda *a: calls.append(isinstance(a[1], dict)) or
                        kernel(*a, interpret=True))
    spec = spec_of(8, 2, "softmax_topk", True, router_bias=True, bias=True, shared=8, I=32)
    p, x = forced(spec, [-40.0 if e in (0, 3, 7) else 0.0 for e in range(8)], n=n, d=64)
    pq, pd, stack = quantize_like(np.random.default_rng(n), p)
    ys = jax.jit(lambda p, x, stack: moe.sparse(spec, p, x, stack=stack))(pq, x, stack)
    assert calls == [True] * 3
    yd = moe.dense(spec, pd, x)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(yd), atol=ATOL * np.abs(np.asarray(yd)).max(), rtol=0)
    np.testing.assert_allclose(np.asarray(ys), np_moe(spec, pd, x), atol=1e-4, rtol=1e-4)
    # without the stack (CPU, or under a mesh): XLA's gather of the chosen bytes, the same result
    yx = jax.jit(lambda p, x: moe.sparse(spec, p, x))(pq, x)
    np.testing.assert_allclose(np.asarray(yx), np.asarray(ys), atol=ATOL * np.abs(np.asarray(yd)).max(), rtol=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled Triton kernel needs a GPU")
@pytest.mark.parametrize("n,fmt", [(4, "fp4"), (32, "fp4"), (4, "fp8"), (3, "fp4_narrow")])
def test_gpu_kernel_equals_reference(n, fmt):
    """On the GPU at GPT-OSS widths (2880 -> 2880; 2 layers x 32 experts), bf16 activations: kernel vs reference;
    fp4_narrow: 48 columns (blocks of 16) and one scale block a step."""
    G, N, K = (64, 2880, 2880) if fmt != "fp4_narrow" else (8, 48, 96)
    k1, k2, k3 = jax.random.split(jax.random.key(n), 3)
    byte = lambda key, shape, lo=0, hi=256: jax.random.randint(key, shape, lo, hi, jnp.int32).astype(jnp.uint8)  # noqa: E731
    if fmt == "fp8":
        b = byte(k1, (G, N, K))
        w = {"fp8": jnp.where((b & 0x7F) == 0x7F, 0, b), "scale": byte(k2, (G, N // 32, K // 32), 118, 132)}
    else:
        w = {"fp4": byte(k1, (G, N, K // 2)), "scale": byte(k2, (G, N, K // 32), 118, 132)}
    x = jax.random.normal(k3, (n, K), F32).astype(BF16)
    ids = jnp.asarray(np.random.default_rng(n).integers(0, G, n), jnp.int32)
    assert gathered.fits(x, w)
    got = np.asarray(jax.jit(gathered.matmul)(x, w, ids), np.float32)
    ref = np.asarray(jax.jit(gathered.reference)(x, w, ids), np.float32)
    np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max(), rtol=0)
    exact = want(x.astype(F32), w, ids)  # float64 products of the same bf16 x
    np.testing.assert_allclose(got, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)
    g = jnp.ones((n, N), F32)
    dx = jax.jit(jax.grad(lambda x: jnp.vdot(gathered.matmul(x, w, ids).astype(F32), g)))(x)
    rx = jax.jit(jax.grad(lambda x: jnp.vdot(gathered.reference(x, w, ids).astype(F32), g)))(x)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(rx, np.float32))  # the same backward
