"""GPT-OSS checkpoints with real MXFP4 expert encodings, in HF's layout and in OpenAI's original one,
convert to a model equal to HF's (whose experts hold transformers' own decoding of the same bytes)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import converters
import jaxmodels as jm
from jaxmodels import cli
from tests.parity import hf_reference as ref


def mxfp4_experts(hf, seed: int = 0) -> dict:
    """Set a HF GPT-OSS's expert weights to random MXFP4 codes (transformers' own decoding of them): exactly
    representable in MXFP4. -> {(layer, "gate_up_proj" | "down_proj"): (blocks, scales)}."""
    rng = np.random.default_rng(seed)
    packed = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for name in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, name)  # [E, in, out]
                E, n_in, n_out = param.shape
                blocks = torch.as_tensor(rng.integers(0, 256, (E, n_out, n_in // 32, 16), dtype=np.uint8))
                scales = torch.as_tensor(rng.integers(124, 130, (E, n_out, n_in // 32), dtype=np.uint8))
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                packed[(i, name)] = (blocks, scales)
    return packed


@pytest.fixture(scope="module")
def quantized():
    """A tiny HF GPT-OSS whose expert weights are exactly representable in MXFP4, and those bytes."""
    hf = ref.build(ref.tiny_config("gpt_oss"), seed=11)
    return hf, mxfp4_experts(hf)


def _compare(hf, dst, packed=None, **load_kw):
    """The converted model's logits equal HF's; kept quantized (`packed`: the checkpoint's bytes), its experts are
    those bytes: gate / up the even / odd output rows of gate_up_proj's, in the [E, out, in/2] layout."""
    model = jm.load(dst, **load_kw)
    if packed is not None:
        E = hf.config.num_local_experts
        for i, layer in enumerate(model.params["layers"].values()):  # the tiny config: one layer a kind
            gate_up, down = (packed[(i, n)] for n in ("gate_up_proj", "down_proj"))
            for leaf, (blocks, scales), rows in (("w_gate", gate_up, slice(0, None, 2)),
                                                 ("w_up", gate_up, slice(1, None, 2)), ("w_down", down, slice(None))):
                w = layer["mlp"][leaf]
                assert set(w) == {"fp4", "scale"} and w["fp4"].dtype == np.uint8
                codes = blocks.numpy()[:, rows].reshape(E, -1, blocks.shape[2] * 16)  # [E, out, in/2]
                np.testing.assert_array_equal(np.asarray(w["fp4"][0]), codes)
                np.testing.assert_array_equal(np.asarray(w["scale"][0]), scales.numpy()[:, rows])
    ids = np.random.default_rng(1).integers(0, 256, (2, 48)).astype(np.int32)
    want = ref.logits(hf, ids)
    got = np.asarray(jm.forward(model, ids))
    assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()


@pytest.mark.parametrize("keep", [False, True], ids=["decoded", "kept quantized"])
def test_hf_mxfp4_layout(quantized, tmp_path, keep):
    hf, packed = quantized
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for (i, name), (blocks, scales) in packed.items():
        base = f"model.layers.{i}.mlp.experts.{name}"
        del sd[base]
        sd[base + "_blocks"], sd[base + "_scales"] = blocks, scales
    src = tmp_path / "hf"
    src.mkdir()
    save_file(sd, src / "model.safetensors")
    cfg = hf.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (src / "config.json").write_text(json.dumps(cfg))
    out = converters.convert(src, tmp_path / "out", dtype="float32", progress=False, keep_quantized=keep)
    _compare(hf, out, packed if keep else None)
    info = cli.describe(out)  # `jaxmodels inspect`: the bytes stored, FP4 experts at half a byte a weight
    stored = sum(v.numel() * 4 for k, v in sd.items() if not k.endswith(("_blocks", "_scales")))
    stored += sum(b.numel() + s.numel() for b, s in packed.values()) if keep else 0
    assert info["kept_quantized"] == keep and info["bytes"] == (stored if keep else 4 * info["parameters"])
    if keep:  # imported straight from the checkpoint, as converted
        _compare(hf, src, packed, keep_quantized=True)


@pytest.mark.parametrize("keep", [False, True], ids=["decoded", "kept quantized"])
def test_openai_original_layout(quantized, tmp_path, keep):
    """`block.N.*` names, fused qkv rows [q; k; v], `X.blocks`/`X.scales`, and the original config keys."""
    hf, packed = quantized
    c = hf.config
    sd = {"embedding.weight": hf.model.embed_tokens.weight, "unembedding.weight": hf.lm_head.weight,
          "norm.scale": hf.model.norm.weight}
    for i, layer in enumerate(hf.model.layers):
        a, m, b = layer.self_attn, layer.mlp, f"block.{i}."
        sd |= {
            b + "attn.norm.scale": layer.input_layernorm.weight,
            b + "attn.qkv.weight": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            b + "attn.qkv.bias": torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]),
            b + "attn.sinks": a.sinks, b + "attn.out.weight": a.o_proj.weight, b + "attn.out.bias": a.o_proj.bias,
            b + "mlp.norm.scale": layer.post_attention_layernorm.weight,
            b + "mlp.gate.weight": m.router.weight, b + "mlp.gate.bias": m.router.bias,
            b + "mlp.mlp1_bias": m.experts.gate_up_proj_bias, b + "mlp.mlp2_bias": m.experts.down_proj_bias,
        }
        for name, orig in (("gate_up_proj", "mlp1_weight"), ("down_proj", "mlp2_weight")):
            sd[b + f"mlp.{orig}.blocks"], sd[b + f"mlp.{orig}.scales"] = packed[(i, name)]
    src = tmp_path / "original"
    src.mkdir()
    save_file({k: v.detach().contiguous() for k, v in sd.items()}, src / "model.safetensors")
    rp = c.rope_parameters
    (src / "config.json").write_text(json.dumps({
        "num_hidden_layers": c.num_hidden_layers, "num_experts": c.num_local_experts,
        "experts_per_token": c.num_experts_per_tok, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "swiglu_limit": c.swiglu_limit, "head_dim": c.head_dim,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "sliding_window": c.sliding_window, "initial_context_length": rp["original_max_position_embeddings"],
        "rope_theta": rp["rope_theta"], "rope_scaling_factor": rp["factor"], "rope_ntk_alpha": rp["beta_slow"],
        "rope_ntk_beta": rp["beta_fast"]}))
    out = converters.convert(src, tmp_path / "out", dtype="float32", progress=False, keep_quantized=keep)
    _compare(hf, out, packed if keep else None)


def test_keep_quantized_needs_quantized_tensors(tmp_path):
    """An unquantized GPT-OSS checkpoint has nothing to keep: one clear error, nothing written."""
    hf = ref.build(ref.tiny_config("gpt_oss"), seed=3)
    src = tmp_path / "hf"
    src.mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(ValueError, match="holds no quantized tensors"):
        converters.convert(src, tmp_path / "out", progress=False, keep_quantized=True)
    assert not (tmp_path / "out").exists()


def test_dense_mlp_names_are_not_gpt_oss_names(tmp_path):
    """GPT-OSS has only experts: a Llama-style dense MLP tensor in its checkpoint is refused by name (the
    family's name table once inherited Llama's MLP rules: its filter compared regex keys with a plain string)."""
    from converters.safetensors_io import CheckpointError

    hf = ref.build(ref.tiny_config("gpt_oss"), seed=3)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    sd["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(hf.config.intermediate_size, hf.config.hidden_size)
    src = tmp_path / "hf"
    src.mkdir()
    save_file(sd, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.gate_proj\.weight'"):
        converters.read_source(src, progress=False)


def test_kept_nan_scale_is_refused(quantized, tmp_path):
    """A NaN scale (E8M0 byte 0xff) kept as bytes would reach the kernels: refused by name, as decoding does."""
    from converters.safetensors_io import CheckpointError

    hf, packed = quantized
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for (i, name), (blocks, scales) in packed.items():
        base = f"model.layers.{i}.mlp.experts.{name}"
        del sd[base]
        sd[base + "_blocks"], sd[base + "_scales"] = blocks, scales.clone()
    sd["model.layers.1.mlp.experts.down_proj_scales"][0, 0, 0] = 0xFF
    src = tmp_path / "hf"
    src.mkdir()
    save_file(sd, src / "model.safetensors")
    (src / "config.json").write_text(json.dumps(hf.config.to_dict()))
    with pytest.raises(CheckpointError, match=r"down_proj_scales: 1 NaN scales"):
        converters.read_source(src, progress=False, keep_quantized=True)
