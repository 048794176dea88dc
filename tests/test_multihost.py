"""Two processes on localhost (4 virtual CPU devices each) run one sharded model through jax.distributed."""
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

import jaxmodels as jm
from converters import orbax_io
from jaxmodels import families, model as M
from tests.parity import hf_reference as ref

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_process_sharded_run_equals_single_process(tmp_path):
    cfg = families.config_from_hf(ref.tiny_config("qwen3"))
    base = jm.Model(cfg, M.init_params(cfg, seed=4, std=0.05))
    orbax_io.save(tmp_path / "model", cfg, jax.tree.map(np.asarray, base.params))
    ids = np.random.default_rng(0).integers(0, 256, (4, 16)).astype(np.int32)
    np.save(tmp_path / "ids.npy", ids)
    addr = f"localhost:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "multihost_worker.py"), str(tmp_path / "model"),
                               str(tmp_path), addr, str(i)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n\n".join(logs)[-4000:]
    got = np.load(tmp_path / "result.npz")
    np.testing.assert_allclose(got["logits"], np.asarray(jm.forward(base, ids)), atol=1e-5, rtol=0)
    want = jm.generate(base, [list(r) for r in ids], max_new_tokens=8, ignore_eos=True).tokens
    assert got["tokens"].tolist() == want
