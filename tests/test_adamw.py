"""The adamw contract's reference (rlportable/contract/adamw.py) against torch, the schedule, determinism."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from rlportable.contract import adamw as ref
from rlportable.ops import adamw as adamw_op
from rlportable.runtime.cpu import CpuBackend

STEPS = 20


def _bits(arrays):
    return [np.asarray(a).view(np.uint32).copy() for a in arrays]


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(16, 8), (33,), (4, 5, 6)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[(rng.standard_normal(s) * (3.0 if t % 3 == 0 else 0.05)).astype(np.float32) for s in shapes]
             for t in range(STEPS)]
    return shapes, params, grads


def _run_reference(params, grads, hyper, warmup=3):
    p = [x.copy() for x in params]
    m = [np.zeros_like(x) for x in params]
    v = [np.zeros_like(x) for x in params]
    for t in range(1, len(grads) + 1):
        lr = ref.lr_at(t, hyper.lr, warmup, len(grads), min_lr=hyper.lr * 0.1)
        p, m, v = ref.adamw_step(p, grads[t - 1], m, v, t, hyper, lr)
    return p, m, v


def test_reference_matches_torch_adamw_with_clipping_over_20_steps():
    torch = pytest.importorskip("torch")
    hyper = ref.Hyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, max_norm=1.0)
    shapes, params, grads = _problem()
    ours, _, _ = _run_reference(params, grads, hyper)

    tparams = [torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for p in params]
    opt = torch.optim.AdamW(tparams, lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                            weight_decay=hyper.weight_decay, foreach=False)
    clipped_steps = 0
    for t in range(1, STEPS + 1):
        for tp, g in zip(tparams, grads[t - 1]):
            tp.grad = torch.tensor(g, dtype=torch.float64)
        norm = float(torch.nn.utils.clip_grad_norm_(tparams, hyper.max_norm, foreach=False))
        clipped_steps += norm > hyper.max_norm
        assert ref.global_norm(grads[t - 1]) == pytest.approx(norm, rel=2.0**-20)
        for group in opt.param_groups:
            group["lr"] = ref.lr_at(t, hyper.lr, 3, STEPS, min_lr=hyper.lr * 0.1)
        opt.step()
    assert 0 < clipped_steps < STEPS  # both regimes exercised
    # Justification of the tolerance: the contract rounds p, m, v to float32 once per step (torch keeps
    # float64 here), a relative error of 2^-24 per stored value and step; the fixed-point norm (B = 23,
    # N = 283 elements) is within sqrt(N) * 2^-22 < 2^-17 relative, moving c and so g' by that much,
    # and Adam's update m^/sqrt(v^) is of order 1 and scaled by lr <= 1e-2. Over 20 steps the difference
    # is at most 20 * (2^-23 * |p| + 1e-2 * 2^-16) < 2e-5 for |p| < 5, and must not be any larger.
    for p, tp in zip(ours, tparams):
        diff = np.abs(p.astype(np.float64) - tp.detach().numpy())
        bound = STEPS * (2.0**-23 * np.abs(p.astype(np.float64)) + 1e-2 * 2.0**-16)
        assert np.all(diff <= bound), float((diff - bound).max())


def test_reference_is_bitwise_deterministic_and_ops_update_in_place():
    hyper = ref.Hyper(lr=3e-3, weight_decay=0.01, max_norm=0.5)
    _, params, grads = _problem(1)
    a, b = _run_reference(params, grads, hyper), _run_reference(params, grads, hyper)
    for x, y in zip(a, b):
        assert all(np.array_equal(u, w) for u, w in zip(_bits(x), _bits(y)))

    backend = CpuBackend()
    p = [x.copy() for x in params]
    m = [np.zeros_like(x) for x in params]
    v = [np.zeros_like(x) for x in params]
    for t in range(1, STEPS + 1):
        lr = ref.lr_at(t, hyper.lr, 3, STEPS, min_lr=hyper.lr * 0.1)
        info = adamw_op.adamw_step(backend, p, grads[t - 1], m, v, t, hyper, lr)
        assert info.clip == ref.clip_factor(grads[t - 1], hyper.max_norm)
    for got, want in zip((p, m, v), a):
        assert all(np.array_equal(u, w) for u, w in zip(_bits(got), _bits(want)))


def test_global_norm_is_exact_up_to_the_fixed_point_grid():
    rng = np.random.default_rng(2)
    grads = [(rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)).astype(np.float32) for n in (5, 1000, 77)]
    exact = math.sqrt(float(sum(Fraction(float(x)) ** 2 for g in grads for x in g)))
    n = sum(g.size for g in grads)
    e = max(math.frexp(float(np.abs(g).max()))[1] - 1 for g in grads)
    assert abs(ref.global_norm(grads) - exact) <= math.sqrt(n) * 2.0 ** (e - 22) + exact * 2.0**-50
    # the chunked sum equals one big exact sum: concatenation and order of tensors do not matter
    assert ref.global_norm(grads) == ref.global_norm([np.concatenate(grads[::-1])])
    big = rng.standard_normal(ref.NORM_CHUNK * 2 + 3).astype(np.float32)
    assert ref.global_norm([big]) == ref.global_norm([big[: ref.NORM_CHUNK + 1], big[ref.NORM_CHUNK + 1:]])


def test_edge_cases():
    zeros = [np.zeros(4, np.float32), np.full(3, -0.0, np.float32), np.zeros(0, np.float32)]
    assert ref.global_norm(zeros) == 0.0 and ref.clip_factor(zeros, 1.0) == 1.0
    assert ref.global_norm([]) == 0.0
    sub = [np.array([2.0**-149, -(2.0**-140)], np.float32)]
    assert ref.global_norm(sub) == pytest.approx(math.hypot(2.0**-149, 2.0**-140), rel=2.0**-20)
    huge = [np.array([3.4e38, -3.4e38], np.float32)]
    assert ref.global_norm(huge) == pytest.approx(math.sqrt(2) * float(np.float32(3.4e38)), rel=2.0**-20)
    assert math.isinf(ref.global_norm([np.array([1.0, np.inf], np.float32)]))
    assert ref.clip_factor([np.array([1.0, -np.inf], np.float32)], 1.0) == 0.0
    assert math.isnan(ref.clip_factor([np.array([1.0, np.nan], np.float32)], 1.0))
    assert ref.clip_factor([np.array([1.0, np.nan], np.float32)], None) == 1.0
    hyper = ref.Hyper(max_norm=1.0)
    p, m, v = ref.adamw_step([np.ones(3, np.float32)], [np.array([1.0, np.nan, 0.0], np.float32)],
                             [np.zeros(3, np.float32)], [np.zeros(3, np.float32)], 1, hyper)
    for x in (p[0], m[0], v[0]):
        assert np.all(x.view(np.uint32) == 0x7FC00000)  # a NaN norm poisons every element, canonically


def test_schedule():
    peak, warmup, total, floor = 1e-3, 10, 110, 1e-5
    assert ref.lr_at(0, peak, warmup, total) == 0.0
    assert ref.lr_at(5, peak, warmup, total) == peak * (5 / 10)
    assert ref.lr_at(warmup, peak, warmup, total, floor) == peak
    assert ref.lr_at(total, peak, warmup, total, floor) == pytest.approx(floor, abs=1e-20)
    assert ref.lr_at(total + 50, peak, warmup, total, floor) == ref.lr_at(total, peak, warmup, total, floor)
    assert ref.lr_at(60, peak, warmup, total, floor) == pytest.approx(floor + (peak - floor) * 0.5, rel=1e-15)
    values = [ref.lr_at(t, peak, warmup, total, floor) for t in range(warmup, total + 1)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    for t in range(warmup, total + 1, 7):  # the contract's cos against libm's, a few ulp apart
        expected = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
        assert ref.lr_at(t, peak, warmup, total, floor) == pytest.approx(expected, rel=1e-13, abs=1e-19)
    assert ref.lr_at(3, peak, 0, total) == pytest.approx(peak * 0.5 * (1 + math.cos(math.pi * 3 / total)), rel=1e-13)


def test_bias_correction_powers():
    for beta in (0.9, 0.999, 0.95):
        for t in (1, 2, 3, 10, 1000, 12345):
            assert ref.power(beta, t) == pytest.approx(beta**t, rel=1e-13)
    assert ref.power(0.9, 0) == 1.0
    with pytest.raises(ValueError):
        ref.hyper_scalars(ref.Hyper(), 0)


def test_exact_sum_is_the_python_integer_sum():
    from rlportable.ops.adamw import exact_sum

    rng = np.random.default_rng(5)
    values = rng.integers(0, 1 << 62, 100_000, dtype=np.int64)
    values[:3] = (1 << 62) - 1  # the largest chunk sum the contract allows
    assert exact_sum(values) == sum(int(v) for v in values)
    assert exact_sum(np.zeros(0, np.int64)) == 0

