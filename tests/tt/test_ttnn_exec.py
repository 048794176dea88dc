"""tt_backend.ttnn_exec on the CPU with a fake `ttnn` module (as tt-transformers' host tests do),
plus hardware tests that only run with a Tenstorrent device.

The fake is built from api_signatures.json (extracted from the ttnn 0.81.1 wheel): every op it
exposes checks its call against the wheel's argument names, refuses unresolved name strings, and
records what it was given; constants and config classes are named stand-ins.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tt_backend import api, ttnn_exec
from tt_backend.program import Ref, TTCall, TTProgram, TTTensorSpec
from tt_backend.ttnn_exec import TTNNExecError, TTNNExecutor

MULTI_OUTPUT = {"ttnn.experimental.nlp_create_qkv_heads": 3, "ttnn.experimental.nlp_create_qkv_heads_decode": 3}


class FakeTensor:
    def __init__(self, tag, data=None, **meta):
        self.tag, self.data, self.meta = tag, data, meta

    def __repr__(self):
        return f"FakeTensor({self.tag})"


class FakeConst:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


class FakeConfig:
    def __init__(self, name, kwargs):
        self.name, self.kwargs = name, kwargs


class _Node:
    pass


class FakeTTNN(_Node):
    """A `ttnn` stand-in with every op, constant and config type of the pinned wheel."""

    __name__ = "ttnn"

    def __init__(self, devices=()):
        self.calls, self.devices, self.opened = [], list(devices), []
        data = api._data()
        for name in data["constants"]:
            self._put(name, FakeConst(name))
        for name in data["types"]:
            self._put(name, self._type(name))
        for name in data["ops"]:
            self._put(name, self._op(name))
        self._put("ttnn.from_torch", self._from_torch)
        self._put("ttnn.to_torch", self._to_torch)
        self.get_device_ids = lambda: list(self.devices)
        self.open_device = lambda device_id=0: self.opened.append(device_id) or f"device{device_id}"
        self.close_device = lambda dev: self.opened.remove(int(dev[6:]))

    def _put(self, dotted, value):
        node, parts = self, dotted.split(".")[1:]
        for p in parts[:-1]:
            nxt = getattr(node, p, None)
            if nxt is None or not isinstance(nxt, _Node):
                nxt = _Node()
                setattr(node, p, nxt)
            node = nxt
        if not isinstance(getattr(node, parts[-1], None), _Node):
            setattr(node, parts[-1], value)

    @staticmethod
    def _check_values(name, args, kwargs):
        for v in list(args) + list(kwargs.values()):
            for x in v if isinstance(v, list) else [v]:
                if isinstance(x, str) and (x.startswith("ttnn.") or x.endswith("MEMORY_CONFIG")):
                    raise TypeError(f"{name}: unresolved name string {x!r} passed to ttnn")
                if isinstance(x, (dict, Ref)):
                    raise TypeError(f"{name}: program value {x!r} passed to ttnn unconverted")

    def _op(self, name):
        def op(*args, **kwargs):
            api.check_call(name, kwargs, n_positional=len(args))  # the wheel's argument names
            self._check_values(name, args, kwargs)
            self.calls.append((name, args, kwargs))
            outs = tuple(FakeTensor(f"{name}#{len(self.calls) - 1}.{j}") for j in range(MULTI_OUTPUT.get(name, 1)))
            return outs if len(outs) > 1 else outs[0]
        return op

    def _type(self, name):
        def make(*args, **kwargs):
            assert not args, f"{name} is built from keywords here"
            bad = set(kwargs) - set(api.type_keywords(name))
            if bad:
                raise TypeError(f"{name}: unexpected {bad}")
            self._check_values(name, (), kwargs)
            return FakeConfig(name, kwargs)
        return make

    def _from_torch(self, tensor, dtype=None, **kwargs):
        api.check_call("ttnn.from_torch", list(kwargs) + (["dtype"] if dtype is not None else []), n_positional=1)
        self._check_values("ttnn.from_torch", (), {**kwargs, "dtype": dtype})
        t = FakeTensor(f"from_torch#{len(self.calls)}", tensor.numpy().copy(), dtype=dtype, torch_dtype=tensor.dtype,
                       **kwargs)
        self.calls.append(("ttnn.from_torch", (tensor,), {"dtype": dtype, **kwargs}))
        return t

    def _to_torch(self, t, **kwargs):
        import torch
        return torch.from_numpy(np.asarray(t.data))


@pytest.fixture
def fake(monkeypatch):
    f = FakeTTNN()
    monkeypatch.setitem(sys.modules, "ttnn", f)  # so the lazy `import ttnn` finds the fake
    return f


# -------------------------------------------------------------------------------- lowered programs
# Tiny HF configs, one per lowered family (head_dim 32: TT's rotary op works on whole tiles).
BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 8192, "num_hidden_layers": 2}
FAMILIES = {
    "llama": {"model_type": "llama", "attention_bias": True},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", "sliding_window": 48},
    "cohere": {"model_type": "cohere", "hidden_size": 128, "use_qk_norm": True, "logit_scale": 0.25},
    "gemma3": {"model_type": "gemma3_text", "query_pre_attn_scalar": 24, "sliding_window": 48,
               "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0},
    "exaone4": {"model_type": "exaone4", "num_hidden_layers": 4, "sliding_window": 48, "sliding_window_pattern": "LLLG",
                "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
    "gpt_oss_dense": {"model_type": "gpt_oss", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 48,
                      "layer_types": ["sliding_attention", "full_attention"]},
}


def tiny_config(name):
    import dataclasses

    from jaxmodels import families
    from jaxmodels.config import MLPSpec

    cfg = families.config_from_hf({**BASE, **FAMILIES[name]})
    if name == "gpt_oss_dense":  # GPT-OSS attention (sinks, windows) over a dense MLP: MoE is not lowered yet
        mlp = MLPSpec(activation="silu", intermediate_size=128)
        cfg = dataclasses.replace(cfg, layers=tuple(dataclasses.replace(s, mlp=mlp) for s in cfg.layers))
    return cfg


@pytest.mark.parametrize("family", list(FAMILIES))  # gemma3 once caught GELU_APPROX, absent from ttnn 0.81.1
def test_lowered_programs_map_onto_the_real_api(fake, family):
    import tt_backend

    progs = tt_backend.lower(tiny_config(family), prefill_len=128, batch=4, max_seq_len=512)
    ex = TTNNExecutor("device0")  # imports the (fake) ttnn lazily
    assert ex.ttnn is fake
    for prog in (progs.prefill, progs.decode):
        fake.calls.clear()
        produced = {o for c in prog.calls for o in c.outputs}
        given = {n: FakeTensor(n) for n in prog.tensors if n not in produced and n not in prog.inputs}
        inputs = {n: FakeTensor(n) for n in prog.inputs}
        t = ex.run(prog, inputs, given)
        assert [c[0] for c in fake.calls] == prog.ops()
        for i, (c, (_, args, kwargs)) in enumerate(zip(prog.calls, fake.calls)):
            assert all(a is t[n] for a, n in zip(args, c.inputs)), i  # positional tensors, in order
            assert set(kwargs) == set(c.kwargs), i
            for k, v in c.kwargs.items():
                got = kwargs[k]
                if isinstance(v, Ref):
                    assert got is t[v.name]
                elif k == "memory_config":
                    assert isinstance(got, FakeConst) and got.name == "ttnn." + v
                elif k == "compute_kernel_config":
                    assert got.name == "ttnn.WormholeComputeKernelConfig"
                    assert got.kwargs["math_fidelity"].name == v["math_fidelity"]
                    assert got.kwargs["fp32_dest_acc_en"] == v["fp32_dest_acc_en"]
                elif isinstance(v, str) and v.startswith("ttnn."):
                    assert got.name == v
                else:
                    assert got == v or [getattr(g, "name", g) for g in got] == v
            # results are bound to the program's names
            for j, o in enumerate(c.outputs):
                assert t[o].tag == f"{c.op}#{i}.{j}"


# ---------------------------------------------------------------------------------- host <-> device
def _spec(shape, dtype="ttnn.bfloat16", layout="ttnn.TILE_LAYOUT", memory="DRAM_MEMORY_CONFIG", kind="activation"):
    pad = lambda s: s if layout == "ttnn.ROW_MAJOR_LAYOUT" else tuple(s[:-2]) + tuple(  # noqa: E731
        None if d is None else -(-d // 32) * 32 for d in s[-2:])
    return TTTensorSpec(tuple(shape), pad(tuple(shape)), dtype, layout, memory, kind)


def test_load_allocate_and_host_inputs(fake):
    ex = TTNNExecutor("device0", ttnn=fake)
    specs = {"w": _spec((1, 1, 64, 32), "ttnn.bfloat8_b", kind="weight"),
             "ids": _spec((1, 5), "ttnn.uint32", "ttnn.ROW_MAJOR_LAYOUT", kind="input"),
             "kv.0.k": _spec((None, 2, 32, 32), "ttnn.bfloat8_b", kind="state")}
    w = np.arange(64 * 32, dtype=np.float32).reshape(1, 1, 64, 32)
    dev = ex.load({"w": w}, specs)
    m = dev["w"].meta
    assert m["dtype"].name == "ttnn.bfloat8_b" and m["layout"].name == "ttnn.TILE_LAYOUT"
    assert m["memory_config"].name == "ttnn.DRAM_MEMORY_CONFIG" and m["device"] == "device0"
    assert np.array_equal(dev["w"].data, w)
    state = ex.allocate_state(specs, num_blocks=7)
    assert list(state) == ["kv.0.k"] and state["kv.0.k"].data.shape == (7, 2, 32, 32)
    assert not state["kv.0.k"].data.any()
    # host arrays given as program inputs go through from_torch; integer dtypes as int32
    prog = TTProgram("decode", [TTCall("ttnn.embedding", ("ids", "w"), {"layout": "ttnn.TILE_LAYOUT"}, ("e",))],
                     {**specs, "e": _spec((1, 5, 32))}, ("ids",), ("e",))
    t = ex.run(prog, {"ids": np.array([[1, 2, 3, 4, 5]], np.int64)}, dev)
    assert str(t["ids"].meta["torch_dtype"]) == "torch.int32" and t["ids"].meta["dtype"].name == "ttnn.uint32"
    assert fake.calls[-1][1][0] is t["ids"] and fake.calls[-1][2]["layout"].name == "ttnn.TILE_LAYOUT"
    assert np.array_equal(ex.to_numpy(t["ids"]), [[1, 2, 3, 4, 5]])
    with pytest.raises(TTNNExecError, match="does not match its spec shape"):
        ex.load({"w": w[..., :16]}, specs)
    with pytest.raises(TTNNExecError, match="no tensor spec for nope"):
        ex.load({"nope": w}, specs)


# ------------------------------------------------------------------------------------------ errors
def _prog(call, extra=None):
    tensors = {"x": _spec((1, 1, 32, 64)), "w": _spec((1, 1, 64, 64), kind="weight"), "y": _spec((1, 1, 32, 64)),
               "q": _spec((1, 1, 32, 64)), **(extra or {})}
    return TTProgram("prefill", [call], tensors, ("x",), tuple(call.outputs))


@pytest.mark.parametrize("call,match", [
    (TTCall("ttnn.linears", ("x", "w"), {}, ("y",)), r"no op 'ttnn.linears'; did you mean ttnn.linear"),
    (TTCall("ttnn.linear", ("x", "w"), {"dtypes": "ttnn.bfloat16"}, ("y",)), r"unknown argument 'dtypes'"),
    (TTCall("ttnn.linear", ("x", "w"), {"dtype": "ttnn.bfloat9"}, ("y",)), r"ttnn has no 'ttnn.bfloat9'"),
    (TTCall("ttnn.linear", ("x", "w"), {"memory_config": "L3_MEMORY_CONFIG"}, ("y",)), r"ttnn has no 'ttnn.L3_MEMORY_CONFIG'"),
    (TTCall("ttnn.linear", ("x", "w"), {"compute_kernel_config": {"math_fidelity": "ttnn.MathFidelity.LoFi"}}, ("y",)),
     r"needs a 'type'"),
    (TTCall("ttnn.linear", ("x", "w"), {"compute_kernel_config": {"type": "ttnn.WormholeComputeKernelConfig",
                                                                  "fidelity": "ttnn.MathFidelity.LoFi"}}, ("y",)),
     r"WormholeComputeKernelConfig takes no fidelity"),
    (TTCall("ttnn.linear", ("x", "w"), {"bias": Ref("nothing")}, ("y",)), r"nobody supplied: nothing"),
    (TTCall("ttnn.experimental.nlp_create_qkv_heads", ("x",), {"num_heads": 1}, ("y", "q")), r"returned 3 tensors"),
])
def test_bad_programs_fail_clearly(fake, call, match):
    ex = TTNNExecutor("device0", ttnn=fake)
    with pytest.raises(TTNNExecError, match=match):
        ex.run(_prog(call), {"x": FakeTensor("x")}, {"w": FakeTensor("w")})


def test_wrong_program_inputs(fake):
    ex = TTNNExecutor("device0", ttnn=fake)
    prog = _prog(TTCall("ttnn.add", ("x", "w"), {}, ("y",)))
    with pytest.raises(TTNNExecError, match=r"program inputs are \['x'\], got \[\]"):
        ex.run(prog, {}, {"w": FakeTensor("w")})


def test_device_detection_and_lazy_import(monkeypatch):
    assert not ttnn_exec.device_available(FakeTTNN())
    assert ttnn_exec.device_available(FakeTTNN(devices=[0]))
    monkeypatch.setitem(sys.modules, "ttnn", None)  # as on a machine without the wheel
    assert not ttnn_exec.device_available()
    with pytest.raises(ImportError, match="needs the `ttnn` package"):
        TTNNExecutor("device0")
    monkeypatch.setitem(sys.modules, "ttnn", FakeTTNN())
    with pytest.raises(TTNNExecError, match="no Tenstorrent device"):
        TTNNExecutor.open()
    f = FakeTTNN(devices=[0])
    monkeypatch.setitem(sys.modules, "ttnn", f)
    ex = TTNNExecutor.open()
    assert f.opened == [0] and ex.device == "device0"
    ex.close()
    assert f.opened == [] and ex.device is None


# ------------------------------------------------------------------------------- hardware tier
def _require_device():
    if not ttnn_exec.device_available():
        pytest.skip("no Tenstorrent device")


@pytest.mark.tt_device
def test_device_prefill_matches_emulator():
    """Hardware only: a tiny Llama's prefill on the chip against the emulator (PCC, not equality:
    device packing, fidelity and accumulation are modelled, not verified)."""
    _require_device()
    import jax

    import jaxmodels as jm
    import tt_backend
    from jaxmodels import model as M
    from tt_backend.weights import prepare

    cfg = tiny_config("llama")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: (1.0 if x.ndim == 1 else 0.05) * rng.standard_normal(x.shape).astype(np.float32)
                          + (1.0 if x.ndim == 1 else 0.0), M.init_params(cfg))
    model = jm.Model(cfg, params)
    T, S, bs = 40, 128, 32
    tokens = rng.integers(0, cfg.vocab_size, T)
    emu = tt_backend.Executor(model, max_seq_len=S, block_size=bs)
    want = emu.prefill(tokens, np.arange(S // bs, dtype=np.int32), emu.allocate_kv_cache(S // bs))
    prog = emu.program("prefill", S)
    ex = TTNNExecutor.open()
    try:
        w = ex.load(prepare(cfg, model.params, S), prog.tensors)
        kv = ex.allocate_state(prog.tensors, S // bs)
        ids = np.zeros((1, S), np.uint32)
        ids[0, :T] = tokens
        inputs = {"tokens": ids, "rope_pos": np.arange(S, dtype=np.uint32)[None],
                  "page_table": np.arange(S // bs, dtype=np.int32)[None]}
        t = ex.run(prog, inputs, {**w, **kv})
        got = ex.to_numpy(t[prog.outputs[0]]).reshape(S, -1)[:T]
    finally:
        ex.close()
    pcc = np.corrcoef(want.ravel(), got.ravel())[0, 1]
    assert pcc >= 0.99, pcc
