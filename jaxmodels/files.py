"""Opening the files of a checkpoint directory that may be hostile: inside it, regular, of bounded size."""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePath

MAX_METADATA_BYTES = 16 << 20  # config.json, tokenizer_config.json, chat_template.jinja (real ones: <= ~2 MB)
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json: ~80 bytes a tensor (DeepSeek-V3 size: ~10 MB)
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json (the largest vocabularies: ~35 MB)


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported; the message names the file or tensor."""


REPO_ID = re.compile(r"^([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")  # org/name or org/name@revision


def locate(src: str | Path) -> Path:
    """The checkpoint `src` names: a path that exists, or a Hugging Face repo id (`org/name`, `org/name@rev`
    with a branch, tag or commit) whose snapshot is in the local hub cache ($HF_HUB_CACHE, else
    huggingface_hub's default). Never downloads (no network at run time). A snapshot downloaded in part
    (`hf download --include ...`) counts: the import names any file it lacks. FileNotFoundError, in one line,
    when it is neither."""
    path = Path(src)
    if path.exists():
        return path
    m = REPO_ID.match(str(src))
    if m is None:
        raise FileNotFoundError(f"checkpoint {src} does not exist")
    from huggingface_hub.constants import HF_HUB_CACHE

    cache = Path(os.environ.get("HF_HUB_CACHE") or HF_HUB_CACHE)
    repo, rev = cache / ("models--" + m[1].replace("/", "--")), m[2] or "main"
    # the hub cache's layout: refs/<branch or tag> holds the commit, snapshots/<commit>/ the files
    ref = repo / "refs" / rev
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else (ref.read_text().strip() if ref.is_file() else None)
    snapshot = repo / "snapshots" / commit if commit and ".." not in Path(commit).parts else None
    if snapshot is None or not snapshot.is_dir():
        raise FileNotFoundError(f"checkpoint {src}: no such path, and {m[1]}{'@' + m[2] if m[2] else ''} is not in "
                                f"the local Hugging Face cache {cache} (download it first, e.g. `hf download "
                                f"{m[1]}`; nothing is fetched at run time)")
    return snapshot


def _area(root: Path) -> Path:
    """Where the files of checkpoint directory `root` may resolve to.

    The rule: a file is read only if its path, every symlink followed, lies inside `root` (itself resolved
    first, so `root` may be a link) -- or, for a snapshot of the Hugging Face hub cache
    (`models--org--name/snapshots/<rev>/...`, whose files are links to `../../blobs/<hash>`), inside that
    `models--org--name` folder. A file a user names directly (a .gguf, a .bin) is the checkpoint itself and may
    be a link to anywhere; every file must be a regular file (no FIFO, device or directory).
    """
    real = root.resolve()
    for p in (real, *real.parents):
        if p.name == "snapshots" and p.parent.name.startswith("models--"):
            return p.parent
    return real


def regular(path: str | Path) -> Path:
    """`path`, checked to be a regular file (after any links)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{path}: not a regular file")
    return Path(path)


def find(root: str | Path, name: str) -> Path | None:
    """`root / name`, checked; None if there is no such file (or only a dangling link).
    CheckpointError if `name` is not a relative name without `..`, or the file breaks the rule of `_area`."""
    root = Path(root)
    if not isinstance(name, str) or PurePath(name).is_absolute() or ".." in PurePath(name).parts:
        raise CheckpointError(f"{root}: {name!r} is not the name of a file inside the checkpoint")
    path = root / name
    if not os.path.lexists(path) or not os.path.exists(path):
        return None
    if not path.resolve().is_relative_to(_area(root)):
        raise CheckpointError(f"{path}: resolves to {path.resolve()}, outside the checkpoint directory {root}")
    return regular(path)


def read_text(path: Path, limit: int) -> str:
    """The UTF-8 text of file `path`, refused if it is longer than `limit` bytes or not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks: on a FIFO swapped in, fstat below refuses it
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        data = f.read(limit + 1) if st.st_size <= limit else b""
    if st.st_size > limit or len(data) > limit:
        raise CheckpointError(f"{path}: {max(st.st_size, len(data)):,} bytes, more than the {limit:,} such a file "
                              f"may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text ({e})") from None


def read_json(path: Path, limit: int) -> dict:
    """The JSON object in file `path` (see `read_text`); CheckpointError if it is not one."""
    try:
        obj = json.loads(read_text(path, limit))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return obj
