"""LoRA: rank-r adapters on the projections chosen by parameter-path patterns, trained alone, merged back.

    adapters = lora.init(cfg, model.params, r"attn/w[qv]$|mlp/w_(gate|up|down)$", rank=8, alpha=16)
    step = train.make_step(cfg, tc, apply=lambda a, base: lora.merge(base, a))   # only the adapters train
    state = train.init(adapters, tc)
    state, metrics = step(state, batch, model.params)
    model = jm.Model(cfg, lora.merge(model.params, state.params))

Patterns are regexes searched in the flattened parameter paths, `layers/<kind>/attn/wq` (kind: the index of
the layer kind in the plan, whose parameters are stacked over its layers). A stored weight reads as a batch of
matrices [*batch, in, out] by its logical axes (jaxmodels.plan.ParamSpec): leading `layers` / `experts` axes
are batch; of the rest, an `embed` axis on the left is the input (wq [embed, heads, head_dim]: D -> H*d), one
on the right the output (wo [heads, head_dim, embed]); otherwise the last two axes are (in, out) and any before
them batch (DeepSeek's grouped wo_a [groups, in, out]). So MoE experts ([layers, experts, embed, mlp]) and
MLA's projections (wq_a, wq_b, wkv, wo_a, wo_b) take adapters like any dense projection: A [*batch, in, r],
B [*batch, r, out], W' = W + (alpha / r) * A @ B.

The forward merges, then runs the one executor (DESIGN §1.2): the low-rank product costs O(in * out * r) per
weight and step, small beside a training batch's matmuls, and no layer needs to know about adapters.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels import plan as plan_lib
from jaxmodels.config import ModelConfig

F32 = jnp.float32
BATCH_AXES = ("layers", "experts")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["weights"], meta_fields=["scale"])
@dataclasses.dataclass(frozen=True)
class Adapters:
    """weights: nested like the params, each adapted leaf replaced by {"a": [*batch, in, r], "b": [*batch, r, out]}
    (in, out: the products of the weight's input and output axes). scale: alpha / rank (static)."""

    weights: dict
    scale: float

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(sorted({p.rsplit("/", 1)[0] for p in plan_lib.flatten(self.weights)}))


def matrix_split(axes: tuple[str | None, ...]) -> tuple[int, int]:
    """(batch axes, input axes) of a stored weight with these logical axes (module docstring); the rest is the
    output. ValueError for fewer than two non-batch axes (a norm, a bias)."""
    b = 0
    while b < len(axes) and axes[b] in BATCH_AXES:
        b += 1
    rest = axes[b:]
    if len(rest) < 2:
        raise ValueError(f"axes {axes}: not a matrix (fewer than two axes besides {'/'.join(BATCH_AXES)})")
    if rest[0] == "embed":
        return b, 1
    if rest[-1] == "embed":
        return b, len(rest) - 1
    return len(axes) - 2, 1


def _axes(cfg: ModelConfig) -> dict[str, tuple]:
    specs = plan_lib.param_specs(cfg) | plan_lib.mtp_param_specs(cfg)
    return {p: s.axes for p, s in plan_lib.flatten(specs).items()}


def targets(cfg: ModelConfig, params: dict, patterns: str | tuple[str, ...]) -> dict[str, tuple[int, int, int]]:
    """{path: (number of batch axes, in, out)} of the floating matrices whose paths match any of `patterns` (regexes,
    re.search). ValueError naming a pattern that is not a regex or matches nothing, or a match that is not a
    floating matrix."""
    patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
    if not patterns:
        raise ValueError("lora: no target patterns given")
    flat, axes = plan_lib.flatten(params), _axes(cfg)
    out = {}
    for pat in patterns:
        try:
            rx = re.compile(pat)
        except re.error as e:
            raise ValueError(f"lora: target pattern {pat!r} is not a regex: {e}") from None
        hits = [p for p in flat if rx.search(p)]
        if not hits:
            some = ", ".join(list(flat)[:6])
            raise ValueError(f"lora: target pattern {pat!r} matches no parameter path (paths read like {some}, ...)")
        for p in hits:
            a = flat[p]
            if not jnp.issubdtype(a.dtype, jnp.floating):
                raise ValueError(f"lora: {p} ({a.dtype}) is not a floating weight")
            try:
                b, n_in = matrix_split(axes.get(p) or (None,) * a.ndim)
            except ValueError as e:
                raise ValueError(f"lora: {p} of shape {tuple(a.shape)} takes no adapter: {e}") from None
            out[p] = (b, math.prod(a.shape[b:b + n_in]), math.prod(a.shape[b + n_in:]))
    return out


def init(cfg: ModelConfig, params: dict, patterns: str | tuple[str, ...], rank: int, alpha: float | None = None,
         seed: int = 0) -> Adapters:
    """Adapters of `rank` on every weight a pattern matches: A ~ N(0, 1/in), B = 0 (the merged model starts as
    the base), fp32, scale alpha / rank (alpha defaults to rank: scale 1)."""
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"lora: rank must be a positive integer, got {rank!r}")
    found = targets(cfg, params, patterns)
    flat = plan_lib.flatten(params)
    rng = np.random.default_rng(seed)  # on the host: adapters are small, and eager jax.random compiles per shape
    weights = {}
    for p, (b, n_in, n_out) in sorted(found.items()):
        if rank > min(n_in, n_out):
            raise ValueError(f"lora: rank {rank} exceeds {p}'s min(in, out) = {min(n_in, n_out)}")
        lead = tuple(flat[p].shape[:b])
        weights[p + "/a"] = jnp.asarray(rng.standard_normal((*lead, n_in, rank), np.float32) / math.sqrt(n_in))
        weights[p + "/b"] = jnp.zeros((*lead, rank, n_out), F32)
    return Adapters(plan_lib.unflatten(weights), float(alpha if alpha is not None else rank) / rank)


def delta(a, b, shape, scale: float) -> jax.Array:
    """scale * A @ B in the weight's layout `shape`: a [*batch, in, r], b [*batch, r, out] -> fp32 [*shape]."""
    return (scale * jnp.matmul(a.astype(F32), b.astype(F32))).reshape(shape)


def merge(params: dict, adapters: Adapters) -> dict:
    """The params with W + scale * A @ B at every adapted path (in W's dtype); other leaves untouched (the
    same arrays). Differentiable in the adapters: the LoRA forward is the model on merge(base, adapters)."""
    flat, ab = plan_lib.flatten(params), plan_lib.flatten(adapters.weights)
    out = dict(flat)
    for p in adapters.paths:
        if p not in flat:
            raise ValueError(f"lora.merge: the adapters have {p}, which the params lack")
        a, b, w = ab[p + "/a"], ab[p + "/b"], flat[p]
        lead = a.shape[:-2]
        if (a.shape[-1] != b.shape[-2] or lead != b.shape[:-2] or tuple(w.shape[:len(lead)]) != lead
                or math.prod(w.shape) != math.prod(lead) * a.shape[-2] * b.shape[-1]):
            raise ValueError(f"lora.merge: adapters of {p} (a {tuple(a.shape)}, b {tuple(b.shape)}) do not fit its "
                             f"shape {tuple(w.shape)}")
        out[p] = (w.astype(F32) + delta(a, b, w.shape, adapters.scale)).astype(w.dtype)
    return plan_lib.unflatten(out)


def num_params(adapters: Adapters) -> int:
    return sum(math.prod(a.shape) for a in jax.tree.leaves(adapters))
