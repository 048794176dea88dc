"""A precision policy chosen per tensor from the model's own weights (tt_transformers' `DecodersPrecision`,
filled by measurement instead of by model name).

Why (measured on tiny random models, full TT numerics, one group switched at a time from an all-bf16/HiFi4
policy): bfloat4_b gate/up weights with LoFi are what costs accuracy. Llama (D=128, std 0.2) 0.998 -> 0.924,
GPT-OSS experts (gate/up std 0.5) 0.999 -> 0.928, Gemma3 with large norm weights 0.973 -> 0.873; every other
group (bfp8 down / qkv / out, bfp8 KV cache, HiFi2 SDPA, bfp8 LM head) costs <= 0.004. How much bfp4 costs a
layer is its relative weight error (about 0.1-0.2 for bfp4 + LoFi, 0.005-0.01 for bfp8) times the share the
sublayer's output has in the residual stream: small for a deep pre-norm model whose layers add small updates,
large where a sandwich post-norm (Gemma) rescales the MLP output to the norm weights' size, or where large
expert weights dominate the residual (GPT-OSS). So the choice must follow the weights, not the family name.

`choose(model, base)` measures that directly. One exact emulator prefill of a probe prompt records every
matmul input; for each weight and each candidate (dtype, fidelity) it computes
    e = ||x Q(W) (at that fidelity) - x W|| / ||x W||          (x: the recorded input, rounded to bf16)
and scales it by the share of the sublayer's contribution in that layer's residual output,
    delta = e * ||contribution|| / ||layer output||
(contribution: attention / MLP output after any post-norm; a routed expert's weighted output). Errors of
different tensors are independent, so the squared deltas of all layers add; starting from `base` (bfp4
gate/up in "performance"), the tensor group with the largest delta is promoted to its next candidate
(bfp4/LoFi -> bfp8/HiFi2 -> bf16/HiFi4) until sum(delta^2) <= budget^2, where the budget leaves the larger
part of the PCC target to what no weight format changes (bf16 activations, the KV cache). A group is never
demoted below `base`.

What no per-tensor policy fixes: a model whose layers amplify small perturbations (Gemma3 with norm weights
~3 +- 1, so q/k norms make attention near one-hot) loses accuracy to bf16 activations alone (0.974 with
every weight bf16 and HiFi4, 0.984 with fp32 activations as well); `choose` reports it through `report`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict

import numpy as np

from tt_backend.emu import numerics
from tt_backend.weights import HIFI2, HIFI2_FP16, HIFI4, LOFI, DecodersPrecision, OpConfig, Precision, policy

BF16, BFP8, BFP4 = "ttnn.bfloat16", "ttnn.bfloat8_b", "ttnn.bfloat4_b"
# per tensor group: the (dtype field, dtype, fidelity field, op config) ladder, cheapest first
LADDERS = {
    "ff1_3": ("ff1_3", "li_ff1_3", ((BFP4, LOFI), (BFP8, HIFI2), (BF16, HIFI4))),
    "ff2": ("ff2", "li_ff2", ((BFP8, HIFI2_FP16), (BFP8, HIFI2), (BF16, HIFI4))),
    "wqkv": ("wqkv", "li_qkv", ((BFP8, HIFI2), (BF16, HIFI4))),
    "wo": ("wo", "li_o", ((BFP8, HIFI2), (BF16, HIFI4))),
}
LM_HEAD = ((BFP8, HIFI2), (BF16, HIFI4))
KV = (BFP8, BF16)  # the KV cache (model-wide)
_GROUP_OF = {"wqkv": "wqkv", "wo": "wo", "w1": "ff1_3", "w3": "ff1_3", "w2": "ff2"}
PROBE_LEN = 128


def weight_budget(target_pcc: float, share: float = 0.25) -> float:
    """The relative error the weight formats may add: `share` of 1 - target_pcc (1 - PCC ~ err^2 / 2)."""
    return math.sqrt(2.0 * share * (1.0 - target_pcc))


def _rung(ladder, dtype: str, cfg: OpConfig) -> int:
    """Index of the first rung at least as precise as (dtype, cfg): base settings are never demoted."""
    order = {BFP4: 0, BFP8: 1, BF16: 2, "ttnn.float32": 3}
    fid = ("LoFi", "HiFi2", "HiFi3", "HiFi4")
    for k, (dt, oc) in enumerate(ladder):
        if order[dt] >= order[dtype] and fid.index(oc.math_fidelity) >= fid.index(cfg.math_fidelity) and \
                (oc.fp32_dest_acc_en or not cfg.fp32_dest_acc_en):
            return k
    return len(ladder) - 1


def _rel_error(x: np.ndarray, w: np.ndarray, dtype: str, cfg: OpConfig) -> float:
    """||x Q(W) - x W|| / ||x W|| for the matrix engine at cfg's fidelity (x already bf16)."""
    ref = np.matmul(x, w)
    got = numerics.matmul(x, numerics.quantize(w, dtype, "host"), "full", cfg.kwargs())
    den = float(np.linalg.norm(ref))
    return float(np.linalg.norm(got - ref)) / den if den > 0 else 0.0


def _norm(t: dict, name: str) -> float:
    return float(np.linalg.norm(np.asarray(t[name], np.float64)))


@dataclasses.dataclass
class Choice:
    """What `choose` measured and picked: per layer and group the deltas of every rung and the rung taken."""

    policy: DecodersPrecision
    deltas: dict  # (layer | "lm_head", group) -> [delta per rung]
    picked: dict  # (layer | "lm_head", group) -> rung index
    budget: float

    def report(self) -> str:
        rows = []
        for key, ds in sorted(self.deltas.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            k = self.picked[key]
            rows.append(f"{key[0]}/{key[1]}: rung {k} delta {ds[k]:.4f} (cheapest {ds[0]:.4f})")
        total = math.sqrt(sum(self.deltas[k][r] ** 2 for k, r in self.picked.items()))
        return f"weight error {total:.4f} <= budget {self.budget:.4f}\n" + "\n".join(rows)


def measure(model, base: Precision, probe_tokens=None, *, executor) -> tuple[dict, dict]:
    """deltas[(layer, group)] = [delta of each rung of that group's ladder] from exact probe prefills run by
    `executor` (the emulator's Executor class: passed in, since the executor resolves named policies through this
    module), and the base's rung of each group. ("kv", "kv_cache") is the model-wide KV-cache dtype."""
    cfg = model.config
    if probe_tokens is None:  # a fixed pseudo-random prompt over the whole vocabulary
        probe_tokens = np.random.default_rng(0x7e57).integers(0, cfg.vocab_size, PROBE_LEN)
    probe_tokens = np.asarray(probe_tokens).reshape(-1)
    ex = executor(model, numerics="exact", policy=base, max_seq_len=-(-len(probe_tokens) // 128) * 128)
    nb = ex.max_seq_len // ex.block_size
    T = len(probe_tokens)
    run = lambda: ex.prefill(probe_tokens, np.arange(nb, dtype=np.int32), ex.allocate_kv_cache(nb),  # noqa: E731
                             return_all=True)
    t = run()
    prog = ex.program("prefill", ex.max_seq_len)
    rows = lambda a: np.asarray(a, np.float32).reshape(-1, a.shape[-1])[:T]  # noqa: E731
    rel = lambda a, b: float(np.linalg.norm(rows(a) - rows(b))) / max(float(np.linalg.norm(rows(b))), 1e-30)  # noqa

    def contrib(i: int, group: str, e) -> str:
        n = f"l{i}"
        if e is not None:  # a routed expert: its routing-weighted output
            return f"{n}.e{e}.yw"
        if group in ("wqkv", "wo", "kv"):
            return f"{n}.att_n" if f"{n}.att_n" in t else f"{n}.attn_out"
        return f"{n}.mlp_n" if f"{n}.mlp_n" in t else f"{n}.mlp_out"

    def share(i: int, name: str) -> float:
        return _norm(t, name) / max(_norm(t, f"l{i}.out"), 1e-30)

    def gain(i: int) -> float:
        """How much attention amplifies a relative error of its q/k/v (softmax over large logits does), and
        how much the later layers amplify an error of layer i's output: one exact run with layer i's wqkv
        rounded to bfloat8_b, output error over input error."""
        w = f"layers.{i}.wqkv"
        keep = ex.weights[w]
        ex.weights[w] = numerics.quantize(keep, BFP8, "host")
        try:
            p = run()
        finally:
            ex.weights[w] = keep
        e_in, e_here = rel(p[f"l{i}.xqkv"], t[f"l{i}.xqkv"]), rel(p[f"l{i}.out"], t[f"l{i}.out"])
        c = contrib(i, "wqkv", None)
        local = max(1.0, rel(p[c], t[c]) / e_in) if e_in > 0 else 1.0
        # and how much the layers after i amplify an error of layer i's output (attention downstream)
        last = f"l{cfg.num_layers - 1}.out"
        down = max(1.0, rel(p[last], t[last]) / e_here) if e_here > 0 else 1.0
        return local, down

    sq: dict = {}
    start: dict = {}
    gains: dict = {}
    for c in prog.calls:
        if c.op != "ttnn.linear":
            continue
        w_name = c.inputs[1]
        if w_name == "lm_head":
            key, ladder, f = ("lm_head", "lm_head"), LM_HEAD, 1.0
            start[key] = _rung(ladder, base.lm_head, base.lm_head_op)
        else:
            m = re.fullmatch(r"layers\.(\d+)\.(?:e(\d+)\.)?(\w+)", w_name)
            if m is None or m.group(3) not in _GROUP_OF:
                continue  # the router stays bf16 (its top-k decides which experts run)
            i, e, leaf = int(m.group(1)), m.group(2), m.group(3)
            group = _GROUP_OF[leaf]
            field, ofield, ladder = LADDERS[group]
            key = (i, group)
            start[key] = _rung(ladder, getattr(base, field), getattr(base, ofield))
            if i not in gains:
                gains[i] = gain(i)
            local, down = gains[i]
            f = share(i, contrib(i, group, e)) * down * (local if group == "wqkv" else 1.0)
        x = numerics.bf16(rows(t[c.inputs[0]]))
        w = np.asarray(ex.weights[w_name], np.float32)[0, 0]
        errs = [(_rel_error(x, w, dt, oc) * f) ** 2 for dt, oc in ladder]
        sq[key] = [a + b for a, b in zip(sq.get(key, [0.0] * len(ladder)), errs)]
    # the KV cache: K and V rounded to its dtype, amplified as q/k/v errors are
    key = ("kv", "kv_cache")
    start[key] = KV.index(base.kv_cache) if base.kv_cache in KV else len(KV) - 1
    tot = [0.0] * len(KV)
    for i in gains:
        n, f = f"l{i}", share(i, contrib(i, "kv", None)) * gains[i][0] * gains[i][1]
        for r, dt in enumerate(KV):
            errs = [rel(numerics.quantize(rows(t[f"{n}.{kv}8"]), dt, "host"), t[f"{n}.{kv}8"]) for kv in "kv"]
            tot[r] += sum((x * f) ** 2 for x in errs)
    if gains:
        sq[key] = tot
    return {k: [math.sqrt(v) for v in vs] for k, vs in sq.items()}, start


def choose(model, base: str | Precision = "performance", *, executor, target_pcc: float = 0.99, probe_tokens=None,
           name: str | None = None) -> Choice:
    """The cheapest per-layer policy at or above `base` whose estimated weight error fits the budget."""
    base = policy(base)
    if isinstance(base, DecodersPrecision):
        raise TypeError("choose starts from a uniform Precision")
    deltas, picked = measure(model, base, probe_tokens, executor=executor)
    budget = weight_budget(target_pcc)
    total = lambda: sum(deltas[k][r] ** 2 for k, r in picked.items())  # noqa: E731
    while total() > budget ** 2:
        up = [k for k, r in picked.items() if r + 1 < len(deltas[k])]
        if not up:
            break
        k = max(up, key=lambda k: deltas[k][picked[k]] ** 2 - deltas[k][picked[k] + 1] ** 2)
        picked[k] += 1
    layers = []
    for i in range(model.config.num_layers):
        kw = {}
        for group, (field, ofield, ladder) in LADDERS.items():
            if (i, group) in picked:
                kw[field], kw[ofield] = ladder[picked[(i, group)]]
        layers.append(dataclasses.replace(base, **kw))
    head, kv = picked.get(("lm_head", "lm_head")), picked.get(("kv", "kv_cache"))
    kw = {} if head is None else {"lm_head": LM_HEAD[head][0], "lm_head_op": LM_HEAD[head][1]}
    kw |= {} if kv is None else {"kv_cache": KV[kv]}
    model_base = dataclasses.replace(base, **kw)
    layers = [dataclasses.replace(p, kv_cache=model_base.kv_cache) for p in layers]
    pol = DecodersPrecision(name or f"{base.name}/measured", model_base, tuple(layers))
    return Choice(pol, deltas, picked, budget)


_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()


def for_model(model, base: str | Precision = "performance", *, executor,
              target_pcc: float = 0.99) -> DecodersPrecision:
    """`choose(...).policy`, remembered for the last few models (executors are built many times per model)."""
    base = policy(base)
    key = (id(model.params), base, target_pcc)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is model.params:
        _CACHE.move_to_end(key)
        return hit[1]
    pol = choose(model, base, executor=executor, target_pcc=target_pcc, name=base.name).policy
    _CACHE[key] = (model.params, pol)
    while len(_CACHE) > 8:
        _CACHE.popitem(last=False)
    return pol
