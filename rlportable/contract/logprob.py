"""Log-probabilities (and entropy) of logits at a temperature: reference of contracts/logprob.toml.

For one row of logits z [V] (float32, from the exact gemm) and temperature T:
  a_v  = RNE_f32(float64(z_v) / float64(T))          (T = 1 gives z exactly)
  m    = max_v a_v                                     exact
  p_v  = exp_f32(a_v - m)                              float32 subtraction, contract exp
  S    = sum_v RNE(p_v * 2^36)                         exact int64 (V <= 2^25)
  ls   = log_f32(RNE_f32(S * 2^-36))                   one rounding, contract log
  logp(y) = RNE_f32(a_y - m) - ls                      two float32 subtractions
  entropy = ls - RNE_f32(W / S') where W = sum_v p_v (a_v - m) as an exact fixed-point sum
            of the exact float64 products (38 bits relative to the largest), S' = S * 2^-36,
            the quotient of their round-to-odd float64 values rounded once to float32.
            A term with p_v = 0 contributes exactly 0 (also where a_v - m = -inf).
A row with a NaN (or T that makes a_v non-finite) gives the canonical NaN. Every sum is
exact, so the vocabulary may be processed in any number of chunks: the bits do not change.

The backward (logprobs_backward) is the gradient of g * logp with respect to the logits z,
from the same a_v, m, p_v and S:
  S'   = odd(S) * 2^-36                                float64 (round to odd, exact scaling)
  q_v  = float64(p_v) / S'                             IEEE float64 division, in [0, 1]
  c_v  = -q_v for v != y, 1 - q_y at the target y      a sign flip (exact; -0 where q_v = 0), a subtraction
  dz_v = RNE_f32((float64(g) / float64(T)) * c_v)      float64 product, one conversion
A row with g = +-0 gives +0 everywhere (masked tokens; even a NaN row); otherwise a non-finite
g or a forward NaN row gives the canonical NaN everywhere.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.contract.elementwise import exp_f32, log_f32

SUM_BITS = 38
MAX_VOCAB = 2**25


def _shifted(logits: np.ndarray, temperature: float):
    a = (logits.astype(np.float64) / np.float64(temperature)).astype(np.float32)
    m = a.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        d = (a - m).astype(np.float32)
    return a, m, d


def _log_sum(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S int64, ls float32) for p float32 [rows, V] in [0, 1]."""
    s = np.rint(p.astype(np.float64) * 2.0 ** (SUM_BITS - 2)).astype(np.int64).sum(axis=1)
    s32 = fp.round_scaled(s, np.full(s.shape, -(SUM_BITS - 2)))
    return s, log_f32(s32)


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def logprobs(logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float32 [rows] log-probability of targets [rows] under softmax(logits / T)."""
    a, m, d = _shifted(np.asarray(logits, dtype=np.float32), temperature)
    p = exp_f32(d)
    _, ls = _log_sum(p)
    rows = np.arange(a.shape[0])
    out = (d[rows, targets] - ls).astype(np.float32)
    out[~np.isfinite(m[:, 0]) | np.isnan(a).any(axis=1)] = fp.CANONICAL_NAN
    return out


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def entropy(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float32 [rows] entropy of softmax(logits / T)."""
    a, m, d = _shifted(np.asarray(logits, dtype=np.float32), temperature)
    p = exp_f32(d)
    s, ls = _log_sum(p)
    with np.errstate(invalid="ignore"):
        # exact products, <= 0; p = 0 gives 0 even where d = -inf (0 * -inf would be NaN)
        w = np.where(p == 0, 0.0, p.astype(np.float64) * d.astype(np.float64))
    qw, ew = quantize_f64_rows(w, SUM_BITS)
    w_sum = fp.round_to_odd_f64(qw.sum(axis=1)) * fp.pow2_f64(ew - (SUM_BITS - 2))
    s_val = fp.round_to_odd_f64(s) * fp.pow2_f64(np.full(s.shape, -(SUM_BITS - 2)))
    mean = (w_sum / s_val).astype(np.float32)
    out = (ls - mean).astype(np.float32)
    out[~np.isfinite(m[:, 0]) | np.isnan(a).any(axis=1)] = fp.CANONICAL_NAN
    return out


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def logprobs_backward(logits: np.ndarray, targets: np.ndarray, temperature: float, grad: np.ndarray) -> np.ndarray:
    """float32 [rows, V]: d(grad[r] * logp[r]) / d logits[r, v], the softmax from the forward's own p_v and S.

    Rows are independent, so any split of the rows into chunks gives the same bits."""
    a, m, d = _shifted(np.asarray(logits, dtype=np.float32), temperature)
    grad = np.asarray(grad, dtype=np.float32)
    p = exp_f32(d)
    s, _ = _log_sum(p)
    s_val = fp.round_to_odd_f64(s) * fp.pow2_f64(np.full(s.shape, -(SUM_BITS - 2)))
    rows = np.arange(a.shape[0])
    c = -(p.astype(np.float64) / s_val[:, None])
    c[rows, targets] += 1.0  # (-q) + 1 is the IEEE subtraction 1 - q
    out = ((grad.astype(np.float64) / np.float64(temperature))[:, None] * c).astype(np.float32)
    out[~np.isfinite(m[:, 0]) | np.isnan(a).any(axis=1) | ~np.isfinite(grad)] = fp.CANONICAL_NAN
    out[grad == 0] = 0.0  # a masked token's row: +0, whatever its logits
    return out


def quantize_f64_rows(w: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-point encoding of finite float64 rows: e = ilogb(max |w|) (0 for zero rows, whose
    q are all 0), q = RNE(w * 2^(bits-2-e)); exact since the scaling is a power of two."""
    largest = np.abs(w).max(axis=1)
    e = np.where(largest > 0, np.frexp(largest)[1] - 1, 0).astype(np.int64)
    shift = bits - 2 - e
    # a power of two beyond float64's range is applied in two exact steps
    half = shift // 2
    q = np.rint((w * fp.pow2_f64(half)[:, None]) * fp.pow2_f64(shift - half)[:, None]).astype(np.int64)
    return q, e
