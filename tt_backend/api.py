"""The real ttnn API, as extracted from the wheel (``api_signatures.json``, written by
``tools/ttnn_oracle/extract_api.py``), so programs can be checked without ttnn installed.

``check_call("ttnn.linear", ["bias", "dtype"])`` raises ``TTApiError`` for an op ttnn does not
have or a keyword none of its overloads accepts; with ``n_positional`` it also checks the number of
positional arguments and that every required parameter is supplied. Op names are ttnn's dotted
names ("ttnn.linear", "ttnn.transformer.scaled_dot_product_attention"); the "ttnn." prefix may be
left out.
"""
from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import Iterable

__all__ = ["TTApiError", "check_call", "signature", "has_op", "has_constant", "type_keywords", "ttnn_version", "ops"]

_PATH = Path(__file__).with_name("api_signatures.json")


class TTApiError(ValueError):
    """A call that the pinned ttnn version would reject: unknown op, keyword or arity."""


@functools.lru_cache(maxsize=1)
def _data() -> dict:
    return json.loads(_PATH.read_text())


def ttnn_version() -> str:
    return _data()["ttnn_version"]


def ops() -> list[str]:
    return list(_data()["ops"])


def _name(op: str) -> str:
    if not isinstance(op, str) or not op:
        raise TTApiError(f"op name must be a non-empty string, got {op!r}")
    return op if op.startswith("ttnn.") else "ttnn." + op


def has_op(op: str) -> bool:
    return _name(op) in _data()["ops"]


def has_constant(name: str) -> bool:
    """True for public ttnn constants/enum members, e.g. "ttnn.bfloat8_b", "ttnn.MathFidelity.HiFi2"."""
    return _name(name) in _data()["constants"]


def type_keywords(name: str) -> list[str]:
    """Constructor keywords of a ttnn config class, e.g. "ttnn.WormholeComputeKernelConfig"."""
    t = _data()["types"].get(_name(name))
    if t is None:
        raise TTApiError(f"ttnn {ttnn_version()} has no config type {name!r}")
    return sorted({p for ov in t for p in ov.get("positional", []) + ov.get("keyword_only", [])})


def signature(op: str) -> list[dict]:
    """The op's overloads: dicts with positional, keyword_only, required, var_positional, var_keyword."""
    name = _name(op)
    entry = _data()["ops"].get(name)
    if entry is None:
        close = difflib.get_close_matches(name, _data()["ops"], n=3, cutoff=0.8)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise TTApiError(f"ttnn {ttnn_version()} has no op {op!r}{hint}")
    full = {"positional": [], "keyword_only": [], "required": [], "var_positional": False, "var_keyword": False}
    return [{**full, **ov} for ov in entry["overloads"]]


def _fits(ov: dict, names: list[str], n_positional: int | None) -> str | None:
    """None if the call fits this overload, else the reason."""
    pos, kw = ov["positional"], ov["keyword_only"]
    if n_positional is not None and n_positional > len(pos) and not ov["var_positional"]:
        return f"takes at most {len(pos)} positional arguments ({', '.join(pos)}), got {n_positional}"
    taken = set(pos[:n_positional]) if n_positional is not None else set()
    allowed = set(pos) | set(kw)
    for n in names:
        if n in taken:
            return f"{n!r} given both positionally and by keyword"
        if n not in allowed and not ov["var_keyword"]:
            close = difflib.get_close_matches(n, sorted(allowed), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            return f"unknown argument {n!r}{hint}"
    if n_positional is not None:
        missing = [r for r in ov["required"] if r not in taken and r not in names]
        if missing:
            return f"missing required argument(s) {', '.join(missing)}"
    return None


def check_call(op: str, arg_names: Iterable[str], n_positional: int | None = None) -> None:
    """Raise ``TTApiError`` unless some overload of ``op`` accepts keywords ``arg_names``
    (and, if given, ``n_positional`` positional arguments)."""
    names = list(arg_names)
    if isinstance(arg_names, str):
        raise TTApiError(f"arg_names must be an iterable of names, not the string {arg_names!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise TTApiError(f"{op}: argument(s) {', '.join(dup)} given more than once")
    overloads = signature(op)
    reasons = [_fits(ov, names, n_positional) for ov in overloads]
    if any(r is None for r in reasons):
        return
    if len(overloads) == 1:
        raise TTApiError(f"{_name(op)} (ttnn {ttnn_version()}): {reasons[0]}")
    detail = "; ".join(f"overload {i}: {r}" for i, r in enumerate(reasons))
    raise TTApiError(f"{_name(op)} (ttnn {ttnn_version()}): no overload accepts this call ({detail})")
