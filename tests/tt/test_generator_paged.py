"""The generator's default executor (the emulated TT program) against `jm.generate`, through paged caches.

Every layer has its own page table over blocks handed out in a shuffled order, so a layer reading another
layer's table, a ring slot off by one or a prefix block rewritten shows up as a different greedy token.
Numerics are `exact` (float32 throughout), so the emulated program must pick jm.generate's tokens, and its
logits at every step must equal jm.forward's on the generated sequence. The tiny models are initialised at unit
gain (and Gemma3's lm_head untied), so greedy continuations vary instead of repeating one token.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import jaxmodels as jm
from jaxmodels import families, plan
from tests.tt.test_tt_forward import BASE, TINY, TINY_MOE
from tt_backend import VLLMExecutor, generator as G, paged_cache as pc

BS = 32
GREEDY = SimpleNamespace(temperature=0.0)


def _model(hf: dict, seed: int) -> jm.Model:
    """Matrices N(0, 1/fan_in), biases N(0, 0.5²), sinks N(0, 1), norms 1 + N(0, 0.1²) (Gemma's N(0, 0.1²))."""
    cfg = families.config_from_hf({**BASE, **hf})
    rng = np.random.default_rng(seed)
    params: dict = {}
    for path, shape in plan.flat_shapes(cfg).items():
        *parents, leaf = path.split("/")
        node = params
        for k in parents:
            node = node.setdefault(k, {})
        if "norm" in leaf:
            x = (0.0 if cfg.norm == "gemma" else 1.0) + 0.1 * rng.standard_normal(shape)
        elif leaf == "sinks":
            x = rng.standard_normal(shape)
        elif leaf.startswith("b"):
            x = 0.5 * rng.standard_normal(shape)
        else:
            x = rng.standard_normal(shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)
        node[leaf] = x.astype(np.float32)
    return jm.Model(cfg, params)


@pytest.fixture(scope="module")
def models():
    return {"llama": _model(TINY["llama"], 3), "gemma3": _model({**TINY["gemma3"], "tie_word_embeddings": False}, 3),
            "gpt_oss": _model(TINY_MOE["gpt_oss"], 3)}


def _prompts(n_tokens, vocab, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in n_tokens]


def _reference(model, prompts, new):
    return [list(t) for t in jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True).tokens]


def _check(model, prompts, got, logits=None):
    """`got` == jm.generate's greedy tokens (and varied: the check has power); each step's logits [step, user,
    vocab] == jm.forward's on prompt + generated tokens."""
    new = len(got[0])
    assert got == _reference(model, prompts, new)
    assert len({t for g in got for t in g}) >= new * len(got) // 2, got
    if logits is None:
        return
    for i, (p, g) in enumerate(zip(prompts, got)):
        ref = np.asarray(jm.forward(model, np.array([p + g[:-1]], np.int32)))[0, len(p) - 1:]
        np.testing.assert_allclose(logits[:, i], ref, rtol=1e-4, atol=1e-4)


class Pool:
    """One block-id space over every layer's buffer, handed out in a shuffled order; each layer gets its own
    blocks (so its own page table) for each request. Ring layers get exactly their ring's blocks."""

    def __init__(self, gen, num_blocks, seed):
        self.gen, self.num_blocks = gen, num_blocks
        cfg = gen.config
        shape = (num_blocks, cfg.num_kv_heads, BS, cfg.head_dim)
        self.kv = gen.allocate_kv_cache_per_layer([(shape, np.float32, i) for i in range(cfg.num_layers)])
        self.alloc = pc.BlockAllocator(num_blocks, order=np.random.default_rng(seed).permutation(num_blocks))
        self.rows = {}  # request -> per-layer logical block lists
        self.width = gen.max_seq_len // BS

    def add(self, request, tokens, shared=None):
        """Blocks for `tokens` positions in every layer; `shared`: (request, n) reuses its first n blocks."""
        rows = []
        for layer, m in enumerate(self.gen.cache_position_modulo()):
            need = m // BS if m else -(-tokens // BS)
            have = list(self.rows[shared[0]][layer][:shared[1]]) if shared else []
            rows.append(have + self.alloc.allocate(request, need - len(have)))
        self.rows[request] = rows

    def tables(self, requests):
        """Per layer: int32 [len(requests), width], -1 past each request's blocks."""
        out = []
        for layer in range(self.gen.config.num_layers):
            t = np.full((len(requests), self.width), -1, np.int32)
            for r, req in enumerate(requests):
                t[r, :len(self.rows[req][layer])] = self.rows[req][layer]
            out.append(t)
        return out


def _serve(gen, pool, requests, prompts, new, start_pos=None, device_sampling=False):
    """Prefill every prompt into its slot, then greedy decode: on the host from the returned logits (returns the
    tokens and every step's logits [new, user, vocab]), or sampled "on device" in steady state (reload_inputs=False;
    returns the tokens and the prefill's logits)."""
    gen.track_block_ownership([pool.alloc], requests)
    tables = pool.tables(requests)
    T = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    logits = gen.prefill_forward(tokens, kv_cache=pool.kv, prompt_lens=[len(p) for p in prompts],
                                 page_tables_per_layer=tables, start_pos=start_pos)
    out = [[int(t)] for t in logits[:, 0].argmax(-1)]
    if not device_sampling:
        steps = [logits[:, 0]]
        for t in range(new - 1):
            lg = gen.decode_forward(np.array([o[-1] for o in out]), np.array([len(p) + t for p in prompts]),
                                    kv_cache=pool.kv, page_tables_per_layer=tables)[:, 0]
            steps.append(lg)
            for o, x in zip(out, lg.argmax(-1)):
                o.append(int(x))
        return out, np.stack(steps)
    nxt = gen.decode_forward(np.array([o[0] for o in out]), np.array([len(p) for p in prompts]), kv_cache=pool.kv,
                             page_tables_per_layer=tables, sampling_params=GREEDY)
    for _ in range(new - 1):
        for o, t in zip(out, nxt):
            o.append(int(t))
        if len(out[0]) == new:
            break
        nxt = gen.decode_forward(None, None, kv_cache=pool.kv, sampling_params=GREEDY, reload_inputs=False)
    return out, logits[:, 0]


def _generator(cls, model, batch, max_seq_len, **kw):
    return cls.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), batch, max_seq_len, model=model,
                                     numerics="exact", **kw)


# --------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("name, cls", [("llama", G.LlamaForCausalLM), ("gemma3", G.Gemma3ForCausalLM),
                                       ("gpt_oss", G.GptOssForCausalLM)])
def test_generation_through_per_layer_page_tables_equals_jm_generate(models, name, cls):
    """Two users, shuffled blocks, each layer its own page table, chunked prefill (200 tokens in 128-token
    chunks); sliding layers keep full-length caches and apply their window of 48 on read."""
    model = models[name]
    gen = _generator(cls, model, 2, 256, max_prefill_chunk_size=128)
    assert all(isinstance(m, VLLMExecutor) for m in gen.model)
    prompts, new = _prompts([200, 37], model.config.vocab_size, seed=1), 12
    pool = Pool(gen, 40, seed=2)
    for r, p in zip("ab", prompts):
        pool.add(r, len(p) + new)
    got, logits = _serve(gen, pool, ["a", "b"], prompts, new)
    _check(model, prompts, got, logits)


@pytest.mark.parametrize("name, cls", [("gemma3", G.Gemma3ForCausalLM), ("gpt_oss", G.GptOssForCausalLM)])
def test_sliding_rings_wrap_past_the_window(models, name, cls):
    """Hybrid KV groups: each sliding layer keeps a ring of 96 tokens (window 48); prompts of 70 and 130
    tokens (the 130-token prefill wraps its ring) decoded to position 180 (every ring wraps again)."""
    model = models[name]
    gen = _generator(cls, model, 2, 256, hybrid_kv_cache_groups=True)
    modulo = gen.cache_position_modulo()
    assert modulo == [96 if s.attention.window else None for s in model.config.layers] and any(modulo)
    prompts, new = _prompts([130, 70], model.config.vocab_size, seed=4), 50
    pool = Pool(gen, 40, seed=5)
    for r, p in zip("ab", prompts):
        pool.add(r, len(p) + new)
    got, _ = _serve(gen, pool, ["a", "b"], prompts, new, device_sampling=True)
    _check(model, prompts, got)
    with pytest.raises(NotImplementedError, match="sliding rings"):
        gen.prefill_forward(np.array([prompts[0]]), kv_cache=pool.kv, prompt_lens=[130],
                            page_tables_per_layer=[t[:1] for t in pool.tables(["a"])], start_pos=[64])


@pytest.mark.parametrize("name, cls", [("llama", G.LlamaForCausalLM), ("gemma3", G.Gemma3ForCausalLM)])
def test_prefix_cache_hit_gives_the_same_tokens(models, name, cls):
    """Request b shares its first 96 tokens with a: its page tables start with a's 3 blocks (per layer) and
    its prefill starts at position 96 (chunked SDPA over the cached prefix). b never writes a shared block
    (ownership is checked on every write), its tokens equal jm.generate's and a cold prefill's."""
    model = models[name]
    prompt_a, tail = _prompts([150, 45], model.config.vocab_size, seed=6)
    prompt_b, new = prompt_a[:96] + tail, 10
    gen = _generator(cls, model, 2, 256)
    pool = Pool(gen, 40, seed=7)
    pool.add("a", len(prompt_a) + new)
    pool.add("b", len(prompt_b) + new, shared=("a", 3))
    gen.track_block_ownership([pool.alloc], ["a", "b"])
    tables = pool.tables(["a", "b"])
    gen.prefill_forward(np.array([prompt_a]), kv_cache=pool.kv, prompt_lens=[len(prompt_a)], empty_slots=[0],
                        page_tables_per_layer=[t[:1] for t in tables])  # a fills the shared prefix
    snapshot = [[a.copy() for a in layer] for layer in pool.kv[0]]
    shared = [pool.rows["a"][layer][:3] for layer in range(model.config.num_layers)]
    tables = [t[1:] for t in tables]
    warm = gen.prefill_forward(np.array([prompt_b]), kv_cache=pool.kv, prompt_lens=[len(prompt_b)],
                               empty_slots=[1], page_tables_per_layer=tables, start_pos=[96])
    for layer, blocks in enumerate(shared):
        for kv_i in range(2):
            np.testing.assert_array_equal(pool.kv[0][layer][kv_i][blocks], snapshot[layer][kv_i][blocks])
    cold_gen = _generator(cls, model, 1, 256)
    cold_pool = Pool(cold_gen, 40, seed=8)
    cold_pool.add("b", len(prompt_b) + new)
    cold, cold_logits = _serve(cold_gen, cold_pool, ["b"], [prompt_b], new)
    np.testing.assert_allclose(warm[0, 0], cold_logits[0, 0], rtol=1e-5, atol=1e-5)
    # continue b from the warm prefill: greedy decode in slot 1 (slot 0 inactive)
    toks = [int(warm[0, 0].argmax())]
    for t in range(new - 1):
        pos = len(prompt_b) + t
        out = gen.decode_forward(np.array([0, toks[-1]]), np.array([-1, pos]), kv_cache=pool.kv,
                                 page_tables_per_layer=pool.tables(["a", "b"]), enable_trace=False)
        toks.append(int(out[1, 0].argmax()))
    assert toks == cold[0]
    _check(model, [prompt_b], [toks])


def test_prefix_cache_hit_at_tt_numerics(models):
    """At `full` numerics (bfp8 KV cache, bf16 activations, the performance policy) a prefix-cache hit gives the
    cold prefill's logits and the same greedy continuation: the cached blocks hold what the cold prefill stores."""
    model = models["llama"]
    prompt_a, tail = _prompts([150, 45], model.config.vocab_size, seed=6)
    prompt_b, new = prompt_a[:96] + tail, 8
    runs = []
    for warm in (True, False):
        gen = G.LlamaForCausalLM.initialize_vllm_model(None, G.EmulatedMesh((1, 1)), 2, 256, model=model,
                                                       numerics="full")
        pool = Pool(gen, 40, seed=7)
        pool.add("a", len(prompt_a))
        pool.add("b", len(prompt_b) + new, shared=("a", 3) if warm else None)
        gen.track_block_ownership([pool.alloc], ["a", "b"])
        tables = pool.tables(["a", "b"])
        if warm:
            gen.prefill_forward(np.array([prompt_a]), kv_cache=pool.kv, prompt_lens=[len(prompt_a)], empty_slots=[0],
                                page_tables_per_layer=[t[:1] for t in tables])
        lg = gen.prefill_forward(np.array([prompt_b]), kv_cache=pool.kv, prompt_lens=[len(prompt_b)], empty_slots=[1],
                                 page_tables_per_layer=[t[1:] for t in tables], start_pos=[96] if warm else None)
        steps, toks = [lg[0, 0]], [int(lg[0, 0].argmax())]
        for t in range(new - 1):
            out = gen.decode_forward(np.array([0, toks[-1]]), np.array([-1, len(prompt_b) + t]), kv_cache=pool.kv,
                                     page_tables_per_layer=tables, enable_trace=False)
            steps.append(out[1, 0])
            toks.append(int(out[1, 0].argmax()))
        runs.append((toks, np.stack(steps)))
    (warm_toks, warm_logits), (cold_toks, cold_logits) = runs
    assert warm_toks == cold_toks and len(set(cold_toks)) > new // 2
    np.testing.assert_allclose(warm_logits, cold_logits, rtol=1e-5, atol=1e-5)


def test_vllm_surface_with_the_default_executor(models):
    """What vLLM reads and calls: capabilities, n_layers (the first layers of the model), DP submeshes."""
    model = models["llama"]
    assert G.LlamaForCausalLM.model_capabilities["supports_prefix_caching"] is True
    assert G.Gemma3ForCausalLM.model_capabilities["supports_prefix_caching"] is False
    gen = G.LlamaForCausalLM.initialize_vllm_model(None, G.EmulatedMesh((1, 2)), 4, 256, n_layers=1,
                                                   tt_data_parallel=2, model=model, numerics="exact")
    assert gen.config.num_layers == 1 and len(gen.model) == 2
    one = dataclasses.replace(model, config=gen.config,
                              params={**model.params, "layers": {"0": _first(model.params["layers"]["0"])}})
    prompts, new = _prompts([20, 50, 7, 33], model.config.vocab_size, seed=9), 4
    kv = gen.allocate_kv_cache((12, 2, BS, 32), np.float32, 1)
    allocs = [pc.BlockAllocator(12, order=np.random.default_rng(s).permutation(12)) for s in range(2)]
    reqs = ["p", "q", "r", "s"]
    gen.track_block_ownership(allocs, reqs)
    for s, p in enumerate(prompts):
        allocs[s // 2].ensure(reqs[s], len(p) + new, BS)
    pt = np.concatenate([allocs[s // 2].page_table([reqs[s]], 8) for s in range(4)])
    tokens = np.zeros((4, 50), np.int32)
    for s, p in enumerate(prompts):
        tokens[s, :len(p)] = p
    nxt = gen.prefill_forward(tokens, page_table=pt, kv_cache=kv, prompt_lens=[len(p) for p in prompts])[:, 0]
    got = [[int(t)] for t in nxt.argmax(-1)]
    for t in range(new - 1):
        out = gen.decode_forward(np.array([g[-1] for g in got]), np.array([len(p) + t for p in prompts]),
                                 page_table=pt, kv_cache=kv)
        for g, lg in zip(got, out[:, 0]):
            g.append(int(lg.argmax()))
    _check(one, prompts, got)


def _first(tree):
    return {k: _first(v) for k, v in tree.items()} if isinstance(tree, dict) else tree[:1]


# ------------------------------------------------------------------------------------ device executor
class EmulatedDevice:
    """`TTNNExecutor`'s interface (load / to_device / run / to_numpy) over the emulator's ops, checking what the
    real one checks before it reaches ttnn: input names, shapes against the specs, weights by name."""

    def __init__(self, emu):
        self.emu, self.loaded = emu, None

    def to_device(self, array, spec, name):
        a = np.asarray(array)
        if len(a.shape) != len(spec.shape) or any(w is not None and w != g for w, g in zip(spec.shape, a.shape)):
            raise AssertionError(f"{name}: host array {a.shape} does not match its spec {spec.shape}")
        return a.astype(np.int32 if "int" in spec.dtype else np.float32)

    def load(self, arrays, specs):
        self.loaded = set(arrays)
        return {n: self.to_device(a, specs[n], n) for n, a in arrays.items()}

    def run(self, prog, inputs, tensors):
        assert set(inputs) == set(prog.inputs)
        inputs = {n: self.to_device(x, prog.tensors[n], n) for n, x in inputs.items()}
        kv = [[tensors[f"kv.{i}.k"], tensors[f"kv.{i}.v"]] for i in range(self.emu.config.num_layers)]
        return self.emu.run(prog, inputs, kv)

    def to_numpy(self, tensor):
        return np.asarray(tensor)


def _device_generator(cls, model, device_of, batch, max_seq_len, **kw):
    """A generator over one `TTNNDeviceExecutor`; its programs follow an emulator of the same policy."""
    from tt_backend import Executor

    programs = Executor(model, numerics="exact", max_seq_len=max_seq_len + 128, block_size=BS)
    device = device_of(programs)
    ex = G.TTNNDeviceExecutor(programs, device, model.params)
    return cls([ex], max_batch_size=batch, max_seq_len=max_seq_len, block_size=BS, **kw), device


@pytest.mark.parametrize("name, cls, hybrid", [("llama", G.LlamaForCausalLM, False),
                                               ("gemma3", G.Gemma3ForCausalLM, True)])
def test_device_executor_plumbing_on_an_emulated_device(models, name, cls, hybrid):
    """The device executor's inputs fit the program's specs (page tables widened to them), its caches live on
    the device (the host buffers stay zero) and its tokens equal jm.generate's; rings on gemma3."""
    model = models[name]
    gen, device = _device_generator(cls, model, EmulatedDevice, 2, 256, hybrid_kv_cache_groups=hybrid)
    assert device.loaded == set(gen.model[0].programs.weight_specs)
    prompts, new = _prompts([130, 40], model.config.vocab_size, seed=10), 8
    pool = Pool(gen, 40, seed=11)
    for r, p in zip("ab", prompts):
        pool.add(r, len(p) + new)
    got, _ = _serve(gen, pool, ["a", "b"], prompts, new)
    _check(model, prompts, got)
    assert not any(a.any() for layer in pool.kv[0] for a in layer)


@pytest.mark.tt_device
@pytest.mark.parametrize("name, cls, hybrid", [("llama", G.LlamaForCausalLM, False),
                                               ("gemma3", G.Gemma3ForCausalLM, True)])
def test_device_generation_matches_the_emulator(models, name, cls, hybrid):
    """Hardware only (skips without the ttnn wheel or a chip): the generator on a real device (ttnn.open_device)
    against the emulated program at `full` numerics, same prompts, same shuffled per-layer page tables, decode
    teacher-forced with the emulator's greedy tokens. PCC >= 0.99 for every step's logits (packing, fidelity and
    accumulation are modelled, not bit-verified); top-1 agreement printed."""
    from tt_backend import ttnn_exec

    try:
        ttnn_exec.import_ttnn()
    except ImportError:
        pytest.skip("the ttnn wheel is not installed")
    if not ttnn_exec.device_available():
        pytest.skip("no Tenstorrent device (ttnn.get_device_ids() is empty)")
    from tt_backend import Executor

    model = models[name]
    emu = Executor(model, numerics="full", max_seq_len=256 + 128, block_size=BS)
    emu_gen = cls([VLLMExecutor.wrap(emu)], max_batch_size=2, max_seq_len=256, block_size=BS,
                  hybrid_kv_cache_groups=hybrid)
    device = ttnn_exec.TTNNExecutor.open()
    try:
        # the device runs the emulator's programs: the same per-layer precision
        dev_gen = cls([G.TTNNDeviceExecutor(emu, device, model.params)], max_batch_size=2, max_seq_len=256,
                      block_size=BS, hybrid_kv_cache_groups=hybrid)
        prompts, new = _prompts([130, 40], model.config.vocab_size, seed=12), 16
        runs = []
        for gen in (emu_gen, dev_gen):
            pool = Pool(gen, 40, seed=13)
            for r, p in zip("ab", prompts):
                pool.add(r, len(p) + new)
            tables = pool.tables(["a", "b"])
            tokens = np.zeros((2, 130), np.int32)
            for i, p in enumerate(prompts):
                tokens[i, :len(p)] = p
            steps = [gen.prefill_forward(tokens, kv_cache=pool.kv, prompt_lens=[130, 40],
                                         page_tables_per_layer=tables)[:, 0]]
            runs.append((gen, pool, tables, steps))
        fed = runs[0][3][0].argmax(-1)
        for t in range(new):
            for gen, pool, tables, steps in runs:
                steps.append(gen.decode_forward(fed, np.array([130 + t, 40 + t]), kv_cache=pool.kv,
                                                page_tables_per_layer=tables)[:, 0])
            fed = runs[0][3][-1].argmax(-1)
    finally:
        device.close()
    want, got = np.stack(runs[0][3]), np.stack(runs[1][3])
    pcc = [np.corrcoef(w.ravel(), g.ravel())[0, 1] for w, g in zip(want, got)]
    print(f"{name}: min PCC {min(pcc):.4f}, top-1 agreement {(want.argmax(-1) == got.argmax(-1)).mean():.3f}")
    assert min(pcc) >= 0.99, pcc


# ------------------------------------------------------------------------------------ KV specs per kind
def _vllm_config(hf):
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype="bfloat16"),
                           cache_config=SimpleNamespace(block_size=BS))


@pytest.mark.parametrize("version", ["v4", "v4.1"])
def test_deepseek_hybrid_kv_specs(version):
    """DeepSeek's caches by kind, from the lowering's declaration and checked against the plan's cache specs:
    a window ring per layer, compressed CSA/HCA entries and indexer keys at the layer's ratio, compressor state;
    reuse layers own no compressed cache. Declared hybrid even with hybrid groups off (the upstream plugin's
    default), and at least three paged kinds."""
    from jaxmodels import families, plan
    from tests.oracles import deepseek_ckpt
    from tests.parity.test_deepseek_v4 import V4_TINY

    hf = ({**V4_TINY, "model_type": "deepseek_v4"} if version == "v4" else deepseek_ckpt.tiny_config(
        "v4.1", quantized=False, hidden_size=64, moe_intermediate_size=32, q_lora_rank=32, o_lora_rank=32,
        index_head_dim=32, engram_head_dim=16, max_position_embeddings=8192))
    cfg = families.config_from_hf(hf)
    specs = G.Generator.get_kv_cache_spec(_vllm_config(hf), hybrid_kv_cache_groups=False)
    for i, layer in enumerate(cfg.layers):
        base = f"model.layers.{i}.self_attn"
        slots = {s.name: s for s in plan.cache_specs(cfg, layer) if isinstance(s, plan.SlotSpec)}
        window = specs[base]
        assert type(window) is G.SlidingWindowSpec and window.sliding_window == slots["kv"].window
        assert (window.num_kv_heads, window.head_size, window.tensors) == (1, cfg.head_dim, 1)  # latent: K = V
        m = layer.attention.mla
        if "compressed" in slots:
            comp = specs[base + ".compressor"]
            assert type(comp) is G.CompressedSpec and comp.compress_ratio == slots["compressed"].per
            assert comp.kind == ("csa" if m.select == "indexer" else "hca")
            state = specs.get(base + ".compressor.state.a")  # a gated compressor's per-token projections
            assert (state is not None) == bool(m.compressor_gate)
            if state is not None:
                assert type(state) is G.CompressorStateSpec and state.dtype == "ttnn.float32"
                assert state.head_size == (2 if m.overlap else 1) * cfg.head_dim and state.of == comp.kind
                assert specs[base + ".compressor.state.g"] == state
        else:  # SWA-only or a reuse layer: it reads a source layer's compressed cache
            assert base + ".compressor" not in specs
        if "index_keys" in slots:
            keys = specs[base + ".indexer"]
            assert (keys.kind, keys.compress_ratio, keys.head_size) == ("index_keys", slots["index_keys"].per,
                                                                        m.index_head_dim)
            istate = specs.get(base + ".indexer.state.a")  # V4: the indexer's own compressor
            assert (istate is not None) == (m.index_keys == "compressor")
        else:
            assert base + ".indexer" not in specs
    kinds = {(type(s).__name__, getattr(s, "kind", None)) for s in specs.values() if isinstance(s, G.AttentionSpec)}
    assert len(kinds) >= 3 and ("SlidingWindowSpec", None) in kinds and ("CompressedSpec", "index_keys") in kinds
    groups = G.kv_cache_groups(specs)
    assert sum(len(names) for _, names in groups) == len(specs)
    assert len({spec for spec, _ in groups}) == len(groups)
    assert [names for spec, names in groups if isinstance(spec, G.SlidingWindowSpec)] == [
        [f"model.layers.{i}.self_attn" for i in range(cfg.num_layers)]]  # every window ring in one group
