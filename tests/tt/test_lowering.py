"""Lowering: the op sequences tt_transformers writes, the constraint checker, the RoPE permutation
rule per family, API conformance against the real ttnn signatures, and per-family snapshots."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

import tt_backend
from jaxmodels import families
from jaxmodels.config import LayerSpec
from tests.tt.test_tt_forward import BASE, TINY, TINY_MOE, tiny_config, tiny_model
from tt_backend import api
from tt_backend.lowering import (TTConstraintError, check_program, check_sampling, check_topk, lower,
                                 padded_prefill_len)
from tt_backend.program import Ref, TTCall
from tt_backend.weights import layer_weights, meta_permutation, needs_meta_permutation

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = list(TINY) + list(TINY_MOE)


def _lower(name, **kw):
    return lower(tiny_config(name), **{"prefill_len": 128, "batch": 4, "max_seq_len": 512, **kw})


def _layer_calls(prog, i):
    """Calls that produce layer i's tensors, plus its in-place cache writes."""
    return [c for c in prog.calls if any(o.startswith(f"l{i}.") for o in c.outputs) or
            (not c.outputs and any(x.startswith(f"kv.{i}.") for x in c.inputs))]


# ------------------------------------------------------------------------------- structure
def test_llama_decoder_layer_is_tt_transformers_sequence():
    p = _lower("llama")
    ops = lambda prog: [c.op.removeprefix("ttnn.") for c in _layer_calls(prog, 0)]  # noqa: E731
    assert ops(p.prefill) == [
        "rms_norm", "linear", "add",  # attention norm, fused QKV, its bias (separate add, as tt_transformers)
        "experimental.nlp_create_qkv_heads",
        "experimental.rotary_embedding_llama", "experimental.rotary_embedding_llama",
        "typecast", "typecast", "experimental.paged_fill_cache", "experimental.paged_fill_cache",
        "transformer.scaled_dot_product_attention", "experimental.nlp_concat_heads", "linear", "add",
        "add", "rms_norm", "linear", "linear", "mul", "linear", "add"]
    assert ops(p.decode) == [
        "rms_norm", "linear", "add", "experimental.nlp_create_qkv_heads_decode",
        "experimental.rotary_embedding_llama", "experimental.rotary_embedding_llama",
        "experimental.paged_update_cache", "experimental.paged_update_cache",
        "transformer.paged_scaled_dot_product_attention_decode", "experimental.nlp_concat_heads_decode",
        "linear", "add", "add", "rms_norm", "linear", "linear", "mul", "linear", "add"]


def test_dtypes_and_compute_configs_follow_the_policy():
    perf, acc = _lower("llama").decode, _lower("llama", policy="accuracy").decode
    t = perf.tensors
    assert t["layers.0.w1"].dtype == "ttnn.bfloat4_b" and t["layers.0.w2"].dtype == "ttnn.bfloat8_b"
    assert t["layers.0.wqkv"].dtype == "ttnn.bfloat8_b" and t["kv.0.k"].dtype == "ttnn.bfloat8_b"
    assert t["embed"].dtype == "ttnn.bfloat16" and t["embed"].layout == "ttnn.ROW_MAJOR_LAYOUT"
    assert acc.tensors["layers.0.wqkv"].dtype == "ttnn.bfloat16" and acc.tensors["layers.0.w1"].dtype == "ttnn.bfloat8_b"
    w1 = next(c for c in perf.calls if c.op == "ttnn.linear" and "layers.0.w1" in c.inputs)
    assert w1.kwargs["compute_kernel_config"]["math_fidelity"] == "ttnn.MathFidelity.LoFi"
    norm = next(c for c in perf.calls if c.op == "ttnn.rms_norm")
    assert norm.kwargs["compute_kernel_config"]["fp32_dest_acc_en"] is True
    # decode: rows padded to a tile, heads padded to 32 in storage; prefill in DRAM
    assert t["l0.q"].shape == (1, 4, 4, 32) and t["l0.q"].padded_shape == (1, 4, 32, 32)
    assert t["x0"].padded_shape == (1, 1, 32, 64) and t["l0.h"].memory == "L1_WIDTH_SHARDED_MEMORY_CONFIG"
    assert _lower("llama").prefill.tensors["l0.h"].memory == "DRAM_MEMORY_CONFIG"
    # cache writes: bf16 rows in decode, cache-dtype tiles in prefill
    upd = next(c for c in perf.calls if c.op == "ttnn.experimental.paged_update_cache")
    assert t[upd.inputs[1]].dtype == "ttnn.bfloat16"
    pre = _lower("llama").prefill
    fill = next(c for c in pre.calls if c.op == "ttnn.experimental.paged_fill_cache")
    assert pre.tensors[fill.inputs[1]].dtype == pre.tensors[fill.inputs[0]].dtype == "ttnn.bfloat8_b"


def test_family_features_reach_the_program():
    # Qwen3: q/k rms_norm before RoPE
    d = _lower("qwen3").decode
    ops0 = [c.op for c in _layer_calls(d, 0)]
    assert ops0.index("ttnn.rms_norm", 1) < ops0.index("ttnn.experimental.rotary_embedding_llama")
    # EXAONE-4: the full-attention layer (3) is NoPE, the sliding ones rotate; windows on the read side only
    e = _lower("exaone4").decode
    rot = lambda i: sum(c.op.endswith("rotary_embedding_llama") for c in _layer_calls(e, i))  # noqa: E731
    assert [rot(i) for i in range(4)] == [2, 2, 2, 0]
    sdpa = [c.kwargs["sliding_window_size"] for c in e.calls if c.op.endswith("attention_decode")]
    assert sdpa == [48, 48, 48, None]
    # post-norm: the attention input is the raw residual
    first = _layer_calls(e, 0)[0]
    assert first.op == "ttnn.linear" and first.inputs[0] == "x0"
    # Gemma3: two rope tables (local and global), sandwich norms, embedding scale, final softcap
    g = _lower("gemma3").prefill
    tables = {c.inputs[1] for c in g.calls if c.op.endswith("rotary_embedding_llama")}
    assert len(tables) == 2
    assert [c.op for c in g.calls][-3:] == ["ttnn.mul", "ttnn.tanh", "ttnn.mul"]
    assert any(c.op == "ttnn.mul" and c.inputs == ("x0",) for c in g.calls)
    # Cohere: parallel block (MLP reads the attention norm's output), LayerNorm, per-head qk LayerNorm, logit scale
    c = _lower("cohere").prefill
    w1 = next(x for x in c.calls if "layers.0.w1" in x.inputs)
    assert w1.inputs[0] == "l0.h" and c.calls[-1].kwargs["input_tensor_b"] == 0.25
    assert "ttnn.rms_norm" not in {x.op for x in c.calls}
    # GPT-OSS attention: per-head sinks reach both SDPA ops
    o = _lower("gpt_oss_dense")
    for prog in (o.prefill, o.decode):
        s = [x for x in prog.calls if "attention" in x.op]
        assert all(isinstance(x.kwargs["attention_sink"], Ref) for x in s) and len(s) == 2


def test_rope_permutation_rule_per_family():
    """HF half-split families are permuted to the interleaved Meta layout; Cohere (already interleaved)
    and NoPE layers are not. V never is."""
    for name, want in (("llama", True), ("qwen3", True), ("mistral", True), ("gemma3", True), ("cohere", False),
                       ("gpt_oss_dense", True)):
        assert all(needs_meta_permutation(s) == want for s in tiny_config(name).layers), name
    exa = tiny_config("exaone4")
    assert [needs_meta_permutation(s) for s in exa.layers] == [True, True, True, False]
    perm = meta_permutation(32)
    assert perm[:4].tolist() == [0, 16, 1, 17] and sorted(perm.tolist()) == list(range(32))
    for name, permuted in (("llama", True), ("cohere", False)):
        m = tiny_model(name)
        cfg, spec = m.config, m.config.layers[0]
        p = {k: (v[0] if not isinstance(v, dict) else {kk: vv[0] for kk, vv in v.items()})
             for k, v in m.params["layers"]["0"].items()}
        w = layer_weights(cfg, spec, p)
        H, K, d, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        wq = w["wqkv"][0, 0][:, : H * d].reshape(D, H, d)
        wv = w["wqkv"][0, 0][:, (H + K) * d:].reshape(D, K, d)
        np.testing.assert_array_equal(wq, np.asarray(p["attn"]["wq"])[..., perm] if permuted else p["attn"]["wq"])
        np.testing.assert_array_equal(wv, p["attn"]["wv"])


# ------------------------------------------------------------------------------ constraints
def _cfg(name="llama", **over):
    return families.config_from_hf({**BASE, **TINY[name], **over})


@pytest.mark.parametrize("over,match", [
    ({"head_dim": 16}, "head_dim=16"),
    ({"hidden_size": 80}, "hidden_size=80"),
    ({"intermediate_size": 100}, "intermediate_size=100"),
    ({"num_attention_heads": 64, "num_key_value_heads": 8}, "64 query"),
])
def test_constraint_checker_rejects(over, match):
    with pytest.raises(TTConstraintError, match=match):
        lower(_cfg(**over))


def test_constraints_on_shapes_and_settings():
    with pytest.raises(TTConstraintError, match="decode batch 33"):
        lower(_cfg(), batch=33)
    with pytest.raises(TTConstraintError, match="block_size=48"):
        lower(_cfg(), block_size=48)
    with pytest.raises(TTConstraintError, match="exceeds max_seq_len"):
        lower(_cfg(), prefill_len=600, max_seq_len=512)
    assert [padded_prefill_len(n) for n in (1, 128, 129, 4100)] == [128, 128, 256, 4224]
    check_topk(32, 65536)
    check_topk(2, 4)  # a router over 4 experts: topk pads the partial tile itself
    for k, width, match in ((5, 4, "k=5"), (8, 65536 + 32, "width")):
        with pytest.raises(TTConstraintError, match=match):
            check_topk(k, width)
    check_sampling(32, 1024, 32)
    for k, width, users, match in ((33, 1024, 1, "k=33"), (8, 1024, 33, "33 users"), (8, 96, 1, "power-of-two")):
        with pytest.raises(TTConstraintError, match=match):
            check_sampling(k, width, users)
    soft = dataclasses.replace(_cfg(), layers=tuple(
        dataclasses.replace(s, attention=dataclasses.replace(s.attention, softcap=50.0)) for s in _cfg().layers))
    with pytest.raises(TTConstraintError, match="softcap"):
        lower(soft)
    dyn = _cfg(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(TTConstraintError, match="dynamic"):
        lower(dyn)


def test_unsupported_layer_kinds_raise_not_implemented():
    moe = tiny_config("qwen3_moe")
    shared = dataclasses.replace(moe, layers=tuple(
        dataclasses.replace(s, mlp=dataclasses.replace(s.mlp, shared_intermediate_size=64)) if s.mlp.kind == "moe"
        else s for s in moe.layers))
    with pytest.raises(NotImplementedError, match="shared expert"):
        lower(shared)
    from jaxmodels.config import MHCSpec
    from jaxmodels.families import deepseek_v4

    mhc = dataclasses.replace(_cfg(), layers=tuple(dataclasses.replace(s, mhc=MHCSpec()) for s in _cfg().layers))
    with pytest.raises(NotImplementedError, match="mHC"):
        lower(mhc)
    ds = deepseek_v4.config({"model_type": "deepseek_v4", "num_hidden_layers": 2, "hidden_size": 64,
                             "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 32,
                             "o_groups": 2, "o_lora_rank": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 32, "compress_ratios": [0, 128]})
    ds_prog = lower(ds)  # DeepSeek is lowered by tt_backend.deepseek_lowering (tests/tt/test_deepseek_lowering.py)
    assert "ttnn.sparse_matmul" in ds_prog.prefill.ops() and "ttnn.sparse_matmul" in ds_prog.decode.ops()


def test_program_checker_catches_illegal_calls():
    p = _lower("llama").decode
    upd = next(i for i, c in enumerate(p.calls) if c.op == "ttnn.experimental.paged_update_cache")
    bad = dataclasses.replace(p, calls=list(p.calls))
    c = bad.calls[upd]
    bad.tensors = dict(p.tensors) | {"x8": dataclasses.replace(p.tensors[c.inputs[1]], dtype="ttnn.bfloat8_b")}
    bad.calls[upd] = TTCall(c.op, (c.inputs[0], "x8"), c.kwargs, c.outputs)
    with pytest.raises(TTConstraintError, match="bfloat16 or float32"):
        check_program(bad)
    pre = _lower("llama").prefill
    f = next(i for i, c in enumerate(pre.calls) if c.op == "ttnn.experimental.paged_fill_cache")
    bad = dataclasses.replace(pre, calls=list(pre.calls))
    c = bad.calls[f]
    bad.calls[f] = TTCall(c.op, (c.inputs[0], "l0.k.rot", c.inputs[2]), c.kwargs, c.outputs)
    with pytest.raises(TTConstraintError, match="raw tile copy"):
        check_program(bad)
    bad = dataclasses.replace(pre, calls=pre.calls + [TTCall("ttnn.add", ("nope", "x0"), {}, ("y",))])
    with pytest.raises(TTConstraintError, match="no tensor spec"):
        check_program(bad)


# ------------------------------------------------------------------------- API conformance
def _variants(family):
    yield _lower(family)
    yield _lower(family, chunk_start=128, per_layer_page_tables=True)  # chunked prefill, hybrid page tables
    yield _lower(family, embeddings=True, attention_mask=True)  # multimodal prefill: embeddings in, masked SDPA
    cfg = tiny_config(family)
    if any(s.attention.window for s in cfg.layers):  # sliding rings
        yield _lower(family, cache_position_modulo=tuple(96 if s.attention.window else None for s in cfg.layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_call_matches_the_real_ttnn_api(family):
    """Op names, keyword names and arity against signatures extracted from the ttnn wheel; every
    ttnn constant we name (dtypes, layouts, memory configs, enums) exists; compute kernel configs use
    only WormholeComputeKernelConfig's fields. Covers the plain, chunked/per-layer, multimodal (embeddings
    input, masked SDPA) and ring variants."""
    progs = [p for v in _variants(family) for p in (v.prefill, v.decode)]
    assert {c.op for p in progs for c in p.calls} >= {"ttnn.linear", "ttnn.experimental.paged_update_cache"}
    for prog in progs:
        for c in prog.calls:
            api.check_call(c.op, list(c.kwargs), n_positional=len(c.inputs))
            for k, v in c.kwargs.items():
                vals = v if isinstance(v, list) else [v]
                for x in vals:
                    if isinstance(x, str):  # memory configs are named without the module prefix
                        name = "ttnn." + x if k == "memory_config" else x
                        assert api.has_constant(name), f"{c.op} {k}={x!r} is not a ttnn constant"
                    if isinstance(x, dict):
                        fields = set(x) - {"type"}
                        assert fields <= set(api.type_keywords(x["type"])), (c.op, fields)
                        assert all(api.has_constant(f) for f in x.values() if isinstance(f, str) and f != x["type"])
        for s in prog.tensors.values():
            assert api.has_constant(s.dtype) and api.has_constant(s.layout) and api.has_constant("ttnn." + s.memory), s


def test_api_check_is_not_vacuous():
    with pytest.raises(api.TTApiError):
        api.check_call("ttnn.rms_norm", ["eps"], n_positional=1)
    with pytest.raises(api.TTApiError):
        api.check_call("ttnn.experimental.rotary_embedding_llama", ["is_decode"], n_positional=4)


# ------------------------------------------------------------------------------ snapshots
def _snapshot(progs) -> dict:
    out = {}
    for mode in ("prefill", "decode"):
        prog = getattr(progs, mode)
        out[mode] = [[c.op, list(c.inputs), json.loads(json.dumps(c.kwargs, default=lambda r: {"$ref": r.name})),
                      [[o, prog.tensors[o].dtype, list(prog.tensors[o].shape)] for o in c.outputs]]
                     for c in prog.calls]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_lowering_snapshot(family):
    """The whole program of each tiny family (ops, inputs, kwargs, output dtypes and shapes) against the
    checked-in snapshot. A deliberate change regenerates it with TT_UPDATE_GOLDEN=1 and is reviewed as a diff."""
    path = GOLDEN / f"lowering_{family}.json"
    got = _snapshot(_lower(family))
    if os.environ.get("TT_UPDATE_GOLDEN"):
        path.write_text(json.dumps(got, indent=0, sort_keys=True) + "\n")
    want = json.loads(path.read_text())
    for mode in ("prefill", "decode"):
        assert len(got[mode]) == len(want[mode]), f"{family} {mode}: {len(got[mode])} calls, snapshot {len(want[mode])}"
        for i, (g, w) in enumerate(zip(got[mode], want[mode])):
            assert g == w, f"{family} {mode} call {i}: {g} != snapshot {w}"


def test_layer_spec_defaults_lower():
    """A plan with default LayerSpecs (pre-norm, full attention, default RoPE) lowers without a family."""
    from jaxmodels.config import MLPSpec, ModelConfig

    cfg = ModelConfig(family="x", vocab_size=64, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      layers=(LayerSpec(mlp=MLPSpec(intermediate_size=64)),))
    progs = tt_backend.lower(cfg, batch=1)
    assert progs.decode.meta["rows"] == 1 and progs.prefill.meta["rows"] == 128


def test_program_variants():
    chunked = _lower("llama", chunk_start=128, per_layer_page_tables=True).prefill
    ops = [c.op for c in chunked.calls]
    assert "ttnn.transformer.chunked_scaled_dot_product_attention" in ops
    assert "ttnn.transformer.scaled_dot_product_attention" not in ops
    assert {"page_table.0", "page_table.1", "chunk_page_table.0"} <= set(chunked.inputs)
    fills = [c for c in chunked.calls if c.op.endswith("paged_fill_cache")]
    assert [c.inputs[2] for c in fills] == ["chunk_page_table.0"] * 2 + ["chunk_page_table.1"] * 2
    ring = _lower("gemma3", cache_position_modulo=(96, None))
    upd = [c.kwargs.get("cache_position_modulo") for c in ring.decode.calls if c.op.endswith("paged_update_cache")]
    assert upd == [96, 96, None, None] and "valid_seq_len" in ring.prefill.inputs
    with pytest.raises(TTConstraintError, match="ring of 32"):
        _lower("gemma3", cache_position_modulo=(32, None))  # smaller than the window of 48
    with pytest.raises(TTConstraintError, match="ring of 96"):
        _lower("gemma3", cache_position_modulo=(None, 96))  # layer 1 is a full-attention layer
    with pytest.raises(TTConstraintError, match="chunk_start=100"):
        _lower("llama", chunk_start=100)


def test_moe_lowering_structure():
    """GPT-OSS: router linear + bias, topk -> softmax over k, scatter to dense weights, then per expert
    w1/w3 (+bias), clamps, sigmoid gate, w2 (+bias), times its routing column, summed."""
    p = _lower("gpt_oss").decode
    ops = [c.op for c in _layer_calls(p, 0)]
    i = ops.index("ttnn.topk")
    assert ops[i - 3:i + 4] == ["ttnn.rms_norm", "ttnn.linear", "ttnn.add", "ttnn.topk", "ttnn.softmax",
                                "ttnn.mul", "ttnn.scatter"]
    assert ops.count("ttnn.clamp") == 2 * 4 and ops.count("ttnn.sigmoid") == 4 and ops.count("ttnn.slice") == 4
    assert p.tensors["l0.topi"].dtype == "ttnn.uint16"
    assert p.tensors["layers.0.e3.w1"].dtype == "ttnn.bfloat4_b" and p.tensors["layers.0.router"].dtype == "ttnn.bfloat16"
    q = _lower("qwen3_moe").prefill  # layer 0 routed (softmax -> topk -> renormalise), layer 1 dense
    ops = [c.op for c in _layer_calls(q, 0)]
    assert ops[ops.index("ttnn.softmax"):ops.index("ttnn.softmax") + 4] == ["ttnn.softmax", "ttnn.topk", "ttnn.sum",
                                                                            "ttnn.div"]
    assert "ttnn.topk" not in [c.op for c in _layer_calls(q, 1)]
