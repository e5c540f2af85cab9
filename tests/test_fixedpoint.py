import numpy as np
import pytest

from exact_oracle import quantize
from rlportable.contract import fixedpoint as fp
from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.ops.fixedpoint import encode_rows, encode_rows_reference
from rlportable.runtime import get_backend


@pytest.mark.parametrize("bits,digits", [(8, 1), (9, 2), (15, 2), (16, 3), (23, 3), (24, 4), (53, 7)])
def test_slice_count_reaches_the_largest_integer(bits, digits):
    assert fp.slice_count(bits) == digits
    q = np.array([2 ** (bits - 1) - 1, -(2 ** (bits - 1) - 1), 0, 1, -1], dtype=np.int64)
    assert np.array_equal(fp.join_digits(fp.split_digits(q, bits)), q)


@pytest.mark.parametrize("kind", [k for k in ROW_KINDS if k != "nonfinite"])
@pytest.mark.parametrize("bits", [9, 15, 23, 40])
def test_quantize_matches_exact_fractions(kind, bits):
    x = random_rows(np.random.default_rng(bits), 6, 37, kind)
    q, e = fp.quantize_rows(x, bits)
    for row in range(x.shape[0]):
        expected_q, expected_e = quantize([float(v) for v in x[row]], bits)
        assert e[row] == expected_e
        assert q[row].tolist() == expected_q


def test_exponent_edge_cases():
    x = np.array([[0.0, -0.0], [1e-45, 0.0], [np.inf, 1.0], [np.nan, 0.0], [3.0, -4.0],
                  [np.finfo(np.float32).max, 0.0], [-1.1754942e-38, 0.0]], dtype=np.float32)
    e = fp.row_exponents(x)
    assert e.tolist() == [-149, -149, fp.NONFINITE_EXPONENT, fp.NONFINITE_EXPONENT, 2, 127, -127]
    q, _ = fp.quantize_rows(x, 23)
    assert not q[2].any() and not q[3].any()


def test_round_scaled_is_one_correct_rounding():
    from exact_oracle import round_fraction_to_f32
    from fractions import Fraction

    rng = np.random.default_rng(3)
    sums = np.concatenate([rng.integers(-2**61, 2**61, 400), rng.integers(-2**20, 2**20, 200), [0, 1, -1, 2**53 + 1]])
    scales = rng.integers(-240, 60, sums.size)
    got = fp.round_scaled(sums, scales).view(np.uint32)
    for s, k, bits in zip(sums.tolist(), scales.tolist(), got.tolist()):
        assert bits == round_fraction_to_f32(Fraction(s) * Fraction(2) ** k), (s, k)


def test_encode_layout_and_padding():
    x = random_rows(np.random.default_rng(0), 3, 70, "normal")
    up = encode_rows_reference(x, 23)
    down = encode_rows_reference(x, 23, descending=True)
    assert up.digits.shape == (3, 3, 128)
    assert np.array_equal(up.digits[:, ::-1], down.digits)
    assert not up.digits[:, :, 70:].any()
    backend = get_backend("cpu")
    assert np.array_equal(encode_rows(backend, x, 23).digits, up.digits)
