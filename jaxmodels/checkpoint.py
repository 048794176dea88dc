"""The converted-model directory, read side: `jaxmodels.json` (format version, dtype, config, file checksums),
`params/` (one safetensors file per parameter leaf), tokenizer files. `converters` writes it
(converters/orbax_io.py).

Format 3 stores each leaf as `params/<leaf path>.safetensors`, one tensor named by its path, its data starting at
byte DATA_OFFSET: the converter writes it slice by slice (a layer, an expert) at known offsets, and a load is one
sequential read per file into a page-aligned buffer that jax adopts without a copy. Format 2 (orbax) still loads.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import logging
import math
import mmap
import os
import struct
import threading
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxmodels import files, plan
from jaxmodels.config import ModelConfig

log = logging.getLogger(__name__)

CONFIG_FILE = "jaxmodels.json"
FORMAT_VERSION = 3  # 3: a safetensors file per leaf; 2: orbax, every family on the one layer plan
LEAF_SUFFIX = ".safetensors"
DATA_OFFSET = 4096  # where a leaf's data starts: page-aligned, so jax can adopt a buffer read whole
ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
             "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
             "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32,
             "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
ST_NAMES = {np.dtype(v): k for k, v in ST_DTYPES.items()}


def leaf_header(leaf: str, shape: tuple[int, ...], dtype) -> bytes:
    """The safetensors header of a one-tensor leaf file, padded so that its data starts at a DATA_OFFSET multiple."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    head = json.dumps({leaf: {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [0, nbytes]}}).encode()
    n = -(-(8 + len(head)) // DATA_OFFSET) * DATA_OFFSET - 8
    return struct.pack("<Q", n) + head.ljust(n)


def parse_leaf_header(file: Path, head: bytes, size: int) -> tuple[str, tuple[int, ...], np.dtype, int]:
    """(tensor name, shape, dtype, data offset) of a leaf file of `size` bytes from its first bytes `head`;
    ValueError naming the file when they are not one tensor that fills the file."""
    try:
        (n,) = struct.unpack("<Q", head[:8])
        meta = json.loads(head[8:8 + n]) if 8 + n <= len(head) else None
        (name, t), = meta.items()
        shape, dtype, (a, b) = tuple(int(x) for x in t["shape"]), np.dtype(ST_DTYPES[t["dtype"]]), t["data_offsets"]
        ok = a == 0 and b == math.prod(shape) * dtype.itemsize and 8 + n + b == size and min(shape, default=0) >= 0
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, AttributeError, LookupError, TypeError,
            ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{file}: not a jaxmodels parameter file (one safetensors tensor filling the file); "
                         f"convert the model again")
    return name, shape, dtype, 8 + n


def aligned_empty(shape: tuple[int, ...], dtype, align: int = DATA_OFFSET) -> np.ndarray:
    """An uninitialised array whose data starts at an `align` boundary (jax aliases 64-byte aligned host buffers)."""
    dtype = np.dtype(dtype)
    raw = np.empty(math.prod(shape) * dtype.itemsize + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


class BufferPool:
    """Page-aligned buffers for large short-lived arrays (a tensor read, its transpose), each taken back once the
    last array over it is gone (a finalizer on the buffer's owner, which every view keeps alive) and handed out
    again. Fresh memory is costly: the kernel zeroes every page on first touch, and on a VM whose host takes freed
    pages back (free page reporting) that first touch runs at 0.3-0.8 GB/s against 10+ GB/s for reused pages.
    Free buffers beyond `keep` bytes are dropped (unmapped), the smallest first. A buffer is handed out only for
    at least half its size: a small array that outlives the pool (a parameter) never pins a large buffer."""

    CHUNK = 2 << 20  # sizes rounded up to a huge page (fewer distinct buffers, transparent huge pages)

    def __init__(self, keep: int):
        self._free: list[mmap.mmap] = []
        self._returned: collections.deque = collections.deque()  # given back, not yet sorted into _free
        self._keep, self._lock, self.closed = keep, threading.Lock(), False

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        with self._lock:
            self._sort_returned()
            fits = [m for m in self._free if n <= len(m) <= 2 * max(n, self.CHUNK)]
            if buf := min(fits, key=len, default=None):
                self._free.remove(buf)
        if buf is None:
            buf = mmap.mmap(-1, max(1, -(-n // self.CHUNK)) * self.CHUNK, flags=mmap.MAP_PRIVATE)  # not shmem
            if hasattr(mmap, "MADV_HUGEPAGE"):
                buf.madvise(mmap.MADV_HUGEPAGE)
        owner = (ctypes.c_char * len(buf)).from_buffer(buf)
        weakref.finalize(owner, self._give_back, buf)
        return np.frombuffer(owner, np.uint8, n).view(dtype).reshape(shape)

    def _give_back(self, buf: mmap.mmap) -> None:
        # Never waits for the lock: a finalizer may run inside `empty` (a garbage collection there), whose thread
        # holds it; then the buffer waits in _returned for the next `empty`. Buffers are dropped, not closed: the
        # owner's export ends only after this callback; the map goes with its last reference.
        if self.closed:
            return
        self._returned.append(buf)
        if self._lock.acquire(blocking=False):
            try:
                if self.closed:  # closed meanwhile: nothing may stay
                    self._returned.clear()
                else:
                    self._sort_returned()
            finally:
                self._lock.release()
        elif self.closed:
            self._returned.clear()

    def _sort_returned(self) -> None:
        """(Under the lock.) The buffers given back join the free ones, beyond `keep` bytes the smallest dropped."""
        while self._returned:
            self._free.append(self._returned.popleft())
        self._free.sort(key=len)
        while sum(map(len, self._free)) > self._keep:
            self._free.pop(0)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._free.clear()
            self._returned.clear()


POOL_MIN = 1 << 20  # smaller scratch arrays come from malloc (which reuses small blocks well)
_pool: BufferPool | None = None


@contextlib.contextmanager
def recycling(keep: int):
    """Within it, `scratch` arrays come from a BufferPool (keeping at most `keep` bytes of free buffers, released at
    the end): conversion and import allocate a tensor or two per tensor of the checkpoint."""
    global _pool
    pool = BufferPool(keep)
    outer, _pool = _pool, pool
    try:
        yield pool
    finally:
        pool.close()
        if _pool is pool:  # (another thread's recycling may have begun meanwhile: its pool stays)
            _pool = outer


def scratch(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised page-aligned array for a short-lived value: from the `recycling` pool when there is one."""
    pool = _pool
    if pool is None or pool.closed or math.prod(shape) * np.dtype(dtype).itemsize < POOL_MIN:
        return aligned_empty(shape, dtype)
    return pool.empty(shape, dtype)


def read_into(fd: int, buf: np.ndarray, offset: int, crc: int | None = None) -> int | None:
    """Fill `buf` (contiguous) with the file's bytes from `offset`; their CRC32 continued from `crc` unless None."""
    view = memoryview(buf.reshape(-1).view(np.uint8))
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
        if n <= 0:
            raise ValueError(f"unexpected end of file at byte {offset + done}")
        if crc is not None:
            crc = zlib.crc32(view[done:done + n], crc)
        done += n
    return crc


DIRECT_MIN = 1 << 20  # smaller leaves are read through the page cache
_direct_ok = hasattr(os, "O_DIRECT")  # False once a file system refused it


DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # how file systems say "no O_DIRECT here"


def _cached(file: Path, offset: int) -> bool:
    """The page at `offset` is in the page cache (a file just copied or read by something else: a buffered read
    copies at memory speed, O_DIRECT would go to the disk)."""
    if not hasattr(os, "RWF_NOWAIT"):
        return False
    fd = os.open(file, os.O_RDONLY)
    try:
        return os.preadv(fd, [bytearray(DATA_OFFSET)], offset, os.RWF_NOWAIT) > 0
    except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
        return False
    finally:
        os.close(fd)


def _read_direct(file: Path, pages: np.ndarray, offset: int) -> bool:
    """Fill page-aligned `pages` from the page-aligned `offset` with O_DIRECT: the disk writes into our buffer, no
    copy out of the page cache (on a 2-core host that copy, not the disk, bounds a cold load). False where the file
    system refuses O_DIRECT, or the file's last whole page is cached (the caller reads it all buffered)."""
    global _direct_ok
    if not _direct_ok or pages.ctypes.data % DATA_OFFSET or _cached(file, offset + pages.size - DATA_OFFSET):
        return False
    try:
        fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno not in DIRECT_REFUSED:
            raise
        _direct_ok = False
        return False
    try:
        read_into(fd, pages, offset)
    except OSError as e:
        if e.errno not in DIRECT_REFUSED:
            raise
        _direct_ok = False  # accepted at open, refused at read
        return False
    finally:
        os.close(fd)
    return True


def read_range(file: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` bytes of `file` from `offset` (uint8), in a page-aligned buffer spanning their pages (the array
    starts offset % DATA_OFFSET bytes into it): the whole pages inside the file are read with O_DIRECT where
    `_read_direct` can (the disk writes into the buffer: no copy out of the page cache, no CPU time: a read beside
    the transforms then costs them nothing), the rest through the page cache. ValueError on a file too short."""
    first, end = offset // DATA_OFFSET * DATA_OFFSET, offset + nbytes
    buf = scratch((-(-end // DATA_OFFSET) * DATA_OFFSET - first,), np.uint8)
    whole = min(buf.size, (os.stat(file).st_size - first) // DATA_OFFSET * DATA_OFFSET)  # pages inside the file
    start = first + whole if whole >= DIRECT_MIN and _read_direct(file, buf[:whole], first) else offset
    if start < end:
        fd = os.open(file, os.O_RDONLY)
        try:
            read_into(fd, buf[start - first:end - first], start)
        finally:
            os.close(fd)
    return buf[offset - first:end - first]


def is_converted(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).exists()


def load_meta(path: str | Path) -> dict:
    where = files.find(path, CONFIG_FILE)
    if where is None:
        raise FileNotFoundError(f"{path}: no {CONFIG_FILE} (not a converted model)")
    return files.read_json(where, files.MAX_METADATA_BYTES)


def load_config(path: str | Path) -> ModelConfig:
    meta = load_meta(path)
    version, cfg = meta.get("format_version"), meta.get("config") or {}
    # version 1 wrote the dense families exactly as today; DeepSeek had a config and layout of its own
    if version == 1 and cfg.get("family", "").startswith("deepseek"):
        raise ValueError(f"{path}: converted by an older jaxmodels (format 1, DeepSeek's own layout); "
                         f"convert the checkpoint again")
    if version not in (1, 2, FORMAT_VERSION):
        raise ValueError(f"{path}: unsupported jaxmodels format version {version}")
    return ModelConfig.from_dict(cfg)


def checksums(params_dir: str | Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file under `params_dir`, hashed in threads (zlib releases the
    GIL): 0.4-0.7 s beside a 4-4.5 s restore of SmolLM2-135M fp32 (333 MB) on 2 CPU cores."""
    root = Path(params_dir)
    files = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as ex:
        return dict(zip(files, ex.map(lambda f: _crc(root / f), files)))


def _crc(path: Path) -> list[int]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 24):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return [size, crc]


def _recorded(path: str | Path) -> dict[str, list[int]] | None:
    """The {file: [size, crc32]} written at conversion, checked to be well formed; None (logged) if there is none."""
    recorded = load_meta(path).get("files")
    if recorded is None:
        log.warning("%s: no checksums recorded (converted by an older jaxmodels); its files are not verified", path)
        return None
    if not isinstance(recorded, dict) or not all(
            isinstance(n, str) and ".." not in Path(n).parts and isinstance(v, list) and len(v) == 2
            and all(isinstance(x, int) for x in v) for n, v in recorded.items()):
        raise ValueError(f"{path}: the checksums in {CONFIG_FILE} are malformed (convert the model again)")
    return recorded


def _check_sizes(where: Path, recorded: dict[str, list[int]]) -> None:
    for name, (size, _) in recorded.items():
        if not (where / name).is_file():
            raise ValueError(f"{where / name}: missing (the converted model is incomplete; convert it again)")
        if (got := (where / name).stat().st_size) != size:
            raise ValueError(f"{where / name}: {got} bytes, {size} written at conversion (truncated or modified; "
                             f"convert it again)")


def _corrupted(file: Path) -> ValueError:
    return ValueError(f"{file}: checksum differs from the one written at conversion (the file is corrupted or was "
                      f"modified; convert it again)")


def verify_files(path: str | Path) -> None:
    """The params files are those written at conversion, byte for byte (sizes and CRC32s in jaxmodels.json)."""
    if (recorded := _recorded(path)) is None:
        return
    where = Path(path) / "params"
    _check_sizes(where, recorded)
    got = checksums(where)
    for name, (_, crc) in recorded.items():
        if got[name][1] != crc:
            raise _corrupted(where / name)


def _verify_once(path: str | Path) -> None:
    """`verify_files` on process 0 only (every other process would read the whole model again); its verdict is
    shared, so every process fails alike."""
    import jax

    if jax.process_count() == 1:
        return verify_files(path)
    from jax.experimental import multihost_utils

    error = None
    if jax.process_index() == 0:
        try:
            verify_files(path)
        except ValueError as e:
            error = e
    if multihost_utils.broadcast_one_to_all(np.int32(error is not None)):
        raise error or ValueError(f"{path}: process 0 found the params files corrupted (its log says which)")


QUANTIZED_PARTS = ("/fp8", "/fp4", "/scale", "_scale")  # kept-quantized DeepSeek weights (converters/deepseek.py)


def planned_base(leaf: str, want) -> str:
    """The planned parameter (a path of `want`) a stored leaf holds: itself, or the weight it is a kept-quantized
    part of (mHC's own `.../scale` parameters are planned, so a suffix alone does not make a part)."""
    return next((leaf[: -len(s)] for s in QUANTIZED_PARTS if leaf.endswith(s) and leaf[: -len(s)] in want), leaf)


def check_shapes(cfg: ModelConfig, stored: dict) -> None:
    """The stored leaves ({path: (shape, dtype)}) are the parameters the config's plan declares: none missing,
    none extra, each of its planned shape (a kept-quantized weight: its layer count). MTP weights are optional."""
    want = plan.flatten(plan.param_specs(cfg))
    if any(p.startswith("mtp/") for p in stored):
        want |= plan.flatten(plan.mtp_param_specs(cfg))
    base = {p: planned_base(p, want) for p in stored}
    extra = sorted(p for p, b in base.items() if b not in want)
    missing = sorted(set(want) - set(base.values()))
    if extra or missing:
        raise ValueError(f"the stored parameters do not match the config in {CONFIG_FILE}: "
                         + "; ".join(x for x in (missing and f"missing {_few(missing)}", extra and f"not in the "
                                                 f"config {_few(extra)}") if x))
    for p, (shape, dtype) in stored.items():
        spec, shape = want[base[p]], tuple(shape)
        if p == base[p] and (dtype in FLOATS or dtype == spec.dtype):  # as planned: the whole shape
            ok = shape == spec.shape
        else:  # kept-quantized bytes or scales: a layout of their own, the same layer count
            ok = not p.startswith("layers/") or shape[:1] == spec.shape[:1]
        if not ok:
            raise ValueError(f"params/{p}: stored shape {shape}, the config in {CONFIG_FILE} gives {spec.shape}")


FLOATS = ("float32", "bfloat16", "float16")


def _few(paths: list[str]) -> str:
    return ", ".join(paths[:4]) + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def load_params(path: str | Path, cfg: ModelConfig, sharding_of=None, verify: bool = True, placement=None) -> dict:
    """Restore params, after checking the files against their checksums (`verify`) and the stored shapes against
    the config. sharding_of(param path) -> jax.sharding.Sharding: restore each leaf straight into it (each device
    reads only its shards); the stored shapes and dtypes come from the checkpoint's own metadata. placement(leaf
    path, stored shape) -> Sharding does the same where the shape decides (`jaxmodels.sharding.placement`: the
    parts of weights kept quantized, split like their parameter).

    Unsharded on one process, each file is read once: its checksum is taken from the buffer it is read into,
    and jax adopts that buffer (on CPU, no copy: host memory stays at the model's bytes)."""
    import jax

    if placement is not None and sharding_of is not None:
        raise ValueError("load_params: give sharding_of or placement, not both")
    if load_meta(path).get("format_version") in (1, 2):
        if placement is not None:  # orbax restores by path: the stored shapes are the planned ones
            specs = plan.flatten(plan.param_specs(cfg)) | plan.flatten(plan.mtp_param_specs(cfg))
            sharding_of = lambda p: placement(p, specs[p].shape if p in specs else ())  # noqa: E731
        return _load_orbax(path, cfg, sharding_of, verify)
    where = Path(path).absolute() / "params"
    if placement is not None:
        sharding_of = placement
    fused = verify and sharding_of is None and jax.process_count() == 1
    recorded = None
    if fused and (recorded := _recorded(path)) is not None:
        _check_sizes(where, recorded)
    elif verify and not fused:
        _verify_once(path)
    try:
        leaves = stored_leaves(where)
    except ValueError:
        if recorded is not None:  # a damaged header: name it as what it is, a file that changed
            verify_files(path)
        raise
    check_shapes(cfg, {p: (shape, str(dtype)) for p, (_, shape, dtype, _) in leaves.items()})
    if sharding_of is not None:
        return plan.unflatten({p: _restore_sharded(f, o, shape, dtype, sharding_of(p, shape) if placement else
                                                   sharding_of(p)) for p, (f, shape, dtype, o) in leaves.items()})

    def one(item):
        p, (file, shape, dtype, offset) = item
        want = None if recorded is None else recorded.get(str(file.relative_to(where)))
        buf = aligned_empty(shape, dtype)
        flat = buf.reshape(-1).view(np.uint8)
        whole = flat.size // DATA_OFFSET * DATA_OFFSET if offset % DATA_OFFSET == 0 else 0  # whole pages: direct
        if whole < DIRECT_MIN or not _read_direct(file, flat[:whole], offset):
            whole = 0
        fd = os.open(file, os.O_RDONLY)
        try:
            crc = None if want is None else zlib.crc32(os.pread(fd, offset, 0))
            crc = crc if crc is None or not whole else zlib.crc32(flat[:whole], crc)
            crc = read_into(fd, flat[whole:], offset + whole, crc)
        finally:
            os.close(fd)
        if want is not None and crc != want[1]:
            raise _corrupted(file)
        return p, jax.device_put(buf, may_alias=True)

    with ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as ex:  # reads and CRCs release the GIL
        params = dict(ex.map(one, sorted(leaves.items(), key=lambda kv: -kv[1][0].stat().st_size)))
    if recorded is not None:  # recorded files that are not leaves (none are written): still verified
        for name in set(recorded) - {str(f.relative_to(where)) for f, *_ in leaves.values()}:
            if _crc(where / name)[1] != recorded[name][1]:
                raise _corrupted(where / name)
    return plan.unflatten(params)


def stored_leaves(where: Path) -> dict[str, tuple[Path, tuple[int, ...], np.dtype, int]]:
    """{leaf path: (file, shape, dtype, data offset)} of the leaf files under `where`, from their headers."""
    out = {}
    for file in sorted(where.rglob("*" + LEAF_SUFFIX)):
        leaf = str(file.relative_to(where))[: -len(LEAF_SUFFIX)]
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(DATA_OFFSET)
            if len(head) >= 8 and 8 + struct.unpack("<Q", head[:8])[0] > len(head):
                head += f.read(min(struct.unpack("<Q", head[:8])[0], 1 << 20))
        name, shape, dtype, offset = parse_leaf_header(file, head, size)
        if name != leaf:
            raise ValueError(f"{file}: holds tensor {name!r}, not {leaf!r}; convert the model again")
        out[leaf] = (file, shape, dtype, offset)
    return out


def _restore_sharded(file: Path, offset: int, shape, dtype, s):
    """One leaf placed by sharding `s`, each device reading only its block; a table split along rows its mesh
    axes do not divide is zero-padded to `sharding.placed_shape` (see jaxmodels/sharding.py, PADDED)."""
    import jax

    from jaxmodels import sharding

    def read(idx):
        return _read_slice(file, offset, shape, dtype, idx)

    placed = sharding.placed_shape(shape, s) if isinstance(s, jax.sharding.NamedSharding) else tuple(shape)
    if placed == tuple(shape):
        return jax.make_array_from_callback(shape, s, read)
    return jax.make_array_from_callback(placed, s, lambda idx: sharding.padded_slice(read, shape, idx))


def _read_slice(file: Path, offset: int, shape, dtype, idx) -> np.ndarray:
    """One shard of a leaf: only its bytes are touched, through a map dropped once copied."""
    if not math.prod(shape):
        return np.zeros(shape, dtype)[idx]
    return np.array(np.memmap(file, dtype, "r", offset, shape)[idx])


def _load_orbax(path: str | Path, cfg: ModelConfig, sharding_of=None, verify: bool = True) -> dict:
    """Format 2: params written by orbax."""
    import jax
    import orbax.checkpoint as ocp

    if verify:
        _verify_once(path)
    ckpt, where = ocp.StandardCheckpointer(), Path(path).absolute() / "params"
    meta = ckpt.metadata(where)
    meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)  # orbax >= 0.12.8 wraps the tree
    leaf = lambda m: hasattr(m, "shape")  # noqa: E731
    check_shapes(cfg, {p: (m.shape, str(m.dtype)) for p, m in plan.flatten(_plain(meta, leaf)).items()})
    if sharding_of is None:
        return ckpt.restore(where)
    target = jax.tree_util.tree_map_with_path(
        lambda p, m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of("/".join(str(k.key) for k in p))),
        meta, is_leaf=leaf)
    return ckpt.restore(where, target)


def _plain(tree, leaf) -> dict:
    """orbax's metadata tree as nested plain dicts."""
    return {k: v if leaf(v) else _plain(v, leaf) for k, v in tree.items()}
