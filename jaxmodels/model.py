"""Executes the layer plan of a `ModelConfig` with JAX.

Parameters are nested dicts. Layers with equal `LayerSpec`s form a *kind*; each kind's parameters
are stacked along a leading axis: `layers/<kind>/attn/wq` has shape [layers of that kind, ...].
The plan is periodic (LLLG…, 5:1, or period 1 for dense models), so the executor `lax.scan`s over
whole periods and unrolls only the layers of one period: compile time does not grow with depth.

KV caches hold, per kind, [layers, batch, kv_heads, slots, head_dim] (heads before slots: the layout
the attention contractions read without a transpose). A layer keeps
min(window, max_len) slots and writes position p into slot p % slots, so sliding-window layers
keep a ring whose memory is independent of the context length, and full layers a plain cache.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxmodels import deepseek
from jaxmodels.config import LayerSpec, ModelConfig
from jaxmodels.families.deepseek_v4 import DeepseekConfig
from jaxmodels.layers import attention, mlp, moe, rope
from jaxmodels.layers.norms import norm
from jaxmodels.sharding import constrain

CACHE_AXES = ("layers", "batch", "kv_heads", None, "head_dim")


# ----------------------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class Plan:
    kinds: tuple[LayerSpec, ...]  # distinct layer specs, in order of first appearance
    kind_of: tuple[int, ...]  # per layer
    rank_of: tuple[int, ...]  # per layer: index inside its kind's stack
    period: int  # the plan repeats every `period` layers (the tail may be a partial period)
    counts: tuple[int, ...]  # layers per kind
    per_period: tuple[int, ...]  # layers per kind in one period

    @property
    def n_periods(self) -> int:
        return len(self.kind_of) // self.period


@functools.lru_cache(maxsize=None)
def plan(cfg: ModelConfig) -> Plan:
    kinds, kind_of, rank_of = [], [], []
    for spec in cfg.layers:
        if spec not in kinds:
            kinds.append(spec)
        k = kinds.index(spec)
        rank_of.append(kind_of.count(k))
        kind_of.append(k)
    n = len(kind_of)
    period = next(p for p in range(1, n + 1) if all(kind_of[i] == kind_of[i % p] for i in range(n)))
    counts = tuple(kind_of.count(k) for k in range(len(kinds)))
    per_period = tuple(kind_of[:period].count(k) for k in range(len(kinds)))
    return Plan(tuple(kinds), tuple(kind_of), tuple(rank_of), period, counts, per_period)


# ----------------------------------------------------------------------------------- parameters
def layer_param_shapes(cfg: ModelConfig, spec: LayerSpec) -> dict:
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a, m = spec.attention, spec.mlp
    attn = {"wq": (D, H, d), "wk": (D, K, d), "wv": (D, K, d), "wo": (H, d, D)}
    if a.qkv_bias:
        attn |= {"bq": (H, d), "bk": (K, d), "bv": (K, d)}
    if a.out_bias:
        attn["bo"] = (D,)
    if a.qk_norm:
        attn |= {"q_norm": (H, d) if a.qk_norm_per_head else (d,), "k_norm": (K, d) if a.qk_norm_per_head else (d,)}
    if a.sinks:
        attn["sinks"] = (H,)
    ffn = _mlp_shapes(D, m)
    norms = {
        "pre": ("attn_norm", "mlp_norm"),
        "parallel": ("attn_norm",),
        "sandwich": ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"),
        "post": ("post_attn_norm", "post_mlp_norm"),
    }[spec.block]
    return {"attn": attn, "mlp": ffn} | {n: (D,) for n in norms}


def _mlp_shapes(D: int, m) -> dict:
    I = m.intermediate_size
    if m.kind == "gated":
        ffn = {"w_gate": (D, I), "w_up": (D, I), "w_down": (I, D)}
        return ffn | ({"b_gate": (I,), "b_up": (I,), "b_down": (D,)} if m.bias else {})
    E = m.num_experts
    ffn = {"router": (D, E), "w_gate": (E, D, I), "w_up": (E, D, I), "w_down": (E, I, D)}
    if m.router_bias:
        ffn["router_bias"] = (E,)
    if m.bias:
        ffn |= {"b_gate": (E, I), "b_up": (E, I), "b_down": (E, D)}
    if m.shared_intermediate_size:
        S = m.shared_intermediate_size
        ffn["shared"] = {"w_gate": (D, S), "w_up": (D, S), "w_down": (S, D)}
    return ffn


def param_shapes(cfg: ModelConfig) -> dict:
    """Nested dict of the shape of every parameter; the contract converters fill and check."""
    pl = plan(cfg)
    layers = {
        str(k): jax.tree.map(lambda s, n=n: (n, *s), layer_param_shapes(cfg, spec), is_leaf=lambda x: isinstance(x, tuple))
        for k, (spec, n) in enumerate(zip(pl.kinds, pl.counts))
    }
    shapes = {"embed": (cfg.vocab_size, cfg.hidden_size), "layers": layers, "final_norm": (cfg.hidden_size,)}
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.hidden_size, cfg.vocab_size)
    return shapes


def flat_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{"layers/0/attn/wq": shape, ...}"""
    out = {}

    def walk(prefix, d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}/", v)
            else:
                out[f"{prefix}{k}"] = tuple(v)

    walk("", param_shapes(cfg))
    return out


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random parameters at the config's shapes (for tests and speed benchmarks)."""
    flat = flat_shapes(cfg)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(flat))
    out: dict = {}
    for key, (path, shape) in zip(keys, flat.items()):
        leaf = path.rsplit("/", 1)[-1]
        if "norm" in leaf:
            val = jnp.zeros(shape, dtype) if _norm_is_offset(cfg, path) else jnp.ones(shape, dtype)
        else:
            val = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        node = out
        *parents, name = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[name] = val
    return out


def _norm_is_offset(cfg: ModelConfig, path: str) -> bool:
    if path == "final_norm":
        return cfg.norm == "gemma"
    spec = plan(cfg).kinds[int(path.split("/")[1])]
    return (spec.attention.qk_norm if path.endswith(("q_norm", "k_norm")) else spec.norm) == "gemma"


# -------------------------------------------------------------------------------------- forward
def _dot(x, w):  # x [..., D] @ w [D, ...]
    return jnp.tensordot(x, w, axes=1)


def _attention(cfg, spec: LayerSpec, p, h, ctx, cache):
    """Returns the attention output and the updated (k, v) cache stacks of this kind, or None."""
    a = spec.attention
    q, k, v = _dot(h, p["wq"]), _dot(h, p["wk"]), _dot(h, p["wv"])
    if a.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if a.qk_norm:
        q = norm(q, p["q_norm"], cfg.norm_eps, a.qk_norm)
        k = norm(k, p["k_norm"], cfg.norm_eps, a.qk_norm)
    if a.rope is not None:
        cos, sin = ctx["rope"][a.rope]
        q, k = rope.apply(q, cos, sin, a.rope.interleaved), rope.apply(k, cos, sin, a.rope.interleaved)
    scale = a.scale if a.scale is not None else cfg.head_dim**-0.5
    pos = ctx["positions"]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, d]
    keys, vals, new_cache = k, v, None
    allowed = attention.mask(pos, pos, a.window)  # within the sequence (no cache, or prefill)
    if cache is not None:
        kc, vc, idx = cache
        slots = kc.shape[3]
        if ctx["mode"] == "prefill":  # keep each row's last `slots` valid positions
            src, valid = _ring_sources(ctx["lengths"], slots)
            take = lambda x: jnp.where(valid[:, None, :, None], jnp.take_along_axis(x, src[:, None, :, None], 2), 0)
            kc = jax.lax.dynamic_update_index_in_dim(kc, take(k).astype(kc.dtype), idx, 0)
            vc = jax.lax.dynamic_update_index_in_dim(vc, take(v).astype(vc.dtype), idx, 0)
        else:  # decode one token per row: write it, then attend over the ring
            rows, slot = jnp.arange(pos.shape[0]), pos[:, 0] % slots
            kc = kc.at[idx, rows, :, slot].set(k[:, :, 0].astype(kc.dtype))
            vc = vc.at[idx, rows, :, slot].set(v[:, :, 0].astype(vc.dtype))
            keys, vals = kc[idx], vc[idx]
            q_last = pos[:, -1:]
            k_pos = q_last - (q_last - jnp.arange(slots)[None]) % slots  # position held by each slot
            allowed = attention.mask(pos, k_pos, a.window, k_valid=k_pos >= 0)
        new_cache = (kc, vc)
    if ctx["mode"] != "decode" and a.softcap is None and not a.sinks:  # whole sequence: the library's fused path
        o = attention.causal(q, k, v, scale=scale, window=a.window)
    else:
        o = attention.attend(q, keys.astype(q.dtype), vals.astype(q.dtype), allowed, scale=scale,
                             softcap=a.softcap, sinks=p.get("sinks"))
    out = jnp.einsum("bthd,hdo->bto", o, p["wo"])
    if a.out_bias:
        out = out + p["bo"]
    return out, new_cache


def _ring_sources(lengths, slots):
    """For each row and slot s: the latest position p < length with p % slots == s (or invalid)."""
    s = jnp.arange(slots)[None]
    last = lengths[:, None] - 1
    src = s + slots * jnp.floor_divide(last - s, slots)
    return jnp.maximum(src, 0), src >= 0


def _layer(cfg, spec: LayerSpec, p, x, ctx, cache):
    eps, nk = cfg.norm_eps, spec.norm
    ffn = functools.partial(moe.sparse if spec.mlp.kind == "moe" else mlp.gated, spec.mlp, p["mlp"])
    h = x if spec.block == "post" else norm(x, p["attn_norm"], eps, nk)
    att, cache = _attention(cfg, spec, p["attn"], h, ctx, cache)
    if spec.block == "parallel":
        x = x + att + ffn(h)
    elif spec.block == "pre":
        x = x + att
        x = x + ffn(norm(x, p["mlp_norm"], eps, nk))
    elif spec.block == "sandwich":
        x = x + norm(att, p["post_attn_norm"], eps, nk)
        x = x + norm(ffn(norm(x, p["mlp_norm"], eps, nk)), p["post_mlp_norm"], eps, nk)
    else:  # post
        x = x + norm(att, p["post_attn_norm"], eps, nk)
        x = x + norm(ffn(x), p["post_mlp_norm"], eps, nk)
    return x, cache


def _run_layers(cfg, layer_params, x, ctx, caches):
    """All decoder layers: a scan over whole periods of the plan, then the unrolled tail."""
    pl = plan(cfg)
    n, P = pl.n_periods, pl.period
    caches = None if caches is None else list(caches)

    def one(i, params_k, x, caches, layer_idx):  # layer i (or its twin in the first period)
        k = pl.kind_of[i]
        c = None if caches is None else (caches[k]["k"], caches[k]["v"], layer_idx)
        x, c = _layer(cfg, pl.kinds[k], params_k, x, ctx, c)
        if c is not None:
            caches[k] = {"k": c[0], "v": c[1]}
        return x, caches

    if n > 0:
        xs = tuple(
            jax.tree.map(lambda a, c=c: a[: n * c].reshape(n, c, *a.shape[1:]), layer_params[str(k)])
            for k, c in enumerate(pl.per_period)
        )

        def body(carry, inp):
            x, caches = carry
            s, xs = inp
            caches = None if caches is None else list(caches)
            for j in range(P):
                k, r = pl.kind_of[j], pl.rank_of[j]
                pk = jax.tree.map(lambda a: a[r], xs[k])
                x, caches = one(j, pk, x, caches, s * pl.per_period[k] + r)
            return (x, None if caches is None else tuple(caches)), None

        carry = (x, None if caches is None else tuple(caches))
        (x, caches), _ = jax.lax.scan(body, carry, (jnp.arange(n), xs), unroll=ctx["unroll"])
        caches = None if caches is None else list(caches)
    for i in range(n * P, cfg.num_layers):  # partial last period
        k, r = pl.kind_of[i], pl.rank_of[i]
        x, caches = one(i, jax.tree.map(lambda a: a[r], layer_params[str(k)]), x, caches, r)
    return x, None if caches is None else tuple(caches)


def _embed(cfg, params, tokens):
    x = params["embed"][tokens]
    if cfg.embed_scale is not None:  # rounded to the weight dtype, as HF
        x = x * jnp.asarray(cfg.embed_scale, params["embed"].dtype)
    return x


def _head(cfg, params, x):
    x = norm(x, params["final_norm"], cfg.norm_eps, cfg.norm)
    w = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
    logits = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if cfg.logit_scale is not None:
        logits = logits * cfg.logit_scale
    if cfg.final_softcap is not None:
        logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
    return constrain(logits, ("batch", None, "vocab"))


def _hidden(cfg, params, tokens, positions, mode, caches=None, lengths=None, unroll=1):
    x = constrain(_embed(cfg, params, tokens), ("batch", None, None))
    ctx = {"positions": positions, "mode": mode, "lengths": lengths, "rope": {}, "unroll": unroll}
    for spec in plan(cfg).kinds:
        r = spec.attention.rope
        if r is not None and r not in ctx["rope"]:
            ctx["rope"][r] = rope.cos_sin(r, cfg.head_dim, positions, x.dtype, cfg.max_position_embeddings)
    return _run_layers(cfg, params["layers"], x, ctx, caches)


def forward(params, cfg: ModelConfig, tokens, positions=None):
    """tokens int32 [B, T] -> float32 logits [B, T, vocab]; no cache."""
    if isinstance(cfg, DeepseekConfig):
        return deepseek.forward(params, cfg, tokens, positions)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, _ = _hidden(cfg, params, tokens, positions, "full")
    return _head(cfg, params, x)


# ---------------------------------------------------------------------------------------- cache
def cache_slots(cfg: ModelConfig, spec: LayerSpec, max_len: int) -> int:
    w = spec.attention.window
    return max_len if w is None else min(w, max_len)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> tuple:
    if isinstance(cfg, DeepseekConfig):
        return deepseek.init_cache(cfg, batch, max_len, dtype)
    pl = plan(cfg)
    out = []
    for spec, n in zip(pl.kinds, pl.counts):
        shape = (n, batch, cfg.num_kv_heads, cache_slots(cfg, spec, max_len), cfg.head_dim)
        zeros = lambda: constrain(jnp.zeros(shape, dtype), CACHE_AXES)  # noqa: E731
        out.append({"k": zeros(), "v": zeros()})
    return tuple(out)


def cache_bytes(cache) -> dict[int, int]:
    return {k: int(c["k"].nbytes + c["v"].nbytes) for k, c in enumerate(cache)}


def prefill(params, cfg: ModelConfig, tokens, lengths, cache):
    """Right-padded prompts [B, T] with `lengths` [B] -> (last-token logits [B, vocab], filled cache)."""
    if isinstance(cfg, DeepseekConfig):
        return deepseek.prefill(params, cfg, tokens, lengths, cache)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    x, cache = _hidden(cfg, params, tokens, positions, "prefill", cache, lengths)
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
    return _head(cfg, params, last)[:, 0], cache


def decode_step(params, cfg: ModelConfig, tokens, positions, cache, unroll: int | bool = 1):
    """One new token per row: tokens [B], positions [B] -> (logits [B, vocab], cache).

    unroll: `lax.scan`'s unroll of the layer loop (True = fully unrolled: compile time grows with
    depth, but every layer then reads its weights through static slices).
    """
    if isinstance(cfg, DeepseekConfig):
        return deepseek.decode_step(params, cfg, tokens, positions, cache, unroll)
    x, cache = _hidden(cfg, params, tokens[:, None], positions[:, None], "decode", cache, unroll=unroll)
    return _head(cfg, params, x)[:, 0], cache
