// Kernel family "attention": exact causal GQA attention over the encoded (fixed-point) KV cache.
// Contract: contracts/attention.toml. Reference: rlportable/contract/attention.py
// (attention, attention_encoded). Line-by-line port of backends/cuda/attention.cu.
//
// Every reduction here is exact: the scores' dot products and the sums L and N_d are
// int64 sums, the maxima (m, E, the q row's exponent) are integer maxima, all combined
// with shared-memory atomics. So the bits depend on nothing but the query row and the
// keys 0..t of its sequence: not on the thread count, the grid, the warp width (64 on
// CDNA, 32 under the HIP-on-CUDA prelude), or on whether a score was kept in shared
// memory or computed again.
#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
#include "contract_math.h"

// Contraction off even where a compiler's default would fuse; the build options say the same.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#define RLP_ATT_Q_BITS 23
#define RLP_ATT_KV_BITS 15
#define RLP_ATT_KV_SLICES 2
#define RLP_ATT_SCORE_SHIFT 34  // (Q_BITS - 2) + (KV_BITS - 2)
#define RLP_ATT_P_SHIFT 21      // P_BITS - 2: p is counted in units of 2^-21
#define RLP_ATT_V_SHIFT 13      // KV_BITS - 2
#define RLP_ATT_MAX_HEAD_DIM 512
#define RLP_ATT_MAX_THREADS 1024
#define RLP_ATT_SCORE_CACHE 4096  // scores of keys below this are kept for pass 2, later ones recomputed
#define RLP_ATT_EV_OFFSET 1024    // ev + offset > 0 for every finite exponent (>= -149)
#define RLP_ATT_BAD_KV 1u
#define RLP_ATT_BAD_INDEX 2u

// The slot of (sequence seq, position j): block_tables[seq, j / block_size] * block_size
// + j % block_size; -1 when the tables or the cache do not hold it.
__device__ __forceinline__ long long rlp_att_slot(const int* __restrict__ block_tables, int max_blocks,
                                                  int block_size, long long num_slots, int seq, int j) {
    int b = j / block_size;
    if (b >= max_blocks) return -1;
    int block = block_tables[(long long)seq * max_blocks + b];
    if (block < 0) return -1;
    long long slot = (long long)block * block_size + (j - b * block_size);
    return slot < num_slots ? slot : -1;
}

// S = sum_d qq[d] * (d0[d] + 256 d1[d]), exact in int64. row points at the key's digit 0
// (Dp bytes) followed by its digit 1 (Dp bytes); Dp is a multiple of 64 and rows start on
// 64-byte boundaries, so 8 digits are read at a time. Digits at d >= D are 0, qq too.
__device__ __forceinline__ long long rlp_att_dot(const int* qq, const signed char* __restrict__ row, int d,
                                                 int dp) {
    const long long* lo = (const long long*)row;
    const long long* hi = (const long long*)(row + dp);
    const int chunks = (d + 7) / 8;
    long long s = 0;
    for (int c = 0; c < chunks; ++c) {
        long long a = lo[c];
        long long b = hi[c];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            int digit0 = (int)(signed char)(a >> (8 * i));
            int digit1 = (int)(signed char)(b >> (8 * i));
            s += (long long)qq[8 * c + i] * (digit0 + 256 * digit1);
        }
    }
    return s;
}

// s = RNE_f32((float64(S) * 2^(eq + ek - 34)) * scale): S is exact in float64 (|S| < 2^53),
// the power of two is exact, the multiply by scale = 1/sqrt(D) (computed on the host in
// float64, IEEE) rounds once to float64, the conversion once to float32.
__device__ __forceinline__ float rlp_att_score(long long s, int eq, int ek, double scale) {
    return rlp_double2float_rn((rlp_ll2double_rn(s) * rlp_pow2_f64(eq + ek - RLP_ATT_SCORE_SHIFT)) * scale);
}

// A float32's bits mapped to an unsigned key with the same order (-inf < ... < -0 < +0 < ... < +inf),
// so the maximum score is an integer atomicMax.
__device__ __forceinline__ unsigned int rlp_att_order_key(float x) {
    unsigned int bits = (unsigned int)__float_as_int(x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float rlp_att_from_order_key(unsigned int key) {
    return __int_as_float((int)((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key));
}

// One block per (query token, head), grid-stride. Pass 1 (threads over keys j = 0..t):
// the exact integer dot product S_j, the score s_j, the maxima m (of s_j) and E (of ev_j),
// and flags for non-finite key/value rows and indices outside the tables. Pass 2 (keys in
// chunks of blockDim): p_j = exp_f32(s_j - m), L += RNE(p_j 2^21), the weights
// w_j = RNE(p_j 2^(ev_j - E + 21)) in shared memory; then threads over (key part, d) add
// w_j * qv_jd into N_d with int64 atomics. Finally o_d = RNE_f32((N_d 2^(E-13)) / L).
// q, out: [tq, hq, d] float32; digits: [num_slots, hkv, 2, dp] int8; exponents: [num_slots, hkv].
extern "C" __global__ void attention_paged(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,
    int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ out) {
    __shared__ int qq[RLP_ATT_MAX_HEAD_DIM];
    __shared__ unsigned long long numerator[RLP_ATT_MAX_HEAD_DIM];
    __shared__ float scores[RLP_ATT_SCORE_CACHE];
    __shared__ int weights[RLP_ATT_MAX_THREADS];
    __shared__ long long value_rows[RLP_ATT_MAX_THREADS];
    __shared__ unsigned int largest;
    __shared__ unsigned int max_key;
    __shared__ unsigned int max_ev;
    __shared__ unsigned int flags;
    __shared__ unsigned long long total;
    const int group = hq / hkv;
    const long long items = tq * hq;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long token = item / hq;
        const int h = (int)(item - token * hq);
        const int g = h / group;
        const float* qr = q + item * (long long)d;
        float* orow = out + item * (long long)d;
        const int seq = q_seq[token];
        const int t = q_pos[token];
        if (threadIdx.x == 0) { largest = 0u; max_key = 0u; max_ev = 0u; flags = 0u; total = 0ull; }
        for (int i = threadIdx.x; i < d; i += blockDim.x) numerator[i] = 0ull;
        __syncthreads();
        unsigned int local = 0u;
        for (int i = threadIdx.x; i < d; i += blockDim.x) local = rlp_max_u32(local, rlp_magnitude_bits(qr[i]));
        atomicMax(&largest, local);
        __syncthreads();
        const int eq = rlp_row_exponent(largest);
        // block-uniform: a non-finite q row, or a query with no keys in the tables
        const bool poisoned_query = eq == RLP_NONFINITE_EXPONENT || seq < 0 || seq >= num_seqs || t < 0;
        if (!poisoned_query) {
            for (int i = threadIdx.x; i < dp; i += blockDim.x)
                qq[i] = i < d ? (int)rlp_quantize(qr[i], RLP_ATT_Q_BITS, eq) : 0;
            __syncthreads();
            // ---- pass 1: scores, m, E, flags
            unsigned int local_key = 0u;
            unsigned int local_ev = 0u;
            unsigned int local_flags = 0u;
            for (int j = threadIdx.x; j <= t; j += blockDim.x) {
                long long slot = rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, j);
                if (slot < 0) { local_flags |= RLP_ATT_BAD_INDEX; continue; }
                long long row = slot * hkv + g;
                int ek = k_exponents[row];
                int ev = v_exponents[row];
                if (ek == RLP_NONFINITE_EXPONENT || ev == RLP_NONFINITE_EXPONENT) { local_flags |= RLP_ATT_BAD_KV; continue; }
                float s = rlp_att_score(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp), eq, ek, scale);
                if (j < RLP_ATT_SCORE_CACHE) scores[j] = s;
                local_key = rlp_max_u32(local_key, rlp_att_order_key(s));
                local_ev = rlp_max_u32(local_ev, (unsigned int)(ev + RLP_ATT_EV_OFFSET));
            }
            atomicMax(&max_key, local_key);
            atomicMax(&max_ev, local_ev);
            atomicOr(&flags, local_flags);
            __syncthreads();
            const float m = rlp_att_from_order_key(max_key);
            const int e_max = (int)max_ev - RLP_ATT_EV_OFFSET;
            // block-uniform: a non-finite key/value row among 0..t, a missing slot, or m = +-inf
            // (a score overflowed float32: the reference's exp argument is then inf - inf, a NaN)
            const bool poisoned_keys = flags != 0u || (rlp_magnitude_bits(m) >= 0x7f800000u);
            if (!poisoned_keys) {
                // ---- pass 2: p, L, weights, N
                const int parts = (int)blockDim.x >= d ? (int)blockDim.x / d : 1;
                long long local_total = 0;
                for (int base = 0; base <= t; base += blockDim.x) {
                    const int j = base + (int)threadIdx.x;
                    const int count = t + 1 - base < (int)blockDim.x ? t + 1 - base : (int)blockDim.x;
                    if (j <= t) {
                        long long row = rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, j) * hkv + g;
                        float s = j < RLP_ATT_SCORE_CACHE
                                      ? scores[j]
                                      : rlp_att_score(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp), eq,
                                                      k_exponents[row], scale);
                        double p = (double)rlp_exp_f32(s - m);
                        local_total += rlp_double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                        weights[threadIdx.x] =
                            (int)rlp_double2ll_rn(p * rlp_pow2_f64(v_exponents[row] - e_max + RLP_ATT_P_SHIFT));
                        value_rows[threadIdx.x] = row * (2LL * dp);
                    }
                    __syncthreads();
                    for (int work = threadIdx.x; work < parts * d; work += blockDim.x) {
                        const int part = work / d;
                        const int i = work - part * d;
                        long long acc = 0;
                        for (int c = part; c < count; c += parts) {
                            const signed char* vr = v_digits + value_rows[c];
                            acc += (long long)weights[c] * ((int)vr[i] + 256 * (int)vr[dp + i]);
                        }
                        if (acc != 0) atomicAdd(&numerator[i], (unsigned long long)acc);
                    }
                    __syncthreads();
                }
                atomicAdd(&total, (unsigned long long)local_total);
                __syncthreads();
                const double denominator = rlp_ll2double_rn((long long)total);  // exact: L < 2^53
                const double unit = rlp_pow2_f64(e_max - RLP_ATT_V_SHIFT);
                for (int i = threadIdx.x; i < d; i += blockDim.x)
                    orow[i] = rlp_double2float_rn((rlp_ll2double_rn((long long)numerator[i]) * unit) / denominator);
            } else {
                for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = rlp_canonical_nan();
            }
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = rlp_canonical_nan();
        }
        __syncthreads();
    }
}

// Encode new key and value rows into cache slots (contracts/fixedpoint.toml with bits = 15,
// 2 ascending digits: the rows fixedpoint_encode_rows writes). k, v: [tokens, hkv, d] float32;
// slots: [tokens] int32; a slot outside [0, num_slots) writes nothing. One block per
// (K or V, token, kv head), grid-stride; the row exponent is an exact integer max.
extern "C" __global__ void attention_write_kv(
    const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots, long long tokens,
    int hkv, int d, int dp, long long num_slots, signed char* __restrict__ k_digits, int* __restrict__ k_exponents,
    signed char* __restrict__ v_digits, int* __restrict__ v_exponents) {
    __shared__ unsigned int largest;
    __shared__ int exponent;
    const long long rows = tokens * hkv;
    for (long long item = blockIdx.x; item < 2 * rows; item += gridDim.x) {
        const bool is_value = item >= rows;
        const long long r = is_value ? item - rows : item;
        const long long token = r / hkv;
        const long long slot = slots[token];
        if (slot < 0 || slot >= num_slots) continue;  // block-uniform: no shared memory touched
        const long long cache_row = slot * hkv + (r - token * hkv);
        const float* xr = (is_value ? v : k) + r * (long long)d;
        signed char* out = (is_value ? v_digits : k_digits) + cache_row * (2LL * dp);
        if (threadIdx.x == 0) largest = 0u;
        __syncthreads();
        unsigned int local = 0u;
        for (int i = threadIdx.x; i < d; i += blockDim.x) local = rlp_max_u32(local, rlp_magnitude_bits(xr[i]));
        atomicMax(&largest, local);
        __syncthreads();
        if (threadIdx.x == 0) {
            exponent = rlp_row_exponent(largest);
            (is_value ? v_exponents : k_exponents)[cache_row] = exponent;
        }
        __syncthreads();
        const int e = exponent;
        for (int i = threadIdx.x; i < dp; i += blockDim.x) {
            long long qv = (i < d && e != RLP_NONFINITE_EXPONENT) ? rlp_quantize(xr[i], RLP_ATT_KV_BITS, e) : 0;
            for (int j = 0; j < RLP_ATT_KV_SLICES; ++j) {
                long long digit = ((qv + 128) & 255) - 128;
                qv = (qv - digit) >> 8;
                out[(long long)j * dp + i] = (signed char)digit;
            }
        }
        __syncthreads();
    }
}
