#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
#include "contract_math.h"
// Kernel family "moe": route (router logits -> each token's k experts and their weights) and combine
// (the k experts' output rows -> one row, one exact sum per element). Contract: contracts/moe.toml;
// reference: rlportable/contract/moe.py route and combine. The experts' products are the gemm
// family's kernels (ops/moe.py groups the tokens by expert).

#define RLP_MOE_SUM_SHIFT 36      // SUM_BITS - 2: probabilities on logprob's 2^-36 grid
#define RLP_MOE_COMBINE_SHIFT 36  // COMBINE_BITS - 2: terms on a 38-bit grid below the largest

// The order key of a non-NaN logit with +0 and -0 equal (the contract's exact comparison), in the high
// 32 bits, and the expert index reversed in the low 32: the largest key is the largest logit, and of
// equal logits the lowest index. Every key of a row is distinct.
__device__ __forceinline__ unsigned long long rlp_moe_key(float z, int e) {
    const unsigned int bits = (unsigned int)__float_as_int(z == 0.0f ? 0.0f : z);
    const unsigned int key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((unsigned long long)key << 32) | (unsigned long long)(0xFFFFFFFFu - (unsigned int)e);
}

__device__ __forceinline__ float rlp_moe_logit(unsigned long long key) {
    const unsigned int k = (unsigned int)(key >> 32);
    return __int_as_float((int)((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k));
}

// One block per row of logits [rows, E] (grid-stride), a multiple of 32 threads, every thread in every
// helper call (common.h's rlp_block_*: exact and order-free). Pass 1: the maximum's key and a NaN flag;
// an undefined row (a NaN, or a maximum of +inf or -inf) takes experts 0..k-1 and the canonical NaN as
// every weight. Pass 2: S = sum RNE(exp_f32(z - m) 2^36) over all E. Then k rounds, each the largest
// key below the previous round's: the experts in descending logit order, ties to the lower index.
// With norm_topk_prob the k chosen terms make D, else D = S; w_j = RNE_f32(p_j / (odd(D) 2^-36)).
extern "C" __global__ void moe_route(const float* __restrict__ logits, long long rows, int experts, int top_k,
                                     int norm_topk_prob, int* __restrict__ chosen, float* __restrict__ weights) {
    __shared__ unsigned long long largest, total, top;
    __shared__ unsigned int nan_flag;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* z = logits + row * (long long)experts;
        int* out_experts = chosen + row * (long long)top_k;
        float* out_weights = weights + row * (long long)top_k;
        if (threadIdx.x == 0) { largest = 0ull; total = 0ull; nan_flag = 0u; }
        __syncthreads();
        unsigned long long local_key = 0ull;
        unsigned int local_nan = 0u;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const float v = z[e];
            if (v != v) {
                local_nan = 1u;
            } else {
                const unsigned long long key = rlp_moe_key(v, e);
                local_key = key > local_key ? key : local_key;
            }
        }
        rlp_block_max_u64(&largest, local_key);
        rlp_block_or_u32(&nan_flag, local_nan);
        __syncthreads();
        const float m = rlp_moe_logit(largest);
        const bool undefined = nan_flag != 0u || !(m - m == 0.0f);  // a NaN, or m = +-inf
        if (undefined) {  // block-uniform
            for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
                out_experts[j] = j;
                out_weights[j] = rlp_canonical_nan();
            }
            __syncthreads();  // the shared words are read before the next row resets them
            continue;
        }
        long long local_sum = 0;
        if (!norm_topk_prob)
            for (int e = threadIdx.x; e < experts; e += blockDim.x)
                local_sum += rlp_double2ll_rn((double)rlp_exp_f32(z[e] - m) * rlp_pow2_f64(RLP_MOE_SUM_SHIFT));
        unsigned long long bound = ~0ull;  // keys below this are still free
        for (int j = 0; j < top_k; ++j) {
            if (threadIdx.x == 0) top = 0ull;
            __syncthreads();
            unsigned long long best = 0ull;
            for (int e = threadIdx.x; e < experts; e += blockDim.x) {
                const unsigned long long key = rlp_moe_key(z[e], e);
                if (key < bound && key > best) best = key;
            }
            rlp_block_max_u64(&top, best);
            __syncthreads();
            bound = top;
            if (threadIdx.x == 0) out_experts[j] = (int)(0xFFFFFFFFu - (unsigned int)bound);
            __syncthreads();  // every thread has read top before the next round resets it
        }
        // the chosen experts' terms (norm_topk_prob), then the weights from D
        if (norm_topk_prob)
            for (int j = threadIdx.x; j < top_k; j += blockDim.x)
                local_sum += rlp_double2ll_rn((double)rlp_exp_f32(z[out_experts[j]] - m) * rlp_pow2_f64(RLP_MOE_SUM_SHIFT));
        rlp_block_sum_i64(&total, local_sum);
        __syncthreads();
        const double denominator = rlp_round_to_odd_f64((long long)total) * rlp_pow2_f64(-RLP_MOE_SUM_SHIFT);
        for (int j = threadIdx.x; j < top_k; j += blockDim.x)
            out_weights[j] = rlp_double2float_rn((double)rlp_exp_f32(z[out_experts[j]] - m) / denominator);
        __syncthreads();  // the shared words are read before the next row resets them
    }
}

// out[t, h] = the exact sum of P_j = float64(w[t, j]) float64(y[t, j, h]) (0 where w = 0), one element
// a thread (grid-stride over rows x hidden): e = ilogb(max |P_j|), q_j = RNE(P_j 2^(36 - e)) in two exact
// power-of-two steps (as quantize_f64_rows), S = sum q_j, out = round_scaled(S, e - 36); a NaN term or
// both infinities give the canonical NaN, else an infinite term that infinity.
extern "C" __global__ void moe_combine(const float* __restrict__ weights, const float* __restrict__ outputs,
                                       long long rows, int top_k, int hidden, float* __restrict__ out) {
    const long long elements = rows * (long long)hidden;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < elements;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / hidden;
        const int h = (int)(i - t * hidden);
        const float* w = weights + t * top_k;
        const float* y = outputs + t * (long long)top_k * hidden + h;
        unsigned long long largest = 0ull;
        bool nan = false, pos = false, neg = false;
        for (int j = 0; j < top_k; ++j) {
            const double p = w[j] == 0.0f ? 0.0 : (double)w[j] * (double)y[(long long)j * hidden];
            const unsigned long long magnitude = (unsigned long long)__double_as_longlong(p) & 0x7fffffffffffffffull;
            if (p != p) nan = true;
            else if (magnitude == 0x7ff0000000000000ull) (p > 0.0 ? pos : neg) = true;
            else if (magnitude > largest) largest = magnitude;
        }
        if (nan || (pos && neg)) { out[i] = rlp_canonical_nan(); continue; }
        if (pos || neg) { out[i] = __int_as_float(pos ? 0x7f800000 : (int)0xff800000u); continue; }
        const int e = rlp_exponent_f64(largest);
        const int shift = RLP_MOE_COMBINE_SHIFT - e;
        const int half = shift >= 0 ? shift / 2 : -((1 - shift) / 2);  // floor(shift / 2)
        const double hi = rlp_pow2_f64(half), lo = rlp_pow2_f64(shift - half);
        long long sum = 0;
        for (int j = 0; j < top_k; ++j) {
            const double p = w[j] == 0.0f ? 0.0 : (double)w[j] * (double)y[(long long)j * hidden];
            sum += rlp_double2ll_rn((p * hi) * lo);
        }
        out[i] = rlp_round_scaled(sum, e - RLP_MOE_COMBINE_SHIFT);
    }
}
