// Kernel family "attention", NVIDIA's fast paths: the tensor-core forward (mma.sync m16n8k32 s8,
// attention_paged_mma_*) and the tiled backward on the FP64 tensor cores (attention_backward_mma_*).
// Contract: contracts/attention.toml. Reference: rlportable/contract/attention.py. The family's
// portable kernels (every variant both vendors run) are backends/portable/attention.hip, included
// here; the runtime compiles this file behind backends/cuda/prelude.h for a CUDA GPU and the
// portable source alone elsewhere. The fast paths give the portable kernels' bits.
#include "attention.hip"
#include "pipeline.h"

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

// groups[i + j] += A_i x B_j over one 64-wide chunk of the reduction dimension (2 mma steps);
// a[i][r]: rows g (r = 0) and g + 8 (r = 1); b[j]: column g.
__device__ __forceinline__ void rlp_attm_chunk(int (&acc)[4][4], const int4 (&a)[3][2], const int4 (&b)[2]) {
#pragma unroll
    for (int step = 0; step < 2; ++step)
#pragma unroll
        for (int i = 0; i < 3; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                rlp_mma_s8(acc[i + j], rlp_word(a[i][0], 2 * step), rlp_word(a[i][1], 2 * step),
                             rlp_word(a[i][0], 2 * step + 1), rlp_word(a[i][1], 2 * step + 1),
                             rlp_word(b[j], 2 * step), rlp_word(b[j], 2 * step + 1));
}

// S = sum_k 256^k G_k of register c of the four shift sums (exact in int64).
template <int R>
__device__ __forceinline__ long long rlp_attm_combine(const int (&acc)[4][R], int c) {
    return (((long long)acc[3][c] * 256 + acc[2][c]) * 256 + acc[1][c]) * 256 + acc[0][c];
}

__device__ __forceinline__ unsigned int rlp_attm_umax_rows(unsigned int v) {
    v = max(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// The warpgroup build (WG, sm_90a, head_dim padded to 128: attention_paged_wgmma_d128): the same blocks,
// rows, rounds and per-score arithmetic, with the products on wgmma from 128-byte-swizzled shared memory
// ([plane][row][128 bytes], rlp_swizzle128). Warpgroup h plays the warps of half h: its warp p holds rows
// 16p..16p+15, keys 32h..32h+31 of the score products (m64n32k32, the six digit pairs in four shift sums,
// each thread's registers the mma kernel's s[nt][c]), and the output columns [64h, 64h + 64) of the value
// products (m64n64k32, A the weights' digits, B V's). Those four shift sums stay int32 over a whole round:
// per key |G_1| <= 128 * 128 + 128 * 64 < 2^15, so up to RLP_ATTW_MAX_KEYS keys (ops/attention.py holds
// the tables' capacity to it) they are exact, and N_d = sum_k 256^k G_k is formed once per row. Weight
// and V tiles alternate between the two 64-byte halves of their rows, so one tile's value products run
// while the next tile is staged and scored.
#define RLP_ATTW_PLANE (64 * 128)  // one digit plane of 64 rows x 128 bytes (q, K, the weights)
#define RLP_ATTW_MAX_KEYS 65536

// Wrappers whose bodies exist only in sm_90a builds (the wgmma entry traps elsewhere).
__device__ __forceinline__ void rlp_attw_fence_proxy() {
#ifdef RLP_HAS_WGMMA
    rlp_fence_proxy_async();
#endif
}

// acc[k] = G_k of the warpgroup's 64 rows x keys 32 half..32 half + 31 of the staged tile.
__device__ __forceinline__ void rlp_attw_scores(int (&acc)[4][16], const signed char* qs, const signed char* ks,
                                                int half) {
#ifdef RLP_HAS_WGMMA
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int r = 0; r < 16; ++r) acc[k][r] = 0;
    rlp_wgmma_fence();
#pragma unroll
    for (int step = 0; step < 4; ++step)
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            const unsigned long long a = rlp_wgmma_descriptor(qs + i * RLP_ATTW_PLANE + 32 * step);
#pragma unroll
            for (int j = 0; j < 2; ++j)
                rlp_wgmma_n32(acc[i + j], a, rlp_wgmma_descriptor(ks + j * RLP_ATTW_PLANE + 32 * 128 * half + 32 * step));
        }
    rlp_wgmma_commit();
    rlp_wgmma_wait<0>();  // also the previous tile's value products
#pragma unroll
    for (int k = 0; k < 4; ++k) rlp_wgmma_pin<16>(acc[k]);
#else
    __trap();
#endif
}

// accv[k] += the weights' and V's digit products of shift k over the tile in the rows' half `parity`;
// left in flight (the next rlp_attw_scores or rlp_attw_wait waits for it).
__device__ __forceinline__ void rlp_attw_values(int (&accv)[4][32], const signed char* ws, const signed char* vt,
                                                int half, int parity) {
#ifdef RLP_HAS_WGMMA
    rlp_wgmma_fence();
#pragma unroll
    for (int step = 0; step < 2; ++step)
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            const int k = 32 * (step + 2 * parity);
            const unsigned long long a = rlp_wgmma_descriptor(ws + i * RLP_ATTW_PLANE + k);
#pragma unroll
            for (int j = 0; j < 2; ++j)
                rlp_wgmma_n64(accv[i + j], a, rlp_wgmma_descriptor(vt + j * 2 * RLP_ATTW_PLANE + RLP_ATTW_PLANE * half + k));
        }
    rlp_wgmma_commit();
#pragma unroll
    for (int k = 0; k < 4; ++k) rlp_wgmma_pin<32>(accv[k]);
#endif
}

__device__ __forceinline__ void rlp_attw_wait(int (&accv)[4][32]) {
#ifdef RLP_HAS_WGMMA
    rlp_wgmma_wait<0>();
#pragma unroll
    for (int k = 0; k < 4; ++k) rlp_wgmma_pin<32>(accv[k]);
#endif
}

template <int DPMAX, bool WG>
__device__ __forceinline__ void rlp_attention_mma(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,
    int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats, signed char* smem) {
    static_assert(!WG || DPMAX == 128, "the warpgroup build: one 128-byte row per operand row");
    constexpr int NTMAX = WG ? 1 : DPMAX / 16;  // 8-column tiles of one warp's half of dp (mma build)
    __shared__ int row_seq[RLP_ATTM_BQ], row_pos[RLP_ATTM_BQ], row_eq[RLP_ATTM_BQ], row_done[RLP_ATTM_BQ];
    __shared__ unsigned int row_mkey[RLP_ATTM_BQ], row_ev[RLP_ATTM_BQ], row_flags[RLP_ATTM_BQ];
    __shared__ unsigned long long row_total[RLP_ATTM_BQ];
    __shared__ long long key_row[RLP_ATTM_BK];
    __shared__ int key_ek[RLP_ATTM_BK], key_ev[RLP_ATTM_BK], key_flag[RLP_ATTM_BK];
    __shared__ int cur_seq, last_pos, pair_max[RLP_ATTM_BQ / 16];

    const int chunks = dp / 64;
    if constexpr (WG) smem += (1024 - ((unsigned int)__cvta_generic_to_shared(smem) & 1023)) & 1023;
    // mma: q [3][chunks][64 rows][64], K [2][chunks][64 keys][64], V^T [2][dp][64 keys], weights [3][64 rows][64 keys];
    // WG: q [3][64 rows][128], K [2][64 keys][128], V^T [2][128 columns][128], weights [3][64 rows][128] (swizzled)
    signed char* qs = smem;
    signed char* ks = qs + (WG ? 3 * RLP_ATTW_PLANE : 3 * RLP_ATTM_BQ * dp);
    signed char* vt = ks + (WG ? 2 * RLP_ATTW_PLANE : 2 * RLP_ATTM_BK * dp);
    signed char* ws = vt + (WG ? 4 * RLP_ATTW_PLANE : 2 * RLP_ATTM_BK * dp);

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // rows 16 pair.. and keys 32 half.. of each tile: warps 2 pair and 2 pair + 1 (mma), warp pair of warpgroup half (WG)
    const int gq = lane / 4, tq4 = lane % 4, pair = WG ? warp % 4 : warp / 2, half = WG ? warp / 4 : warp % 2;
    const int h = blockIdx.y, gkv = h / (hq / hkv);
    const long long r0 = (long long)blockIdx.x * RLP_ATTM_BQ;
    auto q_at = [&](int digit, int r, int i) {
        return WG ? qs + digit * RLP_ATTW_PLANE + rlp_swizzle128(r, i) : qs + ((digit * chunks + i / 64) * RLP_ATTM_BQ + r) * 64 + i % 64;
    };
    // the weight digits of row r, key jl of the tile (WG: in the rows' half `parity`)
    auto w_at = [&](int digit, int r, int jl, int parity) {
        return WG ? ws + digit * RLP_ATTW_PLANE + rlp_swizzle128(r, 64 * parity + jl) : ws + (digit * RLP_ATTM_BQ + r) * RLP_ATTM_BK + jl;
    };
    int accv[WG ? 4 : 1][WG ? 32 : 1];  // WG: the value products' shift sums, whole rounds
#pragma unroll
    for (int k = 0; k < (WG ? 4 : 1); ++k)
#pragma unroll
        for (int r = 0; r < (WG ? 32 : 1); ++r) accv[k][r] = 0;

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
                *q_at(digit, rr, i) = (signed char)low;
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

        // Stage one key tile: per-key slot rows and exponents, K digits, and (pass 2) V transposed
        // (WG: into the rows' half `parity`).
        auto stage = [&](int kb, bool values, int parity) {
            __syncthreads();  // the previous tile's readers are done
            if (tid < RLP_ATTM_BK) {
                long long row;
                int f, ek, ev;
                rlp_att_tile_key(block_tables, max_blocks, block_size, num_slots, seq, kb + tid, last, hkv, gkv,
                                 k_exponents, v_exponents, row, ek, ev, f);
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
                *reinterpret_cast<int4*>(WG ? ks + digit * RLP_ATTW_PLANE + rlp_swizzle128(key, 16 * piece)
                                            : ks + ((digit * chunks + piece / 4) * RLP_ATTM_BK + key) * 64 + 16 * (piece % 4)) = v;
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
                    const int word[4] = {(int)__byte_perm(t0, t2, 0x5410), (int)__byte_perm(t0, t2, 0x7632),
                                         (int)__byte_perm(t1, t3, 0x5410), (int)__byte_perm(t1, t3, 0x7632)};
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        *reinterpret_cast<int*>(
                            WG ? vt + digit * 2 * RLP_ATTW_PLANE + rlp_swizzle128(4 * dg + c, 64 * parity + 4 * kg)
                               : vt + ((long long)digit * dp + 4 * dg + c) * RLP_ATTM_BK + 4 * kg) = word[c];
                }
            }
            if (WG) rlp_attw_fence_proxy();  // the tile (and q) written through the generic proxy, read by wgmma
            __syncthreads();
        };

        // Scores of this warp's 16 rows x 32 keys (32 half .. 32 half + 31 of the tile):
        // s[nt][c] for row g + 8 (c / 2), key 32 half + 8 nt + 2 t + c % 2. WG: every thread of the warpgroup calls it.
        auto scores = [&](float (&s)[4][4]) {
            if constexpr (WG) {
                int acc[4][16];
                rlp_attw_scores(acc, qs, ks, half);
#pragma unroll
                for (int k = 0; k < 4; ++k) rlp_wgmma_pin<32>(accv[k]);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        s[nt][c] = rlp_att_score(rlp_attm_combine(acc, 4 * nt + c), eqr[c / 2],
                                                 key_ek[32 * half + 8 * nt + 2 * tq4 + (c % 2)], scale);
            } else {
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
            }
        };

        // ---- pass 1: m, E, flags. The products run where the warp's rows (mma) or the block's (WG) reach.
        unsigned int mkey[2] = {0u, 0u}, evk[2] = {0u, 0u}, flg[2] = {0u, 0u};
        for (int kb = 0; kb <= last; kb += RLP_ATTM_BK) {
            stage(kb, false, 0);
            if (WG || kb + 32 * half <= my_max) {  // warp-uniform; WG: every tile (wgmma in a uniform path)
                float s[4][4];
                scores(s);
                if (kb + 32 * half <= my_max) {
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
        const int ntiles = dp / 16;  // this warp's 8-column tiles (mma)
        for (int kb = 0, parity = 0; kb <= last; kb += RLP_ATTM_BK, parity ^= (WG ? 1 : 0)) {
            stage(kb, true, parity);
            const bool pair_in = kb <= my_max;  // warp-uniform, equal for both warps of the pair
            // WG: the warpgroup scores every tile (wgmma in a uniform path), every warp writes its weights (or zeros)
            float s[4][4];
            if (WG || (pair_in && kb + 32 * half <= my_max)) scores(s);
            if (pair_in && kb + 32 * half <= my_max) {
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
                            *w_at(digit, r, jl, parity) = (signed char)low;
                        }
                    }
            } else if (WG || pair_in) {  // keys beyond every row of the pair: zero weights
                for (int p = lane; p < 3 * 16 * 2; p += 32) {
                    const int digit = p / 32, r = 16 * pair + (p / 2) % 16, part = p % 2;
                    *reinterpret_cast<int4*>(w_at(digit, r, 32 * half + 16 * part, parity)) = make_int4(0, 0, 0, 0);
                }
            }
            if (WG) rlp_attw_fence_proxy();
            __syncthreads();  // the pair's (WG: the block's) weights are in shared memory
            if constexpr (WG) {
                rlp_attw_values(accv, ws, vt, half, parity);
            } else if (pair_in) {
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
        if constexpr (WG) rlp_attw_wait(accv);
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
            // this thread's numerators: columns 8 n + 2 t + e of its half (mma: dp / 2 columns, WG: 64)
#pragma unroll
            for (int n = 0; n < (WG ? 8 : NTMAX); ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = half * (WG ? 64 : dp / 2) + 8 * n + 2 * tq4 + e;
                    long long numerator;
                    if constexpr (WG) numerator = rlp_attm_combine(accv, 4 * n + 2 * k + e);
                    else numerator = num[n][2 * k + e];
                    if ((WG || n < ntiles) && col < d)
                        orow[col] = ok[k] ? __double2float_rn((__ll2double_rn(numerator) * unit) / denominator)
                                          : rlp_canonical_nan();
                }
        }
        __syncthreads();
        if (tid < RLP_ATTM_BQ && !row_done[tid] && row_seq[tid] == seq) row_done[tid] = 1;
        // the next round's first __syncthreads orders this before any read of row_done
    }
}

// Shared memory: 448 dp + 12288 bytes (dynamic); ops/attention.py passes it.
#define RLP_ATTENTION_MMA_ENTRY(NAME, DPMAX, MIN_BLOCKS, WG)                                                          \
    extern "C" __global__ void __launch_bounds__(RLP_ATTM_THREADS, MIN_BLOCKS) NAME(                             \
        const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, \
        int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,        \
        int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,          \
        const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,                          \
        const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats) {          \
        extern __shared__ int4 rlp_attm_smem[];                                                                  \
        rlp_attention_mma<DPMAX, WG>(q, q_seq, q_pos, tq, hq, hkv, d, dp, scale, block_tables, num_seqs, max_blocks, \
                                 block_size, num_slots, k_digits, k_exponents, v_digits, v_exponents, out,       \
                                 row_stats, reinterpret_cast<signed char*>(rlp_attm_smem));                     \
    }

// head_dim padded to 64 or 128, and to 192 or 256
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d128, 128, 2, false)
RLP_ATTENTION_MMA_ENTRY(attention_paged_mma_d256, 256, 1, false)
// head_dim padded to 128, sm_90a (traps elsewhere; ops/attention.py picks it on compute capability 9.0);
// shared memory: 4 * 3 * 8 KB + 1 KB for the 1024-byte alignment (dynamic)
RLP_ATTENTION_MMA_ENTRY(attention_paged_wgmma_d128, 128, 1, true)

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
    static constexpr int BQ = DP <= 128 ? 64 : 32;     // query rows of a stats (and dq) tile
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

// The scalars of query rows t0 .. t0 + BQ - 1 of head h (the tiled kernels' RlpAttdRows, RlpAtt8Rows,
// RlpAtt8Keys; rows beyond count: poisoned, no terms), NT threads.
template <int BQ, int NT, typename S>
__device__ __forceinline__ void rlp_attd_row_scalars(S& s, const int* __restrict__ row_info,
                                                     const double* __restrict__ row_stats, long long t0, int count,
                                                     int hq, int h) {
    for (int r = threadIdx.x; r < BQ; r += NT) {
        const long long item = (t0 + r) * hq + h;
        const bool in = r < count;
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
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attd_load<DP, BQ>(qs, q_int, t0 * hq + h, hq, rows);
    rlp_attd_row_scalars<RlpAttd<DP>::BQ, RLP_ATTD_THREADS>(s, row_info, row_stats, t0, rows, hq, h);
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
        if (pass == 0) rlp_attt_stats_max<BQ, RLP_ATTD_THREADS>(s);
    }
    __syncthreads();
    rlp_attt_stats_write<RLP_ATTD_THREADS>(s, row_info, row_stats, t0, rows, hq, h);
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

// ---- The int8 tensor-core dq and dkv (mma.sync m16n8k32 s8, sm_80+). With 15-bit coefficients every
// product of the backward is an int8 digit product: S = qq . qk and dP = qdo . qv as the forward's 3 x 2
// digits (rlp_attm_chunk); a block's partial U . qk as 2 x 2 digits, U . qq and U . qdo as 2 x 3, with
// the block's 64 positions as the reduction dimension (one 64-byte chunk). The digit products of equal
// shift meet in int32 (|group| <= 2 * 64 * 2^14 = 2^21), combined exactly in int64. The operands whose
// reduction dimension is the block's positions sit transposed, [digit][column][64 positions]; their
// fragments read the same bytes [16t, 16t + 16) of each chunk as the other operand's (a permutation of
// the positions both share). A block's coefficients never leave the registers of the threads that
// formed them until its exponent is known: then they are quantized and stored as digits.
template <int DP>
struct RlpAtt8 {
    static constexpr int BQ = DP <= 128 ? 64 : 32;  // query rows of a dq tile (keys per step: one block)
    static constexpr int BKV = 4096 / DP;           // key rows of a dkv tile (queries per step: one block)
    static constexpr int CH = DP / 64;              // 64-byte chunks of a row's digits
    // 16 warps where the tiles have work for them: one block a multiprocessor (the shared memory),
    // so more warps are what hides the loads' and the per-pair arithmetic's latency
    static constexpr int THREADS = DP <= 128 ? 512 : 256;
    static constexpr int WARPS = THREADS / 32;
};

// The int8 kernels' scalars: a query block's rows (dq: the tile's rows; dkv: the block's 64 queries) and
// keys (dq: the block's 64 keys; dkv: the tile's keys).
template <int BQ, int BK>
struct RlpAtt8Rows {
    double total[BQ], delta[BQ];
    float m[BQ];
    int eq[BQ], edo[BQ], bad[BQ];
    int ek[BK], ev[BK];
    unsigned int field[BQ];
};

template <int BQ, int BKV>
struct RlpAtt8Keys {
    double total[BQ], delta[BQ];
    float m[BQ];
    int eq[BQ], edo[BQ], bad[BQ];
    int ek[BKV], ev[BKV];
    unsigned int field_k[BKV], field_v[BKV], bad_key[BKV];
};

// A balanced int8 digit of v (v - digit is a multiple of 256), and v's rest after it.
__device__ __forceinline__ int rlp_attd_digit(int& v) {
    const int low = ((v + 128) & 255) - 128;
    v = (v - low) >> 8;
    return low;
}

// Rows [count] of DP integers (|v| <= 2^22) from global (row r at src + (first + r step) DP) as NDIG
// balanced digit planes [digit][DP / 64][ROWS][64] (the reduction dimension d); rows beyond count are 0.
template <int DP, int ROWS, int NDIG, int NT>
__device__ __forceinline__ void rlp_attd_load_digits(signed char* dst, const int* __restrict__ src, long long first,
                                                     long long step, int count) {
    for (int i = threadIdx.x; i < ROWS * (DP / 4); i += NT) {
        const int r = i / (DP / 4);
        const int c = 4 * (i - r * (DP / 4));
        int4 v = make_int4(0, 0, 0, 0);
        if (r < count) v = *reinterpret_cast<const int4*>(src + (first + r * step) * DP + c);
        int w[4] = {v.x, v.y, v.z, v.w};
        unsigned int packed[NDIG];
#pragma unroll
        for (int k = 0; k < NDIG; ++k) packed[k] = 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int k = 0; k < NDIG; ++k) packed[k] |= (unsigned int)(rlp_attd_digit(w[e]) & 255) << (8 * e);
#pragma unroll
        for (int k = 0; k < NDIG; ++k)
            *reinterpret_cast<unsigned int*>(dst + ((k * (DP / 64) + c / 64) * ROWS + r) * 64 + c % 64) = packed[k];
    }
}

// The backward's digit tiles, written once per call by attention_backward_mma_digits: for every 64-position
// block of a sequence (blocks listed in sequence order, block_first[s] the first of sequence s) and head h,
// the rows of q, do (3 digits) or k, v (2) as rlp_attd_load_digits<DP, 64, NDIG> lays them out
// ([digit][DP / 64][64][64], positions past the sequence's end 0), at tiles + (block heads + h) NDIG DP 64.
// dq and dkv copy these bytes at each step (cp.async) instead of reading the int32 rows and splitting
// them again: the split and the int32 rows' bytes were most of a step (one step per query block and head).
extern "C" __global__ void __launch_bounds__(256) attention_backward_mma_digits(
    const int* __restrict__ blocks, const long long* __restrict__ cu_seqlens, int heads, int dp, int ndig,
    const int* __restrict__ src, signed char* __restrict__ tiles) {
    const int seq = blocks[2 * blockIdx.x], h = blockIdx.y;
    const long long t0 = blocks[2 * blockIdx.x + 1];
    const int count = (int)min(64LL, cu_seqlens[seq + 1] - t0);
    signed char* dst = tiles + ((long long)blockIdx.x * heads + h) * ndig * dp * 64;
    for (int i = threadIdx.x; i < 64 * (dp / 4); i += blockDim.x) {
        const int r = i / (dp / 4), c = 4 * (i - r * (dp / 4));
        int4 v = make_int4(0, 0, 0, 0);
        if (r < count) v = *reinterpret_cast<const int4*>(src + ((t0 + r) * heads + h) * dp + c);
        int w[4] = {v.x, v.y, v.z, v.w};
        unsigned int packed[3] = {0u, 0u, 0u};
#pragma unroll
        for (int e = 0; e < 4; ++e)
#pragma unroll
            for (int k = 0; k < 3; ++k) packed[k] |= (unsigned int)(rlp_attd_digit(w[e]) & 255) << (8 * e);
        for (int k = 0; k < ndig; ++k)
            *reinterpret_cast<unsigned int*>(dst + ((k * (dp / 64) + c / 64) * 64 + r) * 64 + c % 64) = packed[k];
    }
}

// NBYTES of a digit tile from global into shared memory, 16 bytes a cp.async (the caller commits and waits).
template <int NBYTES, int NT>
__device__ __forceinline__ void rlp_attd_copy_tile(signed char* dst, const signed char* __restrict__ src) {
    static_assert(NBYTES % 16 == 0, "whole 16-byte pieces");
    for (int i = threadIdx.x; i < NBYTES / 16; i += NT) rlp_cp_async16(dst + 16 * i, src + 16 * i, true);
}

// A 64-position block's row tiles [digit][DP / 64][64][64] transposed in shared memory into [digit][DP][64]
// (position c of column d at byte (digit DP + d) 64 + c), by 4 x 4 byte blocks: the lanes of a half-warp
// take the 16 groups of 4 rows, each at its own group of 4 columns, so loads and stores meet 2-way bank
// conflicts.
template <int DP, int NDIG, int NT>
__device__ __forceinline__ void rlp_attd_transpose(signed char* dst, const signed char* src) {
    constexpr int CH = DP / 64;
    for (int b = threadIdx.x; b < NDIG * CH * 256; b += NT) {
        const int kc = b >> 8, rb = b & 15, db = (rb + ((b >> 4) & 15)) & 15;  // kc = digit CH + chunk
        const int k = kc / CH, ch = kc - k * CH;
        const unsigned int* in = reinterpret_cast<const unsigned int*>(src + (kc * 64 + 4 * rb) * 64 + 4 * db);
        const unsigned int w0 = in[0], w1 = in[16], w2 = in[32], w3 = in[48];  // rows 4 rb .. 4 rb + 3
        const unsigned int t0 = __byte_perm(w0, w1, 0x5140), t1 = __byte_perm(w2, w3, 0x5140);
        const unsigned int t2 = __byte_perm(w0, w1, 0x7362), t3 = __byte_perm(w2, w3, 0x7362);
        unsigned int* out = reinterpret_cast<unsigned int*>(dst + (k * DP + ch * 64 + 4 * db) * 64 + 4 * rb);
        out[0] = __byte_perm(t0, t1, 0x5410);   // column 4 db: byte 0 of each row
        out[16] = __byte_perm(t0, t1, 0x7632);  // column 4 db + 1
        out[32] = __byte_perm(t2, t3, 0x5410);
        out[48] = __byte_perm(t2, t3, 0x7632);
    }
}

// The 16x8 block of a . b^T over DP from row-layout digit tiles (a: RA rows, 3 digits, rows a0..;
// b: RB rows, 2 digits, rows b0..), exact, as float64 (|S| < 2^44): the forward's digit products.
template <int DP, int RA, int RB>
__device__ __forceinline__ void rlp_attd_block8(double (&x)[4], const signed char* a, int a0, const signed char* b,
                                                int b0) {
    constexpr int CH = DP / 64;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int acc[4][4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[k][i] = 0;
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) {
        int4 fa[3][2], fb[2];
#pragma unroll
        for (int i = 0; i < 3; ++i)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                fa[i][r] = *reinterpret_cast<const int4*>(a + ((i * CH + ch) * RA + a0 + g + 8 * r) * 64 + 16 * t);
#pragma unroll
        for (int j = 0; j < 2; ++j)
            fb[j] = *reinterpret_cast<const int4*>(b + ((j * CH + ch) * RB + b0 + g) * 64 + 16 * t);
        rlp_attm_chunk(acc, fa, fb);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = (double)rlp_attm_combine(acc, i);
}

// The 16x8 block of a block's partial: A (2 coefficient digits, [digit][RA][64], rows a0..) times B
// (NB digits, transposed [digit][DP][64], columns b0..) over the block's 64 positions, exact in int64.
template <int RA, int NB, int DP>
__device__ __forceinline__ void rlp_attd_partial8(long long (&x)[4], const signed char* a, int a0, const signed char* b,
                                                  int b0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int acc[NB + 1][4];
#pragma unroll
    for (int k = 0; k <= NB; ++k)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[k][i] = 0;
    int4 fa[2][2], fb[NB];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int r = 0; r < 2; ++r) fa[i][r] = *reinterpret_cast<const int4*>(a + (i * RA + a0 + g + 8 * r) * 64 + 16 * t);
#pragma unroll
    for (int j = 0; j < NB; ++j) fb[j] = *reinterpret_cast<const int4*>(b + (j * DP + b0 + g) * 64 + 16 * t);
#pragma unroll
    for (int step = 0; step < 2; ++step)
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NB; ++j)
                rlp_mma_s8(acc[i + j], rlp_word(fa[i][0], 2 * step), rlp_word(fa[i][1], 2 * step),
                             rlp_word(fa[i][0], 2 * step + 1), rlp_word(fa[i][1], 2 * step + 1),
                             rlp_word(fb[j], 2 * step), rlp_word(fb[j], 2 * step + 1));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        long long v = acc[NB][i];
#pragma unroll
        for (int k = NB - 1; k >= 0; --k) v = v * 256 + acc[k][i];
        x[i] = v;
    }
}

// A quantized coefficient's two digits into a [digit][rows][64] tile at (row, position).
__device__ __forceinline__ void rlp_attd_store_u(signed char* u, int rows, int row, int pos, long long big_u) {
    int v = (int)big_u;
    u[row * 64 + pos] = (signed char)rlp_attd_digit(v);
    u[(rows + row) * 64 + pos] = (signed char)v;
}

// dq of a query tile (grid (tiles, hq)) on the int8 tensor cores: per block of 64 keys, S and dP (each
// warp a 16-row strip x 8 n-blocks' share), the coefficients u = dS 2^ek kept in registers, each row's E
// over the block (lanes, then shared atomics), U's digits into a tile, then the block's partial U . qk
// and acc = acc + partial 2^(E - 26), blocks ascending.
template <int DP>
__device__ __forceinline__ void rlp_attd_dq8(
    const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dq,
    const int* __restrict__ block_first, const signed char* __restrict__ k_tiles,
    const signed char* __restrict__ v_tiles, signed char* smem) {
    using T = RlpAtt8<DP>;
    constexpr int BQ = T::BQ, BK = RLP_ATTB_BLOCK, NT = T::THREADS, NW = T::WARPS;
    constexpr int NBW = (BQ / 16) * (BK / 8) / NW;  // S blocks per warp (one 16-row strip)
    constexpr int NPW = (BQ / 16) * (DP / 8) / NW;   // output blocks per warp
    signed char* q8 = smem;
    signed char* do8 = q8 + 3 * BQ * DP;
    signed char* k8 = do8 + 3 * BQ * DP;
    signed char* v8 = k8 + 2 * BK * DP;
    signed char* kt8 = v8 + 2 * BK * DP;
    signed char* u8 = kt8 + 2 * BK * DP;
    RlpAtt8Rows<BQ, BK>& s = *reinterpret_cast<RlpAtt8Rows<BQ, BK>*>(u8 + 2 * BQ * BK);
    const int warp = threadIdx.x >> 5;
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start, t_end = tile.t0 + tile.rows;
    const int rows = tile.rows, h = tile.h, g = tile.g, tile_seq = q_tiles[2 * blockIdx.x];
    rlp_attd_load_digits<DP, BQ, 3, NT>(q8, q_int, t0 * hq + h, hq, rows);
    rlp_attd_load_digits<DP, BQ, 3, NT>(do8, do_int, t0 * hq + h, hq, rows);
    rlp_attd_row_scalars<BQ, NT>(s, row_info, row_stats, t0, rows, hq, h);
    const int mb = (warp * NBW) / (BK / 8), nb0 = (warp * NBW) % (BK / 8);  // S blocks of this warp
    const int om = (warp * NPW) / (DP / 8), on0 = (warp * NPW) % (DP / 8);  // output blocks of this warp
    double acc[NPW][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[n][i] = 0.0;
    for (long long j0 = start; j0 < t_end; j0 += BK) {
        const int keys = (int)min((long long)BK, t_end - j0);
        __syncthreads();
        // the key block's digit tiles (keys past the query tile's end carry digits, unlike the int32 path's
        // zeros: the causal test leaves their S and dP unused and their coefficients 0)
        const long long tile = ((long long)block_first[tile_seq] + (j0 - start) / BK) * hkv + g;
        rlp_attd_copy_tile<2 * BK * DP, NT>(k8, k_tiles + tile * (2 * BK * DP));
        rlp_attd_copy_tile<2 * BK * DP, NT>(v8, v_tiles + tile * (2 * BK * DP));
        rlp_cp_async_commit();
        for (int c = threadIdx.x; c < BK; c += NT) {
            s.ek[c] = c < keys ? k_exponents[(j0 + c) * hkv + g] : 0;
            s.ev[c] = c < keys ? v_exponents[(j0 + c) * hkv + g] : 0;
        }
        for (int r = threadIdx.x; r < BQ; r += NT) s.field[r] = 0u;
        rlp_cp_async_wait<0>();
        __syncthreads();
        rlp_attd_transpose<DP, 2, NT>(kt8, k8);  // read only after the block's products: the barrier below
        double u[NBW][4];
        unsigned int f[2] = {0u, 0u};
#pragma unroll
        for (int n = 0; n < NBW; ++n) {
            double x[4], y[4];
            rlp_attd_block8<DP, BQ, BK>(x, q8, mb * 16, k8, (nb0 + n) * 8);
            rlp_attd_block8<DP, BQ, BK>(y, do8, mb * 16, v8, (nb0 + n) * 8);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = mb * 16 + rlp_attd_row(i), c = (nb0 + n) * 8 + rlp_attd_col(i);
                u[n][i] = 0.0;
                if (r < rows && c < keys && j0 + c <= t0 + r && s.bad[r] == 0) {
                    double big_p, ds;
                    rlp_attt_pair(x[i], y[i], s.eq[r], s.ek[c], s.edo[r], s.ev[c], s.m[r], s.total[r], s.delta[r],
                                  scale, &big_p, &ds);
                    u[n][i] = ds * rlp_pow2_f64(s.ek[c]);
                    f[i >> 1] = max(f[i >> 1], rlp_attb_field(u[n][i]));
                }
            }
        }
        rlp_attd_row_fields(f, s.field, mb * 16, BQ);
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NBW; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = mb * 16 + rlp_attd_row(i);
                rlp_attd_store_u(u8, BQ, r, (nb0 + n) * 8 + rlp_attd_col(i),
                                 rlp_attb_quantize(u[n][i], rlp_attb_exponent(s.field[r])));
            }
        __syncthreads();
        double unit[2];
#pragma unroll
        for (int half = 0; half < 2; ++half)
            unit[half] = rlp_pow2_f64(rlp_attb_exponent(s.field[om * 16 + rlp_attd_row(2 * half)]) -
                                      (RLP_ATTB_COEF_BITS - 2) - (RLP_ATT_KV_BITS - 2));
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            long long part[4];
            rlp_attd_partial8<BQ, 2, DP>(part, u8, om * 16, kt8, (on0 + n) * 8);
#pragma unroll
            for (int i = 0; i < 4; ++i)  // exact scaling (|part| < 2^35): one rounding, the add
                acc[n][i] = acc[n][i] + (double)part[i] * unit[i >> 1];
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = om * 16 + rlp_attd_row(i);
        if (r >= rows) continue;
        float* out = dq + ((t0 + r) * hq + h) * (long long)d;
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            const int col = (on0 + n) * 8 + rlp_attd_col(i);
            if (col < d) out[col] = s.bad[r] ? rlp_canonical_nan() : __double2float_rn(acc[n][i]);
        }
    }
}

// dk and dv of a key tile (grid (key tiles, hkv)) on the int8 tensor cores: per block of 64 queries
// (from the block holding the tile's first key) and within it per q head of the group in order: S and
// dP as [query][key] fragments, the coefficients dS 2^eq and P 2^edo in registers, each key's E over the
// block (a column maximum), the transposed U digits into tiles, the block's partials U^T . qq and
// U^T . qdo against the transposed q and do digit tiles, acc = acc + partial 2^(E - 34). A key that a
// poisoned row reaches gets the canonical NaN.
template <int DP>
__device__ __forceinline__ void rlp_attd_dkv8(
    const int* __restrict__ key_tiles, const long long* __restrict__ cu_seqlens, int hq, int hkv, int d, double scale,
    const int* __restrict__ q_int, const int* __restrict__ do_int, const int* __restrict__ k_int,
    const int* __restrict__ v_int, const int* __restrict__ k_exponents, const int* __restrict__ v_exponents,
    const int* __restrict__ row_info, const double* __restrict__ row_stats, float* __restrict__ dk,
    float* __restrict__ dv, const int* __restrict__ block_first, const signed char* __restrict__ q_tiles8,
    const signed char* __restrict__ do_tiles8, signed char* smem) {
    using T = RlpAtt8<DP>;
    constexpr int BKV = T::BKV, BQ = RLP_ATTB_BLOCK, NT = T::THREADS, NW = T::WARPS;
    constexpr int NBW = (BQ / 16) * (BKV / 8) / NW;  // S blocks per warp ([query][key])
    constexpr int NPW = (BKV / 16) * (DP / 8) / NW;  // output blocks per warp and output
    signed char* q8 = smem;
    signed char* do8 = q8 + 3 * BQ * DP;
    signed char* qt8 = do8 + 3 * BQ * DP;
    signed char* dot8 = qt8 + 3 * BQ * DP;
    signed char* k8 = dot8 + 3 * BQ * DP;
    signed char* v8 = k8 + 2 * BKV * DP;
    signed char* uk8 = v8 + 2 * BKV * DP;
    signed char* uv8 = uk8 + 2 * BKV * BQ;
    RlpAtt8Keys<BQ, BKV>& s = *reinterpret_cast<RlpAtt8Keys<BQ, BKV>*>(uv8 + 2 * BKV * BQ);
    const int warp = threadIdx.x >> 5;
    const int seq = key_tiles[2 * blockIdx.x];
    const long long j0 = key_tiles[2 * blockIdx.x + 1], start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    const int keys = (int)min((long long)BKV, end - j0);
    const int g = blockIdx.y, group = hq / hkv;
    rlp_attd_load_digits<DP, BKV, 2, NT>(k8, k_int, j0 * hkv + g, hkv, keys);
    rlp_attd_load_digits<DP, BKV, 2, NT>(v8, v_int, j0 * hkv + g, hkv, keys);
    for (int c = threadIdx.x; c < BKV; c += NT) {
        const long long kr = (j0 + c) * hkv + g;
        s.ek[c] = c < keys ? k_exponents[kr] : 0;
        s.ev[c] = c < keys ? v_exponents[kr] : 0;
        s.bad_key[c] = 0u;
    }
    const int mb = (warp * NBW) / (BKV / 8), nb0 = (warp * NBW) % (BKV / 8);  // S blocks: query strip, keys
    const int om = (warp * NPW) / (DP / 8), on0 = (warp * NPW) % (DP / 8);    // output blocks: key strip, d
    double acc_k[NPW][4], acc_v[NPW][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) { acc_k[n][i] = 0.0; acc_v[n][i] = 0.0; }
    for (long long t0 = start + (j0 - start) / BQ * BQ; t0 < end; t0 += BQ)
        for (int hh = 0; hh < group; ++hh) {
            const int h = g * group + hh;
            const int qrows = (int)min((long long)BQ, end - t0);
            __syncthreads();
            const long long tile = ((long long)block_first[seq] + (t0 - start) / BQ) * hq + h;
            rlp_attd_copy_tile<3 * BQ * DP, NT>(q8, q_tiles8 + tile * (3 * BQ * DP));
            rlp_attd_copy_tile<3 * BQ * DP, NT>(do8, do_tiles8 + tile * (3 * BQ * DP));
            rlp_cp_async_commit();
            rlp_attd_row_scalars<BQ, NT>(s, row_info, row_stats, t0, qrows, hq, h);
            for (int c = threadIdx.x; c < BKV; c += NT) { s.field_k[c] = 0u; s.field_v[c] = 0u; }
            rlp_cp_async_wait<0>();
            __syncthreads();
            rlp_attd_transpose<DP, 3, NT>(qt8, q8);  // read only after the block's products: barriers below
            rlp_attd_transpose<DP, 3, NT>(dot8, do8);
            double uk[NBW][4], uv[NBW][4];
#pragma unroll
            for (int n = 0; n < NBW; ++n) {
                double x[4], y[4];
                rlp_attd_block8<DP, BQ, BKV>(x, q8, mb * 16, k8, (nb0 + n) * 8);
                rlp_attd_block8<DP, BQ, BKV>(y, do8, mb * 16, v8, (nb0 + n) * 8);
                unsigned int fk[2] = {0u, 0u}, fv[2] = {0u, 0u}, bad[2] = {0u, 0u};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = mb * 16 + rlp_attd_row(i);        // query row
                    const int c = (nb0 + n) * 8 + rlp_attd_col(i);  // key
                    uk[n][i] = 0.0;
                    uv[n][i] = 0.0;
                    if (r < qrows && c < keys && j0 + c <= t0 + r) {
                        if (s.bad[r] != 0) {
                            bad[i & 1] = 1u;
                        } else {
                            double big_p, ds;
                            rlp_attt_pair(x[i], y[i], s.eq[r], s.ek[c], s.edo[r], s.ev[c], s.m[r], s.total[r],
                                          s.delta[r], scale, &big_p, &ds);
                            uk[n][i] = ds * rlp_pow2_f64(s.eq[r]);
                            uv[n][i] = big_p * rlp_pow2_f64(s.edo[r]);
                            fk[i & 1] = max(fk[i & 1], rlp_attb_field(uk[n][i]));
                            fv[i & 1] = max(fv[i & 1], rlp_attb_field(uv[n][i]));
                        }
                    }
                }
#pragma unroll
                for (int e = 0; e < 2; ++e) {  // key column 2 t + e: the 8 lanes of the column meet
                    const unsigned int k_max = rlp_attd_umax_columns(fk[e]);
                    const unsigned int v_max = rlp_attd_umax_columns(fv[e]);
                    const unsigned int b_any = rlp_attd_umax_columns(bad[e]);
                    const int c = (nb0 + n) * 8 + rlp_attd_col(e);
                    if ((threadIdx.x & 31) < 4) {
                        if (k_max) atomicMax(&s.field_k[c], k_max);
                        if (v_max) atomicMax(&s.field_v[c], v_max);
                        if (b_any) s.bad_key[c] = 1u;
                    }
                }
            }
            __syncthreads();
#pragma unroll
            for (int n = 0; n < NBW; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = mb * 16 + rlp_attd_row(i), c = (nb0 + n) * 8 + rlp_attd_col(i);
                    rlp_attd_store_u(uk8, BKV, c, r, rlp_attb_quantize(uk[n][i], rlp_attb_exponent(s.field_k[c])));
                    rlp_attd_store_u(uv8, BKV, c, r, rlp_attb_quantize(uv[n][i], rlp_attb_exponent(s.field_v[c])));
                }
            __syncthreads();
            double unit_k[2], unit_v[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int c = om * 16 + rlp_attd_row(2 * half);
                unit_k[half] = rlp_pow2_f64(rlp_attb_exponent(s.field_k[c]) - (RLP_ATTB_COEF_BITS - 2) -
                                            RLP_ATTB_ROW_SHIFT);
                unit_v[half] = rlp_pow2_f64(rlp_attb_exponent(s.field_v[c]) - (RLP_ATTB_COEF_BITS - 2) -
                                            RLP_ATTB_ROW_SHIFT);
            }
#pragma unroll
            for (int n = 0; n < NPW; ++n) {
                long long pk[4], pv[4];
                rlp_attd_partial8<BKV, 3, DP>(pk, uk8, om * 16, qt8, (on0 + n) * 8);
                rlp_attd_partial8<BKV, 3, DP>(pv, uv8, om * 16, dot8, (on0 + n) * 8);
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // exact scalings (|partial| < 2^42): one rounding each, the adds
                    acc_k[n][i] = acc_k[n][i] + (double)pk[i] * unit_k[i >> 1];
                    acc_v[n][i] = acc_v[n][i] + (double)pv[i] * unit_v[i >> 1];
                }
            }
        }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int c = om * 16 + rlp_attd_row(i);
        if (c >= keys) continue;
        const long long at = ((j0 + c) * hkv + g) * (long long)d;
        const bool poisoned = s.bad_key[c] != 0u;
#pragma unroll
        for (int n = 0; n < NPW; ++n) {
            const int col = (on0 + n) * 8 + rlp_attd_col(i);
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
    extern "C" __global__ void __launch_bounds__(RlpAtt8<DP>::THREADS) DQ(                                  \
        RLP_ATTT_QUERY_ARGS, const int* __restrict__ block_first, const signed char* __restrict__ q_tiles8,     \
        const signed char* __restrict__ do_tiles8, const signed char* __restrict__ k_tiles8,                   \
        const signed char* __restrict__ v_tiles8) {                                                            \
        extern __shared__ double rlp_attd_smem[];                                                              \
        rlp_attd_dq8<DP>(q_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,     \
                         v_exponents, row_info, row_stats, dq, block_first, k_tiles8, v_tiles8,                \
                         reinterpret_cast<signed char*>(rlp_attd_smem));                                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(RlpAtt8<DP>::THREADS) DKV(                                 \
        RLP_ATTT_KEY_ARGS, const int* __restrict__ block_first, const signed char* __restrict__ q_tiles8,       \
        const signed char* __restrict__ do_tiles8, const signed char* __restrict__ k_tiles8,                   \
        const signed char* __restrict__ v_tiles8) {                                                            \
        extern __shared__ double rlp_attd_smem[];                                                              \
        rlp_attd_dkv8<DP>(key_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,  \
                          v_exponents, row_info, row_stats, dk, dv, block_first, q_tiles8, do_tiles8,          \
                          reinterpret_cast<signed char*>(rlp_attd_smem));                                      \
    }

// padded head_dim 64, 128 and 256 (192 runs as 256)
RLP_ATTD_ENTRIES(64, attention_backward_mma_stats_d64, attention_backward_mma_dq_d64, attention_backward_mma_dkv_d64)
RLP_ATTD_ENTRIES(128, attention_backward_mma_stats_d128, attention_backward_mma_dq_d128,
                 attention_backward_mma_dkv_d128)
RLP_ATTD_ENTRIES(256, attention_backward_mma_stats_d256, attention_backward_mma_dq_d256,
                 attention_backward_mma_dkv_d256)
