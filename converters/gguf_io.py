"""GGUF files (llama.cpp): metadata -> HF-style config, tensors -> HF names, tokenizer -> `tokenizers`.

The header is parsed here (`GGUFFile`, memory-mapped); the `gguf` library dequantizes the tensors.

What llama.cpp's converter changed on the way in is undone here, so the tensors this reader yields are
exactly what the HF checkpoint holds (dequantized):
- llama arch: Q/K rows permuted for llama.cpp's interleaved RoPE kernel -> permuted back.
- gemma3 arch: every RMSNorm weight (input/post-attention/pre-/post-feedforward, q/k norms, final norm)
  stored as w+1, because llama.cpp's norm multiplies by the weight itself where Gemma multiplies by
  (1 + w) -> 1 subtracted. Q/K are not permuted for Gemma (llama.cpp's Gemma converters never call
  its permute; transformers' Gemma2 tensor processor agrees).
Tokenizers: byte-level BPE (`tokenizer.ggml.model == "gpt2"`) and Gemma's SentencePiece BPE
(`"llama"` on a gemma arch), built to match what `transformers` builds from the same file. Any other
tokenizer model is logged and left out (`tokenizer()` returns None: generate() then takes token ids).
"""
from __future__ import annotations

import logging
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from converters.safetensors_io import CheckpointError
from jaxmodels import files
from jaxmodels.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_LLAMA_ATTN_MLP = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
LAYER_NAMES = {  # GGUF blk.N.<name> -> HF model.layers.N.<name>, per architecture
    "llama": {
        **_LLAMA_ATTN_MLP,
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.bias": "self_attn.q_proj.bias",
        "attn_k.bias": "self_attn.k_proj.bias",
        "attn_v.bias": "self_attn.v_proj.bias",
    },
    # gguf-py's MODEL_ARCH.GEMMA3 tensor map, read backwards (checked with gguf 0.19's get_tensor_name_map)
    "gemma3": {
        **_LLAMA_ATTN_MLP,
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
HF_MODEL_TYPE = {"llama": "llama", "gemma3": "gemma3_text"}  # a Gemma3 GGUF holds the text decoder only
NORM_OFFSET = {"gemma3": 1.0}  # arch -> what llama.cpp added to every "*norm.weight"
# llama.cpp's byte-level pre-tokenizers, by `tokenizer.ggml.pre`
BYTE_LEVEL_PRE = {
    "smollm": [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "default": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
    "gpt-2": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
}
GEMMA_SPM_ARCHS = ("gemma", "gemma2", "gemma3")  # SentencePiece BPE built the Gemma way (see _gemma_spm)
CONTROL, USER_DEFINED = 3, 4  # gguf token types: special tokens, and added tokens matched whole in text


# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 = string and 9 = array are read apart
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_PLAIN = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16,
          gguf.GGMLQuantizationType.F64: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: innermost first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # memory-mapped: plain floats in their shape, or uint8 blocks [..., bytes per row]


class GGUFFile:
    """A GGUF file's metadata and tensor table, read with `struct` straight from a memory map.

    `gguf.GGUFReader` builds several NumPy views per array element: ~30 s for a 262k-token vocabulary.
    This reads the same layout (GGUF v2/v3) in well under a second; tensor data stays memory-mapped and
    is dequantized by `gguf.quants`, as before. Raises CheckpointError for a malformed or truncated file.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(files.regular(path), "rb") as f:
            try:
                self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # empty file
                raise CheckpointError(f"{path}: not a readable GGUF file (empty)") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None

    def _unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v[0] if len(v) == 1 else v

    def _string(self) -> str:
        n = self._unpack("<Q")
        if self._pos + n > len(self._buf):
            raise ValueError("string runs past the end of the file")
        s = self._buf[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])
        if vtype == 8:
            return self._string()
        if vtype == 9:
            etype, count = self._unpack("<IQ")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                arr = np.frombuffer(self._buf, dt, count, self._pos)
                self._pos += count * dt.itemsize
                return arr.tolist()
            return [self._value(etype) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {vtype}")

    def _parse(self) -> None:
        self._pos = 0
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r}")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        table = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            dims = tuple(int(d) for d in struct.unpack_from(f"<{n_dims}Q", self._buf, self._pos))
            self._pos += 8 * n_dims
            ttype, offset = self._unpack("<IQ")
            table.append((name, dims, gguf.GGMLQuantizationType(ttype), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        whole = np.frombuffer(self._buf, np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in table:
            n = int(np.prod(dims))
            block, size = gguf.GGML_QUANT_SIZES[ttype]
            nbytes = n * size // block
            begin = start + offset
            if begin + nbytes > len(whole):
                raise ValueError(f"tensor {name!r} ends at byte {begin + nbytes}, past the end of the file "
                                 f"({len(whole)} bytes): truncated")
            raw = whole[begin:begin + nbytes]
            shape = tuple(reversed(dims))
            if ttype in _PLAIN:
                data = raw.view(_PLAIN[ttype]).reshape(shape)
            else:
                data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, ttype))
            self.tensors.append(GGUFTensor(name, dims, ttype, data))
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicated tensor names")


class GGUFReader:
    """`keys()`, `shape(name)`, `get(name)` over HF tensor names; `hf_config` and `tokenizer()`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFFile(self.path)
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
        return self.reader.fields.get(key, default)

    def _token_id(self, key: str, vocab_size: int | None) -> int | None:
        """Metadata field `key`, a token id (or absent), checked against the vocabulary."""
        i = self._field(key)
        if i is not None and vocab_size is not None and not (isinstance(i, int) and 0 <= i < vocab_size):
            raise CheckpointError(f"{self.path.name}: {key} = {i!r} is not a token id (vocabulary of {vocab_size})")
        return i

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
        tokens = self._field("tokenizer.ggml.tokens")
        cfg = {
            "model_type": HF_MODEL_TYPE[a],
            "vocab_size": g("vocab_size") or (len(tokens) if tokens is not None else None),
            "hidden_size": g("embedding_length"),
            "intermediate_size": g("feed_forward_length"),
            "num_hidden_layers": g("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": g("attention.head_count_kv", heads),
            "head_dim": g("attention.key_length") or g("embedding_length") // heads,
            "rms_norm_eps": g("attention.layer_norm_rms_epsilon", 1e-5),
            "max_position_embeddings": g("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in names,
            "pad_token_id": self._field("tokenizer.ggml.padding_token_id"),
        }
        if cfg["vocab_size"] is None and "token_embd.weight" in names:
            cfg["vocab_size"] = int(next(t for t in self.reader.tensors if t.name == "token_embd.weight").dims[1])
        for k in ("bos_token_id", "eos_token_id"):
            cfg[k] = self._token_id(f"tokenizer.ggml.{k}", cfg["vocab_size"])
        scaling = None
        kind = g("rope.scaling.type")
        if kind and kind != "none":
            scaling = {"rope_type": kind, "factor": g("rope.scaling.factor", 1.0),
                       "original_max_position_embeddings": g("rope.scaling.original_context_length")}
        if a == "gemma3":
            cfg.update(self._gemma3_config(g, cfg, scaling))
        else:
            cfg["rope_theta"] = g("rope.freq_base", 10000.0)
            if scaling:
                cfg["rope_scaling"] = scaling
        return cfg

    def _gemma3_config(self, g, cfg: dict, scaling: dict | None) -> dict:
        """What llama.cpp's Gemma3 graph assumes beyond the generic keys (llama-model.cpp, LLM_ARCH_GEMMA3):
        with a sliding window in the file, every 6th layer global and the rest sliding, local RoPE base
        10000 and unscaled; without one, all layers global. Query scale 1/sqrt(head_dim), except the
        27B (62 layers): 1/sqrt(hidden/heads). Final softcap only if the file has one."""
        n = cfg["num_hidden_layers"]
        window = g("attention.sliding_window") or None
        types = ["sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n)]
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if n == 62 else cfg["head_dim"]
        full = {"rope_type": "default", "rope_theta": g("rope.freq_base", 1000000.0)}
        if scaling:  # the global layers only (rope_freq_scale_train_swa = 1)
            full.update({k: v for k, v in scaling.items() if v is not None})
        if (v := g("attention.value_length")) is not None and v != cfg["head_dim"]:
            raise CheckpointError(f"{self.path.name}: gemma3.attention.value_length {v} != key_length "
                                  f"{cfg['head_dim']}; Gemma3 needs equal key and value head sizes")
        return {
            "hidden_activation": "gelu_pytorch_tanh",
            "sliding_window": window,
            "layer_types": types,
            "query_pre_attn_scalar": scalar,
            "rope_parameters": {"full_attention": full,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            "final_logit_softcapping": g("final_logit_softcapping") or None,
        }

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed(self._tensors[name].dims))  # GGUF lists dims innermost first

    def nbytes(self, name: str) -> int:
        return self._tensors[name].data.nbytes

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            c = self.hf_config
            n = c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"]
            # llama.cpp stored rows as reshape(n, 2, d/2).swapaxes(1, 2); invert that.
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if self.arch in NORM_OFFSET and name.endswith("norm.weight"):
            w = (w.astype(np.float32) - np.float32(NORM_OFFSET[self.arch])).astype(w.dtype)
        return w

    # ------------------------------------------------------------------------------- tokenizer
    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]  # quantized blocks are dequantized whole

    def tokenizer(self) -> Tokenizer | None:
        kind = self._field("tokenizer.ggml.model")
        if kind == "gpt2":
            tok = self._byte_level_bpe()
        elif kind == "llama" and self.arch in GEMMA_SPM_ARCHS:
            tok = self._gemma_spm()
        else:
            log.warning("%s: GGUF tokenizer model %r (arch %r) is not supported yet; converting without a "
                        "tokenizer (generate() then takes token ids)", self.path.name, kind, self.arch)
            return None
        tokens = self._field("tokenizer.ggml.tokens")
        types = self._field("tokenizer.ggml.token_type") or []
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == CONTROL])
        if kind == "llama":
            # Added but not special, like <start_of_image>-style markers: matched whole, kept on decode.
            # As transformers does, only those the (respelled) vocabulary holds.
            vocab = tok.get_vocab()
            tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
        bos, eos = (self._token_id(f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("bos", "eos"))
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = self._field("tokenizer.ggml.add_bos_token", kind == "llama")
        return Tokenizer(tok, self._field("tokenizer.chat_template"), None if bos is None else tokens[bos],
                         None if eos is None else tokens[eos], bool(add_bos))

    def _byte_level_bpe(self) -> tokenizers.Tokenizer:
        tokens = self._field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges")]
        tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              ignore_merges=False))
        pre = self._field("tokenizer.ggml.pre", "default")
        tok.pre_tokenizer = pre_tokenizers.Sequence(BYTE_LEVEL_PRE.get(pre, BYTE_LEVEL_PRE["default"]))
        tok.decoder = decoders.ByteLevel()
        return tok

    def _gemma_spm(self) -> tokenizers.Tokenizer:
        """Gemma's SentencePiece BPE as `transformers` builds it from a GGUF (`gemma_tokenizer` in
        integrations/gguf/gguf_tokenizer_mapping.py + `GemmaTokenizer`):

        - tokens of two or more spaces are stored as real spaces; the model looks them up as "▁▁…";
        - the file has no merges: every split of a token into two vocabulary tokens is a merge, ranked by
          the token's position in the file (earlier first; the scores do not follow Gemma's merge order),
          then by the left part's length, longest first;
        - spaces become "▁" in a normalizer, no prefix space, byte fallback for unknown characters.
        """
        tokens = self._field("tokenizer.ggml.tokens")
        spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(spelled)}
        rank = {t: -i for i, t in enumerate(spelled)}  # same dict as transformers': first slot, last index
        merges = []
        for t, r in rank.items():
            for k in range(1, len(t)):
                if t[:k] in vocab and t[k:] in vocab:
                    merges.append((r, k, len(t) - k, t[:k], t[k:]))
        merges.sort(key=lambda m: m[:3], reverse=True)  # keys are unique: the order is fully determined
        unk = self._token_id("tokenizer.ggml.unknown_token_id", len(tokens))
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], fuse_unk=True,
                                              unk_token=tokens[unk] if unk is not None else "<unk>",
                                              dropout=None, byte_fallback=True))
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tok
