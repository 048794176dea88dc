"""The conversion's fast paths (issue #18) give the bytes of the plain ones: the tiled transpose (staged tiles;
bf16 -> float32 written into the high halves) equals numpy's transposed copy for every bit pattern; a tensor read
with O_DIRECT (`checkpoint.read_range`) equals the file's bytes at any offset and length; the read-ahead yields
every tensor in order, holds at most two, and raises a read's error at that tensor."""
import os
import threading
import time
import warnings
import weakref

import ml_dtypes
import numpy as np
import pytest

from converters import hf
from converters.transforms import TILE, transpose
from jaxmodels import checkpoint

BF16 = ml_dtypes.bfloat16


def _every_pattern(dtype, shape, seed=0) -> np.ndarray:
    """An array of `shape` holding every bit pattern of a 16-bit dtype (NaNs, infinities, subnormals, -0), or
    random bits of a 32-bit one."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 2:
        bits = np.resize(np.arange(1 << 16, dtype=np.uint16), shape)
    else:
        bits = np.random.default_rng(seed).integers(0, 1 << 32, size=shape, dtype=np.uint32)
    return bits.view(dtype)


@pytest.mark.parametrize("shape", [(2 * TILE, 4 * TILE), (777, 1333), (300, 2048)])  # whole, ragged tiles; 4 KiB rows
@pytest.mark.parametrize("src,dst", [(BF16, BF16), (BF16, np.float32), (BF16, np.float16), (np.float32, BF16),
                                     (np.float16, np.float32), (np.float32, np.float32)])
def test_the_tiled_transpose_equals_numpys_byte_for_byte(shape, src, dst):
    x = _every_pattern(src, shape)
    with np.errstate(all="ignore"):
        want = np.ascontiguousarray(x.T, dst)
        got = transpose(x, dst)
    assert got.dtype == want.dtype and got.shape == want.shape and got.flags.c_contiguous
    assert got.tobytes() == want.tobytes()
    assert got.ctypes.data % checkpoint.DATA_OFFSET == 0, "written to disk straight from this buffer (O_DIRECT)"


def test_the_tiled_transpose_of_a_strided_view():
    x = _every_pattern(BF16, (900, 1400))[::3, 1::2]
    assert transpose(x, np.float32).tobytes() == np.ascontiguousarray(x.T, np.float32).tobytes()


def test_the_transpose_threads_keep_the_callers_errstate():
    """An overflow in the cast is check_values' error: np.errstate(over="ignore") holds in the worker threads too
    (numpy's error state is per thread), and over="raise" raises."""
    x = np.full((600, 700), 1e6, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(over="ignore"):
            assert np.isinf(transpose(x, np.float16)).all()
    with np.errstate(over="raise"), pytest.raises(FloatingPointError):
        transpose(x, np.float16)


def _evict(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="this OS has no O_DIRECT")
def test_read_range_equals_the_files_bytes(tmp_path, monkeypatch):
    from tests.test_convert_direct import _takes_o_direct

    if not _takes_o_direct(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT")
    page = checkpoint.DATA_OFFSET
    data = os.urandom(6 * page + 123)  # the file ends in a partial page
    f = tmp_path / "tensors"
    f.write_bytes(data)
    monkeypatch.setattr(checkpoint, "DIRECT_MIN", 1)
    monkeypatch.setattr(checkpoint, "_direct_ok", True)
    direct, real_open = [], os.open

    def spy(path, flags, *a):
        if flags & os.O_DIRECT:
            direct.append(path)
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", spy)
    for offset in (0, 1, 8 + 117, page - 1, page, 2 * page + 10):
        for n in (0, 1, page, 3 * page + 7, len(data) - offset):
            if offset + n > len(data):
                continue
            _evict(f)  # O_DIRECT only where the pages are not cached
            got = checkpoint.read_range(f, offset, n)
            assert got.dtype == np.uint8 and got.tobytes() == data[offset:offset + n], (offset, n)
            assert not n or (got.ctypes.data - offset) % page == 0, "the buffer starts at a page boundary"
    assert direct and checkpoint._direct_ok, "the whole pages were read with O_DIRECT"
    with pytest.raises(ValueError, match="unexpected end of file"):
        checkpoint.read_range(f, page, len(data))


def test_the_read_ahead_yields_in_order_and_holds_two(monkeypatch):
    refs, asked = [], []

    def get(name):
        asked.append(name)
        if name == "bad":
            raise ValueError("cannot read bad")
        value = np.full(4, len(asked))
        refs.append(weakref.ref(value))
        return value

    names = ["a", "b", "c", "bad", "e"]
    it = hf.prefetched(get, names)
    for k in range(3):
        value = next(it)
        assert value[0] == k + 1 and asked[k] == names[k]
        assert sum(r() is not None for r in refs) <= 2 and len(asked) <= k + 2, "one read ahead, no more"
        del value
    with pytest.raises(ValueError, match="cannot read bad"):
        next(it)
    assert "e" not in asked


def test_the_read_ahead_goes_as_far_as_its_budget():
    """Tensors of 10 bytes, a budget of 25: two read ahead of the one the caller holds, never three."""
    asked, more = [], threading.Event()

    def get(name):
        asked.append(name)
        if len(asked) == 3:
            more.set()
        return name

    it = hf.prefetched(get, list("abcdef"), [10] * 6, budget=25)
    assert next(it) == "a"
    assert more.wait(10), "the reads went ahead"
    time.sleep(0.2)
    assert asked == list("abc")
    assert list(it) == list("bcdef")


def test_an_unaligned_unstacked_leaf_is_assembled_into_an_aligned_buffer():
    """jax adopts only aligned host memory; a tensor read with O_DIRECT starts where it starts in its file."""
    raw = np.arange(4096 + 3, dtype=np.uint8)
    value = raw[3:].view(np.uint8)
    params = hf.assemble([(("embed", ()), [hf.Part("embed", (), (), value)])])
    assert params["embed"].ctypes.data % 64 == 0 and params["embed"].tobytes() == value.tobytes()


@pytest.mark.parametrize("src_dtype", [BF16, np.float16])
def test_a_widened_tensor_is_checked_for_non_finite_values(src_dtype):
    """bf16/float16 -> float32 keeps every value: its NaN/Inf are counted on the (smaller) source, and found."""
    x = np.ones((64, 64), src_dtype)
    assert hf.check_values("w", x, transpose(x, np.float32)) is not None
    x.reshape(-1)[[3, 700, 4000]] = [np.nan, np.inf, -np.inf]
    with pytest.raises(hf.CheckpointError, match=r"w: 3 non-finite values"):
        hf.check_values("w", x, transpose(x, np.float32))


def _pooled(a: np.ndarray) -> bool:
    """a's memory is a pool buffer (the owner at the end of its base chain is not an array)."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return not isinstance(a, np.ndarray)


def test_a_pool_buffer_comes_back_only_when_its_last_view_is_gone():
    with checkpoint.recycling(keep=64 << 20) as pool:
        a = checkpoint.scratch((3 << 20,), np.uint8)
        first = a.ctypes.data
        assert first % checkpoint.DATA_OFFSET == 0
        view = a[10:20].view(np.uint16)
        del a
        b = checkpoint.scratch((3 << 20,), np.uint8)
        assert b.ctypes.data != first, "handed out again while a view of it lives"
        view[:] = 7
        del view
        c = checkpoint.scratch((1 << 20,), np.float32)  # 4 MiB: fits the buffer just freed (3 MiB, rounded up)
        assert c.ctypes.data == first
        del b, c
        big = [checkpoint.scratch((40 << 20,), np.uint8) for _ in range(3)]
        del big
        assert sum(map(len, [*pool._free, *pool._returned])) <= 64 << 20, "free buffers beyond keep are dropped"
        kept = checkpoint.scratch((5 << 20,), np.uint8)
        kept[:] = 3
        small = checkpoint.scratch((1000,), np.uint8)
        assert _pooled(kept) and not _pooled(small), "small arrays: malloc"
    assert pool.closed and not pool._free
    assert (kept == 3).all(), "an array outlives the pool"
    assert not _pooled(checkpoint.scratch((5 << 20,), np.uint8)), "no pool: malloc"


def test_a_widening_transpose_into_a_recycled_buffer_zeroes_the_low_halves():
    x = _every_pattern(BF16, (600, 1100))
    with checkpoint.recycling(keep=64 << 20):
        dirty = checkpoint.scratch((1100, 600), np.float32)
        dirty.view(np.uint8)[:] = 0xFF
        del dirty
        got = transpose(x, np.float32)
        assert got.tobytes() == np.ascontiguousarray(x.T, np.float32).tobytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_import_transposing_into_its_leaves_equals_one_that_copies(tmp_path, monkeypatch, dtype):
    """read_source writes each transposed tensor straight into its stacked leaf's slot: the same parameters, byte
    for byte, as assembling the stream's own arrays (tensors large enough for the tiled transpose)."""
    import converters
    from tests.test_convert_scale import write_checkpoint

    write_checkpoint(tmp_path / "src", "llama", layers=2, d=512, inter=1536, vocab=1024)
    into, real = [], hf.transpose
    monkeypatch.setattr(hf, "transpose", lambda x, dt, out=None: into.append(out is not None) or real(x, dt, out))
    _, direct, _ = converters.read_source(tmp_path / "src", dtype, progress=False)
    assert into.count(True) == 2 * 7, "every stacked weight (7 a layer) transposed into its slot"
    monkeypatch.setattr(hf, "transpose", real)
    cfg, reader, fam, tok = converters.open_source(tmp_path / "src")
    copied = hf.assemble(converters.source_items(cfg, reader, fam, tok, dtype)())
    from jaxmodels.plan import flatten

    a, b = flatten(direct), flatten(copied)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k
    w_up = a["layers/0/mlp/w_up"]
    assert w_up.shape[1:] == (512, 1536) and w_up.ctypes.data % 64 == 0


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_a_deepseek_import_transposes_into_its_leaves_too(tmp_path, monkeypatch, keep_quantized):
    """DeepSeek's FP8/FP4 import (backbone and MTP blocks) writes its transposed tensors into their stacked leaves'
    slots as the HF path does: the same parameters as assembling the stream's own arrays."""
    import converters
    from jaxmodels.plan import flatten
    from tests.oracles import deepseek_ckpt as ck

    hf_cfg = ck.tiny_config("v4.1")
    ck.write_checkpoint(str(tmp_path / "src"), hf_cfg)
    ck.write_word_tokenizer(tmp_path / "src", hf_cfg["text_config"]["vocab_size"])
    into, real = [], hf.transpose
    monkeypatch.setattr(hf, "transpose", lambda x, dt, out=None: into.append(out is not None) or real(x, dt, out))
    _, direct, _ = converters.read_source(tmp_path / "src", "float32", progress=False, keep_quantized=keep_quantized)
    assert into.count(True) > 0 and "mtp" in direct
    into.clear()
    from converters import deepseek
    from converters.safetensors_io import SafetensorsReader

    deepseek.import_mtp(SafetensorsReader(tmp_path / "src"), converters.open_source(tmp_path / "src")[0],
                        keep_quantized=keep_quantized)
    # (kept quantized, the blocks' stacked weights stay bytes: nothing of theirs is transposed)
    assert into.count(True) > 0 or keep_quantized, "the MTP blocks' transposed tensors go into their slots too"
    monkeypatch.setattr(hf, "transpose", real)
    cfg, reader, fam, tok = converters.open_source(tmp_path / "src")
    copied = hf.assemble(converters.source_items(cfg, reader, fam, tok, "float32", keep_quantized)())
    a, b = flatten(direct), flatten(copied)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(), k


def test_transpose_into_a_wrong_out_is_refused():
    x = np.zeros((600, 700), BF16)
    with pytest.raises(ValueError, match="needs C-contiguous float32"):
        transpose(x, np.float32, np.zeros((600, 700), np.float32))
    out = np.zeros((700, 600), np.float32)
    assert transpose(x, np.float32, out) is out
