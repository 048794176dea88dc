"""Decode and prefill through the public API (`jm.generate`, `M.prefill` jitted with `M.COMPILER_OPTIONS`) on
the GPU, each stage in its own process. Stages: llama (Llama-3.1-8B shape), gpt_oss (GPT-OSS-20B shape, bf16
experts), *_triton (the same with XLA's Triton GEMMs, the old default), *_merge (with XLA's dot merger, the old
default), depth2 / depth32 (first generate() call).

    python3 benchmarks/decode_probe.py --out $OUT [--stages llama,gpt_oss,...] [--tiny]
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = "llama,llama_triton,gpt_oss,gpt_oss_triton,depth2,depth32"


def child(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from benchmarks.bench_dense import LLAMA31_8B, TINY
    from benchmarks.bench_moe import GPT_OSS_20B
    import importlib

    from jaxmodels import families, model as M
    G = importlib.import_module("jaxmodels.generate")  # the module (jaxmodels.generate is also the function)

    name = a.child
    opts = dict(M.COMPILER_OPTIONS)
    if name.endswith("_triton"):
        opts["xla_gpu_enable_triton_gemm"] = True
    if name.endswith("_merge"):  # XLA's dot merger on (the old default: one GEMM of q/k/v over wq|wk|wv copied)
        opts.pop("xla_disable_hlo_passes")
    if name.endswith(("_triton", "_merge")):
        G._generate = jax.jit(G._generate.__wrapped__, compiler_options=opts,
                              static_argnames=("cfg", "max_new", "sampling", "max_len", "unroll", "shard"))
    hf = dict(GPT_OSS_20B if name.startswith("gpt_oss") else LLAMA31_8B)
    if name.startswith("depth"):
        hf["num_hidden_layers"] = int(name[5:])
    if a.tiny:
        hf |= {k: v for k, v in TINY.items() if k in ("vocab_size", "hidden_size", "intermediate_size",
                                                    "num_attention_heads", "num_key_value_heads", "head_dim")}
        hf["num_hidden_layers"] = min(hf["num_hidden_layers"], 4)
    cfg = families.config_from_hf(hf)
    dt = jnp.float32 if a.tiny else jnp.bfloat16
    t0 = time.perf_counter()
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dt))()
    jax.block_until_ready(params)
    model = jm.Model(cfg, params, None)
    rng = np.random.default_rng(0)
    res = {"stage": name, "compiler_options": opts, "init_s": round(time.perf_counter() - t0, 1), "decode": [],
           "prefill": []}

    def gen(B, prompt, new, max_len, **kw):
        prompts = rng.integers(0, cfg.vocab_size, (B, prompt)).tolist()
        t = time.perf_counter()
        out = jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True, max_len=max_len, **kw)
        assert all(len(x) == new for x in out.tokens)
        return time.perf_counter() - t

    lo, hi = (4, 12) if a.tiny else (32, 160)
    cases = [(1, 512, 1024), (32, 512, 1024)]
    if name == "llama":
        cases += [(1, 512, 32768), (1, 8192, 32768), (1, 32000, 32768), (32, 512, 16384), (32, 8192, 16384)]
    if name.startswith("gpt_oss"):
        cases = [(1, 512, 1024), (64, 512, 1024)]
    if name.startswith("depth"):
        first = gen(1, 512, lo, 1024)
        again = min(gen(1, 512, lo, 1024) for _ in range(2))
        res["first_call_s"], res["run_s"] = round(first, 2), round(again, 3)
        cases = []
    if a.tiny:
        cases = [(1, 64, 1024), (4, 64, 1024)]
    for B, prompt, max_len in cases:
        first = gen(B, prompt, lo, max_len)  # compile included
        t_lo = min(gen(B, prompt, lo, max_len) for _ in range(2))
        t_hi = min(gen(B, prompt, hi, max_len) for _ in range(2))
        r = {"batch": B, "context": prompt, "max_len": max_len, "first_call_s": round(first, 2),
             "decode_tok_s": round(B * (hi - lo) / (t_hi - t_lo), 1), "step_ms": round((t_hi - t_lo) / (hi - lo) * 1e3, 3)}
        print(name, r, flush=True)
        res["decode"].append(r)
    if name == "llama" and not a.tiny:
        t_lo = min(gen(1, 512, lo, 1024, unroll=True) for _ in range(2))
        t_hi = min(gen(1, 512, hi, 1024, unroll=True) for _ in range(2))
        res["unroll_true_b1_step_ms"] = round((t_hi - t_lo) / (hi - lo) * 1e3, 3)
        print(name, "unroll=True step ms", res["unroll_true_b1_step_ms"], flush=True)
    if not name.startswith("depth"):
        pre = jax.jit(M.prefill, static_argnums=1, compiler_options=opts)
        for T in ([2048, 8192, 16384] if not a.tiny else [64]):
            if (name.startswith("gpt_oss") and T == 8192) or (name.startswith("llama") and T == 16384):
                continue
            cache = M.init_cache(cfg, 1, T, dt)
            toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, T)), jnp.int32)
            lens = jnp.asarray([T], jnp.int32)
            jax.block_until_ready(pre(params, cfg, toks, lens, cache))
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                jax.block_until_ready(pre(params, cfg, toks, lens, cache))
                ts.append(time.perf_counter() - t)
            r = {"T": T, "ms": round(min(ts) * 1e3, 2), "tok_s": round(T / min(ts))}
            print(name, "prefill", r, flush=True)
            res["prefill"].append(r)
            del cache
    if name.startswith("gpt_oss"):  # a serving-sized batch: 128 prompts of 1024 tokens (MoE memory ~ routed rows)
        B, T, new = (8, 64, 8) if a.tiny else (128, 1024, 32)
        first = gen(B, T, new, None)
        t = min(gen(B, T, new, None) for _ in range(2))
        res["batch_generate"] = {"prompts": B, "prompt_tokens": T, "new_tokens": new, "first_call_s": round(first, 2),
                                 "s": round(t, 3), "prompt_tok_s": round(B * T / t), "out_tok_s": round(B * new / t, 1)}
        print(name, "batch generate", res["batch_generate"], flush=True)
    with open(os.path.join(a.out, f"probe_{a.child}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--child")
    ap.add_argument("--stages", default=STAGES)
    a = ap.parse_args()
    if a.child:
        return child(a)
    os.makedirs(a.out, exist_ok=True)
    for name in a.stages.split(","):
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run([sys.executable, __file__, "--out", a.out, "--child", name] + (["--tiny"] if a.tiny else []),
                       env=env, check=False)


if __name__ == "__main__":
    main()
