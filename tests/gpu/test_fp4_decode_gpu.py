"""The FP4 kernels' PTX decode (`gathered.e2m1_planes`, asm) compiled on the GPU (skipped elsewhere):

    JAX_PLATFORMS=cuda python -m pytest tests/gpu/test_fp4_decode_gpu.py -q

Every e2m1 code at every nibble times every E8M0 scale byte (0: the subnormal 2^-127, 254: 2^127, where codes past
1.5 overflow to inf, 255: NaN), each word with its own scale (so that a pair's two scales must not be swapped), and
random words besides, bit for bit against `qdq.FP4_TABLE` times 2^(byte - 127) in float64 rounded to bf16
(ml_dtypes); the plain decode (`e2m1_bits`, asm off) compiled on the GPU against the same table."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxmodels.layers import gathered, qdq

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU and JAX_PLATFORMS=cuda")


def table(words, scale_bytes):
    """[8, *words.shape] bf16: nibble q of each word (uint32) times 2^(byte - 127) of its scale byte, in float64."""
    codes = np.stack([(words >> np.uint32(4 * q)) & np.uint32(15) for q in range(8)])
    s = np.where(scale_bytes == 255, np.nan, np.exp2(scale_bytes.astype(np.float64) - 127))
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf in bf16, as in the kernels
        return (qdq.FP4_TABLE[codes].astype(np.float64) * s[None]).astype(ml_dtypes.bfloat16)


def same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])  # -0.0 and subnormals


@pytest.mark.parametrize("asm", [True, False], ids=["ptx", "bits"])
def test_every_code_at_every_nibble_times_every_scale_byte(asm):
    rng = np.random.default_rng(0)
    R, G = 256, 8  # rows x scale blocks, 4 words a block: 8192 words
    n = R * G * 4
    every = np.uint32(0x11111111) * (np.arange(n // 2, dtype=np.uint32) % 16)  # code c at all 8 nibbles ...
    every_byte = (np.arange(n // 2) // 16 % 256).astype(np.uint8)  # ... for each scale byte: every triple
    words = np.concatenate([every, rng.integers(0, 2 ** 32, n // 2, dtype=np.uint32)])
    scale_bytes = np.concatenate([every_byte, rng.integers(0, 256, n // 2).astype(np.uint8)])
    order = rng.permutation(n)  # neighbours (a PTX call's pair) from both halves, with different scales
    words, scale_bytes = words[order].reshape(R, G, 4), scale_bytes[order].reshape(R, G, 4)

    def kernel(w_ref, s_ref, o_ref):
        for q, plane in enumerate(gathered.e2m1_planes(w_ref[...], s_ref[...], asm)):
            o_ref[q] = plane.astype(o_ref.dtype)  # (bf16 from the PTX, fp32 otherwise: exact either way)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, R, G, 4), jnp.bfloat16))(
        jnp.asarray(words.view(np.int32)), qdq.e8m0_to_f32(jnp.asarray(scale_bytes)))
    same_bits(got, table(words, scale_bytes))
