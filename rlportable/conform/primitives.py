"""Conformance of the exact primitives: fixedpoint, gemm, rowsum, residual, elementwise."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.inputs import GEMM_SHAPES_FULL, GEMM_SHAPES_QUICK, ROW_KINDS, random_rows
from rlportable.conform.tally import Tally
from rlportable.contract import elementwise as elementwise_ref, exact
from rlportable.ops import elementwise as elementwise_op, fixedpoint as fixedpoint_op, gemm as gemm_op, rowsum as rowsum_op
from rlportable.ops.gemm_fused import available_tiles
from rlportable.runtime.base import Backend

def _shapes(quick: bool):
    return GEMM_SHAPES_QUICK if quick else GEMM_SHAPES_FULL


def check_fixedpoint(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            for bits, descending in ((23, False), (15, True), (53, False), (9, False), (24, False)):
                expected = fixedpoint_op.encode_rows_reference(x, bits, descending)
                actual = fixedpoint_op.encode_rows(backend, backend.asarray(x), bits, descending)
                tally.add(backend.to_numpy(actual.exponents), expected.exponents)
                tally.add(backend.to_numpy(actual.digits), expected.digits)
    return tally


def gemm_methods(backend: Backend) -> list[tuple[str, str | None]]:
    """(method, tile) pairs this backend can run with the default bits."""
    if backend.kernel_vendor is None:
        return [("auto", None)]
    methods = [("blas", None)]
    if backend.kernel_vendor == "cuda":
        methods += [("fused", tile) for tile in available_tiles(backend)]
    return methods


def _gemm_cases(rng, quick: bool):
    for m, k, n in _shapes(quick):
        for kind in ROW_KINDS:
            yield random_rows(rng, m, k, kind), random_rows(rng, n, k, "normal" if kind == "nonfinite" else kind)
    x = random_rows(rng, 9, 40, "normal")
    yield x, random_rows(rng, 6, 40, "nonfinite")  # non-finite weight rows


def check_gemm(backend: Backend, rng, quick: bool, bits_a=gemm_op.DEFAULT_BITS_A, bits_w=gemm_op.DEFAULT_BITS_W) -> Tally:
    tally = Tally()
    for x, w in _gemm_cases(rng, quick):
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


def check_rowsum(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            if kind == "normal":
                x = (x * x).astype(np.float32)  # a sum of squares
            for bits in (rowsum_op.DEFAULT_BITS, 24):
                tally.add(backend.to_numpy(rowsum_op.rowsum(backend, backend.asarray(x), bits)), exact.rowsum(x, bits))
    return tally


def elementwise_inputs(rng, quick: bool) -> np.ndarray:
    """Random float32 bit patterns (every class: NaN, inf, subnormal, normal) plus the edge cases."""
    count = (1 << 18) if quick else (1 << 24)
    random_bits = rng.integers(0, 1 << 32, size=count, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([random_bits, elementwise_ref.edge_inputs()]).view(np.float32)


def _check_elementwise(name: str):
    def check(backend: Backend, rng, quick: bool) -> Tally:
        tally = Tally()
        x = elementwise_inputs(rng, quick)
        expected = getattr(elementwise_ref, f"{name}_f32")(x)
        tally.add(backend.to_numpy(elementwise_op.apply(backend, name, backend.asarray(x))), expected)
        return tally

    return check


def _check_elementwise_exhaustive(name: str):
    def check(backend: Backend, rng, quick: bool) -> Tally:
        tally = Tally()
        result = elementwise_op.exhaustive_check(backend, name)
        tally.compared, tally.mismatches = result["checked"], result["not_correctly_rounded"]
        tally.details = {"exhaustive": result}
        return tally

    return check


def check_residual(backend: Backend, rng, quick: bool) -> Tally:
    from rlportable.ops import residual as residual_op

    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            a, b = random_rows(rng, m, k, kind), random_rows(rng, m, k, kind)
            tally.add(backend.to_numpy(residual_op.add(backend, backend.asarray(a), backend.asarray(b))),
                      residual_op.add_reference(a, b))
            bias = random_rows(rng, 1, k, kind)[0]
            tally.add(backend.to_numpy(residual_op.add_bias(backend, backend.asarray(a), backend.asarray(bias))),
                      residual_op.add_bias_reference(a, bias))
    return tally


PRIMITIVE_CHECKS: list[tuple[str, Callable]] = [
    ("fixedpoint.encode_rows", check_fixedpoint),
    ("gemm", check_gemm),
    ("gemm.other_bits", check_gemm_other_bits),
    ("gemm.invariance", check_gemm_invariance),
    ("gemm.columns", check_gemm_columns),
    ("rowsum", check_rowsum),
    ("residual", check_residual),
    ("elementwise.exp_f32", _check_elementwise("exp")),
    ("elementwise.log_f32", _check_elementwise("log")),
]

#: added by --exhaustive: all 2^32 inputs graded for correct rounding on the device
EXHAUSTIVE_CHECKS: list[tuple[str, Callable]] = [
    ("elementwise.exp_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("exp")),
    ("elementwise.log_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("log")),
]
