"""Export back to Hugging Face (converters.export, `jaxmodels export`): HF -> ours -> HF is bit-exact per tensor in
fp32 and bf16 for every family whose import is lossless; transformers loads the export and its logits equal ours;
sharded output with an index; written atomically, with convert's destination rules."""
import copy
import dataclasses
import json
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from safetensors import safe_open
from tokenizers import models, pre_tokenizers

import converters
import jaxmodels as jm
from converters import hf_export
from converters.transforms import TRANSFORMS
from jaxmodels import cli, families
from jaxmodels.tokenizer import Tokenizer
from tests.oracles import deepseek_ckpt
from tests.parity import hf_deepseek_v4, hf_reference as ref

FAMILIES = list(ref.TINY)  # llama qwen3 qwen2 mistral cohere cohere2 qwen3_moe gemma3 gpt_oss exaone4
ATOL = 1e-4


def _tensors(d) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory's safetensors (one file or the shards of an index)."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            out |= {k: h.get_tensor(k) for k in h.keys()}
    return out


def _assert_bit_exact(want: dict, got: dict):
    assert sorted(got) == sorted(want)
    for k, a in want.items():
        b = got[k]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), k
        assert a.tobytes() == b.tobytes(), f"{k} differs"


def _hf(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=FAMILIES)
def source(request, tmp_path_factory):
    """(family, HF model, directory with `hf/` (its fp32 checkpoint) and `conv/` (our fp32 conversion))."""
    hf = ref.build(ref.tiny_config(request.param))
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf")
    converters.convert(root / "hf", root / "conv", dtype="float32", progress=False)
    return request.param, hf, root


def test_fp32_round_trip_is_bit_exact(source, tmp_path):
    """HF -> convert -> export: the same tensor names, dtypes and bytes as HF wrote; transformers loads the export
    into the state dict it started from, and the config reads back as ours."""
    name, hf, root = source
    out = converters.export(root / "conv", tmp_path / "exp", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    _assert_bit_exact(_tensors(root / "hf"), _tensors(out))
    back = _hf(out).state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == [type(hf).__name__]
    assert families.config_from_hf(config) == jm.load(root / "conv").config


def test_bf16_round_trip_is_bit_exact(source, tmp_path):
    name, hf, _ = source
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path / "hf16")
    conv = converters.convert(tmp_path / "hf16", tmp_path / "conv16", dtype="bfloat16", progress=False)
    out = converters.export(conv, tmp_path / "exp16", progress=False)
    want = _tensors(tmp_path / "hf16")
    assert {a.dtype for a in want.values()} == {np.dtype(ml_dtypes.bfloat16)}
    _assert_bit_exact(want, _tensors(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_exported_fine_tuned_model_logits_equal_ours(source, tmp_path):
    """A model changed after import (every parameter moved, as fine-tuning would) exported from Python: the logits
    of transformers on the export equal ours, fp32."""
    name, hf, root = source
    model = jm.load(root / "conv")
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: np.asarray(a) + 0.02 * rng.standard_normal(a.shape, np.float32), model.params)
    tuned = jm.Model(model.config, params, model.tokenizer)
    out = converters.export(tuned, tmp_path / "exp", progress=False)
    ids = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
    want = np.asarray(jm.forward(tuned, ids))
    got = ref.logits(_hf(out), ids)
    assert np.abs(got - want).max() <= ATOL, f"{name}: max |Δlogit| {np.abs(got - want).max():.2e}"
    assert np.abs(want - np.asarray(jm.forward(model, ids))).max() > 1e-2  # the change reached the logits


@pytest.mark.parametrize("variant", [v for v in ref.VARIANTS])
def test_variants_round_trip_from_the_hf_directory(variant, tmp_path):
    """Tied heads, biases, full / sliding / NoPE plans, MoE sparsity steps and scanned tails: exported straight from
    the source directory (jm.load's other input), the tensors and the model config come back unchanged."""
    hf = ref.build(ref.tiny_config(variant))
    hf.save_pretrained(tmp_path / "hf")
    out = converters.export(tmp_path / "hf", tmp_path / "exp", progress=False)
    _assert_bit_exact(_tensors(tmp_path / "hf"), _tensors(out))
    assert converters.open_source(out)[0] == converters.open_source(tmp_path / "hf")[0]


def test_gpt_oss_mxfp4_experts_export_dequantized(tmp_path):
    """MXFP4 expert blocks + scales (a lossy source layout) come back in HF's unquantized layout, holding exactly
    transformers' own decoding of those bytes, in the model's dtype."""
    from safetensors.torch import save_file

    from tests.parity.test_gpt_oss_layouts import mxfp4_experts

    hf = ref.build(ref.tiny_config("gpt_oss"), seed=11)
    packed = mxfp4_experts(hf)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for (i, name), (blocks, scales) in packed.items():
        base = f"model.layers.{i}.mlp.experts.{name}"
        del sd[base]
        sd[base + "_blocks"], sd[base + "_scales"] = blocks, scales
    (tmp_path / "hf").mkdir()
    save_file(sd, tmp_path / "hf" / "model.safetensors")
    config = hf.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    out = converters.export(tmp_path / "hf", tmp_path / "exp", progress=False)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert not any(k.endswith(("_blocks", "_scales")) for k in _tensors(out))
    back = _hf(out).state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k


# ----------------------------------------------------------------------------------------------- DeepSeek V4
# HF's own V4 configs beside V4_TINY: two hash-routed layers, HCA at ratio 8, a window of 6, top-k 2
V4_VARIANTS = {"v4_tiny": {}, "v4_hca8": dict(
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], sliding_window=6, index_topk=2,
    compress_ratios=None, num_hash_layers=None)}


def _loads_cleanly(path, dtype=torch.float32):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set(), info
    return model.eval()


@pytest.mark.parametrize("variant", list(V4_VARIANTS))
def test_deepseek_v4_fp32_round_trip_is_bit_exact(variant, tmp_path):
    """HF's DeepseekV4ForCausalLM -> convert -> export: every tensor save_pretrained wrote (per-expert w1/w2/w3, mHC,
    both compressors, the indexer, the routers' biases, the int64 hash table) with its name, dtype and bytes;
    transformers loads it with no missing or unexpected key into the state dict it started from (buffers too),
    and config.json reads back as ours."""
    hf = hf_deepseek_v4.build(**V4_VARIANTS[variant])
    hf.save_pretrained(tmp_path / "hf")
    conv = converters.convert(tmp_path / "hf", tmp_path / "conv", dtype="float32", progress=False)
    out = converters.export(conv, tmp_path / "exp", progress=False)
    want = _tensors(tmp_path / "hf")
    assert want["model.layers.0.ffn.gate.tid2eid"].dtype == np.int64 and len(want) > 150
    _assert_bit_exact(want, _tensors(out))
    back = _loads_cleanly(out).state_dict()
    for k, v in hf.state_dict().items():
        assert torch.equal(back[k], v), k
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["dtype"] == "float32"
    assert families.config_from_hf(config) == jm.load(conv).config
    assert transformers.AutoConfig.for_model(**config).layer_types == hf.config.layer_types


def test_deepseek_v4_bf16_round_trip_is_bit_exact(tmp_path):
    """A bf16 V4 as transformers saves it (from_pretrained(dtype=bfloat16).save_pretrained): bf16 weights, the
    modules of its _keep_in_fp32_modules_strict fp32 (norms, mHC, sinks, compressor position biases, router
    biases), the hash table int64. Converted in bf16 (the plan keeps the non-norm ones fp32) and exported, or
    converted in fp32 and exported as bf16: the same bytes either way. The weights hold bf16 values, as a bf16
    model's do: fp32 norms with more bits would be rounded by the bf16 import (ours keeps norms in the model's dtype,
    as DeepSeek's own bf16 release stores them)."""
    hf = hf_deepseek_v4.build().to(torch.bfloat16).float()
    hf.save_pretrained(tmp_path / "bf16-values")
    _hf(tmp_path / "bf16-values", torch.bfloat16).save_pretrained(tmp_path / "hf16")
    want = _tensors(tmp_path / "hf16")
    kept = {k for k, a in want.items() if a.dtype != ml_dtypes.bfloat16}
    assert "model.layers.1.attn.q_norm.weight" in kept and "model.hc_head.hc_fn" in kept
    assert len(kept) < len(want) / 2 and "model.layers.1.attn.wq_b.weight" not in kept
    conv16 = converters.convert(tmp_path / "hf16", tmp_path / "conv16", dtype="bfloat16", progress=False)
    _assert_bit_exact(want, _tensors(converters.export(conv16, tmp_path / "exp16", progress=False)))
    conv32 = converters.convert(tmp_path / "hf16", tmp_path / "conv32", dtype="float32", progress=False)
    out = converters.export(conv32, tmp_path / "exp32", dtype="bfloat16", progress=False)
    _assert_bit_exact(want, _tensors(out))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _loads_cleanly(out, torch.bfloat16)


def test_deepseek_v4_exported_fine_tuned_model_logits_equal_ours(tmp_path):
    """Every floating parameter moved and the hash table re-drawn, exported from Python: transformers' logits on the
    export equal ours in fp32 at T=160 (past the window, an HCA entry, the CSA top-k binding), on inputs whose
    expert choices and top-k boundaries stay >= 1e-5 from a tie."""
    hf = hf_deepseek_v4.build()
    hf.save_pretrained(tmp_path / "hf")
    model = jm.load(tmp_path / "hf")
    rng = np.random.default_rng(1)

    def tune(path, a):
        a = np.asarray(a)
        if "tid2eid" in jax.tree_util.keystr(path):
            return rng.integers(0, model.config.layers[0].mlp.num_experts, a.shape).astype(a.dtype)
        return a + 0.02 * rng.standard_normal(a.shape, np.float32)

    tuned = jm.Model(model.config, jax.tree_util.tree_map_with_path(tune, model.params), model.tokenizer)
    out = converters.export(tuned, tmp_path / "exp", progress=False)
    exported = _loads_cleanly(out)
    ids = np.random.default_rng(7).integers(0, model.config.vocab_size, (2, 160)).astype(np.int32)
    router, indexer = hf_deepseek_v4.nearest_ties(exported, ids)
    assert min(router, indexer) >= 1e-5, f"inputs near a tie (expert choice {router:.1e}, top-k {indexer:.1e})"
    with jax.default_matmul_precision("highest"):
        want, before = np.asarray(jm.forward(tuned, ids)), np.asarray(jm.forward(model, ids))
    got = ref.logits(exported, ids)
    assert np.abs(got - want).max() <= ATOL, f"max |Δlogit| {np.abs(got - want).max():.2e}"
    assert np.abs(want - before).max() > 1e-2  # the change reached the logits


def test_deepseek_v4_kept_quantized_weights_are_refused(tmp_path):
    hf = hf_deepseek_v4.build()
    hf.save_pretrained(tmp_path / "hf")
    model = jm.load(tmp_path / "hf")
    params = jax.tree.map(np.asarray, model.params)
    wq = params["layers"]["1"]["attn"]["wq_b"]
    params["layers"]["1"]["attn"]["wq_b"] = {"fp8": wq.astype(ml_dtypes.float8_e4m3fn).view(np.uint8),
                                            "scale": np.ones((wq.shape[0], 1, 1), np.uint8)}
    with pytest.raises(NotImplementedError, match=r"layers/1/attn/wq_b .*kept quantized.*without keep_quantized"):
        converters.export(jm.Model(model.config, params), tmp_path / "exp", progress=False)
    assert not (tmp_path / "exp").exists() and _siblings(tmp_path / "exp") == []


def test_sharded_above_the_size_threshold(tmp_path):
    """A small max_shard_size: HF's shard names and index (every tensor once, sizes and parameter count), no shard
    above the threshold unless one tensor is; transformers and our import both read it back unchanged."""
    hf = ref.build(ref.tiny_config("llama"))
    hf.save_pretrained(tmp_path / "hf")
    limit = 100_000
    out = converters.export(tmp_path / "hf", tmp_path / "exp", dtype="float32", max_shard_size=limit, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                                          for k in range(1, len(shards) + 1)]
    assert not (out / "model.safetensors").exists() and sorted(set(index["weight_map"].values())) == shards
    want = _tensors(tmp_path / "hf")
    assert sorted(index["weight_map"]) == sorted(want)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in want.values())
    assert index["metadata"]["total_parameters"] == sum(a.size for a in want.values())
    for s in shards:
        with safe_open(str(out / s), framework="np") as h:
            sizes = [h.get_tensor(k).nbytes for k in h.keys()]
            assert sum(sizes) <= limit or len(sizes) == 1
            assert all(index["weight_map"][k] == s for k in h.keys())
    _assert_bit_exact(want, _tensors(out))
    back = _hf(out).state_dict()
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    ours, again = jm.load(tmp_path / "hf"), jm.load(out)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(again.params)))
    assert converters.export(tmp_path / "hf", tmp_path / "one", progress=False).joinpath("model.safetensors").exists()


def test_shard_sizes_spelled_as_hf_does():
    assert [hf_export.shard_bytes(s) for s in (5, "5GB", "500MB", "2GiB", "10kb")] == [5, 5 * 10**9, 5 * 10**8,
                                                                                       2 << 30, 10**4]
    for bad in ("5 parsecs", 0, -1, "GB", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            hf_export.shard_bytes(bad)


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_each_transform_has_an_exact_inverse(name):
    """Every import transform has its inverse beside it (a new transform without one fails here), and it puts each
    element back where it came from: the forward of the inverse is the identity, and on element indices the inverse
    covers every source element exactly once (for the even/odd pair: together)."""
    assert name in hf_export.INVERSES
    want = {"copy": (3, 4), "T": (6, 2, 3), "T_out": (2, 3, 5), "reshape": (4, 5), "even_cols": (3, 4),
            "odd_cols": (3, 4), "wo_a": (2, 3, 4)}[name]
    shape = TRANSFORMS[name][0](want)
    idx = np.arange(np.prod(shape)).reshape(shape)
    pair = ("even_cols", "odd_cols") if name in ("even_cols", "odd_cols") else (name,)
    out = np.full(shape, -1)
    for t in pair:
        part = TRANSFORMS[t][1](idx, want)
        assert part.shape == want
        hf_export.INVERSES[t](out, part)
        assert np.array_equal(TRANSFORMS[t][1](out, want), part)
    assert np.array_equal(out, idx)


def _llama_model(tmp_path):
    hf = ref.build(ref.tiny_config("llama"))
    hf.save_pretrained(tmp_path / "hf")
    return jm.load(tmp_path / "hf")


def _siblings(d):
    return sorted(p.name for p in d.parent.iterdir() if p.name.startswith(f".{d.name}."))


def test_destination_rules(tmp_path):
    """As convert: an existing destination only with overwrite, and then only an earlier export or an empty
    directory; a user's directory, a converted model and the source itself are never touched."""
    model = _llama_model(tmp_path)
    dst = converters.export(model, tmp_path / "exp", progress=False)
    before = (dst / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(FileExistsError, match="already exists"):
        converters.export(model, dst, progress=False)
    assert (dst / "model.safetensors").stat().st_mtime_ns == before
    converters.export(model, dst, dtype="bfloat16", overwrite=True, progress=False)  # an earlier export: replaced
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16" and _siblings(dst) == []

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    (mine / "config.json").write_text("{}")  # looks like a model directory, is not our export
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="already exists" if not overwrite else "not an earlier export"):
            converters.export(model, mine, overwrite=overwrite, progress=False)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "notes.txt"]
    with pytest.raises(FileExistsError, match="not an earlier export"):  # our converted model is not an export
        converters.export(model, converters.convert(tmp_path / "hf", tmp_path / "conv", progress=False),
                          overwrite=True, progress=False)
    with pytest.raises(ValueError, match="contains the source"):
        converters.export(tmp_path / "hf", tmp_path / "hf", overwrite=True, progress=False)
    (tmp_path / "empty").mkdir()
    converters.export(model, tmp_path / "empty", overwrite=True, progress=False)
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_unwritable_destination(tmp_path):
    model = _llama_model(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):  # its parent is a file
        converters.export(model, tmp_path / "file" / "exp", progress=False)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        try:
            with pytest.raises(PermissionError):
                converters.export(model, ro / "exp", progress=False)
            assert list(ro.iterdir()) == []
        finally:
            ro.chmod(0o755)


def test_a_failed_export_leaves_nothing(tmp_path):
    """A NaN found while writing: the error names the tensor; neither the destination nor a temporary remains."""
    model = _llama_model(tmp_path)
    params = jax.tree.map(lambda a: a, model.params)
    params["layers"]["0"]["mlp"]["w_up"] = params["layers"]["0"]["mlp"]["w_up"].at[1, 0, 0].set(jnp.nan)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*non-finite"):
        converters.export(jm.Model(model.config, params), tmp_path / "exp", max_shard_size=50_000, progress=False)
    assert not (tmp_path / "exp").exists() and _siblings(tmp_path / "exp") == []
    with pytest.raises(ValueError, match="overflows float16"):
        big = jax.tree.map(lambda a: a, model.params)
        big["final_norm"] = big["final_norm"].at[0].set(1e6)
        converters.export(jm.Model(model.config, big), tmp_path / "exp", dtype="float16", progress=False)
    assert not (tmp_path / "exp").exists() and _siblings(tmp_path / "exp") == []


_S, _F = "sliding_attention", "full_attention"


@pytest.mark.parametrize("types", [[_F, _S, _S], [_S, _F, _S], [_F, _F, _F]])
def test_qwen2_config_spells_the_plan(types):
    """Qwen2's exported config.json gives transformers' attention layers our windows (layer_types, also where the
    sliding layers are not the tail), and max_window_layers only where it says the same to a reader without
    layer_types (Qwen's released files have none): such a config.json reads back as our plan without them too."""
    cfg = families.config_from_hf({**ref.tiny_config("qwen2"), "num_hidden_layers": 3, "layer_types": types,
                                   "use_sliding_window": _S in types})
    out = hf_export.hf_config(cfg)
    hf_cfg = transformers.AutoConfig.for_model(**out)
    hf_windows = [transformers.models.qwen2.modeling_qwen2.Qwen2Attention(hf_cfg, i).sliding_window
                  for i in range(cfg.num_layers)]
    assert hf_windows == [L.attention.window for L in cfg.layers] == [6 if t == _S else None for t in types]
    tail = types != [_S, _F, _S]
    assert ("max_window_layers" in out) == tail
    if tail:
        assert families.config_from_hf({k: v for k, v in out.items() if k != "layer_types"}) == cfg


def test_what_cannot_be_exported_is_refused_before_writing(tmp_path):
    model = _llama_model(tmp_path)
    ds = types.SimpleNamespace(config=families.config_from_hf(deepseek_ckpt.tiny_config()), params={}, tokenizer=None)
    with pytest.raises(NotImplementedError, match="not supported for deepseek_v41 models yet"):  # no HF class
        converters.export(ds, tmp_path / "exp", progress=False)
    # a plan the family's config.json cannot spell: one Llama layer with a window
    cfg = model.config
    windowed = dataclasses.replace(cfg.layers[1], attention=dataclasses.replace(cfg.layers[1].attention, window=8))
    cfg = dataclasses.replace(cfg, layers=(cfg.layers[0], windowed))
    with pytest.raises(ValueError, match=r"cannot be written as a llama config.json: layers\[1\].attention.window 8"):
        converters.export(jm.Model(cfg, model.params), tmp_path / "exp", progress=False)
    assert not (tmp_path / "exp").exists() and _siblings(tmp_path / "exp") == []


def _word_tokenizer(d, add_bos: bool):
    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(252)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(words[:4])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": add_bos,
        "chat_template": "{% for m in messages %}<bos>{{ m['content'] }}<eos>{% endfor %}"}))


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_files_load_in_transformers(tmp_path, add_bos):
    """transformers' AutoTokenizer on the export tokenizes, templates and decodes as our tokenizer does (a BOS our
    tokenizer prepends itself is put where HF looks for it), and so does ours reading the export."""
    hf = ref.build(ref.tiny_config("qwen3"))
    hf.save_pretrained(tmp_path / "hf")
    _word_tokenizer(tmp_path / "hf", add_bos)
    ours = Tokenizer.from_dir(tmp_path / "hf")
    out = converters.export(converters.convert(tmp_path / "hf", tmp_path / "conv", progress=False), tmp_path / "exp",
                            progress=False)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "w5 w6 w7 w250"
    assert theirs(text).input_ids == ours.encode(text) == Tokenizer.from_dir(out).encode(text)
    assert ours.encode(text)[:1] == ([2] if add_bos else [9])  # w5 is token 9
    msgs = [{"role": "user", "content": "w1 w2"}]
    assert theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(msgs)
    assert (theirs.bos_token, theirs.eos_token) == ("<bos>", "<eos>")
    assert theirs.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))


def test_cli_export(tmp_path, capsys):
    hf = ref.build(ref.tiny_config("gemma3"))
    hf.save_pretrained(tmp_path / "hf")
    conv = converters.convert(tmp_path / "hf", tmp_path / "conv", dtype="float32", progress=False)
    assert cli.main(["export", str(conv), str(tmp_path / "exp"), "--dtype", "bfloat16"]) == 0
    assert f"exported {conv} -> " in capsys.readouterr().out
    assert json.loads((tmp_path / "exp" / "config.json").read_text())["dtype"] == "bfloat16"
    want = {k: v.astype(ml_dtypes.bfloat16) for k, v in _tensors(tmp_path / "hf").items()}
    _assert_bit_exact(want, _tensors(tmp_path / "exp"))
    assert cli.main(["export", str(conv), str(tmp_path / "exp")]) == 2  # exists, no --force
    err = capsys.readouterr().err
    assert "jaxmodels export: error:" in err and "already exists" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert cli.main(["export", str(conv), str(tmp_path / "exp"), "--force", "--max-shard-size", "20KB"]) == 0
    assert (tmp_path / "exp" / "model.safetensors.index.json").is_file()
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "jaxmodels.cli", "export", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: jaxmodels export" in r.stdout and "--max-shard-size" in r.stdout
