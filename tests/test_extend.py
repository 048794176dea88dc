"""`M.extend` continues cached sequences by chunks (chunked prefill, a cached prompt prefix): for every GQA
family, a prompt fed in chunks of any split — shorter and longer than the sliding windows, different per row,
contiguous and paged — gives the full forward's logits at each chunk's end, and decoding after it too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import model as M
from tests.test_paged_cache import DENSE, _config, shuffled_tables

T = 40  # sequence length; the tiny configs' windows are shorter (rings wrap inside a chunk)
SPLITS = [[0, 3, 17, 30], [0, 12, 13, 30]]  # row b's chunks start at SPLITS[b][i]; both rows end at 30, then decode


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("name,paged", [(n, False) for n in DENSE] + [(n, True) for n in ("cohere2", "gemma3",
                                                                                          "gpt_oss")])
def test_chunks_equal_the_full_forward(name, paged):
    cfg = _config(name)
    params = M.init_params(cfg, seed=1, std=0.05)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, T)).astype(np.int32)
    full = np.asarray(M.forward(params, cfg, jnp.asarray(seq)))
    max_len = 64
    cache = M.init_cache(cfg, 2, max_len, jnp.float32, 16 if paged else 0,
                         shuffled_tables(cfg, 2, max_len) if paged else None)
    ext = jax.jit(M.extend, static_argnums=1)
    for i in range(len(SPLITS[0]) - 1):
        start = np.array([s[i] for s in SPLITS])
        lengths = np.array([s[i + 1] for s in SPLITS]) - start
        chunk = np.zeros((2, 20), np.int32)  # one padded shape for every chunk
        for b in range(2):
            chunk[b, :lengths[b]] = seq[b, start[b]: start[b] + lengths[b]]
        logits, cache = ext(params, cfg, jnp.asarray(chunk), jnp.asarray(start), jnp.asarray(lengths), cache)
        end = start + lengths - 1
        np.testing.assert_allclose(logits, full[[0, 1], end], atol=2e-5, rtol=0, err_msg=f"chunk {i}")
    step = jax.jit(M.decode_step, static_argnums=1)
    for pos in range(30, T):
        logits, cache = step(params, cfg, jnp.asarray(seq[:, pos]), jnp.full((2,), pos, jnp.int32), cache)
        np.testing.assert_allclose(logits, full[:, pos], atol=2e-5, rtol=0, err_msg=f"decode at {pos}")


def test_a_row_with_nothing_to_extend_keeps_its_cache():
    cfg = _config("llama")
    params = M.init_params(cfg, seed=1, std=0.05)
    seq = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    cache = M.init_cache(cfg, 2, 16, jnp.float32)
    _, cache = M.extend(params, cfg, jnp.asarray(seq), jnp.array([0, 0]), jnp.array([8, 8]), cache)
    _, after = M.extend(params, cfg, jnp.asarray(seq), jnp.array([8, 8]), jnp.array([0, 3]), cache)
    for old, new in zip(cache.buffers, after.buffers):
        np.testing.assert_array_equal(old[:, 0], new[:, 0])
        assert not np.array_equal(old[:, 1], new[:, 1])


# DeepSeek's extend (window, compressor rings, compressed entries, Engram): tests/test_speculative.py
