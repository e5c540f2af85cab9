"""What a conformance check returns: compared elements and raw-bit mismatches."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np


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

    @property
    def passed(self) -> bool:
        return self.mismatches == 0

    def as_json(self) -> dict:
        out = {**asdict(self), "passed": self.passed}
        if self.details is None:
            del out["details"]
        return out


def bit_mismatches(actual: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose raw bits differ (shapes must match)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return max(actual.size, expected.size, 1)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[expected.dtype.itemsize]
    return int(np.count_nonzero(actual.view(width) != expected.view(width)))


class Tally:
    def __init__(self):
        self.compared = 0
        self.mismatches = 0

    def add(self, actual, expected) -> None:
        self.compared += int(np.asarray(expected).size)
        self.mismatches += bit_mismatches(actual, expected)
