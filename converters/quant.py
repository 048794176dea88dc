"""Block-scaled quantized weights -> float arrays (NumPy + ml_dtypes), exactly as the references decode them."""
from __future__ import annotations

import math

import numpy as np

from jaxmodels.layers import qdq

FP4_VALUES = qdq.FP4_TABLE  # e2m1 code -> value; low nibble = element 2j, high = element 2j+1 (hf_families.md §3.7)


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4: blocks [..., G, 16] uint8 (two codes per byte), scales [..., G] E8M0 -> float32 [..., G*32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} (expected [..., G, 16])")
    lead, g = blocks.shape[:-2], blocks.shape[-2]
    return qdq.dequant_fp4(blocks.reshape(*lead, 1, g * 16), scales[..., None, :], 32, np.float32).reshape(*lead, g * 32)


class MXFP4Reader:
    """Wraps a reader: each `X_blocks` + `X_scales` pair appears as one tensor `X` of the dequantized shape.

    GPT-OSS experts are stored [E, out, in/32, 16]; HF's parameter is the transpose, [E, in, out]
    (`convert_moe_packed_tensors`), which is what this yields, decoded; kept quantized (`keep`), it yields a
    `Quantized` record of the bytes instead: {"/fp4": [E, out, in/2] packed codes, "/scale": [E, out, in/32] E8M0},
    the [out, in] layout `qdq.dequant_fp4` and the FP4 kernels read.
    """

    def __init__(self, reader, keep: bool = False):
        self.reader, self.keep = reader, keep
        keys = set(reader.keys())
        # HF spells the pair `X_blocks` / `X_scales`, OpenAI's original checkpoint `X.blocks` / `X.scales`
        self._pairs = {}  # base name -> (blocks name, scales name)
        for k in sorted(keys):
            for sep in ("_", "."):
                if k.endswith(sep + "blocks"):
                    base = k[: -len(sep + "blocks")]
                    if base + sep + "scales" not in keys:
                        raise ValueError(f"{k} has no {base}{sep}scales beside it")
                    self._pairs[base] = (k, base + sep + "scales")
        hidden = {n for pair in self._pairs.values() for n in pair}
        self._keys = [k for k in reader.keys() if k not in hidden] + list(self._pairs)

    def keys(self):
        return list(self._keys)

    def shape(self, name):
        if name in self._pairs:
            *lead, out, g, _ = self.reader.shape(self._pairs[name][0])
            return (*lead, g * 32, out)
        return self.reader.shape(name)

    @property
    def pairs(self) -> int:
        """How many quantized tensors (block + scale pairs) the checkpoint holds."""
        return len(self._pairs)

    def kept(self) -> MXFP4Reader:
        """The same checkpoint, its MXFP4 tensors kept as bytes."""
        return MXFP4Reader(self.reader, keep=True)

    def held_bytes(self, name):
        """What get(name) holds (hf.read_bytes): a decoded pair in float32, anything else as stored."""
        if name in self._pairs and not self.keep:
            return math.prod(self.shape(name)) * 4
        return self.nbytes(name)

    def nbytes(self, name):
        if name in self._pairs:
            return sum(self.reader.nbytes(n) for n in self._pairs[name]) if hasattr(self.reader, "nbytes") else 0
        return self.reader.nbytes(name) if hasattr(self.reader, "nbytes") else 0

    def get_slice(self, name, index):
        if name in self._pairs and self.keep:
            raise ValueError(f"{name}: MXFP4 kept as bytes is read whole, not in slices (convert it, then load "
                             "the converted directory onto a mesh)")
        if name in self._pairs:  # MXFP4 is decoded whole
            return self.get(name)[index]
        return self.reader.get_slice(name, index)

    def get(self, name):
        if name in self._pairs:
            blocks, scales = self._pairs[name]
            if self.keep:
                return self._bytes(name, self.reader.get(blocks), self.reader.get(scales))
            w = mxfp4_decode(self.reader.get(blocks), self.reader.get(scales))
            return np.swapaxes(w, -1, -2)
        return self.reader.get(name)

    def _bytes(self, name, blocks, scales):
        from converters.deepseek_quant import E8M0
        from converters.hf import Quantized, nonfinite
        from converters.safetensors_io import CheckpointError

        blocks, scales = np.asarray(blocks), np.asarray(scales)
        if blocks.dtype.itemsize != 1 or scales.dtype.itemsize != 1 or blocks.shape[:-1] != scales.shape \
                or blocks.shape[-1] != 16:
            raise CheckpointError(f"{name}: MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales "
                                  f"{scales.dtype}{list(scales.shape)} are not bytes [..., G, 16] and [..., G]")
        if bad := nonfinite(scales.view(np.uint8).view(E8M0)):  # kept as bytes: refused here, as DeepSeek's are
            raise CheckpointError(f"{self._pairs[name][1]}: {bad} NaN scales (E8M0 byte 0xff)")
        codes = blocks.view(np.uint8).reshape(*blocks.shape[:-2], -1)  # [..., out, in/2]
        return Quantized({"/fp4": codes, "/scale": scales.view(np.uint8)})
