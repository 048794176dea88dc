"""Structure of the executor: depth is scanned, not unrolled."""
import jax
import jax.numpy as jnp

from jaxmodels import families, model as M

HF = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 2}


def _program_size(layers: int, model_type: str = "llama") -> int:
    cfg = families.config_from_hf({**HF, "model_type": model_type, "num_hidden_layers": layers})
    params = jax.eval_shape(lambda: M.init_params(cfg))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return len(jax.jit(M.forward, static_argnums=1).lower(params, cfg, tokens).as_text())


def test_program_size_does_not_grow_with_depth():
    """The compiled program (hence compile time) of 32 layers is as large as that of 2 layers."""
    assert _program_size(32) < 1.05 * _program_size(2)
    # LLLG plans scan whole periods (each a scan of the 3 sliding layers + the global one): 32 layers cost as
    # much as two periods of 4
    assert _program_size(32, "cohere2") < 1.05 * _program_size(8, "cohere2")
