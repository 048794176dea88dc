"""DeepSeek V4.1-Flash shapes on one GPU: decode step time per layer at batch 1 and 64 vs the HBM roofline.

Real dimensions (D 5120, 64 heads x 512, q rank 1280, 8 x 1024 grouped output, window 128, 384 experts
top-6 of width 2304, indexer 32 x 128 top-512, candidate blocks 2048 x 8, hc_mult 4) and the real layer
roles, but only four layers (bf16 weights of 384 experts are 27 GB a layer): a ratio-2 kv+index source
(layer 2's role), a ratio-2 reuse layer (3), the ratio-1 kv + index + candidate source (20) and a reindex
layer restricted to the candidates (24). Engram (layers 1, 14) is left out: its 384M-row tables do not fit
beside them. Random bf16 weights (experts dequantised: FP4 kept in the params is not wired into the model).

    PYTHONPATH=. python benchmarks/bench_deepseek.py --out results/deepseek.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # real-width layers fill the card (JAX's default: 75 %)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from _common import jax_ceilings, log, median_time, src_hash  # noqa: E402

from jaxmodels import model as D, plan  # noqa: E402
from jaxmodels.families import deepseek_v4  # noqa: E402

# the released V4.1-Flash text config (specs/deepseek_v4.md §1.2, §1.3)
FLASH = {"num_hidden_layers": 40, "num_nextn_predict_layers": 3, "hidden_size": 5120, "num_attention_heads": 64,
         "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
         "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
         "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
         "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
         "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 384,
         "num_experts_per_tok": 6, "moe_intermediate_size": 2304, "routed_scaling_factor": 1.5,
         "rms_norm_eps": 1e-20, "vocab_size": 129280,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1}}
ROLE_LAYERS = (2, 3, 20, 24)  # ratio-2 source, ratio-2 reuse, ratio-1 source + candidates, reindex


def flash_config(layers=ROLE_LAYERS):
    """V4.1-Flash with the given layers of its plan (all 40 with layers=None), no Engram, no MTP."""
    cfg = deepseek_v4.config({"model_type": "deepseek_v41", "text_config": FLASH})
    picked = cfg.layers if layers is None else tuple(cfg.layers[i] for i in layers)
    return dataclasses.replace(cfg, layers=tuple(dataclasses.replace(s, engram=-1) for s in picked), engram=None,
                               mtp=None)


def step_bytes(cfg, params, batch: int, max_len: int) -> dict:
    """Bytes a decode step must read: every weight but the embedding table (B rows of it) and the routed
    experts, the routed experts the batch picks (expected distinct experts under uniform routing), and the
    caches it attends (window + compressed entries + index keys, bf16)."""
    moe = cfg.layers[0].mlp
    E, k = moe.num_experts, moe.top_k
    expert = params["layers"]["0"]["mlp"]["w_gate"]
    per_param = (0.5 + 1 / 32) if isinstance(expert, dict) else 2  # FP4 bytes + one E8M0 per 32, or bf16
    expert_bytes = 3 * cfg.hidden_size * moe.intermediate_size * per_param
    distinct = E * (1 - (1 - k / E) ** batch)
    dense = 0
    for path, a in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        routed = "/mlp/" in name and any(f"/{n}" in name for n in ("w_gate", "w_up", "w_down")) and "/shared/" not in name
        if not routed and name != "embed":
            dense += a.size * a.dtype.itemsize
    cache = sum(s.attention.window * cfg.head_dim + ((max_len // m.ratio) * (cfg.head_dim * m.compress + m.index_head_dim
                * (m.index_keys == "latent")) if m.ratio else 0) for s in cfg.layers for m in [s.attention.mla]) * 2
    routed = cfg.num_layers * distinct * expert_bytes
    return {"dense_weights": dense, "routed_experts": routed, "cache": batch * cache,
            "total": dense + routed + batch * cache, "distinct_experts_per_layer": distinct}


def run(batches, prompt, steps, reps, tiny=False, fp4=False, layers=ROLE_LAYERS):
    cfg = flash_config(layers)
    if tiny:  # a CPU smoke run of this script: same roles, toy widths
        global FLASH
        FLASH = {**FLASH, "vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 64,
                 "qk_rope_head_dim": 16, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 32, "sliding_window": 16,
                 "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8, "candidate_topk_blocks": 3,
                 "candidate_block_size": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32}
        cfg = flash_config(layers)
    out = {"src": src_hash(), "device": str(jax.devices()[0]), "jax": jax.__version__, "layers": len(cfg.layers),
           "plan_layers": list(layers)}
    out["ceilings"] = jax_ceilings({"bw_bytes": (1 << 20) if tiny else (4 << 30), "mm": 256 if tiny else 8192})
    bw = max(out["ceilings"]["elementwise_rw_GBps"], out["ceilings"]["reduce_read_GBps"]) * 1e9
    t0 = time.perf_counter()
    params = jax.jit(lambda: D.init_params(cfg, dtype=jnp.bfloat16, fp4_experts=fp4))()
    out["experts"] = "fp4 kept quantized" if fp4 else "bf16"
    jax.block_until_ready(params)
    out["init_s"] = time.perf_counter() - t0
    out["param_GB"] = sum(a.nbytes for a in jax.tree.leaves(params)) / 1e9
    log(f"params {out['param_GB']:.1f} GB in {out['init_s']:.1f}s")
    max_len = 256 if tiny else 4096  # the context the decode step attends: 2048 ratio-2 entries, 4096 ratio-1 entries
    prefill = jax.jit(D.prefill, static_argnums=1)
    decode = jax.jit(D.decode_step, static_argnums=1, donate_argnums=(4,))
    out["runs"] = {}
    for B in batches:
        try:
            out["runs"][str(B)] = _one(cfg, params, prefill, decode, B, prompt, steps, reps, max_len, bw)
        except Exception as e:  # noqa: BLE001  (e.g. out of memory at a batch size: recorded, not hidden)
            out["runs"][str(B)] = {"error": repr(e)[:2000]}
            log(f"B={B}: {e!r}"[:2000])
    out["cache_bytes_per_token_bf16"] = plan.cache_bytes_per_token(cfg)
    return out


def _one(cfg, params, prefill, decode, B, prompt, steps, reps, max_len, bw):
    rng = np.random.default_rng(B)
    cache = D.init_cache(cfg, B, max_len, jnp.bfloat16)
    r = {}
    if B == 1:  # prefill is measured at B=1 only: ragged_dot is dense over all 384 experts on XLA:GPU
        toks = jnp.asarray(rng.integers(3, cfg.vocab_size, (B, prompt)), jnp.int32)
        lengths = jnp.full((B,), prompt, jnp.int32)
        t0 = time.perf_counter()
        jax.block_until_ready(prefill(params, cfg, toks, lengths, cache))
        r["prefill_first_s"] = time.perf_counter() - t0
        t_pre, _ = median_time(lambda: jax.block_until_ready(prefill(params, cfg, toks, lengths, cache)), 3)
        r |= {"prefill_len": prompt, "prefill_s": t_pre, "prefill_tok_per_s": prompt / t_pre}
    # decode from position max_len - steps - 8 over caches of max_len: the bytes read do not depend on
    # what the (masked) cache rows hold, so the caches are left empty rather than prefilled
    tok = jnp.asarray(rng.integers(3, cfg.vocab_size, (B,)), jnp.int32)
    pos = jnp.full((B,), max_len - steps - 8, jnp.int32)
    t0 = time.perf_counter()
    logits, cache = decode(params, cfg, tok, pos, cache)
    jax.block_until_ready(logits)
    compile_s = time.perf_counter() - t0
    state = {"cache": cache, "pos": pos + 1}

    def one():
        lg, state["cache"] = decode(params, cfg, tok, state["pos"], state["cache"])
        state["pos"] = state["pos"] + 1
        jax.block_until_ready(lg)

    for _ in range(2):
        one()
    t_step, ts = median_time(one, reps)
    need = step_bytes(cfg, params, B, max_len)
    r |= {"decode_compile_s": compile_s, "decode_step_ms": t_step * 1e3,
         "per_layer_ms": t_step * 1e3 / len(cfg.layers), "bytes": need,
         "roofline_step_ms": need["total"] / bw * 1e3, "roofline_ratio": need["total"] / bw / t_step,
         "tok_per_s": B / t_step, "steps_ms": [t * 1e3 for t in ts]}
    log(f"B={B}: decode {r['decode_step_ms']:.2f} ms/step ({r['per_layer_ms']:.2f} ms/layer), roofline "
        f"{r['roofline_step_ms']:.2f} ms -> {r['roofline_ratio']:.3f}; {r.get('prefill_s', 0) * 1e3:.0f} ms prefill")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="deepseek.json")
    ap.add_argument("--tiny", action="store_true", help="toy widths, for a CPU smoke run")
    ap.add_argument("--fp4", action="store_true", help="routed experts kept as FP4 bytes (decoded in the kernels)")
    ap.add_argument("--layers", default=",".join(map(str, ROLE_LAYERS)),
                    help="layers of the 40-layer plan to keep (default: the four roles %(default)s)")
    a = ap.parse_args()
    res = run([int(b) for b in a.batches.split(",")], a.prompt, a.steps, a.reps, a.tiny, a.fp4,
              tuple(int(i) for i in a.layers.split(",")))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    log(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
