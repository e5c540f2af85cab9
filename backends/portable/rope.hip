#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "rope": rotary position embedding applied with tables made on the host.
// Contract: contracts/rope.toml. Reference: rlportable/contract/rope.py (apply, apply_backward; the cos/sin
// tables come from rope.tables, computed once on the host and uploaded).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA) (no warp-width assumption anywhere).
#include "common.h"

// Contraction off even where a compiler's default would fuse; the build options say the same.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

// x, y [tokens, heads, 2*half]; positions [tokens]; cos_table, sin_table [P, half], row = position.
// Each lane rotates one pair (i, i + half) of one head of one token ("rotate half" layout) by
// (c, s) = (cos, sin) of its position, or by (cos, -sin) for the transpose (the backward):
//   y[i]        = RNE_f32(x[i] * c - x[i+half] * s)
//   y[i + half] = RNE_f32(x[i+half] * c + x[i] * s)
// with the products exact in float64 (24 x 24 bits) and the sum rounded once in float64. Negating
// s is exact and a - (-b) is a + b in IEEE arithmetic, so the transpose computes exactly
//   dx[i] = RNE_f32(dy[i] * c + dy[i+half] * s),  dx[i + half] = RNE_f32(dy[i+half] * c - dy[i] * s).
// Grid-stride: any grid and block size gives the same bits. NaN results are the canonical NaN.
__device__ __forceinline__ void rlp_rope_rotate(const float* __restrict__ x, const int* __restrict__ positions,
                                                const float* __restrict__ cos_table,
                                                const float* __restrict__ sin_table, long long tokens, int heads,
                                                int half, float* __restrict__ y, bool transpose) {
    const long long n = tokens * (long long)heads * (long long)half;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const long long j = k % half;
        const long long head_row = k / half;  // token * heads + head
        const long long token = head_row / heads;
        const long long table = (long long)positions[token] * (long long)half + j;
        const double c = (double)cos_table[table];
        const double s = transpose ? -(double)sin_table[table] : (double)sin_table[table];
        const long long base = head_row * 2LL * (long long)half;
        const double first = (double)x[base + j];
        const double second = (double)x[base + half + j];
        rlp_rope_pair(first, second, c, s, y + base + j, y + base + half + j);
    }
}

extern "C" __global__ void rope_apply(const float* __restrict__ x, const int* __restrict__ positions,
                                      const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                      long long tokens, int heads, int half, float* __restrict__ y) {
    rlp_rope_rotate(x, positions, cos_table, sin_table, tokens, heads, half, y, false);
}

// The gradient of rope_apply for an upstream dy: dx = R(position)^T dy, the same pairs and tables.
extern "C" __global__ void rope_apply_backward(const float* __restrict__ dy, const int* __restrict__ positions,
                                               const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                                               long long tokens, int heads, int half, float* __restrict__ dx) {
    rlp_rope_rotate(dy, positions, cos_table, sin_table, tokens, heads, half, dx, true);
}
