"""Op "logprobs_backward" on the cpu backend: the gradient of g * logp with respect to the logits against
float64 analytic gradients and finite differences, chunk invariance, masked rows, edge rows, input checks,
and the conformance check on cpu.

The device kernels are checked bitwise against the same reference by `rlportable conform`
(rlportable/conform/logprob.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.logprob import CHECKS
from rlportable.contract import logprob as reference
from rlportable.contract.elementwise import exp_f32
from rlportable.errors import InputError
from rlportable.ops import logprob
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
NAN_BITS = 0x7FC00000


def _bits(a):
    return np.asarray(a).view(np.uint32)


def _case(rows: int, vocab: int, seed: int, spread: float = 4.0):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((rows, vocab)) * spread).astype(np.float32)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    grad = rng.standard_normal(rows).astype(np.float32)
    return z, targets, grad


def _float64_log_softmax(z: np.ndarray, temperature: float) -> np.ndarray:
    a = z.astype(np.float64) / temperature
    shifted = a - a.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _float64_gradient(z, targets, temperature, grad) -> np.ndarray:
    softmax = np.exp(_float64_log_softmax(z, temperature))
    onehot = np.zeros_like(softmax)
    onehot[np.arange(z.shape[0]), targets] = 1.0
    return (grad.astype(np.float64) / temperature)[:, None] * (onehot - softmax)


def _tolerance(z, temperature, grad, exact) -> np.ndarray:
    # Error budget of the contract's dz against the exact gradient (g / T)([v = y] - softmax_v):
    #  * q_v = p_v / S' errs relative to softmax_v by: the float32 roundings of a_v, m and a_v - m
    #    (absolute <= 2^-24 (|a_v| + |m| + |a_v - m|) <= 2^-22 max|a| in the exponent, i.e. relative
    #    in p_v), the correctly rounded exp_f32 (2^-24), both again through S (a weighted mean of the
    #    same p_v errors), and S's fixed-point terms (2^-37 each, S' >= 1: <= V 2^-37 relative);
    #    together <= 2^-21 (max|a| + 1) + V 2^-37;
    #  * the float64 steps (a few 2^-53) and the final RNE to float32 (2^-24 |dz|, so 2^-23 |exact|);
    #  * p_v below the float32 normal range loses relative accuracy: 2^-149 |g / T| absolute covers it.
    scale = np.abs(grad.astype(np.float64) / temperature)[:, None]
    a_max = np.abs(z.astype(np.float64) / temperature).max(axis=1, keepdims=True)
    softmax = np.exp(_float64_log_softmax(z, temperature))
    relative = 2.0**-21 * (a_max + 1.0) + z.shape[1] * 2.0**-37
    return scale * softmax * relative + 2.0**-23 * np.abs(exact) + scale * 2.0**-140


@pytest.mark.parametrize("vocab", [13, 1000, 151936])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_close_to_the_float64_gradient(vocab, temperature):
    rows = 3 if vocab > 10000 else 6
    z, targets, grad = _case(rows, vocab, seed=vocab)
    dz = logprob.logprobs_backward(CPU, z, targets, temperature, grad)
    assert dz.shape == (rows, vocab) and dz.dtype == np.float32
    exact = _float64_gradient(z, targets, temperature, grad)
    assert np.all(np.abs(dz - exact) <= _tolerance(z, temperature, grad, exact))
    # the gradient of a log-softmax sums to zero over the vocabulary: here sum_v q_v = sum p_v / S' differs
    # from 1 by S's fixed-point roundings (<= V 2^-37, S' >= 1), and each dz's rounding adds <= 2^-24 |dz|
    # with sum |dz| <= 2 |g| / T; the bound below has a factor 2 of margin on both
    bound = np.abs(grad.astype(np.float64) / temperature) * (vocab * 2.0**-36 + 2.0**-22)
    assert np.all(np.abs(dz.astype(np.float64).sum(axis=1)) <= bound)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_finite_differences_of_a_float64_log_softmax(temperature):
    # f(z) = g * log_softmax(z / T)[y] in float64, central differences with h = 2^-17: truncation
    # h^2 / 6 max|f'''| (|f'''| <= 2 |g| / T^3) and cancellation 2^-53 |f| / h stay below 1e-9,
    # far inside the float32 tolerance of dz; so this checks the formula itself (sign, 1 / T, target).
    z, targets, grad = _case(4, 29, seed=11, spread=2.0)
    dz = logprob.logprobs_backward(CPU, z, targets, temperature, grad)
    h = 2.0**-17
    rows = np.arange(4)
    numeric = np.empty((4, 29))
    for v in range(29):
        up, down = z.astype(np.float64), z.astype(np.float64)
        up[:, v] += h
        down[:, v] -= h
        f_up = grad * _float64_log_softmax(up, temperature)[rows, targets]
        f_down = grad * _float64_log_softmax(down, temperature)[rows, targets]
        numeric[:, v] = (f_up - f_down) / (2 * h)
    exact = _float64_gradient(z, targets, temperature, grad)
    assert np.all(np.abs(dz - numeric) <= _tolerance(z, temperature, grad, exact) + 1e-9)


def test_op_equals_the_reference_bitwise():
    z, targets, grad = _case(9, 1000, seed=2)
    got = logprob.logprobs_backward(CPU, z, targets, 0.7, grad)
    assert np.array_equal(_bits(got), _bits(reference.logprobs_backward(z, targets, 0.7, grad)))


def test_chunked_rows_equal_all_rows():
    z, targets, grad = _case(23, 517, seed=3)
    full = logprob.logprobs_backward(CPU, z, targets, 1.3, grad)
    for chunk in (1, 4, 7, 23):
        parts = [logprob.logprobs_backward(CPU, z[i:i + chunk], targets[i:i + chunk], 1.3, grad[i:i + chunk])
                 for i in range(0, 23, chunk)]
        assert np.array_equal(_bits(np.concatenate(parts)), _bits(full))
    permutation = np.random.default_rng(0).permutation(23)
    permuted = logprob.logprobs_backward(CPU, z[permutation], targets[permutation], 1.3, grad[permutation])
    assert np.array_equal(_bits(permuted), _bits(full[permutation]))


def test_temperature_one_is_the_plain_softmax_of_the_forward():
    # at T = 1: dz_v = RNE_f32(g ([v = y] - p_v / S')), p_v and S from the forward's own terms
    z, targets, grad = _case(5, 300, seed=4)
    a = z - z.max(axis=1, keepdims=True)
    p = exp_f32(a).astype(np.float64)
    s = np.rint(p * 2.0**36).astype(np.int64).sum(axis=1).astype(np.float64) * 2.0**-36  # exact: S < 2^53 here
    onehot = np.zeros_like(p)
    onehot[np.arange(5), targets] = 1.0
    expected = (grad.astype(np.float64)[:, None] * np.where(onehot == 1.0, 1.0 - p / s[:, None], -(p / s[:, None])))
    got = logprob.logprobs_backward(CPU, z, targets, 1.0, grad)
    assert np.array_equal(_bits(got), _bits(expected.astype(np.float32)))


def test_masked_rows_are_exact_zeros():
    z, targets, grad = _case(6, 100, seed=5)
    z[3, 7] = np.nan  # a masked row may hold anything
    z[4, :] = -np.inf
    grad[[0, 3, 4]] = 0.0
    grad[5] = -0.0
    dz = logprob.logprobs_backward(CPU, z, targets, 0.7, grad)
    assert not _bits(dz[[0, 3, 4, 5]]).any()  # +0 bits everywhere, also for g = -0
    unmasked = logprob.logprobs_backward(CPU, z[1:3], targets[1:3], 0.7, grad[1:3])
    assert np.array_equal(_bits(dz[1:3]), _bits(unmasked)) and np.all(dz[1:3] != 0)


def test_edge_rows():
    z = np.array([
        [1.0, np.nan, 0.0],           # NaN -> canonical NaN row
        [np.inf, 0.0, 0.0],           # +inf maximum -> canonical NaN row
        [-np.inf, -np.inf, -np.inf],  # all -inf -> canonical NaN row
        [-np.inf, 2.0, -np.inf],      # one-hot at the target: 1 - 1 = 0; -inf entries have q = 0
        [-np.inf, 2.0, -np.inf],      # ... with the target at a -inf entry: g / T there
        [0.0, -0.0, 0.0],             # ties with signed zeros: uniform
        [1.0, 2.0, 3.0],              # NaN g
        [1.0, 2.0, 3.0],              # inf g
    ], dtype=np.float32)
    targets = np.array([0, 1, 0, 1, 0, 2, 0, 0], dtype=np.int32)
    grad = np.array([1.0, 1.0, 1.0, 2.0, 2.0, 3.0, np.nan, -np.inf], dtype=np.float32)
    dz = logprob.logprobs_backward(CPU, z, targets, 1.0, grad)
    assert (_bits(dz[[0, 1, 2, 6, 7]]) == NAN_BITS).all()
    assert _bits(dz[3]).tolist() == [0x80000000, 0, 0x80000000]  # -0, +0 (2 * (1 - 1)), -0
    assert dz[4].tolist() == [2.0, -2.0, 0.0] and _bits(dz[4])[2] == 0x80000000
    assert np.allclose(dz[5], [-1.0, -1.0, 2.0], rtol=2e-7, atol=0)
    negative = logprob.logprobs_backward(CPU, z[3:4], targets[3:4], 1.0, np.array([-2.0], np.float32))
    assert _bits(negative[0]).tolist() == [0, 0x80000000, 0]  # -g * -0 = +0; -2 (1 - 1) = -0
    # |g| / T beyond FLT_MAX rounds to +-inf (a defined result, not a NaN)
    huge = logprob.logprobs_backward(CPU, z[5:6], targets[5:6], 1e-3, np.array([3e38], np.float32))
    assert huge[0].tolist() == [-np.inf, -np.inf, np.inf]
    assert logprob.logprobs_backward(CPU, z[:0], targets[:0], 1.0, grad[:0]).shape == (0, 3)


@pytest.mark.parametrize("call,message", [
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, np.array([0, 9], np.int32), 1.0, g),
     r"logprobs_backward: targets\[1\] = 9 is outside the vocabulary \[0, 9\)"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t.astype(np.int64), 1.0, g), "targets must be int32"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t, 0.0, g), "temperature must be a finite number > 0"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t, float("inf"), g), "temperature must be"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z[:, :0], t, 1.0, g), r"vocabulary size must lie in \[1, 2\^25\]"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z[0], t, 1.0, g), "logits must be a 2-D"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z.astype(np.float64), t, 1.0, g), "logits must have dtype float32"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t, 1.0, g.astype(np.float64)),
     r"grad must be float32 of shape \(2,\), got float64"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t, 1.0, g[:1]), r"grad must be float32 of shape \(2,\)"),
    (lambda z, t, g: logprob.logprobs_backward(CPU, z, t, 1.0, np.zeros((4,), np.float32)[::2]),
     "grad must be C-contiguous"),
])
def test_input_errors(call, message):
    z = np.zeros((2, 9), dtype=np.float32)
    with pytest.raises(InputError, match=message):
        call(z, np.array([0, 1], np.int32), np.ones(2, np.float32))


def test_conformance_check_on_cpu():
    check = dict(CHECKS)["logprob.backward"]
    tally = check(CPU, np.random.default_rng(0), True)
    assert tally.compared > 0 and tally.mismatches == 0
