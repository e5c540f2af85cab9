"""Op "gather_backward" (embedding) on the cpu backend: the table gradient against exact sums, the token
order of its float64 additions, edge values, input checks, and the conformance check on cpu.

The device kernels are checked bitwise against the same reference by `rlportable conform`
(rlportable/conform/embedding.py).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rlportable.conform.embedding import CHECKS
from rlportable.contract import embedding as reference
from rlportable.errors import InputError
from rlportable.ops import embedding
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
NAN_BITS = 0x7FC00000


def _bits(a):
    return np.asarray(a).view(np.uint32)


def _case(vocab: int, hidden: int, tokens: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, max(1, vocab // 3), tokens).astype(np.int32)  # repeats, and ids with no tokens
    scales = np.ldexp(np.float32(1.0), rng.integers(-20, 20, (tokens, 1)))  # rows of different magnitudes
    dy = (rng.standard_normal((tokens, hidden)) * scales).astype(np.float32)
    return ids, dy


def _token_order_sum(ids, dy, vocab) -> np.ndarray:
    """The contract written as plain Python: float64 additions from +0 in increasing token index."""
    total = [[0.0] * dy.shape[1] for _ in range(vocab)]
    for t, v in enumerate(ids.tolist()):
        for h in range(dy.shape[1]):
            total[v][h] += float(dy[t, h])
    out = np.array(total, dtype=np.float64).reshape(vocab, dy.shape[1]).astype(np.float32)
    out[np.isnan(out)] = np.uint32(NAN_BITS).view(np.float32)
    return out


def test_equals_the_token_order_float64_sum_bitwise():
    ids, dy = _case(40, 11, 200, seed=0)
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 40)
    assert dtable.shape == (40, 11) and dtable.dtype == np.float32
    assert np.array_equal(_bits(dtable), _bits(_token_order_sum(ids, dy, 40)))
    assert np.array_equal(_bits(dtable), _bits(reference.gather_backward(ids, dy, 40)))


def test_close_to_the_exact_sum():
    # Each float64 addition errs by <= 2^-53 of its partial sum, so n terms err by <= n 2^-53 sum|dy|;
    # the one conversion adds half a float32 ulp (<= 2^-24 |sum|, 2^-150 among subnormals). The bound
    # below doubles each part.
    ids, dy = _case(30, 9, 500, seed=1)
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 30)
    counts = np.bincount(ids, minlength=30)[:, None]
    for v in range(30):
        for h in range(9):
            terms = dy[ids == v, h].astype(np.float64)
            exact = math.fsum(terms)
            bound = 2.0**-23 * abs(exact) + counts[v, 0] * 2.0**-52 * np.abs(terms).sum() + 2.0**-149
            assert abs(float(dtable[v, h]) - exact) <= bound


def test_is_the_gradient_of_the_gather():
    # L(table) = sum_t <dy_t, table[ids_t]> is linear in the table: central differences in float64 with
    # h = 1 are exact up to float64 rounding of L (about 2^-52 |L| / h), far below dtable's float32 rounding
    ids, dy = _case(7, 3, 25, seed=2)
    table = np.random.default_rng(3).standard_normal((7, 3))
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 7)

    def loss(t):
        return float((dy.astype(np.float64) * t[ids]).sum())

    for v in range(7):
        for h in range(3):
            up, down = table.copy(), table.copy()
            up[v, h] += 1.0
            down[v, h] -= 1.0
            numeric = (loss(up) - loss(down)) / 2.0
            assert abs(numeric - float(dtable[v, h])) <= 2.0**-23 * abs(numeric) + 1e-12 * np.abs(dy).sum()


def test_rows_without_tokens_are_positive_zero():
    ids = np.array([2, 2, 5], dtype=np.int32)
    dy = np.array([[-0.0, 1.0], [-0.0, -1.0], [3.0, -0.0]], dtype=np.float32)
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 8)
    others = [0, 1, 3, 4, 6, 7]
    assert not _bits(dtable[others]).any()
    assert _bits(dtable[2]).tolist() == [0, 0]  # +0 + -0 + -0 = +0; 1 + -1 = +0
    assert dtable[5].tolist() == [3.0, 0.0] and _bits(dtable[5])[1] == 0
    assert not _bits(embedding.gather_backward(CPU, ids[:0], ids[:0], dy[:0], 4)).any()
    assert embedding.gather_backward(CPU, ids, ids, dy[:, :0], 8).shape == (8, 0)


def test_non_finite_and_overflow():
    big = np.float32(3e38)
    ids = np.array([0, 0, 1, 1, 2, 3, 3], dtype=np.int32)
    dy = np.array([[np.inf], [-np.inf], [np.inf], [1.0], [np.uint32(0x7FC12345).view(np.float32)], [big], [big]],
                  dtype=np.float32)
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 4)
    assert _bits(dtable[0])[0] == NAN_BITS and dtable[1, 0] == np.inf
    assert _bits(dtable[2])[0] == NAN_BITS  # the payload is not kept: the canonical NaN
    assert dtable[3, 0] == np.inf  # 6e38 in float64, beyond FLT_MAX once converted


def test_addition_order_is_the_token_index():
    # the same four values, interleaved between two rows in opposite orders: float64 keeps 1 + 2^-24 + 2^-52
    # only when the two 2^-53 meet first, and float32 rounds that up (above the tie 1 + 2^-24) but 1 + 2^-24
    # down (the tie, to even); so each row's bits show the order its tokens were added in
    one, mid, tiny = np.float32(1.0), np.float32(2.0**-24), np.float32(2.0**-53)
    ids = np.array([0, 1, 0, 1, 0, 1, 0, 1], dtype=np.int32)
    dy = np.array([[one], [tiny], [mid], [tiny], [tiny], [mid], [tiny], [one]], dtype=np.float32)
    dtable = embedding.gather_backward(CPU, ids, ids, dy, 2)
    assert float(dtable[0, 0]) == 1.0  # ((1 + 2^-24) + 2^-53) + 2^-53: each 2^-53 is a float64 tie, to even
    assert float(dtable[1, 0]) == 1.0 + 2.0**-23  # ((2^-53 + 2^-53) + 2^-24) + 1 = 1 + 2^-24 + 2^-52 exactly


def test_token_lists():
    ids = np.array([3, 1, 3, 0, 1, 3], dtype=np.int32)
    offsets, order = reference.token_lists(ids, 5)
    assert offsets.dtype == np.int32 and order.dtype == np.int32
    assert offsets.tolist() == [0, 1, 3, 3, 6, 6]
    assert order.tolist() == [3, 1, 4, 0, 2, 5]


def test_host_ids_may_be_copied_back():
    ids, dy = _case(50, 4, 60, seed=4)
    assert np.array_equal(_bits(embedding.gather_backward(CPU, ids, None, dy, 50)),
                          _bits(embedding.gather_backward(CPU, ids, ids, dy, 50)))


@pytest.mark.parametrize("args,message", [
    (lambda ids, dy: (ids, np.array([0, 20], np.int32), dy, 20), r"ids\[1\] = 20 is outside the table's \[0, 20\)"),
    (lambda ids, dy: (np.array([-1, 0], np.int32), None, dy, 20), r"ids\[0\] = -1"),
    (lambda ids, dy: (ids.astype(np.int64), None, dy, 20), r"ids must be int32 of shape \(2,\)"),
    (lambda ids, dy: (ids[:1], None, dy, 20), r"ids must be int32 of shape \(2,\) \(dy's rows\)"),
    (lambda ids, dy: (ids, ids[:1], dy, 20), r"host_ids must be integers of shape \(2,\)"),
    (lambda ids, dy: (ids, ids.astype(np.float32), dy, 20), "host_ids must be integers"),
    (lambda ids, dy: (ids, ids, dy.astype(np.float64), 20), "dy must have dtype float32"),
    (lambda ids, dy: (ids, ids, dy[0], 20), "dy must be a 2-D matrix"),
    (lambda ids, dy: (ids, ids, dy, 0), r"vocab must be an integer in \[1, 2\^31\), got 0"),
    (lambda ids, dy: (ids, ids, dy, 20.0), "vocab must be an integer"),
    (lambda ids, dy: (ids, ids, dy, True), "vocab must be an integer"),
])
def test_input_errors(args, message):
    ids, dy = np.array([0, 1], np.int32), np.ones((2, 4), np.float32)
    with pytest.raises(InputError, match=message):
        embedding.gather_backward(CPU, *args(ids, dy))


def test_conformance_check_on_cpu():
    check = dict(CHECKS)["embedding.gather_backward"]
    tally = check(CPU, np.random.default_rng(0), True)
    assert tally.compared > 0 and tally.mismatches == 0
