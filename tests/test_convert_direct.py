"""The converted-model writer's O_DIRECT path (issue #18): slices written from page-aligned memory, through the
bounce buffer from unaligned memory, with partial pages at either end and at unaligned file offsets, give the
same bytes and CRC32s as plain buffered writes; a file system that refuses O_DIRECT falls back to buffered."""
import errno
import os
import zlib

import ml_dtypes
import numpy as np
import pytest

from converters import orbax_io
from converters.hf import Part
from jaxmodels.checkpoint import aligned_empty, leaf_header

needs_o_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="this OS has no O_DIRECT")


def _takes_o_direct(where) -> bool:
    """Whether the file system of `where` takes an aligned O_DIRECT write: asked directly, so that a test whose
    code falls back to buffered writes fails instead of skipping (a wrong offset also gets EINVAL)."""
    page = np.zeros(orbax_io.PAGE * 2, np.uint8)
    page = page[-page.ctypes.data % orbax_io.PAGE:][:orbax_io.PAGE]
    try:
        fd = os.open(where / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        return os.pwrite(fd, page, 0) == orbax_io.PAGE
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(where / "probe")


def _unaligned(a: np.ndarray, shift: int) -> np.ndarray:
    """A copy of a whose data starts `shift` bytes past a page boundary."""
    raw = np.empty(a.nbytes + 2 * orbax_io.PAGE, np.uint8)
    start = -raw.ctypes.data % orbax_io.PAGE + shift
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _slices(rng):
    """Stacked leaves of 3 slices each: whole pages, partial pages (unaligned offsets of later slices), bf16 and
    float32, from page-aligned and from unaligned memory."""
    out = []
    for leaf, shape, dtype, shift in [("whole", (8, 1024), ml_dtypes.bfloat16, 0),  # 16 KiB: 4 pages a slice
                                      ("partial", (7, 333), np.float32, 0),  # 9324 B: slices start mid-page
                                      ("bounced", (9, 1000), ml_dtypes.bfloat16, 2),
                                      ("bounced32", (5, 2000), np.float32, 12)]:
        for i in range(3):
            v = rng.standard_normal(shape).astype(dtype)
            if shift:
                v = _unaligned(v, shift)
            else:
                v, a = aligned_empty(shape, dtype), v
                v[...] = a
            out.append(Part(leaf, (3,), (i,), v))
    return out


def _write(root, parts):
    records = [orbax_io._put(root, p) for p in reversed(parts)]  # the last slice first: writes into holes
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}, sorted(records)


def _expected(parts):
    by_leaf = {}
    for p in parts:
        by_leaf.setdefault(p.leaf, []).append(p)
    out = {}
    for leaf, ps in by_leaf.items():
        shape = (3, *ps[0].value.shape)
        data = b"".join(np.ascontiguousarray(p.value).tobytes() for p in sorted(ps, key=lambda p: p.index))
        out[leaf + orbax_io.LEAF_SUFFIX] = leaf_header(leaf, shape, ps[0].value.dtype) + data
    return out


@needs_o_direct
def test_direct_writes_equal_buffered_writes(tmp_path, monkeypatch):
    if not _takes_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    parts = _slices(np.random.default_rng(0))
    monkeypatch.setattr(orbax_io, "DIRECT_MIN", 1)  # every slice with a whole page takes O_DIRECT
    monkeypatch.setattr(orbax_io, "BOUNCE", 3 * orbax_io.PAGE)  # unaligned slices cross several bounce chunks
    monkeypatch.setattr(orbax_io, "_direct_ok", True)
    opened = []
    real_open = os.open

    def spy(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            opened.append(path)
        return fd

    monkeypatch.setattr(os, "open", spy)
    (tmp_path / "direct").mkdir()
    direct = _write(tmp_path / "direct", parts)
    assert orbax_io._direct_ok, "an aligned O_DIRECT write was refused: the offsets or lengths are wrong"
    assert {os.path.basename(f) for f in opened} == {p.leaf + orbax_io.LEAF_SUFFIX for p in parts}
    monkeypatch.setattr(orbax_io, "_direct_ok", False)
    (tmp_path / "buffered").mkdir()
    buffered = _write(tmp_path / "buffered", parts)
    assert direct == buffered
    assert direct[0] == _expected(parts)
    assert sorted(r[-1] for r in direct[1]) == sorted(zlib.crc32(np.ascontiguousarray(p.value).tobytes())
                                                      for p in parts)


@needs_o_direct
def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    parts = _slices(np.random.default_rng(1))
    monkeypatch.setattr(orbax_io, "DIRECT_MIN", 1)
    monkeypatch.setattr(orbax_io, "_direct_ok", True)
    real_open, asked = os.open, []

    def refuse(path, flags, *a):
        if flags & os.O_DIRECT:
            asked.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refuse)
    files, _ = _write(tmp_path, parts)
    assert files == _expected(parts)
    assert orbax_io._direct_ok is False and len(asked) == 1  # asked once, then never again


def test_a_cached_file_is_read_through_the_page_cache(tmp_path):
    """A repeated load reads at memory speed: O_DIRECT only where the file's pages are not cached."""
    from jaxmodels import checkpoint

    f = tmp_path / "leaf"
    f.write_bytes(os.urandom(4 * orbax_io.PAGE))
    f.read_bytes()
    if not hasattr(os, "RWF_NOWAIT"):
        pytest.skip("no RWF_NOWAIT: the cache cannot be asked")
    assert checkpoint._cached(f, 3 * orbax_io.PAGE)


@needs_o_direct
def test_convert_and_load_through_o_direct_equal_the_buffered_paths(tmp_path, monkeypatch):
    """A whole conversion and load with every leaf on the O_DIRECT paths (DIRECT_MIN 1: the tiny model's leaves are
    below the real threshold): the same files and the same parameters as with O_DIRECT off."""
    import jax

    import converters
    import jaxmodels as jm
    from jaxmodels import checkpoint
    from tests.test_convert_scale import write_checkpoint

    if not _takes_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    write_checkpoint(tmp_path / "src", "llama", layers=3, d=64, inter=128, vocab=256)
    direct = []
    real_open = os.open

    def spy(path, flags, *a):
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct.append((path, flags & os.O_ACCMODE))
        return fd

    monkeypatch.setattr(os, "open", spy)
    out = {}
    for mode in ("direct", "buffered"):
        on = mode == "direct"
        for mod in (orbax_io, checkpoint):
            monkeypatch.setattr(mod, "DIRECT_MIN", 1)
            monkeypatch.setattr(mod, "_direct_ok", on and hasattr(os, "O_DIRECT"))
        converters.convert(tmp_path / "src", tmp_path / mode, progress=False)
        model = jm.load(tmp_path / mode)
        files = {p.relative_to(tmp_path / mode): p.read_bytes() for p in (tmp_path / mode).rglob("*") if p.is_file()}
        out[mode] = files, jax.tree.map(np.asarray, model.params)
        assert not on or (orbax_io._direct_ok and checkpoint._direct_ok), "an aligned O_DIRECT call was refused"
    kinds = {flags for _, flags in direct}
    assert kinds == {os.O_WRONLY, os.O_RDONLY}, "both the writer and the loader went through O_DIRECT"
    assert out["direct"][0] == out["buffered"][0]
    same = jax.tree.map(lambda a, b: a.dtype == b.dtype and a.tobytes() == b.tobytes(), *[o[1] for o in out.values()])
    assert all(jax.tree.leaves(same))
