"""Host side of the DeepSeek lowering: the weights and per-run inputs its program reads, and an emulated run.

`prepare(cfg, params, specs)` maps jaxmodels params to the program's weight names ([in, out] matrices with unit
leading dims, as ttnn stores them; the mHC scale triple spread over the 24 mix columns; the Engram q*k product;
full-width RoPE tables and the pair-swap matrix; the candidate-block expansion matrix). `inputs(cfg, model, tokens,
S)` makes the position-derived masks and the Engram hash columns (int64 n-gram hashing on the host, as the
tokenizer runs there). `DeepSeekEmulator(model, numerics=...)` runs the prefill program on `tt_backend.emu`'s ops.
"""
from __future__ import annotations

import numpy as np

from jaxmodels.plan import plan
from tt_backend.deepseek_lowering import BIG, lower, rope_key
from tt_backend.emu import numerics as num
from tt_backend.emu.ops import OPS, Env
from tt_backend.lowering import MASKED, padded_prefill_len
from tt_backend.program import Ref, TTProgram

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


def inputs(cfg, params, tokens, S: int, prog: TTProgram) -> dict[str, np.ndarray]:
    """The program's host inputs for one prompt (tokens [T]) padded to S rows."""
    T = len(tokens)
    ids = np.zeros((1, S), np.uint32)
    ids[0, :T] = tokens
    q = np.arange(S)[:, None]
    out = {"tokens": ids, "rope_pos": np.arange(S, dtype=np.uint32)[None]}
    for name in prog.inputs:
        if name in out:
            continue
        kind, _, rest = name.partition(".")
        if kind == "mask":  # the sliding window: the query and the W-1 keys before it
            W = int(rest[1:])
            k = np.arange(S)[None]
            out[name] = np.where((k <= q) & (k > q - W), 0.0, MASKED).astype(F32)[None, None]
        elif kind == "rope_pos":
            r = int(rest[1:])
            out[name] = (np.arange(S // r) * r).astype(np.uint32)[None]
        elif kind in ("vis", "visadd", "newest", "blockvis"):
            r = int(rest.split(".")[0][1:])
            N = S // r
            count = np.minimum((q + 1) // r, N)  # compressed entries complete for each query
            vis = np.arange(N)[None] < count
            if kind == "vis":
                out[name] = vis.astype(F32)[None, None]
            elif kind == "visadd":
                out[name] = np.where(vis, 0.0, MASKED).astype(F32)[None, None]
            else:
                cb = int(rest.split(".")[1][1:])
                blocks = np.arange(N // cb)[None]
                if kind == "blockvis":
                    out[name] = (blocks * cb < count).astype(F32)[None, None]
                else:
                    out[name] = np.where((blocks == (count - 1) // cb) & (count > 0), BIG, 0.0).astype(F32)[None, None]
        elif kind == "engram":
            out[name] = _engram_cols(cfg, params, ids[0], int(rest.split(".")[1]))
        else:
            raise KeyError(f"no host rule for input {name!r}")
    return out


def _engram_cols(cfg, params, ids, e: int) -> np.ndarray:
    """Hash columns of engram layer e for the (padded) prompt: uint32 [1, S * C] (jaxmodels.layers.engram)."""
    from jaxmodels.layers import engram

    g = cfg.engram
    cmap = np.asarray(params["engram_map"])
    layout = engram.EngramLayout.from_config(g.layer_ids, g.max_ngram, g.vocab_size, g.n_heads, g.compressed_vocab)
    cols = np.asarray(engram.ngram_hashes(cmap[ids.astype(np.int64)][None], layout, cmap[g.pad_token]))
    return cols[0, :, e].reshape(1, -1).astype(np.uint32)


class DeepSeekEmulator:
    """The DeepSeek prefill program on the NumPy emulator (numerics exact | storage | full, see emu.numerics)."""

    def __init__(self, model, *, numerics: str = "exact", policy: str = "performance", max_seq_len: int = 1024):
        self.model, self.cfg, self.level = model, model.config, num.check_level(numerics)
        self.policy, self.max_seq_len = policy, max_seq_len
        self._weights = None

    def _store(self, x, dtype: str, mode: str):
        if self.level == "exact":
            return np.asarray(x, F32) if np.asarray(x).dtype.kind == "f" else x
        return num.quantize(x, dtype, "host" if self.level == "storage" else mode)

    def program(self, T: int) -> TTProgram:
        return lower(self.cfg, prefill_len=T, max_seq_len=self.max_seq_len, policy=self.policy).prefill

    def prefill(self, tokens, return_all: bool = False):
        tokens = np.asarray(tokens).reshape(-1)
        T, S = len(tokens), padded_prefill_len(len(tokens))
        prog = self.program(T)
        specs = {k: s for k, s in prog.tensors.items() if s.kind == "weight"}
        if self._weights is None:
            host = prepare(self.cfg, self.model.params, specs)
            self._weights = {k: self._store(v, specs[k].dtype, "host") for k, v in host.items()}
        t = dict(self._weights)
        for k, v in inputs(self.cfg, self.model.params, tokens, S, prog).items():
            s = prog.tensors[k]
            t[k] = self._store(v, s.dtype, "host") if np.asarray(v).dtype.kind == "f" else v
        env = Env(self.level, lambda x, dt: self._store(x, dt, "device"))
        for n, c in enumerate(prog.calls):
            fn = OPS.get(c.op)
            if fn is None:
                raise NotImplementedError(f"call {n}: the emulator has no {c.op}")
            kw = {k: _resolve(v, t) for k, v in c.kwargs.items()}
            res = fn(env, *[t[x] for x in c.inputs], **kw)
            res = (res,) if len(c.outputs) == 1 else res
            for name, val in zip(c.outputs, res):
                t[name] = self._store(val, prog.tensors[name].dtype, "device")
        if return_all:
            return t
        x = t[prog.outputs[0]]
        return np.asarray(x, F32).reshape(-1, x.shape[-1])[:T]


def _resolve(v, t):
    if isinstance(v, Ref):
        return t[v.name]
    if isinstance(v, list) and v and all(isinstance(x, Ref) for x in v):  # ttnn.concat's tensor list
        return [t[x.name] for x in v]
    return v
