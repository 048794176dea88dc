"""The converted format (3): a safetensors file per leaf that safetensors itself reads, loaded bit for bit;
directories of format 2 (orbax) still load."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest

import jaxmodels as jm
from converters import orbax_io
from jaxmodels import checkpoint, families, model as M
from tests.parity import hf_reference as ref


@pytest.fixture(scope="module")
def tiny():
    cfg = families.config_from_hf(ref.tiny_config("llama"))
    params = jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), M.init_params(cfg, seed=1, std=0.05))
    return cfg, params


def test_each_leaf_is_a_safetensors_file_that_safetensors_reads(tiny, tmp_path):
    from safetensors import safe_open

    cfg, params = tiny
    dst = orbax_io.save(tmp_path / "m", cfg, params)
    assert json.loads((dst / checkpoint.CONFIG_FILE).read_text())["format_version"] == checkpoint.FORMAT_VERSION
    f = dst / "params" / "layers" / "0" / "attn" / "wq.safetensors"
    with safe_open(str(f), "np") as st:
        np.testing.assert_array_equal(st.get_tensor("layers/0/attn/wq"), params["layers"]["0"]["attn"]["wq"])
    model = jm.load(dst)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), b)


def test_a_header_that_is_not_ours_is_refused(tiny, tmp_path):
    cfg, params = tiny
    dst = orbax_io.save(tmp_path / "m", cfg, params)
    f = dst / "params" / "embed.safetensors"
    data = bytearray(f.read_bytes())
    data[8:12] = b"[1, "
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a jaxmodels parameter file"):
        jm.load(dst, verify=False)
    with pytest.raises(ValueError, match="checksum differs"):
        jm.load(dst)


def test_format_2_orbax_directories_still_load(tiny, tmp_path):
    import orbax.checkpoint as ocp

    cfg, params = tiny
    d = tmp_path / "old"
    d.mkdir()
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(d / "params", params)
    ckpt.wait_until_finished()
    (d / checkpoint.CONFIG_FILE).write_text(json.dumps({"format_version": 2, "dtype": "bfloat16",
                                                        "config": cfg.to_dict(),
                                                        "files": checkpoint.checksums(d / "params")}))
    model = jm.load(d)
    for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), b)
