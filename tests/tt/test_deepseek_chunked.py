"""DeepSeek V4 / V4.1 prompts in chunks and continued from a prefix already in the caches, on the TT generator's
default executor (`deepseek_emu.DeepSeekVLLMExecutor`: a first chunk through the prefill program, the rest through
`extend`, the decode program with the chunk's tokens as rows). At `exact` numerics every returned logit equals
jm.forward's and each greedy token is jm.forward's argmax at its position (what jm.generate picks; checked
teacher-forced so that one jm.forward shape serves every test: test_deepseek_generator runs jm.generate itself).

* Chunks cut anywhere (37, 101: mid compression group of every ratio, mid window, mid ring, mid block) give the
  logits of every position of the whole sequence.
* Through the generator: a 245-token prompt in 128-token chunks, then greedy decode.
* A second request sharing request a's 96-token prefix (`DeepseekV4ForCausalLM.prefix_blocks`: compressor state and
  complete entry blocks shared read-only, the window ring and a partly filled entry block copied) prefills only its
  new tokens (start_pos=96, mid HCA-128 group, mid ring) and generates what jm.generate does from its whole prompt;
  a's shared blocks stay bit-identical (the ownership tracker would also refuse a write into them) and a goes on
  generating its own tokens afterwards. vLLM's prefix caching stays off for DeepSeek (the ring and the partial
  entry block need copies, which its block manager does not take); the test takes them as a forking caller would.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import model as M
from tests.tt.test_deepseek_generator import _config, _generator
from tt_backend.lowering import padded_prefill_len

PROMPT, CUTS, NEW = 245, (0, 37, 101, 245), 4


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    cfg = _config(request.param)
    return jm.Model(cfg, M.init_params(cfg, 0, std=0.1))


def _reference(model, seqs):
    """jm.forward's logits [len(seq), vocab] for each sequence: one call of one shape (3 rows, 256 positions; causal,
    so the padding after a sequence is inert), compiled once per config."""
    batch = np.zeros((3, 256), np.int32)
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    ref = np.asarray(jm.forward(model, batch))
    return [ref[i, :len(s)] for i, s in enumerate(seqs)]


def _check_greedy(model, prompt, new, logits):
    """new: greedy tokens after prompt, logits: the generator's logits that chose them. Each equals jm.forward's on
    prompt + new (teacher-forced), and each token is the argmax there (what jm.generate picks)."""
    ref = _reference(model, [prompt + new[:-1]])[0][len(prompt) - 1:]
    np.testing.assert_allclose(np.stack(logits), ref, rtol=1e-4, atol=1e-4)
    assert new == [int(t) for t in ref.argmax(-1)]
    assert len(set(new)) > 1


def _prompt(cfg, n=PROMPT, seed=1):
    return [int(t) for t in np.random.default_rng(seed).integers(3, cfg.vocab_size, n)]


def cut_run(gen, pool, prompt):
    """Request a's prompt in the chunks CUTS (the first through the prefill program, the rest through extend) ->
    the logits each returned: [1, V] (the first chunk's last token), then [chunk length, V] per extend."""
    pool.add("a", PROMPT)
    exe, tables, kv = gen.model[0], [t[:1] for t in pool.tables(["a"]).values()], pool.kv[0]
    ring = exe._ring(gen.cache_position_modulo())
    ids = np.zeros((1, padded_prefill_len(CUTS[1])), np.int32)
    ids[0, :CUTS[1]] = prompt[:CUTS[1]]
    first = exe.prefill(ids, chunk_start=0, last_token_idx=CUTS[1] - 1, valid_seq_len=CUTS[1], page_tables=tables,
                        chunk_page_tables=None, kv_cache=kv, cache_position_modulo=gen.cache_position_modulo(),
                        owners=None)
    got = [first[None]]
    for a, b in itertools.pairwise(CUTS[1:]):
        got.append(exe.extend(prompt[a:b], a, page_tables=tables, kv_cache=kv, ring=ring, owners=None,
                              history=np.array(prompt[:a])))
    return got


def test_chunks_cut_anywhere_equal_jm_forward(model):
    """Chunks [0, 37) (prefill program), [37, 101) and [101, 245) (extend): the logits of every position equal
    jm.forward on the whole prompt."""
    prompt = _prompt(model.config)
    ref = _reference(model, [prompt])[0]
    got = cut_run(*_generator(model, "exact"), prompt)
    assert [len(g) for g in got] == [1, CUTS[2] - CUTS[1], CUTS[3] - CUTS[2]]
    np.testing.assert_allclose(np.concatenate(got), ref[CUTS[1] - 1:], rtol=1e-4, atol=1e-4)


def _greedy(gen, pool, reqs, slots_tokens, positions, steps):
    """Greedy decode of `reqs` (one slot each) for `steps` tokens; returns each request's new tokens and logits."""
    toks, pos, out, seen = list(slots_tokens), list(positions), [[] for _ in reqs], [[] for _ in reqs]
    for _ in range(steps):
        logits = gen.decode_forward(np.array(toks), np.array(pos), kv_cache=pool.kv,
                                    page_tables_per_layer=pool.tables(reqs))[:, 0]
        for i in range(len(reqs)):
            if pos[i] >= 0:
                toks[i] = int(np.argmax(logits[i]))
                out[i].append(toks[i])
                seen[i].append(logits[i])
                pos[i] += 1
    return out, seen


def test_generator_chunked_prefill(model):
    """max_prefill_chunk_size=128: the 245-token prompt runs as two chunks (the second from 128: mid the ring of 64
    slots' second lap for V4.1's ratio-1 and the V4's HCA-8 groups alike); logits and greedy tokens are jm.forward's."""
    prompt = _prompt(model.config)
    gen, pool = _generator(model, "exact")
    gen.max_prefill_chunk_size = 128
    pool.add("a", PROMPT + NEW)
    gen.track_block_ownership([pool.alloc], ["a"])
    calls = []
    prefill = gen.model[0].prefill
    gen.model[0].prefill = lambda *a, **kw: calls.append(kw["chunk_start"]) or prefill(*a, **kw)
    last = gen.prefill_forward(np.array([prompt], np.int32), kv_cache=pool.kv, prompt_lens=[PROMPT],
                               page_tables_per_layer={k: t[:1] for k, t in pool.tables(["a"]).items()})[0, 0]
    assert calls == [0, 128]
    new, logits = _greedy(gen, pool, ["a"], [int(np.argmax(last))], [PROMPT], NEW - 1)
    _check_greedy(model, prompt, [int(np.argmax(last))] + new[0], [last] + logits[0])


def share_prefix(gen, pool, P):
    """Give request b request a's first P positions as a forking caller would (`prefix_blocks`): a's blocks named in
    b's tables where they are shared, private copies where they are not -> (the plan, {cache: its buffer}, the
    shared (cache, block) pairs, how many blocks were copied)."""
    plan = gen.prefix_blocks(P)
    buffers = {n: kv[0] for n, kv in zip(gen.cache_names(), pool.kv[0])}
    shared, copied = [], 0
    for name, rule in plan.items():
        a_rows, b_rows = pool.rows["a"][name], pool.rows["b"][name]
        for col in rule["copy"]:  # a private copy of a's block in b's own block
            buffers[name][b_rows[col]] = buffers[name][a_rows[col]]
            copied += 1
        for col in range(rule["share"]):  # b's table names a's block
            b_rows[col] = a_rows[col]
            shared.append((name, a_rows[col]))
    return plan, buffers, shared, copied


def test_prefix_shared_with_another_request(model):
    """Request b continues request a's 96-token prefix (start_pos=96) over a's shared blocks and copies of its ring
    and partial entry blocks: b's logits and greedy tokens are jm.forward's on b's whole prompt, a's shared blocks are
    untouched, and a then generates its own tokens."""
    P = 96
    prefix = _prompt(model.config, P)
    b_prompt = prefix + _prompt(model.config, 100, seed=3)
    gen, pool = _generator(model, "exact")
    pool.add("a", P + NEW)
    pool.add("b", len(b_prompt) + NEW)
    reqs = ["a", "b"]
    gen.track_block_ownership([pool.alloc], reqs)
    la = gen.prefill_forward(np.array([prefix], np.int32), kv_cache=pool.kv, prompt_lens=[P],
                             page_tables_per_layer={k: t[:1] for k, t in pool.tables(["a"]).items()})[0, 0]
    plan, buffers, shared, copied = share_prefix(gen, pool, P)
    assert shared and copied  # both kinds occur: token-indexed state and complete entry blocks / ring, partials
    kinds = {n.split(".self_attn")[1] for n, _ in shared}
    assert ".compressor.state.a" in kinds and not any(plan[n]["share"] for n in gen.cache_names() if n.endswith(
        "self_attn"))  # compressor state is shared, the window ring never
    before = {(n, blk): buffers[n][blk].copy() for n, blk in shared}
    lb = gen.prefill_forward(np.array([b_prompt], np.int32), kv_cache=pool.kv, prompt_lens=[len(b_prompt)],
                             empty_slots=[1], start_pos=[P],
                             page_tables_per_layer={k: t[1:] for k, t in pool.tables(reqs).items()})[0, 0]
    new, logits = _greedy(gen, pool, reqs, [0, int(np.argmax(lb))], [-1, len(b_prompt)], NEW - 1)
    _check_greedy(model, b_prompt, [int(np.argmax(lb))] + new[1], [lb] + logits[1])
    for (n, blk), x in before.items():
        np.testing.assert_array_equal(buffers[n][blk], x, err_msg=f"{n} block {blk} (shared) was written")
    new, logits = _greedy(gen, pool, reqs, [int(np.argmax(la)), 0], [P, -1], NEW - 1)
    _check_greedy(model, prefix, [int(np.argmax(la))] + new[0], [la] + logits[0])
