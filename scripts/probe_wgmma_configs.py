"""The wgmma gemm at decode sizes (M = 256) over tile widths, stage counts and split-K cluster sizes.

    PYTHONPATH=$PWD python3 scripts/probe_wgmma_configs.py [results.json]

Each configuration is an extra RLP_GEMM_WGMMA_ENTRY(name, BN, STAGES, SPLITS) appended to
backends/cuda/gemm.cu and compiled with the runtime's options; each is timed by CUDA events over
repeated launches on random digits, and its output is compared bitwise with the 64 x 64 tile
without splits (the same exact integers, so the same bits). Prints one JSON line per measurement.
"""

import itertools
import os

import cupy as cp
import numpy as np

from rlportable.runtime import get_backend

from kernel_variants import emit, load, mean_us, write  # scripts/kernel_variants.py

KBLOCK, ROWS = 128, 64
SHARED_LIMIT = 232448  # the H200's dynamic shared memory per block
STAGE_COUNTS = {32: (3, 4, 6), 64: (4, 5), 128: (4,)}
SPLITS = (1, 2, 4)
#: (name, N, K) of Qwen3-0.6B's projections, and q/k/v and gate/up as one product each
SHAPES = [("q", 2048, 1024), ("k", 1024, 1024), ("o", 1024, 2048), ("gate", 3072, 1024), ("down", 1024, 3072),
          ("qkv", 4096, 1024), ("gate_up", 6144, 1024), ("lm_head", 151936, 1024)]
M = int(os.environ.get("RLP_PROBE_M", "256"))  # rows (a decode batch)


def shared_bytes(bn: int, stages: int) -> int:
    return stages * (3 * ROWS + 2 * bn) * KBLOCK + 1024


def configs():
    for bn, splits in itertools.product(STAGE_COUNTS, SPLITS):
        for stages in STAGE_COUNTS[bn]:
            if shared_bytes(bn, stages) <= SHARED_LIMIT:
                yield f"probe_{bn}_{stages}_{splits}", bn, stages, splits


def main():
    backend = get_backend("cuda")
    entries = "".join(f"\nRLP_GEMM_WGMMA_ENTRY({name}, {bn}, {stages}, {splits})" for name, bn, stages, splits in configs())
    module = load(backend.source("gemm") + entries + "\n", "gemm", backend.compile_options())
    rng = np.random.default_rng(0)
    results = []
    for shape, n, k in SHAPES:
        xd = cp.asarray(rng.integers(-127, 128, (M, 3, k), dtype=np.int8))
        wd = cp.asarray(rng.integers(-127, 128, (n, 2, k), dtype=np.int8))
        ea, ew = cp.zeros(M, np.int32), cp.zeros(n, np.int32)
        reference = None
        for name, bn, stages, splits in configs():
            function = module.get_function(name)
            shared = shared_bytes(bn, stages)
            cp.cuda.driver.funcSetAttribute(function.ptr, 8, shared)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            grid = (-(-M // ROWS) * splits, -(-n // bn))
            y = cp.full((M, n), np.nan, np.float32)
            args = (xd, wd, ea, ew, np.int32(M), np.int32(n), np.int32(k), np.int32(-34), y, y, y, np.int32(n), np.int32(n))
            function(grid, (384,), args, shared_mem=shared)
            bits = y.view(np.uint32)
            if reference is None:
                reference = bits.copy()
            same = bool(cp.array_equal(bits, reference))
            us = mean_us(lambda: function(grid, (384,), args, shared_mem=shared))
            emit(results, dict(shape=shape, m=M, n=n, k=k, bn=bn, stages=stages, splits=splits,
                               blocks=grid[0] * grid[1], us=round(us, 2), same_bits=same))
    write(results)


if __name__ == "__main__":
    main()
