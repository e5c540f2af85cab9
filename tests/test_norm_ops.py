"""Op family "norm" on the cpu backend: the reference's properties (forward and backward), the op's input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from exact_oracle import ilogb, quantize, round_fraction_to_f32
from recording_device import RecordingDevice, kernel_parameters

from rlportable.conform.inputs import random_rows
from rlportable.contract import fixedpoint as fp
from rlportable.contract import norm as reference
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


# ---- backward: rmsnorm_backward, rmsnorm_heads_backward


def _float64_rmsnorm_backward(x, w, eps, dy):
    """The textbook gradient in float64 with the float64 r (not the contract's fixed-point r)."""
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    h = x.shape[1]
    r = 1.0 / np.sqrt((x64 * x64).mean(axis=1) + eps)
    g = dy64 * w64
    s = (g * x64).sum(axis=1)
    dx = g * r[:, None] - x64 * (r**3 * s / h)[:, None]
    return dx, (dy64 * x64 * r[:, None]).sum(axis=0)


def _backward_error_bounds(x, w, eps, dy):
    """Per-element bounds on |contract - float64 math| for dx and dweight.

    r: the 23-bit encoding moves each x_j by at most one unit 2^u, u = e - 21 (half a unit, a whole
    one where the clamp bites), so sum x^2 moves by at most d = 2^(u+1) sum|x| + H 2^(2u) and r by
    d / (2 sum x^2) relative; we use delta = d / sum x^2 (twice that, covering the float64 steps).
    dx = A - B with A = r g_i and B = x_i r^3 s / H: A moves by delta |A|, B by 3 delta |B| (r^3),
    plus s's fixed-point error: H half-units of 2^(e_t - 42) and a 2^-52 relative float64 rounding
    per term; then the float32 conversion, 2^-24 relative (or half the subnormal spacing).
    dweight = sum_rows dy x r: delta |u| per row, rows half-units of 2^(e_u - 36), 2^-52 per term,
    then 2^-24 relative.
    """
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    rows, h = x.shape
    dx64, dw64 = _float64_rmsnorm_backward(x, w, eps, dy)
    e = np.array([ilogb(float(np.abs(row).max())) for row in x64])
    unit = 2.0 ** (e - 21)
    ss = (x64 * x64).sum(axis=1)
    delta = (2 * unit * np.abs(x64).sum(axis=1) + h * unit**2) / ss + 2.0**-50
    r = 1.0 / np.sqrt(ss / h + eps)
    g = dy64 * w64
    t = g * x64
    e_t = np.array([ilogb(float(np.abs(row).max())) for row in t])
    s_error = h * 2.0 ** (e_t - 43) + np.abs(t).sum(axis=1) * 2.0**-52
    a = np.abs(g * r[:, None])
    b = np.abs(x64 * (r**3 * t.sum(axis=1) / h)[:, None])
    dx_bound = (delta[:, None] * (a + 3.1 * b) + np.abs(x64) * (r**3 * s_error / h)[:, None] * 1.01
                + 2.0**-24 * np.abs(dx64) * 1.01 + 2.0**-150)
    u = dy64 * x64 * r[:, None]
    e_u = np.array([ilogb(float(np.abs(col).max())) for col in u.T])
    dw_bound = ((np.abs(u) * delta[:, None]).sum(axis=0) + rows * 2.0 ** (e_u - 37)
                + np.abs(u).sum(axis=0) * 2.0**-52) * 1.01 + 2.0**-24 * np.abs(dw64) * 1.01 + 2.0**-150
    return dx64, dx_bound, dw64, dw_bound


@pytest.mark.parametrize("kind", ["normal", "massive"])
@pytest.mark.parametrize("h", [7, 128, 1000, 5120])
def test_backward_close_to_float64_math(kind, h):
    rng = np.random.default_rng(100 + h)
    x = random_rows(rng, 9, h, kind)
    w = random_rows(rng, 1, h, "normal")[0]
    dy = random_rows(rng, 9, h, "normal")
    dx, dweight = norm.rmsnorm_backward(CPU, x, w, 1e-6, dy)
    dx64, dx_bound, dw64, dw_bound = _backward_error_bounds(x, w, 1e-6, dy)
    assert np.all(np.abs(dx - dx64) <= dx_bound)
    assert np.all(np.abs(dweight - dw64) <= dw_bound)
    # the bound is not vacuous: under ten float32 ulps of the row's scale for a typical element
    assert np.median(dx_bound / np.abs(dx64).max(axis=1, keepdims=True)) < 1e-6


def _float64_loss(x64, w64, eps, dy64):
    y = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + eps) * w64
    return float((dy64 * y).sum())


@pytest.mark.parametrize("h", [13, 16])
def test_backward_matches_finite_differences(h):
    # Central differences of the float64 loss L = sum(dy * rmsnorm64(x, w)) with step 1e-5: truncation
    # error ~ step^2 |L'''| / 6 and cancellation ~ 2^-52 |L| / step, both ~1e-10 here (O(1) inputs);
    # 1e-8 absolute is checked against the float64 analytic gradient first. The contract's values must
    # then lie within the analytic bound of _backward_error_bounds plus that 1e-8.
    rng = np.random.default_rng(h)
    x = random_rows(rng, 3, h, "normal")
    w = random_rows(rng, 1, h, "normal")[0]
    dy = random_rows(rng, 3, h, "normal")
    eps, step = 1e-5, 1e-5
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    fd_x = np.zeros_like(x64)
    for i in np.ndindex(x.shape):
        plus, minus = x64.copy(), x64.copy()
        plus[i] += step
        minus[i] -= step
        fd_x[i] = (_float64_loss(plus, w64, eps, dy64) - _float64_loss(minus, w64, eps, dy64)) / (2 * step)
    fd_w = np.zeros_like(w64)
    for i in range(h):
        plus, minus = w64.copy(), w64.copy()
        plus[i] += step
        minus[i] -= step
        fd_w[i] = (_float64_loss(x64, plus, eps, dy64) - _float64_loss(x64, minus, eps, dy64)) / (2 * step)
    dx64, dx_bound, dw64, dw_bound = _backward_error_bounds(x, w, eps, dy)
    assert np.abs(fd_x - dx64).max() < 1e-8 and np.abs(fd_w - dw64).max() < 1e-8
    dx, dweight = norm.rmsnorm_backward(CPU, x, w, eps, dy)
    assert np.all(np.abs(dx - fd_x) <= dx_bound + 1e-8)
    assert np.all(np.abs(dweight - fd_w) <= dw_bound + 1e-8)


def _exact_fixed_point_sum(terms: list[float], bits: int) -> tuple[int, int]:
    """(Q, e) with Python integers: e = ilogb(max |t|) (0 if all zero), Q = sum RNE(t 2^(bits-2-e))."""
    largest = max(abs(t) for t in terms)
    e = ilogb(largest) if largest else 0
    return sum(round(Fraction(t) * Fraction(2) ** (bits - 2 - e)) for t in terms), e


def test_backward_sums_are_exact():
    # s over H and dweight over rows against an independent exact oracle (Python integers, Fractions)
    rng = np.random.default_rng(7)
    rows, h = 6, 300
    x, dy = random_rows(rng, rows, h, "massive"), random_rows(rng, rows, h, "special")
    w = random_rows(rng, 1, h, "normal")[0]
    t = (dy.astype(np.float64) * w.astype(np.float64)) * x.astype(np.float64)
    total, e, finite = reference.fixed_point_sums(t, reference.GRAD_SUM_BITS)
    assert finite.all()
    for row in range(rows):
        expected = _exact_fixed_point_sum([float(v) for v in t[row]], reference.GRAD_SUM_BITS)
        assert (int(total[row]), int(e[row])) == expected
    _, dweight = reference.rmsnorm_backward(x, w, 1e-6, dy)
    r, _ = reference.rms_scale(x, 1e-6)
    u = (dy.astype(np.float64) * x.astype(np.float64)) * r[:, None]
    for column in range(0, h, 37):
        q_sum, e_u = _exact_fixed_point_sum([float(v) for v in u[:, column]], reference.WEIGHT_GRAD_BITS)
        exact = Fraction(q_sum) * Fraction(2) ** (e_u - (reference.WEIGHT_GRAD_BITS - 2))
        assert int(dweight.view(np.uint32)[column]) == round_fraction_to_f32(exact)


def test_backward_rows_and_order():
    rng = np.random.default_rng(21)
    x, dy = random_rows(rng, 40, 96, "massive"), random_rows(rng, 40, 96, "normal")
    w = random_rows(rng, 1, 96, "normal")[0]
    dx, dweight = norm.rmsnorm_backward(CPU, x, w, 1e-6, dy)
    permutation = rng.permutation(40)
    dx_p, dweight_p = norm.rmsnorm_backward(CPU, x[permutation], w, 1e-6, dy[permutation])
    assert np.array_equal(dx_p.view(np.uint32), dx[permutation].view(np.uint32))
    assert np.array_equal(dweight_p.view(np.uint32), dweight.view(np.uint32))  # an exact sum: order-free
    for row in (0, 17, 39):
        one, _ = norm.rmsnorm_backward(CPU, x[row:row + 1], w, 1e-6, dy[row:row + 1])
        assert np.array_equal(one.view(np.uint32), dx[row:row + 1].view(np.uint32))


def test_backward_op_is_the_reference_bitwise():
    rng = np.random.default_rng(4)
    for rows, h in ((1, 1), (7, 13), (5, 257), (3, 1000)):
        for kind in ("normal", "tiny", "huge", "special", "nonfinite", "zeros"):
            x, dy = random_rows(rng, rows, h, kind), random_rows(rng, rows, h, "normal")
            w = random_rows(rng, 1, h, "normal")[0]
            got = norm.rmsnorm_backward(CPU, x, w, 1e-5, dy)
            expected = reference.rmsnorm_backward(x, w, 1e-5, dy)
            for a, b in zip(got, expected):
                assert a.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_backward_edge_cases():
    w = np.array([1.0, -2.0, 0.5], dtype=np.float32)
    dy = np.array([[1.0, 2.0, 3.0]] * 4, dtype=np.float32)
    x = np.array([[0.0, -0.0, 0.0], [1.0, np.nan, 2.0], [1.0, 2.0, 3.0], [1e-45, -1e-45, 0.0]], dtype=np.float32)
    dx, dweight = norm.rmsnorm_backward(CPU, x, w, 1e-6, dy)
    # a zero row: s = 0, c = +0, dx = RNE_f32(g r)
    r0 = 1.0 / np.sqrt(1e-6)
    expected = (dy[0].astype(np.float64) * w.astype(np.float64) * r0).astype(np.float32)
    assert np.array_equal(dx[0].view(np.uint32), expected.view(np.uint32))
    assert (dx.view(np.uint32)[1] == NAN_BITS).all()  # a non-finite x row: a NaN row ...
    assert (dweight.view(np.uint32) == NAN_BITS).all()  # ... and NaN in every dweight element
    assert np.isfinite(dx[2:]).all()  # a subnormal row is an ordinary row
    # NaN in dy poisons its row of dx (through s) and its column of dweight only
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=np.float32)
    dy = np.array([[1.0, np.nan, 1.0], [1.0, 1.0, 1.0]], dtype=np.float32)
    dx, dweight = norm.rmsnorm_backward(CPU, x, w, 1e-6, dy)
    assert (dx.view(np.uint32)[0] == NAN_BITS).all() and np.isfinite(dx[1]).all()
    assert dweight.view(np.uint32)[1] == NAN_BITS and np.isfinite(dweight[[0, 2]]).all()
    # eps = 0 with a zero row: r = inf, c = inf * 0: the canonical NaN
    dx, dweight = norm.rmsnorm_backward(CPU, np.zeros((1, 3), np.float32), w, 0.0, np.ones((1, 3), np.float32))
    assert (dx.view(np.uint32) == NAN_BITS).all() and (dweight.view(np.uint32) == NAN_BITS).all()
    # empty shapes: rows = 0 gives dweight = +0 (empty sums), H = 0 empty outputs
    dx, dweight = norm.rmsnorm_backward(CPU, np.zeros((0, 5), np.float32), np.ones(5, np.float32), 1e-6,
                                        np.zeros((0, 5), np.float32))
    assert dx.shape == (0, 5) and dweight.dtype == np.float32 and (dweight.view(np.uint32) == 0).all()
    dx, dweight = norm.rmsnorm_backward(CPU, np.zeros((3, 0), np.float32), np.ones(0, np.float32), 1e-6,
                                        np.zeros((3, 0), np.float32))
    assert dx.shape == (3, 0) and dweight.shape == (0,)


def test_heads_backward_is_rows_backward():
    rng = np.random.default_rng(9)
    x = random_rows(rng, 5 * 4, 64, "normal").reshape(5, 4, 64)
    dy = random_rows(rng, 5 * 4, 64, "normal").reshape(5, 4, 64)
    w = random_rows(rng, 1, 64, "normal")[0]
    dx, dweight = norm.rmsnorm_heads_backward(CPU, x, w, 1e-6, dy)
    dx_rows, dweight_rows = reference.rmsnorm_backward(x.reshape(20, 64), w, 1e-6, dy.reshape(20, 64))
    assert dx.shape == (5, 4, 64) and dweight.shape == (64,)
    assert np.array_equal(dx.reshape(20, 64).view(np.uint32), dx_rows.view(np.uint32))
    assert np.array_equal(dweight.view(np.uint32), dweight_rows.view(np.uint32))


_ONES = np.ones((2, 4), np.float32)


@pytest.mark.parametrize("x,w,eps,dy,message", [
    (np.ones(4, np.float32), np.ones(4, np.float32), 1e-6, np.ones(4, np.float32), "rmsnorm_backward: x must be a 2-D"),
    (np.ones((2, 4), np.float64), np.ones(4, np.float32), 1e-6, _ONES, "x must have dtype float32"),
    (_ONES, np.ones(4, np.float32), 1e-6, np.ones((2, 5), np.float32), r"dy must be float32 of shape \(2, 4\)"),
    (_ONES, np.ones(4, np.float32), 1e-6, np.ones((2, 4), np.float64), "dy must be float32"),
    (_ONES, np.ones(4, np.float32), 1e-6, np.ones((4, 2), np.float32).T, "dy must be C-contiguous"),
    (_ONES, np.ones(5, np.float32), 1e-6, _ONES, r"weight must be float32 of shape \(4,\)"),
    (_ONES, np.ones(4, np.float32), -1.0, _ONES, "eps must be a finite number >= 0"),
    (np.ones((1, 2**18 + 1), np.float32), np.ones(2**18 + 1, np.float32), 1e-6, np.ones((1, 2**18 + 1), np.float32),
     "exceeds the contract's limit"),
])
def test_backward_input_errors(x, w, eps, dy, message):
    with pytest.raises(InputError, match=message):
        norm.rmsnorm_backward(CPU, x, w, eps, dy)


def test_backward_shape_limits():
    many = np.zeros((reference.MAX_GRAD_ROWS + 1, 1), np.float32)  # 64 MiB, refused before any arithmetic
    with pytest.raises(InputError, match="rows exceed the contract's limit"):
        norm.rmsnorm_backward(CPU, many, np.ones(1, np.float32), 1e-6, many)
    with pytest.raises(InputError, match="heads_backward: dy must have x's shape"):
        norm.rmsnorm_heads_backward(CPU, np.ones((2, 3, 4), np.float32), np.ones(4, np.float32), 1e-6,
                                    np.ones((2, 3, 5), np.float32))


def test_rmsnorm_heads_rope_is_the_norm_then_the_rotation():
    from rlportable.ops import rope

    cpu = get_backend("cpu")
    rng = np.random.default_rng(11)
    tokens, hq, hk, d = 5, 4, 2, 16
    q = rng.standard_normal((tokens, hq, d)).astype(np.float32)
    k = rng.standard_normal((tokens, hk, d)).astype(np.float32)
    q[1, 2, 3] = np.inf  # a non-finite head row: the canonical NaN through both steps
    wq, wk = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    cos, sin = rope.tables(cpu, 32, d, 10000.0)
    positions = rng.integers(0, 32, tokens).astype(np.int32)
    got = norm.rmsnorm_heads_rope(cpu, q, k, wq, wk, 1e-6, positions, cos, sin)
    for x, w, y in zip((q, k), (wq, wk), got):
        want = rope.apply(cpu, norm.rmsnorm_heads(cpu, x, w, 1e-6), positions, cos, sin)
        assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    with pytest.raises(InputError, match="rmsnorm_heads_rope: cos must be float32"):  # k's head_dim is not q's
        norm.rmsnorm_heads_rope(cpu, q, np.ascontiguousarray(k[:, :, :8]), wq, wk, 1e-6, positions, cos, sin)
    with pytest.raises(InputError, match="k_weight must be float32"):
        norm.rmsnorm_heads_rope(cpu, q, k, wq, wk[:8], 1e-6, positions, cos, sin)


def test_add_rmsnorm_is_the_residual_add_then_the_norm():
    from rlportable.ops import residual

    cpu = get_backend("cpu")
    rng = np.random.default_rng(12)
    a = rng.standard_normal((6, 40)).astype(np.float32)
    b = rng.standard_normal((6, 40)).astype(np.float32)
    a[2, 5], b[2, 5] = 3e38, 3e38  # the sum overflows: that row of y is the canonical NaN
    a[4, 1], b[4, 1] = np.inf, -np.inf  # inf - inf: a canonical NaN in s
    w = rng.standard_normal(40).astype(np.float32)
    total, y = norm.add_rmsnorm(cpu, a, b, w, 1e-6)
    want_total = residual.add(cpu, a, b)
    assert np.array_equal(total.view(np.uint32), want_total.view(np.uint32))
    assert np.array_equal(y.view(np.uint32), norm.rmsnorm(cpu, want_total, w, 1e-6).view(np.uint32))
    assert total.view(np.uint32)[4, 1] == 0x7FC00000 and np.all(y.view(np.uint32)[2] == 0x7FC00000)
    with pytest.raises(InputError, match="must be float32 of one shape"):
        norm.add_rmsnorm(cpu, a, b[:3], w, 1e-6)


def _assert_encoded_equal(got, want):
    assert (got.bits, got.k, got.descending, got.k_padded) == (want.bits, want.k, want.descending, want.k_padded)
    assert np.array_equal(np.asarray(got.digits), want.digits)
    assert np.array_equal(np.asarray(got.exponents), want.exponents)


def test_add_rmsnorm_with_encode_bits_returns_the_gemm_encoding_of_y():
    from rlportable.ops import fixedpoint, gemm

    assert norm.FUSED_ENCODE_BITS == gemm.DEFAULT_BITS_A == reference.ENCODE_BITS  # the kernel's one encoding
    rng = np.random.default_rng(13)
    a = rng.standard_normal((6, 100)).astype(np.float32)
    b = rng.standard_normal((6, 100)).astype(np.float32)
    a[2, 5], b[2, 5] = 3e38, 3e38  # a NaN row of y: the exponent sentinel and zero digits
    a[3], b[3] = 0.0, -0.0  # an all-zero row: exponent -149
    a[4, 7] = 1e-42  # subnormal inputs next to normal ones
    w = rng.standard_normal(100).astype(np.float32)
    total, y = norm.add_rmsnorm(CPU, a, b, w, 1e-6)
    for bits in (gemm.DEFAULT_BITS_A, 15):
        s2, y2, encoded = norm.add_rmsnorm(CPU, a, b, w, 1e-6, encode_bits=bits)
        assert np.array_equal(s2.view(np.uint32), total.view(np.uint32))
        assert np.array_equal(y2.view(np.uint32), y.view(np.uint32))
        _assert_encoded_equal(encoded, fixedpoint.encode_rows_reference(y, bits))
    encoded = norm.add_rmsnorm(CPU, a, b, w, 1e-6, encode_bits=23)[2]
    assert encoded.digits.shape == (6, 3, 128) and not np.any(encoded.digits[:, :, 100:])  # K padded to 64
    assert encoded.exponents[2] == fp.NONFINITE_EXPONENT and not np.any(encoded.digits[2])
    assert encoded.exponents[3] == fp.ZERO_ROW_EXPONENT
    empty = norm.add_rmsnorm(CPU, a[:, :0], b[:, :0], w[:0], 1e-6, encode_bits=23)[2]
    assert empty.digits.shape == (6, 3, 0) and np.all(empty.exponents == fp.ZERO_ROW_EXPONENT)
    with pytest.raises(InputError, match="encode_bits must be an integer"):
        norm.add_rmsnorm(CPU, a, b, w, 1e-6, encode_bits=1)


_SCALARS = {"long long": np.int64, "int": np.int32, "double": np.float64}
_POINTERS = {"float*": np.float32, "const float*": np.float32, "signed char*": np.int8, "int*": np.int32,
             "const int*": np.int32}


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_add_rmsnorm_launches_encode_in_the_norm_kernel_up_to_the_fused_limit(vendor):
    """One norm_add_rmsnorm launch writes the encoding up to MAX_FUSED_ENCODED_ROW; above it (and without
    encode_bits) the kernel gets null digits/exponents and fixedpoint_encode_rows runs after. The
    launches' arguments match the kernels' parameters in both sources."""
    parameters = {**kernel_parameters(vendor, "norm"), **kernel_parameters(vendor, "fixedpoint")}
    limit = norm.MAX_FUSED_ENCODED_ROW
    for h, encode_bits, kernels in ((96, None, ["norm_add_rmsnorm"]), (96, 23, ["norm_add_rmsnorm"]),
                                    (limit, 23, ["norm_add_rmsnorm"]),
                                    (limit + 64, 23, ["norm_add_rmsnorm", "fixedpoint_encode_rows"]),
                                    (96, 15, ["norm_add_rmsnorm", "fixedpoint_encode_rows"])):
        device = RecordingDevice(vendor)
        a = np.zeros((3, h), np.float32)
        result = norm.add_rmsnorm(device, a, a.copy(), np.ones(h, np.float32), 1e-6, encode_bits=encode_bits)
        assert [launch.kernel for launch in device.launches] == kernels, (h, encode_bits)
        args, shared_mem = device.launches[0].args, device.launches[0].shared_mem
        fused = encode_bits == 23 and h <= limit
        assert shared_mem == (8 if fused else 4) * h
        if encode_bits is None:
            assert len(result) == 2
        else:
            encoded = result[2]
            assert (encoded.bits, encoded.k, encoded.descending) == (encode_bits, h, False)
            assert encoded.digits.shape == (3, fp.slice_count(encode_bits), -(-h // 64) * 64)
            if fused:
                assert args[8] is encoded.digits and args[9] is encoded.exponents and args[10] == encoded.k_padded
        if not fused:
            assert args[8] is norm.NULL_POINTER and args[9] is norm.NULL_POINTER
        _assert_arguments_match(parameters, device.launches)


def _assert_arguments_match(parameters: dict, launches) -> None:
    """Every launch passes as many arguments as its kernel takes, each of the parameter's type."""
    for _, kernel, _, _, args, _ in launches:
        types = parameters[kernel]
        assert len(args) == len(types), kernel
        for kind, arg in zip(types, args):
            if kind.endswith("*"):
                assert (arg is norm.NULL_POINTER or isinstance(arg, np.ndarray) and arg.dtype == _POINTERS[kind]
                        and arg.flags.c_contiguous), (kernel, kind)
            else:
                assert isinstance(arg, np.generic) and arg.dtype == _SCALARS[kind], (kernel, kind, arg)


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_rmsnorm_heads_rope_launches_one_kernel_up_to_the_fused_head_dim(vendor):
    """One norm_rmsnorm_heads_rope launch for q and k (rows: q's heads, then k's; a segment of 32 lanes each)
    up to MAX_FUSED_HEAD_DIM, its arguments matching the kernel's parameters in both sources; above it,
    norm_rmsnorm then rope_apply for each."""
    parameters = {**kernel_parameters(vendor, "norm"), **kernel_parameters(vendor, "rope")}
    tokens, hq, hk = 3, 4, 2
    for d, kernels in ((128, ["norm_rmsnorm_heads_rope"]),
                       (norm.MAX_FUSED_HEAD_DIM + 2, ["norm_rmsnorm", "rope_apply"] * 2)):
        device = RecordingDevice(vendor)
        q, k = np.zeros((tokens, hq, d), np.float32), np.zeros((tokens, hk, d), np.float32)
        cos, sin = np.ones((8, d // 2), np.float32), np.zeros((8, d // 2), np.float32)
        positions = np.array([0, 7, 3], np.int32)
        q_out, k_out = norm.rmsnorm_heads_rope(device, q, k, np.ones(d, np.float32), np.ones(d, np.float32), 1e-6,
                                               positions, cos, sin)
        assert [launch.kernel for launch in device.launches] == kernels, d
        assert (q_out.shape, k_out.shape) == (q.shape, k.shape)
        _assert_arguments_match(parameters, device.launches)
        if len(kernels) == 1:
            launch = device.launches[0]
            assert (launch.grid, launch.block, launch.shared_mem) == ((-(-tokens * (hq + hk) // 8),), (256,), 0)
            assert all(launch.args[i] is array for i, array in ((0, q), (1, k), (-2, q_out), (-1, k_out)))
        with pytest.raises(InputError, match="rmsnorm_heads_rope: position 8 is outside"):
            norm.rmsnorm_heads_rope(device, q, k, np.ones(d, np.float32), np.ones(d, np.float32), 1e-6,
                                    np.array([0, 8, 3], np.int32), cos, sin)


def test_rmsnorm_heads_rope_write_kv_is_the_rotation_then_the_cache_write():
    """On cpu the two ops in turn (the device kernel is checked against them by conform); the cache gets
    write_kv's bytes of the rotated k and of v, a negative slot writes nothing, and bad caches or slots are
    refused with write_kv's errors."""
    from rlportable.ops import attention, rope

    cpu = get_backend("cpu")
    rng = np.random.default_rng(12)
    tokens, hq, hk, d = 4, 4, 2, 16
    q, k, v = (rng.standard_normal((tokens, h, d)).astype(np.float32) for h in (hq, hk, hk))
    wq, wk = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    cos, sin = rope.tables(cpu, 32, d, 10000.0)
    positions = rng.integers(0, 32, tokens).astype(np.int32)
    slots = np.array([5, -1, 0, 9], np.int32)
    fused, separate = (attention.KVCache.allocate(cpu, 12, hk, d, block_size=4) for _ in range(2))
    got = norm.rmsnorm_heads_rope_write_kv(cpu, q, k, v, wq, wk, 1e-6, positions, cos, sin, fused, slots)
    want = norm.rmsnorm_heads_rope(cpu, q, k, wq, wk, 1e-6, positions, cos, sin)
    attention.write_kv(cpu, separate, want[1], v, slots)
    for a, b in zip(got, want):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    for name in ("k_digits", "k_exponents", "v_digits", "v_exponents"):
        assert np.array_equal(getattr(fused, name), getattr(separate, name)), name
    assert not fused.k_digits[1].any() and fused.k_digits[5].any()  # slot 1 untouched, slot 5 written
    with pytest.raises(InputError, match="write_kv: slot 12 is outside"):
        norm.rmsnorm_heads_rope_write_kv(cpu, q, k, v, wq, wk, 1e-6, positions, cos, sin, fused,
                                         np.array([0, 1, 2, 12], np.int32))


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_rmsnorm_heads_rope_write_kv_launches_one_kernel(vendor):
    """One launch for the q, k and v rows (a segment of 32 lanes each), up to the cache's largest head_dim,
    its arguments the kernel's parameters in both sources."""
    from rlportable.ops import attention

    parameters = kernel_parameters(vendor, "norm")
    tokens, hq, hk = 3, 4, 2
    for d in (128, attention.MAX_HEAD_DIM):
        device = RecordingDevice(vendor)
        q, k, v = (np.zeros((tokens, h, d), np.float32) for h in (hq, hk, hk))
        cos, sin = np.ones((8, d // 2), np.float32), np.zeros((8, d // 2), np.float32)
        cache = attention.KVCache.allocate(device, 16, hk, d, block_size=4)
        slots = np.array([3, -1, 7], np.int32)
        q_out, k_out = norm.rmsnorm_heads_rope_write_kv(device, q, k, v, np.ones(d, np.float32),
                                                        np.ones(d, np.float32), 1e-6, np.array([0, 7, 3], np.int32),
                                                        cos, sin, cache, slots)
        (launch,) = device.launches
        assert launch.kernel == "norm_rmsnorm_heads_rope_write_kv" and (q_out.shape, k_out.shape) == (q.shape, k.shape)
        _assert_arguments_match(parameters, device.launches)
        assert launch.grid == (-(-tokens * (hq + 2 * hk) // 8),) and launch.block == (256,)
        assert all(launch.args[i] is array for i, array in ((0, q), (1, k), (2, v), (13, q_out), (14, k_out)))
        assert launch.args[-4] is cache.k_digits and launch.args[-1] is cache.v_exponents
