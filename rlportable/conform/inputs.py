"""Seeded inputs for conformance checks: random rows plus the edge cases contracts define."""

from __future__ import annotations

import numpy as np

F32 = np.float32
SPECIAL_VALUES = np.array(
    [0.0, -0.0, 1.0, -1.0, np.finfo(F32).tiny, -np.finfo(F32).tiny, 1e-45, -1e-45, 3e-39,
     np.finfo(F32).max, -np.finfo(F32).max, 1e30, -1e-30, 65504.0, 2.0**-126, 2.0**24 + 1],
    dtype=F32,
)


def random_rows(rng: np.random.Generator, rows: int, k: int, kind: str) -> np.ndarray:
    """float32 [rows, k] of one kind: normal, massive, tiny, huge, special, nonfinite, zeros."""
    x = rng.standard_normal((rows, k)).astype(F32)
    if kind == "normal" or k == 0:
        return x
    if kind == "massive":  # one channel thousands of times the median, as in real LLM activations
        x[:, rng.integers(k)] *= F32(25000.0)
        return x
    if kind == "tiny":  # subnormal territory
        return (x * F32(1e-40)).astype(F32)
    if kind == "huge":  # products and sums near FLT_MAX
        return (x * F32(1e37)).astype(F32)
    if kind == "zeros":
        x[:] = 0.0
        x[rng.random((rows, k)) < 0.5] = -0.0
        return x
    if kind == "special":
        mask = rng.random((rows, k)) < 0.3
        x[mask] = rng.choice(SPECIAL_VALUES, size=int(mask.sum()))
        return x
    if kind == "nonfinite":
        for row in range(0, rows, 2):
            x[row, rng.integers(k)] = rng.choice(np.array([np.nan, np.inf, -np.inf], dtype=F32))
        return x
    raise ValueError(f"unknown input kind {kind!r}")


ROW_KINDS = ("normal", "massive", "tiny", "huge", "zeros", "special", "nonfinite")

# (M, K, N): ragged shapes (1x1, 7x13, K not a multiple of 16) and model-like ones
GEMM_SHAPES_QUICK = [(1, 1, 1), (7, 13, 5), (3, 100, 17), (17, 257, 33), (64, 1024, 96), (5, 0, 3)]
#: (1100, 2048, 200): large M with a long K, which `auto` gives the wgmma kernel on compute capability 9.0
#: (ops/gemm.py WGMMA_LARGE_M_MAX_K) and the vendor int8 GEMM elsewhere
GEMM_SHAPES_FULL = GEMM_SHAPES_QUICK + [(130, 1000, 70), (256, 2048, 256), (33, 3072, 129), (1024, 1024, 1024),
                                        (1100, 2048, 200)]
