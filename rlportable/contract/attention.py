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

attention_backward (op "attention_backward") differentiates these values: with do the gradient
of o, P_j = p_j 2^21 / L, dP_j = do . v_j and delta = do . o (exact fixed-point sums),
dS_j = P_j (dP_j - delta) / sqrt(D) in float64; dq, dk and dv are exact weighted sums of encoded
rows (coefficients quantized to 32 bits below their largest, int64 products summed exactly in a
two-word form, one rounding): see the comment above attention_backward.

The per-sequence, per-head functions are the definition; attention_packed_batched,
attention_encoded_batched and attention_packed_backward_batched compute the same bits for many
padded sequences and all heads per NumPy call (the cpu backend's path; see "batched evaluation").
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


def _softmax_weights(qq, eq_s, qk, ek_s, allowed, scale):
    """(p float64 [Tq, L], m float32 [Tq, 1], L float64 [Tq]) of one head: p_j = exp_f32(s_j - m)
    (0 outside `allowed`), m = max_j s_j, L = sum_j RNE(p_j 2^21). eq_s, ek_s: finite exponents."""
    sums = qq @ qk.T  # exact: every partial sum < 2^53
    shift = eq_s[:, None] + ek_s[None, :] - (Q_BITS - 2) - (K_BITS - 2)
    scores = ((sums * fp.pow2_f64(shift)) * scale).astype(np.float32)
    scores = np.where(allowed, scores, np.float32(-np.inf))
    m = scores.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.where(allowed, exp_f32(scores - m), np.float32(0)).astype(np.float64)
    total = np.rint(p * 2.0 ** (P_BITS - 2)).sum(axis=1)  # exact integer sum (< 2^53)
    return p, m, total


def _one_head(qq, eq, qk, ek, qv, ev, allowed, scale) -> np.ndarray:
    bad_q = eq == fp.NONFINITE_EXPONENT
    bad_kv = (ek == fp.NONFINITE_EXPONENT) | (ev == fp.NONFINITE_EXPONENT)
    eq_s = np.where(bad_q, 0, eq)
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)
    p, _, total = _softmax_weights(qq, eq_s, qk, ek_s, allowed, scale)
    e_max = np.where(allowed, ev_s[None, :], np.iinfo(np.int64).min).max(axis=1)
    weights = np.rint(p * fp.pow2_f64(np.where(allowed, ev_s[None, :] - e_max[:, None] + P_BITS - 2, 0)))
    weights = np.where(allowed, weights, 0.0)
    numerator = weights @ qv  # exact
    out = ((numerator * fp.pow2_f64(e_max - (V_BITS - 2))[:, None]) / total[:, None]).astype(np.float32)
    poisoned = bad_q | (allowed & bad_kv[None, :]).any(axis=1)
    out[poisoned] = fp.CANONICAL_NAN
    return out


# ---- backward (contracts/attention.toml, op "attention_backward")
#
# For query row t (head h, kv head g) and key j <= t, with the forward's values s_j, m, p_j, L
# (the same bits as above) and o the forward's float32 output:
#   qdo, edo = encode(do, 23 bits)
#   P_j     = (float64(p_j) * 2^21) / float64(L)                          IEEE float64 divide
#   dP_j    = float64(sum_d qdo_d qv_jd) * 2^(edo + ev_j - 34)            exact
#   delta   = do . o from the exact products qdo_d o_d, summed at 53 bits below the largest (delta_of)
#   dS_j    = (P_j * (dP_j - delta)) * c                                  three float64 roundings, c = 1/sqrt(D)
# and the three gradients are block-scaled weighted sums of encoded rows (block_weighted_sum):
#   dq_t = sum_{j<=t} dS_j k_j         coefficients dS_j 2^ek_j,  rows qk_j (15 bits); blocks: 64 keys
#   dk_j = sum_{t>=j, h in g} dS_tj q_t    coefficients dS_tj 2^eq_t, rows qq_t (23 bits); blocks: 64 queries x 1 head
#   dv_j = sum_{t>=j, h in g} P_tj do_t    coefficients P_tj 2^edo_t, rows qdo_t (23 bits); the same blocks
# A block is an aligned range of BLOCK sequence positions (of one q head for dk and dv); its coefficients
# are quantized to COEF_BITS below their own largest, its integer partial is exact, and the partials are
# added in float64 in ascending (block, head) order, then rounded once to float32.

DO_BITS = 23  # the incoming gradient's rows (3 int8 digits, as activations)
DELTA_BITS = 53  # delta's products, relative to the largest of the row (512 terms stay below 2^62)
COEF_BITS = 15  # coefficients of the weighted sums, relative to the largest of each block (2 int8 digits)
BLOCK = 64  # sequence positions per coefficient block: one exponent per (output row, block)
#: Hq / Hkv limit (the split kernels' shared arrays and the group loops' int32 counters stay within it)
MAX_GROUP = 2**14


def exponent_fields(u: np.ndarray) -> np.ndarray:
    """The biased exponent field (0..2047) of float64 values: an exact integer key for the max."""
    return ((np.ascontiguousarray(u, dtype=np.float64).view(np.uint64) >> np.uint64(52))
            & np.uint64(0x7FF)).astype(np.int64)


def quantize_block(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A block's coefficients u [..., n] (float64) -> (U float64 integers [..., n], E int64 [...]).

    E = (largest exponent field over the last axis) - 1023, 0 for an all-zero block;
    U = RNE(u * 2^(COEF_BITS - 2 - E)), |U| <= 2^(COEF_BITS - 1). Exact but for the one rounding:
    the contract bounds every nonzero |u| to [2^-661, 2^394], so the scaling stays in range."""
    fields = exponent_fields(u).max(axis=-1, initial=0)
    e = np.where(fields > 0, fields - 1023, 0)
    return np.rint(u * fp.pow2_f64(COEF_BITS - 2 - e)[..., None]), e


def block_weighted_sum(blocks, row_bits: int, shape: tuple[int, ...]) -> np.ndarray:
    """sum over blocks (in the order given) of U_b @ r_b, each block's exact partial scaled into float64
    and added to a float64 sum that starts at +0, then one rounding to float32: the kernels' order.

    blocks: (u [..., N, n_b] float64, r [..., n_b, D] integers of row_bits bits), n_b <= BLOCK, in
    ascending (position block, head) order; shape: the result's (+0 where there is no block). Each
    partial is exact in float64 BLAS: |U r| <= 2^14 2^22 and n_b <= 64 terms keep every partial sum
    below 2^42."""
    acc = np.zeros(shape)
    for u, rows in blocks:
        big_u, e = quantize_block(u)
        part = np.matmul(big_u, np.asarray(rows, dtype=np.float64)).astype(np.int64).astype(np.float64)
        part = part * fp.pow2_f64(e - (COEF_BITS - 2) - (row_bits - 2))[..., None]  # exact: a power of two
        acc = acc + part
    with np.errstate(over="ignore"):  # beyond FLT_MAX rounds to +-inf, as the contract says
        return acc.astype(np.float32)


def position_blocks(length: int) -> list[slice]:
    """The aligned BLOCK-position ranges of keys 0..length-1, ascending."""
    return [slice(b, min(b + BLOCK, length)) for b in range(0, length, BLOCK)]


def query_blocks(positions: np.ndarray) -> list[tuple[slice, np.ndarray]]:
    """The query blocks of padded rows at positions [S, Tq] (-1: padding), ascending: for block b, the
    smallest range of rows holding every row of any sequence at a position in [64 b, 64 b + 64), and
    the mask [S, rows] of those rows."""
    out = []
    for b in range(int(positions.max(initial=-1)) // BLOCK + 1):
        inside = (positions >= 0) & (positions // BLOCK == b)
        rows = np.flatnonzero(inside.any(axis=0))
        if rows.size:
            span = slice(int(rows[0]), int(rows[-1]) + 1)
            out.append((span, inside[:, span]))
    return out


def delta_of(qdo: np.ndarray, edo: np.ndarray, o: np.ndarray) -> np.ndarray:
    """delta [Tq] = do . o of finite rows: w_d = float64(qdo_d) float64(o_d) (exact, 22 x 24 bits),
    E = (largest exponent field of the row's w) - 1023 (0 if all are 0), W_d = RNE(w_d 2^(51 - E)),
    delta = float64(sum_d W_d) 2^(E - 51 + edo - 21): an exact int64 sum (|W_d| <= 2^52, D <= 512),
    one rounding to float64, an exact scaling."""
    w = qdo * np.asarray(o, dtype=np.float64)
    fields = exponent_fields(w).max(axis=1, initial=0)
    e = np.where(fields > 0, fields - 1023, 0)
    total = np.rint(w * fp.pow2_f64(DELTA_BITS - 2 - e)[:, None]).astype(np.int64).sum(axis=1)
    return total.astype(np.float64) * fp.pow2_f64(e - (DELTA_BITS - 2) + edo - (DO_BITS - 2))


def _head_gradient_terms(enc, h: int, g: int, allowed: np.ndarray, scale: float):
    """(P, dS float64 [Tq, L], poisoned bool [Tq]) of query head h against kv head g. P and dS are
    0 outside `allowed` and on poisoned rows (their gradients are the canonical NaN instead)."""
    nonfinite = fp.NONFINITE_EXPONENT
    eq, ek, ev, edo = enc["eq"][:, h], enc["ek"][:, g], enc["ev"][:, g], enc["edo"][:, h]
    bad_kv = (ek == nonfinite) | (ev == nonfinite)
    bad_o = ~np.isfinite(enc["o"][:, h]).all(axis=1)
    eq_s, edo_s = (np.where(e == nonfinite, 0, e) for e in (eq, edo))
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)
    qdo = enc["qdo"][:, h]
    with np.errstate(all="ignore"):  # poisoned rows compute NaN or garbage, replaced below
        p, m, total = _softmax_weights(enc["qq"][:, h], eq_s, enc["qk"][:, g], ek_s, allowed, scale)
        big_p = (p * 2.0 ** (P_BITS - 2)) / total[:, None]
        d_p = (qdo @ enc["qv"][:, g].T) * fp.pow2_f64(edo_s[:, None] + ev_s[None, :] - (DO_BITS - 2) - (V_BITS - 2))
        delta = delta_of(qdo, edo_s, np.where(bad_o[:, None], 0.0, enc["o"][:, h]))
        d_s = (big_p * (d_p - delta[:, None])) * scale
    poisoned = ((eq == nonfinite) | (edo == nonfinite) | bad_o | ~np.isfinite(m[:, 0])
                | (allowed & bad_kv[None, :]).any(axis=1))
    keep = allowed & ~poisoned[:, None]
    return np.where(keep, big_p, 0.0), np.where(keep, d_s, 0.0), poisoned


def attention_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, q_positions: np.ndarray,
                       o: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of attention() for one sequence: q, do float32 [Tq, Hq, D] at q_positions [Tq];
    k, v float32 [L, Hkv, D]; o the forward's output (None: recomputed by attention()).
    Returns (dq [Tq, Hq, D], dk [L, Hkv, D], dv [L, Hkv, D]) float32; keys no query reaches get +0.

    A poisoned query row (its forward output is NaN, or its do or o row is non-finite) gives the
    canonical NaN in its dq row and in dk, dv of its kv head at every position j <= t."""
    tq, hq, dim = q.shape
    length, hkv, _ = k.shape
    positions = np.asarray(q_positions, dtype=np.int64)
    _check_lengths(tq, length, positions)
    if o is None:
        o = attention(q, k, v, positions)
    enc = {"o": np.asarray(o, dtype=np.float32)}  # and integers "qq", "qk", "qv", "qdo", exponents "eq", ...
    for name, x, bits in (("q", q, Q_BITS), ("k", k, K_BITS), ("v", v, V_BITS), ("do", do, DO_BITS)):
        enc["q" + name], enc["e" + name] = encode_heads(np.asarray(x, np.float32), bits)
    allowed = np.arange(length)[None, :] <= positions[:, None]  # [Tq, L]
    scale = 1.0 / np.sqrt(np.float64(dim))
    dq = np.empty((tq, hq, dim), dtype=np.float32)
    dk = np.empty((length, hkv, dim), dtype=np.float32)
    dv = np.empty((length, hkv, dim), dtype=np.float32)
    group = hq // hkv
    keys = position_blocks(length)
    queries = [positions // BLOCK == b for b in range(int(positions.max(initial=-1)) // BLOCK + 1)]
    for g in range(hkv):
        key_terms, value_terms, last_poisoned = [], [], -1
        ek_s = np.where(enc["ek"][:, g] == fp.NONFINITE_EXPONENT, 0, enc["ek"][:, g])
        for h in range(g * group, (g + 1) * group):
            big_p, d_s, poisoned = _head_gradient_terms(enc, h, g, allowed, scale)
            u = d_s * fp.pow2_f64(ek_s)[None, :]
            dq[:, h] = block_weighted_sum([(u[:, b], enc["qk"][b, g]) for b in keys], K_BITS, (tq, dim))
            dq[poisoned, h] = fp.CANONICAL_NAN
            eq_s = np.where(poisoned, 0, enc["eq"][:, h])
            edo_s = np.where(poisoned, 0, enc["edo"][:, h])
            key_terms.append((d_s.T * fp.pow2_f64(eq_s)[None, :], enc["qq"][:, h]))
            value_terms.append((big_p.T * fp.pow2_f64(edo_s)[None, :], enc["qdo"][:, h]))
            if poisoned.any():
                last_poisoned = max(last_poisoned, int(positions[poisoned].max()))
        # blocks in ascending (query block, head) order
        dk[:, g] = block_weighted_sum([(u[:, b], r[b]) for b in queries for u, r in key_terms], Q_BITS, (length, dim))
        dv[:, g] = block_weighted_sum([(u[:, b], r[b]) for b in queries for u, r in value_terms], DO_BITS,
                                      (length, dim))
        dk[:last_poisoned + 1, g] = fp.CANONICAL_NAN
        dv[:last_poisoned + 1, g] = fp.CANONICAL_NAN
    return dq, dk, dv


def attention_packed_backward(q, k, v, do, cu_seqlens, o=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attention_backward for packed sequences (sequence i: tokens cu_seqlens[i]..cu_seqlens[i+1]-1 at
    positions 0, 1, ...), one sequence at a time: q, do, o [T, Hq, D]; k, v [T, Hkv, D]."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    dq = np.empty(q.shape, dtype=np.float32)
    dk = np.empty(k.shape, dtype=np.float32)
    dv = np.empty(v.shape, dtype=np.float32)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            dq[a:b], dk[a:b], dv[a:b] = attention_backward(q[a:b], k[a:b], v[a:b], do[a:b], np.arange(b - a),
                                                           None if o is None else o[a:b])
    return dq, dk, dv


# ---- batched evaluation: the functions above for many sequences and all heads at once
#
# The per-sequence functions above are the definition; these evaluate them over a padded chunk of
# sequences, heads laid out [S, Hkv, G, Tq, ...] (G = Hq / Hkv, the q heads of one kv head). A padded
# query row has position -1 and so sees no key; a padded key sits beyond every query position of its
# sequence: the causal mask excludes both exactly as it excludes later keys, and padded rows are never
# poisoned. Each step is the same elementwise IEEE operation on the same operands, an exact integer sum
# (float64 with every partial sum below 2^53, or int64; any order gives the same value) or a max, so
# every bit equals the per-sequence functions' (tests/test_attention_batched_reference.py checks it).
# exp_f32 runs on the allowed entries only. Sequences are sorted by length and cut into chunks whose
# padded [S, Hq, Tq, max(L, D)] arrays (scores and weights; the wide sums of dq) hold at most
# BATCH_ELEMENTS entries; heads are split further when one sequence alone exceeds it (down to one q head
# in the forward, one kv head's group in the backward, whose dk and dv sum over the group: the
# per-sequence backward holds that group's coefficient blocks too). Small chunks are the fast ones:
# their temporaries stay in the cpu caches (a few hundred NumPy calls per chunk).

BATCH_ELEMENTS = 2**15  # entries per chunk: 256 KB per float64 [S, Hq, Tq, max(L, D)] array
ROW_BLOCK_ELEMENTS = 2**22  # the forward's cap once a chunk is one head: 32 MB per float64 [S, rows, L] array


def batch_chunks(query_counts, key_counts, heads: int, width: int = 0,
                 budget: int = BATCH_ELEMENTS) -> list[np.ndarray]:
    """Indices of the sequences with queries, most keys first, cut so that count x heads x (most
    queries) x max(most keys, width) of a chunk stays within budget (a lone sequence may exceed it)."""
    queries = np.asarray(query_counts, dtype=np.int64)
    keys = np.asarray(key_counts, dtype=np.int64)
    order = np.lexsort((-queries, -keys))
    order = order[queries[order] > 0]
    chunks, start = [], 0
    while start < order.size:
        rest = order[start:]  # the chunk's first sequence has its most keys
        cost = (np.arange(1, rest.size + 1) * float(heads) * np.maximum.accumulate(queries[rest])
                * float(max(keys[rest[0]], width)))  # non-decreasing in the count
        count = max(1, int(np.searchsorted(cost, budget, side="right")))
        chunks.append(rest[:count])
        start += count
    return chunks


def _head_slices(qq: np.ndarray, qk: np.ndarray, budget: int, whole_groups: bool) -> list[tuple[slice, slice]]:
    """(q heads, kv heads) pieces of a chunk (qq [S, Tq, Hq, D], qk [S, L, Hkv, D]) whose
    [S, heads, Tq, max(L, D)] arrays stay within budget: whole kv groups where they fit, else (when not
    whole_groups: the forward, whose q heads are independent) part of one group's q heads, at least one."""
    s, tq, hq, dim = qq.shape
    length, hkv = qk.shape[1], qk.shape[2]
    group = hq // hkv
    heads = max(1, budget // max(s * tq * max(length, dim), 1))  # q heads per piece
    if heads >= group or whole_groups:
        step = max(1, min(hkv, heads // group))
        return [(slice(g * group, min(g + step, hkv) * group), slice(g, min(g + step, hkv)))
                for g in range(0, hkv, step)]
    return [(slice(h, min(h + heads, (h // group + 1) * group)), slice(h // group, h // group + 1))
            for g in range(hkv) for h in range(g * group, (g + 1) * group, heads)]


def padded_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[S, max count] row indices starts[s] + t for t < counts[s], -1 beyond (padding)."""
    width = int(counts.max()) if counts.size else 0
    t = np.arange(width, dtype=np.int64)[None, :]
    return np.where(t < counts[:, None], starts[:, None] + t, -1)


def gather_rows(x: np.ndarray, rows: np.ndarray, fill=0) -> np.ndarray:
    """x[rows] for an index array with -1 padding: padded entries hold `fill` (0: a zero row, exponent 0)."""
    out = x[np.maximum(rows, 0)]
    out[rows < 0] = fill
    return out


def _by_group(x: np.ndarray, hkv: int) -> np.ndarray:
    """[S, T, Hq, ...] -> [S, Hkv, G, T, ...] (q head h = g G + i)."""
    s, t, hq = x.shape[:3]
    return np.moveaxis(x.reshape((s, t, hkv, hq // hkv) + x.shape[3:]), 1, 3)


def _from_group(x: np.ndarray) -> np.ndarray:
    """[S, Hkv, G, T, ...] -> [S, T, Hq, ...]."""
    s, hkv, group, t = x.shape[:4]
    return np.moveaxis(x, 3, 1).reshape((s, t, hkv * group) + x.shape[4:])


def _by_head(x: np.ndarray) -> np.ndarray:
    """[S, L, Hkv, ...] -> [S, Hkv, L, ...]."""
    return np.moveaxis(x, 1, 2)


def _grouped_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a [S, Hkv, G, T, n] @ b [S, Hkv, n, m] -> [S, Hkv, G, T, m]: the G heads' rows in one product."""
    s, hkv, group, t, n = a.shape
    return (np.ascontiguousarray(a).reshape(s, hkv, group * t, n) @ b).reshape(s, hkv, group, t, b.shape[-1])


def _softmax_weights_batched(qq, eq_s, qk, ek_s, allowed, scale):
    """_softmax_weights of a chunk: qq [S, Hkv, G, Tq, D], eq_s [S, Hkv, G, Tq]; qk [S, Hkv, L, D],
    ek_s [S, Hkv, L]; allowed [S, 1, 1, Tq, L]. Returns p [S, Hkv, G, Tq, L], m [..., Tq, 1], L [..., Tq]."""
    sums = _grouped_matmul(qq, np.swapaxes(qk, -1, -2))  # exact: every partial sum < 2^53
    shift = eq_s[..., None] + ek_s[:, :, None, None, :] - (Q_BITS - 2) - (K_BITS - 2)
    scores = ((sums * fp.pow2_f64(shift)) * scale).astype(np.float32)
    mask = np.broadcast_to(allowed, scores.shape)
    scores[~mask] = -np.inf
    m = scores.max(axis=-1, keepdims=True)
    p = np.zeros(scores.shape, dtype=np.float64)
    p[mask] = exp_f32(scores[mask] - np.broadcast_to(m, scores.shape)[mask])
    total = np.rint(p * 2.0 ** (P_BITS - 2)).sum(axis=-1)  # exact integer sum (< 2^53)
    return p, m, total


def _chunk_mask(positions: np.ndarray, length: int) -> np.ndarray:
    """allowed [S, 1, 1, Tq, L]: key j <= the query's position (-1: a padded row sees nothing)."""
    return (np.arange(length)[None, None, :] <= positions[:, :, None])[:, None, None]


def _forward_chunk(qq, eq, qk, ek, qv, ev, positions) -> np.ndarray:
    """_one_head for every head of a padded chunk: qq [S, Tq, Hq, D], eq [S, Tq, Hq]; qk, qv
    [S, L, Hkv, D], ek, ev [S, L, Hkv]; positions [S, Tq]. Returns [S, Tq, Hq, D] (padded rows: garbage)."""
    hkv, length, dim = qk.shape[2], qk.shape[1], qk.shape[3]
    qq, eq = _by_group(qq, hkv), _by_group(eq, hkv)
    qk, ek, qv, ev = _by_head(qk), _by_head(ek), _by_head(qv), _by_head(ev)
    allowed = _chunk_mask(positions, length)
    scale = 1.0 / np.sqrt(np.float64(dim))
    bad_q = eq == fp.NONFINITE_EXPONENT
    bad_kv = (ek == fp.NONFINITE_EXPONENT) | (ev == fp.NONFINITE_EXPONENT)
    eq_s = np.where(bad_q, 0, eq)
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)[:, :, None, None, :]  # [S, Hkv, 1, 1, L]
    with np.errstate(all="ignore"):  # overflowing scores (contract: nan_inf); padded rows divide 0 by 0
        p, _, total = _softmax_weights_batched(qq, eq_s, qk, ek_s, allowed, scale)
        e_max = np.where(allowed, ev_s, np.iinfo(np.int64).min).max(axis=-1)  # [S, Hkv, 1, Tq]
        weights = np.rint(p * fp.pow2_f64(np.where(allowed, ev_s - e_max[..., None] + P_BITS - 2, 0)))
        weights = np.where(allowed, weights, 0.0)
        numerator = _grouped_matmul(weights, qv)  # exact
        out = ((numerator * fp.pow2_f64(e_max - (V_BITS - 2))[..., None]) / total[..., None]).astype(np.float32)
    poisoned = bad_q | (allowed & bad_kv[:, :, None, None, :]).any(axis=-1)
    out[poisoned] = fp.CANONICAL_NAN
    return _from_group(out)


def attention_encoded_batched(qq, eq, qk, ek, qv, ev, positions, budget: int = BATCH_ELEMENTS) -> np.ndarray:
    """attention_encoded of S padded sequences at once, the same bits: qq [S, Tq, Hq, D], eq [S, Tq, Hq];
    qk, qv [S, L, Hkv, D], ek, ev [S, L, Hkv] (the keys of sequence s at positions 0..L-1; rows beyond
    its own keys are padding); positions int64 [S, Tq], -1 on padded query rows (their output is garbage).
    A position must have its key in sequence s (as attention_encoded requires)."""
    qq, qk, qv = (np.asarray(x, dtype=np.float64) for x in (qq, qk, qv))
    eq, ek, ev = (np.asarray(e, dtype=np.int64) for e in (eq, ek, ev))  # int32 would clip the int64 sentinels
    positions = np.asarray(positions, dtype=np.int64)
    s, tq, hq, dim = qq.shape
    length = qk.shape[1]
    if length > MAX_KEYS:
        raise ValueError(f"attention: {length} keys exceed the contract's limit {MAX_KEYS}")
    out = np.empty((s, tq, hq, dim), dtype=np.float32)
    for h, g in _head_slices(qq, qk, budget, whole_groups=False):
        # query rows in blocks too (each row's bits are its own), so that one long sequence's
        # [rows, L] arrays stay within budget: memory linear in the length, not quadratic
        heads = h.stop - h.start
        step = max(1, max(budget, ROW_BLOCK_ELEMENTS) // max(s * heads * max(length, dim), 1))
        for r in range(0, tq, step):
            rows = slice(r, min(r + step, tq))
            out[:, rows, h] = _forward_chunk(qq[:, rows, h], eq[:, rows, h], qk[:, :, g], ek[:, :, g], qv[:, :, g],
                                             ev[:, :, g], positions[:, rows])
    return out


def _packed_chunks(cu: np.ndarray, heads: int, dim: int, budget: int):
    """(rows [S, Tmax] token indices with -1 padding, positions [S, Tmax]) of each chunk of a packed batch."""
    lengths = np.diff(cu)
    if lengths.size and lengths.max() > MAX_KEYS:
        raise ValueError(f"attention: {lengths.max()} keys exceed the contract's limit {MAX_KEYS}")
    for seqs in batch_chunks(lengths, lengths, heads, dim, budget):
        rows = padded_rows(cu[:-1][seqs], lengths[seqs])
        yield rows, np.where(rows >= 0, np.arange(rows.shape[1])[None, :], -1)


def attention_packed_batched(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu_seqlens,
                             budget: int = BATCH_ELEMENTS) -> np.ndarray:
    """attention() of every sequence of a packed batch (sequence i: tokens cu_seqlens[i]..cu_seqlens[i+1]-1
    at positions 0, 1, ...), many sequences per NumPy call: q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq, D],
    the bits of attention() one sequence at a time."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    qq, eq = encode_heads(np.asarray(q, np.float32), Q_BITS)
    qk, ek = encode_heads(np.asarray(k, np.float32), K_BITS)
    qv, ev = encode_heads(np.asarray(v, np.float32), V_BITS)
    out = np.empty(q.shape, dtype=np.float32)
    for rows, positions in _packed_chunks(cu, q.shape[1], q.shape[2], budget):
        valid = rows >= 0
        chunk = attention_encoded_batched(*(gather_rows(x, rows) for x in (qq, eq, qk, ek, qv, ev)), positions,
                                          budget)
        out[rows[valid]] = chunk[valid]
    return out


def _query_block_terms(u: np.ndarray, rows: np.ndarray, positions: np.ndarray):
    """dk / dv blocks of a chunk in ascending (query block, head) order: u [S, Hkv, G, Tq, L] coefficients,
    rows [S, Hkv, G, Tq, D], positions [S, Tq] -> (u [S, Hkv, L, n], r [S, Hkv, n, D]), the rows of other
    blocks (and padding) zeroed."""
    for span, inside in query_blocks(positions):
        mask = inside[:, None, :, None]
        for h in range(u.shape[2]):
            yield np.swapaxes(u[:, :, h, span] * mask, -1, -2), rows[:, :, h, span] * mask


def _backward_chunk(qq, eq, qk, ek, qv, ev, qdo, edo, o, positions):
    """attention_backward for every head of a padded chunk: qq, qdo, o [S, Tq, Hq, D], eq, edo [S, Tq, Hq];
    qk, qv [S, L, Hkv, D], ek, ev [S, L, Hkv]; positions [S, Tq] (-1: padding).
    Returns (dq [S, Tq, Hq, D], dk, dv [S, L, Hkv, D]); padded rows hold garbage."""
    nonfinite = fp.NONFINITE_EXPONENT
    s, tq, hq, dim = qq.shape
    length, hkv = qk.shape[1], qk.shape[2]
    qq, eq, qdo, edo, o = (_by_group(x, hkv) for x in (qq, eq, qdo, edo, o))
    qk, ek, qv, ev = _by_head(qk), _by_head(ek), _by_head(qv), _by_head(ev)
    allowed = _chunk_mask(positions, length)
    scale = 1.0 / np.sqrt(np.float64(dim))
    # _head_gradient_terms
    bad_kv = (ek == nonfinite) | (ev == nonfinite)
    bad_o = ~np.isfinite(o).all(axis=-1)
    eq_s, edo_s = (np.where(e == nonfinite, 0, e) for e in (eq, edo))
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)
    with np.errstate(all="ignore"):  # poisoned and padded rows compute NaN or garbage, replaced below
        p, m, total = _softmax_weights_batched(qq, eq_s, qk, ek_s, allowed, scale)
        big_p = (p * 2.0 ** (P_BITS - 2)) / total[..., None]
        d_p = _grouped_matmul(qdo, np.swapaxes(qv, -1, -2)) * fp.pow2_f64(
            edo_s[..., None] + ev_s[:, :, None, None, :] - (DO_BITS - 2) - (V_BITS - 2))
        delta = delta_of(qdo.reshape(-1, dim), edo_s.reshape(-1),
                         np.where(bad_o[..., None], 0.0, o).reshape(-1, dim)).reshape(edo_s.shape)
        d_s = (big_p * (d_p - delta[..., None])) * scale
    valid = (positions >= 0)[:, None, None, :]
    poisoned = ((eq == nonfinite) | (edo == nonfinite) | bad_o | ~np.isfinite(m[..., 0])
                | (allowed & bad_kv[:, :, None, None, :]).any(axis=-1)) & valid
    keep = allowed & ~poisoned[..., None]
    big_p, d_s = np.where(keep, big_p, 0.0), np.where(keep, d_s, 0.0)
    # attention_backward: the three exact weighted sums and the poisoned rows' NaN
    group = hq // hkv
    ek_dq = np.where(ek == nonfinite, 0, ek)[:, :, None, None, :]
    u_dq = (d_s * fp.pow2_f64(ek_dq)).reshape(s, hkv, group * tq, length)
    dq = block_weighted_sum([(u_dq[..., b], qk[:, :, b]) for b in position_blocks(length)], K_BITS,
                            (s, hkv, group * tq, dim))
    dq = dq.reshape(s, hkv, group, tq, dim)
    dq[poisoned] = fp.CANONICAL_NAN
    eq_s, edo_s = np.where(poisoned, 0, eq), np.where(poisoned, 0, edo)
    dk = block_weighted_sum(_query_block_terms(d_s * fp.pow2_f64(eq_s)[..., None], qq, positions), Q_BITS,
                            (s, hkv, length, dim))
    dv = block_weighted_sum(_query_block_terms(big_p * fp.pow2_f64(edo_s)[..., None], qdo, positions), DO_BITS,
                            (s, hkv, length, dim))
    last_poisoned = np.where(poisoned, np.broadcast_to(positions[:, None, None, :], poisoned.shape), -1)
    reached = np.arange(length)[None, None, :] <= last_poisoned.max(axis=(2, 3))[..., None]  # [S, Hkv, L]
    dk, dv = dk.reshape(s, hkv, length, dim), dv.reshape(s, hkv, length, dim)
    dk[reached] = fp.CANONICAL_NAN
    dv[reached] = fp.CANONICAL_NAN
    return _from_group(dq), _by_head(dk), _by_head(dv)


def attention_backward_encoded_batched(qq, eq, qk, ek, qv, ev, qdo, edo, o, positions,
                                       budget: int = BATCH_ELEMENTS):
    """attention_backward of S padded sequences from encoded rows, the same bits: qq, qdo [S, Tq, Hq, D]
    (23 bits) with eq, edo [S, Tq, Hq]; o [S, Tq, Hq, D] the forward's output; qk, qv [S, L, Hkv, D]
    (15 bits) with ek, ev [S, L, Hkv]; positions int64 [S, Tq], -1 on padded query rows.
    Returns (dq [S, Tq, Hq, D], dk [S, L, Hkv, D], dv [S, L, Hkv, D]); padded rows hold garbage."""
    qq, qk, qv, qdo = (np.asarray(x, dtype=np.float64) for x in (qq, qk, qv, qdo))
    eq, ek, ev, edo = (np.asarray(e, dtype=np.int64) for e in (eq, ek, ev, edo))
    positions = np.asarray(positions, dtype=np.int64)
    o = np.asarray(o, dtype=np.float32)
    s, tq, hq, dim = qq.shape
    length, hkv = qk.shape[1], qk.shape[2]
    if length > MAX_KEYS:
        raise ValueError(f"attention: {length} keys exceed the contract's limit {MAX_KEYS}")
    dq = np.empty((s, tq, hq, dim), dtype=np.float32)
    dk = np.empty((s, length, hkv, dim), dtype=np.float32)
    dv = np.empty((s, length, hkv, dim), dtype=np.float32)
    for h, g in _head_slices(qq, qk, budget, whole_groups=True):  # dk, dv sum over a whole group
        dq[:, :, h], dk[:, :, g], dv[:, :, g] = _backward_chunk(
            qq[:, :, h], eq[:, :, h], qk[:, :, g], ek[:, :, g], qv[:, :, g], ev[:, :, g], qdo[:, :, h],
            edo[:, :, h], o[:, :, h], positions)
    return dq, dk, dv


def attention_packed_backward_batched(q, k, v, do, cu_seqlens, o=None,
                                      budget: int = BATCH_ELEMENTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attention_packed_backward with many sequences and all heads per NumPy call, the same bits:
    q, do, o [T, Hq, D]; k, v [T, Hkv, D] float32; o None: recomputed (attention_packed_batched)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    q, k, v, do = (np.asarray(x, dtype=np.float32) for x in (q, k, v, do))
    o = attention_packed_batched(q, k, v, cu, budget) if o is None else np.asarray(o, dtype=np.float32)
    qq, eq = encode_heads(q, Q_BITS)
    qk, ek = encode_heads(k, K_BITS)
    qv, ev = encode_heads(v, V_BITS)
    qdo, edo = encode_heads(do, DO_BITS)
    dq = np.empty(q.shape, dtype=np.float32)
    dk = np.empty(k.shape, dtype=np.float32)
    dv = np.empty(v.shape, dtype=np.float32)
    for rows, positions in _packed_chunks(cu, q.shape[1], q.shape[2], budget):
        valid = rows >= 0
        grads = attention_backward_encoded_batched(
            *(gather_rows(x, rows) for x in (qq, eq, qk, ek, qv, ev, qdo, edo, o)), positions, budget)
        for out, chunk in zip((dq, dk, dv), grads):
            out[rows[valid]] = chunk[valid]
    return dq, dk, dv
