"""Gradient parity with torch autograd through HF transformers (fp32 eager), every dense/hybrid/MoE family.

The mean next-token cross-entropy of a tiny random model; our gradient w.r.t. every parameter is mapped to HF's
checkpoint names by the export path (converters.hf_export: the inverse of the import's name map and transforms,
all linear, so they carry gradients as they carry weights), HF's by transformers' own save-time conversion of
its in-memory layout (revert_weight_conversion: fused MoE experts back to per-expert tensors). Every tensor HF
saves must be matched, and each must agree to max |g_ours - g_hf| <= 1e-4 * max |g_hf|.

DeepSeek V4 (transformers' DeepseekV4ForCausalLM) has tensors without a gradient by construction, each checked,
none skipped:
- the indexer of each CSA layer, `attn.indexer.{wq_b, weights_proj}` and its own compressor's
  `attn.indexer.compressor.{wkv, wgate, norm, ape}`: their only output is the top-k selection of compressed
  entries (integer indices). HF's autograd leaves them without a gradient (None), ours gives exactly 0; both are
  asserted, and the set of such tensors must be exactly these.
- HF's buffers, saved but not parameters: the routers' selection biases `ffn.gate.bias` (they only pick the
  experts; ours must be exactly 0) and the hash layer's `ffn.gate.tid2eid` (an integer table, not
  differentiated on either side).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.core_model_loading import revert_weight_conversion

import converters
from converters import hf_export
from jaxmodels import model as M, train
from tests.parity import hf_deepseek_v4, hf_reference as ref

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "cohere", "cohere2", "gemma3", "gpt_oss", "exaone4", "qwen3_moe"]
RTOL = 1e-4  # per tensor, relative to its largest HF gradient
V4_NO_GRAD = re.compile(r"model\.layers\.\d+\.attn\.indexer\.(wq_b\.weight|weights_proj\.weight|"
                        r"compressor\.(wkv\.weight|wgate\.weight|norm\.weight|ape))")
V4_BUFFERS = re.compile(r"model\.layers\.\d+\.ffn\.gate\.(bias|tid2eid)")


def _ids(cfg, batch=2, t=16):
    """Tokens past every window of 6. Without the pad id: HF's nn.Embedding(padding_idx) gives the pad row no
    gradient from its lookups (a training convention of HF's, not part of the model's function)."""
    low = 0 if cfg.pad_token_id is None else cfg.pad_token_id + 1
    return np.random.default_rng(0).integers(low, cfg.vocab_size, (batch, t)).astype(np.int32)


def _hf_grads(hf, ids) -> tuple[dict[str, np.ndarray], set[str]]:
    """(HF's gradients by saved tensor name, the saved tensors that are not parameters). A parameter autograd
    leaves without a gradient (None) comes back all NaN: the save-time conversion carries it as any value."""
    hf.zero_grad()
    tokens = torch.as_tensor(ids, dtype=torch.long)
    hf(input_ids=tokens, labels=tokens).loss.backward()  # HF's causal LM loss: mean over the T-1 next tokens
    grads = revert_weight_conversion(hf, {n: torch.full_like(p, torch.nan) if p.grad is None else p.grad
                                          for n, p in hf.named_parameters()})
    state = hf.state_dict()  # its buffers: the persistent ones (saved)
    buffers = revert_weight_conversion(hf, {n: state[n] for n, _ in hf.named_buffers() if n in state})
    return {n: g.detach().numpy() for n, g in grads.items()}, set(buffers)


def _check(name, hf, path, ids, no_grad=None, buffers=None):
    """Our gradients == HF's; no_grad / buffers: regexes of the tensors HF gives no gradient / saves as buffers."""
    hf.save_pretrained(path)
    cfg, params, _ = converters.read_source(path, "float32", progress=False)
    params = jax.tree.map(jnp.asarray, params)
    trained, frozen = train.partition(params)

    def loss(p):
        return train.next_token_loss(M.forward(train.combine(p, frozen), cfg, jnp.asarray(ids)), ids)[0]

    with jax.default_matmul_precision("highest"):
        ours = jax.tree.map(np.asarray, train.combine(jax.jit(jax.grad(loss))(trained), frozen))
    want, hf_buffers = _hf_grads(hf, ids)
    tensors = hf_export.plan_export(cfg, ours)
    assert {t.name for t in tensors} == set(want) | hf_buffers  # every tensor HF saves, nothing else
    assert all(buffers and buffers.fullmatch(n) for n in hf_buffers), f"unexpected HF buffers {sorted(hf_buffers)}"
    none = {n for n, g in want.items() if np.isnan(g).all()}
    assert none == {n for n in want if no_grad and no_grad.fullmatch(n)}, f"HF gives no gradient to {sorted(none)}"
    errors = {}
    for t in tensors:
        got = hf_export.tensor_value(t, ours)
        if t.name in hf_buffers and got.dtype.kind in "iu":
            continue  # an integer table: in `frozen`, not differentiated (checked above to be one of `buffers`)
        if t.name in hf_buffers or t.name in none:
            assert not np.any(got), f"{t.name}: HF has no gradient, ours is {np.abs(got).max():.1e}, not 0"
            continue
        g = want[t.name]
        assert np.abs(g).max() > 0, f"{t.name}: HF's gradient is zero, the comparison would mean nothing"
        errors[t.name] = np.abs(got - g).max() / np.abs(g).max()
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= RTOL}
    assert not bad, f"{name}: relative gradient error above {RTOL}: {bad}"
    return errors, none, hf_buffers


@pytest.mark.parametrize("name", FAMILIES)
def test_gradients_match_hf_autograd(name, tmp_path):
    hf = ref.build(ref.tiny_config(name))
    _check(name, hf, tmp_path / "hf", _ids(hf.config))


def test_deepseek_v4_gradients_match_hf_autograd(tmp_path):
    """V4_TINY at T=160: past the window of 16, an HCA entry (ratio 128) from position 127, the CSA indexer's top-k
    of 8 binding from position 35; inputs whose expert choices and top-k boundaries stay >= 1e-5 from a tie."""
    hf = hf_deepseek_v4.build()
    ids = np.random.default_rng(14).integers(0, hf.config.vocab_size, (2, 160)).astype(np.int32)
    router, indexer = hf_deepseek_v4.nearest_ties(hf, ids)
    assert min(router, indexer) >= 1e-5, f"inputs near a tie (expert choice {router:.1e}, top-k {indexer:.1e})"
    errors, none, buffers = _check("deepseek_v4", hf, tmp_path / "hf", ids, V4_NO_GRAD, V4_BUFFERS)
    assert len(none) == 12 and len(buffers) == 5  # 2 CSA layers x 6 indexer tensors; 4 biases + 1 hash table
    assert len(errors) == 190 - 12  # every other parameter compared
