"""The emulated TT program of whole tiny models against `jm.forward`.

Each family is a tiny random model (every weight non-trivial, as tests/parity/hf_reference.py does),
built through `families.config_from_hf` with head_dim 32 (TT's rotary op and head split work on whole
32-column tiles). The long test prefills a 4100-token prompt through shuffled paged blocks and then
decodes 16 teacher-forced steps at positions 4100..4115, so RoPE-layout and window bugs that only show
at long range are caught. References are jm.forward's logits (and, per layer, jaxmodels' own hidden
states of the truncated model); the accuracy table is a frozen regression record.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxmodels as jm
import tt_backend
from jaxmodels import families, model as M, plan
from jaxmodels.config import MLPSpec
from tests.tt.test_emu_ops import comp_pcc
from tt_backend import Executor

GOLDEN = Path(__file__).parent / "golden" / "accuracy.json"
BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192}
TINY = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "rope_theta": 500000.0, "attention_bias": True,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 1024}},
    "qwen3": {"model_type": "qwen3", "num_hidden_layers": 2, "rope_theta": 1e6, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 48},
    "cohere": {"model_type": "cohere", "num_hidden_layers": 2, "hidden_size": 128, "use_qk_norm": True,
               "logit_scale": 0.25, "layer_norm_eps": 1e-5},
    "gemma3": {"model_type": "gemma3_text", "num_hidden_layers": 2, "query_pre_attn_scalar": 24, "sliding_window": 48,
               "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 1e6,
               "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
               "final_logit_softcapping": 30.0},
    "exaone4": {"model_type": "exaone4", "num_hidden_layers": 4, "sliding_window": 48, "sliding_window_pattern": "LLLG",
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    # GPT-OSS attention (sinks, biases, YaRN, alternating windows) over a dense MLP: its MoE is not lowered yet
    "gpt_oss_dense": {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 4,
                      "num_experts_per_tok": 2, "sliding_window": 48,
                      "layer_types": ["sliding_attention", "full_attention"], "rope_theta": 150000.0,
                      "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": False, "original_max_position_embeddings": 4096}},
}

# MoE families (experts lowered densely; see lowering._moe)
TINY_MOE = {
    "gpt_oss": {"model_type": "gpt_oss", "num_hidden_layers": 2, "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"],
                "rope_theta": 150000.0},
    "qwen3_moe": {"model_type": "qwen3_moe", "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_experts": 4,
                  "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1]},
}


def tiny_config(name: str):
    cfg = families.config_from_hf({**BASE, **TINY.get(name, TINY_MOE.get(name, {}))})
    if name == "gpt_oss_dense":
        mlp = MLPSpec(activation="silu", intermediate_size=128)
        cfg = dataclasses.replace(cfg, layers=tuple(dataclasses.replace(s, mlp=mlp) for s in cfg.layers))
    return cfg


def tiny_model(name: str, seed: int = 0) -> jm.Model:
    """Random params: matrices N(0, 0.05²), biases N(0, 0.5²), sinks N(0, 1), norms 1 + N(0, 0.1²)
    (Gemma's (1+w) norms N(0, 0.1²))."""
    cfg = tiny_config(name)
    rng = np.random.default_rng(seed)
    gemma = cfg.norm == "gemma"

    def init(leaf, shape):
        if name == "gpt_oss" and leaf in ("w_gate", "w_up"):  # as the parity harness: the ±7 clamp fires
            return 0.5 * rng.standard_normal(shape, np.float32)
        if "norm" in leaf:
            return (0.0 if gemma else 1.0) + 0.1 * rng.standard_normal(shape, np.float32)
        if leaf == "sinks":
            return rng.standard_normal(shape, np.float32)
        if leaf.startswith("b"):
            return 0.5 * rng.standard_normal(shape, np.float32)
        return 0.05 * rng.standard_normal(shape, np.float32)

    params: dict = {}
    for path, shape in plan.flat_shapes(cfg).items():  # NumPy only: no JAX work to build a tiny model
        *parents, leaf = path.split("/")
        node = params
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = init(leaf, shape)
    return jm.Model(cfg, params)


def topk_agreement(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """tt-metal's teacher-forced metric: top-1 = argmax equal; top-5 = emulated argmax in the reference top-5."""
    a = got.argmax(-1)
    top5 = np.argsort(-ref, axis=-1)[:, :5]
    return float((a == ref.argmax(-1)).mean()), float((top5 == a[:, None]).any(-1).mean())


def run_teacher_forced(model, tokens, prompt_len, numerics, policy, block_size=32, seed=0):
    """Prefill `prompt_len` tokens through a shuffled page table, then decode the rest one by one
    (each step fed the true next token). Returns logits [len(tokens), vocab] and the executor's tensors
    of the prefill."""
    S = tt_backend.lowering.padded_prefill_len(prompt_len)
    n_blocks = -(-max(S, len(tokens)) // block_size)
    ex = Executor(model, numerics=numerics, policy=policy, max_seq_len=n_blocks * block_size, block_size=block_size)
    kv = ex.allocate_kv_cache(n_blocks + 3)
    blocks = np.random.default_rng(seed).permutation(n_blocks + 3)[:n_blocks].astype(np.int32)
    t = ex.prefill(tokens[:prompt_len], blocks, kv, return_all=True)
    prog = ex.program("prefill", S)
    outs = [np.asarray(t[prog.outputs[0]]).reshape(S, -1)[:prompt_len]]
    t["decode_layers"] = []  # per decode step: {layer: hidden [D]}
    for p in range(prompt_len, len(tokens)):
        d = ex.decode(tokens[p:p + 1], [p], blocks[None], kv, return_all=True)
        dprog = ex.program("decode", 1)
        outs.append(np.asarray(d[dprog.outputs[0]]).reshape(1, -1))
        t["decode_layers"].append([np.asarray(d[f"l{i}.out"]).reshape(-1) for i in range(model.config.num_layers)])
    return np.concatenate(outs), t


def _reference(model, tokens):
    return np.asarray(jm.forward(model, np.asarray(tokens)[None]))[0]


def _hidden_after(model, tokens, n_layers):
    """jaxmodels' hidden state after the first `n_layers` layers (the truncated model's executor)."""
    cfg = dataclasses.replace(model.config, layers=model.config.layers[:n_layers])
    pl = plan.plan(cfg)
    layers = {str(k): jax.tree.map(lambda a, c=c: a[:c], model.params["layers"][str(k)]) for k, c in enumerate(pl.counts)}
    tok = np.asarray(tokens)[None]
    pos = np.arange(tok.shape[1], dtype=np.int32)[None]
    x, _, _ = M.hidden({**model.params, "layers": layers}, cfg, tok, pos, "full")
    return np.asarray(x)[0]


FAMILIES = list(TINY)
STEPS = 16
# Prompts past 4096 for the families that cover each RoPE layout / attention mix (HF half-split with
# llama3 scaling, interleaved Cohere, Gemma3 local+global tables, EXAONE sliding+NoPE); the rest run a
# 300-token prompt so the suite stays within its CPU budget.
PROMPT = {"llama": 4100, "cohere": 4100, "gemma3": 4100, "exaone4": 4100}
SHORT_PROMPT = 300
# tt-metal's whole-model gates are 0.94 (accuracy) / 0.86 (performance). Ours are tighter, sized from
# the measured values (golden/accuracy.json; lowest: EXAONE-4 0.973 whole, 0.952 worst decode step,
# 0.978 worst layer) with margin.
MODEL_PCC = {"performance": 0.96, "accuracy": 0.99}
STEP_PCC = 0.93
LAYER_PCC = 0.97


def _load_table():
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("family", FAMILIES + list(TINY_MOE))
def test_exact_forward_equals_jax(family):
    """numerics="exact" is fp32 semantics: the public entry point must reproduce jm.forward."""
    model = tiny_model(family)
    tokens = np.random.default_rng(1).integers(0, 256, (2, 37))
    got = tt_backend.forward(model, tokens, numerics="exact")
    ref = np.asarray(jm.forward(model, tokens))
    assert got.shape == ref.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_vs_jax(family):
    """Prefill (4100 tokens where PROMPT says so) + 16 decode steps, full TT numerics, performance policy:
    whole-model PCC, per-step decode PCC, per-layer PCC of the prefill, top-1/top-5 vs the table."""
    model = tiny_model(family)
    prompt = PROMPT.get(family, SHORT_PROMPT)
    tokens = np.random.default_rng(2).integers(0, 256, prompt + STEPS)
    got, t = run_teacher_forced(model, tokens, prompt, "full", "performance")
    ref = _reference(model, tokens)
    ok, pcc = comp_pcc(ref, got, MODEL_PCC["performance"])
    assert ok, f"{family}: whole-model PCC {pcc:.5f}"
    for s in range(STEPS):  # every decode step (positions 4100..4115 for the long prompts)
        ok, p = comp_pcc(ref[prompt + s], got[prompt + s], STEP_PCC)
        assert ok, f"{family}: decode step {s} (position {prompt + s}) PCC {p:.4f}"
    n = model.config.num_layers
    long = prompt > 1024  # the truncated reference over a whole long sequence is too slow for every layer
    for i in range(n):  # per layer: the first 256 prefill rows (causal: they need no later token) ...
        h_ref = _hidden_after(model, tokens[:256] if long else tokens, i + 1)
        h = np.asarray(t[f"l{i}.out"]).reshape(-1, model.config.hidden_size)[:256]
        ok, p = comp_pcc(h_ref[:256], h, LAYER_PCC)
        assert ok, f"{family}: layer {i} prefill PCC {p:.5f}"
        if not long:  # ... and every decode step's output of this layer
            hd = np.stack([step[i] for step in t["decode_layers"]])
            ok, p = comp_pcc(h_ref[prompt:], hd, LAYER_PCC)
            assert ok, f"{family}: layer {i} decode PCC {p:.5f}"
    _check_accuracy(family, "performance", got, ref, pcc)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_accuracy_policy(family):
    """The accuracy policy (bf16 attention weights, HiFi4, bfp8 MLP) on a shorter run."""
    model = tiny_model(family)
    tokens = np.random.default_rng(3).integers(0, 256, 300 + STEPS)
    got, _ = run_teacher_forced(model, tokens, 300, "full", "accuracy")
    ref = _reference(model, tokens)
    ok, pcc = comp_pcc(ref, got, MODEL_PCC["accuracy"])
    assert ok, f"{family}: accuracy-policy PCC {pcc:.5f}"
    _check_accuracy(family, "accuracy", got, ref, pcc)


def _check_accuracy(family, pol, got, ref, pcc):
    """Teacher-forced top-1/top-5 against the frozen table, with tt-metal's 0.5-point allowance.
    TT_UPDATE_GOLDEN=1 records the measured values instead (a deliberate, reviewed regeneration)."""
    top1, top5 = topk_agreement(got, ref)
    key = f"{family}/{pol}"
    table = _load_table()
    if os.environ.get("TT_UPDATE_GOLDEN"):
        table[key] = {"top1": round(100 * top1, 2), "top5": round(100 * top5, 2), "pcc": round(pcc, 6)}
        GOLDEN.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        return
    assert key in table, f"{key} missing from {GOLDEN.name}; run with TT_UPDATE_GOLDEN=1 to record it"
    want = table[key]
    assert 100 * top1 >= want["top1"] - 0.5, f"{key}: top-1 {100 * top1:.2f}% < frozen {want['top1']}% - 0.5"
    assert 100 * top5 >= want["top5"] - 0.5, f"{key}: top-5 {100 * top5:.2f}% < frozen {want['top5']}% - 0.5"


def test_forward_rejects_what_tt_cannot_run():
    model = tiny_model("llama")
    cfg = dataclasses.replace(model.config, head_dim=16, num_heads=8, num_kv_heads=4)
    with pytest.raises(tt_backend.TTConstraintError, match="head_dim=16"):
        tt_backend.forward(jm.Model(cfg, model.params), np.zeros((1, 4), np.int32))


# GPT-OSS "performance" measures 0.852: its bfloat4_b gate/up experts on this model's large weights (std 0.5,
# so the clamp fires) are the cause; with bfloat8_b gate/up and the same fidelity it measures 0.984.
@pytest.mark.parametrize("family,policy,gate", [("gpt_oss", "accuracy", 0.99), ("gpt_oss", "performance", 0.8),
                                                 ("qwen3_moe", "performance", 0.99)])
def test_moe_prefill_and_decode_vs_jax(family, policy, gate):
    """Routed experts (GPT-OSS: top-k of biased router logits, softmax over k, clamped SwiGLU with
    biases; Qwen3-MoE: softmax then top-k, renormalised) under full TT numerics. GPT-OSS's bfloat4_b
    experts ("performance") cost the most: its tiny model's gate/up weights are large (the clamp fires),
    so bfp4's shared exponents lose more; the gate records the measured level."""
    model = tiny_model(family)
    tokens = np.random.default_rng(8).integers(0, 256, 200 + 8)
    got, _ = run_teacher_forced(model, tokens, 200, "full", policy)
    ref = _reference(model, tokens)
    ok, pcc = comp_pcc(ref, got, gate)
    assert ok, f"{family}/{policy}: PCC {pcc:.5f}"
    _check_accuracy(family, policy, got, ref, pcc)


@pytest.mark.tt_device
def test_emulator_vs_device():
    """Hardware tier: the same programs through ttnn_exec on a device; skipped, and not evidence, without one."""
    try:
        import ttnn  # noqa: F401

        has_device = bool(ttnn.get_device_ids())
    except Exception:  # no wheel in this environment, or no driver
        has_device = False
    if not has_device or not os.environ.get("TT_DEVICE_TESTS"):
        pytest.skip("no Tenstorrent device")
    pytest.fail("emulator-vs-device comparison (tt_backend.ttnn_exec) not written yet: needs hardware to develop "
                "against")


# ------------------------------------------------------------------- the generator's executor
def _pt(blocks):
    return np.asarray(blocks, np.int32)[None]


def test_vllm_executor_chunked_prefill_and_per_layer_tables():
    """Chunked prefill (a second 128-token chunk attends to the first through the cache), each layer
    with its own physical blocks, then decode: equals jm.forward at exact, PCC-close at full."""
    from tt_backend.emu.executor import VLLMExecutor

    model = tiny_model("qwen3")
    L = model.config.num_layers
    tokens = np.random.default_rng(4).integers(0, 256, 256 + 8)
    ref = _reference(model, tokens)
    for numerics, tol in (("exact", None), ("full", 0.99)):
        ex = VLLMExecutor(model, numerics=numerics, max_seq_len=512)
        kv = ex.executor.allocate_kv_cache(40)
        perm = np.random.default_rng(5).permutation(40)
        rows = [_pt(perm[i * 16:(i + 1) * 16]) for i in range(L)]  # layer i: its own 16 blocks
        common = dict(valid_seq_len=128, kv_cache=kv, cache_position_modulo=[None] * L, owners=None)
        got = [ex.prefill(tokens[None, :128], chunk_start=0, last_token_idx=127, page_tables=[r[:, :4] for r in rows],
                          chunk_page_tables=None, **common)]
        got.append(ex.prefill(tokens[None, 128:256], chunk_start=128, last_token_idx=127, page_tables=rows,
                              chunk_page_tables=[r[:, 4:8] for r in rows], **common))
        for p in range(256, 264):
            got.append(ex.decode(tokens[p:p + 1], np.array([p]), page_tables=rows, kv_cache=kv,
                                 cache_position_modulo=[None] * L, owners=None)[0])
        got = np.stack(got)
        want = ref[[127, 255] + list(range(256, 264))]
        if tol is None:
            np.testing.assert_allclose(got, want, atol=3e-5)
        else:
            ok, p = comp_pcc(want, got, tol)
            assert ok, p


def test_vllm_executor_sliding_rings():
    """Sliding layers in rings of 96 tokens (cache_position_modulo), full layers full-length, per-layer
    tables; decode runs far past the ring size. exact == jm.forward."""
    from tt_backend import paged_cache as pc
    from tt_backend.emu.executor import VLLMExecutor

    model = tiny_model("gemma3")  # layer 0 slides (window 48), layer 1 is full
    bs, ring = 32, 96
    T, n = 100, 140
    tokens = np.random.default_rng(6).integers(0, 256, T + n)
    ref = _reference(model, tokens)
    ex = VLLMExecutor(model, numerics="exact", max_seq_len=256)
    kv = ex.executor.allocate_kv_cache(16)
    tables = [_pt([9, 4, 12]), _pt([0, 1, 2, 3, 5, 6, 7, 8])]
    modulo = [ring, None]
    full_row = pc.prefill_page_table(tables[1][0], T, 128, bs)
    got = [ex.prefill(tokens[None, :T], chunk_start=0, last_token_idx=T - 1, valid_seq_len=T,
                      page_tables=[tables[0], full_row], chunk_page_tables=None, kv_cache=kv,
                      cache_position_modulo=modulo, owners=None)]
    for p in range(T, T + n - 1):
        got.append(ex.decode(tokens[p:p + 1], np.array([p]), page_tables=tables, kv_cache=kv,
                             cache_position_modulo=modulo, owners=None)[0])
    np.testing.assert_allclose(np.stack(got), ref[T - 1:T + n - 1], atol=3e-5)
    # the ring never grew: blocks outside the sliding layer's three hold nothing of layer 0
    untouched = np.setdiff1d(np.arange(16), [9, 4, 12])
    assert not kv[0][0][untouched].any()


def test_vllm_executor_ownership_is_enforced():
    """A decode write into a block the row's request does not own raises, and writes nothing."""
    from tt_backend import paged_cache as pc
    from tt_backend.emu.executor import VLLMExecutor

    model = tiny_model("llama")
    ex = VLLMExecutor(model, numerics="exact", max_seq_len=256)
    kv = ex.executor.allocate_kv_cache(8)
    alloc = pc.BlockAllocator(8)
    alloc.allocate("a", 2)
    alloc.allocate("b", 2)
    pt = alloc.page_table(["a"], 4)
    pt[0, 2] = alloc.blocks_of("b")[0]  # position 64 would land in b's block
    before = [k.copy() for k, _ in kv]
    with pytest.raises(pc.BlockOwnershipError):
        ex.decode(np.array([1]), np.array([64]), page_tables=[pt] * 2, kv_cache=kv, cache_position_modulo=[None] * 2,
                  owners=pc.RowOwners(alloc, ["a"]))
    assert all(np.array_equal(a, k) for a, (k, _) in zip(before, kv))


def test_executor_factory_cuts_to_the_generators_layers():
    from tt_backend.emu.executor import executor_factory

    model = tiny_model("exaone4")
    cfg2 = dataclasses.replace(model.config, layers=model.config.layers[:2])
    ex = executor_factory(model, numerics="exact")(cfg2, None, 4, 256, "accuracy")
    assert ex.config == cfg2 and ex.executor.policy.name == "accuracy"
    with pytest.raises(ValueError, match="first layers"):
        executor_factory(model)(tiny_config("llama"), None, 4, 256, "performance")


@pytest.mark.parametrize("numerics", ["exact", "full"])
def test_batched_decode_matches_single_users(numerics):
    """Three users of different prompt lengths in shuffled, owned blocks (every write ownership-checked),
    plus an inactive row, decoded together: each user's logits equal jm.forward on its own sequence
    (exact), or stay PCC-close (full: TT numerics)."""
    from tt_backend import paged_cache as pc

    model = tiny_model("mistral")  # sliding window 48: the longest prompt runs past it
    rng = np.random.default_rng(7)
    lens, steps = [5, 40, 130], 4
    seqs = [rng.integers(0, 256, n + steps) for n in lens]
    ex = Executor(model, numerics=numerics, max_seq_len=512)
    kv = ex.allocate_kv_cache(24)
    alloc = pc.BlockAllocator(24, order=rng.permutation(24))
    users = ["u0", "u1", "u2", None]
    for u, n in zip(users, lens):  # each user owns only the blocks its tokens need, not its padded prefill
        alloc.ensure(u, n + steps, 32)
    owners = pc.RowOwners(alloc, users)
    pt = alloc.page_table(users, 8)
    got = [[ex.prefill(s[:n], pt[i], kv, owners=pc.RowOwners(alloc, [users[i]]))[-1]]
           for i, (s, n) in enumerate(zip(seqs, lens))]
    for t in range(steps):
        toks = np.array([s[n + t] for s, n in zip(seqs, lens)] + [0])
        pos = np.array([n + t for n in lens] + [-1])
        out = ex.decode(toks, pos, pt, kv, owners=owners)
        for i in range(3):
            got[i].append(out[i])
    for i, (s, n) in enumerate(zip(seqs, lens)):  # positions n-1 (prefill's last) .. n+steps-1
        ref = _reference(model, s)[n - 1:]
        if numerics == "exact":
            np.testing.assert_allclose(np.stack(got[i]), ref, atol=3e-5)
        else:
            ok, p = comp_pcc(ref, np.stack(got[i]), 0.97)
            assert ok, (i, p)
