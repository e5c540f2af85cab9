"""A wgmma gemm whose warpgroups each hold all six digit products of their outputs (no epilogue exchange).

    PYTHONPATH=$PWD python3 scripts/probe_wgmma_all_digits.py [results.json]

The built kernel gives warpgroup i activation digit i over the whole 64 x BN tile, so each output's three
partials meet in shared memory after the main loop (the epilogue, its largest phase at decode sizes:
bench/results/wgmma_phases_h200.json). This variant, made by textual edits of backends/cuda/gemm.cu's
rlp_gemm_wgmma, gives warpgroup w the columns [32 w, 32 w + 32) of a 64 x 96 tile with all three activation
digits times both weight digits (six m64n32k32 products per k step, 96 accumulator registers): the exact S
of its outputs is in its own registers, and the epilogue only converts and stores. The price: six n32
wgmma per k step read the activation tile three times from shared memory.
Each shape runs the built kernel as ops/gemm_fused.pick_tile chooses it and the variant at 3 and 4 stages;
outputs are compared bitwise, each timed by CUDA events. Prints one JSON line per measurement.
"""

import cupy as cp
import numpy as np

from rlportable.ops import gemm_fused
from rlportable.runtime import get_backend

from kernel_variants import edit, emit, load, mean_us, write  # scripts/kernel_variants.py

KBLOCK, ROWS, M, SLICE_COLUMNS = 128, 64, 256, 96
HEAD = "template <int BN, int STAGES, int SPLITS>\n__device__ __forceinline__ void rlp_gemm_wgmma("
END = "#ifdef RLP_HAS_WGMMA\n#define RLP_CLUSTER_DIMS"
EPILOGUE = "    // P_i = acc[0] + 256 acc[1] per element"
EPILOGUE_END = "    if constexpr (SPLITS > 1) rlp_cluster_sync();  // no block leaves"
SHAPES = [("gate_up", 6144, 1024), ("qkv", 4096, 1024), ("down", 1024, 3072), ("o", 1024, 2048),
          ("lm_head", 151936, 1024)]
STAGE_COUNTS = (3, 4)

ACCUMULATORS = """    constexpr int SLICE = BN / RLP_A_DIGITS, RS = SLICE / 2;  // a warpgroup's columns; registers per product
    int acc[RLP_A_DIGITS][RLP_W_DIGITS][RS];
#pragma unroll
    for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
        for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
            for (int r = 0; r < RS; ++r) acc[i][j][r] = 0;
"""
PRODUCTS = """#pragma unroll
            for (int i = 0; i < RLP_A_DIGITS; ++i) {
                const unsigned long long a = rlp_wgmma_descriptor(s + i * A_TILE + 32 * ks);
#pragma unroll
                for (int j = 0; j < RLP_W_DIGITS; ++j)  // weight digit j sits in slot W_DIGITS - 1 - j
                    rlp_wgmma<SLICE>(acc[i][j], a, rlp_wgmma_descriptor(s + RLP_A_DIGITS * A_TILE +
                                     (RLP_W_DIGITS - 1 - j) * W_TILE + wg * SLICE * 128 + 32 * ks));
            }
"""
PINS = """#pragma unroll
        for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
            for (int j = 0; j < RLP_W_DIGITS; ++j) rlp_wgmma_pin<RS>(acc[i][j]);
"""
OUTPUTS = """    const int warp = tid / 32, g = (tid % 32) / 4, q = tid % 4;
#pragma unroll
    for (int pair = 0; pair < RS / 2; ++pair) {
        // registers 2 pair, 2 pair + 1 of thread (warp, g, q): one row, two adjacent columns
        const int row = m0 + 16 * warp + g + 8 * (pair % 2), col = n0 + wg * SLICE + 8 * (pair / 2) + 2 * q;
        if (row >= m) continue;
        float out[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            long long s = 0;  // S = P_0 + 256 P_1 + 65536 P_2, P_i = acc[i][0] + 256 acc[i][1]
#pragma unroll
            for (int i = RLP_A_DIGITS - 1; i >= 0; --i)
                s = 256LL * s + ((long long)acc[i][0][2 * pair + c] + 256LL * (long long)acc[i][1][2 * pair + c]);
            out[c] = col + c < n ? rlp_gemm_output_small(s, tile_ea[row - m0], tile_ew[col + c - n0], scale_offset)
                                 : 0.0f;
        }
        rlp_store_column_pair(y0, y1, y2, c1, c2, n, row, col, out);
    }
"""


def all_digits(fn: str) -> str:
    fn = edit(fn, "void rlp_gemm_wgmma(", "void rlp_gemm_wgmma_all_digits(")
    fn = edit(fn, '    static_assert(STAGES * STAGE >= RLP_A_DIGITS * R * 128 * 8, "the stages hold the epilogue\'s partials");\n', "")
    start = fn.index("    int acc[RLP_W_DIGITS][R];")
    stop = fn.index("#pragma unroll\n    for (int s = 0; s < STAGES - 2; ++s)")
    fn = fn[:start] + ACCUMULATORS + fn[stop:]
    start = fn.index("            const unsigned long long a = rlp_wgmma_descriptor(s + wg * A_TILE + 32 * ks);")
    stop = fn.index("        }\n        rlp_wgmma_commit();")
    fn = fn[:start] + PRODUCTS + fn[stop:]
    fn = edit(fn, "#pragma unroll\n        for (int j = 0; j < RLP_W_DIGITS; ++j) rlp_wgmma_pin<R>(acc[j]);\n", PINS)
    fn = edit(fn, "#pragma unroll\n    for (int j = 0; j < RLP_W_DIGITS; ++j) rlp_wgmma_pin<R>(acc[j]);\n", PINS)
    start, stop = fn.index(EPILOGUE), fn.index(EPILOGUE_END)
    return fn[:start] + OUTPUTS + fn[stop:]


def entry(stages: int) -> str:
    return (f'\nextern "C" __global__ void __launch_bounds__(384, 1) probe_all_digits_{stages}('
            "const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, "
            "const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* y0, float* y1, float* y2, "
            f"int c1, int c2) {{ rlp_gemm_wgmma_all_digits<{SLICE_COLUMNS}, {stages}, 1>(xd, wd, ea, ew, m, n, kp, "
            "scale_offset, y0, y1, y2, c1, c2); }\n")


def probe_source(source: str) -> str:
    fn = source[source.index(HEAD):source.index(END)]
    return source + "\n" + all_digits(fn) + "".join(entry(s) for s in STAGE_COUNTS)


def main():
    backend = get_backend("cuda")
    module = load(probe_source(backend.source("gemm")), "gemm", backend.compile_options())
    rng = np.random.default_rng(0)
    results = []
    for shape, n, k in SHAPES:
        xd = cp.asarray(rng.integers(-127, 128, (M, 3, k), dtype=np.int8))
        wd = cp.asarray(rng.integers(-127, 128, (n, 2, k), dtype=np.int8))
        ea = cp.asarray(rng.integers(-20, 20, M, dtype=np.int32))
        ew = cp.asarray(rng.integers(-20, 20, n, dtype=np.int32))
        built = gemm_fused.tile_spec(gemm_fused.pick_tile(M, n, True, k))
        runs = [(built.kernel, (-(-M // ROWS) * built.splits, -(-n // built.cols)), built.shared_bytes)]
        runs += [(f"probe_all_digits_{s}", (-(-M // ROWS), -(-n // SLICE_COLUMNS)),
                  s * (3 * ROWS + 2 * SLICE_COLUMNS) * KBLOCK + 1024) for s in STAGE_COUNTS]
        reference = None
        for name, grid, shared in runs:
            function = module.get_function(name)
            cp.cuda.driver.funcSetAttribute(function.ptr, 8, shared)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
            y = cp.full((M, n), np.nan, np.float32)
            args = (xd, wd, ea, ew, np.int32(M), np.int32(n), np.int32(k), np.int32(-34), y, y, y, np.int32(n),
                    np.int32(n))
            function(grid, (384,), args, shared_mem=shared)
            bits = y.view(np.uint32).copy()
            reference = bits if reference is None else reference
            same = bool(cp.array_equal(bits, reference))
            us = mean_us(lambda: function(grid, (384,), args, shared_mem=shared))
            emit(results, dict(shape=shape, m=M, n=n, k=k, kernel=name, blocks=grid[0] * grid[1], us=round(us, 2),
                               same_bits=same))
    write(results)


if __name__ == "__main__":
    main()
