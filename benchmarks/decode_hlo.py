"""Which large copies and transposes a jitted decode step's optimized HLO holds on this device, with the JAX source
line each came from (the HLO's metadata): the instructions that move weights instead of computing with them.

    PYTHONPATH=. python3 benchmarks/decode_hlo.py --out $OUT [--models llama,gpt_oss] [--layers 4] [--batches 1,32]
"""
import argparse
import json
import os
import re

import jax
import jax.numpy as jnp

from benchmarks.bench_dense import LLAMA31_8B
from benchmarks.bench_moe import GPT_OSS_20B
from jaxmodels import families, model as M

MOVES = re.compile(r"^\s*(ROOT )?(%?[\w.-]+) = (\w+)\[([\d,]*)\](?:\{[^}]*\})? (transpose|copy|fusion)\(")


def big_moves(text: str, min_bytes: int) -> list[dict]:
    """Instructions of the optimized HLO (outside fusion bodies: a fusion is listed once) that are transposes, copies
    or fusions named like them (wrapped_transpose, copy_fusion, ...) with an output of at least min_bytes, with
    their metadata's op_name and source line."""
    size = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u8": 1, "s8": 1, "pred": 1, "u32": 4}
    out, fused = [], False
    for line in text.splitlines():
        if head := re.match(r"^(ENTRY )?%?([\w.-]+) \(", line):  # a computation: skip the bodies of fusions
            fused = head.group(1) is None and ("fused" in head.group(2) or "computation" in head.group(2))
        m = None if fused else MOVES.match(line)
        if not m:
            continue
        name, dt, dims, op = m.group(2), m.group(3), m.group(4), m.group(5)
        if op == "fusion" and not re.search(r"transpose|copy", name):
            continue
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        if n * size.get(dt, 4) < min_bytes:
            continue
        meta = re.search(r'op_name="([^"]*)"', line)
        src = re.search(r'source_file="([^"]*)" source_line=(\d+)', line)
        operands = line[m.end():].split(")", 1)[0][:160]
        out.append({"name": name, "operands": operands, "shape": f"{dt}[{dims}]",
                    "mbytes": round(n * size.get(dt, 4) / 1e6, 1),
                    "op_name": meta.group(1)[-160:] if meta else None,
                    "source": f"{os.path.basename(src.group(1))}:{src.group(2)}" if src else None})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", default="llama,gpt_oss")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--min-mbytes", type=float, default=4.0)
    a = ap.parse_args()
    res = {"jax": jax.__version__, "device": str(jax.devices()[0]), "runs": []}
    for name in a.models.split(","):
        hf = dict(GPT_OSS_20B if name == "gpt_oss" else LLAMA31_8B, num_hidden_layers=a.layers)
        cfg = families.config_from_hf(hf)
        params = jax.jit(lambda: M.init_params(cfg, 0, dtype=jnp.bfloat16))()
        for B in map(int, a.batches.split(",")):
            step = jax.jit(M.decode_step, static_argnums=1, donate_argnums=4, compiler_options=M.COMPILER_OPTIONS)
            cache = M.init_cache(cfg, B, 1024, jnp.bfloat16)
            tok, pos = jnp.zeros((B,), jnp.int32), jnp.full((B,), 512, jnp.int32)
            text = step.lower(params, cfg, tok, pos, cache).compile().as_text()
            path = os.path.join(a.out, f"decode_hlo_{name}_L{a.layers}_B{B}.txt")
            with open(path, "w") as f:
                f.write(text)
            moves = big_moves(text, int(a.min_mbytes * 1e6))
            r = {"model": name, "layers": a.layers, "batch": B, "hlo": os.path.basename(path), "moves": moves}
            print(json.dumps({k: v for k, v in r.items() if k != "moves"}), flush=True)
            for mv in moves:
                print("   ", mv, flush=True)
            res["runs"].append(r)
            with open(os.path.join(a.out, "decode_hlo.json"), "w") as f:
                json.dump(res, f, indent=1)
        del params


if __name__ == "__main__":
    main()
