"""GGUF import of the architectures llama.cpp writes for Qwen2, Qwen3, Qwen3-MoE and Mistral (issue #18 item 5).

Each tiny random HF model (tests/parity/hf_reference.randomize: every weight non-trivial) is written to a GGUF file
the way llama.cpp's convert_hf_to_gguf.py writes it (`write_gguf` below follows its `conversion/` classes: which
arch, which tensor names through gguf-py's own tensor map, Q/K permutation for `LlamaModel` and its subclasses,
experts stacked per layer for Qwen3-MoE, norms / 1-D tensors / the router kept F32, the metadata keys and the
tokenizer as `_set_vocab_gpt2` / `_create_vocab_sentencepiece` write them), then imported through the public path
(`converters.convert` + `jm.load`). References: transformers loading the same file (`from_pretrained(dir,
gguf_file=...)`, where it supports the arch: it dequantizes with the same `gguf` library, so quantized files compare
at the fp32 bar too) and, for F32 files, the original HF model.

What llama.cpp's conversion loses is checked as such: Mistral's sliding window and Qwen's use_sliding_window are
not in the file (llama.cpp runs full attention), and its Qwen3-MoE graph renormalises the routing weights.
transformers 5.24 cannot load a `mistral3` file (no such arch in its GGUF tables) nor a `llama` file with attention
biases (its GGUF config has no attention_bias, the biases are dropped): those are checked against the original HF
model only. It also ignores `qwen3.attention.key_length` and `qwen3moe.expert_feed_forward_length` (the config
classes' defaults, 128 and 768, stand in): the tiny Qwen3 models below use those sizes, as the real ones do.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

import converters
import jaxmodels as jm
from converters.gguf_io import GGUFReader
from jaxmodels import families
from jaxmodels.layers.rope import inv_freq
from tests.parity.hf_reference import build, logits

TOL = 1e-4
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
# Our own writing, with digits, contractions, punctuation, an accent, CJK and an emoji (byte fallback / bytes).
CORPUS = ("The lighthouse keeper wrote the weather down three times a day, and he didn't miss a morning in 1874. "
          "Ships passed at 9:45; the gulls were louder than usual. It's a fair question why anyone would repeat "
          "it. Café owners framed a page beside the counter, and children count the crossed-out lines.\n\n") * 3
TEXTS = ["The keeper's café opened in 1874!\n\n  Ships passed at 9:45;   gulls   were louder.",
         " leading space, tabs\tand 東京 🚀 bytes",
         "<|im_start|>user\nWhy repeat it?<|im_end|>\n<|im_start|>assistant\n<think>\nBecause.</think>",
         "[INST] Name the keeper. [/INST]Nobody knows.</s>"]
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BASE = {"vocab_size": 0, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "tie_word_embeddings": False}
MODELS = {  # name -> (HF config, GGUF arch, tokenizer kind, transformers loads the arch)
    "qwen2": ({**BASE, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32,
               "max_window_layers": 1}, "qwen2", "bpe", True),
    # head_dim 128 as every Qwen3 has: transformers 5.24 ignores qwen3.attention.key_length (Qwen3Config's default)
    "qwen3": ({**BASE, "model_type": "qwen3", "head_dim": 128, "tie_word_embeddings": True}, "qwen3", "bpe", True),
    # expert width 768 as Qwen3-30B-A3B's: transformers ignores qwen3moe.expert_feed_forward_length (its default)
    "qwen3_moe": ({**BASE, "model_type": "qwen3_moe", "head_dim": 16, "num_hidden_layers": 2, "num_experts": 8,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 768, "norm_topk_prob": True,
                   "mlp_only_layers": [], "decoder_sparse_step": 1}, "qwen3moe", "bpe", True),
    # MistralForCausalLM: llama.cpp's LlamaModel (arch "llama", Q/K permuted), SentencePiece vocabulary
    "mistral": ({**BASE, "model_type": "mistral", "head_dim": 16, "rope_theta": 10000.0, "sliding_window": None},
                "llama", "spm", True),
    # Llama with attention biases (llama.cpp permutes the q/k biases too); transformers' GGUF config has no
    # attention_bias, so it cannot load this one
    "llama_bias": ({**BASE, "model_type": "llama", "head_dim": 16, "attention_bias": True}, "llama", "bpe", False),
    # Llama 3.x RoPE scaling (factor 8, original context 8192: llama.cpp assumes 8192 whatever the config says):
    # llama.cpp writes it as rope_freqs.weight, which transformers ignores (it runs the file unscaled)
    "llama3": ({**BASE, "model_type": "llama", "head_dim": 16, "rope_theta": 500000.0,
                "max_position_embeddings": 131072,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}}, "llama", "bpe", False),
    # the text of Mistral3ForConditionalGeneration: llama.cpp's Mistral3Model (a LlamaModel with arch "mistral3")
    "mistral3": ({**BASE, "model_type": "mistral", "head_dim": 16, "rope_theta": 10000.0, "sliding_window": None},
                 "mistral3", "spm", False),
}

FAMILY = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "mistral": "llama", "llama_bias": "llama",
          "llama3": "llama", "mistral3": "mistral"}


# ----------------------------------------------------------------------------------- tokenizers of the tiny models
def _bpe_tokenizer(out: Path) -> transformers.PreTrainedTokenizerFast:
    """A Qwen2-style byte-level BPE (Qwen2's split, byte mapping) trained on CORPUS; special tokens at the end of the
    vocabulary as Qwen's are, and an added non-special <think>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHAT
    hf.save_pretrained(out)
    return hf


def _spm_pieces() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-BPE piece table as a Llama/Mistral tokenizer.model holds it and llama.cpp's
    `_create_vocab_sentencepiece` copies it: <unk> <s> </s>, the 256 byte pieces, merged pieces scored by merge
    order (-rank), single characters last; [INST] and [/INST] control tokens, one user-defined token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=300, show_progress=False))
    merges = json.loads(tok.to_str())["model"]["merges"]
    merged = list(dict.fromkeys("".join(m) for m in merges))
    chars = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]) if t not in set(merged)]
    T = gguf.TokenType
    pieces = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + chars
              + ["[INST]", "[/INST]", "<extra>"])
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))] + [-1e4 - i for i in range(len(chars))] + [0.0] * 3
    types = ([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * (len(merged) + len(chars))
             + [T.CONTROL, T.CONTROL, T.USER_DEFINED])
    return pieces, scores, types


# ------------------------------------------------------------------------------- llama.cpp's convert_hf_to_gguf.py
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: rows of each head reordered for llama.cpp's interleaved (NORM) RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(dim: int, base: float, rope: dict, old: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: llama3 RoPE scaling as one divisor per frequency (rope_freqs.weight). It
    takes the original context from the top level of config.json (default 8192), not from the rope dict."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def write_gguf(hf_dir: Path, path: Path, arch: str, qtype: gguf.GGMLQuantizationType, tokenizer: str) -> Path:
    cfg = json.loads((hf_dir / "config.json").read_text())
    n, H, K = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E = cfg.get("num_local_experts", cfg.get("num_experts"))  # find_hparam(["num_local_experts", "num_experts"])
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, n)
    tensors, experts = [], {}
    for name, t in load_file(str(hf_dir / "model.safetensors")).items():
        if arch in ("llama", "mistral3") and re.search(r"[qk]_proj\.(weight|bias)$", name):  # undo_permute = True
            t = _permute(t, H if "q_proj" in name else K)
        if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name):  # Qwen2MoeModel
            experts.setdefault(int(m[1]), {})[(m[3], int(m[2]))] = t
            if len(experts[int(m[1])]) == 3 * E:
                for w in ("down_proj", "gate_proj", "up_proj"):
                    stack = np.stack([experts[int(m[1])][w, e] for e in range(E)])
                    tensors.append((f"model.layers.{m[1]}.mlp.experts.{w}.weight", stack))
            continue
        tensors.append((name, t))
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if arch in ("llama", "mistral3") and rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        tensors.append(("rope_freqs.weight", llama3_factors(cfg.get("head_dim") or cfg["hidden_size"] // H,
                                                            rope.get("rope_theta", cfg.get("rope_theta")), rope,
                                                            cfg.get("original_max_position_embeddings", 8192))))
    w = gguf.GGUFWriter(str(path), arch)
    for name, t in tensors:
        new = name if name == "rope_freqs.weight" else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"gguf-py has no {arch} name for {name}"
        # prepare_tensors: 1-D tensors, norms and the MoE router stay F32
        q = F32 if t.ndim <= 1 or new.endswith("_norm.weight") or ".ffn_gate_inp." in new else qtype
        w.add_tensor(new, gguf.quants.quantize(t.astype(np.float32), q), raw_dtype=q)
    # TextModel.set_gguf_parameters (+ LlamaModel's vocab size and rope dimension, Qwen2MoeModel's expert width)
    w.add_name(hf_dir.name)
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if E is not None:
        w.add_expert_count(E)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch in ("llama", "mistral3"):
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // H)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == F32 else gguf.LlamaFileType.MOSTLY_Q8_0)
    (_vocab_gpt2 if tokenizer == "bpe" else _vocab_spm)(w, hf_dir, cfg["vocab_size"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _vocab_gpt2(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """TextModel._set_vocab_gpt2 / get_vocab_base: ids past the tokenizer padded as [PADi]; added tokens CONTROL if
    special (or <|...|>-looking), else USER_DEFINED; merges, special ids and the chat template by gguf.SpecialVocab."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    reverse, added = {i: t for t, i in tok.get_vocab().items()}, tok.get_added_vocab()
    T, tokens, types = gguf.TokenType, [], []
    for i in range(vocab_size):
        t = reverse.get(i)
        tokens.append(t if t is not None else f"[PAD{i}]")
        types.append(T.UNUSED if t is None else T.NORMAL if t not in added else
                     T.CONTROL if tok.added_tokens_decoder[i].special or (t.startswith("<|") and t.endswith("|>"))
                     else T.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")  # what get_vocab_base_pre's hash names a Qwen2/Qwen3 tokenizer
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)


def _vocab_spm(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    """_set_vocab_sentencepiece: tokenizer model "llama", pre "default", pieces, scores and types, the prefix space
    (add_dummy_prefix) and BOS/EOS/UNK with add_bos_token as Mistral's tokenizer_config says."""
    pieces, scores, types = _spm_pieces()
    assert len(pieces) == vocab_size
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_add_space_prefix(True)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict:
    """name -> (HF model, its directory)."""
    out = {}
    for name, (cfg, _, kind, _) in MODELS.items():
        d = tmp_path_factory.mktemp(name)
        vocab = len(_bpe_tokenizer(d)) + 7 if kind == "bpe" else len(_spm_pieces()[0])  # +7: [PADi] slots
        model = build({**cfg, "vocab_size": vocab}, seed=len(out))
        model.save_pretrained(d)
        out[name] = model, d
    return out


_converted: dict = {}


def converted(hf_models, tmp_path_factory, name: str, qtype) -> tuple[Path, jm.Model]:
    """(GGUF file, our model converted from it), written and converted once per (name, qtype)."""
    if (name, qtype) not in _converted:
        _, d = hf_models[name]
        _, arch, kind, _ = MODELS[name]
        path = write_gguf(d, d / f"{d.name}-{qtype.name}.gguf", arch, qtype, kind)
        dst = converters.convert(path, tmp_path_factory.mktemp(f"{name}-{qtype.name}") / "out", dtype="float32",
                                 progress=False)
        _converted[name, qtype] = path, jm.load(dst)
    return _converted[name, qtype]


IDS = np.array([[5, 77, 120, 3, 250, 9, 41, 200, 18, 66, 131, 2, 90, 14],
                [260, 1, 33, 150, 12, 99, 7, 180, 222, 6, 55, 140, 37, 208]], np.int32)


def _hf_gguf_model(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager").eval()


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(MODELS))
def test_f32_gguf_matches_the_hf_model(hf_models, tmp_path_factory, name):
    """llama.cpp's F32 conversion is lossless for these configs: our import gives the HF model's logits."""
    model, _ = hf_models[name]
    _, ours = converted(hf_models, tmp_path_factory, name, F32)
    assert ours.config.family == FAMILY[name]
    delta = np.abs(np.asarray(jm.forward(ours, IDS)) - logits(model, IDS)).max()
    assert delta <= TOL, f"{name}: max |Δ| = {delta:.2e} against the HF model"


@pytest.mark.parametrize("qtype", [F32, Q8_0], ids=["F32", "Q8_0"])
@pytest.mark.parametrize("name", [n for n, m in MODELS.items() if m[3]])
def test_gguf_matches_transformers_loading_it(hf_models, tmp_path_factory, name, qtype):
    path, ours = converted(hf_models, tmp_path_factory, name, qtype)
    ref = _hf_gguf_model(path)
    delta = np.abs(np.asarray(jm.forward(ours, IDS)) - logits(ref, IDS)).max()
    assert delta <= TOL, f"{name} {qtype.name}: max |Δ| = {delta:.2e} against transformers on the same file"
    if qtype != F32:  # the quantization is real: the logits moved away from the unquantized model's
        assert np.abs(logits(ref, IDS) - logits(hf_models[name][0], IDS)).max() > 1e-3


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "mistral"])
def test_tokenizer_matches_transformers(hf_models, tmp_path_factory, name):
    path, ours = converted(hf_models, tmp_path_factory, name, F32)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours.tokenizer is not None and ours.tokenizer.chat_template
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == ref(text)["input_ids"], text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
        assert ours.tokenizer.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    if MODELS[name][2] == "bpe":  # and the tokenizer the model was trained with (the GGUF lost nothing)
        for text in TEXTS:
            assert ours.tokenizer.encode(text) == transformers.AutoTokenizer.from_pretrained(hf_models[name][1])(
                text)["input_ids"], text


def test_what_llama_cpp_drops_is_not_invented(hf_models, tmp_path_factory):
    """Qwen2's use_sliding_window and Mistral's sliding window are not in the file: full attention, as llama.cpp
    runs it; Qwen3-MoE's routing weights renormalised (llama.cpp's graph always does)."""
    assert MODELS["qwen2"][0]["use_sliding_window"]
    for name in ("qwen2", "mistral"):
        cfg = converted(hf_models, tmp_path_factory, name, F32)[1].config
        assert all(layer.attention.window is None for layer in cfg.layers), name
    moe = converted(hf_models, tmp_path_factory, "qwen3_moe", F32)[1].config
    assert all(layer.mlp.kind == "moe" and layer.mlp.renormalize for layer in moe.layers)


def test_experts_are_read_one_at_a_time(hf_models, tmp_path_factory):
    """A stacked ffn_*_exps tensor is listed per expert under its HF name; each expert's bytes add up to the
    tensor's, and its values are that expert's rows (Q8_0 blocks never straddle two experts)."""
    path, _ = converted(hf_models, tmp_path_factory, "qwen3_moe", Q8_0)
    reader = GGUFReader(path)
    stacked = next(t for t in reader.reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    full = gguf.quants.dequantize(stacked.data, stacked.tensor_type)
    E = MODELS["qwen3_moe"][0]["num_experts"]
    names = [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(E)]
    assert sum(reader.nbytes(n) for n in names) == stacked.data.nbytes
    for e, n in enumerate(names):
        assert reader.shape(n) == full.shape[1:]
        np.testing.assert_array_equal(reader.get(n), full[e])
    assert not any("exps" in k for k in reader.keys())


def test_unsupported_gguf_variants_are_named(tmp_path):
    """A Mixtral-style llama file (experts) and Ministral3's attention temperature are refused by name."""
    for arch, key, value, match in (("llama", "llama.expert_count", 8, "expert_count"),
                                    ("mistral3", "mistral3.attention.temperature_scale", 0.1, "temperature_scale")):
        path = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        for k, v in (("block_count", 1), ("embedding_length", 64), ("attention.head_count", 4)):
            w.add_uint32(f"{arch}.{k}", v)
        w.add_uint32(key, value) if isinstance(value, int) else w.add_float32(key, value)
        w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(NotImplementedError, match=match):
            GGUFReader(path)


@pytest.mark.parametrize("dim,theta,rope", [
    (128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # Llama 3.1 8B
                     "original_max_position_embeddings": 8192}),
    (64, 500000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # Llama 3.2 1B
                    "original_max_position_embeddings": 8192}),
    (16, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # one blended frequency
                    "original_max_position_embeddings": 8192}),
    (16, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,  # none blended
                    "original_max_position_embeddings": 64})])
def test_llama3_scaling_is_recovered_from_rope_freqs(tmp_path, dim, theta, rope):
    """rope_freqs.weight -> a llama3 rope_scaling whose inverse frequencies are the original parameters' (fp32)."""
    path = tmp_path / "llama3.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for k, v in (("block_count", 1), ("embedding_length", 4 * dim), ("attention.head_count", 4),
                 ("attention.head_count_kv", 4), ("feed_forward_length", 64), ("vocab_size", 8)):
        w.add_uint32(f"llama.{k}", v)
    w.add_rope_freq_base(theta)
    w.add_tensor("rope_freqs.weight", llama3_factors(dim, theta, rope, rope["original_max_position_embeddings"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = GGUFReader(path)
    assert "rope_freqs.weight" not in reader.keys()  # read into the config, not a parameter
    ours = families.config_from_hf(reader.hf_config).layers[0].attention.rope
    want = families.config_from_hf({**reader.hf_config, "rope_scaling": {"rope_type": "llama3", **rope}})
    np.testing.assert_allclose(inv_freq(ours, dim)[0], inv_freq(want.layers[0].attention.rope, dim)[0], rtol=2e-6)
    assert not np.allclose(inv_freq(ours, dim)[0], inv_freq(dataclasses.replace(ours, kind="default"), dim)[0])


def test_qwen2_family_from_hf_safetensors(tmp_path):
    """The qwen2 family these files import as also reads HF's own checkpoints, sliding layers included (layers
    i >= max_window_layers slide when use_sliding_window): logits past the window equal HF's."""
    cfg = {**MODELS["qwen2"][0], "vocab_size": 256, "sliding_window": 4, "max_window_layers": 1}
    model = build(cfg)
    model.save_pretrained(tmp_path)
    ours = jm.load(tmp_path)
    assert [layer.attention.window for layer in ours.config.layers] == [None, 4]
    ids = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
    delta = np.abs(np.asarray(jm.forward(ours, ids)) - logits(model, ids)).max()
    assert delta <= TOL, f"max |Δ| = {delta:.2e}"
