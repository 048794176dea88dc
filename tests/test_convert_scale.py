"""Conversion at checkpoint scale (issue #18): a synthetic checkpoint several times larger than the memory the
conversion may take is converted in a subprocess whose peak RSS (VmHWM, /proc) is measured. Holding the model in
RAM (the old import-then-save) exceeds the limit by far; streaming stays at a few tensors."""
import json
import math
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parents[1]
BF16 = ml_dtypes.bfloat16

CHILD = """
import json, sys
import converters

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

before = status("VmRSS")
converters.convert(sys.argv[1], sys.argv[2], dtype="bfloat16", progress=False)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def _tensors(family: str, layers: int, d: int, inter: int, vocab: int, experts: int) -> dict[str, tuple]:
    """name -> shape of a Llama-shaped (or Qwen3-MoE-shaped, one tensor per expert) HF checkpoint."""
    out = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + n: s for n, s in (("self_attn.q_proj.weight", (d, d)), ("self_attn.k_proj.weight", (d, d)),
                                       ("self_attn.v_proj.weight", (d, d)), ("self_attn.o_proj.weight", (d, d)),
                                       ("input_layernorm.weight", (d,)), ("post_attention_layernorm.weight", (d,)))}
        if family == "qwen3_moe":
            out |= {p + "self_attn.q_norm.weight": (d // 8,), p + "self_attn.k_norm.weight": (d // 8,),
                    p + "mlp.gate.weight": (experts, d)}
            out |= {f"{p}mlp.experts.{e}.{n}": s for e in range(experts)
                    for n, s in (("gate_proj.weight", (inter, d)), ("up_proj.weight", (inter, d)),
                                 ("down_proj.weight", (d, inter)))}
        else:
            out |= {p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
                    p + "mlp.down_proj.weight": (d, inter)}
    return out


def write_checkpoint(root: Path, family: str, layers: int, d: int, inter: int, vocab: int, experts: int = 0,
                     shards: int = 3) -> tuple[int, int]:
    """A bf16 safetensors checkpoint in `shards` files with an index; (total bytes, largest tensor bytes)."""
    root.mkdir(parents=True)
    cfg = {"model_type": family, "vocab_size": vocab, "hidden_size": d, "intermediate_size": inter,
           "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": d // 8,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if family == "qwen3_moe":
        cfg |= {"moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": 2,
                "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    (root / "config.json").write_text(json.dumps(cfg))
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(BF16)  # finite, cheap to tile
    shapes = _tensors(family, layers, d, inter, vocab, experts)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    names, weight_map, done = list(shapes), {}, 0
    for k in range(shards):
        file, chunk = f"model-{k + 1:05d}-of-{shards:05d}.safetensors", {}
        while names and (done < total * (k + 1) / shards or k == shards - 1):
            name = names.pop(0)
            n = math.prod(shapes[name])
            chunk[name] = (np.ones(n, BF16) if name.endswith("norm.weight") else
                           block[:n].copy() if n <= block.size else np.resize(block, n)).reshape(shapes[name])
            done += chunk[name].nbytes
            weight_map[name] = file
        save_file(chunk, str(root / file))
        del chunk
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total, max(math.prod(s) * 2 for s in shapes.values())


def convert_in_child(src: Path, dst: Path, code_root: Path = ROOT) -> dict:
    """Run converters.convert (bf16) in a fresh interpreter importing the code under `code_root`: its RSS before
    the conversion and its peak."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], cwd=code_root, capture_output=True,
                         text=True, timeout=600, env={"PYTHONPATH": str(code_root), "JAX_PLATFORMS": "cpu",
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CASES = {  # ~300 MB each; the largest tensors are 1-2 MB
    "llama": dict(family="llama", layers=48, d=512, inter=1536, vocab=1024),
    "qwen3_moe experts": dict(family="qwen3_moe", layers=12, d=256, inter=256, vocab=1024, experts=64),
}


@pytest.mark.parametrize("case", CASES)
def test_conversion_memory_stays_bounded_whatever_the_model_size(tmp_path, case):
    total, largest = write_checkpoint(tmp_path / "src", **CASES[case])
    limit = total // 3  # the model is 3x what the conversion may add to the process
    got = convert_in_child(tmp_path / "src", tmp_path / "out")
    grew = got["peak"] - got["before"]
    assert grew < limit, f"conversion added {grew / 1e6:.0f} MB of RSS for a {total / 1e6:.0f} MB model"
    assert grew < 2 * largest + (64 << 20), f"{grew / 1e6:.0f} MB, largest tensor {largest / 1e6:.1f} MB"

    # what was written is the checkpoint, slice for slice: one stacked layer, transposed
    from jaxmodels import checkpoint

    layer = CASES[case]["layers"] - 1
    name, leaf = ((f"model.layers.{layer}.mlp.up_proj.weight", "layers/0/mlp/w_up") if case == "llama" else
                  (f"model.layers.{layer}.mlp.experts.63.up_proj.weight", "layers/0/mlp/w_up"))
    src = next(f for f in (tmp_path / "src").glob("*.safetensors") if name in safe_open(str(f), "np").keys())
    file, shape, dtype, offset = checkpoint.stored_leaves(tmp_path / "out" / "params")[leaf]
    stored = np.memmap(file, dtype, "r", offset, shape)
    np.testing.assert_array_equal(stored[layer] if case == "llama" else stored[layer, 63],
                                  safe_open(str(src), "np").get_tensor(name).T)
    checkpoint.verify_files(tmp_path / "out")


READ = """
import json, sys
import numpy as np
import converters

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

before = status("VmRSS")
cfg, params, _ = converters.read_source(sys.argv[1], dtype="bfloat16", progress=False)
from jaxmodels.plan import flatten
print(json.dumps({"before": before, "peak": status("VmHWM"),
                  "dtypes": sorted({str(a.dtype) for a in flatten(params).values()})}))
"""


LARGE = dict(family="llama", layers=2, d=1024, inter=2816, vocab=32768)  # embed and lm_head: 64 MB each, 2/3 of it


@pytest.mark.parametrize("shape", ["small tensors", "large tensors"])
def test_a_bf16_import_never_holds_float32_copies(tmp_path, shape):
    """`jm.load(hf_dir, dtype="bfloat16")` imports through read_source: the params are built in bf16 in place, so
    the import adds the model's bytes and about two tensors (the one placed, the one read ahead), not a float32
    model (2x) on the way, nor a third large tensor (a value kept past its placement, a read past the budget)."""
    total, largest = write_checkpoint(tmp_path / "src", **(CASES["llama"] if shape == "small tensors" else LARGE))
    out = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "src")], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
                                                      "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["dtypes"] == ["bfloat16"]
    assert got["peak"] - got["before"] < total + 2 * largest + (32 << 20), (got, total)


def test_gguf_params_do_not_alias_the_source_file():
    """Imported arrays are ours: a parameter left as a view of the GGUF's read-only map would change (or fault)
    when the file does."""
    import converters
    from jaxmodels.assets import default_gguf
    from jaxmodels.plan import flatten

    _, params, _ = converters.read_source(default_gguf(), "float32")
    shared = [p for p, a in flatten(params).items() if not a.flags.writeable]
    assert not shared, shared
