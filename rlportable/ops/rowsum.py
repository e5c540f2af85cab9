"""Op family "rowsum": exact sum of each float32 row (sums of squares, of exponentials).

Contract: contracts/rowsum.toml; reference: rlportable/contract/exact.py rowsum;
kernels: backends/portable/rowsum.hip.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import exact
from rlportable.errors import InputError
from rlportable.ops.checks import require_bits, require_matrix

DEFAULT_BITS = 38
ROWSUM_THREADS = 256


def rowsum(backend, x, bits: int = DEFAULT_BITS):
    rows, k = require_matrix("x", x)
    bits = require_bits("bits", bits)
    if k > exact.rowsum_max_k(bits):
        raise InputError(f"rowsum: row length {k} exceeds the contract's limit {exact.rowsum_max_k(bits)} for {bits} bits")
    if backend.runs_reference:
        return exact.rowsum(backend.to_numpy(x), bits)
    y = backend.empty((rows,), np.float32)
    if rows:
        backend.launch("rowsum", "rowsum_exact", (min(rows, 65535),), (ROWSUM_THREADS,),
                       (x, np.int64(rows), np.int32(k), np.int32(bits), y))
    return y
