"""Tensor parallelism as a program transform: a single-device `TTProgram` -> the program every device of a
1-D mesh runs (N300: 1x2, T3K: 1x8, a Galaxy row: 1x8), as tt_transformers splits a decoder over
N300/T3K. The lowering stays single-device; `shard(lower(cfg, ...), (1, 8))` gives the mesh program.

Placement (tt_transformers `decoder.py`, `attention.py`, `mlp.py`, `embedding.py`, `lm_head.py`):
- the residual stream is *fractured*: each device holds D/N columns (the embedding table is sharded on
  its hidden dim, `ShardTensor2dMesh(dims=(None, 3))`);
- every norm input is all-gathered first (`DistributedNorm` on N300/T3K: all_gather dim 3, then the norm),
  so norms, routers and attention read replicated activations;
- column-parallel: wqkv (regrouped so each device holds [q | k | v] of its own H/N query and K/N KV heads,
  as `attention.py` builds `qkv_list` per device), w1/w3 and their biases, the LM head (vocab split);
- row-parallel: wo and w2; their partial sums are reduce-scattered on dim 3 back to the fractured
  residual (`tt_all_reduce` on a 1-D mesh is a reduce_scatter); the wo/w2 biases are added after it,
  sharded like the residual, so they are added once;
- heads are split: attention runs on each device's H/N query / K/N KV heads, and the paged KV caches
  hold K/N heads per device (`ShardTensor2dMesh(dims=(None, 1))` of the logical cache); per-head q/k-norm
  weights and attention sinks are split with them;
- MoE experts are expert-parallel (tt_transformers `TtMoeLayer`, GPT-OSS's `ep` axis): device j holds experts
  j*E/N .. (j+1)*E/N - 1 whole, the router runs replicated, the dense routing weights are mesh-partitioned
  so each device keeps its experts' columns, and the sum over devices is the reduce_scatter at the end;
- a replicated value that must join the fractured residual (Gemma's sandwich norms, EXAONE's post norms)
  is cut locally with `ttnn.mesh_partition` (tt_transformers reduce-scatters N equal copies and divides by N;
  the partition is the same numbers without the traffic);
- logits stay vocab-sharded; the host concatenates them (`ConcatMeshToTensor(dim=3)`, as
  `process_output_*` does) and drops the vocab padding (the LM head is padded to whole tiles per device).

The CCLs are the wheel's synchronous `ttnn.all_gather` / `ttnn.reduce_scatter` / `ttnn.mesh_partition`
(tt_transformers calls the `experimental.*_async` variants, whose global semaphores are run-time objects a
serialised program cannot name). Every call is checked against `api_signatures.json` by the tests.

How placements propagate: each tensor has a `Placement` (replicated, sharded on one dim, partial sums,
or device-local expert values); weights get theirs from `WEIGHT_RULES` (rules as data, by name); op rules
then decide each output's placement and insert the one CCL that turns an input into what the op needs.
An op without a rule raises `NotImplementedError` (nothing is replicated silently); shapes the mesh cannot
split raise `MeshShardError` (a `TTConstraintError`) naming the count and the mesh size.

Data parallelism over submeshes, as tt-metal's `generator_vllm.create_submeshes`: `submesh_shapes(mesh,
dp)` gives dp submeshes of shape (1, n/dp), each running the TP program (`tt_backend.emu.mesh`).

Not done: 2-D tensor parallelism (Galaxy's TG scheme: weights sharded over both mesh axes, all-reduces on
`cluster_axis` 0 and 1, distributed RMSNorm); a 2-D mesh is used as DP rows x TP columns.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import numpy as np

from tt_backend.lowering import TILE, TTConstraintError, check_program
from tt_backend.program import Ref, TTCall, TTModelProgram, TTProgram, TTTensorSpec

__all__ = ["MeshShardError", "Placement", "WEIGHT_RULES", "mesh_shape", "shard", "shard_program", "distribute",
           "host_tensor", "submesh_shapes", "ttnn_mapper", "ttnn_composer", "CCL_OPS"]

CCL_OPS = ("ttnn.all_gather", "ttnn.reduce_scatter", "ttnn.mesh_partition")
TOPOLOGY = "ttnn.Topology.Linear"  # tt_transformers' default for N300/T3K CCLs


class MeshShardError(TTConstraintError):
    """A model shape that cannot be split over the mesh (heads, KV heads, hidden or intermediate sizes)."""


@dataclass(frozen=True)
class Placement:
    """Where a tensor's values live across the mesh.

    replicate: every device holds all of it. shard: device j holds slice j of `dim`. partial: every device
    holds a full-shape term; the value is their sum (row-parallel matmul outputs). local: every device holds
    a full-shape value of its own experts (expert parallelism); the layer's value is their sum."""

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
# (name pattern, placement, host preparation); first match wins. Expert weights come first: their names end
# like the dense MLP's ("layers.0.e3.w1").
WEIGHT_RULES: tuple[tuple[str, Placement, str | None], ...] = (
    (r"^layers\.\d+\.e\d+\.(w1|w3|w2|b1|b3|b2)$", E, "experts"),  # whole experts per device (EP)
    (r"^embed$", S(1), None),  # [V, D] table: hidden split, so the lookup is already fractured
    (r"^lm_head$", S(3), "pad_vocab"),  # column-parallel over the (padded) vocab
    (r"\.(wqkv|bqkv)$", S(3), "regroup_qkv"),  # column-parallel, each device's [q | k | v]
    (r"\.(w1|w3|b1|b3)$", S(3), None),  # column-parallel MLP
    (r"\.(wo|w2)$", S(2), None),  # row-parallel: partial sums
    (r"\.(bo|b2)$", S(3), None),  # added after the reduce-scatter, to the fractured output
    (r"\.(q_norm|k_norm)$", S(1), "per_head"),  # [1, heads, 1, d] per-head weights; [1, 1, 1, d] replicated
    (r"\.sinks$", S(3), None),  # [1, 1, 1, H]: one logit per query head
    (r".", R, None),  # norms, router, rope tables, trans_mat
)


def weight_rule(name: str, shape: tuple) -> tuple[Placement, str | None]:
    for pattern, plc, host in WEIGHT_RULES:
        if re.search(pattern, name):
            if host == "per_head" and shape[1] == 1:
                return R, None
            return plc, host
    raise AssertionError("the last rule matches every name")


def mesh_shape(mesh) -> tuple[int, int]:
    """(rows, cols) of a 1-D mesh: an int N means (1, N); (1, N) and (N, 1) are accepted."""
    shape = (1, int(mesh)) if isinstance(mesh, (int, np.integer)) else tuple(int(s) for s in mesh)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"mesh shape must be (rows, cols) with both >= 1, got {mesh!r}")
    if min(shape) > 1:
        raise NotImplementedError(f"tensor parallelism over a 2-D mesh {shape} (Galaxy's TG scheme) is not done: "
                                  f"split it into data-parallel (1, n) submeshes (`submesh_shapes`)")
    return shape


def _mapper(shape: tuple[int, int], plc: Placement, host: str | None = None, **extra) -> dict:
    """The wheel's mesh mapper for `plc` (ttnn.ShardTensor2dMesh(mesh_device, dims, mesh_shape) /
    ttnn.ReplicateTensorToMesh(mesh_device)) plus how the host tensor is prepared before it."""
    if plc.kind == "replicate":
        spec = {"mesh_mapper": "ttnn.ReplicateTensorToMesh"}
    else:
        dim = 0 if plc.kind == "local" else plc.dim  # experts: stacked on a leading dim, one slice per device
        axis = 1 if shape[0] == 1 else 0
        spec = {"mesh_mapper": "ttnn.ShardTensor2dMesh", "mesh_shape": list(shape),
                "dims": [None, dim] if axis == 1 else [dim, None]}
    if host:
        spec["host"] = {"kind": host, **extra}
    return spec


def host_tensor(host: dict, name: str, spec: dict) -> np.ndarray:
    """The host array `ttnn.as_tensor(..., mesh_mapper=...)` is given for weight `name` (mapper `spec`):
    experts stacked, wqkv regrouped per device, the LM head padded."""
    prep = spec.get("host", {})
    kind = prep.get("kind")
    if kind == "experts":
        return np.concatenate([np.asarray(host[s]) for s in prep["stack"]], axis=0)
    a = np.asarray(host[name])
    if kind == "regroup_qkv":
        H, K, d, n = prep["heads"], prep["kv_heads"], prep["head_dim"], prep["devices"]
        q, k, v = np.split(a, [H * d, (H + K) * d], axis=-1)
        parts = [np.split(t, n, axis=-1) for t in (q, k, v)]
        return np.concatenate([p for j in range(n) for p in (parts[0][j], parts[1][j], parts[2][j])], axis=-1)
    if kind == "pad_vocab":
        pad = prep["padded"] - a.shape[-1]
        return np.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)]) if pad else a
    return a


def distribute(a: np.ndarray, spec: dict) -> list[np.ndarray]:
    """What each device holds after `ttnn.as_tensor(a, mesh_mapper=spec)` (device order = row-major mesh order)."""
    if spec["mesh_mapper"] == "ttnn.ReplicateTensorToMesh":
        raise ValueError("a replicated tensor has no per-device split: every device holds it whole")
    shape = spec["mesh_shape"]
    dim = next(d for d in spec["dims"] if d is not None)
    return np.split(a, shape[0] * shape[1], axis=dim)


def ttnn_mapper(ttnn, mesh_device, spec: dict):
    """The wheel's mapper object for `spec`, for `ttnn.as_tensor(host_tensor(...), ..., mesh_mapper=...)` on a real
    mesh (`tt_backend.ttnn_exec` does not load mesh programs yet)."""
    if spec["mesh_mapper"] == "ttnn.ReplicateTensorToMesh":
        return ttnn.ReplicateTensorToMesh(mesh_device)
    return ttnn.ShardTensor2dMesh(mesh_device, dims=tuple(spec["dims"]), mesh_shape=tuple(spec["mesh_shape"]))


def ttnn_composer(ttnn, mesh_device, spec: dict):
    """`ttnn.to_torch(logits, mesh_composer=...)` for a program's `meta["mesh"]["output"]` (then keep the first
    `logical_width` columns when it is given)."""
    return ttnn.ConcatMeshToTensor(mesh_device, dim=spec["dim"])


# ------------------------------------------------------------------------------------- the transform
def shard(program: TTModelProgram, mesh) -> TTModelProgram:
    """Both programs of a model over a 1-D mesh (see the module doc)."""
    shape = mesh_shape(mesh)
    meta = dict(program.meta)
    n = shape[0] * shape[1]
    kv = dict(meta.get("kv_cache", {}))
    if kv.get("shape"):
        kv["shape"] = [kv["shape"][0], kv["shape"][1] // n, *kv["shape"][2:]]
    meta |= {"mesh_shape": list(shape), "kv_cache": kv}
    return TTModelProgram(shard_program(program.prefill, shape), shard_program(program.decode, shape), meta)


def shard_program(prog: TTProgram, mesh) -> TTProgram:
    """The program one device of the mesh runs; `meta["mesh"]` holds every weight's, input's and cache's
    mesh mapper and the output's mesh composer."""
    shape = mesh_shape(mesh)
    return _Sharder(prog, shape).run()


def _local(shape: tuple, plc: Placement, n: int) -> tuple:
    if plc.kind != "shard":
        return tuple(shape)
    return tuple(s // n if i == plc.dim else s for i, s in enumerate(shape))


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
              "ttnn.transformer.paged_scaled_dot_product_attention_decode": 2}
_CACHE_WRITES = {"ttnn.experimental.paged_fill_cache", "ttnn.experimental.paged_update_cache"}


class _Sharder:
    def __init__(self, prog: TTProgram, shape: tuple[int, int]):
        self.prog, self.shape = prog, shape
        self.n = shape[0] * shape[1]
        self.axis = 1 if shape[0] == 1 else 0
        self.calls: list[TTCall] = []
        self.tensors: dict[str, TTTensorSpec] = {}
        self.plc: dict[str, Placement] = {}
        self.full: dict[str, tuple] = {}  # every tensor's logical (whole-mesh) shape
        self.made: dict[tuple[str, Placement], str] = {}  # CCL results already emitted, reused
        self.mappers: dict[str, dict] = {}
        self.alias: dict[str, str] = {}  # dropped expert tails -> the last kept expert's sum
        self.logits = False  # set once the LM head has run: later [.., V] tensors are padded logits

    # ------------------------------------------------------------------------------------ checks
    def _dims(self):
        t, n = self.prog.tensors, self.n
        heads = [c.kwargs for c in self.prog.calls if c.op in _HEADS]
        hk = {(k["num_heads"], k["num_kv_heads"]) for k in heads}
        for H, K in hk:
            if H % n:
                raise MeshShardError(f"tensor parallelism over {n} devices: {H} query heads are not divisible by {n}")
            if K % n:
                raise MeshShardError(f"tensor parallelism over {n} devices: {K} KV heads are not divisible by {n} "
                                     f"(each device keeps whole KV heads in its cache)")
        D = t["final_norm"].shape[-1]
        if D % (TILE * n):
            raise MeshShardError(f"tensor parallelism over {n} devices: hidden_size={D} is not a multiple of "
                                 f"{TILE * n} (the fractured residual keeps D/{n} = whole {TILE}-wide tiles on each "
                                 f"device)")
        for name, s in t.items():
            if s.kind == "weight" and re.search(r"^layers\.\d+\.w1$", name) and s.shape[-1] % (TILE * n):
                raise MeshShardError(f"tensor parallelism over {n} devices: {name} intermediate size {s.shape[-1]} "
                                     f"is not a multiple of {TILE * n} (whole tiles per device)")
        self.heads = hk.pop() if hk else None

    def _experts(self):
        """Expert-parallel MoE layers: keep the first E/N expert iterations of each (device j runs its own
        experts through them), drop the rest, and let the layer read the last kept expert's sum."""
        t, n = self.prog.tensors, self.n
        counts: dict[str, int] = {}
        for name in t:
            m = re.match(r"^layers\.(\d+)\.e(\d+)\.w1$", name)
            if m:
                counts[m.group(1)] = max(counts.get(m.group(1), 0), int(m.group(2)) + 1)
        self.local_experts = {}
        drop = set()
        for i, E in counts.items():
            if E % n:
                raise MeshShardError(f"expert parallelism over {n} devices: layer {i} has {E} experts, not divisible "
                                     f"by {n}")
            keep = E // n
            self.local_experts[i] = (E, keep)
            last = {}
            for k, c in enumerate(self.prog.calls):
                for o in c.outputs:
                    m = re.match(rf"^l{i}\.e(\d+)\.", o)
                    if m:
                        last[int(m.group(1))] = o
                        if int(m.group(1)) >= keep:
                            drop.add(k)
            if keep < E:
                self.alias[last[E - 1]] = last[keep - 1]
        self.calls_in = [c for k, c in enumerate(self.prog.calls) if k not in drop]

    # -------------------------------------------------------------------------------- placements
    def _seed(self):
        prog, n = self.prog, self.n
        V = prog.tensors["lm_head"].shape[-1] if "lm_head" in prog.tensors else None
        self.vocab, self.padded_vocab = V, (None if V is None else -(-V // (TILE * n)) * TILE * n)
        used = {r for c in self.calls_in for r in c.refs()}
        for name, s in prog.tensors.items():
            if s.kind == "weight" and name in used:
                plc, host = weight_rule(name, s.shape)
                full = tuple(s.shape)
                extra = {}
                if host == "experts":
                    i, e, w = re.match(r"^layers\.(\d+)\.e(\d+)\.(\w+)$", name).groups()
                    E, keep = self.local_experts[i]
                    extra = {"stack": [f"layers.{i}.e{j * keep + int(e)}.{w}" for j in range(n)]}
                elif host == "regroup_qkv":
                    H, K = self.heads
                    extra = {"heads": H, "kv_heads": K, "head_dim": full[-1] // (H + 2 * K), "devices": n}
                elif host == "pad_vocab":
                    full = full[:-1] + (self.padded_vocab,)
                    extra = {"padded": self.padded_vocab, "vocab": V}
                self._set(name, plc, full, s)
                self.mappers[name] = _mapper(self.shape, plc, host, **extra)
            elif s.kind == "state":  # paged KV caches [blocks, K, block, d]: whole KV heads per device
                self._set(name, S(1), tuple(s.shape), s)
                self.mappers[name] = _mapper(self.shape, S(1))
            elif s.kind == "input":
                self._set(name, R, tuple(s.shape), s)
                self.mappers[name] = _mapper(self.shape, R)

    def _set(self, name: str, plc: Placement, full: tuple, old: TTTensorSpec):
        self.plc[name], self.full[name] = plc, tuple(full)
        self.tensors[name] = _spec(old, _local(full, plc, self.n))

    # ---------------------------------------------------------------------------------- the CCLs
    def _emit(self, op, x, kwargs, out, plc, full):
        self.calls.append(TTCall(op, (x,), kwargs, (out,)))
        self._set(out, plc, full, self.tensors[x])

    def need(self, name: str, want: Placement) -> str:
        """`name` as placement `want`, emitting the CCL that makes it (once per tensor and placement)."""
        name = self.alias.get(name, name)
        have = self.plc[name]
        if have == want:
            return name
        if (name, want) in self.made:
            return self.made[(name, want)]
        full = self.full[name]
        last = len(full) - 1
        ccl = {"cluster_axis": self.axis, "num_links": 1, "topology": TOPOLOGY,
               "memory_config": self.tensors[name].memory}
        if have in (P, E) and want in (S(last), R):  # tt_all_reduce on a 1-D mesh: reduce_scatter
            out = f"{name}.rs"
            self._emit("ttnn.reduce_scatter", name, {"dim": last, **ccl}, out, S(last), full)
            out = out if want == S(last) else self.need(out, R)
        elif have == S(last) and want == R:  # DistributedNorm: all_gather before the norm
            out = f"{name}.ag"
            self._emit("ttnn.all_gather", name, {"dim": last, **ccl}, out, R, full)
        elif have == R and want == S(last):  # each device keeps its slice, no traffic
            out = f"{name}.part"
            self._emit("ttnn.mesh_partition", name, {"dim": last, "cluster_axis": self.axis,
                                                     "memory_config": self.tensors[name].memory}, out, S(last), full)
        else:
            raise NotImplementedError(f"no collective turns {name} from {have} into {want}")
        self.made[(name, want)] = out
        return out

    # ---------------------------------------------------------------------------------- op rules
    def run(self) -> TTProgram:
        if self.n == 1:
            return self._single()
        self._dims()
        self._experts()
        self._seed()
        for call in self.calls_in:
            self._call(call)
        out = self.alias.get(self.prog.outputs[0], self.prog.outputs[0])
        outputs = (out,)
        composer = {"mesh_composer": "ttnn.ConcatMeshToTensor", "dim": len(self.full[out]) - 1}
        if self.plc[out] != S(len(self.full[out]) - 1):
            raise NotImplementedError(f"program output {out} ends {self.plc[out]}, not vocab-sharded")
        if self.vocab != self.padded_vocab:
            composer["logical_width"] = self.vocab  # drop the LM head's zero padding after the concat
        meta = dict(self.prog.meta) | {"mesh": {"shape": list(self.shape), "cluster_axis": self.axis,
                                                "mappers": self.mappers, "output": composer}}
        new = TTProgram(self.prog.mode, self.calls, self.tensors, self.prog.inputs, outputs, meta)
        check_program(new)
        return new

    def _single(self) -> TTProgram:
        meta = dict(self.prog.meta) | {"mesh": {"shape": list(self.shape), "cluster_axis": self.axis,
                                                "mappers": {}, "output": None}}
        return dataclasses.replace(self.prog, meta=meta)

    def _out(self, old: str, plc: Placement, full: tuple | None = None):
        full = tuple(self.prog.tensors[old].shape) if full is None else full
        if self.vocab != self.padded_vocab and self.logits and full[-1] == self.vocab:
            full = full[:-1] + (self.padded_vocab,)
        self._set(old, plc, full, self.prog.tensors[old])
        return self.tensors[old].shape

    def _call(self, c: TTCall):
        op, n = c.op, self.n
        ins = [self.alias.get(x, x) for x in c.inputs]
        kw = dict(c.kwargs)
        plcs = [self.plc[x] for x in ins]
        full = [self.full[x] for x in ins]
        out_plc: list[Placement]
        if op == "ttnn.embedding":
            ids, table = ins
            out_plc = [S(2) if self.plc[table] == S(1) else R]  # [1, rows, D/N] from the hidden-split table
        elif op == "ttnn.reshape":
            out_plc = [self._reshaped(plcs[0], full[0], tuple(self.prog.tensors[c.outputs[0]].shape))]
        elif op == "ttnn.linear" or op == "ttnn.matmul":
            x, w = ins
            if "bias" in kw:
                raise NotImplementedError(f"{op} with a fused bias: the lowering adds biases separately")
            wp, last = self.plc[w], len(full[0]) - 1
            if wp == S(3):  # column-parallel: replicated input, output split on its last dim
                ins[0], out_plc = self.need(x, R), [S(last)]
                self.logits = self.logits or w == "lm_head"
            elif wp == S(2):  # row-parallel: input split on its last dim, partial sums out
                ins[0], out_plc = self.need(x, S(last)), [P]
            elif wp == E:  # an expert's matmul on this device's expert
                ins[0] = x if self.plc[x] == E else self.need(x, R)
                out_plc = [E]
            else:
                ins[0], out_plc = self.need(x, R), [R]
        elif op in _ELEMENTWISE:
            ins, out_plc = self._elementwise(op, ins, kw)
        elif op in _NORMS:
            p, last = plcs[0], len(full[0]) - 1
            if not (p.kind == "shard" and p.dim != last):  # per-head norms (q/k-norm) stay on their heads
                ins[0], p = self.need(ins[0], R), R
            out_plc = [p]
        elif op in _WHOLE_ROW:
            ins = [self.need(x, R) for x in ins]
            out_plc = [R] * len(c.outputs)
        elif op == "ttnn.slice":
            out_plc = [self._slice(c, ins, kw)]
        elif op in _HEADS:
            ins[0] = self.need(ins[0], S(3))
            kw["num_heads"], kw["num_kv_heads"] = kw["num_heads"] // n, kw["num_kv_heads"] // n
            out_plc = [S(_HEADS[op])] * 3
        elif op == "ttnn.experimental.rotary_embedding_llama":
            ins[1:] = [self.need(x, R) for x in ins[1:]]
            out_plc = [plcs[0]]
        elif op in _CACHE_WRITES or op in _ATTENTION:
            dim = 1 if op == "ttnn.experimental.paged_fill_cache" else _ATTENTION.get(op, 2)
            for k, x in enumerate(ins):
                if self.prog.tensors[x].kind in ("state", "input"):
                    continue
                if self.plc[x] != S(dim):
                    raise NotImplementedError(f"{op}: {x} is {self.plc[x]}, expected its heads split on dim {dim}")
            out_plc = [S(dim)] * len(c.outputs)
        elif op in _CONCAT:
            if self.plc[ins[0]] != S(_CONCAT[op]):
                raise NotImplementedError(f"{op}: {ins[0]} is {self.plc[ins[0]]}, expected split heads")
            if "num_heads" in kw:
                kw["num_heads"] //= n
            out_plc = [S(3)]
        else:
            raise NotImplementedError(f"tensor parallelism has no rule for {op} (call output {c.outputs})")
        for k, v in kw.items():  # keyword tensors: weights keep their mapper, activations are replicated
            if isinstance(v, Ref) and self.prog.tensors[v.name].kind not in ("weight", "state", "input"):
                kw[k] = Ref(self.need(v.name, R))
        shapes = [self._out(o, p) for o, p in zip(c.outputs, out_plc)]
        if op == "ttnn.reshape":
            kw["shape"] = list(shapes[0])
        self.calls.append(TTCall(op, tuple(ins), kw, c.outputs))

    def _reshaped(self, p: Placement, shape_in: tuple, shape_out: tuple) -> Placement:
        """The split dim after a reshape: the output dim of the same size after the same number of elements."""
        if p.kind != "shard":
            return p
        before = math.prod(shape_in[:p.dim])
        for j in range(len(shape_out)):
            if math.prod(shape_out[:j]) == before and shape_out[j] == shape_in[p.dim]:
                return S(j)
        raise NotImplementedError(f"reshape {shape_in} -> {shape_out} moves the split dim {p.dim}")

    def _elementwise(self, op: str, ins: list[str], kw: dict):
        scalar = len(ins) == 1
        if scalar:
            p = self.plc[ins[0]]
            if p == P and op != "ttnn.mul":  # only c * sum(x_j) == sum(c * x_j) may stay partial
                return [self.need(ins[0], S(len(self.full[ins[0]]) - 1))], [S(len(self.full[ins[0]]) - 1)]
            return ins, [p]
        a, b = ins
        pa, pb = self.plc[a], self.plc[b]
        if pa == pb and (pa != P or op == "ttnn.add"):
            return ins, [pa]
        # a broadcast operand (size 1 where the other is split, e.g. the [rows, 1] routing weight) goes along
        for x, y in ((a, b), (b, a)):
            px, py = self.plc[x], self.plc[y]
            if py == R and self._broadcasts(y, px, x):
                if px == E or (px == P and op == "ttnn.mul") or px.kind == "shard":
                    return ins, [px]
        last = len(self.full[a]) - 1
        ins = [self.need(x, S(last)) if self.plc[x] in (P, E, R) else x for x in ins]
        if any(self.plc[x] != S(last) for x in ins):
            raise NotImplementedError(f"{op}: operands {ins} placed {[self.plc[x] for x in ins]}")
        return ins, [S(last)]

    def _broadcasts(self, y: str, px: Placement, x: str) -> bool:
        fy, fx = self.full[y], self.full[x]
        if px.kind == "shard":
            return fy[px.dim] == 1 and fx[px.dim] > 1
        return fy[-1] == 1 and fx[-1] > 1  # a per-row scale of a partial / expert-local value

    def _slice(self, c: TTCall, ins: list[str], kw: dict) -> Placement:
        m = re.match(r"^l(\d+)\.e(\d+)\.", c.outputs[0])
        if m and m.group(1) in self.local_experts:  # this device's routing weights of its k-th local expert
            ins[0] = self.need(ins[0], S(len(self.full[ins[0]]) - 1))
            return E
        ins[0] = self.need(ins[0], R)
        return R


# ---------------------------------------------------------------------------------- data parallel
def submesh_shapes(mesh, data_parallel: int) -> list[tuple[int, int]]:
    """`data_parallel` submeshes of a (rows, cols) mesh, each (1, n / dp), as tt-metal's
    `generator_vllm.create_submeshes` (a Galaxy 8x4 with dp=4 -> four 1x8 rings); each runs the TP program."""
    rows, cols = (1, int(mesh)) if isinstance(mesh, (int, np.integer)) else tuple(int(s) for s in mesh)
    n = rows * cols
    if data_parallel < 1 or n % data_parallel:
        raise MeshShardError(f"cannot split a mesh of {n} devices into {data_parallel} data-parallel submeshes")
    return [(1, n // data_parallel)] * data_parallel
