"""Row fixed-point encoding and exact rounding back to float32: the NumPy reference.

This module is the executable form of contracts/fixedpoint.toml; the kernels in
backends/portable/fixedpoint.hip and backends/portable/common.h must equal it to the bit.

Encoding a float32 row x of length K with B bits (B counts the sign):
  * The row is *non-finite* if any element is NaN or +-inf. Its exponent is the
    sentinel NONFINITE_EXPONENT and its integers are all 0; every exact sum that
    uses the row is NaN (a canonical quiet NaN, bits 0x7FC00000).
  * Otherwise e = ilogb(max_i |x_i|), the exact binary exponent of the largest
    magnitude (so 2^e <= max|x| < 2^(e+1)); an all-zero or empty row has
    e = -149, the exponent of the smallest subnormal.
  * q_i = round_half_even(x_i * 2^(B-2-e)), clamped to [-(2^(B-1)-1), 2^(B-1)-1].
    The product is exact in float64 (a power-of-two scaling of a float32), so
    the only rounding is the one to an integer. |x_i| < 2^(e+1) keeps q inside
    B signed bits; the clamp only catches a round-up to 2^(B-1).
  * The row's value is q * 2^(e-B+2): the scale exponent is e - (B - 2).
  * A row may instead be encoded with a given exponent (quantize_rows's
    `exponents`): any e in [its own exponent, 127], or the sentinel. Tensor
    parallelism uses it: every K-shard of a row takes the MAX over the shards'
    exponents, which is the whole row's exponent, so each shard's q are exactly
    the whole row's q on that shard and the shards' integer dot products add up
    to the whole row's.
  * For int8 tensor cores q is split into n balanced base-256 digits
    d_j in [-128, 127] with q = sum_j d_j * 256^j (digit 0 least significant),
    n the fewest that reach 2^(B-1)-1 (slice_count: 15 bits -> 2, 23 bits -> 3).

Rounding an exact integer sum S back: y = RNE_f32(S * 2^s), rounded once. It is
computed as round-to-odd(S) to float64, an exact scaling by 2^s in float64, and
one round-to-nearest-even conversion to float32; rounding to odd at 53 bits and
then to nearest at <= 24 bits equals a single correct rounding (53 >= 24 + 2),
subnormal results included. Exact zero gives +0.
"""

from __future__ import annotations

import numpy as np

NONFINITE_EXPONENT = np.int32(2**31 - 1)
ZERO_ROW_EXPONENT = -149
MAX_FINITE_EXPONENT = 127  # ilogb(FLT_MAX)
CANONICAL_NAN_BITS = np.uint32(0x7FC00000)
CANONICAL_NAN = CANONICAL_NAN_BITS.view(np.float32)
MAX_BITS = 53  # q * 2^(B-2-e) must stay an exact float64 integer
#: the gemm's activation encoding (ops/gemm.py DEFAULT_BITS_A): 3 int8 digits; the fused kernels that
#: hand their output to a gemm encoded (norm add_rmsnorm, activation swiglu_encode) write this one
ACTIVATION_BITS = 23


def slice_count(bits: int) -> int:
    """Fewest balanced int8 digits that hold every q in [-(2^(B-1)-1), 2^(B-1)-1].

    n digits in [-128, 127] reach 127 * (256^n - 1) / 255, a little under 2^(8n-1):
    so 8 bits take 1 digit, 9..15 take 2, 16..23 take 3, 24..31 take 4.
    """
    n = 1
    while 2 ** (bits - 1) - 1 > 127 * (256**n - 1) // 255:
        n += 1
    return n


def check_bits(bits: int) -> None:
    if not 2 <= int(bits) <= MAX_BITS:
        raise ValueError(f"fixed-point bits must be in [2, {MAX_BITS}], got {bits}")


def row_exponents(x: np.ndarray) -> np.ndarray:
    """e per row: ilogb of the largest magnitude, -149 for zero rows, sentinel for non-finite rows."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[1] == 0:
        return np.full(x.shape[0], ZERO_ROW_EXPONENT, dtype=np.int32)
    largest = (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=1)
    # ilogb from frexp of the largest magnitude's exact float64 value (subnormals included: 2^-149 is normal
    # there); non-finite rows (a signalling NaN's conversion flags invalid) are overwritten below
    with np.errstate(invalid="ignore"):
        e = (np.frexp(largest.view(np.float32).astype(np.float64))[1] - 1).astype(np.int32)
    e[largest == 0] = ZERO_ROW_EXPONENT
    e[largest >= np.uint32(0x7F800000)] = NONFINITE_EXPONENT
    return e


def quantize_rows(x: np.ndarray, bits: int, exponents: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(q int64 [M, K], e int32 [M]) as defined in the module docstring.

    With `exponents` given, row m is encoded with exponents[m] instead of its own
    exponent (a K-shard of a longer row takes the whole row's exponent, so its q
    are exactly that row's q restricted to the shard). Each given exponent must
    cover its row (given_exponents_cover); a sentinel makes the row non-finite.
    """
    check_bits(bits)
    x = np.asarray(x, dtype=np.float32)
    if exponents is None:
        e = row_exponents(x)
    else:
        e = np.asarray(exponents, dtype=np.int32)
        if e.shape != (x.shape[0],) or not given_exponents_cover(x, e).all():
            raise ValueError("given exponents must be one per row, each the sentinel or in "
                             "[the row's own exponent, 127]")
    finite = e != NONFINITE_EXPONENT
    shift = np.where(finite, bits - 2 - e.astype(np.int64), 0)
    scaled = x.astype(np.float64) * np.ldexp(1.0, shift)[:, None]
    limit = float(2 ** (bits - 1) - 1)
    with np.errstate(invalid="ignore"):
        q = np.clip(np.rint(scaled), -limit, limit)
    q[~finite] = 0
    return q.astype(np.int64), e


def given_exponents_cover(x: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """bool [rows]: exponents[m] is a valid encoding exponent for row m of x.

    Valid means the sentinel, or an exponent in [row_exponents(x)[m], 127]: every
    |x_i| < 2^(e+1) then keeps q inside B signed bits (the clamp only catches the
    round-up to 2^(B-1), as without given exponents), and a non-finite row can
    only take the sentinel. An all-reduce MAX of row_exponents over K-shards
    always gives valid exponents for every shard.
    """
    e = np.asarray(exponents).astype(np.int64)
    sentinel = e == int(NONFINITE_EXPONENT)
    return sentinel | ((e >= row_exponents(x)) & (e <= MAX_FINITE_EXPONENT))


def split_digits(q: np.ndarray, bits: int) -> np.ndarray:
    """Balanced base-256 digits of q: int8 [n, *q.shape], digit 0 least significant."""
    digits = []
    rest = np.asarray(q, dtype=np.int64)
    for _ in range(slice_count(bits)):
        digit = ((rest + 128) & 255) - 128
        digits.append(digit.astype(np.int8))
        rest = (rest - digit) >> 8
    if np.any(rest != 0):
        raise AssertionError("value does not fit the digit count")
    return np.stack(digits)


def join_digits(digits: np.ndarray) -> np.ndarray:
    """Inverse of split_digits."""
    q = np.zeros(digits.shape[1:], dtype=np.int64)
    for j in range(digits.shape[0] - 1, -1, -1):
        q = q * 256 + digits[j].astype(np.int64)
    return q


def round_to_odd_f64(s: np.ndarray) -> np.ndarray:
    """int64 -> float64 rounded to odd: exact values stay, inexact ones take the odd neighbour."""
    s = np.asarray(s, dtype=np.int64)
    nearest = s.astype(np.float64)
    # |s| < 2^62 here, so the float64 value converts back to int64 without overflow
    remainder = s - nearest.astype(np.int64)
    raw = nearest.view(np.int64).copy()
    away = ((s > 0) & (remainder < 0)) | ((s < 0) & (remainder > 0))
    raw[away] -= 1  # one step toward zero: the truncated neighbour
    inexact = remainder != 0
    raw[inexact] |= 1
    return raw.view(np.float64)


def pow2_f64(s: np.ndarray) -> np.ndarray:
    """2^s as float64 built from its exponent bits; s must lie in [-1022, 1023]."""
    s = np.asarray(s, dtype=np.int64)
    return ((s + 1023) << 52).view(np.float64)


def round_scaled(s_int: np.ndarray, scale_exponent: np.ndarray) -> np.ndarray:
    """RNE_f32(S * 2^s) with one rounding; S int64 with |S| < 2^62, s in [-1022, 1023]."""
    odd = round_to_odd_f64(s_int)
    with np.errstate(over="ignore"):
        return (odd * pow2_f64(scale_exponent)).astype(np.float32)


def scale_exponent(e: np.ndarray, bits: int) -> np.ndarray:
    """Exponent of the row's unit in the last place: q * 2^(e - (B - 2))."""
    return e.astype(np.int64) - (bits - 2)
