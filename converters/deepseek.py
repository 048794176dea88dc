"""DeepSeek V4 / V4.1 checkpoints (specs/deepseek_v4.md §10): a reader that decodes their quantized tensors, and
the imports of the backbone (with V4.1's vision tower when the config has one: `vision.*`, `aligner.*`, `image_*`,
`ffn.gate.bias_vl`, plain BF16) and of the MTP blocks through the one planner (converters/hf.py) with the name maps
of jaxmodels/families/deepseek_v4.py.

`QuantReader` pairs each `X.weight` with its `X.scale` (HF: `weight_scale_inv`): FP8 e4m3 weights with E8M0
block scales (32x32 in V4.1, 128x128 in V4), MXFP4 experts (packed int8 + E8M0 per 32), per-row FP8 Engram
tables, `wo_a` rounded to bf16 as the reference does. Dequantised tensor by tensor, or kept as their bytes
(`keep_quantized`: FP8 linears and FP4 experts as {"fp8"|"fp4", "scale"} in the checkpoint's [out, in] layout,
expanded inside the matmul; Engram's table as `table` + `table_scale`, its rows expanded after the gather).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from converters import deepseek_quant as dq
from converters.hf import (Leaves, Part, Placement, Quantized, assemble, check_values, nonfinite, normalize, np_dtype,
                           plan_import, source_bytes, stream)
from converters.safetensors_io import CheckpointError
from converters.transforms import TRANSFORMS, transpose
from jaxmodels.families import deepseek_v4 as fam
from jaxmodels.plan import flatten, mtp_param_specs, param_specs, unflatten

log = logging.getLogger(__name__)


def canonical(name: str) -> str:
    return normalize(name, fam.RENAMES)


class QuantReader:
    """Wraps a reader: each `X.weight` + `X.scale` pair appears as one tensor `X.weight` of the logical shape,
    dequantised (float32; wo_a bf16) or, with keep_quantized, as a `Quantized` record of its bytes."""

    def __init__(self, reader, keep_quantized: bool = False, files: dq.SafetensorsFiles | None = None):
        self.reader, self.keep, self.files = reader, keep_quantized, files
        canon = {canonical(k): k for k in reader.keys()}
        self._scale = {k: canon[c[: -len(".weight")] + ".scale"] for c, k in canon.items()
                       if c.endswith(".weight") and c[: -len(".weight")] + ".scale" in canon}
        hidden = set(self._scale.values())
        self._keys = [k for k in reader.keys() if k not in hidden]

    def keys(self):
        return list(self._keys)

    def _packed(self, name) -> bool:
        """MXFP4 experts: int8 [O, I/2] with one scale per 32 of the I inputs."""
        w, s = tuple(self.reader.shape(name)), tuple(self.reader.shape(self._scale[name]))
        return len(w) == 2 and s[0] == w[0] and s[1] * 16 == w[1]

    def shape(self, name):
        shape = tuple(self.reader.shape(name))
        if name in self._scale and self._packed(name):
            return shape[0], shape[1] * 2  # two FP4 codes per byte
        return shape

    def get(self, name):
        w = self.reader.get(name)
        if name not in self._scale:
            return w
        try:
            return self._decode(name, w, self.reader.get(self._scale[name]))
        except TypeError as e:  # a weight or scale of a dtype that is not FP8 / FP4 / E8M0 bytes
            raise CheckpointError(str(e)) from None

    def _decode(self, name, w, s):
        canon = canonical(name)
        engram = canon.endswith(".engram.embed.weight")
        if self.keep and not canon.endswith(".wo_a.weight"):
            packed = self._packed(name)
            raw = dq.packed_fp4_bytes(w, name) if packed else dq.e4m3_array(w, name).view(np.uint8)
            scale = dq.e8m0_bytes(s, name)
            # placed as bytes, never through check_values: refuse their NaN codes here (FP4 has none)
            if bad := 0 if packed else nonfinite(raw.view(dq.E4M3)):
                raise CheckpointError(f"{name}: {bad} non-finite values (NaN/Inf)")
            if bad := nonfinite(scale.view(dq.E8M0)):
                raise CheckpointError(f"{self._scale[name]}: {bad} NaN scales (E8M0 byte 0xff)")
            if engram:  # gathered by row, then expanded: table bytes + E8M0 bytes beside them
                return Quantized({"": raw, "_scale": scale})
            return Quantized({"/fp4" if packed else "/fp8": raw, "/scale": scale})
        if self._packed(name):
            return dq.dequant_fp4_experts(w, s, name=name)
        if engram:
            return dq.dequant_fp8_rows(w, s, name=name)
        block = _block(w.shape, s.shape, name)
        decode = dq.dequant_wo_a if canon.endswith(".wo_a.weight") else dq.dequant_fp8_blocks
        return decode(w, s, block, name)

    def get_slice(self, name, index):
        """get(name)[index] (index: slices of the logical shape). With `files`, only the bytes of that block
        (widened to whole scale blocks: at most a block's rows and columns more) are read and dequantised."""
        shape = self.shape(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        box = [s.indices(n)[:2] for s, n in zip(index, shape)]
        if self.files is None or name not in self.files or (self.keep and name in self._scale):
            return self.get(name)[index]
        if name not in self._scale:
            return self.files.read(name, box)
        scale, canon = self._scale[name], canonical(name)
        (r0, r1), (c0, c1) = box
        try:
            if self._packed(name):  # MXFP4: whole 32-column groups (16 bytes), their scales
                a, b = c0 // 32 * 32, -(-c1 // 32) * 32
                w = self.files.read(name, [(r0, r1), (a // 2, b // 2)])
                s = self.files.read(scale, [(r0, r1), (a // 32, b // 32)])
                return dq.dequant_fp4_experts(w, s, name=name)[:, c0 - a:c1 - a]
            if canon.endswith(".engram.embed.weight"):  # per-row scales per 32 columns
                a, b = c0 // 32 * 32, -(-c1 // 32) * 32
                w = self.files.read(name, [(r0, r1), (a, b)])
                s = self.files.read(scale, [(r0, r1), (a // 32, b // 32)])
                return dq.dequant_fp8_rows(w, s, name=name)[:, c0 - a:c1 - a]
            B = _block(shape, self.files.shape(scale), name)
            ra, rb, ca, cb = r0 // B * B, min(-(-r1 // B) * B, shape[0]), c0 // B * B, min(-(-c1 // B) * B, shape[1])
            w = self.files.read(name, [(ra, rb), (ca, cb)])
            s = self.files.read(scale, [(ra // B, -(-rb // B)), (ca // B, -(-cb // B))])
            out = (dq.dequant_wo_a if canon.endswith(".wo_a.weight") else dq.dequant_fp8_blocks)(w, s, B, name)
            return out[r0 - ra:r1 - ra, c0 - ca:c1 - ca]
        except TypeError as e:  # a weight or scale of a dtype that is not FP8 / FP4 / E8M0 bytes
            raise CheckpointError(str(e)) from None

    def held_bytes(self, name):
        """What get(name) holds (hf.read_bytes): stored bytes, or the decoded tensor (wo_a bf16, else float32)."""
        if name not in self._scale or self.keep and not canonical(name).endswith(".wo_a.weight"):
            return self.nbytes(name)
        return math.prod(self.shape(name)) * (2 if canonical(name).endswith(".wo_a.weight") else 4)

    def nbytes(self, name):
        return source_bytes(self.reader, name) + (source_bytes(self.reader, self._scale[name]) if name in self._scale
                                                  else 0)


def _block(w_shape, s_shape, name) -> int:
    """The square block size implied by a weight's shape and its scale grid's (32 in V4.1, 128 in V4)."""
    for b in (32, 128, 64, 16):
        if (-(-w_shape[0] // b), -(-w_shape[1] // b)) == tuple(s_shape):
            return b
    raise CheckpointError(f"{name}: scale grid {tuple(s_shape)} does not tile a weight of shape {tuple(w_shape)}")


def backbone(reader, cfg, dtype: str = "float32", token_map=None, keep_quantized: bool = False, done=frozenset(),
             bar=None, into=None):
    """`hf.stream` items of the backbone; Engram's token map (built from the tokenizer) goes in as `engram_map`.
    into: the Leaves `assemble` fills (transposed tensors are written straight into their slots, see hf.stream)."""
    if cfg.engram is not None and token_map is None:
        raise CheckpointError("this model uses Engram, which needs the tokenizer (tokenizer.json) to build its "
                              "compressed-vocabulary map; none was found")
    names, skip = fam.import_names(cfg)  # V4.1 with vision: the tower, the aligner, the delimiters and bias_vl too
    yield from stream(QuantReader(reader, keep_quantized), cfg, names, dtype, skip, done=done, bar=bar, into=into,
                      renames=fam.RENAMES, derived=fam.DERIVED)
    if cfg.engram is not None and ("engram_map", ()) not in done:
        yield ("engram_map", ()), [Part("engram_map", (), (), np.asarray(token_map, np.int32))]


def import_backbone(reader, cfg, dtype: str = "float32", progress: bool = True, token_map=None,
                    keep_quantized: bool = False) -> dict:
    """Host params of the backbone (see `backbone`)."""
    leaves = Leaves()
    return assemble(backbone(reader, cfg, dtype, token_map, keep_quantized, into=leaves), leaves)


class _Only:
    """The tensors of a reader whose canonical names start with `prefix`."""

    def __init__(self, reader, prefix: str):
        self.reader, self._keys = reader, [k for k in reader.keys() if canonical(k).startswith(prefix)]

    def keys(self):
        return list(self._keys)

    def __getattr__(self, name):
        return getattr(self.reader, name)


def has_mtp_tensors(reader) -> bool:
    return any(canonical(k).startswith("mtp.") for k in reader.keys())


def mtp_items(reader, cfg, dtype: str = "float32", keep_quantized: bool = False, done=frozenset(), bar=None,
              into=None):
    """`hf.stream` items of the `mtp.*` tensors (DeepSeek or HF spelling), none when the config has no MTP and the
    checkpoint none either; the blocks' embed/head copies are the backbone's (left out)."""
    mtp = _Only(reader, "mtp.")
    if specs := _mtp_specs(mtp, cfg):
        yield from stream(QuantReader(mtp, keep_quantized), cfg, fam.MTP_NAMES, dtype, fam.MTP_SKIP, done=done,
                          bar=bar, into=into, renames=fam.RENAMES, specs=specs, layer=lambda i: (f"mtp/{i}/", ()),
                          what="MTP ", hint=" (load without MTP to skip them)")


def _mtp_specs(mtp, cfg) -> dict:
    """The flat MTP parameter specs of `cfg`; CheckpointError when the checkpoint has mtp.* tensors but the
    config no MTP layers."""
    specs = flatten(mtp_param_specs(cfg))
    if mtp.keys() and not specs:
        raise CheckpointError(f"the checkpoint has {len(mtp.keys())} mtp.* tensors (e.g. {mtp.keys()[0]!r}) "
                              f"but this {cfg.family} config has no MTP layers"
                              + (" (DSpark needs dspark_block_size > 0)" if cfg.family == fam.V41 else ""))
    return specs


def import_mtp(reader, cfg, dtype: str = "float32", keep_quantized: bool = False) -> dict:
    """Host params {"mtp": {...}} of the `mtp.*` tensors ({} when there are none; see `mtp_items`)."""
    leaves = Leaves()
    return assemble(mtp_items(reader, cfg, dtype, keep_quantized, into=leaves), leaves)


def items(reader, cfg, tok, dtype: str = "float32", keep_quantized: bool = False, skip_mtp: bool = False,
          done=frozenset(), bar=None, into=None):
    """All `hf.stream` items of a DeepSeek V4 checkpoint: backbone, Engram map, MTP / DSpark blocks (unless
    skip_mtp); into: see `backbone`."""
    token_map = engram_map(tok, cfg) if cfg.engram is not None and tok is not None else None
    yield from backbone(reader, cfg, dtype, token_map, keep_quantized, done, bar, into)
    if has_mtp_tensors(reader):
        if skip_mtp:
            log.info("left out the MTP / DSpark weights (skip_mtp)")
        else:
            yield from mtp_items(reader, cfg, dtype, keep_quantized, done, bar, into)


def engram_map(tok, cfg) -> np.ndarray:
    """Engram's token id -> normalised-class map, built from the checkpoint's own tokenizer (spec §7.1)."""
    from jaxmodels.layers import engram

    token_map, classes = engram.build_compressed_token_map(tok.tok)
    if cfg.engram.compressed_vocab and classes != cfg.engram.compressed_vocab:
        raise CheckpointError(f"the tokenizer normalises to {classes} classes, the config's "
                              f"engram_compressed_vocab_size is {cfg.engram.compressed_vocab}")
    if len(token_map) < cfg.vocab_size:  # ids past the tokenizer (padding rows of the embedding) hash as pad
        token_map = np.concatenate([token_map, np.full(cfg.vocab_size - len(token_map), token_map[2], np.int32)])
    return token_map


def import_sharded(root, reader, cfg, tok, mesh, rules="tp", dtype: str = "float32", skip_mtp: bool = False) -> dict:
    """Device parameters of a DeepSeek checkpoint (safetensors under `root`, `reader` opened on it) placed on
    `mesh` by `rules` (jaxmodels.sharding), MTP / DSpark blocks included unless skip_mtp: each device reads only
    the bytes of its own block of each tensor (the block widened to whole quantization blocks, at most 31 or 127
    rows and columns more) and dequantises only that, so no process holds a whole tensor it does not place.
    Every name and shape is checked before any data is read, as in the host import."""
    import jax

    from jaxmodels import sharding

    files = dq.SafetensorsFiles(root, reader.keys()) if any(Path(root).glob("*.safetensors")) else None
    quant = QuantReader(reader, files=files)
    if cfg.engram is not None and tok is None:
        raise CheckpointError("this model uses Engram, which needs the tokenizer (tokenizer.json) to build its "
                              "compressed-vocabulary map; none was found")
    parts = [(quant, *fam.import_names(cfg), dict(derived=fam.DERIVED), flatten(param_specs(cfg)))]
    mtp = _Only(quant, "mtp.")
    if mtp.keys() and not skip_mtp:
        specs = _mtp_specs(mtp, cfg)
        parts.append((mtp, fam.MTP_NAMES, fam.MTP_SKIP, dict(layer=lambda i: (f"mtp/{i}/", ()), what="MTP ",
                                                              hint=" (load without MTP to skip them)"), specs))
    placements: dict[str, list[Placement]] = {}
    for source, names, skip, kw, specs in parts:  # all checked before any tensor is read
        for pm in plan_import(source, cfg, names, skip, renames=fam.RENAMES, specs=specs, **kw):
            placements.setdefault(pm.path, []).append((source, pm))
    specs = {p: s for *_, sp in parts for p, s in sp.items()}
    where = sharding.placement(cfg, mesh, rules)
    target = np_dtype(dtype)
    derived = {}
    if cfg.engram is not None:
        derived["engram_map"] = engram_map(tok, cfg)

    def leaf(path, spec):
        s = where(path, spec.shape)
        dt = np.dtype(spec.dtype or target)
        done: dict = {}  # devices that share a block (replicas) read it once

        def block(idx):
            key = tuple((i.start, i.stop) for i in idx)
            if key not in done:
                done[key] = (derived[path][idx].astype(dt) if path in derived
                             else _fill(placements.get(path, ()), spec.shape, dt, idx))
            return done[key]

        placed = sharding.placed_shape(spec.shape, s)
        if placed == spec.shape:
            return jax.make_array_from_callback(spec.shape, s, block)
        return jax.make_array_from_callback(placed, s, lambda idx: sharding.padded_slice(block, spec.shape, idx))

    return unflatten({path: leaf(path, spec) for path, spec in specs.items()})


def _fill(placements, shape, dt, idx) -> np.ndarray:
    """Block `idx` of a parameter of `shape` from its checkpoint placements: each read only for its part."""
    from jaxmodels.checkpoint import aligned_empty

    idx = tuple(slice(*i.indices(n)) for i, n in zip(idx, shape))
    out = aligned_empty(tuple(i.stop - i.start for i in idx), dt)  # page-aligned: jax adopts it, no copy
    out[...] = 0
    for source, pm in placements:
        lead = idx[:len(pm.index)]
        if not all(s.start <= i < s.stop for s, i in zip(lead, pm.index)):
            continue
        at = tuple(i - s.start for s, i in zip(lead, pm.index))
        src = _read_part(source, pm, idx[len(pm.index):])
        with np.errstate(over="ignore"):
            out[at] = src
        check_values(pm.name, src, out[at])
    return out


def _read_part(source, pm: Placement, sub: tuple[slice, ...]) -> np.ndarray:
    """pm's target restricted to `sub`, read through `source.get_slice` for the transforms whose block maps to
    one block of the source (copy, T, wo_a); else (none in DeepSeek's name map today) the whole tensor."""
    want, t = pm.want, pm.transform
    shape = tuple(s.stop - s.start for s in sub)
    full = lambda dims: all(s.start == 0 and s.stop == n for s, n in zip(sub[dims], want[dims]))  # noqa: E731
    if t == "copy":
        return source.get_slice(pm.name, sub)
    if t == "T" and full(slice(2, None)):  # [prod(out), in] -> [in, out0, rest...]
        k = math.prod(want[2:])
        rows = slice(sub[1].start * k, sub[1].stop * k) if len(want) > 1 else slice(None)
        return transpose(source.get_slice(pm.name, (rows, sub[0]))).reshape(shape)
    if t == "wo_a":  # [G*Ro, H*d/G] -> [G, H*d/G, Ro]
        Ro = want[2]
        src = source.get_slice(pm.name, (slice(sub[0].start * Ro, sub[0].stop * Ro), sub[1]))
        return np.ascontiguousarray(src.reshape(shape[0], Ro, shape[1])[:, sub[2]].transpose(0, 2, 1))
    log.debug("%s: transform %r read whole for a block", pm.name, t)
    return np.asarray(TRANSFORMS[t][1](source.get(pm.name), want))[sub]
