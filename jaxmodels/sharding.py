"""Sharding as data: logical axis names on every parameter, one rules table to mesh axes.

    mesh = sharding.make_mesh("data=2,tensor=4")
    model = jm.load(path, mesh=mesh)                 # params placed by the default rules (preset "tp")
    model = jm.load(path, mesh=mesh, rules="fsdp_tp")

Logical names are declared once per parameter *kind* (by its leaf name), never per family. A rule maps
a logical name to a mesh axis (or a tuple of them). A dimension that a mesh axis does not divide stays
replicated (e.g. 2 kv heads over tensor=4), so any mesh shape works and only the speed changes.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from contextvars import ContextVar

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# logical names of each parameter kind's dimensions (after the leading "layers" axis for layer params)
LEAF_AXES = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("norm",),
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "bo": ("norm",),
    "sinks": ("heads",),
    "router": ("embed", None),
    "router_bias": (None,),
}
DENSE_MLP = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed"),
             "b_gate": ("mlp",), "b_up": ("mlp",), "b_down": ("norm",)}
EXPERT_MLP = {k: ("experts", *v) for k, v in DENSE_MLP.items()}

# presets: logical name -> mesh axis (or tuple); names not listed are replicated
RULES = {
    "tp": {"batch": "data", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
           "experts": "expert"},
    "fsdp_tp": {"batch": ("data", "fsdp"), "vocab": "tensor", "embed": "fsdp", "heads": "tensor",
                "kv_heads": "tensor", "mlp": "tensor", "experts": "expert"},
    "ep": {"batch": "data", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor", "experts": "expert",
           "mlp": "tensor"},
}


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


def param_axes(path: str, ndim: int, moe: bool = False) -> tuple:
    """Logical names of a parameter's dimensions from its path (`layers/0/attn/wq`)."""
    parts = path.split("/")
    leaf = parts[-1]
    if leaf.endswith("norm"):
        names = ("norm",) * (ndim - (1 if parts[0] == "layers" else 0))
        if leaf in ("q_norm", "k_norm") and len(names) == 2:  # Cohere's per-head weights
            names = ("heads" if leaf == "q_norm" else "kv_heads", "head_dim")
    elif "mlp" in parts and leaf in DENSE_MLP:
        names = EXPERT_MLP[leaf] if moe and "shared" not in parts else DENSE_MLP[leaf]
    else:
        names = LEAF_AXES[leaf]
    if parts[0] == "layers":
        names = ("layers", *names)
    if len(names) != ndim:
        raise ValueError(f"{path}: {ndim} dims but logical axes {names}")
    return names


def spec_for(names, shape, mesh: Mesh, rules: dict) -> P:
    """PartitionSpec for logical `names`; axes the mesh lacks, or that do not divide the dim, stay replicated."""
    out, used = [], set()
    for name, dim in zip(names, shape):
        axes = rules.get(name)
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
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
    from jaxmodels import model as M

    rules = _rules(rules)
    pl = M.plan(cfg)
    out = {}
    for path, shape in M.flat_shapes(cfg).items():
        parts = path.split("/")
        moe = parts[0] == "layers" and pl.kinds[int(parts[1])].mlp.kind == "moe"
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = spec_for(param_axes(path, len(shape), moe), shape, mesh, rules)
    return out


def shardings(cfg, mesh: Mesh, rules="tp") -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(cfg, mesh, rules),
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: dict, cfg, mesh: Mesh, rules="tp") -> dict:
    """Place params onto the mesh; each device receives only its slice (also across processes)."""
    def place(a, s):
        a = np.asarray(a) if not isinstance(a, jax.Array) or a.is_fully_addressable else a
        return jax.make_array_from_callback(a.shape, s, lambda idx: a[idx])

    return jax.tree.map(place, params, shardings(cfg, mesh, rules))


# ------------------------------------------------------------------------------------ activations
_ACTIVE: ContextVar = ContextVar("jaxmodels_sharding", default=None)


@contextmanager
def use(mesh: Mesh | None, rules="tp"):
    """Within this context, `constrain` pins activations by logical names (traced functions read it)."""
    token = _ACTIVE.set(None if mesh is None else (mesh, _rules(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, names: tuple):
    """with_sharding_constraint by logical names; a no-op outside `use(mesh)`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, mesh, rules)))


def expert_axis(num_experts: int) -> tuple[Mesh, str] | None:
    """(mesh, axis) when the active rules shard `experts` over a mesh axis that divides them."""
    active = _ACTIVE.get()
    if active is None:
        return None
    mesh, rules = active
    axis = rules.get("experts")
    if isinstance(axis, str) and mesh.shape.get(axis, 1) > 1 and num_experts % mesh.shape[axis] == 0:
        return mesh, axis
    return None
