"""Where the wgmma gemm's time goes: the kernel with its loads or its MMAs cut out, and other stage counts.

    PYTHONPATH=$PWD python3 scripts/probe_wgmma.py

Variants are textual edits of backends/cuda/gemm.cu compiled with the runtime's options; each is
timed by CUDA events over repeated launches on random digits (the bits are not checked: conform does).
"""
import json
import sys

import cupy as cp
import numpy as np

from rlportable.runtime.cuda import _nvrtc_compile
from rlportable.runtime import get_backend

LOAD = "if (ahead < kblocks) stage_in(ahead, ahead % STAGES);"
MMA = "rlp_wgmma<BN>(acc[j], a, "
EXTRA = """
RLP_GEMM_WGMMA_ENTRY(probe_64x64_s3, 64, 3)
RLP_GEMM_WGMMA_ENTRY(probe_64x64_s5, 64, 5)
RLP_GEMM_WGMMA_ENTRY(probe_64x128_s3, 128, 3)
"""
PIN = "for (int j = 0; j < RLP_W_DIGITS; ++j) rlp_wgmma_pin<R>(acc[j]);\n        rlp_wgmma_wait<1>();"
FENCE_BAR = "rlp_fence_proxy_async();\n        // block kb landed for every thread; every warpgroup waited for its wgmma of block kb - 2,\n        // so the stage refilled below is free\n        __syncthreads();"
RS = """
__device__ __forceinline__ void rlp_wgmma_rs_n128(int (&d)[64], int a0, int a1, int a2, int a3, unsigned long long b) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {"
        %s
        "}, {%%64, %%65, %%66, %%67}, %%68, 1;\\n"
        : %s
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b));
}
""" % ('"' + ", ".join(f"%{i}" for i in range(64)) + '"', ", ".join(f'"+r"(d[{i}])' for i in range(64)))


def _no_loads(s):
    return s.replace(LOAD, "if (kp < 0) stage_in(ahead, ahead % STAGES);")


def _bare(s):  # no loads, no proxy fence, no barrier: the wgmma stream alone
    return _no_loads(s).replace(FENCE_BAR, "")


def _rs(s):  # A from registers (garbage values: timing only), B from shared memory
    head = "template <int BN>\n__device__ __forceinline__ void rlp_wgmma("
    s = _bare(s).replace(head, RS + head, 1)
    return s.replace("    else rlp_wgmma_n128(d, a, b);",
                     "    else rlp_wgmma_rs_n128(d, (int)a, (int)(a >> 7), (int)(a >> 13), (int)(a >> 19), b);")


ROUND = "y[(long long)row * n + col] = rlp_gemm_output(s, ea[row], ew[col], scale_offset);"


def _one_block(s):  # the first K block only: the fixed cost of a block (prologue, epilogue)
    return _bare(s).replace("const int kblocks = (kp + RLP_WGMMA_KBLOCK - 1) / RLP_WGMMA_KBLOCK;", "const int kblocks = 1;")


VARIANTS = {
    "full": lambda s: s,
    "no_loads": _no_loads,
    "bare": _bare,
    "bare_no_round": lambda s: _bare(s).replace(ROUND, "y[(long long)row * n + col] = (float)s;"),
    "bare_one_block": _one_block,
    "bare_one_block_no_round": lambda s: _one_block(s).replace(ROUND, "y[(long long)row * n + col] = (float)s;"),
}
SHAPES = [(256, 1024, 1024), (256, 1024, 6144), (256, 1024, 151936), (4096, 1024, 1024), (16384, 1024, 6144)]


def main():
    backend = get_backend("cuda")
    source = backend.source("gemm") + EXTRA
    options = backend.compile_options()
    rng = np.random.default_rng(0)
    results = []
    for variant, edit in VARIANTS.items():
        module = cp.cuda.function.Module()
        module.load(_nvrtc_compile(edit(source), "gemm", options))
        for m, k, n in SHAPES:
            xd = cp.asarray(rng.integers(-127, 128, (m, 3, k), dtype=np.int8))
            wd = cp.asarray(rng.integers(-127, 128, (n, 2, k), dtype=np.int8))
            ea, ew = cp.zeros(m, np.int32), cp.zeros(n, np.int32)
            y = cp.empty((m, n), np.float32)
            for kernel, bn, stages in (("gemm_wgmma_a3w2_64x64", 64, 4), ("gemm_wgmma_a3w2_64x128", 128, 4),
                                       ("probe_64x64_s3", 64, 3), ("probe_64x64_s5", 64, 5), ("probe_64x128_s3", 128, 3)):
                if kernel.startswith("probe"):
                    continue
                function = module.get_function(kernel)
                shared = stages * (3 * 64 + 2 * bn) * 128 + 1024
                cp.cuda.driver.funcSetAttribute(function.ptr, 8, shared)
                grid = (-(-m // 64), -(-n // bn))
                args = (xd, wd, ea, ew, np.int32(m), np.int32(n), np.int32(k), np.int32(-34), y)
                for _ in range(3):
                    function(grid, (384,), args, shared_mem=shared)
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                reps = 20
                start.record()
                for _ in range(reps):
                    function(grid, (384,), args, shared_mem=shared)
                stop.record()
                stop.synchronize()
                us = cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps
                tops = 2 * 6 * m * n * k / (us * 1e-6) / 1e12
                row = dict(variant=variant, kernel=kernel, m=m, k=k, n=n, us=round(us, 2), int8_tops=round(tops, 1))
                results.append(row)
                print(json.dumps(row), flush=True)
    json.dump(results, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
