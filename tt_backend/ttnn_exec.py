"""Run a TT program (`tt_backend.program`) with the real `ttnn`, on a Tenstorrent device.

`ttnn` is imported lazily, only when an executor is built: the project's environment has no ttnn
(its wheel needs numpy<2 and a separate Python) and device ops without a chip crash the interpreter.
Use it only where `device_available()` is true.

    ex = TTNNExecutor.open()                        # ttnn.open_device(device_id=0)
    w = ex.load(weights, prog.tensors)              # host float32 arrays -> device (host packing: from_torch)
    kv = ex.allocate_state(prog.tensors, num_blocks)  # zeroed paged caches "kv.<i>.k/v"
    t = ex.run(prog, inputs, {**w, **kv})           # every named tensor (device tensors)
    logits = ex.to_numpy(t[prog.outputs[0]])

Mapping a `TTCall` to ttnn:
- `op` is the dotted ttnn name ("ttnn.experimental.paged_update_cache"), looked up attribute by
  attribute on the ttnn module; `inputs` are passed positionally, `kwargs` by keyword;
- values: `Ref(name)` -> that tensor; strings "ttnn.X[.Y]" -> the ttnn attribute (dtypes, layouts,
  enums such as "ttnn.MathFidelity.HiFi2", "ttnn.UnaryOpType.SILU"); a bare "*_MEMORY_CONFIG" name under
  a `memory_config` key -> `ttnn.<name>`; a dict with "type" -> that config class built from the other
  keys (e.g. `ttnn.WormholeComputeKernelConfig`); lists element-wise; other JSON values as they are;
- outputs: none (in-place cache ops), one tensor, or a tuple unpacked in order.
Every call is checked against the ttnn API extracted from the wheel (`tt_backend.api`) before it is
made, so a program the pinned ttnn would reject fails with a clear error instead of deep in C++.

Not verified on hardware (no device here): that the sharded memory-config names the lowering uses
("L1_WIDTH_SHARDED_MEMORY_CONFIG" without a shard spec) are accepted by every op, and the numbers.
The `tt_device` tests in tests/tt/test_ttnn_exec.py are the place for that.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from tt_backend import api
from tt_backend.program import Ref, TTProgram, TTTensorSpec

__all__ = ["TTNNExecError", "TTNNExecutor", "import_ttnn", "device_available"]

_MEMORY_CONFIG = re.compile(r"^[A-Z0-9_]+_MEMORY_CONFIG$")
_INT_DTYPES = ("ttnn.uint32", "ttnn.int32", "ttnn.uint16", "ttnn.uint8")


class TTNNExecError(RuntimeError):
    """A program that cannot be mapped onto ttnn calls (unknown op/constant, bad inputs)."""


def import_ttnn():
    try:
        import ttnn
    except ImportError as e:  # the usual case off-device
        raise ImportError("tt_backend.ttnn_exec needs the `ttnn` package (Tenstorrent wheel, CPython 3.10/3.12, "
                          "numpy<2) and a Tenstorrent device") from e
    return ttnn


def device_available(ttnn=None) -> bool:
    """True when ttnn imports and reports at least one device. Never opens a device."""
    try:
        ttnn = ttnn or import_ttnn()
        return len(ttnn.get_device_ids()) > 0
    except Exception:
        return False


class TTNNExecutor:
    def __init__(self, device, *, ttnn=None, check_api: bool = True):
        self.ttnn = ttnn if ttnn is not None else import_ttnn()
        self.device = device
        self.check_api = check_api

    @classmethod
    def open(cls, device_id: int = 0, **kw) -> "TTNNExecutor":
        ttnn = import_ttnn()
        if not device_available(ttnn):
            raise TTNNExecError("no Tenstorrent device (ttnn.get_device_ids() is empty)")
        return cls(ttnn.open_device(device_id=device_id), ttnn=ttnn, **kw)

    def close(self) -> None:
        if self.device is not None:
            self.ttnn.close_device(self.device)
            self.device = None

    # ------------------------------------------------------------------------- name mapping
    def attr(self, dotted: str, where: str = "") -> Any:
        """'ttnn.a.b' -> ttnn.a.b, with a clear error naming the call."""
        if not dotted.startswith("ttnn."):
            raise TTNNExecError(f"{where}{dotted!r} is not a ttnn name")
        obj = self.ttnn
        for part in dotted.split(".")[1:]:
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise TTNNExecError(f"{where}ttnn has no {dotted!r}") from None
        return obj

    def resolve(self, value: Any, tensors: Mapping[str, Any], key: str = "", where: str = "") -> Any:
        """A program kwarg value -> the ttnn object it names (see module doc)."""
        if isinstance(value, Ref):
            if value.name not in tensors:
                raise TTNNExecError(f"{where}keyword {key!r} refers to tensor {value.name!r}, which does not exist yet")
            return tensors[value.name]
        if isinstance(value, str):
            if value.startswith("ttnn."):
                return self.attr(value, where)
            if key.endswith("memory_config") and _MEMORY_CONFIG.match(value):
                return self.attr("ttnn." + value, where)
            return value
        if isinstance(value, dict):
            if "type" not in value:
                raise TTNNExecError(f"{where}keyword {key!r}: a config dict needs a 'type' (e.g. "
                                    f"'ttnn.WormholeComputeKernelConfig'), got keys {sorted(value)}")
            cls = self.attr(value["type"], where)
            kw = {k: self.resolve(v, tensors, k, where) for k, v in value.items() if k != "type"}
            if self.check_api:
                allowed = api.type_keywords(value["type"])
                bad = sorted(set(kw) - set(allowed))
                if bad:
                    raise TTNNExecError(f"{where}{value['type']} takes no {', '.join(bad)} (takes {', '.join(allowed)})")
            return cls(**kw)
        if isinstance(value, (list, tuple)):
            return [self.resolve(v, tensors, key, where) for v in value]
        return value

    # --------------------------------------------------------------------- host <-> device
    def to_device(self, array, spec: TTTensorSpec, name: str = "tensor"):
        """Host array -> device tensor of `spec` (ttnn's host conversion packs bf16/bfp here)."""
        import torch

        a = np.asarray(array)
        want = tuple(s for s in spec.shape)
        if len(a.shape) != len(want) or any(w is not None and w != g for w, g in zip(want, a.shape)):
            raise TTNNExecError(f"{name}: host array of shape {a.shape} does not match its spec shape {spec.shape}")
        a = a.astype(np.int32) if spec.dtype in _INT_DTYPES else a.astype(np.float32)
        mem = self.attr("ttnn." + spec.memory if not spec.memory.startswith("ttnn.") else spec.memory, f"{name}: ")
        return self.ttnn.from_torch(torch.from_numpy(np.ascontiguousarray(a)), dtype=self.attr(spec.dtype),
                                    layout=self.attr(spec.layout), device=self.device, memory_config=mem)

    def to_numpy(self, tensor) -> np.ndarray:
        t = self.ttnn.to_torch(tensor)
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    def load(self, arrays: Mapping[str, np.ndarray], specs: Mapping[str, TTTensorSpec]) -> dict:
        """Host arrays (weights, inputs) -> device tensors, each by its spec."""
        missing = sorted(set(arrays) - set(specs))
        if missing:
            raise TTNNExecError(f"no tensor spec for {', '.join(missing)}")
        return {n: self.to_device(a, specs[n], n) for n, a in arrays.items()}

    def allocate_state(self, specs: Mapping[str, TTTensorSpec], num_blocks: int) -> dict:
        """Zeroed persistent buffers (kind "state": the paged KV caches), `None` dims = num_blocks."""
        out = {}
        for n, s in specs.items():
            if s.kind == "state":
                shape = tuple(num_blocks if d is None else d for d in s.shape)
                out[n] = self.to_device(np.zeros(shape, np.float32), TTTensorSpec(shape, shape, s.dtype, s.layout,
                                                                                   s.memory, s.kind), n)
        return out

    # --------------------------------------------------------------------------------- run
    def run(self, prog: TTProgram, inputs: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict:
        """Execute `prog`. `inputs`: the program's per-run inputs (host arrays or device tensors);
        `tensors`: weights and state already on device. Returns every named tensor."""
        if set(inputs) != set(prog.inputs):
            raise TTNNExecError(f"program inputs are {sorted(prog.inputs)}, got {sorted(inputs)}")
        t = dict(tensors)
        for n, v in inputs.items():
            t[n] = self.to_device(v, prog.tensors[n], n) if isinstance(v, np.ndarray) else v
        need = {r for c in prog.calls for r in c.refs()} - {o for c in prog.calls for o in c.outputs}
        absent = sorted(need - set(t))
        if absent:
            raise TTNNExecError(f"tensors the program reads but nobody supplied: {', '.join(absent[:10])}"
                                f"{' ...' if len(absent) > 10 else ''}")
        for i, c in enumerate(prog.calls):
            where = f"call {i} ({c.op}): "
            if self.check_api:
                try:
                    api.check_call(c.op, list(c.kwargs), n_positional=len(c.inputs))
                except api.TTApiError as e:
                    raise TTNNExecError(f"{where}{e}") from None
            fn = self.attr(c.op, where)
            for x in c.inputs:
                if x not in t:
                    raise TTNNExecError(f"{where}input {x!r} does not exist yet")
            kw = {k: self.resolve(v, t, k, where) for k, v in c.kwargs.items()}
            res = fn(*[t[x] for x in c.inputs], **kw)
            if len(c.outputs) == 1:
                t[c.outputs[0]] = res
            elif len(c.outputs) > 1:
                res = tuple(res)
                if len(res) != len(c.outputs):
                    raise TTNNExecError(f"{where}returned {len(res)} tensors, the program names {len(c.outputs)}")
                t.update(zip(c.outputs, res))
        return t
