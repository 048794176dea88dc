"""A converted directory is verified at load: its files against the checksums written at conversion, its stored
shapes against the config (issue #17: flipped bytes and an edited config used to load silently)."""
import json

import jax
import numpy as np
import pytest

import jaxmodels as jm
from converters import orbax_io
from jaxmodels import checkpoint, families, model as M
from tests.parity import hf_reference as ref


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = families.config_from_hf(ref.tiny_config("llama"))
    params = jax.tree.map(np.asarray, M.init_params(cfg, seed=0, std=0.05))
    return orbax_io.save(tmp_path_factory.mktemp("m") / "model", cfg, params), params


def _copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved[0], tmp_path / "model")


def test_loads_what_was_saved(saved):
    model = jm.load(saved[0])
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(saved[1])):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert checkpoint.load_meta(saved[0])["files"]  # the checksums were written


def _largest(d):
    return max((f for f in (d / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def test_flipped_bytes_are_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    f = _largest(d)
    data = bytearray(f.read_bytes())
    data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 64])
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum differs"):
        jm.load(d)


def test_truncated_and_missing_files_are_refused(saved, tmp_path):
    d = _copy(saved, tmp_path)
    f = _largest(d)
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(ValueError, match="bytes, .* written at conversion"):
        jm.load(d)
    f.unlink()
    with pytest.raises(ValueError, match="missing"):
        jm.load(d)


EDITS = {"a layer cut": (lambda c: c["layers"].pop(), r"stored shape \(2, 64, 2, 16\), .* gives \(1, 64"),
         "another width": (lambda c: c.update(hidden_size=48), "stored shape"),
         "a tied head": (lambda c: c.update(tie_embeddings=True), "not in the config lm_head")}


@pytest.mark.parametrize("edit", EDITS)
def test_a_config_that_does_not_match_the_params_is_refused(saved, tmp_path, edit):
    d = _copy(saved, tmp_path)
    meta = json.loads((d / checkpoint.CONFIG_FILE).read_text())
    change, match = EDITS[edit]
    change(meta["config"])
    (d / checkpoint.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        jm.load(d)


def test_check_shapes_accepts_kept_quantized_leaves_and_names_extras():
    cfg = families.config_from_hf(ref.tiny_config("llama"))
    from jaxmodels import plan

    stored = {p: (s.shape, "float32") for p, s in plan.flatten(plan.param_specs(cfg)).items()}
    wq = "layers/0/attn/wq"
    n = stored[wq][0][0]
    stored[wq] = ((n, 7, 3), "float8_e4m3fn")  # bytes in their own layout, the same layer count
    stored[wq + "_scale"] = ((n, 1, 1), "uint8")
    checkpoint.check_shapes(cfg, stored)
    stored[wq] = ((n + 1, 7, 3), "float8_e4m3fn")
    with pytest.raises(ValueError, match="stored shape"):
        checkpoint.check_shapes(cfg, stored)
    stored[wq] = ((n, 7, 3), "float8_e4m3fn")
    with pytest.raises(ValueError, match="not in the config layers/0/attn/extra"):
        checkpoint.check_shapes(cfg, stored | {"layers/0/attn/extra": ((1,), "float32")})


def test_malformed_checksums_are_one_clear_error(saved, tmp_path):
    d = _copy(saved, tmp_path)
    meta = json.loads((d / checkpoint.CONFIG_FILE).read_text())
    meta["files"] = {"../jaxmodels.json": [1, 2]}
    (d / checkpoint.CONFIG_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="checksums in jaxmodels.json are malformed"):
        jm.load(d)
    jm.load(d, verify=False)  # the escape: the files themselves are fine
