"""Mixture of experts (`jaxmodels/layers/moe.py`).

- `sparse` (dropless, sorted by expert, `lax.ragged_dot`) equals `dense` (every expert on every
  token, masked) to fp32 rounding, over routers, biases, activations, shared experts, expert counts,
  top-k, odd token counts, empty experts and all tokens on one expert; and so do their gradients.
- `route` and the whole block equal an independent float64 NumPy implementation written here.
- The whole block equals HF's own modules, `Qwen3MoeSparseMoeBlock` and `GptOssMLP`, with random
  weights copied into our layout (spec: specs/hf_families.md §3.3, §3.7).
"""
import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxmodels.config import MLPSpec
from jaxmodels.layers import moe
from jaxmodels.plan import mlp_param_specs

D = 24
ATOL = 1e-5

# One compilation per case, with LLVM's expensive passes off: several times cheaper than eager dispatch or a
# default jit on 2 CPU cores. `test_batched_input_shape_under_jit` runs a plain `jax.jit` as the model does.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST)
def run(spec, p, x):
    """(route of the tokens, sparse, dense) of one case."""
    return moe.route(spec, p, x.reshape(-1, x.shape[-1])), moe.sparse(spec, p, x), moe.dense(spec, p, x)


route = jax.jit(moe.route, static_argnums=0, compiler_options=FAST)


def spec_of(E=8, k=2, router="softmax_topk", renormalize=False, router_bias=False, bias=False,
            activation="silu", shared=0, I=16, clamp_limit=7.0):
    return MLPSpec(kind="moe", activation=activation, intermediate_size=I, num_experts=E, top_k=k, router=router,
                   renormalize=renormalize, router_bias=router_bias, bias=bias, shared_intermediate_size=shared,
                   clamp_limit=clamp_limit)


def make_params(spec, seed=0, d=D, router_std=None, weight_std=None):
    """Random float32 params of every shape `_mlp_shapes` asks for; biases non-trivial. Gate/up columns have
    std ~1.5 on unit inputs, so a clamp at 1.0 fires often."""
    rng = np.random.default_rng(seed)

    def init(path, shape):
        name = path[-1].key
        if name == "router":
            std = router_std if router_std is not None else 1.0
        elif name.startswith("b_") or name == "router_bias":
            std = 0.5
        else:
            std = (weight_std if weight_std is not None else 1.5) * shape[-2] ** -0.5
        return jnp.asarray(rng.normal(0.0, std, shape).astype(np.float32))

    shapes = _mlp_shapes(d, spec)
    return jax.tree_util.tree_map_with_path(init, shapes, is_leaf=lambda s: isinstance(s, tuple))


def _mlp_shapes(d, spec):
    return jax.tree.map(lambda s: s.shape, mlp_param_specs(d, spec), is_leaf=lambda s: hasattr(s, "axes"))


def make_x(n, seed=1, d=D):
    return jnp.asarray(np.random.default_rng(seed).normal(0.0, 1.0, (n, d)).astype(np.float32))


# ------------------------------------------------------------------ independent NumPy reference (float64)

def np_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def np_route(spec, p, x):
    """softmax_topk: softmax over all experts -> k largest -> optional renorm.
    topk_softmax: k largest (biased) logits -> softmax over those k."""
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(p["router"], np.float64)
    if spec.router_bias:
        logits = logits + np.asarray(p["router_bias"], np.float64)
    if spec.router == "softmax_topk":
        probs = np_softmax(logits)
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, : spec.top_k]
        w = np.take_along_axis(probs, idx, axis=-1)
        if spec.renormalize:
            w = w / w.sum(axis=-1, keepdims=True)
    else:
        idx = np.argsort(-logits, axis=-1, kind="stable")[:, : spec.top_k]
        w = np_softmax(np.take_along_axis(logits, idx, axis=-1))
    return w, idx


def np_act(spec, g, u):
    if spec.activation == "silu":
        return g / (1.0 + np.exp(-g)) * u
    assert spec.activation == "swiglu_clamp"
    g = np.minimum(g, spec.clamp_limit)
    u = np.clip(u, -spec.clamp_limit, spec.clamp_limit)
    return (u + 1.0) * g / (1.0 + np.exp(-spec.clamp_alpha * g))


def np_moe(spec, p, x):
    """Token by token, expert by expert: out[n] = sum_j w[n, j] * expert_{idx[n, j]}(x[n]) (+ shared(x[n]))."""
    q = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    shape = x.shape
    xt = np.asarray(x, np.float64).reshape(-1, shape[-1])
    w, idx = np_route(spec, p, xt)
    out = np.zeros_like(xt)
    for n in range(xt.shape[0]):
        for j in range(spec.top_k):
            e = idx[n, j]
            g, u = xt[n] @ q["w_gate"][e], xt[n] @ q["w_up"][e]
            if spec.bias:
                g, u = g + q["b_gate"][e], u + q["b_up"][e]
            y = np_act(spec, g, u) @ q["w_down"][e]
            if spec.bias:
                y = y + q["b_down"][e]
            out[n] += w[n, j] * y
    if spec.shared_intermediate_size:
        s = q["shared"]
        out += np_act(spec, xt @ s["w_gate"], xt @ s["w_up"]) @ s["w_down"]
    return out.reshape(shape)


# ------------------------------------------------------------------ sparse == dense (== NumPy)

ROUTERS = [("softmax_topk", False), ("softmax_topk", True), ("topk_softmax", False)]
EK = [(4, 1), (4, 4), (8, 2), (8, 4), (16, 1), (16, 4)]
FLAGS = [  # (router_bias, expert bias, activation, shared width)
    (False, False, "silu", 0),
    (True, True, "swiglu_clamp", 0),
    (True, False, "silu", 8),
    (False, True, "swiglu_clamp", 8),
]
# every router x every (E, k); the four flag sets rotate so that each router meets each of them
GRID = [(r, rn, E, k, *FLAGS[(i + j) % 4]) for i, (r, rn) in enumerate(ROUTERS) for j, (E, k) in enumerate(EK)]


def grid_id(c):
    r, rn, E, k, rb, b, act, sh = c
    return f"{r}{'-renorm' if rn else ''}-E{E}k{k}{'-rbias' if rb else ''}{'-bias' if b else ''}-{act}" + \
        (f"-shared{sh}" if sh else "")


@pytest.mark.parametrize("case", GRID, ids=grid_id)
def test_sparse_equals_dense_and_numpy(case):
    router, renormalize, E, k, router_bias, bias, act, shared = case
    # clamp_limit 7 with a shared expert keeps its clamp equal to the default (see test_shared_expert_uses_spec_clamp)
    spec = spec_of(E, k, router, renormalize, router_bias, bias, act, shared, clamp_limit=7.0 if shared else 1.0)
    seed = zlib.crc32(grid_id(case).encode()) % 1000
    n = [1, 7, 13, 33][seed % 4]
    p, x = make_params(spec, seed), make_x(n, seed + 1)
    _, ys, yd = run(spec, p, x)
    ys, yd = np.asarray(ys), np.asarray(yd)
    assert ys.shape == (n, D) and ys.dtype == np.float32
    np.testing.assert_allclose(ys, yd, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ys, np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


def test_grid_covers_the_features():
    assert {c[2:4] for c in GRID} == set(EK) and {(c[0], c[1]) for c in GRID} == set(ROUTERS)
    for r in ROUTERS:
        assert {c[4:] for c in GRID if c[:2] == r} == set(FLAGS)


def test_clamp_fires_in_the_grid():
    """The swiglu_clamp cases above actually exercise both clamps (gate from above, up on both sides)."""
    spec = spec_of(8, 2, activation="swiglu_clamp", bias=True, clamp_limit=1.0)
    p, x = make_params(spec, 3), np.asarray(make_x(13, 4))
    gu = np.einsum("nd,edi->eni", x, np.asarray(p["w_gate"])), np.einsum("nd,edi->eni", x, np.asarray(p["w_up"]))
    assert (gu[0] > 1.0).mean() > 0.1 and (gu[1] > 1.0).mean() > 0.1 and (gu[1] < -1.0).mean() > 0.1


def test_batched_input_shape_under_jit():
    """x [B, T, D] gives the same rows as x [B*T, D], jitted as the model runs it."""
    spec = spec_of(8, 2, "softmax_topk", True, router_bias=True, bias=True, shared=8)
    p, x = make_params(spec, 5), make_x(15, 6)
    y3 = jax.jit(moe.sparse, static_argnums=0)(spec, p, x.reshape(3, 5, D))
    assert y3.shape == (3, 5, D)
    np.testing.assert_allclose(np.asarray(y3).reshape(15, D), np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


# ------------------------------------------------------------------ forced routing: empty experts, one expert

def forced(spec, boost, seed=0, n=11, d=D):
    """x has a constant feature 0 = 1; router row 0 adds `boost[e]` to expert e's logit for every token."""
    p = make_params(spec, seed, d)
    p["router"] = p["router"].at[0].set(jnp.asarray(boost, jnp.float32))
    x = make_x(n, seed + 1, d).at[:, 0].set(1.0)
    return p, x


def counts(idx, E):
    return np.bincount(np.asarray(idx).reshape(-1), minlength=E)


@pytest.mark.parametrize("router,renormalize,bias", [(*r, i % 2 == 0) for i, r in enumerate(ROUTERS)])
def test_some_experts_get_no_tokens(router, renormalize, bias):
    """Experts 0, 3, 6 and 7 (first, middle and last groups) are pushed 40 below the rest: empty groups."""
    spec = spec_of(8, 2, router, renormalize, router_bias=bias, bias=bias, shared=8 if bias else 0)
    dead = [0, 3, 6, 7]
    p, x = forced(spec, [-40.0 if e in dead else 0.0 for e in range(8)], n=9)
    (_, idx), ys, yd = run(spec, p, x)
    c = counts(idx, 8)
    assert all(c[e] == 0 for e in dead) and c.sum() == 18
    ys = np.asarray(ys)
    np.testing.assert_allclose(ys, np.asarray(yd), atol=ATOL, rtol=0)
    np.testing.assert_allclose(ys, np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


HOT = [(8, 1, [5]), (16, 1, [0]), (4, 1, [3]), (8, 2, [2, 6]), (16, 4, [1, 4, 9, 15])]


@pytest.mark.parametrize("router,renormalize,E,k,hot", [(*ROUTERS[i % 3], *h) for i, h in enumerate(HOT)])
def test_all_tokens_pick_the_same_experts(router, renormalize, E, k, hot):
    """Every token picks exactly the `hot` experts; all other groups are empty."""
    spec = spec_of(E, k, router, renormalize, router_bias=True, bias=True)
    p, x = forced(spec, [40.0 if e in hot else 0.0 for e in range(E)], seed=E + k, n=13)
    (_, idx), ys, yd = run(spec, p, x)
    c = counts(idx, E)
    assert [e for e in range(E) if c[e]] == hot and all(c[e] == 13 for e in hot)
    ys = np.asarray(ys)
    np.testing.assert_allclose(ys, np.asarray(yd), atol=ATOL, rtol=0)
    np.testing.assert_allclose(ys, np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("n,ep", [(1, False), (1, True), (4, False)])  # EP: 2 experts a device
def test_gathered_kernel_equals_dense(monkeypatch, n, ep):
    """Few assignments (decode) go through the gathered-experts kernel on the GPU: run here by Pallas' interpreter,
    with empty experts and, under expert parallelism, other devices' rows, it equals dense."""
    from jaxmodels import sharding
    from jaxmodels.layers import gathered

    kernel = gathered.matmul
    spec = spec_of(8, 2, "softmax_topk", True, router_bias=True, bias=True, shared=8, I=32)
    p, x = forced(spec, [-40.0 if e in (0, 3, 7) else 0.0 for e in range(8)], n=n, d=32)  # widths the kernel tiles
    calls = []
    monkeypatch.setattr(moe.gathered, "matmul", lambda *a: calls.append(1) or kernel(*a, interpret=True))
    shard = sharding.Sharding.of(sharding.make_mesh("data=2,expert=4"), "ep") if ep else None
    # this layer as rank 1 of a 3-layer stack, which the kernel reads in place (ignored under expert parallelism)
    stack = ({k: jnp.stack([v * 7 + 1, v, -v]) for k, v in p.items() if k in moe.EXPERT_PARAMS}, jnp.int32(1))
    ys = jax.jit(lambda p, x, stack: moe.sparse(spec, p, x, shard=shard, stack=stack))(p, x, stack)
    assert bool(calls) != ep, "the kernel reads the stack on one device; under expert parallelism XLA's gather"
    np.testing.assert_allclose(np.asarray(ys), np.asarray(moe.dense(spec, p, x)), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(ys), np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("n,G,K,N", [(1, 4, 16, 32), (5, 8, 48, 96), (12, 3, 64, 256)])
def test_gathered_matmul_kernel(n, G, K, N):
    """The kernel (interpreted) against x[i] @ w[ids[i]] in NumPy, repeated and unused experts included."""
    from jaxmodels.layers import gathered

    rng = np.random.default_rng(n + G)
    x, w = rng.standard_normal((n, K), np.float32), rng.standard_normal((G, K, N), np.float32)
    ids = rng.integers(0, G, n)
    got = gathered.matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(ids), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.einsum("nk,nkf->nf", x, w[ids]), atol=1e-4, rtol=1e-5)
    # differentiable: dx = g w[ids]^T, dw[e] = sum of x_i^T g_i over the rows routed to e
    g = rng.standard_normal((n, N), np.float32)
    dx, dw = jax.grad(lambda x, w: jnp.vdot(gathered.matmul(x, w, jnp.asarray(ids), interpret=True), g),
                      argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
    want_dw = np.zeros_like(w)
    np.add.at(want_dw, ids, np.einsum("nk,nf->nkf", x, g))
    np.testing.assert_allclose(np.asarray(dx), np.einsum("nf,nkf->nk", g, w[ids]), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), want_dw, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------ routing semantics

@pytest.mark.parametrize("router,renormalize", ROUTERS + [("topk_softmax", True)])
@pytest.mark.parametrize("router_bias,E,k", [(False, 4, 1), (True, 8, 2), (True, 16, 4), (False, 4, 4)])
def test_route_matches_numpy(router, renormalize, router_bias, E, k):
    spec = spec_of(E, k, router, renormalize, router_bias=router_bias)
    p = make_params(spec, E * 10 + k, router_std=0.5)
    if router_bias:  # large enough to change which experts are picked
        p["router_bias"] = p["router_bias"] * 4
    x = make_x(17, E + k)
    w, idx = route(spec, p, x)
    assert w.shape == idx.shape == (17, k) and w.dtype == jnp.float32
    want_w, want_idx = np_route(spec, p, x)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)  # in descending order
    np.testing.assert_allclose(np.asarray(w), want_w, atol=1e-6, rtol=1e-6)
    if router == "softmax_topk" and renormalize or router == "topk_softmax":
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)
    if router == "softmax_topk" and not renormalize and k < E:
        assert (np.asarray(w).sum(-1) < 1 - 1e-3).all()
    if router_bias:
        spec0 = dataclasses.replace(spec, router_bias=False)
        assert (np_route(spec0, p, x)[1] != want_idx).any(), "the bias should change some picks"


def test_routers_differ():
    """softmax_topk (no renorm) and topk_softmax give different weights for the same logits; with renorm the two
    are the same function (softmax restricted to the k largest) when there is no bias."""
    p, x = make_params(spec_of(8, 2), 1), make_x(9, 2)
    a = route(spec_of(8, 2, "softmax_topk", False), p, x)
    b = route(spec_of(8, 2, "softmax_topk", True), p, x)
    c = route(spec_of(8, 2, "topk_softmax"), p, x)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(c[1]))
    assert np.abs(np.asarray(a[0]) - np.asarray(c[0])).max() > 1e-2
    np.testing.assert_allclose(np.asarray(b[0]), np.asarray(c[0]), atol=1e-6)


def test_shared_expert_uses_spec_clamp():
    spec = spec_of(4, 2, activation="swiglu_clamp", shared=8, clamp_limit=0.5)
    p, x = make_params(spec, 7, weight_std=3.0), make_x(5, 8)
    np.testing.assert_allclose(np.asarray(run(spec, p, x)[1]), np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


# ------------------------------------------------------------------ gradients

GRAD_SPECS = {
    "qwen": spec_of(8, 2, "softmax_topk", True),
    "gptoss": spec_of(4, 2, "topk_softmax", router_bias=True, bias=True, activation="swiglu_clamp", clamp_limit=1.0),
    "shared_k4": spec_of(16, 4, "softmax_topk", False, shared=8),
}


@pytest.mark.parametrize("name", GRAD_SPECS)
def test_gradients_sparse_equal_dense(name):
    spec = GRAD_SPECS[name]
    p = make_params(spec, 11)
    # experts 0 and 1 get no tokens (when E > k + 2): their gradient must be exactly zero
    dead = [0, 1] if spec.num_experts >= spec.top_k + 4 else []
    p["router"] = p["router"].at[0].set(jnp.asarray([-40.0 if e in dead else 0.0 for e in range(spec.num_experts)]))
    x = make_x(13, 12).at[:, 0].set(1.0)
    r = make_x(13, 13)  # random cotangent

    @functools.partial(jax.jit, compiler_options=FAST)
    def grads(p, x):
        def loss(f, p, x):
            return jnp.sum(f(spec, p, x) * r)
        return tuple(jax.grad(functools.partial(loss, f), argnums=(0, 1))(p, x) for f in (moe.sparse, moe.dense))

    gs, gd = grads(p, x)
    flat_s, flat_d = jax.tree_util.tree_leaves_with_path(gs), jax.tree.leaves(gd)
    assert len(flat_s) == len(flat_d) == len(jax.tree.leaves(p)) + 1
    for (path, a), b in zip(flat_s, flat_d):
        a, b = np.asarray(a), np.asarray(b)
        scale = max(np.abs(b).max(), 1.0)
        np.testing.assert_allclose(a, b, atol=ATOL * scale, rtol=0, err_msg=jax.tree_util.keystr(path))
    g = gs[0]
    used = [e for e in range(spec.num_experts) if e not in dead]
    for key in ("w_gate", "w_up", "w_down"):
        assert all(np.abs(np.asarray(g[key][e])).max() > 1e-4 for e in used), key
        assert all(not np.asarray(g[key][e]).any() for e in dead), key
    assert np.abs(np.asarray(g["router"])).max() > 1e-4  # the routing weights carry gradient to the router


# ------------------------------------------------------------------ vs HF modules

def t(a):
    return torch.from_numpy(np.asarray(a, np.float32).copy())


@pytest.mark.parametrize("norm_topk_prob,E,k", [(True, 8, 2), (False, 8, 2), (False, 4, 1), (True, 16, 4)])
def test_qwen3_moe_block_matches_hf(norm_topk_prob, E, k):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    I = 12
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=norm_topk_prob, hidden_act="silu")
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    rng = np.random.default_rng(E * 7 + k + norm_topk_prob)
    router = rng.normal(0, 0.5, (E, D))  # HF [E, D]
    gate_up = rng.normal(0, D ** -0.5 * 1.5, (E, 2 * I, D))  # [E, 2I, D], [out, in], gate rows first
    down = rng.normal(0, I ** -0.5 * 1.5, (E, D, I))  # [E, D, I], [out, in]
    with torch.no_grad():
        block.gate.weight.copy_(t(router))
        block.experts.gate_up_proj.copy_(t(gate_up))
        block.experts.down_proj.copy_(t(down))
    x = rng.normal(0, 1, (2, 7, D)).astype(np.float32)
    with torch.no_grad():
        want = block(t(x)).numpy()

    spec = spec_of(E, k, "softmax_topk", norm_topk_prob, I=I)
    p = {"router": router.T, "w_gate": gate_up[:, :I].transpose(0, 2, 1), "w_up": gate_up[:, I:].transpose(0, 2, 1),
         "w_down": down.transpose(0, 2, 1)}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    assert {k_: v.shape for k_, v in p.items()} == _mlp_shapes(D, spec)
    for y in run(spec, p, jnp.asarray(x))[1:]:
        np.testing.assert_allclose(np.asarray(y), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("E,k", [(4, 2), (8, 4)])
def test_gpt_oss_mlp_matches_hf(E, k):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    I, limit = 8, 2.0
    cfg = GptOssConfig(hidden_size=D, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k,
                       swiglu_limit=limit)
    mlp = GptOssMLP(cfg).eval()
    rng = np.random.default_rng(E * 3 + k)
    router_w, router_b = rng.normal(0, 0.5, (E, D)), rng.normal(0, 1.0, (E,))
    gate_up, gate_up_b = rng.normal(0, 0.5, (E, D, 2 * I)), rng.normal(0, 0.5, (E, 2 * I))  # [in, out], interleaved
    down, down_b = rng.normal(0, 0.5, (E, I, D)), rng.normal(0, 0.5, (E, D))
    with torch.no_grad():
        mlp.router.weight.copy_(t(router_w))
        mlp.router.bias.copy_(t(router_b))
        mlp.experts.gate_up_proj.copy_(t(gate_up))
        mlp.experts.gate_up_proj_bias.copy_(t(gate_up_b))
        mlp.experts.down_proj.copy_(t(down))
        mlp.experts.down_proj_bias.copy_(t(down_b))
    x = rng.normal(0, 1, (3, 5, D)).astype(np.float32)
    with torch.no_grad():
        out = mlp(t(x))
    want = (out[0] if isinstance(out, tuple) else out).numpy()

    gu = np.einsum("nd,edf->enf", x.reshape(-1, D), gate_up) + gate_up_b[:, None]  # the clamps fire both ways
    assert (gu[..., ::2] > limit).any() and (gu[..., 1::2] > limit).any() and (gu[..., 1::2] < -limit).any()

    spec = spec_of(E, k, "topk_softmax", router_bias=True, bias=True, activation="swiglu_clamp", I=I,
                   clamp_limit=limit)
    p = {"router": router_w.T, "router_bias": router_b,
         "w_gate": gate_up[..., ::2], "w_up": gate_up[..., 1::2], "w_down": down,
         "b_gate": gate_up_b[:, ::2], "b_up": gate_up_b[:, 1::2], "b_down": down_b}
    p = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p)
    assert {k_: v.shape for k_, v in p.items()} == _mlp_shapes(D, spec)
    for y in run(spec, p, jnp.asarray(x))[1:]:
        np.testing.assert_allclose(np.asarray(y), want, atol=ATOL, rtol=0)
