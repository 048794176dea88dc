"""EXAONE 4.5's vision tower: Qwen2.5-VL's windowed ViT with GQA and its 2x2 patch merger (specs/vision.md §4).

The reference is transformers 5.24 `Exaone4_5_VisionModel` (`models/exaone4_5/modeling_exaone4_5.py`, with
`vision_utils.get_vision_{position_ids,window_index,cu_seqlens}`). HF permutes the merge units into window order,
runs `cu_seqlens` segments and un-permutes the merger's output. Attention inside a segment does not depend on the
order of its tokens (no causal mask; RoPE is per token), so here the tokens stay in the processor's block-major order
throughout and each segment (a window, or a whole frame in the full blocks) is gathered into a padded row of a batch
of segments, attended with its padding masked, and gathered back. That is exact, and costs
[segments, heads, L_seg, L_seg] scores instead of a mask over the whole packed sequence.

Everything that depends on `grid_thw` (positions, window and frame segments) is computed on the host with NumPy:
`grid_thw` decides the shapes, so it is static under `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.config import MLPSpec, RopeSpec, VisionSpec
from jaxmodels.layers import attention, mlp, rope
from jaxmodels.layers.norms import norm
from jaxmodels.layers.qdq import linear

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Segments:
    """Tokens grouped for attention. index [S, L]: the packed token of each slot (N, one past the last token, pads a
    short segment); valid [S, L]: the slot holds a token; inverse [N]: each token's flat slot s * L + r."""

    index: np.ndarray
    valid: np.ndarray
    inverse: np.ndarray


@dataclasses.dataclass(frozen=True)
class Layout:
    """Host-side tables of one `grid_thw`. positions [N, 2] (row, column of each patch in its frame, block-major as
    HF's `get_vision_position_ids`); windows: the windowed blocks' segments; frames: the full blocks' (one per frame
    of each image, as HF's `cu_seqlens`, which never attend across images or frames)."""

    positions: np.ndarray
    windows: Segments
    frames: Segments


def _segments(seg: np.ndarray) -> Segments:
    """seg [N]: the segment id of each token, ids 0..S-1 all used."""
    n = seg.shape[0]
    counts = np.bincount(seg)
    width = int(counts.max())
    order = np.argsort(seg, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(n) - starts[seg[order]]
    index = np.full((counts.shape[0], width), n, np.int32)
    index[seg[order], rank] = order
    inverse = np.empty(n, np.int32)
    inverse[order] = seg[order] * width + rank
    return Segments(index, index < n, inverse)


def _grid(grid_thw) -> tuple[tuple[int, int, int], ...]:
    rows = tuple(tuple(int(x) for x in row) for row in np.asarray(grid_thw).reshape(-1, 3))
    if not rows or any(min(r) < 1 for r in rows):
        raise ValueError(f"grid_thw must be [N_img, 3] positive (t, h, w) rows, got {rows}")
    return rows


@functools.lru_cache(maxsize=64)
def layout(merge: int, window_units: int, grid: tuple[tuple[int, int, int], ...]) -> Layout:
    """Positions and segments for `grid` ((t, h, w) per image, in patches). window_units: a window's side in merge
    units (HF `window_size // merge // patch`); windows tile each frame's merged grid from its top-left, so the last
    row and column of windows may be partial (HF pads the merged grid by v - n % v and drops the empty slots)."""
    pos, win, frame = [], [], []
    n_win = n_frame = 0
    m2 = merge * merge
    for t, h, w in grid:
        if h % merge or w % merge:
            raise ValueError(f"grid (t, h, w) = {(t, h, w)}: h and w must be multiples of merge_size {merge}")
        bh, bw = h // merge, w // merge
        n = np.arange(h * w)
        unit, sub = n // m2, n % m2
        ub, ur = unit // bw, unit % bw  # the merge block's row and column
        row, col = ub * merge + sub // merge, ur * merge + sub % merge
        wh, ww = -(-bh // window_units), -(-bw // window_units)
        wid = (ub // window_units) * ww + ur // window_units
        for _ in range(t):
            pos.append(np.stack([row, col], axis=-1))
            win.append(wid + n_win)
            frame.append(np.full(h * w, n_frame))
            n_win += wh * ww
            n_frame += 1
    # ceil-many windows a side: none is empty (HF's extra all-pad window when n % v == 0 is dropped there too)
    positions = np.concatenate(pos).astype(np.int32)
    return Layout(positions, _segments(np.concatenate(win)), _segments(np.concatenate(frame)))


def _attend_segments(q, k, v, seg: Segments, scale: float):
    """q [N, H, d], k/v [N, K, d] -> [N, H, d]: attention within each segment only."""
    pad = lambda x: jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])  # noqa: E731
    idx = jnp.asarray(seg.index)
    qs = pad(q)[idx]  # [S, L, H, d]
    ks, vs = (jnp.swapaxes(pad(x)[idx], 1, 2) for x in (k, v))  # [S, K, L, d]
    allowed = jnp.broadcast_to(jnp.asarray(seg.valid)[:, None, :], (*seg.valid.shape, seg.valid.shape[1]))
    o = attention.unordered(qs, ks, vs, allowed, scale=scale)  # [S, L, H, d]
    return o.reshape(-1, *o.shape[2:])[jnp.asarray(seg.inverse)]


def _rope_tables(v: VisionSpec, positions: np.ndarray):
    """cos, sin [N, 1, d/2] in fp32: d/4 frequencies per axis, rows' angles then columns' (HF's
    `Exaone4_5_VisionRotaryEmbedding`: inv_freq over spatial_dim = d/2; its cos/sin repeat these halves)."""
    d = v.head_dim
    if d % 4:
        raise ValueError(f"vision head_dim {d} must be a multiple of 4 for the 2-D RoPE")
    inv, _ = rope.inv_freq(RopeSpec(theta=v.rope_theta), d // 2)
    ang = jnp.asarray(positions)[..., None].astype(F32) * jnp.asarray(inv)  # [N, 2, d/4]
    ang = ang.reshape(ang.shape[0], 1, d // 2)
    return jnp.cos(ang), jnp.sin(ang)


def _block(v: VisionSpec, p, x, full, cos, sin, lay: Layout, both: bool):
    """One pre-norm block: x += proj(attn(RMS(x))); x += down(silu(gate) * up)(RMS(x)). All linears biased."""
    H, K, d = v.num_heads, v.num_kv_heads or v.num_heads, v.head_dim
    with jax.named_scope("attention"):
        a = norm(x, p["norm1"], v.norm_eps, "rms")
        qkv = linear(a, p["wqkv"]) + p["bqkv"]
        q, k, val = jnp.split(qkv, [H * d, (H + K) * d], axis=-1)
        q, k, val = q.reshape(-1, H, d), k.reshape(-1, K, d), val.reshape(-1, K, d)
        # RoPE in fp32 and cast back (HF apply_rotary_pos_emb_vision)
        q = rope.apply(q.astype(F32), cos, sin, interleaved=False).astype(x.dtype)
        k = rope.apply(k.astype(F32), cos, sin, interleaved=False).astype(x.dtype)
        scale = d ** -0.5
        windowed = functools.partial(_attend_segments, seg=lay.windows, scale=scale)
        whole = functools.partial(_attend_segments, seg=lay.frames, scale=scale)
        if both:
            o = jax.lax.cond(full, whole, windowed, q, k, val)
        else:
            o = (whole if full else windowed)(q, k, val)
        x = x + (linear(o.reshape(-1, H * d), p["wo"]) + p["bo"])
    with jax.named_scope("mlp"):
        a = norm(x, p["norm2"], v.norm_eps, "rms")
        x = x + mlp.gated(MLPSpec(activation=v.activation, bias=True), p, a)
    return x


def encode(v: VisionSpec, p, pixel_values, grid_thw) -> jax.Array:
    """Images (or video frames) to merged features: [sum_i t_i*h_i*w_i / merge^2, out_hidden_size].

    pixel_values [N, 3*T*patch^2] in the Qwen2-VL image processor's layout (per image and frame, 2x2-block-major
    patches, each flattened (c, t, ph, pw)); grid_thw [N_img, 3] (t, h, w) in patches, host-side ints (static under
    jit: pass a tuple of tuples). p: `plan.vision_param_specs` for kind window_vit, matrices [in, out].
    The output is in the raster order of merge blocks, image by image, frame by frame: the order HF's
    `pooler_output` has and in which `Exaone4_5_Model` splices it into the image-token positions.
    """
    if v.kind != "window_vit":
        raise ValueError(f"window_vit.encode got a vision spec of kind {v.kind!r}")
    m = v.merge_size
    units = v.window_size // m // v.patch_size
    if units < 1:
        raise ValueError(f"window_size {v.window_size} is less than one merge unit ({m} x {v.patch_size} pixels)")
    grid = _grid(grid_thw)
    lay = layout(m, units, grid)
    n = lay.positions.shape[0]
    width = 3 * v.temporal_patch_size * v.patch_size ** 2
    if pixel_values.shape != (n, width):
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: grid_thw {grid} needs [{n}, {width}]")

    with jax.named_scope("patch_embed"):  # Conv3d, kernel = stride, no bias: a matmul in the weight dtype
        x = linear(pixel_values.astype(p["patch"].dtype), p["patch"])
    cos, sin = _rope_tables(v, lay.positions)
    full = np.array([i in v.full_blocks for i in range(v.num_layers)])
    both = bool(full.any() and not full.all())

    def body(x, inp):
        lp, f = inp
        with jax.named_scope("vision_block"):
            return _block(v, lp, x, f if both else bool(full[0]), cos, sin, lay, both), None

    x, _ = jax.lax.scan(body, x, (p["layers"], jnp.asarray(full)))

    with jax.named_scope("merger"):  # RMS, then each merge block's m*m consecutive tokens side by side
        mp = p["merger"]
        z = norm(x, mp["norm"], v.norm_eps, "rms").reshape(n // (m * m), m * m * x.shape[-1])
        z = jax.nn.gelu(linear(z, mp["w1"]) + mp["b1"], approximate=False)
        return linear(z, mp["w2"]) + mp["b2"]
