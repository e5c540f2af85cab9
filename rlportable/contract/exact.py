"""Exact integer sums and products of fixed-point rows: the NumPy reference of gemm and rowsum.

Integer sums are exact in any order, so these functions define the value every
backend must return, whatever its tiling, split-K, warp width or BLAS.

A gemm is two steps: the exact integer sums S = qa @ qw.T (exact_int_matmul) and
one rounding (round_sums). Tensor parallelism runs them apart: each rank sums
its K-shard with the row exponents all-reduced by MAX, the int64 sums are
all-reduced by SUM, and round_sums of the total is bitwise the unsharded gemm.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp

#: the K of one exact product in the trainer's input gradients (dX = dY W, K = N): longer K is cut into
#: chunks of this many columns, a fixed power of two below gemm_max_k(23, 15) = 65535, so the chunking
#: never depends on data
GEMM_K_CHUNK = 32768
#: the bits of X^T, the second operand of a weight gradient dW = dY^T X (dY^T's rows take the activation
#: default, 23)
WEIGHT_GRAD_BITS = 15


def gemm_max_k(bits_a: int, bits_w: int) -> int:
    """Largest K the contract accepts.

    Two bounds: every dot product stays below 2^53 (exact in float64 and int64),
    and every shift group of int8 digit products, min(n_a, n_w) pairs of at most
    2^14 each per k, stays inside int32 (what tensor cores accumulate in).
    """
    float64_bound = 2 ** (53 - (bits_a - 1) - (bits_w - 1))
    pairs = min(fp.slice_count(bits_a), fp.slice_count(bits_w))
    int32_bound = (2**31 - 1) // (pairs * 2**14)
    return min(float64_bound, int32_bound)


def exact_int_matmul(qa: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """S = qa @ qw.T exactly, as int64.

    Every partial sum is bounded by sum |qa||qw| < 2^53 (gemm_max_k), so a float64
    BLAS product of the integer-valued arrays is exact whatever its summation order
    or use of fma.
    """
    return (qa.astype(np.float64, copy=False) @ qw.astype(np.float64, copy=False).T).astype(np.int64)


def gemm(x: np.ndarray, w: np.ndarray, bits_a: int, bits_w: int) -> np.ndarray:
    """The gemm contract: Y = X @ W.T with exact accumulation and one rounding to float32."""
    qa, ea = fp.quantize_rows(x, bits_a)
    qw, ew = fp.quantize_rows(w, bits_w)
    return gemm_from_encoded(qa, ea, bits_a, qw, ew, bits_w)


def gemm_from_encoded(qa, ea, bits_a, qw, ew, bits_w) -> np.ndarray:
    return round_sums(exact_int_matmul(qa, qw), ea, bits_a, ew, bits_w)


def round_sums(sums, ea, bits_a, ew, bits_w) -> np.ndarray:
    """The one rounding of every gemm: Y[m, n] = RNE_f32(S[m, n] * 2^(ea + ew - (B_a-2) - (B_w-2))).

    S int64 with |S| < 2^62 (a whole row's exact sum, or the sum of its K-shards'
    sums); the canonical NaN where ea[m] or ew[n] is the sentinel; exact zero is +0.
    """
    sums = np.asarray(sums, dtype=np.int64)
    ea, ew = np.asarray(ea), np.asarray(ew)
    finite_a = ea != fp.NONFINITE_EXPONENT
    finite_w = ew != fp.NONFINITE_EXPONENT
    scale = (
        np.where(finite_a, fp.scale_exponent(ea, bits_a), 0)[:, None]
        + np.where(finite_w, fp.scale_exponent(ew, bits_w), 0)[None, :]
    )
    y = fp.round_scaled(sums, scale)
    y[~finite_a, :] = fp.CANONICAL_NAN
    y[:, ~finite_w] = fp.CANONICAL_NAN
    return y


def rowsum(x: np.ndarray, bits: int) -> np.ndarray:
    """The rowsum contract: exact sum of each row's fixed-point integers, rounded once.

    Non-finite rows follow IEEE addition: any NaN, or both infinities, give the
    canonical NaN; otherwise an infinity gives that infinity.
    """
    x = np.asarray(x, dtype=np.float32)
    q, e = fp.quantize_rows(x, bits)
    finite = e != fp.NONFINITE_EXPONENT
    sums = q.sum(axis=1)
    y = fp.round_scaled(sums, np.where(finite, fp.scale_exponent(e, bits), 0))
    if not finite.all():
        bad = ~finite
        rows = x[bad]
        has_nan = np.isnan(rows).any(axis=1)
        has_pos = (rows == np.inf).any(axis=1)
        has_neg = (rows == -np.inf).any(axis=1)
        out = np.where(has_pos, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32)
        out[has_nan | (has_pos & has_neg)] = fp.CANONICAL_NAN
        y[bad] = out
    return y


def rowsum_max_k(bits: int) -> int:
    """Largest row length whose exact sum stays below 2^62 (int64, and round_to_odd_f64's range)."""
    return 2 ** (62 - (bits - 1))
