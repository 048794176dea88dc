"""The conversion progress bar (issue #18 item 6): bytes of the source read / total and the GB/s rate, on stderr;
drawn on a terminal, silent into a pipe or a log, and as --progress / --no-progress say."""
from __future__ import annotations

import re
import struct
import sys

import gguf
import pytest
from tqdm import tqdm

import converters
from converters.gguf_io import GGUFFile
from jaxmodels import cli
from tests.parity.hf_reference import build, tiny_config


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    build(tiny_config("llama")).save_pretrained(d)
    return d


@pytest.fixture
def bars(monkeypatch):
    """The (n, total) of each byte bar a conversion closes."""
    seen = []

    class Recorder(converters.ByteBar):
        def close(self):
            if not getattr(self, "_seen", False):
                self._seen = True
                seen.append((self.n, self.total))
            super().close()

    monkeypatch.setattr(converters, "ByteBar", Recorder)
    return seen


def _safetensors_data_bytes(path) -> int:
    with open(path, "rb") as f:
        (header,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - header


def test_bar_counts_every_source_byte_safetensors(hf_dir, tmp_path, bars):
    converters.convert(hf_dir, tmp_path / "out", dtype="float32", progress=True)
    assert bars == [(_safetensors_data_bytes(hf_dir / "model.safetensors"),) * 2]


def test_bar_counts_every_source_byte_gguf(tmp_path, bars):
    """A quantized GGUF with stacked experts (read one expert at a time): the total is the file's tensor bytes as
    stored (quantized), each counted once."""
    from tests.test_gguf_archs import MODELS, Q8_0, _bpe_tokenizer, write_gguf

    cfg, arch, kind, _ = MODELS["qwen3_moe"]
    d = tmp_path / "moe"
    d.mkdir()
    build({**cfg, "vocab_size": len(_bpe_tokenizer(d)), "moe_intermediate_size": 64}).save_pretrained(d)
    path = write_gguf(d, tmp_path / "moe.gguf", arch, Q8_0, kind)
    stored = sum(t.data.nbytes for t in GGUFFile(path).tensors)
    assert any(t.tensor_type == gguf.GGMLQuantizationType.Q8_0 for t in GGUFFile(path).tensors)
    converters.convert(path, tmp_path / "out", dtype="float32", progress=True)
    assert bars == [(stored, stored)]


def _convert_cli(args, capsys, monkeypatch, tty: bool) -> str:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert cli.main(["convert", *map(str, args)]) == 0
    return capsys.readouterr().err


def test_cli_bar_shows_bytes_and_gb_per_s_on_stderr_of_a_terminal(hf_dir, tmp_path, capsys, monkeypatch):
    total = _safetensors_data_bytes(hf_dir / "model.safetensors")
    err = _convert_cli([hf_dir, tmp_path / "out"], capsys, monkeypatch, tty=True)
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    size = tqdm.format_sizeof(total, divisor=1000) + "B"
    assert re.fullmatch(rf"convert: 100%\|.*\| {re.escape(size)}/{re.escape(size)} \[.*, [0-9.e+-]+ GB/s\]", last), last


@pytest.mark.parametrize("tty,flag", [(False, None), (True, "--no-progress")])
def test_cli_bar_is_silent_in_a_pipe_or_when_asked(hf_dir, tmp_path, capsys, monkeypatch, tty, flag):
    err = _convert_cli([hf_dir, tmp_path / "out", *([flag] if flag else [])], capsys, monkeypatch, tty=tty)
    assert err == ""


def test_cli_progress_forces_the_bar_into_a_pipe(hf_dir, tmp_path, capsys, monkeypatch):
    err = _convert_cli([hf_dir, tmp_path / "out", "--progress"], capsys, monkeypatch, tty=False)
    assert "GB/s]" in err and "convert: 100%" in err
