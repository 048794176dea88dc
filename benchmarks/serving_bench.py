"""Offline serving throughput and latency through the engine (`serving.Engine`, as `LLM` and the server drive it),
random weights at real shapes. Each stage runs in its own process.

    python3 benchmarks/serving_bench.py --out $OUT [--stages tiny,gpt_oss,llama,hf_gpt_oss,hf_llama]
        [--requests 128] [--prompt 1024] [--new 1024] [--max-num-seqs 64] [--budget 2048] [--no-prefix-caching]
        [--no-async-scheduling] [--warmup engine|run|none] [--fp4]

Reports output tok/s (prefill included: all requests arrive at t=0), TTFT and inter-token latency p50/p99, steps,
compiled shapes, the compile time of shapes first met inside the measured run (`compile_s_in_run`), and the
engine's host time per step without it (step() outside the wait for the device's tokens; with async scheduling,
the default, it overlaps the device step).
The `hf_*` stages run the same workload (same shape, random bf16 weights, same request count, lengths, concurrency
and token budget) through transformers' continuous batching, `model.generate_batch` (hf_peer.generate_batch).
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kv_blocks(cfg, rows: int, max_len: int, block_size: int, dtype) -> int:
    """Blocks for `rows` sequences of max_len tokens in each KV pool (its largest need), no preemption."""
    from serving.runner import groups_of

    groups = groups_of(cfg, max_len, block_size, dtype)[0]
    return rows * max(sum(g.entries for g in groups if g.space == s) for s in {g.space for g in groups})


def hf_child(a):
    """The peer: the same workload through transformers' generate_batch."""
    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hf_peer
    from benchmarks.bench_dense import LLAMA31_8B
    from benchmarks.bench_moe import GPT_OSS_20B

    name = a.child
    hf, attn = (GPT_OSS_20B, "eager") if name == "hf_gpt_oss" else (LLAMA31_8B, "sdpa")  # GPT-OSS: no sdpa path
    model, dev, info = hf_peer.build(hf, attn)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, hf["vocab_size"], a.prompt).tolist() for _ in range(a.requests)]
    res = {"stage": name, "versions": hf_peer.versions(), **info, "prompt": a.prompt, "new": a.new,
           "max_num_seqs": a.max_num_seqs, "budget": a.budget}
    res |= hf_peer.generate_batch(model, prompts, a.new, a.max_num_seqs, a.budget)
    print(json.dumps(res), flush=True)
    with open(os.path.join(a.out, f"serving_{name}_{a.requests}r{a.max_num_seqs}s.json"), "w") as f:
        json.dump(res, f, indent=1)


def child(a):
    if a.child.startswith("hf_"):
        return hf_child(a)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from benchmarks.bench_dense import LLAMA31_8B, TINY
    from benchmarks.bench_moe import GPT_OSS_20B
    from jaxmodels import families, model as M
    from serving import Engine, EngineConfig, SamplingParams

    name = a.child
    hf = dict(GPT_OSS_20B if name in ("gpt_oss", "tiny") else LLAMA31_8B)
    if name == "tiny":
        hf |= {k: v for k, v in TINY.items() if k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_attention_heads", "num_key_value_heads", "head_dim")}
        hf["num_hidden_layers"] = 4
    cfg = families.config_from_hf(hf)
    fp4 = a.fp4 and any(ls.mlp.kind == "moe" for ls in cfg.layers)  # a dense model has no experts to keep in FP4
    t0 = time.perf_counter()
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=jnp.bfloat16, fp4_experts=fp4))()
    jax.block_until_ready(params)
    model = jm.Model(cfg, params, None)
    max_len = a.prompt + a.new
    bs = 16
    engine = Engine(model, EngineConfig(max_num_seqs=a.max_num_seqs, max_model_len=max_len, block_size=bs,
                                        kv_blocks=kv_blocks(cfg, a.max_num_seqs, max_len, bs, jnp.bfloat16) + 256,
                                        max_num_batched_tokens=a.budget,
                                        enable_prefix_caching=not a.no_prefix_caching,
                                        async_scheduling=not a.no_async_scheduling))
    res = {"stage": name, "experts": "fp4" if fp4 else "bf16", "init_s": round(time.perf_counter() - t0, 1),
           "requests": a.requests, "prompt": a.prompt,
           "new": a.new, "max_num_seqs": a.max_num_seqs, "budget": a.budget, "prefix_caching": engine.pool.prefix_caching,
           "max_chunk": engine.scheduler.max_chunk, "async_scheduling": engine.async_scheduling,
           "device": str(jax.devices()[0])}
    rng = np.random.default_rng(0)

    def run(n, prompt, new):
        p = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        for i in range(n):
            engine.add(f"{prompt}-{i}-{time.time()}", rng.integers(0, cfg.vocab_size, prompt).tolist(), p)
        t = time.perf_counter()
        times, first, tokens, step_s = {}, {}, 0, []
        while engine.has_work():
            s = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            step_s.append(now - s)
            for o in outs:
                tokens += len(o.token_ids)
                times.setdefault(o.request_id, []).append(now)
        return time.perf_counter() - t, t, times, tokens, step_s

    t = time.perf_counter()
    if a.warmup == "engine":  # every shape a step can launch, as `jaxmodels serve` does before it listens
        res["warmup_shapes"] = engine.warmup(("greedy",))
    elif a.warmup == "run":  # the shapes a short run meets (prefill chunks of every row bucket, decode)
        run(a.max_num_seqs, a.prompt, 4)
    res["warmup"], res["warmup_s"] = a.warmup, round(time.perf_counter() - t, 1)
    res["compiled_shapes_after_warmup"] = len(engine.runner.shapes)
    timing, compile_s, shapes = dict(engine.timing), engine.runner.compile_s, len(engine.runner.shapes)
    wall, t, times, tokens, step_s = run(a.requests, a.prompt, a.new)
    steps = engine.timing["steps"] - timing["steps"]
    compile_s = engine.runner.compile_s - compile_s  # shapes first met in the measured run: not host work
    host_s = (engine.timing["step_s"] - timing["step_s"]) - (engine.timing["wait_s"] - timing["wait_s"]) - compile_s
    ttft = np.array([v[0] - t for v in times.values()])
    itl = np.concatenate([np.diff(v) for v in times.values() if len(v) > 1])
    res |= {"wall_s": round(wall, 2), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 1),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3), "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
            "itl_p50_ms": round(1e3 * float(np.percentile(itl, 50)), 2),
            "itl_p99_ms": round(1e3 * float(np.percentile(itl, 99)), 2),
            "steps": len(step_s), "step_p50_ms": round(1e3 * float(np.median(step_s)), 2),
            "host_ms_per_step": round(1e3 * host_s / steps, 3),
            "compile_s_in_run": round(compile_s, 2), "shapes_compiled_in_run": len(engine.runner.shapes) - shapes,
            "compiled_shapes": len(engine.runner.shapes), "preemptions": engine.stats()["preemptions"]}
    assert tokens == a.requests * a.new, tokens
    print(json.dumps(res), flush=True)
    tag = ("_fp4" if fp4 else "") + ("_nopc" if a.no_prefix_caching else "") + \
        ("_sync" if a.no_async_scheduling else "") + ("" if a.warmup == "engine" else f"_warm{a.warmup}")
    with open(os.path.join(a.out, f"serving_{name}_{a.requests}r{a.max_num_seqs}s{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--stages", default="tiny,gpt_oss,llama")
    ap.add_argument("--child")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--timeout", type=int, default=280)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--warmup", default="engine", choices=("engine", "run", "none"),
                    help="engine: Engine.warmup compiles every step shape first (default); run: a short run of "
                         "max-num-seqs requests compiles the shapes it meets; none: compiles land in the run")
    ap.add_argument("--no-async-scheduling", action="store_true", help="no host/device overlap (for comparison)")
    ap.add_argument("--fp4", action="store_true", help="routed experts kept as FP4 bytes (GPT-OSS's MXFP4)")
    a = ap.parse_args()
    if a.child:
        return child(a)
    os.makedirs(a.out, exist_ok=True)
    for stage in a.stages.split(","):
        args = [sys.executable, __file__, "--child", stage, "--out", a.out, "--requests", str(a.requests),
                "--prompt", str(a.prompt), "--new", str(a.new), "--max-num-seqs", str(a.max_num_seqs),
                "--budget", str(a.budget), "--warmup", a.warmup] + ["--no-prefix-caching"] * a.no_prefix_caching + \
            ["--no-async-scheduling"] * a.no_async_scheduling + ["--fp4"] * a.fp4
        if stage == "tiny":
            args[args.index("--requests") + 1] = "16"
        try:
            subprocess.run(args, timeout=a.timeout, check=False)
        except subprocess.TimeoutExpired:
            print(json.dumps({"stage": stage, "error": f"timed out after {a.timeout} s"}), flush=True)


if __name__ == "__main__":
    main()
