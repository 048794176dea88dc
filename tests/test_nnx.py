"""The Flax NNX view holds the model's own arrays and runs the same functions: logits identical to jm.forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmodels as jm
from jaxmodels import families, model as M, nnx as jnnx, plan, sharding
from jaxmodels.families import deepseek_v4
from tests.parity import hf_reference as ref
from tests.parity.test_deepseek_v4 import V4_TINY

FAMILIES = ["llama", "qwen3", "mistral", "cohere", "cohere2", "gemma3", "gpt_oss", "exaone4", "qwen3_moe", "deepseek_v4"]
# DeepSeek V4 at three layers: a window layer, a compressed (ratio 4, indexer) one, a window one
DEEPSEEK = {**V4_TINY, "model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 0]}


def _model(name) -> jm.Model:
    cfg = deepseek_v4.config(DEEPSEEK) if name == "deepseek_v4" else families.config_from_hf(ref.tiny_config(name))
    return jm.Model(cfg, M.init_params(cfg, seed=3, std=0.05))


def _ids(cfg, batch=2, t=12):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t)).astype(np.int32)


@nnx.jit
def _logits(module, tokens):
    return module(tokens)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_identical_to_forward(name):
    model = _model(name)
    module = jnnx.from_model(model)
    ids = _ids(model.config)
    want = np.asarray(jm.forward(model, ids))
    assert np.array_equal(np.asarray(_logits(module, jnp.asarray(ids))), want)


@pytest.mark.parametrize("name", ["llama", "deepseek_v4"])
def test_the_variables_are_the_params_arrays(name):
    model = _model(name)
    module = jnnx.from_model(model)
    flat = plan.flatten(model.params)
    state = plan.flatten(nnx.state(module).to_pure_dict())
    assert state.keys() == flat.keys()  # nnx paths are the param paths
    assert all(state[p] is flat[p] for p in flat)  # no copies
    trainable = plan.flatten(nnx.state(module, nnx.Param).to_pure_dict())
    assert trainable.keys() == {p for p, a in flat.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    if name == "deepseek_v4":  # the hash router's expert ids are a Table, not a Param
        assert any(p.endswith("tid2eid") for p in plan.flatten(nnx.state(module, jnnx.Table).to_pure_dict()))
    block = getattr(module.layers, "0")
    assert block.spec == plan.plan(model.config).kinds[0] and block.count == plan.plan(model.config).counts[0]


def test_split_merge_round_trip():
    """The module as a pure function of its state (split, merge under jit), and back to a jm.Model."""
    model = _model("llama")
    ids = _ids(model.config)
    graphdef, variables = nnx.split(jnnx.from_model(model))
    got = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(variables, jnp.asarray(ids))
    assert np.array_equal(np.asarray(got), np.asarray(jm.forward(model, ids)))
    back = jnnx.to_model(nnx.merge(graphdef, variables))
    assert back.config == model.config
    assert jax.tree.structure(back.params) == jax.tree.structure(model.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)))


def test_the_module_runs_on_its_current_values():
    """Changing a variable changes the logits (the call reads the module, not a stale copy of the params); the
    hidden/head methods compose to the call; a gradient through nnx flows into every Param."""
    model = _model("llama")
    module = jnnx.from_model(model)
    ids = jnp.asarray(_ids(model.config))
    base = np.asarray(_logits(module, ids))
    np.testing.assert_allclose(np.asarray(module.head(module.hidden(ids))), base, atol=1e-5)
    wq = getattr(module.layers, "0").attn.wq
    wq.set_value(wq.get_value() * 2)
    assert not np.allclose(np.asarray(_logits(module, ids)), base, atol=1e-3)
    assert np.array_equal(np.asarray(jm.forward(jnnx.to_model(module), ids)), np.asarray(_logits(module, ids)))
    grads = nnx.grad(lambda m: m(ids).mean())(module)
    flat = plan.flatten(grads.to_pure_dict())
    assert flat.keys() == plan.flatten(model.params).keys() and all(np.abs(g).max() > 0 for g in flat.values())


def test_a_sharded_model_stays_sharded():
    base = _model("qwen3")
    mesh = sharding.make_mesh("data=2,tensor=4")
    model = jm.Model(base.config, sharding.shard_params(base.params, base.config, mesh), None, mesh, "tp")
    module = jnnx.from_model(model)
    ids = jnp.asarray(_ids(base.config, batch=4))
    assert np.array_equal(np.asarray(_logits(module, ids)), np.asarray(jm.forward(model, ids)))
    back = jnnx.to_model(module)
    assert back.mesh is not None and back.sharding == model.sharding
    wq = back.params["layers"]["0"]["attn"]["wq"]
    assert wq.sharding.is_equivalent_to(model.params["layers"]["0"]["attn"]["wq"].sharding, wq.ndim)


def test_to_model_refuses_other_modules():
    with pytest.raises(TypeError, match="jaxmodels.nnx.Model"):
        jnnx.to_model(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
