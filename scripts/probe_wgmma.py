"""Where the wgmma gemm's time goes: the kernel with its loads or its MMAs cut out, and other stage counts.

    PYTHONPATH=$PWD python3 scripts/probe_wgmma.py

Variants are textual edits of backends/cuda/gemm.cu compiled with the runtime's options; each is
timed by CUDA events over repeated launches on random digits (the bits are not checked: conform does).
A run of an earlier version of this script (wgmma_probe_h200.json, no longer kept; its edits named the
kernel text of b34fffd, before the epilogue moved to all three warpgroups; the 64 x 64 and 64 x 128
tiles only): the rounding epilogue and a block's fixed cost, not the MMAs, dominated.
Prints one JSON line per measurement; with a path argument, also writes them all there as a list.
"""

import cupy as cp
import numpy as np

from rlportable.ops.gemm_fused import tile_spec
from rlportable.runtime import get_backend

from kernel_variants import edit, emit, load, mean_us, write  # scripts/kernel_variants.py

LOAD = "if (ahead < kblocks) stage_in(ahead, ahead % STAGES);"
FENCE = "rlp_fence_proxy_async();"
BARRIER = "so the stage refilled below is free\n        __syncthreads();"
KBLOCKS = "const int kblocks = (split + 1) * kblocks_all / SPLITS - kb_first;"
ROUND = "rlp_gemm_output_small(s, ea[row], ew[col + c], scale_offset)"


def _no_loads(s):  # the main loop's loads left out (the prologue's stay)
    return edit(s, LOAD, "if (kp < 0) stage_in(ahead, ahead % STAGES);")


def _bare(s):  # no loads, no proxy fence, no barrier: the wgmma stream alone
    return edit(edit(_no_loads(s), FENCE, ""), BARRIER, "so the stage refilled below is free\n")


def _one_block(s):  # the first K block only: a block's fixed cost (prologue, epilogue)
    return edit(_bare(s), KBLOCKS, "const int kblocks = split == 0;")


def _no_round(s):  # the epilogue's rounding replaced by a plain conversion
    return edit(s, ROUND, "(float)s")


VARIANTS = {
    "full": lambda s: s,
    "no_loads": _no_loads,
    "bare": _bare,
    "bare_no_round": lambda s: _no_round(_bare(s)),
    "bare_one_block": _one_block,
    "bare_one_block_no_round": lambda s: _no_round(_one_block(s)),
}
SHAPES = [(256, 1024, 1024), (256, 1024, 6144), (256, 1024, 151936), (4096, 1024, 1024), (16384, 1024, 6144)]


def main():
    backend = get_backend("cuda")
    source = backend.source("gemm")
    options = backend.compile_options()
    rng = np.random.default_rng(0)
    results = []
    for variant, change in VARIANTS.items():
        module = load(change(source), "gemm", options)
        for m, k, n in SHAPES:
            xd = cp.asarray(rng.integers(-127, 128, (m, 3, k), dtype=np.int8))
            wd = cp.asarray(rng.integers(-127, 128, (n, 2, k), dtype=np.int8))
            ea, ew = cp.zeros(m, np.int32), cp.zeros(n, np.int32)
            y = cp.empty((m, n), np.float32)
            for tile in ("w64x32", "w64x64", "w64x128"):
                spec = tile_spec(tile)
                kernel, bn, shared = spec.kernel, spec.cols, spec.shared_bytes
                function = module.get_function(kernel)
                cp.cuda.driver.funcSetAttribute(function.ptr, 8, shared)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                grid = (-(-m // 64), -(-n // bn))
                args = (xd, wd, ea, ew, np.int32(m), np.int32(n), np.int32(k), np.int32(-34), y, y, y, np.int32(n), np.int32(n))
                for _ in range(3):
                    function(grid, (spec.threads,), args, shared_mem=shared)
                us = mean_us(lambda: function(grid, (spec.threads,), args, shared_mem=shared))
                tops = 2 * 6 * m * n * k / (us * 1e-6) / 1e12
                row = dict(variant=variant, kernel=kernel, m=m, k=k, n=n, us=round(us, 2), int8_tops=round(tops, 1))
                emit(results, row)
    write(results)


if __name__ == "__main__":
    main()
