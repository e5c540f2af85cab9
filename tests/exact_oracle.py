"""An independent exact oracle for the tests: Python integers and Fractions, no NumPy arithmetic."""

from __future__ import annotations

import math
import struct
from fractions import Fraction


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def round_fraction_to_f32(value: Fraction) -> int:
    """Bits of RNE_f32(value), exact, subnormals and overflow included."""
    if value == 0:
        return 0
    sign = 0x80000000 if value < 0 else 0
    magnitude = abs(value)
    exponent = math.floor(math.log2(magnitude.numerator) - math.log2(magnitude.denominator))
    while Fraction(2) ** exponent > magnitude:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    exponent = max(exponent, -126)  # subnormals share the smallest normal exponent's spacing
    ulp = Fraction(2) ** (exponent - 23)
    units = magnitude / ulp
    integer = units.numerator // units.denominator
    remainder = units - integer
    if remainder > Fraction(1, 2) or (remainder == Fraction(1, 2) and integer % 2 == 1):
        integer += 1
    scaled = Fraction(integer) * ulp
    if scaled >= Fraction(2) ** 128 - Fraction(2) ** 103:  # rounds beyond FLT_MAX
        return sign | 0x7F800000
    return sign | f32_bits(float(scaled))


def ilogb(value: float) -> int:
    mantissa, exponent = math.frexp(abs(value))
    return exponent - 1


def quantize(row: list[float], bits: int) -> tuple[list[int], int]:
    largest = max((abs(v) for v in row), default=0.0)
    e = -149 if largest == 0 else ilogb(largest)
    limit = 2 ** (bits - 1) - 1
    q = []
    for v in row:
        scaled = Fraction(v) * Fraction(2) ** (bits - 2 - e)
        n = round(scaled)  # Python rounds Fractions half to even
        q.append(max(-limit, min(limit, n)))
    return q, e
