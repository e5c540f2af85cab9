"""Op family "rope" on the cpu backend: tables against float64 NumPy, the rotation and its backward, input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import rope as reference
from rlportable.errors import InputError
from rlportable.ops import rope
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 distance in units in the last place (same-sign values)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


@pytest.mark.parametrize("head_dim,theta", [(128, 1_000_000.0), (64, 10000.0), (14, 10000.0), (2, 500000.0)])
def test_tables_match_float64_numpy(head_dim, theta):
    # The contract's float64 exp/log/sin/cos are a few float64 ulps from exact, so after one rounding
    # to float32 they agree with libm's float64 rounded to float32 except within ~2^-50 of a float32
    # rounding boundary, i.e. practically always; allow 1 float32 ulp and require agreement on 99.9%.
    inv = reference.inverse_frequencies(head_dim, theta)
    j = np.arange(head_dim // 2, dtype=np.float64)
    assert _ulps(inv, np.power(theta, -2.0 * j / head_dim).astype(np.float32)).max() <= 1
    positions = np.concatenate([np.arange(2048), np.random.default_rng(0).integers(2048, 2**20, 512)])
    cos, sin = reference.tables(positions, inv)
    angle = positions[:, None].astype(np.float64) * inv.astype(np.float64)[None, :]
    for ours, exact in ((cos, np.cos(angle)), (sin, np.sin(angle))):
        # absolute error within half a float32 ulp of 1 plus the float64 error (values are <= 1)
        assert np.abs(ours.astype(np.float64) - exact).max() <= 2.0**-25 + 2.0**-40
        assert np.mean(ours == exact.astype(np.float32)) > 0.999


def test_llama3_scaling_matches_the_rule():
    scaling = reference.Llama3Scaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                      original_max_position_embeddings=8192)
    base = reference.inverse_frequencies(128, 500000.0).astype(np.float64)
    scaled = reference.inverse_frequencies(128, 500000.0, scaling).astype(np.float64)
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    np.testing.assert_allclose(scaled[high], base[high], rtol=2**-23)
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=2**-23)
    middle = ~high & ~low
    assert np.all(scaled[middle] <= base[middle]) and np.all(scaled[middle] >= base[middle] / 8.0 * (1 - 2**-23))


def test_rotation_against_float64():
    rng = np.random.default_rng(5)
    x = random_rows(rng, 9 * 4, 64, "normal").reshape(9, 4, 64)
    cos, sin = rope.tables(CPU, 100, 64, 10000.0)
    positions = rng.integers(0, 100, 9).astype(np.int32)
    y = rope.apply(CPU, x, positions, cos, sin)
    # the contract computes x1 c - x2 s in float64 with exact products: one float64 rounding, then float32
    c, s = cos[positions][:, None, :].astype(np.float64), sin[positions][:, None, :].astype(np.float64)
    x1, x2 = x[..., :32].astype(np.float64), x[..., 32:].astype(np.float64)
    expected = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    np.testing.assert_allclose(y, expected, rtol=2**-24, atol=2**-149)
    # a rotation keeps each pair's length (to float32 rounding of the tables and the result)
    np.testing.assert_allclose(y[..., :32] ** 2 + y[..., 32:] ** 2, x[..., :32] ** 2 + x[..., 32:] ** 2, rtol=1e-5)
    # position 0 is the identity (cos = 1, sin = 0)
    zero = rope.apply(CPU, x, np.zeros(9, np.int32), cos, sin)
    assert np.array_equal(zero.view(np.uint32), (x + np.float32(0)).view(np.uint32))


def test_position_not_batch_index_decides():
    rng = np.random.default_rng(6)
    x = random_rows(rng, 6 * 2, 16, "normal").reshape(6, 2, 16)
    cos, sin = rope.tables(CPU, 50, 16, 10000.0)
    positions = np.array([3, 9, 9, 0, 49, 17], dtype=np.int32)
    full = rope.apply(CPU, x, positions, cos, sin)
    for t in range(6):
        one = rope.apply(CPU, x[t:t + 1], positions[t:t + 1], cos, sin)
        assert np.array_equal(one.view(np.uint32), full[t:t + 1].view(np.uint32))
    # the same row at the same position, anywhere in another batch, gives the same bits
    batch = np.concatenate([x[4:5], x[1:2], x[0:1]])
    moved = rope.apply(CPU, batch, np.array([0, 9, 3], dtype=np.int32), cos, sin)
    assert np.array_equal(moved[1].view(np.uint32), full[1].view(np.uint32))


def test_nan_results_are_canonical():
    cos, sin = rope.tables(CPU, 4, 4, 10000.0)
    x = np.array([[[np.inf, 1.0, 1.0, 1.0]], [[np.float32(np.nan), 1.0, -np.inf, 1.0]]], dtype=np.float32)
    x[1, 0, 0] = np.uint32(0xFFC00123).view(np.float32)  # a NaN with a payload and the sign bit
    y = rope.apply(CPU, x, np.array([0, 1], dtype=np.int32), cos, sin)
    bits = y.view(np.uint32)
    nan = np.isnan(y)
    assert nan.any() and (bits[nan] == 0x7FC00000).all()


@pytest.mark.parametrize("x,positions,message", [
    (np.ones((2, 3, 8), np.float32), np.array([0, 10], np.int32), r"position 10 is outside the tables' \[0, 10\)"),
    (np.ones((2, 3, 8), np.float32), np.array([-1, 0], np.int32), "position -1"),
    (np.ones((2, 3, 8), np.float32), np.array([0, 1], np.int64), "positions must be int32"),
    (np.ones((2, 3, 8), np.float32), np.array([0], np.int32), r"positions must be int32 of shape \(2,\)"),
    (np.ones((2, 8), np.float32), np.array([0, 1], np.int32), r"x must be float32 \[tokens, heads, head_dim\]"),
    (np.ones((2, 3, 7), np.float32), np.array([0, 1], np.int32), "head_dim must be even"),
])
def test_input_errors(x, positions, message):
    cos, sin = rope.tables(CPU, 10, 8, 10000.0)
    with pytest.raises(InputError, match=message):
        rope.apply(CPU, x, positions, cos, sin)


def test_table_errors():
    with pytest.raises(InputError, match="head_dim must be a positive even"):
        rope.tables(CPU, 10, 7, 10000.0)
    cos, sin = rope.tables(CPU, 10, 8, 10000.0)
    with pytest.raises(InputError, match=r"cos must be float32 \[positions, 4\]"):
        rope.apply(CPU, np.ones((1, 1, 8), np.float32), np.zeros(1, np.int32), cos[:, :3].copy(), sin)


def test_host_positions_are_checked_in_place_of_the_device_copy():
    backend = get_backend("cpu")
    cos, sin = rope.tables(backend, 8, 4, 10000.0)
    x = np.ones((2, 1, 4), np.float32)
    positions = np.array([0, 7], np.int32)
    same = rope.apply(backend, x, positions, cos, sin, host_positions=positions)
    assert np.array_equal(same.view(np.uint32), rope.apply(backend, x, positions, cos, sin).view(np.uint32))
    with pytest.raises(InputError, match="position 8"):
        rope.apply(backend, x, positions, cos, sin, host_positions=np.array([0, 8], np.int32))


# ---- backward: apply_backward (dx = R^T dy)


def _backward_inputs(seed, tokens=9, heads=4, head_dim=64, kind="normal"):
    rng = np.random.default_rng(seed)
    dy = random_rows(rng, tokens * heads, head_dim, kind).reshape(tokens, heads, head_dim)
    cos, sin = rope.tables(CPU, 100, head_dim, 10000.0)
    positions = rng.integers(0, 100, tokens).astype(np.int32)
    return dy, positions, cos, sin


def test_backward_is_the_transpose_in_float64():
    # For fixed tables the forward is the linear map R(c, s) with the float32 table values; its gradient
    # is R^T dy. Each output is one float64 sum of two exact products, rounded to float64 then to
    # float32: |error| <= 2^-24 |value| (+ 2^-53 of the terms, far below) or half the subnormal spacing.
    dy, positions, cos, sin = _backward_inputs(15)
    dx = rope.apply_backward(CPU, dy, positions, cos, sin)
    c, s = cos[positions][:, None, :].astype(np.float64), sin[positions][:, None, :].astype(np.float64)
    d1, d2 = dy[..., :32].astype(np.float64), dy[..., 32:].astype(np.float64)
    expected = np.concatenate([d1 * c + d2 * s, d2 * c - d1 * s], axis=-1)
    terms = np.abs(d1 * c) + np.abs(d2 * s) + np.abs(d2 * c) + np.abs(d1 * s)
    bound = 2.0**-24 * np.abs(expected) + 2.0**-52 * np.concatenate([terms, terms], axis=-1) + 2.0**-150
    assert np.all(np.abs(dx - expected) <= bound)
    # the adjoint identity <R x, dy> = <x, R^T dy>, both sides in float64 from the float32 results
    x = random_rows(np.random.default_rng(16), 9 * 4, 64, "normal").reshape(9, 4, 64)
    y = rope.apply(CPU, x, positions, cos, sin)
    lhs, rhs = float((y.astype(np.float64) * dy).sum()), float((x.astype(np.float64) * dx).sum())
    assert abs(lhs - rhs) <= 2.0**-22 * float(np.abs(x).astype(np.float64).sum() * np.abs(dy).max())


def test_backward_matches_finite_differences():
    # L(x) = sum(dy * R x) in float64 is linear in x, so central differences with step 1e-3 carry only
    # cancellation error, ~2^-52 |L| / step < 1e-10 here; the contract is within 2^-24 relative of R^T dy.
    dy, positions, cos, sin = _backward_inputs(17, tokens=3, heads=2, head_dim=8)
    c, s = cos[positions][:, None, :].astype(np.float64), sin[positions][:, None, :].astype(np.float64)
    dy64 = dy.astype(np.float64)

    def loss(x):
        x1, x2 = x[..., :4], x[..., 4:]
        return float((dy64 * np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)).sum())

    x0 = random_rows(np.random.default_rng(18), 6, 8, "normal").reshape(3, 2, 8).astype(np.float64)
    fd = np.zeros_like(x0)
    for i in np.ndindex(x0.shape):
        plus, minus = x0.copy(), x0.copy()
        plus[i] += 1e-3
        minus[i] -= 1e-3
        fd[i] = (loss(plus) - loss(minus)) / 2e-3
    dx = rope.apply_backward(CPU, dy, positions, cos, sin)
    assert np.all(np.abs(dx - fd) <= 2.0**-24 * np.abs(fd) + 1e-9)


def test_backward_is_apply_with_negated_sine_bitwise():
    for kind in ("normal", "special", "nonfinite", "tiny", "huge", "zeros"):
        dy, positions, cos, sin = _backward_inputs(19, kind=kind)
        dx = rope.apply_backward(CPU, dy, positions, cos, sin)
        negated = rope.apply(CPU, dy, positions, cos, (-sin).astype(np.float32))
        assert np.array_equal(dx.view(np.uint32), negated.view(np.uint32))
        expected = reference.apply_backward(dy, cos[positions], sin[positions])
        assert np.array_equal(dx.view(np.uint32), expected.view(np.uint32))


def test_backward_edge_cases():
    cos, sin = rope.tables(CPU, 4, 4, 10000.0)
    dy = np.array([[[np.inf, 1.0, 1.0, 1.0]], [[np.nan, 1.0, -np.inf, 1.0]], [[1.0, -0.0, 2.0, 3.0]]], dtype=np.float32)
    dy[1, 0, 0] = np.uint32(0xFFC00123).view(np.float32)  # a NaN with a payload and the sign bit
    dx = rope.apply_backward(CPU, dy, np.array([0, 1, 0], dtype=np.int32), cos, sin)
    bits = dx.view(np.uint32)
    nan = np.isnan(dx)
    assert nan.any() and (bits[nan] == 0x7FC00000).all()
    assert np.array_equal(bits[2], (dy[2] + np.float32(0)).view(np.uint32))  # position 0 is the identity
    empty = rope.apply_backward(CPU, np.zeros((0, 2, 4), np.float32), np.zeros(0, np.int32), cos, sin)
    assert empty.shape == (0, 2, 4)


@pytest.mark.parametrize("dy,positions,message", [
    (np.ones((2, 3, 8), np.float32), np.array([0, 10], np.int32), r"position 10 is outside the tables' \[0, 10\)"),
    (np.ones((2, 3, 8), np.float32), np.array([0], np.int32), r"apply_backward: positions must be int32 of shape \(2,\)"),
    (np.ones((2, 8), np.float32), np.array([0, 1], np.int32), r"apply_backward: dy must be float32 \[tokens, heads, head_dim\]"),
    (np.ones((2, 3, 8), np.float64), np.array([0, 1], np.int32), "apply_backward: dy must be float32"),
    (np.ones((2, 3, 7), np.float32), np.array([0, 1], np.int32), "head_dim must be even, got dy"),
    (np.ones((8, 3, 2), np.float32).transpose(2, 1, 0), np.array([0, 1], np.int32), "dy must be C-contiguous"),
])
def test_backward_input_errors(dy, positions, message):
    cos, sin = rope.tables(CPU, 10, 8, 10000.0)
    with pytest.raises(InputError, match=message):
        rope.apply_backward(CPU, dy, positions, cos, sin)
    with pytest.raises(InputError, match="position 8"):
        rope.apply_backward(CPU, np.ones((2, 1, 8), np.float32), np.array([0, 1], np.int32), cos[:8], sin[:8],
                            host_positions=np.array([0, 8], np.int32))
