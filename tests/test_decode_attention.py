"""The decode attention kernel (run by Pallas' interpreter on the CPU) against the XLA path it replaces on the GPU:
`attention.decode` off the GPU reads every slot of the layer's cache and masks. Caches are built and written through
the cache interface, contiguous and paged (pools shared by a ring and a full cache, shuffled block tables), at a
layer inside a stack, with rows that have wrapped their ring, rows not yet past one block, and a row with nothing."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import cache as kv
from jaxmodels.layers import attention, decode_attention
from jaxmodels.plan import SlotSpec

F32, BF16 = jnp.float32, jnp.bfloat16


def written_cache(B, K, d, window, max_len, lasts, dtype, block_size=0, layers=3, layer=1, seed=0):
    """A cache of `layers` layers with a full (window None) or ring k/v spec, written at every layer with random
    keys/values for positions 0 .. lasts[b] of each row (nothing for lasts[b] < 0); returns layer `layer`'s view."""
    specs = [(SlotSpec("k", K, d, window), SlotSpec("v", K, d, window)),
             (SlotSpec("k", K, d, None if window else 5), SlotSpec("v", K, d, None if window else 5))]
    tables = None
    if block_size:  # shuffled blocks, both groups in one pool (disjoint blocks), blocks a row never writes -1
        rng = np.random.default_rng(seed)
        groups = {}
        for s in specs:
            S = s[0].slots(max_len)
            groups[(s[0].window, 1)] = -(-S // block_size)
        total = sum(B * nb for nb in groups.values())
        perm = rng.permutation(total + 3)
        tables, at = {}, 0
        for key, nb in groups.items():
            tables[key] = perm[at: at + B * nb].reshape(B, nb).astype(np.int32)
            at += B * nb
            used = np.minimum(-(-(np.maximum(np.asarray(lasts), -1) + 1) // block_size), nb)  # blocks a row writes
            tables[key][np.arange(nb)[None, :] >= used[:, None]] = -1  # as the allocator leaves the rest
    c = kv.build(specs, [layers, 1], B, max_len, dtype, block_size, tables)
    lasts = jnp.asarray(lasts, jnp.int32)
    T = int(max(np.max(lasts) + 1, 1))

    @jax.jit
    def fill(c, key):
        for l in range(layers):
            lc = kv.LayerCache(c, 0, l)
            for n in ("k", "v"):
                key, sub = jax.random.split(key)
                lc.write(n, jax.random.normal(sub, (B, K, T, d), F32).astype(dtype), jnp.maximum(lasts + 1, 0))
            c = lc.cache
        return c

    return kv.LayerCache(fill(c, jax.random.key(seed)), 0, jnp.asarray(layer, jnp.int32)), lasts


def _check(lc, lasts, H, d, dtype, window, softcap=None, sinks=False, tol=None):
    B = lasts.shape[0]
    q = jax.random.normal(jax.random.key(7), (B, 1, H, d), F32).astype(dtype)
    s = jax.random.normal(jax.random.key(8), (H,), F32) if sinks else None
    kw = dict(window=window, scale=d ** -0.5, softcap=softcap)

    @jax.jit
    def both(q, c, layer, s):
        lc = kv.LayerCache(c, 0, layer)
        want = attention.decode_reference(q, lc, lasts, sinks=s, **kw)
        got = decode_attention.decode(q[:, 0], lc.pages("k"), lc.pages("v"), lasts, sinks=s, interpret=True, **kw)
        return want, got[:, None]

    want, got = both(q, lc.cache, lc.layer, s)
    assert got.shape == want.shape and got.dtype == want.dtype
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    empty = np.asarray(lasts) < 0
    assert not np.any(got[empty]), "a row with nothing to attend gives 0"
    tol = tol or (2e-2 if dtype == BF16 else 2e-6)
    np.testing.assert_allclose(got[~empty], want[~empty], atol=tol, rtol=0)
    return got


@pytest.mark.parametrize("H,K,dtype", [(6, 2, F32), (16, 2, BF16)])  # 3 query heads a kv head: padded to 16
def test_full_cache_contiguous(H, K, dtype):
    """Rows at different lengths across several key blocks and splits (300 slots), one row empty."""
    lc, lasts = written_cache(4, K, 16, None, 300, [0, 63, 64, 250] if H != 6 else [5, -1, 130, 299], dtype)
    _check(lc, lasts, H, 16, dtype, None)


@pytest.mark.parametrize("window,block_size", [(6, 4), (100, 0)])
def test_sliding_ring(window, block_size):
    """A ring of `window` slots: rows that have not filled it, filled it exactly and wrapped it several times."""
    lc, lasts = written_cache(4, 2, 32, window, 512, [2, window - 1, window, 3 * window + 2], F32, block_size)
    _check(lc, lasts, 4, 32, F32, window)


def test_window_narrower_than_the_cache():
    """A window applied to a full cache (slots past the window masked by position)."""
    lc, lasts = written_cache(3, 2, 16, None, 200, [10, 100, 199], F32)
    _check(lc, lasts, 4, 16, F32, 37)


def test_sinks_and_softcap():
    lc, lasts = written_cache(3, 2, 16, None, 160, [0, 70, 159], F32, 8, layer=2)
    _check(lc, lasts, 8, 16, F32, None, sinks=True)
    lc, lasts = written_cache(3, 2, 16, 32, 160, [0, 70, 159], BF16, 0, layer=0)
    _check(lc, lasts, 8, 16, BF16, 32, sinks=True, softcap=3.0)


def test_paged_full_cache_across_blocks():
    """Paged full cache: a row's key block of 64 slots spans several shuffled pages."""
    lc, lasts = written_cache(3, 2, 16, None, 256, [-1, 17, 255], BF16, block_size=16)
    _check(lc, lasts, 8, 16, BF16, None)


def test_the_kernel_reads_only_written_slots():
    """Slots past a row's last position hold NaN: the kernel must never read them into its result (the XLA path
    masks them after the product, so it is not the reference here: the clean cache is)."""
    lc, lasts = written_cache(2, 2, 16, None, 256, [40, 200], F32)
    unwritten = (jnp.arange(256)[None, :] > lasts[:, None])[None, :, None, :, None]

    @jax.jit
    def clean_and_dirty(c):
        poisoned = [jnp.where(unwritten, jnp.nan, b) for b in c.buffers[:2]] + list(c.buffers[2:])
        out = []
        for cc in (c, dataclasses.replace(c, buffers=tuple(poisoned))):
            view = kv.LayerCache(cc, 0, lc.layer)
            out.append(decode_attention.decode(jnp.ones((2, 4, 16)), view.pages("k"), view.pages("v"), lasts,
                                               window=None, scale=0.25, interpret=True))
        return out

    clean, got = clean_and_dirty(lc.cache)
    assert np.isfinite(np.asarray(clean)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(clean))


@pytest.mark.parametrize("name,block_size", [("gpt_oss", 16), ("gemma3", 0)])  # 16: test_paged_cache's tables
def test_decode_step_through_the_kernel(monkeypatch, name, block_size):
    """Whole decode steps with the kernel inside the scanned layer loop (the layer index traced, rings, sinks or
    softcap, a shared paged pool, shuffled tables) equal the XLA path's logits."""
    from jaxmodels import families, model as M
    from tests.parity import hf_reference as ref
    from tests.test_paged_cache import shuffled_tables

    cfg = families.config_from_hf({**ref.tiny_config(name), "max_position_embeddings": 512})
    params = M.init_params(cfg, 0, std=0.1)
    B, lengths = 2, jnp.asarray([3, 45], jnp.int32)
    ids = jax.random.randint(jax.random.key(1), (B, 48), 0, cfg.vocab_size)

    def run():
        tables = shuffled_tables(cfg, B, 64) if block_size else None
        cache = M.init_cache(cfg, B, 64, F32, block_size, tables)
        _, cache = jax.jit(M.prefill, static_argnums=1)(params, cfg, ids, lengths, cache)
        step = jax.jit(M.decode_step, static_argnums=1)
        out, pos = [], lengths
        for _ in range(3):
            logits, cache = step(params, cfg, ids[:, 0], pos, cache)
            out.append(np.asarray(logits))
            pos = pos + 1
        return np.stack(out)

    want = run()
    kernel = decode_attention.decode
    monkeypatch.setattr(decode_attention, "fits", lambda *a: True)
    monkeypatch.setattr(decode_attention, "decode", lambda *a, **k: kernel(*a, **k, interpret=True))
    np.testing.assert_allclose(run(), want, atol=2e-5, rtol=0)
