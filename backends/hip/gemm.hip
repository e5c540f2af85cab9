#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "gemm": Y = X @ W.T exactly (contracts/gemm.toml; reference
// rlportable/contract/exact.py gemm). Line-by-line port of backends/cuda/gemm.cu.
//
// Operands are fixed-point rows split into balanced int8 digits
// (backends/hip/fixedpoint.hip). With digit i of an activation row and digit j of
// a weight row weighted 256^(i+j), the exact dot product is
//     S = sum_d 256^d * G_d,   G_d = sum_{i+j=d} X_i . W_j   (int32, exact)
// and Y = RNE_f32(S * 2^(ea + ew - (Ba-2) - (Bw-2))), one rounding.

// BLAS path, second half: the vendor int8 GEMM (hipBLAS GemmEx) produced G_d for
// every digit shift d (groups [n_groups, m, n], int32); combine them exactly and
// round once.
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
            long long s = 0;
            for (int d = n_groups - 1; d >= 0; --d) s = s * 256 + (long long)groups[(long long)d * plane + idx];
            y[idx] = (ea == RLP_NONFINITE_EXPONENT || exponents_w[col] == RLP_NONFINITE_EXPONENT)
                         ? rlp_canonical_nan()
                         : rlp_round_scaled(s, ea + exponents_w[col] + scale_offset);
        }
    }
}
