"""DeepSeek V4 / V4.1 on the sharding rules table (#13 §2), on 8 virtual CPU devices (tests/conftest.py).

- Placement: every key parameter is split as the rules say (heads / grouped latent / indexer heads over `tensor`,
  routed experts over `expert`, their width over `tensor`, Engram tables by rows, embed over `fsdp` ...), each
  device holding exactly its slice of the host array; checked on the four meshes of the issue, with Auto and
  Explicit axes, without compiling anything. A golden dump pins every parameter's spec.
- Numerics: sharded logits equal the unsharded ones (<= 1e-5) and greedy generation is token-identical. One
  mesh here; every mesh x axis type x version in the slow test (minutes of XLA compiles on 2 cores).
- Import: `jm.load(DeepSeek FP8/FP4 dir, mesh=...)` equals the host import bit for bit and reads each block of
  each tensor once, no more than its shard (+ the scale block it sits in) -- tests/test_sharded_import.py
  measures the host memory.
"""
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxmodels as jm
from jaxmodels import plan, sharding
from jaxmodels.families import deepseek_v4
from tests.oracles import deepseek_ckpt
from tests.parity.test_deepseek_v4 import V4_TINY
from tests.test_paged_cache import V41_NARROW

# the meshes, each with the preset that uses its axes
MESHES = [("tensor=8", "tp"), ("data=2,tensor=4", "tp"), ("data=2,expert=4", "ep"), ("fsdp=2,tensor=4", "fsdp_tp")]
# 8 query heads in 8 output groups, 8 indexer heads: every head-like axis divides tensor=8 (the spec's tiny configs
# have 2 groups, which no tensor axis > 2 splits); Engram tables of 660 and 864 rows (660 = 4 x 165: padded on 8)
WIDE = {"num_attention_heads": 8, "o_groups": 8}
GOLDEN = Path(__file__).parent / "golden" / "partition_specs_deepseek.json"


def config(version):
    if version == "v4.1":
        return deepseek_v4.config(deepseek_ckpt.tiny_config("v4.1", quantized=False, **V41_NARROW, **WIDE,
                                                            index_n_heads=8))
    return deepseek_v4.config({**V4_TINY, **WIDE, "model_type": "deepseek_v4"})


def base_model(version, seed=1, std=0.05):
    """Random weights by each ParamSpec's init, drawn with NumPy (M.init_params dispatches one small jax op per
    leaf: 20 s of compiles on 2 cores): N(0, std^2) matrices, norms 1, expert ids and Engram classes."""
    cfg = config(version)
    rng, out = np.random.default_rng(seed), {}
    for path, s in plan.flatten(plan.param_specs(cfg)).items():
        if s.init == "normal":
            out[path] = (std * rng.standard_normal(s.shape)).astype(np.float32)
        elif s.init == "expert_ids":
            experts = plan.plan(cfg).kinds[int(path.split("/")[1])].mlp.num_experts
            out[path] = rng.integers(0, experts, s.shape).astype(np.int32)
        elif s.init == "classes":
            out[path] = np.arange(s.shape[0], dtype=np.int32) // 2
        else:
            out[path] = np.full(s.shape, {"ones": 1.0, "zeros": 0.0, "half": 0.5}[s.init], np.float32)
    return jm.Model(cfg, jax.tree.map(jax.numpy.asarray, plan.unflatten(out)))


def mesh_of(spec: str, axis_type: str):
    """`spec` as jax.make_mesh builds it (a user's mesh), with all axes Auto or all Explicit."""
    axes = dict(p.split("=") for p in spec.split(","))
    kind = getattr(AxisType, axis_type)
    return jax.make_mesh(tuple(int(v) for v in axes.values()), tuple(axes), axis_types=(kind,) * len(axes))


def _ids(cfg, batch=4, t=24):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t)).astype(np.int32)


# ------------------------------------------------------------------------------------------------- placement
T, E, F = "tensor", "expert", "fsdp"
# expected specs, written out by hand from the rules table (not computed by jaxmodels.sharding): leaf -> per preset
V41_KEYS = {  # layer 1: ratio-2 kv + index source with Engram; every leaf is stacked [1, ...] (each layer its kind)
    "embed": {"tp": P(T, None), "ep": P(None, None), "fsdp_tp": P(T, F)},
    "lm_head": {"tp": P(None, T), "ep": P(None, None), "fsdp_tp": P(F, T)},
    "layers/1/attn/wq_a": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, F, None)},
    "layers/1/attn/wq_b": {"tp": P(None, None, T), "ep": P(None, None, None), "fsdp_tp": P(None, None, T)},
    "layers/1/attn/wkv": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, F, None)},
    "layers/1/attn/sinks": {"tp": P(None, T), "ep": P(None, None), "fsdp_tp": P(None, T)},
    "layers/1/attn/wo_a": {"tp": P(None, T, None, None), "ep": P(None, None, None, None),
                           "fsdp_tp": P(None, T, None, None)},
    "layers/1/attn/wo_b": {"tp": P(None, T, None), "ep": P(None, None, None), "fsdp_tp": P(None, T, F)},
    "layers/1/attn/indexer/wq_b": {"tp": P(None, None, T), "ep": P(None, None, None), "fsdp_tp": P(None, None, T)},
    "layers/1/attn/indexer/weights_proj": {"tp": P(None, None, T), "ep": P(None, None, None),
                                           "fsdp_tp": P(None, F, T)},
    "layers/1/attn/indexer/wk": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, None, None)},
    "layers/1/attn/compressor/wkv": {"tp": P(None, None, None), "ep": P(None, None, None),
                                     "fsdp_tp": P(None, F, None)},
    "layers/1/mlp/w_gate": {"tp": P(None, None, None, T), "ep": P(None, E, None, None),
                            "fsdp_tp": P(None, None, F, T)},
    "layers/1/mlp/w_down": {"tp": P(None, None, T, None), "ep": P(None, E, None, None),
                            "fsdp_tp": P(None, None, T, F)},
    "layers/1/mlp/shared/w_up": {"tp": P(None, None, T), "ep": P(None, None, None), "fsdp_tp": P(None, F, T)},
    "layers/1/mlp/router": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, F, None)},
    "layers/1/hc_attn/fn": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, None, None)},
    "layers/0/engram/table": {"tp": P(None, T, None), "ep": P(None, E, None), "fsdp_tp": P(None, (F, T), None)},
    "layers/1/engram/table": {"tp": P(None, T, None), "ep": P(None, E, None), "fsdp_tp": P(None, (F, T), None)},
    "layers/1/engram/wkv": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, None, None)},
    "engram_map": {"tp": P(None), "ep": P(None), "fsdp_tp": P(None)},
}
V4_KEYS = {  # layer 0: window + hash-routed MoE; layer 1: CSA (ratio 4, indexer with its own compressor); hc_head
    "layers/0/attn/wq_b": V41_KEYS["layers/1/attn/wq_b"],
    "layers/0/attn/wo_a": V41_KEYS["layers/1/attn/wo_a"],
    "layers/0/mlp/w_gate": V41_KEYS["layers/1/mlp/w_gate"],
    "layers/0/mlp/tid2eid": {"tp": P(None, None, None), "ep": P(None, None, None), "fsdp_tp": P(None, None, None)},
    "layers/1/attn/indexer/wq_b": V41_KEYS["layers/1/attn/indexer/wq_b"],
    "layers/1/attn/indexer/compressor/wkv": V41_KEYS["layers/1/attn/compressor/wkv"],
    "layers/1/mlp/w_down": V41_KEYS["layers/1/mlp/w_down"],
    "hc_head/fn": {"tp": P(None, None), "ep": P(None, None), "fsdp_tp": P(None, None)},
}


def _split(spec: P, mesh) -> tuple[int, ...]:
    """How many ways each dimension is split."""
    return tuple(int(np.prod([mesh.shape[a] for a in ((x,) if isinstance(x, str) else x or ())])) for x in spec)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("version", ["v4.1", "v4"])
def test_parameters_are_placed_by_the_rules(version, axis_type):
    """Each key leaf carries the spec the rules give it, every device holds exactly its block of the host array
    (not a replica labelled as a shard), and Engram tables split along rows the mesh does not divide (660 over
    8) are zero-padded."""
    base = base_model(version)
    keys = V41_KEYS if version == "v4.1" else V4_KEYS
    host = {k: np.asarray(v) for k, v in plan.flatten(base.params).items()}
    for spec, rules in MESHES:
        mesh = mesh_of(spec, axis_type)
        placed = plan.flatten(sharding.shard_params(base.params, base.config, mesh, rules))
        for path, want in keys.items():
            a, what = placed[path], f"{spec} {axis_type}: {path}"
            want = P(*(None if x is None or not all(ax in mesh.shape for ax in ((x,) if isinstance(x, str) else x))
                       else x for x in want[rules]))  # an axis the mesh lacks: replicated
            assert a.sharding.spec == want, (what, a.sharding.spec)
            split = _split(want, mesh)
            full = host[path]
            padded = tuple(-(-n // k) * k for n, k in zip(full.shape, split))
            assert a.shape == padded, (what, a.shape)
            if padded != full.shape:
                full = np.pad(full, [(0, p - n) for p, n in zip(padded, full.shape)])
            for shard in a.addressable_shards:
                assert shard.data.shape == tuple(n // k for n, k in zip(padded, split)), (what, shard.data.shape)
                np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index], err_msg=what)
        if version == "v4.1" and spec in ("tensor=8", "fsdp=2,tensor=4"):  # 660 rows over 8 devices: 83 each
            assert placed["layers/0/engram/table"].shape[1] == 664


def test_split_counts_on_tensor8():
    """On tensor=8 the big attention and MoE weights are split 8 ways, not replicated: each device holds 1/8 of
    wq_b, wo_a, wo_b, the experts' and shared expert's width, the Engram tables and the embedding."""
    base = base_model("v4.1")
    placed = plan.flatten(sharding.shard_params(base.params, base.config, sharding.make_mesh("tensor=8"), "tp"))
    for path in ("embed", "lm_head", "layers/1/attn/wq_b", "layers/1/attn/wo_a", "layers/1/attn/wo_b",
                 "layers/1/mlp/w_gate", "layers/1/mlp/w_down", "layers/1/mlp/shared/w_gate", "layers/1/engram/table",
                 "layers/1/attn/indexer/wq_b"):
        a = placed[path]
        per_device = {s.data.size for s in a.addressable_shards}
        assert per_device == {a.size // 8}, (path, per_device, a.size)
    assert placed["layers/1/attn/wkv"].addressable_shards[0].data.size == placed["layers/1/attn/wkv"].size


@pytest.mark.parametrize("version", ["v4.1", "v4"])
def test_shardings_fit_arrays_of_the_planned_shapes(version):
    """sharding.shardings (jit out_shardings, optimizer state: arrays of the planned shapes) never splits a
    dimension its mesh axes do not divide: a 660-row Engram table stays whole there on 8 devices, while its
    placement pads it (above)."""
    cfg = config(version)
    specs = plan.flatten(plan.param_specs(cfg))
    for spec, rules in MESHES:
        flat = plan.flatten(sharding.shardings(cfg, sharding.make_mesh(spec), rules))
        for path, s in flat.items():
            assert sharding.placed_shape(specs[path].shape, s) == specs[path].shape, (spec, path, s.spec)
        if version == "v4.1":
            split = flat["layers/0/engram/table"].spec[1] is not None
            assert split == (spec in ("data=2,tensor=4", "data=2,expert=4")), spec  # 660 = 4 x 165


def golden_specs() -> dict:
    """{preset: {version: {param path: spec}}} on a (fsdp=2, tensor=2, expert=2) mesh."""
    mesh = sharding.make_mesh("data=1,fsdp=2,tensor=2,expert=2")
    out = {}
    for preset in sharding.RULES:
        out[preset] = {}
        for version in ("v4", "v4.1"):
            flat = plan.flatten(sharding.param_specs(config(version), mesh, preset))
            out[preset][version] = {p: str(s) for p, s in sorted(flat.items())}
    return out


def test_partition_specs_match_the_golden_dump():
    """A change of any DeepSeek parameter's placement must update tests/golden/partition_specs_deepseek.json on
    purpose: `XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.test_sharding_deepseek` rewrites it."""
    assert golden_specs() == json.loads(GOLDEN.read_text())


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(golden_specs(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")


# ------------------------------------------------------------------------------------------------- numerics
def _sharded(base, mesh, rules):
    return jm.Model(base.config, sharding.shard_params(base.params, base.config, mesh, rules), None, mesh, rules)


def test_v41_on_a_users_explicit_fsdp_tp_mesh_equals_unsharded():
    """V4.1 (mHC, Engram tables padded 660 -> 664 and split 8 ways, every attention role, MoE) on a
    jax.make_mesh fsdp=2 x tensor=4 mesh with Explicit axes: logits equal one device's."""
    base = base_model("v4.1")
    ids = _ids(base.config)
    want = np.asarray(jm.forward(base, ids))
    m = _sharded(base, mesh_of("fsdp=2,tensor=4", "Explicit"), "fsdp_tp")
    assert np.abs(np.asarray(jm.forward(m, ids)) - want).max() <= 1e-5


# CI runs V4 on tensor=8 (the widest split; V4.1's Explicit fsdp x tensor forward is above, data=2 x tensor=4 and
# data=2 x expert=4 in tests/test_sharding.py); the whole matrix is `heavy` (~4 minutes a version on 2 cores)
@pytest.mark.slow
@pytest.mark.parametrize("version,mesh", [pytest.param(v, m, marks=() if (v, m) == ("v4", MESHES[0]) else
                                                       pytest.mark.heavy) for v in ("v4.1", "v4") for m in MESHES])
def test_every_mesh_and_axis_type_equals_unsharded(version, mesh):
    """On tensor=8, data=2 x tensor=4, data=2 x expert=4 and fsdp=2 x tensor=4, Auto and Explicit axes, the
    sharded logits equal the unsharded ones (<= 1e-5) and greedy generation (prefill + cached decode, past the
    16-token window) is token-identical. Nearly all of the time is XLA compiles."""
    base = base_model(version)
    ids = _ids(base.config)
    want = np.asarray(jm.forward(base, ids))
    prompts = [list(ids[0, :19]), list(ids[1, :6]), list(ids[2, :11])]
    tokens = jm.generate(base, prompts, max_new_tokens=6, ignore_eos=True).tokens
    for spec, rules in [mesh]:
        for axis_type in ("Auto", "Explicit"):  # one compile: the rules run on the mesh's Auto twin
            m = _sharded(base, mesh_of(spec, axis_type), rules)
            err = np.abs(np.asarray(jm.forward(m, ids)) - want).max()
            assert err <= 1e-5, (spec, axis_type, err)
            assert jm.generate(m, prompts, max_new_tokens=6, ignore_eos=True).tokens == tokens, (spec, axis_type)
