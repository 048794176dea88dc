"""Independent float64 NumPy oracles (no code shared with jaxmodels / converters)."""
import os
import sys

# The oracle does many small float64 matmuls; multi-threaded OpenBLAS on a busy CI box makes them ~10x
# slower than one thread. Only effective when this package is imported before numpy (standalone runs).
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
