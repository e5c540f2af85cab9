"""Launch table of the fused gemm kernels (backends/cuda/gemm.cu).

Every tile shape computes the same exact integers, so the choice is about speed
only. Three kinds:
  * "direct": fragments straight from global memory, K split across the warps
    of a block (small M, memory-bound);
  * "encode": a direct kernel that also encodes the float32 activations itself
    (one launch instead of two; needs K % 4 == 0);
  * "tiled": operands staged in shared memory by cp.async (large M).
`pick_tile` takes one per shape, from `rlportable bench gemm --sweep-tiles` on
the H200 (bench/results/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.fixedpoint import EncodedRows

A_DIGITS, W_DIGITS = 3, 2


@dataclass(frozen=True)
class Tile:
    kind: str  # direct | encode | tiled
    kernel: str
    rows: int
    cols: int
    threads: int
    shared_bytes: int = 0

    @property
    def encodes(self) -> bool:
        return self.kind == "encode"


def _direct(rows, cols, warps, kind="direct"):
    prefix = "gemm_encode" if kind == "encode" else "gemm_fused"
    return Tile(kind, f"{prefix}_a3w2_{rows}x{cols}k{warps}", rows, cols, 32 * warps)


def _tiled(rows, cols, warps, chunks_per_stage=2, stages=3):
    stage = (A_DIGITS * rows + W_DIGITS * cols) * 64 * chunks_per_stage
    return Tile("tiled", f"gemm_tiled_a3w2_{rows}x{cols}", rows, cols, 32 * warps, stages * stage)


FUSED_TILES = {
    "16x16k8": _direct(16, 16, 8),
    "16x32k4": _direct(16, 32, 4),
    "32x16k4": _direct(32, 16, 4),
    "e16x16k8": _direct(16, 16, 8, "encode"),
    "e16x32k4": _direct(16, 32, 4, "encode"),
    "t64x64": _tiled(64, 64, 4),
    "t128x64": _tiled(128, 64, 8),
    "t64x128": _tiled(64, 128, 8),
}

#: N at and above which a GEMM is an LM head: many columns, memory-bound on the weight
LARGE_N = 65536


def pick_tile(m: int, n: int, k: int) -> str:
    """Fastest tile per shape in bench/results/gemm_sweep_h200*.json."""
    if m <= 16:
        kind = "e" if k % 4 == 0 else ""
        return kind + ("16x32k4" if n >= LARGE_N else "16x16k8")
    if m <= 64:
        return "t64x64" if n >= LARGE_N else "16x32k4"
    return "t64x64"


def tile_spec(name: str, k: int) -> Tile:
    if name not in FUSED_TILES:
        raise InputError(f"gemm: unknown fused tile {name!r}; choose one of {', '.join(FUSED_TILES)}")
    spec = FUSED_TILES[name]
    if spec.encodes and k % 4:
        raise InputError(f"gemm: tile {name} encodes float32 rows with 16-byte loads and needs K % 4 == 0, got K={k}")
    return spec


def launch_fused(backend, spec: Tile, x, a: EncodedRows | None, weight, y, bits_a: int, scale_offset: int) -> None:
    """Run one fused kernel: `a` holds the encoded activations, or None for an encode tile (then x is read)."""
    m = int(x.shape[0])
    grid = (-(-weight.n // spec.cols), -(-m // spec.rows))
    w = weight.encoded
    if spec.encodes:
        args = (x, np.int32(weight.k), np.int32(bits_a), w.digits, w.exponents,
                np.int32(m), np.int32(weight.n), np.int32(w.k_padded), np.int32(scale_offset), y)
    else:
        args = (a.digits, w.digits, a.exponents, w.exponents,
                np.int32(m), np.int32(weight.n), np.int32(a.k_padded), np.int32(scale_offset), y)
    backend.launch("gemm", spec.kernel, grid, (spec.threads,), args, shared_mem=spec.shared_bytes)


assert (fp.slice_count(23), fp.slice_count(15)) == (A_DIGITS, W_DIGITS)
assert (fp.slice_count(16), fp.slice_count(9)) == (A_DIGITS, W_DIGITS)
