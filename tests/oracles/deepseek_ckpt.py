"""Tiny random DeepSeek-V4.1 checkpoints in DeepSeek's OWN bare layout (specs/deepseek_v4.md §1.4, §10).

`tiny_config()` is the spec's §1.4 TINY config as an HF-style composite `config.json`;
`write_checkpoint(dir, config, seed)` writes `config.json` + `model.safetensors` with REAL encodings:
dense linears FP8 e4m3 (safetensors `F8_E4M3`) with one E8M0 byte per 32×32 block (`F8_E8M0`),
routed experts MXFP4 (`I8`, low nibble = even element) with one E8M0 per 32 along K, the Engram table FP8
with per-row per-32 E8M0 scales, `wo_a` FP8 too (importers dequantise it). With quantized=False every
linear (experts included, unpacked [O, I]) is BF16 and there is no quantization_config; the Engram table
stays FP8 + E8M0 (the reference's `ParallelEngramEmbedding` is FP8 whatever `dtype` is).

The file is serialised by a small writer of our own (numpy only), readable by `safetensors` 0.8.

Weights follow the tt-metal reference test's recipe (`testing.py`: norm means, fan-in-scaled projections
with per-name gains, embedding RMS 0.12, random E2M1 codes for the experts), with changes so that every
feature visibly acts: attention-norm weights ~1 (so compressor gates and indexer weights are not ~0),
router biases comparable to the score spread (they change some selections), Engram q/k weights O(1)
(gates spread over ~(0.2, 0.8) rather than stuck at 0.5) and an Engram value on the scale of the stream.
"""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from tests.oracles.deepseek_v41 import INV448, _scale_from_fp32, engram_layout


def stub_token_map(vocab: int) -> np.ndarray:
    """The spec's StubTokenizer compressed map (§1.4): token 2k -> "w{k}", 2k+1 -> " W{k}" normalise alike,
    so compressed id = id // 2 (compressed vocab = vocab // 2, pad_id = token_map[2] = 1)."""
    return np.arange(vocab, dtype=np.int64) // 2


def write_word_tokenizer(dir, vocab: int) -> None:
    """tokenizer.json of `vocab` words, "w{i}" and " W{i}" alternating: the pairs Engram's compressed map
    (`stub_token_map`) folds into one id."""
    from tokenizers import Tokenizer, models

    words = {(f"w{i // 2}" if i % 2 == 0 else f" W{i // 2}"): i for i in range(vocab)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(os.path.join(str(dir), "tokenizer.json"))


def tiny_config(version: str = "v4.1", quantized: bool = True, **overrides) -> dict:
    """HF-style config.json dict for §1.4's TINY V4.1 model. `overrides` replace `text_config` keys
    (HF names); `engram_num_embeddings` is re-derived from the prime layout unless overridden."""
    if version != "v4.1":
        raise NotImplementedError("only the V4.1 tiny config is provided")
    text = {
        "vocab_size": 512, "hidden_size": 256, "moe_intermediate_size": 128,
        "num_hidden_layers": 6, "num_nextn_predict_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
        "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "norm_topk_prob": True,
        "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hidden_act": "silu", "rms_norm_eps": 1e-20,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0],  # last entry: the DSpark layer
        "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3, 5],
        "candidate_source_layer_id": 3, "candidate_topk_blocks": 3, "candidate_block_size": 4,
        "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 128,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [0, 1], "engram_max_ngram_size": 4, "engram_vocab_size": 100,
        "engram_n_heads": 2, "engram_head_dim": 32, "engram_compressed_vocab_size": 256,
        "engram_pad_token_id": 2, "engram_pad_id": 2,
        "dspark_block_size": 2, "dspark_noise_token_id": 511, "dspark_target_layer_ids": [4, 5],
        "dspark_markov_rank": 32,
        # not fixed by §1.4 (the reference falls back to the backbone's 4/2); differ on purpose so that a
        # loader taking the DSpark expert count from n_routed_experts fails loudly
        "dspark_n_routed_experts": 8, "dspark_num_experts_per_tok": 3,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    }
    text.update(overrides)
    if "engram_num_embeddings" not in overrides:
        text["engram_num_embeddings"] = engram_layout(
            list(text["engram_layer_ids"]), text["engram_max_ngram_size"], text["engram_n_heads"],
            text["engram_vocab_size"], text["engram_compressed_vocab_size"])["num_embeddings"]
    cfg = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "text_config": text,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
           "dtype": "bfloat16"}
    if quantized:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    return cfg


# ----------------------------------------------------------------------------------------------------
# encoders (writer side; the oracle decodes with its own independent formulas)
# ----------------------------------------------------------------------------------------------------
def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def _e8m0_bytes(scale):
    """Power-of-two scales -> E8M0 bytes (biased exponent)."""
    _, e = np.frexp(scale)
    return (e - 1 + 127).astype(np.uint8)


def quantize_fp8_blocks(w, block=32):
    """fp32 [R, C] -> (e4m3 [R, C], E8M0 bytes [ceil(R/B), ceil(C/B)]), one pow2 scale per B×B tile."""
    R, C = w.shape
    Rp, Cp = -(-R // block) * block, -(-C // block) * block
    wp = np.zeros((Rp, Cp), np.float32)
    wp[:R, :C] = w
    tiles = wp.reshape(Rp // block, block, Cp // block, block)
    s = _scale_from_fp32(np.abs(tiles).max(axis=(1, 3)), 1e-4, INV448)
    q = np.clip(tiles / s[:, None, :, None], -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(Rp, Cp)[:R, :C], _e8m0_bytes(s)


def quantize_fp8_rows(w, block=32):
    """fp32 [R, C] -> (e4m3 [R, C], E8M0 bytes [R, C/B]): per-row groups of B (Engram table format)."""
    g = w.reshape(w.shape[0], -1, block)
    s = _scale_from_fp32(np.abs(g).max(-1), 1e-4, INV448)
    q = np.clip(g / s[..., None], -448, 448).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(w.shape), _e8m0_bytes(s)


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def random_fp4(rng, out_f, in_f, gain):
    """Random MXFP4 weight: uniform codes (RMS ≈ 3.2), E8M0 per 32 along K aiming at RMS gain·fan_in^-0.5.
    Returns (packed int8 [O, I/2], E8M0 bytes [O, I/32], float32 dequantised [O, I])."""
    codes = rng.integers(0, 16, size=(out_f, in_f), dtype=np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    exp = round(np.log2(in_f ** -0.5 * gain / 3.2))
    e = exp + rng.integers(-1, 2, size=(out_f, in_f // 32))
    scale = np.ldexp(1.0, e)
    deq = _E2M1[codes] * np.repeat(scale, 32, axis=1)
    return packed, (e + 127).astype(np.uint8), deq.astype(np.float32)


_ST_DTYPE = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.int8): "I8",
             np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int64): "I64"}


def save_safetensors(path, tensors: dict, e8m0_names=()):
    """Minimal safetensors writer (sorted names, 8-byte-aligned header). uint8 arrays named in
    `e8m0_names` are tagged `F8_E8M0`."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        dt = "F8_E8M0" if name in e8m0_names else ("U8" if a.dtype == np.uint8 else _ST_DTYPE[a.dtype])
        b = a.tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


# ----------------------------------------------------------------------------------------------------
# the random model
# ----------------------------------------------------------------------------------------------------
NORM_MEAN = {"attn_norm": 1.0, "ffn_norm": 0.2, "q_norm": 0.97, "kv_norm": 0.4, "compressor.norm": 0.6,
             "k_norm": 0.5, "main_norm": 1.0, "norm": 1.0}
GAIN = {"wq_a": 1.6, "wq_b": 0.95, "wkv": 1.8, "wo_a": 1.6, "wo_b": 1.9, "gate": 2.9, "w1": 1.5, "w3": 1.5,
        "w2": 1.05, "wgate": 1.5, "engram.wkv": 0.25}


def write_checkpoint(dir: str, config: dict, seed: int = 0) -> None:
    """Write `config.json` + `model.safetensors` (DeepSeek bare names, §10.1) for a random model."""
    os.makedirs(dir, exist_ok=True)
    t = config.get("text_config", config)
    quant = config.get("quantization_config") is not None
    B = int(config["quantization_config"]["weight_block_size"][0]) if quant else 32
    rng = np.random.default_rng(seed)
    D, V, n = t["hidden_size"], t["vocab_size"], t["hc_mult"]
    H, d, Dq = t["num_attention_heads"], t["head_dim"], t["q_lora_rank"]
    G, Ro, I = t["o_groups"], t["o_lora_rank"], t["moe_intermediate_size"]
    HI, dI = t["index_n_heads"], t["index_head_dim"]
    L, ratios = t["num_hidden_layers"], t["compress_ratios"]
    out, e8m0 = {}, set()

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def bf16(name, x):
        out[name] = _bf16(x)

    def f32(name, x):
        out[name] = np.asarray(x, np.float32)

    def norm(name, key, size=None):
        bf16(name, NORM_MEAN[key] * (1 + 0.1 * randn(size or D)))

    def linear(name, out_f, in_f, gain, fp8=True, value=None):
        """A dense linear: FP8 + 32×32 E8M0 when quantized (and `fp8`), else BF16."""
        w = randn(out_f, in_f) * in_f ** -0.5 * gain if value is None else value
        if quant and fp8:
            q, s = quantize_fp8_blocks(w, B)
            out[name + ".weight"], out[name + ".scale"] = q, s
            e8m0.add(name + ".scale")
        else:
            bf16(name + ".weight", w)

    def experts(prefix, n_exp):
        for e in range(n_exp):
            enc = {wn: random_fp4(rng, o, i, GAIN[wn]) for wn, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I)))}
            # make the SwiGLU clamp fire (§6): channel 0's w1/w3 rows ×32 (pre-activations ~N(0, 10²)); its
            # w2 column re-coded to ±0.5 and the first K group of w2 scaled by 2^-6 so the output stays O(1)
            for wn in ("w1", "w3"):
                packed, sc, deq = enc[wn]
                sc[0] += 5
                deq[0] *= 32
            packed, sc, deq = enc["w2"]
            codes = np.stack([packed.view(np.uint8) & 0xF, packed.view(np.uint8) >> 4], -1).reshape(D, I)
            codes[:, 0] = np.where(rng.random(D) < 0.5, 1, 9)  # ±0.5
            packed[:] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
            sc[:, 0] -= 6
            deq[:] = _E2M1[codes] * np.ldexp(1.0, np.repeat(sc.astype(np.int64) - 127, 32, axis=1))
            for wn, (packed, sc, deq) in enc.items():
                name = f"{prefix}experts.{e}.{wn}"
                if quant:
                    out[name + ".weight"], out[name + ".scale"] = packed, sc
                    e8m0.add(name + ".scale")
                else:
                    bf16(name + ".weight", deq)

    def block(p, layer_id, n_exp):
        r = ratios[layer_id]
        backbone = layer_id < L
        for site in ("attn", "ffn"):
            f32(f"{p}hc_{site}_fn", randn((2 + n) * n, n * D) * (n * D) ** -0.5)
            f32(f"{p}hc_{site}_base", 0.5 * randn((2 + n) * n))
            f32(f"{p}hc_{site}_scale", 0.5 + 0.25 * randn(3))
        norm(p + "attn_norm.weight", "attn_norm")
        norm(p + "ffn_norm.weight", "ffn_norm")
        a = p + "attn."
        f32(a + "attn_sink", 0.5 + 0.5 * randn(H))
        linear(a + "wq_a", Dq, D, GAIN["wq_a"])
        norm(a + "q_norm.weight", "q_norm", Dq)
        linear(a + "wq_b", H * d, Dq, GAIN["wq_b"])
        linear(a + "wkv", d, D, GAIN["wkv"])
        norm(a + "kv_norm.weight", "kv_norm", d)
        linear(a + "wo_a", G * Ro, H * d // G, GAIN["wo_a"])
        linear(a + "wo_b", D, G * Ro, GAIN["wo_b"])
        if backbone and layer_id in t["kv_source_layer_ids"]:
            linear(a + "compressor.wkv", d, D, GAIN["wkv"], fp8=False)
            if r > 1:
                linear(a + "compressor.wgate", d, D, GAIN["wgate"], fp8=False)
            norm(a + "compressor.norm.weight", "compressor.norm", d)
        if backbone and layer_id in t["index_source_layer_ids"]:
            linear(a + "indexer.wq_b", HI * dI, Dq, GAIN["wq_b"])
            linear(a + "indexer.weights_proj", HI, D, 1.0, fp8=False)
            if layer_id in t["kv_source_layer_ids"]:
                linear(a + "indexer.wk", dI, d, 1.0, fp8=False)
                norm(a + "indexer.k_norm.weight", "k_norm", dI)
        f = p + "ffn."
        linear(f + "gate", n_exp, D, GAIN["gate"], fp8=False)
        f32(f + "gate.bias", 0.1 * randn(n_exp))
        f32(f + "gate.bias_vl", 0.1 * randn(n_exp))
        experts(f, n_exp)
        # shared expert: the same clamp-firing channel 0 (rows ×27, w2 column ×1/300)
        for wn, (o, i) in (("w1", (I, D)), ("w3", (I, D)), ("w2", (D, I))):
            w = randn(o, i) * i ** -0.5 * GAIN[wn]
            if wn == "w2":
                w[:, 0] /= 300
            else:
                w[0] *= 27
            linear(f"{f}shared_experts.{wn}", o, i, GAIN[wn], value=w)

    bf16("embed.weight", 0.12 * randn(V, D))
    lay = engram_layout(list(t["engram_layer_ids"]), t["engram_max_ngram_size"], t["engram_n_heads"],
                        t["engram_vocab_size"], t["engram_compressed_vocab_size"])
    rows = list(t.get("engram_num_embeddings") or lay["num_embeddings"])
    for li in range(L):
        p = f"layers.{li}."
        block(p, li, t["n_routed_experts"])
        if li in t["engram_layer_ids"]:
            k = list(t["engram_layer_ids"]).index(li)
            hd = t["engram_head_dim"]
            cols = (t["engram_max_ngram_size"] - 1) * t["engram_n_heads"]
            q, s = quantize_fp8_rows(randn(rows[k], hd), 32)
            out[p + "engram.embed.weight"], out[p + "engram.embed.scale"] = q, s
            e8m0.add(p + "engram.embed.scale")
            linear(p + "engram.wkv", (n + 1) * D, cols * hd, GAIN["engram.wkv"])
            bf16(p + "engram.q_weight", 1.2 * randn(n, D))
            bf16(p + "engram.k_weight", 1.2 * randn(n, D))
    norm("norm.weight", "norm")
    bf16("head.weight", randn(V, D) * D ** -0.5)

    n_mtp = t.get("num_nextn_predict_layers", 0) if t.get("dspark_block_size", 0) else 0
    for m in range(n_mtp):
        p = f"mtp.{m}."
        block(p, L + m, t.get("dspark_n_routed_experts") or t["n_routed_experts"])
        if m == 0:
            linear(p + "main_proj", D, D * len(t["dspark_target_layer_ids"]), 1.0)
            norm(p + "main_norm.weight", "main_norm")
        if m == n_mtp - 1:
            norm(p + "norm.weight", "norm")
            R = t["dspark_markov_rank"]
            bf16(p + "markov_head.embed.weight", randn(V, R))
            bf16(p + "markov_head.head.weight", randn(V, R) * R ** -0.5)
            bf16(p + "confidence_head.proj.weight", randn(1, D + R) * (D + R) ** -0.5)
    bf16("vision.dummy.weight", randn(4, 4))  # importers must skip vision.* (§10.3)

    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_safetensors(os.path.join(dir, "model.safetensors"), out, e8m0)


def write_tiny_v41(dir, seed: int = 0, **overrides) -> dict:
    """The spec's tiny V4.1 (tiny_config's overrides) in DeepSeek's own layout (real FP8/FP4 encodings) + the word
    tokenizer whose pieces give the stub token map; returns its config."""
    hf = tiny_config("v4.1", quantized=True, **overrides)
    write_checkpoint(str(dir), hf, seed=seed)
    write_word_tokenizer(dir, hf["text_config"]["vocab_size"])
    return hf
