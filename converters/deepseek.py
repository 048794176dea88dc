"""DeepSeek V4 / V4.1 checkpoints (specs/deepseek_v4.md §10): a reader that decodes their quantized tensors, and
the imports of the backbone and of the MTP blocks through the one planner (converters/hf.py) with the name maps
of jaxmodels/families/deepseek_v4.py.

`QuantReader` pairs each `X.weight` with its `X.scale` (HF: `weight_scale_inv`): FP8 e4m3 weights with E8M0
block scales (32x32 in V4.1, 128x128 in V4), MXFP4 experts (packed int8 + E8M0 per 32), per-row FP8 Engram
tables, `wo_a` rounded to bf16 as the reference does. Dequantised tensor by tensor, or kept as their bytes
(`keep_quantized`: FP8 linears and FP4 experts as {"fp8"|"fp4", "scale"} in the checkpoint's [out, in] layout,
expanded inside the matmul; Engram's table as `table` + `table_scale`, its rows expanded after the gather).
"""
from __future__ import annotations

import logging

import numpy as np

from converters import deepseek_quant as dq
from converters.hf import Part, Quantized, assemble, nonfinite, normalize, source_bytes, stream
from converters.safetensors_io import CheckpointError
from jaxmodels.families import deepseek_v4 as fam
from jaxmodels.plan import flatten, mtp_param_specs

log = logging.getLogger(__name__)


def canonical(name: str) -> str:
    return normalize(name, fam.RENAMES)


class QuantReader:
    """Wraps a reader: each `X.weight` + `X.scale` pair appears as one tensor `X.weight` of the logical shape,
    dequantised (float32; wo_a bf16) or, with keep_quantized, as a `Quantized` record of its bytes."""

    def __init__(self, reader, keep_quantized: bool = False):
        self.reader, self.keep = reader, keep_quantized
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
        block = _block(w, s, name)
        return dq.dequant_wo_a(w, s, block, name) if canon.endswith(".wo_a.weight") else dq.dequant_fp8_blocks(w, s, block, name)

    def get_slice(self, name, index):
        return self.get(name)[index]

    def nbytes(self, name):
        return source_bytes(self.reader, name) + (source_bytes(self.reader, self._scale[name]) if name in self._scale
                                                  else 0)


def _block(w, s, name) -> int:
    """The square block size implied by a weight and its scale grid (32 in V4.1, 128 in V4)."""
    for b in (32, 128, 64, 16):
        if (-(-w.shape[0] // b), -(-w.shape[1] // b)) == tuple(s.shape):
            return b
    raise CheckpointError(f"{name}: scale grid {tuple(s.shape)} does not tile a weight of shape {tuple(w.shape)}")


def backbone(reader, cfg, dtype: str = "float32", token_map=None, keep_quantized: bool = False, done=frozenset(),
             bar=None):
    """`hf.stream` items of the backbone; Engram's token map (built from the tokenizer) goes in as `engram_map`."""
    if cfg.engram is not None and token_map is None:
        raise CheckpointError("this model uses Engram, which needs the tokenizer (tokenizer.json) to build its "
                              "compressed-vocabulary map; none was found")
    yield from stream(QuantReader(reader, keep_quantized), cfg, fam.NAMES, dtype, fam.SKIP, done=done, bar=bar,
                      renames=fam.RENAMES, derived=fam.DERIVED)
    if cfg.engram is not None and ("engram_map", ()) not in done:
        yield ("engram_map", ()), [Part("engram_map", (), (), np.asarray(token_map, np.int32))]


def import_backbone(reader, cfg, dtype: str = "float32", progress: bool = True, token_map=None,
                    keep_quantized: bool = False) -> dict:
    """Host params of the backbone (see `backbone`)."""
    return assemble(backbone(reader, cfg, dtype, token_map, keep_quantized))


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


def mtp_items(reader, cfg, dtype: str = "float32", keep_quantized: bool = False, done=frozenset(), bar=None):
    """`hf.stream` items of the `mtp.*` tensors (DeepSeek or HF spelling), none when the config has no MTP and the
    checkpoint none either; the blocks' embed/head copies are the backbone's (left out)."""
    specs = flatten(mtp_param_specs(cfg))
    mtp = _Only(reader, "mtp.")
    if mtp.keys() and not specs:
        raise CheckpointError(f"the checkpoint has {len(mtp.keys())} mtp.* tensors (e.g. {mtp.keys()[0]!r}) "
                              f"but this {cfg.family} config has no MTP layers"
                              + (" (DSpark needs dspark_block_size > 0)" if cfg.family == fam.V41 else ""))
    if specs:
        yield from stream(QuantReader(mtp, keep_quantized), cfg, fam.MTP_NAMES, dtype, fam.MTP_SKIP, done=done,
                          bar=bar, renames=fam.RENAMES, specs=specs, layer=lambda i: (f"mtp/{i}/", ()), what="MTP ",
                          hint=" (load without MTP to skip them)")


def import_mtp(reader, cfg, dtype: str = "float32", keep_quantized: bool = False) -> dict:
    """Host params {"mtp": {...}} of the `mtp.*` tensors ({} when there are none; see `mtp_items`)."""
    return assemble(mtp_items(reader, cfg, dtype, keep_quantized))


def items(reader, cfg, tok, dtype: str = "float32", keep_quantized: bool = False, skip_mtp: bool = False,
          done=frozenset(), bar=None):
    """All `hf.stream` items of a DeepSeek V4 checkpoint: backbone, Engram map, MTP / DSpark blocks (unless
    skip_mtp)."""
    token_map = engram_map(tok, cfg) if cfg.engram is not None and tok is not None else None
    yield from backbone(reader, cfg, dtype, token_map, keep_quantized, done, bar)
    if has_mtp_tensors(reader):
        if skip_mtp:
            log.info("left out the MTP / DSpark weights (skip_mtp)")
        else:
            yield from mtp_items(reader, cfg, dtype, keep_quantized, done, bar)


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
