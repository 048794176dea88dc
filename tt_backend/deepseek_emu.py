"""Host side of the DeepSeek lowering: the weights and per-run inputs its program reads, and an emulated run.

`prepare(cfg, params, specs)` maps jaxmodels params to the program's weight names ([in, out] matrices with unit
leading dims, as ttnn stores them; the mHC scale triple spread over the 24 mix columns; the Engram q*k product;
full-width RoPE tables and the pair-swap matrix; the candidate-block expansion matrix). `inputs(cfg, model, tokens,
S)` makes the position-derived masks and the Engram hash columns (int64 n-gram hashing on the host, as the
tokenizer runs there). `DeepSeekEmulator(model, numerics=...)` runs the prefill and decode programs on
`tt_backend.emu`'s ops over caches of its own; `DeepSeekVLLMExecutor` runs them for `tt_backend.generator` over the
generator's caches and page tables, one per cache kind and layer.
"""
from __future__ import annotations

import functools

import numpy as np

from jaxmodels.plan import plan
from tt_backend import paged_cache as pc
from tt_backend.deepseek_lowering import BIG, kv_specs, lower, rope_key
from tt_backend.emu import numerics as num
from tt_backend.emu.ops import OPS, Env
from tt_backend.lowering import MASKED, padded_prefill_len
from tt_backend.program import Ref, TTProgram
from tt_backend.weights import policy as get_policy

F32 = np.float32


def _layer_params(cfg, params, i):
    pl = plan(cfg)
    tree = params["layers"][str(pl.kind_of[i])]
    r = pl.rank_of[i]

    def take(t):
        return {k: take(v) for k, v in t.items()} if isinstance(t, dict) else np.asarray(t[r])

    return take(tree)


def _rope_table(rope, rope_dim: int, width: int, max_seq_len: int, cs: str) -> np.ndarray:
    """[max_seq_len, width]: the interleaved RoPE of the last rope_dim channels; cos 1 / sin 0 elsewhere."""
    from jaxmodels.layers import rope as R

    cos, sin = R.cos_sin(rope, rope_dim, np.arange(max_seq_len), np.float32)  # the tables jm.forward uses
    t = np.asarray(cos if cs == "cos" else sin, F32)
    out = np.full((max_seq_len, width), 1.0 if cs == "cos" else 0.0, F32)
    out[:, width - rope_dim:] = np.repeat(t, 2, axis=-1)  # pair (2j, 2j+1) shares angle j
    return out


def _swap(width: int, rope_dim: int) -> np.ndarray:
    """P with (x P)[2j] = -x[2j+1], (x P)[2j+1] = x[2j] on the RoPE tail, 0 elsewhere."""
    p = np.zeros((width, width), F32)
    for j in range(width - rope_dim, width, 2):
        p[j + 1, j], p[j, j + 1] = -1.0, 1.0
    return p[None, None]


def prepare(cfg, params, specs: dict) -> dict[str, np.ndarray]:
    """Host arrays for every weight the program declares (`specs`: name -> TTTensorSpec)."""
    out = {}
    n = cfg.mhc.copies
    ropes = {rope_key(s.attention.rope): s.attention.rope for s in cfg.layers}
    rd = cfg.layers[0].attention.mla.rope_dim
    layers = {}
    for name, spec in specs.items():
        parts = name.split(".")
        if name == "embed":
            v = np.asarray(params["embed"], F32)
        elif name == "lm_head":
            v = np.asarray(params["lm_head"], F32)[None, None]
        elif name == "final_norm":
            v = np.asarray(params["final_norm"], F32).reshape(1, 1, 1, -1)
        elif parts[0] == "hc_head":
            p = params["hc_head"]
            v = {"fn": lambda: np.asarray(p["fn"], F32).T[None, None],
                 "scale": lambda: np.full((1, 1, 1, n), np.asarray(p["scale"], F32)[0]),
                 "base": lambda: np.asarray(p["base"], F32).reshape(1, 1, 1, -1)}[parts[1]]()
        elif parts[0] == "rope" and parts[1] == "swap":
            v = _swap(spec.shape[-1], rd)
        elif parts[0] == "rope":
            key, width, cs = name[len("rope."):].rsplit(".", 2)
            v = _rope_table(ropes[key], rd, int(width[1:]), spec.shape[0], cs)
        elif parts[0] == "cand":
            nb, cb = (int(x) for x in parts[2].split("x"))
            v = np.kron(np.eye(nb, dtype=F32), np.ones((1, cb), F32))[None, None]
        elif parts[0] == "layers":
            i = int(parts[1])
            if i not in layers:
                layers[i] = _layer_params(cfg, params, i)
            v = _layer_weight(layers[i], parts[2:], spec.shape, n)
        else:
            raise KeyError(f"no host rule for weight {name!r}")
        v = np.asarray(v)
        if v.dtype.kind == "f":
            v = v.astype(F32)
        if tuple(v.shape) != tuple(spec.shape):
            raise ValueError(f"weight {name}: prepared shape {v.shape} != program shape {spec.shape}")
        out[name] = v
    return out


def _layer_weight(p, parts, shape, n):
    key = ".".join(parts)
    if parts[0] in ("attn_norm", "mlp_norm"):
        return p[parts[0]].reshape(shape)
    if parts[0] in ("hc_attn", "hc_mlp"):
        h = p[parts[0]]
        if parts[1] == "fn":
            return h["fn"].T[None, None]
        if parts[1] == "scale":  # scale[0] on the pre columns, [1] on post, [2] on the n*n comb columns
            s = h["scale"]
            return np.concatenate([np.full(n, s[0]), np.full(n, s[1]), np.full(n * n, s[2])]).reshape(shape)
        return h["base"].reshape(shape)
    if parts[0] == "engram":
        e = p["engram"]
        if parts[1] == "qk":  # only the product of the two is used (fp32, as the model computes it)
            return (e["q_weight"].astype(F32) * e["k_weight"].astype(F32)).reshape(shape)
        return e[parts[1]].reshape(shape)
    t = p
    for k in parts:
        t = t[k]
    t = np.asarray(t)
    if key.endswith("sinks"):
        return t.reshape(shape)
    if t.ndim == 1:  # norms and biases
        return t.reshape(shape)
    if t.ndim == 2 and t.dtype.kind in "iu":  # hash routing table [vocab, k]
        return t.astype(np.uint32)
    return t.reshape(shape)  # [in, out] matrices, [E, in, out] experts, [G, i, r] wo_a: leading unit dims only


def inputs(cfg, params, histories, positions, prog: TTProgram, tables: dict) -> dict[str, np.ndarray]:
    """The program's host inputs. Prefill: one user, histories = [prompt], positions = 0..S-1 (the prompt padded to
    S rows). Decode: one row per user, histories[b] = that user's tokens up to and including the new one,
    positions[b] its position. tables: {1: token page table [users, W], r: entry page table per ratio}.

    Masks are [rows, n] rules laid out as the program declares them ([1, 1, S, n] prefill, [B, 1, 1, n] decode)."""
    decode = prog.mode == "decode"
    q = np.asarray(positions)[:, None]  # [rows, 1]; decode: -1 marks an inactive row (no cache write, masked)
    rows = q.shape[0]
    if decode:
        ids = np.array([h[-1] if len(h) else 0 for h in histories], np.uint32)[None]
    else:
        ids = np.zeros((1, rows), np.uint32)
        ids[0, :len(histories[0])] = histories[0]
    out = {"tokens": ids, "rope_pos": np.maximum(q[:, 0], 0).astype(np.uint32)[None]}
    engram_cols = {}
    for name in prog.inputs:
        if name in out:
            continue
        shape = prog.tensors[name].shape
        kind, _, rest = name.partition(".")
        r = int(rest.split(".")[0][1:]) if kind in ("rope_pos", "vis", "visadd", "newest", "blockvis", "cidx", "cown",
                                                    "cprev", "posmod") else 1
        n = shape[-1] if kind in ("mask", "vis", "visadd", "newest", "blockvis") else None
        if kind == "page_table":  # per cache ("page_table.kv.<i>.<cache>") or per index space (token, ratio r)
            out[name] = tables[rest if rest.startswith("kv.") else int(rest[1:]) if rest else 1]
            continue
        if kind == "valid_seq_len":  # the prompt's real length (a ring's fill stops there)
            v = np.array([len(histories[0])], np.int32)
        elif kind == "cur_pos":
            v = q[:, 0].astype(np.int32)
        elif kind == "mask":  # the sliding window: the query and the W-1 keys before it
            W, *ring = rest.split(".")
            W, k = int(W[1:]), np.arange(n)[None]
            if ring:  # decode over a ring of m slots: slot k holds the latest position p <= q with p = k (mod m)
                k = q - (q - k) % int(ring[0][1:])
            v = np.where((k >= 0) & (k <= q) & (k > q - W), 0.0, MASKED)
        elif kind == "rope_pos":  # a compressed entry stands at its group's first position
            v = (np.arange(shape[-1]) * r if not decode else np.maximum(q[:, 0], 0) // r * r).astype(np.uint32)[None]
        elif kind in ("vis", "visadd", "newest", "blockvis"):
            count = (q + 1) // r  # compressed entries complete for each query
            vis = np.arange(n if kind in ("vis", "visadd") else n * int(rest.split(".")[1][1:]))[None] < count
            if kind == "vis":
                v = vis
            elif kind == "visadd":
                v = np.where(vis, 0.0, MASKED)
            else:
                cb = int(rest.split(".")[1][1:])
                blocks = np.arange(n)[None]
                v = (blocks * cb < count) if kind == "blockvis" else np.where(
                    (blocks == (count - 1) // cb) & (count > 0), BIG, 0.0)
        elif kind == "cidx":  # the entry a decode step completes, -1 where its group is still filling
            v = np.where((q[:, 0] + 1) % r == 0, q[:, 0] // r, -1).astype(np.int32)
        elif kind in ("cown", "cprev"):  # rows of the group ending at the token (and the group before it)
            j = np.arange(shape[2])[None]
            hi = q if kind == "cown" else q - r
            v = np.where((j <= hi) & (j > hi - r), 0.0, MASKED)
        elif kind == "posmod":  # one-hot slot of each token in its group
            v = np.arange(r)[None] == (q % r)
        elif kind == "engram":
            e = int(rest.split(".")[1])
            if not engram_cols:  # every engram layer's columns from one hashing pass
                engram_cols["all"] = (_engram_step_cols(cfg, params, histories) if decode
                                      else _engram_cols(cfg, params, ids[0]))
            v = engram_cols["all"][:, e].reshape(1, -1).astype(np.uint32)
        else:
            raise KeyError(f"no host rule for input {name!r}")
        v = np.asarray(v)
        out[name] = (v.astype(F32) if v.dtype == bool or v.dtype.kind == "f" else v).reshape(shape)
    return out


def _engram_cols(cfg, params, ids, history=None) -> np.ndarray:
    """Hash columns of every engram layer for token ids [T] (jaxmodels.layers.engram): [T, layers, C]. history
    [T, max_ngram-1] (decode: each row one user's token, after those raw ids; -1 where none) continues a
    sequence instead of starting one."""
    from jaxmodels.layers import engram

    g = cfg.engram
    cmap = np.asarray(params["engram_map"])
    layout = engram.EngramLayout.from_config(g.layer_ids, g.max_ngram, g.vocab_size, g.n_heads, g.compressed_vocab)
    ids = cmap[np.asarray(ids, np.int64)]
    if history is None:
        return np.asarray(engram.ngram_hashes(ids[None], layout, cmap[g.pad_token]))[0]
    hist = np.where(history >= 0, cmap[np.maximum(history, 0)], engram.DEAD)
    return np.asarray(engram.ngram_hashes(ids[:, None], layout, cmap[g.pad_token], history=hist))[:, 0]


def _engram_step_cols(cfg, params, histories) -> np.ndarray:
    """Decode: each user's new token (the last of its history) hashed with the max_ngram-1 before it: [B, layers,
    C]. Fixed shapes, so the hashing compiles once whatever the sequence lengths."""
    n = cfg.engram.max_ngram - 1
    hist = np.full((len(histories), n), -1, np.int64)
    for b, h in enumerate(histories):
        prev = list(h[-n - 1:-1]) if len(h) else []
        hist[b, n - len(prev):] = prev
    return _engram_cols(cfg, params, [h[-1] if len(h) else 0 for h in histories], hist)


class DeepSeekEmulator:
    """DeepSeek's prefill and decode programs on the NumPy emulator (numerics exact | storage | full, see
    emu.numerics), over paged caches: user b owns blocks b*W .. (b+1)*W - 1 of every cache (W: its page-table
    width, token- or entry-indexed)."""

    def __init__(self, model, *, numerics: str = "exact", policy: str = "performance", max_seq_len: int = 1024,
                 block_size: int = 32, users: int = 1):
        self.model, self.cfg, self.level = model, model.config, num.check_level(numerics)
        self.policy, self.max_seq_len, self.bs, self.users = policy, max_seq_len, block_size, users
        self._weights, self.caches, self.history = None, {}, [[] for _ in range(users)]

    def _store(self, x, dtype: str, mode: str):
        if self.level == "exact":
            return np.asarray(x, F32) if np.asarray(x).dtype.kind == "f" else x
        return num.quantize(x, dtype, "host" if self.level == "storage" else mode)

    def programs(self, T: int, B: int = 1, window_ring: int | None = None, per_cache: bool = False):
        return _lower(self.cfg, T, B, self.max_seq_len, self.bs, self.policy, per_cache, window_ring)

    def program(self, T: int) -> TTProgram:
        return self.programs(T).prefill

    def _width(self, r: int) -> int:
        return -(-(self.max_seq_len // r) // self.bs)

    def _tables(self, users) -> dict:
        ratios = {1} | {s.attention.mla.ratio for s in self.cfg.layers if s.attention.mla.ratio}
        return {r: np.stack([u * self._width(r) + np.arange(self._width(r)) for u in users]).astype(np.int32)
                for r in ratios}

    def _ratio(self, cache_name: str) -> int:
        i, kind = cache_name.split(".")[1:3]
        return self.cfg.layers[int(i)].attention.mla.ratio if kind in ("cmp", "ikeys") else 1

    def _run(self, prog: TTProgram, host: dict, override: dict | None = None, caches: dict | None = None,
             owners=None) -> dict:
        """Run `prog` over `caches` (program cache name -> buffer; default: this emulator's own, one pool per cache)
        with every cache write checked against `owners` (a paged_cache.RowOwners) when given."""
        self._weights = self._weights or {}
        specs = {k: s for k, s in prog.tensors.items() if s.kind == "weight" and k not in self._weights}
        if specs:  # prepared once; decode adds shape-dependent constants (the candidate expansion over the cache)
            w = prepare(self.cfg, self.model.params, specs)
            self._weights |= {k: self._store(v, specs[k].dtype, "host") for k, v in w.items()}
        t = dict(self._weights)
        for name, s in prog.tensors.items():
            if s.kind == "state" and caches is not None:
                if name not in caches:
                    raise ValueError(f"no buffer for the program's cache {name!r}")
                t[name] = caches[name]
            elif s.kind == "state":
                if name not in self.caches:
                    nb = self.users * self._width(self._ratio(name))
                    self.caches[name] = np.zeros((nb, *s.shape[1:]), F32)
                t[name] = self.caches[name]
        for k, v in host.items():
            t[k] = self._store(v, prog.tensors[k].dtype, "host") if np.asarray(v).dtype.kind == "f" else v
        env = Env(self.level, lambda x, dt: self._store(x, dt, "device"), owners=owners)
        for n, c in enumerate(prog.calls):
            fn = OPS.get(c.op)
            if fn is None:
                raise NotImplementedError(f"call {n}: the emulator has no {c.op}")
            if c.op == "ttnn.experimental.paged_update_cache":  # the op repacks rows into the cache's own dtype
                env.kv_dtype = prog.tensors[c.inputs[0]].dtype if self.level != "exact" else "ttnn.float32"
            kw = {k: _resolve(v, t) for k, v in c.kwargs.items()}
            try:
                res = fn(env, *[t[x] for x in c.inputs], **kw)
            except Exception as e:
                raise type(e)(f"call {n} {c.op} {c.inputs} -> {c.outputs}: {e}") from e
            res = (res,) if len(c.outputs) == 1 else res
            for name, val in zip(c.outputs, res):
                t[name] = self._store(val, prog.tensors[name].dtype, "device")
                if override and name in override:  # isolate a layer: what reaches it is the reference's
                    t[name] = override[name]
        return t

    def prefill(self, tokens, user: int = 0, return_all: bool = False, override: dict | None = None):
        """One user's prompt -> logits [T, vocab]; fills that user's caches. override: tensors whose computed
        values are replaced (e.g. an exact run's, to feed one layer the reference's inputs)."""
        tokens = np.asarray(tokens).reshape(-1)
        T, S = len(tokens), padded_prefill_len(len(tokens))
        prog = self.programs(T).prefill
        self.history[user] = list(tokens)
        host = inputs(self.cfg, self.model.params, [tokens], np.arange(S), prog,
                      {r: v for r, v in self._tables([user]).items()})
        t = self._run(prog, host, override)
        return t if return_all else _logits(t, prog)[:T]

    def decode(self, tokens, positions, return_all: bool = False):
        """One token per user (users 0..B-1) at `positions` -> logits [B, vocab]; caches updated in place."""
        tokens, positions = np.asarray(tokens).reshape(-1), np.asarray(positions).reshape(-1)
        B = len(tokens)
        prog = self.programs(1, B).decode
        for b in range(B):
            if len(self.history[b]) != positions[b]:
                raise ValueError(f"user {b}: position {positions[b]} after {len(self.history[b])} tokens")
            self.history[b].append(int(tokens[b]))
        host = inputs(self.cfg, self.model.params, [np.asarray(self.history[b]) for b in range(B)], positions, prog,
                      self._tables(range(B)))
        t = self._run(prog, host)
        return t if return_all else _logits(t, prog)


@functools.lru_cache(maxsize=32)
def _lower(cfg, T, B, max_seq_len, block_size, policy, per_cache, window_ring):
    return lower(cfg, prefill_len=T, batch=B, max_seq_len=max_seq_len, block_size=block_size, policy=policy,
                 per_cache_page_tables=per_cache, window_ring=window_ring)


def _resolve(v, t):
    if isinstance(v, Ref):
        return t[v.name]
    if isinstance(v, list) and v and all(isinstance(x, Ref) for x in v):  # ttnn.concat's tensor list
        return [t[x.name] for x in v]
    return v


def paged_caches(cfg) -> list[dict]:
    """The program's paged caches (`deepseek_lowering.kv_specs` entries that own a cache, i.e. not reuse layers), in
    the order of the generator's `kv_cache_specs`: what its per-cache page tables and buffers follow."""
    return [c for c in kv_specs(cfg, 32, get_policy("performance")) if "cache" in c]  # names and ratios only


class DeepSeekVLLMExecutor:
    """`tt_backend.generator.Executor` for DeepSeek V4 / V4.1: the lowered programs on the emulator with one page table
    and one buffer per cache (per-cache tables), listed in `paged_caches` order. The window caches are rings of their
    ``cache_position_modulo`` tokens. Prefill runs a prompt's first chunk from position 0 through the prefill program
    and continues a sequence anywhere (later chunks, a cached prefix) through `extend`; decode takes each row's
    previous tokens (``history``, for Engram's n-gram hashes, which run on the host).

    Every block a step reads or writes must be in the user's table: -1 there raises, it is not a skip (a decode
    gathers whole rows through ttnn.embedding, which has no skip rule). Columns past them go to the decode program
    as block 0, whose rows its masks hide."""

    def __init__(self, model, *, numerics: str = "full", policy="performance", max_seq_len: int = 8192,
                 block_size: int = 32):
        self.emu = DeepSeekEmulator(model, numerics=numerics, policy=policy, max_seq_len=max_seq_len,
                                    block_size=block_size)
        self.config, self.caches = model.config, paged_caches(model.config)

    def _ring(self, modulo) -> int | None:
        """The window caches' ring (one for all: every layer has the same window); other caches have none."""
        modulo = list(modulo or [None] * len(self.caches))
        if len(modulo) != len(self.caches):
            raise ValueError(f"cache_position_modulo has {len(modulo)} entries for {len(self.caches)} caches")
        rings = {m for c, m in zip(self.caches, modulo) if c["kind"] == "window"}
        if len(rings) != 1 or any(m for c, m in zip(self.caches, modulo) if c["kind"] != "window"):
            raise ValueError(f"only the window caches are rings, all of one size; got {modulo}")
        return rings.pop()

    def _tables(self, prog, page_tables, seen, ring) -> dict:
        """Per program cache: its table at the program's width (-1 past the caller's columns), after checking that
        each row holds the blocks of its first `seen[row]` tokens (entries: seen // ratio; a ring: its slots)."""
        if len(page_tables) != len(self.caches):
            raise ValueError(f"{len(page_tables)} page tables for {len(self.caches)} caches")
        out, bs = {}, self.emu.bs
        for c, t in zip(self.caches, page_tables):
            t = np.asarray(t, np.int32)
            if t.ndim != 2 or t.shape[0] < len(seen):
                raise ValueError(f"{c['cache']}: page table {list(t.shape)} needs a row for each of {len(seen)} users")
            items = [min(n, ring) if c["kind"] == "window" and ring else n // c["tokens_per_entry"] for n in seen]
            for row, n in enumerate(items):
                need = -(-n // bs)
                if need > t.shape[1] or (t[row, :need] < 0).any():
                    raise ValueError(f"{c['cache']} ({c['kind']}): row {row} needs blocks for {n} "
                                     f"{'entries' if c['tokens_per_entry'] > 1 else 'tokens'} ({need} columns), its "
                                     f"page table has {list(t[row, :need])}")
            name = f"page_table.{c['cache']}"
            W = prog.tensors[name].shape[1]
            full = np.full((t.shape[0], W), -1, np.int32)
            full[:, :min(W, t.shape[1])] = t[:, :W]
            out[c["cache"]] = full
        return out

    EXTEND_ROWS = 32  # rows of the decode program that continues a prompt (one tile of rows, the decode batch limit)

    def prefill(self, tokens, *, chunk_start, last_token_idx, valid_seq_len, page_tables, chunk_page_tables,
                kv_cache, cache_position_modulo, owners, history=None, **multimodal):
        """A prompt's first chunk (chunk_start 0) runs the prefill program; a later chunk, or the rest of a prompt
        whose prefix is already cached (chunk_start > 0, any position), runs `extend`. history: the token ids
        before chunk_start (at least max_ngram-1 of them, or all; needed with Engram when chunk_start > 0)."""
        if multimodal:
            raise NotImplementedError(f"DeepSeek prefill takes token ids only, not {sorted(multimodal)}")
        ids = np.asarray(tokens).reshape(-1)
        T, ring = int(valid_seq_len), self._ring(cache_position_modulo)
        if chunk_start:
            logits = self.extend(ids[:T], int(chunk_start), page_tables=page_tables, kv_cache=kv_cache, ring=ring,
                                 owners=owners, history=history)
            return logits[int(last_token_idx)]
        prog = self.emu.programs(T, 1, ring, per_cache=True).prefill
        if prog.tensors["tokens"].shape[1] != ids.shape[0]:
            raise ValueError(f"prefill of {T} tokens runs {prog.tensors['tokens'].shape[1]} rows, got {ids.shape[0]}")
        host = inputs(self.config, self.emu.model.params, [ids[:T]], np.arange(ids.shape[0]), prog,
                      self._tables(prog, page_tables, [T], ring))
        t = self.emu._run(prog, host, caches=self._buffers(kv_cache), owners=owners)
        return _logits(t, prog)[int(last_token_idx)]

    def extend(self, ids, start: int, *, page_tables, kv_cache, ring, owners, history=None) -> np.ndarray:
        """Continue one user's sequence at position `start` with the token ids `ids` (caches hold positions < start:
        an earlier chunk, or a cached prefix) -> logits [len(ids), vocab].

        The tokens run as the rows of the decode program, `EXTEND_ROWS` at a time, every row addressing the same
        user's page tables at its own position: each row writes its window row, compressor state and (where its
        group completes) its compressed entry before any row reads the caches, and the masks hide from each row what
        lies after it, so a row reads exactly what a decode step at its position would. This is how a chunk starts
        anywhere: mid compression group (the group's earlier rows are in the token-indexed compressor state), mid
        window, mid candidate block. A ring of m slots is written at most m - window + 1 positions per step, so no
        row overwrites a slot an earlier row of its step still reads. (The prefill program cannot continue: its
        attention, pooling and indexer see only its own rows.)"""
        ids = np.asarray(ids).reshape(-1)
        g = self.config.engram
        if g is not None and history is None:
            raise ValueError("Engram hashes each token with the ones before it: a continued prefill needs history")
        before = [] if history is None else [int(x) for x in np.asarray(history).reshape(-1) if x >= 0]
        rows = self.EXTEND_ROWS
        if ring:
            window = max(s.attention.window for s in self.config.layers)
            if ring < window:
                raise ValueError(f"a window ring of {ring} tokens cannot hold the window of {window}")
            rows = min(rows, ring - window + 1)
        if start + len(ids) > self.emu.max_seq_len:
            raise ValueError(f"positions up to {start + len(ids) - 1} >= max_seq_len={self.emu.max_seq_len}")
        prog = self.emu.programs(1, rows, ring, per_cache=True).decode
        one = [np.asarray(t, np.int32)[:1] for t in page_tables]
        row_owners = None if owners is None else pc.RowOwners(owners.allocator, [owners.request_of_row[0]] * rows)
        seq, out = before + [int(x) for x in ids], []
        for s in range(0, len(ids), rows):
            n = min(rows, len(ids) - s)
            toks = np.zeros(rows, np.int64)
            pos = np.full(rows, -1, np.int64)
            toks[:n], pos[:n] = ids[s:s + n], start + s + np.arange(n)
            at = len(before) + s  # index of the step's first token in seq
            histories = [seq[:at + j + 1] for j in range(n)] + [[0]] * (rows - n)
            tables = self._tables(prog, [np.repeat(t, rows, 0) for t in one], [int(q) + 1 for q in pos[:n]] +
                                  [0] * (rows - n), ring)
            tables = {k: np.maximum(t, 0) for k, t in tables.items()}  # ttnn.embedding reads every column
            host = inputs(self.config, self.emu.model.params, histories, pos, prog, tables)
            out.append(_logits(self.emu._run(prog, host, caches=self._buffers(kv_cache), owners=row_owners),
                               prog)[:n])
        return np.concatenate(out)

    def decode(self, tokens, positions, *, page_tables, kv_cache, cache_position_modulo, owners, history=None):
        """tokens / positions [B] (-1: an inactive row); history [B, max_ngram-1] each row's previous token ids
        (-1 where none; needed with Engram) -> logits [B, vocab]."""
        tokens, positions = np.asarray(tokens).reshape(-1), np.asarray(positions).reshape(-1)
        B, ring = len(tokens), self._ring(cache_position_modulo)
        if positions.max(initial=-1) >= self.emu.max_seq_len:
            raise ValueError(f"position {positions.max()} >= max_seq_len={self.emu.max_seq_len}")
        if self.config.engram is not None and history is None:
            raise ValueError("Engram hashes each token with the ones before it: decode needs history")
        prev = np.full((B, 0), -1) if history is None else np.asarray(history)
        histories = [[int(x) for x in h if x >= 0] + [int(t)] for h, t in zip(prev, tokens)]
        prog = self.emu.programs(1, B, ring, per_cache=True).decode
        tables = self._tables(prog, page_tables, [max(int(q) + 1, 0) for q in positions], ring)
        tables = {k: np.maximum(t, 0) for k, t in tables.items()}  # ttnn.embedding reads every column
        host = inputs(self.config, self.emu.model.params, histories, positions, prog, tables)
        return _logits(self.emu._run(prog, host, caches=self._buffers(kv_cache), owners=owners), prog)

    def _buffers(self, kv_cache) -> dict:
        if len(kv_cache) != len(self.caches):
            raise ValueError(f"kv_cache has {len(kv_cache)} entries for {len(self.caches)} caches")
        return {c["cache"]: buf[0] for c, buf in zip(self.caches, kv_cache)}


def _logits(t: dict, prog: TTProgram) -> np.ndarray:
    x = t[prog.outputs[0]]
    return np.asarray(x, F32).reshape(-1, x.shape[-1])
