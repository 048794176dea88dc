"""Bad checkpoints and bad requests fail with an error that names the problem, and leave nothing behind.

DESIGN §1.9: a missing or extra tensor, a wrong shape, an unknown architecture, a truncated file, an
over-long prompt raise a clear error naming the tensor/field/limit; a failed conversion leaves neither
the destination nor its temporary `.<name>.*.partial` sibling. The formats the importer accepts beside
a single safetensors file (a sharded index, a PyTorch `.bin` state dict) give the same model.
"""
import dataclasses
import json
import re
import shutil

import numpy as np
import pytest
import safetensors.torch
import torch

import converters
import jaxmodels as jm
from jaxmodels.config import ModelConfig
from tests.parity import hf_reference as ref

ATOL = 1e-4  # fp32 parity bound of the parity harness


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF model, a pristine single-file safetensors directory of it)."""
    hf = ref.build(ref.tiny_config("llama"))
    src = tmp_path_factory.mktemp("tiny") / "hf"
    hf.save_pretrained(src)
    assert (src / "model.safetensors").exists() and not (src / "model.safetensors.index.json").exists()
    return hf, src


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """Logits of our model converted from the pristine single-file checkpoint, on fixed token ids."""
    hf, src = tiny
    dst = converters.convert(src, tmp_path_factory.mktemp("single") / "out", dtype="float32", progress=False)
    ids = np.random.default_rng(0).integers(0, 256, (2, 24)).astype(np.int32)
    got = np.asarray(jm.forward(jm.load(dst), ids))
    np.testing.assert_allclose(got, ref.logits(hf, ids), atol=ATOL, rtol=0)  # the baseline itself is right
    return ids, got


@pytest.fixture
def src(tiny, tmp_path):
    """A private, mutable copy of the tiny checkpoint."""
    return shutil.copytree(tiny[1], tmp_path / "src")


def _rewrite(path, edit):
    """Load a safetensors file, let `edit` change the dict, and save it back (as transformers does)."""
    tensors = safetensors.torch.load_file(path)
    edit(tensors)
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})


def _leftovers(dst):
    return sorted(p.name for p in dst.parent.glob(f".{dst.name}.*.partial"))


def _assert_fails_cleanly(src, dst, exc, *patterns):
    """convert(src, dst) raises `exc` whose message matches every regex; nothing is left at or beside dst."""
    with pytest.raises(exc) as info:
        converters.convert(src, dst, dtype="float32", progress=False)
    msg = str(info.value)
    for pat in patterns:
        assert re.search(pat, msg), f"error message {msg!r} does not match {pat!r}"
    assert not dst.exists(), f"a failed conversion left {dst}"
    assert _leftovers(dst) == [], f"a failed conversion left temporary dirs {_leftovers(dst)}"
    return msg


# ------------------------------------------------------------------------------------------ bad checkpoints
def _assert_missing_named(src, dst, *patterns):
    _assert_fails_cleanly(src, dst, converters.CheckpointError, r"(?i)missing", *patterns)


def test_missing_tensor_is_named(src, tmp_path):
    _rewrite(src / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _assert_missing_named(src, tmp_path / "out", r"model\.layers\.1\.mlp\.up_proj\.weight", r"layer 1: mlp/w_up")


def test_missing_expert_is_named(tmp_path):
    """One expert's tensor of a MoE layer: the message names that expert, under the per-expert checkpoint name."""
    src = tmp_path / "moe"
    ref.build(ref.tiny_config("qwen3_moe")).save_pretrained(src)
    _rewrite(src / "model.safetensors", lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    _assert_missing_named(src, tmp_path / "out", r"missing 1 tensors", r"model\.layers\.2\.mlp\.experts\.5\.up_proj",
                          r"layer 2: mlp/w_up, expert 5")


def test_missing_non_layer_tensor_is_named(src, tmp_path):
    _rewrite(src / "model.safetensors", lambda t: t.pop("model.norm.weight"))
    _assert_missing_named(src, tmp_path / "out", r"norm")


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.extra_proj.weight",  # unknown parameter
                                   "model.layers.2.mlp.up_proj.weight"])  # a layer the config does not have
def test_unexpected_tensor_is_named(src, tmp_path, extra):
    _rewrite(src / "model.safetensors", lambda t: t.__setitem__(extra, torch.zeros(128, 64)))
    _assert_fails_cleanly(src, tmp_path / "out", converters.CheckpointError, r"(?i)unexpected", re.escape(extra))


def test_wrong_shape_names_tensor_and_both_shapes(src, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"  # [kv_heads * head_dim, hidden] = [32, 64]

    def edit(t):
        t[name] = torch.zeros(33, 64)

    _rewrite(src / "model.safetensors", edit)
    _assert_fails_cleanly(src, tmp_path / "out", converters.CheckpointError,
                          re.escape(name), r"\(33, 64\)", r"\(32, 64\)")


def test_unknown_architecture(src, tmp_path):
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "notamodel"
    (src / "config.json").write_text(json.dumps(cfg))
    _assert_fails_cleanly(src, tmp_path / "out", ValueError, r"(?i)unknown architecture", r"notamodel")


def test_truncated_safetensors_file(src, tmp_path):
    f = src / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    _assert_fails_cleanly(src, tmp_path / "out", converters.CheckpointError,
                          r"(?i)truncated", re.escape("model.safetensors"))


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no" / "such" / "checkpoint"
    msg = _assert_fails_cleanly(missing, tmp_path / "out", FileNotFoundError)
    assert str(missing) in msg
    with pytest.raises(FileNotFoundError):
        jm.load(missing)


def test_failure_while_writing_leaves_nothing(src, tmp_path, monkeypatch):
    """A failure after the parameters are already written into the temporary directory."""
    def boom(self):
        raise RuntimeError("injected failure while writing the config")

    monkeypatch.setattr(ModelConfig, "to_dict", boom)
    _assert_fails_cleanly(src, tmp_path / "out", RuntimeError, "injected failure")


# ---------------------------------------------------------------------------------- other source formats
def test_sharded_checkpoint_matches_single_file(tiny, reference, tmp_path):
    hf, _ = tiny
    src = tmp_path / "sharded"
    hf.save_pretrained(src, max_shard_size="20KB")
    shards = sorted(src.glob("*.safetensors"))
    assert (src / "model.safetensors.index.json").exists() and len(shards) > 1, "not actually sharded"
    ids, want = reference
    got = np.asarray(jm.forward(jm.load(converters.convert(src, tmp_path / "out", dtype="float32",
                                                           progress=False)), ids))
    np.testing.assert_array_equal(got, want)


def test_sharded_checkpoint_with_missing_shard(tiny, tmp_path):
    hf, _ = tiny
    src = tmp_path / "sharded"
    hf.save_pretrained(src, max_shard_size="20KB")
    victim = sorted(src.glob("*.safetensors"))[-1]
    victim.unlink()
    _assert_fails_cleanly(src, tmp_path / "out", converters.CheckpointError, re.escape(victim.name))


def test_pytorch_bin_matches_single_file(tiny, reference, tmp_path):
    hf, _ = tiny
    src = tmp_path / "bin"
    src.mkdir()
    hf.config.to_json_file(src / "config.json")
    torch.save(hf.state_dict(), src / "pytorch_model.bin")
    assert not list(src.glob("*.safetensors"))
    ids, want = reference
    got = np.asarray(jm.forward(jm.load(converters.convert(src, tmp_path / "out", dtype="float32",
                                                           progress=False)), ids))
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------------------- destination
def test_existing_destination_needs_overwrite(src, reference, tmp_path):
    """An existing destination is refused without overwrite, and with it unless it is our own converted output
    (or empty): a user's directory keeps its files either way. overwrite replaces an earlier conversion."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("user data")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=re.escape(str(dst))):
            converters.convert(src, dst, dtype="float32", progress=False, overwrite=overwrite)
        assert sorted(p.name for p in dst.iterdir()) == ["keep.txt"], "a refused conversion touched dst"
        assert (dst / "keep.txt").read_text() == "user data"
    assert _leftovers(dst) == []
    (dst / "keep.txt").unlink()  # an empty directory may be replaced
    converters.convert(src, dst, dtype="float32", progress=False, overwrite=True)
    out = converters.convert(src, dst, dtype="float32", progress=False, overwrite=True)  # over our own output
    assert out == dst.absolute() and (dst / "jaxmodels.json").exists()
    assert [p.name for p in dst.parent.iterdir() if p.name.startswith(".")] == [], "something was left aside"
    ids, want = reference
    np.testing.assert_array_equal(np.asarray(jm.forward(jm.load(dst), ids)), want)


def test_the_source_or_a_directory_holding_it_is_never_a_destination(src, tmp_path):
    before = sorted(p.name for p in src.iterdir())
    for dst in (src, src.parent, tmp_path / "link"):
        if dst.name == "link":
            dst.symlink_to(src)
        with pytest.raises(ValueError, match="is or contains the source"):
            converters.convert(src, dst, dtype="float32", progress=False, overwrite=True)
    assert sorted(p.name for p in src.iterdir()) == before


def test_destination_is_checked_before_the_import(src, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "x").write_text("x")
    monkeypatch.setattr(converters, "open_source", lambda *a, **k: pytest.fail("opened before checking dst"))
    with pytest.raises(FileExistsError):
        converters.convert(src, dst, dtype="float32", progress=False)


@pytest.mark.parametrize("when", ["import", "write"])
def test_a_destination_that_appears_meanwhile_is_left_alone(src, tmp_path, monkeypatch, when):
    """Two conversions to one destination: the first to finish wins, the other fails without touching it — caught
    when its import ends, or at the final rename if the other finished while this one was writing."""
    from converters import orbax_io

    dst = tmp_path / "out"
    module, name = (converters, "open_source") if when == "import" else (orbax_io, "remove_stale")
    real = getattr(module, name)

    def racing(*a, **k):  # another conversion to dst finishes meanwhile
        out = real(*a, **k)
        monkeypatch.setattr(module, name, real)
        converters.convert(src, dst, dtype="float32", progress=False)
        (dst / "theirs").write_text("the winner's output")
        return out

    monkeypatch.setattr(module, name, racing)
    with pytest.raises(FileExistsError, match="already exists" if when == "import" else "appeared while converting"):
        converters.convert(src, dst, dtype="float32", progress=False)
    assert (dst / "theirs").read_text() == "the winner's output" and (dst / "jaxmodels.json").exists()
    assert _leftovers(dst) == []


def test_temporaries_of_dead_conversions_are_removed(src, tmp_path):
    import subprocess
    import socket

    dst = tmp_path / "out"
    child = subprocess.Popen(["true"])
    child.wait()  # a finished, reaped child: its pid names no process
    stale, live, foreign = (tmp_path / f".out.{n}.partial" for n in ("a", "b", "c"))
    for d, owner in ((stale, f"{socket.gethostname()} {child.pid}"), (live, f"{socket.gethostname()} 1"),
                     (foreign, None)):
        d.mkdir()
        (d / "params").write_text("half written")
        if owner:
            (d / "owner").write_text(owner)
    converters.convert(src, dst, dtype="float32", progress=False)
    assert not stale.exists() and live.exists() and foreign.exists()  # pid 1 runs; no owner: not ours to judge


def test_output_follows_the_umask(src, tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        dst = converters.convert(src, tmp_path / "out", dtype="float32", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o755


# --------------------------------------------------------------------------------------------- generate
def test_overlong_prompt_names_max_position_embeddings(tiny, src):
    hf, _ = tiny
    model = jm.load(src)
    limit = 32
    model = jm.Model(dataclasses.replace(model.config, max_position_embeddings=limit), model.params, None)
    prompt = list(np.random.default_rng(1).integers(0, 256, limit - 8 + 1))
    with pytest.raises(ValueError, match=r"max_position_embeddings") as info:
        jm.generate(model, [prompt], max_new_tokens=8, ignore_eos=True)
    assert str(limit) in str(info.value) and "8" in str(info.value)
    # exactly at the limit is allowed, and is what HF produces
    out = jm.generate(model, [prompt[1:]], max_new_tokens=8, ignore_eos=True)
    assert np.array_equal(np.asarray(out.tokens), ref.greedy(hf, np.asarray([prompt[1:]]), 8))
