// Kernel family "gemm": Y = X @ W.T exactly (contracts/gemm.toml; reference
// rlportable/contract/exact.py gemm).
//
// Operands are fixed-point rows split into balanced int8 digits
// (backends/cuda/fixedpoint.cu). With digit i of an activation row and digit j of
// a weight row weighted 256^(i+j), the exact dot product is
//     S = sum_d 256^d * G_d,   G_d = sum_{i+j=d} X_i . W_j   (int32, exact)
// and Y = RNE_f32(S * 2^(ea + ew - (Ba-2) - (Bw-2))), one rounding.
#include "common.cuh"

// BLAS path, second half: the vendor int8 GEMM produced G_d for every digit
// shift d (groups [n_groups, m, n], int32); combine them exactly and round once.
extern "C" __global__ void gemm_combine_groups(
    const int* __restrict__ groups, int n_groups, long long m, long long n,
    const int* __restrict__ exponents_a, const int* __restrict__ exponents_w, int scale_offset,
    float* __restrict__ y) {
    const long long total = m * n;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const long long row = idx / n, col = idx - row * n;
        const int ea = exponents_a[row], ew = exponents_w[col];
        if (ea == RLP_NONFINITE_EXPONENT || ew == RLP_NONFINITE_EXPONENT) {
            y[idx] = rlp_canonical_nan();
            continue;
        }
        long long s = 0;
        for (int d = n_groups - 1; d >= 0; --d) s = s * 256 + (long long)groups[(long long)d * total + idx];
        y[idx] = rlp_round_scaled(s, ea + ew + scale_offset);
    }
}

// ---------------------------------------------------------------------------
// Fused path: int8 digit products on tensor cores (mma.sync m16n8k32, sm_80+),
// the shift groups G_d kept in int32 registers, combined in int64 and rounded
// once, in one kernel. Built for 3 activation digits x 2 weight digits (the
// default 24 x 16 bits).
//
// Fragments are read straight from global memory as 16-byte vectors. The dot
// product is a sum over k, so any permutation of k that A and B share gives the
// same integer: thread (g = lane/4, t = lane%4) reads bytes [16t, 16t+16) of a
// 64-wide k chunk of its rows, and the two mma steps of the chunk take 8 of
// those bytes each. Every read is a coalesced 64-byte run per row.
//
// The warps of a block share one output tile and split K between them; their
// int64 sums meet in shared memory through integer atomics (exact, any order).
#define RLP_A_DIGITS 3
#define RLP_W_DIGITS 2
#define RLP_GROUPS (RLP_A_DIGITS + RLP_W_DIGITS - 1)

__device__ __forceinline__ void rlp_mma_s8(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int4 rlp_load16(const signed char* base, bool valid) {
    return valid ? __ldg(reinterpret_cast<const int4*>(base)) : make_int4(0, 0, 0, 0);
}

__device__ __forceinline__ int rlp_word(const int4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// WM m16 tiles x WN n8 tiles per warp; KSPLIT warps per block split the K chunks.
template <int WM, int WN, int KSPLIT>
__device__ __forceinline__ void rlp_gemm_fused(
    const signed char* __restrict__ xd, const signed char* __restrict__ wd,
    const int* __restrict__ ea, const int* __restrict__ ew, int m, int n, int kp, int scale_offset,
    float* __restrict__ y) {
    constexpr int TM = 16 * WM, TN = 8 * WN;
    __shared__ unsigned long long tile_sum[TM * TN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
    for (int i = threadIdx.x; i < TM * TN; i += blockDim.x) tile_sum[i] = 0ull;

    int acc[RLP_GROUPS][WM][WN][4];
#pragma unroll
    for (int d = 0; d < RLP_GROUPS; ++d)
#pragma unroll
        for (int mi = 0; mi < WM; ++mi)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[d][mi][ni][c] = 0;

    const long long a_row_stride = (long long)RLP_A_DIGITS * kp, w_row_stride = (long long)RLP_W_DIGITS * kp;
    const int chunks = kp / 64;
    for (int chunk = warp; chunk < chunks; chunk += KSPLIT) {
        const int k0 = chunk * 64 + 16 * t;
        int4 va[RLP_A_DIGITS][WM][2];
        int4 vb[RLP_W_DIGITS][WN];
#pragma unroll
        for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
            for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + 16 * mi + g + 8 * h;
                    va[i][mi][h] = rlp_load16(xd + row * a_row_stride + (long long)i * kp + k0, row < m);
                }
#pragma unroll
        for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni) {
                const int col = n0 + 8 * ni + g;
                // weights are stored most significant digit first: digit j sits in slot W_DIGITS-1-j
                vb[j][ni] = rlp_load16(wd + col * w_row_stride + (long long)(RLP_W_DIGITS - 1 - j) * kp + k0, col < n);
            }
#pragma unroll
        for (int step = 0; step < 2; ++step)
#pragma unroll
            for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
                for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
                    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                        for (int ni = 0; ni < WN; ++ni)
                            rlp_mma_s8(acc[i + j][mi][ni],
                                       rlp_word(va[i][mi][0], 2 * step), rlp_word(va[i][mi][1], 2 * step),
                                       rlp_word(va[i][mi][0], 2 * step + 1), rlp_word(va[i][mi][1], 2 * step + 1),
                                       rlp_word(vb[j][ni], 2 * step), rlp_word(vb[j][ni], 2 * step + 1));
    }
    __syncthreads();  // tile_sum zeroed
#pragma unroll
    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < WN; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                long long s = 0;
#pragma unroll
                for (int d = RLP_GROUPS - 1; d >= 0; --d) s = s * 256 + (long long)acc[d][mi][ni][c];
                const int r = 16 * mi + g + 8 * (c / 2), col = 8 * ni + 2 * t + (c % 2);
                atomicAdd(&tile_sum[r * TN + col], (unsigned long long)s);
            }
    __syncthreads();
    for (int i = threadIdx.x; i < TM * TN; i += blockDim.x) {
        const int row = m0 + i / TN, col = n0 + i % TN;
        if (row >= m || col >= n) continue;
        const int e_a = ea[row], e_w = ew[col];
        y[(long long)row * n + col] = (e_a == RLP_NONFINITE_EXPONENT || e_w == RLP_NONFINITE_EXPONENT)
                                          ? rlp_canonical_nan()
                                          : rlp_round_scaled((long long)tile_sum[i], e_a + e_w + scale_offset);
    }
}

#define RLP_GEMM_FUSED_ENTRY(NAME, WM, WN, KSPLIT)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * KSPLIT) NAME(                                          \
        const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, \
        const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* __restrict__ y) {         \
        rlp_gemm_fused<WM, WN, KSPLIT>(xd, wd, ea, ew, m, n, kp, scale_offset, y);                          \
    }

// Tile shapes (rows x cols x warps splitting K), chosen per M by ops/gemm_fused.py.
RLP_GEMM_FUSED_ENTRY(gemm_fused_a3w2_16x16k8, 1, 2, 8)
RLP_GEMM_FUSED_ENTRY(gemm_fused_a3w2_16x32k4, 1, 4, 4)
RLP_GEMM_FUSED_ENTRY(gemm_fused_a3w2_32x32k4, 2, 4, 4)
RLP_GEMM_FUSED_ENTRY(gemm_fused_a3w2_32x16k4, 2, 2, 4)
