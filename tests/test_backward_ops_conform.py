"""The backward ops' conformance checks (rlportable/conform/norm.py, activation.py, rope.py, residual.py)
on the cpu backend.

On cpu each check compares the reference with itself through the op, so this proves the checks run,
cover inputs and agree with the ops' cpu path; on a GPU `rlportable conform` runs the same checks
against the kernels.
"""

from __future__ import annotations

import pytest

from rlportable.conform import activation, norm, residual, rope
from rlportable.conform.tally import check_rng
from rlportable.runtime import get_backend

CPU = get_backend("cpu")

BACKWARD_OP_CHECKS = [(name, dict(family.CHECKS)[name]) for family, name in (
    (norm, "norm.rmsnorm_backward"), (activation, "activation.swiglu_backward"), (rope, "rope.backward"),
    (residual, "residual.transpose"))]


@pytest.mark.parametrize("name,check", BACKWARD_OP_CHECKS, ids=[name for name, _ in BACKWARD_OP_CHECKS])
def test_backward_check_passes_on_cpu(name, check):
    rng = check_rng(0, name)  # as rlportable.conform.run seeds a check
    tally = check(CPU, rng, True)
    assert tally.compared > 0
    assert tally.mismatches == 0
