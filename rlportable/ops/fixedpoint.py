"""Op family "fixedpoint": rows of float32 -> (row exponents, int8 digit slices).

Contract: contracts/fixedpoint.toml; reference: rlportable/contract/fixedpoint.py;
kernels: backends/portable/fixedpoint.hip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.checks import require_bits, require_contiguous, require_matrix, round_up, shape_of
from rlportable.runtime.base import Backend

#: K is padded with zero digits to a multiple of this, so integer GEMMs see aligned rows.
K_ALIGN = 64
#: one block of this many threads per row: the fastest of 256, 512 and 1024 at decode's rows on the
#: H200 (bench/results/row_threads_probe_h200.json)
ENCODE_THREADS = 512


@dataclass
class EncodedRows:
    """Fixed-point rows: digits [rows, slices, k_padded] int8 and exponents [rows] int32."""

    digits: Any
    exponents: Any
    bits: int
    k: int
    descending: bool
    #: on cpu, the integers q [rows, k] int64 the digits were split from (the reference's products
    #: read them instead of joining the digits again); None on devices
    host_q: Any = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return int(self.exponents.shape[0])

    @property
    def slices(self) -> int:
        return fp.slice_count(self.bits)

    @property
    def k_padded(self) -> int:
        return int(self.digits.shape[2])


def encode_rows_reference(x: np.ndarray, bits: int, descending: bool = False, exponents=None) -> EncodedRows:
    q, e = fp.quantize_rows(x, bits, exponents)
    rows, k = q.shape
    digits = np.zeros((rows, fp.slice_count(bits), round_up(k, K_ALIGN)), dtype=np.int8)
    slices = np.moveaxis(fp.split_digits(q, bits), 0, 1)  # [rows, slices, k]
    digits[:, :, :k] = slices[:, ::-1, :] if descending else slices
    return EncodedRows(digits, e, bits, k, descending, host_q=q)


def joined_integers(encoded: EncodedRows) -> np.ndarray:
    """The q int64 [rows, k] of host-side encoded rows (the inverse of encode_rows_reference's digit split)."""
    if encoded.host_q is not None:
        return encoded.host_q
    digits = np.asarray(encoded.digits)[:, :, : encoded.k]
    ascending = digits[:, ::-1] if encoded.descending else digits
    return fp.join_digits(np.moveaxis(ascending, 1, 0))


def row_exponents(backend: Backend, x):
    """int32 [rows]: each row's encoding exponent (contracts/fixedpoint.toml row_exponents).

    A K-shard's exponents, all-reduced by MAX over the shards, are the whole row's.
    """
    rows, k = require_matrix("x", x)
    if backend.runs_reference:
        return fp.row_exponents(backend.to_numpy(x))
    exponents = backend.empty((rows,), np.int32)
    if rows:
        backend.launch("fixedpoint", "fixedpoint_row_exponents", (min(rows, 65535),), (ENCODE_THREADS,),
                       (x, np.int64(rows), np.int32(k), exponents))
    return exponents


def _require_given_exponents(backend: Backend, x, rows: int, exponents) -> None:
    """One int32 exponent per row; on cpu also that each covers its row (a device does not check:
    it would cost the row-max pass that given exponents exist to skip)."""
    if shape_of(exponents) != (rows,) or np.dtype(exponents.dtype) != np.int32:
        raise InputError(f"encode_rows: exponents must be int32 [{rows}], got {np.dtype(exponents.dtype).name} "
                         f"{list(shape_of(exponents))}")
    require_contiguous("exponents", exponents)
    if backend.runs_reference:
        bad = np.flatnonzero(~fp.given_exponents_cover(backend.to_numpy(x), backend.to_numpy(exponents)))
        if bad.size:
            raise InputError(f"encode_rows: given exponent of row {int(bad[0])} is neither the sentinel nor in "
                             f"[the row's own exponent, {fp.MAX_FINITE_EXPONENT}] ({bad.size} rows)")


def encode_rows(backend: Backend, x, bits: int, descending: bool = False, exponents=None) -> EncodedRows:
    """Encode float32 rows on the backend; on cpu this is the reference.

    `exponents` (int32 [rows] on the backend, optional): encode each row with the given
    exponent instead of its own; it must be the sentinel or in [the row's own exponent,
    127] (an all-reduce MAX of row_exponents over K-shards guarantees it). The result's
    exponents are then that same array.
    """
    rows, k = require_matrix("x", x)
    bits = require_bits("bits", bits)
    if exponents is not None:
        _require_given_exponents(backend, x, rows, exponents)
    if backend.runs_reference:
        return encode_rows_reference(backend.to_numpy(x), bits, descending,
                                     None if exponents is None else backend.to_numpy(exponents))
    if exponents is None:
        encoded = empty_encoding(backend, rows, k, bits, descending)
        _launch_encode(backend, x, bits, descending, encoded.digits, encoded.exponents)
        return encoded
    slices = fp.slice_count(bits)
    digits = backend.empty((rows, slices, round_up(k, K_ALIGN)), np.int8)
    if rows:
        backend.launch(
            "fixedpoint", "fixedpoint_encode_rows_given", (min(rows, 65535),), (ENCODE_THREADS,),
            (x, np.int64(rows), np.int32(k), np.int32(digits.shape[2]), np.int32(bits),
             np.int32(slices), np.int32(int(descending)), exponents, digits),
        )
    return EncodedRows(digits, exponents, bits, k, descending)


def empty_encoding(backend: Backend, rows: int, k: int, bits: int, descending: bool = False) -> EncodedRows:
    """An EncodedRows of `rows` rows of length k at `bits` bits, its arrays allocated, not written: for the
    kernels that write an encoding (the encoders here, and the fused ones that encode their output)."""
    digits = backend.empty((rows, fp.slice_count(bits), round_up(k, K_ALIGN)), np.int8)
    return EncodedRows(digits, backend.empty((rows,), np.int32), bits, k, descending)


def encode_rows_into(backend: Backend, x, bits: int, descending: bool, digits, exponents) -> None:
    """encode_rows with each row's own exponent, written into given device arrays: digits int8
    [rows, slices, round_up(k, K_ALIGN)] and exponents int32 [rows] (e.g. row ranges of a larger
    encoding: ops/gemm.py encode_stacked_weight)."""
    rows, k = require_matrix("x", x)
    bits = require_bits("bits", bits)
    if backend.runs_reference:
        raise InputError("encode_rows_into writes device arrays; on cpu use encode_rows")
    expected = ((rows, fp.slice_count(bits), round_up(k, K_ALIGN)), (rows,))
    if (shape_of(digits), shape_of(exponents)) != expected:
        raise InputError(f"encode_rows_into: digits and exponents must be {list(expected[0])} and {list(expected[1])}, "
                         f"got {list(shape_of(digits))} and {list(shape_of(exponents))}")
    _launch_encode(backend, x, bits, descending, digits, exponents)


def _launch_encode(backend: Backend, x, bits: int, descending: bool, digits, exponents) -> None:
    rows, k = shape_of(x)
    if rows:
        backend.launch(
            "fixedpoint", "fixedpoint_encode_rows", (min(rows, 65535),), (ENCODE_THREADS,),
            (x, np.int64(rows), np.int32(k), np.int32(digits.shape[2]), np.int32(bits),
             np.int32(fp.slice_count(bits)), np.int32(int(descending)), digits, exponents),
        )
