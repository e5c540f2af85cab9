"""The suite behind `rlportable conform`: every contract's kernels against the NumPy reference, bitwise.

Each check returns how many elements it compared and how many differ in their
raw bits (NaN payloads and signed zeros included). One module per part of the
stack: primitives, forward_ops and attention, model, sampling, optim, the backward ops, the
parallel ops, golden digests and end to end.
"""

from __future__ import annotations

from typing import Callable



from rlportable.conform.attention import ATTENTION_BACKWARD_CHECKS, ATTENTION_CHECKS
from rlportable.conform.backward_ops import BACKWARD_OP_CHECKS
from rlportable.conform.backward_vocab import BACKWARD_VOCAB_CHECKS
from rlportable.conform.end_to_end import E2E_CHECKS
from rlportable.conform.forward_ops import FORWARD_OP_CHECKS
from rlportable.conform.golden import GOLDEN_CHECKS, QUICK_SKIPPED as GOLDEN_QUICK_SKIPPED
from rlportable.conform.model import DEVICE_ONLY, MODEL_CHECKS
from rlportable.conform.optim import OPTIM_CHECKS
from rlportable.conform.parallel_ops import PARALLEL_OP_CHECKS
from rlportable.conform.parallel_vocab import PARALLEL_VOCAB_CHECKS
from rlportable.conform.primitives import EXHAUSTIVE_CHECKS, PRIMITIVE_CHECKS
from rlportable.conform.sampling import SAMPLING_CHECKS
from rlportable.conform.tally import CheckResult, Settings, SettingsCheck, Tally, bit_mismatches, check_rng
from rlportable.runtime.base import Backend

CHECKS: list[tuple[str, Callable]] = (PRIMITIVE_CHECKS + FORWARD_OP_CHECKS + ATTENTION_CHECKS + MODEL_CHECKS
                                      + SAMPLING_CHECKS + OPTIM_CHECKS + BACKWARD_OP_CHECKS + BACKWARD_VOCAB_CHECKS
                                      + ATTENTION_BACKWARD_CHECKS + PARALLEL_OP_CHECKS + PARALLEL_VOCAB_CHECKS
                                      + GOLDEN_CHECKS)
CHECKS += E2E_CHECKS  # end to end: the engine's log-probs against the trainer's forward (conform/end_to_end.py)

__all__ = ["CHECKS", "CheckResult", "Settings", "Tally", "bit_mismatches", "report", "run"]


def selected(name: str, only: str | None) -> bool:
    """--only: the checks whose name contains the text, or any of its comma-separated texts."""
    return not only or any(part and part in name for part in only.split(","))


def run(backend: Backend, quick: bool = False, seed: int = 0, only: str | None = None,
        progress: Callable[[str], None] | None = None, exhaustive: bool = False,
        settings: Settings | None = None) -> list[CheckResult]:
    """The checks' results, in order. `settings` (default: Settings(seed=seed)) reach the checks that
    take them (SettingsCheck); what a check reports beyond its counts comes back in its result."""
    settings = settings or Settings(seed=seed)
    results = []
    for name, check in CHECKS + (EXHAUSTIVE_CHECKS if exhaustive else []):
        if not selected(name, only) or (backend.on_host and name in DEVICE_ONLY) \
                or (quick and name in GOLDEN_QUICK_SKIPPED):
            continue
        if progress:
            progress(name)
        rng = check_rng(settings.seed, name)
        tally = check(backend, rng, quick, settings) if isinstance(check, SettingsCheck) else check(backend, rng, quick)
        results.append(CheckResult(name, tally.compared, tally.mismatches, tally.details, tally.message))
    return results



def report(device: str, backend_info: dict, results: list[CheckResult]) -> dict:
    from rlportable.provenance import provenance

    return {
        "device": device,
        "provenance": provenance(),
        "backend": backend_info,
        "checks": [r.as_json() for r in results],
        "compared": sum(r.compared for r in results),
        "mismatches": sum(r.mismatches for r in results),
        "passed": all(r.passed for r in results),
    }
