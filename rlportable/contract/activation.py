"""SwiGLU: reference of contracts/activation.toml.

  silu_times(g, u) = RNE_f32((float64(g) / (1 + float64(exp_f32(-g)))) * float64(u))
with exp_f32 the contract's correctly rounded exp and IEEE float64 add, divide,
multiply (the division rounds in float64, the product too, then one conversion).
A NaN result (a NaN input, -inf gate, inf * 0) is the canonical NaN 0x7FC00000.
swiglu_backward is its gradient (dgate, dup) in fixed float64 steps with the same exp_f32.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract.elementwise import exp_f32
from rlportable.contract.fixedpoint import ACTIVATION_BITS, CANONICAL_NAN, quantize_rows


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate = np.asarray(gate, dtype=np.float32)
    e = exp_f32(-gate).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        silu = gate.astype(np.float64) / (1.0 + e)
        y = (silu * np.asarray(up, dtype=np.float32).astype(np.float64)).astype(np.float32)
    y[np.isnan(y)] = CANONICAL_NAN
    return y


@np.errstate(all="ignore")  # overflow to inf and NaN (signalling ones included) are defined results, not warnings
def swiglu_encode(gate: np.ndarray, up: np.ndarray, bits: int = ACTIVATION_BITS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(y, q, e): y = swiglu(gate, up) of rows, and its fixed-point encoding (fixedpoint.quantize_rows:
    the integers q and row exponents e the gemm's digits split). By definition the two in turn."""
    y = swiglu(gate, up)
    q, e = quantize_rows(y, bits)
    return y, q, e


def swiglu_backward(gate: np.ndarray, up: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dgate, dup) float32 of y = swiglu(gate, up) for the upstream dy, elementwise:
      E = float64(exp_f32(-g)),  d = 1 + E,  silu = g / d,  sig = 1 / d
      dup   = RNE_f32(dy * silu)
      dgate = RNE_f32((dy * u) * (sig * (1 + g * (1 - sig))))   (dy * u exact)
    every step an IEEE float64 operation in this order, one conversion per output.
    A NaN result (NaN input, g = +-inf: inf * 0 in dgate, -inf / inf in dup) is the canonical NaN.
    """
    gate = np.asarray(gate, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # non-finite inputs are defined above
        e = exp_f32(-gate).astype(np.float64)
        g = gate.astype(np.float64)
        u = np.asarray(up, dtype=np.float32).astype(np.float64)
        d_out = np.asarray(dy, dtype=np.float32).astype(np.float64)
        denominator = 1.0 + e
        silu = g / denominator
        sig = 1.0 / denominator
        dsilu = sig * (1.0 + g * (1.0 - sig))
        dup = (d_out * silu).astype(np.float32)
        dgate = ((d_out * u) * dsilu).astype(np.float32)
    dup[np.isnan(dup)] = CANONICAL_NAN
    dgate[np.isnan(dgate)] = CANONICAL_NAN
    return dgate, dup
