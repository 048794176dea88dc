"""The speculating serving engine on the GPU (run on the GPU machine; skipped elsewhere).

    JAX_PLATFORMS=cuda python -m pytest tests/gpu/test_speculative_gpu.py -q

On an H100 (2026-12-06, commit 7275596) the first verify step of a speculating engine over two real-width DeepSeek
V4.1-Flash layers with FP4 experts kept quantized (benchmarks/spec_bench.py --engine: one 512-token prompt, a
2048-token step budget) stopped with CUDA_ERROR_ILLEGAL_ADDRESS in `jit_verify_step`; the prefill chunk before it
ran. The "512-token prompt" cases reproduce the benchmark's run. H100, 2026-12-07 (BENCHMARKS.md, fourth session):
at ba459ff they **passed**, kernel on and off (the prefill's MoE through `moe._windows`), while spec_bench itself
(generate-level and --engine) still faulted in its first speculative step with the gathered kernel on and ran with
it off. The cause (found on the CPU afterwards, tests/test_gathered_quantized.py): one layer's FP4 stack is 2.26e9
bytes, which Pallas' Triton lowering indexes with 32-bit signed offsets, so experts from 364 on were read outside the
buffer; whether that faults depends on the device memory below it (the benchmark starts with the speculating
engine and builds its weights eagerly: the "spec first" cases do both). The kernel now reads FP4 as 32-bit words
(a quarter of the offsets); the model here keeps layers 20-22: one kind of one layer (2.26e9 bytes of FP4 a
matrix, the faulting stack) and one of two (4.5e9 bytes, 64-bit offsets).
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU and JAX_PLATFORMS=cuda")


@pytest.mark.parametrize("n", [6, 48])
@pytest.mark.parametrize("N,K", [(2304, 5120), (5120, 2304)], ids=["gate-up", "down"])
@pytest.mark.parametrize("layers", [1, 2])
def test_gathered_fp4_kernel_over_flash_layers(layers, n, N, K):
    """The kernel the verify step reaches first, alone: FP4 experts of one or two V4.1-Flash layers ([384 L, N, K/2]
    bytes, past 2^31 of them: one layer's was issue #13's illegal address), n routed rows whose ids reach the
    first and the last expert, against the XLA gather + dequant."""
    from jaxmodels.layers import gathered

    G = layers * 384
    kx, kw, ks, ki = jax.random.split(jax.random.key(n), 4)
    words = jax.random.bits(kw, (G, N, K // 8), jnp.uint32)  # random bytes, without a uint32 per byte
    w = {"fp4": jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(G, N, K // 2),
         "scale": jax.random.randint(ks, (G, N, K // 32), 120, 131, jnp.int32).astype(jnp.uint8)}
    del words
    x = jax.random.normal(kx, (n, K), jnp.bfloat16)
    ids = jax.random.randint(ki, (n,), 0, G).at[0].set(0).at[-1].set(G - 1)  # the first and the last expert
    assert gathered.fits(x, w)
    got = np.asarray(jax.jit(gathered.matmul)(x, w, ids).astype(jnp.float32))
    want = np.asarray(jax.jit(gathered.reference)(x, w, ids).astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.fixture(scope="module")
def flash():
    """Layers 20-22 of V4.1-Flash at real widths (FP4 experts kept quantized) and its three DSpark blocks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from spec_bench import flash_spec_config

    import jaxmodels as jm
    from jaxmodels import model as M

    cfg = flash_spec_config([20, 21, 22], 4)
    params = M.init_params(cfg, seed=0, dtype=jnp.bfloat16, fp4_experts=True, mtp=True)  # eagerly, as spec_bench
    return jm.Model(cfg, params)


SHAPES = {"64-token prompts": dict(rows=2, prompt=64, max_len=256, budget=512),
          "512-token prompt": dict(rows=1, prompt=512, max_len=604, budget=2048)}  # spec_bench --engine's


def _run(model, k: int, rows: int, prompt: int, max_len: int, budget: int, new: int = 12):
    from serving import Engine, EngineConfig, SamplingParams

    engine = Engine(model, EngineConfig(max_num_seqs=rows, max_model_len=max_len, block_size=16,
                                        kv_blocks=rows * 3 * (max_len // 16 + 16), max_num_batched_tokens=budget,
                                        num_speculative_tokens=k))
    rng = np.random.default_rng(0)
    for i in range(rows):
        engine.add(str(i), rng.integers(3, model.config.vocab_size, prompt).tolist(),
                   SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    got = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return [got[str(i)] for i in range(rows)], engine


@pytest.mark.parametrize("spec_first", [True, False], ids=["spec-first", "plain-first"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kernel", [True, False], ids=["gathered-kernel", "xla-gather"])
def test_speculating_engine_runs_at_real_widths(flash, kernel, shape, spec_first, monkeypatch):
    """Every request gets its tokens and the first one (from the prefill chunk, the same path in both engines)
    equals the plain engine's; the later ones may differ by bf16 rounding between one-token and chunked passes."""
    from jaxmodels.layers import gathered

    if not kernel:
        monkeypatch.setattr(gathered, "fits", lambda x, w: False)
    if spec_first:
        spec, engine = _run(flash, 3, **SHAPES[shape])
        plain, _ = _run(flash, 0, **SHAPES[shape])
    else:
        plain, _ = _run(flash, 0, **SHAPES[shape])
        spec, engine = _run(flash, 3, **SHAPES[shape])
    assert [len(t) for t in spec] == [12] * len(spec) and [t[0] for t in spec] == [t[0] for t in plain]
    assert engine.stats()["spec_steps"] > 0
