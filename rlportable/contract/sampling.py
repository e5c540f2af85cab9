"""Token sampling: the NumPy reference of the sampler's contract (the "sampling" family).

The rollout engine calls this once per step on a batch of logits rows, one row per sequence
that emits a token, each row with its own parameters and its own random counter. Every
quantity below is an integer or a fixed sequence of IEEE-754 binary32/binary64 operations
(round to nearest even) and the contract's exp, so a GPU kernel can reproduce the chosen
token bit for bit; no NumPy random generator, no libm, no float sum whose value depends on
an order. Each row's token depends on that row's logits, parameters and counter alone: not
on the batch, the row's place in it, the scheduling order, the KV block size or the vendor.

What is computed, to the bit
----------------------------
Random numbers: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as
easy as 1, 2, 3", SC11; the Random123 library's philox4x32 with R = 10 rounds), checked
against Random123's known-answer vectors in tests/test_sampling.py. Multipliers
M0 = 0xD2511F53, M1 = 0xCD9E8D57, Weyl key increments W0 = 0x9E3779B9, W1 = 0xBB67AE85; one
round maps counter (c0, c1, c2, c3) and key (k0, k1) to
    (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0))
with the 64-bit products split in 32-bit halves; the key gets (k0 + W0, k1 + W1) mod 2^32
before each of rounds 2..10.
  key     = (seed mod 2^32, seed >> 32)                 seed an integer in [0, 2^64)
  counter = (request, sample_index, position, stream)   each in [0, 2^32); stream 0 = the draw
  r       = x0 + 2^32 * x1                             the first two output words: 64 bits
request is the request's id, sample_index its sample (0..n-1, the members of a GRPO group),
position the 0-based position in the sequence of the token being sampled (the prompt's
length for the first generated token), so every token of every sample has its own r.
Streams 1..2^32-1 are reserved for later uses (they are independent of stream 0).

Sampling one row of float32 logits z [V] (the exact gemm's output), 1 <= V <= 2^25, with
temperature T (float64, finite, >= 0), top_k (integer; < 1 means off), top_p (float64 in
(0, 1]), min_p (float64 in [0, 1]):

  Validity. a_v = z_v when T = 0, else a_v = RNE_f32(float64(z_v) / T) (as in the logprob
  contract; T = 1 gives z exactly). A row with a NaN a_v, a +inf a_v (z = +inf, or z / T
  beyond float32's range) or no finite a_v is refused (InputError naming the row): the
  log-prob the engine must record for it would be NaN. -inf entries are ordinary: they are
  never chosen.
  Greedy (T = 0). The token is the smallest id v with a_v = max a (+0 and -0 compare equal).
  Its distribution is the point mass w = 1 on that token (so `draw` returns it for any r).
  Otherwise:
    m    = max_v a_v
    p_v  = exp_f32(RNE_f32(a_v - m))          contract exp; p of a maximum is exactly 1
    w_v  = RNE(p_v * 2^36)                     the logprob contract's integer terms; w <= 2^36,
                                               p_v < 2^-37 gives 0 (never sampled)
    rank: the order (a_v descending, id ascending), +0 = -0. w is non-increasing along it,
    and every token with w > 0 comes before every token with w = 0, so the three filters
    below each keep a prefix of the ranked tokens that starts with a maximum (w = 2^36):
    top_k  keeps the first k ranks (k < 1 or k >= V: all)
    min_p  keeps w_v >= min_p * 2^36           float64(w) exact, the product exact (power of two)
    top_p  on the tokens kept by both, in rank order with cumulative weights C_j (kept tokens
           ranked strictly before j) and total W' = their sum: keeps j iff C_j < t, where
           t = ceil(top_p * W') computed exactly: top_p = M * 2^-s (M the 53-bit integer
           significand), M * W' as a 128-bit product of 64-bit halves, shifted right by s
           rounding up (s >= 128 gives t = 1). This is the shortest prefix whose weight
           reaches top_p of the kept weight; top_p = 1 keeps every kept token with w > 0.
    The kept weights: w_v for tokens kept by all three filters, 0 otherwise. Their sum W is
    in [2^36, 2^61] (an int64, exact in any order).
  Draw. target = floor(r * W / 2^64), the high 64 bits of the exact 128-bit product
  (0 <= target < W); the token is the v with K_v <= target < K_v + w'_v, where w' are the
  kept weights and K_v = sum of w'_u over u < v (ascending token ids: a prefix sum over the
  vocabulary). Token v is chosen with probability w'_v / W up to 2^-64.

The log-prob of the sampled token is not computed here. The engine records the logprob
contract's value, rlportable.contract.logprob.logprobs(z, token, T), for T > 0, and at T = 1
for greedy rows (`record_temperature`): greedy has no temperature of its own, T = 1 is the
model's distribution, and it is what a trainer recomputes with its default temperature
(`sampled_logprobs` does this grouping). The filters (top-k, top-p, min-p) change which tokens
can be drawn, not the recorded log-prob, as in vLLM's default.

Top log-prob alternatives (`top_logprobs`): the n tokens with the largest log-prob under the
same contract (logits / T, T = 1 for greedy), ordered by (log-prob descending, id ascending),
with those log-probs; they equal logprob.logprobs(z, id, T) bit for bit.

Why these choices: the integer weights are the terms of the logprob contract's exact sum, so
the sampler's distribution is the recorded one up to the filters and the 2^-37 truncation;
integer prefix sums make the draw independent of any summation order; a counter-based
generator needs no state, so a token's random bits are a function of (seed, request, sample,
position) whatever batch it runs in.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import logprob
from rlportable.contract.elementwise import exp_f32
from rlportable.errors import InputError

# Philox4x32-10 constants (Random123, philox.h: PHILOX_M4x32_0/1, PHILOX_W32_0/1)
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

WEIGHT_BITS = logprob.SUM_BITS - 2  # 36: w = RNE(p * 2^36), the logprob contract's S terms
MAX_VOCAB = logprob.MAX_VOCAB        # 2^25: W <= 2^25 * 2^36 = 2^61
STREAM_DRAW = 0

_MASK32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
_BLOCK_ELEMENTS = 1 << 21            # rows are processed in blocks of about this many logits
                                     # (bounds memory; results do not depend on it)


# ---------------------------------------------------------------- integer helpers

def _u64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def philox4x32_10(counter, key) -> np.ndarray:
    """Philox4x32-10: uint32 counter [..., 4] and key [..., 2] -> uint32 [..., 4] (broadcasting)."""
    counter = np.asarray(counter, dtype=np.uint32)
    key = np.asarray(key, dtype=np.uint32)
    if counter.shape[-1:] != (4,) or key.shape[-1:] != (2,):
        raise InputError(f"philox4x32_10: counter must end in 4 words and key in 2, got shapes "
                         f"{counter.shape} and {key.shape}")
    c0, c1, c2, c3 = (counter[..., i].astype(np.uint64) for i in range(4))
    k0, k1 = (key[..., i].astype(np.uint64) for i in range(2))
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    for round_index in range(PHILOX_ROUNDS):
        if round_index > 0:
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        p0 = m0 * c0  # < 2^64: exact in uint64
        p1 = m1 * c2
        c0, c1, c2, c3 = ((p1 >> _U32) ^ c1 ^ k0, p1 & _MASK32,
                          (p0 >> _U32) ^ c3 ^ k1, p0 & _MASK32)
    shape = np.broadcast_shapes(c0.shape, k0.shape)
    return np.stack([np.broadcast_to(c, shape) for c in (c0, c1, c2, c3)], axis=-1).astype(np.uint32)


def mul_u64(a, b) -> tuple[np.ndarray, np.ndarray]:
    """The exact 128-bit product of uint64 arrays as (high, low) 64-bit halves, from 32-bit pieces
    (what a kernel does with umulhi / __umul64hi)."""
    a, b = _u64(a), _u64(b)
    a0, a1 = a & _MASK32, a >> _U32
    b0, b1 = b & _MASK32, b >> _U32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _U32) + (p01 & _MASK32) + (p10 & _MASK32)  # < 3 * 2^32
    low = (p00 & _MASK32) | (mid << _U32)
    high = p11 + (p01 >> _U32) + (p10 >> _U32) + (mid >> _U32)
    return high, low


def _ceil_shift_128(high: np.ndarray, low: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """ceil((high * 2^64 + low) / 2^shift) for shift >= 0, when the result fits in 64 bits."""
    shift = np.asarray(shift, dtype=np.int64)
    nonzero = (high != 0) | (low != 0)
    # shift >= 128: a positive value below 2^128 gives 1
    wide = np.where(nonzero, np.uint64(1), np.uint64(0))
    # 64 <= shift < 128
    s_hi = np.clip(shift - 64, 0, 63).astype(np.uint64)
    q_hi = high >> s_hi
    rem_hi = (low != 0) | ((high & ((np.uint64(1) << s_hi) - np.uint64(1))) != 0)
    # 1 <= shift < 64 (the value's bits above 2^64 shift into the quotient's top)
    s_lo = np.clip(shift, 1, 63).astype(np.uint64)
    q_lo = (high << (np.uint64(64) - s_lo)) | (low >> s_lo)
    rem_lo = (low & ((np.uint64(1) << s_lo) - np.uint64(1))) != 0
    quotient = np.where(shift >= 128, wide,
                        np.where(shift >= 64, q_hi + rem_hi.astype(np.uint64),
                                 np.where(shift == 0, low, q_lo + rem_lo.astype(np.uint64))))
    return quotient


def top_p_threshold(top_p, total) -> np.ndarray:
    """t = ceil(top_p * total), exact: top_p float64 in (0, 1] as M * 2^-s, M * total in 128 bits.
    total: integer weights (uint64/int64, < 2^63). Returns uint64."""
    top_p = np.asarray(top_p, dtype=np.float64)
    fraction, exponent = np.frexp(top_p)              # top_p = fraction * 2^exponent, fraction in [0.5, 1)
    significand = np.ldexp(fraction, 53).astype(np.uint64)  # exact 53-bit integer M
    shift = 53 - exponent.astype(np.int64)             # top_p = M * 2^-shift
    high, low = mul_u64(significand, _u64(total))
    return _ceil_shift_128(high, low, shift)


def seed_key(seed) -> np.ndarray:
    """Philox key words (seed mod 2^32, seed >> 32) of uint64 seeds: uint32 [..., 2]."""
    seed = _u64(seed)
    return np.stack([seed & _MASK32, seed >> _U32], axis=-1).astype(np.uint32)


def random_u64(seed, request, sample_index, position, stream=STREAM_DRAW) -> np.ndarray:
    """r = x0 + 2^32 x1 of Philox4x32-10(counter = (request, sample_index, position, stream),
    key = seed_key(seed)), uint64, broadcast over the arguments."""
    seed = _unsigned("seed", seed, 64)
    words = [_unsigned(name, value, 32) for name, value in
             (("request", request), ("sample_index", sample_index), ("position", position), ("stream", stream))]
    shape = np.broadcast_shapes(seed.shape, *(w.shape for w in words))
    counter = np.stack([np.broadcast_to(w, shape) for w in words], axis=-1).astype(np.uint32)
    x = philox4x32_10(counter, np.broadcast_to(seed_key(seed), shape + (2,)))
    return x[..., 0].astype(np.uint64) | (x[..., 1].astype(np.uint64) << _U32)


# ---------------------------------------------------------------- argument checks

def _unsigned(name: str, value, bits: int) -> np.ndarray:
    """An integer array in [0, 2^bits) as uint64, from Python ints (any size) or integer arrays."""
    if not isinstance(value, (np.ndarray, np.generic)):
        # Python ints and lists of them: never through float64 (NumPy turns [1, 2^64 - 1] into floats)
        array = np.array(value, dtype=object)
        flat = array.ravel()
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in flat):
            raise InputError(f"sampling: {name} must be integers, got {value!r}")
        if any(int(v) < 0 or int(v) >= 2**bits for v in flat):
            raise InputError(f"sampling: {name} must be integers in [0, 2^{bits}), got {value!r}")
        return np.array([int(v) for v in flat], dtype=np.uint64).reshape(array.shape)
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise InputError(f"sampling: {name} must be integers, got dtype {array.dtype.name}")
    if array.dtype.kind == "i" and np.any(array < 0):
        raise InputError(f"sampling: {name} must be integers in [0, 2^{bits}), got a negative value")
    array = array.astype(np.uint64)
    if bits < 64 and np.any(array >> np.uint64(bits)):
        raise InputError(f"sampling: {name} must be integers in [0, 2^{bits}), got {int(array.max())}")
    return array


def row_parameter(name: str, value, rows: int, dtype) -> np.ndarray:
    """A per-row sampling parameter (a scalar or [rows]) as `dtype` [rows]; refuses other shapes and kinds."""
    array = np.asarray(value)
    if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != rows):
        raise InputError(f"sampling: {name} must be a scalar or have shape ({rows},), got shape {array.shape}")
    if np.dtype(dtype).kind == "f":
        if array.dtype.kind not in "iuf" or array.dtype == bool:
            raise InputError(f"sampling: {name} must be numbers, got dtype {array.dtype.name}")
    elif array.dtype.kind not in "iu":
        raise InputError(f"sampling: {name} must be integers, got dtype {array.dtype.name}")
    return np.broadcast_to(array.astype(dtype), (rows,))


def temperatures(temperature, rows: int) -> np.ndarray:
    """float64 [rows]: the sampling temperature of each row, finite and >= 0 (0 = greedy)."""
    temperature = row_parameter("temperature", temperature, rows, np.float64)
    if not np.all(np.isfinite(temperature) & (temperature >= 0)):
        raise InputError(f"sampling: temperature must be finite and >= 0 (0 = greedy), got {temperature}")
    return temperature


def check_vocab(vocab) -> int:
    """The vocabulary size, an integer in [1, 2^25] (the contract's limit)."""
    if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or not 1 <= vocab <= MAX_VOCAB:
        raise InputError(f"sampling: the vocabulary size must lie in [1, 2^25], got {vocab!r}")
    return int(vocab)


def check_parameters(rows: int, temperature, top_k, top_p, min_p):
    """(temperature, top_k, top_p, min_p), each [rows], checked against the contract's ranges."""
    temperature = temperatures(temperature, rows)
    top_k = row_parameter("top_k", 0 if top_k is None else top_k, rows, np.int64)
    top_p = row_parameter("top_p", 1.0 if top_p is None else top_p, rows, np.float64)
    if not np.all((top_p > 0) & (top_p <= 1)):  # NaN fails too
        raise InputError(f"sampling: top_p must lie in (0, 1], got {top_p}")
    min_p = row_parameter("min_p", 0.0 if min_p is None else min_p, rows, np.float64)
    if not np.all((min_p >= 0) & (min_p <= 1)):
        raise InputError(f"sampling: min_p must lie in [0, 1], got {min_p}")
    return temperature, top_k, top_p, min_p


def _check_logits(logits) -> np.ndarray:
    z = np.asarray(logits)
    if z.ndim != 2 or z.dtype != np.float32:
        raise InputError(f"sampling: logits must be a float32 matrix [rows, V], got "
                         f"{z.dtype.name} of shape {z.shape}")
    check_vocab(z.shape[1])
    return z


def record_temperature(temperature) -> np.ndarray:
    """The temperature at which the engine records log-probs: T, or 1 for greedy rows (T = 0)."""
    temperature = np.asarray(temperature, dtype=np.float64)
    return np.where(temperature == 0, 1.0, temperature)


# ---------------------------------------------------------------- the contract

def scaled_logits(z: np.ndarray, temperature: np.ndarray, first_row: int) -> np.ndarray:
    """a = z (T = 0) or RNE_f32(z / T); refuses rows with NaN, +inf or no finite value."""
    t = record_temperature(temperature)
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.where((t == 1.0)[:, None], z, (z.astype(np.float64) / t[:, None]).astype(np.float32))
    a = a.astype(np.float32, copy=False)
    bad_nan = np.isnan(a).any(axis=1)
    bad_inf = (a == np.inf).any(axis=1)
    bad_empty = ~(np.isfinite(a).any(axis=1))
    for row in np.flatnonzero(bad_nan | bad_inf | bad_empty):
        where = f"sampling: row {first_row + row} of the logits"
        if bad_nan[row]:
            raise InputError(f"{where} has a NaN")
        if (z[row] == np.inf).any():
            raise InputError(f"{where} has +inf")
        if bad_inf[row]:
            raise InputError(f"{where} divided by the temperature {temperature[row]!r} overflows float32")
        raise InputError(f"{where} has no finite value")
    return a


def _order_keys(a: np.ndarray) -> np.ndarray:
    """Rank order (a descending, id ascending) as argsort indices; +0 and -0 equal."""
    canonical = (a + np.float32(0.0)).astype(np.float32)  # -0 + 0 = +0
    ids = np.arange(a.shape[0])
    return np.lexsort((ids, -canonical))


def _kept_block(z, temperature, top_k, top_p, min_p, first_row) -> np.ndarray:
    rows, vocab = z.shape
    a = scaled_logits(z, temperature, first_row)
    kept = np.zeros((rows, vocab), dtype=np.int64)
    greedy = temperature == 0
    if greedy.any():
        g = np.flatnonzero(greedy)
        # argmax: first maximum (float comparison, so +0 = -0); a has no NaN here
        kept[g, np.argmax(a[g], axis=1)] = 1
    s = np.flatnonzero(~greedy)
    if s.size == 0:
        return kept
    a_s = a[s]
    m = a_s.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        d = (a_s - m).astype(np.float32)
    p = exp_f32(d)
    w = np.rint(p.astype(np.float64) * 2.0**WEIGHT_BITS).astype(np.int64)
    # min-p: w >= min_p 2^36, exact in float64 (w <= 2^36, the product a power-of-two scaling)
    w = np.where(w.astype(np.float64) >= (min_p[s] * 2.0**WEIGHT_BITS)[:, None], w, 0)
    for i, row in enumerate(s):
        k = int(top_k[row])
        if (k < 1 or k >= vocab) and top_p[row] == 1.0:
            kept[row] = w[i]
            continue
        # only tokens with w > 0 matter (they hold the first ranks); min-p kept a rank prefix
        candidates = np.flatnonzero(w[i] > 0)
        order = candidates[_order_keys(a_s[i, candidates])]
        if 1 <= k < order.size:
            order = order[:k]
        weights = w[i, order]
        if top_p[row] < 1.0:
            before = np.cumsum(weights) - weights                       # C_j, exact int64
            t = top_p_threshold(top_p[row:row + 1], weights.sum(keepdims=True).astype(np.uint64))[0]
            order = order[before.astype(np.uint64) < t]
        kept[row, order] = w[i, order]
    return kept


def _row_blocks(rows: int, vocab: int):
    step = max(1, _BLOCK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def kept_weights(logits, temperature, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """int64 [rows, V]: each row's kept integer weights w' (module docstring): the distribution
    `draw` samples from. Greedy rows (T = 0) are the point mass 1 on the argmax.

    logits float32 [rows, V]; temperature, top_k, top_p, min_p scalars or arrays [rows]
    (None: off, i.e. top_k 0, top_p 1, min_p 0)."""
    z = _check_logits(logits)
    rows, vocab = z.shape
    temperature, top_k, top_p, min_p = check_parameters(rows, temperature, top_k, top_p, min_p)
    out = np.zeros((rows, vocab), dtype=np.int64)
    for block in _row_blocks(rows, vocab):
        out[block] = _kept_block(z[block], temperature[block], top_k[block], top_p[block], min_p[block],
                                 block.start)
    return out


def draw(weights, random) -> np.ndarray:
    """int32 [rows]: the token whose range [K_v, K_v + w_v) (ascending ids) holds
    floor(r W / 2^64), W = the row's total weight. weights int64 [rows, V] (>= 0, W in [1, 2^63)),
    random uint64 [rows]."""
    weights = np.asarray(weights)
    if weights.ndim != 2 or weights.dtype.kind not in "iu":
        raise InputError(f"sampling: weights must be an integer matrix [rows, V], got "
                         f"{weights.dtype.name} of shape {weights.shape}")
    weights = weights.astype(np.int64)
    random = _unsigned("random", random, 64).reshape(-1)
    if random.shape[0] != weights.shape[0]:
        raise InputError(f"sampling: random must have shape ({weights.shape[0]},), got {random.shape}")
    if np.any(weights < 0):
        raise InputError("sampling: weights must be >= 0")
    prefix = np.cumsum(weights, axis=1)  # exact: the totals stay below 2^63
    total = prefix[:, -1] if weights.shape[1] else np.zeros(weights.shape[0], np.int64)
    if np.any(total < 1):
        raise InputError("sampling: every row needs a positive total weight")
    target, _ = mul_u64(random, total.astype(np.uint64))
    # the chosen token's index = the number of tokens whose range ends at or before the target
    return (prefix <= target.astype(np.int64)[:, None]).sum(axis=1).astype(np.int32)


def sample(logits, temperature, top_k=None, top_p=None, min_p=None, *, seed, request, sample_index,
           position) -> np.ndarray:
    """int32 [rows]: the sampled token of each row (module docstring).

    logits float32 [rows, V]; every other argument is a scalar or an array [rows]:
    temperature float64 >= 0 (0 = greedy), top_k int (< 1 = off), top_p in (0, 1],
    min_p in [0, 1], seed in [0, 2^64), request, sample_index, position in [0, 2^32).
    Raises InputError for a row with a NaN, +inf (also from z / T) or no finite logit."""
    z = _check_logits(logits)
    rows, vocab = z.shape
    temperature, top_k, top_p, min_p = check_parameters(rows, temperature, top_k, top_p, min_p)
    random = random_u64(*row_counters(rows, seed, request, sample_index, position))
    tokens = np.zeros(rows, dtype=np.int32)
    for block in _row_blocks(rows, vocab):
        kept = _kept_block(z[block], temperature[block], top_k[block], top_p[block], min_p[block], block.start)
        tokens[block] = draw(kept, random[block])
    return tokens


def row_counters(rows: int, seed, request, sample_index, position) -> list[np.ndarray]:
    """The four counter inputs, checked (seed in [0, 2^64), the others in [0, 2^32)) and
    broadcast to uint64 [rows]."""
    counters = []
    for name, value, bits in (("seed", seed, 64), ("request", request, 32), ("sample_index", sample_index, 32),
                              ("position", position, 32)):
        array = _unsigned(name, value, bits)
        if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != rows):
            raise InputError(f"sampling: {name} must be a scalar or have shape ({rows},), got shape {array.shape}")
        counters.append(np.broadcast_to(array, (rows,)))
    return counters


def sampled_logprobs(logits, tokens, temperature) -> np.ndarray:
    """float32 [rows]: logprob.logprobs(z, token, T) row by row at record_temperature(T), i.e. the
    log-prob the engine records and the trainer recomputes (rows grouped by temperature)."""
    z = _check_logits(logits)
    rows = z.shape[0]
    tokens = np.asarray(tokens)
    if tokens.shape != (rows,) or tokens.dtype.kind not in "iu" or np.any(tokens < 0) \
            or np.any(tokens >= z.shape[1]):
        raise InputError(f"sampling: tokens must be integers in [0, {z.shape[1]}) of shape ({rows},)")
    t = record_temperature(temperatures(temperature, rows))
    out = np.empty(rows, dtype=np.float32)
    for value in np.unique(t):
        group = np.flatnonzero(t == value)
        out[group] = logprob.logprobs(z[group], tokens[group].astype(np.int64), float(value))
    return out


def _all_logprobs(z: np.ndarray, temperature: float) -> np.ndarray:
    """Every entry's logprob.logprobs value, [rows, V] (the same float32 operations)."""
    _, _, d = logprob._shifted(z, temperature)
    with np.errstate(all="ignore"):
        p = exp_f32(d)
        _, ls = logprob._log_sum(p)
        return (d - ls[:, None]).astype(np.float32)


def top_logprobs(logits, temperature, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [rows, n], log-probs float32 [rows, n]): the n largest log-probs of each row
    at record_temperature(T), ordered by (log-prob descending, id ascending), +0 = -0; each
    value equals logprob.logprobs(z, id, T). n in [0, V]. Rows that `sample` refuses raise."""
    z = _check_logits(logits)
    rows, vocab = z.shape
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= vocab:
        raise InputError(f"sampling: the number of top log-probs must be an integer in [0, {vocab}], got {n!r}")
    n = int(n)
    t = record_temperature(temperatures(temperature, rows))
    ids = np.zeros((rows, n), dtype=np.int32)
    values = np.zeros((rows, n), dtype=np.float32)
    if n == 0 or rows == 0:
        return ids, values
    for block in _row_blocks(rows, vocab):
        scaled_logits(z[block], t[block], block.start)  # validity: the same refusals as sample
        for value in np.unique(t[block]):
            group = block.start + np.flatnonzero(t[block] == value)
            lp = _all_logprobs(z[group], float(value))
            for i, row in enumerate(group):
                row_lp = (lp[i] + np.float32(0.0)).astype(np.float32)  # -0 -> +0
                cut = np.partition(row_lp, vocab - n)[vocab - n]     # the n-th largest value
                candidates = np.flatnonzero(row_lp >= cut)           # every tie of it included
                order = candidates[np.lexsort((candidates, -row_lp[candidates]))][:n]
                ids[row] = order
                values[row] = lp[i, order]
    return ids, values
