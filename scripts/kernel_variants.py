"""Kernel variants for the probe scripts: textual edits of a family's source, and loading one."""

import json
import sys

import cupy as cp

from rlportable.runtime.cuda import _nvrtc_compile


def edit(source: str, old: str, new: str) -> str:
    """One textual edit of the kernel source; an anchor that is gone is an error, not a silent no-op."""
    if old not in source:
        raise SystemExit(f"the kernel source no longer contains {old!r}: update the probe")
    return source.replace(old, new)


def load(source: str, family: str, options) -> "cp.cuda.function.Module":
    """The module of this source, compiled as the runtime compiles the family."""
    module = cp.cuda.function.Module()
    module.load(_nvrtc_compile(source, family, options))
    return module


def mean_us(run, reps: int = 20) -> float:
    """Microseconds per call of run(), from CUDA events around reps calls back to back."""
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        run()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps


def emit(results: list, row: dict) -> None:
    """Keep a measurement and print it as one JSON line."""
    results.append(row)
    print(json.dumps(row), flush=True)


def write(results: list) -> None:
    """With a path argument, write all the measurements there as a JSON list."""
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump(results, out, indent=1)


#: where rlp_gemm_wgmma has its block's operand rows (backends/cuda/gemm.cu)
WGMMA_ROWS_ANCHOR = "    const signed char* w_rows = wd + (long long)n0 * w_row_stride;\n"
WGMMA_L2_PREFETCH = """    if (threadIdx.x == 0) {  // probe: the block's whole weight and activation rows into L2 at once
        const long long w_bytes = (long long)min(BN, n - n0) * w_row_stride;
        const long long a_bytes = (long long)min(RLP_WGMMA_ROWS, m - m0) * a_row_stride;
        for (long long o = 0; o < w_bytes; o += 1 << 16)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w_rows + o),
                         "r"((unsigned int)min(w_bytes - o, 1LL << 16)) : "memory");
        for (long long o = 0; o < a_bytes; o += 1 << 16)
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a_rows + o),
                         "r"((unsigned int)min(a_bytes - o, 1LL << 16)) : "memory");
    }
"""


def wgmma_l2_prefetch(fn: str) -> str:
    """rlp_gemm_wgmma (or a copy) asking L2 for all its block's operand bytes before its main loop."""
    return edit(fn, WGMMA_ROWS_ANCHOR, WGMMA_ROWS_ANCHOR + WGMMA_L2_PREFETCH)
