"""Launch table of the fused gemm kernels (backends/cuda/gemm.cu).

Every tile shape computes the same exact integers, so the choice is about speed
only. Three kinds:
  * "direct": fragments straight from global memory, K split across the warps
    of a block (small M, memory-bound);
  * "tiled": operands staged in shared memory by cp.async (mma.sync, sm_80+);
  * "wgmma": Hopper warpgroup MMA from swizzled shared memory, one warpgroup per
    activation digit, or (the "g" tiles) one per third of the columns with the digit
    products in shift-grouped sums (compute capability 9.0 only: built for sm_90a).
`pick_tile` takes one per shape, from `rlportable bench gemm --sweep-tiles` on
the H200 (docs/gemm_performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.fixedpoint import EncodedRows
from rlportable.runtime.flags import has_wgmma

A_DIGITS, W_DIGITS = 3, 2


@dataclass(frozen=True)
class Tile:
    kind: str  # direct | tiled | wgmma
    kernel: str
    rows: int
    cols: int
    threads: int
    shared_bytes: int = 0
    #: split-K: the blocks of one tile (a thread-block cluster, wgmma only), each over a share of K
    splits: int = 1


def _direct(rows, cols, warps):
    return Tile("direct", f"gemm_fused_a3w2_{rows}x{cols}k{warps}", rows, cols, 32 * warps)


def _tiled(rows, cols, warps, chunks_per_stage=2, stages=3):
    stage = (A_DIGITS * rows + W_DIGITS * cols) * 64 * chunks_per_stage
    return Tile("tiled", f"gemm_tiled_a3w2_{rows}x{cols}", rows, cols, 32 * warps, stages * stage)


WGMMA_ROWS, WGMMA_KBLOCK = 64, 128
#: stages per tile width (backends/cuda/gemm.cu RLP_GEMM_WGMMA_ENTRY): 3 keep a 64 x 32 block
#: under half the shared memory, so two blocks share a multiprocessor
WGMMA_STAGES = {32: 3, 64: 4, 128: 4, 96: 4, 192: 3}
# pick_tile's thresholds, in tiles or blocks of a launch: each where the H200's sweeps put the faster
# tile (the measurements behind each: docs/gemm_performance.md, "How pick_tile chooses").
#: 64 x 128 tiles from this many on (two waves of the H200's 132 multiprocessors)
WGMMA_WIDE_FROM_TILES = 264
#: ... and while they fill one wave
WGMMA_ONE_WAVE = (96, 132)
#: 64 x 32 tiles below this many 64 x 64 ones
WGMMA_NARROW_BELOW_TILES = 96
#: ... unless K is this long: then 64 x 64 tiles split in two along K
WGMMA_SPLIT_FROM_K = 2048
#: ... and in 64 x 32 tiles while those split blocks fit one per multiprocessor
WGMMA_NARROW_SPLIT_MAX_BLOCKS = 132
#: the grouped 64 x 192 tiles from this many on, with more than 64 rows
WGMMA_GROUPED_FROM_TILES = 120
#: ... else the grouped 64 x 96 tiles while they fill one wave
WGMMA_GROUPED_ONE_WAVE = (120, 132)
# The 64 x 64 split tiles run in their two-warpgroup grouped build (w64x64g2s2); no grouped 64 x 128
# build exists (slower in the decode step).


def _wgmma(cols, splits=1, grouped=False, warpgroups=A_DIGITS):
    """grouped: the column-split kernels (backends/cuda/gemm.cu GROUPED), over `warpgroups` warpgroups."""
    stage = (A_DIGITS * WGMMA_ROWS + W_DIGITS * cols) * WGMMA_KBLOCK
    suffix = (f"_groups{warpgroups if warpgroups != A_DIGITS else ''}" if grouped else "") + \
        (f"_split{splits}" if splits > 1 else "")
    # + 1024: the kernel aligns its stages to the 128-byte swizzle's 1024-byte atoms
    return Tile("wgmma", f"gemm_wgmma_a3w2_{WGMMA_ROWS}x{cols}{suffix}", WGMMA_ROWS, cols, 128 * warpgroups,
                WGMMA_STAGES[cols] * stage + 1024, splits)


FUSED_TILES = {
    "16x16k8": _direct(16, 16, 8),
    "16x32k4": _direct(16, 32, 4),
    "32x16k4": _direct(32, 16, 4),
    "t64x64": _tiled(64, 64, 4),
    "t128x64": _tiled(128, 64, 8),
    "t64x128": _tiled(64, 128, 8),
    "w64x32": _wgmma(32),
    "w64x64": _wgmma(64),
    "w64x128": _wgmma(128),
    "w64x64s2": _wgmma(64, splits=2),
    "w64x32s2": _wgmma(32, splits=2),
    "w64x96g": _wgmma(96, grouped=True),
    "w64x192g": _wgmma(192, grouped=True),
    "w64x64g2s2": _wgmma(64, splits=2, grouped=True, warpgroups=2),
}
#: most outputs one wgmma launch writes (q, k and v)
WGMMA_OUTPUTS = 3

#: N at and above which a GEMM is an LM head: many columns, memory-bound on the weight
LARGE_N = 65536


def available_tiles(backend) -> list[str]:
    """The tiles this backend can run: none unless it builds the CUDA sources; the wgmma ones on
    compute capability 9.0 only."""
    if backend.kernel_vendor != "cuda":
        return []
    return [name for name, spec in FUSED_TILES.items() if spec.kind != "wgmma" or has_wgmma(backend)]


def pick_tile(m: int, n: int, wgmma: bool = False, k: int = 0) -> str:
    """The fastest tile per shape in the H200's sweeps (docs/gemm_performance.md).

    wgmma (compute capability 9.0): from 65 rows on, and for wide outputs (N >= 4096) from 17. From 65
    rows, the grouped 64 x 192 tiles where they fill the multiprocessors, the grouped 64 x 96 ones where
    those fill exactly one wave; the 64 x 64 split tile in its two-warpgroup grouped build.
    The widest tile that still spreads over the multiprocessors: 64 x 32 while 64 x 64 tiles would
    leave most of them idle (split along K for a long K: 64 x 32 while that is one block per
    multiprocessor at most, else 64 x 64), 64 x 128 when those fill one wave or from two waves on.
    The sweeps measured M = 64, 128 (the split tiles), 256, 4096 and 16384 only: the row bounds between
    them (17, 65) are interpolated, not measured."""
    if wgmma and (m > 64 or (m > 16 and n >= 4096)):
        row_blocks = -(-m // WGMMA_ROWS)
        if m > 64 and row_blocks * -(-n // 192) >= WGMMA_GROUPED_FROM_TILES:
            return "w64x192g"
        if m > 64 and WGMMA_GROUPED_ONE_WAVE[0] <= row_blocks * -(-n // 96) <= WGMMA_GROUPED_ONE_WAVE[1]:
            return "w64x96g"
        if row_blocks * -(-n // 64) < WGMMA_NARROW_BELOW_TILES:
            if k < WGMMA_SPLIT_FROM_K:
                return "w64x32"
            return "w64x32s2" if row_blocks * -(-n // 32) * 2 <= WGMMA_NARROW_SPLIT_MAX_BLOCKS else "w64x64g2s2"
        wide_tiles = row_blocks * -(-n // 128)
        one_wave = WGMMA_ONE_WAVE[0] <= wide_tiles <= WGMMA_ONE_WAVE[1]
        return "w64x128" if one_wave or wide_tiles >= WGMMA_WIDE_FROM_TILES else "w64x64"
    if m <= 16:
        return "16x32k4" if n >= 4096 else "16x16k8"
    if m <= 64 and n <= 1024:
        return "16x16k8"
    direct_blocks = -(-m // 16) * -(-n // 32)
    if direct_blocks <= 512:
        return "16x32k4"
    if n >= 4096 and (m > 64 or n >= LARGE_N):
        return "t64x128"
    return "t64x64"


def tile_spec(name: str) -> Tile:
    if name not in FUSED_TILES:
        raise InputError(f"gemm: unknown fused tile {name!r}; choose one of {', '.join(FUSED_TILES)}")
    return FUSED_TILES[name]


def launch_fused(backend, spec: Tile, a: EncodedRows, weight, outputs: list, scale_offset: int) -> None:
    """One launch of Y = X @ W.T into `outputs`: one [M, N] array, or (wgmma tiles only) up to
    WGMMA_OUTPUTS arrays [M, N_i] that take consecutive column ranges of Y (sum N_i = N)."""
    grid = (-(-weight.n // spec.cols), -(-a.rows // spec.rows))
    w = weight.encoded
    operands = (a.digits, w.digits, a.exponents, w.exponents,
                np.int32(a.rows), np.int32(weight.n), np.int32(a.k_padded), np.int32(scale_offset))
    if spec.kind == "wgmma":
        if not has_wgmma(backend):
            raise InputError(f"gemm: tile {spec.kernel} needs compute capability 9.0 (wgmma); "
                             f"this device is {backend.label}")
        grid = (grid[1] * spec.splits, grid[0])  # row blocks fastest: the blocks sharing a weight tile run together
        operands += _column_outputs(outputs, a.rows, weight.n)
    elif len(outputs) != 1:
        raise InputError(f"gemm: tile {spec.kernel} writes one output; {len(outputs)} were given")
    else:
        operands += (outputs[0],)
    backend.launch("gemm", spec.kernel, grid, (spec.threads,), operands, shared_mem=spec.shared_bytes)


def _column_outputs(outputs: list, m: int, n: int) -> tuple:
    """(y0, y1, y2, c1, c2) of the wgmma kernels: output i takes the columns [c_i, c_(i+1)). Each output
    must be a contiguous float32 [m, N_i] (the kernel writes its rows at stride N_i)."""
    if not 1 <= len(outputs) <= WGMMA_OUTPUTS:
        raise InputError(f"gemm: the wgmma kernels write 1 to {WGMMA_OUTPUTS} outputs; {len(outputs)} were given")
    for i, y in enumerate(outputs):
        shape = tuple(int(s) for s in y.shape)
        flags = getattr(y, "flags", None)
        if len(shape) != 2 or shape[0] != m or np.dtype(y.dtype) != np.float32 or \
                (flags is not None and not flags["C_CONTIGUOUS"]):
            raise InputError(f"gemm: output {i} must be a contiguous float32 [{m}, N_{i}], got "
                             f"{np.dtype(y.dtype).name} {list(shape)}")
    ends = np.cumsum([int(y.shape[1]) for y in outputs])
    if ends[-1] != n:
        raise InputError(f"gemm: the outputs' widths {[int(y.shape[1]) for y in outputs]} do not add up to N={n}")
    ys = list(outputs) + [outputs[-1]] * (WGMMA_OUTPUTS - len(outputs))
    cuts = list(ends[:-1]) + [n] * (WGMMA_OUTPUTS - len(outputs))
    return (*ys, *(np.int32(c) for c in cuts))


assert (fp.slice_count(23), fp.slice_count(15)) == (A_DIGITS, W_DIGITS)
assert (fp.slice_count(16), fp.slice_count(9)) == (A_DIGITS, W_DIGITS)
