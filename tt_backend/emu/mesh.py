"""Emulated multi-device execution of tensor-parallel programs (`tt_backend.mesh`).

    ex = MeshExecutor(model, (1, 8), numerics="exact")     # a T3K: 8 devices, one TP group ((8, 4): a Galaxy)
    kv = ex.allocate_kv_cache(num_blocks)                  # the *logical* caches [blocks, K, block, d], as Executor
    logits = ex.prefill(tokens, page_table_row, kv)        # [T, vocab], the same API as `Executor`
    logits = ex.decode(tokens, positions, page_table, kv)
    ex.devices                                             # every device's tensors of the last run

Each device holds its own tensors: weights distributed by their mesh mappers (`mesh.host_tensor` then the
mapper's split, then host packing to the weight's dtype per device shard), inputs replicated, and its KV
heads of every paged cache as a *view* of the logical cache (split over the heads axis, `ShardTensor2dMesh` on
dim 1), so cache writes land in the caller's buffers and the generator's cache layout is unchanged. Ordinary ops
run per device through the single-device emulator's `OPS`; each CCL runs over every line of devices along its
`cluster_axis` (`groups`), emulated exactly:
- all_gather: concatenation in device order;
- all_reduce / reduce_scatter: the float32 sum of the devices' terms in device order (then split); the result
  is rounded to the output dtype once (hardware's ring accumulates hop by hop in the tensor's dtype: at `full`
  numerics this is a model, not verified);
- mesh_partition: each device keeps its slice.
The output (vocab-sharded logits) is concatenated as `ConcatMeshToTensor` / `ConcatMesh2dToTensor` would (one
copy of replicated rows) and the LM head's padding dropped.

Data parallel x tensor parallel, as tt-metal's generator_vllm: `executor_factory(model)` is a
`tt_backend.generator.initialize_vllm_model(executor_factory=...)` factory: each data-parallel submesh gets a
`MeshVLLMExecutor` over its own devices, in the submesh's shape; `data_parallel(model, mesh, dp)` builds one per
(1, n/dp) submesh directly, as tt-metal's `create_submeshes`.
"""
from __future__ import annotations

import functools

import numpy as np

from tt_backend import mesh as tp
from tt_backend.emu.executor import Executor, VLLMExecutor, first_layers
from tt_backend.emu.ops import OPS, Env
from tt_backend.lowering import check_decode_batch
from tt_backend.program import Ref, TTProgram
from tt_backend.weights import prepare

F32 = np.float32
REPLICATE = {"mesh_mapper": "ttnn.ReplicateTensorToMesh"}


# ------------------------------------------------------------------------------------------- CCLs
# each takes the tensors of one group of devices along the CCL's cluster_axis, in mesh order
def all_gather(xs: list, *, dim: int, **_) -> list:
    full = np.concatenate([np.asarray(x) for x in xs], axis=dim)
    return [full] * len(xs)


def all_reduce(xs: list, **_) -> list:
    acc = np.asarray(xs[0], F32)
    for x in xs[1:]:
        acc = acc + np.asarray(x, F32)
    return [acc] * len(xs)


def reduce_scatter(xs: list, *, dim: int, **_) -> list:
    return np.split(all_reduce(xs)[0], len(xs), axis=dim)


def mesh_partition(xs: list, *, dim: int, **_) -> list:
    return [np.split(np.asarray(x), len(xs), axis=dim)[j] for j, x in enumerate(xs)]


CCL = {"ttnn.all_gather": all_gather, "ttnn.reduce_scatter": reduce_scatter, "ttnn.all_reduce": all_reduce,
       "ttnn.mesh_partition": mesh_partition}


def groups(shape: tuple[int, int], axis: int) -> list[list[int]]:
    """Device indices (row-major) of each line of the mesh along `axis`: the devices one CCL call spans."""
    rows, cols = shape
    if axis == 1:
        return [[r * cols + c for c in range(cols)] for r in range(rows)]
    return [[r * cols + c for r in range(rows)] for c in range(cols)]


# --------------------------------------------------------------------------------------- executor
class MeshExecutor(Executor):
    """`Executor` over a mesh (an int N, (1, N), or a 2-D (rows, cols)): same API, same logical KV caches."""

    def __init__(self, model, mesh, *, numerics: str = "full", policy="performance", max_seq_len: int = 8192,
                 block_size: int = 32):
        super().__init__(model, numerics=numerics, policy=policy, max_seq_len=max_seq_len, block_size=block_size)
        self.mesh_shape = tp.mesh_shape(mesh)
        self.n = self.mesh_shape[0] * self.mesh_shape[1]
        self.weights = {}  # the single-device copy is not used: each device gets its shard below
        self.host = prepare(self.config, model.params, max_seq_len)  # float32, before any mapper or packing
        self._shards: dict[str, list[np.ndarray]] = {}
        self.devices: list[dict] | None = None
        tp.shard_program(Executor.program(self, "decode", 1), self.mesh_shape)  # refuse indivisible shapes now

    @functools.lru_cache(maxsize=32)
    def program(self, mode: str, rows: int, chunk_start: int = 0, per_layer_page_tables: bool = False,
                cache_position_modulo: tuple | None = None, embeddings: bool = False,
                attention_mask: bool = False, cross_tokens: int = 0) -> TTProgram:
        if cross_tokens:
            raise NotImplementedError("Mllama's cross-attention layers have no tensor-parallel placement rules yet")
        single = Executor.program(self, mode, rows, chunk_start, per_layer_page_tables, cache_position_modulo,
                                  embeddings, attention_mask)
        return tp.shard_program(single, self.mesh_shape)

    def _device_weights(self, prog: TTProgram) -> list[dict]:
        mappers = prog.meta["mesh"]["mappers"]
        used = {r for c in prog.calls for r in c.refs()}
        out = [{} for _ in range(self.n)]
        for name in used:
            spec = prog.tensors[name]
            if spec.kind != "weight":
                continue
            if name not in self._shards:  # as ttnn.as_tensor(host, dtype, mesh_mapper=...) packs each shard
                m = mappers.get(name, REPLICATE)
                a = tp.host_tensor(self.host, name, m)
                if m["mesh_mapper"] == "ttnn.ReplicateTensorToMesh":
                    self._shards[name] = [self._store(a, spec.dtype, "host")] * self.n
                else:
                    self._shards[name] = [self._store(p, spec.dtype, "host") for p in tp.distribute(a, m)]
            for j in range(self.n):
                out[j][name] = self._shards[name][j]
        return out

    def run(self, prog: TTProgram, inputs: dict, kv_cache, owners=None) -> dict[str, np.ndarray]:
        """Every device runs `prog`; returns device 0's tensors with the program output composed over the mesh
        (all devices' tensors are in `self.devices`)."""
        if set(inputs) != set(prog.inputs):
            raise ValueError(f"program inputs are {sorted(prog.inputs)}, got {sorted(inputs)}")
        if len(kv_cache) != self.config.num_layers:
            raise ValueError(f"kv_cache has {len(kv_cache)} layers, the model {self.config.num_layers}")
        rows, cols = self.mesh_shape
        heads_axis = prog.meta["mesh"].get("heads_axis", 1)
        k = self.config.num_kv_heads // self.mesh_shape[heads_axis]
        devices = self._device_weights(prog)
        for d, t in enumerate(devices):
            t |= {name: np.asarray(v) for name, v in inputs.items()}  # ReplicateTensorToMesh
            j = d // cols if heads_axis == 0 else d % cols  # the device's place along the heads axis
            for i, (kc, vc) in enumerate(kv_cache):  # views: the device's KV heads of the logical cache
                t[f"kv.{i}.k"], t[f"kv.{i}.v"] = kc[:, j * k:(j + 1) * k], vc[:, j * k:(j + 1) * k]
        env = Env(self.level, lambda x, dt: self._store(x, dt, "device"), self.kv_dtype, owners)
        for idx, c in enumerate(prog.calls):
            if c.op in CCL:
                results = [None] * len(devices)
                for group in groups(self.mesh_shape, c.kwargs["cluster_axis"]):
                    for d, r in zip(group, CCL[c.op]([devices[d][c.inputs[0]] for d in group], **c.kwargs)):
                        results[d] = (r,)
            else:
                fn = OPS.get(c.op)
                if fn is None:
                    raise NotImplementedError(f"call {idx}: the emulator has no {c.op}")
                results = []
                for t in devices:
                    kw = {key: t[v.name] if isinstance(v, Ref) else v for key, v in c.kwargs.items()}
                    res = fn(env, *[t[x] for x in c.inputs], **kw)
                    results.append((res,) if len(c.outputs) == 1 else res)
            for t, res in zip(devices, results):
                for name, val in zip(c.outputs, res):
                    t[name] = self._store(val, prog.tensors[name].dtype, "device")
        self.devices = devices
        out = dict(devices[0])
        name = prog.outputs[0]
        composer = prog.meta["mesh"]["output"]
        if composer is not None:  # Concat(Mesh2d)ToTensor, then one copy of replicated rows, the vocab padding dropped
            if composer["mesh_composer"] == "ttnn.ConcatMeshToTensor":
                full = np.concatenate([t[name] for t in devices], axis=composer["dim"])
            else:
                d_row, d_col = composer["dims"]
                by_row = [np.concatenate([devices[r * cols + c][name] for c in range(cols)], axis=d_col)
                          for r in range(rows)]
                full = np.concatenate(by_row, axis=d_row)
                if composer.get("rows_replicated"):
                    full = np.take(full, [0], axis=d_row)
            width = composer.get("logical_width")
            out[name] = full if width is None else full[..., :width]
        return out


class MeshVLLMExecutor(VLLMExecutor):
    """`VLLMExecutor` (the generator's per-submesh executor) over a TP mesh; caches are the logical ones."""

    def __init__(self, model, mesh, *, numerics: str = "full", policy="performance", max_seq_len: int = 8192,
                 block_size: int = 32):
        self.executor = MeshExecutor(model, mesh, numerics=numerics, policy=policy, max_seq_len=max_seq_len,
                                     block_size=block_size)
        self.config = model.config


def _shape(submesh) -> tuple[int, int]:
    shape = getattr(submesh, "shape", submesh)
    return (1, int(shape)) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)


def executor_factory(model, *, numerics: str = "full", policy=None, block_size: int = 32):
    """For `tt_backend.generator.initialize_vllm_model(mesh_device=EmulatedMesh((rows, cols)),
    tt_data_parallel=dp, executor_factory=...)`: every submesh runs tensor parallel over its own devices, in the
    submesh's own shape (tt-metal hands dp > 1 submeshes over as (1, n/dp) rings and, with dp = 1, the whole
    mesh: a Galaxy's 8x4 then runs the 2-D TG layout)."""

    def make(config, submesh, max_batch_size, max_seq_len, optimizations="performance"):
        check_decode_batch(max_batch_size)
        pol = policy or (optimizations if isinstance(optimizations, str) else "performance")
        return MeshVLLMExecutor(first_layers(model, config), _shape(submesh), numerics=numerics, policy=pol,
                                max_seq_len=max_seq_len, block_size=block_size)

    return make


def data_parallel(model, mesh, data_parallel: int, **kw) -> list[MeshExecutor]:
    """One TP executor per data-parallel submesh of `mesh` (`tt_backend.mesh.submesh_shapes`); each serves its
    own users with its own caches."""
    return [MeshExecutor(model, shape, **kw) for shape in tp.submesh_shapes(mesh, data_parallel)]
