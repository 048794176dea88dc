"""GGUF files (llama.cpp): metadata -> HF-style config, tensors -> HF names, tokenizer -> `tokenizers`.

The header is parsed here (`GGUFFile`, memory-mapped); the `gguf` library dequantizes the tensors.

What llama.cpp's converter (convert_hf_to_gguf.py, `conversion/*.py`) changed on the way in is undone here, so the
tensors this reader yields are exactly what the HF checkpoint holds (dequantized). Per architecture (`ARCHS`):
- llama (also what llama.cpp writes for MistralForCausalLM / Mixtral: there is no `mistral` arch) and mistral3
  (Mistral3 / Ministral3 text): Q/K rows (and biases) permuted for llama.cpp's interleaved RoPE kernel
  (`LlamaModel.permute`, `undo_permute = True`) -> permuted back.
- qwen2, qwen3, qwen3moe: no permutation (llama.cpp runs them with NeoX RoPE, as HF). qwen2 carries q/k/v biases,
  qwen3 per-head q/k RMS norms (`attn_q_norm`, `attn_k_norm`). qwen3moe stacks each layer's experts into one
  tensor per projection (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps`, [experts, out, in]; router
  `ffn_gate_inp`): read back one expert at a time under its HF name.
- gemma3: every RMSNorm weight (input/post-attention/pre-/post-feedforward, q/k norms, final norm) stored as w+1,
  because llama.cpp's norm multiplies by the weight itself where Gemma multiplies by (1 + w) -> 1 subtracted. Q/K
  are not permuted for Gemma (llama.cpp's Gemma converters never call its permute; transformers' agrees).
- Llama 3.x RoPE scaling is written as `rope_freqs.weight`, one divisor per frequency: read back into the llama3
  rope_scaling that gives those divisors (`_llama3_scaling`; transformers drops the tensor and runs unscaled).
What llama.cpp drops is not in the file and is not invented here: a GGUF runs as llama.cpp runs it. Its qwen2 /
qwen3 / llama graphs have no sliding window (Mistral 7B v0.1's 4096 and Qwen's use_sliding_window are dropped:
full attention), and its qwen3moe graph always renormalises the top-k routing weights (norm_topk_prob = True, as
transformers assumes too).
Tokenizers (`tokenizer()`), built to match what `transformers` builds from the same file: byte-level BPE
(`tokenizer.ggml.model == "gpt2"`) with the pre-tokenizer `tokenizer.ggml.pre` names (Qwen2's, Llama 3's, Tekken's
... splits); SentencePiece BPE (`"llama"`: Llama 2 / Mistral style, merges rebuilt from the scores; Gemma's variant
on a gemma arch). Any other tokenizer model is logged and left out (`tokenizer()` returns None: generate() then
takes token ids).
"""
from __future__ import annotations

import logging
import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import tokenizers
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from converters.safetensors_io import CheckpointError
from jaxmodels import files
from jaxmodels.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_ATTN_MLP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QKV_BIAS = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
             "attn_v.bias": "self_attn.v_proj.bias"}
_OUT_BIAS = {"attn_output.bias": "self_attn.o_proj.bias"}
_QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_LLAMA = {**_ATTN_MLP, **_QKV_BIAS, **_OUT_BIAS, "ffn_norm.weight": "post_attention_layernorm.weight"}


@dataclass(frozen=True)
class Arch:
    """What llama.cpp wrote for one `general.architecture`, and the HF model it came from."""

    model_type: str  # the HF model_type (our family) the file imports as
    layer_names: dict[str, str]  # GGUF blk.N.<name> -> HF model.layers.N.<name>
    permuted_qk: bool = False  # Q/K rows (and biases) permuted by LlamaModel.permute
    norm_offset: float = 0.0  # what llama.cpp added to every "*norm.weight"
    experts: dict[str, str] = field(default_factory=dict)  # stacked blk.N.<name> -> per-expert HF name ({e})


ARCHS = {
    "llama": Arch("llama", _LLAMA, permuted_qk=True),
    # Mistral3ForConditionalGeneration / Ministral3ForCausalLM text (llama.cpp's Mistral3Model: a LlamaModel)
    "mistral3": Arch("mistral", _LLAMA, permuted_qk=True),
    "qwen2": Arch("qwen2", {**_ATTN_MLP, **_QKV_BIAS, "ffn_norm.weight": "post_attention_layernorm.weight"}),
    "qwen3": Arch("qwen3", {**_LLAMA, **_QK_NORM}),
    "qwen3moe": Arch(
        "qwen3_moe",
        {**{k: v for k, v in _LLAMA.items() if not k.startswith("ffn_")}, **_QK_NORM,
         "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate_inp.weight": "mlp.gate.weight"},
        experts={"ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
                 "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
                 "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"}),
    # gguf-py's MODEL_ARCH.GEMMA3 tensor map, read backwards (checked with gguf 0.19's get_tensor_name_map); a
    # Gemma3 GGUF holds the text decoder only
    "gemma3": Arch("gemma3_text", {**_ATTN_MLP, **_QK_NORM,
                                   "post_attention_norm.weight": "post_attention_layernorm.weight",
                                   "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                                   "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}, norm_offset=1.0),
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}

# llama.cpp's byte-level pre-tokenizers, by `tokenizer.ggml.pre`: the regex split each names (llama-vocab.cpp;
# transformers' GGUF_PRE_TOKENIZER_SPLITS agrees), then the byte-level mapping
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}
# the rest: GPT-2's own split inside ByteLevel (llama.cpp's "default" / "gpt-2"); SmolLM splits digits first
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
    """`keys()`, `shape(name)`, `get(name)`, `nbytes(name)` over HF tensor names; `hf_config` and `tokenizer()`.

    A stacked expert tensor (`blk.N.ffn_gate_exps.weight`, [experts, out, in]) is listed once per expert under the
    HF per-expert name, and read one expert's rows at a time (quantized blocks never straddle two experts)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = GGUFFile(self.path)
        self.arch = self._field("general.architecture")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown architecture {self.arch!r} in {self.path.name}; "
                             f"supported GGUF architectures: {', '.join(ARCHS)}")
        self.spec = ARCHS[self.arch]
        self.hf_config = self._config()
        self._tensors: dict[str, tuple[GGUFTensor, int | None]] = {}  # HF name -> (tensor, expert index)
        for t in self.reader.tensors:
            m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
            if m and m.group(2) in self.spec.experts:
                if len(t.dims) != 3:
                    raise CheckpointError(f"{self.path.name}: {t.name} has shape {list(reversed(t.dims))}, expected "
                                          f"[experts, rows, columns]")
                for e in range(t.dims[2]):
                    self._tensors[f"model.layers.{m.group(1)}." + self.spec.experts[m.group(2)].format(e=e)] = (t, e)
            elif t.name != "rope_freqs.weight":  # read into the config (_llama3_scaling)
                self._tensors[self._hf_name(t.name)] = (t, None)

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
        if m and m.group(2) in self.spec.layer_names:
            return f"model.layers.{m.group(1)}.{self.spec.layer_names[m.group(2)]}"
        return f"gguf:{name}"  # unknown: the importer reports it as an unexpected tensor

    def _config(self) -> dict:
        a = self.arch
        g = lambda k, d=None: self._field(f"{a}.{k}", d)  # noqa: E731
        heads = g("attention.head_count")
        names = {t.name for t in self.reader.tensors}
        tokens = self._field("tokenizer.ggml.tokens")
        cfg = {
            "model_type": self.spec.model_type,
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
        if (v := g("attention.value_length")) is not None and v != cfg["head_dim"]:
            raise CheckpointError(f"{self.path.name}: {a}.attention.value_length {v} != key_length {cfg['head_dim']}; "
                                  f"{a} needs equal key and value head sizes")
        if (rope_dim := g("rope.dimension_count")) is not None and rope_dim != cfg["head_dim"]:
            raise CheckpointError(f"{self.path.name}: {a}.rope.dimension_count {rope_dim} != head size "
                                  f"{cfg['head_dim']}: partial rotary embeddings are not supported for {a}")
        if g("attention.temperature_scale") is not None:  # Ministral3's llama_4_scaling
            raise NotImplementedError(f"{self.path.name}: {a}.attention.temperature_scale (Llama-4-style attention "
                                      f"temperature scaling, Ministral 3) is not supported yet")
        if (n := g("expert_count")) and not self.spec.experts:
            raise NotImplementedError(f"{self.path.name}: {a} with {a}.expert_count = {n} (a mixture of experts, e.g. "
                                      f"Mixtral) is not supported yet")
        scaling = None
        kind = g("rope.scaling.type")
        if kind and kind != "none":
            scaling = {"rope_type": kind, "factor": g("rope.scaling.factor", 1.0),
                       "original_max_position_embeddings": g("rope.scaling.original_context_length")}
            for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                ("yarn_attn_factor", "attention_factor")):
                if (v := g(f"rope.scaling.{key}")) is not None:
                    scaling[hf_key] = v
        if a == "gemma3":
            cfg.update(self._gemma3_config(g, cfg, scaling))
            return cfg
        cfg["rope_theta"] = g("rope.freq_base", 10000.0)
        if "rope_freqs.weight" in names:  # Llama 3.1+: llama.cpp writes the llama3 scaling as per-frequency factors
            if scaling:
                raise CheckpointError(f"{self.path.name}: both rope_freqs.weight and {a}.rope.scaling.type {kind!r}")
            scaling = self._llama3_scaling(cfg["rope_theta"], cfg["head_dim"])
        if scaling:
            cfg["rope_scaling"] = scaling
        if a in ("llama", "mistral3"):
            cfg["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
        if a in ("qwen2", "qwen3", "qwen3moe", "mistral3"):  # llama.cpp's graphs have no sliding window
            cfg["use_sliding_window"], cfg["sliding_window"] = False, None
        if a == "qwen3":
            cfg["attention_bias"] = any(n.endswith("attn_q.bias") for n in names)
        if a == "qwen3moe":
            cfg.update(self._moe_config(g, names))
        return cfg

    def _llama3_scaling(self, theta: float, head_dim: int) -> dict | None:
        """The llama3 rope_scaling that gives `rope_freqs.weight`'s factors (LlamaModel.generate_extra_tensors: each
        frequency divided by 1 above the high-frequency wavelength, by `factor` below the low-frequency one, by a
        smooth blend between). llama3's parameters enter only through the two wavelengths and the blend's line in
        1/wavelength, so an equivalent set is recovered from the factors and checked to reproduce them all; None if
        every factor is 1. transformers ignores this tensor (it runs such a file unscaled, unlike llama.cpp)."""
        t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
        f = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        if f.shape != (head_dim // 2,) or not np.all(np.isfinite(f)) or f.min() <= 0:
            raise CheckpointError(f"{self.path.name}: rope_freqs.weight has shape {list(f.shape)} or values that are "
                                  f"not per-frequency factors (expected {head_dim // 2} positive numbers)")
        if np.allclose(f, 1.0, rtol=0, atol=1e-7):
            return None
        wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
        factor = float(f.max())
        high, low = f <= 1 + 1e-6, f >= factor * (1 - 1e-6)  # unscaled / fully scaled bands
        mid = ~(high | low)
        blend = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)  # 1/f = (1 - s) / factor + s
        inv_hi = inv_lo = None  # 1 / the high- and low-frequency wavelengths
        if mid.sum() >= 2:  # s = (1/w - 1/Wl) / (1/Wh - 1/Wl): a line in 1/w
            slope, icpt = np.polyfit(1 / wavelen[mid], blend, 1)
            if slope > 0:
                inv_lo = -icpt / slope
                inv_hi = inv_lo + 1 / slope
        else:  # any wavelengths between the bands reproduce the factors; a single blended point fixes the low one
            below = wavelen[high].max() if high.any() else wavelen.min() / 2
            above = wavelen[~high].min() if (~high).any() else wavelen.max() * 2
            if mid.any():
                inv_hi = 1 / np.sqrt(below * above)
                inv_lo = (1 / wavelen[mid][0] - blend[0] * inv_hi) / (1 - blend[0])
            else:  # no blend: Wh < Wl, both in the gap
                inv_hi, inv_lo = 1 / (below ** (2 / 3) * above ** (1 / 3)), 1 / (below ** (1 / 3) * above ** (2 / 3))
        old = 8192  # any context length: llama3 uses it only over low_freq_factor and high_freq_factor
        out = None
        if inv_hi is not None and 0 < inv_lo < inv_hi:
            out = {"rope_type": "llama3", "factor": factor, "low_freq_factor": old * inv_lo,
                   "high_freq_factor": old * inv_hi, "original_max_position_embeddings": old}
            s = (1 / wavelen - inv_lo) / (inv_hi - inv_lo)
            again = np.where(wavelen < 1 / inv_hi, 1.0, np.where(wavelen > 1 / inv_lo, factor,
                                                                 1 / ((1 - s) / factor + s)))
            if not np.allclose(again, f, rtol=1e-5, atol=0):
                out = None
        if out is None:
            raise NotImplementedError(f"{self.path.name}: rope_freqs.weight {np.round(f, 4).tolist()} is not a llama3 "
                                      f"RoPE scaling; other per-frequency factors are not supported yet")
        return out

    def _moe_config(self, g, names: set[str]) -> dict:
        """llama.cpp's Qwen3-MoE graph: every layer sparse, softmax over all experts, top-k renormalised."""
        n, E, k = g("block_count"), g("expert_count"), g("expert_used_count")
        if not E or not k:
            raise CheckpointError(f"{self.path.name}: qwen3moe needs qwen3moe.expert_count and expert_used_count")
        dense = [i for i in range(n) if f"blk.{i}.ffn_gate_exps.weight" not in names]
        if dense:  # llama.cpp's converter cannot write one (its qwen3moe tensor list has no dense FFN)
            raise CheckpointError(f"{self.path.name}: layers {dense} have no experts (blk.N.ffn_gate_exps.weight); "
                                  f"llama.cpp's qwen3moe has only sparse layers")
        if (func := g("expert_gating_func")) not in (None, 1):  # gguf ExpertGatingFuncType.SOFTMAX
            raise NotImplementedError(f"{self.path.name}: qwen3moe.expert_gating_func {func} (only softmax)")
        ffn = g("expert_feed_forward_length")
        if ffn is None:  # older files: the experts' width from the tensor itself
            ffn = int(next(t for t in self.reader.tensors if t.name == "blk.0.ffn_gate_exps.weight").dims[1])
        return {"num_experts": E, "num_experts_per_tok": k, "moe_intermediate_size": ffn, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": [],
                "intermediate_size": g("feed_forward_length") or ffn}

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
        t, e = self._tensors[name]
        dims = tuple(reversed(t.dims))  # GGUF lists dims innermost first
        return dims if e is None else dims[1:]

    def held_bytes(self, name: str) -> int:
        """What get(name) holds (hf.read_bytes): at most float32 (the gguf library dequantises to it)."""
        return math.prod(self.shape(name)) * 4

    def nbytes(self, name: str) -> int:
        t, e = self._tensors[name]
        return t.data.nbytes if e is None else t.data[e].nbytes

    def get(self, name: str) -> np.ndarray:
        t, e = self._tensors[name]
        w = gguf.quants.dequantize(t.data if e is None else t.data[e], t.tensor_type).reshape(self.shape(name))
        if self.spec.permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            c = self.hf_config
            n = c["num_attention_heads"] if "q_proj" in name else c["num_key_value_heads"]
            if w.shape[0] % (2 * n):
                raise CheckpointError(f"{self.path.name}: {name} has {w.shape[0]} rows, not a multiple of 2 x {n} "
                                      f"heads")
            # llama.cpp stored rows as reshape(n, 2, d/2).swapaxes(1, 2); invert that.
            w = w.reshape(n, w.shape[0] // n // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if self.spec.norm_offset and name.endswith("norm.weight"):
            w = (w.astype(np.float32) - np.float32(self.spec.norm_offset)).astype(w.dtype)
        return w

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]  # quantized blocks are dequantized whole

    # ------------------------------------------------------------------------------- tokenizer
    def tokenizer(self) -> Tokenizer | None:
        kind = self._field("tokenizer.ggml.model")
        tokens = self._field("tokenizer.ggml.tokens")
        if tokens is None:
            log.warning("%s: no tokenizer.ggml.tokens; converting without a tokenizer (generate() then takes token "
                        "ids)", self.path.name)
            return None
        if kind == "gpt2":
            tok = self._byte_level_bpe()
        elif kind == "llama" and self.arch in GEMMA_SPM_ARCHS:
            tok = self._gemma_spm()
        elif kind == "llama":
            tok = self._llama_spm()
        else:
            log.warning("%s: GGUF tokenizer model %r (arch %r) is not supported yet; converting without a "
                        "tokenizer (generate() then takes token ids)", self.path.name, kind, self.arch)
            return None
        types = self._field("tokenizer.ggml.token_type") or []
        # Control tokens are special (matched whole, dropped on decode). In a byte-level vocabulary every real token
        # is spelled in the byte alphabet: one marked control that is not is a llama.cpp mislabel, left out as
        # transformers does (adding it would grow the vocabulary).
        alphabet = set(pre_tokenizers.ByteLevel.alphabet()) if kind == "gpt2" else None
        tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
                                if ty == CONTROL and (alphabet is None or set(t) <= alphabet)])
        # Added but not special (Qwen3's <think>, Gemma's <start_of_image>-style markers): llama.cpp matches them
        # whole in text and keeps them on decode. As transformers does, only those the vocabulary holds as spelled.
        vocab = tok.get_vocab()
        tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])
        bos, eos = (self._token_id(f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("bos", "eos"))
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = self._field("tokenizer.ggml.add_bos_token", kind == "llama")
        return Tokenizer(tok, self._field("tokenizer.chat_template"), None if bos is None else tokens[bos],
                         None if eos is None else tokens[eos], bool(add_bos))

    def _byte_level_bpe(self) -> tokenizers.Tokenizer:
        """Byte-level BPE as transformers builds it from a GGUF (`byte_level_tokenizer` + the split of
        `tokenizer.ggml.pre`): a token not spelled in the byte alphabet (llama.cpp stores added tokens as text) is
        respelled byte by byte; the pre-tokenizer is the regex split llama.cpp uses for that name, then the byte
        mapping (GPT-2's own split for "default" and names without a regex of their own)."""
        tokens = self._field("tokenizer.ggml.tokens")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges") or []]
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        pre = self._field("tokenizer.ggml.pre", "default")
        if pre in PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            if pre not in BYTE_LEVEL_PRE:
                log.warning("%s: byte-level pre-tokenizer %r is not known here; splitting text as GPT-2 does "
                            "(token ids may differ from llama.cpp's on some text)", self.path.name, pre)
            tok.pre_tokenizer = pre_tokenizers.Sequence(BYTE_LEVEL_PRE.get(pre, BYTE_LEVEL_PRE["default"]))
        tok.decoder = decoders.ByteLevel()
        return tok

    def _llama_spm(self) -> tokenizers.Tokenizer:
        """SentencePiece BPE (Llama 2, Mistral 7B, TinyLlama ...) as transformers builds it from a GGUF
        (`sentencepiece_tokenizer` + `LlamaTokenizer`): the merges from the file, or else rebuilt from the scores
        (every split of a token into two vocabulary tokens, best score first, then the longer left part, as
        transformers' `generate_merges`); a "▁" prefix before the text (llama.cpp: `tokenizer.ggml.add_space_prefix`,
        on unless the file says otherwise), spaces as "▁", byte fallback for characters not in the vocabulary."""
        tokens = self._field("tokenizer.ggml.tokens")
        if (merges := self._field("tokenizer.ggml.merges")) is not None:
            merges = [tuple(m.split(" ", 1)) for m in merges]
        else:
            scores = self._field("tokenizer.ggml.scores")
            if scores is None or len(scores) != len(tokens):
                raise CheckpointError(f"{self.path.name}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one "
                                      f"per token ({len(tokens)})")
            merges = _merges_from_scores(tokens, scores)
        unk = self._token_id("tokenizer.ggml.unknown_token_id", len(tokens))
        tok = tokenizers.Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                              fuse_unk=True, byte_fallback=True, dropout=None,
                                              unk_token=None if unk is None else tokens[unk]))
        prefix = bool(self._field("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                     prepend_scheme="first" if prefix else "never")
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
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


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: each split of a token into two vocabulary tokens, ordered by the
    token's score (highest first), then the left and right parts' lengths (longest first); ties keep the file's
    order. The same dicts and stable sorts as transformers' `generate_merges`, so the order is the same."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for t, score in dict(zip(tokens, scores)).items():
        local = [(t[:k], t[k:], score) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += local
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    extra = (b for b in range(256) if b not in keep)
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}
