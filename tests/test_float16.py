"""float16 models run on the CPU (XLA:CPU has no f16 x f16 -> f32 dot; those products are widened there) and
agree with the same float16 weights computed in float32 (issue #17: they used to fail on every call)."""
import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import families, model as M
from jaxmodels.families import deepseek_v4
from tests.parity import hf_reference as ref
from tests.parity.test_deepseek_v4 import V4_TINY


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt_oss", pytest.param("deepseek_v4", marks=pytest.mark.slow)])
def test_float16_runs_on_the_cpu(name):
    cfg = (deepseek_v4.config({**V4_TINY, "model_type": "deepseek_v4"}) if name == "deepseek_v4"
           else families.config_from_hf(ref.tiny_config(name)))
    half = M.cast(cfg, M.init_params(cfg, seed=0, std=0.05), "float16")
    ids = np.arange(12)[None] % cfg.vocab_size
    got = np.asarray(jm.forward(jm.Model(cfg, half), ids))
    want = np.asarray(jm.forward(jm.Model(cfg, M.cast(cfg, half, "float32")), ids))
    assert np.abs(want).max() > 0.3 and np.abs(got - want).max() < 1e-2  # float16 activations: ~1e-3 here
    assert len(jm.generate(jm.Model(cfg, half), [[1, 2, 3]], max_new_tokens=3, ignore_eos=True).tokens[0]) == 3
