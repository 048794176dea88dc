"""Speculative decoding cost (issue #13 §3): one speculative step (DSpark draft of k tokens + one target pass
over k+1 positions + the acceptance rule + the drafter's cache update) vs one plain decode step, at batch 1
and 32, at DeepSeek V4.1-Flash shapes with a few layers (bench_deepseek.py's roles, routed experts kept FP4)
and the three DSpark blocks (128 experts top-3, bf16).

Random weights make the acceptance rate meaningless, so this prints the cost ratio r = t_spec / t_plain and
the break-even acceptance rate: with each draft accepted independently with probability a, a step emits
(1 - a^(k+1)) / (1 - a) tokens; speculation pays when that exceeds r. Only a few backbone layers are kept,
so the drafter's share of the step is larger here than in the 43-layer model (the real break-even is lower).

    PYTHONPATH=. python benchmarks/spec_bench.py [--k 3] [--layers 20,24] [--context 2048] [--out spec.json]
    PYTHONPATH=. python benchmarks/spec_bench.py --tiny     # the test suite's tiny V4.1, on a CPU

--engine times the serving engine instead (the public path: `Engine.step` with num_speculative_tokens=k against
a plain engine, every row decoding, the host's work included): ms per step and the same break-even.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # real-width layers fill the card (JAX's default: 75 %)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import log, median_time  # noqa: E402
from bench_deepseek import FLASH  # noqa: E402

from jaxmodels import model as M, speculative as S  # noqa: E402
from jaxmodels.families import deepseek_v4  # noqa: E402
from jaxmodels.sampling import Sampling  # noqa: E402


def flash_spec_config(layers, block: int):
    """V4.1-Flash with the given backbone layers (no Engram) and its three DSpark blocks reading the last
    (up to) three of them."""
    text = {**FLASH, "dspark_block_size": block, "dspark_noise_token_id": 128799, "dspark_markov_rank": 256,
            "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "dspark_target_layer_ids": [37, 38, 39]}
    cfg = deepseek_v4.config({"model_type": "deepseek_v41", "text_config": text})
    picked = tuple(dataclasses.replace(cfg.layers[i], engram=-1) for i in layers)
    targets = tuple(range(max(0, len(picked) - 3), len(picked)))
    return dataclasses.replace(cfg, layers=picked, engram=None, mtp=dataclasses.replace(cfg.mtp, target_layers=targets))


def tiny_config(block: int):
    from tests.oracles import deepseek_ckpt

    return deepseek_v4.config(deepseek_ckpt.tiny_config(
        "v4.1", quantized=False, hidden_size=64, moe_intermediate_size=32, q_lora_rank=32, o_lora_rank=32,
        index_head_dim=32, engram_head_dim=16, dspark_block_size=block, max_position_embeddings=4096))


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance rate a at which (1 - a^(k+1)) / (1 - a) = ratio (None: not reachable, ratio > k+1)."""
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        lo, hi = (a, hi) if sum(a ** i for i in range(k + 1)) < ratio else (lo, a)
    return (lo + hi) / 2


TRACE = False  # --trace: a line (blocking on the device) after each stage and step, to place a device fault


def trace(what, *arrays):
    if TRACE:
        jax.block_until_ready(arrays)
        log(f"  [trace] {what}" + "".join(f" {np.asarray(a).ravel()[:4].tolist()}" for a in arrays))


def measure(cfg, params, B: int, context: int, k: int, reps: int, greedy: bool) -> dict:
    rng = np.random.default_rng(0)
    max_len = context + 8 * (k + 1) * (reps + 4)
    dtype = params["embed"].dtype
    sampling = Sampling(0.0 if greedy else 1.0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, context)), jnp.int32)
    lengths = jnp.full((B,), context, jnp.int32)

    @jax.jit
    def start(params, tokens, lengths):
        cache = M.init_cache(cfg, B, max_len, dtype, lookahead=k)
        logits, cache, aux = S.prefill(params, cfg, tokens, lengths, cache)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        following = jnp.concatenate([tokens[:, 1:], first[:, None]], axis=1)
        dcache, dstate = S.observe(params, cfg, S.drafter_cache(cfg, B, max_len, dtype, k), aux, following,
                                   jnp.zeros_like(lengths), lengths)
        return first, cache, dcache, dstate

    def spec_step(params, tok, pos, cache, dcache, dstate, key):
        kd, ka = jax.random.split(key)
        pick = ((lambda i, row: jnp.argmax(row, axis=-1).astype(jnp.int32)) if greedy
                else lambda i, row: jax.random.categorical(jax.random.fold_in(kd, i), row).astype(jnp.int32))
        drafts, dlogits, dcache = S.propose(params, cfg, dcache, dstate, tok, pos, k, pick)
        chunk = jnp.concatenate([tok[:, None], drafts], axis=1)
        logits, cache, aux = S.verify(params, cfg, chunk, pos, cache)
        emitted, count = S.accept(logits, drafts, dlogits, ka, sampling)
        dcache, dstate = S.observe(params, cfg, dcache, aux, emitted, pos, count)
        tok = jnp.take_along_axis(emitted, (count - 1)[:, None], axis=1)[:, 0]
        return tok, pos + count, cache, dcache, dstate

    spec = jax.jit(spec_step, donate_argnums=(3, 4), compiler_options=M.COMPILER_OPTIONS)
    plain = jax.jit(lambda p, t, pos, c: M.decode_step(p, cfg, t, pos, c), donate_argnums=(3,),
                    compiler_options=M.COMPILER_OPTIONS)

    first, cache, dcache, dstate = start(params, tokens, lengths)
    trace("prefill + drafter observe: first token", first)
    pcache = jax.tree.map(jnp.copy, cache)
    state = {"tok": first, "pos": lengths, "cache": cache, "dcache": dcache, "dstate": dstate}
    pstate = {"tok": first, "pos": lengths, "cache": pcache}
    key = jax.random.PRNGKey(1)

    def run_spec():
        out = spec(params, state["tok"], state["pos"], state["cache"], state["dcache"], state["dstate"], key)
        state.update(zip(("tok", "pos", "cache", "dcache", "dstate"), out))
        jax.block_until_ready(state["tok"])
        trace("spec step: next positions", state["pos"])

    def run_plain():
        logits, pstate["cache"] = plain(params, pstate["tok"], pstate["pos"], pstate["cache"])
        pstate["pos"] = pstate["pos"] + 1
        jax.block_until_ready(logits)
        trace("plain step: next positions", pstate["pos"])

    for fn in (run_spec, run_plain):  # compile and warm
        fn()
        fn()
    t_spec, _ = median_time(run_spec, reps)
    t_plain, _ = median_time(run_plain, reps)
    ratio = t_spec / t_plain
    return {"batch": B, "context": context, "k": k, "spec_ms": 1e3 * t_spec, "plain_ms": 1e3 * t_plain,
            "ratio": ratio, "break_even_acceptance": break_even(ratio, k)}


def measure_engine(cfg, params, B: int, context: int, k: int, reps: int) -> dict:
    """The serving engine's steady decode step with k draft tokens (verify steps) and without (plain decode, the
    host/device overlap on as by default): B requests of `context` random prompt tokens, every row decoding."""
    import jaxmodels as jm
    from serving import Engine, EngineConfig, SamplingParams

    model = jm.Model(cfg, params)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, context).tolist() for _ in range(B)]
    max_len = context + (reps + 16) * (k + 1) + 16
    out = {"batch": B, "context": context, "k": k}
    def step(engine):
        engine.step()
        if TRACE:
            trace(f"engine step {engine.steps}: computed " + str([(r.computed, len(r.tokens))
                                                                for r in list(engine.requests.values())[:2]]))

    for name, kk in (("spec", k), ("plain", 0)):
        engine = Engine(model, EngineConfig(max_num_seqs=B, max_model_len=max_len, block_size=16,
                                            kv_blocks=B * 3 * (max_len // 16 + 16), max_num_batched_tokens=2048,
                                            num_speculative_tokens=kk))
        for i, p in enumerate(prompts):
            engine.add(str(i), p, SamplingParams(temperature=0, max_tokens=max_len - context, ignore_eos=True))
        t0 = time.perf_counter()
        while any(r.computed < len(r.prompt) for r in engine.requests.values()) or engine.steps < 4:
            step(engine)  # prefill (chunks), then a few decode steps: every shape compiled
        out[f"{name}_warm_s"] = time.perf_counter() - t0
        emitted = engine.counters["generation_tokens"]
        t, _ = median_time(functools.partial(step, engine), reps)
        out[f"{name}_ms"] = 1e3 * t
        out[f"{name}_tokens_per_step"] = (engine.counters["generation_tokens"] - emitted) / reps / B
        while engine.has_work():  # the rest, untimed (frees the device memory of this engine's pool)
            for rid in list(engine.requests):
                engine.abort(rid)
            engine.step()
        del engine
    out["ratio"] = out["spec_ms"] / out["plain_ms"]
    out["break_even_acceptance"] = break_even(out["ratio"], k)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny V4.1 test config (CPU)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--layers", default="20,24", help="V4.1-Flash backbone layers to keep")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sampling", action="store_true", help="time the sampling rule instead of greedy")
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    ap.add_argument("--engine", action="store_true", help="time the serving engine's steps (see the docstring)")
    ap.add_argument("--no-gathered", action="store_true", help="MoE decode through XLA's gather, not the kernel")
    ap.add_argument("--trace", action="store_true", help="log each stage and step (timings then include the logging)")
    args = ap.parse_args()
    global TRACE
    TRACE = args.trace
    if args.no_gathered:
        from jaxmodels.layers import gathered

        gathered.fits = lambda x, w: False
    block = max(args.k, 4)
    if args.tiny:
        cfg, dtype = tiny_config(block), jnp.float32
        params = M.init_params(cfg, seed=0, dtype=dtype, mtp=True)
        context = min(args.context, 64)
    else:
        cfg, dtype = flash_spec_config([int(i) for i in args.layers.split(",")], block), jnp.bfloat16
        params = M.init_params(cfg, seed=0, dtype=dtype, fp4_experts=True, mtp=True)
        context = args.context
    log(f"{jax.devices()[0].device_kind}: {len(cfg.layers)} backbone layers + {cfg.mtp.layers} DSpark blocks, "
        f"k={args.k}, context {context}; random weights: acceptance is meaningless, see the break-even column")
    rows = []
    print(f"{'B':>4} {'spec ms':>9} {'plain ms':>9} {'ratio':>6} {'break-even acceptance':>22}")
    for B in (int(b) for b in args.batches.split(",")):
        t0 = time.perf_counter()
        r = (measure_engine(cfg, params, B, context, args.k, args.reps) if args.engine else
             measure(cfg, params, B, context, args.k, args.reps, not args.sampling))
        be = "never (ratio > k+1)" if r["break_even_acceptance"] is None else f"{r['break_even_acceptance']:.3f}"
        print(f"{B:>4} {r['spec_ms']:>9.3f} {r['plain_ms']:>9.3f} {r['ratio']:>6.2f} {be:>22}"
              f"   ({time.perf_counter() - t0:.0f} s incl. compile)")
        rows.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "layers": args.layers, "tiny": args.tiny,
                       "engine": args.engine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
