"""The contract exp's fast path (rlp_exp_f32 in backends/{cuda,hip}/contract_math.*), mirrored in Python.

The device function first evaluates e^x in a few fused multiply-adds and keeps the result only where its
float32 rounding is certain; otherwise, and for |x| > 87, the full evaluation (the reference's operations)
decides. Both are correctly rounded, so the bits are the contract's. On the GPU, `rlportable conform
--exhaustive --only exp_f32` grades all 2^32 inputs (conformance/results/conform_cuda*_exp_fast_exhaustive_h200.json).
Here, without a GPU: the same steps in Python, with each fused multiply-add exact (Fraction arithmetic, one
rounding to nearest even), on the constants parsed from the sources, against the reference exp_f32.
"""

from __future__ import annotations

import re
import struct
from fractions import Fraction

import numpy as np
import pytest

from rlportable.contract import elementwise as reference
from rlportable.resources import resource_dir

HEADER = resource_dir("backends") / "portable" / "contract_math.h"  # both vendors' exp
_HEX = r"-?0x[0-9a-fA-F.]+p[+-]?\d+"


def _constants(text: str) -> dict:
    found = {name: float.fromhex(value.strip("()"))
             for name, value in re.findall(r"#define (RLP_E\w+) \(?(" + _HEX + r")\)?", text)}
    for table in ("rlp_exp_t_hi", "rlp_exp_t_lo"):
        body = text[text.index(f"double {table}[64] = {{"):]
        body = body[body.index("{") + 1:body.index("}")]
        found[table] = [float.fromhex(v) for v in re.findall(_HEX, body)]
        assert len(found[table]) == 64
    found["window"] = int(re.search(r"#define RLP_EXP_FAST_WINDOW (\d+)", text).group(1))
    found["limit"] = int(re.search(r"#define RLP_EXP_FAST_X_BITS (0x[0-9A-Fa-f]+)u", text).group(1), 16)
    return found


def _fma(a: float, b: float, c: float) -> float:
    """a * b + c rounded once to nearest even (int / int true division in Python is correctly rounded)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def fast_exp(x: np.float32, k: dict) -> np.float32 | None:
    """rlp_exp_f32's fast path, step for step; None where the device defers to the full evaluation."""
    if int(np.array(x).view(np.uint32)) & 0x7FFFFFFF > k["limit"]:
        return None
    xd = float(x)
    t = _fma(xd, k["RLP_EXP_INV_LN2_64"], k["RLP_EW_SHIFT"])
    n = _bits(t) - _bits(k["RLP_EW_SHIFT"])
    fn = t - k["RLP_EW_SHIFT"]
    r = _fma(-fn, k["RLP_EXP_LN2_64_LO"], _fma(-fn, k["RLP_EXP_LN2_64_HI"], xd))
    c = _fma(r, k["RLP_EXP_P6"], k["RLP_EXP_P5"])
    for name in ("RLP_EXP_P4", "RLP_EXP_P3", "RLP_EXP_P2"):
        c = _fma(r, c, k[name])
    p = _fma(r * r, c, r)
    j = n & 63
    y = k["rlp_exp_t_hi"][j] + _fma(k["rlp_exp_t_hi"][j], p, k["rlp_exp_t_lo"][j])
    low = _bits(y) & ((1 << 29) - 1)
    if abs(low - (1 << 28)) <= k["window"]:
        return None
    return np.float32(y * 2.0 ** (n >> 6))  # a power-of-two scaling (exact), then one RNE to float32


def test_the_fast_path_covers_the_range_its_constants_state():
    assert _constants(HEADER.read_text())["limit"] == int(np.array(87.0, np.float32).view(np.uint32))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_fast_path_gives_the_reference_bits(seed):
    k = _constants(HEADER.read_text())
    rng = np.random.default_rng(seed)
    wide = rng.uniform(-87.0, 87.0, 3000)
    near_zero = rng.standard_normal(1000) * 10.0 ** rng.uniform(-12, 1, 1000)
    special = [0.0, -0.0, 1e-45, -1e-45, 2.0 ** -30, -(2.0 ** -30), 87.0, -87.0, 1.0, -1.0, 0.5, 88.0, -88.0]
    x = np.concatenate([wide, near_zero, special]).astype(np.float32)
    want = reference.exp_f32(x).view(np.uint32)
    deferred = 0
    for value, expected in zip(x, want):
        got = fast_exp(value, k)
        if got is None:
            deferred += 1
            continue
        assert int(np.array(got).view(np.uint32)) == int(expected), float(value)
    assert deferred <= 2 + 2  # the inputs beyond 87 in magnitude, and next to none from the window


def test_the_fast_path_defers_outside_its_range_and_on_nan():
    k = _constants(HEADER.read_text())
    for value in (np.float32(88.0), np.float32(-90.0), np.float32(np.inf), np.float32(np.nan)):
        assert fast_exp(value, k) is None
