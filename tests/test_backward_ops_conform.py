"""The backward ops' conformance checks (rlportable/conform/backward_ops.py) on the cpu backend.

On cpu each check compares the reference with itself through the op, so this proves the checks run,
cover inputs and agree with the ops' cpu path; on a GPU `rlportable conform` runs the same checks
against the kernels.
"""

from __future__ import annotations

import pytest

from rlportable.conform.backward_ops import BACKWARD_OP_CHECKS
from rlportable.conform.tally import check_rng
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def test_the_check_names():
    assert [name for name, _ in BACKWARD_OP_CHECKS] == [
        "norm.rmsnorm_backward", "activation.swiglu_backward", "rope.backward", "residual.transpose"]


@pytest.mark.parametrize("name,check", BACKWARD_OP_CHECKS, ids=[name for name, _ in BACKWARD_OP_CHECKS])
def test_backward_check_passes_on_cpu(name, check):
    rng = check_rng(0, name)  # as rlportable.conform.run seeds a check
    tally = check(CPU, rng, True)
    assert tally.compared > 0
    assert tally.mismatches == 0
