"""Launch table of the fused gemm kernels (backends/cuda/gemm.cu).

Every tile shape computes the same exact integers, so the choice is about speed
only. "direct" kernels read fragments straight from global memory and split K
across the warps of a block (small M, memory-bound); "tiled" kernels stage
operands in shared memory with cp.async (large M). `pick_tile` takes one per M,
from measurements with `rlportable bench gemm --sweep-tiles` (bench/results/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.ops.fixedpoint import EncodedRows

A_DIGITS, W_DIGITS = 3, 2


@dataclass(frozen=True)
class Tile:
    kernel: str
    rows: int
    cols: int
    threads: int
    shared_bytes: int = 0


def _direct(rows, cols, warps):
    return Tile(f"gemm_fused_a3w2_{rows}x{cols}k{warps}", rows, cols, 32 * warps)


def _tiled(rows, cols, warps):
    stage = (A_DIGITS * rows + W_DIGITS * cols) * 64
    return Tile(f"gemm_tiled_a3w2_{rows}x{cols}", rows, cols, 32 * warps, 2 * stage)


FUSED_TILES = {
    "16x16k8": _direct(16, 16, 8),
    "16x32k4": _direct(16, 32, 4),
    "32x16k4": _direct(32, 16, 4),
    "32x32k4": _direct(32, 32, 4),
    "t64x64": _tiled(64, 64, 4),
    "t128x64": _tiled(128, 64, 8),
    "t64x128": _tiled(64, 128, 8),
}


#: N at and above which a GEMM is an LM head: many columns, memory-bound on the weight
LARGE_N = 65536


def pick_tile(m: int, n: int) -> str:
    """Fastest tile per (M, N) in bench/results/gemm_sweep_h200.json (H200, 2026-11-30)."""
    if m <= 16:
        return "16x32k4" if n >= LARGE_N else "16x16k8"
    if m <= 64:
        return "t64x64" if n >= LARGE_N else "16x32k4"
    return "t64x64"


def launch_fused(backend, a: EncodedRows, weight, y, scale_offset: int, tile: str | None = None) -> None:
    spec = FUSED_TILES[tile or pick_tile(a.rows, weight.n)]
    grid = (-(-weight.n // spec.cols), -(-a.rows // spec.rows))
    backend.launch(
        "gemm", spec.kernel, grid, (spec.threads,),
        (a.digits, weight.encoded.digits, a.exponents, weight.encoded.exponents,
         np.int32(a.rows), np.int32(weight.n), np.int32(a.k_padded), np.int32(scale_offset), y),
        shared_mem=spec.shared_bytes,
    )


assert (fp.slice_count(23), fp.slice_count(15)) == (A_DIGITS, W_DIGITS)
