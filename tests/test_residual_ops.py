"""Op family "residual" on the cpu backend: the transpose (a bit copy) and its input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.errors import InputError
from rlportable.contract import residual as residual_ref
from rlportable.ops import residual
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def _random_bits(rng, shape) -> np.ndarray:
    """Every float32 class: NaN payloads (quiet and signalling, either sign), inf, subnormals, -0."""
    return rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (32, 32), (33, 31), (64, 100), (1, 257), (300, 1)])
def test_transpose_is_a_bit_copy(shape):
    x = _random_bits(np.random.default_rng(shape[0] * 1000 + shape[1]), shape)
    x[0, 0] = np.uint32(0x7F800001).view(np.float32)  # a signalling NaN: no arithmetic may quiet it
    y = residual.transpose(CPU, x)
    assert y.shape == (shape[1], shape[0]) and y.dtype == np.float32 and y.flags["C_CONTIGUOUS"]
    assert np.array_equal(y.view(np.uint32), x.view(np.uint32).T)
    assert np.array_equal(residual_ref.transpose(x).view(np.uint32), y.view(np.uint32))
    assert np.array_equal(residual.transpose(CPU, y).view(np.uint32), x.view(np.uint32))  # an involution


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_transpose_of_empty_matrices(shape):
    y = residual.transpose(CPU, np.zeros(shape, np.float32))
    assert y.shape == (shape[1], shape[0]) and y.dtype == np.float32


@pytest.mark.parametrize("x,message", [
    (np.ones(4, np.float32), r"transpose: x must be a 2-D matrix, got shape \(4,\)"),
    (np.ones((2, 3, 4), np.float32), "transpose: x must be a 2-D matrix"),
    (np.ones((2, 3), np.float64), "transpose: x must have dtype float32, got float64"),
    (np.ones((3, 2), np.float32).T, "transpose: x must be C-contiguous"),
])
def test_transpose_input_errors(x, message):
    with pytest.raises(InputError, match=message):
        residual.transpose(CPU, x)


def test_copy_rows_copies_bits_and_refuses_overlapping_pairs():
    from rlportable.errors import InputError
    from rlportable.ops import residual

    rng = np.random.default_rng(0)
    digits = rng.integers(-128, 128, size=(10, 2, 2, 64), dtype=np.int8)
    exponents = rng.integers(-200, 200, size=(10, 2), dtype=np.int32)
    src, dst = np.array([1, 4], np.int32), np.array([7, 2], np.int32)
    for array in (digits, exponents):
        expected = array.copy()
        expected[dst] = expected[src]
        residual.check_copy_pairs(src, dst, array.shape[0])
        residual.copy_rows(CPU, array, src, dst, 2)
        assert np.array_equal(array, expected)
    for bad_src, bad_dst in (([1, 2], [2, 3]), ([1, 4], [5, 5]), ([0], [10]), ([-1], [3])):
        with pytest.raises(InputError, match="copy_rows"):
            residual.check_copy_pairs(np.array(bad_src), np.array(bad_dst), 10)
