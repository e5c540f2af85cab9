"""Conformance of the residual family (contracts/residual.toml): add and add_bias over every row kind,
and transpose (the backward's bit copy: NaN payloads, signalling NaNs, -0 and subnormals must survive),
bitwise against the reference; and its golden cases."""

from __future__ import annotations

from typing import Callable

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, gemm_shapes, random_bits, random_rows, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import residual as residual_ref
from rlportable.ops import residual as residual_op
from rlportable.runtime.base import Backend


def check_residual(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in gemm_shapes(quick):
        for kind in ROW_KINDS:
            a, b = random_rows(rng, m, k, kind), random_rows(rng, m, k, kind)
            tally.add(backend.to_numpy(residual_op.add(backend, backend.asarray(a), backend.asarray(b))),
                      residual_ref.add(a, b))
            bias = random_rows(rng, 1, k, kind)[0]
            tally.add(backend.to_numpy(residual_op.add_bias(backend, backend.asarray(a), backend.asarray(bias))),
                      residual_ref.add_bias(a, bias))
    return tally


# (rows, cols): 1x1, ragged edges of the 32 x 32 tile, exact tiles, 0-sized, model-like
TRANSPOSE_SHAPES_QUICK = [(1, 1), (7, 13), (32, 32), (33, 31), (1, 1000), (1000, 1), (64, 96), (0, 5), (5, 0), (0, 0)]
TRANSPOSE_SHAPES_FULL = TRANSPOSE_SHAPES_QUICK + [(1024, 4096), (4097, 33), (3000, 1001), (151936 // 16, 64)]


def check_residual_transpose(backend: Backend, rng, quick: bool) -> Tally:
    """A bit copy: random bit patterns (NaN payloads, signalling NaNs, -0, subnormals) must survive."""
    tally = Tally()
    for rows, cols in sizes(backend, quick, TRANSPOSE_SHAPES_QUICK, TRANSPOSE_SHAPES_FULL):
        x = random_bits(rng, (rows, cols))
        got = residual_op.transpose(backend, backend.asarray(x))
        tally.add(backend.to_numpy(got), residual_ref.transpose(x))
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("residual", check_residual),
    ("residual.transpose", check_residual_transpose),
]


# ---- golden

GOLDEN_CASES = Cases("residual")
GOLDEN_RESIDUAL_SHAPES = [[1, 1], [7, 13], [17, 257], [5, 0]]


@GOLDEN_CASES.case("add", seed=40, shapes=GOLDEN_RESIDUAL_SHAPES, kinds=STREAM_ROW_KINDS)
def _residual_add(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            a, b = (backend.asarray(s.floats(shape, kind)) for _ in range(2))
            out.append((f"{i}.{kind}.y", host(backend, residual_op.add(backend, a, b))))
    return out


@GOLDEN_CASES.case("add_bias", seed=41, shapes=GOLDEN_RESIDUAL_SHAPES, kinds=STREAM_ROW_KINDS)
def _residual_add_bias(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x, bias = backend.asarray(s.floats(shape, kind)), backend.asarray(s.floats(shape[-1:], kind))
            out.append((f"{i}.{kind}.y", host(backend, residual_op.add_bias(backend, x, bias))))
    return out


@GOLDEN_CASES.case("transpose", seed=42, shapes=[[1, 1], [7, 13], [32, 32], [33, 31], [64, 96], [0, 5], [5, 0]],
                   kind="bits")
def _residual_transpose(backend, s, r):
    return [(f"{i}.y", host(backend, residual_op.transpose(backend, backend.asarray(s.floats(shape, r["kind"])))))
            for i, shape in enumerate(r["shapes"])]
