"""Launch table of the MFMA gemm kernels (backends/hip/gemm.hip): AMD's matrix-core fast path.

One 64 x 64 tile per instruction set: v_mfma_i32_16x16x32_i8 on gfx942 (MI300X) and
v_mfma_i32_16x16x16i8 on gfx90a (MI200). Both compute the same exact integers as every other
method; which one runs is a matter of which target has it. A backend says which it runs in
`mfma_archs` (runtime/hip.py: its own target; runtime/hip_cpu.py: both, under emulation).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.errors import InputError
from rlportable.ops.fixedpoint import EncodedRows


@dataclass(frozen=True)
class MfmaTile:
    kernel: str
    arch: str  # the AMD target whose instruction it uses
    rows: int = 64
    cols: int = 64
    threads: int = 256  # 4 wavefronts of 64


MFMA_TILES = {
    "gfx942_64x64": MfmaTile("gemm_mfma_a3w2_64x64_gfx942", "gfx942"),
    "gfx90a_64x64": MfmaTile("gemm_mfma_a3w2_64x64_gfx90a", "gfx90a"),
}


def mfma_tiles(backend) -> list[str]:
    """The MFMA tiles this backend runs (none where it has no MFMA kernels: CUDA, other AMD targets)."""
    archs = getattr(backend, "mfma_archs", ())
    return [name for name, tile in MFMA_TILES.items() if tile.arch in archs]


def pick_mfma_tile(backend) -> str | None:
    """The tile of the backend's own target: the first of its mfma_archs that has one."""
    for arch in getattr(backend, "mfma_archs", ()):
        for name, tile in MFMA_TILES.items():
            if tile.arch == arch:
                return name
    return None


def launch_mfma(backend, name: str, a: EncodedRows, weight, y, scale_offset: int) -> None:
    """Y = X @ W.T into the contiguous float32 [M, N] `y` with MFMA tile `name`."""
    if name not in mfma_tiles(backend):
        raise InputError(f"gemm: MFMA tile {name!r} does not run on {backend.label}; "
                         f"its tiles: {mfma_tiles(backend) or 'none'}")
    tile = MFMA_TILES[name]
    w = weight.encoded
    grid = (-(-weight.n // tile.cols), -(-a.rows // tile.rows))
    backend.launch("gemm", tile.kernel, grid, (tile.threads,),
                   (a.digits, w.digits, a.exponents, w.exponents, np.int32(a.rows), np.int32(weight.n),
                    np.int32(a.k_padded), np.int32(scale_offset), y))
