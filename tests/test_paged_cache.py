"""The paged cache layout equals the contiguous one: every family's prefill + decode through shuffled,
non-contiguous block tables gives the contiguous path's logits, on ragged batches past the window and past
4096 (the contiguous path itself is tested equal to the full forward in tests/parity/)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmodels import cache as kv, families, model as M
from jaxmodels.families import deepseek_v4
from tests.oracles import deepseek_ckpt
from tests.parity import hf_reference as ref
from tests.parity.test_deepseek_v4 import V4_TINY

DENSE = ["llama", "qwen3", "mistral", "cohere", "cohere2", "gemma3", "gpt_oss", "exaone4", "qwen3_moe"]
BLOCK = 16
V41_NARROW = dict(hidden_size=64, moe_intermediate_size=32, q_lora_rank=32, o_lora_rank=32, index_head_dim=32,
                  engram_head_dim=16, max_position_embeddings=8192)
LENGTHS = np.array([37, 4099])  # one row past the sliding windows, one past 4096
STEPS = 5


def _config(name):
    if name == "deepseek_v4":
        return deepseek_v4.config({**V4_TINY, "model_type": "deepseek_v4"})
    if name == "deepseek_v41":  # the spec's tiny V4.1 (every role, Engram, DSpark) at narrower widths
        return deepseek_v4.config(deepseek_ckpt.tiny_config("v4.1", quantized=False, **V41_NARROW))
    return families.config_from_hf({**ref.tiny_config(name), "max_position_embeddings": 8192})


def shuffled_tables(cfg, batch, max_len, seed=0):
    """Every table group's rows take disjoint blocks from one random permutation (non-contiguous, interleaved
    across rows and groups, as a block allocator hands them out)."""
    groups = kv.table_groups(cfg, max_len, BLOCK)
    perm = np.random.default_rng(seed).permutation(sum(batch * nb for nb in groups.values()) + 7)  # spare blocks
    out, at = {}, 0
    for key, nb in groups.items():
        out[key] = perm[at: at + batch * nb].reshape(batch, nb).astype(np.int32)
        at += batch * nb
    return out


def _run(cfg, params, ids, cache):
    B = ids.shape[0]
    prefill = jax.jit(M.prefill, static_argnums=1)
    step = jax.jit(M.decode_step, static_argnums=1)
    logits, cache = prefill(params, cfg, jnp.asarray(ids[:, :LENGTHS.max() + 5], jnp.int32), jnp.asarray(LENGTHS),
                            cache)
    out, pos = [np.asarray(logits)], LENGTHS.copy()
    for _ in range(STEPS):
        logits, cache = step(params, cfg, jnp.asarray(ids[np.arange(B), pos], jnp.int32), jnp.asarray(pos), cache)
        out.append(np.asarray(logits))
        pos = pos + 1
    return np.stack(out), cache


@pytest.fixture(autouse=True)
def _precise():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("name", DENSE + [pytest.param(n, marks=pytest.mark.slow) for n in ("deepseek_v4", "deepseek_v41")])
def test_paged_equals_contiguous(name):
    cfg = _config(name)
    params = M.init_params(cfg, seed=1, std=0.05)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 4200))
    max_len = 4160
    want, _ = _run(cfg, params, ids, M.init_cache(cfg, 2, max_len, jnp.float32))
    paged = M.init_cache(cfg, 2, max_len, jnp.float32, block_size=BLOCK, tables=shuffled_tables(cfg, 2, max_len))
    got, cache = _run(cfg, params, ids, paged)
    assert cache.layout.paged and np.abs(want).max() > 0.1
    assert np.abs(got - want).max() <= 1e-6, np.abs(got - want).max(axis=(1, 2))


def test_pools_are_shared_across_table_groups_and_blocks_stay_disjoint():
    """GPT-OSS's sliding and full layers (one each here) have equal entries: one pool per k and v serves both
    table groups (vLLM's tensor_idx sharing); a prefill writes only the blocks of each group's own table."""
    cfg = _config("gpt_oss")
    tables = shuffled_tables(cfg, 2, 256)
    cache = M.init_cache(cfg, 2, 256, jnp.float32, block_size=BLOCK, tables=tables)
    assert len(cache.buffers) == 2 and len(cache.tables) == 2  # k, v pools; sliding and full tables
    assert {r.buffer for refs in cache.layout.kinds for _, r in refs} == {0, 1}
    params = M.init_params(cfg, seed=1, std=0.05)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 64)), jnp.int32)
    _, cache = jax.jit(M.prefill, static_argnums=1)(params, cfg, ids, jnp.asarray([40, 64]), cache)
    written = {int(b) for b in np.nonzero(np.abs(np.asarray(cache.buffers[0])).sum(axis=(0, 2, 3, 4)))[0]}
    owned = {int(b) for t in tables.values() for b in t.ravel()}
    assert written and written <= owned


def test_bad_tables_are_refused():
    cfg = _config("llama")
    with pytest.raises(ValueError, match="block table"):
        M.init_cache(cfg, 2, 64, jnp.float32, block_size=BLOCK, tables={(None, 1): np.zeros((2, 1), np.int32)})


def test_dspark_rings_paged_equal_contiguous():
    """DeepSeek V4.1's DSpark main-KV rings (plan.mtp_cache_specs) on the same interface, paged = contiguous."""
    from jaxmodels import deepseek_mtp as dm

    cfg = _config("deepseek_v41")
    cfg = dataclasses.replace(cfg, mtp=dataclasses.replace(cfg.mtp, layers=1))
    params = M.init_params(cfg, seed=1, std=0.05)
    params["mtp"] = jax.tree.map(jnp.asarray, _mtp_params(cfg))
    mains = jnp.asarray(np.random.default_rng(4).normal(size=(2, 40, 2 * cfg.hidden_size)), jnp.float32)
    outs = []
    for block in (0, BLOCK):
        c = dm.dspark_init_cache(cfg, 2, jnp.float32, block_size=block)
        c = dm.dspark_prefill_cache(params, cfg, c, mains[:, :30], jnp.asarray([30, 21]))
        for p in range(30, 34):
            c = dm.dspark_step_cache(params, cfg, c, mains[:, p:p + 1], jnp.asarray([p, p - 9]))
        outs.append(dm.dspark_draft_cached(params, cfg, c, jnp.asarray([3, 4]), jnp.asarray([33, 24])))
    for a, b in zip(*outs):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    assert np.abs(np.asarray(outs[0][0])).max() > 0.1


def _mtp_params(cfg):
    from jaxmodels.plan import mtp_param_specs

    rng = np.random.default_rng(5)
    return jax.tree.map(lambda s: (0.05 * rng.standard_normal(s.shape) + (s.init == "ones")).astype(np.float32),
                        mtp_param_specs(cfg)["mtp"], is_leaf=lambda s: hasattr(s, "axes"))


def test_tables_given_for_some_groups_do_not_collide():
    """Groups whose tables are not given get blocks past the given ones (they may share a pool with them)."""
    from jaxmodels.plan import SlotSpec

    specs = [(SlotSpec("k", 1, 2, None),), (SlotSpec("k", 1, 2, 4),)]  # a full and a window-4 group, one pool
    cache = kv.build(specs, (1, 1), 2, 16, jnp.float32, block_size=4, tables={(None, 1): np.arange(8).reshape(2, 4)})
    assert len(cache.buffers) == 1
    full, window = kv.LayerCache(cache, 0, 0), None
    full.write("k", jnp.ones((2, 1, 16, 2)), jnp.array([16, 16]))
    window = kv.LayerCache(full.cache, 1, 0)
    window.write("k", 2 * jnp.ones((2, 1, 16, 2)), jnp.array([16, 16]))
    assert set(np.unique(np.asarray(kv.LayerCache(window.cache, 0, 0).read("k")))) == {1.0}


def test_a_compressed_cache_shorter_than_its_ratio():
    """V4's HCA entries (one per 128 tokens) in a 64-token cache: no slot at all, in both layouts."""
    cfg = _config("deepseek_v4")
    for block in (0, BLOCK):
        cache = M.init_cache(cfg, 2, 64, jnp.float32, block_size=block)
        params = M.init_params(cfg, seed=1, std=0.05)
        logits, _ = jax.jit(M.prefill, static_argnums=1)(params, cfg, jnp.zeros((2, 8), jnp.int32),
                                                        jnp.asarray([8, 5]), cache)
        assert np.isfinite(np.asarray(logits)).all()
