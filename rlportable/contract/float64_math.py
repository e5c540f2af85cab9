"""The contract's own float64 exp, log, sin and cos, for tables computed once on the host.

Built only from IEEE-754 binary64 add, subtract, multiply, divide and
conversions (NumPy never fuses them), so every host computes the same bits;
libm (and NumPy's SIMD transcendental functions) differ between platforms.
Accuracy is a few ulp of float64, far below the float32 tables made from them
(the RoPE frequencies and angles, contracts/rope.toml).
"""

from __future__ import annotations

import math

import numpy as np

# Cody-Waite splits: the high parts have trailing zero bits, so k * HI is exact for |k| < 2^20.
LN2_HI = float.fromhex("0x1.62e42fee00000p-1")
LN2_LO = float.fromhex("0x1.a39ef35793c76p-33")
INV_LN2 = float.fromhex("0x1.71547652b82fep+0")
PIO2_1 = float.fromhex("0x1.921fb54400000p+0")  # first 33 bits of pi/2
PIO2_2 = float.fromhex("0x1.0b4611a600000p-34")  # next 33 bits
PIO2_3 = float.fromhex("0x1.3198a2e037073p-69")  # the rest
TWO_OVER_PI = float.fromhex("0x1.45f306dc9c883p-1")

_EXP_TERMS = 18  # |r| <= ln2/2: r^18/18! < 1e-24
_SIN_TERMS = 13  # |r| <= pi/4: r^25/25! < 1e-27
_LOG_TERMS = 13  # |z| <= 0.1716: z^27 < 1e-20
_INV_FACTORIAL = [1.0 / math.factorial(n) for n in range(2 * _SIN_TERMS + 2)]  # correctly rounded


def _pow2(k: np.ndarray) -> np.ndarray:
    return ((np.asarray(k, dtype=np.int64) + 1023) << 52).view(np.float64)


def exp64(x: np.ndarray) -> np.ndarray:
    """e^x for |x| <= 700 (the range the tables need)."""
    x = np.asarray(x, dtype=np.float64)
    k = np.rint(x * INV_LN2)
    r = (x - k * LN2_HI) - k * LN2_LO
    total = np.full_like(r, _INV_FACTORIAL[_EXP_TERMS - 1])
    for n in range(_EXP_TERMS - 2, -1, -1):
        total = total * r + _INV_FACTORIAL[n]
    return total * _pow2(k.astype(np.int64))


def log64(x: np.ndarray) -> np.ndarray:
    """ln x for positive normal x."""
    x = np.asarray(x, dtype=np.float64)
    bits = x.view(np.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(np.float64)  # m in [1, 2)
    big = m > float.fromhex("0x1.6a09e667f3bcdp+0")  # sqrt(2)
    m = np.where(big, m * 0.5, m)
    e = np.where(big, e + 1, e).astype(np.float64)
    z = (m - 1.0) / (m + 1.0)
    z2 = z * z
    total = np.full_like(z, 1.0 / (2 * _LOG_TERMS + 1))
    for n in range(_LOG_TERMS - 1, -1, -1):
        total = total * z2 + 1.0 / (2 * n + 1)
    return e * LN2_HI + (2.0 * z * total + e * LN2_LO)


def sincos64(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sin a, cos a) for 0 <= a < 2^20."""
    a = np.asarray(a, dtype=np.float64)
    n = np.rint(a * TWO_OVER_PI)
    r = ((a - n * PIO2_1) - n * PIO2_2) - n * PIO2_3
    r2 = r * r
    sin_r = np.full_like(r, _INV_FACTORIAL[2 * _SIN_TERMS + 1] * (-1) ** _SIN_TERMS)
    for j in range(_SIN_TERMS - 1, -1, -1):
        sin_r = sin_r * r2 + _INV_FACTORIAL[2 * j + 1] * (-1) ** j
    sin_r = sin_r * r
    cos_r = np.full_like(r, _INV_FACTORIAL[2 * _SIN_TERMS] * (-1) ** _SIN_TERMS)
    for j in range(_SIN_TERMS - 1, -1, -1):
        cos_r = cos_r * r2 + _INV_FACTORIAL[2 * j] * (-1) ** j
    quadrant = n.astype(np.int64) & 3
    sin = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [sin_r, cos_r, -sin_r], -cos_r)
    cos = np.select([quadrant == 0, quadrant == 1, quadrant == 2], [cos_r, -sin_r, -cos_r], sin_r)
    return sin, cos
