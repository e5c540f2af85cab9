"""Op family "norm" on the cpu backend: the reference's properties, the op's input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from exact_oracle import quantize
from rlportable.conform.inputs import random_rows
from rlportable.contract import fixedpoint as fp, norm as reference
from rlportable.errors import InputError
from rlportable.ops import norm
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
NAN_BITS = 0x7FC00000


def _float64_rmsnorm(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * w.astype(np.float64)


@pytest.mark.parametrize("kind", ["normal", "massive"])
@pytest.mark.parametrize("h", [7, 128, 1000, 5120])
def test_close_to_float64_math(kind, h):
    # Tolerance: the 23-bit encoding rounds each x_i by at most 2^(e-22) (half a unit of 2^(e-21)),
    # so sum x^2 moves by at most 2^(e-21) sum|x_i| <= 2^-21 (max|x| sum|x| / sum x^2) relative:
    # about 3.2 * 2^-21 = 1.5e-6 for Gaussian rows, less with a massive channel. r takes half of it;
    # the float64 steps add ~2^-52 and the final conversion 2^-24. So 4e-6 relative, with margin.
    rng = np.random.default_rng(h)
    x = random_rows(rng, 9, h, kind)
    w = random_rows(rng, 1, h, "normal")[0]
    y = norm.rmsnorm(CPU, x, w, 1e-6)
    np.testing.assert_allclose(y, _float64_rmsnorm(x, w, 1e-6), rtol=4e-6, atol=0)


def test_sum_of_squares_is_exact():
    x = random_rows(np.random.default_rng(3), 4, 300, "massive")
    r, finite = reference.rms_scale(x, 1e-5)
    assert finite.all()
    for row in range(4):
        q, e = quantize([float(v) for v in x[row]], reference.NORM_BITS)
        ss = sum(v * v for v in q)  # exact Python integers
        mean = float(ss) * 2.0 ** (2 * (e - (reference.NORM_BITS - 2))) / 300.0
        assert r[row] == 1.0 / np.sqrt(mean + 1e-5)


def test_edge_cases():
    w = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    x = np.array([[1.0, np.nan, 2.0], [np.inf, 1.0, 1.0], [0.0, -0.0, 0.0], [1e-45, -1e-45, 0.0],
                  [3e38, -3e38, 1.0]], dtype=np.float32)
    y = norm.rmsnorm(CPU, x, w, 1e-6)
    bits = y.view(np.uint32)
    assert (bits[0] == NAN_BITS).all() and (bits[1] == NAN_BITS).all()  # non-finite rows
    assert bits[2].tolist() == [0x00000000, 0x00000000, 0x00000000]  # +0*1, -0*-2, +0*0.5
    assert np.isfinite(y[3:]).all()
    # a subnormal row is kept (no flush to zero): eps dominates, y = x / sqrt(1e-6) * w
    assert abs(float(y[3, 0]) / (float(np.float32(1e-45)) * 1000.0) - 1.0) < 1e-3 and y[3, 1] > 0
    assert abs(float(y[4, 0]) - np.sqrt(1.5)) < 1e-6  # no overflow near FLT_MAX
    # NaN from the weight or from eps = 0 on a zero row is the canonical NaN
    y = norm.rmsnorm(CPU, np.array([[1.0, 2.0, 3.0]], dtype=np.float32),
                     np.array([np.nan, np.inf, 1.0], dtype=np.float32), 1e-6)
    assert y.view(np.uint32)[0, 0] == NAN_BITS and y[0, 1] == np.inf
    y = norm.rmsnorm(CPU, np.zeros((1, 3), dtype=np.float32), w, 0.0)
    assert (y.view(np.uint32) == NAN_BITS).all()


def test_rows_are_independent():
    x = random_rows(np.random.default_rng(11), 20, 96, "massive")
    w = random_rows(np.random.default_rng(12), 1, 96, "normal")[0]
    full = norm.rmsnorm(CPU, x, w, 1e-6)
    for row in (0, 7, 19):
        assert np.array_equal(norm.rmsnorm(CPU, x[row:row + 1], w, 1e-6).view(np.uint32), full[row:row + 1].view(np.uint32))
    permutation = np.random.default_rng(1).permutation(20)
    assert np.array_equal(norm.rmsnorm(CPU, x[permutation], w, 1e-6).view(np.uint32), full[permutation].view(np.uint32))


def test_qk_norm_is_rmsnorm_per_head():
    x = random_rows(np.random.default_rng(2), 5 * 4, 64, "normal").reshape(5, 4, 64)
    w = random_rows(np.random.default_rng(3), 1, 64, "normal")[0]
    y = norm.rmsnorm_heads(CPU, x, w, 1e-6)
    assert y.shape == (5, 4, 64)
    assert np.array_equal(y.reshape(20, 64).view(np.uint32), reference.rmsnorm(x.reshape(20, 64), w, 1e-6).view(np.uint32))


def test_empty_shapes():
    assert norm.rmsnorm(CPU, np.zeros((0, 8), np.float32), np.ones(8, np.float32), 1e-6).shape == (0, 8)
    assert norm.rmsnorm(CPU, np.zeros((3, 0), np.float32), np.ones(0, np.float32), 1e-6).shape == (3, 0)


@pytest.mark.parametrize("x,w,eps,message", [
    (np.ones(4, np.float32), np.ones(4, np.float32), 1e-6, "x must be a 2-D"),
    (np.ones((2, 4), np.float64), np.ones(4, np.float32), 1e-6, "x must have dtype float32"),
    (np.ones((2, 4), np.float32), np.ones(5, np.float32), 1e-6, r"weight must be float32 of shape \(4,\)"),
    (np.ones((2, 4), np.float32), np.ones(4, np.float64), 1e-6, "weight must be float32"),
    (np.ones((2, 4), np.float32), np.ones(4, np.float32), -1.0, "eps must be a finite number >= 0"),
    (np.ones((2, 4), np.float32), np.ones(4, np.float32), float("nan"), "eps must be"),
    (np.ones((1, 2**18 + 1), np.float32), np.ones(2**18 + 1, np.float32), 1e-6, "exceeds the contract's limit"),
])
def test_input_errors(x, w, eps, message):
    with pytest.raises(InputError, match=message):
        norm.rmsnorm(CPU, x, w, eps)
    assert fp.CANONICAL_NAN_BITS == NAN_BITS
