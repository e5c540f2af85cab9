"""What a conformance check returns: compared elements and raw-bit mismatches."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Settings:
    """A conform run's settings beyond (backend, rng, quick), for the checks that need them."""

    seed: int = 0  # `conform --seed`: the reproducer's command line names it
    repro_dir: Path = Path("rlportable-repro")  # where a failing end-to-end check writes its reproducer
    golden_dir: Path | None = None  # the golden digests' folder (None: conformance/golden)


class SettingsCheck:
    """A check that takes the run's Settings too: called check(backend, rng, quick, settings)."""

    def __init__(self, function):
        self.function = function

    def __call__(self, backend, rng, quick: bool, settings: Settings):
        return self.function(backend, rng, quick, settings)


def check_rng(seed: int, name: str) -> np.random.Generator:
    """The generator a conformance check draws its inputs from: a function of the run's seed and the
    check's name only (not of which other checks ran), so the same inputs on every device and rank."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])

@dataclass
class CheckResult:
    name: str
    compared: int
    mismatches: int
    details: dict | None = None  # a check's own JSON-ready report, if it has one (end to end: per model)
    message: str | None = None  # a one-line account of a failure, for the user (golden digests)

    @property
    def passed(self) -> bool:
        return self.mismatches == 0

    def as_json(self) -> dict:
        out = {**asdict(self), "passed": self.passed}
        for key in ("details", "message"):
            if out[key] is None:
                del out[key]
        return out


def bit_mismatches(actual: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose raw bits differ (shapes must match)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return max(actual.size, expected.size, 1)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[expected.dtype.itemsize]
    return int(np.count_nonzero(actual.view(width) != expected.view(width)))


class Tally:
    """A check's counts, and what it reports beyond them (details: JSON-ready; message: one line)."""

    def __init__(self):
        self.compared = 0
        self.mismatches = 0
        self.details: dict | None = None
        self.message: str | None = None

    def add(self, actual, expected) -> None:
        self.compared += int(np.asarray(expected).size)
        self.mismatches += bit_mismatches(actual, expected)

    def add_outputs(self, backend, actual, expected) -> None:
        """Each of an op's outputs (on the backend) against its expected host array, in turn."""
        for got, want in zip(actual, expected):
            self.add(backend.to_numpy(got), want)
