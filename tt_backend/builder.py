"""What every TT lowering shares: device limits, dtype/layout names, the checks a program must pass, and the
`Builder` that records ttnn calls with their tensor specs. `tt_backend.lowering` (GQA families) and
`tt_backend.deepseek_lowering` (mHC + MLA) both build on it; neither imports the other's internals."""
from __future__ import annotations

from jaxmodels.config import ModelConfig
from tt_backend.program import TTCall, TTProgram, TTTensorSpec
from tt_backend.weights import Precision

TILE = 32
PREFILL_MULTIPLE = 128  # scaled_dot_product_attention asserts seq_len % 128 == 0 (tt_transformers attention.py)
MAX_DECODE_BATCH = 32  # decode activations hold one user per row of one 32-row tile
MAX_HEADS = 32  # nlp_create_qkv_heads_decode pads heads to 32 (one tile of rows)
MAX_TOPK_WIDTH = 65536  # ttnn.topk: widest single call (tt_sampling chunks the vocab by 64K)
MAX_TOPK_K = 32  # ttnn.sampling: k in (0, 32]

BF16, BFP8, BFP4, F32, U32, I32, U16 = ("ttnn.bfloat16", "ttnn.bfloat8_b", "ttnn.bfloat4_b", "ttnn.float32",
                                        "ttnn.uint32", "ttnn.int32", "ttnn.uint16")
TILE_L, RM = "ttnn.TILE_LAYOUT", "ttnn.ROW_MAJOR_LAYOUT"
# ttnn memory-config attribute names (ttnn.<name>), as tt_backend.ttnn_exec resolves them
DRAM, L1_WIDTH, L1_HEIGHT = "DRAM_MEMORY_CONFIG", "L1_WIDTH_SHARDED_MEMORY_CONFIG", "L1_HEIGHT_SHARDED_MEMORY_CONFIG"


class TTConstraintError(ValueError):
    """A shape or setting the TT device cannot run (not a missing feature of this lowering)."""


def padded_prefill_len(n: int) -> int:
    """The prompt length a prefill program is built for: the next multiple of 128."""
    if n < 1:
        raise TTConstraintError(f"prefill needs at least one token, got {n}")
    return -(-n // PREFILL_MULTIPLE) * PREFILL_MULTIPLE


def tile_pad(n: int) -> int:
    """n rounded up to whole 32-wide tiles."""
    return -(-n // TILE) * TILE


def check_decode_batch(batch: int) -> None:
    if not 1 <= batch <= MAX_DECODE_BATCH:
        raise TTConstraintError(f"decode batch {batch}: one device decodes 1..{MAX_DECODE_BATCH} users "
                                f"(one 32-row tile); use data parallelism for more")


def check_topk(k: int, width: int) -> None:
    """ttnn.topk: one call covers at most 64K columns (it pads a partial tile with -inf itself)."""
    if not 0 < k <= width:
        raise TTConstraintError(f"top-k k={k} over width {width}")
    if width > MAX_TOPK_WIDTH:
        raise TTConstraintError(f"ttnn.topk over width {width} > {MAX_TOPK_WIDTH}: split the vocab into chunks")


def check_sampling(k: int, width: int, users: int) -> None:
    """ttnn.sampling (on-device top-k/top-p): 1..32 users, k in (0, 32], W a power-of-two multiple of 32."""
    if not 0 < k <= MAX_TOPK_K:
        raise TTConstraintError(f"device sampling k={k}: supported 0 < k <= {MAX_TOPK_K}")
    if not 1 <= users <= MAX_DECODE_BATCH:
        raise TTConstraintError(f"device sampling of {users} users: supported 1..{MAX_DECODE_BATCH}")
    tiles = width // TILE
    if width % TILE or tiles & (tiles - 1):
        raise TTConstraintError(f"device sampling width {width} is not a power-of-two multiple of {TILE}: pad "
                                f"(masked) first")
    check_topk(k, width)


def check_program(prog: TTProgram) -> None:
    """Rules a ttnn call list must satisfy (each raises TTConstraintError with the call's index)."""
    t = prog.tensors
    for n, c in enumerate(prog.calls):
        for name in c.refs() + list(c.outputs):
            if name not in t:
                raise TTConstraintError(f"call {n} ({c.op}) uses {name!r}, which has no tensor spec")
        if c.op == "ttnn.experimental.paged_update_cache" and t[c.inputs[1]].dtype not in (BF16, F32):
            raise TTConstraintError(f"call {n}: paged_update_cache input must be bfloat16 or float32 (the op "
                                    f"repacks into the cache dtype), got {t[c.inputs[1]].dtype}")
        if c.op == "ttnn.experimental.paged_fill_cache" and t[c.inputs[1]].dtype != t[c.inputs[0]].dtype:
            raise TTConstraintError(f"call {n}: paged_fill_cache is a raw tile copy; input dtype "
                                    f"{t[c.inputs[1]].dtype} != cache dtype {t[c.inputs[0]].dtype}")
        if c.op == "ttnn.experimental.rotary_embedding_llama" and t[c.inputs[0]].dtype != BF16:
            raise TTConstraintError(f"call {n}: rotary_embedding_llama needs bfloat16 input")
        if c.op == "ttnn.transformer.scaled_dot_product_attention" and t[c.inputs[0]].shape[2] % PREFILL_MULTIPLE:
            raise TTConstraintError(f"call {n}: prefill SDPA length {t[c.inputs[0]].shape[2]} is not a multiple "
                                    f"of {PREFILL_MULTIPLE}")
        if c.op == "ttnn.topk":
            check_topk(c.kwargs["k"], t[c.inputs[0]].shape[-1])
        for name in c.outputs:
            s = t[name]
            if s.layout == TILE_L and any(p % TILE for p in s.padded_shape[-2:] if p is not None):
                raise TTConstraintError(f"call {n}: {name} padded shape {s.padded_shape} is not tile aligned")


MASKED = -1e9  # additive mask value of a forbidden (query, key) pair: exp underflows to 0, no inf arithmetic


# ---------------------------------------------------------------------------------- builder
class Builder:
    """Collects one program's calls and tensor specs (activations, weights) for one mode (prefill | decode)."""

    def __init__(self, cfg: ModelConfig, prec: Precision, mode: str, chunk_start: int = 0,
                 per_layer_page_tables: bool = False, modulo: tuple = (), masked: bool = False):
        self.cfg, self.prec, self.mode = cfg, prec, mode
        self.calls: list[TTCall] = []
        self.tensors: dict[str, TTTensorSpec] = {}
        self.mem = DRAM if mode == "prefill" else L1_WIDTH
        self.chunk_start, self.per_layer, self.modulo = chunk_start, per_layer_page_tables, modulo
        self.masked = masked  # prefill SDPA reads an additive mask input instead of the causal rule

    def page_table(self, i: int, chunk: bool = False) -> str:
        """The page table layer i reads (one per layer for hybrid KV groups); `chunk`: the chunk's slice."""
        return ("chunk_page_table" if chunk else "page_table") + (f".{i}" if self.per_layer else "")

    def ring(self, i: int) -> int | None:
        """cache_position_modulo of layer i's cache (a sliding ring), or None for a full-length cache."""
        return self.modulo[i] if self.modulo else None

    def tensor(self, name, shape, dtype, layout=TILE_L, memory=None, kind="activation"):
        shape = tuple(shape)
        padded = shape if layout == RM else shape[:-2] + tuple(None if s is None else tile_pad(s) for s in shape[-2:])
        self.tensors[name] = TTTensorSpec(shape, padded, dtype, layout, memory or self.mem, kind)
        return name

    def call(self, op, inputs, kwargs, out, shape, dtype=BF16, layout=TILE_L, memory=None):
        outs = (out,) if isinstance(out, str) else tuple(out)
        shapes = (shape,) if isinstance(out, str) else shape
        dtypes = (dtype,) * len(outs) if isinstance(dtype, str) else dtype
        for o, s, dt in zip(outs, shapes, dtypes):
            self.tensor(o, s, dt, layout, memory)
        self.calls.append(TTCall(op, tuple(inputs), kwargs, outs))
        return out

    def weight(self, name, shape, dtype, layout=TILE_L):
        if name not in self.tensors:
            self.tensor(name, shape, dtype, layout, DRAM, "weight")
        return name


def compute_config(op) -> dict:
    """The ttnn compute-kernel config (fidelity, fp32 accumulation) of one op's precision setting."""
    return op.kwargs()
