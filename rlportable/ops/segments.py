"""Launch shape of the kernels that give each row to one segment of 32 lanes.

Kernels over many short rows (norm_rmsnorm_heads_rope's head rows, attention_write_kv's K and V rows)
walk them one aligned segment of 32 lanes per row, grid-stride (backends/portable/common.h: rlp_segment_*): no
shared memory and no barrier, where one block per row spent most of its time in them
(bench/results/row_kernels_probe_h200.json). 32 divides both vendors' warp widths, and a row's
reductions are exact integers, so the bits depend on neither the shape nor the vendor.
"""

from __future__ import annotations

SEGMENT = 32
#: 8 segments (rows) per block
SEGMENT_BLOCK = 256
MAX_GRID = 65535


def segment_launch_shape(rows: int) -> tuple[tuple[int], tuple[int]]:
    """(grid, block) of a kernel that walks `rows` rows (> 0) one segment of 32 lanes per row, grid-stride."""
    return (min(-(-rows // (SEGMENT_BLOCK // SEGMENT)), MAX_GRID),), (SEGMENT_BLOCK,)
