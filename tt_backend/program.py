"""A TT program: an explicit, serialisable list of ttnn calls.

`TTCall.op` is the ttnn function's dotted name ("ttnn.linear"); `inputs` are the names of the
tensors passed positionally; `kwargs` are keyword arguments, where a `Ref` names a tensor (e.g.
`rms_norm(x, weight=Ref("layers.0.attn_norm"))`) and everything else is a JSON value (strings
such as "ttnn.bfloat8_b" for dtypes, dicts for compute kernel configs); `outputs` names the results.
Every tensor a program touches has a `TTTensorSpec` in `TTProgram.tensors`. `TTModelProgram`
holds the prefill and decode programs of one model plus the weight specs they share.

Executors (`tt_backend.emu`, `tt_backend.ttnn_exec`) read only this structure.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

DTYPES = ("ttnn.float32", "ttnn.bfloat16", "ttnn.bfloat8_b", "ttnn.bfloat4_b", "ttnn.uint32", "ttnn.int32",
          "ttnn.uint16")
LAYOUTS = ("ttnn.TILE_LAYOUT", "ttnn.ROW_MAJOR_LAYOUT")


@dataclass(frozen=True)
class Ref:
    """A tensor passed as a keyword argument."""

    name: str


@dataclass(frozen=True)
class TTTensorSpec:
    shape: tuple  # logical shape; None marks a size fixed at run time (number of cache blocks)
    padded_shape: tuple  # as stored: the last two dims padded to 32 in TILE layout
    dtype: str  # one of DTYPES
    layout: str  # one of LAYOUTS
    memory: str  # a ttnn memory config attribute name, e.g. "DRAM_MEMORY_CONFIG" (ttnn.DRAM_MEMORY_CONFIG)
    kind: str = "activation"  # activation | weight | input | state (persistent device buffer: KV caches)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of {DTYPES}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}")
        if self.dtype in ("ttnn.bfloat8_b", "ttnn.bfloat4_b") and self.layout != "ttnn.TILE_LAYOUT":
            raise ValueError(f"{self.dtype} exists only in TILE layout (ttnn tensor docs), got {self.layout}")


@dataclass(frozen=True)
class TTCall:
    op: str
    inputs: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[str, ...] = ()

    def refs(self) -> list[str]:
        """Every tensor name this call reads: positional inputs, then keyword tensors."""
        return list(self.inputs) + [v.name for v in self.kwargs.values() if isinstance(v, Ref)]


@dataclass
class TTProgram:
    mode: str  # prefill | decode
    calls: list[TTCall]
    tensors: dict[str, TTTensorSpec]
    inputs: tuple[str, ...]  # host inputs the caller supplies per run (tokens, positions, page table)
    outputs: tuple[str, ...]
    meta: dict = field(default_factory=dict)

    def ops(self) -> list[str]:
        return [c.op for c in self.calls]


@dataclass
class TTModelProgram:
    prefill: TTProgram
    decode: TTProgram
    meta: dict = field(default_factory=dict)  # family, policy, per-layer cache specs, ...

    def to_json(self) -> str:
        return json.dumps(_encode(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TTModelProgram":
        d = json.loads(text)
        return cls(prefill=_program(d["prefill"]), decode=_program(d["decode"]), meta=d["meta"])


def _encode(x: Any) -> Any:
    if isinstance(x, Ref):
        return {"$ref": x.name}
    if isinstance(x, (TTModelProgram, TTProgram, TTCall, TTTensorSpec)):
        return {k: _encode(getattr(x, k)) for k in x.__dataclass_fields__}
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    return x


def _decode_value(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"$ref"}:
            return Ref(x["$ref"])
        return {k: _decode_value(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode_value(v) for v in x]
    return x


def _tuple(x):
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x


def _program(d: dict) -> TTProgram:
    return TTProgram(
        mode=d["mode"],
        calls=[TTCall(c["op"], tuple(c["inputs"]), _decode_value(c["kwargs"]), tuple(c["outputs"])) for c in d["calls"]],
        tensors={k: TTTensorSpec(**{f: _tuple(v) for f, v in s.items()}) for k, s in d["tensors"].items()},
        inputs=tuple(d["inputs"]), outputs=tuple(d["outputs"]), meta=d["meta"],
    )


def spec_dict(s: TTTensorSpec) -> dict:
    return asdict(s)
