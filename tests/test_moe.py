"""The moe contract's reference (contracts/moe.toml): invariances on raw bits, the tie rule, edge cases,
and accuracy against float64 and a bf16 computation of the same block."""

import ml_dtypes
import numpy as np
import pytest

from rlportable.conform.moe import random_block
from rlportable.contract import fixedpoint as fp, moe
from rlportable.ops import moe as moe_op
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype == np.float32:
        return a.shape == b.shape and np.array_equal(bits(a), bits(b))
    return a.shape == b.shape and np.array_equal(a, b)


@pytest.fixture(scope="module")
def block():
    rng = np.random.default_rng(3)
    router, gate, up, down = random_block(rng, hidden=32, inner=24, experts=8)
    h = rng.standard_normal((48, 32)).astype(np.float32)
    return h, router, gate, up, down


@pytest.mark.parametrize("k,norm", [(1, False), (2, True), (3, False), (8, True)])
def test_a_token_has_the_same_bits_alone_in_a_batch_and_in_any_order(block, k, norm):
    h, router, gate, up, down = block
    whole = moe.moe_block(h, router, gate, up, down, k, norm)
    for t in (0, 17, 47):
        alone = moe.moe_block(h[t:t + 1], router, gate, up, down, k, norm)
        assert all(same(a[0], w[t]) for a, w in zip(alone, whole))
    order = np.random.default_rng(k).permutation(h.shape[0])
    shuffled = moe.moe_block(h[order], router, gate, up, down, k, norm)
    assert all(same(s, w[order]) for s, w in zip(shuffled, whole))
    # a batch of repeated and mixed tokens: every copy has its own row's bits
    mixed = np.concatenate([h[5:6], h[:3], h[5:6]])
    out = moe.moe_block(mixed, router, gate, up, down, k, norm)[0]
    assert same(out[0], whole[0][5]) and same(out[4], whole[0][5]) and same(out[1:4], whole[0][:3])


def test_any_grouping_of_tokens_by_expert_gives_the_same_bits(block):
    h, router, gate, up, down = block
    experts, weights = moe.route(moe.router_logits(h, router), 3, True)
    grouped = moe.expert_outputs(h, experts, gate, up, down)
    rng = np.random.default_rng(0)
    for group_rows in (1, 2, 7, None):
        order = rng.permutation(experts.size)
        assert same(moe.expert_outputs(h, experts, gate, up, down, order=order, group_rows=group_rows), grouped)
    # one token at a time through its experts, one expert at a time (no grouping at all)
    for t in range(h.shape[0]):
        for j in range(3):
            e = experts[t, j]
            g = moe.exact.gemm(h[t:t + 1], gate[e], 23, 15)
            u = moe.exact.gemm(h[t:t + 1], up[e], 23, 15)
            y = moe.exact.gemm(moe.activation.swiglu(g, u), down[e], 23, 15)
            assert same(y[0], grouped[t, j])
    # the order of a token's k experts in the combine does not matter (integer sums)
    slots = np.array([2, 0, 1])
    assert same(moe.combine(weights[:, slots], grouped[:, slots]), moe.combine(weights, grouped))


def test_the_ops_block_is_the_reference(block):
    h, router, gate, up, down = block
    weight = moe_op.encode(CPU, router, gate, up, down, 2, True)
    got = moe_op.block(CPU, h, weight)
    want = moe.moe_block(h, router, gate, up, down, 2, True)
    assert all(same(g, w) for g, w in zip(got, want))
    # the backward runs on devices too (tests/test_moe_device.py, conform's moe.block_backward)


def test_ties_go_to_the_lower_expert_index():
    logits = np.array([[1.0, 3.0, 3.0, 2.0, 3.0],
                       [-0.0, 0.0, -1.0, 0.0, -2.0],
                       [0.5, 0.5, 0.5, 0.5, 0.5]], dtype=np.float32)
    experts, weights = moe.route(logits, 3, False)
    assert experts.tolist() == [[1, 2, 4], [0, 1, 3], [0, 1, 2]]
    assert same(weights[0, 0], weights[0, 1]) and same(weights[0, 1], weights[0, 2])
    assert np.all(weights[2] == np.float32(0.2))
    assert moe.route(logits, 1, True)[0].tolist() == [[1], [0], [0]]
    assert np.all(moe.route(logits, 1, True)[1] == 1.0)  # one expert, renormalised: exactly 1


def test_route_weights_against_float64():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((200, 64)) * 3).astype(np.float32)
    for norm in (False, True):
        experts, weights = moe.route(logits, 8, norm)
        z = logits.astype(np.float64)
        p = np.exp(z - z.max(axis=1, keepdims=True))
        want_experts = np.argsort(-z, axis=1, kind="stable")[:, :8]
        assert np.array_equal(experts, want_experts)
        chosen = np.take_along_axis(p, want_experts, axis=1)
        want = chosen / (chosen.sum(axis=1, keepdims=True) if norm else p.sum(axis=1, keepdims=True))
        # exp_f32 is correctly rounded (2^-24 relative), its argument z - m a float32 subtraction
        # (|z - m| 2^-24 absolute, |z - m| < 25 here), the sum's 2^-36 grid is negligible, and the
        # weight's own rounding adds 2^-24: 2^-18 bounds the sum of these with room to spare
        assert np.abs(weights / want - 1).max() < 2.0**-18, norm
        if norm:
            assert np.abs(weights.astype(np.float64).sum(axis=1) - 1).max() <= 8 * 2.0**-23


def test_route_and_combine_edge_cases():
    logits = np.array([[np.nan, 1.0, 2.0], [np.inf, 0.0, 1.0], [-np.inf] * 3, [1.0, -np.inf, -np.inf],
                       [0.0, -200.0, -1.0]], dtype=np.float32)
    experts, weights = moe.route(logits, 2, True)
    assert experts[:3].tolist() == [[0, 1]] * 3
    assert np.all(bits(weights[:3]) == fp.CANONICAL_NAN_BITS)
    assert experts[3].tolist() == [0, 1] and weights[3].tolist() == [1.0, 0.0]  # a -inf logit: weight +0
    assert experts[4].tolist() == [0, 2]
    assert same(moe.route(logits[4:], 3, False)[1][0, 2], np.float32(0.0))  # exp underflow: +0
    # a zero weight removes its expert even where that expert's output is inf or NaN
    outputs = np.array([[[1.0, -0.0, 2.0], [np.inf, np.nan, -np.inf]]], dtype=np.float32)
    out = moe.combine(np.array([[0.5, 0.0]], dtype=np.float32), outputs)
    assert same(out, np.array([[0.5, 0.0, 1.0]], dtype=np.float32))  # -0 * 0.5 sums to +0
    out = moe.combine(np.array([[0.5, 0.5]], dtype=np.float32), outputs)
    assert out[0, 0] == np.inf and bits(out[0, 1]) == fp.CANONICAL_NAN_BITS and out[0, 2] == -np.inf
    out = moe.combine(np.array([[np.nan, 0.5]], dtype=np.float32), np.zeros_like(outputs))
    assert np.all(bits(out) == fp.CANONICAL_NAN_BITS)
    # a non-finite h row: NaN logits, the canonical NaN over its whole output row
    rng = np.random.default_rng(1)
    router, gate, up, down = random_block(rng, hidden=8, inner=4, experts=4)
    h = rng.standard_normal((2, 8)).astype(np.float32)
    h[1, 3] = np.inf
    out, experts, _ = moe.moe_block(h, router, gate, up, down, 2, True)
    assert np.all(np.isfinite(out[0])) and np.all(bits(out[1]) == fp.CANONICAL_NAN_BITS)
    assert experts[1].tolist() == [0, 1]
    assert moe.moe_block(h[:0], router, gate, up, down, 2, True)[0].shape == (0, 8)


def test_combine_is_one_rounding_of_the_exact_sum():
    rng = np.random.default_rng(2)
    weights = rng.random((50, 4)).astype(np.float32)
    outputs = rng.standard_normal((50, 4, 16)).astype(np.float32)
    outputs[:, 1] *= np.float32(1e-6)  # terms of very different sizes: a float32 sum would drop bits
    out = moe.combine(weights, outputs)
    from fractions import Fraction

    for t, c in ((0, 0), (7, 5), (49, 15)):
        exact = sum(Fraction(float(weights[t, j])) * Fraction(float(outputs[t, j, c])) for j in range(4))
        # RNE of the exact value, unless a term lies below the 2^-36 grid of the largest (then within it)
        assert abs(Fraction(float(out[t, c])) - exact) <= abs(exact) * Fraction(1, 2**23)


# ---- accuracy of the whole block against float64, beside a bf16 computation of it
# The contract's promise (docs/design.md) is an error at most 1/10 of a bf16 forward's against float64.
# Here: activations carry 23 bits and weights 15 bits relative to their row's largest element (errors
# near 2^-15 per product), where bf16 rounds every operand and every op's output to 8 bits (2^-9).


def _block_float64(h, router, gate, up, down, k, norm, experts=None):
    h = h.astype(np.float64)
    z = h @ router.astype(np.float64).T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    top = np.argsort(-z, axis=1, kind="stable")[:, :k] if experts is None else experts
    chosen = np.take_along_axis(p, top, axis=1)
    w = chosen / (chosen.sum(axis=1, keepdims=True) if norm else p.sum(axis=1, keepdims=True))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(k):
            e = top[t, j]
            g, u = gate[e].astype(np.float64) @ h[t], up[e].astype(np.float64) @ h[t]
            out[t] += w[t, j] * (down[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    return out, top, z


def _block_bf16(h, router, gate, up, down, k, norm, experts):
    """HF's bf16 block: operands and every op's output rounded to bf16, products summed in float32,
    the router softmax in float32 (transformers' Qwen3MoeTopKRouter), the same experts as float64's."""
    def r(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)

    hb = r(h)
    z = r(hb @ r(router).T)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    chosen = np.take_along_axis(p, experts, axis=1)
    w = r(chosen / chosen.sum(axis=1, keepdims=True) if norm else chosen)
    out = np.zeros(h.shape, np.float32)
    for t in range(h.shape[0]):
        for j in range(k):
            e = experts[t, j]
            g, u = r(r(gate[e]) @ hb[t]), r(r(up[e]) @ hb[t])
            a = r(r(g / (1 + np.exp(-g))) * u)
            out[t] = r(out[t] + r(r(r(down[e]) @ a) * w[t, j]))
    return out


@pytest.mark.parametrize("k,norm", [(2, True), (4, False)])
def test_block_accuracy_against_float64_and_bf16(k, norm):
    rng = np.random.default_rng(11)
    router, gate, up, down = random_block(rng, hidden=64, inner=48, experts=16, scale=0.15)
    h = rng.standard_normal((64, 64)).astype(np.float32)
    ours, experts, _ = moe.moe_block(h, router, gate, up, down, k, norm)
    want, top, z = _block_float64(h, router, gate, up, down, k, norm)
    # the expert choices equal float64's wherever float64's margin between the k-th and (k+1)-th logit
    # is above the router logits' error (23 x 15 bits: well below 1e-3 at these magnitudes)
    zs = -np.sort(-z, axis=1)
    clear = zs[:, k - 1] - zs[:, k] > 1e-3
    assert np.array_equal(np.sort(experts[clear], axis=1), np.sort(top[clear], axis=1))
    rows = clear  # compare outputs where both chose the same experts
    ours_error = np.abs(ours[rows] - want[rows]).max()
    bf16_error = np.abs(_block_bf16(h, router, gate, up, down, k, norm, top)[rows] - want[rows]).max()
    assert ours_error * 10 <= bf16_error, (ours_error, bf16_error)
