"""Sanity checks of the float64 DeepSeek-V4.1 oracle and the tiny-checkpoint writer (fast, CPU, numpy only).

These pin things that cannot be faked by the oracle agreeing with itself: released constants of the
Engram layout (spec §7.1), exact FP8/FP4 rounding tables (§2), bit-level decoding against ml_dtypes,
Sinkhorn's doubly-stochastic output, causality, a reduction to a plainly written window-attention MoE
transformer, and that every feature of the tiny checkpoint actually moves the logits.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from tests.oracles import deepseek_ckpt as C
from tests.oracles import deepseek_v41 as O


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv41_tiny")
    C.write_checkpoint(str(d), C.tiny_config(), seed=0)
    return O.load_checkpoint(str(d)), str(d)


TOKS = np.random.default_rng(1).integers(0, 512, (2, 40))


# ---------------------------------------------------------------------------------------------- Engram
def test_engram_released_layout():
    lay = O.engram_layout([1, 14], 4, 8, 16_000_000, 99_092)
    assert lay["num_embeddings"] == [384006168, 384016682]
    assert lay["primes"][0][0][0] == 16000057 and lay["primes"][0][-1][-1] == 16000463
    assert lay["primes"][1][0][0] == 16000477 and lay["primes"][1][-1][-1] == 16000889
    assert lay["multipliers"].tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                                           [67716810739261, 51510806800915, 30921347202721, 82619226485591]]


def test_engram_tiny_layout():
    assert O.engram_layout([0, 1], 4, 2, 100, 256)["num_embeddings"] == [660, 864]
    assert C.tiny_config()["text_config"]["engram_num_embeddings"] == [660, 864]


def test_engram_hashes_against_python_ints(tiny):
    """The int64 NumPy hash equals the same recipe in unbounded Python ints (so nothing overflowed)."""
    ck, _ = tiny
    cfg = ck.cfg
    tm = C.stub_token_map(512)
    assert tm[cfg["engram_pad_id"]] == 1
    lay = O.engram_layout([0, 1], 4, 2, 100, 256)
    got = O.engram_hashes(TOKS, cfg, tm)
    assert got.shape == (2, 40, 2, 6) and got.dtype == np.int64
    dead = np.zeros_like(TOKS, bool)
    dead[1, 10:13] = True  # an "image span": blocks n-grams across it
    got_dead = O.engram_hashes(TOKS, cfg, tm, dead_mask=dead)
    for hashes, dm in ((got, None), (got_dead, dead)):
        for b in range(2):
            for p in range(40):
                toks, blocked = [], False
                for shift in range(4):
                    src = -1 if (dm is not None and p >= shift and dm[b, p - shift]) else (
                        int(tm[TOKS[b, p - shift]]) if p >= shift else None)
                    blocked = blocked or p < shift or src == -1
                    toks.append(1 if blocked else src)
                for li in range(2):
                    mult = [int(m) for m in lay["multipliers"][li]]
                    prod = [t * m for t, m in zip(toks, mult)]
                    assert max(prod) < 2 ** 63
                    roll, col = prod[0], 0
                    for i in range(1, 4):
                        roll ^= prod[i]
                        for h in range(2):
                            assert hashes[b, p, li, col] == roll % lay["primes"][li][i - 1][h] + lay["offsets"][li][col]
                            col += 1
    assert (got_dead[1, 10:16] != got[1, 10:16]).any() and (got_dead[1, :10] == got[1, :10]).all()


# ---------------------------------------------------------------------------------------------- numerics
def test_e2m1_tie_table():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2, 0.3, 5.5, 7.0, 100.0])
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 6.0, 6.0, 6.0])
    np.testing.assert_array_equal(O.e2m1_rne(x), want)
    np.testing.assert_array_equal(O.e2m1_rne(-x), -want)


def test_e4m3_rounding_and_decoding_match_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    ref = b.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = O.decode_e4m3(b)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(got[~np.isnan(ref)], ref[~np.isnan(ref)])
    x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32) * np.float32(30.0)
    x = np.concatenate([x, np.float32([0.0, 1e-9, 2.0 ** -10, 3 * 2.0 ** -10, 464.0, -1e4])])
    np.testing.assert_array_equal(O.e4m3_rne(x), np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    np.testing.assert_array_equal(O.decode_e8m0(np.array([127, 120, 0, 254])), [1.0, 2.0 ** -7, 2.0 ** -127, 2.0 ** 127])


def test_act_quant_and_fp4_act_quant():
    x = np.random.default_rng(0).standard_normal((5, 64)) * 3
    q, s = O.act_quant(x, 32, return_parts=True)
    assert np.all(np.abs(q) <= 448) and np.all(np.log2(s) == np.round(np.log2(s)))
    np.testing.assert_array_equal(O.act_quant(x, 32), (q.reshape(5, 2, 32) * s[..., None]).reshape(5, 64))
    # the scale is the smallest power of two with amax / s <= 448
    amax = np.abs(x.reshape(5, 2, 32)).max(-1)
    assert np.all(amax / s <= 448) and np.all(amax / (s / 2) > 448)
    y = O.act_quant(x, 32)
    assert np.abs(y - x).max() <= np.abs(x).max() / 16  # 3 mantissa bits
    q4, s4 = O.fp4_act_quant(x, 32, "e8m0", return_parts=True)
    assert set(np.unique(np.abs(q4))) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    q16, s16 = O.fp4_act_quant(x, 16, "e4m3", return_parts=True)
    np.testing.assert_array_equal(s16, O.e4m3_rne(np.abs(x.reshape(5, 4, 16)).max(-1) / 6))
    assert np.all(O.fp4_act_quant(np.zeros((1, 32)), 32) == 0)
    # the scale is computed from the fp32 product amax·fp32(1/448): for amax = 1.75·2^m that product rounds to
    # exactly 2^(m-8) in fp32 (float64 would give 2^(m-7)); a bf16 input of amax 1.75 keeps q = 448
    blk = np.full((1, 32), 0.5)
    blk[0, 3] = 1.75
    q, s = O.act_quant(blk, 32, return_parts=True)
    assert s[0, 0] == 2.0 ** -8 and q[0, 3] == 448
    q, s = O.fp4_act_quant(np.full((1, 32), 0.75) * np.r_[1, 2, np.ones(30)], 32, "e8m0", return_parts=True)
    assert s[0, 0] == 0.25 and q[0, 1] == 6  # 1.5 · fp32(1/6) rounds to 0.25 in fp32


def test_sinkhorn_doubly_stochastic():
    rng = np.random.default_rng(0)
    mixes, base = rng.standard_normal((7, 24)), rng.standard_normal(24) * 0.5
    pre, post, comb = O.hc_split_sinkhorn(mixes, np.array([0.5, 0.5, 0.5]), base, 4, 20, 1e-6)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-5)   # the last step normalises columns
    np.testing.assert_allclose(comb.sum(-1), 1.0, atol=1e-4)
    assert np.all(comb > 0) and np.all((pre > 1e-6) & (pre < 1 + 1e-6)) and np.all((post > 0) & (post < 2))
    assert np.abs(comb - np.eye(4)).max() > 0.1  # not a trivial identity
    # peaked logits converge slower: 20 iterations leave the rows off, many more make them exact
    sharp = rng.standard_normal((7, 24)) * 3
    _, _, c20 = O.hc_split_sinkhorn(sharp, np.array([0.7, 1.1, 1.5]), base, 4, 20, 1e-6)
    _, _, c500 = O.hc_split_sinkhorn(sharp, np.array([0.7, 1.1, 1.5]), base, 4, 500, 1e-6)
    np.testing.assert_allclose(c20.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(c500.sum(-1), 1.0, atol=1e-5)


# ---------------------------------------------------------------------------------------------- checkpoint
def test_checkpoint_layout_and_encodings(tiny):
    _, d = tiny
    from safetensors import safe_open
    cfg = json.load(open(f"{d}/config.json"))
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["quantization_config"]["weight_block_size"] == [32, 32]
    with safe_open(f"{d}/model.safetensors", "np") as f:
        names = set(f.keys())
    raw = O.read_safetensors(f"{d}/model.safetensors")
    dt = {k: v[0] for k, v in raw.items()}
    assert dt["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dt["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert raw["layers.0.attn.wq_a.scale"][1].shape == (2, 8)
    assert dt["layers.0.attn.wo_a.weight"] == "F8_E4M3"
    assert dt["layers.0.ffn.experts.3.w2.weight"] == "I8" and raw["layers.0.ffn.experts.3.w2.weight"][1].shape == (256, 64)
    assert raw["layers.0.ffn.experts.3.w2.scale"][1].shape == (256, 4)
    assert dt["layers.1.engram.embed.weight"] == "F8_E4M3" and raw["layers.1.engram.embed.scale"][1].shape == (864, 1)
    assert dt["layers.0.hc_attn_fn"] == "F32" and dt["layers.0.ffn.gate.bias"] == "F32"
    for n in ["embed.weight", "head.weight", "norm.weight", "vision.dummy.weight", "mtp.0.main_proj.weight",
              "mtp.0.markov_head.head.weight", "mtp.0.ffn.experts.7.w1.weight", "layers.1.attn.compressor.wgate.weight",
              "layers.3.attn.indexer.wk.weight", "layers.5.attn.indexer.weights_proj.weight", "layers.2.ffn.gate.bias_vl"]:
        assert n in names, n
    for n in ["layers.3.attn.compressor.wgate.weight", "layers.5.attn.indexer.wk.weight", "layers.2.attn.compressor.wkv.weight",
              "mtp.0.attn.compressor.wkv.weight", "mtp.0.attn.indexer.wq_b.weight", "mtp.0.ffn.experts.8.w1.weight"]:
        assert n not in names, n
    # FP4 packing: low nibble is the even element
    packed = raw["layers.0.ffn.experts.0.w1.weight"][1].view(np.uint8)
    deq = O.dequant_fp4(packed, raw["layers.0.ffn.experts.0.w1.scale"][1])
    sc = O.decode_e8m0(raw["layers.0.ffn.experts.0.w1.scale"][1])
    assert deq[1, 0] == O.E2M1_TABLE[packed[1, 0] & 0xF] * sc[1, 0]
    assert deq[1, 1] == O.E2M1_TABLE[packed[1, 0] >> 4] * sc[1, 0]


def test_bf16_variant_has_no_quantisation(tmp_path):
    cfg = C.tiny_config(quantized=False)
    assert "quantization_config" not in cfg
    C.write_checkpoint(str(tmp_path), cfg, seed=0)
    raw = O.read_safetensors(f"{tmp_path}/model.safetensors")
    assert raw["layers.0.attn.wq_a.weight"][0] == "BF16" and "layers.0.attn.wq_a.scale" not in raw
    assert raw["layers.0.ffn.experts.0.w1.weight"][0] == "BF16"
    ck = O.load_checkpoint(str(tmp_path))
    assert not ck.qlin
    lg = O.forward(ck, TOKS[:, :16])
    assert np.isfinite(lg).all() and 0.3 < lg.std() < 3


# ---------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("quant_sim", [False, True])
def test_causality(tiny, quant_sim):
    ck, _ = tiny
    toks = TOKS[:, :32]  # > window 16, > 3 candidate blocks of 4 at layer 3
    toks2 = toks.copy()
    toks2[:, 21] = (toks2[:, 21] + 7) % 512  # an odd position: the middle of a ratio-2 group
    a = O.forward(ck, toks, quant_sim=quant_sim)
    b = O.forward(ck, toks2, quant_sim=quant_sim)
    assert np.isfinite(a).all() and 0.3 < a.std() < 3 and np.abs(a).max() < 20  # O(1) logits
    np.testing.assert_allclose(a[:, :21], b[:, :21], rtol=0, atol=1e-10)
    assert np.abs(a[:, 21:] - b[:, 21:]).max() > 1e-3
    # a prefix forward gives the same logits (prefill of a shorter chunk)
    np.testing.assert_allclose(O.forward(ck, toks[:, :23], quant_sim=quant_sim), a[:, :23], rtol=0, atol=1e-10)


def test_every_feature_moves_the_logits(tiny):
    ck, _ = tiny
    toks = TOKS[:, :16]  # > 12: layer 3's compressed length exceeds 3 blocks × 4, so candidates bite
    base = O.forward(ck, toks)

    def variant(cfg_over=None, w_over=None):
        cfg = dict(ck.cfg, **(cfg_over or {}))
        w = dict(ck.w)
        for k, f in (w_over or {}).items():
            for name in [n for n in w if k in n]:
                w[name] = f(w[name])
        return np.abs(O.forward(O.Checkpoint(cfg, w, ck.qlin), toks) - base).max()

    assert variant({"candidate_source_layer": -1}) > 1e-2           # candidate blocks bite at layer 5
    assert variant({"swiglu_limit": 0.0}) > 1e-2                    # the clamp fires
    assert variant(w_over={"gate.bias": np.zeros_like}) > 1e-2      # bias changes routing
    assert variant(w_over={"attn_sink": lambda s: s - 50}) > 1e-2    # sinks matter
    assert variant({"engram_layer_ids": []}) > 1e-2                 # Engram injection
    assert variant({"index_topk": 4}) > 1e-2                         # top-k selection bites
    assert variant({"window_size": 8}) > 1e-2
    assert variant(w_over={"compressor.wgate": np.zeros_like}) > 1e-2  # compressor gates are not uniform


def _plain_window_moe(ck, toks):
    """A second, deliberately plain formulation (per-token loops) of the V4.1 block stack for the case
    compress_ratios = 0 and no Engram: mHC with delayed pre, window attention with sinks, MoE."""
    cfg, w = ck.cfg, ck.w
    D, n, H, d, rd, W = cfg["dim"], cfg["hc_mult"], cfg["n_heads"], cfg["head_dim"], cfg["rope_head_dim"], cfg["window_size"]
    eps = cfg["norm_eps"]
    T = len(toks)

    def norm(v, g):
        return g * v / np.sqrt(np.mean(v * v) + eps)

    def rot(v, p, sign=1.0):
        v = v.copy()
        for i in range(rd // 2):
            th = sign * p / 10000.0 ** (2 * i / rd)
            a, b = v[d - rd + 2 * i], v[d - rd + 2 * i + 1]
            v[d - rd + 2 * i], v[d - rd + 2 * i + 1] = a * np.cos(th) - b * np.sin(th), a * np.sin(th) + b * np.cos(th)
        return v

    def mix(Xt, pfx):
        flat = Xt.reshape(-1)
        m = w[pfx + "_fn"] @ flat / np.sqrt(np.mean(flat ** 2) + eps)
        sc, bs = w[pfx + "_scale"], w[pfx + "_base"]
        sig = lambda z: 1 / (1 + np.exp(-z))
        pre = [sig(m[k] * sc[0] + bs[k]) + 1e-6 for k in range(n)]
        post = [2 * sig(m[n + k] * sc[1] + bs[n + k]) for k in range(n)]
        Cm = [[m[2 * n + j * n + k] * sc[2] + bs[2 * n + j * n + k] for k in range(n)] for j in range(n)]
        Cm = [[np.exp(v - max(row)) / sum(np.exp(u - max(row)) for u in row) + 1e-6 for v in row] for row in Cm]
        for it in range(2 * 20 - 1):
            if it % 2 == 0:  # columns
                cs = [sum(Cm[j][k] for j in range(n)) + 1e-6 for k in range(n)]
                Cm = [[Cm[j][k] / cs[k] for k in range(n)] for j in range(n)]
            else:
                Cm = [[v / (sum(row) + 1e-6) for v in row] for row in Cm]
        return np.array(pre), np.array(post), np.array(Cm)

    X = [np.stack([w["embed.weight"][t]] * n) for t in toks]
    pre_in = [np.eye(n)[0] for _ in range(T)]
    for L in range(cfg["n_layers"]):
        p = f"layers.{L}."
        a = p + "attn."
        mixes = [mix(X[t], p + "hc_attn") for t in range(T)]
        xs = [norm(pre_in[t] @ X[t], w[p + "attn_norm.weight"]) for t in range(T)]
        qs, ks = [], []
        for t in range(T):
            qr = norm(w[a + "wq_a.weight"] @ xs[t], w[a + "q_norm.weight"])
            q = (w[a + "wq_b.weight"] @ qr).reshape(H, d)
            qs.append(np.stack([rot(q[h], t) for h in range(H)]))
            ks.append(rot(norm(w[a + "wkv.weight"] @ xs[t], w[a + "kv_norm.weight"]), t))
        newX = []
        for t in range(T):
            o = np.zeros((H, d))
            for h in range(H):
                src = list(range(max(0, t - W + 1), t + 1))
                z = np.array([qs[t][h] @ ks[s] / np.sqrt(d) for s in src])
                e = np.exp(z - z.max())
                den = e.sum() + np.exp(w[a + "attn_sink"][h] - z.max())
                o[h] = rot(sum(e[i] * ks[s] for i, s in enumerate(src)) / den, t, -1.0)
            G = cfg["o_groups"]
            og = o.reshape(G, -1)
            Wa = w[a + "wo_a.weight"].reshape(G, cfg["o_lora_rank"], -1)
            y = w[a + "wo_b.weight"] @ np.concatenate([Wa[g] @ og[g] for g in range(G)])
            pA, qA, cA = mixes[t]
            newX.append(np.stack([qA[k] * y + sum(cA[j, k] * X[t][j] for j in range(n)) for k in range(n)]))
        X = newX
        f = p + "ffn."
        for t in range(T):
            pF, qF, cF = mix(X[t], p + "hc_ffn")
            x = norm(mixes[t][0] @ X[t], w[p + "ffn_norm.weight"])
            s = np.sqrt(np.log1p(np.exp(w[f + "gate.weight"] @ x)))
            order = sorted(range(len(s)), key=lambda e: -(s[e] + w[f + "gate.bias"][e]))[: cfg["n_activated_experts"]]
            tot = sum(s[e] for e in order)

            def ffn(ep, scale=1.0):
                g, u = w[ep + "w1.weight"] @ x, w[ep + "w3.weight"] @ x
                g, u = np.minimum(g, 10.0), np.clip(u, -10.0, 10.0)
                return w[ep + "w2.weight"] @ (g / (1 + np.exp(-g)) * u * scale)

            y = ffn(f + "shared_experts.") + sum(ffn(f"{f}experts.{e}.", 1.5 * s[e] / (tot + 1e-20)) for e in order)
            X[t] = np.stack([qF[k] * y + sum(cF[j, k] * X[t][j] for j in range(n)) for k in range(n)])
            pre_in[t] = pF
    return np.stack([norm(pre_in[t] @ X[t], w["norm.weight"]) @ w["head.weight"].T for t in range(T)])


def test_reduction_to_plain_window_moe(tmp_path):
    cfg = C.tiny_config(compress_ratios=[0] * 7, kv_source_layer_ids=[], index_source_layer_ids=[],
                        candidate_source_layer_id=-1, engram_layer_ids=[], num_hidden_layers=3)
    C.write_checkpoint(str(tmp_path), cfg, seed=5)
    ck = O.load_checkpoint(str(tmp_path))
    toks = np.random.default_rng(2).integers(0, 512, 20)
    got = O.forward(ck, toks[None])[0]
    np.testing.assert_allclose(got, _plain_window_moe(ck, toks), rtol=0, atol=1e-9)
