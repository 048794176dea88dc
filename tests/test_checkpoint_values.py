"""Checkpoint values that would convert into a model that silently answers garbage are refused, naming the tensor or
the config field (issue #17, "silent wrong results").

Weights: NaN/Inf, an integer or bool tensor where a float weight belongs, a value past the range of the target
dtype (float32 1e6 -> float16 inf) — checked on each tensor as it is converted, in the host import, the sharded
import and DeepSeek's FP8/FP4 paths (dequantised or kept as bytes). Config numbers: NaN/negative/zero sizes, eps,
theta, factors, caps; heads not divisible by kv heads; a missing required field — one ValueError line naming the
config.json key, while every real config (tiny test configs, transformers' defaults, DeepSeek's) still loads.
"""
import json
import math
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import converters
import jaxmodels as jm
from converters.hf import check_values, nonfinite
from jaxmodels import cli, families, sharding
from jaxmodels.config import ConfigError, ModelConfig
from tests import quant_encoders as enc
from tests.oracles import deepseek_ckpt as ck
from tests.parity import hf_reference as ref

VICTIM = "model.layers.1.mlp.up_proj.weight"  # [intermediate, hidden] = [128, 64]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    src = tmp_path_factory.mktemp("tiny") / "hf"
    ref.build(ref.tiny_config("llama")).save_pretrained(src)  # float32 tensors
    return src


@pytest.fixture
def src(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "src")


def _edit(src, name, edit):
    """Replace tensor `name` of the checkpoint by edit(its torch tensor)."""
    path = src / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    tensors[name] = edit(tensors[name].clone())
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def _fails(src, dst, *patterns, dtype="float32", exc=converters.CheckpointError):
    with pytest.raises(exc) as info:
        converters.convert(src, dst, dtype=dtype, progress=False)
    for pat in patterns:
        assert re.search(pat, str(info.value)), f"{str(info.value)!r} does not match {pat!r}"
    assert not dst.exists() and not list(dst.parent.glob(f".{dst.name}.*"))
    return str(info.value)


def _poison(t, value=float("nan")):
    t.view(-1)[[3, 700, 5000]] = value
    return t


# ------------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named(src, tmp_path, value):
    _edit(src, VICTIM, lambda t: _poison(t, value))
    _fails(src, tmp_path / "out", re.escape(VICTIM) + r": 3 non-finite values \(NaN/Inf\)")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool], ids=str)
def test_integer_or_bool_tensor_for_a_float_weight(src, tmp_path, dtype):
    _edit(src, VICTIM, lambda t: (t * 100).to(dtype))
    _fails(src, tmp_path / "out", re.escape(VICTIM), f"is {str(dtype).split('.')[1]}",
           "expected a floating-point tensor")


def test_float16_overflow_at_conversion(src, tmp_path):
    _edit(src, VICTIM, lambda t: _poison(t, -1e6))  # finite in the float32 checkpoint, inf in float16
    _fails(src, tmp_path / "out", re.escape(VICTIM), r"overflows float16 \(max \|x\| = 1e\+06\)", dtype="float16")
    out = converters.convert(src, tmp_path / "bf16", dtype="bfloat16", progress=False)  # representable: fine
    assert jm.load(out).params["layers"]["0"]["mlp"]["w_up"].dtype == ml_dtypes.bfloat16


def test_sharded_import_checks_each_slice(src):
    _edit(src, VICTIM, _poison)
    with pytest.raises(converters.CheckpointError, match=re.escape(VICTIM) + r": \d+ non-finite values"):
        jm.load(src, mesh=sharding.make_mesh("data=2,tensor=4"))


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    """DeepSeek V4.1's tiny checkpoint in its own layout (FP8 e4m3 + E8M0 scales, packed FP4 experts) as tensors."""
    path = tmp_path_factory.mktemp("v41") / "ckpt"
    path.mkdir()
    ck.write_tiny_v41(path)
    from converters import deepseek_quant as dq

    header, _ = dq.read_safetensors_header(path / "model.safetensors")
    return path, {k: dq.read_safetensors_tensor(path / "model.safetensors", k) for k in header if k != "__metadata__"}


@pytest.mark.parametrize("keep_quantized", [False, True])
@pytest.mark.parametrize("where", ["fp8", "scale", "fp4 scale"])
def test_deepseek_nan_codes(v41, tmp_path, where, keep_quantized):
    """An e4m3 NaN code (S.1111.111) or an E8M0 NaN scale (0xff): refused whether dequantised or kept as bytes."""
    path, tensors = v41
    name = {"fp8": "layers.4.attn.wkv.weight", "scale": "layers.4.attn.wkv.scale",
            "fp4 scale": "layers.2.ffn.experts.1.w1.scale"}[where]
    assert tensors[name].dtype == (ml_dtypes.float8_e4m3fn if where == "fp8" else np.uint8)
    bad = tensors[name].copy()
    bad.view(np.uint8).reshape(-1)[[0, 5]] = 0x7F if where == "fp8" else 0xFF
    d = tmp_path / "bad"
    d.mkdir()
    enc.write_safetensors(d / "model.safetensors", {**tensors, name: bad})
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(path / f, d / f)
    weight = name.removesuffix(".weight").removesuffix(".scale") + ".weight"
    want = (re.escape(name) + r": 2 NaN scales" if keep_quantized and where != "fp8"
            else re.escape(weight) + r": \d+ non-finite values \(NaN/Inf\)")
    with pytest.raises(converters.CheckpointError, match=want):
        converters.read_source(d, progress=False, keep_quantized=keep_quantized)
    converters.read_source(path, progress=False, keep_quantized=keep_quantized)  # the pristine one imports


def test_nonfinite_counts_every_float_format():
    """Exact for each format, across chunk boundaries (it reads NaN/Inf from the bits where it knows them)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(10_001).astype(np.float32) * 100
    x[rng.choice(x.size, 37, replace=False)] = rng.choice([np.nan, np.inf, -np.inf, 1e30, 1e6], 37)
    for dt in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64, ml_dtypes.float8_e4m3fn,
               ml_dtypes.float8_e5m2, ml_dtypes.float8_e8m0fnu, ml_dtypes.float8_e4m3fnuz):
        with np.errstate(over="ignore"):
            y = x.astype(dt)
        want = np.count_nonzero(~np.isfinite(y.astype(np.float64)))
        assert nonfinite(y, chunk=1000) == want > 0, np.dtype(dt).name
    assert nonfinite(np.zeros((0, 4), np.float32)) == 0


def test_exact_widening_pairs_keep_every_value():
    """`check_values` counts NaN/Inf on the source for the casts in EXACT_WIDENING (fewer bytes): right only if the
    cast keeps every value. Every bit pattern of each pair's source (extremes and non-finite values, for a wider
    source) casts there and back unchanged, so a pair added that can overflow or round fails here."""
    from converters.hf import EXACT_WIDENING

    assert EXACT_WIDENING
    for src, dst in EXACT_WIDENING:
        if src.itemsize <= 2:
            x = np.arange(1 << 8 * src.itemsize, dtype=np.uint64).astype(f"u{src.itemsize}").view(src)
        else:
            info = ml_dtypes.finfo(src)
            x = np.array([0, -0.0, 1, info.max, info.min, info.tiny, info.smallest_subnormal, info.eps, np.inf,
                          -np.inf, np.nan], src)
        with np.errstate(over="ignore", invalid="ignore"):
            back = x.astype(dst).astype(src)
        assert np.array_equal(back.view(f"u{src.itemsize}"), x.view(f"u{src.itemsize}")) or \
            np.array_equal(back, x, equal_nan=True), f"{src} -> {dst} loses values"
        assert nonfinite(x.astype(dst)) == nonfinite(x), f"{src} -> {dst}"


def test_integer_parameters_take_integer_tensors():
    """Tables such as DeepSeek's hash router tid2eid (int32): a float source would truncate, int64 past int32 wrap."""
    out = np.zeros(4, np.int32)
    check_values("tid2eid", np.arange(4, dtype=np.int64), out)
    with pytest.raises(converters.CheckpointError, match="tid2eid is float32, expected an integer tensor"):
        check_values("tid2eid", np.arange(4, dtype=np.float32), out)
    with pytest.raises(converters.CheckpointError, match="tid2eid overflows int32"):
        check_values("tid2eid", np.array([0, 1 << 40]), out)


# ------------------------------------------------------------------------------------------- config numbers
BAD_CONFIGS = [  # (family, change to config.json, the message)
    ("llama", {"rope_theta": float("nan")}, "rope_theta must be a positive finite number, got nan"),
    ("llama", {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a positive finite number, got -1e-06"),
    ("llama", {"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
    ("llama", {"vocab_size": -3}, "vocab_size must be a positive integer, got -3"),
    ("llama", {"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive integer, got 0"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ("llama", {"num_key_value_heads": 3}, "num_key_value_heads must be a divisor of the 4 attention heads, got 3"),
    ("llama", {"head_dim": -16}, "head_dim must be a positive integer, got -16"),
    ("llama", {"intermediate_size": 0}, "intermediate_size must be a positive integer, got 0"),
    ("llama", {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
    ("llama", {"max_position_embeddings": 0}, "max_position_embeddings must be a positive integer, got 0"),
    ("llama", {"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ("llama", {"rope_theta": True}, "rope_theta must be a positive finite number, got True"),
    # beside the rope_parameters the mapping reads (transformers 5 saves those): unused, still a broken config
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": float("inf")},
     "rope_theta must be a positive finite number, got inf"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": -8.0, "original_max_position_embeddings": 64}},
     "factor must be a positive finite number, got -8.0"),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "original_max_position_embeddings must be a positive integer, got None"),
    ("qwen3", {"sliding_window": 0}, "sliding_window must be a positive integer, got 0"),
    ("qwen3_moe", {"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer, got 0"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok must be at most num_experts=8, got 9"),
    ("qwen3_moe", {"moe_intermediate_size": -32}, "moe_intermediate_size must be a positive integer, got -32"),
    ("gpt_oss", {"num_local_experts": -4}, "num_local_experts must be a positive integer, got -4"),
    ("gpt_oss", {"swiglu_limit": float("inf")}, "swiglu_limit must be a positive finite number, got inf"),
    ("gemma3", {"rope_local_base_freq": float("nan")}, "rope_local_base_freq must be a positive finite number, got nan"),
    ("gemma3", {"query_pre_attn_scalar": -24}, "query_pre_attn_scalar must be a positive finite number, got -24"),
    ("gemma3", {"final_logit_softcapping": 0.0}, "final_logit_softcapping must be a positive finite number, got 0.0"),
    ("cohere", {"layer_norm_eps": float("nan")}, "layer_norm_eps must be a positive finite number, got nan"),
    ("cohere", {"logit_scale": -0.25}, "logit_scale must be a positive finite number, got -0.25"),
    ("exaone4", {"sliding_window": -6}, "sliding_window must be a positive integer, got -6"),
]


@pytest.mark.parametrize("family, change, message", BAD_CONFIGS, ids=[f"{f}-{next(iter(c))}" for f, c, _ in BAD_CONFIGS])
def test_bad_config_number_is_named(family, change, message):
    with pytest.raises(ValueError) as info:
        families.config_from_hf({**ref.tiny_config(family), **change})
    assert str(info.value).startswith("config.json: " + message), str(info.value)


def test_deepseek_config_numbers():
    for change, message in [({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
                            ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a positive finite number, got -1.0"),
                            ({"compress_rope_theta": float("nan")}, "compress_rope_theta must be a positive finite"),
                            ({"q_lora_rank": 0}, "q_lora_rank must be a positive integer, got 0"),
                            ({"n_routed_experts": 0}, "n_routed_experts must be a positive integer, got 0"),
                            ({"hc_sinkhorn_iters": 0}, "hc_sinkhorn_iters must be a positive integer, got 0")]:
        with pytest.raises(ValueError, match="^config.json: " + re.escape(message)):
            families.config_from_hf(ck.tiny_config(**change))


@pytest.mark.parametrize("family, field", [("llama", "hidden_size"), ("qwen3", "intermediate_size"),
                                           ("gemma3", "num_hidden_layers"), ("cohere", "vocab_size"),
                                           ("gpt_oss", "num_attention_heads")])
def test_missing_required_field_is_named(family, field):
    hf = ref.tiny_config(family)
    hf.pop(field)
    with pytest.raises(ValueError, match=rf"^config.json: missing required field '{field}' \(model_type "
                                         rf"'{hf['model_type']}'\)$"):
        families.config_from_hf(hf)


def test_cli_reports_a_bad_config_in_one_line(pristine, tmp_path, capsys):
    src = shutil.copytree(pristine, tmp_path / "src")
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 0}))
    assert cli.main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "jaxmodels convert: error: config.json: num_hidden_layers must be a positive integer, got 0"
    assert not (tmp_path / "out").exists()


def test_a_converted_config_is_validated_at_load():
    cfg = families.config_from_hf(ref.tiny_config("llama")).to_dict()
    with pytest.raises(ConfigError, match=r"^norm_eps must be a positive finite number, got nan$"):
        ModelConfig.from_dict({**cfg, "norm_eps": math.nan})
    cfg["layers"][1]["attention"]["rope"]["theta"] = -1.0
    with pytest.raises(ConfigError, match=r"^layer 1: theta must be a positive finite number, got -1.0$"):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "cohere", "cohere2",
                                        "gemma3_text", "gemma3", "exaone4", "gpt_oss", "deepseek_v4"])
def test_real_configs_still_load(model_type):
    """transformers' defaults are real models' configs (Llama-2-7B, Qwen3-8B, gpt-oss-20b, DeepSeek-V4 ...); the
    tiny test configs and DeepSeek V4.1's load too."""
    families.config_from_hf(transformers.AutoConfig.for_model(model_type).to_dict())
    for name in [n for n in (*ref.TINY, *ref.VARIANTS) if ref.tiny_config(n)["model_type"].startswith(model_type)]:
        families.config_from_hf(ref.tiny_config(name))
    if model_type == "deepseek_v4":
        families.config_from_hf(ck.tiny_config())
