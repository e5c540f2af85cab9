// Kernel family "gemm": Y = X @ W.T exactly (contracts/gemm.toml; reference
// rlportable/contract/exact.py gemm).
//
// Operands are fixed-point rows split into balanced int8 digits
// (backends/cuda/fixedpoint.cu). With digit i of an activation row and digit j of
// a weight row weighted 256^(i+j), the exact dot product is
//     S = sum_d 256^d * G_d,   G_d = sum_{i+j=d} X_i . W_j   (int32, exact)
// and Y = RNE_f32(S * 2^(ea + ew - (Ba-2) - (Bw-2))), one rounding.
#include "common.cuh"

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

// ---------------------------------------------------------------------------
// Fused path: int8 digit products on tensor cores (mma.sync m16n8k32, sm_80+),
// the shift groups G_d kept in int32 registers, combined in int64 and rounded
// once, in one kernel. Built for 3 activation digits x 2 weight digits (16 to
// 23 activation bits, 9 to 15 weight bits; the default is 23 x 15).
//
// The dot product is a sum over k, so any permutation of k that A and B share
// gives the same integer. Thread (g = lane/4, t = lane%4) takes bytes
// [16t, 16t+16) of each 64-wide k chunk of its rows, and the chunk's two mma
// steps take 8 of those bytes each: every fragment is one 16-byte load.
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

// Accumulate one 64-wide chunk: digits a[i][mi][h] (rows g, g+8 of m16 tile mi)
// times weight digits b[j][ni]; the product of digits i and j lands in group i+j.
template <int WM, int WN>
__device__ __forceinline__ void rlp_mma_chunk(int (&acc)[RLP_GROUPS][WM][WN][4],
                                              const int4 (&a)[RLP_A_DIGITS][WM][2], const int4 (&b)[RLP_W_DIGITS][WN]) {
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
                                   rlp_word(a[i][mi][0], 2 * step), rlp_word(a[i][mi][1], 2 * step),
                                   rlp_word(a[i][mi][0], 2 * step + 1), rlp_word(a[i][mi][1], 2 * step + 1),
                                   rlp_word(b[j][ni], 2 * step), rlp_word(b[j][ni], 2 * step + 1));
}

template <int WM, int WN>
__device__ __forceinline__ void rlp_zero(int (&acc)[RLP_GROUPS][WM][WN][4]) {
#pragma unroll
    for (int d = 0; d < RLP_GROUPS; ++d)
#pragma unroll
        for (int mi = 0; mi < WM; ++mi)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[d][mi][ni][c] = 0;
}

// S = sum_d 256^d G_d for accumulator element c of tile (mi, ni): exact in int64.
template <int WM, int WN>
__device__ __forceinline__ long long rlp_combine(const int (&acc)[RLP_GROUPS][WM][WN][4], int mi, int ni, int c) {
    long long s = 0;
#pragma unroll
    for (int d = RLP_GROUPS - 1; d >= 0; --d) s = s * 256 + (long long)acc[d][mi][ni][c];
    return s;
}

// ---- direct kernels: fragments straight from global memory (small M) -------
// The warps of a block share one output tile and split K; their int64 sums
// meet in shared memory through integer atomics (exact, any order). Loads of
// the next chunk are issued before the current chunk's mma (register double
// buffering).
template <int WM, int WN>
struct RlpDirectFragments {
    int4 a[RLP_A_DIGITS][WM][2];
    int4 b[RLP_W_DIGITS][WN];
};

template <int WM, int WN, int KSPLIT>
__device__ __forceinline__ void rlp_gemm_direct(
    const signed char* __restrict__ xd, const signed char* __restrict__ wd,
    const int* __restrict__ ea, const int* __restrict__ ew, int m, int n, int kp, int scale_offset,
    float* __restrict__ y) {
    constexpr int TM = 16 * WM, TN = 8 * WN;
    __shared__ unsigned long long tile_sum[TM * TN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
    for (int i = threadIdx.x; i < TM * TN; i += blockDim.x) tile_sum[i] = 0ull;
    __syncthreads();

    const long long a_row_stride = (long long)RLP_A_DIGITS * kp, w_row_stride = (long long)RLP_W_DIGITS * kp;
    auto load = [&](RlpDirectFragments<WM, WN>& f, int chunk) {
        const int k0 = chunk * 64 + 16 * t;
#pragma unroll
        for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
            for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = m0 + 16 * mi + g + 8 * h;
                    f.a[i][mi][h] = rlp_load16(xd + row * a_row_stride + (long long)i * kp + k0, row < m);
                }
#pragma unroll
        for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
            for (int ni = 0; ni < WN; ++ni) {
                const int col = n0 + 8 * ni + g;
                // weights are stored most significant digit first: digit j sits in slot W_DIGITS-1-j
                f.b[j][ni] = rlp_load16(wd + col * w_row_stride + (long long)(RLP_W_DIGITS - 1 - j) * kp + k0, col < n);
            }
    };

    int acc[RLP_GROUPS][WM][WN][4];
    rlp_zero<WM, WN>(acc);
    const int chunks = kp / 64;
    RlpDirectFragments<WM, WN> current, next;
    if (warp < chunks) load(current, warp);
    for (int chunk = warp; chunk < chunks; chunk += KSPLIT) {
        if (chunk + KSPLIT < chunks) load(next, chunk + KSPLIT);
        rlp_mma_chunk<WM, WN>(acc, current.a, current.b);
        current = next;
    }
#pragma unroll
    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < WN; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int r = 16 * mi + g + 8 * (c / 2), col = 8 * ni + 2 * t + (c % 2);
                atomicAdd(&tile_sum[r * TN + col], (unsigned long long)rlp_combine<WM, WN>(acc, mi, ni, c));
            }
    __syncthreads();
    for (int i = threadIdx.x; i < TM * TN; i += blockDim.x) {
        const int row = m0 + i / TN, col = n0 + i % TN;
        if (row < m && col < n)
            y[(long long)row * n + col] = rlp_gemm_output((long long)tile_sum[i], ea[row], ew[col], scale_offset);
    }
}

#define RLP_GEMM_DIRECT_ENTRY(NAME, WM, WN, KSPLIT)                                                          \
    extern "C" __global__ void __launch_bounds__(32 * KSPLIT) NAME(                                          \
        const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, \
        const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* __restrict__ y) {         \
        rlp_gemm_direct<WM, WN, KSPLIT>(xd, wd, ea, ew, m, n, kp, scale_offset, y);                         \
    }

// Tile shapes (rows x cols x warps splitting K), chosen per shape by ops/gemm_fused.py.
RLP_GEMM_DIRECT_ENTRY(gemm_fused_a3w2_16x16k8, 1, 2, 8)
RLP_GEMM_DIRECT_ENTRY(gemm_fused_a3w2_16x32k4, 1, 4, 4)
RLP_GEMM_DIRECT_ENTRY(gemm_fused_a3w2_32x16k4, 2, 2, 4)

// ---- tiled kernels: operands staged in shared memory (large M) -------------
// Each stage holds CH 64-wide chunks of a BM-row slab of activation digits and a
// BN-row slab of weight digits, laid out [digit][chunk][row][64] (a warp's
// 16-byte reads of 8 rows then cover 512 contiguous bytes: no bank conflicts).
// cp.async fills STAGES stages ahead; warps split the tile, not K.
__device__ __forceinline__ void rlp_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int address = (unsigned int)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0;  // 0: the 16 bytes are zero-filled
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void rlp_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void rlp_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING)); }

template <int WM, int WN, int WARPS_M, int WARPS_N, int CH, int STAGES>
__device__ __forceinline__ void rlp_gemm_tiled(
    const signed char* __restrict__ xd, const signed char* __restrict__ wd,
    const int* __restrict__ ea, const int* __restrict__ ew, int m, int n, int kp, int scale_offset,
    float* __restrict__ y) {
    constexpr int BM = 16 * WM * WARPS_M, BN = 8 * WN * WARPS_N, THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int A_BYTES = RLP_A_DIGITS * CH * BM * 64, W_BYTES = RLP_W_DIGITS * CH * BN * 64;
    extern __shared__ __align__(16) signed char slab[];  // STAGES x (A then W)
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int g = lane / 4, t = lane % 4;
    const int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const long long a_row_stride = (long long)RLP_A_DIGITS * kp, w_row_stride = (long long)RLP_W_DIGITS * kp;
    const int chunks = kp / 64, groups = (chunks + CH - 1) / CH;

    auto stage_in = [&](int group, int stage) {
        signed char* a_s = slab + stage * (A_BYTES + W_BYTES);
        signed char* w_s = a_s + A_BYTES;
        for (int v = threadIdx.x; v < A_BYTES / 16; v += THREADS) {
            const int digit = v / (CH * BM * 4), ch = (v / (BM * 4)) % CH, row = (v / 4) % BM, part = v % 4;
            const int grow = m0 + row, chunk = group * CH + ch;
            const bool valid = grow < m && chunk < chunks;
            rlp_cp_async16(a_s + v * 16, xd + (valid ? grow * a_row_stride + digit * (long long)kp + chunk * 64 + part * 16 : 0), valid);
        }
        for (int v = threadIdx.x; v < W_BYTES / 16; v += THREADS) {
            const int slot = v / (CH * BN * 4), ch = (v / (BN * 4)) % CH, row = (v / 4) % BN, part = v % 4;
            const int gcol = n0 + row, chunk = group * CH + ch;
            const bool valid = gcol < n && chunk < chunks;
            rlp_cp_async16(w_s + v * 16, wd + (valid ? gcol * w_row_stride + slot * (long long)kp + chunk * 64 + part * 16 : 0), valid);
        }
    };

    int acc[RLP_GROUPS][WM][WN][4];
    rlp_zero<WM, WN>(acc);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < groups) stage_in(s, s);
        rlp_cp_async_commit();
    }
    for (int group = 0; group < groups; ++group) {
        rlp_cp_async_wait<STAGES - 2>();
        __syncthreads();  // this group landed for every thread; the stage refilled below is free
        const int ahead = group + STAGES - 1;
        if (ahead < groups) stage_in(ahead, ahead % STAGES);
        rlp_cp_async_commit();
        const signed char* a_s = slab + (group % STAGES) * (A_BYTES + W_BYTES);
        const signed char* w_s = a_s + A_BYTES;
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
            int4 a[RLP_A_DIGITS][WM][2];
            int4 b[RLP_W_DIGITS][WN];
#pragma unroll
            for (int j = 0; j < RLP_W_DIGITS; ++j)
#pragma unroll
                for (int ni = 0; ni < WN; ++ni) {
                    const int row = warp_n * 8 * WN + 8 * ni + g;
                    b[j][ni] = *reinterpret_cast<const int4*>(w_s + (((RLP_W_DIGITS - 1 - j) * CH + ch) * BN + row) * 64 + 16 * t);
                }
#pragma unroll
            for (int i = 0; i < RLP_A_DIGITS; ++i)
#pragma unroll
                for (int mi = 0; mi < WM; ++mi)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int row = warp_m * 16 * WM + 16 * mi + g + 8 * h;
                        a[i][mi][h] = *reinterpret_cast<const int4*>(a_s + ((i * CH + ch) * BM + row) * 64 + 16 * t);
                    }
            rlp_mma_chunk<WM, WN>(acc, a, b);
        }
    }
#pragma unroll
    for (int mi = 0; mi < WM; ++mi)
#pragma unroll
        for (int ni = 0; ni < WN; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int row = m0 + warp_m * 16 * WM + 16 * mi + g + 8 * (c / 2);
                const int col = n0 + warp_n * 8 * WN + 8 * ni + 2 * t + (c % 2);
                if (row < m && col < n)
                    y[(long long)row * n + col] = rlp_gemm_output(rlp_combine<WM, WN>(acc, mi, ni, c), ea[row], ew[col], scale_offset);
            }
}

#define RLP_GEMM_TILED_ENTRY(NAME, WM, WN, WARPS_M, WARPS_N, CH, STAGES)                                      \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N) NAME(                               \
        const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea, \
        const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* __restrict__ y) {         \
        rlp_gemm_tiled<WM, WN, WARPS_M, WARPS_N, CH, STAGES>(xd, wd, ea, ew, m, n, kp, scale_offset, y);    \
    }

RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_64x64, 2, 4, 2, 2, 2, 3)
RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_128x64, 2, 4, 4, 2, 2, 3)
RLP_GEMM_TILED_ENTRY(gemm_tiled_a3w2_64x128, 2, 4, 2, 4, 2, 3)
