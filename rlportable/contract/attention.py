"""Causal GQA attention: reference of contracts/attention.toml.

Every reduction is an exact integer sum, and a query's result depends only on
its own row and the keys and values at positions 0..t of its sequence, so
packed prefill, chunked prefill and paged decode give the same bits.

For query row q (position t, head h, kv head g = h // (Hq / Hkv)) and the keys
and values k_j, v_j at positions j = 0..t (rows of D values, kv head g):
  qq, eq = encode(q, 23 bits); qk_j, ek_j = encode(k_j, 15); qv_j, ev_j = encode(v_j, 15)
  S_j    = sum_d qq_d qk_jd                                     exact
  s_j    = RNE_f32((float64(S_j) * 2^(eq + ek_j - 21 - 13)) * (1 / sqrt(float64(D))))
  m      = max_j s_j                                            exact
  p_j    = exp_f32(s_j - m)                                     float32 subtraction, contract exp
  L      = sum_j RNE(p_j * 2^21)                                exact
  E      = max_j ev_j                                           exact
  N_d    = sum_j RNE(p_j * 2^(ev_j - E + 21)) * qv_jd           exact
  o_d    = RNE_f32((float64(N_d) * 2^(E - 13)) / float64(L))   IEEE float64 divide, then one conversion
A non-finite q row, or a non-finite k_j or v_j row among j <= t, gives the canonical NaN.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.contract.elementwise import exp_f32

Q_BITS, K_BITS, V_BITS, P_BITS = 23, 15, 15, 23
MAX_KEYS = 2**17  # keeps N_d below 2^53 (2^22 * 2^14 * 2^17)


def encode_heads(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [T, H, D] -> (integers as float64 [T, H, D], exponents int64 [T, H]), one row per (token, head)."""
    rows, heads, dim = x.shape
    q, e = fp.quantize_rows(x.reshape(rows * heads, dim), bits)
    return q.reshape(rows, heads, dim).astype(np.float64), e.reshape(rows, heads).astype(np.int64)


_encode_heads = encode_heads


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray) -> np.ndarray:
    """One sequence: q float32 [Tq, Hq, D] at q_positions [Tq]; k, v float32 [L, Hkv, D] for
    positions 0..L-1 (L > max position). Returns float32 [Tq, Hq, D]."""
    tq = q.shape[0]
    length = k.shape[0]
    positions = np.asarray(q_positions, dtype=np.int64)
    _check_lengths(tq, length, positions)
    qq, eq = encode_heads(q, Q_BITS)
    qk, ek = encode_heads(k, K_BITS)
    qv, ev = encode_heads(v, V_BITS)
    return attention_encoded(qq, eq, qk, ek, qv, ev, positions)


def _check_lengths(tq: int, length: int, positions: np.ndarray) -> None:
    if length > MAX_KEYS:
        raise ValueError(f"attention: {length} keys exceed the contract's limit {MAX_KEYS}")
    if tq and positions.max() >= length:
        raise ValueError("attention: a query position has no key at its own position")


def attention_encoded(qq, eq, qk, ek, qv, ev, q_positions) -> np.ndarray:
    """attention() from rows already encoded (how the KV cache stores them): qq [Tq, Hq, D]
    23-bit integers with exponents eq [Tq, Hq]; qk, qv [L, Hkv, D] 15-bit integers with
    exponents ek, ev [L, Hkv] (fixedpoint.quantize_rows, sentinel for non-finite rows)."""
    qq = np.asarray(qq, dtype=np.float64)
    qk = np.asarray(qk, dtype=np.float64)
    qv = np.asarray(qv, dtype=np.float64)
    eq, ek, ev = (np.asarray(e, dtype=np.int64) for e in (eq, ek, ev))
    tq, hq, dim = qq.shape
    length, hkv, _ = qk.shape
    positions = np.asarray(q_positions, dtype=np.int64)
    _check_lengths(tq, length, positions)
    allowed = np.arange(length)[None, :] <= positions[:, None]  # [Tq, L]
    scale = 1.0 / np.sqrt(np.float64(dim))
    out = np.empty((tq, hq, dim), dtype=np.float32)
    group = hq // hkv
    with np.errstate(over="ignore"):  # scores beyond FLT_MAX become +-inf (contract: nan_inf)
        for h in range(hq):
            g = h // group
            out[:, h, :] = _one_head(qq[:, h], eq[:, h], qk[:, g], ek[:, g], qv[:, g], ev[:, g], allowed, scale)
    return out


def _one_head(qq, eq, qk, ek, qv, ev, allowed, scale) -> np.ndarray:
    bad_q = eq == fp.NONFINITE_EXPONENT
    bad_kv = (ek == fp.NONFINITE_EXPONENT) | (ev == fp.NONFINITE_EXPONENT)
    eq_s = np.where(bad_q, 0, eq)
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)
    sums = qq @ qk.T  # exact: every partial sum < 2^53
    shift = eq_s[:, None] + ek_s[None, :] - (Q_BITS - 2) - (K_BITS - 2)
    scores = ((sums * fp.pow2_f64(shift)) * scale).astype(np.float32)
    scores = np.where(allowed, scores, np.float32(-np.inf))
    m = scores.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.where(allowed, exp_f32(scores - m), np.float32(0)).astype(np.float64)
    total = np.rint(p * 2.0 ** (P_BITS - 2)).sum(axis=1)  # exact integer sum (< 2^53)
    e_max = np.where(allowed, ev_s[None, :], np.iinfo(np.int64).min).max(axis=1)
    weights = np.rint(p * fp.pow2_f64(np.where(allowed, ev_s[None, :] - e_max[:, None] + P_BITS - 2, 0)))
    weights = np.where(allowed, weights, 0.0)
    numerator = weights @ qv  # exact
    out = ((numerator * fp.pow2_f64(e_max - (V_BITS - 2))[:, None]) / total[:, None]).astype(np.float32)
    poisoned = bad_q | (allowed & bad_kv[None, :]).any(axis=1)
    out[poisoned] = fp.CANONICAL_NAN
    return out
