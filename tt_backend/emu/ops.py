"""One NumPy function per ttnn op the lowering emits: the op's semantics, plus the compute numerics
that happen inside it (matmul fidelity/accumulation, bf16 attention probabilities) at level `full`.

Every function takes an `Env` first (numerics level, output quantiser) and the op's own positional
tensors and keyword arguments, named as ttnn names them. Tensors are float32 arrays of their
*logical* shape; the executor rounds each output to its declared dtype. Integer inputs (token ids,
positions, page tables) are int arrays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tt_backend import paged_cache
from tt_backend.emu.numerics import bf16, matmul

F32 = np.float32


@dataclass
class Env:
    level: str  # exact | storage | full
    store: Callable[[np.ndarray, str], np.ndarray]  # (values, ttnn dtype) -> values as that dtype holds them
    kv_dtype: str = "ttnn.bfloat16"  # the paged caches' dtype (paged_update_cache repacks into it)
    owners: object = None  # paged_cache.RowOwners: block-ownership checks on every cache write

    @property
    def full(self) -> bool:
        return self.level == "full"


OPS: dict[str, Callable] = {}


def op(name: str):
    def deco(fn):
        OPS[name] = fn
        return fn

    return deco


# ---------------------------------------------------------------------------------- data movement
@op("ttnn.embedding")
def embedding(env, input_tensor, weight, *, layout=None, dtype=None, memory_config=None):
    """ids [1, R] -> rows [1, R, D] (an exact gather)."""
    ids = np.asarray(input_tensor).astype(np.int64)
    if ids.min() < 0 or ids.max() >= weight.shape[0]:
        raise IndexError(f"embedding index out of range [0, {weight.shape[0]}): {ids.min()}..{ids.max()}")
    return weight[ids]


@op("ttnn.reshape")
def reshape(env, input_tensor, *, shape, memory_config=None):
    return input_tensor.reshape(shape)


@op("ttnn.typecast")
def typecast(env, input_tensor, *, dtype, memory_config=None):
    """Values only change by the output dtype's rounding, which the executor applies."""
    return input_tensor


@op("ttnn.experimental.nlp_create_qkv_heads")
def nlp_create_qkv_heads(env, input_tensor, input_kv=None, *, num_heads, num_kv_heads, transpose_k_heads=False,
                         memory_config=None):
    """[1, 1, S, (H + 2K) d] -> q [1, H, S, d], k [1, K, S, d] (or [1, K, d, S]), v [1, K, S, d]. With `input_kv`
    (ttnn: the input is "the q tensor if kv_tensor is populated"): q from input_tensor [1, 1, S, H d], k and v
    from input_kv [1, 1, S, 2 K d]."""
    def heads(x, n):
        _, _, S, W = x.shape
        return x[0, 0].reshape(S, n, W // n).transpose(1, 0, 2)[None]

    if input_kv is None:
        x = heads(input_tensor, num_heads + 2 * num_kv_heads)
        q, k, v = x[:, :num_heads], x[:, num_heads:num_heads + num_kv_heads], x[:, num_heads + num_kv_heads:]
    else:
        if input_kv.shape[2] != input_tensor.shape[2]:
            raise NotImplementedError("nlp_create_qkv_heads with input_kv of another length than the input is not "
                                      "emulated (whether ttnn allows it is unverified)")
        q, kv = heads(input_tensor, num_heads), heads(input_kv, 2 * num_kv_heads)
        k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    return q, (k.transpose(0, 1, 3, 2) if transpose_k_heads else k), v


@op("ttnn.experimental.nlp_create_qkv_heads_decode")
def nlp_create_qkv_heads_decode(env, input_tensor, *, num_heads, num_kv_heads, memory_config=None):
    """[1, 1, B, (H + 2K) d] -> q [1, B, H, d], k/v [1, B, K, d] (heads padded to 32 only in storage)."""
    _, _, B, W = input_tensor.shape
    d = W // (num_heads + 2 * num_kv_heads)
    x = input_tensor[0, 0].reshape(B, num_heads + 2 * num_kv_heads, d)[None]
    return x[:, :, :num_heads], x[:, :, num_heads:num_heads + num_kv_heads], x[:, :, num_heads + num_kv_heads:]


@op("ttnn.experimental.nlp_concat_heads")
def nlp_concat_heads(env, input_tensor, *, memory_config=None):
    """[1, H, S, d] -> [1, 1, S, H d]."""
    _, H, S, d = input_tensor.shape
    return input_tensor[0].transpose(1, 0, 2).reshape(1, 1, S, H * d)


@op("ttnn.experimental.nlp_concat_heads_decode")
def nlp_concat_heads_decode(env, input_tensor, *, num_heads, memory_config=None):
    """[1, B, H(pad), d] -> [1, 1, B, num_heads d] (padding heads dropped)."""
    _, B, _, d = input_tensor.shape
    return input_tensor[:, :, :num_heads].reshape(1, 1, B, num_heads * d)


# ----------------------------------------------------------------------------------- arithmetic
@op("ttnn.rms_norm")
def rms_norm(env, input_tensor, *, epsilon, weight=None, bias=None, compute_kernel_config=None,
             memory_config=None, program_config=None):
    """x / sqrt(mean(x^2) + eps) * weight, statistics in fp32 (fp32 Dst accumulation)."""
    x = input_tensor.astype(F32)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(epsilon))
    if weight is not None:
        y = y * weight.reshape(-1)
    return y + bias.reshape(-1) if bias is not None else y


@op("ttnn.layer_norm")
def layer_norm(env, input_tensor, *, epsilon, weight=None, bias=None, compute_kernel_config=None,
               memory_config=None, program_config=None):
    x = input_tensor.astype(F32)
    c = x - np.mean(x, axis=-1, keepdims=True)
    y = c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + F32(epsilon))
    if weight is not None:
        y = y * weight.reshape(-1)
    return y + bias.reshape(-1) if bias is not None else y


@op("ttnn.linear")
def linear(env, input_tensor_a, input_tensor_b, *, bias=None, dtype=None, compute_kernel_config=None,
           memory_config=None, program_config=None):
    """[..., M, K] @ [1, 1, K, N] through the matrix-engine model."""
    y = matmul(input_tensor_a, input_tensor_b[0, 0], env.level, compute_kernel_config)
    return y + bias.reshape(-1) if bias is not None else y


_UNARY = {
    "ttnn.UnaryOpType.SILU": lambda x: x / (F32(1) + np.exp(-x)),
    "ttnn.UnaryOpType.GELU": lambda x: F32(0.5) * x * (F32(1) + _erf(x / np.sqrt(F32(2)))),
    "ttnn.UnaryOpType.GELU_TANH": lambda x: F32(0.5) * x * (F32(1) + np.tanh(
        np.sqrt(F32(2 / np.pi)) * (x + F32(0.044715) * x ** 3))),
}


def _erf(x):
    from math import erf

    return np.vectorize(erf, otypes=[F32])(x)


def _binary(a, b, input_tensor_b):
    if (b is None) == (input_tensor_b is None):
        raise TypeError("give exactly one second operand (a tensor, or input_tensor_b as a scalar)")
    return b if b is not None else F32(input_tensor_b)


@op("ttnn.mul")
def mul(env, input_tensor_a, input_tensor_b_tensor=None, *, input_tensor_b=None, input_tensor_a_activations=None,
        dtype=None, memory_config=None):
    """a * b with optional fused activations on a (fp32 SFPU math, output rounded by the executor)."""
    a = input_tensor_a.astype(F32)
    for act in input_tensor_a_activations or ():
        if act not in _UNARY:
            raise NotImplementedError(f"activation {act} is not emulated")
        a = _UNARY[act](a)
    return a * _binary(a, input_tensor_b_tensor, input_tensor_b)


@op("ttnn.add")
def add(env, input_tensor_a, input_tensor_b_tensor=None, *, input_tensor_b=None, dtype=None, memory_config=None):
    return input_tensor_a.astype(F32) + _binary(input_tensor_a, input_tensor_b_tensor, input_tensor_b)


@op("ttnn.tanh")
def tanh(env, input_tensor, *, memory_config=None):
    return np.tanh(input_tensor.astype(F32))


# ---------------------------------------------------------------------------------------- RoPE
@op("ttnn.experimental.rotary_embedding_llama")
def rotary_embedding_llama(env, input_tensor, cos_cache, sin_cache, trans_mat, *, is_decode_mode=False,
                           compute_kernel_config=None, memory_config=None):
    """x * cos + (x @ T) * sin, T one 32x32 tile applied to each 32-column tile of head_dim.

    prefill: x [1, H, S, d], cos/sin [1, 1, S, d]; decode: x [1, B, H, d], cos/sin [1, B, 1, d].
    """
    x = input_tensor.astype(F32)
    d = x.shape[-1]
    tiles = x.reshape(*x.shape[:-1], d // 32, 32)
    rot = matmul(tiles, trans_mat[0, 0], env.level, compute_kernel_config).reshape(x.shape)
    if env.full:
        rot = bf16(rot)  # the swapped tile is packed before the elementwise multiply
    return x * cos_cache + rot * sin_cache


# ------------------------------------------------------------------------------------ KV caches
def _cache_rows(env, dtype: str):
    return lambda rows: env.store(np.asarray(rows, F32), dtype)


@op("ttnn.experimental.paged_fill_cache")
def paged_fill_cache(env, cache, input_tensor, page_table, *, batch_idx=0, cache_position_modulo=None,
                     valid_seq_len_tensor=None):
    """Raw tile copy through one page-table row (tt_backend.paged_cache semantics), in place.
    With a ring (cache_position_modulo), writing stops at valid_seq_len rounded up to whole blocks."""
    valid = None if valid_seq_len_tensor is None else int(np.asarray(valid_seq_len_tensor).reshape(-1)[0])
    paged_cache.paged_fill_cache(cache, np.asarray(input_tensor, cache.dtype), np.asarray(page_table),
                                 batch_idx=batch_idx, cache_position_modulo=cache_position_modulo,
                                 valid_seq_len=valid, owners=env.owners)
    return ()


@op("ttnn.experimental.paged_update_cache")
def paged_update_cache(env, cache, input_tensor, *, update_idxs_tensor, page_table, cache_position_modulo=None):
    """One token row per user, repacked into the cache dtype (rows are independent bfp blocks)."""
    q = _cache_rows(env, env.kv_dtype)
    paged_cache.paged_update_cache(cache, np.asarray(input_tensor, F32), update_idxs=np.asarray(update_idxs_tensor),
                                   page_table=np.asarray(page_table), cache_position_modulo=cache_position_modulo,
                                   quantize=q, owners=env.owners)
    return ()


# ------------------------------------------------------------------------------------ attention
def _softmax_attend(env, q, k, v, allowed, scale, sink, cfg, bias=None):
    """q [G, r, Tq, d] against k/v [G, Tk, d] (G kv heads, r query heads each); allowed [Tq, Tk] or
    [r?]; sink [G, r] logits or None; bias [Tq, Tk] an additive mask (added to the scaled scores). Scores fp32,
    softmax fp32, P rounded to bf16 before P@V at full."""
    G, r, Tq, d = q.shape
    # [G, r*Tq, d] @ [G, d, Tk]: contiguous 3-D batches keep NumPy on its BLAS path
    s = matmul(np.ascontiguousarray(q).reshape(G, r * Tq, d), np.ascontiguousarray(np.swapaxes(k, -1, -2)),
               env.level, cfg).reshape(G, r, Tq, -1) * F32(scale)
    if bias is not None:
        s = s + bias.astype(F32)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink[..., None, None])
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    den = e.sum(-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink[..., None, None] - m)
    p = np.where(den > 0, e / np.where(den > 0, den, 1), 0).astype(F32)
    if env.full:
        p = bf16(p)
    return matmul(p.reshape(G, r * Tq, -1), np.ascontiguousarray(v), env.level, cfg).reshape(G, r, Tq, d)


def _sink(attention_sink, H, K):
    return None if attention_sink is None else attention_sink.reshape(-1)[:H].reshape(K, H // K).astype(F32)


@op("ttnn.transformer.scaled_dot_product_attention")
def scaled_dot_product_attention(env, input_tensor_q, input_tensor_k, input_tensor_v, *, is_causal=True,
                                 attn_mask=None, scale=None, sliding_window_size=None, attention_sink=None,
                                 compute_kernel_config=None, program_config=None, memory_config=None):
    """q [1, H, S, d], k/v [1, K, S, d] -> [1, H, S, d]; grouped heads, causal, optional window of
    `sliding_window_size` keys (the query and the W-1 before it) and per-head sink logits. With
    ``is_causal=False`` an additive ``attn_mask`` [1, 1, S, Sk] (heads broadcast) decides what each query sees;
    k/v may then hold Sk != S keys (cross-attention: tt-metal's Mllama prefill)."""
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: attn_mask needs is_causal=False (ttnn asserts it)")
    _, H, S, d = input_tensor_q.shape
    K = input_tensor_k.shape[1]
    q = input_tensor_q[0].reshape(K, H // K, S, d)
    sink, sc = _sink(attention_sink, H, K), scale if scale is not None else d**-0.5
    out = np.empty((K, H // K, S, d), F32)
    if not is_causal:
        if attn_mask is None:
            raise NotImplementedError("non-causal prefill attention without a mask is not emulated")
        mask, Sk = np.asarray(attn_mask, F32), input_tensor_k.shape[2]
        if mask.shape != (1, 1, S, Sk):
            raise ValueError(f"attn_mask must be [1, 1, {S}, {Sk}], got {list(mask.shape)}")
        if sliding_window_size:
            raise NotImplementedError("attn_mask together with sliding_window_size is not emulated (how ttnn "
                                      "combines them is unverified): put the window into the mask")
        allowed = np.ones((1, S), bool)
        for r0 in range(0, S, 256):
            r1 = min(S, r0 + 256)
            out[:, :, r0:r1] = _softmax_attend(env, q[:, :, r0:r1], input_tensor_k[0], input_tensor_v[0], allowed,
                                               sc, sink, compute_kernel_config, bias=mask[0, 0, r0:r1])
        return out.reshape(1, H, S, d)
    for r0 in range(0, S, 256):  # query blocks bound the [S, S] score memory (values are unchanged)
        r1 = min(S, r0 + 256)
        k0 = max(0, r0 - sliding_window_size + 1) if sliding_window_size else 0  # keys no query here can see
        i, j = np.arange(r0, r1)[:, None], np.arange(k0, r1)[None, :]
        allowed = j <= i
        if sliding_window_size:
            allowed &= j > i - sliding_window_size
        out[:, :, r0:r1] = _softmax_attend(env, q[:, :, r0:r1], input_tensor_k[0, :, k0:r1],
                                           input_tensor_v[0, :, k0:r1], allowed, sc, sink, compute_kernel_config)
    return out.reshape(1, H, S, d)


@op("ttnn.transformer.paged_scaled_dot_product_attention_decode")
def paged_scaled_dot_product_attention_decode(env, input_tensor_q, input_tensor_k, input_tensor_v, *,
                                              page_table_tensor, cur_pos_tensor=None, is_causal=True, attn_mask=None,
                                              scale=None, sliding_window_size=None, attention_sink=None,
                                              compute_kernel_config=None, program_config=None,
                                              memory_config=None, cache_position_modulo=None):
    """q [1, B, H, d]; K/V paged caches; user b attends to its positions 0..cur_pos[b] (the last
    `sliding_window_size` of them when set: cur_pos - W < j <= cur_pos, as tt-metal's
    sdpa_test_utils.create_sliding_window_mask). cur_pos -1 skips the user (output 0); -1 page-table
    entries read as zeros. Sink logits enter the softmax unscaled (HF's GPT-OSS semantics; how ttnn's
    kernel treats `attention_sink` is not verified). ``is_causal=False`` (tt-metal's Mllama cross-attention
    decode): no positions; every user reads keys 0..Sk-1 through its page-table row, weighted by the additive
    ``attn_mask`` [1, B, H, Sk]."""
    _, B, H, d = input_tensor_q.shape
    K = input_tensor_k.shape[1]
    pt = np.asarray(page_table_tensor)
    out = np.zeros((1, B, H, d), F32)
    sc = scale if scale is not None else d**-0.5
    if not is_causal:
        mask = None if attn_mask is None else np.asarray(attn_mask, F32)
        if mask is None or mask.ndim != 4 or mask.shape[:3] != (1, B, H):
            raise ValueError(f"non-causal decode attention needs attn_mask [1, {B}, {H}, keys], got "
                             f"{None if mask is None else list(mask.shape)}")
        if cur_pos_tensor is not None or sliding_window_size or attention_sink is not None:
            raise NotImplementedError("non-causal decode attention with positions, a window or sinks is not emulated")
        Sk = mask.shape[-1]
        allowed = np.ones((1, Sk), bool)
        for b in range(B):
            keys, vals = (paged_cache.gather_sequence(c, pt[b], Sk) for c in (input_tensor_k, input_tensor_v))
            q = input_tensor_q[0, b].reshape(K, H // K, 1, d)
            o = _softmax_attend(env, q, keys, vals, allowed, sc, None, compute_kernel_config,
                                bias=mask[0, b].reshape(K, H // K, 1, Sk))
            out[0, b] = o.reshape(H, d)
        return out
    pos = np.asarray(cur_pos_tensor).reshape(-1)
    for b in range(B):
        p = int(pos[b])
        if p < 0:
            continue
        if cache_position_modulo:  # a ring: slot s holds the latest position = s (mod ring) written so far
            keys, j = paged_cache.gather_ring(input_tensor_k, pt[b], p, cache_position_modulo)
            vals, _ = paged_cache.gather_ring(input_tensor_v, pt[b], p, cache_position_modulo)
        else:
            keys = paged_cache.gather_sequence(input_tensor_k, pt[b], p + 1)
            vals = paged_cache.gather_sequence(input_tensor_v, pt[b], p + 1)
            j = np.arange(p + 1)
        allowed = (j >= 0) & (j <= p)
        if sliding_window_size:
            allowed &= j > p - sliding_window_size
        q = input_tensor_q[0, b].reshape(K, H // K, 1, d)
        o = _softmax_attend(env, q, keys, vals, allowed[None, :], scale if scale is not None else d**-0.5,
                            _sink(attention_sink, H, K), compute_kernel_config)
        out[0, b] = o.reshape(H, d)
    return out


@op("ttnn.transformer.chunked_scaled_dot_product_attention")
def chunked_scaled_dot_product_attention(env, input_tensor_q, input_tensor_k, input_tensor_v, page_table_tensor, *,
                                         chunk_start_idx, scale=None, sliding_window_size=None, attention_sink=None,
                                         compute_kernel_config=None, program_config=None, memory_config=None):
    """A prefill chunk q [1, H, S, d] at positions chunk_start_idx.. against the paged K/V of positions
    0..chunk_start_idx + S - 1 (earlier chunks and this one, already filled), causal."""
    _, H, S, d = input_tensor_q.shape
    K = input_tensor_k.shape[1]
    row = np.asarray(page_table_tensor)[0]
    n = chunk_start_idx + S
    keys = paged_cache.gather_sequence(input_tensor_k, row, n)
    vals = paged_cache.gather_sequence(input_tensor_v, row, n)
    q = input_tensor_q[0].reshape(K, H // K, S, d)
    sink, sc = _sink(attention_sink, H, K), scale if scale is not None else d**-0.5
    out = np.empty((K, H // K, S, d), F32)
    for r0 in range(0, S, 256):
        r1 = min(S, r0 + 256)
        i, j = chunk_start_idx + np.arange(r0, r1)[:, None], np.arange(n)[None, :]
        allowed = j <= i
        if sliding_window_size:
            allowed &= j > i - sliding_window_size
        out[:, :, r0:r1] = _softmax_attend(env, q[:, :, r0:r1], keys, vals, allowed, sc, sink, compute_kernel_config)
    return out.reshape(1, H, S, d)


# ------------------------------------------------------------------------------- MoE routing
@op("ttnn.topk")
def topk(env, input_tensor, *, k, dim=-1, largest=True, sorted=True, memory_config=None):
    """The k largest along `dim`, ties to the lowest index (ttnn's `stable` behaviour): (values, uint16 indices)."""
    if dim not in (-1, input_tensor.ndim - 1) or not largest or not sorted:
        raise NotImplementedError("only largest, sorted top-k over the last dim is emulated")
    idx = np.argsort(-input_tensor, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(input_tensor, idx, -1), idx.astype(np.uint16)


@op("ttnn.softmax")
def softmax(env, input_tensor, *, dim=-1, numeric_stable=True, compute_kernel_config=None, memory_config=None):
    x = input_tensor.astype(F32)
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


@op("ttnn.scatter")
def scatter(env, input, *, dim, index, src, memory_config=None, reduce=None):
    """out = input; out[..., index[..., j]] = src[..., j] along the last dim."""
    if dim not in (-1, input.ndim - 1) or reduce is not None:
        raise NotImplementedError("only a plain scatter along the last dim is emulated")
    out = np.array(input, F32, copy=True)
    np.put_along_axis(out, np.asarray(index).astype(np.int64), src, -1)
    return out


@op("ttnn.slice")
def ttnn_slice(env, input_tensor, *, starts, ends, steps=None, memory_config=None):
    return input_tensor[tuple(slice(a, b, None if steps is None else steps[i]) for i, (a, b) in
                              enumerate(zip(starts, ends)))]


@op("ttnn.clamp")
def clamp(env, input_tensor, *, min=None, max=None, memory_config=None):  # noqa: A002 (ttnn's names)
    return np.clip(input_tensor.astype(F32), -np.inf if min is None else min, np.inf if max is None else max)


@op("ttnn.sigmoid")
def sigmoid(env, input_tensor, *, memory_config=None):
    return F32(1) / (F32(1) + np.exp(-input_tensor.astype(F32)))


@op("ttnn.sum")
def ttnn_sum(env, input_tensor, *, dim, keepdim=False, memory_config=None, compute_kernel_config=None):
    return input_tensor.astype(F32).sum(axis=dim, keepdims=keepdim)


@op("ttnn.div")
def div(env, input_tensor_a, input_tensor_b_tensor=None, *, input_tensor_b=None, memory_config=None):
    return input_tensor_a.astype(F32) / _binary(input_tensor_a, input_tensor_b_tensor, input_tensor_b)


# ----------------------------------------------------------------------- DeepSeek (tt_backend.deepseek_lowering)
@op("ttnn.permute")
def permute(env, input_tensor, *, dims, memory_config=None, pad_value=None):
    return np.transpose(input_tensor, dims)


@op("ttnn.repeat")
def repeat(env, input_tensor, *, repeat_dims, memory_config=None):
    return np.tile(input_tensor, repeat_dims)


@op("ttnn.concat")
def concat(env, *, tensors, dim=0, memory_config=None):
    return np.concatenate([np.asarray(t, F32) for t in tensors], axis=dim)


@op("ttnn.to_layout")
def to_layout(env, tensor, *, layout, dtype=None, memory_config=None):
    return tensor


@op("ttnn.relu")
def relu(env, input_tensor, *, memory_config=None):
    return np.maximum(input_tensor.astype(F32), F32(0))


@op("ttnn.sqrt")
def sqrt(env, input_tensor, *, memory_config=None, fast_and_approximate_mode=False):
    return np.sqrt(input_tensor.astype(F32))


@op("ttnn.abs")
def ttnn_abs(env, input_tensor, *, memory_config=None):
    return np.abs(input_tensor.astype(F32))


@op("ttnn.sign")
def sign(env, input_tensor, *, memory_config=None):
    return np.sign(input_tensor.astype(F32))


@op("ttnn.softplus")
def softplus(env, input_tensor, *, beta=1.0, threshold=20.0, memory_config=None):
    """log(1 + exp(beta x)) / beta, and x itself where beta x > threshold (torch's rule, which ttnn follows)."""
    x = input_tensor.astype(F32)
    bx = x * F32(beta)
    return np.where(bx > threshold, x, np.logaddexp(bx, F32(0)) / F32(beta)).astype(F32)


@op("ttnn.sub")
def sub(env, input_tensor_a, input_tensor_b_tensor=None, *, input_tensor_b=None, dtype=None, memory_config=None):
    return input_tensor_a.astype(F32) - _binary(input_tensor_a, input_tensor_b_tensor, input_tensor_b)


@op("ttnn.max")
def ttnn_max(env, input_tensor, *, dim, keepdim=False, memory_config=None, compute_kernel_config=None):
    return input_tensor.astype(F32).max(axis=dim, keepdims=keepdim)


@op("ttnn.matmul")
def batched_matmul(env, input_tensor_a, input_tensor_b, *, transpose_a=False, transpose_b=False, dtype=None,
                   compute_kernel_config=None, memory_config=None, program_config=None):
    """a @ b with broadcast batch dims (a [1, 1, K, N] weight or a batched b), optional transposes of the last two."""
    a = np.swapaxes(input_tensor_a, -1, -2) if transpose_a else input_tensor_a
    b = np.swapaxes(input_tensor_b, -1, -2) if transpose_b else input_tensor_b
    return matmul(np.ascontiguousarray(a), np.ascontiguousarray(b), env.level, compute_kernel_config)


@op("ttnn.sparse_matmul")
def sparse_matmul(env, input_tensor_a, input_tensor_b, *, sparsity, program_config=None, nnz=None,
                  is_input_a_sparse=False, is_input_b_sparse=True, dtype=None, compute_kernel_config=None,
                  memory_config=None, output_tile=None):
    """Expert matmuls computed only where `sparsity` is nonzero (zeros elsewhere), as the op skips them.

    b sparse (gate/up): a [A, B, M, K], b [1, E, K, N], sparsity [A, B, 1, E] -> [A, B, 1, E, M, N].
    a sparse (down):    a [A, E, M, K], b [1, E, K, N], sparsity [1, 1, A, E] -> [A, E, M, N]."""
    a, b, sp = np.asarray(input_tensor_a, F32), np.asarray(input_tensor_b, F32), np.asarray(sparsity)
    E = b.shape[1]
    if is_input_b_sparse and not is_input_a_sparse:
        A, B, M, _ = a.shape
        out = np.zeros((A, B, 1, E, M, b.shape[-1]), F32)
        for i, j, e in zip(*np.nonzero(sp[:, :, 0, :])):
            out[i, j, 0, e] = matmul(a[i, j], b[0, e], env.level, compute_kernel_config)
        return out
    if is_input_a_sparse and not is_input_b_sparse:
        A, _, M, _ = a.shape
        out = np.zeros((A, E, M, b.shape[-1]), F32)
        for i, e in zip(*np.nonzero(sp[0, 0])):
            out[i, e] = matmul(a[i, e], b[0, e], env.level, compute_kernel_config)
        return out
    raise NotImplementedError("sparse_matmul: exactly one of is_input_a_sparse / is_input_b_sparse is emulated")


@op("ttnn.pad")
def pad(env, input_tensor, *, padding, value, memory_config=None, use_multicore=True):
    """padding: [(before, after)] per dim, filled with `value`."""
    return np.pad(input_tensor.astype(F32), [tuple(p) for p in padding], constant_values=value)
