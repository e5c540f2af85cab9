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

// ---- The backward (contracts/moe.toml route_backward and combine_backward; the references'
// route_backward and combine_backward). The experts' products are the gemm family's, SwiGLU's
// backward the activation family's, d h the combine's exact sum (weights 1) of the 2k + 1 rows.

// The exact grid sum of one float64 term with the largest magnitude's exponent e: RNE(P 2^(36 - e)) in
// two exact power-of-two steps (quantize_f64_rows), as moe_combine's.
__device__ __forceinline__ long long rlp_moe_grid_term(double p, int e) {
    const int shift = RLP_MOE_COMBINE_SHIFT - e;
    const int half = shift >= 0 ? shift / 2 : -((1 - shift) / 2);  // floor(shift / 2)
    return rlp_double2ll_rn((p * rlp_pow2_f64(half)) * rlp_pow2_f64(shift - half));
}

// Flags of the float64 terms of one exact sum: a NaN, a +inf, a -inf.
#define RLP_MOE_TERM_NAN 1u
#define RLP_MOE_TERM_POS 2u
#define RLP_MOE_TERM_NEG 4u

__device__ __forceinline__ void rlp_moe_note_term(double p, unsigned long long* largest, unsigned int* flags) {
    const unsigned long long magnitude = (unsigned long long)__double_as_longlong(p) & 0x7fffffffffffffffull;
    if (p != p) *flags |= RLP_MOE_TERM_NAN;
    else if (magnitude == 0x7ff0000000000000ull) *flags |= p > 0.0 ? RLP_MOE_TERM_POS : RLP_MOE_TERM_NEG;
    else if (magnitude > *largest) *largest = magnitude;
}

// One block per (token, slot) of weights [rows, k] (grid-stride): d_outputs[t, j, h] = RNE_f32(w_j d[h])
// (a NaN the canonical one), d_weights[t, j] = the exact sum over h of float64(d[h]) float64(y_j[h]) on the
// combine's grid below the largest |term| (block-wide max and int64 sum), one rounding; a NaN term or
// both infinities the canonical NaN, else an infinite term that infinity. w_j = 0: both +0.
extern "C" __global__ void moe_combine_backward(const float* __restrict__ d_out, const float* __restrict__ weights,
                                                const float* __restrict__ outputs, long long rows, int top_k,
                                                int hidden, float* __restrict__ d_weights,
                                                float* __restrict__ d_outputs) {
    __shared__ unsigned long long largest, total;
    __shared__ unsigned int flags;
    const long long slots = rows * (long long)top_k;
    for (long long slot = blockIdx.x; slot < slots; slot += gridDim.x) {
        const float w = weights[slot];
        const float* d = d_out + (slot / top_k) * (long long)hidden;
        const float* y = outputs + slot * (long long)hidden;
        float* dy = d_outputs + slot * (long long)hidden;
        if (w == 0.0f) {  // block-uniform; no shared word is read
            for (int i = threadIdx.x; i < hidden; i += blockDim.x) dy[i] = 0.0f;
            if (threadIdx.x == 0) d_weights[slot] = 0.0f;
            continue;
        }
        if (threadIdx.x == 0) { largest = 0ull; total = 0ull; flags = 0u; }
        __syncthreads();
        unsigned long long local = 0ull;
        unsigned int local_flags = 0u;
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            const float v = rlp_double2float_rn((double)w * (double)d[i]);
            dy[i] = v != v ? rlp_canonical_nan() : v;
            rlp_moe_note_term((double)d[i] * (double)y[i], &local, &local_flags);
        }
        rlp_block_max_u64(&largest, local);
        rlp_block_or_u32(&flags, local_flags);
        __syncthreads();
        const unsigned int f = flags;
        if (f == 0u) {  // block-uniform
            const int e = rlp_exponent_f64(largest);
            long long sum = 0;
            for (int i = threadIdx.x; i < hidden; i += blockDim.x) sum += rlp_moe_grid_term((double)d[i] * (double)y[i], e);
            rlp_block_sum_i64(&total, sum);
            __syncthreads();
            if (threadIdx.x == 0) d_weights[slot] = rlp_round_scaled((long long)total, e - RLP_MOE_COMBINE_SHIFT);
        } else if (threadIdx.x == 0) {
            const bool nan = (f & RLP_MOE_TERM_NAN) || (f & (RLP_MOE_TERM_POS | RLP_MOE_TERM_NEG)) ==
                                                           (RLP_MOE_TERM_POS | RLP_MOE_TERM_NEG);
            d_weights[slot] = nan ? rlp_canonical_nan() : __int_as_float((f & RLP_MOE_TERM_POS) ? 0x7f800000 : (int)0xff800000u);
        }
        __syncthreads();  // the shared words are read before the next slot resets them
    }
}

// Row flags of moe_route_backward.
#define RLP_MOE_LOGIT_NAN 1u
#define RLP_MOE_G_NONZERO 2u
#define RLP_MOE_G_NONFINITE 4u
#define RLP_MOE_RESULT_NAN 8u

// One block per row of logits [rows, E] (grid-stride): dz_e = RNE_f32(q_e (gsel_e - c)) with the forward's
// m, p_e = exp_f32(z_e - m) and D (route's sums: all E, or the k chosen with norm_topk_prob),
// q_e = p_e / (odd(D) 2^-36) (the chosen e only with norm_topk_prob, +0 elsewhere), c the exact sum of
// float64(g_j) float64(w_j) on the combine's grid (non-finite terms: a NaN, or that infinity), converted
// exactly. Precedence: g all zero gives +0 everywhere; else a non-finite g or an undefined row (a NaN
// logit, or a maximum of +-inf) the canonical NaN everywhere; else a NaN among the results the canonical
// NaN everywhere. Pass 1 writes every e as unchosen (gsel = 0), pass 2 the k chosen over them.
extern "C" __global__ void moe_route_backward(const float* __restrict__ logits, const int* __restrict__ chosen,
                                              const float* __restrict__ weights, const float* __restrict__ d_weights,
                                              long long rows, int experts, int top_k, int norm_topk_prob,
                                              float* __restrict__ d_logits) {
    __shared__ unsigned long long largest, c_largest, total, c_total;
    __shared__ unsigned int flags, term_flags;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* z = logits + row * (long long)experts;
        const int* top = chosen + row * (long long)top_k;
        const float* w = weights + row * (long long)top_k;
        const float* g = d_weights + row * (long long)top_k;
        float* out = d_logits + row * (long long)experts;
        if (threadIdx.x == 0) { largest = 0ull; c_largest = 0ull; total = 0ull; c_total = 0ull; flags = 0u; term_flags = 0u; }
        __syncthreads();
        unsigned long long local_key = 0ull, local_c = 0ull;
        unsigned int local_flags = 0u, local_terms = 0u;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            const float v = z[e];
            if (v != v) {
                local_flags |= RLP_MOE_LOGIT_NAN;
            } else {
                const unsigned long long key = rlp_moe_key(v, e);
                local_key = key > local_key ? key : local_key;
            }
        }
        for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
            const float gj = g[j];
            if (gj != 0.0f) local_flags |= RLP_MOE_G_NONZERO;
            if (!(gj - gj == 0.0f)) local_flags |= RLP_MOE_G_NONFINITE;
            rlp_moe_note_term((double)gj * (double)w[j], &local_c, &local_terms);
        }
        rlp_block_max_u64(&largest, local_key);
        rlp_block_max_u64(&c_largest, local_c);
        rlp_block_or_u32(&flags, local_flags);
        rlp_block_or_u32(&term_flags, local_terms);
        __syncthreads();
        const unsigned int f = flags;
        const float m = rlp_moe_logit(largest);
        const bool undefined = (f & RLP_MOE_LOGIT_NAN) || !(m - m == 0.0f);
        if (!(f & RLP_MOE_G_NONZERO) || undefined || (f & RLP_MOE_G_NONFINITE)) {  // block-uniform
            const float fill = (f & RLP_MOE_G_NONZERO) ? rlp_canonical_nan() : 0.0f;
            for (int e = threadIdx.x; e < experts; e += blockDim.x) out[e] = fill;
            __syncthreads();  // the shared words are read before the next row resets them
            continue;
        }
        const int ce = rlp_exponent_f64(c_largest);
        long long local_sum = 0, local_csum = 0;
        if (norm_topk_prob) {
            for (int j = threadIdx.x; j < top_k; j += blockDim.x)
                local_sum += rlp_double2ll_rn((double)rlp_exp_f32(z[top[j]] - m) * rlp_pow2_f64(RLP_MOE_SUM_SHIFT));
        } else {
            for (int e = threadIdx.x; e < experts; e += blockDim.x)
                local_sum += rlp_double2ll_rn((double)rlp_exp_f32(z[e] - m) * rlp_pow2_f64(RLP_MOE_SUM_SHIFT));
        }
        const unsigned int tf = term_flags;
        if (tf == 0u)
            for (int j = threadIdx.x; j < top_k; j += blockDim.x)
                local_csum += rlp_moe_grid_term((double)g[j] * (double)w[j], ce);
        rlp_block_sum_i64(&total, local_sum);
        rlp_block_sum_i64(&c_total, local_csum);
        __syncthreads();
        const double denominator = rlp_round_to_odd_f64((long long)total) * rlp_pow2_f64(-RLP_MOE_SUM_SHIFT);
        double c;
        if (tf == 0u) c = (double)(long long)c_total * rlp_pow2_f64(ce - RLP_MOE_COMBINE_SHIFT);
        else if ((tf & RLP_MOE_TERM_NAN) || (tf & (RLP_MOE_TERM_POS | RLP_MOE_TERM_NEG)) == (RLP_MOE_TERM_POS | RLP_MOE_TERM_NEG))
            c = (double)rlp_canonical_nan();
        else c = (double)__int_as_float((tf & RLP_MOE_TERM_POS) ? 0x7f800000 : (int)0xff800000u);
        unsigned int local_nan = 0u;
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            float v = 0.0f;  // an unchosen expert under norm_topk_prob
            if (!norm_topk_prob) {
                const double q = (double)rlp_exp_f32(z[e] - m) / denominator;
                v = rlp_double2float_rn(q * (0.0 - c));
            }
            if (v != v) local_nan = 1u;
            out[e] = v;
        }
        __syncthreads();  // pass 1's writes are seen before pass 2 overwrites the chosen
        for (int j = threadIdx.x; j < top_k; j += blockDim.x) {
            const int e = top[j];
            const double q = (double)rlp_exp_f32(z[e] - m) / denominator;
            const float v = rlp_double2float_rn(q * ((double)g[j] - c));
            if (v != v) local_nan = 1u;
            out[e] = v;
        }
        rlp_block_or_u32(&flags, local_nan ? RLP_MOE_RESULT_NAN : 0u);
        __syncthreads();
        if (flags & RLP_MOE_RESULT_NAN)  // block-uniform
            for (int e = threadIdx.x; e < experts; e += blockDim.x) out[e] = rlp_canonical_nan();
        __syncthreads();  // the shared words are read before the next row resets them
    }
}
