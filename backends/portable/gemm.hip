#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "gemm": Y = X @ W.T exactly (contracts/gemm.toml; reference
// rlportable/contract/exact.py gemm): the BLAS path's kernels, both vendors; backends/cuda/gemm.cu
// adds NVIDIA's tensor-core kernels.
//
// Operands are fixed-point rows split into balanced int8 digits
// (backends/portable/fixedpoint.hip). With digit i of an activation row and digit j of
// a weight row weighted 256^(i+j), the exact dot product is
//     S = sum_d 256^d * G_d,   G_d = sum_{i+j=d} X_i . W_j   (int32, exact)
// and Y = RNE_f32(S * 2^(ea + ew - (Ba-2) - (Bw-2))), one rounding.

// S = sum_d 256^d G_d for element idx of the int32 shift groups [n_groups, m, n]
// (plane = m * n): exact in int64, most significant group first.
__device__ __forceinline__ long long rlp_combine_shift_groups(const int* groups, int n_groups, long long plane,
                                                              long long idx) {
    long long s = 0;
    for (int d = n_groups - 1; d >= 0; --d) s = s * 256 + (long long)groups[(long long)d * plane + idx];
    return s;
}

// exact.round_sums for one element: the canonical NaN for a non-finite row or
// column, else RNE_f32(s * 2^(e_a + e_w + scale_offset)), one rounding.
__device__ __forceinline__ float rlp_gemm_output(long long s, int e_a, int e_w, int scale_offset) {
    return (e_a == RLP_NONFINITE_EXPONENT || e_w == RLP_NONFINITE_EXPONENT)
               ? rlp_canonical_nan()
               : rlp_round_scaled(s, e_a + e_w + scale_offset);
}

// BLAS path, second half: the vendor int8 GEMM produced G_d for every digit
// shift d (groups [n_groups, m, n], int32); combine them exactly and round once.
extern "C" __global__ void gemm_combine_groups(
    const int* __restrict__ groups, int n_groups, long long m, long long n,
    const int* __restrict__ exponents_a, const int* __restrict__ exponents_w, int scale_offset,
    float* __restrict__ y) {
    // grid: x over columns, y over rows (grid-stride), so no 64-bit division per element
    const long long plane = m * n;
    for (long long row = blockIdx.y; row < m; row += gridDim.y) {
        const int ea = exponents_a[row];
        for (long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x; col < n;
             col += (long long)gridDim.x * blockDim.x) {
            const long long idx = row * n + col;
            y[idx] = rlp_gemm_output(rlp_combine_shift_groups(groups, n_groups, plane, idx), ea, exponents_w[col],
                                     scale_offset);
        }
    }
}

// Row-parallel (tensor-parallel) gemm, first half on each rank: the exact sums
// S [m, n] int64 of the rank's K-shard, combined from the G_d like
// gemm_combine_groups but not rounded (the ranks' S are all-reduced by SUM).
extern "C" __global__ void gemm_combine_groups_sums(
    const int* __restrict__ groups, int n_groups, long long m, long long n, long long* __restrict__ sums) {
    const long long plane = m * n;
    for (long long row = blockIdx.y; row < m; row += gridDim.y) {
        for (long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x; col < n;
             col += (long long)gridDim.x * blockDim.x) {
            const long long idx = row * n + col;
            sums[idx] = rlp_combine_shift_groups(groups, n_groups, plane, idx);
        }
    }
}

// Row-parallel gemm, second half: round the all-reduced exact sums S [m, n]
// (|S| < 2^62) once, as gemm_combine_groups rounds its own.
extern "C" __global__ void gemm_round_sums(
    const long long* __restrict__ sums, long long m, long long n, const int* __restrict__ exponents_a,
    const int* __restrict__ exponents_w, int scale_offset, float* __restrict__ y) {
    for (long long row = blockIdx.y; row < m; row += gridDim.y) {
        const int ea = exponents_a[row];
        for (long long col = blockIdx.x * (long long)blockDim.x + threadIdx.x; col < n;
             col += (long long)gridDim.x * blockDim.x) {
            const long long idx = row * n + col;
            y[idx] = rlp_gemm_output(sums[idx], ea, exponents_w[col], scale_offset);
        }
    }
}
