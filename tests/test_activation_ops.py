"""Op family "activation" (SwiGLU) on the cpu backend: float64 accuracy, edge cases, input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import activation as reference
from rlportable.errors import InputError
from rlportable.ops import activation
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


@pytest.mark.parametrize("scale", [1.0, 10.0, 1e-3])
def test_close_to_float64_math(scale):
    # Tolerance: exp_f32 is correctly rounded (relative error <= 2^-24), which moves 1 + e by at
    # most 2^-24 relative; the float64 division and product add ~2^-52 each, the conversion to
    # float32 2^-24. So at most 2^-23 relative, plus the subnormal spacing for tiny results.
    rng = np.random.default_rng(int(scale * 1000))
    gate = (random_rows(rng, 33, 257, "normal") * np.float32(scale)).astype(np.float32)
    up = random_rows(rng, 33, 257, "normal")
    y = activation.swiglu(CPU, gate, up)
    g, u = gate.astype(np.float64), up.astype(np.float64)
    np.testing.assert_allclose(y, g / (1.0 + np.exp(-g)) * u, rtol=2.0**-23, atol=2.0**-149)


def test_edge_cases():
    gate = np.array([0.0, -0.0, -100.0, np.inf, -np.inf, np.nan, np.inf, 1e-45], dtype=np.float32)
    up = np.array([1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 1.0], dtype=np.float32)
    bits = activation.swiglu(CPU, gate, up).view(np.uint32).tolist()
    assert bits[0] == 0x00000000 and bits[1] == 0x80000000  # +-0 / 2 keeps the sign
    assert bits[2] == 0x80000000  # g < -89: exp(-g) = inf, silu = -0
    assert bits[3] == 0x7F800000  # +inf * 2
    assert bits[4] == bits[5] == bits[6] == 0x7FC00000  # -inf/inf, NaN, inf * 0: canonical NaN
    assert bits[7] == 0x00000000  # 1e-45 / 2 rounds to even: +0


def test_any_shape_and_elementwise():
    rng = np.random.default_rng(1)
    gate = random_rows(rng, 4 * 3, 5, "special").reshape(4, 3, 5)
    up = random_rows(rng, 4 * 3, 5, "normal").reshape(4, 3, 5)
    y = activation.swiglu(CPU, gate, up)
    assert y.shape == (4, 3, 5) and y.dtype == np.float32
    flat = reference.swiglu(gate.ravel(), up.ravel())
    assert np.array_equal(y.ravel().view(np.uint32), flat.view(np.uint32))


def test_input_errors():
    with pytest.raises(InputError, match=r"gate \(2, 3\) and up \(3, 2\) must have the same shape"):
        activation.swiglu(CPU, np.ones((2, 3), np.float32), np.ones((3, 2), np.float32))
    with pytest.raises(InputError, match="up must have dtype float32"):
        activation.swiglu(CPU, np.ones(3, np.float32), np.ones(3, np.float64))
