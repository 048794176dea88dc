"""jaxmodels.interpret: the layer-by-layer trace runs the same model as jm.forward (equal logits and final stream for
every block kind), and what it records equals transformers' own intermediates (hidden states, eager attention
probabilities, router logits); mHC mixes are doubly stochastic and indexer selections are top-k of the visible
entries."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxmodels as jm
from jaxmodels import families, interpret, model as M
from jaxmodels.families import deepseek_v4
from tests.parity import hf_reference as ref
from tests.parity.test_deepseek_v4 import V4_TINY

# one family per block kind beside those checked against transformers below (gemma3: sandwich + sliding, gpt_oss:
# sinks + MoE, qwen3_moe: MoE + dense layers): pre (llama), parallel (cohere), post (exaone4), mHC + MLA + hash
# routing (deepseek_v4)
FAMILIES = ["llama", "cohere", "exaone4", "deepseek_v4"]
# DeepSeek V4 at three layers: a window layer, a compressed one (ratio 4, with an indexer), a window one
DEEPSEEK = {**V4_TINY, "model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 0]}
T = {"deepseek_v4": 40}  # 10 compressed entries: more than the indexer's top-k (8) once enough are visible


def _model(name) -> jm.Model:
    cfg = deepseek_v4.config(DEEPSEEK) if name == "deepseek_v4" else families.config_from_hf(ref.tiny_config(name))
    return jm.Model(cfg, M.init_params(cfg, seed=3, std=0.05))


def _ids(cfg, batch=2, t=12):
    return np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, t)).astype(np.int32)


@pytest.fixture(scope="module")
def traced():
    """name -> (model, ids, its trace), each traced once per module."""
    done = {}

    def get(name):
        if name not in done:
            model = _model(name)
            ids = _ids(model.config, t=T.get(name, 12))
            done[name] = model, ids, interpret.trace(model, ids)
        return done[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_trace_runs_the_model_of_forward(name, traced):
    """The logits equal the executor's and the last residual its final stream (mHC: its n streams)."""
    model, ids, tr = traced(name)
    cfg = model.config

    @jax.jit
    def executor(params, ids):
        pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        x, _, aux = M.hidden(params, cfg, ids, pos, "full", collect=True)
        return M.head(params, cfg, x), aux["stream"] if cfg.mhc is not None else x

    logits, stream = executor(model.params, ids)
    np.testing.assert_allclose(np.asarray(tr.logits), np.asarray(logits), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tr.residual[-1]), np.asarray(stream), rtol=0, atol=1e-5)
    assert len(tr.residual) == cfg.num_layers + 1


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss", "qwen3_moe"])
def hf_pair(request, tmp_path_factory):
    """(name, transformers model, our load of its checkpoint, its outputs with every intermediate, token ids)."""
    hf = ref.build(ref.tiny_config(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ids = _ids(jm.load(path).config, t=16)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), output_hidden_states=True, output_attentions=True,
                 output_router_logits=request.param != "gemma3")
    return request.param, hf, jm.load(path), out, ids


def test_residuals_and_attention_equal_transformers(hf_pair):
    """Each layer's input equals HF's hidden_states[i] (its last entry is after the final norm, so not compared),
    and each layer's probabilities equal HF eager attention's: causal, windowed on sliding layers, with sinks."""
    name, hf, model, out, ids = hf_pair
    tr = interpret.trace(model, ids)
    L = model.config.num_layers
    assert len(out.hidden_states) == L + 1 and len(out.attentions) == L
    for i in range(L):
        np.testing.assert_allclose(np.asarray(tr.residual[i]), out.hidden_states[i].numpy(), rtol=0, atol=1e-4)
        np.testing.assert_allclose(np.asarray(tr.attention[i]), out.attentions[i].numpy(), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(tr.logits), out.logits.numpy(), rtol=0, atol=1e-4)
    for i, spec in enumerate(model.config.layers):
        probs = np.asarray(tr.attention[i])
        if spec.attention.window is not None:  # keys at least `window` positions back are masked
            assert np.all(probs[..., np.tril(np.ones((16, 16), bool), -spec.attention.window)] == 0)
        if spec.attention.sinks:  # the sinks take part of the mass
            assert probs.sum(-1).max() < 1 - 1e-3
        else:
            np.testing.assert_allclose(probs.sum(-1), 1, atol=1e-5)


def test_router_choices_equal_transformers(hf_pair):
    """The experts each token is sent to are the top-k of HF's router logits, with softmax-over-the-k weights
    (GPT-OSS's top-k -> softmax and Qwen3-MoE's softmax -> top-k -> renormalise are both that)."""
    name, hf, model, out, ids = hf_pair
    if name == "gemma3":
        pytest.skip("no router")
    tr = interpret.trace(model, ids, attention=False)
    assert tr.attention == {}
    moe_layers = [i for i, s in enumerate(model.config.layers) if s.mlp.kind == "moe"]
    assert sorted(tr.routing) == moe_layers and len(out.router_logits) == len(moe_layers)
    for i, logits in zip(moe_layers, out.router_logits):
        w, experts = (np.asarray(a) for a in tr.routing[i])
        k = experts.shape[-1]
        top = torch.topk(logits, k, dim=-1)
        assert np.array_equal(np.sort(experts.reshape(-1, k), -1), np.sort(top.indices.numpy(), -1))
        want = torch.softmax(top.values, -1).numpy()
        order = np.argsort(experts.reshape(-1, k), -1)
        got = np.take_along_axis(w.reshape(-1, k), order, -1)
        want = np.take_along_axis(want, np.argsort(top.indices.numpy(), -1), -1)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_deepseek_mixes_and_indexer_selections(traced):
    """mHC: pre > 0, 0 < post < 2, comb doubly stochastic (Sinkhorn) at both sites of every layer; the compressed
    layer attends exactly min(top-k, visible) of its entries, all visible."""
    model, ids, tr = traced("deepseek_v4")
    cfg = model.config
    assert sorted(tr.mhc) == [0, 1, 2] and tr.attention == {}  # MLA layers have no GQA probabilities
    for i, sites in tr.mhc.items():
        for site in ("attn", "mlp"):
            mix = sites[site]
            n = cfg.mhc.copies
            assert mix.pre.shape == mix.post.shape == (2, 40, n) and mix.comb.shape == (2, 40, n, n)
            assert np.all(np.asarray(mix.pre) > 0) and np.all((np.asarray(mix.post) > 0) & (np.asarray(mix.post) < 2))
            np.testing.assert_allclose(np.asarray(mix.comb).sum(-2), 1, atol=1e-4)  # into each stream
            np.testing.assert_allclose(np.asarray(mix.comb).sum(-1), 1, atol=1e-3)  # out of each stream
    assert sorted(tr.selected) == [1]
    m = cfg.layers[1].attention.mla
    sel = np.asarray(tr.selected[1])
    visible = np.arange(10)[None, :] < ((np.arange(40) + 1) // m.ratio)[:, None]  # [T, N]
    assert sel.shape == (2, 40, 10) and not np.any(sel & ~visible)
    np.testing.assert_array_equal(sel.sum(-1), np.broadcast_to(np.minimum(m.index_topk, visible.sum(-1)), (2, 40)))
    assert visible.sum(-1).max() > m.index_topk  # the top-k did choose
    with pytest.raises(NotImplementedError, match="mHC"):
        interpret.logit_lens(model, tr)


def test_logit_lens(traced):
    """The lens of the last residual is the model's logits; of any layer, the head on that residual; layers= picks."""
    model, ids, tr = traced("llama")
    lens = interpret.logit_lens(model, tr)
    assert lens.shape == (model.config.num_layers + 1, *ids.shape, model.config.vocab_size)
    np.testing.assert_array_equal(np.asarray(lens[-1]), np.asarray(tr.logits))
    one = interpret.logit_lens(model, tr, layers=[1])
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(M.head(model.params, model.config, tr.residual[1])),
                               atol=1e-6)
    assert not np.allclose(np.asarray(lens[0]), np.asarray(lens[-1]), atol=1e-3)


def test_bad_inputs_are_named():
    model = _model("llama")
    ids = _ids(model.config)
    with pytest.raises(ValueError, match=r"attention layers \[7\]"):
        interpret.trace(model, ids, attention=[0, 7])
    with pytest.raises(ValueError, match="batch, time"):
        interpret.trace(model, ids[0])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        interpret.trace(model, ids + 256)
