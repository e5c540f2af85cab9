// Kernel family "attention": exact causal GQA attention over the encoded (fixed-point) KV cache.
// Contract: contracts/attention.toml. Reference: rlportable/contract/attention.py
// (attention, attention_encoded). One source for both vendors; backends/cuda/attention.cu adds
// NVIDIA's tensor-core fast paths to it.
//
// Every reduction here is exact: the scores' dot products and the sums L and N_d are
// int64 sums, the maxima (m, E, the q row's exponent) are integer maxima, all combined
// with shared-memory atomics. So the bits depend on nothing but the query row and the
// keys 0..t of its sequence: not on the thread count, the grid, the warp width (64 on
// CDNA and HIP-CPU, 32 on NVIDIA), or on whether a score was kept in shared
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
#define RLP_ATT_KV_BITS RLP_KV_BITS  // the cache's encoding (common: RLP_KV_BITS, RLP_KV_SLICES)
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
// o_d = RNE_f32((N_d 2^(E - 13)) / L): the float64 product is exact (a power of two), then one IEEE
// divide and one conversion. L < 2^53 and |N_d| < 2^53 convert exactly.
__device__ __forceinline__ float rlp_att_output(long long numerator, int e_max, long long total) {
    return rlp_double2float_rn((rlp_ll2double_rn(numerator) * rlp_pow2_f64(e_max - RLP_ATT_V_SHIFT)) /
                               rlp_ll2double_rn(total));
}

__device__ __forceinline__ unsigned int rlp_att_order_key(float x) {
    unsigned int bits = (unsigned int)__float_as_int(x);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float rlp_att_from_order_key(unsigned int key) {
    return __int_as_float((int)((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key));
}

// Key j of a tile of the tensor-core forwards (backends/cuda's mma, backends/hip's MFMA): its cache row
// (slot * hkv + g; -1 past `last` or for a missing slot), exponents (0 for a flagged key) and flag
// (RLP_ATT_BAD_INDEX: a slot outside the tables; RLP_ATT_BAD_KV: a non-finite K or V row).
__device__ __forceinline__ void rlp_att_tile_key(const int* __restrict__ block_tables, int max_blocks, int block_size,
                                                 long long num_slots, int seq, int j, int last, int hkv, int g,
                                                 const int* __restrict__ k_exponents,
                                                 const int* __restrict__ v_exponents, long long& row, int& ek,
                                                 int& ev, int& flag) {
    row = -1;
    flag = 0;
    ek = 0;
    ev = 0;
    if (j <= last) {
        const long long slot = rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, j);
        if (slot < 0) {
            flag = RLP_ATT_BAD_INDEX;
        } else {
            row = slot * hkv + g;
            ek = k_exponents[row];
            ev = v_exponents[row];
            if (ek == RLP_NONFINITE_EXPONENT || ev == RLP_NONFINITE_EXPONENT) { flag = RLP_ATT_BAD_KV; ek = 0; ev = 0; }
        }
    }
}

// A poisoned row's statistics: 0 and 0 (the backward marks the row from its NaN o, as the mma forward).
__device__ __forceinline__ void rlp_att_zero_stats(double* row_stats, long long item) {
    if (row_stats != nullptr && threadIdx.x == 0) {
        row_stats[3 * item] = 0.0;
        row_stats[3 * item + 1] = 0.0;
    }
}

// One block per (query token, head), grid-stride. Pass 1 (threads over keys j = 0..t):
// the exact integer dot product S_j, the score s_j, the maxima m (of s_j) and E (of ev_j),
// and flags for non-finite key/value rows and indices outside the tables. Pass 2 (keys in
// chunks of blockDim): p_j = exp_f32(s_j - m), L += RNE(p_j 2^21), the weights
// w_j = RNE(p_j 2^(ev_j - E + 21)) in shared memory; then threads over (key part, d) add
// w_j * qv_jd into N_d with int64 atomics. Finally o_d = RNE_f32((N_d 2^(E-13)) / L).
// q, out: [tq, hq, d] float32; digits: [num_slots, hkv, 2, dp] int8; exponents: [num_slots, hkv].
// row_stats: null, or float64 [tq * hq, 3] whose first two columns receive m and L (the backward's).
extern "C" __global__ void attention_paged(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,
    int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats) {
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
                for (int i = threadIdx.x; i < d; i += blockDim.x)
                    orow[i] = rlp_att_output((long long)numerator[i], e_max, (long long)total);
                if (row_stats != nullptr && threadIdx.x == 0) {  // m and L for the backward
                    row_stats[3 * item] = (double)m;
                    row_stats[3 * item + 1] = rlp_ll2double_rn((long long)total);  // exact: L < 2^53
                }
            } else {
                for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = rlp_canonical_nan();
                rlp_att_zero_stats(row_stats, item);
            }
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = rlp_canonical_nan();
            rlp_att_zero_stats(row_stats, item);
        }
        __syncthreads();
    }
}

// Encode new key and value rows into cache slots (contracts/fixedpoint.toml with bits = 15,
// 2 ascending digits: the rows fixedpoint_encode_rows writes). k, v: [tokens, hkv, d] float32;
// slots: [tokens] int32; a slot outside [0, num_slots) writes nothing. One segment of 32 lanes per
// (K or V, token, kv head) row, grid-stride (the rows are many and short: no shared memory, no
// barrier); the row exponent is an exact integer max (common's rlp_segment_row_exponent).
extern "C" __global__ void attention_write_kv(
    const float* __restrict__ k, const float* __restrict__ v, const int* __restrict__ slots, long long tokens,
    int hkv, int d, int dp, long long num_slots, signed char* __restrict__ k_digits, int* __restrict__ k_exponents,
    signed char* __restrict__ v_digits, int* __restrict__ v_exponents) {
    const long long rows = tokens * hkv;
    for (long long item = rlp_segment_first_row(); item < 2 * rows; item += rlp_segment_row_stride()) {
        const bool is_value = item >= rows;
        const long long r = is_value ? item - rows : item;
        const long long token = r / hkv;
        const long long slot = slots[token];
        if (slot < 0 || slot >= num_slots) continue;  // segment-uniform
        const long long cache_row = slot * hkv + (r - token * hkv);
        rlp_segment_write_kv_row((is_value ? v : k) + r * (long long)d, d, dp,
                                 (is_value ? v_digits : k_digits) + cache_row * (2LL * dp),
                                 (is_value ? v_exponents : k_exponents) + cache_row);
    }
}

// ---------------------------------------------------------------------------
// Split-KV path ("split" in ops/attention.py): the decode-shaped kernels (no warp-width assumption: block-wide results through shared-memory atomics and
// __syncthreads only; the byte products and permutes are plain integer code). The same bits as
// attention_paged, for decode-shaped calls (few query rows per sequence). The keys of a query row
// are cut into `splits` ranges of `chunk` keys (split s: keys s chunk .. min((s + 1) chunk, t + 1) - 1);
// splits * chunk >= max_blocks * block_size, and both depend only on the launch (rows, kv heads, the
// block tables' width), never on the lengths: a captured graph replays for any lengths. A block takes
// one (query row, kv head, split) with ALL the q heads of the kv head's group, so every K and V row is
// read once per group:
//   attention_split_scores   the 23-bit q rows of the group, the scores s_j of the split's keys (to
//                            `scores`), the split's largest order key per head, largest ev and flags;
//   attention_split_values   m per head and E, flags over ALL splits (so p is formed only after the
//                            maxima are global), then p_j = exp_f32(s_j - m), and over the split's keys
//                            the partial sums of L and N_d (int64, to part_total, part_num);
//   attention_split_combine  per (query row, q head): L and N_d as exact sums of the partials, o_d as
//                            attention_paged (or the canonical NaN where attention_paged gives it).
// Every sum is an exact integer sum and every max an exact max: the bits equal attention_paged's for
// any split count, tiling or thread count. Poisoned rows are attention_paged's: a non-finite q row, an
// invalid sequence or position, a non-finite K/V row or a missing slot among keys 0..t, m = +-inf.
// Integer products (exact in every order):
//   S_j = sum_d qq_d qk_jd through int8 digit pairs (rlp_atts_dot4: c + the 4 products of signed bytes,
//   the same integer CUDA's __dp4a gives):
//   qq = a0 + 2^8 a1 + 2^16 a2 (3 balanced digits, |a2| <= 64), qk = b0 + 2^8 b1 (the cache's digits):
//   S = G0 + 2^8 G1 + 2^16 G2 + 2^24 G3, G_k the sum of a_i b_j over i + j = k, |G_k| <= 2 * 512 * 2^14
//   = 2^24: exact in int32. The threads of one key each take a 16-byte piece of both digit planes; their
//   parts of S meet through xor shuffles of int64 (exact).
//   N_d = sum_j w_j qv_jd through float64: w_j = RNE(p_j 2^(ev_j - E + 21)) is an integer <= 2^21 and
//   each value enters as (qv_jd + B) 2^-1074 with 0 <= qv_jd + B < 2^16 (rlp_atts_biased_values), so
//   every product is an integer multiple of 2^-1074 below 2^37 of them and every partial sum of at most
//   2^14 keys (ops/attention.py SPLIT_MAX_KEYS) one below 2^51: float64 holds each exactly (subnormal or
//   normal, the unit 2^-1074 is within its precision below 2^53 units), so the fused multiply-adds round
//   nothing and the sums are exact in any order. They become int64 exactly, and N_d = that sum - B W
//   with W = sum_j w_j, exact integers.
// Scratch (ops/attention.py allocates it; every element read is written first):
//   scores      float32 [tq * hkv, splits * chunk, group]  s_j of (row, kv head; key; head of the group)
//   key_rows    int64   [tq * hkv, splits * chunk]         (r_j << 16) | (ev_j + RLP_ATT_EV_OFFSET): the key's
//                                                          cache row r_j = slot * hkv + g and its ev (keys with
//                                                          finite rows)
//   split_keys  uint32  [tq * hq, splits]      largest order key of the split's scores (0: none)
//   split_info  uint32  [tq * hkv, splits]     (flags << 16) | (largest ev + RLP_ATT_EV_OFFSET) (0: none)
//   query_bad   uint32  [tq * hq]              1: a non-finite q row, or a row with no keys in the tables
//   part_total  int64   [tq * hq, splits]      sum of RNE(p_j 2^21) over the split's keys
//   part_num    int64   [tq * hq, splits, d]   sum of RNE(p_j 2^(ev_j - E + 21)) qv_jd over them
//   (part_total and part_num only with splits > 1: one split's values kernel writes o)
#define RLP_ATTS_THREADS 128     // the kernels' block size (ops/attention.py launches exactly this)
#define RLP_ATTS_SCORE_HEADS 4   // q heads per round of attention_split_scores (register sums)
#define RLP_ATTS_SCORE_PIECES 4  // 16-byte pieces of each digit plane per thread and key in attention_split_scores
#define RLP_ATTS_TILE 512        // keys per tile of attention_split_values
#define RLP_ATTS_WEIGHT_KEYS 1   // keys per thread in flight while attention_split_values forms weights
#define RLP_ATTS_VALUE_HEADS 4   // q heads per round of attention_split_values (register sums)
#define RLP_ATTS_VALUE_KEYS 8    // keys per thread in flight in attention_split_values (twice that with 2 heads)
#define RLP_ATTS_COLUMNS 4       // value columns per thread: one 4-byte load per digit plane and key
// The score and value kernels ask NVIDIA for 8 and 6 blocks per multiprocessor (RLP_LAUNCH_BOUNDS'
// second argument, chosen on the H200); on HIP the minimum is left to the compiler (its second
// __launch_bounds__ argument means waves per execution unit) until an AMD GPU can choose it.

// c + the four products of the signed bytes of a and b, exact in int32. On NVIDIA the instruction
// itself: nvcc turns the loop into dp4a but builds its operands byte by byte (about 10 more
// instructions each), which made the score pass three times the value pass's time. On AMD the vendor
// file defines RLP_ATTS_DOT4 (backends/hip/attention.hip).
__device__ __forceinline__ int rlp_atts_dot4(int a, int b, int c) {
#if defined(RLP_ATTS_DOT4)
    return RLP_ATTS_DOT4(a, b, c);
#elif defined(RLP_HIP_ON_CUDA)
    return __dp4a(a, b, c);
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
#endif
}

__device__ __forceinline__ int rlp_atts_min(int a, int b) { return a < b ? a : b; }

__device__ __forceinline__ long long rlp_atts_min_ll(long long a, long long b) { return a < b ? a : b; }

__device__ __forceinline__ int rlp_atts_word(const int4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// g[k] += sum of a_i b_j over i + j = k, 4 elements: a0, a1, a2 (3 digits) and b0, b1 (2 digits).
__device__ __forceinline__ void rlp_atts_groups4(int (&g)[4], int a0, int a1, int a2, int b0, int b1) {
    g[0] = rlp_atts_dot4(a0, b0, g[0]);
    g[1] = rlp_atts_dot4(a0, b1, rlp_atts_dot4(a1, b0, g[1]));
    g[2] = rlp_atts_dot4(a1, b1, rlp_atts_dot4(a2, b0, g[2]));
    g[3] = rlp_atts_dot4(a2, b1, g[3]);
}

// The same over 16 elements (one 16-byte piece of each digit plane).
__device__ __forceinline__ void rlp_atts_groups16(int (&g)[4], const int4& a0, const int4& a1, const int4& a2,
                                                  const int4& b0, const int4& b1) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        rlp_atts_groups4(g, rlp_atts_word(a0, i), rlp_atts_word(a1, i), rlp_atts_word(a2, i), rlp_atts_word(b0, i),
                         rlp_atts_word(b1, i));
}

// G0 + 2^8 G1 + 2^16 G2 + 2^24 G3, exact in int64.
__device__ __forceinline__ long long rlp_atts_combine(const int (&g)[4]) {
    return (((long long)g[3] * 256 + g[2]) * 256 + g[1]) * 256 + g[0];
}

// The 3 balanced int8 digits of v (|v| < 2^23, v = d0 + 2^8 d1 + 2^16 d2) to out[0], out[stride], out[2 stride].
__device__ __forceinline__ void rlp_atts_digits3(long long v, signed char* out, int stride) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
        const long long low = ((v + 128) & 255) - 128;
        v = (v - low) >> 8;
        out[k * stride] = (signed char)low;
    }
}

// Threads per key in attention_split_scores: RLP_ATTS_SCORE_PIECES 16-byte pieces of each digit plane
// each, rounded up to a power of two (<= 32: an aligned segment of either vendor's warp) so that xor
// shuffles add the parts.
__device__ __forceinline__ int rlp_atts_key_threads(int pieces) {
    int threads = 1;
    while (threads * RLP_ATTS_SCORE_PIECES < pieces) threads *= 2;
    return threads;
}

// The 4 values qv = d0 + 2^8 d1 of a V row's 4 columns (low: their d0 bytes, high: their d1 bytes) as
// (qv + RLP_ATTS_VALUE_BIAS) 2^-1074: the float64 whose bits are the integer (a subnormal, exact). With
// each byte's sign bit flipped (d + 128, unsigned), qv + bias = (d0 + 128) + 2^8 (d1 + 128): a byte
// permute packs two columns' 16 bits, and no conversion instruction or float64 add is needed.
#define RLP_ATTS_VALUE_BIAS 32896  // 128 + 2^8 128: qv + bias lies in [0, 2^16)
__device__ __forceinline__ void rlp_atts_biased_values(double (&value)[4], int low, int high) {
    const unsigned int lo = (unsigned int)low ^ 0x80808080u, hi = (unsigned int)high ^ 0x80808080u;
    const unsigned int c01 = __byte_perm(lo, hi, 0x5140u), c23 = __byte_perm(lo, hi, 0x7362u);
    value[0] = __hiloint2double(0, (int)(c01 & 0xffffu));
    value[1] = __hiloint2double(0, (int)(c01 >> 16));
    value[2] = __hiloint2double(0, (int)(c23 & 0xffffu));
    value[3] = __hiloint2double(0, (int)(c23 >> 16));
}

// N_d of head hi, column i: the key lanes' parts [lane][head][dp] added (exact integers, in int64 mod 2^64:
// the true sum lies within int64) less B W.
__device__ __forceinline__ long long rlp_atts_lane_sum(const unsigned long long* parts, int lanes, int nb, int dp,
                                                       int hi, int i, unsigned long long weight_sum) {
    unsigned long long n = 0ull;
    for (int l = 0; l < lanes; ++l) n += parts[(l * nb + hi) * dp + i];
    return (long long)(n - RLP_ATTS_VALUE_BIAS * weight_sum);
}

// An exact float64 sum of biased values' products (an integer multiple of 2^-1074 below 2^-1021) as
// that integer: two exact scalings by powers of two, then an exact conversion.
__device__ __forceinline__ long long rlp_atts_biased_integer(double sum) {
    return rlp_double2ll_rn(sum * rlp_pow2_f64(537) * rlp_pow2_f64(537));
}

// One block per (query row, kv head g, split), grid-stride; the group's q heads in rounds of
// RLP_ATTS_SCORE_HEADS. Per round: the q rows' exponents (integer maxima) and 3 balanced digits in
// shared memory; then the split's keys, each taken by an aligned set of key_threads threads (up to
// RLP_ATTS_SCORE_PIECES 16-byte pieces of each of its two digit planes each, interleaved: the set's
// loads of one step are contiguous): slot, exponents, flags, E's candidate, the digit-group
// dot products of the piece, the parts added by xor shuffles within the set; its first thread forms the
// scores and each head's largest order key. Writes split_keys, split_info, query_bad (split 0), the
// scores and key_rows (so the value pass loads each key's row and ev at once, not the slot and then
// the exponent).
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 8) attention_split_scores(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,
    int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const int* __restrict__ v_exponents, int splits, int chunk,
    float* __restrict__ scores, long long* __restrict__ key_rows, unsigned int* __restrict__ split_keys,
    unsigned int* __restrict__ split_info, unsigned int* __restrict__ query_bad) {
    __shared__ int4 q_digits[RLP_ATTS_SCORE_HEADS * 3 * (RLP_ATT_MAX_HEAD_DIM / 16)];  // [head][digit][dp / 16]
    __shared__ unsigned int largest[RLP_ATTS_SCORE_HEADS];
    __shared__ unsigned int head_key[RLP_ATTS_SCORE_HEADS];
    __shared__ unsigned int max_ev;
    __shared__ unsigned int flags;
    const int group = hq / hkv;
    const int pieces = dp / 16;  // 16-byte pieces of a digit plane
    const int key_threads = rlp_atts_key_threads(pieces);
    const int lanes = (int)blockDim.x / key_threads;  // keys per block and pass
    const int lane = (int)threadIdx.x / key_threads;
    const int part = (int)threadIdx.x - lane * key_threads;  // pieces part, part + key_threads, ...
    const bool leader = part == 0;
    const long long keys = (long long)splits * chunk;
    const long long items = tq * hkv * splits;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long rowg = item / splits;  // token * hkv + g
        const int split = (int)(item - rowg * splits);
        const long long token = rowg / hkv;
        const int g = (int)(rowg - token * hkv);
        const int seq = q_seq[token];
        const int t = q_pos[token];
        const bool bad_row = seq < 0 || seq >= num_seqs || t < 0;  // block-uniform
        const long long lo = (long long)split * chunk;
        const long long end = bad_row ? lo : rlp_atts_min_ll(lo + chunk, (long long)t + 1);
        if (threadIdx.x == 0) {
            max_ev = 0u;
            // keys no split covers lie beyond the tables (splits * chunk >= max_blocks * block_size)
            flags = (!bad_row && split == splits - 1 && (long long)t >= keys) ? RLP_ATT_BAD_INDEX : 0u;
        }
        for (int h0 = 0; h0 < group; h0 += RLP_ATTS_SCORE_HEADS) {
            const int nb = rlp_atts_min(group - h0, RLP_ATTS_SCORE_HEADS);
            const long long qrow0 = token * hq + (long long)g * group + h0;  // the round's first q row
            if (threadIdx.x < nb) { largest[threadIdx.x] = 0u; head_key[threadIdx.x] = 0u; }
            __syncthreads();
            for (int hi = 0; hi < nb; ++hi) {
                unsigned int local = 0u;
                for (int i = threadIdx.x; i < d; i += blockDim.x)
                    local = rlp_max_u32(local, rlp_magnitude_bits(q[(qrow0 + hi) * d + i]));
                rlp_block_max_u32(&largest[hi], local);
            }
            __syncthreads();
            signed char* digits = reinterpret_cast<signed char*>(q_digits);
            for (int u = threadIdx.x; u < nb * dp; u += blockDim.x) {
                const int hi = u / dp;
                const int i = u - hi * dp;
                const int eq = rlp_row_exponent(largest[hi]);
                const long long v = (!bad_row && eq != RLP_NONFINITE_EXPONENT && i < d)
                                        ? rlp_quantize(q[(qrow0 + hi) * d + i], RLP_ATT_Q_BITS, eq) : 0;
                rlp_atts_digits3(v, digits + hi * 3 * dp + i, dp);
            }
            if (split == 0 && threadIdx.x < nb)
                query_bad[qrow0 + threadIdx.x] =
                    (bad_row || rlp_row_exponent(largest[threadIdx.x]) == RLP_NONFINITE_EXPONENT) ? 1u : 0u;
            __syncthreads();
            int eq[RLP_ATTS_SCORE_HEADS];  // RLP_NONFINITE_EXPONENT: no scores for this head
            unsigned int local_key[RLP_ATTS_SCORE_HEADS];
#pragma unroll
            for (int hi = 0; hi < RLP_ATTS_SCORE_HEADS; ++hi) {
                eq[hi] = hi < nb ? rlp_row_exponent(largest[hi]) : RLP_NONFINITE_EXPONENT;
                local_key[hi] = 0u;
            }
            unsigned int local_ev = 0u;
            unsigned int local_flags = 0u;
            // Block-uniform loop: every thread reaches the shuffles. A key past the split's end, or one
            // whose slot is missing, is computed on row 0 of the cache and never written; a key's K row is
            // read as soon as its slot is known, with the exponents (a row found non-finite gives no score).
            for (long long base = lo; base < end; base += lanes) {
                const long long j = base + lane;
                const long long slot =
                    j < end ? rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, (int)j) : -1;
                const long long row = slot >= 0 ? slot * hkv + g : 0;
                bool live = false;
                int ek = 0;
                if (j < end) {
                    if (slot < 0) {
                        local_flags |= RLP_ATT_BAD_INDEX;
                    } else {
                        const int ev = v_exponents[row];
                        ek = k_exponents[row];
                        if (ek == RLP_NONFINITE_EXPONENT || ev == RLP_NONFINITE_EXPONENT) {
                            local_flags |= RLP_ATT_BAD_KV;
                        } else {
                            live = true;
                            local_ev = rlp_max_u32(local_ev, (unsigned int)(ev + RLP_ATT_EV_OFFSET));
                            if (h0 == 0 && leader) key_rows[rowg * keys + j] = (row << 16) | (ev + RLP_ATT_EV_OFFSET);
                        }
                    }
                }
                const int4* kr = reinterpret_cast<const int4*>(k_digits + row * (2LL * dp));
                int4 b0[RLP_ATTS_SCORE_PIECES], b1[RLP_ATTS_SCORE_PIECES];
#pragma unroll
                for (int c = 0; c < RLP_ATTS_SCORE_PIECES; ++c) {
                    const int piece = part + c * key_threads;
                    const int at = piece < pieces ? piece : 0;
                    b0[c] = kr[at];
                    b1[c] = kr[pieces + at];
                }
#pragma unroll
                for (int hi = 0; hi < RLP_ATTS_SCORE_HEADS; ++hi) {
                    if (hi >= nb) continue;  // block-uniform
                    int sums[4] = {0, 0, 0, 0};
#pragma unroll
                    for (int c = 0; c < RLP_ATTS_SCORE_PIECES; ++c) {
                        const int piece = part + c * key_threads;
                        if (piece < pieces)
                            rlp_atts_groups16(sums, q_digits[(hi * 3) * pieces + piece],
                                              q_digits[(hi * 3 + 1) * pieces + piece],
                                              q_digits[(hi * 3 + 2) * pieces + piece], b0[c], b1[c]);
                    }
                    unsigned long long s = (unsigned long long)rlp_atts_combine(sums);
                    for (int mask = key_threads / 2; mask > 0; mask >>= 1) s += rlp_segment_xor_u64(s, mask);
                    if (live && leader && eq[hi] != RLP_NONFINITE_EXPONENT) {
                        const float score = rlp_att_score((long long)s, eq[hi], ek, scale);
                        scores[(rowg * keys + j) * group + h0 + hi] = score;
                        local_key[hi] = rlp_max_u32(local_key[hi], rlp_att_order_key(score));
                    }
                }
            }
#pragma unroll
            for (int hi = 0; hi < RLP_ATTS_SCORE_HEADS; ++hi)
                if (hi < nb) rlp_block_max_u32(&head_key[hi], local_key[hi]);
            rlp_block_max_u32(&max_ev, local_ev);
            rlp_block_or_u32(&flags, local_flags);
            __syncthreads();
            if (threadIdx.x < nb) split_keys[(qrow0 + threadIdx.x) * splits + split] = head_key[threadIdx.x];
            __syncthreads();  // the next round resets largest and head_key
        }
        if (threadIdx.x == 0) split_info[rowg * splits + split] = (flags << 16) | max_ev;
        __syncthreads();
    }
}

// One block per (query row, kv head g, split), grid-stride; the group's q heads in rounds of up to
// HEADS. E and the flags from every split's split_info, m per head from every split's split_keys; then
// the split's keys in tiles of RLP_ATTS_TILE. Per tile, threads over keys (RLP_ATTS_WEIGHT_KEYS in
// flight each) form p_j, RNE(p_j 2^21) and the weight w_j, whose sums L and W meet through block sums;
// the weights (float64, exact integers) and the V rows' offsets go to shared memory. Then the threads
// of a key row (dp / RLP_ATTS_COLUMNS of them, 4 columns each: together one 128-byte line per digit
// plane) walk the tile's keys, KEYS in flight (RLP_ATTS_VALUE_KEYS, twice that for HEADS = 2), and
// add w_j (qv_jd + B) 2^-1074 into float64 sums per (head, column) (exact: the section's comment). A key past the split's last one reads
// row 0 of the cache with weight 0. The sums meet in shared memory, one int64 per (key lane, head,
// column), added per column less B W (exact, any order). With one split the block writes o itself, as
// attention_split_combine would (ops/attention.py then launches no combine). numerator: the dynamic
// shared memory [lanes][HEADS][dp] (ops/attention.py split_values_shared_bytes).
template <int HEADS>
__device__ __forceinline__ void rlp_atts_values(
    const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, int hq, int hkv, int d, int dp,
    int num_seqs, const signed char* __restrict__ v_digits, int splits, int chunk, const float* __restrict__ scores,
    const long long* __restrict__ key_rows, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    long long* __restrict__ part_total, long long* __restrict__ part_num, float* __restrict__ out,
    unsigned long long* numerator) {
    __shared__ double weights[HEADS * RLP_ATTS_TILE];  // [head][key of the tile]
    __shared__ long long key_offsets[RLP_ATTS_TILE];    // the V row's byte offset
    __shared__ unsigned long long head_total[HEADS];  // L's partial sum
    __shared__ unsigned long long head_weights[HEADS];  // W's partial sum: sum of w_j
    __shared__ float head_m[HEADS];
    __shared__ int head_ok[HEADS];
    __shared__ unsigned int max_ev;
    __shared__ unsigned int flags;
    __shared__ int any_ok;
    const int group = hq / hkv;
    const int row_threads = dp / RLP_ATTS_COLUMNS;  // threads of one key row
    const int lanes = (int)blockDim.x / row_threads;  // key rows in flight per block (1, 2, 4 or 8)
    const int lane = (int)threadIdx.x / row_threads;  // >= lanes: no key row (only where dp does not divide)
    const int column = RLP_ATTS_COLUMNS * ((int)threadIdx.x - lane * row_threads);
    constexpr int KEYS = HEADS <= 2 ? 2 * RLP_ATTS_VALUE_KEYS : RLP_ATTS_VALUE_KEYS;  // the registers 2 heads free
    constexpr bool PREFETCH = HEADS <= 2;  // the first round's loads issued with the item's (below)
    const int stride = KEYS * lanes;  // divides RLP_ATTS_TILE
    const long long keys = (long long)splits * chunk;
    const long long items = tq * hkv * splits;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long rowg = item / splits;
        const int split = (int)(item - rowg * splits);
        const long long token = rowg / hkv;
        const int g = (int)(rowg - token * hkv);
        // What the first round reads before its weights, loaded at once (one round trip, not three): the
        // row's position, the splits' E and flags (below), the round's head maxima and query flags, and this
        // thread's first key of the first tile (its row and scores, used only if the key is in the split).
        // The 2-head build only (PREFETCH): the 4-head one has no registers to spare (it spilled).
        const long long first_qrow = token * hq + (long long)g * group;
        const int first_heads = rlp_atts_min(group, HEADS);
        unsigned int first_key = 0u, first_bad = 0u;
        if (PREFETCH && (int)threadIdx.x < first_heads) {
            for (int s = 0; s < splits; ++s)
                first_key = rlp_max_u32(first_key, split_keys[(first_qrow + threadIdx.x) * splits + s]);
            first_bad = query_bad[first_qrow + threadIdx.x];
        }
        const long long first_j = (long long)split * chunk + threadIdx.x;
        long long first_info = 0;
        float first_s[HEADS];
        if (PREFETCH && (int)threadIdx.x < RLP_ATTS_TILE && (int)threadIdx.x < chunk) {
            first_info = key_rows[rowg * keys + first_j];
#pragma unroll
            for (int hi = 0; hi < HEADS; ++hi)
                if (hi < first_heads) first_s[hi] = scores[(rowg * keys + first_j) * group + hi];
        }
        const int seq = q_seq[token];
        const int t = q_pos[token];
        const bool bad_row = seq < 0 || seq >= num_seqs || t < 0;
        const long long lo = (long long)split * chunk;
        const long long end = bad_row ? lo : rlp_atts_min_ll(lo + chunk, (long long)t + 1);
        if (threadIdx.x == 0) { max_ev = 0u; flags = 0u; }
        __syncthreads();
        unsigned int local_ev = 0u;
        unsigned int local_flags = 0u;
        for (int s = threadIdx.x; s < splits; s += blockDim.x) {
            const unsigned int info = split_info[rowg * splits + s];
            local_ev = rlp_max_u32(local_ev, info & 0xffffu);
            local_flags |= info >> 16;
        }
        rlp_block_max_u32(&max_ev, local_ev);
        rlp_block_or_u32(&flags, local_flags);
        __syncthreads();
        const int e_max = (int)max_ev - RLP_ATT_EV_OFFSET;
        const bool row_ok = !bad_row && flags == 0u;  // block-uniform
        for (int h0 = 0; h0 < group; h0 += HEADS) {
            const int nb = rlp_atts_min(group - h0, HEADS);
            const long long qrow0 = token * hq + (long long)g * group + h0;
            if (threadIdx.x == 0) any_ok = 0;
            __syncthreads();
            for (int hi = threadIdx.x; hi < nb; hi += blockDim.x) {
                const bool first = PREFETCH && h0 == 0 && hi == (int)threadIdx.x;  // loaded with the item
                unsigned int key = first ? first_key : 0u;
                if (!first)
                    for (int s = 0; s < splits; ++s) key = rlp_max_u32(key, split_keys[(qrow0 + hi) * splits + s]);
                const float m = rlp_att_from_order_key(key);
                // as attention_paged: m = +-inf (a score overflowed) poisons the row
                const unsigned int bad = first ? first_bad : query_bad[qrow0 + hi];
                const bool ok = row_ok && bad == 0u && rlp_magnitude_bits(m) < 0x7f800000u;
                head_m[hi] = m;
                head_ok[hi] = ok ? 1 : 0;
                head_total[hi] = 0ull;
                head_weights[hi] = 0ull;
                if (ok) any_ok = 1;
            }
            __syncthreads();
            double sums[HEADS][RLP_ATTS_COLUMNS];
#pragma unroll
            for (int hi = 0; hi < HEADS; ++hi) {
#pragma unroll
                for (int c = 0; c < RLP_ATTS_COLUMNS; ++c) sums[hi][c] = 0.0;
            }
            const bool work = any_ok != 0 && lo < end;  // block-uniform
            for (long long base = lo; work && base < end; base += RLP_ATTS_TILE) {
                // this thread's keys' sums of RNE(p 2^21) (L's part) and of w (W's part) in one int64 per
                // head, as L part + 2^32 W part: the tile's at most 2^9 keys give each part below 2^30
                long long parts[HEADS];
#pragma unroll
                for (int hi = 0; hi < HEADS; ++hi) parts[hi] = 0;
                for (int k0 = threadIdx.x; k0 < RLP_ATTS_TILE; k0 += RLP_ATTS_WEIGHT_KEYS * blockDim.x) {
                    long long offset[RLP_ATTS_WEIGHT_KEYS];
                    int ev[RLP_ATTS_WEIGHT_KEYS];
                    float s[RLP_ATTS_WEIGHT_KEYS][HEADS];
#pragma unroll
                    for (int u = 0; u < RLP_ATTS_WEIGHT_KEYS; ++u) {  // the loads first, then the arithmetic
                        const int k = k0 + u * (int)blockDim.x;
                        const long long j = base + k;
                        offset[u] = -1;  // past the tile or the split: no key (a valid slot otherwise: flags == 0)
                        if (k < RLP_ATTS_TILE && j < end) {
                            const bool first = PREFETCH && h0 == 0 && base == lo && k == (int)threadIdx.x;  // loaded with the item
                            const long long info = first ? first_info : key_rows[rowg * keys + j];
                            offset[u] = info >> 16;
                            ev[u] = (int)(info & 0xffff) - RLP_ATT_EV_OFFSET;
#pragma unroll
                            for (int hi = 0; hi < HEADS; ++hi)
                                if (hi < nb) s[u][hi] = first ? first_s[hi] : scores[(rowg * keys + j) * group + h0 + hi];
                        }
                    }
#pragma unroll
                    for (int u = 0; u < RLP_ATTS_WEIGHT_KEYS; ++u) {
                        const int k = k0 + u * (int)blockDim.x;
                        if (k >= RLP_ATTS_TILE) continue;
                        const bool live = offset[u] >= 0;
                        key_offsets[k] = live ? offset[u] * (2LL * dp) : 0;  // no key: row 0, weight 0
#pragma unroll
                        for (int hi = 0; hi < HEADS; ++hi) {
                            if (hi >= nb) continue;
                            double w = 0.0;
                            if (live && head_ok[hi]) {
                                const double p = (double)rlp_exp_f32(s[u][hi] - head_m[hi]);
                                w = rint(p * rlp_pow2_f64(ev[u] - e_max + RLP_ATT_P_SHIFT));  // an integer <= 2^21
                                parts[hi] += rlp_double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) + (rlp_double2ll_rn(w) << 32);
                            }
                            weights[hi * RLP_ATTS_TILE + k] = w;
                        }
                    }
                }
#pragma unroll
                for (int hi = 0; hi < HEADS; ++hi) {
                    if (hi >= nb) continue;  // block-uniform: every thread reaches the block sums
                    rlp_block_sum_i64(&head_total[hi], (long long)((unsigned long long)parts[hi] & 0xffffffffull));
                    rlp_block_sum_i64(&head_weights[hi], (long long)((unsigned long long)parts[hi] >> 32));
                }
                __syncthreads();
                const int span = (int)rlp_atts_min_ll(end - base, (long long)RLP_ATTS_TILE);
                for (int k0 = lane; lane < lanes && k0 < span; k0 += stride) {
                    int low[KEYS], high[KEYS];
#pragma unroll
                    for (int u = 0; u < KEYS; ++u) {  // keys up to the tile's end: weights 0
                        const signed char* row = v_digits + key_offsets[k0 + u * lanes] + column;
                        low[u] = *reinterpret_cast<const int*>(row);
                        high[u] = *reinterpret_cast<const int*>(row + dp);
                    }
#pragma unroll
                    for (int u = 0; u < KEYS; ++u) {
                        double value[RLP_ATTS_COLUMNS];
                        rlp_atts_biased_values(value, low[u], high[u]);
#pragma unroll
                        for (int hi = 0; hi < HEADS; ++hi) {
                            if (hi >= nb) continue;
                            const double w = weights[hi * RLP_ATTS_TILE + k0 + u * lanes];
#pragma unroll
                            for (int c = 0; c < RLP_ATTS_COLUMNS; ++c) sums[hi][c] = fma(w, value[c], sums[hi][c]);
                        }
                    }
                }
                __syncthreads();  // the next tile overwrites the weights and offsets
            }
#pragma unroll
            for (int hi = 0; hi < HEADS; ++hi) {
                if (hi >= nb) continue;
                if (lane >= lanes) continue;
#pragma unroll
                for (int c = 0; c < RLP_ATTS_COLUMNS; ++c)  // below 2^51: exact
                    numerator[(lane * nb + hi) * dp + column + c] = (unsigned long long)rlp_atts_biased_integer(sums[hi][c]);
            }
            __syncthreads();
            if (splits == 1) {  // the split's sums are L and N_d: o as attention_split_combine would write it
                for (int u = threadIdx.x; u < nb * d; u += blockDim.x) {
                    const int hi = u / d;
                    const int i = u - hi * d;
                    const long long n = rlp_atts_lane_sum(numerator, lanes, nb, dp, hi, i, head_weights[hi]);
                    out[(qrow0 + hi) * d + i] = head_ok[hi] ? rlp_att_output(n, e_max, (long long)head_total[hi])
                                                            : rlp_canonical_nan();
                }
            } else {
                if (threadIdx.x < nb)
                    part_total[(qrow0 + threadIdx.x) * splits + split] = (long long)head_total[threadIdx.x];
                for (int u = threadIdx.x; u < nb * d; u += blockDim.x) {
                    const int hi = u / d;
                    const int i = u - hi * d;
                    part_num[((qrow0 + hi) * splits + split) * d + i] =
                        rlp_atts_lane_sum(numerator, lanes, nb, dp, hi, i, head_weights[hi]);
                }
            }
            __syncthreads();  // the next round resets the sums
        }
    }
}

// rlp_atts_values with rounds of up to RLP_ATTS_VALUE_HEADS q heads (any group).
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 6) attention_split_values(
    const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, int hq, int hkv, int d, int dp,
    int num_seqs, const signed char* __restrict__ v_digits, int splits, int chunk, const float* __restrict__ scores,
    const long long* __restrict__ key_rows, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    long long* __restrict__ part_total, long long* __restrict__ part_num, float* __restrict__ out) {
    RLP_DYNAMIC_SHARED(unsigned long long, rlp_atts_values_smem);  // [lane][head of the round][dp]: N_d + B W parts
    rlp_atts_values<RLP_ATTS_VALUE_HEADS>(q_seq, q_pos, tq, hq, hkv, d, dp, num_seqs, v_digits, splits, chunk,
                                          scores, key_rows, split_keys, split_info, query_bad, part_total, part_num,
                                          out, rlp_atts_values_smem);
}

// rlp_atts_values with rounds of up to 2 q heads, for groups of 1 or 2 (ops/attention.py picks it): half
// the register sums of the 4-head build, the same bits.
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATTS_THREADS, 8) attention_split_values_h2(
    const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, int hq, int hkv, int d, int dp,
    int num_seqs, const signed char* __restrict__ v_digits, int splits, int chunk, const float* __restrict__ scores,
    const long long* __restrict__ key_rows, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    long long* __restrict__ part_total, long long* __restrict__ part_num, float* __restrict__ out) {
    RLP_DYNAMIC_SHARED(unsigned long long, rlp_atts_values_smem);  // [lane][head of the round][dp]: N_d + B W parts
    rlp_atts_values<2>(q_seq, q_pos, tq, hq, hkv, d, dp, num_seqs, v_digits, splits, chunk,
                       scores, key_rows, split_keys, split_info, query_bad, part_total, part_num,
                       out, rlp_atts_values_smem);
}

// One block per (query row, q head), grid-stride: m, E and the flags over the splits, L and N_d as
// exact sums of the splits' partials, o_d = RNE_f32((N_d 2^(E-13)) / L) as attention_paged.
extern "C" __global__ void attention_split_combine(
    long long tq, int hq, int hkv, int d, int splits, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    const long long* __restrict__ part_total, const long long* __restrict__ part_num, float* __restrict__ out) {
    __shared__ unsigned int max_key;
    __shared__ unsigned int max_ev;
    __shared__ unsigned int flags;
    __shared__ unsigned long long total;
    const int group = hq / hkv;
    const long long items = tq * hq;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long token = item / hq;
        const long long rowg = token * hkv + (int)(item - token * hq) / group;
        if (threadIdx.x == 0) { max_key = 0u; max_ev = 0u; flags = 0u; total = 0ull; }
        __syncthreads();
        unsigned int local_key = 0u;
        unsigned int local_ev = 0u;
        unsigned int local_flags = 0u;
        long long local_total = 0;
        for (int s = threadIdx.x; s < splits; s += blockDim.x) {
            const unsigned int info = split_info[rowg * splits + s];
            local_key = rlp_max_u32(local_key, split_keys[item * splits + s]);
            local_ev = rlp_max_u32(local_ev, info & 0xffffu);
            local_flags |= info >> 16;
            local_total += part_total[item * splits + s];
        }
        rlp_block_max_u32(&max_key, local_key);
        rlp_block_max_u32(&max_ev, local_ev);
        rlp_block_or_u32(&flags, local_flags);
        rlp_block_sum_i64(&total, local_total);
        __syncthreads();
        const float m = rlp_att_from_order_key(max_key);
        float* orow = out + item * (long long)d;
        if (query_bad[item] == 0u && flags == 0u && rlp_magnitude_bits(m) < 0x7f800000u) {  // block-uniform
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                long long n = 0;
                for (int s = 0; s < splits; ++s) n += part_num[(item * splits + s) * d + i];
                orow[i] = rlp_att_output(n, (int)max_ev - RLP_ATT_EV_OFFSET, (long long)total);
            }
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = rlp_canonical_nan();
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------
// Backward (contracts/attention.toml, op "attention_backward"; reference: attention_backward in
// rlportable/contract/attention.py), the per-row kernels; no
// warp-width assumption (block-wide results through shared-memory atomics and __syncthreads only).
// Packed sequences: key j of token t's sequence is token j, stored in slot j of a block-size-1 cache
// (attention_write_kv), so cache row = j * hkv + g.
// For query row r = token * hq + h (position t, kv head g) and key j <= t, wherever needed (the same
// bits every time): s_j and p_j = exp_f32(s_j - m) exactly as attention_paged;
//   P_j = (p_j 2^21) / L,  dP_j = (sum_d qdo_d qv_jd) 2^(edo + ev_j - 34),  dS_j = (P_j (dP_j - delta)) c.
// Each gradient element is a block-scaled weighted sum of encoded rows (reference: block_weighted_sum).
// Its terms fall into coefficient blocks: for dq, the keys of one aligned range of 64 positions (counted
// from the sequence start); for dk and dv, the queries of one such range and one q head of the group.
// In a block the coefficients u_i (dS or P times the power of two of the row's exponent) are quantized
// to 15 bits below the block's largest exponent field E (an integer max), U_i = RNE(u_i 2^(13 - E));
// the block's partial sum_i U_i r_id is an exact integer (|.| < 2^42), scaled exactly by a power of
// two into a float64 sum that starts at +0 and takes the blocks one add each, in ascending (position
// block, head) order; one rounding to float32 at the end. Only the adds round, in a fixed order, so any
// thread count or tiling that keeps that order gives the same bits.
// Scratch (written by attention_backward_rows, read by the other two), per query row r:
//   q_int, do_int [rows, d] int32: the 23-bit q and do rows (0 for a non-finite row)
//   row_info [rows, 3] int32: eq, edo, poisoned (1: the forward's row is NaN, or do or o is non-finite)
//   row_stats [rows, 3] float64: m, L (exact values) and delta = do . o: the exact products
//   w_d = qdo_d o_d quantized to 53 bits below their largest exponent field E_w, summed exactly in
//   int64, delta = float64(sum) 2^(E_w - 51 + edo - 21) (reference: delta_of)
#define RLP_ATTB_DO_BITS 23
#define RLP_ATTB_DELTA_BITS 53
#define RLP_ATTB_COEF_BITS 15
#define RLP_ATTB_BLOCK 64        // sequence positions per coefficient block
#define RLP_ATTB_ROUND 16        // coefficient blocks per round of the rows kernels (RLP_ATT_MAX_THREADS / 64)
#define RLP_ATTB_DP_SHIFT 34     // (DO_BITS - 2) + (KV_BITS - 2)
#define RLP_ATTB_ROW_SHIFT 21    // a 23-bit row (q, do) counts in units of 2^(e - 21)

// P_j and dS_j of one (query row, key) pair from its two exact dot products; stats: the row's
// (m, L, delta). Reference: _head_gradient_terms (float64 IEEE steps, one rounding each).
__device__ __forceinline__ void rlp_attb_terms(long long s_int, long long dp_int, int eq, int ek, int edo, int ev,
                                               const double* stats, double scale, double* prob, double* ds) {
    const float s = rlp_att_score(s_int, eq, ek, scale);
    const double p = (double)rlp_exp_f32(s - rlp_double2float_rn(stats[0]));
    const double big_p = (p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) / stats[1];
    const double dp = rlp_ll2double_rn(dp_int) * rlp_pow2_f64(edo + ev - RLP_ATTB_DP_SHIFT);
    *prob = big_p;
    *ds = (big_p * (dp - stats[2])) * scale;
}

// The biased exponent field of a float64 (0 for zero): the integer key of a block's max.
// Reference: exponent_fields.
__device__ __forceinline__ unsigned int rlp_attb_field(double u) {
    return (unsigned int)((__double_as_longlong(u) >> 52) & 0x7ffLL);
}

// E from the block's largest field, 0 for an all-zero block; U = RNE(u 2^(13 - E)), |U| <= 2^14.
// Reference: quantize_block (the contract keeps every nonzero |u| in [2^-661, 2^394]: the scalings
// by 2^(13 - E) and, for the partials, 2^(E - 13 - 21) stay normal).
__device__ __forceinline__ int rlp_attb_exponent(unsigned int field) { return field ? (int)field - 1023 : 0; }

__device__ __forceinline__ long long rlp_attb_quantize(double u, int e) {
    return rlp_double2ll_rn(u * rlp_pow2_f64(RLP_ATTB_COEF_BITS - 2 - e));
}

// acc + float64(partial) 2^(e - 13 - row_shift): one block's exact partial (|partial| < 2^53 converts
// exactly, the power of two is exact) added with the one rounding of the float64 add.
__device__ __forceinline__ double rlp_attb_add_block(double acc, long long partial, unsigned int field, int row_shift) {
    return acc + rlp_ll2double_rn(partial) *
                     rlp_pow2_f64(rlp_attb_exponent(field) - (RLP_ATTB_COEF_BITS - 2) - row_shift);
}

// The coefficient blocks a rows kernel takes per round: one per 64 threads, at least one, at most
// RLP_ATTB_ROUND (the shared arrays' size).
__device__ __forceinline__ int rlp_attb_round_blocks() {
    const int n = (int)blockDim.x / RLP_ATTB_BLOCK;
    return n < 1 ? 1 : (n > RLP_ATTB_ROUND ? RLP_ATTB_ROUND : n);
}
// sum_i a[i] b[i] of two integer rows, exact in int64.
__device__ __forceinline__ long long rlp_attb_dot_rows(const int* a, const int* __restrict__ b, int d) {
    long long s = 0;
    for (int i = 0; i < d; ++i) s += (long long)a[i] * b[i];
    return s;
}

// The three per-row kernels run at any block size up to RLP_ATT_MAX_THREADS: their bounds keep the
// registers within what 1024 threads may hold.
// One block per (token, q head), grid-stride: the q, do and o row exponents (integer maxima), the
// 23-bit q and do rows (to q_int, do_int), delta (E_w an integer max, then an exact int64 sum), then
// m and L over keys start..token in two passes exactly as attention_paged, and the row's info and stats.
// q, dout, o: [tokens, hq, d] float32; token_seq [tokens] int32; cu_seqlens [num_seqs + 1] int64.
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATT_MAX_THREADS, 1) attention_backward_rows(
    const float* __restrict__ q, const float* __restrict__ dout, const float* __restrict__ o,
    const int* __restrict__ token_seq, const long long* __restrict__ cu_seqlens, long long tokens, int hq, int hkv,
    int d, int dp, double scale, const signed char* __restrict__ k_digits, const int* __restrict__ k_exponents,
    const int* __restrict__ v_exponents, int* __restrict__ q_int, int* __restrict__ do_int,
    int* __restrict__ row_info, double* __restrict__ row_stats) {
    __shared__ int qq[RLP_ATT_MAX_HEAD_DIM];
    __shared__ unsigned int largest[3];
    __shared__ unsigned int max_key;
    __shared__ unsigned int flags;
    __shared__ unsigned int delta_field;
    __shared__ unsigned long long delta_sum;
    __shared__ unsigned long long total;
    const int group = hq / hkv;
    const long long items = tokens * hq;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long token = item / hq;
        const int g = (int)(item - token * hq) / group;
        const long long start = cu_seqlens[token_seq[token]];
        const float* qr = q + item * (long long)d;
        const float* dr = dout + item * (long long)d;
        const float* orow = o + item * (long long)d;
        if (threadIdx.x == 0) {
            largest[0] = 0u; largest[1] = 0u; largest[2] = 0u;
            max_key = 0u; flags = 0u; delta_field = 0u; delta_sum = 0ull; total = 0ull;
        }
        __syncthreads();
        unsigned int local_q = 0u, local_do = 0u, local_o = 0u;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            local_q = rlp_max_u32(local_q, rlp_magnitude_bits(qr[i]));
            local_do = rlp_max_u32(local_do, rlp_magnitude_bits(dr[i]));
            local_o = rlp_max_u32(local_o, rlp_magnitude_bits(orow[i]));
        }
        atomicMax(&largest[0], local_q);
        atomicMax(&largest[1], local_do);
        atomicMax(&largest[2], local_o);
        __syncthreads();
        const int eq = rlp_row_exponent(largest[0]);
        const int edo = rlp_row_exponent(largest[1]);
        const int eo = rlp_row_exponent(largest[2]);
        // block-uniform: a non-finite q, do or o row (o is NaN wherever the forward poisons the row)
        const bool bad_rows = eq == RLP_NONFINITE_EXPONENT || edo == RLP_NONFINITE_EXPONENT ||
                              eo == RLP_NONFINITE_EXPONENT;
        unsigned int local_field = 0u;
        for (int i = threadIdx.x; i < dp; i += blockDim.x) {
            const int a = (i < d && eq != RLP_NONFINITE_EXPONENT) ? (int)rlp_quantize(qr[i], RLP_ATT_Q_BITS, eq) : 0;
            qq[i] = a;
            if (i < d) {
                const int b = edo != RLP_NONFINITE_EXPONENT ? (int)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo) : 0;
                q_int[item * d + i] = a;
                do_int[item * d + i] = b;
                if (!bad_rows) local_field = rlp_max_u32(local_field, rlp_attb_field((double)b * (double)orow[i]));
            }
        }
        atomicMax(&delta_field, local_field);
        __syncthreads();
        // delta: W_d = RNE(w_d 2^(51 - E_w)) of the exact products w_d = qdo_d o_d, an exact int64 sum
        const int e_delta = rlp_attb_exponent(delta_field);
        if (!bad_rows) {  // block-uniform
            long long local_delta = 0;
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                const double w = (double)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo) * (double)orow[i];
                local_delta += rlp_double2ll_rn(w * rlp_pow2_f64(RLP_ATTB_DELTA_BITS - 2 - e_delta));
            }
            if (local_delta != 0) atomicAdd(&delta_sum, (unsigned long long)local_delta);
            __syncthreads();
        }
        float m = 0.0f;
        if (!bad_rows) {
            // ---- pass 1: m and the flags (a non-finite key or value row among 0..t)
            unsigned int local_key = 0u;
            unsigned int local_flags = 0u;
            for (long long j = start + threadIdx.x; j <= token; j += blockDim.x) {
                const long long row = j * hkv + g;
                const int ek = k_exponents[row];
                if (ek == RLP_NONFINITE_EXPONENT || v_exponents[row] == RLP_NONFINITE_EXPONENT) { local_flags = 1u; continue; }
                const float s = rlp_att_score(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp), eq, ek, scale);
                local_key = rlp_max_u32(local_key, rlp_att_order_key(s));
            }
            atomicMax(&max_key, local_key);
            atomicOr(&flags, local_flags);
            __syncthreads();
            m = rlp_att_from_order_key(max_key);
            if (flags == 0u && rlp_magnitude_bits(m) < 0x7f800000u) {  // block-uniform
                // ---- pass 2: L = sum_j RNE(p_j 2^21)
                long long local_total = 0;
                for (long long j = start + threadIdx.x; j <= token; j += blockDim.x) {
                    const long long row = j * hkv + g;
                    const float s = rlp_att_score(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp), eq,
                                                  k_exponents[row], scale);
                    local_total += rlp_double2ll_rn((double)rlp_exp_f32(s - m) * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                }
                atomicAdd(&total, (unsigned long long)local_total);
                __syncthreads();
            }
        }
        if (threadIdx.x == 0) {
            const bool poisoned = bad_rows || flags != 0u || rlp_magnitude_bits(m) >= 0x7f800000u;
            int* info = row_info + 3 * item;
            double* stats = row_stats + 3 * item;
            info[0] = poisoned ? 0 : eq;
            info[1] = poisoned ? 0 : edo;
            info[2] = poisoned ? 1 : 0;
            stats[0] = poisoned ? 0.0 : (double)m;
            stats[1] = poisoned ? 0.0 : rlp_ll2double_rn((long long)total);  // exact: L < 2^53
            stats[2] = poisoned ? 0.0 : rlp_ll2double_rn((long long)delta_sum)  // |sum| <= 2^61: one rounding
                                            * rlp_pow2_f64(e_delta - (RLP_ATTB_DELTA_BITS - 2) + edo - RLP_ATTB_ROW_SHIFT);
        }
        __syncthreads();
    }
}

// One block per (token, q head), grid-stride: dq_t = sum_{j<=t} dS_j k_j over the key blocks of 64
// positions, in rounds of up to RLP_ATTB_ROUND blocks. Per round: threads over the round's keys form
// u_j = dS_j 2^ek_j (to shared memory) and each block's largest field (a shared atomicMax); then U_j
// replaces u_j; then one thread per column d forms each block's exact int64 partial sum_j U_j qk_jd and
// adds it to its float64 sum, blocks in ascending order. dq = RNE_f32(sum). A poisoned row gives the
// canonical NaN.
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATT_MAX_THREADS, 1) attention_backward_dq(
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ row_info,
    const double* __restrict__ row_stats, const int* __restrict__ token_seq, const long long* __restrict__ cu_seqlens,
    long long tokens, int hq, int hkv, int d, int dp, double scale, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ dq) {
    __shared__ int qq[RLP_ATT_MAX_HEAD_DIM];
    __shared__ int qdo[RLP_ATT_MAX_HEAD_DIM];
    __shared__ double acc[RLP_ATT_MAX_HEAD_DIM];
    __shared__ double coef[RLP_ATTB_ROUND * RLP_ATTB_BLOCK];  // u, then U (float64 integers)
    __shared__ unsigned int fields[RLP_ATTB_ROUND];
    const int group = hq / hkv;
    const long long items = tokens * hq;
    const int per_round = rlp_attb_round_blocks();
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long token = item / hq;
        const int g = (int)(item - token * hq) / group;
        const long long start = cu_seqlens[token_seq[token]];
        const int* info = row_info + 3 * item;
        const double* stats = row_stats + 3 * item;
        float* out = dq + item * (long long)d;
        if (info[2] == 0) {  // block-uniform
            const int eq = info[0];
            const int edo = info[1];
            for (int i = threadIdx.x; i < dp; i += blockDim.x) {
                qq[i] = i < d ? q_int[item * d + i] : 0;
                qdo[i] = i < d ? do_int[item * d + i] : 0;
                if (i < d) acc[i] = 0.0;
            }
            const long long blocks = (token - start) / RLP_ATTB_BLOCK + 1;
            for (long long b0 = 0; b0 < blocks; b0 += per_round) {
                const int count = blocks - b0 < (long long)per_round ? (int)(blocks - b0) : per_round;
                const long long first = start + b0 * RLP_ATTB_BLOCK;  // the round's first key
                for (int x = threadIdx.x; x < count; x += blockDim.x) fields[x] = 0u;
                __syncthreads();
                for (int w = threadIdx.x; w < count * RLP_ATTB_BLOCK; w += blockDim.x) {
                    const long long j = first + w;
                    double u = 0.0;
                    if (j <= token) {
                        const long long row = j * hkv + g;
                        const int ek = k_exponents[row];
                        double big_p, ds;
                        rlp_attb_terms(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp),
                                       rlp_att_dot(qdo, v_digits + row * (2LL * dp), d, dp), eq, ek, edo,
                                       v_exponents[row], stats, scale, &big_p, &ds);
                        u = ds * rlp_pow2_f64(ek);
                        const unsigned int field = rlp_attb_field(u);
                        if (field) atomicMax(&fields[w / RLP_ATTB_BLOCK], field);
                    }
                    coef[w] = u;
                }
                __syncthreads();
                for (int w = threadIdx.x; w < count * RLP_ATTB_BLOCK; w += blockDim.x)
                    coef[w] = (double)rlp_attb_quantize(coef[w], rlp_attb_exponent(fields[w / RLP_ATTB_BLOCK]));
                __syncthreads();
                for (int i = threadIdx.x; i < d; i += blockDim.x) {
                    double sum = acc[i];
                    for (int x = 0; x < count; ++x) {
                        const long long base = first + (long long)x * RLP_ATTB_BLOCK;
                        const int keys = token + 1 - base < RLP_ATTB_BLOCK ? (int)(token + 1 - base) : RLP_ATTB_BLOCK;
                        long long partial = 0;
                        for (int c = 0; c < keys; ++c) {
                            const signed char* kr = k_digits + ((base + c) * hkv + g) * (2LL * dp);
                            partial += (long long)coef[x * RLP_ATTB_BLOCK + c] * ((int)kr[i] + 256 * (int)kr[dp + i]);
                        }
                        sum = rlp_attb_add_block(sum, partial, fields[x], RLP_ATT_KV_BITS - 2);
                    }
                    acc[i] = sum;
                }
                __syncthreads();
            }
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = rlp_double2float_rn(acc[i]);
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = rlp_canonical_nan();
        }
        __syncthreads();
    }
}

// One block per (key token j, kv head g), grid-stride: dk_j = sum dS_tj q_t and dv_j = sum P_tj do_t
// over the pairs (t >= j of j's sequence, h in g's heads). Coefficient block x = (query block b, head
// h): b ascending from the block holding j, the group's heads ascending within each b. Rounds of up to
// RLP_ATTB_ROUND blocks as in attention_backward_dq: threads over the round's pairs form dS 2^eq and
// P 2^edo and the blocks' largest fields, then U, then one thread per column adds each block's exact
// int64 partials. A poisoned pair anywhere makes dk_j and dv_j the canonical NaN.
extern "C" __global__ void RLP_LAUNCH_BOUNDS(RLP_ATT_MAX_THREADS, 1) attention_backward_dkv(
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ row_info,
    const double* __restrict__ row_stats, const int* __restrict__ token_seq, const long long* __restrict__ cu_seqlens,
    long long tokens, int hq, int hkv, int d, int dp, double scale, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ dk, float* __restrict__ dv) {
    __shared__ int key_row[RLP_ATT_MAX_HEAD_DIM];
    __shared__ int value_row[RLP_ATT_MAX_HEAD_DIM];
    __shared__ double acc[2][RLP_ATT_MAX_HEAD_DIM];                    // dk, dv
    __shared__ double coef[2][RLP_ATTB_ROUND * RLP_ATTB_BLOCK];        // u, then U, of dk and dv
    __shared__ long long pair_rows[RLP_ATTB_ROUND * RLP_ATTB_BLOCK];  // r d of the pair's query row, -1: none
    __shared__ unsigned int fields[2][RLP_ATTB_ROUND];
    __shared__ unsigned int poisoned;
    const int group = hq / hkv;
    const long long items = tokens * hkv;
    const int per_round = rlp_attb_round_blocks();
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long j = item / hkv;
        const int g = (int)(item - j * hkv);
        const int seq = token_seq[j];
        const long long start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
        const long long first_block = start + (j - start) / RLP_ATTB_BLOCK * RLP_ATTB_BLOCK;
        const long long blocks = ((end - first_block + RLP_ATTB_BLOCK - 1) / RLP_ATTB_BLOCK) * group;
        const signed char* kr = k_digits + item * (2LL * dp);  // cache row j * hkv + g
        const signed char* vr = v_digits + item * (2LL * dp);
        const int ek = k_exponents[item];
        const int ev = v_exponents[item];
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            key_row[i] = (int)kr[i] + 256 * (int)kr[dp + i];
            value_row[i] = (int)vr[i] + 256 * (int)vr[dp + i];
            acc[0][i] = 0.0;
            acc[1][i] = 0.0;
        }
        if (threadIdx.x == 0) poisoned = 0u;
        for (long long x0 = 0; x0 < blocks; x0 += per_round) {
            const int count = blocks - x0 < (long long)per_round ? (int)(blocks - x0) : per_round;
            for (int x = threadIdx.x; x < count; x += blockDim.x) { fields[0][x] = 0u; fields[1][x] = 0u; }
            __syncthreads();
            for (int w = threadIdx.x; w < count * RLP_ATTB_BLOCK; w += blockDim.x) {
                const long long x = x0 + w / RLP_ATTB_BLOCK;
                const long long t = first_block + (x / group) * RLP_ATTB_BLOCK + w % RLP_ATTB_BLOCK;
                double uk = 0.0, uv = 0.0;
                long long at = -1;
                if (t >= j && t < end) {
                    const long long r = t * hq + (long long)g * group + x % group;
                    const int* info = row_info + 3 * r;
                    if (info[2] != 0) {
                        atomicOr(&poisoned, 1u);
                    } else {
                        double big_p, ds;
                        rlp_attb_terms(rlp_attb_dot_rows(key_row, q_int + r * d, d),
                                       rlp_attb_dot_rows(value_row, do_int + r * d, d), info[0], ek, info[1], ev,
                                       row_stats + 3 * r, scale, &big_p, &ds);
                        uk = ds * rlp_pow2_f64(info[0]);
                        uv = big_p * rlp_pow2_f64(info[1]);
                        const unsigned int fk = rlp_attb_field(uk), fv = rlp_attb_field(uv);
                        if (fk) atomicMax(&fields[0][w / RLP_ATTB_BLOCK], fk);
                        if (fv) atomicMax(&fields[1][w / RLP_ATTB_BLOCK], fv);
                        at = r * d;
                    }
                }
                coef[0][w] = uk;
                coef[1][w] = uv;
                pair_rows[w] = at;
            }
            __syncthreads();
            if (poisoned != 0u) break;  // block-uniform: written only before the barrier above
            for (int w = threadIdx.x; w < count * RLP_ATTB_BLOCK; w += blockDim.x) {
                const int x = w / RLP_ATTB_BLOCK;
                coef[0][w] = (double)rlp_attb_quantize(coef[0][w], rlp_attb_exponent(fields[0][x]));
                coef[1][w] = (double)rlp_attb_quantize(coef[1][w], rlp_attb_exponent(fields[1][x]));
            }
            __syncthreads();
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                double sum_k = acc[0][i], sum_v = acc[1][i];
                for (int x = 0; x < count; ++x) {
                    long long partial_k = 0, partial_v = 0;
                    for (int w = x * RLP_ATTB_BLOCK; w < (x + 1) * RLP_ATTB_BLOCK; ++w) {
                        const long long at = pair_rows[w];
                        if (at < 0) continue;
                        partial_k += (long long)coef[0][w] * q_int[at + i];
                        partial_v += (long long)coef[1][w] * do_int[at + i];
                    }
                    sum_k = rlp_attb_add_block(sum_k, partial_k, fields[0][x], RLP_ATTB_ROW_SHIFT);
                    sum_v = rlp_attb_add_block(sum_v, partial_v, fields[1][x], RLP_ATTB_ROW_SHIFT);
                }
                acc[0][i] = sum_k;
                acc[1][i] = sum_v;
            }
            __syncthreads();
        }
        float* dk_row = dk + item * (long long)d;
        float* dv_row = dv + item * (long long)d;
        const bool bad = poisoned != 0u;  // block-uniform (read after a barrier that follows every write)
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            dk_row[i] = bad ? rlp_canonical_nan() : rlp_double2float_rn(acc[0][i]);
            dv_row[i] = bad ? rlp_canonical_nan() : rlp_double2float_rn(acc[1][i]);
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------
// Tiled backward, portable (ops/attention.py method "tiled"): the bits of the rows kernels above from
// tiles of query rows x keys in shared memory. The operands sit in shared memory as int32; every
// product and partial sum of the dot products and of a coefficient block's partial is an integer below
// 2^53 formed with float64 FMAs, so each is exact in any order and any cut; only the float64 adds of
// the blocks' partials round, and each thread does those for its outputs in the contract's order.
// dq: per query tile, the key blocks of 64 positions ascending; in each, the 64 keys in steps of BK
// (S, dP, then u = dS 2^ek and each row's largest field), U in place of u, then the block's partials
// (steps again, k rows reloaded but the last) and one float64 add per output. dkv: per key tile (inside
// one block of 64 positions: BKV divides 64), the query blocks ascending from the one holding the tile,
// and for each the group's heads ascending; in each (block, head) the queries in steps of BQ2 the same
// way, with per-key maxima. No warp width is assumed: products are per thread, maxima meet through
// shared-memory atomics, and the one per-row kernel gives a row to a 32-lane segment.
// Tiles are sized so that each kernel's shared memory stays within 64 KiB (MI300X's LDS per
// workgroup): ops/attention.py tiled_tiles / tiled_shared_bytes say the same numbers.
#define RLP_ATTP_THREADS 256

template <int DP>
struct RlpAttp {
    static constexpr int LD = DP + 1;  // int32 rows an odd stride apart: a walk down a column hits distinct banks
    static constexpr int BQ = 2048 / DP;             // query rows of a stats / dq tile
    static constexpr int BK = 16;                    // keys per step of those (4 steps per key block)
    static constexpr int BKV = 2048 / DP;            // key rows of a dkv tile (divides 64)
    static constexpr int BQ2 = DP == 64 ? 8 : 16;    // query rows per step of dkv
    static_assert(RLP_ATTB_BLOCK % BK == 0 && RLP_ATTB_BLOCK % BKV == 0 && RLP_ATTB_BLOCK % BQ2 == 0,
                  "steps and key tiles must tile the 64-position blocks");
};

// How the threads share a ROWS x COLS tile of dot products: thread t takes column t % COLS and rows
// r0 + k RGS (k < RPT) over one of SL slices of the DP terms (SL > 1 where the tile has fewer rows
// than thread groups); PARTS partial sums per operand pair.
template <int ROWS, int COLS>
struct RlpAttpDots {
    static constexpr int RG = RLP_ATTP_THREADS / COLS;
    static constexpr int RGS = RG < ROWS ? RG : ROWS;
    static constexpr int SL = RG / RGS;
    static constexpr int RPT = ROWS / RGS;
    static constexpr int OUT = ROWS * COLS;
    static constexpr int PARTS = SL * OUT;
};

// Partial dot products px[slice][r][c] = a_r . b_c over the slice's terms (py: e_r . f_c when Y),
// rows of DP int32 LD apart; float64 integers (exact: see the section's comment).
template <int DP, int ROWS, int COLS, bool Y>
__device__ __forceinline__ void rlp_attp_dots(const int* a, const int* b, const int* e, const int* f, double* px,
                                              double* py) {
    using T = RlpAttpDots<ROWS, COLS>;
    constexpr int LD = RlpAttp<DP>::LD, SPAN = DP / T::SL;
    const int c = threadIdx.x % COLS, group = threadIdx.x / COLS;
    const int r0 = group % T::RGS, slice = group / T::RGS;
    double x[T::RPT], y[T::RPT];
#pragma unroll
    for (int k = 0; k < T::RPT; ++k) { x[k] = 0.0; y[k] = 0.0; }
    const int* bc = b + c * LD;
    const int* fc = f + c * LD;
#pragma unroll 4
    for (int i = slice * SPAN; i < (slice + 1) * SPAN; ++i) {
        const double bv = (double)bc[i];
        const double fv = Y ? (double)fc[i] : 0.0;
#pragma unroll
        for (int k = 0; k < T::RPT; ++k) {
            const int at = (r0 + k * T::RGS) * LD + i;
            x[k] = rlp_fma_f64((double)a[at], bv, x[k]);
            if (Y) y[k] = rlp_fma_f64((double)e[at], fv, y[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < T::RPT; ++k) {
        const int o = slice * T::OUT + (r0 + k * T::RGS) * COLS + c;
        px[o] = x[k];
        if (Y) py[o] = y[k];
    }
}

// The whole dot product of output o from its slices (exact integers: any order).
template <int ROWS, int COLS>
__device__ __forceinline__ double rlp_attp_sum(const double* parts, int o) {
    using T = RlpAttpDots<ROWS, COLS>;
    double s = parts[o];
#pragma unroll
    for (int slice = 1; slice < T::SL; ++slice) s += parts[slice * T::OUT + o];
    return s;
}

// part[k] += sum_c U[r][c] b[c][col] for the thread's outputs: column t % DP, rows t / DP + k (THREADS / DP);
// U rows u_ld apart (COLS of them used, zero where no pair), b holds COLS rows of DP int32. Exact: a
// block's partials stay integers below 2^53.
template <int DP, int ROWS, int COLS>
__device__ __forceinline__ void rlp_attp_accumulate(double (&part)[ROWS * DP / RLP_ATTP_THREADS], const double* u,
                                                    int u_ld, const int* b) {
    constexpr int RS = RLP_ATTP_THREADS / DP, RPT = ROWS / RS, LD = RlpAttp<DP>::LD;
    const int col = threadIdx.x % DP, r0 = threadIdx.x / DP;
#pragma unroll 4
    for (int c = 0; c < COLS; ++c) {
        const double bv = (double)b[c * LD + col];
#pragma unroll
        for (int k = 0; k < RPT; ++k) part[k] = rlp_fma_f64(u[(r0 + k * RS) * u_ld + c], bv, part[k]);
    }
}

// Rows [count] of DP int32 from global (row r at src + (first + r step) DP) to shared memory (stride LD);
// rows at or beyond count are zero.
template <int DP, int ROWS>
__device__ __forceinline__ void rlp_attp_load(int* dst, const int* __restrict__ src, long long first, long long step,
                                              int count) {
    for (int i = threadIdx.x; i < ROWS * DP; i += RLP_ATTP_THREADS) {
        const int r = i / DP, col = i - r * DP;
        dst[r * RlpAttp<DP>::LD + col] = r < count ? src[(first + r * step) * DP + col] : 0;
    }
}

// int32 elements rounded up to a whole number of 8-byte words (what follows them is 8-byte aligned).
__device__ __forceinline__ constexpr int rlp_attp_words(int ints) { return (ints + 1) / 2; }

// P and dS of one (query row, key) pair from its two exact dot products: rlp_attb_terms, step for step.
__device__ __forceinline__ void rlp_attt_pair(double sum, double dp_sum, int eq, int ek, int edo, int ev, float m,
                                              double total, double delta, double scale, double* big_p, double* ds) {
    const float sc = rlp_double2float_rn((sum * rlp_pow2_f64(eq + ek - RLP_ATT_SCORE_SHIFT)) * scale);
    const double p = (double)rlp_exp_f32(sc - m);
    *big_p = (p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) / total;
    const double dp = dp_sum * rlp_pow2_f64(edo + ev - RLP_ATTB_DP_SHIFT);
    *ds = (*big_p * (dp - delta)) * scale;
}

// One segment per (token, q head) row, grid-stride: q and do as 23-bit integers (rows of dpt, zero beyond
// d; zero for a non-finite row), eq, edo and the bad-rows flag (q, do or o non-finite) in row_info,
// delta in row_stats[2].
extern "C" __global__ void attention_backward_tiled_rows(
    const float* __restrict__ q, const float* __restrict__ dout, const float* __restrict__ o, long long rows, int d,
    int dpt, int* __restrict__ q_int, int* __restrict__ do_int, int* __restrict__ row_info,
    double* __restrict__ row_stats) {
    const int lane = rlp_segment_lane();
    for (long long item = rlp_segment_first_row(); item < rows; item += rlp_segment_row_stride()) {
        const float* qr = q + item * (long long)d;
        const float* dr = dout + item * (long long)d;
        const float* orow = o + item * (long long)d;
        unsigned int local_q = 0u, local_do = 0u, local_o = 0u;
        for (int i = lane; i < d; i += RLP_SEGMENT) {
            local_q = rlp_max_u32(local_q, rlp_magnitude_bits(qr[i]));
            local_do = rlp_max_u32(local_do, rlp_magnitude_bits(dr[i]));
            local_o = rlp_max_u32(local_o, rlp_magnitude_bits(orow[i]));
        }
        const int eq = rlp_row_exponent(rlp_segment_max_u32(local_q));
        const int edo = rlp_row_exponent(rlp_segment_max_u32(local_do));
        const bool bad_rows = eq == RLP_NONFINITE_EXPONENT || edo == RLP_NONFINITE_EXPONENT ||
                              rlp_row_exponent(rlp_segment_max_u32(local_o)) == RLP_NONFINITE_EXPONENT;
        unsigned int local_field = 0u;
        for (int i = lane; i < dpt; i += RLP_SEGMENT) {
            int a = 0, b = 0;
            if (i < d && !bad_rows) {
                a = (int)rlp_quantize(qr[i], RLP_ATT_Q_BITS, eq);
                b = (int)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo);
                local_field = rlp_max_u32(local_field, rlp_attb_field((double)b * (double)orow[i]));
            }
            q_int[item * dpt + i] = a;
            do_int[item * dpt + i] = b;
        }
        // delta: W_d = RNE(w_d 2^(51 - E_w)) of the exact products w_d = qdo_d o_d, an exact int64 sum
        const int e_delta = rlp_attb_exponent(rlp_segment_max_u32(local_field));
        long long delta_sum = 0;
        if (!bad_rows)  // segment-uniform
            for (int i = lane; i < d; i += RLP_SEGMENT) {
                const double w = (double)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo) * (double)orow[i];
                delta_sum += rlp_double2ll_rn(w * rlp_pow2_f64(RLP_ATTB_DELTA_BITS - 2 - e_delta));
            }
        delta_sum = (long long)rlp_segment_sum_u64((unsigned long long)delta_sum);
        if (lane == 0) {
            int* info = row_info + 3 * item;
            info[0] = bad_rows ? 0 : eq;
            info[1] = bad_rows ? 0 : edo;
            info[2] = bad_rows ? 1 : 0;
            row_stats[3 * item + 2] = bad_rows ? 0.0 : rlp_ll2double_rn(delta_sum) *
                                      rlp_pow2_f64(e_delta - (RLP_ATTB_DELTA_BITS - 2) + edo - RLP_ATTB_ROW_SHIFT);
        }
    }
}

// The cache's k and v rows (two digits) as 15-bit integers, rows of dpt (zero beyond dp).
extern "C" __global__ void attention_backward_tiled_keys(
    const signed char* __restrict__ k_digits, const signed char* __restrict__ v_digits, long long rows, int dp,
    int dpt, int* __restrict__ k_int, int* __restrict__ v_int) {
    const long long n = rows * dpt;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / dpt;
        const int c = (int)(i - r * dpt);
        int kv = 0, vv = 0;
        if (c < dp) {
            const signed char* kr = k_digits + r * (2LL * dp);
            const signed char* vr = v_digits + r * (2LL * dp);
            kv = (int)kr[c] + 256 * (int)kr[dp + c];
            vv = (int)vr[c] + 256 * (int)vr[dp + c];
        }
        k_int[i] = kv;
        v_int[i] = vv;
    }
}

// The per-query-tile kernels' scalars: the tile's rows' and a step's keys'.
template <int BQ, int BK>
struct RlpAtttRows {
    int eq[BQ], edo[BQ], bad[BQ];
    float m[BQ];
    double total[BQ], delta[BQ];
    int ek[BK], ev[BK];
    unsigned int key[BQ], flag[BQ], field[BQ];
    unsigned long long sum[BQ];
};

// The statistics kernels' last steps (this source's and CUDA's mma one, over their own scalar structs):
// after pass 0, each row's m from its largest order key and the poisoned flag; at the end, each row's
// info and stats.
template <int BQ, int NT, typename S>
__device__ __forceinline__ void rlp_attt_stats_max(S& s) {
    for (int r = threadIdx.x; r < BQ; r += NT) {
        const float m = rlp_att_from_order_key(s.key[r]);
        if (s.flag[r] != 0u || rlp_magnitude_bits(m) >= 0x7f800000u) s.bad[r] = 1;
        s.m[r] = m;
    }
}

template <int NT, typename S>
__device__ __forceinline__ void rlp_attt_stats_write(const S& s, int* __restrict__ row_info,
                                                     double* __restrict__ row_stats, long long t0, int rows, int hq,
                                                     int h) {
    for (int r = threadIdx.x; r < rows; r += NT) {
        const long long item = (t0 + r) * hq + h;
        const bool poisoned = s.bad[r] != 0;
        if (poisoned) { row_info[3 * item] = 0; row_info[3 * item + 1] = 0; row_info[3 * item + 2] = 1; }
        row_stats[3 * item] = poisoned ? 0.0 : (double)s.m[r];
        row_stats[3 * item + 1] = poisoned ? 0.0 : rlp_ll2double_rn((long long)s.sum[r]);
        if (poisoned) row_stats[3 * item + 2] = 0.0;
    }
}

// The block's query tile: q_tiles[2 blockIdx.x] = sequence, [.. + 1] = first token t0; rows of it in its
// sequence (at most bq), q head h = blockIdx.y and its kv head g; start = the sequence's first token.
struct RlpAtttTile {
    long long t0, start;
    int rows, h, g;
};

__device__ __forceinline__ RlpAtttTile rlp_attt_query_tile_of(const int* __restrict__ q_tiles,
                                                              const long long* __restrict__ cu_seqlens, int bq, int hq,
                                                              int hkv) {
    const int seq = q_tiles[2 * blockIdx.x];
    RlpAtttTile tile;
    tile.t0 = q_tiles[2 * blockIdx.x + 1];
    tile.start = cu_seqlens[seq];
    const long long left = cu_seqlens[seq + 1] - tile.t0;
    tile.rows = (int)(left < (long long)bq ? left : (long long)bq);
    tile.h = blockIdx.y;
    tile.g = tile.h / (hq / hkv);
    return tile;
}

// A query tile's scalars: row r of the tile is token t0 + r (rows valid), head h.
template <int BQ, int BK>
__device__ __forceinline__ void rlp_attt_row_scalars(RlpAtttRows<BQ, BK>& s, const int* __restrict__ row_info,
                                                     const double* __restrict__ row_stats, long long t0, int rows,
                                                     int hq, int h) {
    for (int r = threadIdx.x; r < BQ; r += RLP_ATTP_THREADS) {
        const long long item = (t0 + r) * hq + h;
        const bool in = r < rows;
        s.eq[r] = in ? row_info[3 * item] : 0;
        s.edo[r] = in ? row_info[3 * item + 1] : 0;
        s.bad[r] = in ? row_info[3 * item + 2] : 1;
        s.m[r] = in ? rlp_double2float_rn(row_stats[3 * item]) : 0.0f;
        s.total[r] = in ? row_stats[3 * item + 1] : 1.0;
        s.delta[r] = in ? row_stats[3 * item + 2] : 0.0;
    }
}

// A key step's exponents: key c of the step is token j0 + c (keys valid), kv head g.
template <int BQ, int BK>
__device__ __forceinline__ void rlp_attt_key_scalars(RlpAtttRows<BQ, BK>& s, const int* __restrict__ k_exponents,
                                                     const int* __restrict__ v_exponents, long long j0, int keys,
                                                     int hkv, int g) {
    for (int c = threadIdx.x; c < BK; c += RLP_ATTP_THREADS) {
        s.ek[c] = c < keys ? k_exponents[(j0 + c) * hkv + g] : 0;
        s.ev[c] = c < keys ? v_exponents[(j0 + c) * hkv + g] : 0;
    }
}

// Query tiles, grid (tiles, hq). Pass 1: m (an integer max of order keys) and the flag of a non-finite
// key or value row among 0..t; pass 2: L = sum RNE(p 2^21). Writes m and L to row_stats and the
// poisoned flag to row_info[2]. Shared: partial sums, q rows, k rows, scalars.
template <int DP>
__device__ __forceinline__ void rlp_attt_stats(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, double scale,
    const int* __restrict__ q_int, const int* __restrict__ k_int, const int* __restrict__ k_exponents,
    const int* __restrict__ v_exponents, int* __restrict__ row_info, double* __restrict__ row_stats, double* smem) {
    using T = RlpAttp<DP>;
    using D = RlpAttpDots<T::BQ, T::BK>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD;
    double* px = smem;
    int* qs = reinterpret_cast<int*>(px + D::PARTS);
    int* ks = qs + BQ * LD;
    RlpAtttRows<BQ, BK>& s = *reinterpret_cast<RlpAtttRows<BQ, BK>*>(px + D::PARTS + rlp_attp_words((BQ + BK) * LD));
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attp_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attt_row_scalars<BQ, BK>(s, row_info, row_stats, t0, rows, hq, h);
    for (int r = threadIdx.x; r < BQ; r += RLP_ATTP_THREADS) { s.key[r] = 0u; s.flag[r] = 0u; s.sum[r] = 0ull; }
    for (int pass = 0; pass < 2; ++pass) {
        for (long long j0 = start; j0 < t0 + rows; j0 += BK) {
            const long long left = t0 + rows - j0;
            const int keys = (int)(left < (long long)BK ? left : (long long)BK);
            __syncthreads();
            rlp_attp_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
            rlp_attt_key_scalars<BQ, BK>(s, k_exponents, v_exponents, j0, keys, hkv, g);
            __syncthreads();
            rlp_attp_dots<DP, BQ, BK, false>(qs, ks, qs, ks, px, px);
            __syncthreads();
            for (int o = threadIdx.x; o < D::OUT; o += RLP_ATTP_THREADS) {
                const int r = o / BK, c = o - r * BK;
                if (r >= rows || c >= keys || j0 + c > t0 + r || s.bad[r] != 0) continue;
                if (s.ek[c] == RLP_NONFINITE_EXPONENT || s.ev[c] == RLP_NONFINITE_EXPONENT) {
                    atomicOr(&s.flag[r], 1u);
                    continue;
                }
                const float sc = rlp_double2float_rn(
                    (rlp_attp_sum<BQ, BK>(px, o) * rlp_pow2_f64(s.eq[r] + s.ek[c] - RLP_ATT_SCORE_SHIFT)) * scale);
                if (pass == 0) {
                    atomicMax(&s.key[r], rlp_att_order_key(sc));
                } else {
                    const long long part = rlp_double2ll_rn((double)rlp_exp_f32(sc - s.m[r]) * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                    if (part != 0) atomicAdd(&s.sum[r], (unsigned long long)part);
                }
            }
        }
        __syncthreads();
        if (pass == 0) rlp_attt_stats_max<BQ, RLP_ATTP_THREADS>(s);
    }
    __syncthreads();
    rlp_attt_stats_write<RLP_ATTP_THREADS>(s, row_info, row_stats, t0, rows, hq, h);
}

// dq of a query tile, grid (tiles, hq): for each key block of 64 positions (ascending, up to the tile's
// last row), the u = dS 2^ek of the tile's rows x the block's keys and each row's largest field; U in
// place of u; each row's exact partials sum_c U qk; acc += partial 2^(E - 26), one add per block.
// Shared: partial sums of S and dP, u / U [BQ][64], q, do, k, v rows, scalars.
template <int DP>
__device__ __forceinline__ void rlp_attt_dq(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dq, double* smem) {
    using T = RlpAttp<DP>;
    using D = RlpAttpDots<T::BQ, T::BK>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD, NB = RLP_ATTB_BLOCK, ACC = BQ * DP / RLP_ATTP_THREADS;
    double* px = smem;
    double* py = px + D::PARTS;
    double* us = py + D::PARTS;
    int* qs = reinterpret_cast<int*>(us + BQ * NB);
    int* dos = qs + BQ * LD;
    int* ks = dos + BQ * LD;
    int* vs = ks + BK * LD;
    RlpAtttRows<BQ, BK>& s = *reinterpret_cast<RlpAtttRows<BQ, BK>*>(us + BQ * NB + rlp_attp_words(2 * (BQ + BK) * LD));
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start, last = tile.t0 + tile.rows;  // keys j < last
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attp_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attp_load<DP, BQ>(dos, do_int, t0 * hq + h, hq, rows);
    rlp_attt_row_scalars<BQ, BK>(s, row_info, row_stats, t0, rows, hq, h);
    double acc[ACC];
#pragma unroll
    for (int k = 0; k < ACC; ++k) acc[k] = 0.0;
    for (long long jb = start; jb < last; jb += NB) {
        const int steps = (int)(((last - jb < NB ? last - jb : NB) + BK - 1) / BK);
        __syncthreads();  // the previous block's fields are read
        for (int r = threadIdx.x; r < BQ; r += RLP_ATTP_THREADS) s.field[r] = 0u;
        for (int step = 0; step < steps; ++step) {
            const long long j0 = jb + step * BK;
            const int keys = (int)(last - j0 < (long long)BK ? last - j0 : (long long)BK);
            __syncthreads();
            rlp_attp_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
            rlp_attp_load<DP, BK>(vs, v_int, j0 * hkv + g, hkv, keys);
            rlp_attt_key_scalars<BQ, BK>(s, k_exponents, v_exponents, j0, keys, hkv, g);
            __syncthreads();
            rlp_attp_dots<DP, BQ, BK, true>(qs, ks, dos, vs, px, py);
            __syncthreads();
            for (int o = threadIdx.x; o < D::OUT; o += RLP_ATTP_THREADS) {
                const int r = o / BK, c = o - r * BK;
                double u = 0.0;
                if (r < rows && c < keys && j0 + c <= t0 + r && s.bad[r] == 0) {
                    double big_p, ds;
                    rlp_attt_pair(rlp_attp_sum<BQ, BK>(px, o), rlp_attp_sum<BQ, BK>(py, o), s.eq[r], s.ek[c],
                                  s.edo[r], s.ev[c], s.m[r], s.total[r], s.delta[r], scale, &big_p, &ds);
                    u = ds * rlp_pow2_f64(s.ek[c]);
                    const unsigned int field = rlp_attb_field(u);
                    if (field) atomicMax(&s.field[r], field);
                }
                us[r * NB + step * BK + c] = u;
            }
        }
        __syncthreads();
        for (int o = threadIdx.x; o < BQ * NB; o += RLP_ATTP_THREADS) {
            const int r = o / NB;
            if (o - r * NB < steps * BK) us[o] = (double)rlp_attb_quantize(us[o], rlp_attb_exponent(s.field[r]));
        }
        double part[ACC];
#pragma unroll
        for (int k = 0; k < ACC; ++k) part[k] = 0.0;
        for (int step = steps - 1; step >= 0; --step) {  // the last step's k rows are still loaded
            __syncthreads();
            if (step != steps - 1) {
                const long long j0 = jb + step * BK;
                rlp_attp_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, (int)(last - j0 < BK ? last - j0 : BK));
                __syncthreads();
            }
            rlp_attp_accumulate<DP, BQ, BK>(part, us + step * BK, NB, ks);
        }
#pragma unroll
        for (int k = 0; k < ACC; ++k)
            acc[k] = rlp_attb_add_block(acc[k], rlp_double2ll_rn(part[k]),
                                        s.field[threadIdx.x / DP + k * (RLP_ATTP_THREADS / DP)], RLP_ATT_KV_BITS - 2);
    }
    const int col = threadIdx.x % DP;
#pragma unroll
    for (int k = 0; k < ACC; ++k) {
        const int r = threadIdx.x / DP + k * (RLP_ATTP_THREADS / DP);
        if (r >= rows || col >= d) continue;
        dq[((t0 + r) * hq + h) * (long long)d + col] = s.bad[r] ? rlp_canonical_nan() : rlp_double2float_rn(acc[k]);
    }
}

// The dkv kernel's scalars: a step's query rows and the tile's key rows (their largest fields of
// dS 2^eq and P 2^edo in the current block, and whether a poisoned query row reaches them).
template <int BQ2, int BKV>
struct RlpAtttKeys {
    int r_eq[BQ2], r_edo[BQ2], r_bad[BQ2];
    float r_m[BQ2];
    double r_total[BQ2], r_delta[BQ2];
    int c_ek[BKV], c_ev[BKV];
    unsigned int c_fk[BKV], c_fv[BKV], c_bad[BKV];
};

// dk, dv of a key tile, grid (key tiles, hkv): key_tiles[2 i] = sequence, [2 i + 1] = first key j0
// (a multiple of BKV from the sequence start, so the tile lies in one block of 64 positions). For each
// query block from the tile's own (ascending) and each q head of the group (ascending): the u of the
// block's queries x the tile's keys (dS 2^eq, P 2^edo) and each key's largest fields; U in place of u;
// the exact partials sum_c U qq and sum_c U qdo; acc += partial 2^(E - 34), one add per block.
// Shared: partial sums of S^T and dP^T, u / U [BKV][64] of dk and dv, k, v, q, do rows, scalars.
template <int DP>
__device__ __forceinline__ void rlp_attt_dkv(
    const int* __restrict__ key_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dk,
    float* __restrict__ dv, double* smem) {
    using T = RlpAttp<DP>;
    using D = RlpAttpDots<T::BKV, T::BQ2>;
    constexpr int BKV = T::BKV, BQ2 = T::BQ2, LD = T::LD, NB = RLP_ATTB_BLOCK, ACC = BKV * DP / RLP_ATTP_THREADS;
    double* px = smem;
    double* py = px + D::PARTS;
    double* uk = py + D::PARTS;
    double* uv = uk + BKV * NB;
    int* ks = reinterpret_cast<int*>(uv + BKV * NB);
    int* vs = ks + BKV * LD;
    int* qs = vs + BKV * LD;
    int* dos = qs + BQ2 * LD;
    RlpAtttKeys<BQ2, BKV>& s =
        *reinterpret_cast<RlpAtttKeys<BQ2, BKV>*>(uv + BKV * NB + rlp_attp_words(2 * (BKV + BQ2) * LD));
    const int seq = key_tiles[2 * blockIdx.x];
    const long long j0 = key_tiles[2 * blockIdx.x + 1];
    const long long start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    const int rows = (int)(end - j0 < (long long)BKV ? end - j0 : (long long)BKV);
    const int g = blockIdx.y, group = hq / hkv;
    rlp_attp_load<DP, BKV>(ks, k_int, j0 * hkv + g, hkv, rows);
    rlp_attp_load<DP, BKV>(vs, v_int, j0 * hkv + g, hkv, rows);
    for (int r = threadIdx.x; r < BKV; r += RLP_ATTP_THREADS) {
        const long long kr = (j0 + r) * hkv + g;
        s.c_ek[r] = r < rows ? k_exponents[kr] : 0;
        s.c_ev[r] = r < rows ? v_exponents[kr] : 0;
        s.c_bad[r] = 0u;
    }
    double acc_k[ACC], acc_v[ACC];
#pragma unroll
    for (int k = 0; k < ACC; ++k) { acc_k[k] = 0.0; acc_v[k] = 0.0; }
    for (long long tb = start + (j0 - start) / NB * NB; tb < end; tb += NB) {
        // the block's steps that hold a query t >= j0: [first, steps)
        const int first = (int)((j0 > tb ? j0 - tb : 0) / BQ2);
        const int steps = (int)(((end - tb < NB ? end - tb : NB) + BQ2 - 1) / BQ2);
        for (int hh = 0; hh < group; ++hh) {
            const int h = g * group + hh;
            __syncthreads();  // the previous block's fields are read
            for (int r = threadIdx.x; r < BKV; r += RLP_ATTP_THREADS) { s.c_fk[r] = 0u; s.c_fv[r] = 0u; }
            for (int step = first; step < steps; ++step) {
                const long long t0 = tb + step * BQ2;
                const int qrows = (int)(end - t0 < (long long)BQ2 ? end - t0 : (long long)BQ2);
                __syncthreads();
                rlp_attp_load<DP, BQ2>(qs, q_int, t0 * hq + h, hq, qrows);
                rlp_attp_load<DP, BQ2>(dos, do_int, t0 * hq + h, hq, qrows);
                for (int c = threadIdx.x; c < BQ2; c += RLP_ATTP_THREADS) {
                    const long long it = (t0 + c) * hq + h;
                    const bool in = c < qrows;
                    s.r_eq[c] = in ? row_info[3 * it] : 0;
                    s.r_edo[c] = in ? row_info[3 * it + 1] : 0;
                    s.r_bad[c] = in ? row_info[3 * it + 2] : 1;
                    s.r_m[c] = in ? rlp_double2float_rn(row_stats[3 * it]) : 0.0f;
                    s.r_total[c] = in ? row_stats[3 * it + 1] : 1.0;
                    s.r_delta[c] = in ? row_stats[3 * it + 2] : 0.0;
                }
                __syncthreads();
                rlp_attp_dots<DP, BKV, BQ2, true>(ks, qs, vs, dos, px, py);
                __syncthreads();
                for (int o = threadIdx.x; o < D::OUT; o += RLP_ATTP_THREADS) {
                    const int r = o / BQ2, c = o - r * BQ2;  // key row r, query row c
                    double ku = 0.0, vu = 0.0;
                    if (r < rows && c < qrows && j0 + r <= t0 + c) {
                        if (s.r_bad[c] != 0) {
                            atomicOr(&s.c_bad[r], 1u);
                        } else {
                            double big_p, ds;
                            rlp_attt_pair(rlp_attp_sum<BKV, BQ2>(px, o), rlp_attp_sum<BKV, BQ2>(py, o), s.r_eq[c],
                                          s.c_ek[r], s.r_edo[c], s.c_ev[r], s.r_m[c], s.r_total[c], s.r_delta[c],
                                          scale, &big_p, &ds);
                            ku = ds * rlp_pow2_f64(s.r_eq[c]);
                            vu = big_p * rlp_pow2_f64(s.r_edo[c]);
                            const unsigned int fk = rlp_attb_field(ku), fv = rlp_attb_field(vu);
                            if (fk) atomicMax(&s.c_fk[r], fk);
                            if (fv) atomicMax(&s.c_fv[r], fv);
                        }
                    }
                    uk[r * NB + step * BQ2 + c] = ku;
                    uv[r * NB + step * BQ2 + c] = vu;
                }
            }
            __syncthreads();
            for (int o = threadIdx.x; o < BKV * NB; o += RLP_ATTP_THREADS) {
                const int r = o / NB, c = o - r * NB;
                if (c < first * BQ2 || c >= steps * BQ2) continue;
                uk[o] = (double)rlp_attb_quantize(uk[o], rlp_attb_exponent(s.c_fk[r]));
                uv[o] = (double)rlp_attb_quantize(uv[o], rlp_attb_exponent(s.c_fv[r]));
            }
            double part_k[ACC], part_v[ACC];
#pragma unroll
            for (int k = 0; k < ACC; ++k) { part_k[k] = 0.0; part_v[k] = 0.0; }
            for (int step = steps - 1; step >= first; --step) {  // the last step's q, do rows are still loaded
                __syncthreads();
                if (step != steps - 1) {
                    const long long t0 = tb + step * BQ2;
                    const int qrows = (int)(end - t0 < (long long)BQ2 ? end - t0 : (long long)BQ2);
                    rlp_attp_load<DP, BQ2>(qs, q_int, t0 * hq + h, hq, qrows);
                    rlp_attp_load<DP, BQ2>(dos, do_int, t0 * hq + h, hq, qrows);
                    __syncthreads();
                }
                rlp_attp_accumulate<DP, BKV, BQ2>(part_k, uk + step * BQ2, NB, qs);
                rlp_attp_accumulate<DP, BKV, BQ2>(part_v, uv + step * BQ2, NB, dos);
            }
#pragma unroll
            for (int k = 0; k < ACC; ++k) {
                const int r = threadIdx.x / DP + k * (RLP_ATTP_THREADS / DP);
                acc_k[k] = rlp_attb_add_block(acc_k[k], rlp_double2ll_rn(part_k[k]), s.c_fk[r], RLP_ATTB_ROW_SHIFT);
                acc_v[k] = rlp_attb_add_block(acc_v[k], rlp_double2ll_rn(part_v[k]), s.c_fv[r], RLP_ATTB_ROW_SHIFT);
            }
        }
    }
    __syncthreads();
    const int col = threadIdx.x % DP;
#pragma unroll
    for (int k = 0; k < ACC; ++k) {
        const int r = threadIdx.x / DP + k * (RLP_ATTP_THREADS / DP);
        if (r >= rows || col >= d) continue;
        const long long at = ((j0 + r) * hkv + g) * d + col;
        const bool poisoned = s.c_bad[r] != 0u;
        dk[at] = poisoned ? rlp_canonical_nan() : rlp_double2float_rn(acc_k[k]);
        dv[at] = poisoned ? rlp_canonical_nan() : rlp_double2float_rn(acc_v[k]);
    }
}

// stats' and dq's: q_tiles[2 i] = sequence, q_tiles[2 i + 1] = first token of tile i; grid (tiles, hq)
#define RLP_ATTT_QUERY_ARGS                                                                                      \
    const int *__restrict__ q_tiles, const long long *__restrict__ cu_seqlens, int hq, int hkv, int d, double scale, \
        const int *__restrict__ q_int, const int *__restrict__ do_int, const int *__restrict__ k_int,   \
        const int *__restrict__ v_int, const int *__restrict__ k_exponents, const int *__restrict__ v_exponents, \
        int *__restrict__ row_info, double *__restrict__ row_stats, float *__restrict__ dq

// dkv's: key_tiles[2 i] = sequence, key_tiles[2 i + 1] = first key of tile i; grid (tiles, hkv)
#define RLP_ATTT_KEY_ARGS                                                                                        \
    const int *__restrict__ key_tiles, const long long *__restrict__ cu_seqlens, int hq, int hkv, int d,         \
        double scale, const int *__restrict__ q_int, const int *__restrict__ do_int, const int *__restrict__ k_int, \
        const int *__restrict__ v_int, const int *__restrict__ k_exponents, const int *__restrict__ v_exponents,   \
        const int *__restrict__ row_info, const double *__restrict__ row_stats, float *__restrict__ dk,          \
        float *__restrict__ dv

// stats, dq and dkv of padded head_dim DP
#define RLP_ATTT_ENTRIES(DP, STATS, DQ, DKV)                                                                     \
    extern "C" __global__ void __launch_bounds__(RLP_ATTP_THREADS) STATS(RLP_ATTT_QUERY_ARGS) {                  \
        RLP_DYNAMIC_SHARED(double, rlp_attt_smem);                                                                \
        rlp_attt_stats<DP>(q_tiles, cu_seqlens, hq, hkv, scale, q_int, k_int, k_exponents, v_exponents, row_info, \
                           row_stats, rlp_attt_smem);                                                            \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(RLP_ATTP_THREADS) DQ(RLP_ATTT_QUERY_ARGS) {                     \
        RLP_DYNAMIC_SHARED(double, rlp_attt_smem);                                                                \
        rlp_attt_dq<DP>(q_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,        \
                        v_exponents, row_info, row_stats, dq, rlp_attt_smem);                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(RLP_ATTP_THREADS) DKV(RLP_ATTT_KEY_ARGS) {                      \
        RLP_DYNAMIC_SHARED(double, rlp_attt_smem);                                                                \
        rlp_attt_dkv<DP>(key_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,     \
                         v_exponents, row_info, row_stats, dk, dv, rlp_attt_smem);                               \
    }

// padded head_dim 64, 128 and 256 (192 runs as 256)
RLP_ATTT_ENTRIES(64, attention_backward_tiled_stats_d64, attention_backward_tiled_dq_d64,
                 attention_backward_tiled_dkv_d64)
RLP_ATTT_ENTRIES(128, attention_backward_tiled_stats_d128, attention_backward_tiled_dq_d128,
                 attention_backward_tiled_dkv_d128)
RLP_ATTT_ENTRIES(256, attention_backward_tiled_stats_d256, attention_backward_tiled_dq_d256,
                 attention_backward_tiled_dkv_d256)
