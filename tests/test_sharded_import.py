"""Import straight from DeepSeek's FP8/FP4 layout onto a mesh (#13 §2): `jm.load(src, mesh=...)` equals the host
import bit for bit, each device reads only its block of each tensor (byte ranges: pread, nothing mapped) and
dequantises only that, and host memory never holds a whole dequantised tensor (peak RSS of a load in a
subprocess, against a control that reads whole tensors). A model converted with keep_quantized loads onto a mesh
with its FP8/FP4 bytes and scales split like their parameters."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxmodels as jm
from converters import deepseek_quant as dq
from jaxmodels import plan, sharding
from tests.oracles import deepseek_ckpt

MESHES = [("tensor=8", "tp"), ("data=2,tensor=4", "tp"), ("data=2,expert=4", "ep"), ("fsdp=2,tensor=4", "fsdp_tp")]
# the spec's tiny V4.1 (every role, Engram, DSpark MTP; FP8 32x32, MXFP4 experts) with 8 heads in 8 output groups,
# 8 indexer heads and experts 256 wide: every split dimension divides 8 and its FP8/FP4 scale blocks
WIDE = dict(num_attention_heads=8, o_groups=8, index_n_heads=8, moe_intermediate_size=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v41")
    deepseek_ckpt.write_tiny_v41(path, **WIDE)
    return path


@pytest.fixture(scope="module")
def host(ckpt):
    return {k: np.asarray(v) for k, v in plan.flatten(jm.load(ckpt).params).items()}


def _equal_to_host(flat, host, what):
    """Every leaf of `flat` (leaf path -> array) equals the host import's (padding rows zero)."""
    assert flat.keys() == host.keys(), (what, set(flat) ^ set(host))
    for path, want in host.items():
        got = np.asarray(flat[path])
        assert got.dtype == want.dtype, (what, path, got.dtype)
        if got.shape != want.shape:  # an Engram table split along rows the mesh does not divide: zero rows after
            assert path.endswith(("engram/table", "engram/table_scale")), (what, path, got.shape, want.shape)
            pad = tuple(slice(n, None) if n != g else slice(None) for n, g in zip(want.shape, got.shape))
            assert not got[pad].any(), (what, path)
            got = got[tuple(slice(0, n) for n in want.shape)]
        np.testing.assert_array_equal(got, want, err_msg=f"{what}: {path}")


@pytest.mark.parametrize("spec,rules", MESHES)
def test_import_onto_a_mesh_equals_the_host_import(ckpt, host, spec, rules):
    """Backbone, Engram map and DSpark blocks, placed by the rules, each leaf bit-identical to `jm.load(src)`."""
    m = jm.load(ckpt, mesh=sharding.make_mesh(spec), rules=rules)
    _equal_to_host(plan.flatten(m.params), host, spec)
    wq_b = plan.flatten(m.params)["layers/1/attn/wq_b"]
    assert wq_b.sharding.spec == (P(None, None, None) if rules == "ep" else P(None, None, "tensor"))
    table = plan.flatten(m.params)["layers/0/engram/table"]  # 660 rows
    assert table.shape[1] == (664 if spec in ("tensor=8", "fsdp=2,tensor=4") else 660)


def test_import_with_128_blocks(tmp_path):
    """V4's 128x128 FP8 blocks (partial blocks at every edge of these small matrices): blocks widened to whole
    scale blocks decode as the host import does."""
    hf = deepseek_ckpt.tiny_config("v4.1", quantized=True, **{**WIDE, "o_groups": 4})  # wo_a 128 wide: whole blocks
    hf["quantization_config"]["weight_block_size"] = [128, 128]
    deepseek_ckpt.write_checkpoint(str(tmp_path), hf, seed=3)
    deepseek_ckpt.write_word_tokenizer(tmp_path, hf["text_config"]["vocab_size"])
    want = {k: np.asarray(v) for k, v in plan.flatten(jm.load(tmp_path).params).items()}
    m = jm.load(tmp_path, mesh=sharding.make_mesh("fsdp=2,tensor=4"), rules="fsdp_tp")
    _equal_to_host(plan.flatten(m.params), want, "128 blocks")


@pytest.mark.parametrize("spec,rules,n", [("tensor=8", "tp", 8), ("data=2,tensor=4", "tp", 4)])
def test_each_device_reads_only_its_block(ckpt, spec, rules, n, monkeypatch):
    """Every checkpoint tensor is read through byte ranges, in all at most once (replicas share a block), and the
    split ones in pieces of 1/n: wq_b, wo_a, wo_b, the experts (FP4), the shared expert, the Engram table, the
    embedding, the head, the indexer's wq_b, the DSpark blocks'."""
    reads = []
    real = dq.SafetensorsFiles.read

    def spy(self, name, index):
        out = real(self, name, index)
        reads.append((name, out.size, math.prod(self.shape(name))))
        return out

    monkeypatch.setattr(dq.SafetensorsFiles, "read", spy)
    jm.load(ckpt, mesh=sharding.make_mesh(spec), rules=rules)
    header = json.loads((ckpt / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (ckpt / "model.safetensors").read_bytes()[:8], "little")])
    total, largest = {}, {}
    for name, size, full in reads:
        total[name] = total.get(name, 0) + size
        largest[name] = max(largest.get(name, 0), size / full)
    skipped = ("__metadata__", "vision.", ".bias_vl")  # not parameters of the text model
    assert set(total) == {k for k in header if not any(x in k for x in skipped)}
    assert all(total[k] <= math.prod(header[k]["shape"]) for k in total), \
        {k: total[k] / math.prod(header[k]["shape"]) for k in total if total[k] > math.prod(header[k]["shape"])}
    split = ["layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale", "layers.1.attn.wo_a.weight",
             "layers.1.attn.wo_b.weight", "layers.1.ffn.experts.2.w1.weight", "layers.1.ffn.experts.2.w1.scale",
             "layers.1.ffn.experts.2.w2.weight", "layers.1.ffn.shared_experts.w2.weight",
             "layers.1.engram.embed.weight", "layers.1.engram.embed.scale", "embed.weight", "head.weight",
             "layers.1.attn.indexer.wq_b.weight", "mtp.0.attn.wq_b.weight", "mtp.0.ffn.experts.5.w3.weight"]
    assert {k: largest[k] for k in split} == {k: 1 / n for k in split}


def test_read_block_reads_only_the_block(tmp_path):
    """read_block against NumPy slicing, for row blocks (one run), column blocks (short runs through covering
    spans) and 3-D blocks (uneven runs), with the span limit forcing several spans."""
    a = np.random.default_rng(0).standard_normal((37, 5, 29)).astype(np.float32)
    path = tmp_path / "t.bin"
    path.write_bytes(b"x" * 11 + a.tobytes())
    for index in ([(3, 17)], [(0, 37), (1, 4)], [(5, 30), (0, 5), (2, 27)], [(36, 37), (4, 5), (28, 29)],
                  [(0, 37), (0, 5), (0, 29)], [(2, 2)]):
        for span in (dq.SPAN_BYTES, 300):
            dq.SPAN_BYTES, old = span, dq.SPAN_BYTES
            try:
                got = dq.read_block(path, 11, a.shape, np.float32, index)
            finally:
                dq.SPAN_BYTES = old
            np.testing.assert_array_equal(got, a[tuple(slice(*i) for i in index)], err_msg=str((index, span)))


# ------------------------------------------------------------------------------------------------- kept quantized
T, F = "tensor", "fsdp"
KEPT = {  # leaf -> (spec on tensor=8 "tp", on fsdp=2 x tensor=4 "fsdp_tp"), written out from the rules table
    "layers/1/attn/wq_b/fp8": (P(None, T, None), P(None, T, None)),  # [1, H*d, Dq]: heads are its rows
    "layers/1/attn/wq_b/scale": (P(None, T, None), P(None, T, None)),  # 32x32 blocks: 16 rows of them
    "layers/1/attn/wo_b/fp8": (P(None, None, T), P(None, F, T)),  # [1, D, G*Ro]
    "layers/1/mlp/w_gate/fp4": (P(None, None, T, None), P(None, None, T, F)),  # [1, E, I, D/2]
    "layers/1/mlp/w_gate/scale": (P(None, None, T, None), P(None, None, T, F)),  # [1, E, I, D/32]
    "layers/1/mlp/w_down/fp4": (P(None, None, None, T), P(None, None, F, T)),  # [1, E, D, I/2]
    "layers/1/mlp/w_down/scale": (P(None, None, None, T), P(None, None, F, T)),  # [1, E, D, I/32]: 8 -> 1 each
    "layers/0/engram/table": (P(None, T, None), P(None, (F, T), None)),  # FP8 rows, 660 -> 664
    "layers/0/engram/table_scale": (P(None, T, None), P(None, (F, T), None)),
    "mtp/0/attn/wq_b/fp8": (P(T, None), P(T, None)),
}


@pytest.fixture(scope="module")
def kept(ckpt, tmp_path_factory):
    import converters

    return converters.convert(ckpt, tmp_path_factory.mktemp("kept") / "m", dtype="float32", keep_quantized=True,
                              progress=False)


@pytest.mark.parametrize("spec,rules,which", [("tensor=8", "tp", 0), ("fsdp=2,tensor=4", "fsdp_tp", 1)])
def test_kept_quantized_weights_are_placed_like_their_parameters(kept, spec, rules, which):
    """A model converted with keep_quantized and loaded onto a mesh: FP8 bytes and their block scales, FP4 experts
    and their per-32 scales, the Engram table's rows and scales, the DSpark blocks' weights are split as their
    parameters are (each device's bytes and scales the same blocks), every byte equal to the unsharded load."""
    host = {k: np.asarray(v) for k, v in plan.flatten(jm.load(kept).params).items()}
    mesh = sharding.make_mesh(spec)
    placed = plan.flatten(jm.load(kept, mesh=mesh, rules=rules).params)
    _equal_to_host(placed, host, spec)
    for path, specs in KEPT.items():
        a = placed[path]
        assert a.sharding.spec == specs[which], (path, a.sharding.spec)
        split = [math.prod(mesh.shape[x] for x in ((p,) if isinstance(p, str) else p)) if p else 1
                 for p in specs[which]]
        assert {s.data.shape for s in a.addressable_shards} == {tuple(n // k for n, k in zip(a.shape, split))}
    assert placed["layers/0/engram/table"].shape[1] == placed["layers/0/engram/table_scale"].shape[1] == 664


@pytest.mark.slow
def test_kept_quantized_on_a_mesh_runs_like_one_device(kept):
    """Slow (two compiles, about 80 s on 2 CPU cores): the kept-quantized V4.1 (FP8 linears and FP4 experts
    expanded inside the matmuls, FP8 Engram rows after the gather) split over fsdp=2 x tensor=4 gives the logits
    of the unsharded load."""
    ids = np.random.default_rng(0).integers(0, 512, (2, 20))
    want = np.asarray(jm.forward(jm.load(kept), ids))
    got = np.asarray(jm.forward(jm.load(kept, mesh=sharding.make_mesh("fsdp=2,tensor=4"), rules="fsdp_tp"), ids))
    assert np.abs(got - want).max() <= 1e-5


# ------------------------------------------------------------------------------------------------- host memory
RSS_WORKER = r"""
import gc, json, os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
import jaxmodels as jm
from converters import deepseek
from jaxmodels import sharding


def status(key):  # VmRSS / VmHWM (its peak) in bytes; ru_maxrss would start from the parent's peak
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


def load():
    try:
        with open("/proc/self/clear_refs", "w") as f:  # the peak restarts from the current RSS
            f.write("5")
    except OSError:
        print(json.dumps({"skip": "cannot reset the peak RSS (/proc/self/clear_refs)"}))
        sys.exit(0)
    before, t0 = status("VmRSS"), time.time()
    m = jm.load(sys.argv[1], mesh=sharding.make_mesh("tensor=8"))
    jax.block_until_ready(m.params)
    placed = sum(s.data.nbytes for a in jax.tree.leaves(m.params) for s in a.addressable_shards)
    out = {"seconds": time.time() - t0, "before": before, "after": status("VmRSS"), "peak": status("VmHWM"),
           "placed": placed}
    del m
    gc.collect()
    return out


sliced = load()
deepseek.QuantReader.get_slice = lambda self, name, index: self.get(name)[index]  # the control: whole tensors
print(json.dumps({"sliced": sliced, "whole": load()}))
"""


def test_peak_host_memory_of_a_wide_import(tmp_path, monkeypatch):
    """A tiny-but-wide V4.1 (one Engram table of 498,204 rows x 64: 32 MB of FP8, 128 MB dequantised; the other
    tensors a few MB at most) loaded onto tensor=8 in a fresh process: the peak RSS above what the placed params
    leave resident stays under a quarter of the largest dequantised tensor, where the control (each device's
    block cut from the whole dequantised tensor, as the import did before #13 §2) passes a whole one."""
    rng = np.random.default_rng(0)

    def random_rows(w, block=32):  # the oracle's encoder, 30x faster: random e4m3 codes (no NaN), scales 2^-8..2^-4
        codes = rng.integers(0, 0x7F, w.shape, dtype=np.uint8) | (rng.integers(0, 2, w.shape, np.uint8) << 7)
        return codes.view(dq.E4M3), rng.integers(119, 124, (w.shape[0], w.shape[1] // block), dtype=np.uint8)

    monkeypatch.setattr(deepseek_ckpt, "quantize_fp8_rows", random_rows)
    hf = deepseek_ckpt.tiny_config("v4.1", quantized=True, **WIDE, engram_layer_ids=[1], engram_vocab_size=83_000,
                                   engram_head_dim=64)
    deepseek_ckpt.write_checkpoint(str(tmp_path), hf, seed=0)
    deepseek_ckpt.write_word_tokenizer(tmp_path, hf["text_config"]["vocab_size"])
    largest = hf["text_config"]["engram_num_embeddings"][0] * 64 * 4  # the table, dequantised to float32
    out = subprocess.run([sys.executable, "-c", RSS_WORKER, str(tmp_path)], capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, timeout=600,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in r:
        pytest.skip(r["skip"])
    sliced, whole = r["sliced"], r["whole"]
    print(f"\nlargest tensor {largest / 1e6:.0f} MB (fp32), placed {sliced['placed'] / 1e6:.0f} MB; per block: "
          f"RSS {sliced['before'] / 1e6:.0f} -> peak {sliced['peak'] / 1e6:.0f} -> {sliced['after'] / 1e6:.0f} MB; "
          f"whole tensors: {whole['before'] / 1e6:.0f} -> peak {whole['peak'] / 1e6:.0f} -> "
          f"{whole['after'] / 1e6:.0f} MB")
    for m in (sliced, whole):
        assert m["after"] - m["before"] > m["placed"] / 2  # the params are resident: the peak is the load's
    assert sliced["peak"] - sliced["after"] < largest / 4, sliced
    assert whole["peak"] - whole["after"] > largest, whole
