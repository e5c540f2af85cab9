"""Op family "activation" (SwiGLU and its backward) on the cpu backend: float64 accuracy, edge cases, input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import activation as reference
from rlportable.contract.elementwise import exp_f32
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


# ---- backward: swiglu_backward


def _float64_swiglu_backward(gate, up, dy):
    g, u, d = gate.astype(np.float64), up.astype(np.float64), dy.astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-g))
    dsilu = sig * (1.0 + g * (1.0 - sig))
    return d * u * dsilu, d * g * sig, sig, dsilu


def _backward_bounds(gate, up, dy):
    """Bounds on |contract - float64 math|. exp_f32 is correctly rounded (2^-24 relative), so
    d = 1 + E and sig = 1/d move by <= 2^-24 relative and 1 - sig = E/d by <= sig 2^-24 relative plus
    2^-52 absolute (the float64 subtraction); dsilu = sig (1 + g (1 - sig)) then moves by
    <= 2^-23 |dsilu| + |g| sig (sig (1 - sig) 2^-24 + 2^-52) (a few float64 roundings besides); the
    output conversion adds 2^-24 relative, half the subnormal spacing at worst. Margins: x2.
    Below g = -88.72 exp_f32(-g) overflows to inf (the forward's own edge case): sig = 0 and the
    contract's dgate and dup are signed zeros, the true values below 90 * 2^-128 |dy u| (or |dy g|)."""
    dgate64, dup64, sig, dsilu = _float64_swiglu_backward(gate, up, dy)
    g, du = gate.astype(np.float64), dy.astype(np.float64) * up.astype(np.float64)
    dgate_bound = (np.abs(du) * (2.0**-22 * np.abs(dsilu) + np.abs(g) * sig * (sig * (1 - sig) * 2.0**-23 + 2.0**-51))
                   + 2.0**-23 * np.abs(dgate64) + 2.0**-149)
    dup_bound = 2.0**-22 * np.abs(dup64) + 2.0**-149
    overflow = np.isinf(exp_f32(-gate))
    dgate_bound[overflow] = np.abs(dgate64[overflow]) + 2.0**-149
    dup_bound[overflow] = np.abs(dup64[overflow]) + 2.0**-149
    return dgate64, dgate_bound, dup64, dup_bound


@pytest.mark.parametrize("scale", [1.0, 10.0, 1e-3, 60.0])
def test_backward_close_to_float64_math(scale):
    rng = np.random.default_rng(int(scale * 1000) + 1)
    gate = (random_rows(rng, 33, 257, "normal") * np.float32(scale)).astype(np.float32)
    up, dy = random_rows(rng, 33, 257, "normal"), random_rows(rng, 33, 257, "normal")
    dgate, dup = activation.swiglu_backward(CPU, gate, up, dy)
    dgate64, dgate_bound, dup64, dup_bound = _backward_bounds(gate, up, dy)
    assert np.all(np.abs(dgate - dgate64) <= dgate_bound)
    assert np.all(np.abs(dup - dup64) <= dup_bound)


def test_backward_near_the_root_of_dsilu():
    # 1 + g (1 - sig(g)) = 0 near g = -1.2785: the float64 cancellation is bounded in absolute terms
    gate = np.float32(-1.2784645) + np.arange(-64, 65, dtype=np.float32) * np.float32(2.0**-22)
    up, dy = np.ones_like(gate), np.ones_like(gate)
    dgate, _ = activation.swiglu_backward(CPU, gate, up, dy)
    dgate64, dgate_bound, _, _ = _backward_bounds(gate, up, dy)
    assert np.all(np.abs(dgate - dgate64) <= dgate_bound)
    assert (dgate < 0).any() and (dgate > 0).any()  # the sign change is resolved


def test_backward_matches_finite_differences():
    # Central differences of the float64 forward f = g sigmoid(g) u, step 1e-6 max(1, |g|): truncation
    # ~ step^2 |f'''| and cancellation ~ 2^-52 |f| / step, both < 1e-9 |dy| (1 + |u|) for |g| <= 20;
    # that 1e-8 is checked against the float64 analytic gradient first, then the contract lies within
    # _backward_bounds plus it.
    rng = np.random.default_rng(3)
    gate = (rng.standard_normal(4000) * 6).astype(np.float32)
    up, dy = rng.standard_normal(4000).astype(np.float32), rng.standard_normal(4000).astype(np.float32)
    g, u, d = gate.astype(np.float64), up.astype(np.float64), dy.astype(np.float64)

    def f(g, u):
        return g / (1.0 + np.exp(-g)) * u

    step = 1e-6 * np.maximum(1.0, np.abs(g))
    fd_gate = d * (f(g + step, u) - f(g - step, u)) / (2 * step)
    fd_up = d * (f(g, u + step) - f(g, u - step)) / (2 * step)
    slack = 1e-8 * np.abs(d) * (1 + np.abs(u) + np.abs(g))
    dgate64, dgate_bound, dup64, dup_bound = _backward_bounds(gate, up, dy)
    assert np.all(np.abs(fd_gate - dgate64) <= slack) and np.all(np.abs(fd_up - dup64) <= slack)
    dgate, dup = activation.swiglu_backward(CPU, gate, up, dy)
    assert np.all(np.abs(dgate - fd_gate) <= dgate_bound + slack)
    assert np.all(np.abs(dup - fd_up) <= dup_bound + slack)


def test_backward_edge_cases():
    gate = np.array([0.0, -0.0, -100.0, 50.0, np.inf, -np.inf, np.nan, 1.0, 1.0, 1e-45], dtype=np.float32)
    up = np.array([1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0, np.nan, 1.0, 1.0], dtype=np.float32)
    dy = np.array([2.0, 2.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0, np.inf, 1.0], dtype=np.float32)
    dgate, dup = activation.swiglu_backward(CPU, gate, up, dy)
    dg, du = dgate.view(np.uint32).tolist(), dup.view(np.uint32).tolist()
    assert dg[0] == dg[1] == 0x3F800000  # g = +-0: sig = 1/2, dgate = 2 * 1 * 0.5 = 1
    assert du[0] == 0x00000000 and du[1] == 0x80000000  # dup = 2 * (+-0 / 2) keeps the sign
    assert dg[2] == 0x80000000 and du[2] == 0x80000000  # g < -89: E = inf, dsilu = -0, silu = -0
    assert dg[3] == 0x40C00000 and du[3] == 0x42C80000  # g = 50: 1 + E = 1, dgate = dy u, dup = dy g
    assert dg[4] == dg[5] == dg[6] == dg[7] == 0x7FC00000  # +-inf gate (inf * 0), NaN gate or up
    assert du[4] == 0x7F800000 and du[5] == du[6] == 0x7FC00000  # dy * inf; -inf / inf; NaN
    assert du[7] != 0x7FC00000 and dg[8] == 0x7F800000  # dup ignores up; inf dy gives inf
    assert dg[9] == 0x3F000000 and du[9] == 0x00000000  # subnormal gate: sig = 1/2, dup = 1e-45/2 -> +0


def test_backward_any_shape_is_the_reference_bitwise():
    rng = np.random.default_rng(2)
    for kind in ("normal", "special", "nonfinite", "huge", "tiny", "zeros"):
        gate = random_rows(rng, 4 * 3, 5, kind).reshape(4, 3, 5)
        up = random_rows(rng, 4 * 3, 5, "special").reshape(4, 3, 5)
        dy = random_rows(rng, 4 * 3, 5, "normal").reshape(4, 3, 5)
        dgate, dup = activation.swiglu_backward(CPU, gate, up, dy)
        assert dgate.shape == dup.shape == (4, 3, 5) and dgate.dtype == dup.dtype == np.float32
        flat = reference.swiglu_backward(gate.ravel(), up.ravel(), dy.ravel())
        assert np.array_equal(dgate.ravel().view(np.uint32), flat[0].view(np.uint32))
        assert np.array_equal(dup.ravel().view(np.uint32), flat[1].view(np.uint32))
    empty = np.zeros((0, 7), np.float32)
    assert all(a.shape == (0, 7) for a in activation.swiglu_backward(CPU, empty, empty, empty))


def test_backward_input_errors():
    ones = np.ones((2, 3), np.float32)
    with pytest.raises(InputError, match=r"swiglu_backward: up \(3, 2\) must have gate's shape \(2, 3\)"):
        activation.swiglu_backward(CPU, ones, np.ones((3, 2), np.float32), ones)
    with pytest.raises(InputError, match=r"swiglu_backward: dy \(2,\) must have gate's shape"):
        activation.swiglu_backward(CPU, ones, ones, np.ones(2, np.float32))
    with pytest.raises(InputError, match="swiglu_backward: dy must have dtype float32"):
        activation.swiglu_backward(CPU, ones, ones, np.ones((2, 3), np.float64))


def test_swiglu_encode_is_swiglu_then_the_gemm_encoding():
    from rlportable.ops import fixedpoint

    cpu = get_backend("cpu")
    gate = random_rows(np.random.default_rng(3), 6, 40, "massive")
    up = random_rows(np.random.default_rng(4), 6, 40, "normal")
    gate[2, 7] = np.nan  # a non-finite row: the sentinel exponent, zero digits
    y, encoded = activation.swiglu_encode(cpu, gate, up)
    want = fixedpoint.encode_rows_reference(reference.swiglu(gate, up), 23)
    assert np.array_equal(y.view(np.uint32), reference.swiglu(gate, up).view(np.uint32))
    assert np.array_equal(encoded.digits, want.digits) and np.array_equal(encoded.exponents, want.exponents)
    assert (encoded.bits, encoded.k, encoded.descending) == (23, 40, False)
    y_ref, q, e = reference.swiglu_encode(gate, up)
    assert np.array_equal(e, want.exponents) and np.array_equal(q, fixedpoint.joined_integers(want))
    with pytest.raises(InputError, match="swiglu_encode: gate"):
        activation.swiglu_encode(cpu, gate[0], up[0])


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_swiglu_encode_launches_one_kernel_up_to_the_fused_limit(vendor):
    from recording_device import RecordingDevice, kernel_parameters

    parameters = {**kernel_parameters(vendor, "activation"), **kernel_parameters(vendor, "fixedpoint")}
    limit = activation.MAX_FUSED_ENCODED_ROW
    for h, bits, kernels in ((96, 23, ["activation_swiglu_encode"]), (limit, 23, ["activation_swiglu_encode"]),
                             (limit + 64, 23, ["activation_swiglu", "fixedpoint_encode_rows"]),
                             (96, 15, ["activation_swiglu", "fixedpoint_encode_rows"])):
        device = RecordingDevice(vendor)
        gate = np.zeros((3, h), np.float32)
        y, encoded = activation.swiglu_encode(device, gate, gate.copy(), bits)
        assert [launch.kernel for launch in device.launches] == kernels, (h, bits)
        assert encoded.digits.shape == (3, -(-bits // 8), -(-h // 64) * 64) and encoded.bits == bits
        for launch in device.launches:
            types = parameters[launch.kernel]
            assert len(launch.args) == len(types), launch.kernel
        if kernels[0] == "activation_swiglu_encode":
            args = device.launches[0].args
            assert args[5] is y and args[6] is encoded.digits and args[7] is encoded.exponents
            assert device.launches[0].shared_mem == 4 * h and int(args[4]) == encoded.k_padded
