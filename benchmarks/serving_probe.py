"""Where an engine decode step's time goes (Llama-3.1-8B shape, 64 rows, 2048-token max_model_len, random weights):
the engine's step() wall time, the jitted paged step alone (same arguments, device time), and `M.decode_step` on a
contiguous cache of the same size.

    python3 benchmarks/serving_probe.py --out $OUT
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=64)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from benchmarks.bench_dense import LLAMA31_8B
    from jaxmodels import families, model as M
    from serving import Engine, EngineConfig, SamplingParams
    from serving import runner as R

    cfg = families.config_from_hf(LLAMA31_8B)
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=jnp.bfloat16))()
    model = jm.Model(cfg, params, None)
    B, L, bs = a.rows, 2048, 16
    engine = Engine(model, EngineConfig(max_num_seqs=B, max_model_len=L, block_size=bs, kv_blocks=B * L // bs + 64))
    rng = np.random.default_rng(0)
    for i in range(B):
        engine.add(str(i), rng.integers(0, cfg.vocab_size, 512).tolist(),
                   SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    walls = []
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        if len(walls) == 120:  # steady decode: capture one step's arguments
            pieces = [(r, r.computed, 1) for r in engine.scheduler.running]
            break
    res = {"rows": B, "engine_step_ms_p50_steady": round(1e3 * float(np.median(walls[60:120])), 2)}
    # the same jitted step, alone: host arguments built once
    run = engine.runner
    P = R.bucket(len(pieces), 8, cap=run.rows - 1)
    rows = np.array([r.row for r, _, _ in pieces], np.int32)
    tokens = np.array([[r.tokens[-1]] for r, _, _ in pieces], np.int32)
    start = np.array([r.computed for r, _, _ in pieces], np.int32)
    tables = tuple(np.stack([r.blocks.entries[gi] for r, _, _ in pieces]) for gi in range(len(run.groups)))
    s = {"temperature": np.zeros(P, np.float32), "top_k": np.zeros(P, np.int32), "top_p": np.ones(P, np.float32),
         "min_p": np.zeros(P, np.float32), "seed": np.zeros(P, np.uint32), "index": np.zeros(P, np.int32),
         "presence": np.zeros(P, np.float32), "frequency": np.zeros(P, np.float32), "emit": np.ones(P, bool)}
    args = [jax.device_put(x) for x in (rows, tables, tokens, start, np.zeros(P, np.int32), s)]

    def paged():
        out = R.step(params, run.cache, run.counts, *args, cfg=cfg, how="decode", sampled=False, penalized=False,
                     top_n=0)
        run.cache, run.counts = out[0], out[-1]
        return out[1]

    def timed(fn, n=30):
        jax.block_until_ready(fn())
        t = time.perf_counter()
        for _ in range(n):
            x = fn()
        jax.block_until_ready(x)
        return round(1e3 * (time.perf_counter() - t) / n, 2)

    res["paged_step_alone_ms"] = timed(paged)
    cache = M.init_cache(cfg, B, L, jnp.bfloat16)
    dec = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4, compiler_options=M.COMPILER_OPTIONS)
    tok, pos = jnp.asarray(tokens[:, 0]), jnp.asarray(start)
    state = {"cache": cache}

    def contiguous():
        logits, state["cache"] = dec(params, cfg, tok, pos, state["cache"])
        return logits

    res["contiguous_decode_ms"] = timed(contiguous)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    kv = 2 * cfg.num_layers * B * 640 * cfg.num_kv_heads * cfg.head_dim * 2  # the live context only
    res["roofline_ms_at_4.8TBps"] = round(1e3 * (weights + kv) / 4.8e12, 2)
    print(json.dumps(res), flush=True)
    with open(os.path.join(a.out, "serving_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
