"""Multi-host runs through `jax.distributed` (no home-made transport).

Every process runs the same program; `initialize` joins them before any JAX computation:

    jaxmodels generate --model M --prompt hi --mesh data=2,tensor=4 \\
        --coordinator host0:1234 --num-processes 2 --process-id $RANK

or set JAXMODELS_COORDINATOR / JAXMODELS_NUM_PROCESSES / JAXMODELS_PROCESS_ID and call `initialize()`.
On GPU clusters with a scheduler (SLURM, ...) `jax.distributed.initialize()` can also find these itself.
"""
from __future__ import annotations

import os

import jax
import numpy as np


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run; returns False (and does nothing) for a single process."""
    coordinator = coordinator or os.environ.get("JAXMODELS_COORDINATOR")
    env_n, env_id = os.environ.get("JAXMODELS_NUM_PROCESSES"), os.environ.get("JAXMODELS_PROCESS_ID")
    num_processes = num_processes if num_processes is not None else int(env_n) if env_n else None
    process_id = process_id if process_id is not None else int(env_id) if env_id else None
    if not num_processes or num_processes == 1:
        return False
    if coordinator is None or process_id is None:
        raise ValueError("a multi-process run needs a coordinator address and this process's id")
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


def to_host(x) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on every process."""
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
