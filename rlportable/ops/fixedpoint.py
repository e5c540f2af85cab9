"""Op family "fixedpoint": rows of float32 -> (row exponents, int8 digit slices).

Contract: contracts/fixedpoint.toml; reference: rlportable/contract/fixedpoint.py;
kernels: backends/{cuda,hip}/fixedpoint.*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.ops.checks import require_bits, require_matrix, round_up
from rlportable.runtime.base import Backend

#: K is padded with zero digits to a multiple of this, so integer GEMMs see aligned rows.
K_ALIGN = 64
ENCODE_THREADS = 256


@dataclass
class EncodedRows:
    """Fixed-point rows: digits [rows, slices, k_padded] int8 and exponents [rows] int32."""

    digits: Any
    exponents: Any
    bits: int
    k: int
    descending: bool

    @property
    def rows(self) -> int:
        return int(self.exponents.shape[0])

    @property
    def slices(self) -> int:
        return fp.slice_count(self.bits)

    @property
    def k_padded(self) -> int:
        return int(self.digits.shape[2])


def encode_rows_reference(x: np.ndarray, bits: int, descending: bool = False) -> EncodedRows:
    q, e = fp.quantize_rows(x, bits)
    rows, k = q.shape
    digits = np.zeros((rows, fp.slice_count(bits), round_up(k, K_ALIGN)), dtype=np.int8)
    slices = np.moveaxis(fp.split_digits(q, bits), 0, 1)  # [rows, slices, k]
    digits[:, :, :k] = slices[:, ::-1, :] if descending else slices
    return EncodedRows(digits, e, bits, k, descending)


def encode_rows(backend: Backend, x, bits: int, descending: bool = False) -> EncodedRows:
    """Encode float32 rows on the backend; on cpu this is the reference."""
    rows, k = require_matrix("x", x)
    bits = require_bits("bits", bits)
    if backend.kernel_vendor is None:
        return encode_rows_reference(backend.to_numpy(x), bits, descending)
    slices = fp.slice_count(bits)
    digits = backend.empty((rows, slices, round_up(k, K_ALIGN)), np.int8)
    exponents = backend.empty((rows,), np.int32)
    if rows:
        grid = (min(rows, 65535),)
        backend.launch(
            "fixedpoint", "fixedpoint_encode_rows", grid, (ENCODE_THREADS,),
            (x, np.int64(rows), np.int32(k), np.int32(digits.shape[2]), np.int32(bits),
             np.int32(slices), np.int32(int(descending)), digits, exponents),
        )
    return EncodedRows(digits, exponents, bits, k, descending)
