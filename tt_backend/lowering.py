"""The layer plan -> TT programs (ttnn call lists), as tt_transformers writes a decoder layer.

`lower(cfg, prefill_len=..., batch=..., ...)` returns a `TTModelProgram` with
- prefill: one user, its prompt padded to a multiple of 128 (`padded_prefill_len`), activations
  [1, 1, S, D] in DRAM; K/V typecast to the cache dtype and written with `paged_fill_cache`;
  causal `scaled_dot_product_attention`; logits for all S rows;
- decode: one token for each of B users (B <= 32), activations [1, 1, B, D]; heads padded to 32
  by `nlp_create_qkv_heads_decode`; `paged_update_cache` with bf16 rows; paged SDPA decode.

Both read the same weights (`tt_backend.weights.prepare`) and the same per-layer paged K/V caches
[num_blocks, kv_heads, block_size, head_dim] ("kv.<layer>.k" / ".v"). Sliding-window layers keep a
full-length cache and enforce the window on the read side (`sliding_window_size`), as Tenstorrent's
generator_vllm does.

Options: `chunk_start` (a later prefill chunk attending to earlier ones through the cache with
`chunked_scaled_dot_product_attention`), `per_layer_page_tables` (hybrid KV-cache groups read
"page_table.<i>"), `cache_position_modulo` (sliding layers as rings), `policy` (DecodersPrecision-like
dtypes and compute configs, `tt_backend.weights.POLICIES`; a `DecodersPrecision` sets them per layer, as
`tt_backend.precision.choose` does from the weights).

Multimodal prefill (the vision tower runs in JAX on the host, `tt_backend.multimodal`): `embeddings=True`
makes the prefill start from an "embeddings" input [1, 1, S, D] (HF's inputs_embeds: lookup, embed scale and
spliced image features, made by the caller) instead of "tokens" and the embedding lookup; `attention_mask=True`
replaces the causal rule of prefill SDPA by additive masks [1, 1, S, S] (`attention_masks`: Gemma3's
bidirectional image blocks), one input per distinct window ("attn_mask", "attn_mask.w<W>"). Decode is unchanged.

Mllama's cross-attention layers (`cross_tokens`, `_cross_layer`): the prefill of a request with images reads its
image features ("cross_states", from the vision tower run in JAX on the host: `tt_backend.multimodal`), projects
them through each cross layer's wk / wv + k_norm and fills that layer's paged cache through "cross_page_table";
decode reads those K/V back (nothing recomputed). Additive masks and HF's row mask are host inputs
(`tt_backend.cross_attention`). Without images (cross_tokens=0) the cross layers are skipped, as in HF.

MoE layers (GPT-OSS, Qwen3-MoE routers) are lowered with dense experts: every expert runs on every
row, weighted by its routing weight (exact routing, E times the expert work of ttnn.sparse_matmul).

`check_config` raises `TTConstraintError` for what TT cannot do and `NotImplementedError` for what
this lowering does not do yet (shared experts outside DeepSeek, mHC on GQA layers); nothing falls back silently.
DeepSeek V4 / V4.1 configs (mHC + MLA) are lowered by `tt_backend.deepseek_lowering` (prefill and decode over its
own hybrid paged caches, listed in meta["kv_cache_specs"]) and `lower` hands them over.
`check_program` validates a program's calls (dtype/layout rules of cache ops, tile alignment, top-k).

Tensor parallelism is a transform of these programs (`tt_backend.mesh`). Not lowered (yet): on-device sampling
(`check_sampling` holds its limits; logits go to the host), sparse expert matmuls outside DeepSeek. The
prefill program returns the logits of every row (tt_transformers keeps only the last token's tile),
so it also serves as `tt_backend.forward`.
"""
from __future__ import annotations

import math

import numpy as np

from jaxmodels.config import LayerSpec, ModelConfig
# the shared limits, names and checks, re-exported: callers read them as lowering.<name>
from tt_backend.builder import (  # noqa: F401
    BF16, BFP4, BFP8, DRAM, F32, I32, L1_HEIGHT, L1_WIDTH, MASKED, MAX_DECODE_BATCH, MAX_HEADS, MAX_TOPK_K,
    MAX_TOPK_WIDTH, PREFILL_MULTIPLE, RM, TILE, TILE_L, U16, U32, Builder, TTConstraintError, check_decode_batch,
    check_program, check_sampling, check_topk, compute_config, padded_prefill_len)
from tt_backend.program import Ref, TTModelProgram, TTProgram
from tt_backend.weights import DecodersPrecision, Precision, layer_policy, policy as get_policy, rope_specs

ACTIVATIONS = {"silu": "ttnn.UnaryOpType.SILU", "gelu_tanh": "ttnn.UnaryOpType.GELU_TANH",
               "gelu": "ttnn.UnaryOpType.GELU"}

# ----------------------------------------------------------------------------------- checks
def check_layer(cfg: ModelConfig, i: int, spec: LayerSpec) -> None:
    a = spec.attention
    where = f"layer {i}"
    if spec.residual != "plain":
        raise NotImplementedError(f"{where}: residual {spec.residual!r} (mHC) lowering is a later issue")
    if a.kind == "cross":
        _check_cross_layer(cfg, where, spec)
    elif a.kind != "gqa":
        raise NotImplementedError(f"{where}: {a.kind!r} attention (DeepSeek's latent attention) lowering is a later issue")
    if spec.engram >= 0:
        raise NotImplementedError(f"{where}: Engram lowering is a later issue")
    m = spec.mlp
    if m.kind == "moe":
        if m.shared_intermediate_size:
            raise NotImplementedError(f"{where}: MoE with a shared expert: lowering is a later issue")
        if m.router not in ("topk_softmax", "softmax_topk"):
            raise NotImplementedError(f"{where}: MoE router {m.router!r} is not lowered")
        if m.route_scale != 1.0:
            raise NotImplementedError(f"{where}: MoE routing weights scaled by {m.route_scale}: not lowered")
        if m.num_experts > MAX_TOPK_WIDTH:
            raise TTConstraintError(f"{where}: ttnn.topk over {m.num_experts} experts > {MAX_TOPK_WIDTH}")
    if m.activation not in ACTIVATIONS and not (m.kind == "moe" and m.activation == "swiglu_clamp"):
        raise NotImplementedError(f"{where}: MLP activation {m.activation!r} has no ttnn lowering here "
                                  f"(supported: {sorted(ACTIVATIONS)}, and swiglu_clamp for experts)")
    if spec.mlp.intermediate_size % TILE:
        raise TTConstraintError(f"{where}: intermediate_size={spec.mlp.intermediate_size} is not a multiple of "
                                f"the {TILE}-wide tile")
    if a.softcap is not None:
        raise TTConstraintError(f"{where}: attention logit softcap={a.softcap}: ttnn SDPA has no softcap argument")
    if a.rope is not None and a.rope.kind == "dynamic":
        raise TTConstraintError(f"{where}: dynamic NTK RoPE rescales at run time; TT rope tables are static")
    if a.window is not None and a.window < 1:
        raise TTConstraintError(f"{where}: sliding window {a.window} < 1")


def check_config(cfg: ModelConfig) -> None:
    """Raise for anything in the plan that TT cannot run, before any call is emitted."""
    if cfg.mhc is not None or any(s.attention.kind == "mla" for s in cfg.layers):
        raise NotImplementedError(f"{cfg.family}: mla attention (DeepSeek V4's latent attention), mHC and Engram "
                                  f"lowering is a later issue")
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if D % TILE:
        raise TTConstraintError(f"hidden_size={D} is not a multiple of the {TILE}-wide tile")
    if d % TILE:
        raise TTConstraintError(f"head_dim={d} is not a multiple of {TILE}: rotary_embedding_llama and the "
                                f"head split work on whole 32-column tiles")
    if H > MAX_HEADS or K > MAX_HEADS:
        raise TTConstraintError(f"{H} query / {K} kv heads on one device: nlp_create_qkv_heads_decode pads heads "
                                f"to {MAX_HEADS}; more need tensor parallelism, which this lowering does not do")
    if cfg.norm not in ("rms", "rms_fp32", "gemma", "layernorm"):
        raise TTConstraintError(f"final norm kind {cfg.norm!r}")
    for i, spec in enumerate(cfg.layers):
        check_layer(cfg, i, spec)


# --------------------------------------------------------------------------- prefill masks
def mask_name(window: int | None) -> str:
    """The mask input that layers with this sliding window read in a masked prefill."""
    return "attn_mask" if window is None else f"attn_mask.w{window}"


def attention_masks(cfg: ModelConfig, image_blocks, rows: int) -> dict[str, np.ndarray]:
    """The masked prefill's mask inputs: {mask_name(window): float32 [1, 1, rows, rows]}, 0 where query q may
    see key k, `MASKED` elsewhere. image_blocks [T <= rows] int: the bidirectional region a prompt token belongs
    to (`jaxmodels.layers.vision.image_blocks`: Gemma3's image soft tokens), -1 for text; padding rows are text.
    Gemma3's rule (HF `token_type_ids_mask_function`, specs/vision.md §1.5): full layers
    allowed = k <= q or same(q, k); sliding layers additionally k > q - W (one-sided, so a later token of the
    same image always passes it)."""
    blk = np.full(rows, -1, np.int64)
    given = np.asarray(image_blocks).reshape(-1)
    if given.shape[0] > rows:
        raise ValueError(f"image_blocks has {given.shape[0]} entries for a prefill of {rows} rows")
    blk[: given.shape[0]] = given
    q, k = np.arange(rows)[:, None], np.arange(rows)[None, :]
    base = (k <= q) | ((blk[:, None] == blk[None, :]) & (blk[:, None] >= 0))
    out = {}
    for w in {s.attention.window for s in cfg.layers}:
        allowed = base if w is None else base & (k > q - w)
        out[mask_name(w)] = np.where(allowed, 0.0, MASKED).astype(np.float32)[None, None]
    return out


def _norm(b: Builder, x, w, kind, shape, out, eps):
    """rms_norm or layer_norm (Cohere); Gemma's (1+w) is folded into w by weights.py."""
    op = "ttnn.layer_norm" if kind == "layernorm" else "ttnn.rms_norm"
    kw = {"epsilon": eps, "weight": Ref(w), "compute_kernel_config": compute_config(b.prec.norm), "memory_config": b.mem}
    return b.call(op, [x], kw, out, shape)


def _linear(b: Builder, x, w, out, shape, op_cfg, bias=None):
    """ttnn.linear, bias added by a separate ttnn.add as tt_transformers does for DRAM-sharded matmuls."""
    y = b.call("ttnn.linear", [x, w], {"dtype": BF16, "compute_kernel_config": compute_config(op_cfg), "memory_config": b.mem},
               out if bias is None else out + ".nobias", shape)
    if bias is not None:
        b.call("ttnn.add", [y, bias], {"memory_config": b.mem}, out, shape)
    return out


def _attention(b: Builder, i: int, spec: LayerSpec, h: str, rows: int, rope_name: dict) -> str:
    cfg, prec, mode = b.cfg, b.prec, b.mode
    a = spec.attention
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L = f"layers.{i}"
    n = f"l{i}"
    qkv_w = b.weight(f"{L}.wqkv", (1, 1, D, (H + 2 * K) * d), prec.wqkv)
    bias = b.weight(f"{L}.bqkv", (1, 1, 1, (H + 2 * K) * d), BF16) if a.qkv_bias else None
    xqkv = _linear(b, h, qkv_w, f"{n}.xqkv", (1, 1, rows, (H + 2 * K) * d), prec.li_qkv, bias)
    if mode == "prefill":  # [1, heads, S, d]
        shapes = ((1, H, rows, d), (1, K, rows, d), (1, K, rows, d))
        b.call("ttnn.experimental.nlp_create_qkv_heads", [xqkv],
               {"num_heads": H, "num_kv_heads": K, "transpose_k_heads": False, "memory_config": DRAM},
               (f"{n}.q", f"{n}.k", f"{n}.v"), shapes)
    else:  # [1, B, heads (padded to 32 in storage), d]
        shapes = ((1, rows, H, d), (1, rows, K, d), (1, rows, K, d))
        b.call("ttnn.experimental.nlp_create_qkv_heads_decode", [xqkv],
               {"num_heads": H, "num_kv_heads": K, "memory_config": L1_HEIGHT},
               (f"{n}.q", f"{n}.k", f"{n}.v"), shapes)
    q, k, v = f"{n}.q", f"{n}.k", f"{n}.v"
    if a.qk_norm:
        for t, heads, wn in ((q, H, "q_norm"), (k, K, "k_norm")):
            shape = b.tensors[t].shape
            if a.qk_norm_per_head:  # one weight row per head: weightless norm, then a broadcast multiply
                w = b.weight(f"{L}.{wn}", (1, heads, 1, d), BF16)
                if mode == "decode":  # decode heads sit in dim 2
                    w = b.call("ttnn.reshape", [w], {"shape": [1, 1, heads, d]}, f"{t}.{wn}_w", (1, 1, heads, d))
                op = "ttnn.layer_norm" if a.qk_norm == "layernorm" else "ttnn.rms_norm"
                y = b.call(op, [t], {"epsilon": cfg.norm_eps, "compute_kernel_config": compute_config(prec.norm),
                                     "memory_config": b.mem}, f"{t}.normed", shape)
                b.call("ttnn.mul", [y, w], {"memory_config": b.mem}, f"{t}.n", shape)
            else:
                w = b.weight(f"{L}.{wn}", (1, 1, 1, d), BF16, RM)
                _norm(b, t, w, a.qk_norm, shape, f"{t}.n", cfg.norm_eps)
        q, k = f"{q}.n", f"{k}.n"
    if a.rope is not None:
        cos, sin = rope_name[a.rope]
        for t in (q, k):
            b.call("ttnn.experimental.rotary_embedding_llama", [t, cos, sin, "rope.trans_mat"],
                   {"is_decode_mode": mode == "decode", "compute_kernel_config": compute_config(prec.rope)},
                   f"{t}.rot", b.tensors[t].shape)
        q, k = f"{q}.rot", f"{k}.rot"
    kc, vc = f"kv.{i}.k", f"kv.{i}.v"
    scale = a.scale if a.scale is not None else d**-0.5
    sdpa_kw = {"scale": scale, "sliding_window_size": a.window, "compute_kernel_config": compute_config(prec.sdpa)}
    if a.sinks:
        sdpa_kw["attention_sink"] = Ref(b.weight(f"{L}.sinks", (1, 1, 1, H), BF16))
    ring = {} if b.ring(i) is None else {"cache_position_modulo": b.ring(i)}
    if mode == "prefill":
        k8 = b.call("ttnn.typecast", [k], {"dtype": prec.kv_cache}, f"{n}.k8", b.tensors[k].shape, prec.kv_cache)
        v8 = b.call("ttnn.typecast", [v], {"dtype": prec.kv_cache}, f"{n}.v8", b.tensors[v].shape, prec.kv_cache)
        fill_kw = {"batch_idx": 0, **ring}
        if ring:  # a ring keeps the last `modulo` tokens: stop at the real length, not the padded one
            fill_kw["valid_seq_len_tensor"] = Ref("valid_seq_len")
        for c, t in ((kc, k8), (vc, v8)):
            b.call("ttnn.experimental.paged_fill_cache", [c, t, b.page_table(i, chunk=b.chunk_start > 0)], fill_kw,
                   (), ())
        if b.chunk_start:  # later chunks attend to earlier ones through the cache
            o = b.call("ttnn.transformer.chunked_scaled_dot_product_attention", [q, kc, vc, b.page_table(i)],
                       {"chunk_start_idx": b.chunk_start, **sdpa_kw}, f"{n}.attn", (1, H, rows, d))
        elif b.masked:  # the window is part of the mask (`attention_masks`)
            kw = {k: v for k, v in sdpa_kw.items() if k != "sliding_window_size"}
            o = b.call("ttnn.transformer.scaled_dot_product_attention", [q, k8, v8],
                       {"is_causal": False, "attn_mask": Ref(mask_name(a.window)), **kw}, f"{n}.attn", (1, H, rows, d))
        else:
            o = b.call("ttnn.transformer.scaled_dot_product_attention", [q, k8, v8],
                       {"is_causal": True, **sdpa_kw}, f"{n}.attn", (1, H, rows, d))
        o = b.call("ttnn.experimental.nlp_concat_heads", [o], {"memory_config": DRAM}, f"{n}.concat",
                   (1, 1, rows, H * d))
    else:
        for c, t in ((kc, k), (vc, v)):
            b.call("ttnn.experimental.paged_update_cache", [c, t],
                   {"update_idxs_tensor": Ref("cur_pos"), "page_table": Ref(b.page_table(i)), **ring}, (), ())
        o = b.call("ttnn.transformer.paged_scaled_dot_product_attention_decode", [q, kc, vc],
                   {"page_table_tensor": Ref(b.page_table(i)), "cur_pos_tensor": Ref("cur_pos"), **sdpa_kw, **ring,
                    "memory_config": L1_HEIGHT}, f"{n}.attn", (1, rows, H, d))
        o = b.call("ttnn.experimental.nlp_concat_heads_decode", [o], {"num_heads": H}, f"{n}.concat",
                   (1, 1, rows, H * d))
    wo = b.weight(f"{L}.wo", (1, 1, H * d, D), prec.wo)
    bo = b.weight(f"{L}.bo", (1, 1, 1, D), BF16) if a.out_bias else None
    return _linear(b, o, wo, f"{n}.attn_out", (1, 1, rows, D), prec.li_o, bo)


def _mlp(b: Builder, i: int, spec: LayerSpec, h: str, rows: int) -> str:
    cfg, prec, m = b.cfg, b.prec, spec.mlp
    D, I = cfg.hidden_size, m.intermediate_size
    L, n = f"layers.{i}", f"l{i}"
    bias = lambda name, width: b.weight(f"{L}.{name}", (1, 1, 1, width), BF16) if m.bias else None  # noqa: E731
    w1 = _linear(b, h, b.weight(f"{L}.w1", (1, 1, D, I), prec.ff1_3), f"{n}.w1", (1, 1, rows, I), prec.li_ff1_3,
                 bias("b1", I))
    w3 = _linear(b, h, b.weight(f"{L}.w3", (1, 1, D, I), prec.ff1_3), f"{n}.w3", (1, 1, rows, I), prec.li_ff1_3,
                 bias("b3", I))
    g = b.call("ttnn.mul", [w1, w3], {"input_tensor_a_activations": [ACTIVATIONS[m.activation]],
                                      "dtype": BF16, "memory_config": b.mem}, f"{n}.gated", (1, 1, rows, I))
    return _linear(b, g, b.weight(f"{L}.w2", (1, 1, I, D), prec.ff2), f"{n}.mlp_out", (1, 1, rows, D),
                   prec.li_ff2, bias("b2", D))


def _moe(b: Builder, i: int, spec: LayerSpec, h: str, rows: int) -> str:
    """Routed experts, computed densely: every expert runs on every row and is weighted by its routing
    weight (0 for unchosen experts), as tt_transformers' first MoE path did. GPT-OSS's router
    (linear + bias -> ttnn.topk -> softmax over the k values) or Qwen3-MoE's (softmax over all ->
    topk [-> renormalise]); ttnn.scatter makes the dense [rows, experts] weights. Exact for the
    routing, but E times the expert FLOPs of the sparse_matmul path (a later optimisation)."""
    cfg, prec, m = b.cfg, b.prec, spec.mlp
    D, I, E, k = cfg.hidden_size, m.intermediate_size, m.num_experts, m.top_k
    L, n = f"layers.{i}", f"l{i}"
    se, sk, sr = (1, 1, rows, E), (1, 1, rows, k), (1, 1, rows, 1)
    rb = b.weight(f"{L}.router_bias", (1, 1, 1, E), BF16) if m.router_bias else None
    logits = _linear(b, h, b.weight(f"{L}.router", (1, 1, D, E), BF16), f"{n}.router", se, prec.router, rb)
    topk = {"k": k, "dim": -1, "largest": True, "sorted": True}
    smax = {"dim": -1, "numeric_stable": True, "compute_kernel_config": compute_config(prec.router)}
    if m.router == "topk_softmax":  # GPT-OSS: the k largest logits, softmax over those k
        b.call("ttnn.topk", [logits], topk, (f"{n}.topv", f"{n}.topi"), (sk, sk), (BF16, U16))
        w = b.call("ttnn.softmax", [f"{n}.topv"], smax, f"{n}.topw", sk)
    else:  # Qwen3-MoE: softmax over all experts, the k largest probabilities [, renormalised]
        probs = b.call("ttnn.softmax", [logits], smax, f"{n}.probs", se)
        b.call("ttnn.topk", [probs], topk, (f"{n}.topv", f"{n}.topi"), (sk, sk), (BF16, U16))
        w = f"{n}.topv"
        if m.renormalize:
            tot = b.call("ttnn.sum", [w], {"dim": -1, "keepdim": True}, f"{n}.topsum", sr)
            w = b.call("ttnn.div", [w, tot], {}, f"{n}.topw", sk)
    zeros = b.call("ttnn.mul", [logits], {"input_tensor_b": 0.0}, f"{n}.zeros", se)  # router logits are finite
    route = b.call("ttnn.scatter", [zeros], {"dim": -1, "index": Ref(f"{n}.topi"), "src": Ref(w)},
                   f"{n}.route", se)
    acc = None
    for e in range(E):
        Le, ne = f"{L}.e{e}", f"{n}.e{e}"
        bias = lambda name, width: b.weight(f"{Le}.{name}", (1, 1, 1, width), BF16) if m.bias else None  # noqa: E731
        re = b.call("ttnn.slice", [route], {"starts": [0, 0, 0, e], "ends": [1, 1, rows, e + 1]}, f"{ne}.w", sr)
        g = _linear(b, h, b.weight(f"{Le}.w1", (1, 1, D, I), prec.ff1_3), f"{ne}.g", (1, 1, rows, I),
                    prec.li_ff1_3, bias("b1", I))
        u = _linear(b, h, b.weight(f"{Le}.w3", (1, 1, D, I), prec.ff1_3), f"{ne}.u", (1, 1, rows, I),
                    prec.li_ff1_3, bias("b3", I))
        si = (1, 1, rows, I)
        if m.activation == "swiglu_clamp":  # (clip(u, ±l) + 1) * g' * sigmoid(alpha g'), g' = min(g, l)
            g = b.call("ttnn.clamp", [g], {"max": m.clamp_limit}, f"{ne}.gc", si)
            u = b.call("ttnn.clamp", [u], {"min": -m.clamp_limit, "max": m.clamp_limit}, f"{ne}.uc", si)
            sg = b.call("ttnn.mul", [g], {"input_tensor_b": m.clamp_alpha}, f"{ne}.ag", si)
            sg = b.call("ttnn.sigmoid", [sg], {}, f"{ne}.sig", si)
            glu = b.call("ttnn.mul", [g, sg], {}, f"{ne}.glu", si)
            u1 = b.call("ttnn.add", [u], {"input_tensor_b": 1.0}, f"{ne}.u1", si)
            act = b.call("ttnn.mul", [u1, glu], {}, f"{ne}.act", si)
        else:
            act = b.call("ttnn.mul", [g, u], {"input_tensor_a_activations": [ACTIVATIONS[m.activation]],
                                              "dtype": BF16}, f"{ne}.act", si)
        y = _linear(b, act, b.weight(f"{Le}.w2", (1, 1, I, D), prec.ff2), f"{ne}.y", (1, 1, rows, D),
                    prec.li_ff2, bias("b2", D))
        y = b.call("ttnn.mul", [y, re], {}, f"{ne}.yw", (1, 1, rows, D))
        acc = y if acc is None else b.call("ttnn.add", [acc, y], {}, f"{ne}.acc", (1, 1, rows, D))
    return acc


def _layer(b: Builder, i: int, spec: LayerSpec, x: str, rows: int, rope_name: dict) -> str:
    """Decoder layer i under its own precision (a DecodersPrecision's entry, or the uniform policy)."""
    model_prec, b.prec = b.prec, layer_policy(b.prec, i)
    try:
        return _layer_body(b, i, spec, x, rows, rope_name)
    finally:
        b.prec = model_prec


def _layer_body(b: Builder, i: int, spec: LayerSpec, x: str, rows: int, rope_name: dict) -> str:
    if spec.attention.kind == "cross":  # Mllama: skipped without image features (a text-only request), as HF
        return _cross_layer(b, i, spec, x, rows) if b.cross_tokens else x
    cfg = b.cfg
    D, eps, L, n = cfg.hidden_size, cfg.norm_eps, f"layers.{i}", f"l{i}"
    shape = (1, 1, rows, D)
    nw = lambda name: b.weight(f"{L}.{name}", (1, 1, 1, D), BF16, RM)  # noqa: E731
    norm = lambda t, name, out: _norm(b, t, nw(name), spec.norm, shape, out, eps)  # noqa: E731
    add = lambda p, q, out: b.call("ttnn.add", [p, q], {"memory_config": b.mem}, out, shape)  # noqa: E731
    h = x if spec.block == "post" else norm(x, "attn_norm", f"{n}.h")
    att = _attention(b, i, spec, h, rows, rope_name)
    ffn = _moe if spec.mlp.kind == "moe" else _mlp
    if spec.block == "parallel":  # Cohere: attention and MLP read the same normed input
        y = ffn(b, i, spec, h, rows)
        x = add(add(x, att, f"{n}.x_attn"), y, f"{n}.out")
    elif spec.block == "pre":
        x = add(x, att, f"{n}.x_attn")
        x = add(x, ffn(b, i, spec, norm(x, "mlp_norm", f"{n}.h2"), rows), f"{n}.out")
    elif spec.block == "sandwich":  # Gemma: norms before and after each sublayer
        x = add(x, norm(att, "post_attn_norm", f"{n}.att_n"), f"{n}.x_attn")
        y = ffn(b, i, spec, norm(x, "mlp_norm", f"{n}.h2"), rows)
        x = add(x, norm(y, "post_mlp_norm", f"{n}.mlp_n"), f"{n}.out")
    else:  # post (EXAONE): norms on the sublayer outputs only
        x = add(x, norm(att, "post_attn_norm", f"{n}.att_n"), f"{n}.x_attn")
        y = ffn(b, i, spec, x, rows)
        x = add(x, norm(y, "post_mlp_norm", f"{n}.mlp_n"), f"{n}.out")
    return x


def _program(cfg: ModelConfig, prec: Precision | DecodersPrecision, mode: str, rows: int, max_seq_len: int,
             block_size: int,
             page_table_width: int, chunk_start: int = 0, per_layer_page_tables: bool = False,
             modulo: tuple = (), embeddings: bool = False, attention_mask: bool = False,
             cross_tokens: int = 0) -> TTProgram:
    prefill = mode == "prefill"
    b = Builder(cfg, prec, mode, chunk_start if prefill else 0, per_layer_page_tables, modulo,
                 masked=attention_mask and prefill)
    b.cross_tokens = cross_tokens  # image-feature tokens the cross layers read (0: they are skipped)
    D, V, K, d = cfg.hidden_size, cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim
    users = 1 if mode == "prefill" else rows
    embeddings = embeddings and prefill
    inputs = [b.tensor("embeddings", (1, 1, rows, D), BF16, TILE_L, DRAM, "input") if embeddings else
              b.tensor("tokens", (1, rows), U32, RM, DRAM, "input"),
              b.tensor("rope_pos", (1, rows), U32, RM, DRAM, "input")]
    if b.masked:
        for w in sorted({s.attention.window for s in cfg.layers}, key=lambda w: (w is not None, w or 0)):
            inputs.append(b.tensor(mask_name(w), (1, 1, rows, rows), BF16, TILE_L, DRAM, "input"))
    for i in range(cfg.num_layers) if per_layer_page_tables else [0]:
        inputs.append(b.tensor(b.page_table(i), (users, page_table_width), I32, RM, DRAM, "input"))
        if b.chunk_start:
            inputs.append(b.tensor(b.page_table(i, chunk=True), (1, rows // block_size), I32, RM, DRAM, "input"))
    if mode == "prefill" and any(m is not None for m in modulo):
        inputs.append(b.tensor("valid_seq_len", (1,), I32, RM, DRAM, "input"))
    if mode == "decode":
        inputs.append(b.tensor("cur_pos", (rows,), I32, RM, DRAM, "input"))
    if cross_tokens:
        inputs += _cross_inputs(b, rows, cross_tokens, block_size)
    for i in range(cfg.num_layers):
        for kv in "kv":
            b.tensor(f"kv.{i}.{kv}", (None, K, block_size, d), prec.kv_cache, TILE_L, DRAM, "state")
    # rope: cos/sin looked up per position with ttnn.embedding, then shaped for the op's mode
    rope_name = {}
    for name, r in rope_specs(cfg).items():
        pair = []
        for cs in ("cos", "sin"):
            tab = b.weight(f"{name}.{cs}", (max_seq_len, d), BF16, RM)
            e = b.call("ttnn.embedding", ["rope_pos", tab], {"layout": TILE_L, "dtype": BF16}, f"{name}.{cs}.rows",
                       (1, rows, d))
            shape = [1, rows, 1, d] if mode == "decode" else [1, 1, rows, d]
            pair.append(b.call("ttnn.reshape", [e], {"shape": shape}, f"{name}.{cs}.m", tuple(shape)))
        rope_name[r] = tuple(pair)
    if any(s.attention.rope is not None for s in cfg.layers):
        b.weight("rope.trans_mat", (1, 1, TILE, TILE), BF16)
    if embeddings:  # the caller's inputs_embeds (scaled, images spliced): no lookup here
        x = "embeddings"
    else:
        emb = b.weight("embed", (V, D), BF16, RM)
        x = b.call("ttnn.embedding", ["tokens", emb], {"layout": TILE_L, "dtype": BF16}, "embed.rows", (1, rows, D))
        x = b.call("ttnn.reshape", [x], {"shape": [1, 1, rows, D]}, "x0", (1, 1, rows, D))
        if cfg.embed_scale is not None:
            x = b.call("ttnn.mul", [x], {"input_tensor_b": float(cfg.embed_scale), "memory_config": b.mem},
                       "x0.scaled", (1, 1, rows, D))
    layer_outputs = []
    for i, spec in enumerate(cfg.layers):
        x = _layer(b, i, spec, x, rows, rope_name)
        layer_outputs.append(x)  # a skipped cross layer's output is its input
    fw = b.weight("final_norm", (1, 1, 1, D), BF16, RM)
    h = _norm(b, x, fw, cfg.norm, (1, 1, rows, D), "final.h", cfg.norm_eps)
    V = cfg.logits_size  # Mllama's head has fewer rows than its embedding
    head = b.weight("lm_head", (1, 1, D, V), prec.lm_head)
    out = b.call("ttnn.linear", [h, head], {"dtype": BF16, "compute_kernel_config": compute_config(prec.lm_head_op),
                                            "memory_config": b.mem}, "logits.raw", (1, 1, rows, V))
    if cfg.logit_scale is not None:
        out = b.call("ttnn.mul", [out], {"input_tensor_b": float(cfg.logit_scale), "memory_config": b.mem},
                     "logits.scaled", (1, 1, rows, V))
    if cfg.final_softcap is not None:  # cap * tanh(x / cap)
        c = float(cfg.final_softcap)
        out = b.call("ttnn.mul", [out], {"input_tensor_b": 1.0 / c, "memory_config": b.mem}, "logits.div", (1, 1, rows, V))
        out = b.call("ttnn.tanh", [out], {"memory_config": b.mem}, "logits.tanh", (1, 1, rows, V))
        out = b.call("ttnn.mul", [out], {"input_tensor_b": c, "memory_config": b.mem}, "logits.capped", (1, 1, rows, V))
    prog = TTProgram(mode, b.calls, b.tensors, tuple(inputs), (out,),
                     {"rows": rows, "block_size": block_size, "page_table_width": page_table_width,
                      "chunk_start": b.chunk_start, "cache_position_modulo": list(modulo) or None,
                      **({"embeddings": True} if embeddings else {}), **({"attention_mask": True} if b.masked else {}),
                      **({"cross_tokens": cross_tokens} if cross_tokens else {}), "layer_outputs": layer_outputs})
    check_program(prog)
    return prog


def lower(cfg: ModelConfig, *, prefill_len: int = PREFILL_MULTIPLE, batch: int = MAX_DECODE_BATCH,
          max_seq_len: int = 8192, block_size: int = 32, policy: str | Precision | DecodersPrecision = "performance",
          chunk_start: int = 0, per_layer_page_tables: bool = False,
          cache_position_modulo: tuple[int | None, ...] | None = None, embeddings: bool = False,
          attention_mask: bool = False, cross_tokens: int = 0) -> TTModelProgram:
    """The prefill program for a prompt of `prefill_len` tokens (padded to a multiple of 128) and
    the decode program for `batch` users, over paged caches of `block_size`-token blocks and
    page tables wide enough for `max_seq_len` positions.

    chunk_start: the prefill is a later chunk of a longer prompt (or follows a cached prefix) starting
    at this position; it attends to the earlier tokens through the cache
    (`chunked_scaled_dot_product_attention`) and fills through a "chunk_page_table".
    per_layer_page_tables: every layer reads its own "page_table.<i>" (hybrid KV-cache groups).
    cache_position_modulo: per layer, the ring size of a sliding layer's cache (None = full length).
    embeddings: the prefill reads input embeddings [1, 1, S, D] ("embeddings") instead of token ids.
    attention_mask: prefill attention reads additive masks ([1, 1, S, S], `attention_masks`) instead of the
    causal rule; not with chunk_start (the mask would have to cover the cached prefix too).
    cross_tokens: Mllama's cross-attention layers read this many image-feature tokens per user (padded to a multiple
    of 128; the prefill fills their K/V from "cross_states", decode reads them back); 0: the cross layers are
    skipped (a text-only request, as HF skips them without images).
    """
    from tt_backend import deepseek_lowering

    if deepseek_lowering.is_deepseek(cfg):  # mHC / MLA / Engram: its own lowering and caches
        if (chunk_start or per_layer_page_tables or cache_position_modulo or embeddings or attention_mask
                or cross_tokens):
            raise NotImplementedError("DeepSeek lowering: chunked / paged / multimodal prefill options are not "
                                      "supported yet")
        return deepseek_lowering.lower(cfg, prefill_len=prefill_len, batch=batch, max_seq_len=max_seq_len,
                                       block_size=block_size, policy=policy)
    check_config(cfg)
    check_decode_batch(batch)
    if block_size % TILE:
        raise TTConstraintError(f"block_size={block_size} is not a multiple of {TILE}")
    prec = get_policy(policy)
    if isinstance(prec, DecodersPrecision) and len(prec.layers) != cfg.num_layers:
        raise ValueError(f"policy {prec.name!r} has {len(prec.layers)} decoder entries for {cfg.num_layers} layers")
    S = padded_prefill_len(prefill_len)
    if chunk_start < 0 or chunk_start % block_size:
        raise TTConstraintError(f"chunk_start={chunk_start} must be a non-negative multiple of block_size={block_size}")
    if chunk_start + S > max_seq_len:
        raise TTConstraintError(f"prefill of {S} (padded) tokens from {chunk_start} exceeds max_seq_len={max_seq_len}")
    modulo = tuple(cache_position_modulo or ())
    if modulo:
        if len(modulo) != cfg.num_layers:
            raise ValueError(f"cache_position_modulo has {len(modulo)} entries for {cfg.num_layers} layers")
        for i, (m, spec) in enumerate(zip(modulo, cfg.layers)):
            if m is None:
                continue
            w = spec.attention.window
            if w is None or m < w or m % block_size:
                raise TTConstraintError(f"layer {i}: a ring of {m} tokens needs a sliding layer with window <= {m} "
                                        f"and a multiple of block_size={block_size} (window {w})")
        if chunk_start:
            raise NotImplementedError("chunked prefill into sliding rings is not supported (as in tt-metal)")
    if attention_mask and chunk_start:
        raise NotImplementedError("a masked prefill (Gemma3's bidirectional image blocks) runs whole prompts from "
                                  "position 0: chunked_scaled_dot_product_attention takes no attention mask")
    if cross_tokens:
        if not any(s.attention.kind == "cross" for s in cfg.layers):
            raise ValueError(f"cross_tokens={cross_tokens}: this {cfg.family} model has no cross-attention layers")
        if chunk_start:
            raise NotImplementedError("a prefill with image features runs the whole prompt from position 0 (the "
                                      "cross layers fill their K/V once)")
        cross_tokens = padded_prefill_len(cross_tokens)
    width = math.ceil(max_seq_len / block_size)
    opts = dict(per_layer_page_tables=per_layer_page_tables, modulo=modulo, cross_tokens=cross_tokens)
    return TTModelProgram(
        prefill=_program(cfg, prec, "prefill", S, max_seq_len, block_size, width, chunk_start, **opts,
                         embeddings=embeddings, attention_mask=attention_mask),
        decode=_program(cfg, prec, "decode", batch, max_seq_len, block_size, width, **opts),
        meta={"family": cfg.family, "policy": prec.name, "max_seq_len": max_seq_len, "block_size": block_size,
              "num_layers": cfg.num_layers, "kv_cache": {"shape": [None, cfg.num_kv_heads, block_size, cfg.head_dim],
                                                         "dtype": prec.kv_cache},
              "sliding_window": [s.attention.window for s in cfg.layers]},
    )


# ------------------------------------------------------------------ Mllama cross-attention layers
# A cross layer's keys and values come from the image features ("cross_states", the projected vision tower output the
# host computes in JAX), not from the text: the prefill projects them through the layer's own wk/wv + k_norm and fills
# the layer's paged cache through "cross_page_table" (tt-metal's compute_xattn_kv_cache); decode only reads them.
CROSS_INPUTS = {"prefill": ("cross_states", "cross_mask", "cross_mlp_keep", "cross_page_table"),
                "decode": ("cross_mask", "cross_attn_keep", "cross_mlp_keep", "cross_page_table")}


def _check_cross_layer(cfg: ModelConfig, where: str, spec: LayerSpec) -> None:
    a = spec.attention
    if a.rope is not None or a.window is not None or a.qk_norm not in (None, "rms") or a.qkv_bias or a.out_bias:
        raise NotImplementedError(f"{where}: a cross-attention layer with rope / window / {a.qk_norm!r} q-k norm / "
                                  f"biases is not Mllama's and is not lowered")
    if cfg.num_heads % 2:
        raise TTConstraintError(f"{where}: {cfg.num_heads} query heads: the cross layer splits them with tt-metal's "
                                f"nlp_create_qkv_heads(xq, xq, num_kv_heads=H / 2), which needs H even")


def _cross_inputs(b: Builder, rows: int, cross_tokens: int, block_size: int) -> list[str]:
    """The cross layers' host inputs. prefill (one user): its image features [1, 1, Sx, D], the additive mask
    [1, 1, S, Sx] (`cross_attention.masks`), HF's full_text_row_masked_out_mask as [1, 1, S, D] (a text row that
    sees no tile gets no MLP update) and the user's cross page table [1, Wx]; decode (B users): the mask
    [1, B, H, Sx] (the layout of q), a per-user keep [1, B, H, d] on the attention output (0 for a user without
    images: its cross layers add nothing), the MLP keep [1, 1, B, D] and the users' cross page tables [B, Wx].
    Masks and keeps are expanded on the host (tt-metal: "broadcast ops broken ... must broadcast on host")."""
    D, H, d = b.cfg.hidden_size, b.cfg.num_heads, b.cfg.head_dim
    users = 1 if b.mode == "prefill" else rows
    shapes = {"cross_states": (1, 1, cross_tokens, D), "cross_attn_keep": (1, rows, H, d),
              "cross_mask": (1, 1, rows, cross_tokens) if b.mode == "prefill" else (1, rows, H, cross_tokens),
              "cross_mlp_keep": (1, 1, rows, D)}
    names = CROSS_INPUTS[b.mode]
    out = [b.tensor(n, shapes[n], BF16, TILE_L, DRAM, "input") for n in names[:-1]]
    return out + [b.tensor(names[-1], (users, -(-cross_tokens // block_size)), I32, RM, DRAM, "input")]


def _cross_layer(b: Builder, i: int, spec: LayerSpec, x: str, rows: int) -> str:
    """MllamaCrossAttentionDecoderLayer (HF 5.24, specs/vision.md §3.4):
    x += tanh(g_attn) * wo(attn(q_norm(wq h), k_norm(wk s), wv s; mask)),  h = rms(x);
    x += tanh(g_mlp) * keep * mlp(rms(x)), keep = the row sees some tile. A row that sees no tile attends to every
    image key (its mask row is 0, HF's rule) and its attention output is kept; only the MLP branch is zeroed
    (Meta's reference and tt-metal also zero the attention branch: HF is the reference here). tanh(gate) is
    folded into the gate weights on the host (`cross_attention.layer_weights`)."""
    cfg, prec, mode = b.cfg, b.prec, b.mode
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    L, n = f"layers.{i}", f"l{i}"
    shape = (1, 1, rows, D)
    nw = lambda name: b.weight(f"{L}.{name}", (1, 1, 1, D), BF16, RM)  # noqa: E731
    h = _norm(b, x, nw("attn_norm"), spec.norm, shape, f"{n}.h", cfg.norm_eps)
    xq = _linear(b, h, b.weight(f"{L}.wq", (1, 1, D, H * d), prec.wqkv), f"{n}.xq", (1, 1, rows, H * d), prec.li_qkv)
    qn = b.weight(f"{L}.q_norm", (1, 1, 1, d), BF16, RM)
    kc, vc, pt = f"kv.{i}.k", f"kv.{i}.v", "cross_page_table"
    sdpa = {"is_causal": False, "attn_mask": Ref("cross_mask"), "scale": d**-0.5,
            "compute_kernel_config": compute_config(prec.sdpa)}
    if mode == "prefill":  # [1, H, S, d]; input_kv = xq only satisfies the op (its k/v outputs are unused)
        b.call("ttnn.experimental.nlp_create_qkv_heads", [xq, xq],
               {"num_heads": H, "num_kv_heads": H // 2, "transpose_k_heads": False, "memory_config": DRAM},
               (f"{n}.q", f"{n}.q_k", f"{n}.q_v"), ((1, H, rows, d), (1, H // 2, rows, d), (1, H // 2, rows, d)))
        q = _norm(b, f"{n}.q", qn, "rms", (1, H, rows, d), f"{n}.q.n", cfg.norm_eps)
        S = b.cross_tokens
        xkv = _linear(b, "cross_states", b.weight(f"{L}.wkv", (1, 1, D, 2 * K * d), prec.wqkv), f"{n}.xkv",
                      (1, 1, S, 2 * K * d), prec.li_qkv)
        b.call("ttnn.experimental.nlp_create_qkv_heads", [xkv, xkv],  # k, v of input_kv; 2K "q" heads unused
               {"num_heads": 2 * K, "num_kv_heads": K, "transpose_k_heads": False, "memory_config": DRAM},
               (f"{n}.kv_q", f"{n}.k", f"{n}.v"), ((1, 2 * K, S, d), (1, K, S, d), (1, K, S, d)))
        k = _norm(b, f"{n}.k", b.weight(f"{L}.k_norm", (1, 1, 1, d), BF16, RM), "rms", (1, K, S, d), f"{n}.k.n",
                  cfg.norm_eps)
        k8 = b.call("ttnn.typecast", [k], {"dtype": prec.kv_cache}, f"{n}.k8", (1, K, S, d), prec.kv_cache)
        v8 = b.call("ttnn.typecast", [f"{n}.v"], {"dtype": prec.kv_cache}, f"{n}.v8", (1, K, S, d), prec.kv_cache)
        for c, t in ((kc, k8), (vc, v8)):  # kept for decode: computed once per request
            b.call("ttnn.experimental.paged_fill_cache", [c, t, pt], {"batch_idx": 0}, (), ())
        o = b.call("ttnn.transformer.scaled_dot_product_attention", [q, k8, v8], sdpa, f"{n}.attn", (1, H, rows, d))
        o = b.call("ttnn.experimental.nlp_concat_heads", [o], {"memory_config": DRAM}, f"{n}.concat",
                   (1, 1, rows, H * d))
    else:  # [1, B, H, d], the decode layout of q (no K/V of its own: nothing is written)
        q = b.call("ttnn.reshape", [xq], {"shape": [1, rows, H, d]}, f"{n}.q", (1, rows, H, d))
        q = _norm(b, q, qn, "rms", (1, rows, H, d), f"{n}.q.n", cfg.norm_eps)
        o = b.call("ttnn.transformer.paged_scaled_dot_product_attention_decode", [q, kc, vc],
                   {"page_table_tensor": Ref(pt), **sdpa, "memory_config": L1_HEIGHT}, f"{n}.attn", (1, rows, H, d))
        o = b.call("ttnn.mul", [o, "cross_attn_keep"], {"memory_config": L1_HEIGHT}, f"{n}.attn_kept", (1, rows, H, d))
        o = b.call("ttnn.experimental.nlp_concat_heads_decode", [o], {"num_heads": H}, f"{n}.concat",
                   (1, 1, rows, H * d))
    mul = lambda p, q, out: b.call("ttnn.mul", [p, q], {"memory_config": b.mem}, out, shape)  # noqa: E731
    add = lambda p, q, out: b.call("ttnn.add", [p, q], {"memory_config": b.mem}, out, shape)  # noqa: E731
    att = _linear(b, o, b.weight(f"{L}.wo", (1, 1, H * d, D), prec.wo), f"{n}.attn_out", shape, prec.li_o)
    x = add(x, mul(att, b.weight(f"{L}.attn_gate", (1, 1, 1, D), BF16), f"{n}.att_g"), f"{n}.x_attn")
    y = _mlp(b, i, spec, _norm(b, x, nw("mlp_norm"), spec.norm, shape, f"{n}.h2", cfg.norm_eps), rows)
    y = mul(mul(y, "cross_mlp_keep", f"{n}.mlp_kept"), b.weight(f"{L}.mlp_gate", (1, 1, 1, D), BF16), f"{n}.mlp_g")
    return add(x, y, f"{n}.out")
