// AMD's integer MFMA for the fast-path kernels of backends/hip: one 16 x 16 block D = A B + C of int8
// operands and int32 sums, on v_mfma_i32_16x16x32_i8 (gfx942: KL = 8 int8 of A and of B a lane, a `long`)
// or v_mfma_i32_16x16x16i8 (gfx90a: KL = 4, an `int`). The lane layout (cpu_prelude.h "Integer MFMA"):
// lane l gives row (column) l % 16 and reduction bytes KL (l / 16) .. + KL - 1 of a step of 4 KL; D's lane
// l holds column l % 16, rows 4 (l / 16) + r, r = 0..3. Each instruction exists only where its target
// is compiled (clang's __gfx942__ / __gfx90a__); HIP-CPU emulates both.
#ifndef RLP_HIP_MFMA_H
#define RLP_HIP_MFMA_H

typedef int rlp_mfma_i32x4 __attribute__((vector_size(16)));

template <int KL>
struct RlpMfma;
#if defined(__gfx942__) || defined(RLP_HIP_CPU)
template <>
struct RlpMfma<8> {
    typedef long operand;
    static __device__ __forceinline__ rlp_mfma_i32x4 run(operand a, operand b, rlp_mfma_i32x4 c) {
        return __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, c, 0, 0, 0);
    }
};
#endif
#if defined(__gfx90a__) || defined(RLP_HIP_CPU)
template <>
struct RlpMfma<4> {
    typedef int operand;
    static __device__ __forceinline__ rlp_mfma_i32x4 run(operand a, operand b, rlp_mfma_i32x4 c) {
        return __builtin_amdgcn_mfma_i32_16x16x16i8(a, b, c, 0, 0, 0);
    }
};
#endif

// S = sum_d 256^d G_d of register r of a 16 x 16 block's G shift groups, exact in int64 (most significant
// group first).
template <int G>
__device__ __forceinline__ long long rlp_mfma_combine(const rlp_mfma_i32x4 (&groups)[G], int r) {
    long long s = groups[G - 1][r];
#pragma unroll
    for (int d = G - 2; d >= 0; --d) s = s * 256 + groups[d][r];
    return s;
}

#endif
