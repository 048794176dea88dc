"""The measured per-tensor precision policy (`tt_backend.precision`) on models it was not tuned on.

Configs, seeds and init scales below were drawn for this file only; the policy's budget and ladders were
chosen on other seeds (100..105) and scales. Every case runs the emulated "performance" program at full
TT numerics (the executor resolves the name per model) against `jm.forward` (logits) and the exact
emulator (per-layer residual outputs; `numerics="exact"` equals jm.forward, test_tt_forward), and
requires PCC >= 0.99 per layer and on the logits; top-1 agreement is reported in every message.
With `-s` the module prints a table of every case it ran (min layer PCC, logits PCC, top-1).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import families, plan
from tests.tt.test_emu_ops import comp_pcc
from tests.tt.test_tt_forward import topk_agreement
from tt_backend import Executor, lowering, precision
from tt_backend.weights import POLICIES, DecodersPrecision

HF = {
    "llama": {"model_type": "llama", "rope_theta": 500000.0, "attention_bias": True},
    "qwen3": {"model_type": "qwen3", "rope_theta": 1e6, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "sliding_window": 96},
    "cohere": {"model_type": "cohere", "use_qk_norm": True, "logit_scale": 0.125, "layer_norm_eps": 1e-5},
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 32, "sliding_window": 96, "rope_theta": 1e6,
               "rope_local_base_freq": 1e4, "final_logit_softcapping": 30.0},
    "exaone4": {"model_type": "exaone4", "sliding_window": 96},
    "gpt_oss": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 96,
                "rope_theta": 150000.0},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True},
}
LAYER_TYPES = {"gemma3": "sliding_attention", "exaone4": "sliding_attention", "gpt_oss": "sliding_attention"}
# (seed, hidden, intermediate, layers, matrix std, norm mean offset, norm std, expert gate/up std)
FAST = {
    "llama": (7011, 96, 192, 2, 0.04, 0.0, 0.15, None),
    "qwen3": (7023, 128, 160, 2, 0.07, 0.0, 0.2, None),
    "mistral": (7037, 64, 224, 3, 0.03, 0.0, 0.1, None),
    "cohere": (7041, 128, 192, 2, 0.06, 0.0, 0.1, None),
    "gemma3": (7053, 96, 256, 3, 0.06, 0.0, 0.25, None),
    "exaone4": (7069, 64, 192, 3, 0.05, 0.0, 0.1, None),
    "gpt_oss": (7079, 64, 96, 2, 0.05, 0.0, 0.1, 0.4),
    "qwen3_moe": (7083, 96, 128, 2, 0.06, 0.0, 0.1, None),
}
# heavier: other seeds, small / large matrix norms, large norm weights (mean 1 + 1.0, std 0.3)
SLOW_CASES = [(7103, 128, 256, 3, 0.15, 0.0, 0.3, None), (7121, 96, 160, 2, 0.02, 0.0, 0.1, None),
              (7137, 64, 128, 2, 0.05, 1.0, 0.3, 0.6)]
SLOW = [(f, s) for f in HF for s in SLOW_CASES]
PCC = 0.99
T = 128
RESULTS: list = []  # (family, case, layer_min, logits, top1) of every check run, printed at the end (-s)


def config(family: str, D: int, I: int, L: int):
    hf = {"vocab_size": 384, "hidden_size": D, "intermediate_size": I, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "num_hidden_layers": L,
          **HF[family]}
    if family == "cohere":  # Cohere's head_dim is hidden / heads: keep it one 32-wide tile
        hf["num_attention_heads"] = D // 32
        hf["num_key_value_heads"] = 1 if D // 32 % 2 else 2
    if family == "qwen3_moe":
        hf["moe_intermediate_size"] = I // 2 // 32 * 32 or 32
    if family in LAYER_TYPES:
        hf["layer_types"] = [LAYER_TYPES[family]] * (L - 1) + ["full_attention"]
    return families.config_from_hf(hf)


def model(family: str, case) -> jm.Model:
    seed, D, I, L, std, norm_off, norm_std, expert_std = case
    cfg = config(family, D, I, L)
    rng = np.random.default_rng(seed)
    centre = (0.0 if cfg.norm == "gemma" else 1.0) + norm_off

    def init(leaf, shape):
        if expert_std is not None and leaf in ("w_gate", "w_up") and len(shape) == 4:  # stacked experts
            return expert_std * rng.standard_normal(shape, np.float32)
        if "norm" in leaf:
            return centre + norm_std * rng.standard_normal(shape, np.float32)
        if leaf == "sinks":
            return rng.standard_normal(shape, np.float32)
        if leaf.startswith("b"):
            return 10 * std * rng.standard_normal(shape, np.float32)
        return std * rng.standard_normal(shape, np.float32)

    params: dict = {}
    for path, shape in plan.flat_shapes(cfg).items():
        *parents, leaf = path.split("/")
        node = params
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = init(leaf, shape)
    return jm.Model(cfg, params)


def _prefill(m, tokens, numerics, pol="performance"):
    ex = Executor(m, numerics=numerics, policy=pol, max_seq_len=T, block_size=32)
    t = ex.prefill(tokens, np.arange(T // 32, dtype=np.int32), ex.allocate_kv_cache(T // 32), return_all=True)
    return t, ex


def measured(family: str, case, pol="performance", m=None) -> dict:
    """One case at full TT numerics under `pol` (a name: measured per model) against jm.forward / the exact run
    (m: the case's model, if not `model(family, case)`)."""
    m = model(family, case) if m is None else m
    cfg = m.config
    tokens = np.random.default_rng(case[0] + 1).integers(0, cfg.vocab_size, T)
    ref = np.asarray(jm.forward(m, tokens[None]))[0]
    exact, _ = _prefill(m, tokens, "exact")
    got, ex = _prefill(m, tokens, "full", pol)
    logits = np.asarray(got[ex.program("prefill", T).outputs[0]]).reshape(T, -1)
    top1, top5 = topk_agreement(logits, ref)
    layers = [comp_pcc(exact[f"l{i}.out"].reshape(T, -1), got[f"l{i}.out"].reshape(T, -1))[1]
              for i in range(cfg.num_layers)]
    pcc = comp_pcc(ref, logits)[1]
    msg = (f"{family} case {case}: logits PCC {pcc:.5f}, layer PCC {np.round(layers, 5).tolist()}, "
           f"top-1 {100 * top1:.1f}%, top-5 {100 * top5:.1f}%, policy {_describe(ex.policy)}")
    return {"layer_min": min(layers), "logits": pcc, "top1": top1, "msg": msg, "policy": ex.policy}


def check(family: str, case) -> dict:
    r = measured(family, case)
    RESULTS.append((family, case, r["layer_min"], r["logits"], r["top1"]))
    assert isinstance(r["policy"], DecodersPrecision), r["msg"]
    assert r["layer_min"] >= PCC and r["logits"] >= PCC, r["msg"]
    return r


@pytest.fixture(scope="module", autouse=True)
def _table():
    yield
    if RESULTS:
        print(f"\n{'family':10s} {'seed':>5s} {'std':>5s} {'norm':>9s} {'min layer PCC':>13s} {'logits PCC':>10s} "
              f"{'top-1':>6s}")
        for family, c, lmin, pcc, top1 in RESULTS:
            print(f"{family:10s} {c[0]:5d} {c[4]:5.2f} {1 + c[5]:4.1f}+-{c[6]:<3.2f} {lmin:13.5f} {pcc:10.5f} "
                  f"{100 * top1:5.1f}%")


def _describe(p) -> str:
    short = {"ttnn.bfloat4_b": "b4", "ttnn.bfloat8_b": "b8", "ttnn.bfloat16": "bf16"}
    per = [f"{short[q.ff1_3]}/{short[q.ff2]}/{short[q.wqkv]}/{short[q.wo]}" for q in p.layers]
    return f"ff1_3/ff2/wqkv/wo per layer {per}, kv {short[p.kv_cache]}, lm_head {short[p.lm_head]}"


@pytest.mark.parametrize("family", list(FAST))
def test_unseen_config_meets_pcc(family):
    check(family, FAST[family])


@pytest.mark.slow
@pytest.mark.parametrize("family,case", SLOW)
def test_unseen_scales_meet_pcc(family, case):
    check(family, case)


def test_bfp4_kept_where_the_layer_tolerates_it():
    """The policy follows the weights: with a tiny MLP contribution (w_down scaled by 1e-2) bfp4 gate/up
    stays; with a large one (scaled by 4) the same layers' gate/up are promoted to bfp8."""
    m = model("llama", FAST["llama"])

    def scaled(f):
        layers = {k: {**v, "mlp": {**v["mlp"], "w_down": v["mlp"]["w_down"] * f}}
                  for k, v in m.params["layers"].items()}
        return jm.Model(m.config, {**m.params, "layers": layers})

    quiet = precision.choose(scaled(1e-2), "performance", executor=Executor)
    loud = precision.choose(scaled(4.0), "performance", executor=Executor)
    assert all(p.ff1_3 == "ttnn.bfloat4_b" for p in quiet.policy.layers), quiet.report()
    assert any(p.ff1_3 == "ttnn.bfloat8_b" for p in loud.policy.layers), loud.report()
    assert quiet.budget == pytest.approx(precision.weight_budget(PCC))


def test_per_layer_policy_reaches_the_program():
    """A DecodersPrecision's per-layer dtypes and fidelities land on that layer's tensors and calls only."""
    cfg = config("llama", 64, 128, 2)
    base = POLICIES["performance"]
    l1 = dataclasses.replace(base, ff1_3="ttnn.bfloat8_b", li_ff1_3=precision.HIFI2, wqkv="ttnn.bfloat16",
                             sdpa=precision.HIFI4)
    pol = DecodersPrecision("mixed", base, (base, l1))
    prog = lowering.lower(cfg, policy=pol).decode
    t = prog.tensors
    assert t["layers.0.w1"].dtype == "ttnn.bfloat4_b" and t["layers.1.w1"].dtype == "ttnn.bfloat8_b"
    assert t["layers.0.wqkv"].dtype == "ttnn.bfloat8_b" and t["layers.1.wqkv"].dtype == "ttnn.bfloat16"
    fid = {c.inputs[1]: c.kwargs["compute_kernel_config"]["math_fidelity"] for c in prog.calls if c.op == "ttnn.linear"}
    assert fid["layers.0.w1"].endswith("LoFi") and fid["layers.1.w1"].endswith("HiFi2")
    sdpa = [c.kwargs["compute_kernel_config"]["math_fidelity"] for c in prog.calls if "scaled_dot" in c.op]
    assert sdpa[0].endswith("HiFi2") and sdpa[1].endswith("HiFi4"), sdpa
    with pytest.raises(ValueError, match="decoder entries"):
        lowering.lower(cfg, policy=DecodersPrecision("short", base, (base,)))
    with pytest.raises(ValueError, match="model-wide"):
        DecodersPrecision("kv", base, (base, dataclasses.replace(base, kv_cache="ttnn.bfloat16")))


def test_routing_error_follows_the_margins():
    """Routing flips cost what the score margins say: GPT-OSS's router with a bias that puts experts 0 and 1 ahead by
    40 logits flips nothing (estimate 0, policy as routing-blind); with its own bias the estimate is positive. On
    Qwen3-MoE (near-tied top-2 of 4) the routing term promotes groups that act before a router reads its input
    (never the last layer's experts or the LM head), and the promoted policy's routing error is the lower."""
    m = model("gpt_oss", FAST["gpt_oss"])
    ahead = lambda b: np.broadcast_to(np.array([20, 20, -20, -20], np.float32), b.shape)  # noqa: E731
    sep = {k: {**v, "mlp": {**v["mlp"], "router_bias": ahead(v["mlp"]["router_bias"])}}
           for k, v in m.params["layers"].items()}
    apart = jm.Model(m.config, {**m.params, "layers": sep})
    ch = precision.choose(apart, "performance", executor=Executor)
    assert max(ch.routing.values()) == 0.0, ch.report()
    assert ch.policy == precision.choose(apart, "performance", executor=Executor, routing=False).policy
    assert max(precision.choose(m, "performance", executor=Executor).routing.values()) > 0.0

    q = model("qwen3_moe", FAST["qwen3_moe"])
    aware = precision.choose(q, "performance", executor=Executor)
    blind = precision.choose(q, "performance", executor=Executor, routing=False)
    last = q.config.num_layers - 1
    more = [k for k, r in aware.picked.items() if r > blind.picked[k]]
    assert more and all(aware.picked[k] >= r for k, r in blind.picked.items()), aware.report()
    assert all(k[0] != "lm_head" and k not in ((last, "ff1_3"), (last, "ff2")) for k in more), more
    before = precision.routing_errors(q, blind.policy, executor=Executor)
    assert sum(r ** 2 for r in aware.routing.values()) < sum(r ** 2 for r in before.values()), (aware.routing, before)


@pytest.mark.slow
@pytest.mark.parametrize("case", [SLOW_CASES[0], SLOW_CASES[2]])
def test_routing_blind_policy_fails_where_the_routing_term_passes(case):
    """Qwen3-MoE cases 7103 / 7137 under the per-tensor policy alone (routing=False: the policy before the routing
    term) miss PCC 0.99 (0.983 / 0.987 on the logits; 7103: 2 / 6 / 11 tokens' experts swapped in layers 0 / 1 / 2);
    the default policy passes the same cases in test_unseen_scales_meet_pcc."""
    blind = precision.choose(model("qwen3_moe", case), "performance", executor=Executor, routing=False).policy
    r = measured("qwen3_moe", case, blind)
    assert min(r["layer_min"], r["logits"]) < PCC, r["msg"]


# GPT-OSS with large experts over 4 layers: 3 of 8 seeds (7243, 7301, 7311-7316) miss 0.99 from 0-3 near-tied tokens
# per layer whose experts swap (tt_backend/precision.py, "Where the swaps come from")
GPT_OSS_HARD = (7243, 128, 256, 4, 0.08, 0.0, 0.2, 0.5)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="min layer PCC 0.9888: 2 of 128 tokens swap an expert in layer 0 from the "
                   "rounding of float32 test weights; no format choice tried lifts every seed (precision.py)")
def test_gpt_oss_hard_case_misses_pcc():
    check("gpt_oss", GPT_OSS_HARD)


@pytest.mark.slow
def test_gpt_oss_hard_case_passes_with_checkpoint_weights():
    """The same case with its weights rounded to bf16 first (what a checkpoint holds): no swaps in layer 0, and
    PCC >= 0.99 (measured 0.9989): the swaps above come from the weights' storage, not the program."""
    import ml_dtypes

    m = model("gpt_oss", GPT_OSS_HARD)
    rounded = lambda t: ({k: rounded(v) for k, v in t.items()} if isinstance(t, dict) else  # noqa: E731
                         np.asarray(t).astype(ml_dtypes.bfloat16).astype(np.float32))
    r = measured("gpt_oss", GPT_OSS_HARD, m=jm.Model(m.config, rounded(m.params)))
    RESULTS.append(("gpt_oss", GPT_OSS_HARD, r["layer_min"], r["logits"], r["top1"]))
    assert r["layer_min"] >= PCC and r["logits"] >= PCC, r["msg"]
