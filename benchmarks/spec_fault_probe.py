"""Where does the speculative step's CUDA_ERROR_ILLEGAL_ADDRESS come from (issue #13, BENCHMARKS.md "Speculative
decoding on the GPU", fourth session)? Runs spec_bench's generate-level step (B=1, context 512, the gathered FP4
kernel on) with every gathered-kernel call's ids range and operand shapes printed through a host round trip
before the kernel runs, so the last lines before a fault name the call that made it (or show every id in range).

    CUDA_LAUNCH_BLOCKING=1 JAX_PLATFORMS=cuda PYTHONPATH=. python benchmarks/spec_fault_probe.py [--context 512]
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jaxmodels.layers import gathered  # noqa: E402

_call = gathered._quantized_call


def _checked(x, w, ids, interpret):
    G = (w["fp4"] if "fp4" in w else w["fp8"]).shape[0]
    shapes = {k: v.shape for k, v in w.items()}

    def host(i):
        i = np.asarray(i)
        print(f"  [ids] n={i.size} min={i.min()} max={i.max()} G={G} x={x.shape} w={shapes}"
              + ("  <-- OUT OF RANGE" if i.min() < 0 or i.max() >= G else ""), flush=True)
        return i

    ids = jax.pure_callback(host, jax.ShapeDtypeStruct(ids.shape, jnp.int32), ids.astype(jnp.int32))
    return _call(x, w, ids, interpret)


if __name__ == "__main__":
    gathered._quantized_call = _checked
    import spec_bench

    sys.argv = [sys.argv[0], "--k", "3", "--batches", "1", "--context", "512", "--reps", "1", "--trace", *sys.argv[1:]]
    spec_bench.main()
