"""Memory-mapped reading of HF safetensors checkpoints (single file or sharded index), one tensor at a time."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open

from converters.deepseek_quant import read_safetensors_header
from jaxmodels import files
from jaxmodels.checkpoint import ST_DTYPES as _OUR_DTYPES, read_range
from jaxmodels.files import CheckpointError

ST_DTYPES = _OUR_DTYPES | {"F8_E8M0": np.uint8}  # E8M0 scales stay raw bytes (see converters/deepseek_quant.py)

__all__ = ["CheckpointError", "SafetensorsReader", "TorchReader"]
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on a file's JSON header


def _check_complete(path: Path) -> None:
    """Fail clearly on a truncated file: the header promises more bytes than the file holds."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: a safetensors header of {n:,} bytes (at most {MAX_HEADER_BYTES:,})")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, AttributeError, LookupError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({type(e).__name__}: {e})") from None
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, tensors end at {8 + n + end})")


class SafetensorsReader:
    """`keys()` and `get(name)`: one tensor read into a fresh array (`read_range`: O_DIRECT, no map of the file
    stays resident, so host memory holds only what the caller keeps); `get_slice` reads through the memory map."""

    def __init__(self, root: str | Path):
        root = self._root = Path(root)
        if index := files.find(root, INDEX):
            weight_map = files.read_json(index, files.MAX_INDEX_BYTES).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index}: weight_map is not an object of tensor name -> file name")
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("consolidated"))
            if not names:
                raise CheckpointError(f"{root}: no *.safetensors files")
            weight_map = None
        self._handles, self._where = {}, {}
        for name in names:
            path = files.find(root, name)
            if path is None:
                raise CheckpointError(f"{root / name}: " + ("a dangling link" if weight_map is None else
                                                            "listed in the index but missing"))
            _check_complete(path)
            h = safe_open(str(path), framework="np")
            self._handles[name] = h
            for key in h.keys():
                if weight_map is not None and key in weight_map:
                    if weight_map[key] != name:
                        continue  # the index says which file holds it
                elif key in self._where:
                    raise CheckpointError(f"tensor {key!r} is in two files, {self._where[key]} and {name}"
                                          + ("" if weight_map is None else ", and the index names neither"))
                self._where[key] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise CheckpointError(f"tensors listed in the index are not in their files: {missing[:5]}")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def nbytes(self, name: str) -> int:
        a, b = self._entry(name)[0]["data_offsets"]
        return b - a

    def _entry(self, name: str) -> tuple[dict, int, Path]:
        path = self._root / self._where[name]
        header, base = read_safetensors_header(path)
        return header[name], base, path

    def get(self, name: str) -> np.ndarray:
        """F8_E4M3 as float8_e4m3fn, F8_E8M0 as its raw bytes (uint8: see converters/deepseek_quant.py)."""
        meta, base, path = self._entry(name)
        if meta["dtype"] not in ST_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {meta['dtype']}")
        a, _ = meta["data_offsets"]
        dtype, shape = np.dtype(ST_DTYPES[meta["dtype"]]), tuple(meta["shape"])
        try:  # its whole pages read with O_DIRECT
            return read_range(path, base + a, math.prod(shape) * dtype.itemsize).view(dtype).reshape(shape)
        except ValueError as e:
            raise CheckpointError(f"{path}: tensor {name!r}: {e}") from None

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the bytes of `index` are read from the memory map."""
        return self._handles[self._where[name]].get_slice(name)[index]


class TorchReader:
    """PyTorch `.bin` / `.pt` state dicts, loaded with `weights_only=True` and memory-mapped."""

    def __init__(self, root: str | Path):
        import torch  # optional dependency: only this format needs it

        root = Path(root)
        if root.is_file():
            paths = [files.regular(root)]
        else:
            paths = [files.find(root, p.name) for p in sorted(root.iterdir())
                     if p.suffix in (".bin", ".pt", ".pth") and not p.name.startswith("training")]
            paths = [p for p in paths if p is not None]  # dangling links
        if not paths:
            raise CheckpointError(f"{root}: no .bin/.pt files")
        self._tensors = {}
        for f in paths:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises many kinds; name the file
                raise CheckpointError(f"{f}: cannot read PyTorch checkpoint ({e})") from None
            self._tensors.update(sd)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def nbytes(self, name: str) -> int:
        t = self._tensors[name]
        return t.numel() * t.element_size()

    def get(self, name: str) -> np.ndarray:
        import ml_dtypes
        import torch

        t = self._tensors[name]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]
