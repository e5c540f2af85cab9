// Kernel family "attention", NVIDIA's fast paths: the tensor-core forward (mma.sync m16n8k32 s8,
// attention_paged_mma_*) and the tiled backward on the FP64 tensor cores (attention_backward_mma_*).
// Contract: contracts/attention.toml. Reference: rlportable/contract/attention.py. The family's
// portable kernels (every variant both vendors run) are backends/portable/attention.hip, included
// here; the runtime compiles this file behind backends/cuda/prelude.h for a CUDA GPU and the
// portable source alone elsewhere. The fast paths give the portable kernels' bits.
#include "attention.hip"

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
    const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats, signed char* smem) {
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
        if (bad && row_stats != nullptr && lane < 2) row_stats[3 * (row * hq + h) + lane] = 0.0;
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
            if (row_stats != nullptr && half == 0 && tq4 == 0) {  // m and L for the backward (0 when poisoned)
                double* stats = row_stats + 3 * ((r0 + r) * hq + h);
                stats[0] = ok[k] ? (double)m[k] : 0.0;
                stats[1] = ok[k] ? denominator : 0.0;
            }
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
        const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats) {          \
        extern __shared__ int4 rlp_attm_smem[];                                                                  \
        rlp_attention_mma<DPMAX>(q, q_seq, q_pos, tq, hq, hkv, d, dp, scale, block_tables, num_seqs, max_blocks, \
                                 block_size, num_slots, k_digits, k_exponents, v_digits, v_exponents, out,       \
                                 row_stats, reinterpret_cast<signed char*>(rlp_attm_smem));                     \
    }

// head_dim padded to 64 or 128, and to 192 or 256
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d128, 128, 2)
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d256, 256, 1)

// ---------------------------------------------------------------------------
// Tiled backward: the CUDA fast path of op "attention_backward", the bits of the rows kernels above
// (ops/attention.py method "tiled"). Tiles of query rows x key columns in shared memory, the products
// on the FP64 tensor cores (mma.sync m16n8k4 f64, sm_80+) over integer operands held exactly in float64.
// Each partial sum of a product stays below 2^53, so each mma result is the exact integer sum in any
// order, and the tiling changes nothing:
//   S = qq . qk, dP = qdo . qv               |terms| < 2^36, D <= 256 terms
//   dq block partial  += U . qk              |U| <= 2^14, |qk| < 2^14, 64 keys: < 2^35
//   dk, dv block partial += U . qq, U . qdo  |qq|, |qdo| < 2^22, 64 queries: < 2^42
// The coefficients of one block (64 aligned positions: keys for dq, queries of one q head for dk and dv)
// are held in shared memory until the block's largest exponent field is known, quantized in place, and
// the block's exact partial is scaled into the float64 sum in ascending (block, head) order, as the
// contract orders it. The steps: _rows and _keys (encoded rows), _stats (m, L, the poisoned flag: two
// passes over the keys; left out when the forward gave m and L), _dq (per query tile and q head) and
// _dkv (per key tile and kv head). Shared-memory rows are DP + 4 doubles apart: a half-warp's fragment
// loads then fall on 16 distinct bank pairs.
#define RLP_ATTD_THREADS 256
#define RLP_ATTD_WARPS 8
#define RLP_ATTD_PAD 4

template <int DP>
struct RlpAttd {
    static constexpr int LD = DP + RLP_ATTD_PAD;
    static constexpr int BQ = 4096 / DP;              // query rows of a dq / stats tile
    static constexpr int BK = DP <= 128 ? 64 : 32;     // keys per step of those (a coefficient block: 64)
    static constexpr int BKV = 4096 / DP;             // key rows of a dkv tile
    static constexpr int BQ2 = 32;                    // query rows per step of dkv
    static constexpr int ULD = RLP_ATTB_BLOCK + RLP_ATTD_PAD;  // coefficient tiles (one block) row stride
};

// One 16x8x4 f64 product. Thread (g, t) = (lane / 4, lane % 4) holds A (g, t) and (g + 8, t), B (t, g),
// C (g, 2t + i) for i = 0, 1 and (g + 8, 2t + i) for i = 2, 3. sm_90 has the m16n8k4 shape, at twice
// m8n8k4's rate (scripts/probe_dmma.py); sm_80 runs it as two m8n8k4 (the same exact sums).
__device__ __forceinline__ void rlp_attd_mma(double (&c)[4], double a0, double a1, double b) {
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
__device__ __forceinline__ int rlp_attd_row(int i) { return ((threadIdx.x & 31) >> 2) + 8 * (i >> 1); }
__device__ __forceinline__ int rlp_attd_col(int i) { return 2 * (threadIdx.x & 3) + (i & 1); }

// 16x8 blocks of exact dot products: x[n] = a . b_n^T and y[n] = c . e_n^T for 16 rows of a (and c) and
// the NB blocks of 8 rows of b (and e) that follow each other (b_n = b + 8 n ld), rows ld apart, k values
// each (k % 8 == 0; Y: also y). The even and odd k-steps go to two chains (integer sums: any split is
// exact), and a and c serve all NB blocks.
template <int NB, bool Y>
__device__ __forceinline__ void rlp_attd_dots(double (&x)[NB][4], double (&y)[NB][4], const double* a, const double* b,
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
            rlp_attd_mma(x[n], a0, a1, b[off + n * 8 * ld + i]);
            rlp_attd_mma(x1[n], a2, a3, b[off + n * 8 * ld + i + 4]);
            if (Y) {
                rlp_attd_mma(y[n], c0, c1, e[off + n * 8 * ld + i]);
                rlp_attd_mma(y1[n], c2, c3, e[off + n * 8 * ld + i + 4]);
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { x[n][i] += x1[n][i]; y[n][i] += y1[n][i]; }
}

// The largest of v over the 8 rows of a fragment column (lanes with the same lane % 4).
__device__ __forceinline__ unsigned int rlp_attd_umax_columns(unsigned int v) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 4));
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 8));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 16));
}

// acc[n] += U[16 rows, kk] . B[kk rows, 8 columns at 8 n] for N column blocks (U rows uld apart, B rows
// ld apart).
template <int N>
__device__ __forceinline__ void rlp_attd_accumulate(double (&acc)[N][4], const double* u, int uld, const double* b,
                                                    int ld, int kk) {
    const int lane = threadIdx.x & 31;
    const int a_off = (lane >> 2) * uld + (lane & 3);
    const int b_off = (lane & 3) * ld + (lane >> 2);
#pragma unroll 2
    for (int i = 0; i < kk; i += 4) {
        const double u0 = u[a_off + i], u1 = u[a_off + 8 * uld + i];
#pragma unroll
        for (int n = 0; n < N; ++n) rlp_attd_mma(acc[n], u0, u1, b[b_off + i * ld + 8 * n]);
    }
}

// Rows [count] of DP integers from global (row r at src + (first + r step) DP) into shared memory as
// float64 (exact; stride LD); rows at or beyond `count` are zero. The operands travel as int32, half the
// bytes of float64, and are converted once per tile.
template <int DP, int ROWS>
__device__ __forceinline__ void rlp_attd_load(double* dst, const int* __restrict__ src, long long first,
                                              long long step, int count) {
    constexpr int LD = RlpAttd<DP>::LD;
    for (int i = threadIdx.x; i < ROWS * (DP / 4); i += RLP_ATTD_THREADS) {
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




// The per-query-tile kernels' shared state: the tile's q and do rows, a step's k and v rows, the
// rows' and keys' scalars.
template <int DP>
struct RlpAttdRows {
    static constexpr int BQ = RlpAttd<DP>::BQ;
    static constexpr int BK = RlpAttd<DP>::BK;
    int eq[BQ], edo[BQ], bad[BQ];
    float m[BQ];
    double total[BQ], delta[BQ];
    int ek[BK], ev[BK];
    unsigned int key[BQ], flag[BQ], field[BQ];
    unsigned long long sum[BQ];
};


__device__ __forceinline__ RlpAtttTile rlp_attd_query_tile_of(const int* __restrict__ q_tiles,
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
__device__ __forceinline__ void rlp_attd_row_scalars(RlpAttdRows<DP>& s, const int* __restrict__ row_info,
                                                     const double* __restrict__ row_stats, long long t0, int rows,
                                                     int hq, int h) {
    for (int r = threadIdx.x; r < RlpAttd<DP>::BQ; r += RLP_ATTD_THREADS) {
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
__device__ __forceinline__ void rlp_attd_key_scalars(RlpAttdRows<DP>& s, const int* __restrict__ k_exponents,
                                                     const int* __restrict__ v_exponents, long long j0, int keys,
                                                     int hkv, int g) {
    for (int c = threadIdx.x; c < RlpAttd<DP>::BK; c += RLP_ATTD_THREADS) {
        s.ek[c] = c < keys ? k_exponents[(j0 + c) * hkv + g] : 0;
        s.ev[c] = c < keys ? v_exponents[(j0 + c) * hkv + g] : 0;
    }
}

// Query tiles: q_tiles[2 i] = sequence, q_tiles[2 i + 1] = first token; grid (tiles, hq). Pass 1: m
// (an integer max of order keys) and the flag of a non-finite key or value row among 0..t; pass 2:
// L = sum RNE(p 2^21). Writes m and L to row_stats and the poisoned flag to row_info[2].
template <int DP>
__device__ __forceinline__ void rlp_attd_stats(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, double scale,
    const int* __restrict__ q_int, const int* __restrict__ k_int, const int* __restrict__ k_exponents,
    const int* __restrict__ v_exponents, int* __restrict__ row_info, double* __restrict__ row_stats, double* smem) {
    using T = RlpAttd<DP>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD, NSB = (BQ / 16) * (BK / 8);  // 16x8 blocks of S
    constexpr int NB = NSB >= 2 * RLP_ATTD_WARPS ? NSB / RLP_ATTD_WARPS : 1;  // blocks per warp, sharing a
    double* qs = smem;
    double* ks = qs + BQ * LD;
    RlpAttdRows<DP>& s = *reinterpret_cast<RlpAttdRows<DP>*>(ks + BK * LD);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const RlpAtttTile tile = rlp_attd_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attd_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attd_row_scalars<DP>(s, row_info, row_stats, t0, rows, hq, h);
    for (int r = threadIdx.x; r < BQ; r += RLP_ATTD_THREADS) { s.key[r] = 0u; s.flag[r] = 0u; s.sum[r] = 0ull; }
    for (int pass = 0; pass < 2; ++pass) {
        for (long long j0 = start; j0 < t0 + rows; j0 += BK) {
            const int keys = (int)min((long long)BK, t0 + rows - j0);
            __syncthreads();
            rlp_attd_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
            rlp_attd_key_scalars<DP>(s, k_exponents, v_exponents, j0, keys, hkv, g);
            __syncthreads();
            for (int sg = warp; sg < NSB / NB; sg += RLP_ATTD_WARPS) {
                const int mb = sg / (BK / 8 / NB), nb0 = (sg - mb * (BK / 8 / NB)) * NB;
                double x[NB][4], unused[NB][4];
                rlp_attd_dots<NB, false>(x, unused, qs + mb * 16 * LD, ks + nb0 * 8 * LD, qs, ks, LD, DP);
                unsigned int key[2] = {0u, 0u}, flag[2] = {0u, 0u};
                long long part[2] = {0, 0};
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = mb * 16 + rlp_attd_row(i), c = (nb0 + n) * 8 + rlp_attd_col(i);
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
                    const int r = mb * 16 + rlp_attd_row(2 * half);
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
            for (int r = threadIdx.x; r < BQ; r += RLP_ATTD_THREADS) {
                const float m = rlp_att_from_order_key(s.key[r]);
                if (s.flag[r] != 0u || rlp_magnitude_bits(m) >= 0x7f800000u) s.bad[r] = 1;
                s.m[r] = m;
            }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += RLP_ATTD_THREADS) {
        const long long item = (t0 + r) * hq + h;
        const bool poisoned = s.bad[r] != 0;
        if (poisoned) { row_info[3 * item] = 0; row_info[3 * item + 1] = 0; row_info[3 * item + 2] = 1; }
        row_stats[3 * item] = poisoned ? 0.0 : (double)s.m[r];
        row_stats[3 * item + 1] = poisoned ? 0.0 : __ll2double_rn((long long)s.sum[r]);
        if (poisoned) row_stats[3 * item + 2] = 0.0;
    }
}


// rlp_attt_pair for query row r, key c of a query tile.
template <int DP>
__device__ __forceinline__ void rlp_attd_terms(const RlpAttdRows<DP>& s, int r, int c, double sum, double dp_sum,
                                               double scale, double* big_p, double* ds) {
    rlp_attt_pair(sum, dp_sum, s.eq[r], s.ek[c], s.edo[r], s.ev[c], s.m[r], s.total[r], s.delta[r], scale, big_p, ds);
}

// Largest exponent field of the coefficients per row of a 16x8 fragment block: f[half] holds the thread's
// rows g (half 0) and g + 8 (half 1); the four lanes of a row meet, lane % 4 == 0 adds it to field[].
__device__ __forceinline__ void rlp_attd_row_fields(const unsigned int (&f)[2], unsigned int* field, int r0,
                                                    int rows) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned int m = rlp_attm_umax_rows(f[half]);
        const int r = r0 + rlp_attd_row(2 * half);
        if ((threadIdx.x & 3) == 0 && r < rows && m) atomicMax(&field[r], m);
    }
}

// U = RNE(u 2^(13 - E)) in place over a [rows, 64] coefficient tile (row stride ULD), E from field[r].
template <int ROWS>
__device__ __forceinline__ void rlp_attd_quantize_tile(double* u, const unsigned int* field) {
    constexpr int ULD = RLP_ATTB_BLOCK + RLP_ATTD_PAD;
    for (int i = threadIdx.x; i < ROWS * RLP_ATTB_BLOCK; i += RLP_ATTD_THREADS) {
        const int r = i / RLP_ATTB_BLOCK, c = i - r * RLP_ATTB_BLOCK;
        u[r * ULD + c] = (double)rlp_attb_quantize(u[r * ULD + c], rlp_attb_exponent(field[r]));
    }
}

// dq of a query tile (grid (tiles, hq)): per block of 64 keys (aligned from the sequence start), the
// coefficients u = dS 2^ek of the tile's rows into a shared tile (in steps of BK keys), each row's E
// over the block, U in place, the block's exact partial U . qk (the last step's keys still resident,
// earlier ones loaded again), then acc = acc + partial 2^(E - 26), blocks ascending.
template <int DP>
__device__ __forceinline__ void rlp_attd_dq(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dq, double* smem) {
    using T = RlpAttd<DP>;
    constexpr int BQ = T::BQ, BK = T::BK, LD = T::LD, ULD = T::ULD, NSUB = RLP_ATTB_BLOCK / BK;
    constexpr int NSB = (BQ / 16) * (BK / 8);
    constexpr int NB = NSB >= 2 * RLP_ATTD_WARPS ? NSB / RLP_ATTD_WARPS : 1;  // S blocks per warp, sharing a
    constexpr int NPW = 4;  // 16x8 accumulator blocks per warp: BQ DP / 128 blocks over 8 warps
    double* qs = smem;
    double* dos = qs + BQ * LD;
    double* ks = dos + BQ * LD;
    double* vs = ks + BK * LD;
    double* us = vs + BK * LD;
    RlpAttdRows<DP>& s = *reinterpret_cast<RlpAttdRows<DP>*>(us + BQ * ULD);
    const int warp = threadIdx.x >> 5;
    const RlpAtttTile tile = rlp_attd_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start, t_end = tile.t0 + tile.rows;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attd_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attd_load<DP, BQ>(dos, do_int, t0 * hq + h, hq, rows);
    rlp_attd_row_scalars<DP>(s, row_info, row_stats, t0, rows, hq, h);
    const int acc_m = (warp * NPW) / (DP / 8), acc_n = (warp * NPW) % (DP / 8);
    double acc[NPW][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0;
    for (long long b0 = start; b0 < t_end; b0 += RLP_ATTB_BLOCK) {
        for (int sub = 0; sub < NSUB; ++sub) {
            const long long j0 = b0 + sub * BK;
            const int keys = (int)max(0LL, min((long long)BK, t_end - j0));
            __syncthreads();
            if (sub == 0)
                for (int r = threadIdx.x; r < BQ; r += RLP_ATTD_THREADS) s.field[r] = 0u;
            rlp_attd_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, keys);
            rlp_attd_load<DP, BK>(vs, v_int, j0 * hkv + g, hkv, keys);
            rlp_attd_key_scalars<DP>(s, k_exponents, v_exponents, j0, keys, hkv, g);
            __syncthreads();
            for (int sg = warp; sg < NSB / NB; sg += RLP_ATTD_WARPS) {
                const int mb = sg / (BK / 8 / NB), nb0 = (sg - mb * (BK / 8 / NB)) * NB;
                double x[NB][4], y[NB][4];
                rlp_attd_dots<NB, true>(x, y, qs + mb * 16 * LD, ks + nb0 * 8 * LD, dos + mb * 16 * LD,
                                        vs + nb0 * 8 * LD, LD, DP);
                unsigned int f[2] = {0u, 0u};
#pragma unroll
                for (int n = 0; n < NB; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = mb * 16 + rlp_attd_row(i), c = (nb0 + n) * 8 + rlp_attd_col(i);
                        double u = 0.0;
                        if (r < rows && c < keys && j0 + c <= t0 + r && s.bad[r] == 0) {
                            double big_p, ds;
                            rlp_attd_terms<DP>(s, r, c, x[n][i], y[n][i], scale, &big_p, &ds);
                            u = ds * rlp_pow2_f64(s.ek[c]);
                            f[i >> 1] = max(f[i >> 1], rlp_attb_field(u));
                        }
                        us[r * ULD + sub * BK + c] = u;
                    }
                rlp_attd_row_fields(f, s.field, mb * 16, rows);
            }
        }
        __syncthreads();
        rlp_attd_quantize_tile<BQ>(us, s.field);
        __syncthreads();
        int e[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) e[half] = rlp_attb_exponent(s.field[acc_m * 16 + rlp_attd_row(2 * half)]);
        double part[NPW][4];
#pragma unroll
        for (int n = 0; n < NPW; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[n][i] = 0.0;
        for (int sub = NSUB - 1; sub >= 0; --sub) {
            if (sub != NSUB - 1) {
                const long long j0 = b0 + sub * BK;
                __syncthreads();
                rlp_attd_load<DP, BK>(ks, k_int, j0 * hkv + g, hkv, (int)max(0LL, min((long long)BK, t_end - j0)));
                __syncthreads();
            }
            rlp_attd_accumulate<NPW>(part, us + acc_m * 16 * ULD + sub * BK, ULD, ks + acc_n * 8, LD, BK);
        }
#pragma unroll
        for (int n = 0; n < NPW; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i)  // the partial's scaling is exact: one rounding, the add
                acc[n][i] = acc[n][i] + part[n][i] * rlp_pow2_f64(e[i >> 1] - (RLP_ATTB_COEF_BITS - 2) -
                                                                  (RLP_ATT_KV_BITS - 2));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = acc_m * 16 + rlp_attd_row(i);
        if (r >= rows) continue;
        float* out = dq + ((t0 + r) * hq + h) * (long long)d;
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            const int col = (acc_n + n) * 8 + rlp_attd_col(i);
            if (col < d) out[col] = s.bad[r] ? rlp_canonical_nan() : __double2float_rn(acc[n][i]);
        }
    }
}

// dk and dv of a key tile (grid (key tiles, hkv)): per block of 64 queries (aligned from the sequence
// start, from the block holding the tile's first key) and, within it, per q head of the group in order:
// the coefficients dS 2^eq and P 2^edo of the tile's keys into two shared tiles (in steps of BQ2 queries),
// each key's E over the block, U in place, the block's exact partials U . qq and U . qdo (the last
// step's rows still resident), then acc = acc + partial 2^(E - 34). A key that a poisoned query row
// reaches gets the canonical NaN.
template <int DP>
__device__ __forceinline__ void rlp_attd_dkv(
    const int* __restrict__ key_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dk,
    float* __restrict__ dv, double* smem) {
    using T = RlpAttd<DP>;
    constexpr int BKV = T::BKV, BQ2 = T::BQ2, LD = T::LD, ULD = T::ULD, NSUB = RLP_ATTB_BLOCK / BQ2;
    constexpr int NSB = (BKV / 16) * (BQ2 / 8);
    constexpr int NB = NSB >= 2 * RLP_ATTD_WARPS ? NSB / RLP_ATTD_WARPS : 1;  // S blocks per warp, sharing a
    constexpr int NPW = 4;  // 16x8 accumulator blocks per warp and output: BKV DP / 128 blocks over 8 warps
    double* ks = smem;
    double* vs = ks + BKV * LD;
    double* qs = vs + BKV * LD;
    double* dos = qs + BQ2 * LD;
    double* uk = dos + BQ2 * LD;
    double* uv = uk + BKV * ULD;
    double* r_total = uv + BKV * ULD;
    double* r_delta = r_total + BQ2;
    float* r_m = reinterpret_cast<float*>(r_delta + BQ2);
    int* r_eq = reinterpret_cast<int*>(r_m + BQ2);
    int* r_edo = r_eq + BQ2;
    int* r_bad = r_edo + BQ2;
    int* c_ek = r_bad + BQ2;
    int* c_ev = c_ek + BKV;
    unsigned int* c_fk = reinterpret_cast<unsigned int*>(c_ev + BKV);
    unsigned int* c_fv = c_fk + BKV;
    unsigned int* c_bad = c_fv + BKV;
    const int warp = threadIdx.x >> 5;
    const int seq = key_tiles[2 * blockIdx.x];
    const long long j0 = key_tiles[2 * blockIdx.x + 1], start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    const int rows = (int)min((long long)BKV, end - j0);
    const int g = blockIdx.y, group = hq / hkv;
    rlp_attd_load<DP, BKV>(ks, k_int, j0 * hkv + g, hkv, rows);
    rlp_attd_load<DP, BKV>(vs, v_int, j0 * hkv + g, hkv, rows);
    for (int r = threadIdx.x; r < BKV; r += RLP_ATTD_THREADS) {
        const long long kr = (j0 + r) * hkv + g;
        c_ek[r] = r < rows ? k_exponents[kr] : 0;
        c_ev[r] = r < rows ? v_exponents[kr] : 0;
        c_bad[r] = 0u;
    }
    const int acc_m = (warp * NPW) / (DP / 8), acc_n = (warp * NPW) % (DP / 8);
    double acc_k[NPW][4], acc_v[NPW][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { acc_k[n][i] = 0.0; acc_v[n][i] = 0.0; }
    for (long long b0 = start + (j0 - start) / RLP_ATTB_BLOCK * RLP_ATTB_BLOCK; b0 < end; b0 += RLP_ATTB_BLOCK)
        for (int hh = 0; hh < group; ++hh) {
            const int h = g * group + hh;
            for (int sub = 0; sub < NSUB; ++sub) {
                const long long t0 = b0 + sub * BQ2;
                const int qrows = (int)max(0LL, min((long long)BQ2, end - t0));
                __syncthreads();
                if (sub == 0)
                    for (int r = threadIdx.x; r < BKV; r += RLP_ATTD_THREADS) { c_fk[r] = 0u; c_fv[r] = 0u; }
                rlp_attd_load<DP, BQ2>(qs, q_int, t0 * hq + h, hq, qrows);
                rlp_attd_load<DP, BQ2>(dos, do_int, t0 * hq + h, hq, qrows);
                for (int c = threadIdx.x; c < BQ2; c += RLP_ATTD_THREADS) {
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
                for (int sg = warp; sg < NSB / NB; sg += RLP_ATTD_WARPS) {
                    const int mb = sg / (BQ2 / 8 / NB), nb0 = (sg - mb * (BQ2 / 8 / NB)) * NB;
                    double x[NB][4], y[NB][4];
                    rlp_attd_dots<NB, true>(x, y, ks + mb * 16 * LD, qs + nb0 * 8 * LD, vs + mb * 16 * LD,
                                            dos + nb0 * 8 * LD, LD, DP);
                    unsigned int fk[2] = {0u, 0u}, fv[2] = {0u, 0u}, bad[2] = {0u, 0u};
#pragma unroll
                    for (int n = 0; n < NB; ++n)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const int r = mb * 16 + rlp_attd_row(i);        // key row
                            const int c = (nb0 + n) * 8 + rlp_attd_col(i);  // query row
                            double ukv = 0.0, uvv = 0.0;
                            if (r < rows && c < qrows && j0 + r <= t0 + c) {
                                if (r_bad[c] != 0) {
                                    bad[i >> 1] = 1u;
                                } else {
                                    double big_p, ds;
                                    rlp_attt_pair(x[n][i], y[n][i], r_eq[c], c_ek[r], r_edo[c], c_ev[r], r_m[c],
                                                  r_total[c], r_delta[c], scale, &big_p, &ds);
                                    ukv = ds * rlp_pow2_f64(r_eq[c]);
                                    uvv = big_p * rlp_pow2_f64(r_edo[c]);
                                    fk[i >> 1] = max(fk[i >> 1], rlp_attb_field(ukv));
                                    fv[i >> 1] = max(fv[i >> 1], rlp_attb_field(uvv));
                                }
                            }
                            uk[r * ULD + sub * BQ2 + c] = ukv;
                            uv[r * ULD + sub * BQ2 + c] = uvv;
                        }
                    rlp_attd_row_fields(fk, c_fk, mb * 16, rows);
                    rlp_attd_row_fields(fv, c_fv, mb * 16, rows);
                    rlp_attd_row_fields(bad, c_bad, mb * 16, rows);
                }
            }
            __syncthreads();
            rlp_attd_quantize_tile<BKV>(uk, c_fk);
            rlp_attd_quantize_tile<BKV>(uv, c_fv);
            __syncthreads();
            int ek[2], ev[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int r = acc_m * 16 + rlp_attd_row(2 * half);
                ek[half] = rlp_attb_exponent(c_fk[r]);
                ev[half] = rlp_attb_exponent(c_fv[r]);
            }
            double part_k[NPW][4], part_v[NPW][4];
#pragma unroll
            for (int n = 0; n < NPW; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) { part_k[n][i] = 0.0; part_v[n][i] = 0.0; }
            for (int sub = NSUB - 1; sub >= 0; --sub) {
                if (sub != NSUB - 1) {
                    const long long t0 = b0 + sub * BQ2;
                    const int qrows = (int)max(0LL, min((long long)BQ2, end - t0));
                    __syncthreads();
                    rlp_attd_load<DP, BQ2>(qs, q_int, t0 * hq + h, hq, qrows);
                    rlp_attd_load<DP, BQ2>(dos, do_int, t0 * hq + h, hq, qrows);
                    __syncthreads();
                }
                rlp_attd_accumulate<NPW>(part_k, uk + acc_m * 16 * ULD + sub * BQ2, ULD, qs + acc_n * 8, LD, BQ2);
                rlp_attd_accumulate<NPW>(part_v, uv + acc_m * 16 * ULD + sub * BQ2, ULD, dos + acc_n * 8, LD, BQ2);
            }
#pragma unroll
            for (int n = 0; n < NPW; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // exact scalings: one rounding each, the adds
                    acc_k[n][i] = acc_k[n][i] + part_k[n][i] * rlp_pow2_f64(ek[i >> 1] - (RLP_ATTB_COEF_BITS - 2) -
                                                                            RLP_ATTB_ROW_SHIFT);
                    acc_v[n][i] = acc_v[n][i] + part_v[n][i] * rlp_pow2_f64(ev[i >> 1] - (RLP_ATTB_COEF_BITS - 2) -
                                                                            RLP_ATTB_ROW_SHIFT);
                }
        }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = acc_m * 16 + rlp_attd_row(i);
        if (r >= rows) continue;
        const long long at = ((j0 + r) * hkv + g) * (long long)d;
        const bool poisoned = c_bad[r] != 0u;
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            const int col = (acc_n + n) * 8 + rlp_attd_col(i);
            if (col >= d) continue;
            dk[at + col] = poisoned ? rlp_canonical_nan() : __double2float_rn(acc_k[n][i]);
            dv[at + col] = poisoned ? rlp_canonical_nan() : __double2float_rn(acc_v[n][i]);
        }
    }
}

#define RLP_ATTD_ENTRIES(DP, STATS, DQ, DKV)                                                                   \
    extern "C" __global__ void __launch_bounds__(RLP_ATTD_THREADS) STATS(RLP_ATTT_QUERY_ARGS) {              \
        extern __shared__ double rlp_attd_smem[];                                                              \
        rlp_attd_stats<DP>(q_tiles, cu_seqlens, hq, hkv, scale, q_int, k_int, k_exponents, v_exponents, row_info, \
                           row_stats, rlp_attd_smem);                                                          \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(RLP_ATTD_THREADS) DQ(RLP_ATTT_QUERY_ARGS) {                 \
        extern __shared__ double rlp_attd_smem[];                                                              \
        rlp_attd_dq<DP>(q_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,      \
                        v_exponents, row_info, row_stats, dq, rlp_attd_smem);                                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(RLP_ATTD_THREADS) DKV(RLP_ATTT_KEY_ARGS) {                  \
        extern __shared__ double rlp_attd_smem[];                                                              \
        rlp_attd_dkv<DP>(key_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,   \
                         v_exponents, row_info, row_stats, dk, dv, rlp_attd_smem);                             \
    }

// padded head_dim 64, 128 and 256 (192 runs as 256)
RLP_ATTD_ENTRIES(64, attention_backward_mma_stats_d64, attention_backward_mma_dq_d64, attention_backward_mma_dkv_d64)
RLP_ATTD_ENTRIES(128, attention_backward_mma_stats_d128, attention_backward_mma_dq_d128,
                 attention_backward_mma_dkv_d128)
RLP_ATTD_ENTRIES(256, attention_backward_mma_stats_d256, attention_backward_mma_dq_d256,
                 attention_backward_mma_dkv_d256)
