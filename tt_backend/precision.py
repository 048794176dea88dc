"""A precision policy chosen per tensor from the model's own weights (tt_transformers' `DecodersPrecision`,
filled by measurement instead of by model name).

Why (measured on tiny random models, full TT numerics, one group switched at a time from an all-bf16/HiFi4
policy): bfloat4_b gate/up weights with LoFi are what costs accuracy. Llama (D=128, std 0.2) 0.998 -> 0.924,
GPT-OSS experts (gate/up std 0.5) 0.999 -> 0.928, Gemma3 with large norm weights 0.973 -> 0.873; every other
group (bfp8 down / qkv / out, bfp8 KV cache, HiFi2 SDPA, bfp8 LM head) costs <= 0.004 (but see routing below).
How much bfp4 costs a layer is its relative weight error (about 0.1-0.2 for bfp4 + LoFi, 0.005-0.01 for bfp8)
times the share the sublayer's output has in the residual stream: small for a deep pre-norm model whose layers
add small updates, large where a sandwich post-norm (Gemma) rescales the MLP output to the norm weights' size, or
where large expert weights dominate the residual (GPT-OSS). So the choice must follow the weights, not the family name.

`choose(model, base)` measures that directly. One exact emulator prefill of a probe prompt records every
matmul input; for each weight and each candidate (dtype, fidelity) it computes
    e = ||x Q(W) (at that fidelity) - x W|| / ||x W||          (x: the recorded input, rounded to bf16)
and scales it by the share of the sublayer's contribution in that layer's residual output,
    delta = e * ||contribution|| / ||layer output||
(contribution: attention / MLP output after any post-norm; a routed expert's weighted output). Errors of
different tensors are independent, so the squared deltas of all layers add; starting from `base` (bfp4
gate/up in "performance"), the tensor group with the largest delta is promoted to its next candidate
(bfp4/LoFi -> bfp8/HiFi2 -> bf16/HiFi4; SDPA HiFi2 -> HiFi4, its error measured by running the op on the
recorded q, k, v) until sum(delta^2) <= budget^2, where the budget leaves the larger
part of the PCC target to what no weight format changes (bf16 activations, the KV cache). A group is never
demoted below `base`.

Routing (MoE layers). Top-k routing is discontinuous: where a token's k-th and (k+1)-th expert scores are
near-tied, a small error of the router's *input* swaps an expert and moves that token's MoE output by the whole
difference of the two experts' weighted outputs; with few experts and tokens, 2-3 swaps can cost a layer its 0.99.
Measured on Qwen3-MoE (4 experts, top-2; cases 7103 and 7137 of tests/tt/test_precision_policy.py, which the
routing-blind policy missed at 0.983 / 0.987 on the logits): exact expert choices alone lift every layer to
>= 0.998, so the weight formats' own error is fine; the router's arithmetic is not what flips them either. With
its input made exact the router scores' noise (bf16 weights, HiFi3, bf16 logits and probabilities) is sigma
0.004-0.007, against 0.02-0.3 from the error that attention leaves in the residual stream the router reads
(bfp8 wqkv / KV cache, HiFi2 SDPA, bf16 activations): an fp32 gate with fp32 softmax and top-k changed the logits
PCC by 0.0000 (7103) and +0.005 (7137), a bf16 wqkv alone lifted 7103 to 0.998. tt-metal's gates are bf16 as
well (GPT-OSS `topk.py`: bf16 weights, `ttnn.topk` on bf16 logits; DeepSeek `moe_gate.py`: bf16, HiFi2), so the
router keeps `Precision.router`, and `choose` buys a more exact router *input*. `routing_error` estimates a MoE
layer's expected error from swaps,
    r^2 = sum over (token, chosen a, unchosen b) of P(flip) ||y(b for a) - y||^2 / ||layer output||^2,
    P(flip) = Phi(-(s_a - s_b) / sigma_t,ab)
with the margins and every expert's output y from the exact probe (the lowering runs all experts), and the gap
noise sigma measured by a full-numerics prefill of the candidate policy on the same probe (so it holds everything
upstream: formats, activations, the KV cache, earlier layers' flips). After the per-tensor promotion, `choose`
promotes, one at a time and re-measured, the group acting before the worst router (its layer's attention and
SDPA fidelity, earlier layers, the KV cache) whose delta weighs most in the stream the router reads, until
sum(delta^2) + sum(r^2) <= budget^2. If even every such group at its top rung leaves the routers over budget, it
takes that where it measures lower than the per-tensor choice (what is left is what no format lowers).
Estimated vs realised tokens with swapped experts, 8 unseen prompts per model, layers 0/1/2: 7103 routing-blind
14/34/49 vs 16/33/54, as chosen 7/13/21 vs 8/18/28; 7137 11/21 vs 14/17; another Qwen3-MoE (7151) 7/26/41 vs
14/32/52: low by up to 2x. One 128-token prompt's routing error is lumpy (a few large swaps), and where bf16
activations alone flip experts no format helps: Qwen3-MoE 7177 (4 layers, expert std 0.5) with every group at
its top rung missed 0.99 on 4 of 8 prompts (mean min-layer PCC 0.9886); GPT-OSS 7243 reaches 0.9886 on the logits
with every group at its top rung and 0.9901 even with fp32 weights and KV cache (exact expert choices: 0.9998).

Where the swaps come from (GPT-OSS, D 128, I 256, 4 layers, matrix std 0.08, norms 1 +- 0.2, expert gate/up std
0.5, seeds 7243, 7301, 7311-7316 of tests/tt/test_precision_policy.py's `model`; min layer PCC as chosen: 0.9888,
0.9936, 0.9969, 0.9940, 0.9966, 0.9905, 0.9888, 0.9898: 3 of 8 under 0.99). In 7243 layer 0 already has 2 of 128
tokens with a swapped expert (PCC 0.9946), each moving its token's output by the whole expert difference (layer
output error 10 %); the router input's error is 0.4 % (its logits' noise std 0.005 against a median 2nd-3rd gap of
0.12, 10 % quantile 0.03: the swaps are the few tokens within ~0.01). Switched one at a time, none of these removes
them: fp32 router logits / top-k / softmax (0.99455 -> 0.99455), an fp32 residual stream and norm outputs, fp32
biases. What does is the weights' storage: the test draws float32 weights, which no device format holds; with the
same weights rounded to bf16 first (as every checkpoint is) the case reaches 0.9989 (layer 0: 0.99997). A float32
rung for wqkv / wo / the router, bought only against routing error, was tried (patch not kept): per seed it moved
the min layer PCC both ways (7315 0.9888 -> 0.9986, 7316 0.9898 -> 0.9748, 7243 0.9888 -> 0.9827 where the
estimate then preferred a cheaper policy): with 0-3 near-tied tokens per layer the realised error is a draw, and
an estimate from one 128-token probe cannot order policies whose expected swap counts differ by less than one.
So a hard 0.99 on every seed is not reachable by a format choice here; tt-metal keeps its gates bf16 (above) and
would show the same swaps against a float32 reference.

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
from tt_backend.emu.ops import OPS, Env
from tt_backend.program import Ref
from tt_backend.weights import HIFI2, HIFI2_FP16, HIFI4, LOFI, DecodersPrecision, OpConfig, Precision, policy

BF16, BFP8, BFP4 = "ttnn.bfloat16", "ttnn.bfloat8_b", "ttnn.bfloat4_b"
# per tensor group: the (dtype field, dtype, fidelity field, op config) ladder, cheapest first
LADDERS = {
    "ff1_3": ("ff1_3", "li_ff1_3", ((BFP4, LOFI), (BFP8, HIFI2), (BF16, HIFI4))),
    "ff2": ("ff2", "li_ff2", ((BFP8, HIFI2_FP16), (BFP8, HIFI2), (BF16, HIFI4))),
    "wqkv": ("wqkv", "li_qkv", ((BFP8, HIFI2), (BF16, HIFI4))),
    "wo": ("wo", "li_o", ((BFP8, HIFI2), (BF16, HIFI4))),
    "sdpa": (None, "sdpa", ((None, HIFI2), (None, HIFI4))),  # attention's own matmuls: a fidelity, no weight
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
        if (dt is None or order[dt] >= order[dtype]) and fid.index(oc.math_fidelity) >= \
                fid.index(cfg.math_fidelity) and (oc.fp32_dest_acc_en or not cfg.fp32_dest_acc_en):
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
    routing: dict = dataclasses.field(default_factory=dict)  # MoE layer -> routing error under `policy`

    @property
    def error(self) -> float:
        """The estimate `choose` holds to the budget: weight deltas and routing errors, in quadrature."""
        return math.sqrt(sum(self.deltas[k][r] ** 2 for k, r in self.picked.items()) + _sq(self.routing))

    def report(self) -> str:
        rows = []
        for key, ds in sorted(self.deltas.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            k = self.picked[key]
            rows.append(f"{key[0]}/{key[1]}: rung {k} delta {ds[k]:.4f} (cheapest {ds[0]:.4f})")
        rows += [f"{i}/routing: {r:.4f}" for i, r in sorted(self.routing.items())]
        over = "<=" if self.error <= self.budget else "> (what no format lowers: the groups it can are at the top)"
        return f"estimated error {self.error:.4f} {over} budget {self.budget:.4f}\n" + "\n".join(rows)


def _sq(routing: dict) -> float:
    return sum(r ** 2 for r in routing.values())


def measure(model, base: Precision, probe_tokens=None, *, executor) -> tuple[dict, dict]:
    """deltas[(layer, group)] = [delta of each rung of that group's ladder] from exact probe prefills run by
    `executor` (the emulator's Executor class: passed in, since the executor resolves named policies through this
    module), and the base's rung of each group. ("kv", "kv_cache") is the model-wide KV-cache dtype."""
    return _measure(model, base, probe_tokens, executor)[:2]


def _measure(model, base: Precision, probe_tokens, executor) -> tuple[dict, dict, dict]:
    """`measure`, plus the exact probe run's tensors (which `routing_errors` reuses)."""
    cfg = model.config
    probe_tokens = _probe_tokens(cfg, probe_tokens)
    ex = executor(model, numerics="exact", policy=base, max_seq_len=-(-len(probe_tokens) // 128) * 128)
    T = len(probe_tokens)
    run = lambda: _prefill_all(ex, probe_tokens)  # noqa: E731
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
    # attention's fidelity: the SDPA op on the recorded q, k, v (bf16) at each rung against the same op exact
    _, ofield, ladder = LADDERS["sdpa"]
    for c in prog.calls:
        if c.op != "ttnn.transformer.scaled_dot_product_attention":
            continue
        i = int(re.match(r"l(\d+)\.", c.outputs[0]).group(1))
        key = (i, "sdpa")
        start[key] = _rung(ladder, None, getattr(base, ofield))
        args = [numerics.bf16(t[x]) for x in c.inputs]
        kw = {k: t[v.name] if isinstance(v, Ref) else v for k, v in c.kwargs.items()}
        sdpa = lambda level, oc: OPS[c.op](Env(level, lambda x, dt: x), *args,  # noqa: E731
                                            **{**kw, "compute_kernel_config": oc.kwargs()})[..., :T, :]
        ref, f = sdpa("exact", ladder[-1][1]), share(i, contrib(i, "wo", None)) * gains[i][1]
        sq[key] = [(float(np.linalg.norm(sdpa("full", oc) - ref) / max(np.linalg.norm(ref), 1e-30)) * f) ** 2
                   for _, oc in ladder]
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
    return {k: [math.sqrt(v) for v in vs] for k, vs in sq.items()}, start, t


# ---------------------------------------------------------------------------------- routing flips
_erfc = np.frompyfunc(math.erfc, 1, 1)


def _flip_probability(margin: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Phi(-margin / sigma): Gaussian noise of std sigma on a score gap `margin` >= 0 reverses it (sigma 0: never)."""
    safe = np.where(sigma > 0, sigma, 1.0)
    return np.where(sigma > 0, 0.5 * _erfc(margin / safe / math.sqrt(2.0)).astype(np.float64), 0.0)


def _scores(t: dict, n: str, spec, T: int) -> np.ndarray:
    """What ttnn.topk ranks, in logit units: log-probabilities (softmax -> top-k) or the logits (top-k -> softmax)."""
    if spec.router == "softmax_topk":
        return np.log(np.maximum(_rows(t[f"{n}.probs"], T), 1e-38))
    return _rows(t[f"{n}.router"], T)


def _route_weights(spec, z: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The routing weights [N, k] of experts idx [N, k] given logits z [N, E], by the layer's router rule."""
    if spec.router == "softmax_topk":
        p = np.exp(z - z.max(-1, keepdims=True))
        w = np.take_along_axis(p / p.sum(-1, keepdims=True), idx, -1)
        return w / w.sum(-1, keepdims=True) if spec.renormalize else w
    v = np.take_along_axis(z, idx, -1)
    v = np.exp(v - v.max(-1, keepdims=True))
    return v / v.sum(-1, keepdims=True)


def routing_error(spec, exact: dict, full: dict, n: str, T: int) -> float:
    """Expected ||MoE output error from swapped experts|| / ||layer output|| of layer `n` ("l<i>") over the first T
    rows: `exact` and `full` are one probe's tensors at exact and at full numerics (see the module docstring)."""
    E, k = spec.num_experts, spec.top_k
    s0 = _scores(exact, n, spec, T)  # margins in these units equal logit margins
    d = _scores(full, n, spec, T) - s0
    # the noise of token t's gap s_a - s_b: the pair's typical noise (1.4826 MAD over tokens = std for a Gaussian)
    # times the token's own scale (its gaps' noise in those units): a token with sharp attention, or whose experts
    # flipped in an earlier layer, brings a larger error into this router than the rest
    gaps = d[:, :, None] - d[:, None, :]  # [T, E, E]
    typical = 1.4826 * np.median(np.abs(gaps), 0)
    units = gaps / np.where(typical > 0, typical, 1.0)
    scale = np.sqrt((units ** 2)[:, ~np.eye(E, dtype=bool)].mean(1))
    sigma = typical[None] * scale[:, None, None]
    idx = np.asarray(exact[f"{n}.topi"]).reshape(-1, k)[:T].astype(np.int64)
    chosen = np.zeros((T, E), bool)
    np.put_along_axis(chosen, idx, True, -1)
    out = np.argsort(chosen, -1, kind="stable")[:, : E - k]  # the unchosen experts
    if out.shape[1] == 0:
        return 0.0
    gap = np.take_along_axis(s0, idx, -1)[:, :, None] - np.take_along_axis(s0, out, -1)[:, None, :]  # [T, k, E-k]
    p = _flip_probability(gap, sigma[np.arange(T)[:, None, None], idx[:, :, None], out[:, None, :]])
    tt, j, b = np.nonzero(p > 1e-6)
    if not len(tt):
        return 0.0
    z = _rows(exact[f"{n}.router"], T)
    y = np.stack([_rows(exact[f"{n}.e{e}.y"], T) for e in range(E)], 1)  # [T, E, D]: the lowering runs every expert
    base = np.einsum("tk,tkd->td", _route_weights(spec, z, idx), np.take_along_axis(y, idx[:, :, None], 1))
    alt = idx[tt].copy()
    alt[np.arange(len(tt)), j] = out[tt, b]
    moved = np.einsum("pk,pkd->pd", _route_weights(spec, z[tt], alt), y[tt[:, None], alt]) - base[tt]
    err2 = float((p[tt, j, b] * (moved ** 2).sum(-1)).sum())
    return math.sqrt(err2) / max(float(np.linalg.norm(_rows(exact[f"{n}.out"], T))), 1e-30)


def _rows(a, T: int) -> np.ndarray:
    return np.asarray(a, np.float64).reshape(-1, a.shape[-1])[:T]


def routing_errors(model, pol: DecodersPrecision, probe_tokens=None, *, executor, exact=None) -> dict[int, float]:
    """{MoE layer: `routing_error`} of `pol`, from one full-numerics prefill of the probe under it (and one exact
    prefill, unless `exact` holds its tensors)."""
    tokens = _probe_tokens(model.config, probe_tokens)
    run = lambda level: _prefill_all(executor(model, numerics=level, policy=pol,  # noqa: E731
                                              max_seq_len=-(-len(tokens) // 128) * 128), tokens)
    exact = run("exact") if exact is None else exact
    full = run("full")
    return {i: routing_error(s.mlp, exact, full, f"l{i}", len(tokens))
            for i, s in enumerate(model.config.layers) if s.mlp.kind == "moe"}


def _probe_tokens(cfg, probe_tokens) -> np.ndarray:
    if probe_tokens is None:  # a fixed pseudo-random prompt over the whole vocabulary
        probe_tokens = np.random.default_rng(0x7e57).integers(0, cfg.vocab_size, PROBE_LEN)
    return np.asarray(probe_tokens).reshape(-1)


def _prefill_all(ex, tokens) -> dict:
    """Every tensor of a prefill of `tokens` from position 0."""
    nb = ex.max_seq_len // ex.block_size
    return ex.prefill(tokens, np.arange(nb, dtype=np.int32), ex.allocate_kv_cache(nb), return_all=True)


_ATTENTION = ("wqkv", "wo", "sdpa", "kv_cache")


def _upstream(cfg, key, i: int) -> bool:
    """Whether tensor group `key` acts before layer i's router reads its input: earlier layers, and the router's
    own layer's attention unless attention and MLP read the same input (parallel blocks); the KV cache is read by
    every layer's attention."""
    layer, group = key
    own = cfg.layers[i].block != "parallel"
    if layer == "kv":
        return own or i > 0
    return isinstance(layer, int) and (layer < i or (own and layer == i and group in _ATTENTION))


def _stream_weight(cfg, exact: dict, key) -> float:
    """How much more a relative error of `key` weighs in the residual stream that routers read than in its layer's
    output (the deltas' unit): ||layer output|| / ||residual after attention|| for attention groups (large where
    the layer's MoE output dominates the residual), the largest over layers for the KV cache, else 1."""
    layer, group = key
    if group not in _ATTENTION:
        return 1.0
    ratio = lambda j: _norm(exact, f"l{j}.out") / max(_norm(exact, f"l{j}.x_attn"), 1e-30)  # noqa: E731
    layers = range(cfg.num_layers) if layer == "kv" else [layer]
    return max((ratio(j) for j in layers if f"l{j}.x_attn" in exact), default=1.0)


def choose(model, base: str | Precision = "performance", *, executor, target_pcc: float = 0.99, probe_tokens=None,
           name: str | None = None, routing: bool = True) -> Choice:
    """The cheapest per-layer policy at or above `base` whose estimated weight error fits the budget; for MoE
    models (unless `routing=False`) then with the expected routing-flip errors added in quadrature."""
    base = policy(base)
    if isinstance(base, DecodersPrecision):
        raise TypeError("choose starts from a uniform Precision")
    cfg = model.config
    deltas, picked, exact = _measure(model, base, probe_tokens, executor)
    budget = weight_budget(target_pcc)
    total = lambda: sum(deltas[k][r] ** 2 for k, r in picked.items())  # noqa: E731
    gain = lambda k: deltas[k][picked[k]] ** 2 - deltas[k][picked[k] + 1] ** 2  # noqa: E731
    promotable = lambda: [k for k, r in picked.items() if r + 1 < len(deltas[k])]  # noqa: E731
    while total() > budget ** 2 and promotable():
        picked[max(promotable(), key=gain)] += 1
    name = name or f"{base.name}/measured"
    flips: dict = {}
    moe = [i for i, s in enumerate(cfg.layers) if s.mlp.kind == "moe"]
    if routing and moe:
        errors = lambda rungs: routing_errors(model, _policy(model, base, rungs, name), probe_tokens,  # noqa: E731
                                              executor=executor, exact=exact)
        # every group upstream of a router at its top rung: if even that leaves the routers over budget, take it
        # where it measures better than what the per-tensor promotion chose (noise is not bought)
        top = {k: len(deltas[k]) - 1 if any(_upstream(cfg, k, i) for i in moe) else r for k, r in picked.items()}
        flips = errors(top)
        at_top = sum(deltas[k][r] ** 2 for k, r in top.items()) + _sq(flips)
        if at_top > budget ** 2:
            now = errors(picked)
            if at_top < total() + _sq(now):
                picked = top
            else:
                flips = now
        else:  # promote one group at a time, re-measured: a promotion changes the noise of every later router
            while True:
                flips = errors(picked)
                if total() + _sq(flips) <= budget ** 2:
                    break
                up = []
                for i in sorted(flips, key=flips.get, reverse=True):
                    up = [k for k in promotable() if _upstream(cfg, k, i)]  # the worst router that can improve
                    if up:
                        break
                if not up:  # (the top fits, so only reached if re-measuring the same policy disagreed)
                    break
                picked[max(up, key=lambda k: gain(k) * _stream_weight(cfg, exact, k) ** 2)] += 1
    return Choice(_policy(model, base, picked, name), deltas, picked, budget, flips)


def _policy(model, base: Precision, picked: dict, name: str) -> DecodersPrecision:
    """The DecodersPrecision of the rungs `picked` (groups not measured keep `base`)."""
    layers = []
    for i in range(model.config.num_layers):
        kw = {}
        for group, (field, ofield, ladder) in LADDERS.items():
            if (i, group) in picked:
                dt, kw[ofield] = ladder[picked[(i, group)]]
                if field is not None:
                    kw[field] = dt
        layers.append(dataclasses.replace(base, **kw))
    head, kv = picked.get(("lm_head", "lm_head")), picked.get(("kv", "kv_cache"))
    kw = {} if head is None else {"lm_head": LM_HEAD[head][0], "lm_head_op": LM_HEAD[head][1]}
    kw |= {} if kv is None else {"kv_cache": KV[kv]}
    model_base = dataclasses.replace(base, **kw)
    layers = [dataclasses.replace(p, kv_cache=model_base.kv_cache) for p in layers]
    return DecodersPrecision(name, model_base, tuple(layers))


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
