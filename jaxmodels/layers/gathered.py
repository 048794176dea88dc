"""Each row through its own expert: y[i] = x[i] @ w[ids[i]], reading only the chosen experts' weights.

Decode routes few rows (tokens x top-k <= experts; E/2 for FP4 past 32 experts, where `windowed` wins above), so
its MoE cost is the routed experts' bytes. The grouped GEMM (`grouped.py`) computes tiles for every expert whatever
the group sizes (GPT-OSS-20B at batch 1 on an H200: 7.1 of an 11.3 ms step, reading all 32 experts per layer), and
XLA's gather of w[ids] materialises the chosen slabs at ~300 GB/s before its matmul. This kernel (Pallas, Triton
backend) is a GEMV per (row, column block, split of the contraction) that reads its expert's slab in place: give it
every layer's experts ([L * E, K, N], ids offset by the layer), since XLA copies a scanned layer's slice of the
stack before a Triton call (18 of a 23.6 ms GPT-OSS step when it was given the slice). The XLA gather + einsum is
the reference, run everywhere the kernel does not.

Experts kept quantized ({"fp4": packed e2m1 [G, N, K/2], "scale": E8M0 [G, N, K/32]}, the [out, in] layout of
`qdq.dequant_fp4`, also GPT-OSS's MXFP4, read as 32-bit words of 8 codes; or {"fp8": e4m3 [G, N, K], "scale":
E8M0 [G, N/B, K/B]}) are read as stored: the kernel decodes each block of the chosen slab in registers (e2m1 codes
and E8M0 bytes bit for bit as `qdq`), so a step reads the quantized bytes only (FP4: ~0.28 of bf16). Their
reference is `qdq.dequant` of the chosen experts, then the same einsum. H100, GPT-OSS-20B widths, one 2880 x 2880
matrix over 24 layers' stack (BENCHMARKS.md, fifth session): B=1 0.047 ms (XLA dequant path 0.049), B=8 0.169 ms
(0.198). Earlier H200 timings of the byte-reading kernel (B=1 0.033, bf16 kernel 0.028; without decoding the loads
took 0.026 / 0.118 ms, so 16-byte-wide column rows, not the bandwidth, bound it) read layers 16-23 of that 3.2e9-byte
stack through wrapped offsets (issue #13).
"""
import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxmodels.layers import qdq, triton

F32 = jnp.float32
HALF = (jnp.bfloat16, jnp.float16)
TARGET_PROGRAMS = 528  # ~4 programs per SM of an H200
FP4_BLOCK = 32  # values per E8M0 scale, 16 packed bytes


def _tiles(x, w) -> bool:
    if isinstance(w, dict):  # [G, N, ...] kept quantized: columns in blocks of 16 (and of the FP8 scale block)
        N = w["fp4" if "fp4" in w else "fp8"].shape[1]
        return x.ndim == 2 and N % 16 == 0 and ("fp4" in w or _fp8_block(w) is not None)
    return x.ndim == 2 and getattr(w, "ndim", 0) == 3 and w.shape[1] % 16 == 0 and w.shape[2] % 32 == 0


def fits(x, w) -> bool:
    """Whether the kernel runs: on the GPU, half-precision activations (of the weights' dtype unless they are kept
    quantized), widths it tiles, operands the lowering can address (`triton.offsets_fit`: read as bytes, one
    V4.1-Flash layer's FP4 experts, 2.26e9, could not: from expert 364's last rows on they were read outside the
    buffer, issue #13; FP4 is read as words since, FP8 bytes and E8M0 scales are still checked), and not switched
    off by JAXMODELS_GATHERED_KERNEL=0 (read when a program is traced)."""
    same = isinstance(w, dict) or x.dtype == w.dtype
    on = os.environ.get("JAXMODELS_GATHERED_KERNEL", "1") != "0"
    return (on and jax.default_backend() == "gpu" and same and x.dtype in HALF and _tiles(x, w)
            and triton.offsets_fit(*jax.tree.leaves(_addressed(w))))


def _addressed(w):
    """The weight operands' shapes as the kernel receives them: FP4 bytes as 32-bit words (`_words`)."""
    return {**w, "fp4": jax.eval_shape(_words, w["fp4"])} if isinstance(w, dict) and "fp4" in w else w


def _words(b):
    """Packed FP4 bytes [G, N, K/2] viewed as int32 words [G, N, K/8] (little-endian: nibble q of word p is
    element 8p + q of the row). A word's offset is a quarter of its byte's, so Pallas' 32-bit offsets reach 8 GiB
    of a stack, not 2 (one V4.1-Flash layer's experts are 2.26e9 bytes)."""
    return jax.lax.bitcast_convert_type(b.reshape(*b.shape[:-1], -1, 4), jnp.int32)


def reference(x, w, ids):
    """The XLA path: the chosen slabs gathered (and dequantised, if kept quantized), then one batched matmul."""
    if isinstance(w, dict):
        wq = qdq.dequant({k: v[ids] for k, v in w.items()}, x.dtype)  # exact in x's dtype ([n, N, K])
        return jnp.einsum("nk,nfk->nf", x, wq, preferred_element_type=F32).astype(x.dtype)
    return jnp.einsum("nk,nkf->nf", x, w[ids], preferred_element_type=F32).astype(x.dtype)


def matmul(x, w, ids, *, interpret: bool = False):
    """x [n, K], w [G, K, N] or kept quantized ([G, N, K] as bytes, see the module doc), ids [n] int -> [n, N] in
    x's dtype, accumulated in fp32. Differentiable in x (and in w unless quantized); the backward is the
    reference's. interpret: run the kernel in Pallas' interpreter wherever its widths tile (CPU tests)."""
    if not (fits(x, w) or interpret and _tiles(x, w)):
        return reference(x, w, ids)
    return _kernel_matmul(x, w, ids, interpret)


def _splits(rows_by_cols: int, steps: int) -> int:
    """Split the contraction until ~4 programs an SM: at decode sizes (4 rows) the columns alone give too few."""
    return next((s for s in range(1, steps + 1) if steps % s == 0 and rows_by_cols * s >= TARGET_PROGRAMS), steps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_matmul(x, w, ids, interpret):
    if isinstance(w, dict):
        return _quantized_call(x, w, ids, interpret)
    n, (_, K, N) = x.shape[0], w.shape
    bk = next(b for b in (64, 32, 16) if K % b == 0)
    bn = 64 if N % 64 == 0 else 32
    steps = K // bk
    splits = _splits(n * (N // bn), steps)
    parts = pl.pallas_call(
        functools.partial(_kernel, steps=steps // splits, bk=bk, bn=bn), grid=(n, N // bn, splits),
        in_specs=[triton.whole(x), triton.whole(w), triton.whole(ids)],
        out_specs=pl.BlockSpec((None, None, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, n, N), F32), interpret=interpret, name="gathered_matmul",
        **({} if interpret else triton.params(num_stages=4)),
    )(x, w, ids.astype(jnp.int32))
    return jnp.sum(parts, axis=0).astype(x.dtype)


def _kernel_matmul_fwd(x, w, ids, interpret):
    return _kernel_matmul(x, w, ids, interpret), (x, w, ids)


def _kernel_matmul_bwd(interpret, res, g):
    x, w, ids = res
    if isinstance(w, dict):  # bytes: no cotangent
        return jax.vjp(lambda x: reference(x, w, ids), x)[1](g)[0], None, None
    dx, dw = jax.vjp(lambda x, w: reference(x, w, ids), x, w)[1](g)
    return dx, dw, None


_kernel_matmul.defvjp(_kernel_matmul_fwd, _kernel_matmul_bwd)


def _kernel(x_ref, w_ref, ids_ref, o_ref, *, steps: int, bk: int, bn: int):
    """Row i, columns j*bn .. of its expert's matrix, over split s of the contraction (steps blocks of bk)."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ids_ref[i]

    def body(t, acc):
        k0 = (s * steps + t) * bk
        xb = x_ref[i, pl.ds(k0, bk)].astype(F32)
        wb = w_ref[e, pl.ds(k0, bk), pl.ds(j * bn, bn)].astype(F32)
        return acc + jnp.sum(xb[:, None] * wb, axis=0)

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn,), F32))


# ---- experts kept quantized: [G, N, K] bytes, decoded in registers ----

def _fp8_block(w):
    """The square block of an FP8 weight's scale grid that the kernel tiles (16 .. 128), else None."""
    N, K = w["fp8"].shape[1:]
    return next((b for b in (128, 64, 32, 16) if tuple(w["scale"].shape[1:]) == (-(-N // b), -(-K // b))
                 and K % b == 0), None)


def _quantized_call(x, w, ids, interpret):
    n, N = x.shape[0], w["scale"].shape[1] if "fp4" in w else w["fp8"].shape[1]
    if "fp4" in w:  # a scale block: 4 words of 8 nibbles; x split by nibble q (element 8p + q of the block)
        K = 2 * w["fp4"].shape[2]
        blocks = K // FP4_BLOCK
        g = 2 if blocks % 2 == 0 else 1  # 32 bytes a column a load (H200: 16 was ~1.3x slower)
        sub = 3 if (blocks // g) % 3 == 0 else 1
        steps, bn = blocks // (g * sub), next(b for b in (64, 32, 16) if N % b == 0)
        kernel = functools.partial(_fp4_kernel, sub=sub, g=g, asm=asm_decode(interpret))
        words = _words(w["fp4"]).reshape(*w["fp4"].shape[:2], blocks, 4)  # a scale block: 4 words
        xq = jnp.moveaxis(x.reshape(n, blocks, 4, 8), -1, 0)  # [8, n, blocks, 4]: the elements of nibble q
        operands = (xq, words, w["scale"])
    else:  # a step: bk values inside one scale block; columns bn inside one scale block
        B = _fp8_block(w)
        K, bk = w["fp8"].shape[2], min(64, B)
        steps, bn = K // bk, next(b for b in (64, 32, 16) if N % b == 0 and B % b == 0)
        fp8 = w["fp8"] if w["fp8"].dtype == jnp.float8_e4m3fn else jax.lax.bitcast_convert_type(
            w["fp8"], jnp.float8_e4m3fn)  # raw bytes (uint8 / int8) reinterpreted, as qdq
        kernel = functools.partial(_fp8_kernel, bk=bk, block=B)
        operands = (x, fp8, w["scale"])
    splits = _splits(n * (N // bn), steps)
    ids = ids.astype(jnp.int32)
    parts = pl.pallas_call(
        functools.partial(kernel, steps=steps // splits, bn=bn), grid=(n, N // bn, splits),
        in_specs=[triton.whole(a) for a in (*operands, ids)],
        out_specs=pl.BlockSpec((None, None, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((splits, n, N), F32), interpret=interpret,
        name="gathered_matmul_" + ("fp4" if "fp4" in w else "fp8"),
        **({} if interpret else triton.params(num_stages=4)),
    )(*operands, ids)
    return jnp.sum(parts, axis=0).astype(x.dtype)


def e2m1_bits(c):
    """e2m1 codes (int32, bit 3 = sign) -> fp32, `qdq.FP4_TABLE` bit for bit (-0.0 for code 8) without a table:
    magnitude code 2e + m (e > 0) is 2^(e-1) (1 + m/2), exponent field e + 126; code 1 is 0.5 (field 126)."""
    mag = c & 7
    field = jnp.where(mag >= 2, mag + 252, mag * 252)  # (exponent, top mantissa bit) = field << 22
    return jax.lax.bitcast_convert_type((field << 22) | ((c & 8) << 28), F32)


def asm_decode(interpret: bool) -> bool:
    """Whether the FP4 kernels decode with `_E2M1_PTX` (compiled on the GPU, unless JAXMODELS_ASM_DECODE=0, read when
    traced) or with `e2m1_bits` (the interpreter, which runs no PTX). H100, one V4.1-Flash layer's matrix: the
    windows 1.06-1.12x faster (2.44 -> 2.20 ms at 768 rows), the gathered kernel 1.21-1.39x (BENCHMARKS.md)."""
    return not interpret and os.environ.get("JAXMODELS_ASM_DECODE", "1") != "0"


def _e2m1_ptx(q: int) -> str:
    """Two words' nibbles q to a bf16 pair, scaled: byte q // 2 of both words side by side in 16-bit halves (prmt),
    a nibble's magnitude bits 2e + m moved to the bf16 exponent's two low bits and the mantissa's top bit and its sign
    to the sign (2^(e-127) (1 + m/2), or the subnormal m 2^-127), then times 2^126 and times the scales. bf16x2
    fma keeps subnormals, and each product is exact or overflows to inf as the dequantised weight does."""
    k, (mag, sign) = q // 2, ((6, 12), (2, 8))[q % 2]  # a low nibble's bits 0-3, a high one's 4-7
    return "\n".join([
        "{", ".reg .b32 b, v, t, sc, c, z;",
        "cvt.rn.bf16x2.f32 sc, $4, $3;",  # the first word's scale in the low half
        "mov.b32 c, 0x7E807E80;", "mov.b32 z, 0x80008000;",  # 2^126 and -0, twice
        f"prmt.b32 b, $1, $2, 0x{4 + k}{4 + k}{k}{k};",
        f"shl.b32 v, b, {mag};", "and.b32 v, v, 0x01C001C0;", f"shl.b32 t, b, {sign};", "and.b32 t, t, 0x80008000;",
        "or.b32 v, v, t;", "fma.rn.bf16x2 v, v, c, z;", "fma.rn.bf16x2 $0, v, sc, z;", "}"])


_E2M1_PTX = [_e2m1_ptx(q) for q in range(8)]


def e2m1_planes(words, scale, asm: bool):
    """int32 words of 8 e2m1 codes and their fp32 scales (broadcast to the words) -> 8 arrays: nibble q of each word
    times its scale, exactly the dequantised weight. asm: on the GPU, in bf16 (e2m1 times a power of two fits its
    mantissa, and it overflows where fp32 does), two codes to a 32-bit op (`_e2m1_ptx`, ~4 ops a weight once ptxas
    shares the scale and byte moves between nibbles); else in fp32 from `e2m1_bits`. The PTX takes two elements a
    call, so it needs at least two a thread of the kernels' 4 warps (Triton aborts the process otherwise): smaller
    loads (the gathered kernel's [16 or 32, 1, 4] words at odd widths) decode plainly."""
    if not asm or words.size < 2 * 32 * 4:
        return [e2m1_bits((words >> (4 * q)) & 15) * scale for q in range(8)]  # (the shift's sign bits: past & 15)
    from jax.experimental.pallas import triton as plgpu  # (Pallas' lowering keeps one result of an asm block)
    scale, out = jnp.broadcast_to(scale, words.shape), jax.ShapeDtypeStruct(words.shape, jnp.bfloat16)
    return [plgpu.elementwise_inline_asm(ptx, args=[words, scale], constraints="=r,r,r,f,f", pack=2,
                                         result_shape_dtypes=[out])[0] for ptx in _E2M1_PTX]


def _fp4_kernel(x_ref, w_ref, s_ref, ids_ref, o_ref, *, steps: int, bn: int, sub: int, g: int, asm: bool):
    """Row i, columns j*bn .. of its expert's packed matrix, viewed [N, K/32, 4] words (a scale block of 4 words a
    row), over split s of the contraction: a load is g scale blocks of bn columns ([bn, g, 4], 16 g bytes contiguous
    a column) and their scales [bn, g]; each of a word's 8 nibbles decoded times its scale (`e2m1_planes`: the
    weights exactly as dequantised, 6 * 2^127 is inf there too), times its x, summed in fp32; sub loads a loop
    step."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e, cols = ids_ref[i], pl.ds(j * bn, bn)

    def body(t, acc):
        for u in range(sub):
            kb = ((s * steps + t) * sub + u) * g  # the first scale block
            words = w_ref[e, cols, pl.ds(kb, g), :]  # [bn, g, 4] int32
            scale = qdq.e8m0_to_f32(s_ref[e, cols, pl.ds(kb, g)])[:, :, None]  # [bn, g, 1]
            for q, wq in enumerate(e2m1_planes(words, scale, asm)):
                xq = x_ref[q, i, pl.ds(kb, g), :].astype(F32)[None]  # [1, g, 4]
                acc = acc + wq.astype(F32) * xq
        return acc

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn, g, 4), F32))
    o_ref[...] = jnp.sum(jnp.sum(acc, axis=2), axis=1)


def _fp8_kernel(x_ref, w_ref, s_ref, ids_ref, o_ref, *, steps: int, bn: int, bk: int, block: int):
    """Row i, columns j*bn .. of its expert's e4m3 matrix [N, K] (inside one row of scale blocks), over split s
    of the contraction in steps of bk values (inside one scale block): one E8M0 scale per step."""
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    e = ids_ref[i]

    row = jax.lax.div(j, block // bn)  # of the scale grid (bn and bk divide the block)

    def body(t, acc):
        step = s * steps + t
        k0 = step * bk
        xb = x_ref[i, pl.ds(k0, bk)].astype(F32)
        wb = w_ref[e, pl.ds(j * bn, bn), pl.ds(k0, bk)].astype(F32)
        wb = wb * qdq.e8m0_to_f32(s_ref[e, row, jax.lax.div(step, block // bk)])  # exactly as dequantised
        return acc + jnp.sum(wb * xb[None, :], axis=1)

    o_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros((bn,), F32))
