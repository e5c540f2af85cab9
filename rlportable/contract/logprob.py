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

Vocabulary-parallel log-probs (tensor parallelism; shard_max_keys, shard_sums, shard_finish): a
rank holding the columns [start, start + Vr) gives the key of its maximum (NAN_KEY on a NaN),
then, with m from the MAX of the keys, its part of S and the target's d_y = RNE_f32(a_y - m) as
int64 (0 if another rank owns the target); the SUM of those over the ranks goes through the same
final formula as logprobs (shared helpers), so any split of the vocabulary gives logprobs' bits.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.contract.elementwise import exp_f32, log_f32

SUM_BITS = 38
MAX_VOCAB = 2**25


def _scaled(logits: np.ndarray, temperature: float) -> np.ndarray:
    """a_v = RNE_f32(float64(z_v) / float64(T)), float32 [rows, V]."""
    return (np.asarray(logits, dtype=np.float32).astype(np.float64) / np.float64(temperature)).astype(np.float32)


def _shifted(logits: np.ndarray, temperature: float):
    a = _scaled(logits, temperature)
    m = a.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        d = (a - m).astype(np.float32)
    return a, m, d


def _sum_terms(p: np.ndarray) -> np.ndarray:
    """int64 [rows, V]: the exact terms RNE(p_v * 2^36) of S, for p float32 in [0, 1]."""
    return np.rint(p.astype(np.float64) * 2.0 ** (SUM_BITS - 2)).astype(np.int64)


def _log_of_sum(s: np.ndarray) -> np.ndarray:
    """ls = log_f32(RNE_f32(S * 2^-36)), float32 [rows], for S int64 [rows]."""
    return log_f32(fp.round_scaled(s, np.full(s.shape, -(SUM_BITS - 2))))


def _log_sum(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S int64, ls float32) for p float32 [rows, V] in [0, 1]."""
    s = _sum_terms(p).sum(axis=1)
    return s, _log_of_sum(s)


def _logp_value(d_target: np.ndarray, ls: np.ndarray, undefined: np.ndarray) -> np.ndarray:
    """logp = RNE_f32(a_y - m) - ls (float32), the canonical NaN where the row is undefined."""
    out = (np.asarray(d_target, dtype=np.float32) - ls).astype(np.float32)
    out[undefined] = fp.CANONICAL_NAN
    return out


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def logprobs(logits: np.ndarray, targets: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """float32 [rows] log-probability of targets [rows] under softmax(logits / T)."""
    a, m, d = _shifted(np.asarray(logits, dtype=np.float32), temperature)
    p = exp_f32(d)
    _, ls = _log_sum(p)
    rows = np.arange(a.shape[0])
    return _logp_value(d[rows, targets], ls, ~np.isfinite(m[:, 0]) | np.isnan(a).any(axis=1))


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


# --- The vocabulary-parallel log-prob (tensor parallelism): one rank holds the columns
# [start, start + Vr) of every row. Three per-rank steps around two exact collectives give
# logprobs' bits on the whole row: MAX of shard_max_keys over the ranks, SUM of shard_sums
# over the ranks, then shard_finish. Both collectives are order-free (an integer max, an
# int64 sum with one owner for the target's column), so any rank count or split gives the bits.

NAN_KEY = 0xFFFFFFFF  # the largest key: a row with a NaN anywhere stays NaN under MAX


def order_key(a: np.ndarray) -> np.ndarray:
    """uint32 order-preserving key of non-NaN float32 a (a < b <=> key(a) < key(b); -0 < +0)."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32)
    return np.where(bits & np.uint32(0x80000000), ~bits, bits | np.uint32(0x80000000)).astype(np.uint32)


def from_key(key: np.ndarray) -> np.ndarray:
    """float32 with the given order key (the inverse of order_key); NAN_KEY gives a NaN."""
    key = np.asarray(key, dtype=np.uint32)
    return np.where(key & np.uint32(0x80000000), key & np.uint32(0x7FFFFFFF), ~key).astype(np.uint32).view(np.float32)


@np.errstate(all="ignore")  # overflow to inf is a defined result, not a warning
def shard_max_keys(logits_shard: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """uint32 [rows]: order_key(max_v a_v) over the shard's columns, NAN_KEY if any a_v is NaN."""
    a = _scaled(logits_shard, temperature)
    keys = order_key(np.where(np.isnan(a), np.float32(-np.inf), a)).max(axis=1, initial=0)
    return np.where(np.isnan(a).any(axis=1), np.uint32(NAN_KEY), keys).astype(np.uint32)


def _undefined(keys: np.ndarray) -> np.ndarray:
    """Rows whose global maximum m = from_key(key) is not finite (NAN_KEY, +inf, -inf): logprobs' NaN rows."""
    return ~np.isfinite(from_key(keys))


@np.errstate(all="ignore")  # overflow to inf and NaN are defined results, not warnings
def shard_sums(logits_shard: np.ndarray, keys: np.ndarray, targets: np.ndarray, vocab_start: int,
               temperature: float = 1.0) -> np.ndarray:
    """int64 [rows, 2]: (this shard's part of S, the bits of d_y = RNE_f32(a_y - m) if it owns the target, else 0).

    m = from_key(keys) is the whole row's maximum (the MAX of every shard's shard_max_keys); a row
    whose m is not finite writes (0, 0)."""
    a = _scaled(logits_shard, temperature)
    m = from_key(keys)[:, None]
    undefined = _undefined(keys)
    # an undefined row is computed against m = 0 (its m may be NaN or inf) and zeroed below
    d = (a - np.where(undefined[:, None], np.float32(0), m)).astype(np.float32)
    out = np.zeros((a.shape[0], 2), dtype=np.int64)
    out[:, 0] = _sum_terms(exp_f32(d)).sum(axis=1)
    local = np.asarray(targets).astype(np.int64) - int(vocab_start)
    owned = (local >= 0) & (local < a.shape[1])
    rows = np.flatnonzero(owned)
    out[rows, 1] = d[rows, local[rows]].view(np.uint32).astype(np.int64)  # zero-extended bits
    out[undefined] = 0
    return out


def shard_finish(sums: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """float32 [rows]: logprobs' value from the SUM over the shards of shard_sums and the MAX of the keys."""
    sums = np.asarray(sums, dtype=np.int64)
    d_target = (sums[:, 1] & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    with np.errstate(all="ignore"):
        return _logp_value(d_target, _log_of_sum(sums[:, 0]), _undefined(keys))
