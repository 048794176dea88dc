"""Conversion and loading at checkpoint scale (issue #18), on the host: a bf16 Llama-shaped safetensors checkpoint
(1.32 GB, 3 shards, largest tensor 131 MB) converted and loaded, each operation in a fresh process whose peak RSS
comes from wait4(), each starting with the files evicted from the page cache (read from the disk); next to
transformers' from_pretrained and the files' read rate (cat cold and cached; dd with O_DIRECT).

    python benchmarks/bench_convert.py [--old /tmp/oldrepo] [--ckpt /tmp/bench_convert/src] [--json out.json]

--old: another checkout (e.g. `git archive HEAD | tar -x -C /tmp/oldrepo`) measured the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(layers=12, d=2048, inter=5632, heads=32, kv_heads=4, vocab=32000)

OPS = {
    "convert --dtype bfloat16": "from jaxmodels.cli import main\nimport sys\nt=time.time()\nmain(['convert', SRC, "
                                "OUT + '/bf16', '--dtype', 'bfloat16'])\nt=time.time()-t",
    "convert --dtype float32": "from jaxmodels.cli import main\nt=time.time()\nmain(['convert', SRC, OUT + '/f32', "
                               "'--dtype', 'float32'])\nt=time.time()-t",
    "jm.load(converted)": "import jax, jaxmodels as jm\nt=time.time()\nm = jm.load(OUT + '/bf16')\n"
                          "jax.block_until_ready(m.params)\nt=time.time()-t",
    'jm.load(hf_dir, dtype="bfloat16")': "import jax, jaxmodels as jm\nt=time.time()\nm = jm.load(SRC, "
                                         "dtype='bfloat16')\njax.block_until_ready(m.params)\nt=time.time()-t",
}
PEER = ("transformers from_pretrained", "import torch, transformers\nt=time.time()\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.bfloat16)\nt=time.time()-t")


def write_checkpoint(root: Path) -> int:
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    s = SHAPE
    hd = s["d"] // s["heads"]
    shapes = {"model.embed_tokens.weight": (s["vocab"], s["d"])}
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (s["d"], s["d"]), p + "self_attn.k_proj.weight": (s["kv_heads"] * hd, s["d"]),
                   p + "self_attn.v_proj.weight": (s["kv_heads"] * hd, s["d"]), p + "self_attn.o_proj.weight": (s["d"], s["d"]),
                   p + "mlp.gate_proj.weight": (s["inter"], s["d"]), p + "mlp.up_proj.weight": (s["inter"], s["d"]),
                   p + "mlp.down_proj.weight": (s["d"], s["inter"]), p + "input_layernorm.weight": (s["d"],),
                   p + "post_attention_layernorm.weight": (s["d"],)}
    shapes |= {"model.norm.weight": (s["d"],), "lm_head.weight": (s["vocab"], s["d"])}
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": s["vocab"], "hidden_size": s["d"],
        "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "head_dim": hd, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 22) * 0.02).astype(ml_dtypes.bfloat16)
    total = sum(math.prod(x) * 2 for x in shapes.values())
    names, weight_map, done = list(shapes), {}, 0
    for k in range(3):
        file, chunk = f"model-{k + 1:05d}-of-00003.safetensors", {}
        while names and (done < total * (k + 1) / 3 or k == 2):
            n = names.pop(0)
            chunk[n] = np.resize(block, shapes[n])
            done += chunk[n].nbytes
            weight_map[n] = file
        save_file(chunk, str(root / file), metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    return total


def run(code: str, src: Path, out: Path, code_root: Path) -> dict:
    """Run `code` in a fresh interpreter (code under code_root first on the path); its timed section's seconds,
    the whole process's seconds and its peak RSS."""
    prog = f"import time, json\nSRC, OUT = {str(src)!r}, {str(out)!r}\n{code}\nprint('@@', json.dumps(t))"
    env = dict(os.environ, PYTHONPATH=str(code_root), JAX_PLATFORMS="cpu")
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", prog], cwd=code_root, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    stdout = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.time() - t0
    if status != 0:
        raise RuntimeError(f"{code!r} failed under {code_root}: {stdout[-2000:]}")
    t = json.loads(stdout.split("@@")[-1])
    return {"s": t, "process_s": wall, "peak_rss_gb": usage.ru_maxrss * 1024 / 1e9}


def evict(*roots: Path) -> None:
    """Every file under roots out of the page cache (written back first): each operation reads from the disk, as
    a checkpoint too large for RAM would, whatever ran before it."""
    for root in roots:
        for f in [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file()):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def read_rates(src: Path) -> dict:
    files = sorted(str(f) for f in src.glob("*.safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    evict(src)
    t = time.time()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    cold = size / (time.time() - t) / 1e9
    t = time.time()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    cat = size / (time.time() - t) / 1e9
    t = time.time()
    for f in files:  # O_DIRECT: bypasses the page cache, the disk's own rate
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], capture_output=True, check=True)
    return {"cat_gbs": cat, "cat_cold_gbs": cold, "dd_direct_gbs": size / (time.time() - t) / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/bench_convert/src"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.ckpt.exists():
        write_checkpoint(args.ckpt)
    size = sum(f.stat().st_size for f in args.ckpt.glob("*.safetensors"))
    rows = {"checkpoint_gb": size / 1e9, "cpus": os.cpu_count(), "read": read_rates(args.ckpt)}
    for label, root in (("old", args.old), ("new", ROOT)):
        if root is None:
            continue
        out = args.ckpt.parent / label
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        for op, code in OPS.items():
            evict(args.ckpt, out)
            r = run(code, args.ckpt, out, root)
            r["gbs"] = size / r["s"] / 1e9
            rows[f"{label}: {op}"] = r
            print(f"{label:4} {op:36} {r['s']:6.2f} s  peak RSS {r['peak_rss_gb']:5.2f} GB  {r['gbs']:5.2f} GB/s "
                  f"(process {r['process_s']:.1f} s)", flush=True)
    evict(args.ckpt)
    r = run(PEER[1], args.ckpt, args.ckpt.parent, ROOT)
    rows[PEER[0]] = r
    print(f"peer {PEER[0]:36} {r['s']:6.2f} s  peak RSS {r['peak_rss_gb']:5.2f} GB  {size / r['s'] / 1e9:5.2f} GB/s")
    print(f"read: cat {rows['read']['cat_cold_gbs']:.2f} GB/s cold, {rows['read']['cat_gbs']:.2f} GB/s (page cache), dd O_DIRECT {rows['read']['dd_direct_gbs']:.2f} GB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
