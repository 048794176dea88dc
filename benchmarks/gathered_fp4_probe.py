"""MoE decode with FP4 experts kept quantized, on the GPU (issue #11): the gathered-experts GEMV
(`layers/gathered.py`) at GPT-OSS-20B shape (24 layers x 32 experts, 2880 -> 2880, top-4) for

  bf16     bf16 experts [L*E, K, N], the kernel (the bf16 baseline)
  fp4      packed e2m1 + E8M0 scales [L*E, N, K/2 | K/32], decoded inside the kernel (reads the quantized bytes)
  fp4_xla  the path the kernel replaces: XLA gathers the chosen experts' bytes, `qdq.dequant` to bf16, einsum

at B=1 and B=8 tokens (4 and 32 routed rows); each timed call runs the matmul of all 24 layers (the ids offset by
the layer, as the model's scan does; unrolled, so no loop overhead), so no slab is read twice from L2. Reported: ms per matmul,
bytes of the routed experts' slabs (distinct experts: bf16 2 B a weight, FP4 0.5 + 1/32) and GB/s. Then
`jm.generate` decode tok/s of a GPT-OSS-20B-shape model, random weights, experts either bf16 or FP4 kept quantized
(`init_params(fp4_experts=True)`: MXFP4's layout, [E, out, in/2] + E8M0 per 32; importing a GPT-OSS checkpoint
today dequantises its MXFP4 experts, only DeepSeek V4 imports keep them, so this stage is random weights).
generate_fp4_xla is the same FP4 model through the path the kernel replaces (XLA gather + dequant + einsum). Each
stage runs in its own process (`--stages kernel,generate_fp4,generate_fp4_xla,generate_bf16`); ~4 minutes on an
H200 (drop generate_bf16, measured in BENCHMARKS.md's decode section, if time is short).

    python3 benchmarks/gathered_fp4_probe.py --out $OUT
    python3 benchmarks/gathered_fp4_probe.py --out /tmp/probe --tiny      # CPU smoke (kernel interpreted)
"""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGES = "kernel,generate_fp4,generate_fp4_xla,generate_bf16"
HBM_GBS = 4474.0  # H200, measured (BENCHMARKS.md, dense section)


def _time(f, *args, reps=5):
    import jax

    jax.block_until_ready(f(*args))  # compile
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return min(ts)


def kernel_stage(a):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels.layers import gathered

    L, E, k, K, N = (2, 8, 2, 64, 64) if a.tiny else (24, 32, 4, 2880, 2880)
    batches = (1, 4) if a.tiny else (1, 8)
    dt = jnp.float32 if a.tiny else jnp.bfloat16
    interpret = a.tiny  # the CPU runs the kernel in Pallas' interpreter
    keys = jax.random.split(jax.random.key(0), 3)
    w_bf16 = jax.jit(lambda key: (jax.random.normal(key, (L * E, K, N), jnp.float32) * K ** -0.5).astype(dt))(keys[0])
    w_fp4 = jax.jit(lambda key: {
        "fp4": jax.random.randint(key, (L * E, N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8),
        "scale": jax.random.randint(keys[2], (L * E, N, K // 32), 118, 124, jnp.int32).astype(jnp.uint8)})(keys[1])
    jax.block_until_ready((w_bf16, w_fp4))
    fp4_bytes_per_expert = N * K // 2 + N * K // 32
    variants = {
        "bf16": (w_bf16, lambda x, w, ids: gathered.matmul(x, w, ids, interpret=interpret), 2 * K * N),
        "fp4": (w_fp4, lambda x, w, ids: gathered.matmul(x, w, ids, interpret=interpret), fp4_bytes_per_expert),
        "fp4_xla": (w_fp4, gathered.reference, fp4_bytes_per_expert),
    }
    rng = np.random.default_rng(0)
    out = []
    for B in batches:
        experts = np.stack([rng.choice(E, k, replace=False) for _ in range(B)]).reshape(-1)  # each token's top-k
        distinct = len(np.unique(experts))
        x = jax.random.normal(jax.random.key(B), (B * k, K), jnp.float32).astype(dt)
        ids = jnp.asarray(experts, jnp.int32)
        for name, (w, mm, per_expert) in variants.items():
            def layers(x, w, ids, mm=mm):  # every layer's matmul in one program (no loop's host round trips)
                return sum(mm(x, w, layer * E + ids).astype(jnp.float32) for layer in range(L))

            t = _time(jax.jit(layers), x, w, ids, reps=2 if a.tiny else 10) / L
            nbytes = distinct * per_expert
            r = {"variant": name, "batch": B, "routed_rows": B * k, "distinct_experts": distinct,
                 "ms": round(t * 1e3, 4), "bytes_read": nbytes, "gb_s": round(nbytes / t / 1e9, 1),
                 "of_hbm": round(nbytes / t / 1e9 / HBM_GBS, 3)}
            print("kernel", r, flush=True)
            out.append(r)
        # the three agree (fp4 vs its reference; bf16 is other weights)
        got = jax.jit(variants["fp4"][1])(x, w_fp4, ids + E)
        ref = jax.jit(gathered.reference)(x, w_fp4, ids + E)
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))) /
                    jnp.max(jnp.abs(ref.astype(jnp.float32))))
        out.append({"batch": B, "fp4_vs_reference_max_rel_err": err})
        print("kernel", out[-1], flush=True)
    return {"shape": {"layers": L, "experts": E, "top_k": k, "K": K, "N": N, "dtype": str(jnp.dtype(dt))},
            "backend": jax.default_backend(), "results": out}


def generate_stage(a, fp4: bool, kernel: bool = True):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxmodels as jm
    from benchmarks.bench_moe import GPT_OSS_20B, TINY
    from jaxmodels import families, model as M

    from jaxmodels.layers import gathered

    if not kernel:  # the replaced path: XLA gathers the chosen experts' bytes and expands them to bf16
        fits = gathered.fits
        gathered.fits = lambda x, w: not isinstance(w, dict) and fits(x, w)
    hf = TINY if a.tiny else GPT_OSS_20B
    cfg = families.config_from_hf(hf)
    dt = jnp.float32 if a.tiny else jnp.bfloat16
    t0 = time.perf_counter()
    params = jax.jit(lambda: M.init_params(cfg, 0, dtype=dt, fp4_experts=fp4))()
    jax.block_until_ready(params)
    expert_bytes = sum(v.nbytes for path, v in jax.tree_util.tree_leaves_with_path(params)
                       if any(getattr(p, "key", None) in ("w_gate", "w_up", "w_down") for p in path)
                       and "shared" not in jax.tree_util.keystr(path))
    model = jm.Model(cfg, params, None)
    rng = np.random.default_rng(0)
    res = {"experts": ("fp4 kept quantized" + ("" if kernel else ", XLA dequant path")) if fp4 else str(jnp.dtype(dt)), "init_s": round(time.perf_counter() - t0, 1),
           "expert_bytes_all_layers": int(expert_bytes), "backend": jax.default_backend(), "decode": []}

    def gen(B, prompt, new, max_len):
        prompts = rng.integers(0, cfg.vocab_size, (B, prompt)).tolist()
        t = time.perf_counter()
        out = jm.generate(model, prompts, max_new_tokens=new, ignore_eos=True, max_len=max_len)
        assert all(len(x) == new for x in out.tokens)
        return time.perf_counter() - t

    lo, hi = (4, 12) if a.tiny else (32, 160)
    prompt, max_len = (16, 64) if a.tiny else (512, 1024)
    for B in (1, 4) if a.tiny else (1, 8):
        first = gen(B, prompt, lo, max_len)  # compile included
        t_lo = min(gen(B, prompt, lo, max_len) for _ in range(2))
        t_hi = min(gen(B, prompt, hi, max_len) for _ in range(2))
        r = {"batch": B, "context": prompt, "max_len": max_len, "first_call_s": round(first, 2),
             "decode_tok_s": round(B * (hi - lo) / (t_hi - t_lo), 1),
             "step_ms": round((t_hi - t_lo) / (hi - lo) * 1e3, 3)}
        print("generate", res["experts"], r, flush=True)
        res["decode"].append(r)
    return res


def child(a):
    name = a.child
    res = kernel_stage(a) if name == "kernel" else generate_stage(a, fp4=name.startswith("generate_fp4"),
                                                                kernel=name != "generate_fp4_xla")
    res["stage"] = name
    with open(os.path.join(a.out, f"gathered_fp4_{name}.json"), "w") as fh:
        json.dump(res, fh, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (smoke run)")
    ap.add_argument("--stages", default=STAGES)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        return child(a)
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rc = 0
    for name in a.stages.split(","):
        t = time.perf_counter()
        rc |= subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--child", name]
                             + (["--tiny"] if a.tiny else []), env=env, check=False).returncode
        print(f"stage {name}: {time.perf_counter() - t:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
