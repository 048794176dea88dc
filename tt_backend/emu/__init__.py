"""NumPy emulation of the ttnn calls a TT program makes (semantics + TT numerics) and its executor."""
from tt_backend.emu.executor import Executor, VLLMExecutor, executor_factory, forward
from tt_backend.emu.numerics import LEVELS
from tt_backend.emu.ops import OPS

__all__ = ["Executor", "VLLMExecutor", "executor_factory", "forward", "LEVELS", "OPS"]
