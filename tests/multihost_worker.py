"""One process of tests/test_multihost.py: join, load sharded, run forward and generate, write results."""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

from jaxmodels import distributed  # noqa: E402

model_dir, out, coordinator, pid = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
distributed.initialize(coordinator, num_processes=2, process_id=pid)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxmodels as jm  # noqa: E402
from jaxmodels import sharding  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
ids = np.load(os.path.join(out, "ids.npy"))
model = jm.load(model_dir, mesh=sharding.make_mesh("data=2,tensor=4"))
logits = distributed.to_host(jm.forward(model, ids))
tokens = jm.generate(model, [list(r) for r in ids], max_new_tokens=8, ignore_eos=True).tokens
if pid == 0:
    np.savez(os.path.join(out, "result.npz"), logits=logits, tokens=np.asarray(tokens))
print(f"process {pid} done", flush=True)
