"""Issue #11's table in one command: decode and prefill through the public API at real shapes, each with its
roofline measured in the same run and the HF transformers peer measured in the same run.

    python3 benchmarks/bench.py --out $OUT [--models llama,gpt_oss] [--tiny]

Models (random bf16 weights at real shapes: speed does not depend on the values):
  llama    Llama-3.1-8B shape (bench_dense.LLAMA31_8B)
  gpt_oss  GPT-OSS-20B shape with bf16 experts (bench_moe.GPT_OSS_20B)

Workloads, ours:
  decode   `jm.generate` (greedy, ignore_eos) from B random prompts: tok/s = B * (160 - 32) / (t(160 new) - t(32 new)),
           best of 2 calls at each length after one that compiles it, so prefill, dispatch and compile cancel
           (decode_probe.py's method). Llama: B=1 and B=32 at context 512 in a 1024-slot cache, and B=1 at context
           512 / 8192 / 32000 in a 32768-slot cache (the cost must follow the context, not the cache); GPT-OSS: B=1
           and B=64 at context 512 in a 1024-slot cache.
  prefill  `jax.jit(M.prefill, compiler_options=M.COMPILER_OPTIONS)`, batch 1, a T-slot cache, best of 5:
           Llama T = 2048 and 8192, GPT-OSS T = 2048 and 16384.
The HF peer (benchmarks/hf_peer.py), same GPU, same run, best of 3: Llama decode with a StaticCache of the same
size and torch.compile(mode="reduce-overhead", fullgraph=True) (32 steps at the same context), GPT-OSS decode eager
(DynamicCache, 16 steps; it has no sdpa path, and its compiled decode is not in a steady state, BENCHMARKS.md),
prefill eager (use_cache, logits of the last token) for both. The 32k-cache contexts have no HF peer by default:
stage llama_hf_long adds one (StaticCache of 32768 slots, compiled once; about 1 more minute).

Rooflines, from this run's ceilings (the best of JAX's and torch's HBM bandwidth and bf16 matmul rate, measured as
_common.jax_ceilings / torch_ceilings do):
  decode   bytes per step / bandwidth. Llama: every matmul weight once + the valid KV of every row
           (bench_dense.decode_bytes); GPT-OSS: the non-expert weights + the experts the step touches, for uniform
           routing E * (1 - (1 - k/E)^B) per layer (bench_moe.expected_distinct) + the valid KV, sliding layers at
           most their window (bench_moe.decode_bytes). At the measured steps' mean context.
  prefill  useful FLOPs / matmul rate (bench_dense.prefill_flops); GPT-OSS the larger of that (top-k experts,
           windowed attention) and every weight read once / bandwidth (bench_moe.prefill_cost).

Each stage (llama_jax, llama_hf, gpt_oss_jax, gpt_oss_hf) runs in its own process, so the GPU's memory is freed
between them, under its own time limit, within a budget for the whole run (--budget-s, default 540 s: one
10-minute device call). Output: the markdown table on stdout and in <out>/bench.md; every number, repetition and
setting in <out>/bench.json (stage JSONs in <out>/stage_*.json).

    .venv/bin/python benchmarks/bench.py --tiny --out /tmp/bench_tiny     # CPU smoke test (tiny configs)
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dense  # noqa: E402
import bench_moe  # noqa: E402
import hf_peer  # noqa: E402
from _common import (REPO, drive, jax_ceilings, jax_public_decode, jax_public_prefill, log,  # noqa: E402
                     run_stage, torch_ceilings)

TITLES = {"llama": "Llama-3.1-8B", "gpt_oss": "GPT-OSS-20B"}
HF_KIND = {"eager": "eager", "compile reduce-overhead fullgraph": "compiled",  # hf_peer.CompiledForward's modes
           "compile reduce-overhead": "compiled (graph breaks)", "eager StaticCache": "eager StaticCache"}


def settings(tiny: bool) -> dict:
    """Everything a stage needs, as data (recorded in the result). A decode case is [batch, context, cache slots,
    HF peer in the model's hf stage]; `long` lists the contexts stage llama_hf_long measures in the cache of `long_cache`."""
    if tiny:
        llama = dict(decode=[[1, 16, 64, True], [4, 16, 64, True], [1, 16, 256, False], [1, 64, 256, False],
                             [1, 200, 256, False]], prefill=[32, 64], long=[16, 64, 200], long_cache=256)
        gpt_oss = dict(decode=[[1, 16, 64, True], [4, 16, 64, True]], prefill=[32, 128])
        common = dict(new=[4, 36], reps=2, prefill_reps=2, hf_reps=2, hf_steps={"compiled": 4, "eager": 4},
                      bw_bytes=1 << 24, mm=256, budget_s=None,
                      jax_dtype="float32")  # XLA:CPU cannot run the bf16 x bf16 -> f32 batched attention dots at B >= 2
        hf = {"llama": bench_dense.TINY, "gpt_oss": bench_moe.TINY}
    else:
        llama = dict(decode=[[1, 512, 1024, True], [32, 512, 1024, True], [1, 512, 32768, False],
                             [1, 8192, 32768, False], [1, 32000, 32768, False]], prefill=[2048, 8192],
                     long=[512, 8192, 32000], long_cache=32768)
        gpt_oss = dict(decode=[[1, 512, 1024, True], [64, 512, 1024, True]], prefill=[2048, 16384])
        common = dict(new=[32, 160], reps=2, prefill_reps=5, hf_reps=3, hf_steps={"compiled": 32, "eager": 16},
                      bw_bytes=4 << 30, mm=8192, budget_s=540)
        hf = {"llama": bench_dense.LLAMA31_8B, "gpt_oss": bench_moe.GPT_OSS_20B}
    llama |= dict(attn="sdpa", hf_decode="compiled")
    gpt_oss |= dict(attn="eager", hf_decode="eager")  # GptOss has no sdpa path; flash/flex kernels are not there
    return dict(hf=hf, workloads={"llama": llama, "gpt_oss": gpt_oss}, **common)


# ------------------------------------------------------------------------------------ rooflines
def decode_roofline(name: str, hf: dict, B: int, ctx: float, bw: float) -> dict:
    if name == "llama":
        by = bench_dense.decode_bytes(bench_dense.count(hf), B, ctx)
        extra = {}
    else:
        c = bench_moe.count(hf)
        ex = bench_moe.expected_distinct(c["experts"], c["top_k"], B)
        by = bench_moe.decode_bytes(c, B, ctx, ex)
        extra = {"experts_per_layer": ex}
    return {"bytes_per_step": by, "step_ms": by / bw * 1e3, "tokens_per_s": B / (by / bw), **extra}


def prefill_roofline(name: str, hf: dict, T: int, bw: float, fl: float) -> dict:
    if name == "llama":
        f = bench_dense.prefill_flops(bench_dense.count(hf), T)
        t, extra = f / fl, {}
    else:
        f, by = bench_moe.prefill_cost(bench_moe.count(hf), T)
        t, extra = max(f / fl, by / bw), {"bytes": by}
    return {"flops": f, "ms": t * 1e3, "tokens_per_s": T / t, **extra}


# ------------------------------------------------------------------------------------ stages
def stage_jax(S: dict, out: dict, save, name: str):
    """This machine's ceilings, then decode through jm.generate and prefill at each of the model's workloads."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from jaxmodels import families, model as M

    W = S["workloads"][name]
    dt = jnp.dtype(S.get("jax_dtype", "bfloat16"))
    dev = jax.devices()[0]
    r = out.setdefault("jax", {"version": jax.__version__, "device": str(dev), "device_kind": dev.device_kind,
                               "backend": jax.default_backend()})
    log(f"[jax] {jax.__version__} on {dev.device_kind} ({jax.default_backend()})")
    r["ceilings"] = jax_ceilings(S)
    save()
    cfg = families.config_from_hf(S["hf"][name])
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dt))()
    jax.block_until_ready(params)
    r["param_bytes"] = int(sum(v.nbytes for v in jax.tree.leaves(params)))
    model = jm.Model(cfg, params, None)
    rng = np.random.default_rng(0)
    r["decode"], r["prefill"] = [], []
    for B, ctx, cache, _ in W["decode"]:
        try:
            r["decode"].append(jax_public_decode(model, B, ctx, cache, tuple(S["new"]), S["reps"], rng))
        except Exception as e:  # noqa: BLE001  one failed case (e.g. out of memory) is a result; go on
            r["decode"].append({"batch": B, "context": ctx, "max_len": cache, "error": f"{type(e).__name__}: {e}"[:2000]})
            log(f"[jax] decode B={B} context {ctx} cache {cache} failed: {r['decode'][-1]['error'][:500]}")
        save()
    for T in W["prefill"]:
        try:
            r["prefill"].append(jax_public_prefill(cfg, params, T, S["prefill_reps"], rng, dt))
        except Exception as e:  # noqa: BLE001
            r["prefill"].append({"T": T, "error": f"{type(e).__name__}: {e}"[:2000]})
            log(f"[jax] prefill T={T} failed: {r['prefill'][-1]['error'][:500]}")
        save()


def stage_hf(S: dict, out: dict, save, name: str):
    """torch's ceilings (on cuda), the eager prefills, then the peer decode cases (compiled or eager)."""
    import torch

    W = S["workloads"][name]
    r = out.setdefault("hf", {"versions": hf_peer.versions(), "decode_kind": W["hf_decode"]})
    if torch.cuda.is_available():
        r["device"] = torch.cuda.get_device_name()
        r["ceilings"] = torch_ceilings(S, out)
        log(f"[hf] ceilings {r['ceilings']}")
        save()
    model, dev, info = hf_peer.build(S["hf"][name], W["attn"])
    r.update(info)
    r["decode"], r["prefill"] = [], []
    save()
    g = torch.Generator().manual_seed(0)
    for T in W["prefill"]:
        try:
            r["prefill"].append(hf_peer.prefill(model, dev, T, S["hf_reps"], g))
        except torch.cuda.OutOfMemoryError as e:  # GPT-OSS's eager attention materialises [heads, T, T] scores
            r["prefill"].append({"T": T, "error": f"OutOfMemoryError: {str(e)[:300]}"})
            log(f"[hf] eager prefill T={T}: out of memory")
        torch.cuda.empty_cache()
        save()
    n = S["hf_steps"][W["hf_decode"]]
    cf = hf_peer.CompiledForward(model)
    if W["hf_decode"] == "compiled":
        r["mode"], r["attempts"] = hf_peer.COMPILED, cf.attempts
    for B, ctx, cache, peer in W["decode"]:
        if not peer:
            continue
        if W["hf_decode"] == "compiled":
            d = hf_peer.compiled_decode(cf, dev, B, ctx, cache, n, S["hf_reps"], g)
            if d is None:
                break
        else:
            d = hf_peer.eager_decode(model, dev, B, ctx, n, S["hf_reps"], g)
        r["decode"].append(d)
        save()


def stage_hf_long(S: dict, out: dict, save, name: str = "llama"):
    """The compiled HF decode at B=1 over the long contexts, one StaticCache of `long_cache` slots (one compile)."""
    import torch

    W = S["workloads"][name]
    r = out.setdefault("hf", {"versions": hf_peer.versions(), "decode_kind": "compiled", "mode": hf_peer.COMPILED})
    model, dev, info = hf_peer.build(S["hf"][name], W["attn"])
    r.update(info)
    cf = hf_peer.CompiledForward(model)
    r["attempts"] = cf.attempts
    g = torch.Generator().manual_seed(2)
    first, *rest = W["long"]
    d = hf_peer.compiled_decode(cf, dev, 1, first, W["long_cache"], S["hf_steps"]["compiled"], S["hf_reps"], g,
                                contexts=rest)
    r["decode"] = d or []
    save()


STAGES = {f"{m}_{kind}": (lambda S, o, s, m=m, f=f: f(S, o, s, m)) for m in TITLES
          for kind, f in (("jax", stage_jax), ("hf", stage_hf))}
STAGES["llama_hf_long"] = stage_hf_long


# ------------------------------------------------------------------------------------ summary
def _fmt(x: float) -> str:
    return "—" if x != x else f"{x:,.0f}" if x >= 1000 else f"{x:.1f}"


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x == x else "—"


def _cell(r: dict, ms_key: str, prefix: str = "") -> str:
    """'tok/s (ms)' of a result, 'failed: why' or '—' (not run: a stage skipped or timed out)."""
    if "tokens_per_s" in r:
        return f"{prefix}{_fmt(r['tokens_per_s'])} ({r[ms_key]:.2f} ms)"
    return f"{prefix}failed: {r['error'][:60]}" if "error" in r else "—"


def summarize(res: dict, S: dict) -> str:
    """The table: one row per workload of each model whose stages ran; ours and HF at their best repetition."""
    nan = float("nan")
    ceil = {}  # the best of each ceiling over the stages that measured it
    for k, st in res.items():
        for fw, key in (("jax", "jax"), ("torch", "hf")):
            for c, v in st.get(key, {}).get("ceilings", {}).items() if k.startswith("stage_") else ():
                if c.endswith(("GBps", "TFLOPs")):
                    ceil[f"{fw}_{c}"] = max(ceil.get(f"{fw}_{c}", 0.0), v)
    bw = max([v for k, v in ceil.items() if k.endswith("GBps")] or [nan]) * 1e9
    fl = max([v for k, v in ceil.items() if k.endswith("TFLOPs")] or [nan]) * 1e12
    lo, hi = S["new"]
    rows = []
    for name, title in TITLES.items():
        stages = [f"stage_{name}_jax", f"stage_{name}_hf"] + (["stage_llama_hf_long"] if name == "llama" else [])
        if not any(k in res for k in stages):
            continue
        W, hf_cfg = S["workloads"][name], S["hf"][name]
        jx = res.get(stages[0], {}).get("jax", {})
        peer = [h for k in stages[1:] for h in res.get(k, {}).get("hf", {}).get("decode", [])]
        for B, ctx, cache, _ in W["decode"]:
            d = next((d for d in jx.get("decode", []) if (d["batch"], d["context"], d["max_len"]) == (B, ctx, cache)), {})
            h = next((h for h in peer if (h["batch"], h["context"]) == (B, ctx)
                      and h.get("cache_slots", cache) == cache), {})  # eager: a DynamicCache, no slots
            h = h and h | {"tokens_per_s": B * h["steps"] / min(h["rep_s"]), "step_ms": min(h["rep_s"]) / h["steps"] * 1e3}
            roof = decode_roofline(name, hf_cfg, B, d.get("mean_context", ctx + (lo + hi - 1) / 2), bw)
            rows.append({"model": name, "workload": "decode", "batch": B, "context": ctx, "cache_slots": cache,
                         "label": f"{title} decode B={B}, context {ctx}, cache {cache}", "roofline": roof,
                         "ours": d, "hf": h, "hf_kind": HF_KIND.get(h.get("mode", "eager")) if h else None})
        for T in W["prefill"]:
            d = next((d for d in jx.get("prefill", []) if d["T"] == T), {})
            h = next((h for h in res.get(stages[1], {}).get("hf", {}).get("prefill", []) if h["T"] == T), {})
            h = h and (h | {"tokens_per_s": T / min(h["rep_s"]), "ms": min(h["rep_s"]) * 1e3} if "rep_s" in h else h)
            rows.append({"model": name, "workload": "prefill", "batch": 1, "T": T, "label": f"{title} prefill T={T}",
                         "roofline": prefill_roofline(name, hf_cfg, T, bw, fl), "ours": d, "hf": h,
                         "hf_kind": "eager" if h else None})
    for w in rows:
        ours, theirs = w["ours"].get("tokens_per_s", nan), w["hf"].get("tokens_per_s", nan)
        w["ours_over_roofline"], w["ours_over_hf"] = ours / w["roofline"]["tokens_per_s"], ours / theirs
    res["ceilings"] = {"bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": fl / 1e12, "measured": ceil}
    res["rows"] = rows

    jd = next((res[k]["jax"] for k in res if k.startswith("stage_") and "jax" in res[k]), {})
    hv = next((res[k]["hf"]["versions"] for k in res if k.startswith("stage_") and "hf" in res[k]), {})
    lines = [f"**{jd.get('device_kind', '?')}**, jax {jd.get('version', '?')}, torch {hv.get('torch', '?')}, "
             f"transformers {hv.get('transformers', '?')}, commit {res.get('commit') or '?'} (jaxmodels/ source hash "
             f"{res.get('jaxmodels_src_sha256_12')})" + (", TINY configs: a smoke test, not a measurement" if
                                                          res.get("tiny") else "") + ".",
             f"Ceilings measured in this run (best of JAX and torch): HBM {bw / 1e9:,.0f} GB/s, bf16 matmul "
             f"{fl / 1e12:,.0f} TFLOP/s. Tokens/s (ms per step or per prefill), best repetition; HF in the same run.",
             "", "| workload | roofline | ours | ours / roofline | HF (same run) | ours / HF |", "|---|---|---|---|---|---|"]
    for w in rows:
        ms = "step_ms" if w["workload"] == "decode" else "ms"
        roof = w["roofline"]
        theirs = _cell(w["hf"], ms, f"{w['hf_kind']} ") if w["hf"] else "—"
        lines.append(f"| {w['label']} | {_fmt(roof['tokens_per_s'])} ({roof[ms]:.2f} ms) | {_cell(w['ours'], ms)} | "
                     f"{_ratio(w['ours_over_roofline'])} | {theirs} | {_ratio(w['ours_over_hf'])} |")
    notes = []
    for name in TITLES:  # each model's first decode case: B=1, context 512, a 1024-slot cache
        w = next((w for w in rows if w["model"] == name and "first_call_s" in w["ours"]), None)
        if w:
            notes.append(f"- {w['label']}: the first `jm.generate` call (compile included) took "
                         f"{w['ours']['first_call_s']:.1f} s")
    for name, st in res.get("stages", {}).items():
        if isinstance(st["rc"], str) and st["rc"].startswith("skipped"):
            notes.append(f"- stage {name}: {st['rc']} (--budget-s), its rows are missing")
        elif st["rc"] != 0:
            notes.append(f"- stage {name}: {st['rc'] if isinstance(st['rc'], str) else 'rc=' + str(st['rc'])} after "
                         f"{st['wall_s']:.0f} s, its rows are partial or missing")
    for k in [k for k in res if k.startswith("stage_")]:
        for a in res[k].get("hf", {}).get("attempts", []):
            if "error" in a:
                notes.append(f"- HF {k[6:]}: {a['mode']} failed at B={a['batch']} ({a['error'][:120]}); next mode used")
    return "\n".join(lines + ([""] + notes if notes else []))


# ------------------------------------------------------------------------------------ driver
def git_commit() -> str | None:
    try:
        c = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        d = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "jaxmodels", "benchmarks"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if c.returncode:
        return None
    return c.stdout.strip() + ("+uncommitted" if d.stdout.strip() else "")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for bench.json, bench.md and the stage JSONs")
    ap.add_argument("--models", default="llama,gpt_oss", help="comma-separated: llama, gpt_oss")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, for a CPU smoke test")
    ap.add_argument("--stages", help="instead of --models: stages to run, of " + ", ".join(STAGES))
    ap.add_argument("--stage", choices=list(STAGES), help="run one stage in this process (used by the driver)")
    ap.add_argument("--timeouts", help="seconds per stage, e.g. llama_hf=200 (defaults: llama_jax 150, llama_hf 180, "
                                       "gpt_oss_jax 180, gpt_oss_hf 100, llama_hf_long 150; tiny: 400 each)")
    ap.add_argument("--budget-s", type=float, help="the whole run's limit in seconds (default 540; tiny: none)")
    ap.add_argument("--commit", help="recorded in the result (default: git rev-parse --short HEAD)")
    args = ap.parse_args()
    S = settings(args.tiny)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.stage:
        return run_stage(STAGES, args.stage, args, S)
    models = args.models.split(",")
    if unknown := [m for m in models if m not in TITLES]:
        ap.error(f"unknown model(s) {unknown}: choose from {list(TITLES)}")
    args.stages = args.stages or ",".join(f"{m}_{k}" for m in models for k in ("jax", "hf"))
    if unknown := [s for s in args.stages.split(",") if s not in STAGES]:
        ap.error(f"unknown stage(s) {unknown}: choose from {list(STAGES)}")
    limits = ({s: 400 for s in STAGES} if args.tiny else
              {"llama_jax": 150, "gpt_oss_jax": 180, "llama_hf": 180, "gpt_oss_hf": 100, "llama_hf_long": 150})
    limits |= dict(kv.split("=") for kv in args.timeouts.split(",")) if args.timeouts else {}
    args.timeouts = ",".join(f"{k}={v}" for k, v in limits.items())
    args.commit = args.commit or git_commit()
    res = drive(__file__, "bench.json", args, S, summarize, budget_s=args.budget_s or S["budget_s"])
    (Path(args.out) / "bench.md").write_text(res["table"] + "\n")


if __name__ == "__main__":
    main()
