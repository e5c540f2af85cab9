"""The contract families, in the order `rlportable conform` runs them: the one list that the kernel checks
(conform/__init__.py) and the golden cases (conform/golden.py) both iterate, so a family cannot be in
one and silently missing from the other."""

from rlportable.conform import (
    activation, adamw, attention, elementwise, embedding, fixedpoint, gemm, logprob, moe, norm, residual, rope,
    rowsum, sampling,
)

FAMILIES = (fixedpoint, gemm, rowsum, residual, elementwise, norm, rope, activation, embedding, logprob, attention,
            sampling, adamw, moe)
