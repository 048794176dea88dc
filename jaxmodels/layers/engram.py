"""Engram (DeepSeek V4.1): n-gram hash lookups gated into every hc stream before the layer's block.

Spec: specs/deepseek_v4.md §7 (REF41 `Engram`, REF41-eng `engram.py`), §12 trap 22.

Host side (NumPy): `build_compressed_token_map`, `EngramLayout.from_config`.

Device side: `hash_window` / `ngram_hashes` compute the same hash columns in jit-able JAX with 32-bit
integers only. Why: generate() is one jitted program, so the hash of each new token must be computed inside
the decode loop, and the reference's arithmetic is int64 (`tok * mult` up to 2^63, XOR, `% prime`). JAX's
x64 mode is a process-wide switch that would change the dtype of every Python scalar and index in the
library, so instead the 64-bit values are held as (hi, lo) uint32 limbs:
- `tok * mult`: tok < 2^31 times a 64-bit odd multiplier; the product is < 2^63 by construction
  (mult <= INT64_MAX // compressed_vocab), so hi = mulhi(tok, mult_lo) + tok * mult_hi (mod 2^32) is exact;
  mulhi is built from 16-bit partial products.
- XOR is limb-wise.
- `% p` (p < 2^31): r = hi % p, then the low limb is folded in k bits at a time, r = (r << k | bits) % p,
  with k = 32 - bit_length(max prime) so nothing overflows uint32 (k = 8 for the released primes ~1.6e7).
The outputs (offset + residue < Σ primes, 3.84e8 for the released model) fit int32.

Hash columns are int32 [B, S, n_engram_layers, (max_ngram-1)*n_heads], ordered (2-gram heads, 3-gram heads, ...)
and offset into each layer's own table.

`engram_inject` is §7.2. Parameters of one engram layer (n = hc_mult, D = dim, H = head_dim = 256,
C = (max_ngram-1)*n_heads = 24):
  table     [R, H]          the hash table; bf16/fp32 (dequantised at load), or float8_e4m3fn kept quantized
                            together with `table_scale` [R, H/32] uint8 E8M0 bytes (rows dequantised after the gather)
  wkv       [C*H, (n+1)*D]  (in, out) layout: the checkpoint's `engram.wkv.weight` [(n+1)*D, C*H] transposed.
                            Columns [0, n*D) are the n keys (stream-major), [n*D, (n+1)*D) the shared value.
                            Or kept quantized in the checkpoint layout: {"fp8": e4m3 bytes [(n+1)*D, C*H],
                            "scale": E8M0 bytes [(n+1)*D/32, C*H/32]} (qdq.linear).
  q_weight  [n, D], k_weight [n, D]   only their product is used.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers import qdq

F32 = jnp.float32
DEAD = -1  # compressed id of a token that takes no part in an n-gram (image spans); also "before the start"
GATE_CLAMP = 1e-6


# ------------------------------------------------------------------------------------------- host side
def build_compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """Token id -> compressed id (int32 [vocab]) and the number of classes (§7.1 step 1).

    `tokenizer` is a `tokenizers.Tokenizer` or a HF tokenizer (its `backend_tokenizer` is used: the raw Rust
    decode, no clean-up of spaces). Each id is decoded alone; a decode containing U+FFFD (a partial UTF-8 byte
    token) is keyed by its raw token string, any other by its normalised text (or the raw text when that
    normalises to nothing). Keys are numbered in first-seen order.
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token that is exactly one space from stripping to "" (REF41-eng)
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    n = len(tokenizer) if hasattr(tokenizer, "backend_tokenizer") else backend.get_vocab_size(with_added_tokens=True)
    key_to_id: dict[str, int] = {}
    lookup = np.zeros(n, np.int32)
    for token_id in range(n):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the first 13 prime bases)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class EngramLayout:
    """Prime-sized bucket ranges and hash multipliers of every engram layer (hashable: a static jit argument).

    primes[l][g][h]: modulus of n-gram order g+2, head h of engram layer l; offsets[l][c]: start of column c's
    range in layer l's table (exclusive cumsum of the flattened primes); multipliers[l][shift] (odd, < 2^63).
    """

    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    vocab_size: int
    compressed_vocab: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    multipliers: tuple[tuple[int, ...], ...]

    @classmethod
    def from_config(cls, layer_ids, max_ngram: int, vocab_size: int, n_heads: int,
                    compressed_vocab: int) -> "EngramLayout":
        return _layout(tuple(int(i) for i in layer_ids), int(max_ngram), int(vocab_size), int(n_heads),
                       int(compressed_vocab))

    @property
    def n_cols(self) -> int:
        return (self.max_ngram - 1) * self.n_heads

    @property
    def num_embeddings(self) -> tuple[int, ...]:
        """Table rows per engram layer (= Σ of its primes)."""
        return tuple(sum(sum(g) for g in layer) for layer in self.primes)

    def flat_primes(self) -> np.ndarray:
        """int64 [n_layers, n_cols], column order (2-gram heads, 3-gram heads, ...)."""
        return np.array([[p for g in layer for p in g] for layer in self.primes], np.int64).reshape(-1, self.n_cols)


@functools.lru_cache(maxsize=32)
def _layout(layer_ids, max_ngram, vocab_size, n_heads, compressed_vocab) -> EngramLayout:
    if max_ngram < 2 or n_heads < 1 or compressed_vocab < 1:
        raise ValueError(f"engram layout needs max_ngram >= 2, n_heads >= 1, compressed_vocab >= 1; got "
                         f"{max_ngram}, {n_heads}, {compressed_vocab}")
    seen: set[int] = set()  # one global set: no prime is reused across orders, heads or layers
    primes = []
    for _ in layer_ids:
        per_order = []
        for _ in range(max_ngram - 1):
            cur, sizes = vocab_size - 1, []
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                sizes.append(cur)
            per_order.append(tuple(sizes))
        primes.append(tuple(per_order))
    offsets = tuple(tuple(int(v) for v in np.cumsum([0] + [p for g in layer for p in g][:-1])) for layer in primes)
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)  # keeps tok * mult < 2^63
    mults = tuple(tuple(int(v) * 2 + 1 for v in np.random.default_rng(10007 * layer).integers(
        0, bound, size=max_ngram, dtype=np.int64)) for layer in layer_ids)
    return EngramLayout(layer_ids, max_ngram, n_heads, vocab_size, compressed_vocab, tuple(primes), offsets, mults)


# ----------------------------------------------------------------------------------------- device side
def _u32(x):
    return jnp.asarray(x, jnp.uint32)


def _mul_wide(a, b):
    """Full 64-bit product of uint32 a, b as (hi, lo) uint32 (16-bit partial products)."""
    a0, a1, b0, b1 = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)  # < 3 * 2^16
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, a * b  # uint32 multiply wraps: the low limb


def _mod64(hi, lo, p, k: int):
    """(hi * 2^32 + lo) % p for uint32 limbs, p < 2^(32-k) (uint32, broadcastable), k bits folded per step."""
    r = hi % p
    for shift in range(32 - k, -k, -k):  # chunks of lo from the top; the last chunk may be narrower
        width = k if shift >= 0 else k + shift
        shift = max(shift, 0)
        r = ((r << width) | ((lo >> shift) & ((1 << width) - 1))) % p
    return r


def hash_window(window, pad_id, layout: EngramLayout):
    """Hash columns int32 [B, S, n_layers, n_cols] from a look-back window, inside jit, without x64.

    window int32 [B, S, max_ngram]: window[..., s] = compressed id at position p - s, DEAD (-1) for image tokens
    and for positions before the sequence start. Blocking is cumulative from shift 0 upwards.
    """
    window = jnp.asarray(window, jnp.int32)
    n = layout.max_ngram
    if window.shape[-1] != n:
        raise ValueError(f"window has {window.shape[-1]} look-back slots, the layout needs max_ngram={n}")
    flat = layout.flat_primes()
    if int(flat.max()) >= 2 ** 31 or int(np.max(np.array(layout.offsets)[:, -1] + flat[:, -1])) >= 2 ** 31:
        raise ValueError("engram tables of 2^31 rows or more do not fit the int32 hash columns")
    k = 32 - int(flat.max()).bit_length()
    blocked = jnp.zeros(window.shape[:-1], bool)
    toks = []
    for s in range(n):
        blocked = blocked | (window[..., s] == DEAD)
        toks.append(jnp.where(blocked, jnp.asarray(pad_id, jnp.int32), window[..., s]))
    tok = _u32(jnp.stack(toks, -1))[..., None, :]  # [B, S, 1, n]
    mult = np.array(layout.multipliers, np.uint64)  # [L, n]
    m_hi, m_lo = (mult >> np.uint64(32)).astype(np.uint32), (mult & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi, lo = _mul_wide(tok, _u32(m_lo))
    hi = hi + tok * _u32(m_hi)  # exact: the full product is < 2^63
    primes = _u32(flat.reshape(len(layout.layer_ids), n - 1, layout.n_heads))
    r_hi, r_lo, cols = hi[..., 0], lo[..., 0], []
    for i in range(1, n):
        r_hi, r_lo = r_hi ^ hi[..., i], r_lo ^ lo[..., i]
        cols.append(_mod64(r_hi[..., None], r_lo[..., None], primes[:, i - 1], k))
    return jnp.concatenate(cols, -1).astype(jnp.int32) + jnp.asarray(np.array(layout.offsets, np.int32))


def ngram_windows(compressed_ids, max_ngram: int, dead_mask=None, history=None):
    """[B, S] compressed ids -> look-back window [B, S, max_ngram] (DEAD before the start / for dead tokens).

    history [B, max_ngram-1]: the compressed ids of the positions just before this chunk (DEAD where none),
    for decode steps and chunked prefill.
    """
    ids = jnp.asarray(compressed_ids, jnp.int32)
    if dead_mask is not None:
        ids = jnp.where(dead_mask, DEAD, ids)
    B, S = ids.shape
    if history is None:
        history = jnp.full((B, max_ngram - 1), DEAD, jnp.int32)
    seq = jnp.concatenate([jnp.asarray(history, jnp.int32), ids], axis=1)
    h = max_ngram - 1
    return jnp.stack([seq[:, h - s: h - s + S] for s in range(max_ngram)], axis=-1)


def ngram_hashes(compressed_ids, layout: EngramLayout, pad_id, dead_mask=None, history=None):
    """Hash columns int32 [B, S, n_layers, n_cols] of compressed ids [B, S]; see `ngram_windows` for `history`."""
    return hash_window(ngram_windows(compressed_ids, layout.max_ngram, dead_mask, history), pad_id, layout)


# --------------------------------------------------------------------------------------- gate + inject
def _gather_rows(p, cols, dtype):
    table = p["table"]
    if "table_scale" in p:  # kept FP8: dequantise only the gathered rows (REF41 ParallelEngramEmbedding)
        rows = qdq.dequant_fp8(jnp.asarray(table)[cols], jnp.asarray(p["table_scale"])[cols], (1, 32))
        return rows.astype(jnp.bfloat16).astype(dtype)  # the reference's rows are bf16
    return table[cols].astype(dtype)


def engram_inject(p, X, cols, token_mask=None, eps: float = 1e-20, *, act_quant: bool = False):
    """§7.2: X [B, S, n, D] -> X with the gated n-gram value added to every stream (X's dtype).

    cols int [B, S, C] (this layer's hash columns); token_mask [B, S] bool, False closes the gate (image
    tokens). act_quant=True applies the reference's FP8 activation QDQ before `wkv` (an FP8 linear in REF41).
    """
    B, S, n, D = X.shape
    dt = X.dtype
    e = _gather_rows(p, cols, dt).reshape(B, S, -1)  # [B, S, C*H]
    kv = qdq.linear(e, p["wkv"], 32 if act_quant else None)
    key = kv[..., : n * D].astype(F32).reshape(B, S, n, D)
    val = kv[..., n * D:].astype(F32)
    w = p["q_weight"].astype(F32) * p["k_weight"].astype(F32)
    h = X.astype(F32)
    # per (token, stream) over D, not jointly over the streams
    rstd = jax.lax.rsqrt(jnp.mean(h * h, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(h * w * key, -1) * rstd * np.float32(D ** -0.5)
    # signed sqrt: copysign, as the reference (dot = +-0 gives +-sqrt(1e-6), not 0)
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), np.float32(GATE_CLAMP))), dot))
    if token_mask is not None:
        gate = jnp.where(token_mask[..., None], gate, 0.0)
    return (h + gate[..., None] * val[:, :, None, :]).astype(dt)
