"""Vision towers and projectors (specs/vision.md): images -> the embeddings that replace a prompt's image tokens.

`encode(v, p, images)` dispatches on `VisionSpec.kind` and returns (features [M, D], valid [M]): one row per image
token in the order the prompt's placeholders take them, padded rows marked invalid (Pixtral runs the padded batch
and masks, so images of different sizes share one compilation). `splice` writes the valid rows over the image
tokens' embeddings, in order, as HF's `masked_scatter`.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.config import MLPSpec
from jaxmodels.layers import mlp
from jaxmodels.layers.attention import unordered
from jaxmodels.layers.norms import layer_norm, norm

F32 = jnp.float32


def patchify(pixels, p: int):
    """[N, C, H, W] -> [N, H/p, W/p, C*p*p]: a kernel = stride = p conv's input patches, flattened (c, kh, kw)."""
    N, C, H, W = pixels.shape
    x = pixels.reshape(N, C, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
    return x.reshape(N, H // p, W // p, C * p * p)


def activation(name: str, x):
    """The activation of an ungated tower MLP (SigLIP's, Mllama's): silu, erf GELU or tanh GELU."""
    if name in ("gelu", "gelu_tanh"):
        return jax.nn.gelu(x, approximate=name == "gelu_tanh")
    if name == "silu":
        return jax.nn.silu(x)
    raise NotImplementedError(f"vision towers have no activation {name!r}")


def _heads(x, lp, names):
    """q, k, v [N, T, H, d] (projections and their biases where present)."""
    out = []
    for n in names:
        y = jnp.einsum("ntc,chd->nthd", x, lp["w" + n])
        out.append(y + lp["b" + n] if "b" + n in lp else y)
    return out


def _kv_first(a):  # [N, T, H, d] -> [N, H, T, d], the layout attention reads keys and values in
    return a.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------------------------- SigLIP (Gemma3)
def siglip(v, p, pixel_values):
    """pixel_values [N, 3, S, S] -> the post-layernorm last hidden state [N, (S/p)^2, C] (specs §1.3)."""
    dt = p["patch"].dtype
    x = patchify(pixel_values.astype(dt), v.patch_size)
    N = x.shape[0]
    x = x.reshape(N, -1, x.shape[-1]) @ p["patch"] + p["patch_bias"] + p["pos"]

    def layer(x, lp):
        a = layer_norm(x, lp["ln1"]["w"], lp["ln1"]["b"], v.norm_eps)
        q, k, val = _heads(a, lp, "qkv")
        o = unordered(q, _kv_first(k), _kv_first(val), scale=v.head_dim ** -0.5)
        x = x + jnp.einsum("nthd,hdc->ntc", o, lp["wo"]) + lp["bo"]
        a = layer_norm(x, lp["ln2"]["w"], lp["ln2"]["b"], v.norm_eps)
        return x + activation(v.activation, a @ lp["fc1"] + lp["b1"]) @ lp["fc2"] + lp["b2"], None

    x, _ = jax.lax.scan(layer, x, p["layers"])
    return layer_norm(x, p["post_norm"]["w"], p["post_norm"]["b"], v.norm_eps)


def gemma3_projector(v, p, x):
    """[N, (S/p)^2, C] -> [N, tokens_per_image, D]: k x k average pool of the patch grid, (1+w) RMS norm, x @ W
    (W is [C, D] as stored: no transpose), cast back to the tower's dtype (specs §1.4)."""
    N, P, C = x.shape
    side, per = int(round(P ** 0.5)), int(round(v.tokens_per_image ** 0.5))
    k = side // per
    pooled = x.astype(F32).reshape(N, per, k, per, k, C).mean(axis=(2, 4)).astype(x.dtype).reshape(N, -1, C)
    y = norm(pooled, p["norm"], v.projector_eps, "gemma")
    return (y @ p["w"]).astype(x.dtype)


# ----------------------------------------------------------------------------------------------- Pixtral (Mistral3)
def _axial_rope(v, rows: int, cols: int, dtype):
    """cos, sin [rows * cols, d] of Pixtral's 2-D RoPE in row-major patch order: rows take the even-index
    frequencies, columns the odd ones; computed in fp32 and cast to the model dtype, as HF."""
    d = v.head_dim
    inv = (np.float32(1.0) / (np.float32(v.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d))))
    i, j = np.meshgrid(np.arange(rows, dtype=np.float32), np.arange(cols, dtype=np.float32), indexing="ij")
    ang = np.concatenate([i.reshape(-1, 1) * inv[0::2], j.reshape(-1, 1) * inv[1::2]], axis=-1).astype(np.float32)
    ang = np.concatenate([ang, ang], axis=-1)
    return jnp.asarray(np.cos(ang), dtype), jnp.asarray(np.sin(ang), dtype)


def _rotate(x, cos, sin):  # x [N, T, H, d], cos/sin [T, d]: q*cos + rotate_half(q)*sin in x's dtype
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos[None, :, None] + rot * sin[None, :, None]


def pixtral(v, p, pixel_values, image_sizes=None):
    """pixel_values [N, 3, H, W] (zero-padded), image_sizes [N, 2] (each image's own H', W'; None: the padded size)
    -> (hidden state `feature_layer` [N, H/p, W/p, C], each image's patch grid [N, 2]). Each image attends to itself only
    (HF's block-diagonal mask over the packed patches), so running the padded grid with its padding masked is
    the same arithmetic; RoPE positions are grid coordinates."""
    dt = p["patch"].dtype
    N, _, H, W = pixel_values.shape
    ps = v.patch_size
    x = patchify(pixel_values.astype(dt), ps) @ p["patch"]
    gh, gw = x.shape[1], x.shape[2]
    sizes = jnp.full((N, 2), jnp.array([H, W])) if image_sizes is None else jnp.asarray(image_sizes, jnp.int32)
    valid = ((jnp.arange(gh)[None, :, None] < sizes[:, 0, None, None] // ps)
             & (jnp.arange(gw)[None, None, :] < sizes[:, 1, None, None] // ps))
    x = norm(x.reshape(N, gh * gw, -1), p["ln_pre"], 1e-5, "rms")
    cos, sin = _axial_rope(v, gh, gw, dt)
    allowed = jnp.broadcast_to(valid.reshape(N, 1, gh * gw), (N, gh * gw, gh * gw))

    def layer(x, lp):
        a = norm(x, lp["attn_norm"], 1e-5, "rms")
        q, k, val = _heads(a, lp, "qkv")
        o = unordered(_rotate(q, cos, sin), _kv_first(_rotate(k, cos, sin)), _kv_first(val), allowed,
                   scale=v.head_dim ** -0.5)
        x = x + jnp.einsum("nthd,hdc->ntc", o, lp["wo"])
        a = norm(x, lp["mlp_norm"], 1e-5, "rms")
        return x + mlp.gated(MLPSpec(activation=v.activation), lp, a), None

    L = v.num_layers
    run = v.feature_layer if v.feature_layer >= 0 else L + 1 + v.feature_layer  # hidden_states[0]: after ln_pre
    x, _ = jax.lax.scan(layer, x, jax.tree.map(lambda a: a[:run], p["layers"]))
    return x.reshape(N, gh, gw, -1), sizes // ps


def mistral3_projector(v, p, x, grid):
    """(x [N, gh, gw, C], each image's patch grid [N, 2]) -> (features [N * gh/m * gw/m, D], valid): RMS norm, the
    m x m patch merger (channel-major, F.unfold's layout; an odd last row or column of patches is dropped, as HF's
    unfold drops it), linear -> GELU(erf) -> linear (specs §2.4)."""
    N, gh, gw, C = x.shape
    m = v.merge_size
    y = norm(x, p["norm"], v.projector_eps, "rms")
    y = y.reshape(N, gh // m, m, gw // m, m, C).transpose(0, 1, 3, 5, 2, 4).reshape(N, gh // m, gw // m, C * m * m)
    y = y @ p["merge"]
    y = y @ p["w1"] + p["b1"] if "b1" in p else y @ p["w1"]
    y = jax.nn.gelu(y, approximate=False)
    y = y @ p["w2"] + p["b2"] if "b2" in p else y @ p["w2"]
    merged = grid // m
    valid = ((jnp.arange(gh // m)[None, :, None] < merged[:, 0, None, None])
             & (jnp.arange(gw // m)[None, None, :] < merged[:, 1, None, None]))
    return y.reshape(-1, y.shape[-1]), valid.reshape(-1)


# ----------------------------------------------------------------------------------------------- dispatch
def encode(v, p, images: dict):
    """The image tokens' embeddings of a batch of processed images (HF processor names) -> (features [M, D],
    valid [M] bool)."""
    if v.kind == "siglip":
        z = gemma3_projector(v, p["projector"], siglip(v, p, images["pixel_values"]))
        z = z.reshape(-1, z.shape[-1])
        return z, jnp.ones(z.shape[:1], bool)
    if v.kind == "pixtral":
        x, grid = pixtral(v, p, images["pixel_values"], images.get("image_sizes"))
        return mistral3_projector(v, p["projector"], x, grid)
    if v.kind == "deepseek_vit":  # every position of each image's span, delimiters included
        from jaxmodels.layers import deepseek_vision

        return deepseek_vision.encode(v, p, images["pixel_values"], images["image_grid_hw"])
    from jaxmodels.layers import window_vit

    z = window_vit.encode(v, p, images["pixel_values"], images["image_grid_thw"])
    return z, jnp.ones(z.shape[:1], bool)


def splice(x, tokens, image_token_id: int | None, features, valid):
    """x [B, T, D] with the image tokens' rows replaced, in order (row-major over the batch), by the valid feature
    rows (cast to x's dtype); the caller checks that the counts agree. image_token_id None: `tokens` is the
    boolean mask of the image tokens."""
    B, T, D = x.shape
    feats = features[jnp.argsort(~valid, stable=True)]  # the valid rows first, in order
    is_img = tokens if image_token_id is None else tokens == image_token_id
    idx = jnp.clip(jnp.cumsum(is_img.reshape(-1)) - 1, 0, feats.shape[0] - 1)
    rows = feats[idx].reshape(B, T, D).astype(x.dtype)
    return jnp.where(is_img[..., None], rows, x)


def image_blocks(token_type_ids):
    """Gemma3's bidirectional image regions: [B, T] int32, the index of the contiguous run of token_type 1 a token
    belongs to, -1 for text (specs §1.5)."""
    img = jnp.asarray(token_type_ids) == 1
    starts = img & ~jnp.pad(img, ((0, 0), (1, 0)))[:, :-1]
    return jnp.where(img, jnp.cumsum(starts, axis=1) - 1, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------- host side
ACCEPTED = {"siglip": ("pixel_values", "token_type_ids"), "pixtral": ("pixel_values", "image_sizes"),
            "window_vit": ("pixel_values", "image_grid_thw"),
            "mllama": ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask"),
            "deepseek_vit": ("pixel_values", "image_grid_hw")}
STATIC = ("image_grid_thw", "image_grid_hw")  # decide shapes: passed to jit as static values


def image_tokens(v, images: dict) -> int:
    """How many image tokens these processed images fill (host side, from the shapes and sizes)."""
    pv = np.shape(images["pixel_values"])
    if v.kind == "siglip":
        return pv[0] * v.tokens_per_image
    if v.kind == "pixtral":
        grid = np.asarray(images.get("image_sizes", [pv[2:]] * pv[0])) // v.patch_size // v.merge_size
        return int(np.sum(grid[:, 0] * grid[:, 1]))
    if v.kind == "deepseek_vit":
        from jaxmodels.layers import deepseek_vision

        return sum(deepseek_vision.span_tokens(v, deepseek_vision.grids(images["image_grid_hw"])))
    thw = np.asarray(images["image_grid_thw"])
    return int(np.sum(np.prod(thw, axis=1))) // v.merge_size ** 2


def inputs(cfg, tokens: np.ndarray, given: dict) -> tuple[dict, tuple]:
    """Check a forward's vision inputs against the model and the prompt's image tokens on the host -> (arrays for
    jit, static values as a hashable tuple). ValueError naming the problem: images for a text-only model, a name
    this family does not take, pixel values of the wrong rank or size, image token counts that disagree."""
    given = {k: val for k, val in given.items() if val is not None}
    if not given:
        return {}, ()
    v = cfg.vision
    if v is None:
        raise ValueError(f"this {cfg.family} model has no vision tower: it takes no {', '.join(sorted(given))}")
    if (why := v.problem()) is not None:
        raise ValueError(f"this {cfg.family} model cannot take images: {why}")
    unknown = sorted(set(given) - set(ACCEPTED[v.kind]))
    if unknown:
        raise ValueError(f"{cfg.family} takes {', '.join(ACCEPTED[v.kind])}, not {', '.join(unknown)}")
    arrays = {k: np.asarray(val) for k, val in given.items()}
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, length] with images, got shape {list(tokens.shape)}")
    for name, rank in (("token_type_ids", 2), ("cross_attention_mask", 4)):  # per token: the tokens' [B, T] first
        a = arrays.get(name)
        if a is not None and (a.ndim != rank or a.shape[:2] != tokens.shape
                              or not (np.issubdtype(a.dtype, np.integer) or a.dtype == bool)):
            raise ValueError(f"{name} must be {rank}-D integers starting with the tokens' {list(tokens.shape)}, "
                             f"got {a.dtype} {list(a.shape)}")
    if "pixel_values" not in arrays:
        return {k: jnp.asarray(a) for k, a in arrays.items()}, ()
    pv = arrays["pixel_values"]
    if not np.issubdtype(pv.dtype, np.floating):
        raise ValueError(f"pixel_values must be floating point, got {pv.dtype}")
    if v.kind == "mllama":
        _mllama_inputs(v, tokens.shape, arrays)
        return {k: jnp.asarray(a) for k, a in arrays.items()}, ()
    if v.kind == "deepseek_vit":
        from jaxmodels.layers import deepseek_vision

        if "image_grid_hw" not in arrays:
            raise ValueError(f"{cfg.family} takes image_grid_hw (each image's patch rows and columns) with "
                             "pixel_values")
        grid = deepseek_vision.grids(arrays["image_grid_hw"])
        want = [deepseek_vision.patches(grid), 3, v.patch_size, v.patch_size]
        if list(pv.shape) != want:
            raise ValueError(f"pixel_values must be {want} (the patches of image_grid_hw {[list(g) for g in grid]}), "
                             f"got {list(pv.shape)}")
    elif v.kind == "window_vit":
        want = 3 * v.temporal_patch_size * v.patch_size ** 2
        if pv.ndim != 2 or pv.shape[1] != want:
            raise ValueError(f"pixel_values must be [patches, {want}], got {list(pv.shape)}")
        if "image_grid_thw" not in arrays or int(np.prod(arrays["image_grid_thw"], axis=1).sum()) != pv.shape[0]:
            raise ValueError("image_grid_thw must give one (t, h, w) per image whose patches sum to pixel_values'")
    elif pv.ndim != 4 or pv.shape[1] != 3:
        raise ValueError(f"pixel_values must be [images, 3, height, width], got {list(pv.shape)}")
    elif v.kind == "siglip" and pv.shape[2:] != (v.image_size, v.image_size):
        raise ValueError(f"pixel_values must be {v.image_size}x{v.image_size} images, got {pv.shape[2]}x{pv.shape[3]}")
    elif v.kind == "pixtral":
        cell = v.patch_size * v.merge_size
        sizes = arrays.setdefault("image_sizes", np.tile(np.asarray(pv.shape[2:]), (pv.shape[0], 1)))
        if sizes.shape != (pv.shape[0], 2) or (sizes < cell).any() or (sizes > np.asarray(pv.shape[2:])).any():
            raise ValueError(f"image_sizes must be [{pv.shape[0]}, 2] sizes of at least {cell} within pixel_values'"
                             f" {pv.shape[2]}x{pv.shape[3]}, got {sizes.tolist()}")
        if pv.shape[2] % cell or pv.shape[3] % cell:
            raise ValueError(f"pixel_values' height and width must be multiples of {cell}, got {list(pv.shape[2:])}")
    need, have = image_tokens(v, arrays), int(np.sum(tokens == v.image_token_id))
    if need != have:
        raise ValueError(f"the images fill {need} image tokens (id {v.image_token_id}) but the tokens hold {have}")
    if v.kind == "deepseek_vit":
        deepseek_vision.check_spans(v, tokens, grid)
    static = tuple((k, tuple(map(tuple, arrays.pop(k).tolist()))) for k in STATIC if k in arrays)
    return {k: jnp.asarray(a) for k, a in arrays.items()}, static


def _mllama_inputs(v, shape, a: dict) -> None:
    """Mllama's inputs agree with each other and the tokens [B, T] (nothing is spliced: the cross-attention layers
    read the images where cross_attention_mask lets each token see them)."""
    B, T = shape
    S = v.image_size
    pv = a["pixel_values"]
    if pv.ndim != 6 or pv.shape[0] != B or pv.shape[2:] != (v.max_tiles, 3, S, S):
        raise ValueError(f"pixel_values must be [{B}, images, {v.max_tiles}, 3, {S}, {S}], got {list(pv.shape)}")
    N = pv.shape[1]
    want = {"aspect_ratio_ids": (B, N), "aspect_ratio_mask": (B, N, v.max_tiles),
            "cross_attention_mask": (B, T, N, v.max_tiles)}
    for name, shape_ in want.items():
        if name not in a:
            raise ValueError(f"mllama needs {name} with pixel_values")
        if a[name].shape != shape_:
            raise ValueError(f"{name} must be {list(shape_)}, got {list(a[name].shape)}")
    ids = a["aspect_ratio_ids"]
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() > len(v.aspect_ratios):
        raise ValueError(f"aspect_ratio_ids must be integers in [0, {len(v.aspect_ratios)}]")
