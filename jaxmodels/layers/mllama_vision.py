"""Llama 3.2 Vision's tiled encoder and projector (specs/vision.md §3.3; HF 5.24 `MllamaVisionModel` followed by
`multi_modal_projector` and the reshape `MllamaModel` / the cross-attention layers apply): processed images -> the
`cross_states` every cross-attention layer of the decoder reads its keys and values from.

Each image is its T = max_tiles tiles of (S/p)^2 patches plus a CLS token, NP tokens a tile, padded to a multiple
of 8 (Lp). All T * Lp tokens of an image attend jointly in the local and the global encoder; only pairs where both
tokens are invalid (a pad slot, or a tile the aspect-ratio mask drops) are masked, so valid tokens do read pad
tiles and pad slots. The B * N_img images run as one batch; every input is a traced array (runs under jax.jit).
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxmodels.layers.attention import unordered
from jaxmodels.layers.norms import layer_norm
from jaxmodels.layers.vision import activation, patchify

LN_EPS = 1e-5  # layernorm_pre / layernorm_post: nn.LayerNorm's default, whatever norm_eps says


def tokens_per_tile(v) -> int:
    """NP: the patches of one tile plus its CLS token (1601 at 560 px / 14)."""
    return (v.image_size // v.patch_size) ** 2 + 1


def padded_tokens_per_tile(v) -> int:
    """Lp: NP padded with zero slots to a multiple of 8 (1608), the encoders' per-tile length."""
    n = tokens_per_tile(v)
    return n + (8 - n % 8) % 8


def _layer(v, x, lp, allowed, gated: bool):
    """One `MllamaVisionEncoderLayer`: x [N, S, C] -> [N, S, C]. Pre-LN (eps norm_eps), bias-free q/k/v/o over
    H heads (scale d^-1/2), fc1 -> act -> fc2 with biases; global layers scale both branches by tanh(gate)."""
    a = layer_norm(x, lp["ln1"]["w"], lp["ln1"]["b"], v.norm_eps)
    q, k, val = (jnp.einsum("nsc,chd->nshd", a, lp[w]) for w in ("wq", "wk", "wv"))
    o = unordered(q, k.transpose(0, 2, 1, 3), val.transpose(0, 2, 1, 3), allowed, scale=v.head_dim ** -0.5)
    h = jnp.einsum("nshd,hdc->nsc", o, lp["wo"])
    x = x + (jnp.tanh(lp["gate_attn"]) * h if gated else h)
    a = layer_norm(x, lp["ln2"]["w"], lp["ln2"]["b"], v.norm_eps)
    h = activation(v.activation, a @ lp["fc1"] + lp["b1"]) @ lp["fc2"] + lp["b2"]
    return x + (jnp.tanh(lp["gate_ffn"]) * h if gated else h)


def _tile_embedding(p, ids, T: int, C: int):
    """tanh(gate) * embedding[id] as [N, T, 1, C]: one vector per tile, added to every token of it."""
    return jnp.tanh(p["gate"]) * p["embedding"][ids].reshape(-1, T, 1, C)


def _local(v, p, x, allowed):
    """The ungated local encoder as one scan -> (last output [N, S, C], the outputs of the layers in
    `intermediate_layers`, in that order, [k, N, S, C]). 5.24 records each layer's OUTPUT (specs §3.6): index i is
    what local layer i returns. The recorded states live in a carry of one row per distinct index plus a scratch
    row that the other layers write to."""
    wanted = sorted(set(v.intermediate_layers))
    slot = np.full(v.num_layers, len(wanted), np.int32)
    slot[wanted] = np.arange(len(wanted), dtype=np.int32)

    def step(carry, xs):
        x, kept = carry
        lp, s = xs
        x = _layer(v, x, lp, allowed, gated=False)
        return (x, jax.lax.dynamic_update_index_in_dim(kept, x, s, 0)), None

    kept = jnp.zeros((len(wanted) + 1, *x.shape), x.dtype)
    (x, kept), _ = jax.lax.scan(step, (x, kept), (p["layers"], jnp.asarray(slot)))
    return x, kept[jnp.asarray([wanted.index(i) for i in v.intermediate_layers], jnp.int32)]


def features(v, p, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
    """`MllamaVisionModel(...).last_hidden_state`: pixel_values [B, N_img, T, 3, S, S], aspect_ratio_ids [B, N_img]
    (k >= 1: aspect_ratios[k-1]; 0: no image), aspect_ratio_mask [B, N_img, T] (1: a real tile)
    -> [B, N_img, T, NP, C * (1 + len(intermediate_layers))]: per token (CLS first, pad slots dropped, pad tiles
    kept) the global encoder's output, then the recorded local outputs interleaved, feature C + c*k + j being
    channel c of intermediate j. No final norm."""
    B, M, T = pixel_values.shape[:3]
    S, C = v.image_size, v.hidden_size
    if pixel_values.shape[2:] != (v.max_tiles, 3, S, S):
        raise ValueError(f"pixel_values must be [batch, images, {v.max_tiles}, 3, {S}, {S}], "
                         f"got {list(pixel_values.shape)}")
    if aspect_ratio_ids.shape != (B, M) or aspect_ratio_mask.shape != (B, M, T):
        raise ValueError(f"aspect_ratio_ids must be [{B}, {M}] and aspect_ratio_mask [{B}, {M}, {T}], got "
                         f"{list(aspect_ratio_ids.shape)} and {list(aspect_ratio_mask.shape)}")
    N, NP, Lp = B * M, tokens_per_tile(v), padded_tokens_per_tile(v)
    dt = p["patch"].dtype
    ids = aspect_ratio_ids.reshape(N)

    with jax.named_scope("mllama_embed"):
        x = patchify(pixel_values.reshape(N * T, 3, S, S).astype(dt), v.patch_size)
        x = x.reshape(N, T, NP - 1, -1) @ p["patch"]
        x = x + _tile_embedding(p["pre_tile"], ids, T, C)  # before CLS: CLS gets no pre-tile term
        cls = jnp.broadcast_to(p["class_embedding"].astype(dt), (N, T, 1, C))
        x = jnp.concatenate([cls, x], axis=2)
        g = jnp.tanh(p["pos"]["gate"])
        x = x + (1 - g) * p["pos"]["embedding"]
        x = x + g * p["pos"]["tile"][ids].reshape(N, T, NP, C)
        x = layer_norm(x, p["ln_pre"]["w"], p["ln_pre"]["b"], LN_EPS)
        x = jnp.pad(x, ((0, 0), (0, 0), (0, Lp - NP), (0, 0))).reshape(N, T * Lp, C)

    # masked iff both tokens are invalid (HF: finfo.min * invalid[q] * invalid[k])
    valid = (aspect_ratio_mask.reshape(N, T, 1) != 0) & (jnp.arange(Lp) < NP)
    valid = valid.reshape(N, T * Lp)
    allowed = valid[:, :, None] | valid[:, None, :]

    with jax.named_scope("mllama_local"):
        x, kept = _local(v, p, x, allowed)
    with jax.named_scope("mllama_global"):
        x = layer_norm(x, p["ln_post"]["w"], p["ln_post"]["b"], LN_EPS).reshape(N, T, Lp, C)
        x = (x + _tile_embedding(p["post_tile"], ids, T, C)).reshape(N, T * Lp, C)  # reaches CLS and pad slots
        x, _ = jax.lax.scan(lambda x, lp: (_layer(v, x, lp, allowed, gated=True), None), x, p["global_layers"])

    x = x.reshape(B, M, T, Lp, C)[:, :, :, :NP]
    k = len(v.intermediate_layers)
    if k:
        inter = jnp.moveaxis(kept, 0, -1).reshape(B, M, T, Lp, C * k)[:, :, :, :NP]  # [.., c, j] -> c*k + j
        x = jnp.concatenate([x, inter], axis=-1)
    return x


def encode(v, p, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
    """Processed images (HF processor names and shapes, see `features`) -> cross_states [B, N_img * T * NP, D]:
    `multi_modal_projector` (x @ W + b) over the features, ordered image, tile, token (CLS first), pad tiles
    included and pad slots not. HF's projector output is [B * N_img * T, NP, D], which every cross-attention
    layer's k/v projection views as [B, N_img * T * NP, ...]: this is that view."""
    x = features(v, p, pixel_values, aspect_ratio_ids, aspect_ratio_mask)
    with jax.named_scope("mllama_projector"):
        y = x @ p["projector"]["w"] + p["projector"]["b"]
    return y.reshape(pixel_values.shape[0], -1, y.shape[-1])
