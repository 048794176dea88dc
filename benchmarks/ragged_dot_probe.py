"""MoE prefill at DeepSeek V4.1-Flash widths (384 experts, 5120 -> 2304, top-6) on the GPU: is XLA's `lax.ragged_dot`
right past 2^31 elements of its dense lowering, and what does `moe._windows` (the loop that replaces it for many
experts) cost? Each case runs in its own process (an illegal address poisons the CUDA context) and prints one
JSON line: ok / max error against a batched einsum over uniform groups, or how the process ended.

    JAX_PLATFORMS=cuda CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=. python benchmarks/ragged_dot_probe.py [--cases a,b]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

E, K, N = (384, 5120, 2304) if __import__("os").environ.get("PROBE_TINY") is None else (48, 64, 32)
CASES = {  # name: (rows per expert, what)
    "ragged_dot_384_rows": (1, "lax.ragged_dot, [384 x 5120] rows: its dense operand 384 x 1.97e6 < 2^31"),
    "ragged_dot_3072_rows": (8, "lax.ragged_dot, [3072 x 5120] rows (a 512-token prefill): 6.0e9 > 2^31"),
    "windows_bf16_3072_rows": (8, "moe._windows, bf16 experts, 3072 rows"),
    "windows_fp4_3072_rows": (8, "moe._windows, FP4 experts kept quantized, 3072 rows"),
    "windows_fp4_12288_rows": (32, "moe._windows, FP4 experts kept quantized, 12288 rows (a 2048-token prefill)"),
}


def run(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmodels.config import MLPSpec
    from jaxmodels.layers import moe, qdq

    per, _ = CASES[name]
    M = E * per
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (M, K), jnp.bfloat16)
    sizes = jnp.full((E,), per, jnp.int32)
    out = {"case": name, "rows": M}
    if name.startswith("ragged_dot"):
        w = (jax.random.normal(kw, (E, K, N), jnp.bfloat16) * K ** -0.5).astype(jnp.bfloat16)
        f = jax.jit(jax.lax.ragged_dot)
        want = jnp.einsum("epk,ekn->epn", x.reshape(E, per, K), w, preferred_element_type=jnp.float32).reshape(M, N)
    else:
        spec = MLPSpec(kind="moe", activation="silu", intermediate_size=N, num_experts=E, top_k=6)
        if "fp4" in name:
            def q(o, i, k):
                return {"fp4": jax.random.bits(k, (E, o, i // 2), jnp.uint8),
                        "scale": jnp.full((E, o, i // 32), 121, jnp.uint8)}  # 2^-6
            ks = jax.random.split(kw, 3)
            p = {"w_gate": q(N, K, ks[0]), "w_up": q(N, K, ks[1]), "w_down": q(K, N, ks[2])}
        else:
            ks = jax.random.split(kw, 3)
            p = {"w_gate": jax.random.normal(ks[0], (E, K, N), jnp.bfloat16) * 0.02,
                 "w_up": jax.random.normal(ks[1], (E, K, N), jnp.bfloat16) * 0.02,
                 "w_down": jax.random.normal(ks[2], (E, N, K), jnp.bfloat16) * 0.02}

        def f(x, p, sizes):
            return moe._windows(spec, p, x, sizes)

        f = jax.jit(f)
        w = p

        def expert(name, e):  # the reference: one expert at a time, in fp32, from the same bytes
            v = jax.tree.map(lambda a: a[e], p[name])
            return (qdq.dequant(v, jnp.float32).T if isinstance(v, dict) else v.astype(jnp.float32))

        xs = x.reshape(E, per, K).astype(jnp.float32)
        ref = jax.jit(lambda e: jax.nn.silu(xs[e] @ expert("w_gate", e)) * (xs[e] @ expert("w_up", e))
                      @ expert("w_down", e))
        checked = [0, 1, E // 2, E - 1]
        want = None
    t0 = time.perf_counter()
    got = f(x, w, sizes)
    jax.block_until_ready(got)
    out["first_s"] = time.perf_counter() - t0
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, w, sizes))
        ts.append(time.perf_counter() - t0)
    out["ms"] = 1e3 * sorted(ts)[1]
    got = np.asarray(got.astype(jnp.float32))
    if want is not None:
        want = np.asarray(want)
        out["max_err_rel"] = float(np.abs(got - want).max() / np.abs(want).max())
    else:
        errs = []
        for e in checked:
            r = np.asarray(ref(e))
            errs.append(float(np.abs(got[e * per:(e + 1) * per] - r).max() / np.abs(r).max()))
        out["max_err_rel"] = max(errs)
    out["ok"] = out["max_err_rel"] < 3e-2
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run(args.one)), flush=True)
        return
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                               timeout=args.timeout)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("{")), None)
            res = json.loads(line) if line else {
                "case": name, "ok": False, "rc": r.returncode,
                "error": [ln for ln in r.stderr.splitlines() if "Error" in ln or "error" in ln][-3:]}
        except subprocess.TimeoutExpired:
            res = {"case": name, "ok": False, "error": f"timed out after {args.timeout} s"}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res["what"] = CASES[name][1]
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
