"""Many experts (`moe._windows`: one loop step per window of an expert's sorted rows) against the paths it
replaces: `moe.dense` (every expert on every token) and the float64 NumPy block of test_moe, over routers, biases,
shared experts, empty and hot experts, windows that split a group, experts kept quantized (FP4 and FP8, against
the dense block on their dequantised weights), a layer read in place from every layer's stack, expert parallelism
and gradients. Cases with few experts force the loop by lowering `WINDOWED_EXPERTS` (each case jits afresh)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels.layers import moe, qdq
from tests.test_gathered_quantized import fp4_experts, fp8_experts
from tests.test_moe import ATOL, FAST, forced, make_params, make_x, np_moe, spec_of


def sparse_dense(spec, p, x, **kw):
    f = jax.jit(lambda p, x: (moe.sparse(spec, p, x, **kw), moe.dense(spec, p, x)), compiler_options=FAST)
    return [np.asarray(a) for a in f(p, x)]


@pytest.fixture
def windowed(monkeypatch):
    monkeypatch.setattr(moe, "WINDOWED_EXPERTS", 0)


def loop_runs(monkeypatch):
    calls = []
    inner = moe._windows
    monkeypatch.setattr(moe, "_windows", lambda *a: calls.append(1) or inner(*a))
    return calls


# (E, k, router, renorm, router bias, expert bias, activation, shared, tokens); tokens * k > E (fewer assignments
# take the gathered path)
CASES = [
    (8, 2, "softmax_topk", True, False, False, "silu", 0, 13),
    (4, 4, "topk_softmax", False, True, True, "swiglu_clamp", 0, 33),   # every expert has all 33 tokens
    (16, 1, "softmax_topk", False, True, False, "silu", 8, 17),          # some experts empty
    (8, 2, "topk_softmax", False, False, True, "swiglu_clamp", 8, 5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c[0]}k{c[1]}-{c[2]}-n{c[8]}")
def test_windows_equal_dense_and_numpy(windowed, monkeypatch, case):
    E, k, router, rn, rb, b, act, shared, n = case
    spec = spec_of(E, k, router, rn, router_bias=rb, bias=b, activation=act, shared=shared, clamp_limit=1.0)
    p, x = make_params(spec, E + n), make_x(n, E + n + 1)
    calls = loop_runs(monkeypatch)
    ys, yd = sparse_dense(spec, p, x)
    assert calls
    np.testing.assert_allclose(ys, yd, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ys, np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


def test_windows_split_a_hot_group_and_skip_empty_ones(windowed):
    """Every token on experts 2 and 6 (37 rows each: windows of 16 split them, the last one partial), the six
    others empty, first and last included."""
    spec = spec_of(8, 2, "softmax_topk", True, router_bias=True, bias=True)
    p, x = forced(spec, [40.0 if e in (2, 6) else 0.0 for e in range(8)], seed=3, n=37)
    ys, yd = sparse_dense(spec, p, x)
    np.testing.assert_allclose(ys, yd, atol=ATOL, rtol=0)
    np.testing.assert_allclose(ys, np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


def test_many_experts_take_the_windows_by_default(monkeypatch):
    """More experts than the grouped kernels take (64 here): the loop, without patching the threshold."""
    spec = spec_of(64, 4, "softmax_topk", True, shared=8)
    p, x = make_params(spec, 5), make_x(40, 6)
    calls = loop_runs(monkeypatch)
    ys, yd = sparse_dense(spec, p, x)
    assert calls and 64 > moe.WINDOWED_EXPERTS
    np.testing.assert_allclose(ys, yd, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_quantized_experts_decoded_one_at_a_time(windowed, fmt):
    """Experts kept quantized ([E, out, in] bytes + scales): each step decodes its expert; equal to the dense
    block over the dequantised experts."""
    E, D, I = 6, 64, 32
    spec = spec_of(E, 2, "softmax_topk", True, I=I)
    p = make_params(spec, 8, d=D)
    rng = np.random.default_rng(9)
    make = fp4_experts if fmt == "fp4" else functools.partial(fp8_experts, block=32)
    q = {"w_gate": make(rng, E, I, D), "w_up": make(rng, E, I, D), "w_down": make(rng, E, D, I)}
    x = make_x(21, 10, d=D)
    ys = jax.jit(lambda q, x: moe.sparse(spec, p | q, x), compiler_options=FAST)(q, x)
    expanded = p | {k: jnp.swapaxes(qdq.dequant(v, jnp.float32), -1, -2) for k, v in q.items()}
    yd = moe.dense(spec, expanded, x)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(yd), atol=ATOL * np.abs(np.asarray(yd)).max(), rtol=0)


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
def test_quantized_experts_read_from_the_stack(windowed, fmt):
    """Kept quantized and given every layer's stack ([L, E, ...] bytes and scales), the loop decodes this layer's
    experts from it: equal to the same layer's own quantized experts."""
    E, D, I = 6, 64, 32
    spec = spec_of(E, 2, "softmax_topk", True, I=I)
    p = make_params(spec, 21, d=D)
    rng = np.random.default_rng(22)
    make = fp4_experts if fmt == "fp4" else functools.partial(fp8_experts, block=32)
    layers = [{"w_gate": make(rng, E, I, D), "w_up": make(rng, E, I, D), "w_down": make(rng, E, D, I)}
              for _ in range(3)]
    stack = (jax.tree.map(lambda *a: jnp.stack(a), *layers), jnp.int32(2))
    x = make_x(19, 23, d=D)
    f = jax.jit(lambda q, x, s: moe.sparse(spec, p | q, x, stack=s), compiler_options=FAST)
    got = f(layers[0], x, stack)  # p holds layer 0's experts: the stack's layer 2 must be read instead
    want = f(layers[2], x, None)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(want) - np.asarray(f(layers[0], x, None))).max() > 1e-3


def test_tensor_parallel_windows():
    """Experts' widths split over `tensor` of a data=2 x tensor=4 mesh (as the "tp" rules place them), 40 experts
    through the loop, partitioned by XLA: equal to dense on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxmodels import sharding

    spec = spec_of(40, 2, "softmax_topk", True, bias=True, shared=8, I=32)
    p, x = make_params(spec, 24), make_x(37, 25)
    mesh = sharding.make_mesh("data=2,tensor=4")
    split = {"w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"), "w_down": P(None, "tensor", None)}
    placed = {k: jax.device_put(v, NamedSharding(mesh, split[k])) if k in split else v for k, v in p.items()}
    assert len(placed["w_gate"].sharding.device_set) == 8
    ys = jax.jit(lambda p, x: moe.sparse(spec, p, x, shard=sharding.Sharding.of(mesh, "tp")),
                 compiler_options=FAST)(placed, x)
    np.testing.assert_allclose(np.asarray(ys), np.asarray(moe.dense(spec, p, x)), atol=ATOL, rtol=0)


def test_a_layer_read_in_place_from_the_stack(windowed):
    """Given every layer's stack and this layer's rank, the loop reads the experts there, not p's."""
    spec = spec_of(8, 2, "topk_softmax", router_bias=True, bias=True, activation="swiglu_clamp", clamp_limit=1.0)
    p, x = make_params(spec, 12), make_x(19, 13)
    stack = ({k: jnp.stack([v * 7 + 1, v, -v]) for k, v in p.items() if k in moe.EXPERT_PARAMS}, jnp.int32(1))
    decoy = p | {k: jnp.zeros_like(p[k]) for k in ("w_gate", "w_up", "w_down")}  # what p holds is not read
    ys = jax.jit(lambda p, x, s: moe.sparse(spec, p, x, stack=s), compiler_options=FAST)(decoy, x, stack)
    np.testing.assert_allclose(np.asarray(ys), np_moe(spec, p, x), atol=ATOL, rtol=ATOL)


def test_expert_parallel_windows(windowed):
    """Under expert parallelism each device loops over its own experts; other devices' rows add nothing."""
    from jaxmodels import sharding

    spec = spec_of(8, 2, "softmax_topk", True, router_bias=True, bias=True, shared=8)
    p, x = make_params(spec, 14), make_x(23, 15)
    shard = sharding.Sharding.of(sharding.make_mesh("data=2,expert=4"), "ep")
    ys, yd = sparse_dense(spec, p, x, shard=shard)
    np.testing.assert_allclose(ys, yd, atol=ATOL, rtol=0)


def test_gradients_through_the_windows(windowed):
    spec = spec_of(8, 2, "topk_softmax", router_bias=True, bias=True, activation="swiglu_clamp", clamp_limit=1.0)
    p, x = make_params(spec, 16), make_x(17, 17)
    r = make_x(17, 18)

    @functools.partial(jax.jit, compiler_options=FAST)
    def grads(p, x):
        return [jax.grad(lambda p, x: jnp.sum(f(spec, p, x) * r), argnums=(0, 1))(p, x)
                for f in (moe.sparse, moe.dense)]

    gs, gd = grads(p, x)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(gs), jax.tree.leaves(gd)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, atol=ATOL * max(np.abs(b).max(), 1.0), rtol=0,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("rows,experts,want", [(1, 8, 16), (3072, 384, 16), (12288, 384, 32), (65, 2, 64),
                                               (100000, 8, 256)])
def test_window_sizes(rows, experts, want):
    assert moe._window(rows, experts) == want


@pytest.mark.parametrize("sizes", [[0, 5, 0, 40, 1, 0], [17, 0, 0, 0, 0, 16], [0, 0, 0, 0, 0, 0]])
def test_windows_equal_ragged_dot_and_leave_rows_past_the_groups_zero(sizes):
    """`_windows` alone against the grouped matmuls it replaces (`lax.ragged_dot`), 70 rows of which the groups
    cover fewer: the rest come out exactly zero (other devices' rows under expert parallelism)."""
    spec = spec_of(6, 2, activation="swiglu_clamp", clamp_limit=1.0)
    p, x = make_params(spec, 19), make_x(70, 20)
    sizes = jnp.asarray(sizes, jnp.int32)
    e = jnp.minimum(jnp.repeat(jnp.arange(6), sizes, total_repeat_length=70), 5)
    got = np.asarray(jax.jit(lambda p, x, s: moe._windows(spec, p, x, s), compiler_options=FAST)(p, x, sizes))
    want = np.asarray(moe._expert_out(spec, p, x, e, ragged=sizes))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    assert not got[int(sizes.sum()):].any()
