"""RMSNorm (and the per-head QK-norm): reference of contracts/norm.toml.

For a float32 row x of length H with weight w and epsilon eps:
  q, e  = fixed-point encoding of x with B = 23 bits (contracts/fixedpoint.toml)
  ss    = sum_i q_i^2                         exact int64 (H <= 2^18)
  mean  = float64(ss) * 2^(2(e-(B-2))) / H    (RNE conversion, exact scaling, IEEE division)
  r     = 1 / sqrt(mean + eps)                (IEEE float64 add, sqrt, divide)
  y_i   = RNE_f32((float64(x_i) * r) * float64(w_i))
A non-finite row gives the canonical NaN everywhere, and so does any other NaN result (a NaN
or infinite weight, eps <= 0): NaN payloads are not portable between vendors.
rmsnorm_backward is the gradient (dx, dweight) at the forward's r, with exact fixed-point sums over
the row (44 bits) and over rows (38 bits) of defined float64 terms (see its docstring).
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.contract.logprob import quantize_f64_rows

NORM_BITS = 23
MAX_ROW = 2**18
#: add_rmsnorm's optional encoding of y (contracts/norm.toml): fixedpoint at gemm.DEFAULT_BITS_A, ascending
ENCODE_BITS = fp.ACTIVATION_BITS


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def rms_scale(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(r float64 [rows], finite bool [rows]) for float32 rows x [rows, H]."""
    q, e = fp.quantize_rows(x, NORM_BITS)
    finite = e != fp.NONFINITE_EXPONENT
    ss = (q * q).sum(axis=1)
    shift = 2 * np.where(finite, fp.scale_exponent(e, NORM_BITS), 0)
    mean = ss.astype(np.float64) * fp.pow2_f64(shift) / np.float64(x.shape[1])
    r = 1.0 / np.sqrt(mean + np.float64(eps))
    return r, finite


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """float32 [rows, H] -> float32 [rows, H]."""
    x = np.asarray(x, dtype=np.float32)
    r, finite = rms_scale(x, eps)
    y = ((x.astype(np.float64) * r[:, None]) * weight.astype(np.float64)[None, :]).astype(np.float32)
    y[~finite] = fp.CANONICAL_NAN
    y[np.isnan(y)] = fp.CANONICAL_NAN
    return y


# ---- backward (contracts/norm.toml op "rmsnorm_backward")

GRAD_SUM_BITS = 44  # s = sum_j dy_j w_j x_j: H <= 2^18 terms of |q| <= 2^43, |sum| <= 2^61
WEIGHT_GRAD_BITS = 38  # dweight: rows <= 2^24 terms of |q| <= 2^37, |sum| <= 2^61
MAX_GRAD_ROWS = 2**24


@np.errstate(all="ignore")  # inf * 0 and NaN are defined results, not warnings
def add_rmsnorm(a: np.ndarray, b: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(s, y): s = residual.add(a, b) (float32 sum, NaN canonical), y = rmsnorm(s, weight): by definition
    the two ops in turn. The op's optional encoded output (contracts/norm.toml) is by definition the
    gemm's activation encoding of this y: ops/fixedpoint.py encode_rows_reference(y, ENCODE_BITS)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = (np.asarray(a, np.float32) + np.asarray(b, np.float32)).astype(np.float32)
    total[np.isnan(total)] = fp.CANONICAL_NAN
    return total, rmsnorm(total, weight, eps)


def rmsnorm_heads_rope(q: np.ndarray, k: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray, eps: float,
                       cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3's QK-norm then RoPE: rope.apply(rmsnorm of each head row) for q [T, hq, D] and k [T, hk, D];
    cos, sin [T, D / 2] are the tables' rows at the tokens' positions. By definition the two ops in turn."""
    from rlportable.contract import rope

    return tuple(rope.apply(rmsnorm(x.reshape(-1, x.shape[2]), w, eps).reshape(x.shape), cos, sin)
                 for x, w in ((q, q_weight), (k, k_weight)))


def fixed_point_sums(terms: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(Q int64 [rows], e int64 [rows], finite bool [rows]): the exact sum of each float64 row's
    fixed-point integers, logprob.quantize_f64_rows's encoding (e = ilogb of the largest |term|,
    0 for a zero row; q = RNE(term * 2^(bits-2-e)) in two exact power-of-two steps). A row with a
    NaN or infinite term is not finite; its Q and e are 0."""
    finite = np.isfinite(terms).all(axis=1)
    q, e = quantize_f64_rows(np.where(finite[:, None], terms, 0.0), bits)
    return q.sum(axis=1), e, finite


def _fixed_point_value(total: np.ndarray, e: np.ndarray, bits: int) -> np.ndarray:
    """float64 odd(Q) * 2^(e-(bits-2)): round to odd at 53 bits, then an exact scaling."""
    return fp.round_to_odd_f64(total) * fp.pow2_f64(e - (bits - 2))


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def rmsnorm_backward(x: np.ndarray, weight: np.ndarray, eps: float, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dx float32 [rows, H], dweight float32 [H]) of y = rmsnorm(x, weight, eps) for the upstream dy.

    Per row, with r the forward's rms_scale and g_j = dy_j w_j (exact in float64):
      t_j   = RNE_f64(g_j * x_j)                    one float64 rounding
      s     = odd(Q) * 2^(e-42),  (Q, e) = fixed_point_sums(t, 44)
      c     = (((r * r) * r) * s) / H               IEEE float64, left to right
      dx_j  = RNE_f32((g_j * r) - (x_j * c))        float64, one conversion
    Per column, over rows: u = RNE_f64(RNE_f64(dy x) * r), r = NaN on a non-finite x row;
      dweight = RNE_f32(odd(Q) * 2^(e-36)),  (Q, e) = fixed_point_sums(u over rows, 38).
    A non-finite x row, or a row with a non-finite t, gives the canonical NaN in all of dx's
    row; a column with a non-finite u gives the canonical NaN in dweight; so does any NaN result.
    For finite float32 inputs every nonzero t lies in [2^-447, 2^384) and every nonzero u in
    [2^-810, 2^436) (r <= 2^179 on a row with a nonzero x, r >= 2^-512 for any eps <= DBL_MAX),
    so no term is subnormal and every power of two above is a normal float64.
    """
    x = np.asarray(x, dtype=np.float32)
    dy = np.asarray(dy, dtype=np.float32)
    rows, h = x.shape
    if rows == 0 or h == 0:  # empty sums are +0
        return np.empty((rows, h), dtype=np.float32), np.zeros(h, dtype=np.float32)
    r, finite_x = rms_scale(x, eps)
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    g = dy64 * weight.astype(np.float64)[None, :]
    total, e, finite_t = fixed_point_sums(g * x64, GRAD_SUM_BITS)
    s = _fixed_point_value(total, e, GRAD_SUM_BITS)
    c = (((r * r) * r) * s) / np.float64(h)
    dx = ((g * r[:, None]) - (x64 * c[:, None])).astype(np.float32)
    dx[~(finite_x & finite_t)] = fp.CANONICAL_NAN
    dx[np.isnan(dx)] = fp.CANONICAL_NAN
    r_rows = np.where(finite_x, r, np.nan)
    u = (dy64 * x64) * r_rows[:, None]
    total_w, e_w, finite_w = fixed_point_sums(np.ascontiguousarray(u.T), WEIGHT_GRAD_BITS)
    dweight = fp.round_scaled(total_w, e_w - (WEIGHT_GRAD_BITS - 2))
    dweight[~finite_w] = fp.CANONICAL_NAN
    dweight[np.isnan(dweight)] = fp.CANONICAL_NAN
    return dx, dweight
