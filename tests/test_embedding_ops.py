"""Op family "embedding" on the cpu backend: a bit copy of rows; ids checked on the host."""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.errors import InputError
from rlportable.ops import embedding
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def test_gather_copies_bits():
    rng = np.random.default_rng(0)
    table = rng.integers(0, 2**32, size=(20, 9), dtype=np.uint64).astype(np.uint32).view(np.float32)
    ids = np.array([3, 0, 19, 3], dtype=np.int32)
    out = embedding.gather(CPU, table, ids)
    assert out.shape == (4, 9) and out.dtype == np.float32
    assert np.array_equal(out.view(np.uint32), table.view(np.uint32)[ids])  # NaN payloads and -0 kept
    assert embedding.gather(CPU, table, np.zeros(0, np.int32)).shape == (0, 9)
    assert embedding.embed is embedding.gather


@pytest.mark.parametrize("ids,message", [
    (np.array([0, 20], np.int32), r"ids\[1\] = 20 is outside the table's \[0, 20\)"),
    (np.array([-1], np.int32), r"ids\[0\] = -1"),
    (np.array([0, 1], np.int64), "ids must be a 1-D int32 array"),
    (np.zeros((2, 1), np.int32), "ids must be a 1-D int32 array"),
])
def test_input_errors(ids, message):
    with pytest.raises(InputError, match=message):
        embedding.gather(CPU, np.ones((20, 4), np.float32), ids)


def test_table_must_be_a_float32_matrix():
    with pytest.raises(InputError, match="table must have dtype float32"):
        embedding.gather(CPU, np.ones((20, 4), np.float64), np.zeros(1, np.int32))
