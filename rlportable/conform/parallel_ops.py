"""Conformance of the per-rank pieces of tensor parallelism, bitwise against the reference.

Row-parallel gemm: fixedpoint.row_exponents, encode_rows with given exponents,
gemm.gemm_sums and gemm.round_sums, and the k_sharding identity end to end
(contracts/gemm.toml round_sums): the ranks are emulated on one backend, with
NumPy (np.maximum, int64 sums) in place of the collectives.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Callable

import numpy as np

from rlportable.conform.inputs import GEMM_SHAPES_FULL, GEMM_SHAPES_QUICK, ROW_KINDS, random_rows
from rlportable.conform.tally import Tally
from rlportable.contract import exact, fixedpoint as fp
from rlportable.ops import fixedpoint as fixedpoint_op, gemm as gemm_op
from rlportable.runtime.base import Backend

#: (bits_a, bits_w) for gemm_sums and round_sums: the default and the other widths check_gemm_other_bits uses
BITS_PAIRS = ((gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W), (15, 15), (8, 8), (31, 15))
SHARD_COUNTS = (1, 2, 3, 4, 8)


def _shapes(backend: Backend, quick: bool):
    """The full list on devices; on cpu (the reference against itself) the quick one."""
    return GEMM_SHAPES_FULL if not quick and backend.kernel_vendor is not None else GEMM_SHAPES_QUICK


def _random_bits(rng, shape) -> np.ndarray:
    """float32 of uniformly random bit patterns: every class (NaN payloads, inf, subnormal, normal)."""
    return rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32)


def shard_bounds(rng, k: int, shards: int) -> np.ndarray:
    """shards + 1 ragged column bounds 0 = b_0 <= ... <= b_shards = k (empty shards allowed)."""
    cuts = np.sort(rng.integers(0, k + 1, size=shards - 1))
    return np.concatenate([[0], cuts, [k]]).astype(np.int64)


def split_columns(x: np.ndarray, bounds) -> list[np.ndarray]:
    """Contiguous K-shards x[:, b_s:b_{s+1}] (kernels read row-major memory)."""
    return [np.ascontiguousarray(x[:, a:b]) for a, b in pairwise(bounds)]


def row_parallel_gemm(backend: Backend, x_shards: list[np.ndarray], w_shards: list[np.ndarray],
                      bits_a: int = gemm_op.DEFAULT_BITS_A, bits_w: int = gemm_op.DEFAULT_BITS_W,
                      sum_order=None) -> np.ndarray:
    """Y = gemm(x, w) from K-shards, one emulated rank per shard (contracts/gemm.toml round_sums):
    all-reduce MAX of the row exponents, per-rank encodings and exact sums, all-reduce SUM in
    `sum_order` (any order gives the same int64), one rounding."""
    x_dev = [backend.asarray(x) for x in x_shards]
    w_dev = [backend.asarray(w) for w in w_shards]
    ea = np.maximum.reduce([backend.to_numpy(fixedpoint_op.row_exponents(backend, x)) for x in x_dev])
    ew = np.maximum.reduce([backend.to_numpy(fixedpoint_op.row_exponents(backend, w)) for w in w_dev])
    ea_dev, ew_dev = backend.asarray(ea), backend.asarray(ew)
    weights = [gemm_op.encode_weight(backend, w, bits_w, exponents=ew_dev) for w in w_dev]
    encoded = [fixedpoint_op.encode_rows(backend, x, bits_a, exponents=ea_dev) for x in x_dev]
    partial = [backend.to_numpy(gemm_op.gemm_sums(backend, a, weight)) for a, weight in zip(encoded, weights)]
    total = np.zeros((ea.shape[0], ew.shape[0]), dtype=np.int64)
    for rank in sum_order if sum_order is not None else range(len(partial)):
        total += partial[rank]
    return backend.to_numpy(gemm_op.round_sums(backend, backend.asarray(total), ea_dev, bits_a, weights[0]))


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
    for m, k, _ in _shapes(backend, quick):
        for x in [random_rows(rng, m, k, kind) for kind in ROW_KINDS] + [_random_bits(rng, (m, k))]:
            tally.add(backend.to_numpy(fixedpoint_op.row_exponents(backend, backend.asarray(x))), fp.row_exponents(x))
    # many short rows: every magnitude class as a row maximum, subnormal-only rows (each ilogb down to -149)
    subnormal = (rng.integers(0, 1 << 23, size=(2000, 7), dtype=np.uint64).astype(np.uint32)
                 >> rng.integers(0, 23, size=(2000, 1)).astype(np.uint32)).view(np.float32)
    for x in (_random_bits(rng, (5000, 3)), subnormal, np.zeros((3, 5), np.float32) * np.float32(-1)):
        tally.add(backend.to_numpy(fixedpoint_op.row_exponents(backend, backend.asarray(x))), fp.row_exponents(x))
    return tally


def check_encode_rows_given(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in _shapes(backend, quick):
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


def _gemm_operands(backend: Backend, rng, quick: bool):
    for m, k, n in _shapes(backend, quick):
        for kind in ROW_KINDS:
            yield random_rows(rng, m, k, kind), random_rows(rng, n, k, "normal" if kind == "nonfinite" else kind)
    yield random_rows(rng, 9, 40, "normal"), random_rows(rng, 6, 40, "nonfinite")  # non-finite weight rows


def check_gemm_sums(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for x, w in _gemm_operands(backend, rng, quick):
        for bits_a, bits_w in BITS_PAIRS:
            if x.shape[1] > exact.gemm_max_k(bits_a, bits_w):
                continue
            expected = exact.exact_int_matmul(fp.quantize_rows(x, bits_a)[0], fp.quantize_rows(w, bits_w)[0])
            weight = gemm_op.encode_weight(backend, backend.asarray(w), bits_w)
            encoded = fixedpoint_op.encode_rows(backend, backend.asarray(x), bits_a)
            tally.add(backend.to_numpy(gemm_op.gemm_sums(backend, encoded, weight)), expected)
    return tally


def random_sums(rng, m: int, n: int) -> np.ndarray:
    """int64 [m, n] sums: every magnitude class up to 2^62 (beyond 2^53 the round to odd matters), zeros."""
    magnitude_bits = rng.integers(0, 63, size=(m, n))
    sums = rng.integers(0, 1 << 62, size=(m, n), dtype=np.int64) >> (62 - magnitude_bits)
    sums[rng.random((m, n)) < 0.5] *= -1
    sums[rng.random((m, n)) < 0.05] = 0
    return sums


def _random_exponents(rng, rows: int) -> np.ndarray:
    e = rng.integers(fp.ZERO_ROW_EXPONENT, fp.MAX_FINITE_EXPONENT + 1, size=rows)
    e[rng.random(rows) < 0.1] = int(fp.NONFINITE_EXPONENT)
    return e.astype(np.int32)


def check_round_sums(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, _, n in _shapes(backend, quick) + [(64, 0, 300), (3, 0, 0), (0, 0, 5)]:
        for bits_a, bits_w in BITS_PAIRS:
            sums, ea, ew = random_sums(rng, m, n), _random_exponents(rng, m), _random_exponents(rng, n)
            # zero weight rows take any exponent in [-149, 127] or the sentinel: a weight carrying ew
            weight = gemm_op.encode_weight(backend, backend.asarray(np.zeros((n, 1), np.float32)), bits_w,
                                           exponents=backend.asarray(ew))
            y = gemm_op.round_sums(backend, backend.asarray(sums), backend.asarray(ea), bits_a, weight)
            tally.add(backend.to_numpy(y), exact.round_sums(sums, ea, bits_a, ew, bits_w))
    return tally


def _one_shard_nonfinite(rng, x: np.ndarray, bounds) -> np.ndarray:
    """Copy of x with a NaN or inf in one nonempty shard of every third row."""
    x = x.copy()
    widths = np.diff(bounds)
    nonempty = np.flatnonzero(widths)
    for row in range(0, x.shape[0], 3):
        shard = rng.choice(nonempty)
        value = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32))
        x[row, bounds[shard] + rng.integers(widths[shard])] = value
    return x


def check_k_sharded_gemm(backend: Backend, rng, quick: bool) -> Tally:
    """The k_sharding identity end to end on the backend: sharded == unsharded gemm, bitwise."""
    tally = Tally()
    for x, w in _gemm_operands(backend, rng, quick):
        k = x.shape[1]
        for shards in SHARD_COUNTS:
            bounds = shard_bounds(rng, k, shards)
            if k and rng.random() < 0.3:
                x = _one_shard_nonfinite(rng, x, bounds)
            expected = exact.gemm(x, w, gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W)
            got = row_parallel_gemm(backend, split_columns(x, bounds), split_columns(w, bounds),
                                    sum_order=rng.permutation(shards))
            tally.add(got, expected)
    return tally


PARALLEL_OP_CHECKS: list[tuple[str, Callable]] = [
    ("fixedpoint.row_exponents", check_row_exponents),
    ("fixedpoint.encode_rows_given", check_encode_rows_given),
    ("gemm.sums", check_gemm_sums),
    ("gemm.round_sums", check_round_sums),
    ("gemm.k_sharded", check_k_sharded_gemm),
]
