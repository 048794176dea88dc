"""Activations times weights, kept a GEMM when the activations are one row (batch-1 decode).

XLA's GPU simplifier turns a product whose left side is a single row into a multiply-reduce fusion when
(1 + columns) x depth is under 1e7 (`ShouldStrengthReduceDotToReduce`: too small to be worth a GEMM), and layout
assignment then wants the weight transposed, a copy it makes on every step, hoisted out of the layer loop for the
whole stack: at Llama-8B's widths the k and v projections (4096 x 1024), 0.27 ms of a 4.9 ms batch-1 step on an
H200 (BENCHMARKS.md); at a width of 1024 every matrix of the model. Two rows keep it a GEMM reading the weight in
place: the row is stacked on a row of zeros, and the product's first row kept, each behind an optimization barrier
(the simplifier cannot fold the zeros or move the row's slice into the product through one).
"""
import math

import jax
import jax.numpy as jnp

XLA_SMALL_DOT = 10_000_000  # XLA's (1 + columns) * depth below which one row is strength-reduced (0: never pad)


def dot(x, w, axes: int = 1):
    """jnp.tensordot(x, w, axes): x's last `axes` dims against w's first, in x's dtype rules; one row of x (every
    leading dim 1) against a small weight goes through two rows (module doc)."""
    depth, cols = math.prod(x.shape[x.ndim - axes:]), math.prod(w.shape[axes:])
    if math.prod(x.shape[:x.ndim - axes]) != 1 or (1 + cols) * depth >= XLA_SMALL_DOT:
        return jnp.tensordot(x, w, axes=axes)
    two = jax.lax.optimization_barrier(jnp.stack([x, jnp.zeros_like(x)]))
    return jax.lax.optimization_barrier(jnp.tensordot(two, w, axes=axes))[0]
