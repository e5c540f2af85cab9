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

// ---------------------------------------------------------------------------
// Tiled variant for large M: the block stages a [digits][rows][64] slab of each
// operand in shared memory (cp.async, two stages) so that each digit byte read
// from global memory feeds every warp of the block. Same k permutation and the
// same exact arithmetic as above; warps split the tile, not K.
__device__ __forceinline__ void rlp_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(bytes));
}

// BM x BN tile; WARPS_M x WARPS_N warps, each WM m16 tiles x WN n8 tiles.
template <int WM, int WN, int WARPS_M, int WARPS_N>
__device__ __forceinline__ void rlp_gemm_tiled(
    const signed char* __restrict__ xd, const signed char* __restrict__ wd,
    const int* __restrict__ ea, const int* __restrict__ ew, int m, int n, int kp, int scale_offset,
    float* __restrict__ y) {
    constexpr int BM = 16 * WM * WARPS_M, BN = 8 * WN * WARPS_N, THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int A_BYTES = RLP_A_DIGITS * BM * 64, W_BYTES = RLP_W_DIGITS * BN * 64;
    extern __shared__ __align__(16) signed char slab[];  // 2 stages x (A then W)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const long long a_row_stride = (long long)RLP_A_DIGITS * kp, w_row_stride = (long long)RLP_W_DIGITS * kp;
    const int chunks = kp / 64;

    // slab layout per stage: A[digit][row][64] then W[slot][row][64]
    auto stage_in = [&](int chunk, int stage) {
        signed char* a_s = slab + stage * (A_BYTES + W_BYTES);
        signed char* w_s = a_s + A_BYTES;
        const long long k0 = (long long)chunk * 64;
        for (int v = threadIdx.x; v < A_BYTES / 16; v += THREADS) {
            const int digit = v / (BM * 4), row = (v / 4) % BM, part = v % 4;
            const int grow = m0 + row;
            rlp_cp_async16(a_s + v * 16, xd + (grow < m ? grow : 0) * a_row_stride + digit * (long long)kp + k0 + part * 16, grow < m);
        }
        for (int v = threadIdx.x; v < W_BYTES / 16; v += THREADS) {
            const int slot = v / (BN * 4), row = (v / 4) % BN, part = v % 4;
            const int gcol = n0 + row;
            rlp_cp_async16(w_s + v * 16, wd + (gcol < n ? gcol : 0) * w_row_stride + slot * (long long)kp + k0 + part * 16, gcol < n);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };

    int acc[RLP_GROUPS][WM][WN][4];
#pragma unroll
    for (int d = 0; d < RLP_GROUPS; ++d)
#pragma unroll
        for (int mi = 0; mi < WM; ++mi)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[d][mi][ni][c] = 0;

    if (chunks > 0) stage_in(0, 0);
    for (int chunk = 0; chunk < chunks; ++chunk) {
        const int stage = chunk & 1;
        if (chunk + 1 < chunks) {
            stage_in(chunk + 1, stage ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::);
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::);
        }
        __syncthreads();
        const signed char* a_s = slab + stage * (A_BYTES + W_BYTES);
        const signed char* w_s = a_s + A_BYTES;
        int4 vb[RLP_W_DIGITS][WN];
#pragma unroll
        for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni) {
                const int row = warp_n * 8 * WN + 8 * ni + g;
                vb[j][ni] = *reinterpret_cast<const int4*>(w_s + ((RLP_W_DIGITS - 1 - j) * BN + row) * 64 + 16 * t);
            }
#pragma unroll
        for (int i = 0; i < RLP_A_DIGITS; ++i) {
            int4 va[WM][2];
#pragma unroll
            for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = warp_m * 16 * WM + 16 * mi + g + 8 * h;
                    va[mi][h] = *reinterpret_cast<const int4*>(a_s + (i * BM + row) * 64 + 16 * t);
                }
#pragma unroll
            for (int step = 0; step < 2; ++step)
#pragma unroll
                for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
                    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                        for (int ni = 0; ni < WN; ++ni)
                            rlp_mma_s8(acc[i + j][mi][ni],
                                       rlp_word(va[mi][0], 2 * step), rlp_word(va[mi][1], 2 * step),
                                       rlp_word(va[mi][0], 2 * step + 1), rlp_word(va[mi][1], 2 * step + 1),
                                       rlp_word(vb[j][ni], 2 * step), rlp_word(vb[j][ni], 2 * step + 1));
        }
        __syncthreads();  // the stage is refilled next iteration
    }
#pragma unroll
    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < WN; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = m0 + warp_m * 16 * WM + 16 * mi + g + 8 * (c / 2);
                const int col = n0 + warp_n * 8 * WN + 8 * ni + 2 * t + (c % 2);
                if (row >= m || col >= n) continue;
                long long s = 0;
#pragma unroll
                for (int d = RLP_GROUPS - 1; d >= 0; --d) s = s * 256 + (long long)acc[d][mi][ni][c];
                const int e_a = ea[row], e_w = ew[col];
                y[(long long)row * n + col] = (e_a == RLP_NONFINITE_EXPONENT || e_w == RLP_NONFINITE_EXPONENT)
                                                  ? rlp_canonical_nan()
                                                  : rlp_round_scaled(s, e_a + e_w + scale_offset);
            }
}

#define RLP_GEMM_TILED_ENTRY(NAME, WM, WN, WARPS_M, WARPS_N)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N) NAME(                               \
        const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, \
        const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* __restrict__ y) {         \
        rlp_gemm_tiled<WM, WN, WARPS_M, WARPS_N>(xd, wd, ea, ew, m, n, kp, scale_offset, y);                \
    }

RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_128x64, 2, 4, 4, 2)
RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_64x64, 2, 4, 2, 2)
RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_64x128, 2, 4, 2, 4)
