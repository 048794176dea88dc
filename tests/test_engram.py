"""Engram (`jaxmodels/layers/engram.py`): token map, prime layout, multipliers, hashes, gate and injection.

Expected values: the spec's published numbers (specs/deepseek_v4.md §7.1: engram_num_embeddings, first/last
primes, multipliers; §1.4 tiny sums), sympy's nextprime, a plain-Python-int transcription of §7.1 steps 4-5,
hand-derived token classes, and a float64 NumPy transcription of §7.2 written here.
"""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from converters import deepseek_quant as dq
from jaxmodels.layers import engram as E
from tests import quant_encoders as enc

REAL = dict(layer_ids=(1, 14), max_ngram=4, vocab_size=16_000_000, n_heads=8, compressed_vocab=99_092)
REAL_MULT = {1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
             14: [67716810739261, 51510806800915, 30921347202721, 82619226485591]}
INT64_MAX = 2 ** 63 - 1
# the reference's hashing in NumPy int64 (specs §7.1 steps 4-5): what the uint32-limb JAX hash is checked against
def ngram_tokens_np(compressed_ids, max_ngram: int, pad_id: int, dead_mask=None) -> np.ndarray:
    """[B, S] compressed ids -> [B, S, max_ngram] (shift 0 = the token itself), blocked slots = pad_id.

    Blocking is cumulative (§7.1 step 4): once the look-back passes the sequence start or a E.DEAD token, that
    slot and every older one is pad.
    """
    ids = np.asarray(compressed_ids, np.int64)
    if dead_mask is not None:
        ids = np.where(np.asarray(dead_mask, bool), E.DEAD, ids)
    B, S = ids.shape
    pos = np.arange(S)
    out = np.empty((B, S, max_ngram), np.int64)
    blocked = np.zeros((B, S), bool)
    for shift in range(max_ngram):
        src = ids[:, np.clip(pos - shift, 0, None)]
        blocked |= (pos < shift)[None] | (src == E.DEAD)
        out[..., shift] = np.where(blocked, pad_id, src)
    return out


def ngram_hashes_np(compressed_ids, layout, pad_id: int, dead_mask=None) -> np.ndarray:
    """Hash columns int64 [B, S, n_layers, n_cols] (§7.1 steps 4-5), in NumPy int64 as the reference."""
    tok = ngram_tokens_np(compressed_ids, layout.max_ngram, pad_id, dead_mask)
    mult = np.array(layout.multipliers, np.int64)  # [L, n]
    prod = tok[:, :, None, :] * mult  # < 2^63 by construction
    primes = layout.flat_primes().reshape(len(layout.layer_ids), layout.max_ngram - 1, layout.n_heads)
    roll, cols = prod[..., 0], []
    for i in range(1, layout.max_ngram):
        roll = roll ^ prod[..., i]
        cols.append(roll[..., None] % primes[:, i - 1])
    return np.concatenate(cols, axis=-1) + np.array(layout.offsets, np.int64)



inject = jax.jit(E.engram_inject, static_argnames=("eps", "act_quant"))  # eager op-by-op dispatch is slow


@pytest.fixture(scope="module")
def real():
    return E.EngramLayout.from_config(**REAL)


# ---- layout ----

def test_released_layout_matches_the_spec(real):
    assert real.num_embeddings == (384006168, 384016682)
    flat = real.flat_primes()
    assert flat.shape == (2, 24)
    assert (flat[0, 0], flat[0, -1], flat[1, 0], flat[1, -1]) == (16000057, 16000463, 16000477, 16000889)
    # the global-seen rule hands out the first 48 primes above the vocab size, in order
    sympy = pytest.importorskip("sympy")
    want, p = [], 16_000_000 - 1
    for _ in range(48):
        p = sympy.nextprime(p)
        want.append(p)
    assert flat.reshape(-1).tolist() == want
    assert [list(m) for m in real.multipliers] == [REAL_MULT[1], REAL_MULT[14]]
    for layer, offs in zip(flat, real.offsets):
        assert list(offs) == [sum(layer[:c]) for c in range(24)]
    # every product tok * mult stays below 2^63
    assert max(max(m) for m in real.multipliers) * (REAL["compressed_vocab"] - 1) <= INT64_MAX


def test_tiny_layout():
    lay = E.EngramLayout.from_config((0, 1), 4, 100, 2, 256)
    assert lay.num_embeddings == (660, 864)
    assert lay.primes == (((101, 103), (107, 109), (113, 127)), ((131, 137), (139, 149), (151, 157)))
    assert lay.offsets[1] == (0, 131, 268, 407, 556, 707)
    bound = (INT64_MAX // 256) // 2
    for layer, m in zip((0, 1), lay.multipliers):
        g = np.random.default_rng(10007 * layer)
        assert list(m) == [2 * int(v) + 1 for v in g.integers(0, bound, 4, dtype=np.int64)]


# ---- hashes ----

def python_hashes(ids, dead, primes, offsets, mults, pad, n):
    """§7.1 steps 4-5 with Python ints: per position, cumulative blocking, then multiply-XOR-mod."""
    B, S = len(ids), len(ids[0])
    out = np.zeros((B, S, len(primes), (n - 1) * len(primes[0][0])), np.int64)
    for b in range(B):
        for p in range(S):
            blocked, tok = False, []
            for shift in range(n):
                if p < shift or dead[b][p - shift]:
                    blocked = True
                tok.append(pad if blocked else int(ids[b][p - shift]))
            for li, (lp, lo, lm) in enumerate(zip(primes, offsets, mults)):
                prod = [t * m for t, m in zip(tok, lm)]
                assert all(0 <= x < 2 ** 63 for x in prod)
                roll, c = prod[0], 0
                for i in range(1, n):
                    roll ^= prod[i]
                    for h, prime in enumerate(lp[i - 1]):
                        out[b, p, li, c] = roll % prime + lo[c]
                        c += 1
    return out


def test_hashes_match_python_transcription(real):
    rng = np.random.default_rng(0)
    V = REAL["compressed_vocab"]
    ids = rng.integers(0, V, (3, 23))
    ids[0, :4] = V - 1  # the largest compressed id
    dead = rng.random((3, 23)) < 0.1
    dead[1, 5] = True
    pad = 1
    want = python_hashes(ids.tolist(), dead.tolist(), real.primes, real.offsets, [REAL_MULT[1], REAL_MULT[14]],
                         pad, 4)
    got = ngram_hashes_np(ids, real, pad, dead)
    assert got.dtype == np.int64 and got.shape == (3, 23, 2, 24)
    np.testing.assert_array_equal(got, want)
    jgot = jax.jit(lambda i, d: E.ngram_hashes(i, real, pad, d))(ids.astype(np.int32), dead)
    assert jgot.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(jgot), want)
    assert (want[..., 0, :] < np.array(real.offsets[0]) + real.flat_primes()[0]).all()


def test_blocking_at_start_and_dead_tokens():
    P = 99
    got = ngram_tokens_np([[5, 6, 7, 8, 9]], 4, P, [[False, False, True, False, False]])
    want = [[5, P, P, P], [6, 5, P, P], [P, P, P, P], [8, P, P, P], [9, 8, P, P]]
    np.testing.assert_array_equal(got[0], want)
    got = ngram_tokens_np([[1, 2, 3, 4, 5, 6]], 4, P)
    np.testing.assert_array_equal(got[0, 5], [6, 5, 4, 3])
    np.testing.assert_array_equal(got[0, 1], [2, 1, P, P])
    # the same blocking inside the JAX window path
    lay = E.EngramLayout.from_config((0, 1), 4, 100, 2, 256)
    got = jax.jit(lambda i, d: E.hash_window(E.ngram_windows(i, 4, d), P, lay))(
        jnp.array([[5, 6, 7, 8, 9]]), jnp.array([[False, False, True, False, False]]))
    np.testing.assert_array_equal(np.asarray(got),
                                  ngram_hashes_np([[5, 6, 7, 8, 9]], lay, P, [[False, False, True, False, False]]))


def test_decode_with_history_equals_full_sequence():
    lay = E.EngramLayout.from_config((0, 1), 4, 100, 2, 256)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, (2, 9)).astype(np.int32)
    full = ngram_hashes_np(ids, lay, 1)
    step = jax.jit(lambda tok, hist: E.ngram_hashes(tok, lay, 1, history=hist))
    for p in range(9):
        hist = np.full((2, 3), E.DEAD, np.int32)
        lo = max(0, p - 3)
        hist[:, 3 - (p - lo):] = ids[:, lo:p]
        np.testing.assert_array_equal(np.asarray(step(ids[:, p:p + 1], hist))[:, 0], full[:, p])


def test_limb_hash_extremes():
    """Largest id x largest multiplier, multipliers with all-ones limbs, and primes up to 2^31 - 1."""
    V = 99_092
    mmax = 2 * ((INT64_MAX // V) // 2 - 1) + 1  # the largest multiplier the layout can draw
    ones_lo = ((mmax >> 32) << 32) - 1  # low limb all ones
    mults = (mmax, (1 << 32) - 1, (1 << 33) - 1, 1), (mmax - 2, 3, ones_lo, mmax)
    assert all(m * (V - 1) < 2 ** 63 for ms in mults for m in ms)
    for primes in ((((16000057, 16000069), (16000073, 16000079), (16000081, 16000087)),) * 2,
                   (((2147483647, 2147483629), (65537, 3), (2, 1000003)),) * 2):
        lay = E.EngramLayout((1, 2), 4, 2, 0, V, primes, ((0,) * 6,) * 2, mults)
        ids = np.array([[V - 1] * 6 + [0, 1, V - 2, 12345, V - 1, 2]])
        dead = np.zeros_like(ids, bool)
        want = python_hashes(ids.tolist(), dead.tolist(), primes, lay.offsets, mults, V - 1, 4)
        np.testing.assert_array_equal(ngram_hashes_np(ids, lay, V - 1), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda i: E.ngram_hashes(i, lay, V - 1))(ids)), want)


def test_mod64_limbs_random():
    rng = np.random.default_rng(3)
    vals = [int(v) for v in rng.integers(0, 2 ** 63, 2000, dtype=np.uint64)] + [2 ** 63 - 1, 0, 2 ** 32, 2 ** 32 - 1]
    hi = jnp.array([v >> 32 for v in vals], jnp.uint32)
    lo = jnp.array([v & 0xFFFFFFFF for v in vals], jnp.uint32)
    for p in (2, 3, 257, 16000057, 2 ** 31 - 1):
        k = 32 - p.bit_length()
        got = np.asarray(E._mod64(hi, lo, jnp.uint32(p), k))
        assert got.tolist() == [v % p for v in vals]
    a = rng.integers(0, 2 ** 32, 3000, dtype=np.uint64)
    b = rng.integers(0, 2 ** 32, 3000, dtype=np.uint64)
    h, lw = E._mul_wide(jnp.asarray(a.astype(np.uint32)), jnp.asarray(b.astype(np.uint32)))
    full = [int(x) * int(y) for x, y in zip(a, b)]
    assert np.asarray(h).tolist() == [f >> 32 for f in full]
    assert np.asarray(lw).tolist() == [f & 0xFFFFFFFF for f in full]


# ---- token map ----

def small_tokenizer():
    from tokenizers import Tokenizer, decoders, models

    vocab = ["hello", "Hello", "ĠHELLO", "hÃ©llo", "Ġ", "ĠĠ", "Ċ", "ĉ", "Ã", "©", "world", "ï¬ģ", "fi",
             "ĠĠworld", "ÌģĠ", "Ìģ"]  # byte-level: "Ġ" = space, "Ċ" = \n, "ĉ" = \t, "Ã" = byte 0xC3 ...
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|PAD|>"])
    return tok


# hello Hello " HELLO" héllo -> "hello"; " " "  " "\n" "\t" -> " "; lone bytes 0xC3 / 0xA9 decode to U+FFFD and are
# keyed by their raw token strings (two classes); "world" "  world"; "ﬁ" (NFKC) "fi"; "\u0301 " strips its accent
# to " "; a lone "\u0301" normalises to "" and keeps its raw text; the special token is its own class.
WANT_MAP = [0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 4, 5, 5, 4, 1, 6, 7]


def test_compressed_token_map():
    tok = small_tokenizer()
    assert tok.decode([8], skip_special_tokens=False) == "\ufffd"
    lookup, n = E.build_compressed_token_map(tok)
    assert n == 8 and lookup.tolist() == WANT_MAP


def test_compressed_token_map_through_hf_wrapper():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=small_tokenizer())
    lookup, n = E.build_compressed_token_map(hf)
    assert n == 8 and lookup.tolist() == WANT_MAP


# ---- gate and injection ----

def inject_oracle(table, wkv_io, qw, kw, X, cols, mask, eps):
    """§7.2 in float64: gather, wkv, per-(token, stream) RMS, signed-sqrt sigmoid gate, value to every stream."""
    B, S, n, D = X.shape
    e = table[cols].reshape(B, S, -1).astype(np.float64)
    kv = e @ wkv_io.astype(np.float64)
    key, val = kv[..., : n * D].reshape(B, S, n, D), kv[..., n * D:]
    h = X.astype(np.float64)
    w = qw.astype(np.float64) * kw.astype(np.float64)
    dot = (h * w * key).sum(-1) / np.sqrt((h ** 2).mean(-1) + eps) / np.sqrt((key ** 2).mean(-1) + eps) / math.sqrt(D)
    gate = 1 / (1 + np.exp(-np.copysign(np.sqrt(np.maximum(np.abs(dot), 1e-6)), dot)))
    gate = np.where(mask[..., None], gate, 0)
    return h + gate[..., None] * val[:, :, None, :], gate


def engram_params(rng, R=50, H=64, C=6, n=4, D=32):
    return {"table": rng.standard_normal((R, H)).astype(np.float32),
            "wkv": (rng.standard_normal((C * H, (n + 1) * D)) / math.sqrt(C * H)).astype(np.float32),
            "q_weight": (1 + 0.3 * rng.standard_normal((n, D))).astype(np.float32),
            "k_weight": (1 + 0.3 * rng.standard_normal((n, D))).astype(np.float32)}


def test_inject_matches_float64_oracle():
    rng = np.random.default_rng(0)
    p = engram_params(rng)
    X = (rng.standard_normal((2, 5, 4, 32)) * rng.uniform(0.1, 10, (2, 5, 4, 1))).astype(np.float32)
    cols = rng.integers(0, 50, (2, 5, 6))
    mask = rng.random((2, 5)) < 0.7
    got = np.asarray(inject(p, X, cols, mask, 1e-20))
    want, gate = inject_oracle(p["table"], p["wkv"], p["q_weight"], p["k_weight"], X, cols, mask, 1e-20)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert 0.05 < gate[mask].min() and gate[mask].max() < 0.95  # the gate is active, not saturated
    np.testing.assert_array_equal(got[~mask], X[~mask])  # closed gate: the stream passes through untouched


def test_gate_is_per_stream_and_value_shared():
    rng = np.random.default_rng(1)
    p = engram_params(rng)
    X = rng.standard_normal((1, 3, 4, 32)).astype(np.float32)
    cols = rng.integers(0, 50, (1, 3, 6))
    base = np.asarray(inject(p, X, cols)) - X
    X2 = X.copy()
    X2[:, :, 2] *= 37.0  # rescaling one stream leaves its own gate (and the others') unchanged
    np.testing.assert_allclose(np.asarray(inject(p, X2, cols)) - X2, base, rtol=1e-4, atol=1e-4)
    val = (p["table"][cols].reshape(1, 3, -1) @ p["wkv"])[..., 4 * 32:]
    ratio = base / val[:, :, None, :]  # the same value vector in every stream, scaled by that stream's gate
    np.testing.assert_allclose(ratio, np.broadcast_to(ratio[..., :1], ratio.shape), rtol=1e-4)
    assert np.ptp(ratio[..., 0], axis=-1).min() > 1e-3  # and the gates differ between streams


def test_zero_dot_uses_copysign():
    """key = 0 gives dot = +0 and the reference's copysign gives sigmoid(+sqrt(1e-6)), not sigmoid(0)."""
    rng = np.random.default_rng(2)
    p = engram_params(rng)
    p["wkv"][:, : 4 * 32] = 0
    X = rng.standard_normal((1, 2, 4, 32)).astype(np.float32)
    cols = rng.integers(0, 50, (1, 2, 6))
    gate = (np.asarray(inject(p, X, cols)) - X) / (p["table"][cols].reshape(1, 2, -1) @ p["wkv"])[
        ..., None, 4 * 32:]
    np.testing.assert_allclose(gate, 1 / (1 + np.exp(-1e-3)), rtol=1e-4)


def test_kept_quantized_table_and_wkv_equal_dequantised():
    rng = np.random.default_rng(4)
    n, D, H, C, R = 4, 32, 64, 6, 40
    tq, ts = enc.quantize_fp8_blocks(rng.standard_normal((R, H)).astype(np.float32), (1, 32))  # per row, per 32
    wq, ws = enc.quantize_fp8_blocks(rng.standard_normal(((n + 1) * D, C * H)).astype(np.float32) * 0.05, 32)
    common = {"q_weight": np.ones((n, D), np.float32), "k_weight": rng.standard_normal((n, D)).astype(np.float32)}
    dense = dict(common, table=dq.dequant_fp8_rows(tq, ts).astype(ml_dtypes.bfloat16),
                 wkv=dq.dequant_fp8_blocks(wq, ws, 32).T.astype(ml_dtypes.bfloat16))
    quant = dict(common, table=tq, table_scale=ts.view(ml_dtypes.float8_e8m0fnu),
                 wkv={"fp8": wq.view(np.uint8), "scale": ws})
    X = rng.standard_normal((2, 3, n, D)).astype(ml_dtypes.bfloat16)
    cols = rng.integers(0, R, (2, 3, C))
    for aq in (False, True):
        a, b = inject(dense, X, cols, act_quant=aq), inject(quant, X, cols, act_quant=aq)
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
