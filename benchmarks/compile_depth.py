"""Compile time of a DeepSeek decode step against depth: the real V4.1-Flash / V4-Flash layer plans vs four layers.

Runs of same-role layers are scanned (jaxmodels.plan.Run), so compile time follows the number of distinct layer
bodies, not the depth. Real widths; parameters and cache are abstract (jax.eval_shape), so nothing is allocated
and the script runs on any backend:

    PYTHONPATH=. python benchmarks/compile_depth.py --out results/compile_depth.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_deepseek import FLASH  # noqa: E402

from jaxmodels import model as M, plan  # noqa: E402
from jaxmodels.families import deepseek_v4  # noqa: E402

V4_FLASH = {"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "hidden_size": 4096,
            "num_attention_heads": 64, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8,
            "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 256,
            "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "num_hash_layers": 3,
            "routed_scaling_factor": 1.5, "vocab_size": 129280,
            "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1}}
ENGRAM = {"engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
          "engram_n_heads": 8, "engram_head_dim": 256, "engram_vocab_size": 16000000,
          "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2}


def configs() -> dict:
    v41 = deepseek_v4.config({"model_type": "deepseek_v41", "text_config": {**FLASH, **ENGRAM}})
    v41 = dataclasses.replace(v41, mtp=None)
    v4 = dataclasses.replace(deepseek_v4.config(V4_FLASH), mtp=None)
    no_engram = lambda c, layers: dataclasses.replace(  # noqa: E731
        c, layers=tuple(dataclasses.replace(s, engram=-1) for s in layers), engram=None)
    return {"v4.1-flash roles 2,3,20,24": no_engram(v41, tuple(v41.layers[i] for i in (2, 3, 20, 24))),
            # every layer kind of the plan once (Engram on 1 and 14): the depth-free part of the 40-layer cost
            "v4.1-flash each kind once": dataclasses.replace(v41, layers=tuple(v41.layers[i] for i in
                                                                               (0, 1, 2, 3, 14, 20, 21, 24))),
            "v4.1-flash 40 layers, Engram": v41,
            "v4-flash first 4 layers": dataclasses.replace(v4, layers=v4.layers[:4]),
            "v4-flash 43 layers": v4}


def measure(cfg, batch: int, max_len: int) -> dict:
    params = jax.eval_shape(lambda: M.init_params(cfg, dtype=jnp.bfloat16))
    cache = jax.eval_shape(lambda: M.init_cache(cfg, batch, max_len, jnp.bfloat16))
    i32 = jax.ShapeDtypeStruct((batch,), jnp.int32)
    t0 = time.perf_counter()
    lowered = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4).lower(params, cfg, i32, i32, cache)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    pl = plan.plan(cfg)
    return {"layers": cfg.num_layers, "kinds": len(pl.kinds), "bodies": pl.bodies(), "lower_s": round(t1 - t0, 2),
            "compile_s": round(t2 - t1, 2), "stablehlo_chars": len(lowered.as_text())}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="compile_depth.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-len", type=int, default=4096)
    a = ap.parse_args()
    res = {"device": str(jax.devices()[0]), "jax": jax.__version__, "runs": {}}
    for name, cfg in configs().items():
        res["runs"][name] = measure(cfg, a.batch, a.max_len)
        print(name, res["runs"][name], flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
