"""Kernel variants for the probe scripts: textual edits of a family's source, and loading one."""

import json
import sys

import cupy as cp

from rlportable.runtime.cuda import _nvrtc_compile


def edit(source: str, old: str, new: str) -> str:
    """One textual edit of the kernel source; an anchor that is gone is an error, not a silent no-op."""
    if old not in source:
        raise SystemExit(f"the kernel source no longer contains {old!r}: update the probe")
    return source.replace(old, new)


def load(source: str, family: str, options) -> "cp.cuda.function.Module":
    """The module of this source, compiled as the runtime compiles the family."""
    module = cp.cuda.function.Module()
    module.load(_nvrtc_compile(source, family, options))
    return module


def mean_us(run, reps: int = 20) -> float:
    """Microseconds per call of run(), from CUDA events around reps calls back to back."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        run()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps


def emit(results: list, row: dict) -> None:
    """Keep a measurement and print it as one JSON line."""
    results.append(row)
    print(json.dumps(row), flush=True)


def write(results: list) -> None:
    """With a path argument, write all the measurements there as a JSON list."""
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out, indent=1)
