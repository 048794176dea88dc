"""Tensor parallelism over a mesh (`tt_backend.mesh`) and its emulation (`tt_backend.emu.mesh`).

Tiny random models (dense Llama / Qwen3, Gemma3's sliding + global sandwich layers, GPT-OSS with expert-parallel
MoE) run on 1-D meshes of 2 and 8 devices (N300, T3K) and 2-D meshes 2x4 and 8x4 (Galaxy's TG layout): prefill
through a shuffled page table, then decode; logits and the logical KV caches equal the single-device emulation at
`exact` numerics up to float32 summation order (a matmul whose contracted dim is split sums it in partial sums), and
the single-device run equals jm.forward. Every call of the sharded programs, every mesh mapper and the output
composer is checked against the ttnn 0.81.1 wheel's signatures.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import families, plan
from tests.tt.test_emu_ops import comp_pcc
from tests.tt.test_tt_forward import BASE, TINY, TINY_MOE
from tt_backend import api, generator as G, paged_cache as pc
from tt_backend import mesh as tp
from tt_backend.emu.executor import Executor, VLLMExecutor
from tt_backend.emu.mesh import MeshExecutor, MeshVLLMExecutor, data_parallel, executor_factory
from tt_backend.lowering import TTConstraintError, lower
from tt_backend.program import TTModelProgram
from tt_backend.weights import POLICIES

# more than 2 devices: 8 query and KV heads, hidden and intermediate sizes of 8 whole tiles (1x8: all split 8 ways;
# 2x4 / 8x4: heads and intermediate split over the rows, the hidden size over the 4 columns); one expert per device
WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8, "num_key_value_heads": 8}
CASES = [("llama", 2), ("qwen3", 2), ("gemma3", 2), ("gpt_oss", 2), ("llama", 8), ("qwen3", 8), ("gemma3", 8),
         ("gpt_oss", 8), ("llama", (2, 4)), ("gemma3", (2, 4)), ("gpt_oss", (2, 4)), ("qwen3", (8, 4)),
         ("gpt_oss", (8, 4))]


def devices(mesh) -> int:
    return int(np.prod(mesh))


def head_split(mesh) -> int:
    """How many ways the heads are split: the one axis of a 1-D mesh, the rows of a 2-D one."""
    rows, cols = tp.mesh_shape(mesh)
    return rows if rows > 1 else cols


def config(family: str, mesh=2, **over):
    hf = {**BASE, **TINY.get(family, TINY_MOE.get(family, {}))}
    n = devices(mesh)
    if n > 2:
        hf |= WIDE | ({"num_local_experts": n, "intermediate_size": 64} if family == "gpt_oss" else {})
    return families.config_from_hf({**hf, **over})


def model(cfg, seed: int = 0) -> jm.Model:
    """Random params as tests/tt/test_tt_forward.tiny_model draws them (GPT-OSS gate/up large enough that the
    +-7 clamp fires)."""
    rng = np.random.default_rng(seed)
    gemma = cfg.norm == "gemma"

    def init(leaf, shape):
        if cfg.family == "gpt_oss" and leaf in ("w_gate", "w_up"):
            return 0.5 * rng.standard_normal(shape, np.float32)
        if "norm" in leaf:
            return (0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(shape, np.float32)
        if leaf == "sinks":
            return rng.standard_normal(shape, np.float32)
        if leaf.startswith("b"):
            return 0.5 * rng.standard_normal(shape, np.float32)
        return 0.05 * rng.standard_normal(shape, np.float32)

    params: dict = {}
    for path, shape in plan.flat_shapes(cfg).items():
        *parents, leaf = path.split("/")
        node = params
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = init(leaf, shape)
    return jm.Model(cfg, params)


def run(ex, tokens, prompt: int, blocks):
    """Prefill `prompt` tokens, then decode the rest teacher-forced; logits of every position, and the caches."""
    kv = ex.allocate_kv_cache(len(blocks) + 2)
    out = [ex.prefill(tokens[:prompt], blocks, kv)]
    for p in range(prompt, len(tokens)):
        out.append(ex.decode(tokens[p:p + 1], [p], blocks[None], kv))
    return np.concatenate(out), kv


# ------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("family,n", CASES)
def test_mesh_equals_single_device(family, n):
    """Emulated exact numerics over the mesh == the single device == jm.forward, prefill and decode; the
    logical caches (each device's KV heads) hold what the single device's do."""
    m = model(config(family, n))
    tokens = np.random.default_rng(3).integers(0, 256, 43)
    blocks = np.random.default_rng(4).permutation(6)[:4].astype(np.int32)
    single, kv1 = run(Executor(m, numerics="exact", max_seq_len=256), tokens, 40, blocks)
    ex = MeshExecutor(m, n, numerics="exact", max_seq_len=256)
    multi, kvn = run(ex, tokens, 40, blocks)
    np.testing.assert_allclose(multi, single, atol=1e-5, rtol=0)
    np.testing.assert_allclose(single, np.asarray(jm.forward(m, tokens[None]))[0], atol=2e-5, rtol=0)
    for (k1, v1), (kn, vn) in zip(kv1, kvn):
        np.testing.assert_allclose(kn[blocks], k1[blocks], atol=1e-5, rtol=0)
        np.testing.assert_allclose(vn[blocks], v1[blocks], atol=1e-5, rtol=0)
    # each device really holds a shard: its cache view holds its heads (split over the rows of a 2-D mesh), its
    # wqkv 1/n of the whole
    d0 = ex.devices[0]
    assert len(ex.devices) == devices(n)
    assert d0["kv.0.k"].shape[1] == m.config.num_kv_heads // head_split(n)
    assert d0["layers.0.wqkv"].size * devices(n) == ex.host["layers.0.wqkv"].size


@pytest.mark.parametrize("mesh", [2, (2, 4)])
def test_full_numerics_stay_close_to_one_device(mesh):
    """At TT numerics (bf16 partial sums, bfp weights per shard) the mesh stays PCC-close to one device."""
    m = model(config("llama", mesh))
    tokens = np.random.default_rng(5).integers(0, 256, 36)
    blocks = np.arange(3, dtype=np.int32)
    pol = POLICIES["performance"]
    single, _ = run(Executor(m, numerics="full", policy=pol, max_seq_len=128), tokens, 33, blocks)
    multi, _ = run(MeshExecutor(m, mesh, numerics="full", policy=pol, max_seq_len=128), tokens, 33, blocks)
    ok, pcc = comp_pcc(single, multi, 0.999)
    assert ok, pcc
    assert (single.argmax(-1) == multi.argmax(-1)).mean() >= 0.9


def test_vocab_padded_to_whole_tiles_per_device():
    """A vocab that does not split into whole tiles per device: the LM head is zero-padded, the host drops it."""
    m = model(config("llama", 2, vocab_size=288))
    prog = tp.shard(lower(m.config, prefill_len=40, batch=1, max_seq_len=256), 2)
    assert prog.prefill.tensors["lm_head"].shape == (1, 1, 64, 160)
    assert prog.prefill.meta["mesh"]["output"] == {"mesh_composer": "ttnn.ConcatMeshToTensor", "dim": 3,
                                                   "logical_width": 288}
    tokens = np.random.default_rng(6).integers(0, 288, 40)
    got = tp_forward(m, tokens, 2)
    np.testing.assert_allclose(got, np.asarray(jm.forward(m, tokens[None]))[0], atol=2e-5, rtol=0)


def tp_forward(m, tokens, n):
    ex = MeshExecutor(m, n, numerics="exact", max_seq_len=128)
    return ex.prefill(tokens, np.arange(4, dtype=np.int32), ex.allocate_kv_cache(4))


@pytest.mark.parametrize("family", ["cohere", "exaone4", "qwen3_moe", "mistral"])
def test_other_block_kinds(family):
    """Parallel (Cohere: per-head LayerNorm q/k weights split with the heads), post-norm (EXAONE: NoPE layer),
    Qwen3-MoE routing with a dense layer, sliding windows: 2 devices == jm.forward."""
    m = model(config(family, 2))
    tokens = np.random.default_rng(7).integers(0, 256, 40)
    np.testing.assert_allclose(tp_forward(m, tokens, 2), np.asarray(jm.forward(m, tokens[None]))[0], atol=2e-5,
                               rtol=0)


# ------------------------------------------------------------------------------- program and the wheel
def _check_against_wheel(prog):
    for c in prog.calls:
        api.check_call(c.op, list(c.kwargs), n_positional=len(c.inputs))
        for v in c.kwargs.values():
            if isinstance(v, str) and v.startswith("ttnn.") and "." in v[5:]:
                assert api.has_constant(v), v
    mesh = prog.meta["mesh"]
    for name, spec in mesh["mappers"].items():  # ttnn.ShardTensor2dMesh(mesh_device, dims=, mesh_shape=), ...
        api.check_call(spec["mesh_mapper"], [k for k in spec if k not in ("mesh_mapper", "host")], n_positional=1)
        api.check_call("ttnn.as_tensor", ["dtype", "layout", "device", "memory_config", "mesh_mapper"],
                       n_positional=1)
    out = mesh["output"]  # ConcatMeshToTensor(mesh_device, dim=) / ConcatMesh2dToTensor(mesh_device, mesh_shape=, dims=)
    api.check_call(out["mesh_composer"], [k for k in out if k not in ("mesh_composer", "logical_width",
                                                                      "rows_replicated")], n_positional=1)
    api.check_call("ttnn.to_torch", ["mesh_composer"], n_positional=1)


@pytest.mark.parametrize("family,n", CASES)
def test_every_call_and_mapper_matches_the_wheel(family, n):
    prog = tp.shard(lower(config(family, n), prefill_len=128, batch=4, max_seq_len=512), n)
    rows = tp.mesh_shape(n)[0]
    for p in (prog.prefill, prog.decode):
        _check_against_wheel(p)
        ccl = [c for c in p.calls if c.op in tp.CCL_OPS]
        assert {c.kwargs["cluster_axis"] for c in ccl} == ({1} if rows == 1 else {0, 1})
    # the sharded model program is still plain data
    again = TTModelProgram.from_json(prog.to_json())
    assert again.decode.calls == prog.decode.calls
    assert again.meta["kv_cache"]["shape"][1] == config(family, n).num_kv_heads // head_split(n)


def test_placement_is_tt_transformers():
    """Llama on 2 devices, layer 0 of decode: all_gather before each norm, column-parallel QKV with each
    device's heads, row-parallel wo/w2 followed by reduce_scatter, biases after it, the final norm gathered,
    logits vocab-sharded; the mappers are the ones tt_transformers gives each weight."""
    cfg = config("llama", 2)
    prog = tp.shard(lower(cfg, prefill_len=128, batch=4, max_seq_len=512), 2).decode
    ops = [c.op.removeprefix("ttnn.") for c in prog.calls]
    i0 = next(i for i, c in enumerate(prog.calls) if c.op == "ttnn.rms_norm")
    layer = ops[i0 - 1:ops.index("add", ops.index("reduce_scatter", ops.index("reduce_scatter") + 1)) + 1]
    assert layer == [
        "all_gather", "rms_norm", "linear", "add", "experimental.nlp_create_qkv_heads_decode",
        "experimental.rotary_embedding_llama", "experimental.rotary_embedding_llama",
        "experimental.paged_update_cache", "experimental.paged_update_cache",
        "transformer.paged_scaled_dot_product_attention_decode", "experimental.nlp_concat_heads_decode",
        "linear", "reduce_scatter", "add", "add", "all_gather", "rms_norm", "linear", "linear", "mul", "linear",
        "reduce_scatter", "add"]
    heads = next(c for c in prog.calls if c.op.endswith("nlp_create_qkv_heads_decode"))
    assert (heads.kwargs["num_heads"], heads.kwargs["num_kv_heads"]) == (2, 1)
    assert ops[-2:] == ["rms_norm", "linear"] and ops[-3] == "all_gather"
    maps = prog.meta["mesh"]["mappers"]
    dims = {n: maps[n].get("dims") for n in ("embed", "layers.0.wqkv", "layers.0.wo", "layers.0.w1", "layers.0.w2",
                                             "layers.0.bo", "lm_head", "kv.0.k", "layers.0.attn_norm", "tokens")}
    assert dims == {"embed": [None, 1], "layers.0.wqkv": [None, 3], "layers.0.wo": [None, 2],
                    "layers.0.w1": [None, 3], "layers.0.w2": [None, 2], "layers.0.bo": [None, 3],
                    "lm_head": [None, 3], "kv.0.k": [None, 1], "layers.0.attn_norm": None, "tokens": None}
    assert prog.tensors["kv.0.k"].shape == (None, 1, 32, 32) and prog.tensors["l0.q"].shape == (1, 4, 2, 32)
    # wqkv regrouped: device j's columns are its own q heads, then its k head, then its v head
    m = model(cfg)
    host = MeshExecutor(m, 2, numerics="exact", max_seq_len=512).host
    w = host["layers.0.wqkv"]
    shards = tp.distribute(tp.host_tensor(host, "layers.0.wqkv", maps["layers.0.wqkv"]), maps["layers.0.wqkv"])
    d = cfg.head_dim
    for j, s in enumerate(shards):
        q, k, v = w[..., 2 * j * d:(2 * j + 2) * d], w[..., (4 + j) * d:(5 + j) * d], w[..., (6 + j) * d:(7 + j) * d]
        np.testing.assert_array_equal(s, np.concatenate([q, k, v], -1))


def test_experts_are_expert_parallel():
    """GPT-OSS with 8 experts on 8 devices: one expert iteration per device (device j's weights are expert j,
    stacked and split by ShardTensor2dMesh), the routing weights mesh-partitioned, one reduce_scatter per MoE."""
    prog = tp.shard(lower(config("gpt_oss", 8), prefill_len=128, batch=4, max_seq_len=512), 8).decode
    maps = prog.meta["mesh"]["mappers"]
    assert [n for n in maps if n.startswith("layers.0.e")] == [f"layers.0.e0.{w}" for w in
                                                               ("w1", "b1", "w3", "b3", "w2", "b2")]
    assert maps["layers.0.e0.w1"]["host"]["stack"] == [f"layers.0.e{j}.w1" for j in range(8)]
    assert maps["layers.0.e0.w1"]["dims"] == [None, 1] and maps["layers.0.router"] == {
        "mesh_mapper": "ttnn.ReplicateTensorToMesh"}
    part = [c for c in prog.calls if c.op == "ttnn.mesh_partition"]
    assert [c.inputs[0] for c in part] == ["l0.route", "l1.route"]
    rs = [c.inputs[0] for c in prog.calls if c.op == "ttnn.reduce_scatter"]
    assert "l0.e0.yw" in rs and not any(".e1." in c.outputs[0] for c in prog.calls if c.outputs)


# --------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("n,over,match", [
    (8, {}, "4 query heads are not divisible by 8"),
    (4, {"num_key_value_heads": 2}, "2 KV heads are not divisible by 4"),
    (4, {"num_key_value_heads": 4}, "hidden_size=64 is not a multiple of 128"),
    (2, {"intermediate_size": 96}, "intermediate size 96 is not a multiple of 64"),
    ((2, 8), {"num_key_value_heads": 4, "hidden_size": 128}, "hidden_size=128 is not a multiple of 256"),
    ((8, 4), {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 128},
     "4 KV heads are not divisible by 8"),
])
def test_indivisible_shapes_are_refused(n, over, match):
    cfg = config("llama", 2, **over)
    with pytest.raises(tp.MeshShardError, match=match):
        tp.shard(lower(cfg, prefill_len=128, batch=1, max_seq_len=256), n)
    assert issubclass(tp.MeshShardError, TTConstraintError)
    with pytest.raises(tp.MeshShardError, match=match):  # the executor refuses at construction
        MeshExecutor(model(cfg), n, numerics="exact", max_seq_len=256)


def test_experts_not_divisible_are_refused():
    cfg = config("gpt_oss", 8)
    cfg4 = dataclasses.replace(cfg, layers=tuple(dataclasses.replace(
        s, mlp=dataclasses.replace(s.mlp, num_experts=4)) for s in cfg.layers))
    with pytest.raises(tp.MeshShardError, match="4 experts, not divisible by 8"):
        tp.shard(lower(cfg4, prefill_len=128, batch=1, max_seq_len=256), 8)
    with pytest.raises(tp.MeshShardError, match="3 data-parallel"):
        tp.submesh_shapes((2, 4), 3)


# ------------------------------------------------------------------------------------ DP submeshes x TP
def test_data_parallel_submeshes_with_tensor_parallelism():
    """A (2, 4) mesh as two data-parallel (1, 4) TP groups (generator_vllm's create_submeshes): each group serves
    its own users with its own caches and equals the single device; and the same through the generator's
    initialize_vllm_model with this module's executor factory."""
    cfg = config("llama", 2, hidden_size=128, num_key_value_heads=4)
    m = model(cfg)
    assert tp.submesh_shapes((2, 4), 2) == [(1, 4), (1, 4)] and tp.submesh_shapes((8, 4), 4) == [(1, 8)] * 4
    groups = data_parallel(m, (2, 4), 2, numerics="exact", max_seq_len=128)
    assert [g.mesh_shape for g in groups] == [(1, 4), (1, 4)]
    single = Executor(m, numerics="exact", max_seq_len=128)
    for g, seed in zip(groups, (8, 9)):
        tokens = np.random.default_rng(seed).integers(0, 256, 37)
        blocks = np.arange(4, dtype=np.int32)
        np.testing.assert_allclose(run(g, tokens, 35, blocks)[0], run(single, tokens, 35, blocks)[0], atol=1e-5,
                                   rtol=0)

    gen = G.LlamaForCausalLM.initialize_vllm_model(cfg, G.EmulatedMesh((2, 4)), 4, 128, tt_data_parallel=2,
                                                   executor_factory=executor_factory(m, numerics="exact"))
    assert [x.executor.mesh_shape for x in gen.model] == [(1, 4), (1, 4)]
    kv = gen.allocate_kv_cache((8, 4, 32, 32), np.float32, cfg.num_layers)
    lens = [20, 33, 7, 12]
    seqs = [np.random.default_rng(30 + s).integers(0, 256, n + 1) for s, n in enumerate(lens)]
    pt = np.stack([np.arange(4) + 4 * (s % 2) for s in range(4)]).astype(np.int32)  # two users per submesh
    tokens = np.zeros((4, max(lens)), np.int32)
    for s, n in enumerate(lens):
        tokens[s, :n] = seqs[s][:n]
    logits = gen.prefill_forward(tokens, page_table=pt, kv_cache=kv, prompt_lens=lens)
    out = gen.decode_forward(np.array([q[n] for q, n in zip(seqs, lens)]), np.array(lens), page_table=pt,
                             kv_cache=kv)
    for s, n in enumerate(lens):
        ref = np.asarray(jm.forward(m, seqs[s][None]))[0]
        np.testing.assert_allclose(logits[s, 0], ref[n - 1], atol=2e-5, rtol=0)
        np.testing.assert_allclose(out[s, 0], ref[n], atol=2e-5, rtol=0)
    # without data parallelism the generator hands over the whole mesh: a 2-D one runs the 2-D (TG) layout
    whole = G.LlamaForCausalLM.initialize_vllm_model(cfg, G.EmulatedMesh((2, 2)), 4, 128,
                                                     executor_factory=executor_factory(m, numerics="exact"))
    assert [x.executor.mesh_shape for x in whole.model] == [(2, 2)]


def test_one_device_mesh_is_the_program_itself():
    prog = lower(config("llama", 2), prefill_len=128, batch=1, max_seq_len=256)
    one = tp.shard(prog, 1)
    assert one.decode.calls == prog.decode.calls and one.decode.meta["mesh"]["mappers"] == {}
    json.loads(one.to_json())


def test_mappers_build_the_wheels_objects():
    """ttnn_mapper / ttnn_composer call the wheel's classes with the arguments they take."""
    calls = []

    class Fake:
        def __getattr__(self, name):
            def make(*args, **kw):
                api.check_call(f"ttnn.{name}", list(kw), n_positional=len(args))
                calls.append((name, kw))
                return name
            return make

    prog = tp.shard(lower(config("llama", 2), prefill_len=128, batch=1, max_seq_len=256), 2).prefill
    maps = prog.meta["mesh"]["mappers"]
    assert tp.ttnn_mapper(Fake(), "mesh", maps["layers.0.wo"]) == "ShardTensor2dMesh"
    assert tp.ttnn_mapper(Fake(), "mesh", maps["final_norm"]) == "ReplicateTensorToMesh"
    assert tp.ttnn_composer(Fake(), "mesh", prog.meta["mesh"]["output"]) == "ConcatMeshToTensor"
    assert calls[0] == ("ShardTensor2dMesh", {"dims": (None, 2), "mesh_shape": (1, 2)})


def test_rings_chunks_and_per_layer_tables_on_a_mesh():
    """vLLM executor paths on 2 devices == one device: Gemma3's sliding layer in a 96-token ring with per-layer
    page tables decoding past the ring; Llama's prompt prefilled in two chunks (the second reads the first
    through the cache)."""
    m = model(config("gemma3", 2))
    T, steps = 100, 30
    tokens = np.random.default_rng(10).integers(0, 256, T + steps)
    tables = [np.array([[9, 4, 12]], np.int32), np.array([[0, 1, 2, 3, 5, 6, 7, 8]], np.int32)]
    modulo = [96, None]
    outs = []
    for ex in (VLLMExecutor(m, numerics="exact", max_seq_len=256), MeshVLLMExecutor(m, 2, numerics="exact",
                                                                                    max_seq_len=256)):
        kv = ex.executor.allocate_kv_cache(16)
        full_row = pc.prefill_page_table(tables[1][0], T, 128, 32)
        got = [ex.prefill(tokens[None, :T], chunk_start=0, last_token_idx=T - 1, valid_seq_len=T,
                          page_tables=[tables[0], full_row], chunk_page_tables=None, kv_cache=kv,
                          cache_position_modulo=modulo, owners=None)]
        for p in range(T, T + steps):
            got.append(ex.decode(tokens[p:p + 1], np.array([p]), page_tables=tables, kv_cache=kv,
                                 cache_position_modulo=modulo, owners=None)[0])
        outs.append(np.stack(got))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=0)

    m = model(config("llama", 2))
    tokens = np.random.default_rng(11).integers(0, 256, 160)
    row = np.array([[3, 0, 5, 1, 4, 2, 6, 7]], np.int32)
    outs = []
    for ex in (VLLMExecutor(m, numerics="exact", max_seq_len=256), MeshVLLMExecutor(m, 2, numerics="exact",
                                                                                    max_seq_len=256)):
        kv = ex.executor.allocate_kv_cache(8)
        ex.prefill(tokens[None, :128], chunk_start=0, last_token_idx=127, valid_seq_len=128, page_tables=[row] * 2,
                   chunk_page_tables=[row[:, :4]] * 2, kv_cache=kv, cache_position_modulo=[None] * 2, owners=None)
        outs.append(ex.prefill(tokens[None, 128:], chunk_start=128, last_token_idx=31, valid_seq_len=160,
                               page_tables=[row] * 2, chunk_page_tables=[row[:, 4:8]] * 2, kv_cache=kv,
                               cache_position_modulo=[None] * 2, owners=None))
    np.testing.assert_allclose(outs[1], outs[0], atol=1e-5, rtol=0)
    ref = np.asarray(jm.forward(m, tokens[None]))[0, -1]
    np.testing.assert_allclose(outs[0], ref, atol=3e-5, rtol=0)


def test_galaxy_placement_is_tt_transformers_tg():
    """8x4 (Galaxy): heads and the intermediate size split over the 8 rows, the hidden size over the 4 columns, as
    tt_transformers' TG layout (wqkv / w1 / w3 dims=(3, 2), wo / w2 dims=(2, 3)); each matmul's partial sums are
    all-reduced on the axis that split its contracted dim; logits come back from one row of devices."""
    prog = tp.shard(lower(config("llama", (8, 4)), prefill_len=128, batch=4, max_seq_len=512), (8, 4)).decode
    maps = prog.meta["mesh"]["mappers"]
    dims = {n: maps[n].get("dims") for n in ("embed", "layers.0.wqkv", "layers.0.bqkv", "layers.0.wo", "layers.0.bo",
                                             "layers.0.w1", "layers.0.w2", "lm_head", "kv.0.k")}
    assert dims == {"embed": [None, 1], "layers.0.wqkv": [3, 2], "layers.0.bqkv": [3, None], "layers.0.wo": [2, 3],
                    "layers.0.bo": [None, 3], "layers.0.w1": [3, 2], "layers.0.w2": [2, 3], "lm_head": [None, 3],
                    "kv.0.k": [1, None]}
    seq = [(c.op.removeprefix("ttnn."), c.kwargs.get("cluster_axis")) for c in prog.calls
           if c.op in tp.CCL_OPS or c.op == "ttnn.linear"][:10]
    assert seq == [("all_gather", 1), ("mesh_partition", 1), ("linear", None), ("all_reduce", 1),  # norm, wqkv
                   ("linear", None), ("all_reduce", 0),  # wo
                   ("all_gather", 1), ("mesh_partition", 1), ("linear", None), ("linear", None)]  # norm, w1, w3
    assert prog.tensors["kv.0.k"].shape == (None, 1, 32, 32) and prog.tensors["x0"].shape == (1, 1, 4, 64)
    assert prog.meta["mesh"]["output"] == {"mesh_composer": "ttnn.ConcatMesh2dToTensor", "mesh_shape": [8, 4],
                                           "dims": [1, 3], "rows_replicated": True}


def test_an_op_without_a_rule_is_refused():
    """A call the transform has no placement rule for (e.g. a future DeepSeek op) fails loudly, never replicated."""
    prog = lower(config("llama", 2), prefill_len=128, batch=1, max_seq_len=256).decode
    i = next(k for k, c in enumerate(prog.calls) if c.op == "ttnn.rms_norm")
    calls = list(prog.calls)
    calls[i] = dataclasses.replace(calls[i], op="ttnn.experimental.new_op")
    with pytest.raises(NotImplementedError, match="no rule for ttnn.experimental.new_op"):
        tp.shard_program(dataclasses.replace(prog, calls=calls), 2)
