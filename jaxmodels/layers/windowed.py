"""Expert-sorted rows through their experts in windows of W rows of one expert, all windows in one kernel: the
grouped matmul for more experts than `grouped`'s kernels take (DeepSeek's 256-384, Qwen3-MoE's 128), experts kept
in FP4 decoded inside.

The rows of expert e are cut into windows of W rows; P = E + ceil(M / W) windows cover any group sizes (`layout`).
`moe._windows` (XLA) runs the windows one loop step after another, each step expanding its expert to bf16 in HBM:
432 steps for a k=3 verify of 32 sequences on V4.1-Flash. `gathered` reads an expert per row, which past ~E rows
is more than the whole stack. Here rows are laid out window by window ([P * W, K], `spread`; a window's unused
rows zero), program (p, j) multiplies window p by column block j of its expert on the tensor cores (W >= 16 rows),
an FP4 tile decoded in registers once for the window's W rows, and the rows come back in their order (`collect`).
So a step reads each routed expert's bytes about once. Pallas on the Triton backend like `gathered` (`grouped`'s
Mosaic GPU GEMM did not compile past 32 experts). `reference`, a loop over the same windows, runs everywhere the
kernel does not and is its backward.
"""
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxmodels.layers import gathered, qdq, triton

F32 = jnp.float32
MAX_WINDOW = 128  # rows a program: its fp32 accumulator [W, bn] lives in registers


@functools.partial(jax.tree_util.register_dataclass, data_fields=("expert", "start", "count"), meta_fields=("W",))
@dataclasses.dataclass(frozen=True)
class Layout:
    """Window p holds the rows start[p] .. start[p] + count[p] - 1 of expert[p]; count 0: an unused window."""
    expert: jax.Array  # [P] int32, local ids 0 .. E-1
    start: jax.Array  # [P] int32
    count: jax.Array  # [P] int32
    W: int  # rows a window (static)


def layout(sizes, rows: int, W: int) -> Layout:
    """The windows of `rows` expert-sorted rows whose group sizes are `sizes` [E] (sum <= rows): each group's
    pieces of W rows in order, then unused windows up to the static count E + ceil(rows / W)."""
    E = sizes.shape[0]
    pieces = -(-sizes // W)
    ends = jnp.cumsum(pieces)
    p = jnp.arange(E + -(-rows // W))
    e = jnp.minimum(jnp.searchsorted(ends, p, side="right"), E - 1)  # past the last window: a piece past E-1's
    piece = p - (ends - pieces)[e]
    start = (jnp.cumsum(sizes) - sizes)[e] + piece * W
    count = jnp.clip(sizes[e] - piece * W, 0, W)
    return Layout(e.astype(jnp.int32), start.astype(jnp.int32), count.astype(jnp.int32), W)


def _slots(lay: Layout):
    """[P, W] row of each slot, and whether the slot holds one."""
    return lay.start[:, None] + jnp.arange(lay.W), jnp.arange(lay.W) < lay.count[:, None]


def spread(x, lay: Layout):
    """Rows [M, K] -> window layout [P * W, K]; unused slots zero."""
    src, ok = _slots(lay)
    return jnp.where(ok[..., None], x[jnp.where(ok, src, 0)], jnp.zeros((), x.dtype)).reshape(-1, x.shape[-1])


def collect(y, lay: Layout, rows: int):
    """Window layout [P * W, N] -> rows [rows, N]; rows in no window (past the groups) zero, as `lax.ragged_dot`."""
    src, ok = _slots(lay)
    slot = jnp.full((rows,), y.shape[0], jnp.int32).at[jnp.where(ok, src, rows).reshape(-1)].set(
        jnp.arange(y.shape[0], dtype=jnp.int32), mode="drop")
    return jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)])[slot]


def reference(xw, w, lay: Layout, first=0):
    """The windows one loop step each: window p times expert first + expert[p] of w (every layer's [G, K, N], or
    kept in FP4 [G, N, K/2] + scales, dequantised to xw's dtype), accumulated in fp32; unused windows zero."""
    W = lay.W

    @jax.checkpoint  # the backward recomputes a step's weights instead of keeping one per window
    def window(xp, e):
        we = jax.tree.map(lambda v: v[e], w)
        we = qdq.dequant(we, xp.dtype).T if isinstance(we, dict) else we
        return jnp.dot(xp, we, preferred_element_type=F32)

    def step(p, out):
        y = window(jax.lax.dynamic_slice_in_dim(xw, p * W, W), first + lay.expert[p])
        y = jnp.where(lay.count[p] > 0, y, 0).astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, y, p * W, 0)

    N = jax.tree.leaves(w)[0].shape[1 if isinstance(w, dict) else 2]
    return jax.lax.fori_loop(0, lay.expert.shape[0], step, jnp.zeros((xw.shape[0], N), xw.dtype))


def _tiles(x, w) -> bool:
    if x.ndim != 2 or x.dtype not in gathered.HALF:
        return False
    if isinstance(w, dict):  # FP4 only: N a multiple of 16, whole scale blocks
        return "fp4" in w and w["fp4"].shape[1] % 16 == 0 and (2 * w["fp4"].shape[2]) % gathered.FP4_BLOCK == 0
    return getattr(w, "ndim", 0) == 3 and w.dtype == x.dtype and w.shape[1] % 32 == 0 and w.shape[2] % 32 == 0


def fits(x, w) -> bool:
    """Whether the kernel runs: on the GPU, half-precision rows, bf16 experts of their dtype or FP4 ones whose
    widths it tiles, operands Pallas' offsets address; JAXMODELS_WINDOWED_KERNEL=0 switches it off (read when a
    program is traced)."""
    on = os.environ.get("JAXMODELS_WINDOWED_KERNEL", "1") != "0"
    return (on and jax.default_backend() == "gpu" and _tiles(x, w)
            and triton.offsets_fit(*jax.tree.leaves(gathered._addressed(w))))


def matmul(xw, w, lay: Layout, first=0, *, interpret: bool = False):
    """xw [P * W, K] in `lay`'s window layout, w every layer's experts ([G, K, N], or FP4 {"fp4" [G, N, K/2],
    "scale" [G, N, K/32]}), window p through expert first + lay.expert[p] -> [P * W, N] in xw's dtype (unused
    windows zero). Differentiable in xw (and in w unless quantized) through `reference`'s backward.
    The kernel takes windows of W >= 16 rows, a power of two (`reference` any other).
    interpret: the kernel in Pallas' interpreter wherever its widths tile (CPU tests)."""
    tiles = lay.W >= 16 and lay.W & (lay.W - 1) == 0  # the tensor cores' rows; Triton's blocks: powers of two
    if not (tiles and (fits(xw, w) or interpret and _tiles(xw, w))):
        return reference(xw, w, lay, first)
    return _kernel_matmul(xw, w, lay, jnp.asarray(first, jnp.int32), interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kernel_matmul(xw, w, lay, first, interpret):
    W, K = lay.W, xw.shape[1]
    ids = lay.expert + first
    if isinstance(w, dict):
        N, blocks = w["fp4"].shape[1], K // gathered.FP4_BLOCK
        bn, nbk, warps, stages = tiling(N, blocks, W)
        kernel = functools.partial(_fp4_kernel, blocks=blocks, nbk=nbk, N=N, W=W, asm=gathered.asm_decode(interpret))
        words = gathered._words(w["fp4"]).reshape(*w["fp4"].shape[:2], blocks, 4)
        # the rows by nibble, [8, PW, K/8], copied: read with stride 8 inside, the kernel lost more than the copy
        # costs (BENCHMARKS.md)
        operands = (jnp.moveaxis(xw.reshape(-1, K // 8, 8), -1, 0), words, w["scale"])
    else:
        N, bk = w.shape[2], 64 if K % 64 == 0 else 32
        bn, _, warps, stages = tiling(N)
        kernel = functools.partial(_kernel, steps=K // bk, bk=bk, W=W)
        operands = (xw, w)
    cols = -(-N // bn)  # FP4: a last block of columns past N is masked, written to columns cut off here
    y = pl.pallas_call(
        kernel, grid=(lay.expert.shape[0], cols),
        in_specs=[triton.whole(a) for a in (ids, lay.count, *operands)],
        out_specs=pl.BlockSpec((W, bn), lambda p, j: (p, j)),
        out_shape=jax.ShapeDtypeStruct((xw.shape[0], cols * bn), xw.dtype), interpret=interpret,
        name="windowed_matmul" + ("_fp4" if isinstance(w, dict) else ""),
        **({} if interpret else triton.params(num_warps=warps, num_stages=stages)),
    )(ids, lay.count, *operands)
    return y[:, :N]  # (a slice XLA fuses into its consumer)


def tiling(N: int, blocks: int | None = None, W: int = 32) -> tuple[int, int, int, int]:
    """(columns a program, scale blocks a step, warps, pipeline stages) of the kernel for N output columns, FP4
    rows of `blocks` scale blocks (None: bf16) and windows of W rows. bf16 column blocks divide N; FP4 ones may
    end past N (masked), and a step's scale blocks need not divide the row's (its last step masked). FP4's were
    the fastest at GPT-OSS's 32 experts 2880 -> 2880 on an H100 (BENCHMARKS.md: 1024 rows, W 32: 0.312 ms, was
    0.384 at 64 columns and 4 blocks; 4096 rows, W 128: 0.755, was 0.924); shared memory holds `stages` copies
    of a step's words and 8 x W x 4 nbk row elements."""
    if blocks is None:
        return next(b for b in (64, 32, 16) if N % b == 0), 8, 4, 3
    return (256, 4, 8, 3) if W >= 128 else (128, 8, 4, 2)


def _kernel_matmul_fwd(xw, w, lay, first, interpret):
    return _kernel_matmul(xw, w, lay, first, interpret), (xw, w, lay, first)


def _kernel_matmul_bwd(interpret, res, g):
    xw, w, lay, first = res
    zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), (lay, first))
    if isinstance(w, dict):  # bytes: no cotangent
        return (jax.vjp(lambda x: reference(x, w, lay, first), xw)[1](g)[0], None, *zeros)
    dx, dw = jax.vjp(lambda x, w: reference(x, w, lay, first), xw, w)[1](g)
    return dx, dw, *zeros


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


def _finish(n_ref, o_ref, accumulate):
    """Write window p's tile: the accumulated product, or zeros for an unused window (whose bytes are not read)."""
    used = n_ref[pl.program_id(0)] > 0

    @pl.when(used)
    def _():
        o_ref[...] = accumulate().astype(o_ref.dtype)

    @pl.when(jnp.logical_not(used))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _kernel(e_ref, n_ref, x_ref, w_ref, o_ref, *, steps: int, bk: int, W: int):
    """Window p (rows p*W ..) times columns j*bn .. of its expert [K, N], steps blocks of bk along K."""
    p, j = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[1]
    e, rows, cols = e_ref[p], pl.ds(p * W, W), pl.ds(j * bn, bn)

    def body(t, acc):
        k = pl.ds(t * bk, bk)
        return acc + jnp.dot(x_ref[rows, k], w_ref[e, k, cols], preferred_element_type=F32)

    _finish(n_ref, o_ref, lambda: jax.lax.fori_loop(0, steps, body, jnp.zeros((W, bn), F32)))


def _fp4_kernel(e_ref, n_ref, xq_ref, w_ref, s_ref, o_ref, *, blocks: int, nbk: int, N: int, W: int, asm: bool):
    """Window p times columns j*bn .. of its packed expert, viewed [N, K/32, 4] words: a step decodes nbk scale
    blocks of bn columns ([bn, nbk, 4] words, 16 nbk bytes contiguous a column) exactly as `qdq.dequant`
    (`gathered.e2m1_planes`: e2m1 times the E8M0 scale, then in the rows' dtype), and for each nibble q multiplies
    the decoded [bn, 4 nbk] plane with the rows' elements 8p + q (xq [8, P*W, K/8]). A row of `blocks` scale
    blocks that nbk does not divide (GPT-OSS's 2880: 90) ends in one step whose loads past the row are masked to
    zeros (Triton's dots need 16 along the contraction, so a step cannot shrink to the rest); columns past N (a
    last block of bn that N does not fill) load as zeros too, and their products land in columns cut off after."""
    p, j = pl.program_id(0), pl.program_id(1)
    bn = o_ref.shape[1]
    e, rows, cols = e_ref[p], pl.ds(p * W, W), pl.ds(j * bn, bn)
    ragged = N % bn != 0

    def body(t, acc, masked=False):
        kb = t * nbk

        def load(ref, index, shape, limit, weights=True):
            """ref[index] of `shape`, zeros where dimension 1 (scale blocks, or xq's columns; its slice starts at kb
            scaled to its size) reaches `limit` in the masked step, and for weights where dimension 0 (columns)
            reaches N."""
            mask = None
            if masked:
                mask = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + kb * (shape[1] // nbk) < limit
            if ragged and weights:
                past = jax.lax.broadcasted_iota(jnp.int32, shape, 0) + j * bn < N
                mask = past if mask is None else mask & past
            if mask is None:
                return ref[index]
            from jax.experimental.pallas import triton as plgpu

            index = tuple(jnp.int32(i) if isinstance(i, int) else i for i in index)  # the interpreter's need
            return plgpu.load(ref.at[index], mask=mask, other=0)

        words = load(w_ref, (e, cols, pl.ds(kb, nbk), slice(None)), (bn, nbk, 4), blocks)  # int32
        scale = qdq.e8m0_to_f32(load(s_ref, (e, cols, pl.ds(kb, nbk)), (bn, nbk), blocks))[:, :, None]
        for q, wq in enumerate(gathered.e2m1_planes(words, scale, asm)):
            wq = wq.astype(o_ref.dtype).reshape(bn, 4 * nbk)
            xq = load(xq_ref, (q, rows, pl.ds(4 * kb, 4 * nbk)), (W, 4 * nbk), 4 * blocks, weights=False)
            acc = acc + jax.lax.dot_general(xq, wq, (((1,), (1,)), ((), ())), preferred_element_type=F32)
        return acc

    def accumulate():
        steps, acc = blocks // nbk, jnp.zeros((W, bn), F32)
        if steps:  # (traced even for no trip, and a row of fewer than nbk blocks has no whole step)
            acc = jax.lax.fori_loop(0, steps, body, acc)
        if blocks % nbk:  # a loop of one: its start is traced, and Pallas refuses static slices past a dimension
            acc = jax.lax.fori_loop(steps, steps + 1, functools.partial(body, masked=True), acc)
        return acc

    _finish(n_ref, o_ref, accumulate)
