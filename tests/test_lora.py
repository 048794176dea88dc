"""LoRA: merge = W + scale * A @ B by hand (dense, MoE experts, DeepSeek MLA), the merged model's logits equal
the base model plus the adapter's own term, adapter gradients follow the chain rule through W, only adapters
train."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import families, lora, model as M, plan, train
from jaxmodels.families import deepseek_v4
from jaxmodels.layers.norms import norm
from tests.parity import hf_reference as ref
from tests.parity.test_deepseek_v4 import V4_TINY

CASES = {  # family: (patterns, paths that must be adapted, with their (batch axes, in, out))
    "llama": (r"attn/w[qkvo]$|mlp/w_(gate|up|down)$|^lm_head$",
              {"layers/0/attn/wq": (1, 64, 64), "layers/0/attn/wo": (1, 64, 64), "layers/0/mlp/w_down": (1, 128, 64),
               "lm_head": (0, 64, 256)}),
    "qwen3_moe": (r"mlp/w_(gate|up|down)$", {"layers/0/mlp/w_gate": (2, 64, 32), "layers/0/mlp/w_down": (2, 32, 64),
                                               "layers/1/mlp/w_up": (1, 64, 128)}),
    "deepseek_v4": (r"attn/(wq_a|wq_b|wkv|wo_a|wo_b)$", {"layers/0/attn/wq_a": (1, 64, 32),
                                                          "layers/0/attn/wq_b": (1, 32, 256),
                                                          "layers/0/attn/wo_a": (2, 128, 32),
                                                          "layers/0/attn/wo_b": (1, 64, 64)}),
}


def _setup(name):
    if name == "deepseek_v4":
        cfg = deepseek_v4.config({**V4_TINY, "model_type": "deepseek_v4", "num_hidden_layers": 3,
                                  "compress_ratios": [0, 4, 0]})
    else:
        cfg = families.config_from_hf(ref.tiny_config(name))
    return cfg, M.init_params(cfg, seed=4, std=0.05)


def _same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _randomized(adapters, seed=0):
    """B = 0 at init makes every merge trivially the base: give B values."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), jnp.float32), adapters)


@pytest.mark.parametrize("name", CASES)
def test_merge_equals_w_plus_scaled_ab(name):
    cfg, params = _setup(name)
    patterns, expect = CASES[name]
    found = lora.targets(cfg, params, patterns)
    assert {p: found[p] for p in expect} == expect
    adapters = lora.init(cfg, params, patterns, rank=4, alpha=8)
    assert adapters.scale == 2.0 and adapters.paths == tuple(sorted(found))
    merge = jax.jit(lora.merge)
    assert _same(merge(params, adapters), params)  # B = 0: the base
    adapters = _randomized(adapters)
    merged, flat, ab = (plan.flatten(t) for t in (merge(params, adapters), params, adapters.weights))
    for p, w in flat.items():
        if p not in found:
            assert np.array_equal(merged[p], w), p
            continue
        b, n_in, n_out = found[p]
        W = np.asarray(w).reshape(-1, n_in, n_out)
        A, B = np.asarray(ab[p + "/a"]).reshape(-1, n_in, 4), np.asarray(ab[p + "/b"]).reshape(-1, 4, n_out)
        want = np.stack([W[i] + 2.0 * A[i] @ B[i] for i in range(W.shape[0])]).reshape(w.shape)
        np.testing.assert_allclose(np.asarray(merged[p]), want, rtol=1e-5, atol=1e-6, err_msg=p)


def test_merged_logits_equal_base_plus_adapter_term():
    """An adapter on lm_head: the merged model's logits = the base logits + scale * (final_norm(h) @ A) @ B,
    the LoRA forward computed in the other order; and an adapter on every projection moves the logits."""
    cfg, params = _setup("llama")
    adapters = _randomized(lora.init(cfg, params, r"^lm_head$", rank=4, alpha=4))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
    x, _, _ = M.hidden(params, cfg, tokens, jnp.broadcast_to(jnp.arange(12), tokens.shape), "full")
    h = norm(x, params["final_norm"], cfg.norm_eps, cfg.norm)
    a, b = adapters.weights["lm_head"]["a"], adapters.weights["lm_head"]["b"]
    want = M.head(params, cfg, x) + adapters.scale * (h @ a) @ b
    got = jax.jit(M.forward, static_argnums=1)(lora.merge(params, adapters), cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    every = _randomized(lora.init(cfg, params, CASES["llama"][0], rank=4))
    assert np.abs(np.asarray(M.forward(lora.merge(params, every), cfg, tokens) - got)).max() > 1e-2


def test_adapter_gradients_follow_the_chain_rule():
    """d loss / dA = scale * dW @ B^T and d loss / dB = scale * A^T @ dW, dW the gradient w.r.t. the merged weight
    (here the stacked MoE experts, [layers, experts, in, out])."""
    cfg, params = _setup("qwen3_moe")
    adapters = _randomized(lora.init(cfg, params, r"layers/0/mlp/w_up$", rank=3, alpha=6))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 10)), jnp.int32)

    def loss(p):
        return train.next_token_loss(M.forward(p, cfg, tokens), tokens)[0]

    merged = lora.merge(params, adapters)
    dW = jax.jit(jax.grad(loss))(merged)["layers"]["0"]["mlp"]["w_up"]
    g = jax.jit(jax.grad(lambda ad: loss(lora.merge(params, ad))))(adapters).weights["layers"]["0"]["mlp"]["w_up"]
    a, b = adapters.weights["layers"]["0"]["mlp"]["w_up"]["a"], adapters.weights["layers"]["0"]["mlp"]["w_up"]["b"]
    np.testing.assert_allclose(g["a"], 2.0 * dW @ jnp.swapaxes(b, -1, -2), rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(g["b"], 2.0 * jnp.swapaxes(a, -1, -2) @ dW, rtol=1e-4, atol=1e-8)


def test_only_the_adapters_train():
    """The train state holds the adapters alone (params and AdamW moments); their training lowers the loss."""
    cfg, params = _setup("llama")
    adapters = lora.init(cfg, params, r"attn/w[qv]$", rank=4, alpha=8)
    tc = train.TrainConfig(learning_rate=3e-2, total_steps=6, compute_dtype=None)
    step = train.make_step(cfg, tc, apply=lambda ad, base: lora.merge(base, ad))
    state = train.init(adapters, tc)
    assert plan.flatten(state.opt_state[1][0].mu.weights).keys() == plan.flatten(adapters.weights).keys()
    tokens = np.random.default_rng(2).integers(0, 256, (4, 16)).astype(np.int32)
    losses = []
    for _ in range(6):
        state, metrics = step(state, {"tokens": tokens}, params)
        losses.append(float(metrics["loss"]))
    assert isinstance(state.params, lora.Adapters) and state.params.paths == adapters.paths
    assert losses[-1] < losses[0] - 0.05, losses
    assert np.abs(np.asarray(state.params.weights["layers"]["0"]["attn"]["wq"]["b"])).max() > 0


def test_bad_targets_are_refused():
    cfg, params = _setup("llama")
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        lora.init(cfg, params, r"attn/wq$", rank=0)
    with pytest.raises(ValueError, match="'attn/wz' matches no parameter path"):
        lora.init(cfg, params, (r"attn/wq$", r"attn/wz"), rank=2)
    with pytest.raises(ValueError, match="is not a regex"):
        lora.init(cfg, params, r"attn/(wq", rank=2)
    with pytest.raises(ValueError, match="layers/0/attn_norm .* takes no adapter"):
        lora.init(cfg, params, r"attn_norm", rank=2)
    with pytest.raises(ValueError, match="rank 65 exceeds"):
        lora.init(cfg, params, r"attn/wk$", rank=65)
    adapters = lora.init(cfg, params, r"attn/wq$", rank=2)
    other, _ = _setup("qwen3")
    with pytest.raises(ValueError, match="do not fit"):
        lora.merge(M.init_params(other), adapters)
