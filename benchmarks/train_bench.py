"""Training speed on one GPU (#15): jaxmodels.train vs HF transformers + torch, same shapes, batch and sequence.

Random weights at real shapes (speed does not depend on the values), random tokens, every token a target.

  jax_full   Llama-3.2-1B shape, full fine-tune: train.make_step (AdamW on optax, warmup + cosine, clipping at 1),
             fp32 master weights and moments, bf16 compute (train.TrainConfig's default), no remat; plus the
             machine's ceilings (HBM bandwidth, bf16 matmul rate) for the roofline
  hf_full    the same with LlamaForCausalLM (sdpa) in fp32 under torch.autocast(bf16), torch.optim.AdamW(fused),
             clip_grad_norm_(1.0): the usual PyTorch mixed-precision recipe, eager
  jax_lora   Llama-3.1-8B shape, LoRA rank 16 on the attention projections (wq wk wv wo), bf16 base weights:
             train.make_step with apply=lora.merge, only the adapters train (fp32, AdamW)
  hf_lora    the same on HF: bf16 model, frozen, each q/k/v/o_proj wrapped as base(x) + (x A^T) B^T * alpha/r
             with fp32 A, B (what PEFT's LoRA Linear computes), autocast bf16, AdamW(fused) on the adapters

Each step is timed to completion (loss on the host / cuda synchronize); the first `warmup` steps (compile,
autotuning, allocator warm-up) are excluded. tokens/s = batch x seq x steps / time. MFU = model FLOPs per token x
tokens/s over the H200's dense bf16 peak (989 TFLOP/s, spec); `roof` divides by the best matmul rate measured in
this run instead. Model FLOPs per token (no recompute counted): full fine-tune 6 N + 6 L H d T (N: matmul weights
incl. the head; causal attention, forward and backward); LoRA 4 N (forward + input gradients of the frozen
weights) + 6 x adapter parameters + the same attention term. (jaxmodels' LoRA merges W + A B and differentiates
the merged weight, so it also computes a full dW per adapted matrix: 2 N_adapted per token more work than counted.)

Each stage runs in its own process (JAX preallocates the GPU; torch gets it to itself after) under its own time
limit and writes <out>/stage_<name>.json; the driver merges them into <out>/train_bench.json and prints a table.

    PYTHONUNBUFFERED=1 python3 benchmarks/train_bench.py --out $OUT --commit $(git rev-parse --short HEAD)
    .venv/bin/python benchmarks/train_bench.py --tiny --out /tmp/train_bench_tiny     # CPU smoke test
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import drive, jax_ceilings, log, run_stage, sync, torch_ceilings  # noqa: E402
from bench_dense import LLAMA31_8B, count  # noqa: E402

LLAMA32_1B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2}
H200_BF16_PEAK = 989.4e12  # dense bf16 tensor-core FLOP/s of an H200 SXM (NVIDIA's data sheet)
LORA_TARGETS = {"jax": r"attn/w[qkvo]$", "hf": ("q_proj", "k_proj", "v_proj", "o_proj")}


def settings(tiny: bool) -> dict:
    if tiny:  # fp32 compute: XLA:CPU cannot run the bf16 x bf16 -> f32 batched attention dots at B >= 2
        return dict(hf={"full": LLAMA32_1B | TINY, "lora": LLAMA31_8B | TINY}, full=(2, 32), lora=(2, 32), rank=4,
                    warmup=1, steps=2, lr=1e-4, compute_dtype=None, bw_bytes=1 << 24, mm=256)
    return dict(hf={"full": LLAMA32_1B, "lora": LLAMA31_8B}, full=(8, 2048), lora=(4, 2048), rank=16,
                warmup=2, steps=5, lr=1e-5, compute_dtype="bfloat16", bw_bytes=4 << 30, mm=8192)


# ------------------------------------------------------------------------------------ counting
def flops_per_token(hf: dict, seq: int, lora_rank: int = 0) -> dict:
    """Model FLOPs per trained token (module docstring), and the counts they come from."""
    c = count(hf)
    n = c["layer_matmul_params"] + c["lm_head_params"]
    attn = 6 * c["layers"] * c["heads"] * c["head_dim"] * seq  # causal: QK^T and PV over T/2 keys on average, x3
    if not lora_rank:
        return {"matmul_params": n, "flops_per_token": 6 * n + attn, "attention_flops_per_token": attn}
    D, H, K, d = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    adapter = c["layers"] * lora_rank * ((D + H * d) + 2 * (D + K * d) + (H * d + D))  # q, k, v, o: r (in + out)
    adapted = c["layers"] * (2 * D * H * d + 2 * D * K * d)
    return {"matmul_params": n, "adapter_params": adapter, "adapted_params": adapted,
            "flops_per_token": 4 * n + 6 * adapter + attn, "attention_flops_per_token": attn}


def timed(step, S: dict) -> dict:
    """Run `step()` (which must return only once the step is done) warmup + steps times; the timed steps' stats."""
    first = []
    for _ in range(S["warmup"]):
        t0 = time.perf_counter()
        loss0 = step()
        first.append(time.perf_counter() - t0)
    ts, losses = [], []
    for _ in range(S["steps"]):
        t0 = time.perf_counter()
        losses.append(step())
        ts.append(time.perf_counter() - t0)
    return {"warmup_s": first, "step_s": ts, "median_step_s": statistics.median(ts), "total_s": sum(ts),
            "first_loss": loss0, "losses": losses, "finite": all(math.isfinite(x) for x in [loss0, *losses])}


def _result(r: dict, S: dict, which: str) -> dict:
    B, T = S[which]
    r |= {"batch": B, "seq": T, "tokens_per_step": B * T, "tokens_per_s": B * T * S["steps"] / r["total_s"]}
    log(f"[{which}] {r['tokens_per_s']:.0f} tokens/s, median step {r['median_step_s'] * 1e3:.1f} ms "
        f"(warm-up {[round(x, 1) for x in r['warmup_s']]} s), loss {r['first_loss']:.3f} -> {r['losses'][-1]:.3f}")
    if not r["finite"]:
        raise FloatingPointError(f"{which}: non-finite loss {r['losses']}")
    return r


# ------------------------------------------------------------------------------------ JAX stages
def _jax_stage(S: dict, out: dict, save, which: str):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, lora, model as M, train

    dev = jax.devices()[0]
    out["jax"] = r = {"version": jax.__version__, "device": str(dev), "device_kind": dev.device_kind,
                      "backend": jax.default_backend()}
    log(f"[jax] {jax.__version__} on {dev.device_kind} ({jax.default_backend()})")
    if which == "full":
        r["ceilings"] = jax_ceilings(S)
        save()
    cfg = families.config_from_hf(S["hf"][which])
    B, T = S[which]
    tc = train.TrainConfig(learning_rate=S["lr"], warmup_steps=1, total_steps=1000, weight_decay=0.0,
                           clip_norm=1.0, compute_dtype=S["compute_dtype"], remat=None)
    r["train_config"] = {k: str(v) for k, v in vars(tc).items()}
    t0 = time.perf_counter()
    if which == "full":  # fp32 masters; the step casts them to bf16 for the forward
        params = jax.jit(lambda: M.init_params(cfg, 0, dtype=jnp.float32))()
        trained, frozen = train.partition(params)
        state = train.init(trained, tc)
        del params, trained  # train.init copied them: the state is all the step needs besides `frozen`
        step = train.make_step(cfg, tc)
    else:  # bf16 base weights (frozen), fp32 adapters
        dt = jnp.float32 if S["compute_dtype"] is None else jnp.bfloat16
        frozen = jax.jit(lambda: M.init_params(cfg, 0, dtype=dt))()
        adapters = lora.init(cfg, frozen, LORA_TARGETS["jax"], rank=S["rank"], alpha=2 * S["rank"])
        r["lora"] = {"targets": LORA_TARGETS["jax"], "rank": S["rank"], "adapted": list(adapters.paths),
                     "adapter_params": lora.num_params(adapters)}
        state = train.init(adapters, tc)
        step = train.make_step(cfg, tc, apply=lambda a, base: lora.merge(base, a))
    jax.block_until_ready((state, frozen))
    r["init_s"] = time.perf_counter() - t0
    r["trained_params"] = int(sum(a.size for a in jax.tree.leaves(state.params)))
    log(f"[jax] {which}: {r['trained_params']:,} trained parameters, state ready in {r['init_s']:.1f} s")
    save()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    batch = {"tokens": tokens}
    holder = {"state": state}
    del state

    def one():
        holder["state"], metrics = step(holder["state"], batch, frozen)
        return float(metrics["loss"])  # on the host: the step has finished

    r["train"] = _result(timed(one, S), S, which)
    stats = dev.memory_stats() or {}
    r["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    save()


# ------------------------------------------------------------------------------------ torch stages
def _hf_model(S: dict, which: str, dtype, dev):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = {k: v for k, v in S["hf"][which].items() if k not in ("model_type", "architectures", "torch_dtype")}
    conf = LlamaConfig(**hf)
    conf._attn_implementation = "sdpa"
    conf.use_cache = False
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(conf)
    finally:
        torch.set_default_dtype(prev)
    return model.to(dev, dtype).train()


def _hf_stage(S: dict, out: dict, save, which: str):
    import torch
    import transformers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out["hf"] = r = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__}, "device": dev}
    if dev == "cuda":
        r["device_name"] = torch.cuda.get_device_name()
        if which == "full":
            r["ceilings"] = torch_ceilings(S, out)
            log(f"[hf] ceilings {r['ceilings']}")
        save()
    mixed = S["compute_dtype"] is not None
    t0 = time.perf_counter()
    if which == "full":  # fp32 masters, bf16 autocast
        model = _hf_model(S, which, torch.float32, dev)
        params = [p for p in model.parameters() if p.requires_grad]
    else:  # bf16 base, frozen; fp32 adapters
        model = _hf_model(S, which, torch.bfloat16 if mixed else torch.float32, dev)
        model.requires_grad_(False)
        params = []
        for layer in model.model.layers:
            for name in LORA_TARGETS["hf"]:
                wrapped = LoRALinear(getattr(layer.self_attn, name), S["rank"], 2 * S["rank"])
                setattr(layer.self_attn, name, wrapped)
                params += [wrapped.a, wrapped.b]
        r["lora"] = {"targets": list(LORA_TARGETS["hf"]), "rank": S["rank"],
                     "adapter_params": sum(p.numel() for p in params)}
    opt = torch.optim.AdamW(params, lr=S["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                            fused=dev == "cuda")
    sync(dev)
    r["build_s"] = time.perf_counter() - t0
    r["trained_params"] = int(sum(p.numel() for p in params))
    log(f"[hf] {which}: {r['trained_params']:,} trained parameters, built in {r['build_s']:.1f} s on {dev}")
    save()
    B, T = S[which]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, S["hf"][which]["vocab_size"], (B, T), generator=g).to(dev)

    def one():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=mixed):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # on the host: the step has finished

    r["train"] = _result(timed(one, S), S, which)
    if dev == "cuda":
        r["peak_bytes_allocated"] = torch.cuda.max_memory_allocated()
    save()


def LoRALinear(base, rank: int, alpha: float):  # noqa: N802 (a class made on demand: torch is imported lazily)
    """base(x) + (x A^T) B^T * alpha / rank, A [r, in] ~ N(0, 1/in), B [out, r] = 0, fp32: PEFT's LoRA Linear
    without dropout."""
    import torch

    class _LoRA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base, self.scale = base, alpha / rank
            dev = base.weight.device
            self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, device=dev) / base.in_features ** 0.5)
            self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, device=dev))

        def forward(self, x):
            return self.base(x) + (x @ self.a.t().to(x.dtype)) @ self.b.t().to(x.dtype) * self.scale

    return _LoRA()


STAGES = {"jax_full": lambda S, o, s: _jax_stage(S, o, s, "full"),
          "hf_full": lambda S, o, s: _hf_stage(S, o, s, "full"),
          "jax_lora": lambda S, o, s: _jax_stage(S, o, s, "lora"),
          "hf_lora": lambda S, o, s: _hf_stage(S, o, s, "lora")}
# the JAX stages take 90% of the GPU (default 75%): the 1B step holds [8 x 2048, 128256] fp32 logits and their softmax
STAGE_ENV = {name: {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"} for name in ("jax_full", "jax_lora")}


# ------------------------------------------------------------------------------------ driver
def summarize(res: dict, S: dict) -> str:
    jx_full = res.get("stage_jax_full", {}).get("jax", {})
    hf_full = res.get("stage_hf_full", {}).get("hf", {})
    rates = [c.get("matmul_bf16_TFLOPs", float("nan"))
             for c in (jx_full.get("ceilings", {}), hf_full.get("ceilings", {}))]
    best = max([x for x in rates if x == x] or [float("nan")]) * 1e12
    kind = jx_full.get("device_kind", "") or hf_full.get("device_name", "")
    peak = H200_BF16_PEAK if "H200" in kind else float("nan")
    lines = [f"device {kind or '?'}: bf16 matmul measured {best / 1e12:.0f} TFLOP/s, spec peak {peak / 1e12:.0f}",
             f"{'workload':<34}{'tokens/step':>12}{'jax tok/s':>11}{'hf tok/s':>11}{'jax MFU':>9}{'hf MFU':>8}"
             f"{'jax roof':>10}{'hf roof':>9}{'jax/hf':>8}"]
    res["mfu"] = {}
    for which, name in (("full", "Llama-3.2-1B full fine-tune"), ("lora", f"Llama-3.1-8B LoRA r{S['rank']} q,k,v,o")):
        B, T = S[which]
        f = flops_per_token(S["hf"][which], T, S["rank"] if which == "lora" else 0)
        jt = res.get(f"stage_jax_{which}", {}).get("jax", {}).get("train", {}).get("tokens_per_s", float("nan"))
        ht = res.get(f"stage_hf_{which}", {}).get("hf", {}).get("train", {}).get("tokens_per_s", float("nan"))
        fl = f["flops_per_token"]
        res["mfu"][which] = {**f, "jax_tokens_per_s": jt, "hf_tokens_per_s": ht, "jax_mfu": jt * fl / peak,
                             "hf_mfu": ht * fl / peak, "jax_roof": jt * fl / best, "hf_roof": ht * fl / best}
        m = res["mfu"][which]
        lines.append(f"{name:<34}{f'{B}x{T}':>12}{jt:>11.0f}{ht:>11.0f}{m['jax_mfu']:>9.3f}{m['hf_mfu']:>8.3f}"
                     f"{m['jax_roof']:>10.3f}{m['hf_roof']:>9.3f}{jt / ht:>8.2f}")
    lines.append("MFU: model FLOPs (6N + attention; LoRA 4N + 6 adapters + attention) x tokens/s / spec peak; "
                 "roof: / measured matmul rate")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU: a smoke test")
    ap.add_argument("--out", default="benchmarks/results/tmp")
    ap.add_argument("--stage", choices=list(STAGES), help="run one stage in this process (used by the driver)")
    ap.add_argument("--stages", default="jax_full,hf_full,jax_lora,hf_lora")
    ap.add_argument("--timeouts", default="jax_full=80,hf_full=40,jax_lora=80,hf_lora=40", help="seconds per stage")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    S = settings(args.tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(STAGES, args.stage, args, S)
    res = drive(__file__, "train_bench.json", args, S, summarize, STAGE_ENV)
    bad = [n for n, s in res["stages"].items() if s["rc"] != 0]
    if bad:
        sys.exit(f"stages failed: {bad} (see {Path(args.out) / 'train_bench.json'})")


if __name__ == "__main__":
    main()
