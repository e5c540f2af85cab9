#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "logprob": log-probabilities and entropy of logits at a temperature, and the
// log-probabilities' gradient with respect to the logits.
// Contract: contracts/logprob.toml. Reference: rlportable/contract/logprob.py (logprobs,
// entropy, quantize_f64_rows, logprobs_backward, shard_max_keys, shard_sums, shard_finish).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA).
#include "common.h"
#include "contract_math.h"

#define RLP_LOGPROB_WANT_LOGP 1
#define RLP_LOGPROB_WANT_ENTROPY 2

__device__ __forceinline__ unsigned long long rlp_logprob_max_u64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

// a_v = RNE_f32(double(z_v) / double(T)) (IEEE float64 division). T = 1 gives z exactly, so it skips the
// division (the one difference, a signalling NaN left unquieted, only ever feeds a canonical-NaN result).
__device__ __forceinline__ float rlp_logprob_scaled(float z, double temperature) {
    return temperature == 1.0 ? z : rlp_double2float_rn((double)z / temperature);
}

// The NaN marker of a shard's key: above every float's key, so MAX over the ranks keeps it.
#define RLP_LOGPROB_NAN_KEY 0xffffffffu

// A shard's element key: rlp_logprob_key(a), or the NaN marker for a NaN a.
__device__ __forceinline__ unsigned int rlp_logprob_key_or_nan(float a) {
    return a != a ? RLP_LOGPROB_NAN_KEY : rlp_logprob_key(a);
}

// A row whose maximum m is NaN (a shard's NaN marker) or +-inf has no log-prob: the canonical NaN.
__device__ __forceinline__ bool rlp_logprob_undefined(float m) {
    return rlp_magnitude_bits(m) >= 0x7f800000u;
}

// w_v = p_v * d_v, exact in float64 (24 x 24 bits); 0 where p_v = 0 (also where d_v = -inf).
__device__ __forceinline__ double rlp_logprob_term(float p, float d) {
    return p == 0.0f ? 0.0 : (double)p * (double)d;
}

// One block per row (grid-stride over rows); every row-wide result (max, NaN flag, the
// exact int64 sums, the largest |w|) is combined by common's rlp_block_* (segments of 32 lanes,
// then one shared-memory atomic per segment): exact and order-free, whatever the block size
// (a multiple of 32, every thread calling) or warp width. mode: RLP_LOGPROB_WANT_LOGP writes
// logp[row] (targets read), RLP_LOGPROB_WANT_ENTROPY writes entropy[row]; an output not
// asked for is never touched. The host checked 1 <= vocab <= 2^25 and 0 <= targets < vocab.
//   pass 1: a_v, m = max a_v (integer key), any NaN;
//   pass 2: d_v = a_v - m (float32), p_v = exp_f32(d_v), S = sum RNE(p_v 2^36), max |w_v|;
//   ls = log_f32(RNE_f32(S 2^-36)); logp = (a_y - m) - ls;
//   pass 3 (entropy): W = sum RNE(w_v 2^(36-e)), e = ilogb(max |w_v|) (exp_f32 recomputed);
//   entropy = ls - RNE_f32((odd(W) 2^(e-36)) / (odd(S) 2^-36)).
// A row with a NaN a_v, or whose maximum is +-inf, gives the canonical NaN.
extern "C" __global__ void logprob_rows(const float* __restrict__ logits, const int* __restrict__ targets,
                                        long long rows, int vocab, double temperature, int mode,
                                        float* __restrict__ logp, float* __restrict__ entropy) {
    __shared__ unsigned int largest_key;
    __shared__ unsigned int has_nan;
    __shared__ unsigned long long total;
    __shared__ unsigned long long largest_w;
    __shared__ unsigned long long w_total;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* zr = logits + row * (long long)vocab;
        if (threadIdx.x == 0) { largest_key = 0u; has_nan = 0u; total = 0ull; largest_w = 0ull; w_total = 0ull; }
        __syncthreads();
        unsigned int local_key = 0u;
        unsigned int nan = 0u;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float a = rlp_logprob_scaled(zr[i], temperature);
            if (a != a) nan = 1u;
            else local_key = rlp_max_u32(local_key, rlp_logprob_key(a));
        }
        rlp_block_max_u32(&largest_key, local_key);
        rlp_block_or_u32(&has_nan, nan);
        __syncthreads();
        const float m = rlp_logprob_from_key(largest_key);
        if (has_nan != 0u || rlp_logprob_undefined(m)) {
            if (threadIdx.x == 0) {
                if (mode & RLP_LOGPROB_WANT_LOGP) logp[row] = rlp_canonical_nan();
                if (mode & RLP_LOGPROB_WANT_ENTROPY) entropy[row] = rlp_canonical_nan();
            }
        } else {
            long long local_s = 0;
            unsigned long long local_w = 0ull;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float d = rlp_logprob_scaled(zr[i], temperature) - m;
                float p = rlp_exp_f32(d);
                local_s += rlp_logprob_sum_term(p);
                if (mode & RLP_LOGPROB_WANT_ENTROPY) {
                    double w = rlp_logprob_term(p, d);
                    local_w = rlp_logprob_max_u64(local_w, (unsigned long long)__double_as_longlong(w) & 0x7fffffffffffffffull);
                }
            }
            rlp_block_sum_i64(&total, local_s);
            rlp_block_max_u64(&largest_w, local_w);
            __syncthreads();
            const long long s = (long long)total;
            const float ls = rlp_logprob_log_sum(s);
            if ((mode & RLP_LOGPROB_WANT_LOGP) && threadIdx.x == 0) {
                float d_target = rlp_logprob_scaled(zr[targets[row]], temperature) - m;
                logp[row] = rlp_logprob_value(d_target, ls);
            }
            if (mode & RLP_LOGPROB_WANT_ENTROPY) {
                const int e = rlp_exponent_f64(largest_w);
                const int shift = (RLP_LOGPROB_SUM_BITS - 2) - e;
                const int half = shift >> 1;  // floor(shift / 2): a power of two beyond range in two exact steps
                const double scale_hi = rlp_pow2_f64(half);
                const double scale_lo = rlp_pow2_f64(shift - half);
                long long local_q = 0;
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                    float d = rlp_logprob_scaled(zr[i], temperature) - m;
                    double w = rlp_logprob_term(rlp_exp_f32(d), d);
                    local_q += rlp_double2ll_rn((w * scale_hi) * scale_lo);
                }
                rlp_block_sum_i64(&w_total, local_q);
                __syncthreads();
                if (threadIdx.x == 0) {
                    double w_sum = rlp_round_to_odd_f64((long long)w_total) * rlp_pow2_f64(e - (RLP_LOGPROB_SUM_BITS - 2));
                    double s_val = rlp_round_to_odd_f64(s) * rlp_pow2_f64(-(RLP_LOGPROB_SUM_BITS - 2));
                    float mean = rlp_double2float_rn(w_sum / s_val);
                    entropy[row] = ls - mean;
                }
            }
        }
        __syncthreads();
    }
}

// logprobs_backward's element: q = p / S' (IEEE float64 division), c = -q (exact) or 1 - q at
// the target, dz = RNE_f32(scale * c) with scale = g / T: one float64 product, one conversion.
__device__ __forceinline__ float rlp_logprob_grad_element(float p, bool is_target, double s_val, double scale) {
    const double q = (double)p / s_val;
    const double c = is_target ? 1.0 - q : -q;
    return rlp_double2float_rn(scale * c);
}

// The gradient of grad[row] * logp[row] with respect to logits[row, :] (logprobs_backward).
// One block per row (grid-stride over rows); the max, the NaN flag and the exact sum S are
// computed as in logprob_rows (rlp_block_*: any block size that is a multiple of 32, any warp
// width gives the same bits). The host checked 1 <= vocab <= 2^25 and 0 <= targets < vocab.
//   g = +-0: +0 everywhere, the logits are not read (masked tokens);
//   g non-finite: the canonical NaN everywhere;
//   pass 1: a_v, m = max a_v (integer key), any NaN; a NaN or m = +-inf: the canonical NaN everywhere;
//   pass 2: S = sum RNE(exp_f32(a_v - m) 2^36), exact int64; S' = odd(S) 2^-36;
//   pass 3: dz_v = RNE_f32((g / T) * c_v), c_v = -p_v / S' or 1 - p_y / S' (exp_f32 recomputed).
extern "C" __global__ void logprob_backward_rows(const float* __restrict__ logits, const int* __restrict__ targets,
                                                 const float* __restrict__ grad, long long rows, int vocab,
                                                 double temperature, float* __restrict__ dlogits) {
    __shared__ unsigned int largest_key;
    __shared__ unsigned int has_nan;
    __shared__ unsigned long long total;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* zr = logits + row * (long long)vocab;
        float* dz = dlogits + row * (long long)vocab;
        const float g = grad[row];  // the same for every thread: every branch below is block-uniform
        if (g == 0.0f) {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) dz[i] = 0.0f;
        } else if (rlp_magnitude_bits(g) >= 0x7f800000u) {
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) dz[i] = rlp_canonical_nan();
        } else {
            if (threadIdx.x == 0) { largest_key = 0u; has_nan = 0u; total = 0ull; }
            __syncthreads();
            unsigned int local_key = 0u;
            unsigned int nan = 0u;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                float a = rlp_logprob_scaled(zr[i], temperature);
                if (a != a) nan = 1u;
                else local_key = rlp_max_u32(local_key, rlp_logprob_key(a));
            }
            rlp_block_max_u32(&largest_key, local_key);
            rlp_block_or_u32(&has_nan, nan);
            __syncthreads();
            const float m = rlp_logprob_from_key(largest_key);
            if (has_nan != 0u || rlp_logprob_undefined(m)) {
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) dz[i] = rlp_canonical_nan();
            } else {
                long long local_s = 0;
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                    float p = rlp_exp_f32(rlp_logprob_scaled(zr[i], temperature) - m);
                    local_s += rlp_logprob_sum_term(p);
                }
                rlp_block_sum_i64(&total, local_s);
                __syncthreads();
                const double s_val = rlp_round_to_odd_f64((long long)total) * rlp_pow2_f64(-(RLP_LOGPROB_SUM_BITS - 2));
                const double scale = (double)g / temperature;
                const int target = targets[row];
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                    float p = rlp_exp_f32(rlp_logprob_scaled(zr[i], temperature) - m);
                    dz[i] = rlp_logprob_grad_element(p, i == target, s_val, scale);
                }
            }
        }
        __syncthreads();  // every thread is done with this row's shared values before the next row resets them
    }
}

// ---- Vocabulary-parallel log-probs (tensor parallelism). A rank holds the columns
// [vocab_start, vocab_start + width) of every row. logprob_shard_max gives each row's key;
// the ranks all-reduce MAX of the keys; logprob_shard_sums gives each row's int64 pair; the
// ranks all-reduce SUM of the pairs; logprob_shard_finish gives logprob_rows' bits. The
// helpers above are logprob_rows' own, so both paths share one formula.

// keys[row] = max over the shard of rlp_logprob_key_or_nan(a_v): the key of the shard's
// maximum, or the NaN marker. One block per row (grid-stride); rlp_block_max_u32, exact and
// order-free at any block size (a multiple of 32) or warp width. The host checked width >= 1.
extern "C" __global__ void logprob_shard_max(const float* __restrict__ logits, long long rows, int width,
                                             double temperature, unsigned int* __restrict__ keys) {
    __shared__ unsigned int largest_key;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* zr = logits + row * (long long)width;
        if (threadIdx.x == 0) largest_key = 0u;
        __syncthreads();
        unsigned int local_key = 0u;
        for (int i = threadIdx.x; i < width; i += blockDim.x) {
            local_key = rlp_max_u32(local_key, rlp_logprob_key_or_nan(rlp_logprob_scaled(zr[i], temperature)));
        }
        rlp_block_max_u32(&largest_key, local_key);
        __syncthreads();
        if (threadIdx.x == 0) keys[row] = largest_key;
        __syncthreads();  // thread 0 has read largest_key before the next row resets it
    }
}

// sums[row] = (sum over the shard of RNE(exp_f32(a_v - m) 2^36), the bits of a_y - m zero-extended
// when the global target y lies in [vocab_start, vocab_start + width), else 0), m = the float of
// keys[row] (the MAX over every rank); a row whose m is NaN or +-inf writes (0, 0). One block per
// row (grid-stride); the sum through rlp_block_sum_i64, exact and order-free.
extern "C" __global__ void logprob_shard_sums(const float* __restrict__ logits, const unsigned int* __restrict__ keys,
                                              const int* __restrict__ targets, long long rows, int width,
                                              int vocab_start, double temperature, long long* __restrict__ sums) {
    __shared__ unsigned long long total;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* zr = logits + row * (long long)width;
        const float m = rlp_logprob_from_key(keys[row]);  // the same for every thread: the branch is block-uniform
        if (rlp_logprob_undefined(m)) {
            if (threadIdx.x == 0) { sums[2 * row] = 0; sums[2 * row + 1] = 0; }
        } else {
            if (threadIdx.x == 0) total = 0ull;
            __syncthreads();
            long long local_s = 0;
            for (int i = threadIdx.x; i < width; i += blockDim.x) {
                local_s += rlp_logprob_sum_term(rlp_exp_f32(rlp_logprob_scaled(zr[i], temperature) - m));
            }
            rlp_block_sum_i64(&total, local_s);
            __syncthreads();
            if (threadIdx.x == 0) {
                const long long local_target = (long long)targets[row] - (long long)vocab_start;
                unsigned int d_bits = 0u;
                if (local_target >= 0 && local_target < (long long)width) {
                    d_bits = (unsigned int)__float_as_int(rlp_logprob_scaled(zr[local_target], temperature) - m);
                }
                sums[2 * row] = (long long)total;
                sums[2 * row + 1] = (long long)d_bits;
            }
        }
        __syncthreads();  // thread 0 has read total before the next row resets it
    }
}

// logp[row] = rlp_logprob_value(d_y, rlp_logprob_log_sum(S)) from sums[row] = (S, the bits of d_y) (the SUM
// over the ranks of logprob_shard_sums), the canonical NaN where the float of keys[row] is NaN or +-inf.
// One thread per row (grid-stride).
extern "C" __global__ void logprob_shard_finish(const long long* __restrict__ sums, const unsigned int* __restrict__ keys,
                                                long long rows, float* __restrict__ logp) {
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x; row < rows; row += stride) {
        if (rlp_logprob_undefined(rlp_logprob_from_key(keys[row]))) {
            logp[row] = rlp_canonical_nan();
        } else {
            const float d_target = __int_as_float((int)(unsigned int)(unsigned long long)sums[2 * row + 1]);
            logp[row] = rlp_logprob_value(d_target, rlp_logprob_log_sum(sums[2 * row]));
        }
    }
}
