"""The canonical inputs of the golden digests: a SplitMix64 stream (value i of seed s is splitmix64's
output for the state s + (i + 1) * 0x9E3779B97F4A7C15 mod 2^64, consumed in the order a case draws),
turned into float32 by exact constructions only (a 24-bit integer times a power of two, raw bit
patterns, constants), never by NumPy's random generators or float arithmetic, so the inputs are the
same on any machine and NumPy release."""

from __future__ import annotations

import numpy as np

from rlportable.conform.inputs import SPECIAL_VALUES

INPUT_RULE = ("rlportable.conform.golden.Stream(seed): SplitMix64 values drawn in the case's order, made "
              "into float32 by exact constructions (24-bit integers times powers of two, raw bit patterns)")

#: the row kinds of Stream.floats the per-op cases sweep (all but "logits" and "bits")
STREAM_ROW_KINDS = ["uniform", "massive", "tiny", "huge", "zeros", "special", "nonfinite"]

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(seed: int, start: int, count: int) -> np.ndarray:
    """uint64 [count]: splitmix64 outputs number start .. start + count - 1 of the stream `seed`."""
    index = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    z = np.uint64(seed) + index * _GAMMA  # uint64 arrays wrap modulo 2^64
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class Stream:
    """The canonical inputs of one case: every draw takes the next values of one splitmix64 stream."""

    def __init__(self, seed: int):
        self.seed, self.used = int(seed), 0

    def u64(self, count: int) -> np.ndarray:
        values = splitmix64(self.seed, self.used, int(count))
        self.used += int(count)
        return values

    def ints(self, shape, low: int, high: int, dtype=np.int32) -> np.ndarray:
        """Integers in [low, high) (value mod the range: a tiny bias, but the same everywhere)."""
        count = int(np.prod(shape, dtype=np.int64))
        values = (self.u64(count) % np.uint64(high - low)).astype(np.int64) + low
        return values.astype(dtype).reshape(shape)

    def permutation(self, n: int) -> np.ndarray:
        return np.argsort(self.u64(n), kind="stable").astype(np.int64)

    def _int24(self, count: int) -> np.ndarray:
        return (self.u64(count) >> np.uint64(40)).astype(np.int64) - (1 << 23)

    def floats(self, shape, kind: str = "uniform") -> np.ndarray:
        """float32 of one kind, every value exact:
        uniform   m * 2^-22 for a 24-bit signed integer m: [-2, 2)
        logits    m * 2^-20: [-8, 8)
        massive   uniform, one column (per matrix) times 2^15, as LLM activations have
        tiny      m * 2^-149 for 23-bit m: subnormals
        huge      m * 2^104: up to 2^127, near FLT_MAX
        zeros     +0 and -0
        special   uniform, a quarter replaced by conform.inputs.SPECIAL_VALUES
        nonfinite uniform, one NaN / +inf / -inf in every other row
        bits      uniformly random float32 bit patterns (NaN payloads, infinities, subnormals)"""
        shape = tuple(int(d) for d in shape)
        count = int(np.prod(shape, dtype=np.int64))
        if kind == "bits":
            return (self.u64(count) >> np.uint64(32)).astype(np.uint32).view(np.float32).reshape(shape)
        exponent = {"uniform": -22, "logits": -20, "massive": -22, "special": -22, "nonfinite": -22,
                    "tiny": -149, "huge": 104, "zeros": 0}
        if kind not in exponent:
            raise ValueError(f"unknown input kind {kind!r}")
        m = self._int24(count)
        if kind == "tiny":
            m >>= 1
        x = np.ldexp(m.astype(np.float64), exponent[kind]).astype(np.float32).reshape(shape)
        if kind == "zeros":
            x = np.where(m.reshape(shape) < 0, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        rows = x.reshape(-1, shape[-1]) if x.ndim and shape[-1] else None
        if kind == "massive" and rows is not None and rows.size:
            rows[:, int(self.ints((), 0, shape[-1]))] *= np.float32(2.0**15)
        if kind == "special" and count:
            pick = self.u64(count)
            replace = (pick & np.uint64(3)) == 0
            values = SPECIAL_VALUES[((pick >> np.uint64(2)) % np.uint64(SPECIAL_VALUES.size)).astype(np.int64)]
            x.reshape(-1)[replace] = values[replace]
        if kind == "nonfinite" and rows is not None and rows.size:
            specials = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
            for row in range(0, rows.shape[0], 2):
                rows[row, int(self.ints((), 0, shape[-1]))] = specials[row // 2 % 3]
        return x
