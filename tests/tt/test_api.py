"""tt_backend.api: calls checked against the argument names extracted from the ttnn 0.81.1 wheel.

The expectations below are facts about the wheel's bindings (tools/ttnn_oracle/extract_api.py read
them from nanobind's signatures), not about our code.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tt_backend import api
from tt_backend.api import TTApiError, check_call

ROOT = Path(__file__).resolve().parents[2]


def test_signatures_file_is_pinned_and_broad():
    d = json.loads((ROOT / "tt_backend" / "api_signatures.json").read_text())
    assert d["ttnn_version"] == "0.81.1" == api.ttnn_version()
    names = api.ops()
    assert len(names) > 800
    for ns in ("ttnn.transformer.", "ttnn.experimental.", "ttnn.operations."):
        assert sum(n.startswith(ns) for n in names) > 10, ns
    assert d["sources"]["nb_signature"] > 0.8 * len(names)  # mostly the real bindings, not docstrings


@pytest.mark.parametrize("op,names,npos", [
    # as tt_transformers calls them
    ("ttnn.linear", ["bias", "dtype", "compute_kernel_config", "memory_config", "program_config"], 2),
    ("ttnn.rms_norm", ["epsilon", "weight", "program_config", "memory_config", "compute_kernel_config"], 1),
    ("ttnn.experimental.nlp_create_qkv_heads_decode", ["num_heads", "num_kv_heads", "memory_config"], 1),
    ("ttnn.experimental.rotary_embedding_llama", ["is_decode_mode"], 4),
    ("ttnn.experimental.paged_update_cache", ["update_idxs_tensor", "page_table"], 2),
    ("ttnn.experimental.paged_fill_cache", ["batch_idx"], 3),
    ("ttnn.transformer.paged_scaled_dot_product_attention_decode",
     ["page_table_tensor", "cur_pos_tensor", "scale", "sliding_window_size", "program_config",
      "compute_kernel_config", "memory_config"], 3),
    ("ttnn.transformer.scaled_dot_product_attention", ["is_causal", "scale", "sliding_window_size"], 3),
    ("ttnn.experimental.nlp_concat_heads_decode", ["num_heads"], 1),
    ("ttnn.mul", ["input_tensor_a_activations", "dtype", "memory_config"], 2),
    ("ttnn.from_torch", ["dtype", "layout", "device", "memory_config", "mesh_mapper"], 1),
    ("ttnn.as_tensor", ["dtype", "layout", "device", "memory_config", "cache_file_name", "mesh_mapper"], 1),
    ("ttnn.embedding", ["layout", "dtype"], 2),
    ("ttnn.topk", ["k", "dim", "largest", "sorted"], 1),
    ("ttnn.typecast", [], 3),  # second overload: (input_tensor, input_dtype, output_dtype)
    ("linear", ["bias"], None),  # the "ttnn." prefix may be left out
])
def test_known_good_calls_pass(op, names, npos):
    check_call(op, names, n_positional=npos)
    check_call(op, names)


@pytest.mark.parametrize("op,names,npos,match", [
    ("ttnn.rms_norms", [], None, r"no op 'ttnn.rms_norms'; did you mean ttnn.rms_norm"),
    ("ttnn.rms_norm", ["epsilion"], 1, r"unknown argument 'epsilion' \(did you mean epsilon"),
    ("ttnn.linear", ["compute_config"], 2, r"unknown argument 'compute_config'"),
    # in the op's docstring, but not accepted by the 0.81.1 binding:
    ("ttnn.transformer.paged_scaled_dot_product_attention_decode", ["cur_pos"], 4, r"unknown argument 'cur_pos'"),
    ("ttnn.transformer.paged_scaled_dot_product_attention_decode", ["share_cache"], 4, r"unknown argument 'share_cache'"),
    ("ttnn.linear", [], 3, r"at most 2 positional"),
    ("ttnn.experimental.rotary_embedding_llama", [], 2, r"missing required argument\(s\) sin_cache, trans_mat"),
    ("ttnn.softmax", ["input_tensor"], 1, r"given both positionally and by keyword"),
    ("ttnn.typecast", ["dtype"], 3, r"no overload accepts"),
])
def test_bad_calls_fail_clearly(op, names, npos, match):
    with pytest.raises(TTApiError, match=match):
        check_call(op, names, n_positional=npos)


def test_signature_and_constants():
    (ov,) = api.signature("ttnn.rms_norm")
    assert ov["positional"] == ["input_tensor"] and "epsilon" in ov["keyword_only"] and ov["required"] == ["input_tensor"]
    for c in ("ttnn.bfloat8_b", "ttnn.bfloat4_b", "ttnn.TILE_LAYOUT", "ttnn.DRAM_MEMORY_CONFIG", "ttnn.MathFidelity.LoFi"):
        assert api.has_constant(c), c
    assert not api.has_constant("ttnn.bfloat8")
    assert "fp32_dest_acc_en" in api.type_keywords("ttnn.WormholeComputeKernelConfig")
    with pytest.raises(TTApiError):
        api.type_keywords("ttnn.NoSuchConfig")
    with pytest.raises(TTApiError, match="iterable of names"):
        check_call("ttnn.add", "dtype")


ORACLE_PY = os.environ.get("TTNN_ORACLE_PYTHON", "/work/ttnn-venv/bin/python")


def test_live_extraction_matches_committed_json(tmp_path):
    if not os.path.exists(ORACLE_PY):
        pytest.skip(f"no ttnn oracle interpreter at {ORACLE_PY} (set TTNN_ORACLE_PYTHON; see tools/ttnn_oracle/README.md)")
    out = tmp_path / "sig.json"
    r = subprocess.run([ORACLE_PY, str(ROOT / "tools" / "ttnn_oracle" / "extract_api.py"), str(out)],
                       capture_output=True, text=True, timeout=120)
    if r.returncode and "No module named" in r.stderr:
        pytest.skip(f"{ORACLE_PY} cannot run the extractor: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    fresh, committed = json.loads(out.read_text()), json.loads((ROOT / "tt_backend" / "api_signatures.json").read_text())
    assert fresh["ttnn_version"] == committed["ttnn_version"]
    assert fresh["ops"] == committed["ops"]
