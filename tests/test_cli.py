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


@pytest.mark.parametrize("cmd", ["convert", "inspect", "generate"])
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


def test_errors_are_one_clear_line(tmp_path):
    r = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()
