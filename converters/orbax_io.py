"""The converted-model directory, write side (read side: jaxmodels/checkpoint.py): `jaxmodels.json` (config),
`params/` (orbax), tokenizer files.

Nothing we did not create is deleted or overwritten. `check_destination` runs before any import work: an
existing destination needs overwrite, and even then only an empty directory or one of our own converted
outputs is replaced, never the source or a directory that contains it. The output is written into a temporary
sibling (`.<name>.*.partial`, with an `owner` file naming its process) and moved in at the end: a rename that
fails if something appeared at the destination meanwhile (two converts to one destination: one wins, the other
fails), or with overwrite the old output set aside, the new one moved in, the old one removed. Temporaries of
conversions whose process has died (killed runs) are removed by the next conversion to that destination.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxmodels.checkpoint import CONFIG_FILE, FORMAT_VERSION, checksums
from jaxmodels.config import ModelConfig

log = logging.getLogger(__name__)
OWNER = "owner"  # in a temporary output: "host pid"


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


def remove_stale(dst: Path) -> None:
    """Remove the temporaries of earlier conversions to `dst` whose process is gone (a killed run)."""
    host = socket.gethostname()
    for tmp in dst.parent.glob(f".{dst.name}.*.partial"):
        try:
            who_host, pid = (tmp / OWNER).read_text().split()
        except (OSError, ValueError):
            continue  # not ours to judge (no owner file): left alone
        if who_host == host and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("removed %s, left by an interrupted conversion (process %s)", tmp, pid)


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
    dst = check_destination(dst, src, overwrite)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it 0700; the output follows the umask
        (tmp / OWNER).write_text(f"{socket.gethostname()} {os.getpid()}")
        ckpt = ocp.StandardCheckpointer()
        ckpt.save(tmp / "params", params)
        ckpt.wait_until_finished()
        if tokenizer is not None:
            tokenizer.save(tmp)
        dtypes = sorted({str(a.dtype) for a in jax.tree.leaves(params)})
        meta = {"format_version": FORMAT_VERSION, "dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
                "config": cfg.to_dict(), "files": checksums(tmp / "params")}  # verified at load
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
        (tmp / OWNER).unlink()
        _move_in(tmp, dst, overwrite, src)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _move_in(tmp: Path, dst: Path, overwrite: bool, src) -> None:
    """rename(tmp, dst): fails if a non-empty dst appeared (an empty directory is replaced: nothing is lost);
    with overwrite, what is there (checked again: still ours) is set aside first and removed after."""
    aside = None
    if overwrite and dst.exists():
        check_destination(dst, src, overwrite)
        aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
        os.rename(dst, aside / "old")
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if aside is not None:
            os.rename(aside / "old", dst)
            aside.rmdir()
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(f"{dst} appeared while converting (another conversion to it?); left it as it "
                                  f"is, nothing written") from None
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
