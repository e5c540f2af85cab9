// Kernel family "attention": exact causal GQA attention over the encoded (fixed-point) KV cache.
// Contract: contracts/attention.toml. Reference: rlportable/contract/attention.py
// (attention, attention_encoded). backends/hip/attention.hip is the same logic, line for
// line, in HIP spellings.
//
// Every reduction here is exact: the scores' dot products and the sums L and N_d are
// int64 sums, the maxima (m, E, the q row's exponent) are integer maxima, all combined
// with shared-memory atomics. So the bits depend on nothing but the query row and the
// keys 0..t of its sequence: not on the thread count, the grid, the warp width, or on
// whether a score was kept in shared memory or computed again.
#include "common.cuh"
#include "contract_math.cuh"

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
    return __double2float_rn((__ll2double_rn(s) * rlp_pow2_f64(eq + ek - RLP_ATT_SCORE_SHIFT)) * scale);
}

// A float32's bits mapped to an unsigned key with the same order (-inf < ... < -0 < +0 < ... < +inf),
// so the maximum score is an integer atomicMax.
// o_d = RNE_f32((N_d 2^(E - 13)) / L): the float64 product is exact (a power of two), then one IEEE
// divide and one conversion. L < 2^53 and |N_d| < 2^53 convert exactly.
__device__ __forceinline__ float rlp_att_output(long long numerator, int e_max, long long total) {
    return __double2float_rn((__ll2double_rn(numerator) * rlp_pow2_f64(e_max - RLP_ATT_V_SHIFT)) /
                             __ll2double_rn(total));
}

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
        for (int i = threadIdx.x; i < d; i += blockDim.x) local = max(local, rlp_magnitude_bits(qr[i]));
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
                local_key = max(local_key, rlp_att_order_key(s));
                local_ev = max(local_ev, (unsigned int)(ev + RLP_ATT_EV_OFFSET));
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
                        local_total += __double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                        weights[threadIdx.x] =
                            (int)__double2ll_rn(p * rlp_pow2_f64(v_exponents[row] - e_max + RLP_ATT_P_SHIFT));
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
// Split-KV path ("split" in ops/attention.py, CUDA and HIP): the SAME contract, the same bits as
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
//   S_j = sum_d qq_d qk_jd through int8 digit pairs (rlp_atts_dot4: c + the 4 products of signed bytes):
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
// attention_split_scores is built for 8 blocks of RLP_ATTS_THREADS per multiprocessor (64 registers, no
// spill), attention_split_values_h2 for 8 too (64 registers, 48 bytes of spills outside the value loop)
// and the 4-head attention_split_values for 6 (80 registers, 16 bytes of spills): the fastest occupancies
// in scripts/probe_attention.py's sweeps on the H200 (RLP_PROBE_EXPONENTS=flat). The 2-head build at 8
// (bench/results/attention_probe_h2_blocks_h200.json): 77.1 -> 73.2 us at 384 keys, 39.8 -> 35.5 at 128,
// 115.3 -> 110.7 at 640; 256 rows x 8 KV heads then fill two waves of blocks instead of three (at 6 it was
// also the fastest before the value pass's early loads).

// c + the four products of the signed bytes of a and b, exact in int32.
__device__ __forceinline__ int rlp_atts_dot4(int a, int b, int c) { return __dp4a(a, b, c); }

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
    return __double2ll_rn(sum * rlp_pow2_f64(537) * rlp_pow2_f64(537));
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
extern "C" __global__ void __launch_bounds__(RLP_ATTS_THREADS, 8) attention_split_scores(
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
        const long long end = bad_row ? lo : min(lo + chunk, (long long)t + 1);
        if (threadIdx.x == 0) {
            max_ev = 0u;
            // keys no split covers lie beyond the tables (splits * chunk >= max_blocks * block_size)
            flags = (!bad_row && split == splits - 1 && (long long)t >= keys) ? RLP_ATT_BAD_INDEX : 0u;
        }
        for (int h0 = 0; h0 < group; h0 += RLP_ATTS_SCORE_HEADS) {
            const int nb = min(group - h0, RLP_ATTS_SCORE_HEADS);
            const long long qrow0 = token * hq + (long long)g * group + h0;  // the round's first q row
            if (threadIdx.x < nb) { largest[threadIdx.x] = 0u; head_key[threadIdx.x] = 0u; }
            __syncthreads();
            for (int hi = 0; hi < nb; ++hi) {
                unsigned int local = 0u;
                for (int i = threadIdx.x; i < d; i += blockDim.x)
                    local = max(local, rlp_magnitude_bits(q[(qrow0 + hi) * d + i]));
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
                            local_ev = max(local_ev, (unsigned int)(ev + RLP_ATT_EV_OFFSET));
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
                    b0[c] = __ldg(kr + at);
                    b1[c] = __ldg(kr + pieces + at);
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
                        local_key[hi] = max(local_key[hi], rlp_att_order_key(score));
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
        const int first_heads = min(group, HEADS);
        unsigned int first_key = 0u, first_bad = 0u;
        if (PREFETCH && (int)threadIdx.x < first_heads) {
            for (int s = 0; s < splits; ++s) first_key = max(first_key, split_keys[(first_qrow + threadIdx.x) * splits + s]);
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
        const long long end = bad_row ? lo : min(lo + chunk, (long long)t + 1);
        if (threadIdx.x == 0) { max_ev = 0u; flags = 0u; }
        __syncthreads();
        unsigned int local_ev = 0u;
        unsigned int local_flags = 0u;
        for (int s = threadIdx.x; s < splits; s += blockDim.x) {
            const unsigned int info = split_info[rowg * splits + s];
            local_ev = max(local_ev, info & 0xffffu);
            local_flags |= info >> 16;
        }
        rlp_block_max_u32(&max_ev, local_ev);
        rlp_block_or_u32(&flags, local_flags);
        __syncthreads();
        const int e_max = (int)max_ev - RLP_ATT_EV_OFFSET;
        const bool row_ok = !bad_row && flags == 0u;  // block-uniform
        for (int h0 = 0; h0 < group; h0 += HEADS) {
            const int nb = min(group - h0, HEADS);
            const long long qrow0 = token * hq + (long long)g * group + h0;
            if (threadIdx.x == 0) any_ok = 0;
            __syncthreads();
            for (int hi = threadIdx.x; hi < nb; hi += blockDim.x) {
                const bool first = PREFETCH && h0 == 0 && hi == (int)threadIdx.x;  // loaded with the item
                unsigned int key = first ? first_key : 0u;
                if (!first)
                    for (int s = 0; s < splits; ++s) key = max(key, split_keys[(qrow0 + hi) * splits + s]);
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
                                parts[hi] += __double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) + (__double2ll_rn(w) << 32);
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
                const int span = (int)min(end - base, (long long)RLP_ATTS_TILE);
                for (int k0 = lane; lane < lanes && k0 < span; k0 += stride) {
                    int low[KEYS], high[KEYS];
#pragma unroll
                    for (int u = 0; u < KEYS; ++u) {  // keys up to the tile's end: weights 0
                        const signed char* row = v_digits + key_offsets[k0 + u * lanes] + column;
                        low[u] = __ldg(reinterpret_cast<const int*>(row));
                        high[u] = __ldg(reinterpret_cast<const int*>(row + dp));
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
extern "C" __global__ void __launch_bounds__(RLP_ATTS_THREADS, 6) attention_split_values(
    const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, int hq, int hkv, int d, int dp,
    int num_seqs, const signed char* __restrict__ v_digits, int splits, int chunk, const float* __restrict__ scores,
    const long long* __restrict__ key_rows, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    long long* __restrict__ part_total, long long* __restrict__ part_num, float* __restrict__ out) {
    extern __shared__ unsigned long long rlp_atts_values_smem[];  // [lane][head of the round][dp]: N_d + B W parts
    rlp_atts_values<RLP_ATTS_VALUE_HEADS>(q_seq, q_pos, tq, hq, hkv, d, dp, num_seqs, v_digits, splits, chunk,
                                          scores, key_rows, split_keys, split_info, query_bad, part_total, part_num,
                                          out, rlp_atts_values_smem);
}

// rlp_atts_values with rounds of up to 2 q heads, for groups of 1 or 2 (ops/attention.py picks it): half
// the register sums of the 4-head build, the same bits.
extern "C" __global__ void __launch_bounds__(RLP_ATTS_THREADS, 8) attention_split_values_h2(
    const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, int hq, int hkv, int d, int dp,
    int num_seqs, const signed char* __restrict__ v_digits, int splits, int chunk, const float* __restrict__ scores,
    const long long* __restrict__ key_rows, const unsigned int* __restrict__ split_keys,
    const unsigned int* __restrict__ split_info, const unsigned int* __restrict__ query_bad,
    long long* __restrict__ part_total, long long* __restrict__ part_num, float* __restrict__ out) {
    extern __shared__ unsigned long long rlp_atts_values_smem[];  // [lane][head of the round][dp]: N_d + B W parts
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
            local_key = max(local_key, split_keys[item * splits + s]);
            local_ev = max(local_ev, info & 0xffffu);
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
// Tensor-core path (CUDA only, sm_80+: mma.sync m16n8k32 s8): the SAME contract, the same
// bits as attention_paged (every sum is an exact integer sum, every max an exact max).
//
// A block takes 64 consecutive query rows (token indices) of one q head: grid (ceil(tq/64), hq),
// 256 threads = 8 warps. Warps 2p and 2p+1 own rows 16p..16p+15 of the tile; in the score
// products warp half h = warp % 2 takes keys 32h..32h+31 of each 64-key tile, in the value
// products it takes the columns [h dp/2, (h+1) dp/2). Rows of several sequences in one tile
// are served one sequence per round (rows of other sequences are idle in that round), so the
// kernel takes any q_seq / q_pos, like attention_paged.
// Pass 1 (per key tile): S = sum_d qq_d qk_jd from 3 x 2 digit-pair int8 products, grouped by
// shift i + j in int32 (|group| <= 2 * 512 * 2^14 = 2^24) and combined exactly in int64; the
// score as rlp_att_score; m (order keys), E (ev + offset) and the flags per row: exact maxima
// over the row's own keys j <= t, reduced across threads with shuffles and shared atomics.
// Pass 2 (per key tile): the scores again (same bits), p = rlp_exp_f32(s - m), L += RNE(p 2^21)
// (int64), w = RNE(p 2^(ev - E + 21)) <= 2^21 as 3 balanced int8 digits in shared memory, and
// N_d += sum_j w_j qv_jd: int8 products with the 64 keys as the reduction dimension (V staged
// transposed, [digit][d][key]), 4 shift groups in int32 per key tile (|group| <= 64 * 2 * 2^14
// = 2^21), combined into int64 accumulators in registers. o_d as attention_paged.
// Fragments: thread (g = lane/4, t = lane%4) takes bytes [16t, 16t+16) of each 64-byte chunk of
// the reduction dimension for both operands (a permutation of it that A and B share: the
// integer sums are unchanged), so every fragment is one 16-byte shared-memory load.
#define RLP_ATTM_BQ 64
#define RLP_ATTM_BK 64
#define RLP_ATTM_THREADS 256

__device__ __forceinline__ void rlp_attm_mma(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ int rlp_attm_word(const int4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// groups[i + j] += A_i x B_j over one 64-wide chunk of the reduction dimension (2 mma steps);
// a[i][r]: rows g (r = 0) and g + 8 (r = 1); b[j]: column g.
__device__ __forceinline__ void rlp_attm_chunk(int (&acc)[4][4], const int4 (&a)[3][2], const int4 (&b)[2]) {
#pragma unroll
    for (int step = 0; step < 2; ++step)
#pragma unroll
        for (int i = 0; i < 3; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                rlp_attm_mma(acc[i + j], rlp_attm_word(a[i][0], 2 * step), rlp_attm_word(a[i][1], 2 * step),
                             rlp_attm_word(a[i][0], 2 * step + 1), rlp_attm_word(a[i][1], 2 * step + 1),
                             rlp_attm_word(b[j], 2 * step), rlp_attm_word(b[j], 2 * step + 1));
}

__device__ __forceinline__ long long rlp_attm_combine(const int (&acc)[4][4], int c) {
    return (((long long)acc[3][c] * 256 + acc[2][c]) * 256 + acc[1][c]) * 256 + acc[0][c];
}

__device__ __forceinline__ unsigned int rlp_attm_umax_rows(unsigned int v) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

template <int DPMAX>
__device__ __forceinline__ void rlp_attention_mma(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,
    int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ out, signed char* smem) {
    constexpr int NTMAX = DPMAX / 16;  // 8-column tiles of one warp's half of dp
    __shared__ int row_seq[RLP_ATTM_BQ], row_pos[RLP_ATTM_BQ], row_eq[RLP_ATTM_BQ], row_done[RLP_ATTM_BQ];
    __shared__ unsigned int row_mkey[RLP_ATTM_BQ], row_ev[RLP_ATTM_BQ], row_flags[RLP_ATTM_BQ];
    __shared__ unsigned long long row_total[RLP_ATTM_BQ];
    __shared__ long long key_row[RLP_ATTM_BK];
    __shared__ int key_ek[RLP_ATTM_BK], key_ev[RLP_ATTM_BK], key_flag[RLP_ATTM_BK];
    __shared__ int cur_seq, last_pos, pair_max[RLP_ATTM_BQ / 16];

    const int chunks = dp / 64;
    signed char* qs = smem;                          // [3][chunks][64 rows][64]
    signed char* ks = qs + 3 * RLP_ATTM_BQ * dp;     // [2][chunks][64 keys][64]
    signed char* vt = ks + 2 * RLP_ATTM_BK * dp;     // [2][dp][64 keys]
    signed char* ws = vt + 2 * RLP_ATTM_BK * dp;     // [3][64 rows][64 keys]

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int gq = lane / 4, tq4 = lane % 4, pair = warp / 2, half = warp % 2;
    const int h = blockIdx.y, gkv = h / (hq / hkv);
    const long long r0 = (long long)blockIdx.x * RLP_ATTM_BQ;

    // ---- q rows: exponent, 3 balanced digits; rows that cannot run get the canonical NaN now
    for (int rr = warp; rr < RLP_ATTM_BQ; rr += RLP_ATTM_THREADS / 32) {
        const long long row = r0 + rr;
        const bool exists = row < tq;
        const float* qr = q + (exists ? (row * hq + h) * (long long)d : 0);
        unsigned int largest = 0u;
        if (exists)
            for (int i = lane; i < d; i += 32) largest = max(largest, rlp_magnitude_bits(qr[i]));
        for (int o = 16; o >= 1; o /= 2) largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
        const int eq = rlp_row_exponent(largest);
        const int seq = exists ? q_seq[row] : -1;
        const int t = exists ? q_pos[row] : -1;
        const bool bad = exists && (eq == RLP_NONFINITE_EXPONENT || seq < 0 || seq >= num_seqs || t < 0);
        for (int i = lane; i < dp; i += 32) {
            long long v = (exists && !bad && i < d) ? rlp_quantize(qr[i], RLP_ATT_Q_BITS, eq) : 0;
#pragma unroll
            for (int digit = 0; digit < 3; ++digit) {
                long long low = ((v + 128) & 255) - 128;
                v = (v - low) >> 8;
                qs[((digit * chunks + i / 64) * RLP_ATTM_BQ + rr) * 64 + i % 64] = (signed char)low;
            }
        }
        if (bad)
            for (int i = lane; i < d; i += 32) out[(row * hq + h) * (long long)d + i] = rlp_canonical_nan();
        if (lane == 0) {
            row_seq[rr] = seq;
            row_pos[rr] = t;
            row_eq[rr] = bad ? 0 : eq;
            row_done[rr] = (!exists || bad) ? 1 : 0;
        }
    }

    for (;;) {  // one round per sequence among the tile's rows
        if (tid == 0) { cur_seq = 0x7fffffff; last_pos = -1; }
        if (tid < RLP_ATTM_BQ / 16) pair_max[tid] = -1;
        if (tid < RLP_ATTM_BQ) { row_mkey[tid] = 0u; row_ev[tid] = 0u; row_flags[tid] = 0u; row_total[tid] = 0ull; }
        __syncthreads();
        if (tid < RLP_ATTM_BQ && !row_done[tid]) atomicMin(&cur_seq, row_seq[tid]);
        __syncthreads();
        const int seq = cur_seq;
        if (seq == 0x7fffffff) break;  // block-uniform
        if (tid < RLP_ATTM_BQ && !row_done[tid] && row_seq[tid] == seq) {
            atomicMax(&last_pos, row_pos[tid]);
            atomicMax(&pair_max[tid / 16], row_pos[tid]);
        }
        __syncthreads();
        const int last = last_pos;
        const int my_max = pair_max[pair];  // -1: no row of this pair in the round (warp-uniform)
        bool act[2];
        int pos[2], eqr[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int r = 16 * pair + gq + 8 * k;
            act[k] = !row_done[r] && row_seq[r] == seq;
            pos[k] = act[k] ? row_pos[r] : -1;
            eqr[k] = act[k] ? row_eq[r] : 0;
        }

        // Stage one key tile: per-key slot rows and exponents, K digits, and (pass 2) V transposed.
        auto stage = [&](int kb, bool values) {
            __syncthreads();  // the previous tile's readers are done
            if (tid < RLP_ATTM_BK) {
                const int j = kb + tid;
                long long row = -1;
                int f = 0, ek = 0, ev = 0;
                if (j <= last) {
                    const long long slot = rlp_att_slot(block_tables, max_blocks, block_size, num_slots, seq, j);
                    if (slot < 0) {
                        f = RLP_ATT_BAD_INDEX;
                    } else {
                        row = slot * hkv + gkv;
                        ek = k_exponents[row];
                        ev = v_exponents[row];
                        if (ek == RLP_NONFINITE_EXPONENT || ev == RLP_NONFINITE_EXPONENT) { f = RLP_ATT_BAD_KV; ek = 0; ev = 0; }
                    }
                }
                key_row[tid] = row;
                key_ek[tid] = ek;
                key_ev[tid] = ev;
                key_flag[tid] = f;
            }
            __syncthreads();
            const int per = dp / 16;  // 16-byte pieces per digit row
            for (int p = tid; p < RLP_ATTM_BK * 2 * per; p += RLP_ATTM_THREADS) {
                const int piece = p % per, digit = (p / per) % 2, key = p / (2 * per);
                const long long row = key_row[key];
                const int4 v = row >= 0 ? __ldg(reinterpret_cast<const int4*>(k_digits + row * (2LL * dp) +
                                                                             (long long)digit * dp + 16 * piece))
                                        : make_int4(0, 0, 0, 0);
                *reinterpret_cast<int4*>(ks + ((digit * chunks + piece / 4) * RLP_ATTM_BK + key) * 64 + 16 * (piece % 4)) = v;
            }
            if (values) {
                const int dgroups = dp / 4;
                for (int p = tid; p < 2 * (RLP_ATTM_BK / 4) * dgroups; p += RLP_ATTM_THREADS) {
                    const int dg = p % dgroups, kg = (p / dgroups) % (RLP_ATTM_BK / 4), digit = p / (dgroups * (RLP_ATTM_BK / 4));
                    int r[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const long long row = key_row[4 * kg + i];
                        r[i] = row >= 0 ? __ldg(reinterpret_cast<const int*>(v_digits + row * (2LL * dp) +
                                                                            (long long)digit * dp + 4 * dg))
                                        : 0;
                    }
                    // 4 keys x 4 columns of bytes -> 4 columns x 4 keys
                    const unsigned int t0 = __byte_perm(r[0], r[1], 0x5140), t1 = __byte_perm(r[0], r[1], 0x7362);
                    const unsigned int t2 = __byte_perm(r[2], r[3], 0x5140), t3 = __byte_perm(r[2], r[3], 0x7362);
                    int* base = reinterpret_cast<int*>(vt + ((long long)digit * dp + 4 * dg) * RLP_ATTM_BK + 4 * kg);
                    base[0 * RLP_ATTM_BK / 4] = (int)__byte_perm(t0, t2, 0x5410);
                    base[1 * RLP_ATTM_BK / 4] = (int)__byte_perm(t0, t2, 0x7632);
                    base[2 * RLP_ATTM_BK / 4] = (int)__byte_perm(t1, t3, 0x5410);
                    base[3 * RLP_ATTM_BK / 4] = (int)__byte_perm(t1, t3, 0x7632);
                }
            }
            __syncthreads();
        };

        // Scores of this warp's 16 rows x 32 keys (32 half .. 32 half + 31 of the tile):
        // s[nt][c] for row g + 8 (c / 2), key 32 half + 8 nt + 2 t + c % 2.
        auto scores = [&](float (&s)[4][4]) {
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                int acc[4][4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[i][c] = 0;
                const int key = 32 * half + 8 * nt + gq;
                for (int c = 0; c < chunks; ++c) {
                    int4 a[3][2], b[2];
#pragma unroll
                    for (int i = 0; i < 3; ++i)
#pragma unroll
                        for (int r = 0; r < 2; ++r)
                            a[i][r] = *reinterpret_cast<const int4*>(
                                qs + ((i * chunks + c) * RLP_ATTM_BQ + 16 * pair + gq + 8 * r) * 64 + 16 * tq4);
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        b[j] = *reinterpret_cast<const int4*>(ks + ((j * chunks + c) * RLP_ATTM_BK + key) * 64 + 16 * tq4);
                    rlp_attm_chunk(acc, a, b);
                }
#pragma unroll
                for (int c = 0; c < 4; ++c)
                    s[nt][c] = rlp_att_score(rlp_attm_combine(acc, c), eqr[c / 2],
                                             key_ek[32 * half + 8 * nt + 2 * tq4 + (c % 2)], scale);
            }
        };

        // ---- pass 1: m, E, flags
        unsigned int mkey[2] = {0u, 0u}, evk[2] = {0u, 0u}, flg[2] = {0u, 0u};
        for (int kb = 0; kb <= last; kb += RLP_ATTM_BK) {
            stage(kb, false);
            if (kb + 32 * half <= my_max) {  // warp-uniform
                float s[4][4];
                scores(s);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int jl = 32 * half + 8 * nt + 2 * tq4 + (c % 2), k = c / 2;
                        if (act[k] && kb + jl <= pos[k]) {
                            if (key_flag[jl]) {
                                flg[k] |= (unsigned int)key_flag[jl];
                            } else {
                                mkey[k] = max(mkey[k], rlp_att_order_key(s[nt][c]));
                                evk[k] = max(evk[k], (unsigned int)(key_ev[jl] + RLP_ATT_EV_OFFSET));
                            }
                        }
                    }
            }
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            mkey[k] = rlp_attm_umax_rows(mkey[k]);
            evk[k] = rlp_attm_umax_rows(evk[k]);
            flg[k] |= __shfl_xor_sync(0xffffffffu, flg[k], 1);
            flg[k] |= __shfl_xor_sync(0xffffffffu, flg[k], 2);
            if (tq4 == 0 && act[k]) {
                const int r = 16 * pair + gq + 8 * k;
                atomicMax(&row_mkey[r], mkey[k]);
                atomicMax(&row_ev[r], evk[k]);
                atomicOr(&row_flags[r], flg[k]);
            }
        }
        __syncthreads();
        bool ok[2];
        float m[2];
        int e_max[2];
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int r = 16 * pair + gq + 8 * k;
            m[k] = rlp_att_from_order_key(row_mkey[r]);
            e_max[k] = (int)row_ev[r] - RLP_ATT_EV_OFFSET;
            // a non-finite key/value row among 0..t, a missing slot, or m = +-inf (as attention_paged)
            ok[k] = act[k] && row_flags[r] == 0u && rlp_magnitude_bits(m[k]) < 0x7f800000u;
        }

        // ---- pass 2: p, L, weights, N
        long long total[2] = {0, 0};
        long long num[NTMAX][4];
#pragma unroll
        for (int n = 0; n < NTMAX; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) num[n][c] = 0;
        const int ntiles = dp / 16;  // this warp's 8-column tiles
        for (int kb = 0; kb <= last; kb += RLP_ATTM_BK) {
            stage(kb, true);
            const bool pair_in = kb <= my_max;  // warp-uniform, equal for both warps of the pair
            if (pair_in) {
                if (kb + 32 * half <= my_max) {
                    float s[4][4];
                    scores(s);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            const int jl = 32 * half + 8 * nt + 2 * tq4 + (c % 2), k = c / 2;
                            long long w = 0;
                            if (ok[k] && kb + jl <= pos[k]) {
                                const double p = (double)rlp_exp_f32(s[nt][c] - m[k]);
                                total[k] += __double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                                w = __double2ll_rn(p * rlp_pow2_f64(key_ev[jl] - e_max[k] + RLP_ATT_P_SHIFT));
                            }
                            const int r = 16 * pair + gq + 8 * k;
#pragma unroll
                            for (int digit = 0; digit < 3; ++digit) {
                                long long low = ((w + 128) & 255) - 128;
                                w = (w - low) >> 8;
                                ws[(digit * RLP_ATTM_BQ + r) * RLP_ATTM_BK + jl] = (signed char)low;
                            }
                        }
                } else {  // keys beyond every row of the pair: zero weights
                    for (int p = lane; p < 3 * 16 * 2; p += 32) {
                        const int digit = p / 32, r = 16 * pair + (p / 2) % 16, part = p % 2;
                        *reinterpret_cast<int4*>(ws + (digit * RLP_ATTM_BQ + r) * RLP_ATTM_BK + 32 * half + 16 * part) =
                            make_int4(0, 0, 0, 0);
                    }
                }
            }
            __syncthreads();  // the pair's weights are in shared memory
            if (pair_in) {
                int4 a[3][2];
#pragma unroll
                for (int i = 0; i < 3; ++i)
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        a[i][r] = *reinterpret_cast<const int4*>(ws + (i * RLP_ATTM_BQ + 16 * pair + gq + 8 * r) * RLP_ATTM_BK + 16 * tq4);
#pragma unroll
                for (int n = 0; n < NTMAX; ++n) {
                    if (n < ntiles) {
                        const int col = half * (dp / 2) + 8 * n + gq;
                        int4 b[2];
#pragma unroll
                        for (int j = 0; j < 2; ++j)
                            b[j] = *reinterpret_cast<const int4*>(vt + ((long long)j * dp + col) * RLP_ATTM_BK + 16 * tq4);
                        int acc[4][4];
#pragma unroll
                        for (int i = 0; i < 4; ++i)
#pragma unroll
                            for (int c = 0; c < 4; ++c) acc[i][c] = 0;
                        rlp_attm_chunk(acc, a, b);
#pragma unroll
                        for (int c = 0; c < 4; ++c) num[n][c] += rlp_attm_combine(acc, c);
                    }
                }
            }
        }
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            long long sum = total[k];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (tq4 == 0 && ok[k]) atomicAdd(&row_total[16 * pair + gq + 8 * k], (unsigned long long)sum);
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            if (!act[k]) continue;
            const int r = 16 * pair + gq + 8 * k;
            float* orow = out + ((r0 + r) * hq + h) * (long long)d;
            const double denominator = __ll2double_rn((long long)row_total[r]);  // exact: L < 2^53
            const double unit = rlp_pow2_f64(e_max[k] - RLP_ATT_V_SHIFT);
#pragma unroll
            for (int n = 0; n < NTMAX; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = half * (dp / 2) + 8 * n + 2 * tq4 + e;
                    if (n < ntiles && col < d)
                        orow[col] = ok[k] ? __double2float_rn((__ll2double_rn(num[n][2 * k + e]) * unit) / denominator)
                                          : rlp_canonical_nan();
                }
        }
        __syncthreads();
        if (tid < RLP_ATTM_BQ && !row_done[tid] && row_seq[tid] == seq) row_done[tid] = 1;
        // the next round's first __syncthreads orders this before any read of row_done
    }
}

// Shared memory: 448 dp + 12288 bytes (dynamic); ops/attention.py passes it.
#define RLP_ATTENTION_MMA_ENTRY(NAME, DPMAX, MIN_BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(RLP_ATTM_THREADS, MIN_BLOCKS) NAME(                             \
        const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, \
        int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,        \
        int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,          \
        const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,                          \
        const int* __restrict__ v_exponents, float* __restrict__ out) {                                         \
        extern __shared__ int4 rlp_attm_smem[];                                                                  \
        rlp_attention_mma<DPMAX>(q, q_seq, q_pos, tq, hq, hkv, d, dp, scale, block_tables, num_seqs, max_blocks, \
                                 block_size, num_slots, k_digits, k_exponents, v_digits, v_exponents, out,       \
                                 reinterpret_cast<signed char*>(rlp_attm_smem));                                \
    }

// head_dim padded to 64 or 128, and to 192 or 256
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d128, 128, 2)
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d256, 256, 1)

// ---------------------------------------------------------------------------
// Backward (contracts/attention.toml, op "attention_backward"; reference: attention_backward in
// rlportable/contract/attention.py). Packed sequences: key j of token t's sequence is token j, stored
// in slot j of a block-size-1 cache (attention_write_kv), so cache row = j * hkv + g.
// For query row r = token * hq + h (position t, kv head g) and key j <= t, wherever needed (the same
// bits every time): s_j and p_j = exp_f32(s_j - m) exactly as attention_paged;
//   P_j = (p_j 2^21) / L,  dP_j = (sum_d qdo_d qv_jd) 2^(edo + ev_j - 34),  dS_j = (P_j (dP_j - delta)) c.
// Each gradient element is an exact weighted sum of encoded rows: coefficients u_i (dS or P times the
// power of two of the row's exponent) are quantized to 32 bits below their largest exponent field E
// (an integer max), U_i = RNE(u_i 2^(30 - E)); the products U_i r_id (|.| < 2^53) are added into two
// integer sums, lo (each product's low 32 bits) and hi (the rest), so any order, tiling or thread
// count gives the same pair; (hi, lo) is rounded once at the end (rlp_attb_round_wide).
// Scratch (written by attention_backward_rows, read by the other two), per query row r:
//   q_int, do_int [rows, d] int32: the 23-bit q and do rows (0 for a non-finite row)
//   row_info [rows, 3] int32: eq, edo, poisoned (1: the forward's row is NaN, or do or o is non-finite)
//   row_stats [rows, 3] float64: m, L (exact values) and delta = do . o: the exact products
//   w_d = qdo_d o_d quantized to 53 bits below their largest exponent field E_w, summed exactly in
//   int64, delta = float64(sum) 2^(E_w - 51 + edo - 21) (reference: delta_of)
#define RLP_ATTB_DO_BITS 23
#define RLP_ATTB_DELTA_BITS 53
#define RLP_ATTB_COEF_BITS 32
#define RLP_ATTB_DP_SHIFT 34     // (DO_BITS - 2) + (KV_BITS - 2)
#define RLP_ATTB_ROW_SHIFT 21    // a 23-bit row (q, do) counts in units of 2^(e - 21)
#define RLP_ATTB_LOW_BITS 32

// P_j and dS_j of one (query row, key) pair from its two exact dot products; stats: the row's
// (m, L, delta). Reference: _head_gradient_terms (float64 IEEE steps, one rounding each).
__device__ __forceinline__ void rlp_attb_terms(long long s_int, long long dp_int, int eq, int ek, int edo, int ev,
                                               const double* stats, double scale, double* prob, double* ds) {
    const float s = rlp_att_score(s_int, eq, ek, scale);
    const double p = (double)rlp_exp_f32(s - __double2float_rn(stats[0]));
    const double big_p = (p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) / stats[1];
    const double dp = __ll2double_rn(dp_int) * rlp_pow2_f64(edo + ev - RLP_ATTB_DP_SHIFT);
    *prob = big_p;
    *ds = (big_p * (dp - stats[2])) * scale;
}

// The biased exponent field of a float64 (0 for zero): the integer key of the coefficients' max.
// Reference: exponent_fields.
__device__ __forceinline__ unsigned int rlp_attb_field(double u) {
    return (unsigned int)((__double_as_longlong(u) >> 52) & 0x7ffLL);
}

// E from the largest field, 0 for an all-zero sum; U = RNE(u 2^(30 - E)), |U| <= 2^31.
// Reference: quantize_coefficients.
__device__ __forceinline__ int rlp_attb_exponent(unsigned int field) { return field ? (int)field - 1023 : 0; }

__device__ __forceinline__ long long rlp_attb_quantize(double u, int e) {
    return __double2ll_rn(u * rlp_pow2_f64(RLP_ATTB_COEF_BITS - 2 - e));
}

// (lo, hi) += prod: lo takes prod mod 2^32 (in [0, 2^32)), hi takes floor(prod / 2^32).
__device__ __forceinline__ void rlp_attb_add(unsigned long long& lo, long long& hi, long long prod) {
    lo += (unsigned long long)(prod & 0xffffffffLL);
    hi += prod >> RLP_ATTB_LOW_BITS;
}

// RNE_f32((hi 2^32 + lo) 2^e) with one rounding. Normalised to H 2^32 + l (0 <= l < 2^32, |H| < 2^53),
// H 2^32 and l are exact float64; their sum rounded to odd (TwoSum's exact error decides: a nonzero
// error with an even nearest moves one step toward the exact sum), scaled exactly, converted once.
// Reference: round_wide.
__device__ __forceinline__ float rlp_attb_round_wide(unsigned long long lo, unsigned long long hi, int e) {
    const long long high = (long long)hi + (long long)(lo >> RLP_ATTB_LOW_BITS);
    const double a = __ll2double_rn(high) * rlp_pow2_f64(RLP_ATTB_LOW_BITS);
    const double b = __ll2double_rn((long long)(lo & 0xffffffffull));
    const double s = a + b;
    const double bb = s - a;
    const double err = (a - (s - bb)) + (b - bb);
    long long raw = __double_as_longlong(s);
    if (err != 0.0 && (raw & 1LL) == 0LL) raw += ((err > 0.0) == (s > 0.0)) ? 1LL : -1LL;
    return __double2float_rn(__longlong_as_double(raw) * rlp_pow2_f64(e));
}

// sum_i a[i] b[i] of two integer rows, exact in int64.
__device__ __forceinline__ long long rlp_attb_dot_rows(const int* a, const int* __restrict__ b, int d) {
    long long s = 0;
    for (int i = 0; i < d; ++i) s += (long long)a[i] * b[i];
    return s;
}

// One block per (token, q head), grid-stride: the q, do and o row exponents (integer maxima), the
// 23-bit q and do rows (to q_int, do_int), delta (E_w an integer max, then an exact int64 sum), then
// m and L over keys start..token in two passes exactly as attention_paged, and the row's info and stats.
// q, dout, o: [tokens, hq, d] float32; token_seq [tokens] int32; cu_seqlens [num_seqs + 1] int64.
extern "C" __global__ void attention_backward_rows(
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
            local_q = max(local_q, rlp_magnitude_bits(qr[i]));
            local_do = max(local_do, rlp_magnitude_bits(dr[i]));
            local_o = max(local_o, rlp_magnitude_bits(orow[i]));
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
                if (!bad_rows) local_field = max(local_field, rlp_attb_field((double)b * (double)orow[i]));
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
                local_delta += __double2ll_rn(w * rlp_pow2_f64(RLP_ATTB_DELTA_BITS - 2 - e_delta));
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
                local_key = max(local_key, rlp_att_order_key(s));
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
                    local_total += __double2ll_rn((double)rlp_exp_f32(s - m) * rlp_pow2_f64(RLP_ATT_P_SHIFT));
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
            stats[1] = poisoned ? 0.0 : __ll2double_rn((long long)total);  // exact: L < 2^53
            stats[2] = poisoned ? 0.0 : __ll2double_rn((long long)delta_sum)  // |sum| <= 2^61: one rounding
                                            * rlp_pow2_f64(e_delta - (RLP_ATTB_DELTA_BITS - 2) + edo - RLP_ATTB_ROW_SHIFT);
        }
        __syncthreads();
    }
}

// One block per (token, q head), grid-stride: dq_t = sum_{j<=t} dS_j k_j. Pass 1 (threads over keys):
// E, the largest exponent field of u_j = dS_j 2^ek_j. Pass 2 (keys in chunks of blockDim): U_j in
// shared memory, then threads over (key part, d) add U_j qk_jd into the two-word sums.
// dq = RNE_f32(sum 2^(E - 30 - 13)). A poisoned row gives the canonical NaN.
extern "C" __global__ void attention_backward_dq(
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ row_info,
    const double* __restrict__ row_stats, const int* __restrict__ token_seq, const long long* __restrict__ cu_seqlens,
    long long tokens, int hq, int hkv, int d, int dp, double scale, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ dq) {
    __shared__ int qq[RLP_ATT_MAX_HEAD_DIM];
    __shared__ int qdo[RLP_ATT_MAX_HEAD_DIM];
    __shared__ unsigned long long acc_lo[RLP_ATT_MAX_HEAD_DIM];
    __shared__ unsigned long long acc_hi[RLP_ATT_MAX_HEAD_DIM];
    __shared__ long long weights[RLP_ATT_MAX_THREADS];
    __shared__ long long key_rows[RLP_ATT_MAX_THREADS];
    __shared__ unsigned int max_field;
    const int group = hq / hkv;
    const long long items = tokens * hq;
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
                if (i < d) { acc_lo[i] = 0ull; acc_hi[i] = 0ull; }
            }
            if (threadIdx.x == 0) max_field = 0u;
            __syncthreads();
            // ---- pass 1: E
            unsigned int local = 0u;
            for (long long j = start + threadIdx.x; j <= token; j += blockDim.x) {
                const long long row = j * hkv + g;
                const int ek = k_exponents[row];
                double big_p, ds;
                rlp_attb_terms(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp),
                               rlp_att_dot(qdo, v_digits + row * (2LL * dp), d, dp), eq, ek, edo, v_exponents[row],
                               stats, scale, &big_p, &ds);
                local = max(local, rlp_attb_field(ds * rlp_pow2_f64(ek)));
            }
            atomicMax(&max_field, local);
            __syncthreads();
            const int e = rlp_attb_exponent(max_field);
            // ---- pass 2: the exact sums
            const int parts = (int)blockDim.x >= d ? (int)blockDim.x / d : 1;
            for (long long base = start; base <= token; base += blockDim.x) {
                const long long j = base + threadIdx.x;
                const int count = token + 1 - base < (long long)blockDim.x ? (int)(token + 1 - base) : (int)blockDim.x;
                if (j <= token) {
                    const long long row = j * hkv + g;
                    const int ek = k_exponents[row];
                    double big_p, ds;
                    rlp_attb_terms(rlp_att_dot(qq, k_digits + row * (2LL * dp), d, dp),
                                   rlp_att_dot(qdo, v_digits + row * (2LL * dp), d, dp), eq, ek, edo,
                                   v_exponents[row], stats, scale, &big_p, &ds);
                    weights[threadIdx.x] = rlp_attb_quantize(ds * rlp_pow2_f64(ek), e);
                    key_rows[threadIdx.x] = row * (2LL * dp);
                }
                __syncthreads();
                for (int work = threadIdx.x; work < parts * d; work += blockDim.x) {
                    const int part = work / d;
                    const int i = work - part * d;
                    unsigned long long lo = 0ull;
                    long long hi = 0;
                    for (int c = part; c < count; c += parts) {
                        const signed char* kr = k_digits + key_rows[c];
                        rlp_attb_add(lo, hi, weights[c] * ((int)kr[i] + 256 * (int)kr[dp + i]));
                    }
                    if (lo != 0ull || hi != 0) {
                        atomicAdd(&acc_lo[i], lo);
                        atomicAdd(&acc_hi[i], (unsigned long long)hi);
                    }
                }
                __syncthreads();
            }
            const int unit = e - (RLP_ATTB_COEF_BITS - 2) - (RLP_ATT_KV_BITS - 2);
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = rlp_attb_round_wide(acc_lo[i], acc_hi[i], unit);
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = rlp_canonical_nan();
        }
        __syncthreads();
    }
}

// One block per (key token j, kv head g), grid-stride: dk_j = sum dS_tj q_t and dv_j = sum P_tj do_t
// over the n = (end - j) * group pairs (t >= j of j's sequence, h in g's heads), pair w -> t = j + w / group,
// h = g * group + w % group. Pass 1 (threads over pairs): any poisoned pair (then dk_j and dv_j are the
// canonical NaN), else the largest exponent fields of dS 2^eq and P 2^edo. Pass 2 (pairs in chunks of
// blockDim): U in shared memory, then threads over (pair part, d) add U_k q_td and U_v do_td.
extern "C" __global__ void attention_backward_dkv(
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ row_info,
    const double* __restrict__ row_stats, const int* __restrict__ token_seq, const long long* __restrict__ cu_seqlens,
    long long tokens, int hq, int hkv, int d, int dp, double scale, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ dk, float* __restrict__ dv) {
    __shared__ int key_row[RLP_ATT_MAX_HEAD_DIM];
    __shared__ int value_row[RLP_ATT_MAX_HEAD_DIM];
    __shared__ unsigned long long acc[4][RLP_ATT_MAX_HEAD_DIM];  // dk lo, dk hi, dv lo, dv hi
    __shared__ long long key_weights[RLP_ATT_MAX_THREADS];
    __shared__ long long value_weights[RLP_ATT_MAX_THREADS];
    __shared__ long long pair_rows[RLP_ATT_MAX_THREADS];
    __shared__ unsigned int max_field[2];
    __shared__ unsigned int poisoned;
    const int group = hq / hkv;
    const long long items = tokens * hkv;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long j = item / hkv;
        const int g = (int)(item - j * hkv);
        const long long n = (cu_seqlens[token_seq[j] + 1] - j) * group;
        const signed char* kr = k_digits + item * (2LL * dp);  // cache row j * hkv + g
        const signed char* vr = v_digits + item * (2LL * dp);
        const int ek = k_exponents[item];
        const int ev = v_exponents[item];
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            key_row[i] = (int)kr[i] + 256 * (int)kr[dp + i];
            value_row[i] = (int)vr[i] + 256 * (int)vr[dp + i];
            acc[0][i] = 0ull; acc[1][i] = 0ull; acc[2][i] = 0ull; acc[3][i] = 0ull;
        }
        if (threadIdx.x == 0) { max_field[0] = 0u; max_field[1] = 0u; poisoned = 0u; }
        __syncthreads();
        // ---- pass 1: poisoned pairs, the maxima E_k and E_v
        unsigned int local_k = 0u, local_v = 0u, local_bad = 0u;
        for (long long w = threadIdx.x; w < n; w += blockDim.x) {
            const long long r = (j + w / group) * hq + (long long)g * group + w % group;
            const int* info = row_info + 3 * r;
            if (info[2] != 0) { local_bad = 1u; continue; }
            double big_p, ds;
            rlp_attb_terms(rlp_attb_dot_rows(key_row, q_int + r * d, d), rlp_attb_dot_rows(value_row, do_int + r * d, d),
                           info[0], ek, info[1], ev, row_stats + 3 * r, scale, &big_p, &ds);
            local_k = max(local_k, rlp_attb_field(ds * rlp_pow2_f64(info[0])));
            local_v = max(local_v, rlp_attb_field(big_p * rlp_pow2_f64(info[1])));
        }
        atomicMax(&max_field[0], local_k);
        atomicMax(&max_field[1], local_v);
        atomicOr(&poisoned, local_bad);
        __syncthreads();
        float* dk_row = dk + item * (long long)d;
        float* dv_row = dv + item * (long long)d;
        if (poisoned == 0u) {  // block-uniform
            const int e_k = rlp_attb_exponent(max_field[0]);
            const int e_v = rlp_attb_exponent(max_field[1]);
            // ---- pass 2: the exact sums
            const int parts = (int)blockDim.x >= d ? (int)blockDim.x / d : 1;
            for (long long base = 0; base < n; base += blockDim.x) {
                const long long w = base + threadIdx.x;
                const int count = n - base < (long long)blockDim.x ? (int)(n - base) : (int)blockDim.x;
                if (w < n) {
                    const long long r = (j + w / group) * hq + (long long)g * group + w % group;
                    const int* info = row_info + 3 * r;
                    double big_p, ds;
                    rlp_attb_terms(rlp_attb_dot_rows(key_row, q_int + r * d, d),
                                   rlp_attb_dot_rows(value_row, do_int + r * d, d), info[0], ek, info[1], ev,
                                   row_stats + 3 * r, scale, &big_p, &ds);
                    key_weights[threadIdx.x] = rlp_attb_quantize(ds * rlp_pow2_f64(info[0]), e_k);
                    value_weights[threadIdx.x] = rlp_attb_quantize(big_p * rlp_pow2_f64(info[1]), e_v);
                    pair_rows[threadIdx.x] = r * d;
                }
                __syncthreads();
                for (int work = threadIdx.x; work < parts * d; work += blockDim.x) {
                    const int part = work / d;
                    const int i = work - part * d;
                    unsigned long long lo_k = 0ull, lo_v = 0ull;
                    long long hi_k = 0, hi_v = 0;
                    for (int c = part; c < count; c += parts) {
                        const long long at = pair_rows[c] + i;
                        rlp_attb_add(lo_k, hi_k, key_weights[c] * q_int[at]);
                        rlp_attb_add(lo_v, hi_v, value_weights[c] * do_int[at]);
                    }
                    if (lo_k != 0ull || hi_k != 0) {
                        atomicAdd(&acc[0][i], lo_k);
                        atomicAdd(&acc[1][i], (unsigned long long)hi_k);
                    }
                    if (lo_v != 0ull || hi_v != 0) {
                        atomicAdd(&acc[2][i], lo_v);
                        atomicAdd(&acc[3][i], (unsigned long long)hi_v);
                    }
                }
                __syncthreads();
            }
            const int unit_k = e_k - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT;
            const int unit_v = e_v - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT;
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                dk_row[i] = rlp_attb_round_wide(acc[0][i], acc[1][i], unit_k);
                dv_row[i] = rlp_attb_round_wide(acc[2][i], acc[3][i], unit_v);
            }
        } else {
            for (int i = threadIdx.x; i < d; i += blockDim.x) {
                dk_row[i] = rlp_canonical_nan();
                dv_row[i] = rlp_canonical_nan();
            }
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------
// Tiled backward: the CUDA fast path of op "attention_backward", the bits of the rows kernels above
// (ops/attention.py method "tiled"). Tiles of query rows x key columns in shared memory, every
// product on the FP64 tensor cores (mma.sync m16n8k4 f64, sm_80+) over integer operands held exactly
// in float64. Each partial sum of a product stays below 2^53, so each mma result is the exact integer
// sum in any order, and the tiling changes nothing:
//   S = qq . qk, dP = qdo . qv                |terms| < 2^36, D <= 256 terms
//   dq += U_hi . qk, U_lo . qk               U = U_hi 2^16 + U_lo, |U_hi|, |U_lo| <= 2^15 + 1; <= 2^17 keys
//   dk += U_hi . qq, dv += U_hi . qdo (U_lo)  at most RLP_ATTT_MAX_TERMS (q row, head) pairs per launch item
// The steps: _rows (encoded rows, delta), _keys (k, v rows from the cache), _stats (m, L, the poisoned
// flag: two passes over the keys), _fields (the coefficients' largest exponent fields E: per query row
// for dq, per key row for dk and dv, with a poison mark), _dq, _dkv (launch items cut where a key tile
// has more pairs than one item may sum; such tiles add their exact two-word sums with integer atomics
// and _finish rounds them). Shared-memory rows are DP + 4 doubles apart: a half-warp's fragment loads
// then fall on 16 distinct bank pairs.
#define RLP_ATTT_THREADS 256
#define RLP_ATTT_WARPS 8
#define RLP_ATTT_PAD 4
#define RLP_ATTT_POISON 4096u  // a key row's field above every exponent field: a poisoned pair reaches it
#define RLP_ATTT_HALF 16       // U = U_hi 2^16 + U_lo

template <int DP>
struct RlpAttt {
    static constexpr int LD = DP + RLP_ATTT_PAD;
    static constexpr int BQ = 4096 / DP;                        // query rows of a dq / stats / fields tile
    static constexpr int BK = (4096 / DP < 32) ? 4096 / DP : 32;  // keys per step of those
    static constexpr int BKV = 4096 / DP;                       // key rows of a dkv tile
    static constexpr int BQ2 = 32;                              // query rows per step of dkv
    static constexpr int ULD = 32 + RLP_ATTT_PAD;               // coefficient tiles' row stride
};

// One 16x8x4 f64 product. Thread (g, t) = (lane / 4, lane % 4) holds A (g, t) and (g + 8, t), B (t, g),
// C (g, 2t + i) for i = 0, 1 and (g + 8, 2t + i) for i = 2, 3. sm_90 has the m16n8k4 shape, at twice
// m8n8k4's rate (scripts/probe_dmma.py); sm_80 runs it as two m8n8k4 (the same exact sums).
__device__ __forceinline__ void rlp_attt_mma(double (&c)[4], double a0, double a1, double b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a0), "d"(a1), "d"(b));
#else
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(c[0]), "+d"(c[1]) : "d"(a0), "d"(b));
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(c[2]), "+d"(c[3]) : "d"(a1), "d"(b));
#endif
}

// Row and column of element i of a thread's C fragment in a 16x8 block.
__device__ __forceinline__ int rlp_attt_row(int i) { return ((threadIdx.x & 31) >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int rlp_attt_col(int i) { return 2 * (threadIdx.x & 3) + (i & 1); }

// 16x8 blocks of exact dot products: x[n] = a . b_n^T and y[n] = c . e_n^T for 16 rows of a (and c) and
// the NB blocks of 8 rows of b (and e) that follow each other (b_n = b + 8 n ld), rows ld apart, k values
// each (k % 8 == 0; Y: also y). The even and odd k-steps go to two chains (integer sums: any split is
// exact), and a and c serve all NB blocks.
template <int NB, bool Y>
__device__ __forceinline__ void rlp_attt_dots(double (&x)[NB][4], double (&y)[NB][4], const double* a, const double* b,
                                              const double* c, const double* e, int ld, int k) {
    const int off = ((threadIdx.x & 31) >> 2) * ld + (threadIdx.x & 3);
    double x1[NB][4], y1[NB][4];
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { x[n][i] = 0.0; y[n][i] = 0.0; x1[n][i] = 0.0; y1[n][i] = 0.0; }
#pragma unroll 2
    for (int i = 0; i < k; i += 8) {
        const double a0 = a[off + i], a1 = a[off + 8 * ld + i];
        const double a2 = a[off + i + 4], a3 = a[off + 8 * ld + i + 4];
        double c0 = 0.0, c1 = 0.0, c2 = 0.0, c3 = 0.0;
        if (Y) { c0 = c[off + i]; c1 = c[off + 8 * ld + i]; c2 = c[off + i + 4]; c3 = c[off + 8 * ld + i + 4]; }
#pragma unroll
        for (int n = 0; n < NB; ++n) {
            rlp_attt_mma(x[n], a0, a1, b[off + n * 8 * ld + i]);
            rlp_attt_mma(x1[n], a2, a3, b[off + n * 8 * ld + i + 4]);
            if (Y) {
                rlp_attt_mma(y[n], c0, c1, e[off + n * 8 * ld + i]);
                rlp_attt_mma(y1[n], c2, c3, e[off + n * 8 * ld + i + 4]);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { x[n][i] += x1[n][i]; y[n][i] += y1[n][i]; }
}

// The largest of v over the 8 rows of a fragment column (lanes with the same lane % 4).
__device__ __forceinline__ unsigned int rlp_attt_umax_columns(unsigned int v) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 8));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

// acc[n] += U[16 rows, kk] . B[kk rows, 8 columns at 8 n] for N column blocks (U rows uld apart, B rows
// ld apart), both halves of U.
template <int N>
__device__ __forceinline__ void rlp_attt_accumulate(double (&acc)[N][2][4], const double* u_hi, const double* u_lo,
                                                    int uld, const double* b, int ld, int kk) {
    const int lane = threadIdx.x & 31;
    const int a_off = (lane >> 2) * uld + (lane & 3);
    const int b_off = (lane & 3) * ld + (lane >> 2);
#pragma unroll 2
    for (int i = 0; i < kk; i += 4) {
        const double h0 = u_hi[a_off + i], h1 = u_hi[a_off + 8 * uld + i];
        const double l0 = u_lo[a_off + i], l1 = u_lo[a_off + 8 * uld + i];
#pragma unroll
        for (int n = 0; n < N; ++n) {
            const double bv = b[b_off + i * ld + 8 * n];
            rlp_attt_mma(acc[n][0], h0, h1, bv);
            rlp_attt_mma(acc[n][1], l0, l1, bv);
        }
    }
}

// U split exactly into U_hi 2^16 + U_lo with U_lo in [-2^15, 2^15).
__device__ __forceinline__ void rlp_attt_split(long long u, double* hi, double* lo) {
    const long long low = ((u + (1LL << 15)) & 0xffffLL) - (1LL << 15);
    *lo = (double)low;
    *hi = (double)((u - low) >> RLP_ATTT_HALF);
}

// The exact sum hi_sum 2^16 + lo_sum as the two words (lo, hi) rlp_attb_round_wide takes (lo not
// normalised: the two low parts are added, < 2^33).
__device__ __forceinline__ void rlp_attt_words(double hi_sum, double lo_sum, unsigned long long* lo, long long* hi) {
    const long long a = __double2ll_rn(hi_sum);  // exact: integers below 2^53
    const long long b = __double2ll_rn(lo_sum);
    *lo = (((unsigned long long)a << RLP_ATTT_HALF) & 0xffffffffull) + ((unsigned long long)b & 0xffffffffull);
    *hi = (a >> (RLP_ATTB_LOW_BITS - RLP_ATTT_HALF)) + (b >> RLP_ATTB_LOW_BITS);
}

// Rows [count] of DP integers from global (row r at src + (first + r step) DP) into shared memory as
// float64 (exact; stride LD); rows at or beyond `count` are zero. The operands travel as int32, half the
// bytes of float64, and are converted once per tile.
template <int DP, int ROWS>
__device__ __forceinline__ void rlp_attt_load(double* dst, const int* __restrict__ src, long long first,
                                              long long step, int count) {
    constexpr int LD = RlpAttt<DP>::LD;
    for (int i = threadIdx.x; i < ROWS * (DP / 4); i += RLP_ATTT_THREADS) {
        const int r = i / (DP / 4);
        const int c = 4 * (i - r * (DP / 4));
        int4 v = make_int4(0, 0, 0, 0);
        if (r < count) v = *reinterpret_cast<const int4*>(src + (first + r * step) * DP + c);
        double* out = dst + r * LD + c;
        out[0] = (double)v.x;
        out[1] = (double)v.y;
        out[2] = (double)v.z;
        out[3] = (double)v.w;
    }
}

// One warp per (token, q head) row, grid-stride: the rows kernel's encoding for the tiled kernels: q
// and do as 23-bit integers (rows of dpt, zero beyond d; zero for a non-finite row), eq, edo
// and the bad-rows flag (q, do or o non-finite) in row_info, delta in row_stats[2].
__device__ __forceinline__ unsigned int rlp_attt_warp_max(unsigned int v) {
#pragma unroll
    for (int m = 16; m; m >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, m));
    return v;
}

extern "C" __global__ void attention_backward_tiled_rows(
    const float* __restrict__ q, const float* __restrict__ dout, const float* __restrict__ o, long long rows, int d,
    int dpt, int* __restrict__ q_int, int* __restrict__ do_int, int* __restrict__ row_info,
    double* __restrict__ row_stats) {
    const int lane = threadIdx.x & 31;
    const int warps = blockDim.x >> 5;
    for (long long item = (long long)blockIdx.x * warps + (threadIdx.x >> 5); item < rows;
         item += (long long)gridDim.x * warps) {
        const float* qr = q + item * (long long)d;
        const float* dr = dout + item * (long long)d;
        const float* orow = o + item * (long long)d;
        unsigned int local_q = 0u, local_do = 0u, local_o = 0u;
        for (int i = lane; i < d; i += 32) {
            local_q = max(local_q, rlp_magnitude_bits(qr[i]));
            local_do = max(local_do, rlp_magnitude_bits(dr[i]));
            local_o = max(local_o, rlp_magnitude_bits(orow[i]));
        }
        const int eq = rlp_row_exponent(rlp_attt_warp_max(local_q));
        const int edo = rlp_row_exponent(rlp_attt_warp_max(local_do));
        const bool bad_rows = eq == RLP_NONFINITE_EXPONENT || edo == RLP_NONFINITE_EXPONENT ||
                              rlp_row_exponent(rlp_attt_warp_max(local_o)) == RLP_NONFINITE_EXPONENT;
        unsigned int local_field = 0u;
        for (int i = lane; i < dpt; i += 32) {
            int a = 0, b = 0;
            if (i < d && !bad_rows) {
                a = (int)rlp_quantize(qr[i], RLP_ATT_Q_BITS, eq);
                b = (int)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo);
                local_field = max(local_field, rlp_attb_field((double)b * (double)orow[i]));
            }
            q_int[item * dpt + i] = a;
            do_int[item * dpt + i] = b;
        }
        // delta: W_d = RNE(w_d 2^(51 - E_w)) of the exact products w_d = qdo_d o_d, an exact int64 sum
        const int e_delta = rlp_attb_exponent(rlp_attt_warp_max(local_field));
        long long delta_sum = 0;
        if (!bad_rows)  // warp-uniform
            for (int i = lane; i < d; i += 32) {
                const double w = (double)rlp_quantize(dr[i], RLP_ATTB_DO_BITS, edo) * (double)orow[i];
                delta_sum += __double2ll_rn(w * rlp_pow2_f64(RLP_ATTB_DELTA_BITS - 2 - e_delta));
            }
#pragma unroll
        for (int m = 16; m; m >>= 1) delta_sum += __shfl_xor_sync(0xffffffffu, delta_sum, m);
        if (lane == 0) {
            int* info = row_info + 3 * item;
            info[0] = bad_rows ? 0 : eq;
            info[1] = bad_rows ? 0 : edo;
            info[2] = bad_rows ? 1 : 0;
            row_stats[3 * item + 2] = bad_rows ? 0.0 : __ll2double_rn(delta_sum) *
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

// The per-query-tile kernels' shared state: the tile's q and do rows, a step's k and v rows, the
// rows' and keys' scalars.
template <int DP>
struct RlpAtttRows {
    static constexpr int BQ = RlpAttt<DP>::BQ;
    static constexpr int BK = RlpAttt<DP>::BK;
    int eq[BQ], edo[BQ], bad[BQ], e[BQ];
    float m[BQ];
    double total[BQ], delta[BQ];
    int ek[BK], ev[BK];
    unsigned int key[BQ], flag[BQ], field_q[BQ], field_k[BK], field_v[BK];
    unsigned long long sum[BQ];
};

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
    tile.rows = (int)min((long long)bq, cu_seqlens[seq + 1] - tile.t0);
    tile.h = blockIdx.y;
    tile.g = tile.h / (hq / hkv);
    return tile;
}

// Loads a query tile's scalars: row r of the tile is token t0 + r (rows valid), head h.
template <int DP>
__device__ __forceinline__ void rlp_attt_row_scalars(RlpAtttRows<DP>& s, const int* __restrict__ row_info,
                                                     const double* __restrict__ row_stats, long long t0, int rows,
                                                     int hq, int h) {
    for (int r = threadIdx.x; r < RlpAttt<DP>::BQ; r += RLP_ATTT_THREADS) {
        const long long item = (t0 + r) * hq + h;
        const bool in = r < rows;
        s.eq[r] = in ? row_info[3 * item] : 0;
        s.edo[r] = in ? row_info[3 * item + 1] : 0;
        s.bad[r] = in ? row_info[3 * item + 2] : 1;
        s.m[r] = in ? (float)row_stats[3 * item] : 0.0f;
        s.total[r] = in ? row_stats[3 * item + 1] : 1.0;
        s.delta[r] = in ? row_stats[3 * item + 2] : 0.0;
    }
}

template <int DP>
__device__ __forceinline__ void rlp_attt_key_scalars(RlpAtttRows<DP>& s, const int* __restrict__ k_exponents,
                                                     const int* __restrict__ v_exponents, long long j0, int keys,
                                                     int hkv, int g) {
    for (int c = threadIdx.x; c < RlpAttt<DP>::BK; c += RLP_ATTT_THREADS) {
        s.ek[c] = c < keys ? k_exponents[(j0 + c) * hkv + g] : 0;
        s.ev[c] = c < keys ? v_exponents[(j0 + c) * hkv + g] : 0;
    }
}

// Query tiles: q_tiles[2 i] = sequence, q_tiles[2 i + 1] = first token; grid (tiles, hq). Pass 1: m
// (an integer max of order keys) and the flag of a non-finite key or value row among 0..t; pass 2:
// L = sum RNE(p 2^21). Writes m and L to row_stats and the poisoned flag to row_info[2].
template <int DP>
__device__ __forceinline__ void rlp_attt_stats(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, double scale,
    const int* __restrict__ q_int, const int* __restrict__ k_int, const int* __restrict__ k_exponents,
    const int* __restrict__ v_exponents, int* __restrict__ row_info, double* __restrict__ row_stats, double* smem) {
    using T = RlpAttt<DP>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD, NSB = (BQ / 16) * (BK / 8);  // 16x8 blocks of S
    constexpr int NB = NSB >= 2 * RLP_ATTT_WARPS ? NSB / RLP_ATTT_WARPS : 1;  // blocks per warp, sharing a
    double* qs = smem;
    double* ks = qs + BQ * LD;
    RlpAtttRows<DP>& s = *reinterpret_cast<RlpAtttRows<DP>*>(ks + BK * LD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attt_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attt_row_scalars<DP>(s, row_info, row_stats, t0, rows, hq, h);
    for (int r = threadIdx.x; r < BQ; r += RLP_ATTT_THREADS) { s.key[r] = 0u; s.flag[r] = 0u; s.sum[r] = 0ull; }
    for (int pass = 0; pass < 2; ++pass) {
        for (long long j0 = start; j0 < t0 + rows; j0 += BK) {
            const int keys = (int)min((long long)BK, t0 + rows - j0);
            __syncthreads();
            rlp_attt_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
            rlp_attt_key_scalars<DP>(s, k_exponents, v_exponents, j0, keys, hkv, g);
            __syncthreads();
            for (int sg = warp; sg < NSB / NB; sg += RLP_ATTT_WARPS) {
                const int mb = sg / (BK / 8 / NB), nb0 = (sg - mb * (BK / 8 / NB)) * NB;
                double x[NB][4], unused[NB][4];
                rlp_attt_dots<NB, false>(x, unused, qs + mb * 16 * LD, ks + nb0 * 8 * LD, qs, ks, LD, DP);
                unsigned int key[2] = {0u, 0u}, flag[2] = {0u, 0u};
                long long part[2] = {0, 0};
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = mb * 16 + rlp_attt_row(i), c = (nb0 + n) * 8 + rlp_attt_col(i);
                        if (r < rows && c < keys && j0 + c <= t0 + r && s.bad[r] == 0) {
                            const float sc = __double2float_rn(
                                (x[n][i] * rlp_pow2_f64(s.eq[r] + s.ek[c] - RLP_ATT_SCORE_SHIFT)) * scale);
                            if (s.ek[c] == RLP_NONFINITE_EXPONENT || s.ev[c] == RLP_NONFINITE_EXPONENT) flag[i >> 1] = 1u;
                            else if (pass == 0) key[i >> 1] = max(key[i >> 1], rlp_att_order_key(sc));
                            else part[i >> 1] += __double2ll_rn((double)rlp_exp_f32(sc - s.m[r]) *
                                                                rlp_pow2_f64(RLP_ATT_P_SHIFT));
                        }
                    }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int r = mb * 16 + rlp_attt_row(2 * half);
                    if (pass == 0) {
                        const unsigned int k = rlp_attm_umax_rows(key[half]);
                        unsigned int f = flag[half];
                        f |= __shfl_xor_sync(0xffffffffu, f, 1);
                        f |= __shfl_xor_sync(0xffffffffu, f, 2);
                        if ((lane & 3) == 0 && r < rows) { atomicMax(&s.key[r], k); atomicOr(&s.flag[r], f); }
                    } else {
                        long long t = part[half];
                        t += __shfl_xor_sync(0xffffffffu, t, 1);
                        t += __shfl_xor_sync(0xffffffffu, t, 2);
                        if ((lane & 3) == 0 && r < rows && t != 0) atomicAdd(&s.sum[r], (unsigned long long)t);
                    }
                }
            }
        }
        __syncthreads();
        if (pass == 0)
            for (int r = threadIdx.x; r < BQ; r += RLP_ATTT_THREADS) {
                const float m = rlp_att_from_order_key(s.key[r]);
                if (s.flag[r] != 0u || rlp_magnitude_bits(m) >= 0x7f800000u) s.bad[r] = 1;
                s.m[r] = m;
            }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += RLP_ATTT_THREADS) {
        const long long item = (t0 + r) * hq + h;
        const bool poisoned = s.bad[r] != 0;
        if (poisoned) { row_info[3 * item] = 0; row_info[3 * item + 1] = 0; row_info[3 * item + 2] = 1; }
        row_stats[3 * item] = poisoned ? 0.0 : (double)s.m[r];
        row_stats[3 * item + 1] = poisoned ? 0.0 : __ll2double_rn((long long)s.sum[r]);
        if (poisoned) row_stats[3 * item + 2] = 0.0;
    }
}

// P and dS of one (query row, key) pair from its two exact dot products (float64 integers) and the
// row's and key's scalars: the rows kernels' rlp_attb_terms, step for step.
__device__ __forceinline__ void rlp_attt_pair(double sum, double dp_sum, int eq, int ek, int edo, int ev, float m,
                                              double total, double delta, double scale, double* big_p, double* ds) {
    const float sc = __double2float_rn((sum * rlp_pow2_f64(eq + ek - RLP_ATT_SCORE_SHIFT)) * scale);
    const double p = (double)rlp_exp_f32(sc - m);
    *big_p = (p * rlp_pow2_f64(RLP_ATT_P_SHIFT)) / total;
    const double dp = dp_sum * rlp_pow2_f64(edo + ev - RLP_ATTB_DP_SHIFT);
    *ds = (*big_p * (dp - delta)) * scale;
}

// rlp_attt_pair for query row r, key c of a query tile.
template <int DP>
__device__ __forceinline__ void rlp_attt_terms(const RlpAtttRows<DP>& s, int r, int c, double sum, double dp_sum,
                                               double scale, double* big_p, double* ds) {
    rlp_attt_pair(sum, dp_sum, s.eq[r], s.ek[c], s.edo[r], s.ev[c], s.m[r], s.total[r], s.delta[r], scale, big_p, ds);
}

// FIELDS: the largest exponent fields (per query row: of dS 2^ek, to e_fields; per key row and kv
// head: of dS 2^eq and P 2^edo, atomicMax into key_fields [T hkv, 2], RLP_ATTT_POISON where a
// poisoned row reaches the key). DQ: dq of the tile's rows from the exact sums of U . qk.
template <int DP, bool DQ>
__device__ __forceinline__ void rlp_attt_query_tile(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, int* __restrict__ e_fields,
    unsigned int* __restrict__ key_fields, float* __restrict__ dq, double* smem) {
    using T = RlpAttt<DP>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD, ULD = T::ULD, NSB = (BQ / 16) * (BK / 8);
    constexpr int NB = NSB >= 2 * RLP_ATTT_WARPS ? NSB / RLP_ATTT_WARPS : 1;  // S blocks per warp, sharing a
    constexpr int NPW = 4;  // 16x8 accumulator blocks per warp: BQ DP / 128 blocks over 8 warps
    double* qs = smem;
    double* ds_rows = qs + BQ * LD;
    double* ks = ds_rows + BQ * LD;
    double* vs = ks + BK * LD;
    double* u_hi = vs + BK * LD;
    double* u_lo = u_hi + BQ * ULD;
    RlpAtttRows<DP>& s = *reinterpret_cast<RlpAtttRows<DP>*>(u_lo + BQ * ULD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attt_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attt_load<DP, BQ>(ds_rows, do_int, t0 * hq + h, hq, rows);
    rlp_attt_row_scalars<DP>(s, row_info, row_stats, t0, rows, hq, h);
    for (int r = threadIdx.x; r < BQ; r += RLP_ATTT_THREADS) {
        s.field_q[r] = 0u;
        if (DQ) s.e[r] = r < rows ? e_fields[(t0 + r) * hq + h] : 0;
    }
    const int acc_m = (warp * NPW) / (DP / 8), acc_n = (warp * NPW) % (DP / 8);
    double acc[NPW][2][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { acc[n][0][i] = 0.0; acc[n][1][i] = 0.0; }
    for (long long j0 = start; j0 < t0 + rows; j0 += BK) {
        const int keys = (int)min((long long)BK, t0 + rows - j0);
        __syncthreads();
        rlp_attt_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
        rlp_attt_load<DP, BK>(vs, v_int, j0 * hkv + g, hkv, keys);
        rlp_attt_key_scalars<DP>(s, k_exponents, v_exponents, j0, keys, hkv, g);
        for (int c = threadIdx.x; c < BK; c += RLP_ATTT_THREADS) { s.field_k[c] = 0u; s.field_v[c] = 0u; }
        __syncthreads();
        for (int sg = warp; sg < NSB / NB; sg += RLP_ATTT_WARPS) {
            const int mb = sg / (BK / 8 / NB), nb0 = (sg - mb * (BK / 8 / NB)) * NB;
            double x[NB][4], y[NB][4];
            rlp_attt_dots<NB, true>(x, y, qs + mb * 16 * LD, ks + nb0 * 8 * LD, ds_rows + mb * 16 * LD,
                                    vs + nb0 * 8 * LD, LD, DP);
            unsigned int fq[2] = {0u, 0u};
#pragma unroll
            for (int n = 0; n < NB; ++n) {
                unsigned int fk[4] = {0u, 0u, 0u, 0u}, fv[4] = {0u, 0u, 0u, 0u};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = mb * 16 + rlp_attt_row(i), c = (nb0 + n) * 8 + rlp_attt_col(i);
                    const bool reach = r < rows && c < keys && j0 + c <= t0 + r;
                    const bool valid = reach && s.bad[r] == 0;
                    double big_p = 0.0, ds = 0.0;
                    if (valid) rlp_attt_terms<DP>(s, r, c, x[n][i], y[n][i], scale, &big_p, &ds);
                    if (DQ) {
                        double hi = 0.0, lo = 0.0;
                        if (valid) rlp_attt_split(rlp_attb_quantize(ds * rlp_pow2_f64(s.ek[c]), s.e[r]), &hi, &lo);
                        u_hi[r * ULD + c] = hi;
                        u_lo[r * ULD + c] = lo;
                    } else if (valid) {
                        fq[i >> 1] = max(fq[i >> 1], rlp_attb_field(ds * rlp_pow2_f64(s.ek[c])));
                        fk[i] = rlp_attb_field(ds * rlp_pow2_f64(s.eq[r]));
                        fv[i] = rlp_attb_field(big_p * rlp_pow2_f64(s.edo[r]));
                    } else if (reach) {
                        fk[i] = RLP_ATTT_POISON;
                        fv[i] = RLP_ATTT_POISON;
                    }
                }
                if (!DQ) {
#pragma unroll
                    for (int i = 0; i < 2; ++i) {  // column 2 t + i: rows g (element i) and g + 8 (element i + 2)
                        const unsigned int k_max = rlp_attt_umax_columns(max(fk[i], fk[i + 2]));
                        const unsigned int v_max = rlp_attt_umax_columns(max(fv[i], fv[i + 2]));
                        const int c = (nb0 + n) * 8 + rlp_attt_col(i);
                        if (lane < 4 && k_max) atomicMax(&s.field_k[c], k_max);
                        if (lane < 4 && v_max) atomicMax(&s.field_v[c], v_max);
                    }
                }
            }
            if (!DQ) {
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const unsigned int f = rlp_attm_umax_rows(fq[half]);
                    const int r = mb * 16 + rlp_attt_row(2 * half);
                    if ((lane & 3) == 0 && r < rows && f) atomicMax(&s.field_q[r], f);
                }
            }
        }
        __syncthreads();
        if (DQ) {
            rlp_attt_accumulate<NPW>(acc, u_hi + acc_m * 16 * ULD, u_lo + acc_m * 16 * ULD, ULD, ks + acc_n * 8, LD, BK);
        } else {
            for (int c = threadIdx.x; c < keys; c += RLP_ATTT_THREADS) {
                unsigned int* kf = key_fields + 2 * ((j0 + c) * hkv + g);
                if (s.field_k[c]) atomicMax(kf, s.field_k[c]);
                if (s.field_v[c]) atomicMax(kf + 1, s.field_v[c]);
            }
        }
    }
    __syncthreads();
    if (DQ) {
        const int unit_base = -(RLP_ATTB_COEF_BITS - 2) - (RLP_ATT_KV_BITS - 2);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = acc_m * 16 + rlp_attt_row(i);
            if (r >= rows) continue;
            float* out = dq + ((t0 + r) * hq + h) * (long long)d;
#pragma unroll
            for (int n = 0; n < NPW; ++n) {
                const int col = (acc_n + n) * 8 + rlp_attt_col(i);
                if (col < d) {
                    unsigned long long lo;
                    long long hi;
                    rlp_attt_words(acc[n][0][i], acc[n][1][i], &lo, &hi);
                    out[col] = s.bad[r] ? rlp_canonical_nan()
                                        : rlp_attb_round_wide(lo, (unsigned long long)hi, s.e[r] + unit_base);
                }
            }
        }
    } else {
        for (int r = threadIdx.x; r < rows; r += RLP_ATTT_THREADS)
            e_fields[(t0 + r) * hq + h] = rlp_attb_exponent(s.field_q[r]);
    }
}

// One block per (key tile item, kv head): items[5 i ..] = sequence, first key j0, first and end query row
// of the item's range (t >= j0), and a flag (ops/attention.py tiled_plan): nonzero where the
// key tile is cut into several items, whose exact sums go to dk_wide / dv_wide ([T hkv, d, 2] words)
// for _finish. dk = sum over pairs of U(dS 2^eq) qq, dv = sum of U(P 2^edo) qdo.
template <int DP>
__device__ __forceinline__ void rlp_attt_dkv(
    const int* __restrict__ items, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, const unsigned int* __restrict__ key_fields,
    float* __restrict__ dk, float* __restrict__ dv, unsigned long long* __restrict__ dk_wide,
    unsigned long long* __restrict__ dv_wide, double* smem) {
    using T = RlpAttt<DP>;
    constexpr int BKV = T::BKV, BQ2 = T::BQ2, LD = T::LD, ULD = T::ULD, NSB = (BKV / 16) * (BQ2 / 8);
    constexpr int NB = NSB >= 2 * RLP_ATTT_WARPS ? NSB / RLP_ATTT_WARPS : 1;  // S blocks per warp, sharing a
    constexpr int NPW = 4;  // 16x8 accumulator blocks per warp and output: BKV DP / 128 blocks over 8 warps
    double* ks = smem;
    double* vs = ks + BKV * LD;
    double* qs = vs + BKV * LD;
    double* dos = qs + BQ2 * LD;
    double* uk_hi = dos + BQ2 * LD;
    double* uk_lo = uk_hi + BKV * ULD;
    double* uv_hi = uk_lo + BKV * ULD;
    double* uv_lo = uv_hi + BKV * ULD;
    int* r_eq = reinterpret_cast<int*>(uv_lo + BKV * ULD);
    int* r_edo = r_eq + BQ2;
    int* r_bad = r_edo + BQ2;
    float* r_m = reinterpret_cast<float*>(r_bad + BQ2);
    double* r_total = reinterpret_cast<double*>(r_m + BQ2);
    double* r_delta = r_total + BQ2;
    int* c_ek = reinterpret_cast<int*>(r_delta + BQ2);
    int* c_ev = c_ek + BKV;
    int* c_fk = c_ev + BKV;
    int* c_fv = c_fk + BKV;
    const int warp = threadIdx.x >> 5;
    const int* item = items + 5 * blockIdx.x;
    const int seq = item[0];
    const long long j0 = item[1], q_begin = item[2], q_end = item[3];
    const bool wide = item[4] != 0;
    const long long end = cu_seqlens[seq + 1];
    const int rows = (int)min((long long)BKV, end - j0);
    const int g = blockIdx.y, group = hq / hkv;
    rlp_attt_load<DP, BKV>(ks, k_int, j0 * hkv + g, hkv, rows);
    rlp_attt_load<DP, BKV>(vs, v_int, j0 * hkv + g, hkv, rows);
    for (int r = threadIdx.x; r < BKV; r += RLP_ATTT_THREADS) {
        const long long kr = (j0 + r) * hkv + g;
        c_ek[r] = r < rows ? k_exponents[kr] : 0;
        c_ev[r] = r < rows ? v_exponents[kr] : 0;
        c_fk[r] = r < rows ? (int)key_fields[2 * kr] : 0;
        c_fv[r] = r < rows ? (int)key_fields[2 * kr + 1] : 0;
    }
    const int acc_m = (warp * NPW) / (DP / 8), acc_n = (warp * NPW) % (DP / 8);
    double acc_k[NPW][2][4], acc_v[NPW][2][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { acc_k[n][0][i] = 0.0; acc_k[n][1][i] = 0.0; acc_v[n][0][i] = 0.0; acc_v[n][1][i] = 0.0; }
    for (int hh = 0; hh < group; ++hh) {
        const int h = g * group + hh;
        for (long long t0 = q_begin; t0 < q_end; t0 += BQ2) {
            const int qrows = (int)min((long long)BQ2, q_end - t0);
            __syncthreads();
            rlp_attt_load<DP, BQ2>(qs, q_int, t0 * hq + h, hq, qrows);
            rlp_attt_load<DP, BQ2>(dos, do_int, t0 * hq + h, hq, qrows);
            for (int c = threadIdx.x; c < BQ2; c += RLP_ATTT_THREADS) {
                const long long it = (t0 + c) * hq + h;
                const bool in = c < qrows;
                r_eq[c] = in ? row_info[3 * it] : 0;
                r_edo[c] = in ? row_info[3 * it + 1] : 0;
                r_bad[c] = in ? row_info[3 * it + 2] : 1;
                r_m[c] = in ? (float)row_stats[3 * it] : 0.0f;
                r_total[c] = in ? row_stats[3 * it + 1] : 1.0;
                r_delta[c] = in ? row_stats[3 * it + 2] : 0.0;
            }
            __syncthreads();
            for (int sg = warp; sg < NSB / NB; sg += RLP_ATTT_WARPS) {
                const int mb = sg / (BQ2 / 8 / NB), nb0 = (sg - mb * (BQ2 / 8 / NB)) * NB;
                double x[NB][4], y[NB][4];
                rlp_attt_dots<NB, true>(x, y, ks + mb * 16 * LD, qs + nb0 * 8 * LD, vs + mb * 16 * LD,
                                        dos + nb0 * 8 * LD, LD, DP);
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = mb * 16 + rlp_attt_row(i);        // key row
                        const int c = (nb0 + n) * 8 + rlp_attt_col(i);  // query row
                        double kh = 0.0, kl = 0.0, vh = 0.0, vl = 0.0;
                        if (r < rows && c < qrows && j0 + r <= t0 + c && r_bad[c] == 0 &&
                            c_fk[r] < (int)RLP_ATTT_POISON) {
                            double big_p, ds;
                            rlp_attt_pair(x[n][i], y[n][i], r_eq[c], c_ek[r], r_edo[c], c_ev[r], r_m[c], r_total[c],
                                          r_delta[c], scale, &big_p, &ds);
                            rlp_attt_split(rlp_attb_quantize(ds * rlp_pow2_f64(r_eq[c]), rlp_attb_exponent(c_fk[r])),
                                           &kh, &kl);
                            rlp_attt_split(rlp_attb_quantize(big_p * rlp_pow2_f64(r_edo[c]),
                                                             rlp_attb_exponent(c_fv[r])), &vh, &vl);
                        }
                        uk_hi[r * ULD + c] = kh;
                        uk_lo[r * ULD + c] = kl;
                        uv_hi[r * ULD + c] = vh;
                        uv_lo[r * ULD + c] = vl;
                    }
            }
            __syncthreads();
            rlp_attt_accumulate<NPW>(acc_k, uk_hi + acc_m * 16 * ULD, uk_lo + acc_m * 16 * ULD, ULD, qs + acc_n * 8, LD,
                                     BQ2);
            rlp_attt_accumulate<NPW>(acc_v, uv_hi + acc_m * 16 * ULD, uv_lo + acc_m * 16 * ULD, ULD, dos + acc_n * 8, LD,
                                     BQ2);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = acc_m * 16 + rlp_attt_row(i);
        if (r >= rows) continue;
        const long long kr = (j0 + r) * hkv + g;
        const bool poisoned = c_fk[r] >= (int)RLP_ATTT_POISON;
        const int unit_k = rlp_attb_exponent(c_fk[r]) - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT;
        const int unit_v = rlp_attb_exponent(c_fv[r]) - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT;
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            const int col = (acc_n + n) * 8 + rlp_attt_col(i);
            if (col >= d) continue;
            unsigned long long lo_k, lo_v;
            long long hi_k, hi_v;
            rlp_attt_words(acc_k[n][0][i], acc_k[n][1][i], &lo_k, &hi_k);
            rlp_attt_words(acc_v[n][0][i], acc_v[n][1][i], &lo_v, &hi_v);
            const long long at = kr * d + col;
            if (wide) {
                if (!poisoned) {
                    atomicAdd(dk_wide + 2 * at, lo_k);
                    atomicAdd(dk_wide + 2 * at + 1, (unsigned long long)hi_k);
                    atomicAdd(dv_wide + 2 * at, lo_v);
                    atomicAdd(dv_wide + 2 * at + 1, (unsigned long long)hi_v);
                }
            } else {
                dk[at] = poisoned ? rlp_canonical_nan() : rlp_attb_round_wide(lo_k, (unsigned long long)hi_k, unit_k);
                dv[at] = poisoned ? rlp_canonical_nan() : rlp_attb_round_wide(lo_v, (unsigned long long)hi_v, unit_v);
            }
        }
    }
}

// The key rows of cut tiles (wide_rows[j] != 0): dk, dv rounded from their summed words.
extern "C" __global__ void attention_backward_tiled_finish(
    const int* __restrict__ wide_rows, long long tokens, int hkv, int d, const unsigned int* __restrict__ key_fields,
    const unsigned long long* __restrict__ dk_wide, const unsigned long long* __restrict__ dv_wide,
    float* __restrict__ dk, float* __restrict__ dv) {
    const long long n = tokens * hkv * d;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const long long kr = i / d;
        if (wide_rows[kr / hkv] == 0) continue;
        const unsigned int fk = key_fields[2 * kr], fv = key_fields[2 * kr + 1];
        if (fk >= RLP_ATTT_POISON) { dk[i] = rlp_canonical_nan(); dv[i] = rlp_canonical_nan(); continue; }
        dk[i] = rlp_attb_round_wide(dk_wide[2 * i], dk_wide[2 * i + 1],
                                    rlp_attb_exponent(fk) - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT);
        dv[i] = rlp_attb_round_wide(dv_wide[2 * i], dv_wide[2 * i + 1],
                                    rlp_attb_exponent(fv) - (RLP_ATTB_COEF_BITS - 2) - RLP_ATTB_ROW_SHIFT);
    }
}

#define RLP_ATTT_QUERY_ARGS                                                                                      \
    const int *__restrict__ q_tiles, const long long *__restrict__ cu_seqlens, int hq, int hkv, int d, double scale, \
        const int *__restrict__ q_int, const int *__restrict__ do_int, const int *__restrict__ k_int,   \
        const int *__restrict__ v_int, const int *__restrict__ k_exponents, const int *__restrict__ v_exponents, \
        int *__restrict__ row_info, double *__restrict__ row_stats, int *__restrict__ e_fields,                 \
        unsigned int *__restrict__ key_fields, float *__restrict__ dq

// fields (IS_DQ false) and dq (true) of padded head_dim DP: rlp_attt_query_tile
#define RLP_ATTT_QUERY_ENTRY(NAME, DP, IS_DQ)                                                                    \
    extern "C" __global__ void __launch_bounds__(RLP_ATTT_THREADS) NAME(RLP_ATTT_QUERY_ARGS) {                   \
        extern __shared__ double rlp_attt_smem[];                                                                \
        rlp_attt_query_tile<DP, IS_DQ>(q_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int,      \
                                       k_exponents, v_exponents, row_info, row_stats, e_fields, key_fields, dq,   \
                                       rlp_attt_smem);                                                           \
    }

#define RLP_ATTT_ENTRIES(DP, STATS, FIELDS, DQ, DKV)                                                             \
    extern "C" __global__ void __launch_bounds__(RLP_ATTT_THREADS) STATS(                                       \
        RLP_ATTT_QUERY_ARGS) {                                                                                   \
        extern __shared__ double rlp_attt_smem[];                                                                \
        rlp_attt_stats<DP>(q_tiles, cu_seqlens, hq, hkv, scale, q_int, k_int, k_exponents, v_exponents, row_info, \
                           row_stats, rlp_attt_smem);                                                            \
    }                                                                                                            \
    RLP_ATTT_QUERY_ENTRY(FIELDS, DP, false)                                                                  \
    RLP_ATTT_QUERY_ENTRY(DQ, DP, true)                                                                       \
    extern "C" __global__ void __launch_bounds__(RLP_ATTT_THREADS) DKV(                                         \
        const int* __restrict__ items, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d,        \
        double scale, const int* __restrict__ q_int, const int* __restrict__ do_int,                      \
        const int* __restrict__ k_int, const int* __restrict__ v_int, const int* __restrict__ k_exponents, \
        const int* __restrict__ v_exponents, const int* __restrict__ row_info,                                  \
        const double* __restrict__ row_stats, const unsigned int* __restrict__ key_fields, float* __restrict__ dk, \
        float* __restrict__ dv, unsigned long long* __restrict__ dk_wide, unsigned long long* __restrict__ dv_wide) { \
        extern __shared__ double rlp_attt_smem[];                                                                \
        rlp_attt_dkv<DP>(items, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,         \
                         v_exponents, row_info, row_stats, key_fields, dk, dv, dk_wide, dv_wide, rlp_attt_smem); \
    }

// padded head_dim 64, 128 and 256 (192 runs as 256)
RLP_ATTT_ENTRIES(64, attention_backward_tiled_stats_d64, attention_backward_tiled_fields_d64,
                 attention_backward_tiled_dq_d64, attention_backward_tiled_dkv_d64)
RLP_ATTT_ENTRIES(128, attention_backward_tiled_stats_d128, attention_backward_tiled_fields_d128,
                 attention_backward_tiled_dq_d128, attention_backward_tiled_dkv_d128)
RLP_ATTT_ENTRIES(256, attention_backward_tiled_stats_d256, attention_backward_tiled_fields_d256,
                 attention_backward_tiled_dq_d256, attention_backward_tiled_dkv_d256)
