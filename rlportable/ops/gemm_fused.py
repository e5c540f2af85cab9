"""Launch table of the fused gemm kernel (backends/cuda/gemm.cu, gemm_fused_a3w2_*).

Every tile shape computes the same exact integers, so the choice is about speed
only; `FUSED_TILES` lists them, `pick_tile` takes one per M (measured with
`rlportable bench gemm`).
"""

from __future__ import annotations

import numpy as np

from rlportable.ops.fixedpoint import EncodedRows

# name -> (rows, cols, warps splitting K)
FUSED_TILES = {
    "16x16k8": (16, 16, 8),
    "16x32k4": (16, 32, 4),
    "32x16k4": (32, 16, 4),
    "32x32k4": (32, 32, 4),
}


def pick_tile(m: int) -> str:
    if m <= 16:
        return "16x16k8"
    if m <= 64:
        return "16x32k4"
    return "32x32k4"


def launch_fused(backend, a: EncodedRows, weight, y, scale_offset: int, tile: str | None = None) -> None:
    tile = tile or pick_tile(a.rows)
    rows, cols, warps = FUSED_TILES[tile]
    grid = (-(-weight.n // cols), -(-a.rows // rows))
    backend.launch(
        "gemm", f"gemm_fused_a3w2_{tile}", grid, (32 * warps,),
        (a.digits, weight.encoded.digits, a.exponents, weight.encoded.exponents,
         np.int32(a.rows), np.int32(weight.n), np.int32(a.k_padded), np.int32(scale_offset), y),
    )
