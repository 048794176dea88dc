"""DeepSeek V4 / V4.1 lowered to ttnn call lists (prefill), with the host tensors the program reads.

What a layer does (specs/deepseek_v4.md §3-§7, jaxmodels.layers.{mhc, mla, moe, engram}) and how it is lowered:
- mHC: the residual stream is held token-major, X [1, S, n, D], so that each token's n copies are the rows of one
  small matrix. mixes = rms(X) @ fn^T (ttnn.rms_norm without weight, ttnn.linear), sigmoid pre/post, and the
  Sinkhorn normalisation as ttnn ops (softmax, then sum/add/div pairs over the two axes, unrolled). collapse is a
  batched matmul pre [1, S, 1, n] @ X, expand comb^T @ X (transpose_a) + post (outer product) y.
- MLA: low-rank q (wq_a, q_norm, wq_b), one K=V latent head (wkv, kv_norm); interleaved RoPE on the last
  rope_dim channels as x * cos + (x @ P) * sin with full-width tables (cos 1, sin 0 on the other channels) and P a
  fixed pair-swap matrix, so no slicing is needed. Attention over [window keys | compressed entries | sink] is
  one softmax over a ttnn.concat of the score blocks; the window, visibility and selection rules are additive masks.
- compressor (kv sources): ttnn.linear projections, gated pooling of each group of r tokens as a softmax over
  the slot axis of a [1, S/r, r, c] view, kv norm, RoPE at the group's first position.
- indexer: per-head relu(q.k) weighted by weights_proj and summed over heads, masked to the visible entries,
  ttnn.topk + ttnn.scatter -> a 0/1 selection, which reuse layers read; V4.1 candidate blocks: block maxima
  (ttnn.max over a [.., blocks, block] view), the newest visible block forced in, ttnn.topk over blocks, expanded
  back to entries by a fixed 0/1 matmul; later indexers add -1e9 outside the candidates.
- MoE: sqrt(softplus) scores in fp32, top-k on scores + selection bias (or the hash table, V4's first layers,
  looked up with ttnn.embedding), weights renormalised and scaled. Experts run **sparse** as tt-metal's GPT-OSS
  experts do: rows in blocks of 32, a [1, blocks, 1, E] sparsity tensor (which experts each block needs), gate/up
  by ttnn.sparse_matmul(is_input_b_sparse) and down by ttnn.sparse_matmul(is_input_a_sparse); only the (block,
  expert) pairs in use are computed. The shared expert is a dense gated MLP.
- Engram: hash columns are computed on the host (int64 n-gram hashing, like tokenisation; they are a program
  input "engram.cols.<l>"), the table rows are gathered with ttnn.embedding, then wkv, the per-stream gate
  (rms-normed dot, signed sqrt, sigmoid) and the gated value added to every stream.

Masks that depend only on positions (window, visibility of compressed entries, the newest candidate block, the
rows of the compressor group a decode step closes) are host inputs, as Gemma3's prefill masks are in
`tt_backend.lowering`.

Caches (program "state" tensors, paged [blocks, 1, block_size, width], one block pool each; `kv_specs` lists them
for a generator): "kv.<i>.window" (every layer; token-indexed, full length with the window applied on the read
side, or a ring of `window_ring` tokens), "kv.<i>.cmp" and "kv.<i>.ikeys" (kv sources; entry-indexed: one row per
`ratio` tokens), "kv.<i>.cstate.a/.g" and V4's "kv.<i>.istate.a/.g" (the compressor's per-token projections and
gates, fp32, token-indexed). Token-indexed caches read "page_table" [users, max_seq/block], entry-indexed ones
"page_table.r<ratio>"; with per-cache tables each cache reads "page_table.<cache>" (a ring: ring/block columns).
Prefill fills them (paged_fill_cache); decode writes the token's rows (paged_update_cache; a compressed entry only
when its group completes, index -1 otherwise) and reads each user's blocks back through ttnn.embedding over its
page table. ttnn.embedding has no "-1: skip" rule, so every entry a decode reads must name a real block; the host
puts one where a user has none (the rows are masked).
"""
from __future__ import annotations

import dataclasses

from jaxmodels.config import ModelConfig
from tt_backend.builder import (BF16, BFP8, DRAM, F32, I32, MASKED, RM, TILE, TILE_L, U16, U32, Builder,
                                TTConstraintError, check_decode_batch, check_program, compute_config,
                                padded_prefill_len)
from tt_backend.program import Ref, TTModelProgram, TTProgram
from tt_backend.weights import HIFI2, HIFI4, Precision, policy as get_policy

BIG = -MASKED  # 1e9: what an additive mask subtracts; also lifts the newest candidate block above any score
SPARSE_BLOCK = 32  # rows per sparsity block of ttnn.sparse_matmul (one tile of rows)


def is_deepseek(cfg: ModelConfig) -> bool:
    return cfg.mhc is not None or any(s.attention.kind == "mla" for s in cfg.layers)


def check(cfg: ModelConfig, S: int) -> None:
    """What this lowering (or TT) cannot do for a DeepSeek config, before any call is emitted."""
    if cfg.mhc is None or any(s.attention.kind != "mla" for s in cfg.layers):
        raise NotImplementedError("DeepSeek lowering needs mHC and MLA on every layer (as V4 / V4.1 have)")
    if cfg.numerics != "plain":
        raise NotImplementedError(f"DeepSeek numerics {cfg.numerics!r} (the reference's simulated FP8/FP4 QDQ) "
                                  f"is not lowered; TT stores its own bf16/bfp formats")
    if cfg.hidden_size % TILE or cfg.head_dim % TILE:
        raise TTConstraintError(f"hidden_size={cfg.hidden_size} and head_dim={cfg.head_dim} must be multiples of "
                                f"{TILE}")
    for i, s in enumerate(cfg.layers):
        m, p = s.attention.mla, s.mlp
        if p.kind != "moe" or p.activation != "silu_limit":
            raise NotImplementedError(f"layer {i}: DeepSeek lowering expects silu_limit MoE layers, got {p}")
        if m.ratio and S % m.ratio:
            raise TTConstraintError(f"layer {i}: prefill of {S} rows is not a whole number of ratio-{m.ratio} groups")
        if m.candidate_source and (S // m.ratio) % m.candidate_block_size:
            raise TTConstraintError(f"layer {i}: {S // m.ratio} entries are not whole candidate blocks of "
                                    f"{m.candidate_block_size}")


# ------------------------------------------------------------------------------------------------- builder
class _DS:
    """Emits one DeepSeek prefill program (rows S) into a `builder.Builder`."""

    def __init__(self, cfg: ModelConfig, prec: Precision, S: int, max_seq_len: int, mode: str = "prefill",
                 block_size: int = 32, per_cache_tables: bool = False, window_ring: int | None = None):
        # S: the rows of the program (prefill: the padded prompt of one user; decode: one token of each of S users)
        self.cfg, self.prec, self.S, self.max_seq_len, self.mode, self.bs = cfg, prec, S, max_seq_len, mode, block_size
        self.per_cache, self.ring = per_cache_tables, window_ring
        self.decode = mode == "decode"
        self.users = S if self.decode else 1
        self.b = Builder(cfg, prec, "prefill")  # DRAM activations in both modes (no sharded decode layouts yet)
        self.inputs: list[str] = []
        self.state: dict[str, str] = {}  # what kv/index sources publish for later layers (tensor names)

    # -- paged caches: token-indexed ("page_table") or entry-indexed per ratio ("page_table.r<r>"), or one table per
    # cache ("page_table.<cache>": hybrid KV groups, each cache kind its own blocks)
    def ring_of(self, cache) -> int | None:
        """The ring (cache_position_modulo) of a window cache, None for full-length caches."""
        return self.ring if cache.endswith(".window") else None

    def table(self, cache, r: int = 1) -> str:
        name = f"page_table.{cache}" if self.per_cache else "page_table" if r == 1 else f"page_table.r{r}"
        ring = self.ring_of(cache)
        width = ring // self.bs if ring else -(-(self.max_seq_len // r) // self.bs)
        return mask_input(self, name, (self.users, width), I32, RM)

    def ring_kw(self, cache) -> dict:
        return {"cache_position_modulo": self.ring_of(cache)} if self.ring_of(cache) else {}

    def cache(self, name, width, dtype=None):
        if name not in self.b.tensors:
            self.b.tensor(name, (None, 1, self.bs, width), dtype or self.prec.kv_cache, TILE_L, DRAM, "state")
        return name

    def fill(self, cache, x, r=1):
        """Prefill: rows x [1,1,n,w] into the cache through the user's page-table row (raw tile copy: the cache's
        dtype first)."""
        spec = self.b.tensors[cache]
        shape = self.b.tensors[x].shape
        if shape[2] % TILE:  # fill copies whole tiles: pad a short run of entries (ratio 128: one per prompt)
            rows = -(-shape[2] // TILE) * TILE
            x = self.op("ttnn.pad", [x], {"padding": [[0, 0], [0, 0], [0, rows - shape[2]], [0, 0]], "value": 0.0},
                        x + ".pad", (*shape[:2], rows, shape[3]), self.b.tensors[x].dtype)
        if self.b.tensors[x].dtype != spec.dtype:
            x = self.op("ttnn.typecast", [x], {"dtype": spec.dtype}, x + ".tc", self.b.tensors[x].shape, spec.dtype)
        kw = self.ring_kw(cache)
        if kw:  # a ring keeps the last `ring` tokens: stop at the real length, not the padded one
            kw["valid_seq_len_tensor"] = Ref(mask_input(self, "valid_seq_len", (1,), I32, RM))
        self.b.call("ttnn.experimental.paged_fill_cache", [cache, x, self.table(cache, r)], {"batch_idx": 0, **kw},
                    (), ())

    def update(self, cache, x, idx, r=1):
        """Decode: one row per user x [1,1,B,w] written at idx [B] (-1 skips the user)."""
        B, w = self.S, self.b.tensors[x].shape[-1]
        row = self.reshape(x, (1, B, 1, w), x + ".row", self.b.tensors[x].dtype if self.b.tensors[x].dtype == F32 else BF16)
        self.b.call("ttnn.experimental.paged_update_cache", [cache, row],
                    {"update_idxs_tensor": Ref(idx), "page_table": Ref(self.table(cache, r)), **self.ring_kw(cache)},
                    (), ())

    def gather(self, cache, r, out):
        """Decode: every user's cached rows as [B, 1, L, w] (ttnn.embedding over the page table reads whole
        blocks); what a query may see is decided by masks."""
        B, w, bs = self.S, self.b.tensors[cache].shape[-1], self.bs
        tab = self.table(cache, r)
        Wp = self.b.tensors[tab].shape[1]
        flat = self.op("ttnn.reshape", [cache], {"shape": [-1, bs * w]}, out + ".flat", (None, bs * w),
                       self.b.tensors[cache].dtype)
        rm = F32 if self.b.tensors[cache].dtype == F32 else BF16  # bfp formats exist only in tiles
        flat = self.b.call("ttnn.to_layout", [flat], {"layout": RM, "dtype": rm}, out + ".rm", (None, bs * w), rm, RM)
        rows = self.op("ttnn.embedding", [tab, flat], {"layout": TILE_L, "dtype": F32}, out + ".rows",
                       (B, Wp, bs * w), F32)
        return self.reshape(rows, (B, 1, Wp * bs, w), out, F32)

    # -- small emitters
    def op(self, op, inputs, kwargs, out, shape, dtype=BF16):
        return self.b.call(op, list(inputs), kwargs, out, shape, dtype)

    def w(self, name, shape, dtype=BF16, layout=TILE_L):
        return self.b.weight(name, shape, dtype, layout)

    def inp(self, name, shape, dtype, layout=TILE_L):
        self.inputs.append(self.b.tensor(name, shape, dtype, layout, DRAM, "input"))
        return name

    def linear(self, x, w, out, shape, cfg_op=None, dtype=BF16):
        cc = compute_config(cfg_op or self.prec.li_qkv)
        return self.op("ttnn.linear", [x, w], {"dtype": dtype, "compute_kernel_config": cc}, out, shape, dtype)

    def matmul(self, a, b_, out, shape, dtype=BF16, cfg_op=None, **kw):
        cc = compute_config(cfg_op or self.prec.sdpa)
        return self.op("ttnn.matmul", [a, b_], {**kw, "dtype": dtype, "compute_kernel_config": cc}, out, shape, dtype)

    def rms(self, x, w, out, shape, dtype=BF16):
        kw = {"epsilon": self.cfg.norm_eps, "compute_kernel_config": compute_config(self.prec.norm)}
        if w is not None:
            kw["weight"] = Ref(w)
        return self.op("ttnn.rms_norm", [x], kw, out, shape, dtype)

    def reshape(self, x, shape, out, dtype=BF16):
        return self.op("ttnn.reshape", [x], {"shape": list(shape)}, out, tuple(shape), dtype)

    def permute(self, x, dims, out, shape, dtype=BF16):
        return self.op("ttnn.permute", [x], {"dims": list(dims)}, out, shape, dtype)

    def scal(self, name, x, v, out, shape, dtype=BF16):  # ttnn.mul / ttnn.add with a scalar
        return self.op(name, [x], {"input_tensor_b": float(v)}, out, shape, dtype)

    def bin(self, name, a, b_, out, shape, dtype=BF16):
        return self.op(name, [a, b_], {}, out, shape, dtype)

    def unary(self, name, x, out, shape, dtype=BF16, **kw):
        return self.op(name, [x], kw, out, shape, dtype)

    def slice(self, x, starts, ends, out, dtype=BF16):
        return self.op("ttnn.slice", [x], {"starts": list(starts), "ends": list(ends)}, out,
                       tuple(e - s for s, e in zip(starts, ends)), dtype)

    # -- RoPE: x * cos + (x @ P) * sin over full-width tables
    def rope_rows(self, rope, width: int, pos_input: str, rows: int) -> tuple[str, str]:
        """cos/sin [1, 1, rows, width] for the positions in `pos_input` (cached per table and positions)."""
        key = f"{rope_key(rope)}.w{width}"
        cache = self.b.tensors
        pair = []
        for cs in ("cos", "sin"):
            out = f"rope.{key}.{pos_input}.{cs}"
            if out not in cache:
                tab = self.w(f"rope.{key}.{cs}", (self.max_seq_len, width), F32, RM)  # fp32 angles, as the reference
                e = self.op("ttnn.embedding", [pos_input, tab], {"layout": TILE_L, "dtype": F32}, out + ".rows",
                            (1, rows, width), F32)
                self.reshape(e, (1, 1, rows, width), out, F32)
            pair.append(out)
        return pair[0], pair[1]

    def rope(self, x, shape, rope, pos_input, rows, out, inverse=False):
        width = shape[-1]
        cos, sin = self.rope_rows(rope, width, pos_input, rows)
        swap = self.w(f"rope.swap.w{width}.r{self.cfg.layers[0].attention.mla.rope_dim}", (1, 1, width, width))
        xp = self.op("ttnn.matmul", [x, swap], {"dtype": BF16, "compute_kernel_config": compute_config(self.prec.rope)},
                     out + ".swap", shape)
        xc = self.bin("ttnn.mul", x, cos, out + ".cos", shape)
        xs = self.bin("ttnn.mul", xp, sin, out + ".sin", shape)
        return self.bin("ttnn.sub" if inverse else "ttnn.add", xc, xs, out, shape)

    # -- mHC
    def mixes(self, X, L, site, n):
        """(pre [1,1,S,n], post [1,1,S,n], comb [1,S,n,n]) of the streams X [1,S,n,D] (fp32)."""
        cfg, S, D = self.cfg, self.S, self.cfg.hidden_size
        eps, it = cfg.mhc.eps, cfg.mhc.sinkhorn_iters
        p, N = f"{L}.{site}", (2 + n) * n
        flat = self.reshape(X, (1, 1, S, n * D), f"{p}.flat")
        nx = self.rms(flat, None, f"{p}.rms", (1, 1, S, n * D), F32)  # one RMS over all n*D values
        m = self.linear(nx, self.w(f"{p}.fn", (1, 1, n * D, N), F32), f"{p}.m", (1, 1, S, N),
                        self.prec.router, F32)
        m = self.bin("ttnn.mul", m, self.w(f"{p}.scale", (1, 1, 1, N), F32), f"{p}.ms", (1, 1, S, N), F32)
        m = self.bin("ttnn.add", m, self.w(f"{p}.base", (1, 1, 1, N), F32), f"{p}.mb", (1, 1, S, N), F32)
        sn = (1, 1, S, n)
        pre = self.unary("ttnn.sigmoid", self.slice(m, (0, 0, 0, 0), (1, 1, S, n), f"{p}.pre_l", F32),
                         f"{p}.pre_s", sn, F32)
        pre = self.scal("ttnn.add", pre, eps, f"{p}.pre", sn, F32)
        post = self.unary("ttnn.sigmoid", self.slice(m, (0, 0, 0, n), (1, 1, S, 2 * n), f"{p}.post_l", F32),
                          f"{p}.post_s", sn, F32)
        post = self.scal("ttnn.mul", post, 2.0, f"{p}.post", sn, F32)
        c = self.slice(m, (0, 0, 0, 2 * n), (1, 1, S, N), f"{p}.c_l", F32)
        snn = (1, S, n, n)
        c = self.reshape(c, snn, f"{p}.c0", F32)
        c = self.op("ttnn.softmax", [c], {"dim": -1, "numeric_stable": True}, f"{p}.c_sm", snn, F32)
        c = self.scal("ttnn.add", c, eps, f"{p}.c_e", snn, F32)

        def normalise(c, dim, tag):
            shape = (1, S, 1, n) if dim == -2 else (1, S, n, 1)
            s = self.op("ttnn.sum", [c], {"dim": dim, "keepdim": True}, f"{p}.{tag}.sum", shape, F32)
            s = self.scal("ttnn.add", s, eps, f"{p}.{tag}.den", shape, F32)
            return self.bin("ttnn.div", c, s, f"{p}.{tag}", snn, F32)

        c = normalise(c, -2, "col0")
        for k in range(1, it):  # Sinkhorn: (row, column) normalisations, the last one a column
            c = normalise(c, -1, f"row{k}")
            c = normalise(c, -2, f"col{k}")
        return pre, post, c

    def collapse(self, X, pre, out, n):
        """sum_k pre_k X_k: [1,S,1,n] @ [1,S,n,D] -> [1,1,S,D]."""
        S, D = self.S, self.cfg.hidden_size
        p = self.reshape(pre, (1, S, 1, n), out + ".pre", F32)
        y = self.matmul(p, X, out + ".mm", (1, S, 1, D), cfg_op=HIFI4)  # fp32 mixing weights: HiFi4 keeps 11 bits
        return self.reshape(y, (1, 1, S, D), out)

    def expand(self, y, R, post, comb, out, n):
        """out_k = post_k y + sum_j comb[j, k] R_j -> [1,S,n,D]."""
        S, D = self.S, self.cfg.hidden_size
        mixed = self.matmul(comb, R, out + ".mix", (1, S, n, D), cfg_op=HIFI4, transpose_a=True)
        pc = self.reshape(post, (1, S, n, 1), out + ".post", F32)
        yr = self.reshape(y, (1, S, 1, D), out + ".y")
        py = self.matmul(pc, yr, out + ".py", (1, S, n, D), cfg_op=HIFI4)  # outer product (K = 1)
        return self.bin("ttnn.add", py, mixed, out, (1, S, n, D))

    # -- layer
    def layer(self, i, X, pre_in):
        cfg, spec, S, D = self.cfg, self.cfg.layers[i], self.S, self.cfg.hidden_size
        n, L = cfg.mhc.copies, f"layers.{i}"
        if spec.engram >= 0:
            X = self.engram(i, spec.engram, X)
        pA, qA, cA = self.mixes(X, L, "hc_attn", n)
        delayed = cfg.mhc.delayed
        if delayed and pre_in is None:  # the one-hot pre of the first layer: copy 0 of the (identical) streams
            h = self.reshape(self.slice(X, (0, 0, 0, 0), (1, S, 1, D), f"l{i}.x0"), (1, 1, S, D), f"l{i}.c_attn")
        else:
            h = self.collapse(X, pre_in if delayed else pA, f"l{i}.c_attn", n)
        h = self.rms(h, self.w(f"{L}.attn_norm", (1, 1, 1, D), BF16, RM), f"l{i}.h", (1, 1, S, D))
        X = self.expand(self.attention(i, h), X, qA, cA, f"l{i}.x_attn", n)
        pF, qF, cF = self.mixes(X, L, "hc_mlp", n)
        h = self.collapse(X, pA if delayed else pF, f"l{i}.c_mlp", n)
        # fp32: the router picks experts from it (DeepSeek routes in fp32; bf16 here flips near-tied choices)
        h = self.rms(h, self.w(f"{L}.mlp_norm", (1, 1, 1, D), BF16, RM), f"l{i}.h2", (1, 1, S, D), F32)
        X = self.expand(self.moe(i, h), X, qF, cF, f"l{i}.out", n)
        return X, pF

    # -- attention
    def rowshape(self, n):
        """Per-query masks over n keys: prefill [1, 1, S, n] (queries are rows), decode [B, 1, 1, n] (one per user)."""
        return (self.S, 1, 1, n) if self.decode else (1, 1, self.S, n)

    def attention(self, i, h):
        cfg, spec, S, D = self.cfg, self.cfg.layers[i], self.S, self.cfg.hidden_size
        a, m = spec.attention, spec.attention.mla
        H, d, L, nm = cfg.num_heads, cfg.head_dim, f"layers.{i}.attn", f"l{i}.a"
        prec = self.prec
        qa = self.linear(h, self.w(f"{L}.wq_a", (1, 1, D, m.q_lora_rank), prec.wqkv), f"{nm}.qa",
                         (1, 1, S, m.q_lora_rank))
        qr = self.rms(qa, self.w(f"{L}.q_norm", (1, 1, 1, m.q_lora_rank), BF16, RM), f"{nm}.qr",
                      (1, 1, S, m.q_lora_rank))
        q = self.linear(qr, self.w(f"{L}.wq_b", (1, 1, m.q_lora_rank, H * d), prec.wqkv), f"{nm}.qb", (1, 1, S, H * d))
        q = self.permute(self.reshape(q, (1, S, H, d), f"{nm}.q4"), (0, 2, 1, 3), f"{nm}.qh", (1, H, S, d))
        if m.variant == "v4":  # an unweighted per-head RMS after wq_b
            q = self.rms(q, None, f"{nm}.qn", (1, H, S, d))
        q = self.rope(q, (1, H, S, d), a.rope, "rope_pos", S, f"{nm}.q")
        kv = self.linear(h, self.w(f"{L}.wkv", (1, 1, D, d), prec.wqkv), f"{nm}.kv_l", (1, 1, S, d))
        kv = self.rms(kv, self.w(f"{L}.kv_norm", (1, 1, 1, d), BF16, RM), f"{nm}.kv_n", (1, 1, S, d))
        kv = self.rope(kv, (1, 1, S, d), a.rope, "rope_pos", S, f"{nm}.kv")
        win = self.cache(f"kv.{i}.window", d)
        if self.decode:  # the token's row into the window cache, then every user's cached rows
            self.update(win, kv, mask_input(self, "cur_pos", (S,), I32, RM))
            kv = self.gather(win, 1, f"{nm}.win")  # [B, 1, L, d]
            q = self.permute(q, (2, 1, 0, 3), f"{nm}.qd", (S, H, 1, d))  # one query row per user
        else:
            self.fill(win, kv)
        qs = self.b.tensors[q].shape[:3]
        scale = d ** -0.5
        nw = self.b.tensors[kv].shape[2]
        zw = self.matmul(q, kv, f"{nm}.zw_raw", (*qs, nw), F32, transpose_b=True)
        zw = self.scal("ttnn.mul", zw, scale, f"{nm}.zw_s", (*qs, nw), F32)
        ring = f".m{self.ring}" if self.decode and self.ring else ""  # decode reads ring slots, not positions
        wmask = mask_input(self, f"mask.w{a.window}{ring}", self.rowshape(nw))
        zw = self.bin("ttnn.add", zw, wmask, f"{nm}.zw", (*qs, nw), F32)
        blocks, values = [zw], [kv]
        if m.ratio:
            r = m.ratio
            if m.compress:
                self.compressor(i, h)
            if m.select == "indexer":
                self.indexer(i, h, qr)
            kvc = self.state["kv"]
            N = self.b.tensors[kvc].shape[2]
            sel = mask_input(self, f"vis.r{r}", self.rowshape(N)) if m.select == "all" else self.state["topk"]
            add = self.scal("ttnn.add", sel, -1.0, f"{nm}.sel_m1", self.rowshape(N), F32)
            add = self.scal("ttnn.mul", add, BIG, f"{nm}.sel_add", self.rowshape(N), F32)
            zc = self.matmul(q, kvc, f"{nm}.zc_raw", (*qs, N), F32, transpose_b=True)
            zc = self.scal("ttnn.mul", zc, scale, f"{nm}.zc_s", (*qs, N), F32)
            blocks.append(self.bin("ttnn.add", zc, add, f"{nm}.zc", (*qs, N), F32))
            values.append(kvc)
        reps = [S, 1, 1, 1] if self.decode else [1, 1, S, 1]
        sink = self.op("ttnn.repeat", [self.w(f"{L}.sinks", (1, H, 1, 1), F32)], {"repeat_dims": reps},
                       f"{nm}.sinkcol", (*qs, 1), F32)
        width = sum(self.b.tensors[z].shape[-1] for z in blocks)
        z = self.op("ttnn.concat", [], {"tensors": [Ref(x) for x in blocks + [sink]], "dim": -1}, f"{nm}.z",
                    (*qs, width + 1), F32)
        pr = self.op("ttnn.softmax", [z], {"dim": -1, "numeric_stable": True,
                                           "compute_kernel_config": compute_config(prec.sdpa)}, f"{nm}.p", (*qs, width + 1))
        pr = self.slice(pr, (0, 0, 0, 0), (*qs, width), f"{nm}.pv")
        vb = self.b.tensors[values[0]].shape[0]
        v = values[0] if len(values) == 1 else self.op("ttnn.concat", [], {"tensors": [Ref(x) for x in values],
                                                                            "dim": 2}, f"{nm}.v", (vb, 1, width, d))
        o = self.matmul(pr, v, f"{nm}.o", (*qs, d))
        if self.decode:
            o = self.permute(o, (2, 1, 0, 3), f"{nm}.o_u", (1, H, S, d))
        o = self.rope(o, (1, H, S, d), a.rope, "rope_pos", S, f"{nm}.o_r", inverse=True)
        # grouped low-rank output: group g = heads g*H/G .. (g+1)*H/G - 1
        G, Ro = m.o_groups, m.o_lora_rank
        gi = H * d // G
        o = self.permute(o, (0, 2, 1, 3), f"{nm}.o_t", (1, S, H, d))
        o = self.permute(self.reshape(o, (1, S, G, gi), f"{nm}.o_g"), (0, 2, 1, 3), f"{nm}.o_gt", (1, G, S, gi))
        u = self.matmul(o, self.w(f"{L}.wo_a", (1, G, gi, Ro), prec.wo), f"{nm}.u", (1, G, S, Ro))
        u = self.reshape(self.permute(u, (0, 2, 1, 3), f"{nm}.u_t", (1, S, G, Ro)), (1, 1, S, G * Ro), f"{nm}.u_f")
        return self.linear(u, self.w(f"{L}.wo_b", (1, 1, G * Ro, D), prec.wo), f"{nm}.out", (1, 1, S, D), prec.li_o)

    def compress(self, h, L, nm, r, c, overlap, ape, rope, state):
        """A compressor: (latent, entries = RoPE(latent) at the group's first position), [1, 1, n, c].

        Projections a = x wkv, gate = x wgate (+ V4's in-group position bias ape[pos % r]); each group of r tokens
        is pooled by a per-channel softmax over its slots. V4.1 ratio 1 has no gate (one slot: weight 1). With
        overlap (V4 CSA; projections 2c wide) entry j pools the previous group's first half of the channels and
        its own group's second half (2r slots); group 0 has no previous group (gate -1e9: weight 0).
        Prefill: n = S/r entries, the projections kept in the state caches `state` (+ ".a" / ".g") for decode.
        Decode: the token's projections go into the state caches and the group ending at it is pooled from them
        (masks select its rows: n = B, one entry per user, written by the caller only where a group completes)."""
        S, D = self.S, self.cfg.hidden_size
        width = 2 * c if overlap else c
        a = self.linear(h, self.w(f"{L}.wkv", (1, 1, D, width), F32), f"{nm}.a", (1, 1, S, width), self.prec.router,
                        F32)
        if r == 1 and not ape:
            pooled = a
        elif self.decode:
            g = self.linear(h, self.w(f"{L}.wgate", (1, 1, D, width), F32), f"{nm}.g", (1, 1, S, width),
                            self.prec.router, F32)
            if ape:
                # the bias of each token's slot in its group: one-hot(pos % r) [1,1,B,r] @ ape [1,1,r,width]
                onehot = mask_input(self, f"posmod.r{r}", (1, 1, S, r))
                e = self.matmul(onehot, self.w(f"{L}.ape", (1, 1, r, width), F32), f"{nm}.ape", (1, 1, S, width), F32,
                                cfg_op=HIFI4)
                g = self.bin("ttnn.add", g, e, f"{nm}.gp", (1, 1, S, width), F32)
            pos = mask_input(self, "cur_pos", (S,), I32, RM)
            ca, cg = self.cache(state + ".a", width, F32), self.cache(state + ".g", width, F32)
            self.update(ca, a, pos)
            self.update(cg, g, pos)
            A, G_ = self.gather(ca, 1, f"{nm}.A"), self.gather(cg, 1, f"{nm}.G")
            Lr = self.b.tensors[A].shape[2]
            own = mask_input(self, f"cown.r{r}", (S, 1, Lr, 1))  # 0 on the rows of the group ending here
            if overlap:
                prev = mask_input(self, f"cprev.r{r}", (S, 1, Lr, 1))  # 0 on the previous group's rows
                halves = lambda t, tag: [self.slice(t, (0, 0, 0, 0), (S, 1, Lr, c), f"{nm}.{tag}1", F32),  # noqa: E731
                                         self.slice(t, (0, 0, 0, c), (S, 1, Lr, width), f"{nm}.{tag}2", F32)]
                cat = lambda ts, out: self.op("ttnn.concat", [], {"tensors": [Ref(x) for x in ts], "dim": 2},  # noqa
                                              out, (S, 1, 2 * Lr, self.b.tensors[ts[0]].shape[-1]), F32)
                A = cat(halves(A, "A"), f"{nm}.Acat")
                G_ = cat(halves(G_, "G"), f"{nm}.Gcat")
                own = cat([prev, own], f"{nm}.maskcat")
            Ls = self.b.tensors[A].shape[2]
            G_ = self.bin("ttnn.add", G_, own, f"{nm}.Gm", (S, 1, Ls, c), F32)
            wv = self.op("ttnn.softmax", [G_], {"dim": 2, "numeric_stable": True}, f"{nm}.w", (S, 1, Ls, c), F32)
            pv = self.bin("ttnn.mul", A, wv, f"{nm}.aw", (S, 1, Ls, c), F32)
            pooled = self.reshape(self.op("ttnn.sum", [pv], {"dim": 2, "keepdim": True}, f"{nm}.sum", (S, 1, 1, c),
                                          F32), (1, 1, S, c), f"{nm}.pooled", F32)
        else:
            N = S // r
            g = self.linear(h, self.w(f"{L}.wgate", (1, 1, D, width), F32), f"{nm}.g", (1, 1, S, width),
                            self.prec.router, F32)
            a4 = self.reshape(a, (1, N, r, width), f"{nm}.a4", F32)
            g4 = self.reshape(g, (1, N, r, width), f"{nm}.g4", F32)
            if ape:
                g4 = self.bin("ttnn.add", g4, self.w(f"{L}.ape", (1, 1, r, width), F32), f"{nm}.g4p", (1, N, r, width),
                              F32)
            self.fill(self.cache(state + ".a", width, F32), a)
            self.fill(self.cache(state + ".g", width, F32), self.reshape(g4, (1, 1, S, width), f"{nm}.gfill", F32))
            slots = r
            if overlap:
                def halves(t, tag, fill):
                    first = self.slice(t, (0, 0, 0, 0), (1, N, r, c), f"{nm}.{tag}.first", F32)
                    own = self.slice(t, (0, 0, 0, c), (1, N, r, width), f"{nm}.{tag}.own", F32)
                    pad = self.scal("ttnn.mul", self.slice(first, (0, 0, 0, 0), (1, 1, r, c), f"{nm}.{tag}.g0", F32),
                                    0.0, f"{nm}.{tag}.zero", (1, 1, r, c), F32)
                    if fill:
                        pad = self.scal("ttnn.add", pad, fill, f"{nm}.{tag}.pad", (1, 1, r, c), F32)
                    parts = [pad]
                    if N > 1:
                        parts.append(self.slice(first, (0, 0, 0, 0), (1, N - 1, r, c), f"{nm}.{tag}.prev_src", F32))
                    prev = parts[0] if N == 1 else self.op("ttnn.concat", [], {"tensors": [Ref(x) for x in parts],
                                                                               "dim": 1}, f"{nm}.{tag}.prev",
                                                           (1, N, r, c), F32)
                    return self.op("ttnn.concat", [], {"tensors": [Ref(prev), Ref(own)], "dim": 2}, f"{nm}.{tag}.slots",
                                   (1, N, 2 * r, c), F32)

                a4, g4, slots = halves(a4, "a", 0.0), halves(g4, "g", -BIG), 2 * r
            wv = self.op("ttnn.softmax", [g4], {"dim": -2, "numeric_stable": True}, f"{nm}.w", (1, N, slots, c), F32)
            pv = self.bin("ttnn.mul", a4, wv, f"{nm}.aw", (1, N, slots, c), F32)
            pooled = self.reshape(self.op("ttnn.sum", [pv], {"dim": 2, "keepdim": True}, f"{nm}.sum", (1, N, 1, c),
                                          F32), (1, 1, N, c), f"{nm}.pooled", F32)
        n = self.b.tensors[pooled].shape[2]
        latent = self.rms(pooled, self.w(f"{L}.norm", (1, 1, 1, c), BF16, RM), f"{nm}.latent", (1, 1, n, c))
        pos = mask_input(self, f"rope_pos.r{r}", (1, n), U32, RM)
        return latent, self.rope(latent, (1, 1, n, c), rope, pos, n, f"{nm}.entries")

    def publish(self, cache, rows, r, out):
        """Compressed rows into their entry-indexed cache; returns what attention / the indexer read: the prompt's
        entries (prefill), or every user's cached entries after this step's writes (decode)."""
        if not self.decode:
            self.fill(cache, rows, r)
            return rows
        self.update(cache, rows, mask_input(self, f"cidx.r{r}", (self.S,), I32, RM), r)
        return self.gather(cache, r, out)

    def compressor(self, i, h):
        """kv source: this layer's compressed entries (and the latent its V4.1 indexer keys come from)."""
        m, a = self.cfg.layers[i].attention.mla, self.cfg.layers[i].attention
        d = self.cfg.head_dim
        latent, entries = self.compress(h, f"layers.{i}.attn.compressor", f"l{i}.cmp", m.ratio, d, m.overlap,
                                        m.variant == "v4", a.rope, f"kv.{i}.cstate")
        self.state["kv"] = self.publish(self.cache(f"kv.{i}.cmp", d), entries, m.ratio, f"l{i}.cmp.all")
        self.state["latent"] = latent

    def indexer(self, i, h, qr):
        cfg, m, S, D = self.cfg, self.cfg.layers[i].attention.mla, self.S, self.cfg.hidden_size
        rope = self.cfg.layers[i].attention.rope
        L, nm, r = f"layers.{i}.attn.indexer", f"l{i}.idx", m.ratio
        HI, dI = m.index_heads, m.index_head_dim
        if m.index_keys == "latent":  # keys from this layer's pre-RoPE latent
            lat = self.state["latent"]
            n = self.b.tensors[lat].shape[2]
            k = self.linear(lat, self.w(f"{L}.wk", (1, 1, cfg.head_dim, dI), BF16), f"{nm}.k_l", (1, 1, n, dI))
            k = self.rms(k, self.w(f"{L}.k_norm", (1, 1, 1, dI), BF16, RM), f"{nm}.k_n", (1, 1, n, dI))
            pos = mask_input(self, f"rope_pos.r{r}", (1, n), U32, RM)
            k = self.rope(k, (1, 1, n, dI), rope, pos, n, f"{nm}.k")
            self.state["index_k"] = self.publish(self.cache(f"kv.{i}.ikeys", dI), k, r, f"{nm}.k_all")
        elif m.index_keys == "compressor":  # V4: its own overlapped compressor at index_head_dim
            _, k = self.compress(h, f"{L}.compressor", f"{nm}.cmp", r, dI, True, True, rope, f"kv.{i}.istate")
            self.state["index_k"] = self.publish(self.cache(f"kv.{i}.ikeys", dI), k, r, f"{nm}.k_all")
        N = self.b.tensors[self.state["index_k"]].shape[2]
        qi = self.linear(qr, self.w(f"{L}.wq_b", (1, 1, m.q_lora_rank, HI * dI), self.prec.wqkv), f"{nm}.q_l",
                         (1, 1, S, HI * dI))
        qi = self.permute(self.reshape(qi, (1, S, HI, dI), f"{nm}.q4"), (0, 2, 1, 3), f"{nm}.qh", (1, HI, S, dI))
        qi = self.rope(qi, (1, HI, S, dI), rope, "rope_pos", S, f"{nm}.q")
        wts = self.linear(h, self.w(f"{L}.weights_proj", (1, 1, D, HI), BF16), f"{nm}.w_l", (1, 1, S, HI),
                          self.prec.router, F32)
        wts = self.scal("ttnn.mul", wts, dI ** -0.5 * HI ** -0.5, f"{nm}.w_s", (1, 1, S, HI), F32)
        if self.decode:  # per user: heads as the batch's second dim
            qi = self.permute(qi, (2, 1, 0, 3), f"{nm}.qd", (S, HI, 1, dI))
            wts = self.reshape(wts, (S, HI, 1, 1), f"{nm}.w", F32)
        else:
            wts = self.permute(wts, (0, 3, 2, 1), f"{nm}.w", (1, HI, S, 1), F32)
        qs = self.b.tensors[qi].shape[:3]
        s = self.matmul(qi, self.state["index_k"], f"{nm}.qk", (*qs, N), F32, transpose_b=True)
        s = self.unary("ttnn.relu", s, f"{nm}.relu", (*qs, N), F32)
        s = self.bin("ttnn.mul", s, wts, f"{nm}.sw", (*qs, N), F32)
        s = self.op("ttnn.sum", [s], {"dim": 1, "keepdim": True}, f"{nm}.s", self.rowshape(N), F32)
        vis = mask_input(self, f"vis.r{r}", self.rowshape(N))
        vis_add = mask_input(self, f"visadd.r{r}", self.rowshape(N))
        s = self.bin("ttnn.add", s, vis_add, f"{nm}.s_vis", self.rowshape(N), F32)
        if m.candidate_source:
            self.state["candidates"] = self.candidates(i, s, r, N, m.candidate_blocks, m.candidate_block_size)
        keep = vis
        if m.candidate_filter:
            cand = self.state["candidates"]
            add = self.scal("ttnn.mul", self.scal("ttnn.add", cand, -1.0, f"{nm}.c_m1", self.rowshape(N), F32), BIG,
                            f"{nm}.c_add", self.rowshape(N), F32)
            s = self.bin("ttnn.add", s, add, f"{nm}.s_cand", self.rowshape(N), F32)
            keep = self.bin("ttnn.mul", vis, cand, f"{nm}.keep", self.rowshape(N), F32)
        self.state["topk"] = self.top_mask(s, min(m.index_topk, N), keep, f"{nm}.sel", self.rowshape(N))

    def top_mask(self, s, k, keep, out, shape):
        """0/1 mask of the k largest entries per row, restricted to `keep` (picks outside it are dropped)."""
        sk = (*shape[:-1], k)
        self.op("ttnn.topk", [s], {"k": k, "dim": -1, "largest": True, "sorted": True}, (out + ".v", out + ".i"),
                (sk, sk), (F32, U16))
        zeros = self.scal("ttnn.mul", s, 0.0, out + ".zeros", shape, F32)
        ones = self.scal("ttnn.add", self.scal("ttnn.mul", out + ".v", 0.0, out + ".v0", sk, F32), 1.0,
                         out + ".ones", sk, F32)
        hit = self.op("ttnn.scatter", [zeros], {"dim": -1, "index": Ref(out + ".i"), "src": Ref(ones)}, out + ".hit",
                      shape, F32)
        return self.bin("ttnn.mul", hit, keep, out, shape, F32)

    def candidates(self, i, s, r, N, n_blocks, cb):
        """V4.1 candidate blocks over the visible-masked scores s (rowshape(N)) -> 0/1 entries (rowshape(N))."""
        S, nm = self.S, f"l{i}.cand"
        nb = N // cb
        lead = (S, 1) if self.decode else (1, S)
        sv = self.reshape(s, (*lead, nb, cb), f"{nm}.s4", F32)
        bm = self.op("ttnn.max", [sv], {"dim": -1, "keepdim": True}, f"{nm}.bmax", (*lead, nb, 1), F32)
        bm = self.reshape(bm, self.rowshape(nb), f"{nm}.bs", F32)
        newest = mask_input(self, f"newest.r{r}.b{cb}", self.rowshape(nb))  # BIG on the newest visible block
        bm = self.bin("ttnn.add", bm, newest, f"{nm}.bs_new", self.rowshape(nb), F32)
        bvis = mask_input(self, f"blockvis.r{r}.b{cb}", self.rowshape(nb))
        keep = self.top_mask(bm, min(n_blocks, nb), bvis, f"{nm}.keep", self.rowshape(nb))
        expand = self.w(f"cand.expand.{nb}x{cb}", (1, 1, nb, N), BF16)  # 0/1: block b covers entries b*cb..
        return self.matmul(keep, expand, f"{nm}.mask", self.rowshape(N), F32)

    # -- MoE
    def moe(self, i, h):
        cfg, spec, S, D = self.cfg, self.cfg.layers[i], self.S, self.cfg.hidden_size
        m, L, nm, prec = spec.mlp, f"layers.{i}.mlp", f"l{i}.moe", self.prec
        E, k, I = m.num_experts, m.top_k, m.intermediate_size
        se = (1, 1, S, E)
        logits = self.linear(h, self.w(f"{L}.router", (1, 1, D, E), F32), f"{nm}.logits", se, HIFI4, F32)
        if m.score_func != "sqrtsoftplus":
            raise NotImplementedError(f"layer {i}: score function {m.score_func!r} is not lowered")
        sc = self.unary("ttnn.softplus", logits, f"{nm}.sp", se, F32, beta=1.0, threshold=20.0)
        sc = self.unary("ttnn.sqrt", sc, f"{nm}.scores", se, F32)
        zeros = self.scal("ttnn.mul", sc, 0.0, f"{nm}.zeros", se, F32)
        if m.router == "hash":  # V4's first layers: experts looked up by token id
            ids = self.op("ttnn.embedding", ["tokens", self.w(f"{L}.tid2eid", (cfg.vocab_size, k), U32, RM)],
                          {"layout": RM, "dtype": U32}, f"{nm}.ids", (1, S, k), U32)
            ids = self.reshape(ids, (1, 1, S, k), f"{nm}.topi", U32)
        else:
            picks = sc
            if m.selection_bias:
                picks = self.bin("ttnn.add", sc, self.w(f"{L}.selection_bias", (1, 1, 1, E), F32), f"{nm}.picks", se,
                                 F32)
            self.op("ttnn.topk", [picks], {"k": k, "dim": -1, "largest": True, "sorted": True},
                    (f"{nm}.topv", f"{nm}.topi"), ((1, 1, S, k),) * 2, (F32, U16))
            ids = f"{nm}.topi"
        ones = self.scal("ttnn.add", self.scal("ttnn.mul", zeros, 0.0, f"{nm}.z2", se, F32), 1.0, f"{nm}.ones", se,
                         F32)
        ones_k = self.slice(ones, (0, 0, 0, 0), (1, 1, S, k), f"{nm}.ones_k", F32)
        chosen = self.op("ttnn.scatter", [zeros], {"dim": -1, "index": Ref(ids), "src": Ref(ones_k)},
                         f"{nm}.chosen", se, F32)
        wd = self.bin("ttnn.mul", sc, chosen, f"{nm}.w_raw", se, F32)  # unbiased scores of the chosen experts
        if m.renormalize:
            tot = self.op("ttnn.sum", [wd], {"dim": -1, "keepdim": True}, f"{nm}.tot", (1, 1, S, 1), F32)
            tot = self.scal("ttnn.add", tot, 1e-20, f"{nm}.tot_e", (1, 1, S, 1), F32)
            wd = self.bin("ttnn.div", wd, tot, f"{nm}.w_n", se, F32)
        if m.route_scale != 1.0:
            wd = self.scal("ttnn.mul", wd, m.route_scale, f"{nm}.w", se, F32)
        y = self.sparse_experts(i, h, chosen, wd)
        if m.shared_intermediate_size:
            y = self.bin("ttnn.add", y, self.shared(i, h), f"{nm}.out", (1, 1, S, D))
        return y

    def act(self, g, u, out, shape, limit):
        """DeepSeek's silu_limit: silu(min(g, l)) * clip(u, -l, l)."""
        g = self.op("ttnn.clamp", [g], {"max": limit}, out + ".gc", shape)
        u = self.op("ttnn.clamp", [u], {"min": -limit, "max": limit}, out + ".uc", shape)
        return self.op("ttnn.mul", [g, u], {"input_tensor_a_activations": ["ttnn.UnaryOpType.SILU"], "dtype": BF16},
                       out, shape)

    def sparse_experts(self, i, h, chosen, wd):
        """Routed experts through ttnn.sparse_matmul: rows in blocks of 32, only (block, expert) pairs in use."""
        cfg, m, S, D = self.cfg, self.cfg.layers[i].mlp, self.S, self.cfg.hidden_size
        E, I, L, nm, prec = m.num_experts, m.intermediate_size, f"layers.{i}.mlp", f"l{i}.ex", self.prec
        blk = min(SPARSE_BLOCK, S)  # decode: the users' rows are one block
        nb = S // blk
        cv = self.reshape(chosen, (1, nb, blk, E), f"{nm}.c4", F32)
        sparsity = self.op("ttnn.max", [cv], {"dim": 2, "keepdim": True}, f"{nm}.sparsity", (1, nb, 1, E), BF16)
        sp_rm = self.op("ttnn.to_layout", [sparsity], {"layout": RM}, f"{nm}.sparsity_rm", (1, nb, 1, E), BF16)
        xs = self.reshape(h, (1, nb, blk, D), f"{nm}.x")
        grid = {"type": "ttnn.CoreCoord", "arg0": 8, "arg1": 8}  # CoreCoord(x, y): positional only in the wheel
        pc = lambda n_out: {"type": "ttnn.MatmulMultiCoreReuseMultiCast1DProgramConfig",  # noqa: E731
                            "compute_with_storage_grid_size": grid, "in0_block_w": 1, "out_subblock_h": 1, "out_subblock_w": 1, "per_core_M": 1,
                            "per_core_N": -(-n_out // TILE), "fuse_batch": False, "mcast_in0": True}
        six = (1, nb, 1, E, blk, I)

        def up(name):
            return self.op("ttnn.sparse_matmul", [xs, self.w(f"{L}.{name}", (1, E, D, I), prec.ff1_3)],
                           {"sparsity": Ref(sp_rm), "is_input_a_sparse": False, "is_input_b_sparse": True,
                            "program_config": pc(I), "dtype": BF16, "compute_kernel_config": compute_config(prec.li_ff1_3)},
                           f"{nm}.{name}", six)

        g, u = up("w_gate"), up("w_up")
        a = self.act(g, u, f"{nm}.act", six, m.clamp_limit)
        a = self.reshape(a, (nb, E, blk, I), f"{nm}.act4")
        sp_a = self.reshape(sp_rm, (1, 1, nb, E), f"{nm}.sparsity_a", BF16)
        y = self.op("ttnn.sparse_matmul", [a, self.w(f"{L}.w_down", (1, E, I, D), prec.ff2)],
                    {"sparsity": Ref(sp_a), "is_input_a_sparse": True, "is_input_b_sparse": False,
                     "program_config": pc(D), "dtype": BF16, "compute_kernel_config": compute_config(prec.li_ff2)},
                    f"{nm}.down", (nb, E, blk, D))
        # routing weights [1,1,S,E] -> [nb, E, blk, 1]; unchosen experts weigh 0 (and were not computed)
        wv = self.permute(self.reshape(wd, (nb, blk, E, 1), f"{nm}.w4", F32), (0, 2, 1, 3), f"{nm}.wt",
                          (nb, E, blk, 1), F32)
        y = self.bin("ttnn.mul", y, wv, f"{nm}.yw", (nb, E, blk, D))
        y = self.op("ttnn.sum", [y], {"dim": 1, "keepdim": True}, f"{nm}.ysum", (nb, 1, blk, D))
        return self.reshape(y, (1, 1, S, D), f"{nm}.y")

    def shared(self, i, h):
        m, S, D, L, nm, prec = (self.cfg.layers[i].mlp, self.S, self.cfg.hidden_size, f"layers.{i}.mlp.shared",
                                f"l{i}.sh", self.prec)
        I = m.shared_intermediate_size
        g = self.linear(h, self.w(f"{L}.w_gate", (1, 1, D, I), prec.ff1_3), f"{nm}.g", (1, 1, self.S, I), prec.li_ff1_3)
        u = self.linear(h, self.w(f"{L}.w_up", (1, 1, D, I), prec.ff1_3), f"{nm}.u", (1, 1, S, I), prec.li_ff1_3)
        a = self.act(g, u, f"{nm}.act", (1, 1, S, I), m.clamp_limit)
        return self.linear(a, self.w(f"{L}.w_down", (1, 1, I, D), prec.ff2), f"{nm}.y", (1, 1, S, D), prec.li_ff2)

    # -- Engram
    def engram(self, i, e, X):
        cfg, S, D, n = self.cfg, self.S, self.cfg.hidden_size, self.cfg.mhc.copies
        g = cfg.engram
        C, Hd, L, nm = (g.max_ngram - 1) * g.n_heads, g.head_dim, f"layers.{i}.engram", f"l{i}.eg"
        cols = mask_input(self, f"engram.cols.{e}", (1, S * C), U32, RM)
        rows = self.op("ttnn.embedding", [cols, self.w(f"{L}.table", (g.rows[e], Hd), BF16, RM)],
                       {"layout": TILE_L, "dtype": BF16}, f"{nm}.rows", (1, S * C, Hd))
        emb = self.reshape(rows, (1, 1, S, C * Hd), f"{nm}.emb")
        kv = self.linear(emb, self.w(f"{L}.wkv", (1, 1, C * Hd, (n + 1) * D), self.prec.wqkv), f"{nm}.kv",
                         (1, 1, S, (n + 1) * D))
        key = self.reshape(self.slice(kv, (0, 0, 0, 0), (1, 1, S, n * D), f"{nm}.key_f"), (1, S, n, D), f"{nm}.key")
        val = self.reshape(self.slice(kv, (0, 0, 0, n * D), (1, 1, S, (n + 1) * D), f"{nm}.val_f"), (1, S, 1, D),
                           f"{nm}.val")
        snd = (1, S, n, D)
        hn = self.rms(X, None, f"{nm}.hn", snd, F32)
        kn = self.rms(key, None, f"{nm}.kn", snd, F32)
        dot = self.bin("ttnn.mul", hn, self.w(f"{L}.qk", (1, 1, n, D), F32), f"{nm}.hw", snd, F32)
        dot = self.bin("ttnn.mul", dot, kn, f"{nm}.hwk", snd, F32)
        s1 = (1, S, n, 1)
        dot = self.op("ttnn.sum", [dot], {"dim": -1, "keepdim": True}, f"{nm}.dsum", s1, F32)
        dot = self.scal("ttnn.mul", dot, D ** -0.5, f"{nm}.dot", s1, F32)
        mag = self.unary("ttnn.abs", dot, f"{nm}.abs", s1, F32)
        mag = self.op("ttnn.clamp", [mag], {"min": 1e-6}, f"{nm}.absc", s1, F32)
        mag = self.unary("ttnn.sqrt", mag, f"{nm}.sqrt", s1, F32)
        sgn = self.unary("ttnn.sign", dot, f"{nm}.sign", s1, F32)  # sign(0) = 0 where the reference has +-1e-3
        gate = self.unary("ttnn.sigmoid", self.bin("ttnn.mul", mag, sgn, f"{nm}.ssqrt", s1, F32), f"{nm}.gate", s1,
                          F32)
        gv = self.matmul(gate, val, f"{nm}.gv", snd)  # outer product (K = 1): gate_k * value
        return self.bin("ttnn.add", X, gv, f"{nm}.out", snd)

    # -- whole program
    def program(self) -> TTProgram:
        cfg, S, D, V = self.cfg, self.S, self.cfg.hidden_size, self.cfg.vocab_size
        n = cfg.mhc.copies
        self.inp("tokens", (1, S), U32, RM)
        self.inp("rope_pos", (1, S), U32, RM)
        emb = self.w("embed", (V, D), BF16, RM)
        x = self.op("ttnn.embedding", ["tokens", emb], {"layout": TILE_L, "dtype": BF16}, "embed.rows", (1, S, D))
        x = self.reshape(x, (1, S, 1, D), "x0")
        X = self.op("ttnn.repeat", [x], {"repeat_dims": [1, 1, n, 1]}, "X0", (1, S, n, D))
        pre = None
        for i in range(cfg.num_layers):
            X, pre = self.layer(i, X, pre)
        if cfg.mhc.delayed:
            pre_out = pre
        else:  # V4: a learned collapse of the output
            flat = self.reshape(X, (1, 1, S, n * D), "head.flat")
            nx = self.rms(flat, None, "head.rms", (1, 1, S, n * D), F32)
            hm = self.linear(nx, self.w("hc_head.fn", (1, 1, n * D, n), F32), "head.m", (1, 1, S, n), self.prec.router,
                             F32)
            hm = self.bin("ttnn.mul", hm, self.w("hc_head.scale", (1, 1, 1, n), F32), "head.ms", (1, 1, S, n), F32)
            hm = self.bin("ttnn.add", hm, self.w("hc_head.base", (1, 1, 1, n), F32), "head.mb", (1, 1, S, n), F32)
            pre_out = self.scal("ttnn.add", self.unary("ttnn.sigmoid", hm, "head.sig", (1, 1, S, n), F32),
                                cfg.mhc.eps, "head.pre", (1, 1, S, n), F32)
        x = self.collapse(X, pre_out, "final.x", n)
        h = self.rms(x, self.w("final_norm", (1, 1, 1, D), BF16, RM), "final.h", (1, 1, S, D))
        out = self.linear(h, self.w("lm_head", (1, 1, D, V), self.prec.lm_head), "logits", (1, 1, S, V),
                          self.prec.lm_head_op)
        prog = TTProgram(self.mode, self.b.calls, self.b.tensors, tuple(self.inputs), (out,),
                         {"rows": S, "family": cfg.family, "block_size": self.bs,
                          "layer_outputs": [f"l{i}.out" for i in range(cfg.num_layers)]})
        check_program(prog)
        return prog


def mask_input(ds: _DS, name, shape, dtype=F32, layout=TILE_L):
    """A host input (position-derived masks and indices), declared once."""
    if name not in ds.b.tensors:
        ds.inp(name, shape, dtype, layout)
    return name


def rope_key(rope) -> str:
    return f"t{rope.theta:g}.{rope.kind}.f{rope.factor:g}"


# ------------------------------------------------------------------------------------------------- lowering
def lower(cfg: ModelConfig, *, prefill_len: int = 128, batch: int = 32, max_seq_len: int = 8192, block_size: int = 32,
          policy="performance", per_cache_page_tables: bool = False, window_ring: int | None = None) -> TTModelProgram:
    """DeepSeek's prefill program for one prompt of `prefill_len` tokens (padded to 128) and decode program for
    `batch` users, over paged caches of `block_size` rows (`kv_specs`; the programs' "state" tensors).

    per_cache_page_tables: every cache reads its own "page_table.<cache>" (hybrid KV groups: each kind, each layer
    its own blocks) instead of one table per index space. window_ring: the window caches are rings of that many
    tokens (cache_position_modulo; the prefill fill stops at "valid_seq_len"); needs per-cache tables."""
    prec = get_policy(policy)
    if policy == "performance":
        # measured on the tiny V4.1 (per-layer PCC vs exact): bfp4/LoFi experts 0.95; bfp8 experts 0.986, the rest
        # lost to near-tied expert and indexer choices flipping after bfp8 q/kv projections; bf16 projections into
        # the latent attention, indexer and Engram (wqkv) with bfp8 experts and wo: 0.994. The named policy
        # becomes that (issue #16: bfp8 where bfp4 breaks the layer)
        prec = dataclasses.replace(prec, name="performance-deepseek", ff1_3=BFP8, li_ff1_3=HIFI2, li_ff2=HIFI2,
                                   wqkv=BF16)
    if not isinstance(prec, Precision):
        raise NotImplementedError("per-layer DecodersPrecision is not applied to DeepSeek layers yet")
    S = padded_prefill_len(prefill_len)
    check(cfg, S)
    if S > max_seq_len:
        raise TTConstraintError(f"prefill of {S} (padded) tokens exceeds max_seq_len={max_seq_len}")
    check_decode_batch(batch)
    if block_size % TILE:
        raise TTConstraintError(f"block_size={block_size} is not a multiple of {TILE}")
    if window_ring is not None:
        windows = {s.attention.window for s in cfg.layers}
        if not per_cache_page_tables:
            raise NotImplementedError("a window ring is addressed by its own page table: pass per_cache_page_tables")
        if window_ring % block_size or window_ring < max(windows):
            raise TTConstraintError(f"window_ring={window_ring} must be a multiple of block_size={block_size} and "
                                    f"hold the window ({max(windows)})")
    opts = dict(block_size=block_size, per_cache_tables=per_cache_page_tables, window_ring=window_ring)
    prefill = _DS(cfg, prec, S, max_seq_len, "prefill", **opts).program()
    decode = _DS(cfg, prec, batch, max_seq_len, "decode", **opts).program()
    return TTModelProgram(prefill=prefill, decode=decode,
                          meta={"family": cfg.family, "policy": prec.name, "max_seq_len": max_seq_len,
                                "block_size": block_size, "num_layers": cfg.num_layers, "window_ring": window_ring,
                                "kv_cache_specs": kv_specs(cfg, block_size, prec)})


def kv_specs(cfg: ModelConfig, block_size: int, prec: Precision) -> list[dict]:
    """The hybrid caches DeepSeek's programs read, one dict per cache: `cache` (the program's state tensor),
    `kind`: window (every layer: the RoPE'd latent rows, `ring` = the sliding window), csa / hca (a kv source's
    compressed entries: indexer-selected / all attended), index_keys (the indexer's keys), compressor_state (the
    per-token projections and gates of a gated compressor, fp32; `of` says whose), reuse (a layer that reads
    `reads`' caches and owns none); `page_table` (the program input addressing it), `tokens_per_entry`, `width`
    (row width) and `dtype`."""
    out, source = [], None

    def add(i, kind, cache, width, ratio=1, dtype=None, **extra):
        out.append({"layer": i, "kind": kind, "cache": cache, "page_table": "page_table" if ratio == 1 else
                    f"page_table.r{ratio}", "tokens_per_entry": ratio, "width": width, "block_size": block_size,
                    "dtype": dtype or prec.kv_cache, **extra})

    for i, s in enumerate(cfg.layers):
        m, d = s.attention.mla, cfg.head_dim
        add(i, "window", f"kv.{i}.window", d, ring=s.attention.window)
        if not m.ratio:
            continue
        if not m.compress:
            out.append({"layer": i, "kind": "reuse", "reads": source, "tokens_per_entry": m.ratio})
            continue
        source, kind = i, "csa" if m.select == "indexer" else "hca"
        add(i, kind, f"kv.{i}.cmp", d, m.ratio)
        if m.index_keys in ("latent", "compressor"):
            add(i, "index_keys", f"kv.{i}.ikeys", m.index_head_dim, m.ratio)
        if m.compressor_gate:  # gated pooling reads the projections of the group's tokens back
            for ab in "ag":
                add(i, "compressor_state", f"kv.{i}.cstate.{ab}", 2 * d if m.overlap else d, dtype=F32, of=kind)
        if m.index_keys == "compressor":  # V4: the indexer's own overlapped compressor
            for ab in "ag":
                add(i, "compressor_state", f"kv.{i}.istate.{ab}", 2 * m.index_head_dim, dtype=F32, of="index_keys")
    return out
