"""DeepSeek V4.1's vision tower: images -> the embeddings of their whole token spans (specs/deepseek_v4.md §9).

The reference is upstream DeepSeek-V4.1-Flash@dba1be0a `inference/vision.py` (ViT, Aligner) and `inference/model.py`
(`Transformer.encode_image`, `merge_image_embeddings`), vendored byte for byte in tenstorrent/tt-metal
`models/demos/deepseek_v3_d_p/reference/deepseek_v41/`.

An image is a grid of n_h x n_w patches (`jaxmodels.images.deepseek_v41` lays them out row-major, each patch
flattened (channel, row, column)). The ViT, over one image at a time in the reference:
  patch embedding  a Linear with bias on the 3*p*p patch values;
  blocks           x += wo(attn(norm1 x)), x += w2(silu(gate) * up) with [gate | up] = w1(norm2 x): one fused qkv
                   Linear and the output Linear with biases, the MLP without; attention bidirectional over the
                   image, scale d^-1/2; 2-D RoPE on q and k: the first half of each head turns against the second
                   half by [row * f, column * f] with d/4 frequencies f_j = theta^(-4j/d), in fp32;
  norms            RMSNorm with eps 1e-6 (the reference's default, not the text model's 1e-20), statistics and
                   weight in fp32, then cast (`norms.norm` kind rms_fp32); a final norm after the blocks.
The aligner pads the feature grid with zeros to multiples of r = merge_size (bottom and right, after the final norm),
takes each r x r block as one C*r*r vector in F.unfold's channel-major order (c*r*r + kh*r + kw) and maps it with
Linear -> GELU (erf) -> Linear, both with biases, to the text width: ceil(n_h/r) x ceil(n_w/r) rows, reading order.

In the prompt an image is the span [start] + ([image] * w + [newline]) * h + [end] over that h x w grid, every
position holding the image token id: start, end and newline take learned rows, the image slots the aligner rows.
`encode` returns the rows of every image's span, image after image, so `vision.splice` writes them over the image
tokens as it does for the other families. The whole span counts as image for the decoder: its tokens pick experts
with the router's bias_vl and take no part in Engram (model.py, from the image token id).

Here the images of a request run as one batch [images, longest grid, C] whose padding is masked out of attention
(each image attends to itself only): per token the reference's arithmetic. The grids decide every shape, so they
are static host ints; `layout` makes the positions and gathers with NumPy.
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
START, END, NEWLINE = 0, 1, 2  # rows of the delimiter table; the aligner rows follow them
_SWIGLU = MLPSpec(activation="silu")


def token_grid(grid: tuple[int, int], r: int) -> tuple[int, int]:
    """The aligner's rows x columns for a patch grid (n_h, n_w): ceil(n/r) each (the padded blocks count)."""
    return -(-grid[0] // r), -(-grid[1] // r)


def span_length(rows: int, cols: int) -> int:
    """Tokens of an image whose aligner grid is rows x cols: start, each row and its newline, end."""
    return rows * (cols + 1) + 2


def grids(image_grid_hw) -> tuple[tuple[int, int], ...]:
    """[images, 2] (n_h, n_w) patch grids as a tuple of int pairs; ValueError unless each is two ints >= 1."""
    a = np.asarray(image_grid_hw)
    if a.ndim != 2 or a.shape[1] != 2 or not a.shape[0] or not np.issubdtype(a.dtype, np.integer) or (a < 1).any():
        raise ValueError(f"image_grid_hw must be [images, 2] patch rows and columns (integers >= 1), got "
                         f"{a.dtype} {list(a.shape)}" + (f" {a.tolist()}" if a.size <= 8 else ""))
    return tuple((int(h), int(w)) for h, w in a)


def span_tokens(v: VisionSpec, grid: tuple[tuple[int, int], ...]) -> list[int]:
    """Each image's span length in tokens."""
    return [span_length(*token_grid(g, v.merge_size)) for g in grid]


def patches(grid: tuple[tuple[int, int], ...]) -> int:
    """The patches of all images: the rows of pixel_values."""
    return sum(h * w for h, w in grid)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Host tables of one request's grids. length: the longest image's patches (the batch's width);
    positions [images, length, 2] (row, column) of each slot; valid [images, length]: the slot holds a patch;
    patches [images, length]: the row of pixel_values in each slot (one past the last: a zero row);
    unfold [aligner rows, r*r]: the flat slot (image * length + patch) feeding each position kh*r + kw of each
    aligner block (images * length: the zero padding); span [span tokens]: the row of [start, end, newline,
    aligner rows...] each position of the spans takes."""

    length: int
    positions: np.ndarray
    valid: np.ndarray
    patches: np.ndarray
    unfold: np.ndarray
    span: np.ndarray


@functools.lru_cache(maxsize=64)
def layout(r: int, grid: tuple[tuple[int, int], ...]) -> Layout:
    n = len(grid)
    length = max(h * w for h, w in grid)
    positions = np.zeros((n, length, 2), np.int32)
    valid = np.zeros((n, length), bool)
    patches = np.full((n, length), sum(h * w for h, w in grid), np.int32)
    unfold, span, first, rows = [], [], 0, 3
    for i, (h, w) in enumerate(grid):
        k = np.arange(h * w)
        positions[i, : h * w] = np.stack([k // w, k % w], -1)
        valid[i, : h * w] = True
        patches[i, : h * w] = first + k
        first += h * w
        th, tw = token_grid((h, w), r)
        for bi in range(th):
            for bj in range(tw):
                ii = bi * r + np.arange(r)[:, None]  # [r, 1] patch rows of the block
                jj = bj * r + np.arange(r)[None, :]  # [1, r] patch columns
                inside = (ii < h) & (jj < w)
                unfold.append(np.where(inside, i * length + ii * w + jj, n * length).reshape(-1))
        span.append(START)
        for bi in range(th):
            span.extend(rows + bi * tw + np.arange(tw))
            span.append(NEWLINE)
        span.append(END)
        rows += th * tw
    return Layout(length, positions, valid, patches, np.asarray(unfold, np.int32), np.asarray(span, np.int32))


def _rope_tables(v: VisionSpec, positions: np.ndarray):
    """cos, sin [images, length, 1, d/2] fp32: angles [row * f, column * f] with f the d/4 frequencies
    theta^(-2j/(d/2)) (the reference's `get_vision_cos_sin` over rope_dim = d/2)."""
    d = v.head_dim
    inv, _ = rope.inv_freq(RopeSpec(theta=v.rope_theta), d // 2)
    ang = positions.astype(np.float32)[..., None] * np.asarray(inv, np.float32)  # [N, L, 2, d/4]
    ang = ang.reshape(*positions.shape[:2], 1, d // 2)
    return jnp.asarray(np.cos(ang)), jnp.asarray(np.sin(ang))


def _block(v: VisionSpec, p, x, cos, sin, allowed):
    """One pre-norm ViT block over x [images, length, C]."""
    N, L, C = x.shape
    H, d = v.num_heads, v.head_dim
    with jax.named_scope("attention"):
        a = norm(x, p["norm1"], v.norm_eps, "rms_fp32")
        q, k, val = jnp.split(linear(a, p["wqkv"]) + p["bqkv"], 3, axis=-1)
        q, k, val = (t.reshape(N, L, H, d) for t in (q, k, val))
        # the halves of each head, in fp32, cast back (the reference's apply_rotary)
        q = rope.apply(q.astype(F32), cos, sin, interleaved=False).astype(x.dtype)
        k = rope.apply(k.astype(F32), cos, sin, interleaved=False).astype(x.dtype)
        o = attention.unordered(q, k.transpose(0, 2, 1, 3), val.transpose(0, 2, 1, 3), allowed, scale=d ** -0.5)
        x = x + (linear(o.reshape(N, L, C), p["wo"]) + p["bo"])
    with jax.named_scope("mlp"):
        a = norm(x, p["norm2"], v.norm_eps, "rms_fp32")
        gate, up = jnp.split(linear(a, p["w_gate_up"]), 2, axis=-1)
        return x + linear(mlp.activate(_SWIGLU, gate, up), p["w_down"])


def vit(v: VisionSpec, p, pixel_values, grid: tuple[tuple[int, int], ...]):
    """pixel_values [patches, 3, p, p] (the images' patches one after another) -> the final-norm features
    [images, length, C] of `layout(...)`'s slots (padding slots hold values nobody reads)."""
    lay = layout(v.merge_size, grid)
    dt = p["patch"].dtype
    flat = pixel_values.reshape(pixel_values.shape[0], -1).astype(dt)
    flat = jnp.concatenate([flat, jnp.zeros((1, flat.shape[1]), dt)])
    with jax.named_scope("patch_embed"):
        x = linear(flat[jnp.asarray(lay.patches)], p["patch"]) + p["patch_bias"]
    cos, sin = _rope_tables(v, lay.positions)
    allowed = jnp.broadcast_to(jnp.asarray(lay.valid)[:, None, :], (len(grid), lay.length, lay.length))

    def body(x, lp):
        with jax.named_scope("vision_block"):
            return _block(v, lp, x, cos, sin, allowed), None

    x, _ = jax.lax.scan(body, x, p["layers"])
    return norm(x, p["norm"], v.norm_eps, "rms_fp32")


def aligner(v: VisionSpec, p, x, grid: tuple[tuple[int, int], ...]):
    """ViT features [images, length, C] -> aligner rows [sum of ceil(n_h/r) * ceil(n_w/r), D], image by image."""
    lay = layout(v.merge_size, grid)
    N, L, C = x.shape
    r = v.merge_size
    flat = jnp.concatenate([x.reshape(N * L, C), jnp.zeros((1, C), x.dtype)])
    blocks = flat[jnp.asarray(lay.unfold)]  # [M, r*r, C]
    blocks = blocks.transpose(0, 2, 1).reshape(-1, C * r * r)  # channel-major: c*r*r + kh*r + kw
    h = jax.nn.gelu(linear(blocks, p["w1"]) + p["b1"], approximate=False)
    return linear(h, p["w2"]) + p["b2"]


def encode(v: VisionSpec, p, pixel_values, image_grid_hw):
    """The embeddings of every image's span, in order -> (features [span tokens, D], valid [span tokens]).
    p: `plan.vision_param_specs` of kind deepseek_vit; image_grid_hw: each image's (n_h, n_w) patch grid, host
    ints (static under jit)."""
    if v.kind != "deepseek_vit":
        raise ValueError(f"deepseek_vision.encode got a vision spec of kind {v.kind!r}")
    grid = grids(image_grid_hw)
    n = patches(grid)
    if tuple(pixel_values.shape) != (n, 3, v.patch_size, v.patch_size):
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: image_grid_hw {grid} needs "
                         f"[{n}, 3, {v.patch_size}, {v.patch_size}]")
    z = aligner(v, p["projector"], vit(v, p, pixel_values, grid), grid)
    delimiters = jnp.stack([p["image_start"], p["image_end"], p["image_newline"]]).astype(z.dtype)
    rows = jnp.concatenate([delimiters, z])[jnp.asarray(layout(v.merge_size, grid).span)]
    return rows, jnp.ones(rows.shape[:1], bool)


def check_spans(v: VisionSpec, tokens: np.ndarray, grid: tuple[tuple[int, int], ...]) -> None:
    """Each image's span lies on consecutive image tokens, images in order (row-major over the batch) — what the
    splice assumes: ValueError naming the image and where its span breaks. The counts were checked before."""
    lengths, i, left = span_tokens(v, grid), 0, 0
    for b, row in enumerate(np.asarray(tokens)):
        for t, is_image in enumerate(row == v.image_token_id):
            if is_image:
                if left == 0:
                    left = lengths[i]
                    i += 1
                left -= 1
            elif left:
                raise ValueError(f"image {i - 1}'s span of {lengths[i - 1]} image tokens (id {v.image_token_id}) is "
                                 f"broken by token {int(row[t])} at row {b} position {t}: an image's tokens must be "
                                 "consecutive")
        if left:
            raise ValueError(f"image {i - 1}'s span of {lengths[i - 1]} image tokens runs past the end of row {b}")
