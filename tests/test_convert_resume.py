"""An interrupted conversion resumes (issue #18): the slices it had written are verified by their CRC32 and kept,
the rest converted; the result is the same as an uninterrupted run, and nothing appears at the destination
before the end."""
import json
import os
import signal
import subprocess
import sys

import pytest

import converters
from converters import orbax_io
from tests.test_convert_scale import ROOT, write_checkpoint

KILLED_AFTER = """
import os, signal, sys
import converters
from converters import orbax_io

real, count = orbax_io._put, [0]

def put(*a):
    out = real(*a)
    count[0] += 1
    if count[0] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)  # as a crash or the OOM killer would: no cleanup runs
    return out

orbax_io._put = put
converters.convert(sys.argv[1], sys.argv[2], dtype=sys.argv[4], progress=False)
"""


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt") / "src"
    write_checkpoint(root, "llama", layers=6, d=64, inter=128, vocab=256)
    return root


def _killed(src, dst, after: int, dtype: str = "bfloat16"):
    out = subprocess.run([sys.executable, "-c", KILLED_AFTER, str(src), str(dst), str(after), dtype], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert not dst.exists()  # atomic: nothing at the destination
    (partial,) = dst.parent.glob(f".{dst.name}.*.partial")
    return partial


def _counting(monkeypatch):
    calls = []
    real = orbax_io._put
    monkeypatch.setattr(orbax_io, "_put", lambda *a: calls.append(a[1].leaf) or real(*a))
    return calls


def _interrupting(monkeypatch, when):
    """orbax_io._put raising KeyboardInterrupt (a Ctrl-C) at the slice for which when(n, part) holds (n counts
    calls from 1); returns the real _put."""
    real, n = orbax_io._put, [0]

    def put(*a):
        n[0] += 1
        if when(n[0], a[1]):
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(orbax_io, "_put", put)
    return real


@pytest.fixture(scope="module")
def fresh(src, tmp_path_factory):
    dst = converters.convert(src, tmp_path_factory.mktemp("fresh") / "out", progress=False)
    return json.loads((dst / "jaxmodels.json").read_text())["files"]


def test_a_killed_conversion_resumes_where_it_stopped(src, fresh, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    partial = _killed(src, dst, after=30)
    journaled = len((partial / orbax_io.JOURNAL).read_text().splitlines())
    assert journaled == 29  # the 30th slice was written, not yet journaled: it is converted again
    calls = _counting(monkeypatch)
    converters.convert(src, dst, progress=False)
    assert len(calls) == _total(src) - journaled
    assert json.loads((dst / "jaxmodels.json").read_text())["files"] == fresh  # byte for byte the same output
    assert not list(tmp_path.glob(".out.*"))


def test_a_damaged_slice_is_converted_again(src, fresh, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    partial = _killed(src, dst, after=30)
    (path, index), [(leaf, shape, dtype, offset, nbytes, crc)] = json.loads(
        (partial / orbax_io.JOURNAL).read_text().splitlines()[5])
    with open(partial / "params" / (leaf + ".safetensors"), "r+b") as f:  # a flipped byte inside that slice
        f.seek(offset + nbytes // 2)
        b = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    calls = _counting(monkeypatch)
    converters.convert(src, dst, progress=False)
    assert len(calls) == _total(src) - 28 and leaf in calls
    assert json.loads((dst / "jaxmodels.json").read_text())["files"] == fresh


def test_another_job_starts_over(src, tmp_path, monkeypatch):
    """Other options (here the dtype) or a changed source: the interrupted temporary is not reused but removed."""
    dst = tmp_path / "out"
    _killed(src, dst, after=30, dtype="float32")
    calls = _counting(monkeypatch)
    converters.convert(src, dst, dtype="bfloat16", progress=False)
    assert len(calls) == _total(src)
    assert not list(tmp_path.glob(".out.*"))


def test_ctrl_c_keeps_the_partial_for_the_same_process_and_errors_remove_it(src, fresh, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    real = _interrupting(monkeypatch, lambda n, part: n == 10)
    with pytest.raises(KeyboardInterrupt):
        converters.convert(src, dst, progress=False)
    assert len(list(tmp_path.glob(".out.*.partial"))) == 1 and not dst.exists()
    monkeypatch.setattr(orbax_io, "_put", real)
    calls = _counting(monkeypatch)
    converters.convert(src, dst, progress=False)  # the same (still running) process resumes it
    assert len(calls) == _total(src) - 9
    assert json.loads((dst / "jaxmodels.json").read_text())["files"] == fresh

    def failing(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(orbax_io, "_put", failing)
    with pytest.raises(OSError):
        converters.convert(src, tmp_path / "again", progress=False)
    assert not list(tmp_path.glob(".again.*"))


def _total(src) -> int:
    cfg, reader, fam, tok = converters.open_source(src)
    return sum(len(parts) for _, parts in converters.source_items(cfg, reader, fam, tok, "bfloat16")())


def test_the_journal_survives_a_torn_last_line(src, fresh, tmp_path):
    dst = tmp_path / "out"
    partial = _killed(src, dst, after=12)
    with open(partial / orbax_io.JOURNAL, "a") as f:
        f.write('[["layers/0/attn/wq", [3]], [["layers/0/at')  # killed while writing a line
    converters.convert(src, dst, progress=False)
    assert json.loads((dst / "jaxmodels.json").read_text())["files"] == fresh
    assert os.listdir(tmp_path) == ["out"]  # the resumed temporary became the output


def test_an_interrupted_deepseek_engram_conversion_resumes(tmp_path, monkeypatch):
    """The Engram token map (built from the tokenizer, not read from a tensor) is not written twice on resume."""
    from tests.oracles import deepseek_ckpt

    src = tmp_path / "v41"
    deepseek_ckpt.write_tiny_v41(src)
    fresh = json.loads((converters.convert(src, tmp_path / "fresh", progress=False) / "jaxmodels.json").read_text())
    real = _interrupting(monkeypatch, lambda n, part: part.leaf.startswith("mtp/"))  # past the Engram map
    with pytest.raises(KeyboardInterrupt):
        converters.convert(src, tmp_path / "out", progress=False)
    monkeypatch.setattr(orbax_io, "_put", real)
    dst = converters.convert(src, tmp_path / "out", progress=False)
    assert json.loads((dst / "jaxmodels.json").read_text())["files"] == fresh["files"]


def test_another_destination_keeps_its_partial(src, tmp_path, monkeypatch):
    """`.out.v2.<x>.partial` belongs to a conversion to `out.v2`: converting to `out` neither removes nor adopts it."""
    real = _interrupting(monkeypatch, lambda n, part: n == 10)
    with pytest.raises(KeyboardInterrupt):
        converters.convert(src, tmp_path / "out.v2", progress=False)
    monkeypatch.setattr(orbax_io, "_put", real)
    (partial,) = tmp_path.glob(".out.v2.*.partial")
    converters.convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert partial.exists()
    calls = _counting(monkeypatch)
    converters.convert(src, tmp_path / "out.v2", progress=False)
    assert len(calls) == _total(src) - 9 and not partial.exists()


def test_a_scalar_parameter_keeps_its_shape(tmp_path):
    import numpy as np

    from converters.hf import Part

    orbax_io._put(tmp_path, Part("x", (), (), np.float32(3.5).reshape(())))
    from safetensors import safe_open

    with safe_open(tmp_path / "x.safetensors", "np") as f:
        assert f.get_tensor("x").shape == ()
