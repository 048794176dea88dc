"""Memory-mapped reading of HF safetensors checkpoints (single file or sharded index), one tensor at a time."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported; the message names the file or tensor."""


def _check_complete(path: Path) -> None:
    """Fail clearly on a truncated file: the header promises more bytes than the file holds."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
            header = json.loads(f.read(n))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, tensors end at {8 + n + end})")


class SafetensorsReader:
    """`keys()` and `get(name)`: a numpy copy of one tensor, read through the file's memory map."""

    def __init__(self, root: str | Path):
        root = self._root = Path(root)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in root.glob("*.safetensors") if not p.name.startswith("consolidated"))
            if not files:
                raise CheckpointError(f"{root}: no *.safetensors files")
            weight_map = None
        self._handles, self._where = {}, {}
        for name in files:
            path = root / name
            if not path.exists():
                raise CheckpointError(f"{path}: listed in the index but missing")
            _check_complete(path)
            h = safe_open(str(path), framework="np")
            self._handles[name] = h
            for key in h.keys():
                self._where[key] = name
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self._where))
            if missing:
                raise CheckpointError(f"tensors listed in the index are not in their files: {missing[:5]}")

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        try:
            return self._handles[self._where[name]].get_tensor(name)
        except AttributeError:  # F8_E4M3 / F8_E8M0 (DeepSeek): safetensors.numpy has no such dtypes; read the raw bytes
            from converters.deepseek_quant import read_safetensors_tensor

            return read_safetensors_tensor(self._root / self._where[name], name)

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the bytes of `index` are read from the memory map."""
        return self._handles[self._where[name]].get_slice(name)[index]


class TorchReader:
    """PyTorch `.bin` / `.pt` state dicts, loaded with `weights_only=True` and memory-mapped."""

    def __init__(self, root: str | Path):
        import torch  # optional dependency: only this format needs it

        root = Path(root)
        files = [root] if root.is_file() else sorted(
            p for p in root.iterdir() if p.suffix in (".bin", ".pt", ".pth") and not p.name.startswith("training"))
        if not files:
            raise CheckpointError(f"{root}: no .bin/.pt files")
        self._tensors = {}
        for f in files:
            try:
                sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # noqa: BLE001 - torch raises many kinds; name the file
                raise CheckpointError(f"{f}: cannot read PyTorch checkpoint ({e})") from None
            self._tensors.update(sd)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        import ml_dtypes
        import torch

        t = self._tensors[name]
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def get_slice(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]
