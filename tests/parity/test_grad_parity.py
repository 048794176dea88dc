"""Gradient parity with torch autograd through HF transformers (fp32 eager), every dense/hybrid/MoE family.

The mean next-token cross-entropy of a tiny random model; our gradient w.r.t. every parameter is mapped to HF's
checkpoint names by the export path (converters.hf_export: the inverse of the import's name map and transforms,
all linear, so they carry gradients as they carry weights), HF's by transformers' own save-time conversion of
its in-memory layout (revert_weight_conversion: fused MoE experts back to per-expert tensors). Every HF
parameter must be matched, and each tensor must agree to max |g_ours - g_hf| <= 1e-4 * max |g_hf|.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

import converters
from converters import hf_export
from jaxmodels import model as M, train
from tests.parity import hf_reference as ref

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "cohere", "gemma3", "gpt_oss", "exaone4", "qwen3_moe"]
RTOL = 1e-4  # per tensor, relative to its largest HF gradient


def _ids(cfg, batch=2, t=16):
    """Tokens past every window of 6. Without the pad id: HF's nn.Embedding(padding_idx) gives the pad row no
    gradient from its lookups (a training convention of HF's, not part of the model's function)."""
    low = 0 if cfg.pad_token_id is None else cfg.pad_token_id + 1
    return np.random.default_rng(0).integers(low, cfg.vocab_size, (batch, t)).astype(np.int32)


def _hf_grads(hf, ids) -> dict[str, np.ndarray]:
    hf.zero_grad()
    tokens = torch.as_tensor(ids, dtype=torch.long)
    hf(input_ids=tokens, labels=tokens).loss.backward()  # HF's causal LM loss: mean over the T-1 next tokens
    grads = revert_weight_conversion(hf, {n: p.grad for n, p in hf.named_parameters()})
    return {n: g.detach().numpy() for n, g in grads.items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_match_hf_autograd(name, tmp_path):
    hf = ref.build(ref.tiny_config(name))
    hf.save_pretrained(tmp_path / "hf")
    cfg, params, _ = converters.read_source(tmp_path / "hf", "float32", progress=False)
    params = jax.tree.map(jnp.asarray, params)
    ids = _ids(cfg)
    trained, frozen = train.partition(params)

    def loss(p):
        return train.next_token_loss(M.forward(train.combine(p, frozen), cfg, jnp.asarray(ids)), ids)[0]

    ours = jax.tree.map(np.asarray, train.combine(jax.jit(jax.grad(loss))(trained), frozen))
    want = _hf_grads(hf, ids)
    tensors = hf_export.plan_export(cfg, ours)
    assert {t.name for t in tensors} == set(want)  # every HF parameter, nothing else
    errors = {}
    for t in tensors:
        got, g = hf_export.tensor_value(t, ours), want[t.name]
        assert np.abs(g).max() > 0, f"{t.name}: HF's gradient is zero, the comparison would mean nothing"
        errors[t.name] = np.abs(got - g).max() / np.abs(g).max()
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= RTOL}
    assert not bad, f"{name}: relative gradient error above {RTOL}: {bad}"
