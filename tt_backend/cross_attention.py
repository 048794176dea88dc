"""Mllama's cross-attention layers on TT: their weights, the host inputs of the lowered cross layers
(`lowering._cross_layer`), and the per-request state a generator keeps for decode.

What runs where:
- host (JAX, `tt_backend.multimodal.VisionTower.cross_inputs`): the tiled vision encoder and the projector ->
  the image features `states` [Sx, D] (HF's cross_attention_states, Sx = images x max_tiles x tokens a tile) and
  the prompt's cross_attention_mask (which tiles each token sees);
- device (the lowered program): each cross layer projects `states` through its own wk / wv and k_norm, writes K/V
  into its paged cache through the request's cross page table (once, at prefill: tt-metal's
  compute_xattn_kv_cache), and reads them back in every decode step; the tanh gates are folded into weights here.

The masks are HF's `_prepare_cross_attention_mask`: key k (tile k // tokens_per_tile) is visible to a token whose
mask row holds that tile; a row that sees no tile sees every image key (HF zeroes its mask, not its output) and gets
no MLP update (full_text_row_masked_out_mask). Keys past the request's own Sx (padding to the program's width) are
never visible. A request without images runs no cross layer in its prefill (HF skips them), and its decode rows
keep nothing of the cross layers' output (`attn_keep` 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxmodels.config import ModelConfig
from tt_backend.lowering import MASKED, padded_prefill_len
from tt_backend.paged_cache import SKIP
from tt_backend.weights import prepare as prepare_text


def is_cross(cfg: ModelConfig) -> bool:
    return any(s.attention.kind == "cross" for s in cfg.layers)


def tokens_per_tile(cfg: ModelConfig) -> int:
    v = cfg.vision
    return (v.image_size // v.patch_size) ** 2 + 1  # patches + CLS (pad slots are not features)


def cross_tokens(cfg: ModelConfig, images: int) -> int:
    """Image-feature tokens (keys of every cross layer) of `images` images: each is max_tiles tiles, pad tiles too."""
    return images * cfg.vision.max_tiles * tokens_per_tile(cfg)


# ----------------------------------------------------------------------------------------- weights
def layer_weights(cfg: ModelConfig, p: dict) -> dict[str, np.ndarray]:
    """One cross layer's params -> its TT tensors: wq [1, 1, D, H d], wkv = [wk | wv] [1, 1, D, 2 K d] (one matmul
    over the image features, then nlp_create_qkv_heads), wo, the per-head q/k norm weights [1, 1, 1, d], the gates
    as tanh(gate) broadcast to [1, 1, 1, D] (constant per layer: the device runs a plain multiply), the norms and
    the MLP. No RoPE, so no Meta permutation."""
    D, H, K, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    a, m = p["attn"], p["mlp"]
    gate = lambda g: np.broadcast_to(np.tanh(f(g)).reshape(1, 1, 1, 1), (1, 1, 1, D)).copy()  # noqa: E731
    return {"wq": f(a["wq"]).reshape(D, H * d)[None, None],
            "wkv": np.concatenate([f(a["wk"]).reshape(D, K * d), f(a["wv"]).reshape(D, K * d)], 1)[None, None],
            "wo": f(a["wo"]).reshape(H * d, D)[None, None],
            "q_norm": f(a["q_norm"]).reshape(1, 1, 1, d), "k_norm": f(a["k_norm"]).reshape(1, 1, 1, d),
            "attn_gate": gate(a["gate"]), "mlp_gate": gate(p["mlp_gate"]),
            "w1": f(m["w_gate"])[None, None], "w3": f(m["w_up"])[None, None], "w2": f(m["w_down"])[None, None],
            "attn_norm": f(p["attn_norm"]).reshape(1, 1, 1, D), "mlp_norm": f(p["mlp_norm"]).reshape(1, 1, 1, D)}


def prepare(cfg: ModelConfig, params: dict, max_seq_len: int) -> dict[str, np.ndarray]:
    """`tt_backend.weights.prepare`, with every cross layer's tensors replaced by `layer_weights` (weights.prepare
    reads a cross layer as a self-attention one: a fused wqkv the cross layer has no use for)."""
    from jaxmodels.plan import plan

    out = prepare_text(cfg, params, max_seq_len)
    if not is_cross(cfg):
        return out
    pl = plan(cfg)
    for i, spec in enumerate(cfg.layers):
        if spec.attention.kind != "cross":
            continue
        for name in [n for n in out if n.startswith(f"layers.{i}.")]:
            del out[name]
        tree = params["layers"][str(pl.kind_of[i])]
        p = _index(tree, pl.rank_of[i])
        out |= {f"layers.{i}.{n}": v for n, v in layer_weights(cfg, p).items()}
    return out


def _index(tree, r):
    return {k: _index(v, r) for k, v in tree.items()} if isinstance(tree, dict) else tree[r]


# ------------------------------------------------------------------------------------- host inputs
@dataclass
class CrossPrefill:
    """One request's image side of a prefill: `states` float32 [Sx, D] (image, tile, token order), `tiles` int
    [T, images x max_tiles] (the prompt's cross_attention_mask, images and tiles flattened) and `page_table` int
    [W] (the request's blocks for its Sx cross tokens in every cross layer's cache)."""

    states: np.ndarray
    tiles: np.ndarray
    page_table: np.ndarray


@dataclass
class CrossDecode:
    """The image side of a decode step: per user the tiles its decode rows see (the prompt's last mask row, which
    HF repeats for every generated token) or None (no images), the users' cross page tables [B, W] and the cross
    tokens the program reads per user (the generator's maximum)."""

    tiles: list
    page_table: np.ndarray
    tokens: int


def masks(cfg: ModelConfig, tiles: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """tiles int [R, n] (each row's visible tiles) -> (additive mask float32 [R, width], MLP keep float32 [R]).
    Key k < n * tokens_per_tile belongs to tile k // tokens_per_tile; a row that sees no tile sees all of them."""
    tiles = np.asarray(tiles) > 0
    seen = np.repeat(tiles, tokens_per_tile(cfg), axis=1)
    if seen.shape[1] > width:
        raise ValueError(f"{seen.shape[1]} image-feature tokens do not fit the program's {width}")
    row = seen.any(axis=1)
    allowed = np.zeros((tiles.shape[0], width), bool)
    allowed[:, :seen.shape[1]] = seen | ~row[:, None]
    return np.where(allowed, 0.0, MASKED).astype(np.float32), row.astype(np.float32)


def _table(row, width: int) -> np.ndarray:
    """A cross page-table row cut or padded (-1: skipped, zeros when read) to the program's width."""
    row = np.asarray(row, np.int32).reshape(-1)[:width]
    return np.pad(row, (0, width - row.shape[0]), constant_values=SKIP)


def prefill_inputs(cfg: ModelConfig, cross: CrossPrefill, rows: int, block_size: int) -> tuple[int, dict]:
    """(padded cross tokens Sxp, the prefill program's cross inputs for a prompt padded to `rows`). The page table
    keeps only the blocks of the request's Sx real tokens; the padding rows of the fill are skipped (-1), so they
    never land in a block the request does not own."""
    states = np.asarray(cross.states, np.float32)
    Sx, D = states.shape
    T = cross.tiles.shape[0]
    Sxp = padded_prefill_len(Sx)
    x = np.zeros((1, 1, Sxp, D), np.float32)
    x[0, 0, :Sx] = states
    tiles = np.zeros((rows, cross.tiles.shape[1]), np.int32)
    tiles[:T] = cross.tiles
    add, keep = masks(cfg, tiles, Sxp)
    own = -(-Sx // block_size)
    table = _table(cross.page_table, -(-Sxp // block_size))
    if (table[:own] == SKIP).any():
        raise ValueError(f"the cross page table must give {own} blocks for {Sx} image-feature tokens, got "
                         f"{np.asarray(cross.page_table).reshape(-1)[:own].tolist()}")
    table[own:] = SKIP
    return Sxp, {"cross_states": x, "cross_mask": add[None, None],
                 "cross_mlp_keep": np.repeat(keep[:, None], D, 1)[None, None].astype(np.float32),
                 "cross_page_table": table[None]}


def decode_inputs(cfg: ModelConfig, cross: CrossDecode, batch: int, block_size: int) -> tuple[int, dict]:
    """(padded cross tokens Sxp, the decode program's cross inputs for `batch` users)."""
    H, d, D = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    Sxp = padded_prefill_len(cross.tokens)
    if len(cross.tiles) != batch or np.shape(cross.page_table)[0] != batch:
        raise ValueError(f"cross tiles / page table for {len(cross.tiles)} / {np.shape(cross.page_table)[0]} users, "
                         f"the decode has {batch}")
    add = np.zeros((batch, Sxp), np.float32)
    mlp, attn = np.zeros(batch, np.float32), np.zeros(batch, np.float32)
    for b, t in enumerate(cross.tiles):
        if t is not None:
            m, k = masks(cfg, np.asarray(t).reshape(1, -1), Sxp)
            add[b], mlp[b], attn[b] = m[0], k[0], 1.0
    width = -(-Sxp // block_size)
    return Sxp, {"cross_mask": np.repeat(add[:, None, :], H, 1)[None],
                 "cross_attn_keep": np.broadcast_to(attn[None, :, None, None], (1, batch, H, d)).astype(np.float32),
                 "cross_mlp_keep": np.broadcast_to(mlp[None, None, :, None], (1, 1, batch, D)).astype(np.float32),
                 "cross_page_table": np.stack([_table(r, width) for r in np.asarray(cross.page_table)])}
