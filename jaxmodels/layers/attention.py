"""Grouped-query attention core, with causal / sliding-window masks from absolute positions."""
import jax
import jax.numpy as jnp

F32 = jnp.float32


def mask(q_pos, k_pos, window: int | None, k_valid=None):
    """Boolean [B, Tq, Tk]: key visible to query iff k <= q (and k > q - W for a window of W keys).

    A window of W means the query itself plus W-1 earlier tokens, as HF's `sliding_window_overlay`.
    """
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    m = k <= q
    if window is not None:
        m &= k > q - window
    if k_valid is not None:
        m &= k_valid[:, None, :]
    return m


def attend(q, k, v, allowed, *, scale: float, softcap: float | None = None, sinks=None):
    """q [B, Tq, H, d], k/v [B, K, Tk, d] (heads before positions, the KV-cache layout),
    allowed [B, Tq, Tk] -> [B, Tq, H, d].

    Query head h reads kv head h // (H/K). Scores and softmax in fp32 (HF eager). `sinks` [H]: a
    per-head logit in the softmax denominator that carries no value (GPT-OSS).
    """
    b, tq, h, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, tq, kv, h // kv, d)
    s = jnp.einsum("bqgrd,bgkd->bgrqk", qg, k, preferred_element_type=F32) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(allowed[:, None, None], s, jnp.finfo(F32).min)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sk = jnp.broadcast_to(sinks.astype(F32).reshape(kv, h // kv)[None, :, :, None, None], s.shape[:-1] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sk], axis=-1), axis=-1)[..., :-1]
    # P·V in the value dtype, as HF's matmul (XLA accumulates in fp32); XLA:CPU also lacks bf16 x bf16 -> f32 here
    o = jnp.einsum("bgrqk,bgkd->bqgrd", p.astype(v.dtype), v)
    return o.reshape(b, tq, h, d).astype(q.dtype)


def causal(q, k, v, *, scale: float, window: int | None = None):
    """Causal (optionally sliding-window) attention of a whole sequence with itself through
    `jax.nn.dot_product_attention`: cuDNN's fused kernel on GPU for bf16/fp16, XLA elsewhere.
    q [B, T, H, d], k/v [B, K, T, d] -> [B, T, H, d]. Same semantics as `attend` with `mask(pos, pos, window)`."""
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)  # cuDNN: half types only
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="cudnn" if fused else None)
