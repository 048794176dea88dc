"""Capacity plan for DeepSeek V4.1-Flash and V4-Pro on H200 meshes (#13 §2), computed by our own code from the
released configs (specs/deepseek_v4.md §1.2, §10.1, §13): no GPU, no weights.

- Weights: every parameter of the plan (`plan.param_specs` + `mtp_param_specs`) in the checkpoint's storage
  (FP8 e4m3 + an E8M0 per B x B block, MXFP4 experts + an E8M0 per 32, FP8 Engram rows + an E8M0 per 32, BF16,
  F32) and as our params hold them when loaded with keep_quantized (the same, but wo_a dequantised to bf16 at
  load, as the reference does, and int64 tid2eid as int32).
- KV: `plan.cache_bytes_per_token` and the cache specs of every layer kind: bytes per token of context in our bf16
  layout and in the reference's packed records (FP4 + scales), plus the per-sequence window rings and compressor
  state.
- Meshes: 1 / 2 / 4 / 8 H200 (141 GB; 10 % kept for activations, XLA workspace and fragmentation), each leaf split
  as `jaxmodels.sharding.spec_for` places it under the preset's rules (padding included); the caches are split
  over `data` only (one shared K=V latent: tensor parallel replicates it).
- Decode roofline: bytes one device moves per step / HBM bandwidth (4.8 TB/s peak, 4.4 measured), tok/s =
  batch / step time. Moved: the dense weights of its shard, the routed experts the batch picks (expected distinct
  experts under uniform routing), B rows of the embedding and Engram tables, and the caches it attends: the
  architecture's sparse reads (window + top-k entries per compressed layer + every indexer key of the index
  layers) and, as a second figure, what our attention reads today (selections are masks over all entries).

    PYTHONPATH=. python benchmarks/capacity_plan.py [--json results/capacity_plan.json]
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from jaxmodels import plan, sharding
from jaxmodels.families import deepseek_v4

GB = 1e9
HBM = 141 * GB
USABLE = 0.90 * HBM
BW_PEAK, BW_MEASURED = 4.8e12, 4.4e12

# the released V4.1-Flash text config (specs/deepseek_v4.md §1.2, §1.3, §7)
V41_FLASH = {
    "model_type": "deepseek_v41",
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                            "expert_dtype": "fp4"},
    "text_config": {
        "num_hidden_layers": 40, "num_nextn_predict_layers": 3, "hidden_size": 5120, "num_attention_heads": 64,
        "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
        "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "n_routed_experts": 384,
        "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2304,
        "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-20, "vocab_size": 129280, "max_position_embeddings": 1 << 20,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1},
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
        "engram_vocab_size": 16_000_000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}}
# V4-Pro (specs/deepseek_v4.md §1.2, §13: PROINV)
V4_PRO = {
    "model_type": "deepseek_v4", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "hidden_size": 7168, "num_attention_heads": 128,
    "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536, "o_groups": 16, "o_lora_rank": 1024,
    "sliding_window": 128, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0], "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 1024, "n_routed_experts": 384, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5, "num_hash_layers": 3,
    "rms_norm_eps": 1e-6, "vocab_size": 129280, "max_position_embeddings": 1 << 20, "hc_mult": 4,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1}}
MODELS = {"V4.1-Flash": V41_FLASH, "V4-Pro": V4_PRO}

MESHES = {1: [("1 GPU", {}, "tp")],
          2: [("tensor=2", {"tensor": 2}, "tp"), ("expert=2", {"expert": 2}, "ep")],
          4: [("tensor=4", {"tensor": 4}, "tp"), ("expert=4", {"expert": 4}, "ep"),
              ("data=2,tensor=2", {"data": 2, "tensor": 2}, "tp")],
          8: [("tensor=8", {"tensor": 8}, "tp"), ("expert=8", {"expert": 8}, "ep"),
              ("data=2,tensor=4", {"data": 2, "tensor": 4}, "tp"), ("data=2,expert=4", {"data": 2, "expert": 4}, "ep"),
              ("fsdp=2,tensor=4", {"fsdp": 2, "tensor": 4}, "fsdp_tp")]}
# V4.1's Engram tables (203 GB) are only gathered, 24 rows of 256 B per token and engram layer: kept in host memory
# they would leave the GPUs (NOT implemented: jaxmodels places every parameter on the devices)
HOST_ENGRAM = [("tensor=2", {"tensor": 2}, "tp"), ("tensor=4", {"tensor": 4}, "tp"),
               ("data=2,tensor=4", {"data": 2, "tensor": 4}, "tp")]
CONTEXTS = (8192, 32768, 131072, 1 << 20)

# checkpoint linears stored FP8 + block scales (spec §10.1): param leaf name -> kept FP8 by our import
FP8 = ("attn/wq_a", "attn/wq_b", "attn/wkv", "attn/wo_b", "attn/indexer/wq_b", "mlp/shared/w_gate",
       "mlp/shared/w_up", "mlp/shared/w_down", "engram/wkv", "main_proj", "e_proj", "h_proj")


class _Mesh:
    """What spec_for reads of a mesh: its axis sizes (no devices needed)."""

    def __init__(self, shape: dict):
        self.shape = dict(shape)


def config(hf: dict):
    return deepseek_v4.config(hf)


def _kind(path: str, spec) -> str:
    routed = path.endswith(("mlp/w_gate", "mlp/w_up", "mlp/w_down")) and "experts" in spec.axes
    if routed:
        return "fp4"
    if path.endswith("engram/table"):
        return "engram"
    if path.endswith("attn/wo_a"):
        return "wo_a"
    if path.endswith(FP8):
        return "fp8"
    if spec.dtype in ("float32", "int32"):
        return spec.dtype
    return "bf16"


def _bytes(kind: str, shape, block: int, runtime: bool) -> float:
    """Bytes of one leaf (stacked over layers / experts) as stored: checkpoint, or our params (runtime)."""
    n = math.prod(shape)
    mats = math.prod(shape[:-2]) if len(shape) > 2 else 1
    if kind == "fp4":  # packed e2m1 + one E8M0 per 32 inputs
        return n / 2 + n / 32
    if kind == "engram":  # FP8 rows + one E8M0 per 32 channels
        return n + n / 32
    if kind == "fp8" or (kind == "wo_a" and not runtime):
        o, i = shape[-2:]
        return n + mats * math.ceil(o / block) * math.ceil(i / block)
    if kind == "wo_a":  # dequantised to bf16 at load (CONV41, our import)
        return 2 * n
    if kind in ("float32", "int32"):
        return 4 * n
    return 2 * n


def leaves(cfg) -> dict:
    """{path: ParamSpec} of the backbone and MTP blocks."""
    return plan.flatten(plan.param_specs(cfg)) | plan.flatten(plan.mtp_param_specs(cfg))


def weights(cfg, runtime: bool = True) -> dict:
    """Bytes by storage kind (and in all), backbone and MTP apart."""
    out: dict[str, float] = {}
    for path, s in leaves(cfg).items():
        k = ("mtp " if path.startswith("mtp/") else "") + _kind(path, s)
        out[k] = out.get(k, 0) + _bytes(_kind(path, s), s.shape, cfg.quant_block, runtime)
    out["total"] = sum(out.values())
    return out


def stored(cfg) -> dict:
    """{leaf path: (shape, bytes per element, kind)} of our params loaded with keep_quantized (converters/deepseek.py):
    FP8 linears as bytes [.., out, in] + an E8M0 grid, FP4 experts as [.., out, in/2] + an E8M0 per 32 inputs, the
    Engram table as FP8 rows + `table_scale`, wo_a bf16, the rest in the plan's dtype (bf16 / fp32 / int32)."""
    out = {}
    for path, s in leaves(cfg).items():
        kind, lead, shape = _kind(path, s), s.shape[:-2], s.shape
        if kind in ("fp8", "fp4"):
            i, o = shape[-2:]
            b = cfg.quant_block
            if kind == "fp4":
                out[path + "/fp4"], out[path + "/scale"] = ((*lead, o, i // 2), 1, kind), ((*lead, o, i // 32), 1, kind)
            else:
                out[path + "/fp8"] = ((*lead, o, i), 1, kind)
                out[path + "/scale"] = ((*lead, -(-o // b), -(-i // b)), 1, kind)
        elif kind == "engram":
            out[path], out[path + "_scale"] = (shape, 1, kind), ((*shape[:-1], shape[-1] // 32), 1, kind)
        else:
            out[path] = (shape, 4 if kind in ("float32", "int32") else 2, kind)
    return out


def _local(cfg, path, shape, mesh: dict, rules: str) -> tuple[int, ...]:
    """The block of a stored leaf one device holds, placed by jaxmodels.sharding (PADDED rows rounded up)."""
    m = _Mesh(mesh)
    spec = sharding.stored_spec(cfg, path, shape, m, rules)
    split = [math.prod(m.shape[a] for a in ((x,) if isinstance(x, str) else x)) if x else 1 for x in spec]
    return tuple(-(-n // k) for n, k in zip(shape, split))


def per_device_weights(cfg, mesh: dict, rules: str, host_engram: bool = False) -> float:
    """Bytes of params on one device: each stored leaf split as jm.load places it on that mesh."""
    return sum(math.prod(_local(cfg, path, shape, mesh, rules)) * size
               for path, (shape, size, kind) in stored(cfg).items() if not (host_engram and kind == "engram"))


def cache(cfg) -> dict:
    """Per-token and per-sequence cache bytes, from the plan's cache specs (backbone layers)."""
    ours = plan.cache_bytes_per_token(cfg, 2)
    packed = plan.cache_bytes_per_token(cfg, 2, packed=True)
    state = sum(math.prod(st.shape) * 4 for spec in cfg.layers for st in plan.cache_specs(cfg, spec)
                if isinstance(st, plan.StateSpec))
    return {"per_token_bf16": ours["per_token"], "per_token_packed": packed["per_token"],
            "window_rings_per_sequence": ours["window_per_sequence"], "state_per_sequence": state}


def seq_bytes(cfg, ctx: int, c: dict) -> float:
    return ctx * c["per_token_bf16"] + c["window_rings_per_sequence"] + c["state_per_sequence"]


def read_per_sequence(cfg, ctx: int, sparse: bool) -> float:
    """Cache bytes one decode step reads for one sequence at context `ctx` (bf16 entries)."""
    d, total = cfg.head_dim, 0.0
    for spec in cfg.layers:
        a, m = spec.attention, spec.attention.mla
        total += min(a.window, ctx) * d * 2
        if not m.ratio:
            continue
        entries = ctx // m.ratio
        total += (min(m.index_topk, entries) if sparse and m.select != "all" else entries) * d * 2
        if m.select == "indexer":  # the indexer scores every visible key (V4.1's later ones: the candidates only)
            keys = entries
            if sparse and m.candidate_filter:
                keys = min(entries, m.candidate_blocks * m.candidate_block_size)
            total += keys * m.index_head_dim * 2
    return total


def step_bytes(cfg, mesh: dict, rules: str, batch: int, ctx: int, sparse: bool) -> float:
    """Bytes one device moves in one decode step of `batch` sequences at context `ctx` (the Engram rows count
    alike wherever the tables are)."""
    moe = cfg.layers[0].mlp
    picked = 1 - (1 - moe.top_k / moe.num_experts) ** batch  # share of the routed experts the batch reads
    total = 0.0
    for path, (shape, size, kind) in stored(cfg).items():
        if path.startswith("mtp/"):  # plain decoding
            continue
        local = _local(cfg, path, shape, mesh, rules)
        b = math.prod(local) * size
        if kind == "fp4":
            b *= picked
        elif kind == "engram" or path == "embed":  # gathered rows only
            rows = batch * (cfg.engram.max_ngram - 1) * cfg.engram.n_heads if kind == "engram" else batch
            b = min(b, rows * b / local[-2])
        total += b
    return total + math.ceil(batch / mesh.get("data", 1)) * read_per_sequence(cfg, ctx, sparse)


def plan_model(name: str, hf: dict) -> dict:
    cfg = config(hf)
    c = cache(cfg)
    out = {"model": name, "layers": cfg.num_layers, "params": sum(math.prod(s.shape) for s in leaves(cfg).values()),
           "checkpoint_bytes": weights(cfg, runtime=False), "runtime_bytes": weights(cfg, runtime=True),
           "cache": c, "meshes": []}
    meshes = [(n, label, mesh, rules, False) for n, ms in MESHES.items() for label, mesh, rules in ms]
    if cfg.engram is not None:
        meshes += [(math.prod(mesh.values()), label + " + Engram in host RAM", mesh, rules, True)
                   for label, mesh, rules in HOST_ENGRAM]
    for n, label, mesh, rules, host in meshes:
        w = per_device_weights(cfg, mesh, rules, host)
        free = USABLE - w
        data = mesh.get("data", 1)
        row = {"gpus": n, "mesh": label, "rules": rules, "weights_per_device": w, "free_per_device": free,
               "fits": free > 0, "max_batch": {}, "decode": []}
        if free > 0:
            for ctx in CONTEXTS:
                row["max_batch"][ctx] = int(free // seq_bytes(cfg, ctx, c)) * data
            for ctx in (8192, 131072):
                for batch in sorted({1, 32, 256, row["max_batch"][ctx]}):
                    if 0 < batch <= row["max_batch"][ctx]:
                        t = {k: step_bytes(cfg, mesh, rules, batch, ctx, k == "sparse") for k in ("sparse", "dense")}
                        row["decode"].append({"context": ctx, "batch": batch, "step_bytes": t,
                                              "tok_s": {k: {"peak": batch * BW_PEAK / v, "measured":
                                                            batch * BW_MEASURED / v} for k, v in t.items()}})
        out["meshes"].append(row)
    return out


def report(r: dict) -> str:
    g = lambda b: f"{b / GB:,.1f}"  # noqa: E731
    w, wc, c = r["runtime_bytes"], r["checkpoint_bytes"], r["cache"]
    lines = [f"## {r['model']}: {r['layers']} layers, {r['params'] / 1e9:,.1f} B parameters (MTP included)", "",
             "| storage | checkpoint GB | our params GB (keep_quantized) |", "|---|---:|---:|"]
    for k in sorted(set(w) | set(wc), key=lambda k: (k == "total", k)):
        lines.append(f"| {k} | {g(wc.get(k, 0))} | {g(w.get(k, 0))} |")
    lines += ["", f"KV cache per token of context: {c['per_token_bf16']:,.0f} B in our bf16 layout, "
              f"{c['per_token_packed']:,.0f} B in the reference's packed FP4 records; per sequence also "
              f"{c['window_rings_per_sequence'] / 1e6:,.2f} MB of window rings (128 slots x 512 x bf16 a layer) and "
              f"{c['state_per_sequence'] / 1e6:,.2f} MB of compressor state.", "",
              "| GPUs | mesh (rules) | weights/GPU GB | free/GPU GB | max batch @8k | @32k | @128k | @1M |",
              "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for m in r["meshes"]:
        mb = m["max_batch"]
        cols = " | ".join(str(mb.get(x, "-")) for x in CONTEXTS) if m["fits"] else "does not fit | | |"
        lines.append(f"| {m['gpus']} | {m['mesh']} ({m['rules']}) | {g(m['weights_per_device'])} | "
                     f"{g(m['free_per_device'])} | {cols} |")
    lines += ["", "Decode roofline (tok/s at 4.8 TB/s peak / 4.4 measured; sparse reads = the architecture's, dense "
              "= our masked attention today):", "",
              "| mesh | context | batch | GB moved/GPU/step (sparse) | tok/s sparse (peak / measured) | "
              "tok/s dense (measured) |", "|---|---:|---:|---:|---:|---:|"]
    for m in r["meshes"]:
        for d in m["decode"]:
            t = d["tok_s"]
            lines.append(f"| {m['mesh']} | {d['context'] // 1024}k | {d['batch']} | "
                         f"{d['step_bytes']['sparse'] / GB:,.2f} | {t['sparse']['peak']:,.0f} / "
                         f"{t['sparse']['measured']:,.0f} | {t['dense']['measured']:,.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the numbers here too")
    a = ap.parse_args(argv)
    results = [plan_model(name, hf) for name, hf in MODELS.items()]
    print(f"H200: {HBM / GB:.0f} GB, {USABLE / GB:.1f} GB usable; HBM {BW_PEAK / 1e12} TB/s peak, "
          f"{BW_MEASURED / 1e12} measured\n")
    print("\n\n".join(report(r) for r in results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
