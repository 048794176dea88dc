"""Independent float64 NumPy oracle for the DeepSeek-V4.1 backbone (specs/deepseek_v4.md §2-§8).

Written from the spec's formulas, checked line by line against the upstream reference `inference/model.py`
(as vendored in tenstorrent/tt-metal; where the two differ the reference is followed), and deliberately
sharing no code with `jaxmodels` / `converters`. Everything is float64. `quant_sim=True` adds the
reference's simulated quantisation (§2, §12.9): FP8 activation QDQ per 32 before every FP8/FP4 linear,
FP8 QDQ of the window KV, FP4 (E4M3/16) QDQ of the compressed KV, FP4 (E8M0/32) QDQ of the indexer q/k.
The QDQ functions are bit-exact to the reference kernels on bf16 inputs (scales from the fp32 product,
as `fast_round_scale`), but nothing else is rounded to bf16, so quant_sim is the reference's function
without its bf16 noise — not a bit-exact replay.

Public pieces: `load_checkpoint`, `forward`, `backbone` (logits + per-layer aux), `dspark_forward`,
`hc_split_sinkhorn`, `mixes_sinkhorn`, `engram_layout`, `engram_hashes`, `act_quant`, `fp4_act_quant`,
`e4m3_rne`, `e2m1_rne`, `rope_freqs`, `apply_rope`.

Semantics: `forward` is the reference's single prefill chunk at start_pos 0 over [B, T] and returns the
logits of EVERY position (the reference keeps only the last); each position is causal, and the
reference's own decode step reproduces the last position. Top-k ties (exact-zero indexer scores are
common: relu of all heads = 0) break towards the LOWER index, like `jax.lax.top_k`; the reference's tie
order is implementation-defined (§12.15). With quant_sim, two implementations that differ by float
rounding (fp32 vs float64, bf16) occasionally land on the other side of a QDQ rounding boundary, and
through top-k that can move later logits by O(0.1-1): compare quant_sim runs with a tolerance or by
position statistics, plain runs tightly.
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

# ----------------------------------------------------------------------------------------------------
# §2 numerics building blocks
# ----------------------------------------------------------------------------------------------------
FP8_MAX, FP4_MAX = 448.0, 6.0
INV448 = np.float32(1.0 / 448.0)  # the kernel multiplies by fp32 reciprocals (§2)
INV6 = np.float32(1.0 / 6.0)


def pow2ceil(y):
    """2^ceil(log2(y)) for y > 0."""
    m, e = np.frexp(np.asarray(y, dtype=np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def _scale_from_fp32(amax, floor, inv):
    """pow2ceil(fp32(max(amax, floor)) · fp32 constant), the product rounded to fp32 as `fast_round_scale`
    sees it (K41:22-38). The fp32 rounding matters: amax = 1.75·2^m (common for bf16 data) times
    fp32(1/448) rounds to exactly 2^(m-8) in fp32 but lies just above it in float64."""
    a32 = np.maximum(np.asarray(amax, dtype=np.float64).astype(np.float32), np.float32(floor))
    return pow2ceil((a32 * inv).astype(np.float32))


def e4m3_rne(x):
    """Round float64 to the nearest float8_e4m3fn value, ties to even, saturating at ±448."""
    x = np.clip(np.asarray(x, dtype=np.float64), -FP8_MAX, FP8_MAX)
    a = np.abs(x)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)  # 3 mantissa bits; subnormal step 2^-9
    return np.copysign(np.minimum(np.rint(a / quantum) * quantum, FP8_MAX), x)


def e2m1_rne(x):
    """Round float64 to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even code, saturating at ±6."""
    x = np.clip(np.asarray(x, dtype=np.float64), -FP4_MAX, FP4_MAX)
    a = np.abs(x)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    quantum = np.ldexp(1.0, np.maximum(e - 1, 0) - 1)  # 1 mantissa bit; subnormal step 0.5
    return np.copysign(np.minimum(np.rint(a / quantum) * quantum, FP4_MAX), x)


def act_quant(x, block=32, return_parts=False):
    """FP8 QDQ along the last dim in blocks of `block` with UE8M0 scales (§2 act_quant, K41:41-113):
    s = pow2ceil(max(amax, 1e-4) · fp32(1/448)), q = e4m3_rne(x / s) (saturating).

    Returns the dequantised float64 array, or (q, s) with q the e4m3 values and s the power-of-2 scales.
    Bit-exact to the reference kernel on bf16 inputs (x / s is exact: s is a power of two)."""
    x = np.asarray(x, dtype=np.float64)
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    s = _scale_from_fp32(np.abs(xg).max(-1, initial=0.0), 1e-4, INV448)
    q = e4m3_rne(xg / s[..., None])
    if return_parts:
        return q.reshape(x.shape), s
    return (q * s[..., None]).reshape(x.shape)


def fp4_act_quant(x, block=32, scale_fmt="e8m0", return_parts=False):
    """FP4 (E2M1) QDQ along the last dim (§2 fp4_act_quant, K41:116-199).

    scale_fmt "e8m0" (indexer q/k, block 32): s = pow2ceil(max(amax, 6·2^-126) · fp32(1/6)).
    scale_fmt "e4m3" (compressed KV, block 16): s = e4m3_rne(fp32(max(amax, 6·2^-9) / 6)); here s is not a
    power of two, so x / s is taken in fp32 as the kernel does (it decides E2M1 ties)."""
    x = np.asarray(x, dtype=np.float64)
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = np.abs(xg).max(-1, initial=0.0)
    if scale_fmt == "e8m0":
        s = _scale_from_fp32(amax, 6 * 2.0 ** -126, INV6)
        v = xg / s[..., None]
    elif scale_fmt == "e4m3":
        a32 = np.maximum(amax.astype(np.float32), np.float32(6 * 2.0 ** -9))
        s = e4m3_rne((a32 / np.float32(6.0)).astype(np.float32))
        v = (xg.astype(np.float32) / s[..., None].astype(np.float32)).astype(np.float64)
    else:
        raise ValueError(scale_fmt)
    q = e2m1_rne(v)
    if return_parts:
        return q.reshape(x.shape), s
    return (q * s[..., None]).reshape(x.shape)


# ----------------------------------------------------------------------------------------------------
# §10.2 checkpoint reading and dequantisation (own safetensors parser; no torch / safetensors needed)
# ----------------------------------------------------------------------------------------------------
E2M1_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float64)


def decode_e4m3(b):
    """uint8 bit patterns of float8_e4m3fn -> float64 (0x7F/0xFF are NaN)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * np.ldexp(1.0, exp - 7))
    val = np.where((exp == 15) & (man == 7), np.nan, val)
    return sign * val


def decode_e8m0(b):
    """uint8 E8M0 bytes -> 2^(b-127) float64; 0xFF is NaN (§2)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int64)
    return np.where(b == 255, np.nan, np.ldexp(1.0, b - 127))


def read_safetensors(path):
    """{name: (dtype_string, numpy array of the raw storage)}; bf16 as uint16, fp8 kinds as uint8."""
    raw_dtypes = {"F64": np.float64, "F32": np.float32, "I64": np.int64, "I32": np.int32, "BF16": np.uint16,
                  "F16": np.float16, "I8": np.int8, "U8": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8}
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        arr = np.frombuffer(data[base + lo: base + hi], dtype=raw_dtypes[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out


def _to_f64(dtype, arr):
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "F8_E4M3":
        return decode_e4m3(arr)
    if dtype in ("F32", "F64", "F16"):
        return arr.astype(np.float64)
    raise ValueError(dtype)


def dequant_fp8_blocks(wq, s_bytes, block):
    """W[o,i] = e4m3(Wq[o,i]) · 2^(S[o//B, i//B] - 127) (§10.2)."""
    w = decode_e4m3(wq)
    s = decode_e8m0(s_bytes)
    s = np.repeat(np.repeat(s, block, 0), block, 1)[: w.shape[0], : w.shape[1]]
    return w * s


def dequant_fp4(packed, s_bytes, block=32):
    """Packed int8 [O, I/2]: low nibble = element 2k, high = 2k+1; one E8M0 per `block` along I (§10.2)."""
    b = np.asarray(packed).view(np.uint8)
    vals = np.stack([E2M1_TABLE[b & 0xF], E2M1_TABLE[b >> 4]], axis=-1).reshape(b.shape[0], -1)
    return vals * np.repeat(decode_e8m0(s_bytes), block, axis=1)


def dequant_fp8_rows(wq, s_bytes, block=32):
    """Engram table: per-row E8M0 scale per `block` channels (§7.2, §10.2)."""
    return decode_e4m3(wq) * np.repeat(decode_e8m0(s_bytes), block, axis=1)


class Checkpoint:
    """Config (inference-style names) + float64 weights, with the set of names that were FP8/FP4 linears."""

    def __init__(self, cfg, weights, quantized_linears):
        self.cfg, self.w, self.qlin = cfg, weights, quantized_linears


# HF text_config key -> inference ModelArgs key (§1.1)
_HF_TO_ARGS = {
    "vocab_size": "vocab_size", "hidden_size": "dim", "num_hidden_layers": "n_layers",
    "num_nextn_predict_layers": "n_mtp_layers", "num_attention_heads": "n_heads", "head_dim": "head_dim",
    "qk_rope_head_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
    "o_groups": "o_groups", "sliding_window": "window_size", "compress_ratios": "compress_ratios",
    "kv_source_layer_ids": "kv_source_layers", "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer", "candidate_topk_blocks": "candidate_topk_blocks",
    "candidate_block_size": "candidate_block_size", "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim", "index_topk": "index_topk", "rope_theta": "rope_theta",
    "compress_rope_theta": "compress_rope_theta", "rms_norm_eps": "norm_eps",
    "moe_intermediate_size": "moe_inter_dim", "n_routed_experts": "n_routed_experts",
    "n_shared_experts": "n_shared_experts", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "norm_topk_prob": "norm_topk_prob",
    "swiglu_limit": "swiglu_limit", "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
    "hc_eps": "hc_eps", "engram_layer_ids": "engram_layer_ids", "engram_num_embeddings": "engram_num_embeddings",
    "engram_max_ngram_size": "engram_max_ngram_size", "engram_vocab_size": "engram_vocab_size",
    "engram_n_heads": "engram_n_heads", "engram_head_dim": "engram_head_dim",
    "engram_compressed_vocab_size": "engram_compressed_vocab_size", "engram_pad_token_id": "engram_pad_id",
    "engram_pad_id": "engram_pad_id", "dspark_block_size": "dspark_block_size",
    "dspark_noise_token_id": "dspark_noise_token_id", "dspark_target_layer_ids": "dspark_target_layer_ids",
    "dspark_markov_rank": "dspark_markov_rank", "dspark_n_routed_experts": "dspark_n_routed_experts",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts", "gate_temp": "gate_temp",
}


def config_from_hf(hf):
    """HF-style config.json (composite V4.1 or flat) -> dict of inference ModelArgs names."""
    text = hf.get("text_config", hf)
    cfg = {"gate_temp": 1.0, "norm_topk_prob": True, "candidate_source_layer": -1, "engram_layer_ids": [],
           "dspark_block_size": 0, "dspark_target_layer_ids": [], "n_mtp_layers": 0,
           "dspark_n_routed_experts": 0, "dspark_n_activated_experts": 0}
    for k, v in text.items():
        if k in _HF_TO_ARGS:
            cfg[_HF_TO_ARGS[k]] = v
    rs = text.get("rope_scaling") or {}
    cfg["rope_factor"] = rs.get("factor", 1.0)
    cfg["original_seq_len"] = rs.get("original_max_position_embeddings", 0) if rs else 0
    cfg["beta_fast"] = rs.get("beta_fast", 32)
    cfg["beta_slow"] = rs.get("beta_slow", 1)
    q = hf.get("quantization_config")
    cfg["fp8_block"] = int(q["weight_block_size"][0]) if q else 32
    return cfg


def load_checkpoint(ckpt_dir):
    """Read config.json + every *.safetensors in ckpt_dir; dequantise FP8 / FP4 / E8M0 to float64."""
    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    raw = {}
    for fn in sorted(os.listdir(ckpt_dir)):
        if fn.endswith(".safetensors"):
            raw.update(read_safetensors(os.path.join(ckpt_dir, fn)))
    B = cfg["fp8_block"]
    weights, qlin = {}, set()
    for name, (dt, arr) in raw.items():
        if name.endswith(".scale") or name.startswith(("vision.", "aligner.", "image_")):
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if dt == "I8":  # MXFP4 routed experts
            weights[name] = dequant_fp4(arr, scale[1])
            qlin.add(name)
        elif dt == "F8_E4M3" and ".engram.embed." in name:
            weights[name] = dequant_fp8_rows(arr, scale[1])
        elif dt == "F8_E4M3":
            weights[name] = dequant_fp8_blocks(arr, scale[1], B)
            if not name.endswith("attn.wo_a.weight"):  # wo_a is dequantised at load, used unquantised (§5.6)
                qlin.add(name)
        else:
            weights[name] = _to_f64(dt, arr)
    return Checkpoint(cfg, weights, qlin)


# ----------------------------------------------------------------------------------------------------
# basic ops
# ----------------------------------------------------------------------------------------------------
def rms_norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.logaddexp(0.0, x)


class _Ctx:
    """Checkpoint + numerics mode: `lin` applies the activation QDQ before FP8/FP4 linears (§2 linear)."""

    def __init__(self, ck, quant_sim):
        self.ck, self.cfg, self.w, self.qs = ck, ck.cfg, ck.w, quant_sim
        self._wt = {}

    def lin(self, x, name):
        if self.qs and name in self.ck.qlin:
            x = act_quant(x, 32)
        if name not in self._wt:  # contiguous W^T: much faster 2-D BLAS calls than x @ W.T
            self._wt[name] = np.ascontiguousarray(self.w[name].T)
        return (x.reshape(-1, x.shape[-1]) @ self._wt[name]).reshape(*x.shape[:-1], -1)


def rope_freqs(rd, base, original_seq_len=0, factor=1.0, beta_fast=32, beta_slow=1):
    """Per-pair frequencies [rd/2] with the optional YaRN ramp (§2 RoPE); float64."""
    freqs = 1.0 / base ** (np.arange(0, rd, 2, dtype=np.float64) / rd)
    if original_seq_len > 0:
        def cdim(r):
            return rd * math.log(original_seq_len / (r * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(cdim(beta_fast)), 0)
        high = min(math.ceil(cdim(beta_slow)), rd - 1)
        ramp = np.clip((np.arange(rd // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return freqs


def apply_rope(x, pos, freqs, inverse=False):
    """Interleaved (GPT-J) rotation of the LAST 2·len(freqs) channels (§2, §12.1).

    x is [B, P, dim] or [B, P, H, dim]; `pos` [P] are the absolute positions of axis 1."""
    rd = 2 * len(freqs)
    ang = np.asarray(pos, dtype=np.float64)[:, None] * freqs[None, :]  # [P, rd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    if inverse:
        sin = -sin
    if x.ndim == 4:  # [B, P, H, dim]
        cos, sin = cos[:, None, :], sin[:, None, :]
    y = x.copy()
    lo = x.shape[-1] - rd
    x0, x1 = x[..., lo::2], x[..., lo + 1::2]
    y[..., lo::2] = x0 * cos - x1 * sin
    y[..., lo + 1::2] = x0 * sin + x1 * cos
    return y


def layer_freqs(cfg, layer_id):
    """Ratio-0 layers: rope_theta, no YaRN; ratio>0: compress_rope_theta with YaRN (§12.2)."""
    if cfg["compress_ratios"][layer_id]:
        return rope_freqs(cfg["rope_head_dim"], cfg["compress_rope_theta"], cfg["original_seq_len"],
                          cfg["rope_factor"], cfg["beta_fast"], cfg["beta_slow"])
    return rope_freqs(cfg["rope_head_dim"], cfg["rope_theta"])


# ----------------------------------------------------------------------------------------------------
# §4 mHC
# ----------------------------------------------------------------------------------------------------
def hc_split_sinkhorn(mixes, scale, base, hc_mult=4, iters=20, hc_eps=1e-6):
    """mixes [..., (2+n)·n] -> (pre [..., n], post [..., n], comb [..., n, n]) per §4 / K41:406-458:
    pre = sigmoid+eps (not normalised), post = 2·sigmoid, comb = row softmax + eps, column normalise,
    then (iters-1) × (row, column) normalisations, eps inside every denominator."""
    n = hc_mult
    pre = sigmoid(mixes[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    C = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mixes.shape[:-1], n, n)  # C[j,k] row-major
    C = np.exp(C - C.max(-1, keepdims=True))
    C = C / C.sum(-1, keepdims=True) + hc_eps
    C = C / (C.sum(-2, keepdims=True) + hc_eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdims=True) + hc_eps)
        C = C / (C.sum(-2, keepdims=True) + hc_eps)
    return pre, post, C


def mixes_sinkhorn(X, fn, base, scale, hc_mult=4, iters=20, hc_eps=1e-6, norm_eps=1e-20):
    """Stream X [..., n, D] -> (pre, post, comb). The unweighted RMS is over the flattened n·D vector
    (one scalar per token), applied after the projection (§4, §12.6). comb[j, k]: j = source copy."""
    xf = X.reshape(*X.shape[:-2], -1)
    mixes = (xf @ fn.T) / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + norm_eps)
    return hc_split_sinkhorn(mixes, scale, base, hc_mult, iters, hc_eps)


def hc_collapse(X, p):
    return np.einsum("...k,...kd->...d", p, X)


def hc_expand(y, R, post, comb):
    """out_k = post_k · y + Σ_j comb[j,k] · R_j (§4, §12.3)."""
    return post[..., :, None] * y[..., None, :] + np.einsum("...jk,...jd->...kd", comb, R)


# ----------------------------------------------------------------------------------------------------
# §7 Engram
# ----------------------------------------------------------------------------------------------------
def _is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0 or n % 3 == 0:
        return n in (2, 3)
    i = 5
    while i * i <= n:
        if n % i == 0 or n % (i + 2) == 0:
            return False
        i += 6
    return True


def engram_layout(layer_ids, max_ngram, n_heads, vocab_size, compressed_vocab):
    """§7.1 prime layout + multipliers. Returns dict with primes [L][max_ngram-1][H], offsets [L][24],
    num_embeddings [L], multipliers int64 [L, max_ngram]."""
    seen, primes = set(), []
    for _ in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            cur, heads = vocab_size - 1, []
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                heads.append(cur)
            per_n.append(heads)
        primes.append(per_n)
    flat = [[p for ph in layer for p in ph] for layer in primes]
    offsets = [np.concatenate([[0], np.cumsum(f[:-1])]).astype(np.int64) for f in flat]
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    mults = np.stack([np.random.default_rng(10007 * lid).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
                      for lid in layer_ids]) if layer_ids else np.zeros((0, max_ngram), np.int64)
    return {"primes": primes, "offsets": offsets, "num_embeddings": [int(sum(f)) for f in flat],
            "multipliers": mults}


def _layout_from_cfg(cfg):
    return engram_layout(list(cfg["engram_layer_ids"]), cfg["engram_max_ngram_size"], cfg["engram_n_heads"],
                         cfg["engram_vocab_size"], cfg["engram_compressed_vocab_size"])


def engram_hashes(tokens, cfg, token_map, dead_mask=None):
    """int64 hash ids [B, T, n_engram_layers, (max_ngram-1)·heads] per §7.1 (column order: 2-gram heads,
    3-gram heads, ...). `dead_mask` [B, T] True marks DEAD (image) positions. All arithmetic in int64."""
    tokens = np.asarray(tokens, dtype=np.int64)
    tm = np.asarray(token_map, dtype=np.int64)
    lay = _layout_from_cfg(cfg)
    N = cfg["engram_max_ngram_size"]
    pad_id = np.int64(tm[cfg["engram_pad_id"]])
    comp = tm[tokens]
    if dead_mask is not None:
        comp = np.where(dead_mask, -1, comp)
    B, T = tokens.shape
    pos = np.arange(T)
    toks, blocked = [], np.zeros((B, T), bool)
    for shift in range(N):
        src = comp[:, np.maximum(pos - shift, 0)]
        blocked = blocked | (pos < shift)[None, :] | (src == -1)
        toks.append(np.where(blocked, pad_id, src))
    toks = np.stack(toks, -1)  # [B, T, N]
    out = []
    for li in range(len(cfg["engram_layer_ids"])):
        prod = toks * lay["multipliers"][li][None, None, :]  # no overflow: mult < INT64_MAX // cvocab
        roll, cols = prod[..., 0], []
        for i in range(1, N):
            roll = np.bitwise_xor(roll, prod[..., i])
            for h, p in enumerate(lay["primes"][li][i - 1]):
                cols.append(roll % np.int64(p))
        out.append(np.stack(cols, -1) + lay["offsets"][li][None, None, :])
    return np.stack(out, 2)


def engram_apply(ctx, X, ids, layer_id):
    """§7.2: gate per stream from a normalised dot with a per-stream key; the value is added to all streams."""
    cfg, w, p = ctx.cfg, ctx.w, f"layers.{layer_id}.engram."
    n, D, eps = cfg["hc_mult"], cfg["dim"], cfg["norm_eps"]
    E = w[p + "embed.weight"][ids]  # [B, T, cols, hd]
    kv = ctx.lin(E.reshape(*E.shape[:2], -1), p + "wkv.weight")
    key, val = kv[..., : n * D].reshape(*kv.shape[:2], n, D), kv[..., n * D:]
    wgt = w[p + "q_weight"] * w[p + "k_weight"]
    rstd = 1 / np.sqrt(np.mean(X * X, -1) + eps) / np.sqrt(np.mean(key * key, -1) + eps)
    dot = (X * wgt * key).sum(-1) * rstd * D ** -0.5
    gate = sigmoid(np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6)))
    return X + gate[..., None] * val[..., None, :], gate


# ----------------------------------------------------------------------------------------------------
# §5 attention
# ----------------------------------------------------------------------------------------------------
def topk_mask(score, k, keep_neg_inf=False):
    """Boolean mask of the top-`k` entries along the last axis, ties -> lower index first. -inf picks are
    dropped unless `keep_neg_inf` (the indexer keeps them and filters by visibility instead, §5.4)."""
    order = np.argsort(-score, axis=-1, kind="stable")
    rank = np.argsort(order, axis=-1, kind="stable")  # inverse permutation: position of each entry
    return (rank < k) if keep_neg_inf else (rank < k) & (score > -np.inf)


def select_candidate_blocks(score, compress_lens, topk_blocks, block):
    """§5.4: block score = max over `block`; the newest visible block forced +inf; -inf picks dropped."""
    T = score.shape[-1]
    nb = -(-T // block)
    padded = np.concatenate([score, np.full(score.shape[:-1] + (nb * block - T,), -np.inf)], -1)
    bs = padded.reshape(*score.shape[:-1], nb, block).max(-1)
    last = (np.asarray(compress_lens) - 1) // block  # [S] (prefill); -1 when nothing visible
    bs = np.where(np.arange(nb)[None, None, :] == last[None, :, None], np.inf, bs)
    keep = topk_mask(bs, min(topk_blocks, nb))
    return np.repeat(keep, block, -1)[..., :T]


class _Shared:
    """What sources hand to later layers within one forward (§11.5)."""
    compress_kv = None   # [B, Nc, d] RoPE'd (+QDQ'd) compressed latents
    index_k = None       # [B, Nc, dI]
    topk = None          # bool [B, T, Nc]: compressed entries each query attends
    candidates = None    # bool [B, T, Nc]


def sparse_attention(q, kv_win, win_mask, kv_c, c_mask, sink, scale):
    """q [B,T,H,d]; window keys kv_win [B,T,d] with win_mask [T,T]; compressed keys kv_c [B,Nc,d] with
    c_mask [B,T,Nc]. K = V. Sink adds exp(sink_h) to the denominator, unscaled (§5.5)."""
    zw = np.einsum("bshd,btd->bhst", q, kv_win) * scale
    zw = np.where(win_mask[None, None], zw, -np.inf)
    if kv_c is not None and kv_c.shape[1] > 0:
        zc = np.einsum("bshd,btd->bhst", q, kv_c) * scale
        zc = np.where(c_mask[:, None], zc, -np.inf)
        z = np.concatenate([zw, zc], -1)
        V = np.concatenate([kv_win, kv_c], 1)
    else:
        z, V = zw, kv_win
    s = sink[None, :, None, None]
    m = np.maximum(z.max(-1, keepdims=True), s)
    e = np.exp(z - m)
    den = e.sum(-1, keepdims=True) + np.exp(s - m)
    o = np.einsum("bhst,btd->bshd", e / den, V)
    return o


def attention(ctx, x, layer_id, sh):
    cfg, w = ctx.cfg, ctx.w
    p = f"layers.{layer_id}.attn."
    B, T, _ = x.shape
    H, d, rd, W = cfg["n_heads"], cfg["head_dim"], cfg["rope_head_dim"], cfg["window_size"]
    eps, r = cfg["norm_eps"], cfg["compress_ratios"][layer_id]
    pos = np.arange(T)
    fr = layer_freqs(cfg, layer_id)

    qr = rms_norm(ctx.lin(x, p + "wq_a.weight"), w[p + "q_norm.weight"], eps)
    q = ctx.lin(qr, p + "wq_b.weight").reshape(B, T, H, d)
    q = apply_rope(q, pos, fr)
    kv = rms_norm(ctx.lin(x, p + "wkv.weight"), w[p + "kv_norm.weight"], eps)
    kv = apply_rope(kv, pos, fr)
    if ctx.qs:
        kv = act_quant(kv, 32)  # window KV FP8 QDQ over all d dims, after RoPE (§5.1)
    win_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - W)

    kv_c = c_mask = None
    if r > 0:
        is_backbone = layer_id < cfg["n_layers"]
        kv_src = is_backbone and layer_id in cfg["kv_source_layers"]
        idx_src = is_backbone and layer_id in cfg["index_source_layers"]
        Nc = T // r
        compress_lens = (pos + 1) // r  # group j visible once the query passed its last token (§5.4)
        latent = None
        if kv_src:  # §5.3 compressor (pre-RoPE latent)
            cp = p + "compressor."
            if r == 1:
                latent = rms_norm(x @ w[cp + "wkv.weight"].T, w[cp + "norm.weight"], eps)
            else:
                a = (x[:, : Nc * r] @ w[cp + "wkv.weight"].T).reshape(B, Nc, r, d)
                z = (x[:, : Nc * r] @ w[cp + "wgate.weight"].T).reshape(B, Nc, r, d)
                z = np.exp(z - z.max(2, keepdims=True))
                c = (a * z / z.sum(2, keepdims=True)).sum(2)
                latent = rms_norm(c, w[cp + "norm.weight"], eps)
        if idx_src and Nc > 0:  # §5.4 indexer
            ip = p + "indexer."
            HI, dI = cfg["index_n_heads"], cfg["index_head_dim"]
            gpos = np.arange(Nc) * r  # a latent stands for the first token of its group
            if kv_src:
                k = rms_norm(latent @ w[ip + "wk.weight"].T, w[ip + "k_norm.weight"], eps)
                k = apply_rope(k, gpos, fr)
                if ctx.qs:
                    k = fp4_act_quant(k, 32, "e8m0")
                sh.index_k = k
            qi = ctx.lin(qr, ip + "wq_b.weight").reshape(B, T, HI, dI)
            qi = apply_rope(qi, pos, fr)
            if ctx.qs:
                qi = fp4_act_quant(qi, 32, "e8m0")
            wts = (x @ w[ip + "weights_proj.weight"].T) * (dI ** -0.5 * HI ** -0.5)
            kk = sh.index_k[:, :Nc]
            score = (np.maximum(np.einsum("bshd,btd->bsht", qi, kk), 0) * wts[..., None]).sum(2)
            score = np.where(np.arange(Nc)[None, None, :] < compress_lens[None, :, None], score, -np.inf)
            if layer_id == cfg["candidate_source_layer"]:
                sh.candidates = select_candidate_blocks(score, compress_lens, cfg["candidate_topk_blocks"],
                                                        cfg["candidate_block_size"])
            elif 0 <= cfg["candidate_source_layer"] < layer_id:
                score = np.where(sh.candidates, score, -np.inf)
            # top-min(K, Nc) over ALL entries, then invisible picks -> -1 (REF41 Indexer.forward). A visible
            # entry masked by the candidates (-inf) can be picked when fewer than kk are finite; the reference
            # takes such -inf picks in an implementation-defined order, we take the lowest indices.
            visible = np.arange(Nc)[None, None, :] < compress_lens[None, :, None]
            sh.topk = topk_mask(score, min(cfg["index_topk"], Nc), keep_neg_inf=True) & visible
            sh.last_score = score
        elif idx_src:
            sh.topk = np.zeros((B, T, 0), bool)
        if kv_src:
            lat = apply_rope(latent, np.arange(Nc) * r, fr)
            if ctx.qs:
                lat = fp4_act_quant(lat, 16, "e4m3")
            sh.compress_kv = lat
        kv_c = sh.compress_kv[:, :Nc]
        c_mask = sh.topk

    o = sparse_attention(q, kv, win_mask, kv_c, c_mask, w[p + "attn_sink"], d ** -0.5)
    o = apply_rope(o, pos, fr, inverse=True)
    G, Ro = cfg["o_groups"], cfg["o_lora_rank"]
    Wa = w[p + "wo_a.weight"].reshape(G, Ro, -1)
    u = np.einsum("bsgd,grd->bsgr", o.reshape(B, T, G, -1), Wa)
    return ctx.lin(u.reshape(B, T, G * Ro), p + "wo_b.weight")


# ----------------------------------------------------------------------------------------------------
# §6 MoE
# ----------------------------------------------------------------------------------------------------
def moe(ctx, x, prefix, n_experts, topk):
    cfg, w = ctx.cfg, ctx.w
    lim = cfg["swiglu_limit"]
    s = (x @ w[prefix + "gate.weight"].T) / cfg.get("gate_temp", 1.0)
    assert cfg["score_func"] == "sqrtsoftplus"
    s = np.sqrt(softplus(s))
    sel = topk_mask(s + w[prefix + "gate.bias"], topk)  # bias: selection only
    wts = np.where(sel, s, 0.0)
    if cfg.get("norm_topk_prob", True) and topk > 1:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    wts = wts * cfg["route_scale"]

    def expert(xx, ep, rw=None):
        g = ctx.lin(xx, ep + "w1.weight")
        u = ctx.lin(xx, ep + "w3.weight")
        if lim > 0:
            u, g = np.clip(u, -lim, lim), np.minimum(g, lim)
        h = silu(g) * u
        if rw is not None:
            h = h * rw[..., None]  # routing weight before w2 (§12.21)
        return ctx.lin(h, ep + "w2.weight")

    y = np.zeros_like(x)
    for e in range(n_experts):
        m = sel[..., e]
        if m.any():
            y[m] += expert(x[m], f"{prefix}experts.{e}.", wts[..., e][m])
    return y + expert(x, prefix + "shared_experts."), sel, s


# ----------------------------------------------------------------------------------------------------
# §3 top level
# ----------------------------------------------------------------------------------------------------
def _block(ctx, X, pre_in, layer_id, prefix, sh, n_experts, topk, attn_fn):
    cfg, w = ctx.cfg, ctx.w
    n, it, he, eps = cfg["hc_mult"], cfg["hc_sinkhorn_iters"], cfg["hc_eps"], cfg["norm_eps"]
    pA, qA, cA = mixes_sinkhorn(X, w[prefix + "hc_attn_fn"], w[prefix + "hc_attn_base"],
                                w[prefix + "hc_attn_scale"], n, it, he, eps)
    y = attn_fn(rms_norm(hc_collapse(X, pre_in), w[prefix + "attn_norm.weight"], eps))
    X = hc_expand(y, X, qA, cA)
    pF, qF, cF = mixes_sinkhorn(X, w[prefix + "hc_ffn_fn"], w[prefix + "hc_ffn_base"],
                                w[prefix + "hc_ffn_scale"], n, it, he, eps)
    y, _, _ = moe(ctx, rms_norm(hc_collapse(X, pA), w[prefix + "ffn_norm.weight"], eps), prefix + "ffn.",
                  n_experts, topk)
    X = hc_expand(y, X, qF, cF)
    return X, pF  # delayed pre: the next sublayer collapses with pF (§4, §12.5)


def default_token_map(cfg, token_map=None):
    if token_map is not None:
        return np.asarray(token_map, dtype=np.int64)
    if cfg["engram_compressed_vocab_size"] * 2 != cfg["vocab_size"]:
        raise ValueError("pass token_map: the stub map (id // 2) only fits compressed vocab = vocab // 2")
    return np.arange(cfg["vocab_size"], dtype=np.int64) // 2  # spec §1.4 StubTokenizer


def backbone(ck, tokens, quant_sim=False, token_map=None):
    """Returns (logits [B,T,V], aux dict) — aux holds per-layer diagnostics and the DSpark main hidden."""
    ctx = ck if isinstance(ck, _Ctx) else _Ctx(ck, quant_sim)
    cfg, w = ctx.cfg, ctx.w
    tokens = np.asarray(tokens, dtype=np.int64)
    B, T = tokens.shape
    n = cfg["hc_mult"]
    hashes = None
    if cfg["engram_layer_ids"]:
        hashes = engram_hashes(tokens, cfg, default_token_map(cfg, token_map))
    X = np.repeat(w["embed.weight"][tokens][:, :, None, :], n, axis=2)
    pre = np.zeros((B, T, n))
    pre[..., 0] = 1.0
    sh = _Shared()
    aux = {"main_hiddens": [], "engram_gates": {}, "topk": {}, "candidates": None}
    for i in range(cfg["n_layers"]):
        if i in cfg["engram_layer_ids"]:
            X, g = engram_apply(ctx, X, hashes[:, :, list(cfg["engram_layer_ids"]).index(i)], i)
            aux["engram_gates"][i] = g
        if i in cfg["dspark_target_layer_ids"]:
            aux["main_hiddens"].append(X.mean(2))  # input of the layer, after Engram (§12.26)
        X, pre = _block(ctx, X, pre, i, f"layers.{i}.", sh, cfg["n_routed_experts"], cfg["n_activated_experts"],
                        lambda xx, i=i: attention(ctx, xx, i, sh))
        if cfg["compress_ratios"][i]:
            aux["topk"][i] = sh.topk
    aux["candidates"] = sh.candidates
    x = rms_norm(hc_collapse(X, pre), w["norm.weight"], cfg["norm_eps"])  # final collapse, last FFN pre
    logits = x @ w["head.weight"].T
    return logits, aux


def forward(ckpt_dir, tokens, quant_sim=False, token_map=None):
    """Float64 logits [B, T, vocab] of the V4.1 backbone (prefill semantics, every position); `ckpt_dir`
    may also be a loaded `Checkpoint`. A 1-D token array gives [T, vocab]."""
    ck = ckpt_dir if isinstance(ckpt_dir, Checkpoint) else load_checkpoint(ckpt_dir)
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim == 1:
        return backbone(ck, tokens[None], quant_sim, token_map)[0][0]
    return backbone(ck, tokens, quant_sim, token_map)[0]


# ----------------------------------------------------------------------------------------------------
# §8.1 DSpark (the reference's decode-time `forward_spec`)
# ----------------------------------------------------------------------------------------------------
def _dspark_attention(ctx, x, main_x, layer_id, prefix, p):
    """Draft queries at positions p+1..p+blk attend the window of main_x KV (positions ≤ p, the ring)
    plus every draft KV of the block (bidirectional), with sinks; ratio-0 RoPE (rope_theta, no YaRN)."""
    cfg, w = ctx.cfg, ctx.w
    a = prefix + "attn."
    B, blk, _ = x.shape
    H, d, W, eps = cfg["n_heads"], cfg["head_dim"], cfg["window_size"], cfg["norm_eps"]
    fr = layer_freqs(cfg, layer_id)
    mpos = np.arange(max(0, p - W + 1), p + 1)
    dpos = np.arange(p + 1, p + 1 + blk)
    main_kv = rms_norm(ctx.lin(main_x[:, mpos], a + "wkv.weight"), w[a + "kv_norm.weight"], eps)
    main_kv = apply_rope(main_kv, mpos, fr)
    qr = rms_norm(ctx.lin(x, a + "wq_a.weight"), w[a + "q_norm.weight"], eps)
    q = apply_rope(ctx.lin(qr, a + "wq_b.weight").reshape(B, blk, H, d), dpos, fr)
    kv = apply_rope(rms_norm(ctx.lin(x, a + "wkv.weight"), w[a + "kv_norm.weight"], eps), dpos, fr)
    if ctx.qs:
        main_kv, kv = act_quant(main_kv, 32), act_quant(kv, 32)
    keys = np.concatenate([main_kv, kv], 1)
    o = sparse_attention(q, keys, np.ones((blk, keys.shape[1]), bool), None, None, w[a + "attn_sink"], d ** -0.5)
    o = apply_rope(o, dpos, fr, inverse=True)
    G, Ro = cfg["o_groups"], cfg["o_lora_rank"]
    u = np.einsum("bsgd,grd->bsgr", o.reshape(B, blk, G, -1), w[a + "wo_a.weight"].reshape(G, Ro, -1))
    return ctx.lin(u.reshape(B, blk, G * Ro), a + "wo_b.weight")


def dspark_forward(ckpt_dir, tokens, quant_sim=False, token_map=None, first_token=None):
    """The DSpark draft made right after the backbone has processed `tokens` [B, T] (the reference's
    decode step at start_pos = T-1 followed by `forward_spec`; needs T ≥ 2). The draft block is
    [first_token, noise × (blk-1)] at positions T..T+blk-1, `first_token` defaulting to the greedy
    argmax of the backbone's last logits. Returns (draft_logits [B, blk, V] incl. the Markov bias,
    out_ids [B, blk+1] (greedy), confidence [B, blk])."""
    ck = ckpt_dir if isinstance(ckpt_dir, Checkpoint) else load_checkpoint(ckpt_dir)
    ctx = _Ctx(ck, quant_sim)
    cfg, w = ctx.cfg, ctx.w
    tokens = np.asarray(tokens, dtype=np.int64)
    B, T = tokens.shape
    assert T >= 2 and cfg["dspark_block_size"] > 0
    logits, aux = backbone(ctx, tokens, token_map=token_map)
    p, blk, L, n, eps = T - 1, cfg["dspark_block_size"], cfg["n_layers"], cfg["hc_mult"], cfg["norm_eps"]
    first = logits[:, -1].argmax(-1) if first_token is None else np.broadcast_to(np.asarray(first_token), (B,))
    main_h = np.concatenate(aux["main_hiddens"], -1)  # [B, T, len(targets)·D]
    main_x = rms_norm(ctx.lin(main_h, "mtp.0.main_proj.weight"), w["mtp.0.main_norm.weight"], eps)
    ids = np.full((B, blk), cfg["dspark_noise_token_id"], np.int64)
    ids[:, 0] = first
    X = np.repeat(w["embed.weight"][ids][:, :, None, :], n, axis=2)
    pre = np.zeros((B, blk, n))
    pre[..., 0] = 1.0
    n_exp = cfg["dspark_n_routed_experts"] or cfg["n_routed_experts"]
    k_exp = cfg["dspark_n_activated_experts"] or cfg["n_activated_experts"]
    m_last = cfg["n_mtp_layers"] - 1
    for m in range(cfg["n_mtp_layers"]):
        pf = f"mtp.{m}."
        X, pre = _block(ctx, X, pre, L + m, pf, None, n_exp, k_exp,
                        lambda xx, m=m, pf=pf: _dspark_attention(ctx, xx, main_x, L + m, pf, p))
    x = hc_collapse(X, pre)
    dl = rms_norm(x, w[f"mtp.{m_last}.norm.weight"], eps) @ w["head.weight"].T
    me, mh = w[f"mtp.{m_last}.markov_head.embed.weight"], w[f"mtp.{m_last}.markov_head.head.weight"]
    out = np.zeros((B, blk + 1), np.int64)
    out[:, 0] = first
    embeds = []
    for i in range(blk):
        e = me[out[:, i]]
        dl[:, i] += e @ mh.T
        embeds.append(e)
        out[:, i + 1] = dl[:, i].argmax(-1)
    conf = np.concatenate([x, np.stack(embeds, 1)], -1) @ w[f"mtp.{m_last}.confidence_head.proj.weight"][0]
    return dl, out, conf
