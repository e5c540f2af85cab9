"""Conformance of the fixedpoint family (contracts/fixedpoint.toml): encode_rows, and the row-parallel
pieces row_exponents and encode_rows with given exponents (each K-shard encoded with the whole row's
exponent is the whole row's encoding on that shard), bitwise against the reference; and its golden case."""

from __future__ import annotations

from itertools import pairwise
from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import (
    GEMM_SHAPES_FULL, GEMM_SHAPES_QUICK, ROW_KINDS, gemm_shapes, random_bits, random_rows, shard_bounds, sizes,
    split_columns,
)
from rlportable.conform.tally import Tally
from rlportable.contract import fixedpoint as fp
from rlportable.ops import fixedpoint as fixedpoint_op, gemm as gemm_op
from rlportable.runtime.base import Backend


def check_fixedpoint(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in gemm_shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            for bits, descending in ((23, False), (15, True), (53, False), (9, False), (24, False)):
                expected = fixedpoint_op.encode_rows_reference(x, bits, descending)
                actual = fixedpoint_op.encode_rows(backend, backend.asarray(x), bits, descending)
                tally.add(backend.to_numpy(actual.exponents), expected.exponents)
                tally.add(backend.to_numpy(actual.digits), expected.digits)
    return tally


# ---- sharded: the per-rank pieces of a K-sharded gemm

def covering_exponents(rng, x: np.ndarray) -> np.ndarray:
    """Valid given exponents for the rows of x: each row's own exponent raised by 0..40 (at most 127),
    a few finite rows given the sentinel (as when another shard of the row is non-finite)."""
    own = fp.row_exponents(x).astype(np.int64)
    finite = own != int(fp.NONFINITE_EXPONENT)
    raised = np.minimum(own + rng.integers(0, 41, size=own.shape) * (rng.random(own.shape) < 0.7),
                        fp.MAX_FINITE_EXPONENT)
    given = np.where(finite, raised, own)
    given[rng.random(own.shape) < 0.1] = int(fp.NONFINITE_EXPONENT)
    return given.astype(np.int32)


def check_row_exponents(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in sizes(backend, quick, GEMM_SHAPES_QUICK, GEMM_SHAPES_FULL):
        for x in [random_rows(rng, m, k, kind) for kind in ROW_KINDS] + [random_bits(rng, (m, k))]:
            tally.add(backend.to_numpy(fixedpoint_op.row_exponents(backend, backend.asarray(x))), fp.row_exponents(x))
    # many short rows: every magnitude class as a row maximum, subnormal-only rows (each ilogb down to -149)
    subnormal = (rng.integers(0, 1 << 23, size=(2000, 7), dtype=np.uint64).astype(np.uint32)
                 >> rng.integers(0, 23, size=(2000, 1)).astype(np.uint32)).view(np.float32)
    for x in (random_bits(rng, (5000, 3)), subnormal, np.zeros((3, 5), np.float32) * np.float32(-1)):
        tally.add(backend.to_numpy(fixedpoint_op.row_exponents(backend, backend.asarray(x))), fp.row_exponents(x))
    return tally


def check_encode_rows_given(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in sizes(backend, quick, GEMM_SHAPES_QUICK, GEMM_SHAPES_FULL):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            given = covering_exponents(rng, x)
            for bits, descending in ((23, False), (15, True), (53, False), (9, False), (24, False)):
                expected = fixedpoint_op.encode_rows_reference(x, bits, descending, given)
                actual = fixedpoint_op.encode_rows(backend, backend.asarray(x), bits, descending,
                                                   exponents=backend.asarray(given))
                tally.add(backend.to_numpy(actual.exponents), expected.exponents)
                tally.add(backend.to_numpy(actual.digits), expected.digits)
            _check_shards_slice_the_row(backend, rng, tally, x)
    return tally


def _check_shards_slice_the_row(backend: Backend, rng, tally: Tally, x: np.ndarray) -> None:
    """Each K-shard encoded with the whole row's exponent is the whole row's encoding on that shard."""
    for bits, descending in ((gemm_op.DEFAULT_BITS_A, False), (gemm_op.DEFAULT_BITS_W, True)):
        whole = fixedpoint_op.encode_rows_reference(x, bits, descending)
        exponents = backend.asarray(whole.exponents)
        bounds = shard_bounds(rng, x.shape[1], 3)
        for (a, b), shard in zip(pairwise(bounds), split_columns(x, bounds)):
            encoded = fixedpoint_op.encode_rows(backend, backend.asarray(shard), bits, descending, exponents=exponents)
            tally.add(backend.to_numpy(encoded.digits)[:, :, : b - a], whole.digits[:, :, a:b])


CHECKS: list[tuple[str, Callable]] = [
    ("fixedpoint.encode_rows", check_fixedpoint),
    ("fixedpoint.row_exponents", check_row_exponents),
    ("fixedpoint.encode_rows_given", check_encode_rows_given),
]


# ---- golden

GOLDEN_CASES = Cases("fixedpoint")


@GOLDEN_CASES.case("encode_rows", seed=1, shapes=[[1, 1], [7, 13], [4, 100], [3, 0]], kinds=STREAM_ROW_KINDS,
                   bits_descending=[[23, False], [15, True], [53, False], [9, False]])
def _fixedpoint_encode_rows(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x = backend.asarray(s.floats(shape, kind))
            for bits, descending in r["bits_descending"]:
                encoded = fixedpoint_op.encode_rows(backend, x, bits, descending)
                tag = f"{i}.{kind}.{bits}{'d' if descending else ''}"
                out += [(f"{tag}.exponents", host(backend, encoded.exponents, "int32")),
                        (f"{tag}.digits", host(backend, encoded.digits, "int8"))]
    return out
