"""Tensor parallelism as a program transform: a single-device `TTProgram` -> the program every device of a
mesh runs, as tt_transformers splits a decoder over N300 (1x2), T3K (1x8) and Galaxy (8x4, "TG"). The lowering
stays single-device; `shard(lower(cfg, ...), (1, 8))` gives the mesh program.

Which mesh axis splits what (MaxText-style logical axes, `LOGICAL_AXES`): every weight dim has a logical name
("heads", "ffn", "vocab", "embed" = the hidden size, "experts"); a 1-D mesh (1, N) maps them all to its one axis,
Galaxy's 2-D mesh (R, C) maps heads / ffn to the rows (axis 0) and embed / vocab to the columns (axis 1), as
tt_transformers' TG layout does. A weight dim takes its axis unless an earlier dim of the same weight has it
(so on a 1-D mesh wqkv splits its heads and keeps its input whole).

Placement (tt_transformers `decoder.py`, `attention.py`, `mlp.py`, `embedding.py`, `lm_head.py`, `ccl.py`):
- the residual stream is *fractured*: each device holds D/C columns (the embedding table is sharded on
  its hidden dim, `ShardTensor2dMesh(dims=(None, 3))`), replicated over the rows of a 2-D mesh;
- norm inputs are all-gathered first (`DistributedNorm` on N300/T3K: all_gather dim 3, then the norm); on a
  2-D mesh the norm's output is then cut back to the columns (`ttnn.mesh_partition`) for the 2-D-sharded
  matmuls (TG runs a distributed RMSNorm instead: the same numbers, its stats exchanged instead of x);
- 1-D: column-parallel wqkv (regrouped so each device holds [q | k | v] of its own heads, as `attention.py`
  builds `qkv_list`), w1/w3 and their biases, the LM head (vocab split); row-parallel wo and w2, whose partial
  sums are reduce-scattered on dim 3 back to the fractured residual (`tt_all_reduce` on a 1-D mesh); their
  biases are added after it, sharded like the residual, so they are added once;
- 2-D (TG): wqkv / w1 / w3 `dims=(3, 2)` and wo / w2 `dims=(2, 3)`: each matmul's partial sums over one axis
  are all-reduced on that `cluster_axis` (attention.py / mlp.py's `tt_all_reduce(cluster_axis=1 | 0)`);
- heads are split (over the heads axis): attention runs on each device's query / KV heads and the paged KV
  caches hold their KV heads (`ShardTensor2dMesh` on the logical cache's dim 1); per-head q/k-norm weights and
  attention sinks are split with them;
- MoE experts are expert-parallel (tt_transformers `TtMoeLayer`, GPT-OSS's `ep` axis): device d (row-major)
  holds experts d*E/n .. (d+1)*E/n - 1 whole, the router runs replicated, the dense routing weights are
  mesh-partitioned so each device keeps its experts' columns, and the sum over devices is the CCL at the end;
- a replicated value that must join the fractured residual (Gemma's sandwich norms, EXAONE's post norms)
  is cut locally with `ttnn.mesh_partition` (tt_transformers reduce-scatters N equal copies and divides by N;
  the partition is the same numbers without the traffic); partial sums needed whole use `ttnn.all_reduce`;
- logits stay vocab-sharded; the host concatenates them (`ConcatMeshToTensor(dim=3)` on a 1-D mesh,
  `ConcatMesh2dToTensor(dims=(1, 3))` and one row on a 2-D one, as `process_output_*` does) and drops the vocab
  padding (the LM head is padded to whole tiles per device).

The CCLs are the wheel's synchronous `ttnn.all_gather` / `ttnn.reduce_scatter` / `ttnn.all_reduce` /
`ttnn.mesh_partition` with `cluster_axis` (tt_transformers calls the `experimental.*_async` variants, whose
global semaphores are run-time objects a serialised program cannot name). The tests check every call against
`api_signatures.json`.

How placements propagate: each tensor has one `Placement` per mesh axis (replicated, sharded on one dim,
partial sums, or device-local expert values); weights get theirs from `WEIGHT_RULES` + `LOGICAL_AXES` (rules as
data, by name); op rules then decide each output's placement and insert the CCLs that turn an input into what
the op needs. An op without a rule raises `NotImplementedError` (nothing is replicated silently); shapes the
mesh cannot split raise `MeshShardError` (a `TTConstraintError`) naming the count and the mesh size.

Data parallelism over submeshes, as tt-metal's `generator_vllm.create_submeshes`: `submesh_shapes(mesh,
dp)` gives dp submeshes of shape (1, n/dp), each running the TP program (`tt_backend.emu.mesh`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np

from tt_backend.lowering import TILE, TTConstraintError, check_program
from tt_backend.program import Ref, TTCall, TTModelProgram, TTProgram, TTTensorSpec

__all__ = ["MeshShardError", "Placement", "WEIGHT_RULES", "LOGICAL_AXES", "mesh_shape", "shard", "shard_program",
           "distribute", "host_tensor", "submesh_shapes", "ttnn_mapper", "ttnn_composer", "CCL_OPS"]

CCL_OPS = ("ttnn.all_gather", "ttnn.reduce_scatter", "ttnn.all_reduce", "ttnn.mesh_partition")
TOPOLOGY = "ttnn.Topology.Linear"  # tt_transformers' default for N300/T3K CCLs


class MeshShardError(TTConstraintError):
    """A model shape that cannot be split over the mesh (heads, KV heads, hidden or intermediate sizes)."""


@dataclass(frozen=True)
class Placement:
    """Where a tensor's values live along one mesh axis.

    replicate: every device of the axis holds all of it. shard: device j of the axis holds slice j of `dim`
    (a dim split on both axes is split by rows, then each row's part by columns). partial: every device holds a
    full-shape term; the value is their sum (a matmul whose contracted dim is split). local: every device holds a
    full-shape value of its own experts (expert parallelism); the layer's value is their sum."""

    kind: str
    dim: int | None = None

    def __post_init__(self):
        if self.kind not in ("replicate", "shard", "partial", "local"):
            raise ValueError(f"unknown placement kind {self.kind!r}")
        if (self.kind == "shard") != (self.dim is not None):
            raise ValueError("a shard placement needs its dim; other placements take none")


R, P, E = Placement("replicate"), Placement("partial"), Placement("local")


def S(dim: int) -> Placement:
    return Placement("shard", dim)


# ------------------------------------------------------------------------------------------ weights
# (name pattern, logical name of each dim, host preparation); first match wins. Expert weights come first:
# their names end like the dense MLP's ("layers.0.e3.w1").
WEIGHT_RULES: tuple[tuple[str, tuple, str | None], ...] = (
    (r"^layers\.\d+\.e\d+\.(w1|w3|w2|b1|b3|b2)$", ("experts",), "experts"),  # whole experts per device (EP)
    (r"^embed$", (None, "embed"), None),  # [V, D] table: hidden split, so the lookup is already fractured
    (r"^lm_head$", (None, None, "embed", "vocab"), "pad_vocab"),  # vocab-parallel (padded to whole tiles)
    (r"\.wqkv$", (None, None, "embed", "heads"), "regroup_qkv"),  # each device's [q | k | v]
    (r"\.bqkv$", (None, None, None, "heads"), "regroup_qkv"),
    (r"\.(w1|w3)$", (None, None, "embed", "ffn"), None),
    (r"\.(b1|b3)$", (None, None, None, "ffn"), None),
    (r"\.wo$", (None, None, "heads", "embed"), None),
    (r"\.w2$", (None, None, "ffn", "embed"), None),
    (r"\.(bo|b2)$", (None, None, None, "embed"), None),  # added to the reduced, fractured output
    (r"\.(q_norm|k_norm)$", (None, "heads", None, None), "per_head"),  # [1, heads, 1, d]; [1, 1, 1, d] replicated
    (r"\.sinks$", (None, None, None, "heads"), None),  # [1, 1, 1, H]: one logit per query head
    (r"^kv\.\d+\.[kv]$", (None, "heads", None, None), None),  # paged caches [blocks, K, block, d]
    (r".", (), None),  # norms, router, rope tables, trans_mat
)
# logical name -> mesh axis, and the order in which a weight's dims claim their axis
LOGICAL_AXES = {"1d": {"heads": 1, "ffn": 1, "vocab": 1, "embed": 1},
                "2d": {"heads": 0, "ffn": 0, "vocab": 1, "embed": 1}}
_PRIORITY = ("heads", "ffn", "vocab", "embed")


def mesh_shape(mesh) -> tuple[int, int]:
    """(rows, cols): an int N means (1, N); (N, 1) is turned into (1, N) (a 1-D mesh splits on its one axis)."""
    shape = (1, int(mesh)) if isinstance(mesh, (int, np.integer)) else tuple(int(s) for s in mesh)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh shape must be (rows, cols) with both >= 1, got {mesh!r}")
    return (1, shape[0]) if shape[1] == 1 else shape


def _layout(shape: tuple[int, int], logical: tuple, full: tuple) -> tuple[Placement, Placement]:
    """A weight's placement per mesh axis from the logical names of its dims."""
    if logical == ("experts",):  # stacked [rows, cols, ...] on the host, split by both axes
        return tuple(E if shape[a] > 1 else R for a in (0, 1))
    axes = LOGICAL_AXES["2d" if shape[0] > 1 else "1d"]
    out = [R, R]
    for name in _PRIORITY:
        for dim, ln in enumerate(logical):
            a = axes[name] if ln == name else None
            if a is not None and shape[a] > 1 and out[a] == R and full[dim] > 1:
                out[a] = S(dim)
    return tuple(out)


def weight_rule(name: str, shape: tuple) -> tuple[tuple, str | None]:
    for pattern, logical, host in WEIGHT_RULES:
        if re.search(pattern, name):
            if host == "per_head" and shape[1] == 1:
                return (), None
            return logical, host
    raise AssertionError("the last rule matches every name")


def _mapper(shape: tuple[int, int], layout: tuple, host: str | None = None, **extra) -> dict:
    """The wheel's mesh mapper for `layout` (ttnn.ShardTensor2dMesh(mesh_device, dims, mesh_shape) /
    ttnn.ReplicateTensorToMesh(mesh_device)) plus how the host tensor is prepared before it."""
    if all(p == R for p in layout):
        spec = {"mesh_mapper": "ttnn.ReplicateTensorToMesh"}
    else:  # experts: stacked on two leading dims [rows, cols, ...], one slice per device
        dims = [a if p == E else (p.dim if p.kind == "shard" else None) for a, p in enumerate(layout)]
        spec = {"mesh_mapper": "ttnn.ShardTensor2dMesh", "mesh_shape": list(shape), "dims": dims}
    if host:
        spec["host"] = {"kind": host, **extra}
    return spec


def ttnn_mapper(ttnn, mesh_device, spec: dict):
    """The wheel's mapper object for `spec`, for `ttnn.as_tensor(host_tensor(...), ..., mesh_mapper=...)` on a real
    mesh (`tt_backend.ttnn_exec` does not load mesh programs yet)."""
    if spec["mesh_mapper"] == "ttnn.ReplicateTensorToMesh":
        return ttnn.ReplicateTensorToMesh(mesh_device)
    return ttnn.ShardTensor2dMesh(mesh_device, dims=tuple(spec["dims"]), mesh_shape=tuple(spec["mesh_shape"]))


def ttnn_composer(ttnn, mesh_device, spec: dict):
    """`ttnn.to_torch(logits, mesh_composer=...)` for a program's `meta["mesh"]["output"]` (then keep row 0 of dim 1
    when `rows_replicated`, and the first `logical_width` columns when it is given)."""
    if spec["mesh_composer"] == "ttnn.ConcatMeshToTensor":
        return ttnn.ConcatMeshToTensor(mesh_device, dim=spec["dim"])
    return ttnn.ConcatMesh2dToTensor(mesh_device, mesh_shape=tuple(spec["mesh_shape"]), dims=tuple(spec["dims"]))


def host_tensor(host: dict, name: str, spec: dict) -> np.ndarray:
    """The host array `ttnn.as_tensor(..., mesh_mapper=...)` is given for weight `name` (mapper `spec`):
    experts stacked [rows, cols, ...], wqkv regrouped per heads group, the LM head padded."""
    prep = spec.get("host", {})
    kind = prep.get("kind")
    if kind == "experts":
        rows, cols = spec["mesh_shape"]
        grid = [[np.asarray(host[prep["stack"][r * cols + c]])[0, 0] for c in range(cols)] for r in range(rows)]
        return np.stack([np.stack(g) for g in grid])
    a = np.asarray(host[name])
    if kind == "regroup_qkv":
        H, K, d, n = prep["heads"], prep["kv_heads"], prep["head_dim"], prep["groups"]
        q, k, v = np.split(a, [H * d, (H + K) * d], axis=-1)
        parts = [np.split(t, n, axis=-1) for t in (q, k, v)]
        return np.concatenate([p for j in range(n) for p in (parts[0][j], parts[1][j], parts[2][j])], axis=-1)
    if kind == "pad_vocab":
        pad = prep["padded"] - a.shape[-1]
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a
    return a


def distribute(a: np.ndarray, spec: dict) -> list[np.ndarray]:
    """What each device holds after `ttnn.as_tensor(a, mesh_mapper=spec)`, devices in row-major mesh order."""
    if spec["mesh_mapper"] == "ttnn.ReplicateTensorToMesh":
        raise ValueError("a replicated tensor has no per-device split: every device holds it whole")
    rows, cols = spec["mesh_shape"]
    d0, d1 = spec["dims"]
    by_row = np.split(a, rows, axis=d0) if d0 is not None else [a] * rows
    out = []
    for part in by_row:
        out += np.split(part, cols, axis=d1) if d1 is not None else [part] * cols
    return out


# ------------------------------------------------------------------------------------- the transform
def shard(program: TTModelProgram, mesh) -> TTModelProgram:
    """Both programs of a model over a mesh (see the module doc)."""
    shape = mesh_shape(mesh)
    prefill, decode = shard_program(program.prefill, shape), shard_program(program.decode, shape)
    meta = dict(program.meta)
    kv = dict(meta.get("kv_cache", {}))
    if kv.get("shape") and "kv.0.k" in decode.tensors:
        kv["shape"] = [None, *decode.tensors["kv.0.k"].shape[1:]]
    meta |= {"mesh_shape": list(shape), "kv_cache": kv}
    return TTModelProgram(prefill, decode, meta)


def shard_program(prog: TTProgram, mesh) -> TTProgram:
    """The program one device of the mesh runs; `meta["mesh"]` holds every weight's, input's and cache's
    mesh mapper and the output's mesh composer."""
    return _Sharder(prog, mesh_shape(mesh)).run()


def _spec(old: TTTensorSpec, shape: tuple) -> TTTensorSpec:
    tile = old.layout == "ttnn.TILE_LAYOUT"
    pad = lambda s: None if s is None else -(-s // TILE) * TILE  # noqa: E731
    padded = shape[:-2] + tuple(pad(s) for s in shape[-2:]) if tile else shape
    return dataclasses.replace(old, shape=tuple(shape), padded_shape=tuple(padded))


_ELEMENTWISE = {"ttnn.add", "ttnn.mul", "ttnn.div", "ttnn.typecast", "ttnn.tanh", "ttnn.clamp", "ttnn.sigmoid"}
_NORMS = {"ttnn.rms_norm", "ttnn.layer_norm"}
_WHOLE_ROW = {"ttnn.topk", "ttnn.softmax", "ttnn.sum", "ttnn.scatter"}  # read the whole last dim: replicated
_HEADS = {"ttnn.experimental.nlp_create_qkv_heads": 1, "ttnn.experimental.nlp_create_qkv_heads_decode": 2}
_CONCAT = {"ttnn.experimental.nlp_concat_heads": 1, "ttnn.experimental.nlp_concat_heads_decode": 2}
_ATTENTION = {"ttnn.transformer.scaled_dot_product_attention": 1,
              "ttnn.transformer.chunked_scaled_dot_product_attention": 1,
              "ttnn.transformer.paged_scaled_dot_product_attention_decode": 2,
              "ttnn.experimental.paged_fill_cache": 1, "ttnn.experimental.paged_update_cache": 2}


class _Sharder:
    def __init__(self, prog: TTProgram, shape: tuple[int, int]):
        self.prog, self.shape = prog, shape
        self.n = shape[0] * shape[1]
        self.axes = [a for a in (0, 1) if shape[a] > 1]
        self.heads_axis = LOGICAL_AXES["2d" if shape[0] > 1 else "1d"]["heads"]
        self.calls: list[TTCall] = []
        self.tensors: dict[str, TTTensorSpec] = {}
        self.plc: dict[str, tuple] = {}  # per tensor: (axis-0 placement, axis-1 placement)
        self.full: dict[str, tuple] = {}  # every tensor's logical (whole-mesh) shape
        self.made: dict[tuple, str] = {}  # CCL results already emitted, reused
        self.mappers: dict[str, dict] = {}
        self.alias: dict[str, str] = {}  # dropped expert tails -> the last kept expert's sum
        self.logits = False  # set once the LM head has run: later [.., V] tensors are padded logits

    def size(self, logical: str) -> int:
        return self.shape[LOGICAL_AXES["2d" if self.shape[0] > 1 else "1d"][logical]]

    # ------------------------------------------------------------------------------------ checks
    def _dims(self):
        t, where = self.prog.tensors, f"tensor parallelism over a {self.shape[0]}x{self.shape[1]} mesh"
        hk = {(c.kwargs["num_heads"], c.kwargs["num_kv_heads"]) for c in self.prog.calls if c.op in _HEADS}
        nh = self.size("heads")
        for H, K in hk:
            if H % nh:
                raise MeshShardError(f"{where}: {H} query heads are not divisible by {nh}")
            if K % nh:
                raise MeshShardError(f"{where}: {K} KV heads are not divisible by {nh} (each device keeps whole KV "
                                     f"heads in its cache)")
        D, ne = t["final_norm"].shape[-1], self.size("embed")
        if D % (TILE * ne):
            raise MeshShardError(f"{where}: hidden_size={D} is not a multiple of {TILE * ne} (the fractured "
                                 f"residual keeps D/{ne} = whole {TILE}-wide tiles on each device)")
        nf = self.size("ffn")
        for name, s in t.items():
            if s.kind == "weight" and re.search(r"^layers\.\d+\.w1$", name) and s.shape[-1] % (TILE * nf):
                raise MeshShardError(f"{where}: {name} intermediate size {s.shape[-1]} is not a multiple of "
                                     f"{TILE * nf} (whole tiles per device)")
        self.heads = hk.pop() if hk else None

    def _experts(self):
        """Expert-parallel MoE layers: keep the first E/n expert iterations of each (device d runs its own
        experts through them), drop the rest, and let the layer read the last kept expert's sum."""
        t, n = self.prog.tensors, self.n
        counts: dict[str, int] = {}
        for name in t:
            m = re.match(r"^layers\.(\d+)\.e(\d+)\.w1$", name)
            if m:
                counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
        self.local_experts = {}
        drop = set()
        for i, E_ in counts.items():
            if E_ % n:
                raise MeshShardError(f"expert parallelism over {n} devices: layer {i} has {E_} experts, not "
                                     f"divisible by {n}")
            keep = E_ // n
            self.local_experts[i] = (E_, keep)
            last = {}
            for k, c in enumerate(self.prog.calls):
                for o in c.outputs:
                    m = re.match(rf"^l{i}\.e(\d+)\.", o)
                    if m:
                        last[int(m.group(1))] = o
                        if int(m.group(1)) >= keep:
                            drop.add(k)
            if keep < E_:
                self.alias[last[E_ - 1]] = last[keep - 1]
        self.calls_in = [c for k, c in enumerate(self.prog.calls) if k not in drop]

    # -------------------------------------------------------------------------------- placements
    def _seed(self):
        prog, n = self.prog, self.n
        V = prog.tensors["lm_head"].shape[-1] if "lm_head" in prog.tensors else None
        nv = self.size("vocab")
        self.vocab, self.padded_vocab = V, (None if V is None else -(-V // (TILE * nv)) * TILE * nv)
        used = {r for c in self.calls_in for r in c.refs()}
        for name, s in prog.tensors.items():
            if name not in used and s.kind != "state":
                continue
            if s.kind in ("weight", "state"):
                logical, host = weight_rule(name, s.shape)
                full, extra = tuple(s.shape), {}
                if host == "experts":
                    i, e, w = re.match(r"^layers\.(\d+)\.e(\d+)\.(\w+)$", name).groups()
                    keep = self.local_experts[i][1]
                    extra = {"stack": [f"layers.{i}.e{j * keep + int(e)}.{w}" for j in range(n)]}
                elif host == "regroup_qkv":
                    H, K = self.heads
                    extra = {"heads": H, "kv_heads": K, "head_dim": full[-1] // (H + 2 * K),
                             "groups": self.size("heads")}
                elif host == "pad_vocab":
                    full = full[:-1] + (self.padded_vocab,)
                    extra = {"padded": self.padded_vocab, "vocab": V}
                layout = _layout(self.shape, logical, full)
                self._set(name, layout, full, s)
                self.mappers[name] = _mapper(self.shape, layout, host, **extra)
            elif s.kind == "input":
                self._set(name, (R, R), tuple(s.shape), s)
                self.mappers[name] = _mapper(self.shape, (R, R))

    def _local(self, full: tuple, layout: tuple) -> tuple:
        div = [1] * len(full)
        for a, p in enumerate(layout):
            if p.kind == "shard":
                div[p.dim] *= self.shape[a]
        return tuple(s if s is None else s // k for s, k in zip(full, div))

    def _set(self, name: str, layout: tuple, full: tuple, old: TTTensorSpec):
        self.plc[name], self.full[name] = tuple(layout), tuple(full)
        self.tensors[name] = _spec(old, self._local(full, layout))

    # ---------------------------------------------------------------------------------- the CCLs
    def need(self, name: str, want: tuple) -> str:
        """`name` laid out as `want`, emitting the CCLs that make it (once per tensor and layout), axis by axis."""
        name = self.alias.get(name, name)
        if self.plc[name] == tuple(want):
            return name
        key = (name, tuple(want))
        if key not in self.made:
            cur = name
            for a in self.axes:
                if self.plc[cur][a] != want[a]:
                    cur = self._convert(cur, a, want[a])
            self.made[key] = cur
        return self.made[key]

    def _convert(self, name: str, a: int, want: Placement) -> str:
        have, full = self.plc[name][a], self.full[name]
        last = len(full) - 1
        ccl = {"cluster_axis": a, "num_links": 1, "topology": TOPOLOGY, "memory_config": self.tensors[name].memory}
        tag = f"ax{a}" if len(self.axes) > 1 else ""
        if have in (P, E) and want == R:  # partial sums needed whole
            op, kw, out = "ttnn.all_reduce", ccl, f"{name}.ar{tag}"
        elif have in (P, E) and want == S(last):  # tt_all_reduce on a 1-D mesh: reduce_scatter
            op, kw, out = "ttnn.reduce_scatter", {"dim": last, **ccl}, f"{name}.rs{tag}"
        elif have == S(last) and want == R:  # DistributedNorm: all_gather before the norm
            op, kw, out = "ttnn.all_gather", {"dim": last, **ccl}, f"{name}.ag{tag}"
        elif have == R and want == S(last):  # each device keeps its slice, no traffic
            kw = {"dim": last, "cluster_axis": a, "memory_config": self.tensors[name].memory}
            op, out = "ttnn.mesh_partition", f"{name}.part{tag}"
        else:
            raise NotImplementedError(f"no collective turns {name} from {have} into {want} on mesh axis {a}")
        layout = list(self.plc[name])
        layout[a] = want
        self.calls.append(TTCall(op, (name,), kw, (out,)))
        self._set(out, tuple(layout), full, self.tensors[name])
        return out

    # ---------------------------------------------------------------------------------- op rules
    def run(self) -> TTProgram:
        if self.n == 1:
            meta = dict(self.prog.meta) | {"mesh": {"shape": list(self.shape), "mappers": {}, "output": None}}
            return dataclasses.replace(self.prog, meta=meta)
        self._dims()
        self._experts()
        self._seed()
        for call in self.calls_in:
            self._call(call)
        out = self.alias.get(self.prog.outputs[0], self.prog.outputs[0])
        last = len(self.full[out]) - 1
        if self.plc[out] != (R, S(last)):
            raise NotImplementedError(f"program output {out} ends {self.plc[out]}, not vocab-sharded on the columns")
        if self.shape[0] == 1:
            composer = {"mesh_composer": "ttnn.ConcatMeshToTensor", "dim": last}
        else:  # rows hold copies: concatenate them on dim 1 and keep one
            composer = {"mesh_composer": "ttnn.ConcatMesh2dToTensor", "mesh_shape": list(self.shape),
                        "dims": [1, last], "rows_replicated": True}
        if self.vocab != self.padded_vocab:
            composer["logical_width"] = self.vocab  # drop the LM head's zero padding after the concat
        meta = dict(self.prog.meta) | {"mesh": {"shape": list(self.shape), "heads_axis": self.heads_axis,
                                                "mappers": self.mappers, "output": composer}}
        new = TTProgram(self.prog.mode, self.calls, self.tensors, self.prog.inputs, (out,), meta)
        check_program(new)
        return new

    def _out(self, old: str, layout: tuple):
        full = tuple(self.prog.tensors[old].shape)
        if self.vocab != self.padded_vocab and self.logits and full[-1] == self.vocab:
            full = full[:-1] + (self.padded_vocab,)
        self._set(old, layout, full, self.prog.tensors[old])
        return self.tensors[old].shape

    def _heads(self, dim: int) -> tuple:
        """Split heads on the heads axis (dim 1 in prefill [1, H, S, d], 2 in decode [1, B, H, d])."""
        return tuple(S(dim) if a == self.heads_axis else R for a in (0, 1))

    def _call(self, c: TTCall):
        op, nh = c.op, self.size("heads")
        ins = [self.alias.get(x, x) for x in c.inputs]
        kw = dict(c.kwargs)
        last = len(self.full[ins[0]]) - 1 if ins else 0
        if op == "ttnn.embedding":  # [1, rows, D/C] from the hidden-split table
            out = [tuple(S(2) if p == S(1) else R for p in self.plc[ins[1]])]
        elif op == "ttnn.reshape":
            shape_out = tuple(self.prog.tensors[c.outputs[0]].shape)
            out = [tuple(self._reshaped(p, self.full[ins[0]], shape_out) for p in self.plc[ins[0]])]
        elif op in ("ttnn.linear", "ttnn.matmul"):
            if "bias" in kw:
                raise NotImplementedError(f"{op} with a fused bias: the lowering adds biases separately")
            x, w = ins
            want, lay = [], []
            for xp, wp in zip(self.plc[x], self.plc[w]):
                if wp == S(3):  # output features split: input whole, output split on its last dim
                    want.append(R), lay.append(S(last))
                elif wp == S(2):  # contracted dim split: input split on its last dim, partial sums out
                    want.append(S(last)), lay.append(P)
                elif wp == E:  # this device's expert
                    want.append(E if xp == E else R), lay.append(E)
                else:
                    want.append(R), lay.append(R)
            ins[0], out = self.need(x, tuple(want)), [tuple(lay)]
            self.logits = self.logits or w == "lm_head"
        elif op in _ELEMENTWISE:
            ins, out = self._elementwise(op, ins)
        elif op in _NORMS:  # per-head norms (q/k-norm) stay on their heads; others read the whole row
            lay = tuple(p if p.kind == "shard" and p.dim != last else R for p in self.plc[ins[0]])
            ins[0], out = self.need(ins[0], lay), [lay]
        elif op in _WHOLE_ROW:
            ins, out = [self.need(x, (R, R)) for x in ins], [(R, R)] * len(c.outputs)
        elif op == "ttnn.slice":
            m = re.match(r"^l(\d+)\.e(\d+)\.", c.outputs[0])
            if m and m.group(1) in self.local_experts:  # the routing weights of this device's k-th expert
                lay = tuple(S(last) if a in self.axes else R for a in (0, 1))
                ins[0], out = self.need(ins[0], lay), [tuple(E if a in self.axes else R for a in (0, 1))]
            else:
                ins[0], out = self.need(ins[0], (R, R)), [(R, R)]
        elif op in _HEADS:
            ins[0] = self.need(ins[0], self._heads(3))
            kw["num_heads"], kw["num_kv_heads"] = kw["num_heads"] // nh, kw["num_kv_heads"] // nh
            out = [self._heads(_HEADS[op])] * 3
        elif op == "ttnn.experimental.rotary_embedding_llama":
            ins[1:] = [self.need(x, (R, R)) for x in ins[1:]]
            out = [self.plc[ins[0]]]
        elif op in _ATTENTION:
            for x in ins:
                if self.prog.tensors[x].kind not in ("state", "input") and self.plc[x] != self._heads(_ATTENTION[op]):
                    raise NotImplementedError(f"{op}: {x} is {self.plc[x]}, expected its heads split")
            out = [self._heads(_ATTENTION[op])] * len(c.outputs)
        elif op in _CONCAT:
            if self.plc[ins[0]] != self._heads(_CONCAT[op]):
                raise NotImplementedError(f"{op}: {ins[0]} is {self.plc[ins[0]]}, expected split heads")
            if "num_heads" in kw:
                kw["num_heads"] //= nh
            out = [self._heads(3)]
        else:
            raise NotImplementedError(f"tensor parallelism has no rule for {op} (call output {c.outputs})")
        for k, v in kw.items():  # keyword tensors: weights keep their mapper, activations are replicated
            if isinstance(v, Ref) and self.prog.tensors[v.name].kind not in ("weight", "state", "input"):
                kw[k] = Ref(self.need(v.name, (R, R)))
        shapes = [self._out(o, lay) for o, lay in zip(c.outputs, out)]
        if op == "ttnn.reshape":
            kw["shape"] = list(shapes[0])
        self.calls.append(TTCall(op, tuple(ins), kw, c.outputs))

    @staticmethod
    def _reshaped(p: Placement, shape_in: tuple, shape_out: tuple) -> Placement:
        """The split dim after a reshape: the output dim of the same size after the same number of elements."""
        if p.kind != "shard":
            return p
        before = math.prod(shape_in[:p.dim])
        for j in range(len(shape_out)):
            if math.prod(shape_out[:j]) == before and shape_out[j] == shape_in[p.dim]:
                return S(j)
        raise NotImplementedError(f"reshape {shape_in} -> {shape_out} moves the split dim {p.dim}")

    def _elementwise(self, op: str, ins: list[str]):
        """Per mesh axis: equal placements go through; a broadcast operand (size 1 where the other is split, e.g.
        the [rows, 1] routing weight) goes along; otherwise both meet at the last dim split (or whole, when the
        other axis already splits the last dim), partial sums reduced first."""
        last = len(self.full[ins[0]]) - 1
        lays = [list(self.plc[x]) for x in ins]
        out = [R, R]
        for a in self.axes:
            ps = [lay[a] for lay in lays]
            other = [lay[1 - a] for lay in lays]
            target = R if S(last) in other else S(last)
            if len(ins) == 1:
                p = ps[0]
                keep = p != P or op == "ttnn.mul"  # only c * sum(x_j) == sum(c * x_j) may stay partial
                out[a] = p if keep else target
                lays[0][a] = out[a]
                continue
            pa, pb = ps
            if pa == pb and (pa != P or op == "ttnn.add"):
                out[a] = pa
                continue
            done = False
            for i, j in ((0, 1), (1, 0)):
                px, py = ps[i], ps[j]
                if py == R and self._broadcasts(ins[j], px, ins[i]) and (
                        px == E or (px == P and op == "ttnn.mul") or px.kind == "shard"):
                    out[a], done = px, True
                    break
            if done:
                continue
            for lay in lays:
                lay[a] = target
            out[a] = target
        ins = [self.need(x, tuple(lay)) for x, lay in zip(ins, lays)]
        return ins, [tuple(out)]

    def _broadcasts(self, y: str, px: Placement, x: str) -> bool:
        fy, fx = self.full[y], self.full[x]
        if px.kind == "shard":
            return fy[px.dim] == 1 and fx[px.dim] > 1
        return fy[-1] == 1 and fx[-1] > 1  # a per-row scale of a partial / expert-local value


# ---------------------------------------------------------------------------------- data parallel
def submesh_shapes(mesh, data_parallel: int) -> list[tuple[int, int]]:
    """`data_parallel` submeshes of a (rows, cols) mesh, each (1, n / dp), as tt-metal's
    `generator_vllm.create_submeshes` (a Galaxy 8x4 with dp=4 -> four 1x8 rings); each runs the TP program."""
    rows, cols = (1, int(mesh)) if isinstance(mesh, (int, np.integer)) else tuple(int(s) for s in mesh)
    n = rows * cols
    if data_parallel < 1 or n % data_parallel:
        raise MeshShardError(f"cannot split a mesh of {n} devices into {data_parallel} data-parallel submeshes")
    return [(1, n // data_parallel)] * data_parallel
