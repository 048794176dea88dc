"""Emulated ttnn ops: semantics at `exact` against straightforward float64 references, and accuracy
under TT numerics with tt-metal's PCC gates (norm >= 0.9999, bfp8 linear >= 0.999, bfp4 LoFi
linear >= 0.98, decode attention with a bfp8 cache >= 0.99, K/V cache >= 0.9995)."""
from __future__ import annotations

import numpy as np
import pytest

from tt_backend import formats
from tt_backend.emu import numerics
from tt_backend.emu.ops import OPS, Env
from tt_backend.weights import meta_permutation, rope_tables, trans_mat
from jaxmodels.config import RopeSpec

RNG = np.random.default_rng(0)


def comp_pcc(golden, calculated, pcc: float = 0.99) -> tuple[bool, float]:
    """tt-metal's comp_pcc rules: both all-NaN pass; one all-NaN fails; exactly one all-zero fails;
    otherwise inf/NaN are zeroed and the Pearson correlation of the flattened values is compared."""
    g = np.asarray(golden, np.float64).ravel()
    c = np.asarray(calculated, np.float64).ravel()
    if np.isnan(g).all() and np.isnan(c).all():
        return True, 1.0
    if np.isnan(g).all() or np.isnan(c).all():
        return False, 0.0
    if g.any() != c.any():
        return False, 0.0
    g, c = np.where(np.isfinite(g), g, 0), np.where(np.isfinite(c), c, 0)
    if np.array_equal(g, c):
        return True, 1.0
    r = float(np.corrcoef(g, c)[0, 1])
    r = 1.0 if np.isnan(r) else r  # constant inputs: tt-metal's masked result counts as 1.0
    return r >= pcc, r


def env(level="exact", kv="ttnn.bfloat8_b"):
    store = {"exact": lambda x, dt: np.asarray(x, np.float32),
             "storage": lambda x, dt: numerics.quantize(x, dt, "host"),
             "full": lambda x, dt: numerics.quantize(x, dt, "device")}[level]
    return Env(level, store, kv if level != "exact" else "ttnn.float32")


def cc(fid="HiFi2", fp32=True):
    return {"math_fidelity": f"ttnn.MathFidelity.{fid}", "fp32_dest_acc_en": fp32}


def randn(*shape, scale=1.0):
    return (scale * RNG.standard_normal(shape)).astype(np.float32)


def test_comp_pcc_rules():
    x = randn(100)
    assert comp_pcc(x, x) == (True, 1.0)
    assert comp_pcc(x, np.zeros(100))[0] is False
    assert comp_pcc(np.full(4, np.nan), np.full(4, np.nan)) == (True, 1.0)
    assert comp_pcc(np.full(4, np.nan), x[:4])[0] is False
    assert comp_pcc(x, -x)[1] == pytest.approx(-1.0)


# ------------------------------------------------------------------------------ exact semantics
def test_embedding_and_reshape():
    w = randn(50, 64)
    ids = np.array([[3, 0, 49, 3]], np.uint32)
    out = OPS["ttnn.embedding"](env(), ids, w)
    np.testing.assert_array_equal(out, w[[3, 0, 49, 3]][None])
    with pytest.raises(IndexError):
        OPS["ttnn.embedding"](env(), np.array([[50]], np.uint32), w)


@pytest.mark.parametrize("op", ["ttnn.rms_norm", "ttnn.layer_norm"])
def test_norms_exact(op):
    x, w = randn(1, 1, 64, 96, scale=3.0), randn(96)
    x64 = x.astype(np.float64)
    if op == "ttnn.rms_norm":
        ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * w
    else:
        c = x64 - x64.mean(-1, keepdims=True)
        ref = c / np.sqrt((c ** 2).mean(-1, keepdims=True) + 1e-5) * w
    got = OPS[op](env(), x, epsilon=1e-5, weight=w.reshape(1, 1, 3, 32))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_linear_exact():
    a, w = randn(1, 1, 64, 96), randn(1, 1, 96, 128)
    np.testing.assert_allclose(OPS["ttnn.linear"](env(), a, w, compute_kernel_config=cc("LoFi")),
                               (a[0, 0].astype(np.float64) @ w[0, 0])[None, None], rtol=1e-5, atol=1e-4)


def test_mul_activations_and_add():
    a, b = randn(1, 1, 32, 64), randn(1, 1, 32, 64)
    a64 = a.astype(np.float64)
    silu = OPS["ttnn.mul"](env(), a, b, input_tensor_a_activations=["ttnn.UnaryOpType.SILU"])
    np.testing.assert_allclose(silu, a64 / (1 + np.exp(-a64)) * b, rtol=1e-5, atol=1e-6)
    gelu = OPS["ttnn.mul"](env(), a, b, input_tensor_a_activations=["ttnn.UnaryOpType.GELU_TANH"])
    ref = 0.5 * a64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (a64 + 0.044715 * a64 ** 3))) * b
    np.testing.assert_allclose(gelu, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(OPS["ttnn.mul"](env(), a, input_tensor_b=0.25), a * 0.25)
    np.testing.assert_allclose(OPS["ttnn.add"](env(), a, b), a + b)
    with pytest.raises(TypeError):
        OPS["ttnn.add"](env(), a, b, input_tensor_b=1.0)


def test_qkv_heads_split_and_concat():
    H, K, d, S, B = 4, 2, 32, 64, 5
    x = randn(1, 1, S, (H + 2 * K) * d)
    q, k, v = OPS["ttnn.experimental.nlp_create_qkv_heads"](env(), x, num_heads=H, num_kv_heads=K)
    for h in range(H):
        np.testing.assert_array_equal(q[0, h], x[0, 0, :, h * d:(h + 1) * d])
    for h in range(K):
        np.testing.assert_array_equal(k[0, h], x[0, 0, :, (H + h) * d:(H + h + 1) * d])
        np.testing.assert_array_equal(v[0, h], x[0, 0, :, (H + K + h) * d:(H + K + h + 1) * d])
    np.testing.assert_array_equal(OPS["ttnn.experimental.nlp_concat_heads"](env(), q), x[..., :H * d])
    xd = randn(1, 1, B, (H + 2 * K) * d)
    qd, kd, vd = OPS["ttnn.experimental.nlp_create_qkv_heads_decode"](env(), xd, num_heads=H, num_kv_heads=K)
    assert qd.shape == (1, B, H, d) and kd.shape == (1, B, K, d)
    np.testing.assert_array_equal(kd[0, 3, 1], xd[0, 0, 3, (H + 1) * d:(H + 2) * d])
    np.testing.assert_array_equal(OPS["ttnn.experimental.nlp_concat_heads_decode"](env(), qd, num_heads=H),
                                  xd[..., :H * d])


def _hf_rope(x, pos, theta, d):
    """HF rotate_half RoPE in float64 on [..., S, d] (the layout jaxmodels' params use)."""
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_rotary_embedding_llama_is_hf_rope_after_meta_permutation(mode):
    """The TT op on Meta-permuted heads, un-permuted, equals HF's rotate_half RoPE, positions past 4096."""
    d, theta = 64, 10000.0
    cos, sin = rope_tables(RopeSpec(theta=theta), d, 8192)
    perm, inv = meta_permutation(d), np.argsort(meta_permutation(d))
    T = trans_mat()[None, None]
    pos = np.array([0, 1, 5, 4095, 4096, 4100, 8000, 8191])
    if mode == "prefill":  # x [1, H, S, d], tables [1, 1, S, d]
        x = randn(1, 3, len(pos), d)
        out = OPS["ttnn.experimental.rotary_embedding_llama"](env(), x[..., perm], cos[pos][None, None],
                                                              sin[pos][None, None], T, is_decode_mode=False)
        ref = _hf_rope(x.astype(np.float64), pos, theta, d)
    else:  # x [1, B, H, d], tables [1, B, 1, d]
        x = randn(1, len(pos), 3, d)
        out = OPS["ttnn.experimental.rotary_embedding_llama"](env(), x[..., perm], cos[pos][None, :, None],
                                                              sin[pos][None, :, None], T, is_decode_mode=True)
        ref = _hf_rope(x.astype(np.float64).transpose(0, 2, 1, 3), pos, theta, d).transpose(0, 2, 1, 3)
    # fp32 tables (as HF builds them): the angle p * inv_freq of p ~ 8000 carries ~5e-4 rad of rounding
    np.testing.assert_allclose(out[..., inv], ref, atol=3e-3)
    # without the permutation the interleaved op is a different rotation (what scrambled Cohere)
    assert not np.allclose(OPS["ttnn.experimental.rotary_embedding_llama"](
        env(), x, *((cos[pos][None, None], sin[pos][None, None]) if mode == "prefill"
                    else (cos[pos][None, :, None], sin[pos][None, :, None])), T, is_decode_mode=mode == "decode"),
        ref, atol=1e-2)


def _attn_ref(q, k, v, scale, window=None, sinks=None, q_pos=None):
    """float64 loops: q [H, Tq, d] at positions q_pos, k/v [K, Tk, d] at positions 0..Tk-1."""
    H, Tq, d = q.shape
    K, Tk, _ = k.shape
    q_pos = np.arange(Tq) if q_pos is None else q_pos
    out = np.zeros((H, Tq, d))
    for h in range(H):
        g = h // (H // K)
        for i in range(Tq):
            js = [j for j in range(Tk) if j <= q_pos[i] and (window is None or j > q_pos[i] - window)]
            s = np.array([q[h, i] @ k[g, j] * scale for j in js])
            logits = np.concatenate([s, [sinks[h]]]) if sinks is not None else s
            p = np.exp(logits - logits.max())
            p = p[: len(js)] / p.sum()
            out[h, i] = p @ v[g, js]
    return out


@pytest.mark.parametrize("window,sinks", [(None, False), (7, False), (None, True), (5, True)])
def test_prefill_sdpa_exact(window, sinks):
    H, K, S, d = 4, 2, 128, 32
    q, k, v = randn(1, H, S, d), randn(1, K, S, d), randn(1, K, S, d)
    sk = randn(1, 1, 1, H) if sinks else None
    got = OPS["ttnn.transformer.scaled_dot_product_attention"](
        env(), q, k, v, is_causal=True, scale=0.3, sliding_window_size=window, attention_sink=sk)
    ref = _attn_ref(q[0].astype(np.float64), k[0], v[0], 0.3, window, None if sk is None else sk.reshape(-1))
    np.testing.assert_allclose(got[0], ref, atol=2e-5)


def _paged(kv_seq, block, rng):
    """[K, T, d] contiguous -> (cache [n_blocks + 2, K, block, d] with shuffled blocks, page-table row)."""
    K, T, d = kv_seq.shape
    n = -(-T // block)
    phys = rng.permutation(n + 2)[:n]
    cache = np.zeros((n + 2, K, block, d), np.float32)
    padded = np.zeros((K, n * block, d), np.float32)
    padded[:, :T] = kv_seq
    for j, b in enumerate(phys):
        cache[b] = padded[:, j * block:(j + 1) * block]
    return cache, phys.astype(np.int32)


@pytest.mark.parametrize("window,sinks", [(None, False), (9, False), (None, True)])
def test_paged_decode_sdpa_exact(window, sinks):
    """Shuffled physical blocks, different positions per user, a skipped user (cur_pos -1)."""
    H, K, d, block, T = 4, 2, 32, 32, 100
    rng = np.random.default_rng(1)
    kseq, vseq = randn(K, T, d), randn(K, T, d)
    kc, row = _paged(kseq, block, rng)
    vc = np.zeros_like(kc)
    for j, b in enumerate(row):  # the same block map for V
        part = np.zeros((K, block, d), np.float32)
        part[:, : max(0, min(block, T - j * block))] = vseq[:, j * block:(j + 1) * block]
        vc[b] = part
    pos = np.array([99, 0, -1, 40], np.int32)
    pt = np.stack([row] * 4)
    q = randn(1, 4, H, d)
    sk = randn(1, 1, 1, H) if sinks else None
    got = OPS["ttnn.transformer.paged_scaled_dot_product_attention_decode"](
        env(), q, kc, vc, page_table_tensor=pt, cur_pos_tensor=pos, scale=0.2, sliding_window_size=window,
        attention_sink=sk)
    for b, p in enumerate(pos):
        if p < 0:
            np.testing.assert_array_equal(got[0, b], 0)
            continue
        ref = _attn_ref(q[0, b][:, None].astype(np.float64), kseq[:, : p + 1], vseq[:, : p + 1], 0.2, window,
                        None if sk is None else sk.reshape(-1), q_pos=np.array([p]))
        np.testing.assert_allclose(got[0, b], ref[:, 0], atol=2e-5)


def test_paged_update_cache_repacks_rows_into_cache_dtype():
    """bf16 rows go in; the cache holds each row as the device packs it into bfloat8_b."""
    K, d, block = 2, 32, 32
    cache = np.zeros((4, K, block, d), np.float32)
    x = randn(1, 2, 32, d)  # heads padded to 32 rows; the first K are real
    pt = np.array([[2, 0], [3, 1]], np.int32)
    OPS["ttnn.experimental.paged_update_cache"](env("full"), cache, x, update_idxs_tensor=np.array([33, 5]),
                                                page_table=pt)
    np.testing.assert_array_equal(cache[0, :, 1], formats.quantize(x[0, 0, :K], "bfloat8_b", "device"))
    np.testing.assert_array_equal(cache[3, :, 5], formats.quantize(x[0, 1, :K], "bfloat8_b", "device"))
    untouched = np.ones(cache.shape[:1] + cache.shape[2:3], bool)
    untouched[0, 1] = untouched[3, 5] = False
    assert not cache.transpose(0, 2, 1, 3)[untouched].any()  # nothing else written
    exact = np.zeros_like(cache)
    OPS["ttnn.experimental.paged_update_cache"](env(), exact, x, update_idxs_tensor=np.array([33, -1]),
                                                page_table=pt)
    np.testing.assert_array_equal(exact[0, :, 1], x[0, 0, :K])
    assert np.count_nonzero(exact) == K * d  # the -1 user wrote nothing


# ------------------------------------------------------------------------------ TT numerics
def _trunc_ref(x, bits):
    """Keep `bits` significant bits by truncation, via frexp (independent of the emulator's bit masks)."""
    m, e = np.frexp(x.astype(np.float64))
    return (np.trunc(m * 2.0 ** bits) / 2.0 ** bits * 2.0 ** e).astype(np.float32)


def test_keep_bits_matches_frexp_truncation():
    x = randn(1000, scale=100.0)
    for bits in (5, 7, 10, 11):
        np.testing.assert_array_equal(numerics.keep_bits(x, bits), _trunc_ref(x, bits))


def test_matmul_fidelity_phases():
    a = formats.quantize(randn(64, 96), "bfloat16", "host")
    w = formats.quantize(randn(96, 64), "bfloat16", "host")
    exact = a.astype(np.float64) @ w
    # LoFi: activation top 7 bits x weight top 5 bits
    lofi = numerics.matmul(a, w, "full", cc("LoFi"))
    np.testing.assert_allclose(lofi, _trunc_ref(a, 7).astype(np.float64) @ _trunc_ref(w, 5), rtol=1e-5, atol=1e-4)
    # HiFi4 on bf16 operands keeps every bit (bf16 has 8 significant bits)
    np.testing.assert_allclose(numerics.matmul(a, w, "full", cc("HiFi4")), exact, rtol=1e-5, atol=1e-4)
    errs = [np.abs(numerics.matmul(a, w, "full", cc(f)) - exact).mean() for f in ("LoFi", "HiFi2", "HiFi3", "HiFi4")]
    assert errs[0] > errs[1] > errs[3] and errs[1] >= errs[2]
    # bfp4 weights have at most 3 significant bits, so LoFi already multiplies them exactly
    w4 = formats.quantize(randn(96, 64), "bfloat4_b", "host")
    np.testing.assert_allclose(numerics.matmul(a, w4, "full", cc("LoFi")),
                               numerics.matmul(a, w4, "full", cc("HiFi2")), rtol=1e-6, atol=1e-6)
    # bf16 Dst accumulation loses more than fp32 Dst
    e16 = np.abs(numerics.matmul(a, w, "full", cc("HiFi4", fp32=False)) - exact).mean()
    assert e16 > 4 * errs[3]


def test_norm_pcc_under_tt_numerics():
    x = randn(1, 1, 128, 256, scale=2.0)
    w = 1 + 0.1 * randn(256)
    ref = OPS["ttnn.rms_norm"](env(), x, epsilon=1e-5, weight=w)
    e = env("full")
    got = e.store(OPS["ttnn.rms_norm"](e, e.store(x, "ttnn.bfloat16"), epsilon=1e-5,
                                       weight=formats.quantize(w, "bfloat16", "host"), compute_kernel_config=cc()),
                  "ttnn.bfloat16")
    ok, p = comp_pcc(ref, got, 0.9999)
    assert ok, p


@pytest.mark.parametrize("wdtype,fid,gate", [("bfloat8_b", "HiFi2", 0.999), ("bfloat4_b", "LoFi", 0.98)])
def test_linear_pcc_under_tt_numerics(wdtype, fid, gate):
    a, w = randn(1, 1, 128, 256), randn(1, 1, 256, 256, scale=0.05)
    ref = a[0, 0].astype(np.float64) @ w[0, 0]
    e = env("full")
    got = e.store(OPS["ttnn.linear"](e, e.store(a, "ttnn.bfloat16"), formats.quantize(w, wdtype, "host"),
                                     compute_kernel_config=cc(fid, fid != "LoFi")), "ttnn.bfloat16")
    ok, p = comp_pcc(ref, got, gate)
    assert ok, p


def test_decode_attention_pcc_with_bfp8_cache():
    """K/V written row by row through paged_update_cache into bfloat8_b: cache PCC >= 0.9995,
    decode attention PCC >= 0.99 against float64 attention over the unquantised K/V."""
    H, K, d, block, T = 8, 2, 64, 32, 200
    rng = np.random.default_rng(3)
    kseq, vseq = randn(K, T, d), randn(K, T, d)
    n = -(-T // block)
    row = rng.permutation(n).astype(np.int32)
    kc, vc = np.zeros((n, K, block, d), np.float32), np.zeros((n, K, block, d), np.float32)
    e = env("full")
    for p in range(T):
        pad = np.zeros((1, 1, 32, d), np.float32)
        for cache, seq in ((kc, kseq), (vc, vseq)):
            pad[0, 0, :K] = seq[:, p]
            OPS["ttnn.experimental.paged_update_cache"](e, cache, pad, update_idxs_tensor=np.array([p]),
                                                        page_table=row[None])
    for cache, seq in ((kc, kseq), (vc, vseq)):
        ok, pc = comp_pcc(seq, cache[row].transpose(1, 0, 2, 3).reshape(K, -1, d)[:, :T], 0.9995)
        assert ok, pc
    q = randn(1, 1, H, d)
    got = OPS["ttnn.transformer.paged_scaled_dot_product_attention_decode"](
        e, e.store(q, "ttnn.bfloat16"), kc, vc, page_table_tensor=row[None], cur_pos_tensor=np.array([T - 1]),
        scale=d ** -0.5, compute_kernel_config=cc())
    ref = _attn_ref(q[0, 0][:, None].astype(np.float64), kseq, vseq, d ** -0.5, q_pos=np.array([T - 1]))
    ok, pc = comp_pcc(ref[:, 0], got[0, 0], 0.99)
    assert ok, pc
