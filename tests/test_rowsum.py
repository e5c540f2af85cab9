from fractions import Fraction

import numpy as np
import pytest

from exact_oracle import quantize, round_fraction_to_f32
from rlportable.contract import exact
from rlportable.conform.inputs import random_rows
from rlportable.ops.rowsum import DEFAULT_BITS, rowsum
from rlportable.runtime import get_backend


@pytest.mark.parametrize("kind", ["normal", "massive", "tiny", "huge", "special", "zeros"])
def test_rowsum_equals_exact_oracle(kind):
    x = random_rows(np.random.default_rng(5), 7, 300, kind)
    got = exact.rowsum(x, DEFAULT_BITS).view(np.uint32)
    for row in range(7):
        q, e = quantize([float(v) for v in x[row]], DEFAULT_BITS)
        assert got[row] == round_fraction_to_f32(Fraction(sum(q)) * Fraction(2) ** (e - DEFAULT_BITS + 2))


def test_rowsum_ieee_specials():
    x = np.array([[1, np.inf], [1, -np.inf], [np.inf, -np.inf], [np.nan, 1], [0, -0.0]], dtype=np.float32)
    y = rowsum(get_backend("cpu"), x).view(np.uint32)
    assert y.tolist() == [0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00000, 0]


def test_rowsum_is_order_free():
    x = random_rows(np.random.default_rng(9), 3, 1000, "massive")
    reversed_rows = np.ascontiguousarray(x[:, ::-1])
    assert np.array_equal(exact.rowsum(x, 38).view(np.uint32), exact.rowsum(reversed_rows, 38).view(np.uint32))
