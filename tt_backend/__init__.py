"""tt_backend: the jaxmodels layer plan lowered to ttnn calls, with a CPU emulator of those calls.

    import tt_backend
    logits = tt_backend.forward(model, tokens, numerics="full")   # float32 [B, T, vocab]
    progs = tt_backend.lower(model.config)                         # TTModelProgram (prefill + decode)
    ex = tt_backend.Executor(model)                                # paged prefill/decode (see emu/executor.py)
    make = tt_backend.executor_factory(model)                      # for generator.initialize_vllm_model

Modules: program (TT call lists), lowering (plan -> calls, constraint checks), weights (HF -> TT layout,
precision policy), emu (NumPy ttnn emulation), formats (tiles, bfp), paged_cache, generator, multimodal (the
vision tower in JAX on the host, its embeddings into the TT text prefill), api, ttnn_exec.
"""
from tt_backend.emu.executor import Executor, VLLMExecutor, executor_factory, forward
from tt_backend.lowering import TTConstraintError, lower

__all__ = ["forward", "lower", "Executor", "VLLMExecutor", "executor_factory", "TTConstraintError"]
