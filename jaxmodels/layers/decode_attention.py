"""Decode attention over the cache: one query token per row, reading only the slots each row has written.

XLA's attention of a decode step reads every slot of the cache (its cost follows the cache size, not the
context) and, inside the scanned layer loop, first copies the layer's slice of the stacked cache (at batch 32,
2 of a 9.9 ms Llama-8B step). This kernel (Pallas, Triton backend) reads the whole stacked buffer in place
through the layer index and a block table, one program per (row, kv head, split of the row's valid slots),
split-K flash decoding: each program keeps a running max and sum over its blocks of slots, and the splits are
combined afterwards, where GPT-OSS's sinks enter the denominator. Windows, rings, sinks and softcap are the
cache's and `attention.attend`'s semantics exactly; `attention.decode` runs it on the GPU for half types and the
XLA path everywhere else (the CPU tests run this kernel in Pallas' interpreter against that path).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxmodels.layers import triton

F32 = jnp.float32
BLOCK_K = 64  # slots per step of a program's loop
MIN_ROWS = 16  # the smallest M of a Triton dot: a kv head's query heads are padded to it
TARGET_PROGRAMS = 512  # splits of a row's slots until (rows x kv heads x splits) fills ~4 programs per SM
_INIT = -1e30  # a finite start for the running max: fully masked blocks never give inf - inf


def _kernel(q_ref, k_ref, v_ref, table_ref, meta_ref, o_ref, m_ref, l_ref, *, slots, window, block_size, pages,
            kv_heads, splits, scale, softcap):
    """One (row b, kv head h, split s): q [R, d] over the slots of its split; o [R, d], m and l [R] unnormalised."""
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, last = meta_ref[0], meta_ref[1 + b]
    n = jnp.clip(last + 1, 0, slots)  # slots written: positions 0 .. last, a ring holds the latest `slots`
    chunk = (n + splits * BLOCK_K - 1) // (splits * BLOCK_K) * BLOCK_K
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, n)
    q = q_ref[...]
    R, d = q.shape

    def body(i, carry):
        o, m, l = carry
        slot = lo + i * BLOCK_K + jnp.arange(BLOCK_K, dtype=jnp.int32)
        safe = jnp.minimum(slot, n - 1)
        page = jnp.maximum(table_ref[b, safe // block_size], 0)  # unallocated (-1): block 0, masked below
        row = (layer * pages + page) * kv_heads + h
        off = safe % block_size
        k = k_ref[row, off, :].astype(q.dtype)  # [BLOCK_K, d]
        x = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32) * scale
        if softcap is not None:
            x = softcap * jnp.tanh(x / softcap)
        pos = last - (last - safe + slots) % slots  # what the slot holds (cache.LayerCache.positions)
        ok = (slot < hi) & (pos >= 0)
        if window is not None:
            ok &= pos > last - window
        x = jnp.where(ok[None, :], x, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        p = jnp.exp(x - m_new[:, None])
        c = jnp.exp(m - m_new)
        v = v_ref[row, off, :].astype(q.dtype)  # P.V in the queries' dtype, as `attend` of the cast cache
        o = o * c[:, None] + jax.lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())),
                                                 preferred_element_type=F32)
        return o, m_new, l * c + jnp.sum(p, axis=1)

    steps = jnp.maximum(hi - lo + BLOCK_K - 1, 0) // BLOCK_K
    init = (jnp.zeros((R, d), F32), jnp.full((R,), _INIT, F32), jnp.zeros((R,), F32))
    o, m, l = jax.lax.fori_loop(0, steps, body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def fits(q, k) -> bool:
    """Whether the kernel runs: on the GPU, half-precision queries over a cache of their dtype (a mixed pair is
    not what the GPU tests cover), a head width Triton tiles within shared memory, a cache the lowering addresses
    (`triton.offsets_fit`; values share the keys' geometry)."""
    d = q.shape[-1]
    return (jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and k.buffer.dtype == q.dtype
            and d in (16, 32, 64, 128, 256) and k.buffer.shape[-1] == d and triton.offsets_fit(k.buffer))


def decode(q, k, v, last, *, window: int | None, scale: float, softcap: float | None = None, sinks=None,
           interpret: bool = False):
    """q [B, H, d] (one token per row) over one layer of a cache -> [B, H, d] in q's dtype.

    k, v: keys and values as `jaxmodels.cache.Pages` (every layer, read in place; v's table is k's); last [B]:
    each row's query position (its slots hold positions up to it; < 0: a row with nothing to attend, whose
    output is 0). window: keys at p > last - window only. sinks [H]: a logit in each head's softmax denominator
    (GPT-OSS). Scores, softmax and accumulation in fp32; P.V in the queries' dtype."""
    B, H, d = q.shape
    slots, K = k.slots, k.heads
    assert v.buffer.shape == k.buffer.shape, "keys and values share one geometry"
    r = H // K
    R = max(MIN_ROWS, 1 << (r - 1).bit_length())
    splits = max(1, min(-(-TARGET_PROGRAMS // (B * K)), -(-slots // BLOCK_K)))
    qg = jnp.pad(q.reshape(B, K, r, d), ((0, 0), (0, 0), (0, R - r), (0, 0)))
    meta = jnp.concatenate([jnp.asarray(k.layer, jnp.int32).reshape(1), jnp.asarray(last, jnp.int32)])
    kernel = functools.partial(_kernel, slots=slots, window=window, block_size=k.buffer.shape[1], pages=k.pages,
                               kv_heads=K, splits=splits, scale=scale, softcap=softcap)
    parts = (B, K, splits, R)
    o, m, l = pl.pallas_call(
        kernel, grid=(B, K, splits),
        in_specs=[pl.BlockSpec((None, None, R, d), lambda b, h, s: (b, h, 0, 0)), triton.whole(k.buffer),
                  triton.whole(v.buffer), triton.whole(k.table), triton.whole(meta)],
        out_specs=[pl.BlockSpec((None, None, None, R, d), lambda b, h, s: (b, h, s, 0, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0)),
                   pl.BlockSpec((None, None, None, R), lambda b, h, s: (b, h, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((*parts, d), F32), jax.ShapeDtypeStruct(parts, F32),
                   jax.ShapeDtypeStruct(parts, F32)],
        interpret=interpret, name="decode_attention",
        **({} if interpret else triton.params(num_stages=2)),
    )(qg, k.buffer, v.buffer, k.table.astype(jnp.int32), meta)
    return combine(o[..., :r, :], m[..., :r], l[..., :r], sinks).reshape(B, H, d).astype(q.dtype)


def combine(o, m, l, sinks=None):
    """Splits' unnormalised outputs o [B, K, S, r, d] with their maxima m and sums l [B, K, S, r] -> [B, K, r, d].
    A sink adds exp(sink) to the denominator only."""
    M = jnp.max(m, axis=2)
    w = jnp.exp(m - M[:, :, None])
    den = jnp.sum(l * w, axis=2)
    if sinks is not None:
        K, r = o.shape[1], o.shape[3]
        den = den + jnp.exp(sinks.astype(F32).reshape(1, K, r) - M)
    num = jnp.sum(o * w[..., None], axis=2)
    return num / jnp.maximum(den, jnp.finfo(F32).tiny)[..., None]
