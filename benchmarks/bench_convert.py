"""Conversion and loading at checkpoint scale (issue #18), on the host: a bf16 Llama-shaped safetensors checkpoint
(1.32 GB, 3 shards, largest tensor 131 MB) converted and loaded, each operation in a fresh process whose peak RSS
comes from wait4(), each starting with the files evicted from the page cache (read from the disk); next to
transformers' from_pretrained and the files' read rate (cat cold and cached; dd with O_DIRECT).

    python benchmarks/bench_convert.py [--old /tmp/oldrepo] [--ckpt /tmp/bench_convert/src] [--json out.json]
                                       [--repeat 3] [--max-load 0.7]

--old: another checkout (e.g. `git archive HEAD | tar -x -C /tmp/oldrepo`) measured the same way, its conversions
checked to write the same files as this one's. --repeat: rounds, each measuring the disk (dd) and then old and new
in turn; the summary gives min and median, and each rate's ratio to the median dd rate. --max-load: before each
operation wait (up to 10 minutes) until the 1-minute load average is below it (a shared machine); the load each
operation started at is in the JSON.
"""
from __future__ import annotations

import argparse
import filecmp
import json
import math
import os
import shutil
import statistics
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
    'jm.load(hf_dir, dtype="float32")': "import jax, jaxmodels as jm\nt=time.time()\nm = jm.load(SRC, "
                                        "dtype='float32')\njax.block_until_ready(m.params)\nt=time.time()-t",
}
WRITES = {"convert --dtype bfloat16": "bf16", "convert --dtype float32": "f32"}  # op -> its output under OUT
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


def wait_for_quiet(max_load: float | None, limit_s: float = 600) -> float:
    """The 1-minute load average once it is below max_load (or after limit_s): other processes' work on a shared
    machine's cores shows up in every timing here."""
    t = time.time()
    while max_load is not None and os.getloadavg()[0] >= max_load and time.time() - t < limit_s:
        time.sleep(5)
    return os.getloadavg()[0]


def same_files(a: Path, b: Path) -> bool:
    """Two converted directories hold the same files, byte for byte (compared in small chunks: this process's
    peak RSS is where every child's ru_maxrss starts)."""
    files = lambda d: sorted(p.relative_to(d) for p in d.rglob("*") if p.is_file())  # noqa: E731
    return files(a) == files(b) and all(filecmp.cmp(a / f, b / f, shallow=False) for f in files(a))


def summary(rows: dict, rounds: list, size: int) -> None:
    """min / median of each operation over the rounds, GB/s (of the source's bytes) and ratio to the median dd."""
    dd = statistics.median(r["read"]["dd_direct_gbs"] for r in rounds)
    print(f"\n{len(rounds)} round(s); dd O_DIRECT {min(r['read']['dd_direct_gbs'] for r in rounds):.2f}-"
          f"{max(r['read']['dd_direct_gbs'] for r in rounds):.2f} GB/s, median {dd:.2f}; load at start "
          f"{min(x['load'] for r in rounds for x in r['ops'].values()):.2f}-"
          f"{max(x['load'] for r in rounds for x in r['ops'].values()):.2f}")
    for op in rounds[0]["ops"]:
        times = [r["ops"][op]["s"] for r in rounds]
        best, med = min(times), statistics.median(times)
        rows.setdefault("summary", {})[op] = {"min_s": best, "median_s": med, "median_gbs": size / med / 1e9,
                                              "ratio_to_dd": size / med / 1e9 / dd}
        print(f"{op:44} min {best:6.2f} s  median {med:6.2f} s  {size / med / 1e9:5.2f} GB/s  "
              f"{size / med / 1e9 / dd:4.2f} x dd")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, help="another checkout to measure the same way")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/bench_convert/src"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--max-load", type=float)
    args = ap.parse_args()
    if not args.ckpt.exists():
        write_checkpoint(args.ckpt)
    size = sum(f.stat().st_size for f in args.ckpt.glob("*.safetensors"))
    rows = {"checkpoint_gb": size / 1e9, "cpus": os.cpu_count(), "rounds": []}
    for _ in range(args.repeat):
        wait_for_quiet(args.max_load)
        rnd = {"read": read_rates(args.ckpt), "ops": {}}
        rows["rounds"].append(rnd)
        print(f"read: cat {rnd['read']['cat_cold_gbs']:.2f} GB/s cold, {rnd['read']['cat_gbs']:.2f} GB/s (page "
              f"cache), dd O_DIRECT {rnd['read']['dd_direct_gbs']:.2f} GB/s", flush=True)
        for op, code in OPS.items():
            for label, root in (("old", args.old), ("new", ROOT)):
                if root is None:
                    continue
                out = args.ckpt.parent / label
                if op in WRITES:
                    shutil.rmtree(out / WRITES[op], ignore_errors=True)
                out.mkdir(exist_ok=True)
                load = wait_for_quiet(args.max_load)
                evict(args.ckpt, out)
                r = run(code, args.ckpt, out, root) | {"load": load}
                r["gbs"] = size / r["s"] / 1e9
                rnd["ops"][f"{label}: {op}"] = r
                print(f"{label:4} {op:36} {r['s']:6.2f} s  peak RSS {r['peak_rss_gb']:5.2f} GB  {r['gbs']:5.2f} GB/s "
                      f"(process {r['process_s']:.1f} s, load {load:.2f})", flush=True)
        if args.old is not None:
            for sub in WRITES.values():
                rnd[f"same {sub}"] = same_files(args.ckpt.parent / "old" / sub, args.ckpt.parent / "new" / sub)
                print(f"old and new {sub} conversions write the same files: {rnd[f'same {sub}']}")
    summary(rows, rows["rounds"], size)
    wait_for_quiet(args.max_load)
    evict(args.ckpt)
    r = run(PEER[1], args.ckpt, args.ckpt.parent, ROOT)
    rows[PEER[0]] = r
    print(f"peer {PEER[0]:36} {r['s']:6.2f} s  peak RSS {r['peak_rss_gb']:5.2f} GB  {size / r['s'] / 1e9:5.2f} GB/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
