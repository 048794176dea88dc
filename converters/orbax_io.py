"""The converted-model directory, write side (format and read side: jaxmodels/checkpoint.py): `jaxmodels.json`
(config, checksums), `params/` (a safetensors file per leaf), tokenizer files. (Format 2 wrote `params/` with
orbax, hence this module's name; it still loads.)

Streaming: `write` takes the converted values as they come, a slice of a leaf at a time (`hf.Part`: a layer, an
expert, a whole tensor), and writes each straight into its place in its leaf file (os.pwrite at the slice's
offset), checksummed on the way (the file's CRC32 is combined from its slices'): nothing is gathered in memory,
nothing read back. Whole pages go out with O_DIRECT (no copy into the page cache: on a small host that copy, not
the disk, bounded the conversion), the partial pages at a slice's ends through the page cache.

Nothing we did not create is deleted or overwritten. `check_destination` runs before any import work: an
existing destination needs overwrite, and even then only an empty directory or one of our own converted
outputs is replaced, never the source or a directory that contains it. The output is written into a temporary
sibling (`.<name>.*.partial`, with an `owner` file naming its process) and moved in at the end: a rename that
fails if something appeared at the destination meanwhile (two converts to one destination: one wins, the other
fails), or with overwrite the old output set aside, the new one moved in, the old one removed.

Resuming: a conversion also writes `job.json` (its source files by size and mtime, its options) and `journal` (a
line per slice written: where, and its CRC32) into its temporary. An error removes the temporary; an interruption
(Ctrl-C, a kill, a crash) leaves it. The next conversion of the same job to the same destination takes over the
temporary of a process that is gone: it reads back each journaled slice, keeps those whose CRC32 matches and
converts only the rest. Other temporaries of dead processes are removed.
"""
from __future__ import annotations

import collections
import errno
import functools
import glob
import json
import logging
import math
import os
import secrets
import shutil
import socket
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from converters.crc32 import combine
from converters.hf import Part
from converters.safetensors_io import CheckpointError
from jaxmodels.checkpoint import (CONFIG_FILE, FORMAT_VERSION, LEAF_SUFFIX, ST_DTYPES, ST_NAMES, leaf_header,
                                  read_into)
from jaxmodels import multimodal
from jaxmodels.config import ModelConfig
from jaxmodels.plan import flatten

log = logging.getLogger(__name__)
OWNER = "owner"  # in a temporary output: "host pid"
INTERRUPTED = "interrupted"  # the owner's pid once it stopped on Ctrl-C: resumable from the same process too
JOB, JOURNAL = "job.json", "journal"  # in a temporary output: what it converts, the slices written so far


def check_destination(dst: str | Path, src: str | Path | None = None, overwrite: bool = False) -> Path:
    """The absolute destination, if writing there loses nothing; else FileExistsError / ValueError naming why."""
    dst = Path(dst).absolute()
    if src is not None:
        s, d = Path(src).resolve(), dst.resolve()
        if s == d or s.is_relative_to(d):
            raise ValueError(f"{dst} is or contains the source checkpoint {src}: refusing to write there")
    if not dst.exists() and not dst.is_symlink():
        return dst
    if not overwrite:
        raise FileExistsError(f"{dst} already exists (pass overwrite=True / --force to replace a converted model)")
    if dst.is_symlink() or not dst.is_dir():
        raise FileExistsError(f"{dst} is not a directory; --force replaces only a converted model or an empty "
                              f"directory")
    if any(dst.iterdir()) and not (dst / CONFIG_FILE).is_file():
        raise FileExistsError(f"{dst} is a non-empty directory without {CONFIG_FILE}, not a converted model: "
                              f"--force replaces only a converted model or an empty directory")
    return dst


def _temporaries(dst: Path, suffix: str = ".partial") -> list[Path]:
    """The temporaries of conversions to exactly `dst`: `.NAME.<token>.partial` (not those of `NAME.v2`, say)."""
    pre = f".{dst.name}."
    return sorted(p for p in dst.parent.glob(f"{glob.escape(pre)}*{suffix}")
                  if "." not in p.name[len(pre):-len(suffix)])


def remove_stale(dst: Path) -> None:
    """Remove the temporaries of earlier conversions to `dst` whose process is gone (a killed run)."""
    for tmp in _temporaries(dst):
        if (pid := _abandoned(tmp)) is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s, left by an interrupted conversion (process %s)", tmp, pid)


def _abandoned(tmp: Path) -> str | None:
    """The owner (a pid, or INTERRUPTED) of a temporary that no process of this host writes any more; None if it
    is alive, of another host, or not ours to judge (no owner file)."""
    try:
        host, pid = (tmp / OWNER).read_text().split()
    except (OSError, ValueError):
        return None
    if host != socket.gethostname() or not (pid == INTERRUPTED or pid.isdigit() and not _alive(int(pid))):
        return None
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save(dst: str | Path, cfg: ModelConfig, params: dict, tokenizer=None, overwrite: bool = False,
         src: str | Path | None = None) -> Path:
    """Write a parameter tree held in memory (numpy or jax arrays) as a converted model."""
    items = [((p, ()), [Part(p, (), (), np.asarray(v))]) for p, v in flatten(params).items()]
    return write(dst, cfg, lambda done: iter(items), tokenizer, overwrite, src)


def write(dst: str | Path, cfg: ModelConfig, items_for, tokenizer=None, overwrite: bool = False,
          src: str | Path | None = None, job: dict | None = None) -> Path:
    """Write a converted model whose params come as a stream: items_for(done) -> iterator of (key, [Part]), a key
    (param path, index) per converted placement, leaving out the keys in `done` (those a resumed temporary already
    holds). job: what identifies this conversion (JSON-able); given, an interrupted run of it can be resumed."""
    dst = check_destination(dst, src, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = _take_over(dst, job) if job is not None else None
    remove_stale(dst)
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it 0700; the output follows the umask
        (tmp / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        if job is not None:
            (tmp / JOB).write_text(json.dumps(job))
    try:
        done = _verified_journal(tmp) if job is not None else {}
        if done:
            log.warning("resuming the conversion in %s: %d converted slices verified and kept", tmp, len(done))
        records = [r for parts in done.values() for r in parts]
        with open(tmp / JOURNAL, "a") as journal:
            _write_all(tmp / "params", items_for(set(done)), journal, records)
        if tokenizer is not None:
            tokenizer.save(tmp)
        if cfg.vision is not None and src is not None and (settings := multimodal.read_settings(src)) is not None:
            (tmp / multimodal.SETTINGS_FILE).write_text(json.dumps(settings, indent=1))  # how images are fed
        leaves = _leaf_checksums(tmp / "params", records)
        dtypes = sorted({r[2] for r in records})
        dtypes = [str(np.dtype(ST_DTYPES[d])) for d in dtypes]
        meta = {"format_version": FORMAT_VERSION, "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
                "config": cfg.to_dict(), "files": leaves}  # verified at load
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        for name in (JOURNAL, JOB, OWNER):
            (tmp / name).unlink(missing_ok=True)
        sync(tmp)  # on disk before it becomes dst (and before an old dst is removed)
        move_in(tmp, dst, (lambda d: check_destination(d, src, True)) if overwrite else None)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:  # interrupted: left to be resumed (or removed by the next conversion to dst)
        if not tmp.exists():  # interrupted after the rename: dst is complete
            raise
        if job is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            (tmp / OWNER).write_text(f"{socket.gethostname()} {INTERRUPTED}")
            log.warning("interrupted: %s kept; converting to %s again resumes it", tmp, dst)
        raise
    return dst


IN_FLIGHT = 256 << 20  # bytes of converted slices that may wait to be written while the next is produced


def _write_all(root: Path, items, journal, records: list) -> None:
    """Write each item's parts and journal them, in order, in a writer thread: the disk writes overlap the next
    tensors' reads and transforms. Items wait in a queue of at most the largest item's bytes so far (the disk stays
    busy through a slow transform) and at most IN_FLIGHT: they count towards host memory, so one larger than that
    is written before the next is produced (peak: about three tensors + IN_FLIGHT)."""
    stop = threading.Event()  # set by an error or an interruption: the writes queued behind it are not made

    def write(key, parts, crcs):
        if stop.is_set():
            return
        try:
            written = [_put(root, part, crc) for part, crc in zip(parts, crcs)]
        except BaseException:
            stop.set()
            raise
        records.extend(written)
        journal.write(json.dumps([[key[0], list(key[1])], written]) + "\n")
        journal.flush()

    with ThreadPoolExecutor(1, thread_name_prefix="write") as writer:
        queue, largest = collections.deque(), 0  # (future, bytes) in order
        try:
            for item in items:
                size = sum(p.value.nbytes for p in item[1])
                largest = max(largest, size)
                crcs = [_crc_pool().submit(zlib.crc32, _bytes(p.value)) for p in item[1]]  # ahead of the write
                queue.append((writer.submit(write, *item, crcs), size))
                del item
                while queue and sum(n for _, n in queue) > min(largest, IN_FLIGHT):
                    queue.popleft()[0].result()
            while queue:
                queue.popleft()[0].result()
        except BaseException:
            stop.set()
            raise


def _bytes(value: np.ndarray) -> np.ndarray:
    """A value's bytes in C order, as uint8 (ascontiguousarray would make a 0-d value 1-d)."""
    return np.require(value, requirements="C").reshape(-1).view(np.uint8)


def _put(root: Path, part: Part, crc=None) -> list:
    """Write one slice into its leaf file (created at its full size on first use); its journal record
    [leaf, leaf shape, dtype, offset, bytes, crc32]. crc: a future of the slice's CRC32, queued ahead (else taken
    here, beside the write)."""
    v = np.require(part.value, requirements="C")
    if v.dtype not in ST_NAMES:
        raise CheckpointError(f"{part.leaf}: cannot store values of dtype {v.dtype}")
    shape = tuple(part.lead) + v.shape
    head = leaf_header(part.leaf, shape, v.dtype)
    offset = len(head) + (int(np.ravel_multi_index(part.index, part.lead)) * v.nbytes if part.index else 0)
    file = root / (part.leaf + LEAF_SUFFIX)
    file.parent.mkdir(parents=True, exist_ok=True)
    data = _bytes(v)
    crc = crc or _crc_pool().submit(zlib.crc32, data)  # beside the write: the CPU's time overlaps the disk's
    fd = os.open(file, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        size = len(head) + math.prod(shape) * v.dtype.itemsize
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        _pwrite(fd, head, 0)
        a, b = -(-offset // PAGE) * PAGE, (offset + data.size) // PAGE * PAGE  # the whole pages of the slice
        if b - a < DIRECT_MIN or not _pwrite_direct(file, data[a - offset:b - offset], a):
            a = b = offset
        _pwrite(fd, data[:a - offset], offset)  # the partial pages at either end (or all of it) buffered
        _pwrite(fd, data[b - offset:], b)
    finally:
        os.close(fd)
        crc = crc.result()
    return [part.leaf, list(shape), ST_NAMES[v.dtype], offset, v.nbytes, crc]


@functools.cache
def _crc_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(1, thread_name_prefix="crc32")


def _pwrite(fd: int, data, offset: int) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], offset + done)


PAGE = 4096  # O_DIRECT's alignment of file offsets, lengths and memory (a multiple of every block size in use)
DIRECT_MIN = 1 << 20  # smaller slices are written through the page cache
BOUNCE = 16 << 20  # bytes of the aligned buffer an unaligned slice is copied through
_direct_ok = hasattr(os, "O_DIRECT")  # False once a file system refused it: then everything is buffered
DIRECT_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # how file systems say "no O_DIRECT here"
_bounce = threading.local()


def _pwrite_direct(file: Path, pages: np.ndarray, offset: int) -> bool:
    """Write whole pages at a page-aligned offset with O_DIRECT: the disk reads our buffer (DMA), nothing is copied
    into the page cache — on a 2-core host a buffered write runs at ~0.5 GB/s of CPU time, this at the disk's
    3+ GB/s. A slice whose memory is not page-aligned goes through an aligned bounce buffer. False (nothing
    needed undoing: the caller writes it all buffered) where the file system refuses O_DIRECT."""
    global _direct_ok
    if not _direct_ok:
        return False
    try:
        fd = os.open(file, os.O_WRONLY | os.O_DIRECT)
    except OSError as e:
        if e.errno not in DIRECT_REFUSED:
            raise
        _direct_ok = False
        return False
    try:
        if pages.ctypes.data % PAGE == 0:
            _pwrite(fd, pages, offset)
        else:
            bounce = getattr(_bounce, "buf", None)
            if bounce is None or bounce.size < BOUNCE:
                raw = np.empty(BOUNCE + PAGE, np.uint8)
                bounce = _bounce.buf = raw[-raw.ctypes.data % PAGE:][:BOUNCE]
            for i in range(0, pages.size, BOUNCE):
                n = min(BOUNCE, pages.size - i)
                bounce[:n] = pages[i:i + n]
                _pwrite(fd, bounce[:n], offset + i)
    except OSError as e:
        if e.errno not in DIRECT_REFUSED:
            raise
        _direct_ok = False  # accepted at open, refused at write (some FUSE and network file systems)
        return False
    finally:
        os.close(fd)
    return True


def _leaf_checksums(root: Path, records: list) -> dict[str, list[int]]:
    """{leaf file: [size, crc32]}, combined from the header's and the slices' CRC32s; a leaf whose slices do not
    tile it exactly (one placed twice, or with gaps) is an error."""
    by_leaf: dict[str, list] = {}
    for r in records:
        by_leaf.setdefault(r[0], []).append(r)
    out = {}
    for leaf, rs in sorted(by_leaf.items()):
        shapes = {(tuple(r[1]), r[2]) for r in rs}
        if len(shapes) > 1:
            raise CheckpointError(f"{leaf}: its slices disagree on the stacked shape and dtype: {sorted(shapes)}")
        (shape, dtype), = shapes
        head = leaf_header(leaf, shape, ST_DTYPES[dtype])
        crc, end = zlib.crc32(head), len(head)
        for _, _, _, offset, nbytes, part in sorted(rs, key=lambda r: r[3]):
            if offset != end:
                raise CheckpointError(f"{leaf}: slices written {'twice' if offset < end else 'with a gap'} at byte "
                                      f"{offset}")
            crc, end = combine(crc, part, nbytes), end + nbytes
        if end != len(head) + math.prod(shape) * np.dtype(ST_DTYPES[dtype]).itemsize:
            raise CheckpointError(f"{leaf}: only {end - len(head)} of its bytes were written")
        out[leaf + LEAF_SUFFIX] = [end, crc]
    return out


def _take_over(dst: Path, job: dict) -> Path | None:
    """The temporary of an interrupted conversion of `job` to `dst` whose process is gone, renamed to a name of
    ours (atomic: of two racing resumers one wins) and owned by this process; None if there is none."""
    for tmp in _temporaries(dst):
        try:
            if _abandoned(tmp) is None or json.loads((tmp / JOB).read_text()) != job:
                continue
        except (OSError, ValueError):
            continue
        mine = dst.parent / f".{dst.name}.{secrets.token_hex(6)}.partial"
        try:
            os.rename(tmp, mine)
        except OSError:
            continue  # another resumer took it
        (mine / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        return mine
    return None


def _verified_journal(tmp: Path) -> dict[tuple, list]:
    """{key: records} of the journaled slices still in their files byte for byte (read back, CRC32 compared);
    a torn last line, a missing or resized file or a differing CRC32 means that slice is converted again."""
    done = {}
    try:
        lines = (tmp / JOURNAL).read_text().splitlines()
    except FileNotFoundError:
        return done
    for line in lines:
        try:
            (path, index), recs = json.loads(line)
            key = (path, tuple(index))
            ok = all(_holds(tmp / "params", *r) for r in recs)
        except (ValueError, TypeError, KeyError, OSError):
            continue
        if ok:
            done[key] = recs
    return done


def _holds(root: Path, leaf: str, shape, dtype: str, offset: int, nbytes: int, crc: int) -> bool:
    file = root / (leaf + LEAF_SUFFIX)
    head = leaf_header(leaf, tuple(shape), ST_DTYPES[dtype])
    if file.stat().st_size != len(head) + math.prod(shape) * np.dtype(ST_DTYPES[dtype]).itemsize:
        return False
    fd = os.open(file, os.O_RDONLY)
    try:
        buf = np.empty(nbytes, np.uint8)
        return os.pread(fd, len(head), 0) == head and read_into(fd, buf, offset, 0) == crc
    finally:
        os.close(fd)


def move_in(tmp: Path, dst: Path, recheck=None, doing: str = "converting") -> None:
    """rename(tmp, dst), durably: fails if a non-empty dst appeared (an empty directory is replaced: nothing is
    lost). recheck(dst), given when replacing is allowed, raises unless what is there is still ours to replace;
    it is then set aside first and removed once tmp is in place."""
    aside = None
    if recheck is not None and (dst.exists() or dst.is_symlink()):
        recheck(dst)
        aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.rename(dst, aside / "old")
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if aside is not None:
            os.rename(aside / "old", dst)
            aside.rmdir()
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(f"{dst} appeared while {doing} (another conversion or export writing it?); left "
                                  f"it as it is, nothing written") from None
        raise
    _fsync(dst.parent)  # the rename is durable before the old copy goes
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _fsync(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync(root: Path) -> None:
    """fsync every file and directory under root: the data is on disk before a rename publishes it."""
    for d, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(d, name))
        _fsync(d)


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
