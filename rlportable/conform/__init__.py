"""The suite behind `rlportable conform`: every contract's kernels against the NumPy reference, bitwise.

Each check returns how many elements it compared and how many differ in their raw bits (NaN payloads and
signed zeros included). One module per contract family (conform/families.py, in the contracts' order)
holds its forward, backward and sharded checks and its golden cases; then the model and engine checks,
the golden digests and end to end.
"""

from __future__ import annotations

from typing import Callable

from rlportable.conform.elementwise import EXHAUSTIVE_CHECKS
from rlportable.conform.end_to_end import E2E_CHECKS
from rlportable.conform.families import FAMILIES
from rlportable.conform.golden import GOLDEN_CHECKS, QUICK_SKIPPED as GOLDEN_QUICK_SKIPPED
from rlportable.conform.model import DEVICE_ONLY, MODEL_CHECKS
from rlportable.conform.tally import CheckResult, Settings, SettingsCheck, Tally, bit_mismatches, check_rng
from rlportable.runtime.base import Backend

CHECKS: list[tuple[str, Callable]] = [check for family in FAMILIES for check in family.CHECKS]
CHECKS += MODEL_CHECKS  # whole models and the engine on the backend against the cpu reference
CHECKS += GOLDEN_CHECKS  # the committed digests (conform/golden.py)
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
    """A run's JSON: every check, the totals, and (when there are any) the golden cases' failure messages
    and the exhaustive exp/log reports."""
    from rlportable.provenance import provenance

    payload = {
        "device": device,
        "provenance": provenance(),
        "backend": backend_info,
        "checks": [r.as_json() for r in results],
        "compared": sum(r.compared for r in results),
        "mismatches": sum(r.mismatches for r in results),
        "passed": all(r.passed for r in results),
    }
    golden_failures = {r.name: r.message for r in results if r.message and r.name.startswith("golden.")}
    if golden_failures:
        payload["golden_failures"] = golden_failures
    exhaustive = [r.details["exhaustive"] for r in results if r.details and "exhaustive" in r.details]
    if exhaustive:
        payload["exhaustive"] = exhaustive
    return payload
