"""Conformance of the rowsum family (contracts/rowsum.toml): exact row sums at two widths over every row
kind (sums of squares among them), bitwise against the reference; and its golden case."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, gemm_shapes, random_rows
from rlportable.conform.tally import Tally
from rlportable.contract import exact
from rlportable.ops import rowsum as rowsum_op
from rlportable.runtime.base import Backend


def check_rowsum(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in gemm_shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            if kind == "normal":
                x = (x * x).astype(np.float32)  # a sum of squares
            for bits in (rowsum_op.DEFAULT_BITS, 24):
                tally.add(backend.to_numpy(rowsum_op.rowsum(backend, backend.asarray(x), bits)), exact.rowsum(x, bits))
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("rowsum", check_rowsum),
]


# ---- golden

GOLDEN_CASES = Cases("rowsum")


@GOLDEN_CASES.case("rowsum", seed=4, shapes=[[1, 1], [7, 13], [5, 1000], [3, 0]], kinds=STREAM_ROW_KINDS,
                   bits=[38, 24])
def _rowsum(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x = backend.asarray(s.floats(shape, kind))
            out += [(f"{i}.{kind}.{bits}", host(backend, rowsum_op.rowsum(backend, x, bits))) for bits in r["bits"]]
    return out
