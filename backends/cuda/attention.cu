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
    return __double2float_rn((__ll2double_rn(s) * rlp_pow2_f64(eq + ek - RLP_ATT_SCORE_SHIFT)) * scale);
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
                const double denominator = __ll2double_rn((long long)total);  // exact: L < 2^53
                const double unit = rlp_pow2_f64(e_max - RLP_ATT_V_SHIFT);
                for (int i = threadIdx.x; i < d; i += blockDim.x)
                    orow[i] = __double2float_rn((__ll2double_rn((long long)numerator[i]) * unit) / denominator);
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
        for (int i = threadIdx.x; i < d; i += blockDim.x) local = max(local, rlp_magnitude_bits(xr[i]));
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
