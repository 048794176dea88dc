"""ttnn host-conversion oracle. Runs ONLY in a Python 3.12 venv with ttnn==0.81.1 and torch
(never in the project venv: ttnn needs numpy<2). No Tenstorrent hardware needed: a mock Wormhole
N150 cluster descriptor makes ttnn's host-side tensor conversion work; no device op is ever called.

Library use:  ``from oracle import roundtrip, tile_bytes, bf16``  (after ``sys.path`` points here).
              Inputs are NumPy arrays or torch tensors; ``bf16(bits)`` makes a ``torch.bfloat16``
              tensor from uint16 bit patterns (NumPy has no bfloat16, and going through torch's
              float32 -> bf16 cast would rewrite NaNs).
CLI use:      ``python oracle.py IN.npz OUT.npz``; IN holds arrays ``x:<case>`` (any NumPy dtype)
              and ``bf16:<case>`` (uint16 bit patterns of a bfloat16 input), plus optional
              ``dtypes`` (list of names); OUT gets ``<case>:<dtype>`` = float32 round trip and
              ``<case>:<dtype>:bytes`` = uint8 tile byte image. Used by tests/tt/test_formats.py.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TT_METAL_MOCK_CLUSTER_DESC_PATH", os.path.join(HERE, "wormhole_n150_mock.yaml"))
os.environ.setdefault("LOGURU_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import ttnn  # noqa: E402

DTYPES = {"bfloat16": ttnn.bfloat16, "bfloat8_b": ttnn.bfloat8_b, "bfloat4_b": ttnn.bfloat4_b,
          "float32": ttnn.float32}


def versions():
    from importlib.metadata import version
    return {"ttnn": version("ttnn"), "torch": torch.__version__, "numpy": np.__version__}


def bf16(bits):
    """A torch.bfloat16 tensor holding exactly the uint16 bit patterns ``bits``."""
    bits = np.require(np.asarray(bits, dtype=np.uint16), requirements="C")
    return torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)


def _from(x, dtype, pad_value=None):
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(np.require(x, requirements="C"))  # (ascontiguousarray would make 0-d 1-d)
    return ttnn.from_torch(x.contiguous(), dtype=DTYPES[dtype], layout=ttnn.TILE_LAYOUT, pad_value=pad_value)


def roundtrip(x, dtype, pad_value=None):
    """ttnn.to_torch(ttnn.from_torch(x, dtype, TILE_LAYOUT)) as a float32 ndarray."""
    y = ttnn.to_torch(_from(x, dtype, pad_value))
    return y.to(torch.float32).numpy()


def tile_bytes(x, dtype, pad_value=None):
    """The host buffer of the TILE-layout tensor: raw bytes, tiles in order."""
    t = _from(x, dtype, pad_value)
    return np.array(np.from_dlpack(t.host_buffer().get_shard(ttnn.MeshCoordinate(0, 0))), dtype=np.uint8)


def main(argv):
    src, dst = argv
    inp = np.load(src, allow_pickle=False)
    dtypes = [str(d) for d in inp["dtypes"]] if "dtypes" in inp else list(DTYPES)
    out = {}
    for key in inp.files:
        kind, _, case = key.partition(":")
        if kind not in ("x", "bf16"):
            continue
        x = bf16(inp[key]) if kind == "bf16" else inp[key]
        for d in dtypes:
            out[f"{case}:{d}"] = roundtrip(x, d)
            out[f"{case}:{d}:bytes"] = tile_bytes(x, d)
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1:])
