"""Sharding as data: logical axis names on every parameter, one rules table to mesh axes.

    mesh = sharding.make_mesh("data=2,tensor=4")
    model = jm.load(path, mesh=mesh)                 # params placed by the default rules (preset "tp")
    model = jm.load(path, mesh=mesh, rules="fsdp_tp")

Logical names are declared once, with each parameter's shape (`jaxmodels.plan.ParamSpec`). A rule maps a
logical name to a mesh axis (or a tuple of them). A dimension that a mesh axis does not divide stays
replicated (e.g. 2 kv heads over tensor=4), so any mesh shape works and only the speed changes; except the
rows of lookup tables that are only ever gathered (`PADDED`: DeepSeek V4.1's Engram tables, 384,016,682 rows
= 2 x a prime), which are split anyway: the placed array gets zero rows appended up to a multiple of the mesh
axes (`placed_shape`), rows no index reaches (DeepSeek's own converter pads its row shards the same way).
Activations are pinned through a `Sharding` passed to the executor as an argument (no ambient context).

DeepSeek V4 / V4.1 on these names (jaxmodels/plan.py): `heads` splits the query heads (wq_b's outputs, the
sinks), the output's head groups (wo_a) and the grouped low-rank latent they project to (wo_b's input, the
reference's row-parallel split) and the indexer's heads; `experts` the routed experts, `mlp` their width and the
shared expert's; `table_rows` the Engram tables; the one shared K=V latent, the compressor, the router and the
mHC mixes stay replicated (small), and the mHC residual streams are activations split only over `batch`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxmodels import plan

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# presets: logical name -> mesh axis (or tuple); names not listed are replicated
RULES = {
    "tp": {"batch": "data", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
           "experts": "expert", "table_rows": ("tensor", "expert")},
    "fsdp_tp": {"batch": ("data", "fsdp"), "vocab": "tensor", "embed": "fsdp", "heads": "tensor",
                "kv_heads": "tensor", "mlp": "tensor", "experts": "expert", "table_rows": ("fsdp", "tensor", "expert")},
    "ep": {"batch": "data", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "experts": "expert",
           "mlp": "tensor", "table_rows": ("tensor", "expert")},
}
# logical names whose dimension is only ever indexed (gathered), never reduced over or produced by a matmul:
# split over their mesh axes even when those do not divide it, the placed array padded (see `placed_shape`)
PADDED = frozenset({"table_rows"})


def make_mesh(spec: str | dict, devices=None) -> Mesh:
    """'data=2,tensor=4' (axes: data, fsdp, tensor, expert; size 1 allowed) -> a Mesh over the devices."""
    if isinstance(spec, str):
        try:
            spec = {k.strip(): int(v) for k, v in (p.split("=") for p in spec.split(",") if p.strip())}
        except ValueError:
            raise ValueError(f"mesh spec {spec!r}: expected axis=size pairs such as 'data=2,tensor=4'") from None
    unknown = set(spec) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; use {', '.join(MESH_AXES)}")
    devices = np.asarray(jax.devices() if devices is None else devices)
    need = math.prod(spec.values())
    if need != devices.size:
        raise ValueError(f"mesh {spec} needs {need} devices, {devices.size} available")
    return Mesh(devices.reshape(tuple(spec.values())), tuple(spec))


def auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axis names, every axis Auto. The rules place arrays and pin activations by
    PartitionSpecs and let XLA propagate the rest; Explicit axes (`jax.make_mesh`'s default) would instead ask
    every gather and dot in the model for its output sharding."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def entered(shard: "Sharding | None"):
    """`shard.entered()`, or nothing to enter when unsharded."""
    return contextlib.nullcontext() if shard is None else shard.entered()


def spec_for(names, shape, mesh: Mesh, rules: dict) -> P:
    """PartitionSpec for logical `names`; axes the mesh lacks, or that do not divide the dim, stay replicated
    (names in PADDED excepted: split whatever their size)."""
    out, used = [], set()
    for name, dim in zip(names, shape):
        axes = rules.get(name)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        if axes and (name in PADDED or dim % math.prod(mesh.shape[a] for a in axes) == 0):
            used.update(axes)
            out.append(axes[0] if len(axes) == 1 else axes)
        else:
            out.append(None)
    return P(*out)


def _rules(rules) -> dict:
    if isinstance(rules, str):
        try:
            return RULES[rules]
        except KeyError:
            raise ValueError(f"unknown sharding preset {rules!r}; presets: {', '.join(RULES)}") from None
    return dict(rules)


def param_specs(cfg, mesh: Mesh, rules="tp") -> dict:
    """The PartitionSpec of every parameter, as a tree shaped like the params."""
    rules = _rules(rules)
    flat = plan.flatten(plan.param_specs(cfg))
    return plan.unflatten({path: spec_for(s.axes, s.shape, mesh, rules) for path, s in flat.items()})


def shardings(cfg, mesh: Mesh, rules="tp") -> dict:
    """NamedShardings for arrays of the planned shapes (jit out_shardings, optimizer state), as a tree shaped
    like the params. A PADDED split the mesh does not divide is left out here (such arrays cannot take it; the
    placement of params pads them instead: `place`, `shard_params`, jm.load)."""
    mesh, flat = auto_axes(mesh), plan.flatten(plan.param_specs(cfg))

    def one(path, spec):
        shape = flat[path].shape
        return P(*(None if x is not None and placed_shape((n,), NamedSharding(mesh, P(x)))[0] != n else x
                   for x, n in zip(spec, shape)))

    return plan.unflatten({p: NamedSharding(mesh, one(p, s)) for p, s in plan.flatten(param_specs(cfg, mesh,
                                                                                                  rules)).items()})


def placed_shape(shape, s: NamedSharding) -> tuple[int, ...]:
    """The global shape of an array of `shape` placed by `s`: each dimension rounded up to a multiple of the
    mesh axes that split it (the same shape where they divide it, as they always do but for PADDED names)."""
    out = []
    for i, dim in enumerate(shape):
        axes = s.spec[i] if i < len(s.spec) else None
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(s.mesh.shape[a] for a in axes)
        out.append(-(-dim // n) * n)
    return tuple(out)


def padded_slice(read, shape, idx) -> np.ndarray:
    """Block `idx` (a device's slices of an array placed by `placed_shape`) of an array of `shape` whose blocks
    `read(slices)` returns: `read` asked only for the part inside `shape`, zeros past it."""
    idx = tuple(slice(i.start or 0, n if i.stop is None else i.stop) for i, n in zip(idx, shape))
    inner = tuple(slice(min(i.start, n), min(i.stop, n)) for i, n in zip(idx, shape))
    if all(i == j for i, j in zip(idx, inner)):
        return read(inner)
    part = np.asarray(read(inner))
    out = np.zeros(tuple(i.stop - i.start for i in idx), part.dtype)
    out[tuple(slice(0, i.stop - i.start) for i in inner)] = part
    return out


# the parts of a weight kept quantized (DeepSeek's FP8 / FP4, converters/deepseek.py), as jaxmodels.checkpoint
# stores them: the bytes [..., out, in] (FP4: two inputs a byte) and their E8M0 scales; the Engram table's scales
QUANTIZED_PARTS = ("/fp8", "/fp4", "/scale", "_scale")


def stored_spec(cfg, path: str, shape, mesh: Mesh, rules="tp") -> P:
    """PartitionSpec of any leaf params hold: a parameter of the plan (MTP blocks included) by its logical axes,
    or a part of a weight kept quantized, split like that parameter's out and in axes (the bytes are [..., out,
    in], the parameter [..., in, out]) where the mesh axes divide the dimension in whole scale blocks (32 x 32 or
    128 x 128 for FP8, 32 inputs for FP4), so that a device's bytes and scales cover the same blocks; the Engram
    table's scales by its rows. Anything else is replicated."""
    rules, specs = _rules(rules), _stored_specs(cfg)
    if path in specs:
        return spec_for(specs[path].axes, specs[path].shape, mesh, rules)
    part = next((x for x in QUANTIZED_PARTS if path.endswith(x) and path[: -len(x)] in specs), None)
    if part is None or len(shape) < 2:
        return P()
    s = specs[path[: -len(part)]]
    if part == "_scale":
        return spec_for(s.axes, (*s.shape[:-1], shape[-1]), mesh, rules)
    (i_name, o_name), (i, o) = s.axes[-2:], s.shape[-2:]
    if part == "/fp4" or (part == "/scale" and shape[-2] == o):  # MXFP4: a scale per row and 32 inputs
        units = (o, i // 32 if i % 32 == 0 else 1)
    else:  # FP8: a scale per B x B block
        b = cfg.quant_block
        units = (o // b if o % b == 0 else 1, i // b if i % b == 0 else 1)
    return spec_for((*s.axes[:-2], o_name, i_name), (*s.shape[:-2], *units), mesh, rules)


@functools.lru_cache(maxsize=16)
def _stored_specs(cfg) -> dict:
    return plan.flatten(plan.param_specs(cfg)) | plan.flatten(plan.mtp_param_specs(cfg))


def placement(cfg, mesh: Mesh, rules="tp"):
    """(leaf path, stored shape) -> NamedSharding of every leaf params may hold (see `stored_spec`)."""
    auto = auto_axes(mesh)
    return lambda path, shape: NamedSharding(auto, stored_spec(cfg, path, shape, mesh, rules))


def place(a, s: NamedSharding):
    """One host (or fully addressable) array placed by `s`, each device given only its block; zero-padded to
    `placed_shape` where s splits a PADDED dimension the mesh does not divide."""
    a = np.asarray(a) if not isinstance(a, jax.Array) or a.is_fully_addressable else a
    shape = placed_shape(a.shape, s)
    if shape == tuple(a.shape):
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])
    return jax.make_array_from_callback(shape, s, lambda idx: padded_slice(lambda i: a[i], a.shape, idx))


def shard_params(params: dict, cfg, mesh: Mesh, rules="tp") -> dict:
    """Place params onto the mesh; each device receives only its slice (also across processes). Every leaf is
    placed by `stored_spec`: the plan's parameters, MTP blocks and the parts of weights kept quantized. Leaves
    split along a PADDED name the mesh does not divide come out zero-padded to `placed_shape`."""
    where = placement(cfg, mesh, rules)
    return plan.unflatten({p: place(a, where(p, np.shape(a))) for p, a in plan.flatten(params).items()})


# ------------------------------------------------------------------------------------ activations
@dataclass(frozen=True)
class Sharding:
    """A mesh and its rules, hashable: a static argument of jitted code, passed down to the layers that
    constrain activations or split experts."""

    mesh: Mesh
    rules: tuple

    @classmethod
    def of(cls, mesh: Mesh | None, rules="tp") -> "Sharding | None":
        if mesh is None:
            return None
        r = _rules(rules)
        return cls(auto_axes(mesh), tuple(sorted((k, v if isinstance(v, str) else tuple(v)) for k, v in r.items())))

    def constrain(self, x, names: tuple):
        """with_sharding_constraint by logical names."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec_for(names, x.shape, self.mesh,
                                                                                      dict(self.rules))))

    def entered(self):
        """Our Auto mesh as the context mesh while jitted code traces and runs: inside a user's
        `jax.set_mesh(an Explicit mesh)` JAX would otherwise refuse shardings on a mesh of other axis types."""
        return jax.set_mesh(self.mesh)

    def expert_axis(self, num_experts: int) -> tuple[Mesh, str] | None:
        """(mesh, axis) when the rules shard `experts` over a mesh axis that divides them."""
        axis = dict(self.rules).get("experts")
        if isinstance(axis, str) and self.mesh.shape.get(axis, 1) > 1 and num_experts % self.mesh.shape[axis] == 0:
            return self.mesh, axis
        return None
