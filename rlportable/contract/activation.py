"""SwiGLU: reference of contracts/activation.toml.

  silu_times(g, u) = RNE_f32((float64(g) / (1 + float64(exp_f32(-g)))) * float64(u))
with exp_f32 the contract's correctly rounded exp and IEEE float64 add, divide,
multiply (the division rounds in float64, the product too, then one conversion).
A NaN result (a NaN input, -inf gate, inf * 0) is the canonical NaN 0x7FC00000.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract.elementwise import exp_f32
from rlportable.contract.fixedpoint import CANONICAL_NAN


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    gate = np.asarray(gate, dtype=np.float32)
    e = exp_f32(-gate).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        silu = gate.astype(np.float64) / (1.0 + e)
        y = (silu * np.asarray(up, dtype=np.float32).astype(np.float64)).astype(np.float32)
    y[np.isnan(y)] = CANONICAL_NAN
    return y
