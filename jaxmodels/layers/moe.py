"""Mixture of experts: routers as data, dropless grouped matmuls with `lax.ragged_dot`.

Every (token, expert) assignment is computed: tokens are sorted by expert and each expert's rows go
through one grouped matmul. No capacity factor, nothing dropped. `dense` computes every expert on
every token and masks: the reference the sparse path is tested against.
"""
import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec as P

from jaxmodels import sharding
from jaxmodels.config import MLPSpec
from jaxmodels.layers import mlp

F32 = jnp.float32


def route(spec: MLPSpec, p, x):
    """x [N, D] -> (weights [N, k] in x's dtype, expert ids [N, k])."""
    logits = jnp.dot(x, p["router"])
    if spec.router_bias:
        logits = logits + p["router_bias"]
    if spec.router == "softmax_topk":  # softmax over all experts in fp32, then the k largest
        probs = jax.nn.softmax(logits.astype(F32), axis=-1)
        w, idx = jax.lax.top_k(probs, spec.top_k)
        if spec.renormalize:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
    elif spec.router == "topk_softmax":  # the k largest logits, softmax over those k in the logits' dtype
        v, idx = jax.lax.top_k(logits, spec.top_k)
        w = jax.nn.softmax(v, axis=-1)
    else:
        raise ValueError(f"unknown router {spec.router!r}")
    return w.astype(x.dtype), idx


def _expert_out(spec, p, x, e, ragged=None):
    """Gated expert MLP; `ragged` = group sizes for sorted rows, else x [E, N, D] per expert."""
    if ragged is not None:
        mm = lambda a, w: jax.lax.ragged_dot(a, w, ragged)  # noqa: E731
    else:
        mm = lambda a, w: jnp.einsum("end,edf->enf", a, w)  # noqa: E731
    g, u = mm(x, p["w_gate"]), mm(x, p["w_up"])
    if spec.bias:
        g, u = g + p["b_gate"][e], u + p["b_up"][e]
    y = mm(mlp.activate(spec, g, u), p["w_down"])
    return y + p["b_down"][e] if spec.bias else y


def sparse(spec: MLPSpec, p, x):
    """Dropless routed experts (+ shared expert). x [..., D].

    Under a mesh whose rules shard `experts`, each device computes only its own experts' assignments
    (routing is replicated) and one psum over the expert axis combines them (`shard_map`).
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    w, idx = route(spec, p, xt)
    ep = sharding.expert_axis(spec.num_experts)
    if ep is None:
        out = _routed(spec, p, xt, w, idx, 0)
    else:
        mesh, axis = ep
        experts = {k: v for k, v in p.items() if k in EXPERT_PARAMS}
        in_specs = ({k: P(axis) for k in experts}, P(), P(), P())

        def local(experts, xt, w, idx):
            first = jax.lax.axis_index(axis) * (spec.num_experts // mesh.shape[axis])
            return jax.lax.psum(_routed(spec, experts, xt, w, idx, first), axis)

        out = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), axis_names={axis},
                            check_vma=False)(experts, xt, w, idx)
    return _shared(spec, p, xt, out).reshape(shape)


EXPERT_PARAMS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def _routed(spec, p, xt, w, idx, first):
    """Sum of the assignments to the experts in `p` (global ids first ..); other assignments add 0.

    Few assignments (decode: tokens * top_k <= experts) gather just the chosen experts' weights;
    otherwise rows are sorted by expert into one grouped `ragged_dot` per matrix (rows of other
    devices' experts sort last, past every group, and come out zero).
    """
    E = p["w_gate"].shape[0]
    local = idx - first
    mine = (local >= 0) & (local < E)
    w = jnp.where(mine, w, 0)
    if xt.shape[0] * spec.top_k <= E:
        return _gathered(spec, p, xt, w, jnp.clip(local, 0, E - 1))
    flat = jnp.where(mine, local, E).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // spec.top_k
    expert = jnp.minimum(flat[order], E - 1)
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
    y = _expert_out(spec, p, xt[token], expert, ragged=sizes)
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros_like(xt).at[token].add(y.astype(xt.dtype))


def _gathered(spec, p, xt, w, idx):
    """Each (token, slot) reads only its expert's matrices: weight bytes ~ tokens * top_k experts."""
    e = idx.reshape(-1)
    rows = jnp.repeat(xt, spec.top_k, axis=0)
    mm = lambda a, name: jnp.einsum("nd,ndf->nf", a, p[name][e])  # noqa: E731
    g, u = mm(rows, "w_gate"), mm(rows, "w_up")
    if spec.bias:
        g, u = g + p["b_gate"][e], u + p["b_up"][e]
    y = mm(mlp.activate(spec, g, u), "w_down")
    if spec.bias:
        y = y + p["b_down"][e]
    y = y.reshape(xt.shape[0], spec.top_k, -1) * w[..., None]
    return jnp.sum(y, axis=1).astype(xt.dtype)


def dense(spec: MLPSpec, p, x):
    """Reference: every expert on every token, weighted by the (mostly zero) routing matrix."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    w, idx = route(spec, p, xt)
    combine = jnp.zeros((xt.shape[0], spec.num_experts), w.dtype).at[jnp.arange(xt.shape[0])[:, None], idx].add(w)
    e = jnp.arange(spec.num_experts)[:, None]
    y = _expert_out(spec, p, jnp.broadcast_to(xt, (spec.num_experts, *xt.shape)), e)
    out = jnp.einsum("ne,end->nd", combine, y).astype(x.dtype)
    return _shared(spec, p, xt, out).reshape(shape)


def _shared(spec, p, xt, out):
    if not spec.shared_intermediate_size:
        return out
    shared = MLPSpec(activation=spec.activation, clamp_alpha=spec.clamp_alpha, clamp_limit=spec.clamp_limit)
    return out + mlp.gated(shared, p["shared"], xt)
