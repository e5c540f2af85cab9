"""What several test modules share: whether this is CI, and the hip-cpu backend or a skip."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """CI sets CI; there a missing compiler or HIP-CPU fails a test instead of skipping it."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def hip_cpu_backend():
    """A HipCpuBackend (the HIP sources on the CPU), or the test skipped (failed in CI) without HIP-CPU."""
    from rlportable.runtime import hip_cpu

    available, reason = hip_cpu.probe()
    if not available:
        if in_ci():
            pytest.fail(f"{reason} (CI must run the HIP sources on HIP-CPU; see .ci/run)")
        pytest.skip(reason)
    return hip_cpu.HipCpuBackend()


def clean_exit(result) -> bool:
    """A CliRunner result that ended by the command's own exit (an "error: ..." line and a status), not by an
    uncaught exception: CliRunner keeps a traceback out of result.output, so the output cannot tell."""
    return result.exception is None or isinstance(result.exception, SystemExit)
