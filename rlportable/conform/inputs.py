"""Seeded inputs shared by the families' conformance checks: random rows of every kind, random bit
patterns, the edge inputs of the exp and log contracts, the shape lists, and the ragged shard splits of
the sharded checks."""

from __future__ import annotations

from itertools import pairwise

import numpy as np

from rlportable.contract import elementwise as elementwise_ref

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


def gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """(M, K, N) shapes of the primitives' checks: the full list unless --quick (cpu included)."""
    return GEMM_SHAPES_QUICK if quick else GEMM_SHAPES_FULL


def sizes(backend, quick: bool, quick_sizes: list, full_sizes: list) -> list:
    """The full list on devices; on cpu (the reference against itself) the quick one, to keep CI short."""
    return full_sizes if not quick and not backend.runs_reference else quick_sizes


def random_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """float32 of uniformly random bit patterns: every class (NaN payloads, inf, subnormal, normal)."""
    return rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32)


def elementwise_inputs(rng: np.random.Generator, quick: bool) -> np.ndarray:
    """Random float32 bit patterns (every class: NaN, inf, subnormal, normal) plus the edge cases."""
    count = (1 << 18) if quick else (1 << 24)
    bits = rng.integers(0, 1 << 32, size=count, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, elementwise_ref.edge_inputs()]).view(np.float32)


def cu_seqlens(lengths) -> np.ndarray:
    """int64 [n + 1]: the offsets of packed sequences of these lengths (0, then the running sums)."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


#: shard counts of the sharded checks (K-sharded gemm, vocabulary-sharded log-prob and embedding)
SHARD_COUNTS = (1, 2, 3, 4, 8)


def shard_bounds(rng: np.random.Generator, k: int, shards: int) -> np.ndarray:
    """shards + 1 ragged column bounds 0 = b_0 <= ... <= b_shards = k (empty shards allowed)."""
    cuts = np.sort(rng.integers(0, k + 1, size=shards - 1))
    return np.concatenate([[0], cuts, [k]]).astype(np.int64)


def split_columns(x: np.ndarray, bounds) -> list[np.ndarray]:
    """Contiguous K-shards x[:, b_s:b_{s+1}] (kernels read row-major memory)."""
    return [np.ascontiguousarray(x[:, a:b]) for a, b in pairwise(bounds)]


def ragged_cuts(rng: np.random.Generator, vocab: int, shards: int) -> list[int]:
    """Cut points 0 = c_0 < c_1 < ... < c_n = vocab of min(shards, vocab) contiguous shards of random widths >= 1."""
    shards = min(shards, vocab)
    inner = np.sort(rng.choice(np.arange(1, vocab), size=shards - 1, replace=False)) if shards > 1 else []
    return [0, *[int(c) for c in inner], vocab]
