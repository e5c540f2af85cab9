"""Where the wgmma gemm's time goes at decode sizes (M = 256), and one pipeline variant.

    PYTHONPATH=$PWD python3 scripts/probe_wgmma_phases.py [results.json]

Copies of backends/cuda/gemm.cu's rlp_gemm_wgmma, each with one textual edit, compiled beside it:
  as_built     unchanged;
  wait0        each k block's wgmma waited for at once (wait_group 0), so a stage is refilled one
               block later than now: STAGES - 1 blocks of loads ahead instead of STAGES - 2 (same bits);
  no_loads     no loads after the prologue (the main loop multiplies stale tiles: timing only);
  no_mma       no wgmma (timing only);
  no_epilogue  nothing after the main loop but a store that never happens (timing only).
Each is timed by CUDA events over repeated launches on random digits; as_built and wait0 outputs are
compared bitwise. Prints one JSON line per measurement.
"""

import os
import re

import cupy as cp
import numpy as np

from rlportable.runtime import get_backend

from kernel_variants import edit, emit, load, mean_us, wgmma_l2_prefetch, write  # scripts/kernel_variants.py

KBLOCK, ROWS, M = 128, 64, 256
HEAD = "template <int BN, int STAGES, int SPLITS, bool GROUPED, int WARPGROUPS>\n__device__ __forceinline__ void rlp_gemm_wgmma("
END = "#ifdef RLP_HAS_WGMMA\n#define RLP_CLUSTER_DIMS"
EPILOGUE = "    // P_i = acc[0] + 256 acc[1] per element"
EPILOGUE_END = "    if constexpr (SPLITS > 1) rlp_cluster_sync();  // no block leaves"
#: (shape, N, K, BN, STAGES, SPLITS, GROUPED, WARPGROUPS): Qwen3-0.6B's decode launches (the exchange tiles as
#: pick_tile made them before the grouped ones, and grouped tiles); RLP_PROBE_SHAPES=name,... a subset;
#: RLP_PROBE_K=<k> every shape's K instead
SHAPES = [("gate_up", 6144, 1024, 64, 4, 1, False, 3), ("qkv", 4096, 1024, 128, 4, 1, False, 3),
          ("down", 1024, 3072, 64, 4, 2, False, 3), ("o", 1024, 2048, 64, 4, 2, False, 3),
          ("lm_head", 151936, 1024, 128, 4, 1, False, 3), ("gate_up_grouped", 6144, 1024, 192, 3, 1, True, 3),
          ("lm_head_grouped", 151936, 1024, 192, 3, 1, True, 3),
          ("o_grouped2", 1024, 2048, 64, 4, 2, True, 2), ("down_grouped2", 1024, 3072, 64, 4, 2, True, 2)]
#: Timings are of back-to-back launches: the weights stay in L2 between them, unlike in a decode step, where
#: every layer's come from DRAM (a 64 x 128 grouped q/k/v build gained 3 us here and lost 2.6 in the step).


def variants(fn: str) -> dict:
    wait0 = edit(edit(edit(edit(fn, "for (int s = 0; s < STAGES - 2; ++s)", "for (int s = 0; s < STAGES - 1; ++s)"),
                           "rlp_cp_async_wait<STAGES - 3>();", "rlp_cp_async_wait<STAGES - 2>();"),
                      "const int ahead = kb + STAGES - 2;", "const int ahead = kb + STAGES - 1;"),
                 "rlp_wgmma_wait<1>();", "rlp_wgmma_wait<0>();")
    no_loads = edit(fn, "        if (ahead < kblocks) stage_in(ahead, ahead % STAGES);\n", "")
    no_mma, count = re.subn(r"rlp_wgmma<SLICE>\(acc\[(i \+ )?j\], a, rlp_wgmma_descriptor\([^;]*\);",
                            "acc[0][0] += (int)a;", fn)
    assert count == 2, "the wgmma calls moved: update the probe"
    start, stop = fn.index(EPILOGUE), fn.index(EPILOGUE_END)
    no_epilogue = fn[:start] + "    if (acc[0][0] == 0x7fffffff && acc[1][0] == 0x7fffffff) y0[threadIdx.x] = 0.0f;\n" + fn[stop:]
    return {"as_built": fn, "wait0": wait0, "no_loads": no_loads, "no_mma": no_mma, "no_epilogue": no_epilogue,
            "l2_prefetch": wgmma_l2_prefetch(fn)}


def entry(variant: str, bn: int, stages: int, splits: int, grouped: bool, warpgroups: int) -> str:
    name = f"probe_{variant}_{bn}_{stages}_{splits}_{int(grouped)}_{warpgroups}"
    return (f'\nextern "C" __global__ void RLP_CLUSTER_DIMS({splits}) __launch_bounds__({128 * warpgroups}, 1) {name}('
            "const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, "
            "const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* y0, float* y1, float* y2, "
            f"int c1, int c2) {{ rlp_gemm_wgmma_{variant}<{bn}, {stages}, {splits}, {str(grouped).lower()}, {warpgroups}>(xd, wd, ea, ew, m, n, kp, "
            "scale_offset, y0, y1, y2, c1, c2); }\n")


def main():
    backend = get_backend("cuda")
    source = backend.source("gemm")
    fn = source[source.index(HEAD):source.index(END)]
    copies = {name: text.replace("void rlp_gemm_wgmma(", f"void rlp_gemm_wgmma_{name}(")
              for name, text in variants(fn).items()}
    chosen = os.environ.get("RLP_PROBE_SHAPES")
    shapes = [s for s in SHAPES if chosen is None or s[0] in chosen.split(",")]
    configs = sorted({config[3:] for config in shapes})
    extra = "".join(copies.values()) + "".join(entry(v, *c) for v in copies for c in configs)
    module = load(source + "\n" + extra, "gemm", backend.compile_options())
    rng = np.random.default_rng(0)
    results = []
    for shape, n, k, bn, stages, splits, grouped, warpgroups in shapes:
        k = int(os.environ.get("RLP_PROBE_K", k))  # RLP_PROBE_K=128: one K block (the fixed part of a launch)
        xd = cp.asarray(rng.integers(-127, 128, (M, 3, k), dtype=np.int8))
        wd = cp.asarray(rng.integers(-127, 128, (n, 2, k), dtype=np.int8))
        ea, ew = cp.zeros(M, np.int32), cp.zeros(n, np.int32)
        shared = stages * (3 * ROWS + 2 * bn) * KBLOCK + 1024
        grid = (-(-M // ROWS) * splits, -(-n // bn))
        reference = None
        for variant in copies:
            if grouped and variant == "no_epilogue":
                continue  # the grouped epilogue exchanges nothing: the edit removes the other kind's
            function = module.get_function(f"probe_{variant}_{bn}_{stages}_{splits}_{int(grouped)}_{warpgroups}")
            cp.cuda.driver.funcSetAttribute(function.ptr, 8, shared)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            y = cp.full((M, n), np.nan, np.float32)
            args = (xd, wd, ea, ew, np.int32(M), np.int32(n), np.int32(k), np.int32(-34), y, y, y, np.int32(n),
                    np.int32(n))
            function(grid, (128 * warpgroups,), args, shared_mem=shared)
            same = None
            if variant in ("as_built", "wait0", "l2_prefetch"):
                bits = y.view(np.uint32).copy()
                reference = bits if reference is None else reference
                same = bool(cp.array_equal(bits, reference))
            us = mean_us(lambda: function(grid, (128 * warpgroups,), args, shared_mem=shared))
            emit(results, dict(shape=shape, n=n, k=k, bn=bn, stages=stages, splits=splits, grouped=grouped, variant=variant,
                               us=round(us, 2), same_bits=same))
    write(results)


if __name__ == "__main__":
    main()
