"""Mixture of experts: routers as data, dropless grouped matmuls (`grouped.ragged_dot`).

Every (token, expert) assignment is computed: tokens are sorted by expert and each expert's rows go
through one grouped matmul. No capacity factor, nothing dropped. `dense` computes every expert on
every token and masks: the reference the sparse path is tested against. Experts kept quantized
({"fp8"|"fp4", "scale"} leaves, [E, out, in]) are expanded inside the computation. The sharding decision
is an argument: `shard` (see jaxmodels.sharding.Sharding) says whether experts are split over a mesh axis.

More experts than the grouped kernels take (DeepSeek's 256-384, Qwen3-MoE's 128) go through windows of an
expert's rows: on the GPU all at once (`windowed`, a kernel per matrix), elsewhere `_windows`, one XLA loop step a
window. XLA lowers `lax.ragged_dot` densely (every row through every expert behind a
mask: E times the FLOPs, a [rows, E * in] operand), which at V4.1-Flash widths is 6e9 elements for a 512-token
prefill, with every FP4 expert expanded to bf16 (9 GB a matrix) before it.
"""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxmodels.config import MLPSpec
from jaxmodels.layers import gathered, grouped, mlp, qdq, windowed

F32 = jnp.float32
SCORES = {"softmax": lambda s: jax.nn.softmax(s, axis=-1), "sigmoid": jax.nn.sigmoid,
          "sqrtsoftplus": lambda s: jnp.sqrt(jax.nn.softplus(s))}


def route(spec: MLPSpec, p, x, tokens=None):
    """x [N, D] -> (weights [N, k], expert ids [N, k]); weights in x's dtype, fp32 for DeepSeek's routers."""
    if spec.router in ("biased_topk", "hash"):  # DeepSeek: fp32 scores; a bias that only picks the experts
        s = SCORES[spec.score_func](jnp.einsum("nd,de->ne", x.astype(F32), p["router"].astype(F32)))
        if spec.router == "hash":
            idx = p["tid2eid"][tokens.reshape(-1)]
        else:
            picks = s + p["selection_bias"].astype(F32) if spec.selection_bias else s
            idx = jax.lax.top_k(picks, spec.top_k)[1]
        w = jnp.take_along_axis(s, idx, axis=-1)
    else:
        logits = jnp.dot(x, p["router"])
        if spec.router_bias:
            logits = logits + p["router_bias"]
        if spec.router == "softmax_topk":  # softmax over all experts in fp32, then the k largest
            w, idx = jax.lax.top_k(jax.nn.softmax(logits.astype(F32), axis=-1), spec.top_k)
        else:  # topk_softmax: the k largest logits, softmax over those k in the logits' dtype
            v, idx = jax.lax.top_k(logits, spec.top_k)
            w = jax.nn.softmax(v, axis=-1)
    if spec.renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    if spec.route_scale != 1.0:
        w = w * spec.route_scale
    return (w if spec.router in ("biased_topk", "hash") else w.astype(x.dtype)), idx


def _expert_out(spec, p, x, e, ragged=None):
    """Gated expert MLP; `ragged` = group sizes for sorted rows, else x [E, N, D] per expert."""
    if ragged is not None:
        mm = lambda a, w: grouped.ragged_dot(a, w, ragged)  # noqa: E731
    else:
        mm = lambda a, w: jnp.einsum("end,edf->enf", a, w)  # noqa: E731
    g, u = mm(x, p["w_gate"]), mm(x, p["w_up"])
    if spec.bias:
        g, u = g + p["b_gate"][e], u + p["b_up"][e]
    y = mm(mlp.activate(spec, g, u), p["w_down"])
    return y + p["b_down"][e] if spec.bias else y


EXPERT_PARAMS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")


def sparse(spec: MLPSpec, p, x, shard=None, tokens=None, act_block: int | None = None, stack=None):
    """Dropless routed experts (+ shared expert). x [..., D]; tokens [...] for hash routing.
    stack: (this kind's MLP params stacked over its layers, this layer's index) for kernels that read the
    experts of a scanned layer in place.

    Under a `shard` whose rules split `experts` over a mesh axis, each device computes only its own experts'
    assignments (routing is replicated) and one psum over that axis combines them (`shard_map`).
    act_block: the reference's numerics (every expert on every token, FP8 activation QDQ, fp32 accumulation).
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    w, idx = route(spec, p, xt, tokens)
    if act_block:
        return _reference(spec, p, xt, w, idx, act_block).reshape(shape)
    w = w.astype(xt.dtype)
    ep = shard.expert_axis(spec.num_experts) if shard is not None else None
    if ep is None:
        # on a mesh XLA would gather the whole stack to every device for the kernel (no partitioning rule)
        out = _routed(spec, p, xt, w, idx, 0, None if shard is not None else stack)
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


def _routed(spec, p, xt, w, idx, first, stack=None):
    """Sum of the assignments to the experts in `p` (global ids first ..); other assignments add 0.

    Few assignments (tokens * top_k <= experts: decode) read only their experts' weights (`_gathered`); more go
    sorted by expert through one grouped matmul per matrix (`_windowed` past 32 experts, and for FP4 experts where
    its kernel runs). Experts kept quantized gather just their bytes there; the windows' kernel decodes their FP4 in
    registers, its loop one expert a step; on the grouped path (<= 32 experts off the kernel) every expert is
    expanded once.
    """
    E = jax.tree.leaves(p["w_gate"])[0].shape[0]
    quantized = isinstance(p["w_gate"], dict)
    local = idx - first
    mine = (local >= 0) & (local < E)
    w = jnp.where(mine, w, 0)
    # the windows' kernel: past the grouped kernels' experts, and for FP4 experts at any count (it decodes them
    # in registers; the grouped path expands every expert to bf16 first)
    mats = _kernel_mats(xt, stack) if E > WINDOWED_EXPERTS or quantized else None
    # FP4 windows through the kernel beat an expert read per row from about E/2 rows on (H100, BENCHMARKS.md)
    if xt.shape[0] * spec.top_k <= (E // 2 if mats is not None and quantized else E):
        return _gathered(spec, p, xt, w, jnp.clip(local, 0, E - 1), stack)
    flat = jnp.where(mine, local, E).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token, sorted_e = order // spec.top_k, flat[order]
    sizes = jnp.bincount(flat, length=E + 1)[:E].astype(jnp.int32)
    if E > WINDOWED_EXPERTS or mats is not None:
        y = _windowed(spec, p, xt[token], sizes, stack, mats)
    else:
        if isinstance(p["w_gate"], dict):  # expand every expert once, [E, in, out]
            p = p | {k: jnp.swapaxes(qdq.dequant(p[k], xt.dtype), -1, -2) for k in ("w_gate", "w_up", "w_down")}
        e = jnp.minimum(sorted_e, E - 1)  # other devices' rows sort last, past every group, and come out zero
        y = _expert_out(spec, p, xt[token], e, ragged=sizes)
    y = y * w.reshape(-1)[order][:, None]
    return jnp.zeros_like(xt).at[token].add(y.astype(xt.dtype))


WINDOWED_EXPERTS = grouped.MAX_GROUPS  # more experts than this: `_windows`, not one grouped matmul per matrix


def _window(rows: int, experts: int) -> int:
    """Rows a loop step takes: about the mean group, a power of two in [16, 256]."""
    return min(256, max(16, 1 << max(0, -(-rows // experts) - 1).bit_length()))


def _in_place(stack, name):
    """Expert matrix `name` as the kernels read it, from the stack of a scanned layer: every layer's [L * E, ...]
    and this layer's first id."""
    whole = stack[0][name]
    return jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), whole), stack[1] * jax.tree.leaves(whole)[0].shape[1]


def lone(p):
    """`sparse`'s stack for a layer that is not scanned (its own params, as MTP blocks): its experts as a stack of
    one, so that the kernels read them as they do a scanned layer's (a leading axis of 1 moves no bytes)."""
    return {k: jax.tree.map(lambda v: v[None], p[k]) for k in ("w_gate", "w_up", "w_down")}, 0


def _kernel_mats(x, stack):
    """The three expert matrices as `windowed.matmul` reads them (`_in_place`), if it runs on all of them: given the
    stack (none on a mesh), on the GPU, for widths and offsets it takes; else None."""
    if stack is None:
        return None
    mats = {k: _in_place(stack, k) for k in ("w_gate", "w_up", "w_down")}
    return mats if all(windowed.fits(x, w) for w, _ in mats.values()) else None


def _windowed(spec, p, x, sizes, stack, mats):
    """Rows sorted by expert (x [M, D], group sizes [E]) through their experts: given `mats` (`_kernel_mats`: on the
    GPU, from every layer's stack), the windows of all experts in one kernel per matrix (`windowed.matmul`);
    elsewhere, and on a mesh (no stack: the kernel has no partitioning rule, XLA would gather the stack to every
    device), `_windows`. Rows past the groups come out zero."""
    M, E = x.shape[0], sizes.shape[0]
    if mats is None:
        return _windows(spec, p, x, sizes, stack)
    lay = windowed.layout(sizes, M, min(_window(M, E), windowed.MAX_WINDOW))
    e = jnp.repeat(lay.expert, lay.W)  # each slot's expert, for the biases

    def mm(a, name):
        w, first = mats[name]
        return windowed.matmul(a, w, lay, first)

    xw = windowed.spread(x, lay)
    g, u = mm(xw, "w_gate"), mm(xw, "w_up")
    if spec.bias:
        g, u = g + p["b_gate"][e], u + p["b_up"][e]
    y = mm(mlp.activate(spec, g, u), "w_down")
    return windowed.collect(y + p["b_down"][e] if spec.bias else y, lay, M)


def _windows(spec, p, x, sizes, stack=None):
    """Rows sorted by expert (x [M, D], group sizes [E], sum <= M) through their experts, one window of W rows of
    one expert a step (`windowed.layout`): E + M / W steps, each reading one expert's matrices (decoding just that
    expert if kept quantized; with `stack`, in place in every layer's stack) and W rows from its group's start.
    Rows past the groups come out zero, as `lax.ragged_dot` gives them. Memory is O(M + one expert), work ~ routed
    rows; the static step count keeps the loop free of host syncs, so the steps past the last window compute on
    nothing. On a tensor-parallel mesh each step ends in its own all-reduce of [W, D] (not measured)."""
    M, D = x.shape
    lay = windowed.layout(sizes, M, _window(M, sizes.shape[0]))
    W = lay.W
    padded = jnp.concatenate([x, jnp.zeros((W, D), x.dtype)])  # a window from any start stays inside

    def expert(name, e):
        if stack is None:
            w = jax.tree.map(lambda v: v[e], p[name])
        else:  # [L, E, ...]: this layer's expert e, sliced from the stack (not this layer's copy of it)
            w = jax.tree.map(lambda v: v[stack[1], e], stack[0][name])
        return qdq.dequant(w, x.dtype).T if isinstance(w, dict) else w  # [in, out]

    @jax.checkpoint  # the backward recomputes a step's weights: saved, they would come to steps (> E) experts
    def mlp_of(xw, e):
        g, u = xw @ expert("w_gate", e), xw @ expert("w_up", e)
        if spec.bias:
            g, u = g + p["b_gate"][e], u + p["b_up"][e]
        y = mlp.activate(spec, g, u) @ expert("w_down", e)
        return y + p["b_down"][e] if spec.bias else y

    def step(j, out):
        e, start = lay.expert[j], lay.start[j]
        valid = jnp.arange(W) < lay.count[j]  # none in an unused window
        y = mlp_of(jax.lax.dynamic_slice_in_dim(padded, start, W), e)
        kept = jax.lax.dynamic_slice_in_dim(out, start, W)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None], y.astype(out.dtype), kept), start, 0)

    out = jax.lax.fori_loop(0, lay.expert.shape[0], step, jnp.zeros((M + W, D), x.dtype))
    return out[:M]


def _gathered(spec, p, xt, w, idx, stack=None):
    """Each (token, slot) reads only its expert's matrices: weight bytes ~ tokens * top_k experts. Given `stack`,
    through `gathered.matmul` (on the GPU a kernel reading every layer's stack in place, experts kept quantized
    decoded inside it), else XLA's gather (of the chosen experts' bytes, then expanded)."""
    e = idx.reshape(-1)
    rows = jnp.repeat(xt, spec.top_k, axis=0)

    def mm(a, name):
        if stack is None:  # (the kernel given a scanned layer's slice: XLA copies the slice first)
            return gathered.reference(a, p[name], e)
        w, first = _in_place(stack, name)  # bytes and scales too, if kept quantized
        return gathered.matmul(a, w, first + e)

    g, u = mm(rows, "w_gate"), mm(rows, "w_up")
    if spec.bias:
        g, u = g + p["b_gate"][e], u + p["b_up"][e]
    y = mm(mlp.activate(spec, g, u), "w_down")
    if spec.bias:
        y = y + p["b_down"][e]
    y = y.reshape(xt.shape[0], spec.top_k, -1) * w[..., None]
    return jnp.sum(y, axis=1).astype(xt.dtype)


def _reference(spec, p, xt, w, idx, act_block):
    """DeepSeek's reference numerics: every expert on every token (tiny models), FP8 linears, the routing weight
    applied before w2, accumulated in fp32 in ascending expert order, then the shared expert."""
    y = jnp.zeros(xt.shape, F32)
    for e in range(spec.num_experts):
        we = jnp.sum(jnp.where(idx == e, w, 0.0), axis=-1, keepdims=True)
        pe = {k: jax.tree.map(lambda t: t[e], p[k]) for k in ("w_gate", "w_up", "w_down")}
        y = y + jnp.where(we > 0, mlp.gated(spec, pe, xt, act_block, weight=we).astype(F32), 0.0)
    return (y + _shared(spec, p, xt, 0.0, act_block).astype(F32)).astype(xt.dtype)


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


def _shared(spec, p, xt, out, act_block=None):
    if not spec.shared_intermediate_size:
        return out
    shared = MLPSpec(activation=spec.activation, clamp_alpha=spec.clamp_alpha, clamp_limit=spec.clamp_limit,
                     activation_fp32=spec.activation_fp32)
    return out + mlp.gated(shared, p["shared"], xt, act_block)
