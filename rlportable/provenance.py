"""Where a result came from: the commit and the date, recorded in every JSON result."""

from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path


def commit() -> str:
    """$RLPORTABLE_COMMIT (set it where the tree travels without .git), else git, else 'unknown'."""
    if os.environ.get("RLPORTABLE_COMMIT"):
        return os.environ["RLPORTABLE_COMMIT"]
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return result.stdout.strip() if result.returncode == 0 else "unknown"


def provenance() -> dict:
    return {"commit": commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def host() -> dict:
    """The machine a CPU measurement ran on: architecture, cores, NumPy's version."""
    import multiprocessing
    import platform

    import numpy

    return {"machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores", "numpy": numpy.__version__}
