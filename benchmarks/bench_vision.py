"""Vision-encoder throughput on one GPU (#14): jaxmodels vs HF transformers (PyTorch), images/s.

Random weights at real shapes, bf16: the Gemma3-4B SigLIP tower + projector at 896 px, and the Mllama-11B tiled
encoder (32 local + 8 global layers, 4 tiles of 560 px an image) + projector. Our side builds its ModelConfig with
`families.config_from_hf` from the HF config dicts below (a one-layer text part, the real vision shape) and times
a `jax.jit` (`COMPILER_OPTIONS`) of `layers.vision.encode` / `layers.mllama_vision.encode`; HF's side is
SiglipVisionModel + Gemma3MultiModalProjector and MllamaVisionModel + its projector Linear, sdpa, no_grad, timed
with cuda events. Each side runs in its own process (JAX preallocates the card), measures its own ceilings
(bf16 8192^3 matmul, HBM), and saves after every measurement; the driver merges them and prints a table.

    PYTHONPATH=. python3 benchmarks/bench_vision.py                        # H200: $OUT/bench_vision.json
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/bench_vision.py --tiny --out /tmp/bv.json   # CPU smoke test
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, jax_ceilings, log, median_time, src_hash, torch_ceilings  # noqa: E402

RATIOS = [[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]
GEMMA3_4B = {
    "model_type": "gemma3", "mm_tokens_per_image": 256, "image_token_index": 262144,
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "num_hidden_layers": 27,
                      "num_attention_heads": 16, "intermediate_size": 4304, "patch_size": 14, "image_size": 896,
                      "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False},
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "num_hidden_layers": 1, "vocab_size": 512,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 256},
}
MLLAMA_11B = {
    "model_type": "mllama", "image_token_index": 128256,
    "vision_config": {"hidden_size": 1280, "num_hidden_layers": 32, "num_global_layers": 8, "attention_heads": 16,
                      "intermediate_size": 5120, "patch_size": 14, "image_size": 560, "max_num_tiles": 4,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30], "vision_output_dim": 7680,
                      "hidden_act": "gelu", "norm_eps": 1e-5, "supported_aspect_ratios": RATIOS},
    "text_config": {"model_type": "mllama_text_model", "hidden_size": 4096, "num_hidden_layers": 1,
                    "cross_attention_layers": [0], "vocab_size": 512, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 256, "bos_token_id": 1, "eos_token_id": 2,
                    "pad_token_id": 0},
}


def _tiny(hf: dict, vision: dict, text: dict) -> dict:
    return hf | {"vision_config": hf["vision_config"] | vision, "text_config": hf["text_config"] | text}


def settings(tiny: bool) -> dict:
    if tiny:
        txt = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64}
        models = {"gemma3_siglip": _tiny(GEMMA3_4B | {"mm_tokens_per_image": 16, "image_token_index": 511}, dict(
                      hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, patch_size=4,
                      image_size=32), txt | {"head_dim": 32}),
                  "mllama": _tiny(MLLAMA_11B | {"image_token_index": 511}, dict(
                      hidden_size=32, num_hidden_layers=3, num_global_layers=1, attention_heads=4,
                      intermediate_size=64, patch_size=4, image_size=16, intermediate_layers_indices=[0, 2],
                      vision_output_dim=96), txt)}
        return dict(models=models, batches={"gemma3_siglip": [1, 2], "mllama": [1, 2]}, warmup=1, reps=2,
                    dtype="float32", bw_bytes=1 << 22, mm=256)  # XLA:CPU lacks some bf16 batched dots
    # Mllama stops at 16 images (64 tiles): our attention keeps fp32 scores, 16 x 16 x 6432^2 x 4 B = 42 GB a layer
    return dict(models={"gemma3_siglip": GEMMA3_4B, "mllama": MLLAMA_11B},
                batches={"gemma3_siglip": [1, 8, 32], "mllama": [1, 4, 16]}, warmup=2, reps=5,
                dtype="bfloat16", bw_bytes=1 << 30, mm=8192)


def flops_per_image(hf: dict) -> float:
    """Model FLOPs of one image (2 per multiply-add): every matmul (patch embedding, q/k/v/o, fc1/fc2, projector)
    plus attention's QK^T and PV (2 x 2 L^2 C a layer over all heads); norms, softmax, GELU, pooling and the
    position / tile embeddings are left out. Mllama counts the padded sequence both sides run: T tiles of Lp
    tokens (NP = patches + CLS, padded to a multiple of 8), all attending jointly."""
    v, D = hf["vision_config"], hf["text_config"]["hidden_size"]
    C, I, p, S = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["image_size"]
    if hf["model_type"] == "gemma3":
        L, layers = (S // p) ** 2, v["num_hidden_layers"]
        ends = 2 * L * 3 * p * p * C + 2 * hf["mm_tokens_per_image"] * C * D  # patch conv; pooled tokens @ W
    else:
        T, NP = v["max_num_tiles"], (S // p) ** 2 + 1
        L, layers = T * (NP + (-NP) % 8), v["num_hidden_layers"] + v["num_global_layers"]
        ends = 2 * T * (NP - 1) * 3 * p * p * C + 2 * T * NP * v["vision_output_dim"] * D
    return ends + layers * (2 * L * (4 * C * C + 2 * C * I) + 4 * L * L * C)


def _record(out, save, name, B, fn):
    """out[name][B] = fn() or the error (OOM at a batch size must not lose the others)."""
    try:
        r = fn()
    except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    out.setdefault(name, {})[str(B)] = r
    log(f"  {name} B={B}: {r}")
    save()


# ------------------------------------------------------------------------------------ JAX stage
def stage_jax(S: dict, out: dict, save):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels import families, model as M
    from jaxmodels.layers import mllama_vision, vision

    # speed does not depend on the values: RngBitGenerator keys compile far faster than threefry (XLA:CPU: 45 -> 12 s)
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    dt, rng = jnp.dtype(S["dtype"]), np.random.default_rng(0)
    out |= {"version": jax.__version__, "device": jax.devices()[0].device_kind, "ceilings": jax_ceilings(S)}
    save()
    for name, hf in S["models"].items():
        cfg = families.config_from_hf(hf)
        v = cfg.vision
        params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dt)["vision"])()  # one compile; text part dropped
        pixels = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32).astype(dt))  # noqa: E731
        if v.kind == "siglip":
            fn = lambda p, x: vision.encode(v, p, {"pixel_values": x})[0]  # noqa: E731
            make = lambda B: (pixels(B, 3, v.image_size, v.image_size),)  # noqa: E731
        else:
            fn = lambda p, x, ids, mask: mllama_vision.encode(v, p, x, ids, mask)  # noqa: E731
            ratio = 1 + [h * w for h, w in v.aspect_ratios].index(v.max_tiles)  # every tile real

            def make(B):
                x = pixels(B, 1, v.max_tiles, 3, v.image_size, v.image_size)
                return x, jnp.full((B, 1), ratio, jnp.int32), jnp.ones((B, 1, v.max_tiles), jnp.int32)
        jitted = jax.jit(fn, compiler_options=M.COMPILER_OPTIONS)

        def one(B):
            args = make(B)
            t0 = time.perf_counter()
            compiled = jitted.lower(params, *args).compile()
            tc = time.perf_counter() - t0
            call = lambda: jax.block_until_ready(compiled(params, *args))  # noqa: E731
            for _ in range(S["warmup"]):
                y = call()
            t, ts = median_time(call, S["reps"])
            return {"ms": t * 1e3, "images_per_s": B / t, "compile_s": tc, "rep_s": ts, "out_shape": list(y.shape),
                    "finite": bool(jnp.isfinite(y).all())}
        for B in S["batches"][name]:
            _record(out, save, name, B, lambda: one(B))


# ------------------------------------------------------------------------------------ HF stage
def hf_class(name: str, module: str):
    """A transformers class by name: top level first, then its modeling module; None if this version lacks it."""
    import transformers
    cls = getattr(transformers, name, None)
    if cls is None:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module}"), name, None)
        except ImportError:
            pass
    return cls


def build_hf(name: str, hf: dict, dev, dt):
    """(module, make inputs) of the HF tower + projector; RuntimeError naming any class this transformers lacks."""
    import torch
    names = {"gemma3_siglip": [("Gemma3Config", "gemma3"), ("SiglipVisionModel", "siglip.modeling_siglip"),
                               ("Gemma3MultiModalProjector", "gemma3.modeling_gemma3")],
             "mllama": [("MllamaConfig", "mllama"), ("MllamaVisionModel", "mllama.modeling_mllama")]}[name]
    classes = [hf_class(n, m) for n, m in names]
    missing = [n for (n, _), c in zip(names, classes) if c is None]
    if missing:
        raise RuntimeError(f"transformers lacks {', '.join(missing)}: no HF peer for {name}")
    conf = classes[0](**{k: v for k, v in hf.items() if k != "model_type"})
    vc = conf.vision_config
    vc._attn_implementation = "sdpa"
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            tower = classes[1](vc)
            head = (classes[2](conf) if name == "gemma3_siglip"
                    else torch.nn.Linear(vc.vision_output_dim, conf.text_config.hidden_size, bias=True))
    finally:
        torch.set_default_dtype(prev)
    model = torch.nn.ModuleDict({"tower": tower, "head": head}).to(dev, dt).eval()
    S_ = vc.image_size
    if name == "gemma3_siglip":
        run = lambda x: model["head"](model["tower"](pixel_values=x).last_hidden_state)  # noqa: E731
        make = lambda B: (torch.randn(B, 3, S_, S_, device=dev, dtype=dt),)  # noqa: E731
    else:
        T = vc.max_num_tiles
        ratio = 1 + [h * w for h, w in vc.supported_aspect_ratios].index(T)
        run = lambda x, ids, mask: model["head"](model["tower"](x, ids, mask).last_hidden_state)  # noqa: E731
        make = lambda B: (torch.randn(B, 1, T, 3, S_, S_, device=dev, dtype=dt),  # noqa: E731
                          torch.full((B, 1), ratio, device=dev), torch.ones(B, 1, T, device=dev, dtype=torch.long))
    return run, make, vc._attn_implementation


def torch_time(fn, reps: int, cuda: bool):
    """Median seconds of one fn() (cuda events on the GPU, wall clock on the CPU) and every rep."""
    import torch
    if not cuda:
        return median_time(fn, reps)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return statistics.median(ts), ts


def stage_hf(S: dict, out: dict, save):
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    dev, dt = ("cuda" if cuda else "cpu"), getattr(torch, S["dtype"])
    out |= {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if cuda:
        out["ceilings"] = torch_ceilings(S, out)
    save()
    for name, hf in S["models"].items():
        try:
            run, make, attn = build_hf(name, hf, dev, dt)
        except Exception as e:  # noqa: BLE001  (a class missing in this transformers: say so, time the rest)
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"[hf] {name}: SKIPPED, {out[name]['error']}")
            save()
            continue
        out.setdefault(name, {})["attn_implementation"] = attn

        def one(B):
            args = make(B)
            with torch.no_grad():
                for _ in range(S["warmup"]):
                    y = run(*args)
                if cuda:
                    torch.cuda.synchronize()
                t, ts = torch_time(lambda: run(*args), S["reps"], cuda)
            return {"ms": t * 1e3, "images_per_s": B / t, "rep_s": ts, "out_shape": list(y.shape)}
        for B in S["batches"][name]:
            _record(out, save, name, B, lambda: one(B))
            if cuda:
                torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ driver
def summarize(res: dict, S: dict) -> tuple[str, dict]:
    jx, th = res.get("jax", {}), res.get("hf", {})
    ceil = max([d.get("ceilings", {}).get("matmul_bf16_TFLOPs", 0) for d in (jx, th)]) * 1e12 or float("nan")
    nan = float("nan")
    lines = [f"bf16 matmul ceiling (best measured): {ceil / 1e12:.0f} TFLOP/s",
             f"{'model':<15}{'B':>4}{'GFLOP/img':>11}{'ours ms':>10}{'ours img/s':>12}{'hf ms':>10}{'hf img/s':>10}"
             f"{'ours/hf':>9}{'ours/ceil':>10}{'hf/ceil':>9}{'compile s':>10}"]
    rows = {}
    for name, hf in S["models"].items():
        f = flops_per_image(hf)
        for B in S["batches"][name]:
            o, h = jx.get(name, {}).get(str(B), {}), th.get(name, {}).get(str(B), {})
            oi, hi = o.get("images_per_s", nan), h.get("images_per_s", nan)
            r = {"flops_per_image": f, "ours_images_per_s": oi, "hf_images_per_s": hi, "ours_over_hf": oi / hi,
                 "ours_frac_of_matmul_ceiling": oi * f / ceil, "hf_frac_of_matmul_ceiling": hi * f / ceil}
            rows[f"{name}/{B}"] = r
            lines.append(f"{name:<15}{B:>4}{f / 1e9:>11.1f}{o.get('ms', nan):>10.2f}{oi:>12.2f}{h.get('ms', nan):>10.2f}"
                         f"{hi:>10.2f}{r['ours_over_hf']:>9.2f}{r['ours_frac_of_matmul_ceiling']:>10.2f}"
                         f"{r['hf_frac_of_matmul_ceiling']:>9.2f}{o.get('compile_s', nan):>10.1f}")
    errors = []
    for side, d in (("ours", jx), ("hf", th)):
        for n in S["models"]:
            m = d.get(n, {})
            errors += [f"{side} {n}{'' if k == 'error' else f' B={k}'}: {r if k == 'error' else r['error']}"
                       for k, r in m.items() if k == "error" or isinstance(r, dict) and "error" in r]
    return "\n".join(lines + errors), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, float32, CPU smoke test")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peer")
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "bench_vision.json"))
    ap.add_argument("--timeouts", default="jax=150,hf=100", help="seconds per stage process")
    ap.add_argument("--stage", help=argparse.SUPPRESS)
    ap.add_argument("--part", help=argparse.SUPPRESS)
    args = ap.parse_args()
    S = settings(args.tiny)
    if args.stage:  # a stage process: write its JSON after every measurement
        out: dict = {}
        save = lambda: Path(args.part).write_text(json.dumps(out, indent=1, default=str))  # noqa: E731
        {"jax": stage_jax, "hf": stage_hf}[args.stage](S, out, save)
        return save()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = None
    res = {"settings": {k: v for k, v in S.items() if k != "models"}, "hf_configs": S["models"], "tiny": args.tiny,
           "commit": commit or None, "jaxmodels_src_sha256_12": src_hash(), "host": platform.node(),
           "python": sys.version.split()[0], "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "stages": {}}
    limits = {"jax": 150.0, "hf": 100.0} | {k: float(v) for k, v in (kv.split("=") for kv in args.timeouts.split(","))}
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # the JAX process has the card to itself
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["jax"] + ([] if args.no_hf else ["hf"]):
            part, t0 = Path(tmp) / f"{name}.json", time.perf_counter()
            log(f"== stage {name} (limit {limits[name]:.0f} s)")
            cmd = [sys.executable, __file__, "--stage", name, "--part", str(part)] + ["--tiny"] * args.tiny
            try:
                rc = subprocess.run(cmd, env=env, timeout=limits[name]).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            res["stages"][name] = {"rc": rc, "wall_s": time.perf_counter() - t0}
            res[name] = json.loads(part.read_text()) if part.exists() else {}
    res["table"], res["summary"] = summarize(res, S)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    log("\n" + res["table"] + f"\n\nwrote {args.out}")


if __name__ == "__main__":
    main()
