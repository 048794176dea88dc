"""Training: the masked next-token loss against numpy, resume bit-exact through orbax, bf16 compute over fp32
master weights, accumulation equal to one big batch, per-layer remat (same gradients, less memory), and a
sharded step equal to the unsharded one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import families, model as M, sharding, train
from tests.parity import hf_reference as ref

T = 16


def _setup(name="llama", **over):
    cfg = families.config_from_hf({**ref.tiny_config(name), **over})
    return cfg, M.init_params(cfg, seed=1, std=0.05)


def _batch(i, rows=4):
    """Right-padded rows with a prompt each: the loss counts the completion tokens only."""
    tokens = np.random.default_rng(i).integers(0, 256, (rows, T)).astype(np.int32)
    lengths, prompts = np.array([16, 12, 10, 16])[:rows], np.array([3, 4, 5, 1])[:rows]
    return {"tokens": tokens, "mask": train.loss_mask(lengths, prompts, T)}


def _same(a, b) -> bool:
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_masked_loss_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 7, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (3, 7)).astype(np.int32)
    mask = np.asarray(train.loss_mask([7, 5, 2], [2, 1, 0], 7))
    assert mask.tolist()[1] == [0, 1, 1, 1, 1, 0, 0]  # prompt token 0 and padding 5.. excluded
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    terms = [-logp[b, t - 1, tokens[b, t]] for b in range(3) for t in range(1, 7) if mask[b, t]]
    loss, n = train.next_token_loss(jnp.asarray(logits), jnp.asarray(tokens), mask)
    assert n == len(terms) and np.isclose(loss, np.mean(terms), rtol=1e-6)
    # logits that only predict excluded tokens do not matter
    moved = logits.copy()
    moved[1, 4:] += 100 * rng.normal(size=moved[1, 4:].shape)  # predict positions 5, 6: padding
    moved[0, 0] += 100  # predicts position 1: prompt
    assert train.next_token_loss(jnp.asarray(moved), jnp.asarray(tokens), mask)[0] == loss
    assert train.next_token_loss(jnp.asarray(logits), jnp.asarray(tokens), np.zeros((3, 7)))[0] == 0


def test_resume_is_bit_exact(tmp_path):
    """4 micro-steps (bf16 compute, clipping, warmup + cosine, accumulation over 2) in one go equal 2 + save +
    restore into a fresh state + 2, bit for bit: params, both Adam moments, the accumulator and the counters."""
    cfg, params = _setup()
    tc = train.TrainConfig(learning_rate=1e-2, warmup_steps=1, total_steps=4, accumulate=2, weight_decay=0.1,
                           clip_norm=0.5)
    trained, frozen = train.partition(params)
    step = train.make_step(cfg, tc)
    state = train.init(trained, tc)
    for i in range(4):
        state, _ = step(state, _batch(i), frozen)
    half = train.init(trained, tc)
    for i in range(2):
        half, _ = step(half, _batch(i), frozen)
    train.save(tmp_path / "ckpt", half)
    resumed = train.restore(tmp_path / "ckpt", train.init(trained, tc))
    for i in range(2, 4):
        resumed, _ = step(resumed, _batch(i), frozen)
    assert _same(resumed, state) and int(resumed.step) == 4
    assert not np.allclose(state.params["embed"], trained["embed"])  # it trained


def test_bf16_compute_over_fp32_master_weights():
    """The step's loss is the loss of the bf16-cast model (not of the fp32 one), while the params and AdamW's
    moments stay fp32."""
    cfg, params = _setup()
    trained, frozen = train.partition(params)
    batch = _batch(0)
    state = train.init(jax.tree.map(lambda a: a.astype(jnp.bfloat16), trained), train.TrainConfig())
    assert {a.dtype for a in jax.tree.leaves(state)} == {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}
    state, metrics = train.make_step(cfg, train.TrainConfig())(state, batch, frozen)
    assert {a.dtype for a in jax.tree.leaves(state.opt_state) if a.ndim} == {jnp.dtype(jnp.float32)}

    def loss(p):
        return train.next_token_loss(M.forward(p, cfg, jnp.asarray(batch["tokens"])), batch["tokens"], batch["mask"])[0]

    bf16, fp32 = float(jax.jit(loss)(M.cast(cfg, params, jnp.bfloat16))), float(jax.jit(loss)(params))
    assert abs(float(metrics["loss"]) - bf16) < 1e-5 and abs(bf16 - fp32) > 1e-4, (float(metrics["loss"]), bf16, fp32)


def test_accumulation_equals_one_big_batch():
    """Two micro-batches of equal target counts accumulated = one step on both together (mean of the means)."""
    cfg, params = _setup()
    trained, frozen = train.partition(params)
    a, b = _batch(0), _batch(1)
    assert float(a["mask"].sum()) == float(b["mask"].sum())
    both = {k: np.concatenate([a[k], b[k]]) for k in a}
    # eps 1: AdamW's first update ~ lr * g, linear in the gradient (at eps 1e-8 it is lr * sign(g), which
    # turns fp32 summation-order noise in near-zero gradients into full-size differences)
    common = dict(learning_rate=1e-2, total_steps=3, compute_dtype=None, clip_norm=None, eps=1.0)
    acc = train.TrainConfig(accumulate=2, **common)
    s = train.init(trained, acc)
    step = train.make_step(cfg, acc)
    s, _ = step(s, a, frozen)
    assert _same(s.params, train.init(trained, acc).params)  # no update before the last micro-batch
    s, _ = step(s, b, frozen)
    one = train.TrainConfig(accumulate=1, **common)
    big, _ = train.make_step(cfg, one)(train.init(trained, one), both, frozen)
    diff = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(s.params), jax.tree.leaves(big.params)))
    moved = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(big.params), jax.tree.leaves(trained)))
    assert diff < 1e-4 * moved, (diff, moved)


def test_remat_same_gradients_less_memory():
    """jax.checkpoint on each scanned layer: gradients unchanged, the compiled backward's buffers smaller."""
    cfg, params = _setup(num_hidden_layers=6)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 64)), jnp.int32)

    def loss(forward):
        return lambda p: train.next_token_loss(forward(p, tokens), tokens)[0]

    def plain(p, t):
        return M.forward(p, cfg, t)

    remat = train.remat_layers(plain, "nothing")
    compiled = [jax.jit(jax.grad(loss(f))).lower(params).compile() for f in (plain, remat)]
    g0, g1 = (c(params) for c in compiled)
    assert all(np.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)))
    mem = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    assert mem[1] < 0.7 * mem[0], mem


def test_sharded_step_equals_unsharded():
    """fsdp x tensor on 8 devices: the state keeps the rules' placement, and 2 steps give the unsharded params."""
    cfg, params = _setup()
    trained, frozen = train.partition(params)
    tc = train.TrainConfig(learning_rate=1e-2, total_steps=2, compute_dtype=None, eps=1.0)  # eps: see above
    want = train.init(trained, tc)
    step = train.make_step(cfg, tc)
    for i in range(2):
        want, _ = step(want, _batch(i), frozen)
    mesh = sharding.make_mesh("fsdp=2,tensor=4")
    got = train.init(trained, tc, cfg, mesh, "fsdp_tp")
    step = train.make_step(cfg, tc, mesh, "fsdp_tp")
    for i in range(2):
        got, _ = step(got, _batch(i), frozen)
    rules = sharding.param_specs(cfg, mesh, "fsdp_tp")["layers"]["0"]["attn"]["wq"]
    assert rules == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    placed = jax.sharding.NamedSharding(sharding.auto_axes(mesh), rules)
    assert got.params["layers"]["0"]["attn"]["wq"].sharding.is_equivalent_to(placed, 4)
    mu = got.opt_state[1][0].mu["layers"]["0"]["attn"]["wq"]  # chain(clip, adamw): adamw's ScaleByAdamState
    assert mu.sharding.is_equivalent_to(placed, 4)
    for x, y in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_bad_train_configs_are_refused():
    with pytest.raises(ValueError, match="accumulate"):
        train.TrainConfig(accumulate=0)
    with pytest.raises(ValueError, match="warmup_steps"):
        train.TrainConfig(warmup_steps=10, total_steps=5)
    with pytest.raises(ValueError, match="remat"):
        train.TrainConfig(remat="some")
    with pytest.raises(ValueError, match="cfg"):
        train.init({}, train.TrainConfig(), mesh=sharding.make_mesh("data=8"))
    lr = train.schedule(train.TrainConfig(learning_rate=1.0, warmup_steps=4, total_steps=10, end_learning_rate=0.1))
    assert float(lr(0)) == 0 and float(lr(4)) == 1.0 and np.isclose(float(lr(10)), 0.1)
