"""Conformance of the gemm family (contracts/gemm.toml): gemm at the default and other operand widths,
every method and tile, row invariance and stacked weights; the row-parallel pieces gemm_sums and
round_sums and the k_sharding identity end to end (the ranks emulated on one backend, NumPy's
np.maximum and int64 sums in place of the collectives), bitwise against the reference; and its golden
cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import (
    GEMM_SHAPES_FULL, GEMM_SHAPES_QUICK, ROW_KINDS, SHARD_COUNTS, gemm_shapes, random_rows, shard_bounds, sizes,
    split_columns,
)
from rlportable.conform.tally import Tally
from rlportable.contract import exact, fixedpoint as fp
from rlportable.ops import fixedpoint as fixedpoint_op, gemm as gemm_op
from rlportable.ops.gemm_fused import available_tiles
from rlportable.ops.gemm_mfma import mfma_tiles
from rlportable.runtime.base import Backend


def gemm_methods(backend: Backend) -> list[tuple[str, str | None]]:
    """(method, tile) pairs this backend can run with the default bits."""
    if backend.runs_reference:
        return [("auto", None)]
    methods = [("blas", None)]
    methods += [("fused", tile) for tile in available_tiles(backend)]
    methods += [("fused", tile) for tile in mfma_tiles(backend)]
    return methods


def _gemm_cases(rng, shapes):
    """(x, w) operands: every row kind at every (M, K, N) shape, then non-finite weight rows."""
    for m, k, n in shapes:
        for kind in ROW_KINDS:
            yield random_rows(rng, m, k, kind), random_rows(rng, n, k, "normal" if kind == "nonfinite" else kind)
    yield random_rows(rng, 9, 40, "normal"), random_rows(rng, 6, 40, "nonfinite")  # non-finite weight rows


def check_gemm(backend: Backend, rng, quick: bool, bits_a=gemm_op.DEFAULT_BITS_A, bits_w=gemm_op.DEFAULT_BITS_W) -> Tally:
    tally = Tally()
    for x, w in _gemm_cases(rng, gemm_shapes(quick)):
        if x.shape[1] > exact.gemm_max_k(bits_a, bits_w):
            continue
        expected = exact.gemm(x, w, bits_a, bits_w)
        weight = gemm_op.encode_weight(backend, backend.asarray(w), bits_w)
        for method, tile in gemm_methods(backend) if (bits_a, bits_w) == (gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W) else [("auto", None)]:
            y = gemm_op.gemm(backend, backend.asarray(x), weight, bits_a, method=method, tile=tile)
            tally.add(backend.to_numpy(y), expected)
    return tally


def check_gemm_other_bits(backend: Backend, rng, quick: bool) -> Tally:
    """Non-default operand widths (blas path on devices), shapes within each K limit."""
    tally = Tally()
    for bits_a, bits_w in ((15, 15), (22, 15), (8, 8), (31, 15)):
        tally_bits = check_gemm(backend, rng, True, bits_a, bits_w)
        tally.compared += tally_bits.compared
        tally.mismatches += tally_bits.mismatches
    return tally


def check_gemm_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """Row permutation and batch size: each row's bits must not depend on its neighbours."""
    tally = Tally()
    m, k, n = (37, 300, 50) if quick else (300, 1024, 256)
    x = random_rows(rng, m, k, "massive")
    weight = gemm_op.encode_weight(backend, backend.asarray(random_rows(rng, n, k, "normal")))
    for method, tile in gemm_methods(backend):
        def run(rows):
            return backend.to_numpy(gemm_op.gemm(backend, backend.asarray(rows), weight, method=method, tile=tile))

        full = run(x)
        permutation = rng.permutation(m)
        tally.add(run(x[permutation]), full[permutation])
        for row in rng.choice(m, size=min(m, 5), replace=False):
            tally.add(run(x[row:row + 1]), full[row:row + 1])
        tally.add(run(x[: m // 3]), full[: m // 3])
    return tally


def check_gemm_columns(backend: Backend, rng, quick: bool) -> Tally:
    """Stacked weights (q, k and v; gate and up): each output of gemm_columns against its own
    reference gemm, for every wgmma tile this device has (one launch writes all the outputs, odd
    widths included) and for the automatic choice."""
    tally = Tally()
    tiles = [None] + [tile for tile in available_tiles(backend) if tile.startswith("w")]
    shapes = [(37, 300, (40, 24, 24)), (37, 300, (33, 31, 65))] if quick else \
        [(256, 1024, (256, 128, 128)), (130, 2048, (33, 31, 65)), (256, 3072, (96, 32)), (9, 64, (5, 6, 7))]
    for m, k, widths in shapes:
        x = random_rows(rng, m, k, "massive")
        parts = [random_rows(rng, n, k, "normal") for n in widths]
        stacked = gemm_op.encode_stacked_weight(backend, [backend.asarray(w) for w in parts])
        expected = [exact.gemm(x, w, gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W) for w in parts]
        for tile in tiles:
            for y, want in zip(gemm_op.gemm_columns(backend, backend.asarray(x), stacked, tile=tile), expected):
                tally.add(backend.to_numpy(y), want)
    return tally


# ---- sharded: row-parallel gemm from K-shards (contracts/gemm.toml round_sums)

#: (bits_a, bits_w) for gemm_sums and round_sums: the default and the other widths check_gemm_other_bits uses
BITS_PAIRS = ((gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W), (15, 15), (8, 8), (31, 15))


def _sharded_shapes(backend: Backend, quick: bool) -> list[tuple[int, int, int]]:
    return sizes(backend, quick, GEMM_SHAPES_QUICK, GEMM_SHAPES_FULL)


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


def check_gemm_sums(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for x, w in _gemm_cases(rng, _sharded_shapes(backend, quick)):
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
    for m, _, n in _sharded_shapes(backend, quick) + [(64, 0, 300), (3, 0, 0), (0, 0, 5)]:
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
    for x, w in _gemm_cases(rng, _sharded_shapes(backend, quick)):
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


CHECKS: list[tuple[str, Callable]] = [
    ("gemm", check_gemm),
    ("gemm.other_bits", check_gemm_other_bits),
    ("gemm.invariance", check_gemm_invariance),
    ("gemm.columns", check_gemm_columns),
    ("gemm.sums", check_gemm_sums),
    ("gemm.round_sums", check_round_sums),
    ("gemm.k_sharded", check_k_sharded_gemm),
]


# ---- golden

GOLDEN_CASES = Cases("gemm")


def _gemm_outputs(backend, s, shapes, kinds, bits_a, bits_w):
    out = []
    for i, (m, k, n) in enumerate(shapes):
        for kind in kinds:
            x = s.floats((m, k), kind)
            w = s.floats((n, k), "uniform" if kind == "nonfinite" else kind)
            if kind == "uniform" and n and k:
                w[n // 2, k // 2] = np.float32(np.nan)  # a non-finite weight row: its output column is NaN
            weight = gemm_op.encode_weight(backend, backend.asarray(w), bits_w)
            out.append((f"{i}.{kind}.y", host(backend, gemm_op.gemm(backend, backend.asarray(x), weight, bits_a))))
    return out


@GOLDEN_CASES.case("gemm", seed=2, shapes=[[1, 1, 1], [7, 13, 5], [17, 257, 33], [64, 1024, 96], [5, 0, 3]],
                   kinds=STREAM_ROW_KINDS, bits_a=23, bits_w=15)
def _gemm_default_bits(backend, s, r):
    return _gemm_outputs(backend, s, r["shapes"], r["kinds"], r["bits_a"], r["bits_w"])


@GOLDEN_CASES.case("other_bits", seed=3, shapes=[[7, 13, 5], [17, 257, 33]], kinds=["uniform", "massive", "special"],
                   bits=[[15, 15], [22, 15], [8, 8], [31, 15]])
def _gemm_other_bits(backend, s, r):
    out = []
    for bits_a, bits_w in r["bits"]:
        out += [(f"{bits_a}x{bits_w}.{name}", y)
                for name, y in _gemm_outputs(backend, s, r["shapes"], r["kinds"], bits_a, bits_w)]
    return out
