"""Decode step time and compile time vs the layer loop's unroll, Llama-3.1-8B or GPT-OSS-20B shape (GPU).

    python3 benchmarks/decode_unroll.py --out $OUT [--model llama|gpt_oss] [--batches 1,32] [--tiny]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.bench_dense import LLAMA31_8B  # noqa: E402
from benchmarks.bench_moe import GPT_OSS_20B  # noqa: E402
from jaxmodels import families, model as M  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--model", default="llama", choices=("llama", "gpt_oss"))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--unrolls", default="1,2,4,True")
    a = ap.parse_args()
    hf = dict(LLAMA31_8B if a.model == "llama" else GPT_OSS_20B)
    if a.tiny:
        hf |= {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
    cfg = families.config_from_hf(hf)
    dtype = jnp.float32 if a.tiny else jnp.bfloat16  # a CPU smoke test: XLA:CPU lacks some bf16 dots
    params = M.init_params(cfg, 0, dtype=dtype)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "model": a.model, "runs": []}
    for B in map(int, a.batches.split(",")):
        for unroll in (True if u == "True" else int(u) for u in a.unrolls.split(",")):
            cache = M.init_cache(cfg, B, 1024, dtype)
            f = jax.jit(M.decode_step, static_argnums=(1, 5), donate_argnums=4)
            tok, pos = jnp.zeros((B,), jnp.int32), jnp.full((B,), 512, jnp.int32)
            t0 = time.perf_counter()
            compiled = f.lower(params, cfg, tok, pos, cache, unroll).compile()
            t_compile = time.perf_counter() - t0
            for _ in range(3):
                logits, cache = compiled(params, tok, pos, cache)
            jax.block_until_ready(logits)
            n = 5 if a.tiny else 50
            t0 = time.perf_counter()
            for i in range(n):
                logits, cache = compiled(params, tok, pos + i, cache)
            jax.block_until_ready(logits)
            step = (time.perf_counter() - t0) / n
            r = {"batch": B, "unroll": str(unroll), "compile_s": round(t_compile, 2), "step_ms": round(step * 1e3, 3)}
            print(r, flush=True)
            res["runs"].append(r)
            del cache
    with open(os.path.join(a.out, f"decode_unroll_{a.model}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
