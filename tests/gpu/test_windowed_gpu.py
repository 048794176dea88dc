"""The windowed grouped matmul compiled on the GPU (skipped elsewhere):

    JAX_PLATFORMS=cuda python -m pytest tests/gpu/test_windowed_gpu.py -q

Against the XLA loop over the same windows (`windowed.reference`, what runs off the GPU) at V4.1-Flash widths (one
layer's 384 FP4 experts, 2.26e9 bytes a matrix, both matrices, the rows of a k=3 verify at B=32 and of a 512-token
prefill, routed uniformly), at small widths against float64 products of the dequantised experts, bf16 experts at
Qwen3-MoE's (128 experts, 2048 -> 768), and `moe.sparse` with the kernel on against it switched off."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import moe, windowed
from tests.test_windowed import want

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU and JAX_PLATFORMS=cuda")
BF16 = jnp.bfloat16


def routed(key, E, M):
    """Group sizes of M rows routed uniformly over E experts, and the rows."""
    return jnp.bincount(jax.random.randint(key, (M,), 0, E), length=E).astype(jnp.int32)


def fp4(key, G, N, K, lo=118, hi=132):
    k1, k2 = jax.random.split(key)
    byte = lambda k, s, a, b: jax.random.randint(k, s, a, b, jnp.int32).astype(jnp.uint8)  # noqa: E731
    return {"fp4": byte(k1, (G, N, K // 2), 0, 256), "scale": byte(k2, (G, N, K // 32), lo, hi)}


def both(x, w, sizes, first=0):
    lay = windowed.layout(sizes, x.shape[0], min(moe._window(x.shape[0], sizes.shape[0]), windowed.MAX_WINDOW))
    xw = windowed.spread(x, lay)
    assert windowed.fits(xw, w)
    kernel = jax.jit(lambda xw, w: windowed.matmul(xw, w, lay, first))(xw, w)
    ref = jax.jit(lambda xw, w: windowed.reference(xw, w, lay, first))(xw, w)
    back = jax.jit(lambda y: windowed.collect(y, lay, x.shape[0]))
    return np.asarray(back(kernel), np.float32), np.asarray(back(ref), np.float32)


@pytest.mark.parametrize("M", [768, 3072])
@pytest.mark.parametrize("N,K", [(2304, 5120), (5120, 2304)], ids=["gate-up", "down"])
def test_flash_fp4_layer(M, N, K):
    k1, k2, k3 = jax.random.split(jax.random.key(M + N), 3)
    w = fp4(k1, 384, N, K)
    sizes = routed(k2, 384, M).at[-1].add(3)  # the last expert used
    x = jax.random.normal(k3, (M + 3, K), jnp.float32).astype(BF16)
    got, ref = both(x, w, sizes)
    np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("M", [64, 1024, 4096])  # windows of 16, 64 and 128 rows: both of `tiling`'s FP4 choices
def test_gpt_oss_fp4_widths(M):
    """GPT-OSS-20B's MXFP4 experts (32 a layer, 2880 -> 2880: 90 scale blocks, so a last step masked past the row),
    this layer the second of a stack of three, against float64 products of the dequantised experts. The bytes past
    its last expert's last row (the next layer's first expert, not routed) hold NaN scales: a read of them
    unmasked would turn that column NaN."""
    k1, k2, k3 = jax.random.split(jax.random.key(M), 3)
    w = fp4(k1, 3 * 32, 2880, 2880, 116, 124)
    w["scale"] = w["scale"].at[64, 0, :4].set(255)
    sizes = routed(k2, 32, M).at[-1].add(3)  # the last expert used
    x = jax.random.normal(k3, (M + 3, 2880), jnp.float32).astype(BF16)
    got, ref = both(x, w, sizes, first=32)
    exact = want(x, w, np.asarray(sizes).tolist(), 32)
    np.testing.assert_allclose(got, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)
    np.testing.assert_allclose(ref, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)


@pytest.mark.parametrize("tiling", [(128, 8, 4, 2), (256, 4, 8, 3), (256, 8, 8, 3), (64, 4, 4, 3)], ids=str)
def test_gpt_oss_fp4_tilings(monkeypatch, tiling):
    """The same widths at tilings `windowed.tiling` may pick: column blocks of 128 / 256 that 2880 does not fill
    (the last masked), 4 or 8 scale blocks a step (90 leaves 2: a masked last step). NaN scales right past the
    layer's last row, as above."""
    monkeypatch.setattr(windowed, "tiling", lambda N, blocks=None, W=None: tiling)
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    w = fp4(k1, 3 * 32, 2880, 2880, 116, 124)
    w["scale"] = w["scale"].at[64, 0, :4].set(255)
    sizes = routed(k2, 32, 1024).at[-1].add(3)
    x = jax.random.normal(k3, (1024 + 3, 2880), jnp.float32).astype(BF16)
    got, _ = both(x, w, sizes, first=32)
    exact = want(x, w, np.asarray(sizes).tolist(), 32)
    np.testing.assert_allclose(got, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)


@pytest.mark.parametrize("fmt", ["fp4", "bf16"])
def test_small_widths_against_float64(fmt):
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    G, N, K, M = 3 * 64, 256, 512, 1000
    w = fp4(k1, G, N, K) if fmt == "fp4" else jax.random.normal(k1, (G, K, N), jnp.float32).astype(BF16)
    sizes = routed(k2, 64, M - 40)  # 40 rows past the groups
    x = jax.random.normal(k3, (M, K), jnp.float32).astype(BF16)
    got, ref = both(x, w, sizes, first=64)
    exact = want(x, w, np.asarray(sizes).tolist(), 64)
    np.testing.assert_allclose(got, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)
    np.testing.assert_allclose(ref, exact, atol=1e-2 * np.abs(exact).max(), rtol=0)
    assert not got[M - 40:].any()


def test_bf16_at_qwen3_moe_widths():
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    w = (jax.random.normal(k1, (128, 2048, 768), jnp.float32) / 32).astype(BF16)
    sizes = routed(k2, 128, 4096)
    x = jax.random.normal(k3, (4096, 2048), jnp.float32).astype(BF16)
    got, ref = both(x, w, sizes)
    np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("fmt", ["fp4", "bf16", "fp4, 32 experts"])
def test_moe_block_kernel_on_equals_off(monkeypatch, fmt):
    """`moe.sparse` with 256 experts, 200 tokens x top-8 (1600 routed rows), this layer read from a 2-layer stack:
    the kernel's result equals the XLA loop's (JAXMODELS_WINDOWED_KERNEL=0, read when traced). FP4 at 32 experts
    (GPT-OSS's count, top-4, 800 rows; 2880 wide): the kernel against every expert expanded to bf16."""
    from tests.test_moe import make_params, spec_of

    E, D, I, k = (32, 2880, 2880, 4) if "32" in fmt else (256, 512, 256, 8)
    fmt = fmt.split(",")[0]
    spec = spec_of(E, k, "softmax_topk", True, shared=256, I=I)
    p = jax.tree.map(lambda a: a.astype(BF16), make_params(spec, 1, d=D))
    k = jax.random.split(jax.random.key(5), 4)
    if fmt == "fp4":
        layers = [{"w_gate": fp4(k[0], E, I, D, 118, 124), "w_up": fp4(k[1], E, I, D, 118, 124),
                   "w_down": fp4(k[2], E, D, I, 118, 124)} for _ in range(2)]
    else:
        layers = [{n: p[n] * (i + 1) for n in ("w_gate", "w_up", "w_down")} for i in range(2)]
    stack = (jax.tree.map(lambda *a: jnp.stack(a), *layers), jnp.int32(1))
    x = jax.random.normal(k[3], (200, D), jnp.float32).astype(BF16)
    on = jax.jit(functools.partial(moe.sparse, spec))
    assert "triton" in on.lower(p | layers[1], x, stack=stack).as_text()  # the kernel runs, at 32 experts too
    on = on(p | layers[1], x, stack=stack)
    monkeypatch.setenv("JAXMODELS_WINDOWED_KERNEL", "0")
    off = jax.jit(lambda p, x, s: moe.sparse(spec, p, x, stack=s))(p | layers[1], x, stack)
    on, off = np.asarray(on, np.float32), np.asarray(off, np.float32)
    np.testing.assert_allclose(on, off, atol=2e-2 * np.abs(off).max(), rtol=0)


@pytest.mark.parametrize("tokens", [4, 200], ids=["gathered", "windowed"])
def test_moe_block_alone_through_the_kernels(tokens):
    """A layer that is not scanned (an MTP block) given `moe.lone(p)`: the kernels (gathered at 4 tokens x top-8,
    windowed at 200) equal the XLA paths it took without a stack, FP4 experts."""
    from tests.test_moe import make_params, spec_of

    E, D, I = 256, 512, 256
    spec = spec_of(E, 8, "softmax_topk", True, shared=256, I=I)
    k = jax.random.split(jax.random.key(6), 4)
    p = jax.tree.map(lambda a: a.astype(BF16), make_params(spec, 1, d=D)) | {
        "w_gate": fp4(k[0], E, I, D, 118, 124), "w_up": fp4(k[1], E, I, D, 118, 124),
        "w_down": fp4(k[2], E, D, I, 118, 124)}
    x = jax.random.normal(k[3], (tokens, D), jnp.float32).astype(BF16)
    kernels = jax.jit(lambda p, x: moe.sparse(spec, p, x, stack=moe.lone(p)))
    assert "triton" in kernels.lower(p, x).as_text()  # the Pallas (Triton) kernels, not the XLA paths
    on = np.asarray(kernels(p, x), np.float32)
    off = np.asarray(jax.jit(functools.partial(moe.sparse, spec))(p, x), np.float32)
    np.testing.assert_allclose(on, off, atol=2e-2 * np.abs(off).max(), rtol=0)
