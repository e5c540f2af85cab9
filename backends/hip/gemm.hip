// Kernel family "gemm", AMD's fast path: the fused exact GEMM on the integer matrix cores (MFMA),
// gemm_mfma_a3w2_64x64_gfx942 (v_mfma_i32_16x16x32_i8, CDNA3: MI300X) and _gfx90a
// (v_mfma_i32_16x16x16i8, CDNA2: MI200). Contract: contracts/gemm.toml; reference:
// rlportable/contract/exact.py gemm. The family's portable kernels (the blas path's combine, both
// vendors) are backends/portable/gemm.hip, included here. Each kernel is built only where its
// instruction exists (clang's __gfx942__ / __gfx90a__) and on HIP-CPU, which emulates both
// (backends/hip/cpu_prelude.h); `rlportable conform --device hip-cpu` checks them bit for bit.
#include "../portable/gemm.hip"

#if defined(__gfx942__) || defined(__gfx90a__) || defined(RLP_HIP_CPU)
// The same sums as backends/cuda/gemm.cu's fused kernels: 3 activation digits (ascending layout,
// digit i weighs 256^i) and 2 weight digits (descending layout: slot s is digit 1 - s) give 6 int8
// products per 16 x 16 block, summed by shift d = i + j into 4 int32 groups over the whole of K
// (|group| <= 2 pairs * 2^14 * K < 2^31: gemm_max_k), combined in int64 and rounded once in the
// epilogue. Integer sums are exact in any order, so the tiling and the instruction's K width change
// nothing.
//
// A block: 256 threads = 4 wavefronts of 64, a 64 x 64 output tile; wavefront w takes rows
// 32 (w / 2) .. + 31 and columns 32 (w % 2) .. + 31 as 2 x 2 blocks of 16 x 16. K is staged in chunks
// of 64 bytes a digit row through LDS (5 digit planes x 64 rows x 80 bytes: 25,600 bytes; the 16
// bytes of padding a row keep 16-byte stores aligned and spread the rows' 8-byte fragment reads over
// the banks); the next chunk's 5 x 16 bytes a thread are loaded into registers while the current
// chunk is multiplied. Operand fragments (AMD's layout, cpu_prelude.h "Integer MFMA"): lane l gives
// row (or column) l % 16 and k = KL (l / 16) .. + KL - 1 of the instruction's K = 4 KL; D's lane l
// holds column l % 16, rows 4 (l / 16) .. + 3.
#define RLP_MFMA_ROWS 64
#define RLP_MFMA_COLS 64
#define RLP_MFMA_THREADS 256
#define RLP_MFMA_KC 64                       // bytes of K a chunk
#define RLP_MFMA_LD (RLP_MFMA_KC + 16)       // LDS row stride
#define RLP_MFMA_PLANES 5                    // 3 activation digit planes, then 2 weight digit planes

#include "mfma.h"

template <int KL>
__device__ __forceinline__ void rlp_gemm_mfma(const signed char* __restrict__ a_digits,
                                              const signed char* __restrict__ w_digits,
                                              const int* __restrict__ a_exponents, const int* __restrict__ w_exponents,
                                              int m, int n, int kp, int scale_offset, float* __restrict__ y) {
    typedef typename RlpMfma<KL>::operand operand;
    __shared__ int4 tiles[RLP_MFMA_PLANES * RLP_MFMA_ROWS * RLP_MFMA_LD / 16];
    signed char* lds = reinterpret_cast<signed char*>(tiles);

    const int tid = threadIdx.x, lane = tid % 64, wave = tid / 64;
    const long long row0 = (long long)blockIdx.y * RLP_MFMA_ROWS, col0 = (long long)blockIdx.x * RLP_MFMA_COLS;
    // This thread's share of a chunk: 16 bytes of row (or column) `mine` in each of the 5 planes.
    const int mine = tid / 4, piece = tid % 4;
    const bool row_ok = row0 + mine < m, col_ok = col0 + mine < n;
    const signed char* a_row = a_digits + (row0 + mine) * 3LL * kp + 16 * piece;
    const signed char* w_row = w_digits + (col0 + mine) * 2LL * kp + 16 * piece;
    int4 staged[RLP_MFMA_PLANES];
    auto load = [&](int k0) {
        const int4 zero = make_int4(0, 0, 0, 0);
#pragma unroll
        for (int i = 0; i < 3; ++i)
            staged[i] = row_ok ? *reinterpret_cast<const int4*>(a_row + (long long)i * kp + k0) : zero;
#pragma unroll
        for (int j = 0; j < 2; ++j)  // plane 3 + j holds weight digit j (ascending), which is slot 1 - j
            staged[3 + j] = col_ok ? *reinterpret_cast<const int4*>(w_row + (long long)(1 - j) * kp + k0) : zero;
    };

    rlp_mfma_i32x4 acc[2][2][4];  // [row block][column block][shift group]
#pragma unroll
    for (int rb = 0; rb < 2; ++rb)
#pragma unroll
        for (int cb = 0; cb < 2; ++cb)
#pragma unroll
            for (int g = 0; g < 4; ++g) acc[rb][cb][g] = rlp_mfma_i32x4{0, 0, 0, 0};

    const int frag_row = lane % 16, frag_k = KL * (lane / 16);
    const int wave_rows = 32 * (wave / 2), wave_cols = 32 * (wave % 2);
    if (kp > 0) load(0);
    for (int k0 = 0; k0 < kp; k0 += RLP_MFMA_KC) {
        __syncthreads();  // the previous chunk's readers are done
#pragma unroll
        for (int p = 0; p < RLP_MFMA_PLANES; ++p)
            *reinterpret_cast<int4*>(lds + (p * RLP_MFMA_ROWS + mine) * RLP_MFMA_LD + 16 * piece) = staged[p];
        __syncthreads();
        if (k0 + RLP_MFMA_KC < kp) load(k0 + RLP_MFMA_KC);  // in flight while this chunk is multiplied
#pragma unroll
        for (int ks = 0; ks < RLP_MFMA_KC; ks += 4 * KL) {
            operand af[3][2], wf[2][2];
#pragma unroll
            for (int i = 0; i < 3; ++i)
#pragma unroll
                for (int rb = 0; rb < 2; ++rb)
                    af[i][rb] = *reinterpret_cast<const operand*>(
                        lds + (i * RLP_MFMA_ROWS + wave_rows + 16 * rb + frag_row) * RLP_MFMA_LD + ks + frag_k);
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
                for (int cb = 0; cb < 2; ++cb)
                    wf[j][cb] = *reinterpret_cast<const operand*>(
                        lds + ((3 + j) * RLP_MFMA_ROWS + wave_cols + 16 * cb + frag_row) * RLP_MFMA_LD + ks + frag_k);
#pragma unroll
            for (int rb = 0; rb < 2; ++rb)
#pragma unroll
                for (int cb = 0; cb < 2; ++cb)
#pragma unroll
                    for (int i = 0; i < 3; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                            acc[rb][cb][i + j] = RlpMfma<KL>::run(af[i][rb], wf[j][cb], acc[rb][cb][i + j]);
        }
    }

    // Epilogue: lane l holds column l % 16 and rows 4 (l / 16) + r of each 16 x 16 block.
#pragma unroll
    for (int rb = 0; rb < 2; ++rb)
#pragma unroll
        for (int cb = 0; cb < 2; ++cb) {
            const long long col = col0 + wave_cols + 16 * cb + lane % 16;
            if (col >= n) continue;
            const int ew = w_exponents[col];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const long long row = row0 + wave_rows + 16 * rb + 4 * (lane / 16) + r;
                if (row >= m) continue;
                y[row * n + col] = rlp_gemm_output(rlp_mfma_combine<4>(acc[rb][cb], r), a_exponents[row], ew,
                                                   scale_offset);
            }
        }
}

// grid (ceil(n / 64), ceil(m / 64)), 256 threads; operands as the CUDA fused kernels take them
// (ops/gemm_mfma.py launch_mfma): activation digits [m, 3, kp] ascending, weight digits [n, 2, kp]
// descending, kp a multiple of 64.
#define RLP_GEMM_MFMA_ENTRY(NAME, KL)                                                                            \
    extern "C" __global__ void __launch_bounds__(RLP_MFMA_THREADS) NAME(                                         \
        const signed char* __restrict__ a_digits, const signed char* __restrict__ w_digits,                     \
        const int* __restrict__ a_exponents, const int* __restrict__ w_exponents, int m, int n, int kp,         \
        int scale_offset, float* __restrict__ y) {                                                              \
        rlp_gemm_mfma<KL>(a_digits, w_digits, a_exponents, w_exponents, m, n, kp, scale_offset, y);            \
    }
#if defined(__gfx942__) || defined(RLP_HIP_CPU)
RLP_GEMM_MFMA_ENTRY(gemm_mfma_a3w2_64x64_gfx942, 8)
#endif
#if defined(__gfx90a__) || defined(RLP_HIP_CPU)
RLP_GEMM_MFMA_ENTRY(gemm_mfma_a3w2_64x64_gfx90a, 4)
#endif
#endif
