"""Conformance of the elementwise family (contracts/elementwise.toml): exp_f32 and log_f32 on random bit
patterns of every class plus the contract's edge inputs, bitwise against the reference; with
--exhaustive, all 2^32 inputs graded for correct rounding on the device; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.inputs import elementwise_inputs
from rlportable.conform.tally import Tally
from rlportable.contract import elementwise as elementwise_ref
from rlportable.ops import elementwise as elementwise_op
from rlportable.runtime.base import Backend


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


CHECKS: list[tuple[str, Callable]] = [
    ("elementwise.exp_f32", _check_elementwise("exp")),
    ("elementwise.log_f32", _check_elementwise("log")),
]

#: added by --exhaustive: all 2^32 inputs graded for correct rounding on the device
EXHAUSTIVE_CHECKS: list[tuple[str, Callable]] = [
    ("elementwise.exp_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("exp")),
    ("elementwise.log_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("log")),
]


# ---- golden

GOLDEN_CASES = Cases("elementwise")


def _elementwise(name: str):
    def compute(backend, s, r):
        random_bits = (s.u64(r["random_inputs"]) >> np.uint64(32)).astype(np.uint32)
        x = np.concatenate([elementwise_ref.edge_inputs(), random_bits])
        return [("y", host(backend, elementwise_op.apply(backend, name, backend.asarray(x.view(np.float32)))))]

    compute.__name__ = f"_elementwise_{name}"
    return compute


GOLDEN_CASES.case("exp_f32", seed=5, inputs="the contract's edge_inputs() then random bit patterns",
                  random_inputs=1 << 16)(_elementwise("exp"))
GOLDEN_CASES.case("log_f32", seed=6, inputs="the contract's edge_inputs() then random bit patterns",
                  random_inputs=1 << 16)(_elementwise("log"))
