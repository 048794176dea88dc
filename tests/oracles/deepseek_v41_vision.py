"""Independent float64 NumPy oracle of DeepSeek V4.1's vision path (specs/deepseek_v4.md §9), sharing no code with
`jaxmodels` / `converters`.

Written from the upstream reference, DeepSeek-V4.1-Flash@dba1be0a `inference/vision.py` (ViT, Aligner),
`inference/image_processor.py` (span layout) and `inference/model.py` (`encode_image`, `merge_image_embeddings`,
`Gate` with `bias_vl`, `Engram` with its token mask, `Transformer.forward`), as vendored byte for byte in
tenstorrent/tt-metal `models/demos/deepseek_v3_d_p/reference/deepseek_v41/`. The text backbone reuses the V4.1
oracle's pieces (tests/oracles/deepseek_v41.py) and adds what images change there: every position of an image span
routes with `bias_vl`, is DEAD for the Engram n-gram hash and gets no Engram update.

The ViT, per image (n = n_h * n_w patches, row-major; C = dim, H heads of d = C / H):
  x = patches.flatten(1) @ Wpe^T + b
  per block: x += wo(attn(rope(q), rope(k), v)) + bo with q | k | v = thirds of wqkv(rms(x)) + bqkv, heads
             contiguous; x += w2(silu(g) * u) with g | u = halves of w1(rms(x)) (no biases)
  rms(x) = w * x / sqrt(mean(x^2) + 1e-6); a final rms after the blocks
  rope: angles a = [row * f, col * f] (d/2 of them), f_j = theta^(-2j / (d/2)) for j < d/4; the first half x1 of a
        head and the second x2 turn as (x1 cos a - x2 sin a, x2 cos a + x1 sin a); scores / sqrt(d), softmax
The aligner: the feature grid zero-padded to multiples of r (bottom, right); each r x r block a vector
v[c*r*r + kh*r + kw] (torch F.unfold's order); w2(gelu_erf(w1 v + b1)) + b2.
Spans: [START] + ([IMAGE] * w + [NEWLINE]) * h + [END]; START/END/NEWLINE take image_start / image_end /
image_newline, the IMAGE slots the aligner rows in reading order.
"""
from __future__ import annotations

import math
import os

import numpy as np

from tests.oracles import deepseek_v41 as text

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3  # the reference's token types
VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


def load_vision(ckpt_dir) -> dict:
    """The vision tensors of a checkpoint directory, float64, by their checkpoint names."""
    out = {}
    for fn in sorted(os.listdir(ckpt_dir)):
        if fn.endswith(".safetensors"):
            for name, (dt, arr) in text.read_safetensors(os.path.join(ckpt_dir, fn)).items():
                if name.startswith(VISION_PREFIXES):
                    out[name] = text._to_f64(dt, arr)
    return out


def _rms(x, w, eps=1e-6):
    return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _gelu(x):
    erf = np.vectorize(math.erf)
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def vit(W, patches, n_h, n_w, heads, theta=10000.0):
    """patches [n_h * n_w, 3, p, p] -> final-norm features [n_h * n_w, C]."""
    x = patches.reshape(patches.shape[0], -1) @ W["vision.patch_embed.proj.weight"].T
    x = x + W["vision.patch_embed.proj.bias"]
    n, C = x.shape
    d = C // heads
    half = d // 2
    f = 1.0 / theta ** (np.arange(0, half, 2) / half)  # d/4 frequencies
    k = np.arange(n)
    ang = np.concatenate([(k // n_w)[:, None] * f, (k % n_w)[:, None] * f], -1)[:, None, :]  # [n, 1, d/2]
    cos, sin = np.cos(ang), np.sin(ang)

    def rope(t):
        t1, t2 = t[..., :half], t[..., half:]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)

    b = 0
    while f"vision.blocks.{b}.norm1.weight" in W:
        p = f"vision.blocks.{b}."
        a = _rms(x, W[p + "norm1.weight"])
        qkv = a @ W[p + "attn.wqkv.weight"].T + W[p + "attn.wqkv.bias"]
        q, kk, v = (qkv[:, i * C:(i + 1) * C].reshape(n, heads, d) for i in range(3))
        s = np.einsum("qhd,khd->hqk", rope(q), rope(kk)) / math.sqrt(d)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", s / s.sum(-1, keepdims=True), v).reshape(n, C)
        x = x + o @ W[p + "attn.wo.weight"].T + W[p + "attn.wo.bias"]
        g = _rms(x, W[p + "norm2.weight"]) @ W[p + "mlp.w1.weight"].T
        gate, up = g[:, : g.shape[1] // 2], g[:, g.shape[1] // 2:]
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ W[p + "mlp.w2.weight"].T
        b += 1
    return _rms(x, W["vision.norm.weight"])


def aligner(W, x, n_h, n_w, r):
    """Features [n_h * n_w, C] -> aligner rows [ceil(n_h/r) * ceil(n_w/r), D] in reading order."""
    C = x.shape[1]
    th, tw = -(-n_h // r), -(-n_w // r)
    grid = np.zeros((th * r, tw * r, C))
    grid[:n_h, :n_w] = x.reshape(n_h, n_w, C)
    rows = []
    for bi in range(th):
        for bj in range(tw):
            block = grid[bi * r:(bi + 1) * r, bj * r:(bj + 1) * r]  # [kh, kw, c]
            rows.append(block.transpose(2, 0, 1).reshape(-1))  # index c*r*r + kh*r + kw
    v = np.stack(rows)
    return _gelu(v @ W["aligner.w1.weight"].T + W["aligner.w1.bias"]) @ W["aligner.w2.weight"].T + W["aligner.w2.bias"]


def span_types(rows, cols):
    return [IMAGE_START] + ([IMAGE] * cols + [IMAGE_NEW_LINE]) * rows + [IMAGE_END]


def span_rows(W, patches, n_h, n_w, heads, r, theta=10000.0):
    """(the rows of one image's whole span [len, D], its token types)."""
    z = aligner(W, vit(W, patches, n_h, n_w, heads, theta), n_h, n_w, r)
    types = span_types(-(-n_h // r), -(-n_w // r))
    table = {IMAGE_START: W["image_start"], IMAGE_END: W["image_end"], IMAGE_NEW_LINE: W["image_newline"]}
    out, k = [], 0
    for t in types:
        if t == IMAGE:
            out.append(z[k])
            k += 1
        else:
            out.append(table[t])
    return np.stack(out), types


def _moe(ctx, x, prefix, n_experts, topk, image):
    """REF41 `MoE` with `Gate`'s bias_vl on image tokens (image [B, T] bool)."""
    cfg, w = ctx.cfg, ctx.w
    lim = cfg["swiglu_limit"]
    s = np.sqrt(text.softplus((x @ w[prefix + "gate.weight"].T) / cfg.get("gate_temp", 1.0)))
    bias = np.where(image[..., None], w[prefix + "gate.bias_vl"], w[prefix + "gate.bias"])
    sel = text.topk_mask(s + bias, topk)
    wts = np.where(sel, s, 0.0)
    if cfg.get("norm_topk_prob", True) and topk > 1:
        wts = wts / (wts.sum(-1, keepdims=True) + 1e-20)
    wts = wts * cfg["route_scale"]

    def expert(xx, ep, rw=None):
        g, u = ctx.lin(xx, ep + "w1.weight"), ctx.lin(xx, ep + "w3.weight")
        if lim > 0:
            u, g = np.clip(u, -lim, lim), np.minimum(g, lim)
        h = text.silu(g) * u
        return ctx.lin(h if rw is None else h * rw[..., None], ep + "w2.weight")

    y = np.zeros_like(x)
    for e in range(n_experts):
        m = sel[..., e]
        if m.any():
            y[m] += expert(x[m], f"{prefix}experts.{e}.", wts[..., e][m])
    return y + expert(x, prefix + "shared_experts.")


def backbone(ck, tokens, token_types, rows_per_image, token_map=None, route_images=True, engram_images=True):
    """Logits [B, T, V] of a V4.1 prefill whose image spans (token_types >= 0) take `rows_per_image` (each image's
    span rows, in order, row-major over the batch). route_images / engram_images False: image tokens routed with the
    text bias / treated as text by Engram (what the reference does NOT do: for tests that show these matter)."""
    ctx = text._Ctx(ck, False)
    cfg, w = ctx.cfg, ctx.w
    tokens = np.asarray(tokens, np.int64)
    types = np.asarray(token_types)
    image = types >= 0
    B, T = tokens.shape
    n, it, he, eps = cfg["hc_mult"], cfg["hc_sinkhorn_iters"], cfg["hc_eps"], cfg["norm_eps"]
    h = w["embed.weight"][tokens].copy()
    spans = iter(rows_per_image)
    for b in range(B):
        t = 0
        while t < T:
            if types[b, t] == IMAGE_START:
                rows = next(spans)
                h[b, t:t + len(rows)] = rows
                t += len(rows)
            else:
                t += 1
    hashes = None
    if cfg["engram_layer_ids"]:
        hashes = text.engram_hashes(tokens, cfg, text.default_token_map(cfg, token_map),
                                    dead_mask=image if engram_images else None)
    X = np.repeat(h[:, :, None, :], n, axis=2)
    pre = np.zeros((B, T, n))
    pre[..., 0] = 1.0
    sh = text._Shared()
    routed = image if route_images else np.zeros_like(image)
    for i in range(cfg["n_layers"]):
        p = f"layers.{i}."
        if i in cfg["engram_layer_ids"]:
            new, _ = text.engram_apply(ctx, X, hashes[:, :, list(cfg["engram_layer_ids"]).index(i)], i)
            X = np.where(image[..., None, None], X, new) if engram_images else new  # gate 0: untouched
        pA, qA, cA = text.mixes_sinkhorn(X, w[p + "hc_attn_fn"], w[p + "hc_attn_base"], w[p + "hc_attn_scale"], n, it,
                                         he, eps)
        y = text.attention(ctx, text.rms_norm(text.hc_collapse(X, pre), w[p + "attn_norm.weight"], eps), i, sh)
        X = text.hc_expand(y, X, qA, cA)
        pF, qF, cF = text.mixes_sinkhorn(X, w[p + "hc_ffn_fn"], w[p + "hc_ffn_base"], w[p + "hc_ffn_scale"], n, it,
                                         he, eps)
        y = _moe(ctx, text.rms_norm(text.hc_collapse(X, pA), w[p + "ffn_norm.weight"], eps), p + "ffn.",
                 cfg["n_routed_experts"], cfg["n_activated_experts"], routed)
        X, pre = text.hc_expand(y, X, qF, cF), pF
    x = text.rms_norm(text.hc_collapse(X, pre), w["norm.weight"], eps)
    return x @ w["head.weight"].T
