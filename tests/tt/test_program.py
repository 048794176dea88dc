"""TT program dataclasses: validation and a lossless JSON round trip."""
from __future__ import annotations

import json

import pytest

from tests.tt.test_tt_forward import tiny_config
from tt_backend.lowering import lower
from tt_backend.program import Ref, TTCall, TTModelProgram, TTTensorSpec


@pytest.mark.parametrize("family", ["llama", "gemma3", "cohere"])
def test_json_round_trip_is_lossless(family):
    progs = lower(tiny_config(family), prefill_len=128, batch=2, max_seq_len=256)
    text = progs.to_json()
    back = TTModelProgram.from_json(text)
    for mode in ("prefill", "decode"):
        a, b = getattr(progs, mode), getattr(back, mode)
        assert a.calls == b.calls and a.tensors == b.tensors
        assert (a.inputs, a.outputs, a.mode) == (b.inputs, b.outputs, b.mode)
    assert back.to_json() == text and back.meta == json.loads(text)["meta"]
    # tensors passed by keyword stay references, not strings
    norm = next(c for c in back.decode.calls if c.op.endswith("_norm") and "weight" in c.kwargs)
    assert isinstance(norm.kwargs["weight"], Ref) and norm.kwargs["weight"].name in back.decode.tensors


def test_refs_and_specs():
    c = TTCall("ttnn.rms_norm", ("x",), {"epsilon": 1e-5, "weight": Ref("w")}, ("y",))
    assert c.refs() == ["x", "w"]
    with pytest.raises(ValueError, match="only in TILE layout"):
        TTTensorSpec((32, 32), (32, 32), "ttnn.bfloat8_b", "ttnn.ROW_MAJOR_LAYOUT", "DRAM_MEMORY_CONFIG")
    with pytest.raises(ValueError, match="unknown dtype"):
        TTTensorSpec((32, 32), (32, 32), "bf16", "ttnn.TILE_LAYOUT", "DRAM_MEMORY_CONFIG")
