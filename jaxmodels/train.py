"""Training on the pure model: next-token loss, an optax train step, remat, mixed precision, a mesh, orbax.

    tc = train.TrainConfig(learning_rate=1e-4, warmup_steps=100, total_steps=10_000, accumulate=4, remat="dots")
    params, frozen = train.partition(model.params)          # floating leaves train; integer tables stay
    state = train.init(params, tc, model.config, mesh, "fsdp_tp")
    step = train.make_step(model.config, tc, mesh, "fsdp_tp")
    state, metrics = step(state, {"tokens": tokens, "mask": train.loss_mask(lengths, prompt_lengths, T)}, frozen)
    train.save(path, state); state = train.restore(path, state)

The state is (step, fp32 master params, optimizer state); the forward runs in `compute_dtype` (bf16 by default)
through a cast inside the loss, so gradients arrive in fp32 and AdamW's moments stay fp32. What is not trained
(integer tables, LoRA's base weights) is the step's `frozen` argument, recombined with the trained leaves by
`apply` (default: a deep merge; LoRA: `lambda adapters, base: lora.merge(base, adapters)`).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jcore

from jaxmodels import model as executor, plan as plan_lib, sharding
from jaxmodels.config import ModelConfig

F32 = jnp.float32

# names of jax.checkpoint policies for each scanned layer body: what the backward pass keeps from the forward
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,  # recompute each layer whole: least memory
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep the weight matmuls' outputs
    "everything": jax.checkpoint_policies.everything_saveable,  # no recompute (as remat=None), for comparison
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimizer and step options (hashable: a static argument of the jitted step).

    learning_rate: the peak, reached after `warmup_steps` (linear from 0) and decayed by a cosine to
    `end_learning_rate` at `total_steps` (optimizer steps, i.e. after accumulation). clip_norm: clip the
    global gradient norm (None: no clipping). accumulate: micro-batches per optimizer step (optax.MultiSteps:
    each call of the step takes one micro-batch, and the update applies their mean gradient every
    `accumulate` calls). compute_dtype: the forward's dtype (None: the params' own). remat: a REMAT_POLICIES
    name or a jax.checkpoint policy applied to every scanned layer body (None: keep every residual).
    """

    learning_rate: float = 3e-4
    warmup_steps: int = 0
    total_steps: int = 1000
    end_learning_rate: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0
    accumulate: int = 1
    compute_dtype: str | None = "bfloat16"
    remat: str | Callable | None = None

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ValueError(f"TrainConfig.learning_rate must be > 0, got {self.learning_rate}")
        if self.total_steps < 1 or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(f"TrainConfig: need 0 <= warmup_steps <= total_steps and total_steps >= 1, got "
                             f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}")
        if self.accumulate < 1:
            raise ValueError(f"TrainConfig.accumulate must be >= 1 micro-batches, got {self.accumulate}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"TrainConfig.clip_norm must be > 0 or None, got {self.clip_norm}")
        if isinstance(self.remat, str) and self.remat not in REMAT_POLICIES:
            raise ValueError(f"TrainConfig.remat {self.remat!r}: use one of {', '.join(REMAT_POLICIES)}, a "
                             f"jax.checkpoint policy, or None")
        if self.compute_dtype is not None:
            jnp.dtype(self.compute_dtype)  # TypeError naming it if unknown


# ----------------------------------------------------------------------------------------------- the loss
def loss_mask(lengths, prompt_lengths, T: int) -> jax.Array:
    """float32 [B, T]: 1 at the tokens the loss predicts (position prompt_lengths[b] .. lengths[b]-1 of a
    right-padded row: the completion), 0 at prompt tokens and padding. lengths, prompt_lengths: int [B]."""
    t = jnp.arange(T)[None]
    lengths, prompt_lengths = jnp.asarray(lengths)[:, None], jnp.asarray(prompt_lengths)[:, None]
    return ((t >= prompt_lengths) & (t < lengths)).astype(F32)


def next_token_loss(logits, tokens, mask=None) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of predicting tokens[:, t+1] from logits[:, t], over the targets mask marks.

    logits float [B, T, V]; tokens int [B, T]; mask [B, T] weights of each token *as a target* (loss_mask;
    None: every token after the first). -> (loss, number of target tokens), both fp32 scalars; a batch with
    no targets has loss 0.
    """
    logp = jax.nn.log_softmax(logits[:, :-1].astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = jnp.ones(nll.shape, F32) if mask is None else jnp.asarray(mask, F32)[:, 1:]
    n = w.sum()
    return (nll * w).sum() / jnp.maximum(n, 1.0), n


# ----------------------------------------------------------------------------------------------- remat
def _checkpoint_scans(closed, policy, wrap: bool):
    """The closed jaxpr with every scan body (nested ones too) under jax.checkpoint(policy); wrap: this one too."""
    eqns = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            eqn = eqn.replace(params={**eqn.params, "jaxpr": _checkpoint_scans(eqn.params["jaxpr"], policy, True)})
        eqns.append(eqn)
    out = jcore.ClosedJaxpr(closed.jaxpr.replace(eqns=eqns), closed.consts)
    if not wrap:
        return out
    return jax.make_jaxpr(jax.checkpoint(jcore.jaxpr_as_fun(out), policy=policy))(*closed.in_avals)


def remat_layers(fn: Callable, policy) -> Callable:
    """fn with jax.checkpoint(policy) on each `lax.scan` body it runs: the executor scans the layers, so the
    backward pass keeps per layer only what the policy saves and recomputes the rest one layer at a time.
    (A checkpoint around the whole forward would not lower the peak: its backward recomputes every layer
    before the first gradient.) Scans inside a nested jit are left as they are."""
    policy = REMAT_POLICIES[policy] if isinstance(policy, str) else policy

    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        out = jcore.jaxpr_as_fun(_checkpoint_scans(closed, policy, False))(*jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return wrapped


# ----------------------------------------------------------------------------------------------- the state
@functools.partial(jax.tree_util.register_dataclass, data_fields=["step", "params", "opt_state"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32 scalar: micro-steps taken
    params: dict  # the trained leaves, fp32 master copies
    opt_state: optax.OptState


def partition(params: dict) -> tuple[dict, dict]:
    """(floating leaves, the rest: integer tables and quantized bytes), as two nested dicts of the params' paths."""
    flat = plan_lib.flatten(params)
    floating = {p: a for p, a in flat.items() if jnp.issubdtype(a.dtype, jnp.floating)}
    return plan_lib.unflatten(floating), plan_lib.unflatten({p: a for p, a in flat.items() if p not in floating})


def combine(params: dict, frozen: dict) -> dict:
    """The deep merge of two nested dicts with disjoint leaves (inverse of `partition`)."""
    return plan_lib.unflatten(plan_lib.flatten(frozen) | plan_lib.flatten(params))


def schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps, tc.total_steps,
                                              tc.end_learning_rate)


def optimizer(tc: TrainConfig, weight_decay_mask=None) -> optax.GradientTransformation:
    """Gradient clipping -> AdamW on the warmup + cosine schedule, accumulated over `tc.accumulate` micro-steps.
    weight_decay_mask: optax.adamw's mask (a pytree of bools or a function of the params; None: decay all)."""
    tx = optax.adamw(schedule(tc), tc.b1, tc.b2, tc.eps, weight_decay=tc.weight_decay, mask=weight_decay_mask)
    if tc.clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(tc.clip_norm), tx)
    return optax.MultiSteps(tx, tc.accumulate) if tc.accumulate > 1 else tx


def state_shardings(state, cfg: ModelConfig, mesh: jax.sharding.Mesh, rules="tp"):
    """NamedShardings for a TrainState (or its eval_shape): every leaf whose dict keys spell a parameter path
    of the same shape (the params, AdamW's moments, MultiSteps' accumulated gradients) is placed as that
    parameter by the rules; the rest (counters, LoRA adapters) is replicated."""
    placed = plan_lib.flatten(sharding.shardings(cfg, mesh, rules))
    shapes = plan_lib.flat_shapes(cfg)
    replicated = jax.sharding.NamedSharding(sharding.auto_axes(mesh), jax.sharding.PartitionSpec())

    def one(path, leaf):
        name = "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        return placed[name] if shapes.get(name) == tuple(leaf.shape) else replicated

    return jax.tree_util.tree_map_with_path(one, state)


def init(params: dict, tc: TrainConfig, cfg: ModelConfig | None = None, mesh=None, rules="tp",
         weight_decay_mask=None) -> TrainState:
    """A fresh TrainState of the trained leaves `params`: fp32 master copies (new buffers, so that donating
    the state never frees the caller's arrays) and the optimizer's state, placed on `mesh` by `rules` when
    given (then cfg is needed)."""
    if mesh is not None and cfg is None:
        raise ValueError("train.init: placing the state on a mesh needs the model's config (cfg=...)")
    tx = optimizer(tc, weight_decay_mask)

    def fresh(params):
        params = jax.tree.map(lambda a: jnp.array(a, F32), params)
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    if mesh is None:
        return fresh(params)
    out = state_shardings(jax.eval_shape(fresh, params), cfg, mesh, rules)
    return jax.jit(fresh, out_shardings=out)(params)  # each device builds only its shards


def make_step(cfg: ModelConfig, tc: TrainConfig, mesh=None, rules="tp", apply: Callable | None = None,
              weight_decay_mask=None) -> Callable:
    """The jitted train step `step(state, batch, frozen={}) -> (state, metrics)`; the state is donated.

    batch: {"tokens": int32 [B, T], "mask": [B, T] (loss_mask; optional)}. frozen: what is not trained
    (`partition`'s second half; LoRA's base params). apply(params, frozen) -> the model's params (default
    `combine`). On a mesh, the state keeps `state_shardings` and the activations are pinned by `rules`.
    metrics: loss (of this micro-batch), tokens (its target count), grad_norm (before clipping).
    """
    tx = optimizer(tc, weight_decay_mask)
    apply = combine if apply is None else apply
    shard = sharding.Sharding.of(mesh, rules)

    def forward(p, tokens):
        return executor.forward(p, cfg, tokens, shard=shard)

    if tc.remat is not None:
        forward = remat_layers(forward, tc.remat)

    def loss_fn(params, frozen, batch):
        p = apply(params, frozen)
        if tc.compute_dtype is not None:  # bf16 compute; the cast's transpose brings the gradients back to fp32
            p = executor.cast(cfg, p, tc.compute_dtype)
        return next_token_loss(forward(p, batch["tokens"]), batch["tokens"], batch.get("mask"))

    def step(state: TrainState, batch: dict, frozen: dict):
        (loss, n), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, frozen, batch)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = TrainState(state.step + 1, params, opt_state)
        if shard is not None:  # the new state where the old one was (XLA would otherwise choose)
            new = jax.lax.with_sharding_constraint(new, state_shardings(new, cfg, shard.mesh, dict(shard.rules)))
        return new, {"loss": loss, "tokens": n, "grad_norm": optax.global_norm(grads)}

    jitted = jax.jit(step, donate_argnums=0, compiler_options=executor.COMPILER_OPTIONS)

    def run(state: TrainState, batch: dict, frozen: dict | None = None):
        batch = {k: jnp.asarray(v) for k, v in batch.items()}
        if shard is not None:  # rows over the batch axes; the state keeps the placement init gave it
            batch = {k: jax.device_put(v, jax.sharding.NamedSharding(shard.mesh, sharding.spec_for(
                ("batch",) + (None,) * (v.ndim - 1), v.shape, shard.mesh, dict(shard.rules)))) for k, v in batch.items()}
        with sharding.entered(shard):
            return jitted(state, batch, {} if frozen is None else frozen)

    return run


# ----------------------------------------------------------------------------------------------- checkpoints
def save(path: str | Path, state: TrainState) -> Path:
    """Write the whole state with orbax (atomically: orbax renames a temporary directory at the end)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path, state)
        ckpt.wait_until_finished()
    return path


def restore(path: str | Path, like: TrainState) -> TrainState:
    """The state saved at `path`, with the structure, dtypes and shardings of `like` (a TrainState or its
    jax.eval_shape with shardings: restore straight into the mesh placement)."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=getattr(a, "sharding", None)),
                          like)
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(Path(path).absolute(), target)
