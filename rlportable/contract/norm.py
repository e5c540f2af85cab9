"""RMSNorm (and the per-head QK-norm): reference of contracts/norm.toml.

For a float32 row x of length H with weight w and epsilon eps:
  q, e  = fixed-point encoding of x with B = 23 bits (contracts/fixedpoint.toml)
  ss    = sum_i q_i^2                         exact int64 (H <= 2^18)
  mean  = float64(ss) * 2^(2(e-(B-2))) / H    (RNE conversion, exact scaling, IEEE division)
  r     = 1 / sqrt(mean + eps)                (IEEE float64 add, sqrt, divide)
  y_i   = RNE_f32((float64(x_i) * r) * float64(w_i))
A non-finite row gives the canonical NaN everywhere, and so does any other NaN result (a NaN
or infinite weight, eps <= 0): NaN payloads are not portable between vendors.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp

NORM_BITS = 23
MAX_ROW = 2**18


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
