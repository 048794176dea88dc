"""The `jaxmodels` command end to end on a tiny HF checkpoint with a tokenizer."""
import json
import subprocess
import sys

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from jaxmodels import cli
from tests.parity import hf_reference as ref


def run(*args):
    return subprocess.run([sys.executable, "-m", "jaxmodels.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli") / "hf"
    ref.build(ref.tiny_config("qwen3")).save_pretrained(d)
    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(254)]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d


@pytest.mark.parametrize("cmd", ["convert", "inspect", "generate", "serve"])
def test_help(cmd):
    r = run(cmd, "--help")
    assert r.returncode == 0 and "usage: jaxmodels " + cmd in r.stdout


def test_convert_inspect_generate(hf_dir, tmp_path):
    dst = tmp_path / "out"
    r = run("convert", str(hf_dir), str(dst), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert (dst / "jaxmodels.json").exists() and (dst / "tokenizer.json").exists()
    info = cli.describe(dst)
    assert (info["family"], info["layers"], info["dtype"]) == ("qwen3", 3, "float32")
    assert [k["attention"] for k in info["kinds"]] == ["full causal", "sliding W=6"]
    assert info["kinds"][0]["layers"] == [0, 2] and info["bytes"] == 4 * info["parameters"]
    r = run("inspect", str(dst))
    assert r.returncode == 0 and "sliding W=6" in r.stdout and "qwen3" in r.stdout
    r = run("generate", "--model", str(dst), "--prompt", "w5 w6 w7", "--no-chat", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "> w5 w6 w7" and all(w.startswith("w") for w in lines[1].split())
    assert "tokens/s" in r.stderr
    r = run("convert", str(hf_dir), str(dst))  # exists, no --force
    assert r.returncode == 2 and "already exists" in r.stderr
    before = sorted(p.name for p in hf_dir.iterdir())
    r = run("convert", str(hf_dir), str(hf_dir), "--force")  # the source itself: refused, untouched
    assert r.returncode == 2 and "contains the source" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in hf_dir.iterdir()) == before


def test_errors_are_one_clear_line(tmp_path, hf_dir):
    r = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
    r = run("generate", "--model", str(hf_dir), "--prompt", "w5", "--keep-quantized")  # nothing quantized in it
    assert r.returncode == 2 and "holds no quantized tensors" in r.stderr and "Traceback" not in r.stderr


def test_repo_ids_come_from_the_local_hub_cache(hf_dir, tmp_path, monkeypatch):
    """`jaxmodels convert ORG/NAME` and jm.load(ORG/NAME[@rev]) read the local Hugging Face cache's snapshot
    (files linked to ../../blobs, as huggingface_hub lays it out); a repo id not cached is one clear line."""
    import numpy as np

    import jaxmodels as jm

    cache, rev = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--acme--tiny-qwen3"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for f in hf_dir.iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/{f.name}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ids = np.array([[5, 6, 7, 8]], np.int32)
    want = np.asarray(jm.forward(jm.load(hf_dir), ids))
    for name in ("acme/tiny-qwen3", f"acme/tiny-qwen3@{rev}", "acme/tiny-qwen3@main"):
        assert np.array_equal(np.asarray(jm.forward(jm.load(name), ids)), want)
    r = subprocess.run([sys.executable, "-m", "jaxmodels.cli", "convert", "acme/tiny-qwen3", str(tmp_path / "out"),
                        "--dtype", "float32"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert np.array_equal(np.asarray(jm.forward(jm.load(tmp_path / "out"), ids)), want)
    # downloaded in part (`hf download --include`): the hub's own file list names a file this snapshot lacks
    (repo / "trees").mkdir()
    (repo / "trees" / f"{rev}.json").write_text(json.dumps([{"path": "original/consolidated.00.pth", "size": 1}]))
    assert np.array_equal(np.asarray(jm.forward(jm.load("acme/tiny-qwen3"), ids)), want)
    for missing in ("acme/absent", "acme/tiny-qwen3@no-such-revision"):
        r = subprocess.run([sys.executable, "-m", "jaxmodels.cli", "inspect", missing], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "not in the local Hugging Face cache" in r.stderr and str(cache) in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
