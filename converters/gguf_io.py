"""GGUF files (llama.cpp) through the `gguf` library: metadata -> HF-style config, tensors -> HF names.

llama.cpp stores llama-arch Q/K rows permuted for its interleaved RoPE kernel; this reader undoes
that, so the tensors it yields are exactly what the HF checkpoint holds (and dequantized).
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from converters.safetensors_io import CheckpointError
from jaxmodels.tokenizer import Tokenizer

LAYER_NAMES = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>, per architecture
    "llama": {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    },
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# llama.cpp's byte-level pre-tokenizers, by `tokenizer.ggml.pre`
BYTE_LEVEL_PRE = {
    "smollm": [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "default": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "gpt-2": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
}
CONTROL = 3  # gguf token type of special tokens


class GGUFReader:
    """`keys()`, `shape(name)`, `get(name)` over HF tensor names; `hf_config` and `tokenizer()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as e:  # noqa: BLE001 - the gguf parser raises bare ValueErrors / struct errors
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({e})") from None
        self.arch = self._field("general.architecture")
        if self.arch not in LAYER_NAMES:
            raise ValueError(f"unknown architecture {self.arch!r} in {self.path.name}; "
                             f"supported GGUF architectures: {', '.join(LAYER_NAMES)}")
        self.hf_config = self._config()
        self._tensors = {}
        for t in self.reader.tensors:
            name = self._hf_name(t.name)
            self._tensors[name] = t

    def _field(self, key, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _hf_name(self, name: str) -> str:
        if name in GLOBAL_NAMES:
            return GLOBAL_NAMES[name]
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if m and m.group(2) in LAYER_NAMES[self.arch]:
            return f"model.layers.{m.group(1)}.{LAYER_NAMES[self.arch][m.group(2)]}"
        return f"gguf:{name}"  # unknown: the importer reports it as an unexpected tensor

    def _config(self) -> dict:
        a = self.arch
        g = lambda k, d=None: self._field(f"{a}.{k}", d)  # noqa: E731
        heads = g("attention.head_count")
        names = {t.name for t in self.reader.tensors}
        cfg = {
            "model_type": a,
            "vocab_size": g("vocab_size") or len(self._field("tokenizer.ggml.tokens")),
            "hidden_size": g("embedding_length"),
            "intermediate_size": g("feed_forward_length"),
            "num_hidden_layers": g("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": g("attention.head_count_kv", heads),
            "head_dim": g("attention.key_length") or g("embedding_length") // heads,
            "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
            "rope_theta": g("rope.freq_base", 10000.0),
            "max_position_embeddings": g("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
        }
        kind = g("rope.scaling.type")
        if kind and kind != "none":
            cfg["rope_scaling"] = {"rope_type": kind, "factor": g("rope.scaling.factor", 1.0),
                                   "original_max_position_embeddings": g("rope.scaling.original_context_length")}
        return cfg

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(s) for s in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            c = self.hf_config
            n = c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"]
            # llama.cpp stored rows as reshape(n, 2, d/2).swapaxes(1, 2); invert that.
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        return w

    def tokenizer(self) -> Tokenizer:
        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{self.path.name}: GGUF tokenizer model {kind!r} is not supported yet (only byte-level BPE)")
        tokens = self._field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges")]
        tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              ignore_merges=False))
        pre = self._field("tokenizer.ggml.pre", "default")
        tok.pre_tokenizer = pre_tokenizers.Sequence(BYTE_LEVEL_PRE.get(pre, BYTE_LEVEL_PRE["default"]))
        tok.decoder = decoders.ByteLevel()
        types = self._field("tokenizer.ggml.token_type") or []
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
        bos, eos = self._field("tokenizer.ggml.bos_token_id"), self._field("tokenizer.ggml.eos_token_id")
        return Tokenizer(tok, self._field("tokenizer.chat_template"), None if bos is None else tokens[bos],
                         None if eos is None else tokens[eos], bool(self._field("tokenizer.ggml.add_bos_token", False)))
