"""RoPE frequency tables equal HF's to the last ulp.

HF computes base ** x with torch's vectorised pow (SLEEF, 1-ulp accuracy); its results differ from
any correctly rounded pow (numpy's included) by one ulp in ~1% of entries, and even between torch's
own vector and scalar paths. llama3's smoothing band re-derives its weight from 2π/inv, which can
stretch that 1 ulp to a few. So we require <= 4 ulp; a wrong formula (a band edge, a factor, the ramp)
is off by orders of magnitude more.
"""
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxmodels.families import _common
from jaxmodels.layers import rope

CASES = {
    "default": {"rope_theta": 500000.0},
    "linear": {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn": {"rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 4096}},
    "yarn_truncate_mscale": {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
        "mscale_all_dim": 1.0}},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_inv_freq_bitwise_equal_to_hf(case, head_dim):
    hf_cfg = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=131072, **CASES[case])
    kind = hf_cfg.rope_parameters["rope_type"]
    want, want_af = ROPE_INIT_FUNCTIONS[kind](hf_cfg, torch.device("cpu")) if kind != "default" else (None, 1.0)
    if kind == "default":
        want = 1.0 / (hf_cfg.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    spec = _common.rope_spec(_common.rope_params(hf_cfg.to_dict()), 10000.0, 131072)
    got, af = rope.inv_freq(spec, head_dim)
    assert got.dtype == np.float32
    np.testing.assert_array_max_ulp(got, want.numpy(), maxulp=4)
    assert af == pytest.approx(want_af, rel=1e-7)


def test_rotations_half_and_interleaved():
    """A 2-d rotation by angle a per pair: half-split pairs (j, j+d/2), interleaved pairs (2j, 2j+1)."""
    import jax.numpy as jnp

    x = np.random.default_rng(0).normal(size=(1, 1, 1, 4)).astype(np.float32)
    a = np.array([0.3, 1.1], np.float32)
    c, s = np.cos(a)[None, None], np.sin(a)[None, None]
    half = np.asarray(rope.apply(jnp.asarray(x), jnp.asarray(c), jnp.asarray(s), interleaved=False))[0, 0, 0]
    inter = np.asarray(rope.apply(jnp.asarray(x), jnp.asarray(c), jnp.asarray(s), interleaved=True))[0, 0, 0]
    v = x[0, 0, 0]
    for j, (p, q) in enumerate([(0, 2), (1, 3)]):
        np.testing.assert_allclose([half[p], half[q]], [v[p] * c[0, 0, j] - v[q] * s[0, 0, j],
                                                        v[q] * c[0, 0, j] + v[p] * s[0, 0, j]], rtol=1e-6)
    for j, (p, q) in enumerate([(0, 1), (2, 3)]):
        np.testing.assert_allclose([inter[p], inter[q]], [v[p] * c[0, 0, j] - v[q] * s[0, 0, j],
                                                          v[q] * c[0, 0, j] + v[p] * s[0, 0, j]], rtol=1e-6)
