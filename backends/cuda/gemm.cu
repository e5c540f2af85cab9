// Kernel family "gemm", NVIDIA's fast paths: Y = X @ W.T exactly (contracts/gemm.toml; reference
// rlportable/contract/exact.py gemm) with the digit products on the tensor cores (mma.sync, and wgmma
// on sm_90a). The family's portable kernels (the BLAS path's combine and round, both vendors) are
// backends/portable/gemm.hip, included here; the runtime compiles this file behind
// backends/cuda/prelude.h for a CUDA GPU and the portable source alone elsewhere.
//
// Operands are fixed-point rows split into balanced int8 digits (backends/portable/fixedpoint.hip).
// With digit i of an activation row and digit j of a weight row weighted 256^(i+j), the exact dot
// product is
//     S = sum_d 256^d * G_d,   G_d = sum_{i+j=d} X_i . W_j   (int32, exact)
// and Y = RNE_f32(S * 2^(ea + ew - (Ba-2) - (Bw-2))), one rounding.
#include "gemm.hip"
#include "pipeline.h"

// rlp_gemm_output for |s| < 2^53, which the gemm contract's K limit guarantees for a whole
// (unsharded) gemm: s converts to float64 exactly and the power-of-two scaling is exact (the
// exponent stays far inside float64's range), so the one conversion to float32 is the only
// rounding, as in rlp_round_scaled (whose round-to-odd step leaves such an s as it is).
__device__ __forceinline__ float rlp_gemm_output_small(long long s, int e_a, int e_w, int scale_offset) {
    return (e_a == RLP_NONFINITE_EXPONENT || e_w == RLP_NONFINITE_EXPONENT)
               ? rlp_canonical_nan()
               : __double2float_rn(__ll2double_rn(s) * rlp_pow2_f64(e_a + e_w + scale_offset));
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

__device__ __forceinline__ int4 rlp_load16(const signed char* base, bool valid) {
    return valid ? __ldg(reinterpret_cast<const int4*>(base)) : make_int4(0, 0, 0, 0);
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
            y[(long long)row * n + col] = rlp_gemm_output_small((long long)tile_sum[i], ea[row], ew[col], scale_offset);
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
                    y[(long long)row * n + col] = rlp_gemm_output_small(rlp_combine<WM, WN>(acc, mi, ni, c), ea[row], ew[col], scale_offset);
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

// ---- wgmma kernels (sm_90a): Hopper warpgroup MMA from swizzled shared memory ------------
// Built only where the arch-specific Hopper features exist (--gpu-architecture=sm_90a, which
// runtime/flags.py gives compute capability 9.0); elsewhere the entry points trap, and
// ops/gemm_fused.py never picks them.
//
// One block = 3 warpgroups over a 64-row x BN-column tile; warpgroup i multiplies activation
// digit i by both weight digits, so each holds two int32 sums, P_i = X_i.W_0 + 256 X_i.W_1
// (exact in int64), and S = P_0 + 256 P_1 + 65536 P_2 = sum_{i,j} 256^(i+j) X_i.W_j: the same
// integer as the mma.sync kernels' shift groups, so the same bits.
// GROUPED builds (the "_groups" kernels) split the tile by columns instead: of WARPGROUPS warpgroups,
// w takes the columns [w BN / WARPGROUPS, (w + 1) BN / WARPGROUPS) with all six digit products, added per
// shift k = i + j into four int32 sums G_k (the contract's K limit: 2 pairs * 2^14 * K < 2^31), so
// S = sum_k 256^k G_k is in its own registers and the epilogue exchanges nothing (split-K builds still
// add their blocks' S). With three warpgroups, 1.5 times the columns per block for the same 128
// accumulator registers: tiles that fill the multiprocessors at decode and prefill sizes (ops/gemm_fused.py).
// Each stage holds one 128-byte K block of every operand row: [digit][row][128 bytes] with the
// 128-byte swizzle (16-byte piece p of row r at p ^ (r % 8)), the layout wgmma's descriptors
// read; cp.async fills STAGES - 2 blocks ahead while one block of wgmma is in flight.
#define RLP_WGMMA_ROWS 64     // rows of one m64 wgmma: the block's tile rows
#define RLP_WGMMA_KBLOCK 128  // K bytes per stage: one swizzled 128-byte row per operand row

#ifdef RLP_HAS_WGMMA
// Thread-block clusters (split-K below): the generic address of the same shared-memory location
// in block `rank` of this cluster, and a barrier over every thread of the cluster that also
// orders shared-memory writes before it against the reads after it, cluster-wide.
template <typename T>
__device__ __forceinline__ const T* rlp_cluster_peer(const T* local, int rank) {
    unsigned long long peer;
    asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(peer) : "l"(local), "r"(rank));
    return reinterpret_cast<const T*>(peer);
}
__device__ __forceinline__ void rlp_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

// SPLITS > 1: split-K over a cluster of SPLITS blocks (the SPLITS consecutive x blocks of one
// tile), block r multiplying K blocks [r kb / SPLITS, (r + 1) kb / SPLITS). Every block stores its
// exact P_i partials in its own shared memory; after a cluster barrier each warpgroup of each block
// rounds a share of the tile's elements, adding the SPLITS blocks' partials read through
// distributed shared memory. Integer sums in any grouping are the same integer: the same bits.
// Several projections of the same activations in one launch (q, k and v; gate and up: their
// weights stacked into one), each written to its own array: output columns [0, c1) go to y0
// ([m, c1]), [c1, c2) to y1 ([m, c2 - c1]), [c2, n) to y2 ([m, n - c2]). One output: c1 = c2 = n.
// Returns where column col of row `row` goes, and the end of its segment.
__device__ __forceinline__ float* rlp_column_output(float* y0, float* y1, float* y2, int c1, int c2, int n,
                                                    int row, int col, int& segment_end) {
    if (col < c1) { segment_end = c1; return y0 + (long long)row * c1 + col; }
    if (col < c2) { segment_end = c2; return y1 + (long long)row * (c2 - c1) + (col - c1); }
    segment_end = n;
    return y2 + (long long)row * (n - c2) + (col - c2);
}

// out[0] and out[1], row `row`'s outputs at the even column col and col + 1, to their arrays: with every
// segment's width even, both columns share a segment and the pair is 8-byte aligned (one float2 store).
__device__ __forceinline__ void rlp_store_column_pair(float* y0, float* y1, float* y2, int c1, int c2, int n, int row,
                                                      int col, const float (&out)[2]) {
    int end;
    float* dst = rlp_column_output(y0, y1, y2, c1, c2, n, row, col, end);
    if (col + 1 < end && ((c1 | c2 | n) & 1) == 0) {
        *reinterpret_cast<float2*>(dst) = make_float2(out[0], out[1]);
    } else {
        if (col < n) *dst = out[0];
        if (col + 1 < n) *rlp_column_output(y0, y1, y2, c1, c2, n, row, col + 1, end) = out[1];
    }
}

#ifdef RLP_HAS_WGMMA
// One operand's share of a wgmma stage: PLANES digit planes of ROWS rows, each row's 16-byte pieces put at
// their 128-byte-swizzled places in tile ([plane][row][128 bytes]) from rows (the block's first operand row,
// rows row_stride bytes apart, planes kp bytes apart). A thread's pieces are v = threadIdx.x + t THREADS: with
// THREADS a multiple of 64, its piece of a row (v % 8) and that row's swizzle phase ((v / 8) % 8) never change,
// so the caller computes `swizzled` once and the loads take 32-bit offsets and no division (the main loop's
// load issue was most of the kernel's instructions at decode sizes).
template <int PLANES, int ROWS, int THREADS>
__device__ __forceinline__ void rlp_wgmma_stage_operand(signed char* tile, const signed char* rows, int row_stride,
                                                        int kp, int k, bool k_valid, int valid_rows, int swizzled) {
    static_assert(THREADS % 64 == 0, "every thread keeps one piece and one swizzle phase");
    constexpr int PIECES = PLANES * ROWS * 8;
#pragma unroll
    for (int t = 0; t < (PIECES + THREADS - 1) / THREADS; ++t) {
        const int v = threadIdx.x + t * THREADS;
        if (PIECES % THREADS != 0 && v >= PIECES) break;
        const int plane = v / (ROWS * 8), row = (v / 8) % ROWS;
        const bool valid = k_valid && row < valid_rows;
        rlp_cp_async16(tile + plane * (ROWS * 128) + row * 128 + swizzled,
                       rows + (valid ? row * row_stride + plane * kp + k : 0), valid);
    }
}
#endif

#ifdef RLP_HAS_WGMMA
// The GROUPED epilogue: each thread's registers 2 pair, 2 pair + 1 are one row's two adjacent columns of its
// warpgroup's slice, S = sum_k 256^k G_k (exact in int64). With split-K (SPLITS blocks of a cluster, each over
// a share of K), rank r rounds the pairs with pair % SPLITS == r: the other ranks leave their S of those in
// their shared memory (exchange, [register][thread], after the main loop), read through distributed shared
// memory and added exactly; every thread of a rank holds the same registers' outputs, so one index serves all.
template <int SLICE, int GROUPS, int SPLITS, int THREADS>
__device__ __forceinline__ void rlp_wgmma_grouped_outputs(const int (&acc)[GROUPS][SLICE / 2], const int* tile_ea,
                                                          const int* tile_ew, long long* exchange, int split,
                                                          int m0, int n0, int m, int n, int scale_offset, float* y0,
                                                          float* y1, float* y2, int c1, int c2) {
    constexpr int R = SLICE / 2;
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    const int warp = tid / 32, g = (tid % 32) / 4, q = tid % 4;
    auto sum_of = [&](int r) {
        long long s = 0;
#pragma unroll
        for (int k = GROUPS - 1; k >= 0; --k) s = 256LL * s + (long long)acc[k][r];
        return s;
    };
    if constexpr (SPLITS > 1) {
        __syncthreads();  // every warpgroup's wgmma is done reading the stages
#pragma unroll
        for (int r = 0; r < R; ++r)
            if ((r / 2) % SPLITS != split) exchange[r * THREADS + threadIdx.x] = sum_of(r);
        rlp_cluster_sync();
    }
#pragma unroll
    for (int pair = 0; pair < R / 2; ++pair) {
        if (pair % SPLITS != split) continue;
        const int row = m0 + 16 * warp + g + 8 * (pair % 2), col = n0 + wg * SLICE + 8 * (pair / 2) + 2 * q;
        if (row >= m) continue;
        float out[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            long long s = sum_of(2 * pair + c);
#pragma unroll
            for (int b = 0; b < SPLITS; ++b)
                if (b != split) s += rlp_cluster_peer(exchange, b)[(2 * pair + c) * THREADS + threadIdx.x];
            out[c] = col + c < n ? rlp_gemm_output_small(s, tile_ea[row - m0], tile_ew[col + c - n0], scale_offset)
                                 : 0.0f;
        }
        rlp_store_column_pair(y0, y1, y2, c1, c2, n, row, col, out);
    }
    if constexpr (SPLITS > 1) rlp_cluster_sync();  // no block leaves while its sums are read
}
#endif

template <int BN, int STAGES, int SPLITS, bool GROUPED, int WARPGROUPS>
__device__ __forceinline__ void rlp_gemm_wgmma(
    const signed char* __restrict__ xd, const signed char* __restrict__ wd,
    const int* __restrict__ ea, const int* __restrict__ ew, int m, int n, int kp, int scale_offset,
    float* y0, float* y1, float* y2, int c1, int c2) {
#ifdef RLP_HAS_WGMMA
    constexpr int THREADS = 128 * WARPGROUPS;
    constexpr int SLICE = GROUPED ? BN / WARPGROUPS : BN;  // a warpgroup's columns
    constexpr int SUMS = GROUPED ? RLP_A_DIGITS + RLP_W_DIGITS - 1 : RLP_W_DIGITS;  // int32 sums per output
    constexpr int R = SLICE / 2;  // registers per sum
    constexpr int A_TILE = RLP_WGMMA_ROWS * RLP_WGMMA_KBLOCK, W_TILE = BN * RLP_WGMMA_KBLOCK;
    constexpr int STAGE = RLP_A_DIGITS * A_TILE + RLP_W_DIGITS * W_TILE;
    static_assert(STAGES >= 3 && STAGE % 1024 == 0, "stages of whole 1024-byte swizzle atoms");
    static_assert(GROUPED || STAGES * STAGE >= RLP_A_DIGITS * R * 128 * 8, "the stages hold the epilogue's partials");
    static_assert(GROUPED ? SLICE % 8 == 0 && SLICE * WARPGROUPS == BN : WARPGROUPS == RLP_A_DIGITS,
                  "grouped: whole 8-column wgmma slices; otherwise one warpgroup per activation digit");
    extern __shared__ unsigned char rlp_wgmma_shared[];
    // the swizzle pattern is a function of the address: tiles start on 1024-byte boundaries
    const unsigned int base = (unsigned int)__cvta_generic_to_shared(rlp_wgmma_shared);
    signed char* slab = reinterpret_cast<signed char*>(rlp_wgmma_shared) + ((1024 - (base & 1023)) & 1023);
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;  // warpgroup wg multiplies activation digit wg
    // row blocks vary fastest, so the blocks that share a weight tile run together (L2 reuse)
    const int split = blockIdx.x % SPLITS;  // this block's rank in its cluster
    const int m0 = blockIdx.x / SPLITS * RLP_WGMMA_ROWS, n0 = blockIdx.y * BN;
    const long long a_row_stride = (long long)RLP_A_DIGITS * kp, w_row_stride = (long long)RLP_W_DIGITS * kp;
    const int kblocks_all = (kp + RLP_WGMMA_KBLOCK - 1) / RLP_WGMMA_KBLOCK;
    const int kb_first = split * kblocks_all / SPLITS;
    const int kblocks = (split + 1) * kblocks_all / SPLITS - kb_first;
    // The exponents of the tile's rows and columns, read once before the main loop (whose barriers make
    // them visible): the epilogue then reads them from shared memory, not as dependent global loads
    // behind its per-pair branches (which cost about as much as the main loop: probe_wgmma_phases).
    __shared__ int tile_ea[RLP_WGMMA_ROWS], tile_ew[BN];
    for (int i = threadIdx.x; i < RLP_WGMMA_ROWS + BN; i += THREADS) {
        if (i < RLP_WGMMA_ROWS) tile_ea[i] = m0 + i < m ? ea[m0 + i] : 0;
        else tile_ew[i - RLP_WGMMA_ROWS] = n0 + i - RLP_WGMMA_ROWS < n ? ew[n0 + i - RLP_WGMMA_ROWS] : 0;
    }

    const signed char* a_rows = xd + (long long)m0 * a_row_stride;
    const signed char* w_rows = wd + (long long)n0 * w_row_stride;
    const int piece = threadIdx.x % 8, swizzled = (piece ^ ((threadIdx.x / 8) % 8)) << 4;
    auto stage_in = [&](int kb, int stage) {
        signed char* s = slab + stage * STAGE;
        const int k = (kb_first + kb) * RLP_WGMMA_KBLOCK + 16 * piece;
        rlp_wgmma_stage_operand<RLP_A_DIGITS, RLP_WGMMA_ROWS, THREADS>(s, a_rows, RLP_A_DIGITS * kp, kp, k, k < kp,
                                                                       m - m0, swizzled);
        rlp_wgmma_stage_operand<RLP_W_DIGITS, BN, THREADS>(s + RLP_A_DIGITS * A_TILE, w_rows, RLP_W_DIGITS * kp, kp, k,
                                                           k < kp, n - n0, swizzled);
    };

    int acc[SUMS][R];
#pragma unroll
    for (int j = 0; j < SUMS; ++j)
#pragma unroll
        for (int r = 0; r < R; ++r) acc[j][r] = 0;
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < kblocks) stage_in(s, s);
        rlp_cp_async_commit();
    }
    for (int kb = 0; kb < kblocks; ++kb) {
        rlp_cp_async_wait<STAGES - 3>();
        rlp_fence_proxy_async();
        // block kb landed for every thread; every warpgroup waited for its wgmma of block kb - 2,
        // so the stage refilled below is free
        __syncthreads();
        const int ahead = kb + STAGES - 2;
        if (ahead < kblocks) stage_in(ahead, ahead % STAGES);
        rlp_cp_async_commit();
        const signed char* s = slab + (kb % STAGES) * STAGE;
        rlp_wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < RLP_WGMMA_KBLOCK / 32; ++ks) {
            // weight digit j sits in slot W_DIGITS - 1 - j
            const signed char* w = s + RLP_A_DIGITS * A_TILE + (GROUPED ? wg * SLICE * RLP_WGMMA_KBLOCK : 0) + 32 * ks;
            if constexpr (GROUPED) {
#pragma unroll
                for (int i = 0; i < RLP_A_DIGITS; ++i) {
                    const unsigned long long a = rlp_wgmma_descriptor(s + i * A_TILE + 32 * ks);
#pragma unroll
                    for (int j = 0; j < RLP_W_DIGITS; ++j)
                        rlp_wgmma<SLICE>(acc[i + j], a, rlp_wgmma_descriptor(w + (RLP_W_DIGITS - 1 - j) * W_TILE));
                }
            } else {
                const unsigned long long a = rlp_wgmma_descriptor(s + wg * A_TILE + 32 * ks);
#pragma unroll
                for (int j = 0; j < RLP_W_DIGITS; ++j)
                    rlp_wgmma<SLICE>(acc[j], a, rlp_wgmma_descriptor(w + (RLP_W_DIGITS - 1 - j) * W_TILE));
            }
        }
        rlp_wgmma_commit();
#pragma unroll
        for (int j = 0; j < SUMS; ++j) rlp_wgmma_pin<R>(acc[j]);
        rlp_wgmma_wait<1>();
    }
    rlp_wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < SUMS; ++j) rlp_wgmma_pin<R>(acc[j]);
    rlp_cp_async_wait<0>();
    if constexpr (GROUPED) {
        rlp_wgmma_grouped_outputs<SLICE, SUMS, SPLITS, THREADS>(acc, tile_ea, tile_ew, reinterpret_cast<long long*>(slab),
                                                                 split, m0, n0, m, n, scale_offset, y0, y1, y2, c1, c2);
        return;
    }
    __syncthreads();  // every warpgroup is done with the stages: they now hold the partials

    // P_i = acc[0] + 256 acc[1] per element, exact in int64. Every warpgroup stores its P_i in the
    // accumulator layout itself, [i][register][thread] (which all three share: conflict-free), then
    // warpgroup w rounds the register pairs p = w, w + 3, ...: S = P_0 + 256 P_1 + 65536 P_2. A warpgroup
    // keeps the P_i of the pairs it rounds itself in its registers (a third of the exchange's traffic).
    long long* partial = reinterpret_cast<long long*>(slab);
    const int own = split * RLP_A_DIGITS + wg;  // this warpgroup rounds the pairs p with p % (3 SPLITS) == own
#pragma unroll
    for (int r = 0; r < R; ++r)
        if ((r / 2) % (RLP_A_DIGITS * SPLITS) != own)
            partial[(wg * R + r) * 128 + tid] = (long long)acc[0][r] + 256LL * (long long)acc[1][r];
    if constexpr (SPLITS == 1) __syncthreads();
    else rlp_cluster_sync();
    const long long* parts[SPLITS];
#pragma unroll
    for (int b = 0; b < SPLITS; ++b) parts[b] = SPLITS == 1 ? partial : rlp_cluster_peer(partial, b);
    const int warp = tid / 32, g = (tid % 32) / 4, q = tid % 4;
#pragma unroll
    for (int pair = 0; pair < R / 2; ++pair) {
        if (pair % (RLP_A_DIGITS * SPLITS) != own) continue;
        // registers 2 pair, 2 pair + 1 of thread (warp, g, q): one row, two adjacent columns
        const int row = m0 + 16 * warp + g + 8 * (pair % 2), col = n0 + 8 * (pair / 2) + 2 * q;
        if (row >= m) continue;
        float out[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            const int i = (2 * pair + c) * 128 + tid;
            const long long mine = (long long)acc[0][2 * pair + c] + 256LL * (long long)acc[1][2 * pair + c];
            long long s = 0;  // the sum over the cluster's blocks of P_0 + 256 P_1 + 65536 P_2 (exact)
#pragma unroll
            for (int b = 0; b < SPLITS; ++b) {
                long long block_sum = 0;
#pragma unroll
                for (int d = RLP_A_DIGITS - 1; d >= 0; --d)
                    block_sum = 256LL * block_sum + (b == split && d == wg ? mine : parts[b][d * R * 128 + i]);
                s += block_sum;
            }
            out[c] = col + c < n ? rlp_gemm_output_small(s, tile_ea[row - m0], tile_ew[col + c - n0], scale_offset)
                                 : 0.0f;
        }
        rlp_store_column_pair(y0, y1, y2, c1, c2, n, row, col, out);
    }
    if constexpr (SPLITS > 1) rlp_cluster_sync();  // no block leaves while its partials are read
#else
    __trap();  // not an sm_90a build: ops/gemm_fused.py picks these kernels only on compute capability 9.0
#endif
}

#ifdef RLP_HAS_WGMMA
#define RLP_CLUSTER_DIMS(SPLITS) __cluster_dims__(SPLITS, 1, 1)
#else
#define RLP_CLUSTER_DIMS(SPLITS)
#endif
// Two blocks per multiprocessor for 64 x 32 tiles (their stages take under half the shared memory)
#define RLP_GEMM_WGMMA_ENTRY(NAME, BN, STAGES, SPLITS, GROUPED, WARPGROUPS)                                  \
    extern "C" __global__ void RLP_CLUSTER_DIMS(SPLITS) __launch_bounds__(128 * (WARPGROUPS), (BN) <= 32 ? 2 : 1)  \
        NAME(const signed char* __restrict__ xd, const signed char* __restrict__ wd, const int* __restrict__ ea,   \
             const int* __restrict__ ew, int m, int n, int kp, int scale_offset, float* y0, float* y1, float* y2, \
             int c1, int c2) {                                                                                     \
        rlp_gemm_wgmma<BN, STAGES, SPLITS, GROUPED, WARPGROUPS>(xd, wd, ea, ew, m, n, kp, scale_offset, y0, y1, y2,  \
                                                                c1, c2);                                             \
    }

RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x32, 32, 3, 1, false, RLP_A_DIGITS)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x64, 64, 4, 1, false, RLP_A_DIGITS)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x128, 128, 4, 1, false, RLP_A_DIGITS)
// split-K over clusters of two: for the few tiles of a long K at decode sizes (o and down at M = 256;
// 64 x 32 at M = 128, two blocks per multiprocessor)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x64_split2, 64, 4, 2, false, RLP_A_DIGITS)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x32_split2, 32, 3, 2, false, RLP_A_DIGITS)
// column-split warpgroups with shift-grouped sums (GROUPED): 32 or 64 columns a warpgroup, 64 or 128
// accumulator registers; three warpgroups (the 64 x 192 tile's three stages fill the shared memory) or two
// (64 x 64 split in two along K, for o and down at M = 256)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x96_groups, 96, 4, 1, true, 3)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x192_groups, 192, 3, 1, true, 3)
RLP_GEMM_WGMMA_ENTRY(gemm_wgmma_a3w2_64x64_groups2_split2, 64, 4, 2, true, 2)
