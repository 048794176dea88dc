"""Sharded execution on 8 virtual CPU devices equals the unsharded model (tests/conftest.py sets them up)."""
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxmodels as jm
from converters import orbax_io
from jaxmodels import families, model as M, sharding
from tests.parity import hf_reference as ref

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "cohere", "cohere2", "gemma3", "gpt_oss", "exaone4", "qwen3_moe"]
MESHES = [("tensor=8", "tp"), ("data=2,tensor=4", "tp"), ("data=8", "tp"), ("fsdp=2,tensor=4", "fsdp_tp"),
          ("data=2,expert=4", "ep")]
GOLDEN = Path(__file__).parent / "golden" / "partition_specs.json"


def _model(name):
    """Random weights at the parity tests' scale (N(0, 0.05²) matrices): logits of order 1, so the
    1e-5 bound measures fp32 reassociation across shards, not the size of the logits."""
    cfg = families.config_from_hf(ref.tiny_config(name))
    return jm.Model(cfg, M.init_params(cfg, seed=2, std=0.05))


def _ids(batch=4, t=20):
    return np.random.default_rng(0).integers(0, 256, (batch, t)).astype(np.int32)


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_logits_equal_unsharded(name):
    base = _model(name)
    want = np.asarray(jm.forward(base, _ids()))
    for spec, rules in MESHES:
        mesh = sharding.make_mesh(spec)
        m = jm.Model(base.config, sharding.shard_params(base.params, base.config, mesh, rules), None, mesh, rules)
        got = np.asarray(jm.forward(m, _ids()))
        assert np.abs(got - want).max() <= 1e-5, (spec, rules, np.abs(got - want).max())


@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_moe"])
def test_sharded_generation_equals_unsharded(name):
    base = _model(name)
    prompts = [list(r[: 5 + 3 * i]) for i, r in enumerate(_ids())]
    want = jm.generate(base, prompts, max_new_tokens=12, ignore_eos=True).tokens
    for spec, rules in (MESHES[1], MESHES[4]):
        mesh = sharding.make_mesh(spec)
        m = jm.Model(base.config, sharding.shard_params(base.params, base.config, mesh, rules), None, mesh, rules)
        assert jm.generate(m, prompts, max_new_tokens=12, ignore_eos=True).tokens == want, spec


def test_load_restores_straight_into_the_sharding(tmp_path):
    base = _model("qwen3")
    orbax_io.save(tmp_path / "m", base.config, jax.tree.map(np.asarray, base.params))
    mesh = sharding.make_mesh("data=2,tensor=4")
    m = jm.load(tmp_path / "m", mesh=mesh)
    wq = m.params["layers"]["0"]["attn"]["wq"]
    assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert {s.data.shape for s in wq.addressable_shards} == {(wq.shape[0], wq.shape[1], 1, wq.shape[3])}
    np.testing.assert_allclose(np.asarray(jm.forward(m, _ids())), np.asarray(jm.forward(base, _ids())), atol=1e-5)


@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3_moe"])
def test_a_users_own_mesh_works(name, axis_type, tmp_path):
    """`jax.make_mesh` meshes, whose axes are Explicit by default in current JAX (issue #17: every family failed
    on them inside JAX), place, run, generate and restore like our own."""
    base = _model(name)
    kind = getattr(jax.sharding.AxisType, axis_type)
    want = np.asarray(jm.forward(base, _ids()))
    tokens = jm.generate(base, [[1, 2, 3], [4, 5]], max_new_tokens=4, ignore_eos=True).tokens
    for rules, axes in (("tp", ("data", "tensor")), ("ep", ("data", "expert"))):
        mesh = jax.make_mesh((2, 4), axes, axis_types=(kind, kind))
        m = jm.Model(base.config, sharding.shard_params(base.params, base.config, mesh, rules), None, mesh, rules)
        assert np.abs(np.asarray(jm.forward(m, _ids())) - want).max() <= 1e-5, rules
        assert jm.generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=4, ignore_eos=True).tokens == tokens, rules
    orbax_io.save(tmp_path / "m", base.config, jax.tree.map(np.asarray, base.params))
    m = jm.load(tmp_path / "m", mesh=mesh, rules=rules)
    assert np.abs(np.asarray(jm.forward(m, _ids())) - want).max() <= 1e-5
    with jax.set_mesh(mesh):  # the user's mesh as JAX's context mesh, as Explicit meshes are meant to be used
        assert np.abs(np.asarray(jm.forward(m, _ids())) - want).max() <= 1e-5
        assert jm.generate(m, [[1, 2, 3], [4, 5]], max_new_tokens=4, ignore_eos=True).tokens == tokens


def test_indivisible_dims_stay_replicated():
    """2 kv heads over tensor=4: the kv-head axis stays whole; 4 query heads do split."""
    cfg = families.config_from_hf(ref.tiny_config("llama"))
    specs = sharding.param_specs(cfg, sharding.make_mesh("data=2,tensor=4"), "tp")["layers"]["0"]["attn"]
    assert specs["wk"] == jax.sharding.PartitionSpec(None, None, None, None)
    assert specs["wq"] == jax.sharding.PartitionSpec(None, None, "tensor", None)


def test_bad_mesh_specs_are_refused():
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.make_mesh("pipeline=8")
    with pytest.raises(ValueError, match="needs 6 devices"):
        sharding.make_mesh("data=2,tensor=3")
    with pytest.raises(ValueError, match="unknown sharding preset"):
        sharding.param_specs(families.config_from_hf(ref.tiny_config("llama")), sharding.make_mesh("data=8"), "x")


def golden_specs() -> dict:
    """{preset: {family: {param path: spec}}} on a (data=2, fsdp=1, tensor=2, expert=2) mesh."""
    mesh = sharding.make_mesh("data=2,fsdp=1,tensor=2,expert=2")
    out = {}
    for preset in sharding.RULES:
        out[preset] = {}
        for name in FAMILIES:
            cfg = families.config_from_hf(ref.tiny_config(name))
            flat = jax.tree_util.tree_flatten_with_path(sharding.param_specs(cfg, mesh, preset),
                                                        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
            out[preset][name] = {"/".join(k.key for k in path): str(spec) for path, spec in flat[0]}
    return out


def test_partition_specs_match_the_golden_dump():
    """A refactor that changes any parameter's placement must update tests/golden/partition_specs.json
    on purpose: `python -m tests.test_sharding` rewrites it."""
    assert golden_specs() == json.loads(GOLDEN.read_text())


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_specs(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


def test_expert_parallel_runs_experts_locally():
    """With experts over `expert`, MoE layers go through shard_map (local experts + one psum)."""
    base = _model("qwen3_moe")
    mesh = sharding.make_mesh("data=2,expert=4")
    params = sharding.shard_params(base.params, base.config, mesh, "ep")
    shard = sharding.Sharding.of(mesh, "ep")
    text = str(jax.make_jaxpr(lambda p: M.forward(p, base.config, _ids(), shard=shard))(params))
    assert "shard_map" in text and "psum" in text
    mesh = sharding.make_mesh("data=2,tensor=4")  # no expert axis: the plain sparse path
    params = sharding.shard_params(base.params, base.config, mesh, "tp")
    shard = sharding.Sharding.of(mesh, "tp")
    assert "shard_map" not in str(jax.make_jaxpr(lambda p: M.forward(p, base.config, _ids(), shard=shard))(params))


@pytest.mark.parametrize("name", ["llama", "cohere", "gpt_oss"])
def test_import_onto_a_mesh_reads_slices_and_equals_host_import(name, tmp_path):
    """jm.load(HF dir, mesh=...) fills each device from its own checkpoint slices; the result equals the
    host import, and the safetensors reads for sliced transforms cover only each shard."""
    import converters
    from converters import safetensors_io

    hf = ref.build(ref.tiny_config(name), seed=6)
    hf.save_pretrained(tmp_path / "hf")
    host = jm.load(tmp_path / "hf")
    reads = []
    real = safetensors_io.SafetensorsReader.get_slice

    def spy(self, tensor, index):
        out = real(self, tensor, index)
        reads.append((tensor, out.size, int(np.prod(self.shape(tensor)))))
        return out

    mesh = sharding.make_mesh("data=2,tensor=4")
    safetensors_io.SafetensorsReader.get_slice = spy
    try:
        m = jm.load(tmp_path / "hf", mesh=mesh)
    finally:
        safetensors_io.SafetensorsReader.get_slice = real
    for got, want in zip(jax.tree.leaves(m.params), jax.tree.leaves(host.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    q = [(size, full) for t, size, full in reads if t.endswith("q_proj.weight")]
    assert q and all(size == full // 4 for size, full in q)  # 4 heads over tensor=4: a quarter each
    ids = _ids()
    np.testing.assert_allclose(np.asarray(jm.forward(m, ids)), np.asarray(jm.forward(host, ids)), atol=1e-5)
    assert converters.read_source_sharded  # public


@pytest.mark.slow  # ~100 s a version on 2 cores
@pytest.mark.parametrize("version", ["v4", "v4.1"])
def test_deepseek_sharded_equals_unsharded(version):
    """DeepSeek's parameters carry logical axes in the plan like every family's: placed by the generic rules
    (heads / experts / vocab over tensor or expert, batch over data), logits and greedy tokens equal one device."""
    from tests.test_paged_cache import _config

    cfg = _config(f"deepseek_{version.replace('.', '')}")
    base = jm.Model(cfg, M.init_params(cfg, seed=1, std=0.05))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (4, 24))
    want = np.asarray(jm.forward(base, ids))
    for spec, rules in (("data=2,tensor=4", "tp"), ("data=2,expert=4", "ep")):
        mesh = sharding.make_mesh(spec)
        m = jm.Model(cfg, sharding.shard_params(base.params, cfg, mesh, rules), None, mesh, rules)
        assert np.abs(np.asarray(jm.forward(m, ids)) - want).max() <= 1e-5, spec
    prompts = [list(ids[0, :9]), list(ids[1, :5])]  # the cached path, on the last mesh
    assert (jm.generate(m, prompts, max_new_tokens=4, ignore_eos=True).tokens
            == jm.generate(base, prompts, max_new_tokens=4, ignore_eos=True).tokens)
