"""Op family "elementwise": the contract's exp and log, float32 -> float32, correctly rounded.

Contract: contracts/elementwise.toml; reference: rlportable/contract/elementwise.py;
kernels: backends/portable/elementwise.hip.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import elementwise as reference
from rlportable.errors import InputError, RlpError
from rlportable.runtime.base import Backend

FUNCTIONS = ("exp", "log")
THREADS = 256
CHECK_SPAN = 1 << 26  # float32 bit patterns per launch of the exhaustive checker
CHECK_SLOTS = 1024  # wrong / ambiguous inputs the checker records per launch


def _require(name: str, x) -> int:
    if x.ndim != 1 or np.dtype(x.dtype) != np.float32:
        raise InputError(f"{name}: x must be a 1-D float32 array, got {np.dtype(x.dtype).name} of shape {tuple(x.shape)}")
    return int(x.shape[0])


def apply(backend: Backend, name: str, x):
    """y = exp(x) or log(x) under the contract, on the backend."""
    if name not in FUNCTIONS:
        raise InputError(f"unknown elementwise function {name!r}; choose one of {FUNCTIONS}")
    n = _require(name, x)
    if backend.runs_reference:
        return getattr(reference, f"{name}_f32")(backend.to_numpy(x))
    y = backend.empty((n,), np.float32)
    if n:
        backend.launch("elementwise", f"elementwise_{name}_f32", (min(-(-n // THREADS), 4096),), (THREADS,),
                       (x, y, np.int64(n)))
    return y


def exhaustive_check(backend: Backend, name: str, progress=None) -> dict:
    """Grade every one of the 2^32 float32 inputs on the device.

    The device kernel compares each result with a float64 libm oracle (an oracle
    only; the contract functions use none) and counts results that are certainly
    wrong and inputs too close to a rounding boundary for the oracle to decide.
    Those ambiguous inputs are decided here with mpmath.
    """
    if backend.runs_reference:
        raise RlpError("the exhaustive check runs on a GPU; on cpu use "
                       "`python -m rlportable.contract.elementwise --exhaustive-cpu exp|log`")
    which = FUNCTIONS.index(name)
    totals = np.zeros(3, dtype=np.uint64)  # checked, wrong, ambiguous
    wrong_inputs, ambiguous_inputs, ambiguous_got = [], [], []
    for start in range(0, 1 << 32, CHECK_SPAN):
        counters = backend.zeros((3,), np.uint64)
        slots = backend.zeros((3 * CHECK_SLOTS,), np.uint32)
        backend.launch("elementwise", "elementwise_exhaustive_check", (1056,), (THREADS,),
                       (np.uint32(start), np.uint64(CHECK_SPAN), np.int32(which), counters, slots))
        counts, recorded = backend.to_numpy(counters), backend.to_numpy(slots)
        if counts[1] > CHECK_SLOTS or counts[2] > CHECK_SLOTS:
            raise RlpError(f"{name}: more wrong or ambiguous results than the checker records near {start:#x}")
        totals += counts
        wrong_inputs += recorded[: counts[1]].tolist()
        ambiguous_inputs += recorded[CHECK_SLOTS: CHECK_SLOTS + counts[2]].tolist()
        ambiguous_got += recorded[2 * CHECK_SLOTS: 2 * CHECK_SLOTS + counts[2]].tolist()
        if progress and start % (1 << 30) == 0:
            progress(f"{name}: {start >> 30}/4 of the inputs")
    correct = reference.resolve_ambiguous(name, np.array(ambiguous_inputs, dtype=np.uint32))
    ambiguous_wrong = int(np.count_nonzero(correct != np.array(ambiguous_got, dtype=np.uint32)))
    return {"function": name, "checked": int(totals[0]), "not_correctly_rounded": int(totals[1]) + ambiguous_wrong,
            "ambiguous_resolved_by_mpmath": int(totals[2]), "wrong_inputs": [hex(b) for b in wrong_inputs[:16]]}
