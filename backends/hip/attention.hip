// Kernel family "attention", AMD's fast path: the forward on the integer matrix cores (MFMA),
// attention_paged_mfma_d{64,128}_{gfx942,gfx90a} (v_mfma_i32_16x16x32_i8 on CDNA3, 16x16x16i8 on
// CDNA2). Contract: contracts/attention.toml, op "attention"; reference: rlportable/contract/attention.py.
// The family's portable kernels are backends/portable/attention.hip, included here. Each kernel is
// built only where its instruction exists (clang's __gfx942__ / __gfx90a__) and on HIP-CPU, which
// emulates both (backends/hip/cpu_prelude.h); `rlportable conform --device hip-cpu` checks them bit
// for bit. The same bits as attention_paged: every sum is an exact integer sum, every max exact.
#include "../portable/attention.hip"

#if defined(__gfx942__) || defined(__gfx90a__) || defined(RLP_HIP_CPU)
// The plan of NVIDIA's attention_paged_mma (backends/cuda/attention.cu) on AMD's wavefront: a block
// takes 64 consecutive query rows of one q head, grid (ceil(tq / 64), hq), 256 threads = 4 wavefronts;
// wavefront w owns rows 16 w .. 16 w + 15 and every key of a 64-key tile. Rows of several sequences
// are served one sequence per round. Pass 1 (per key tile): S = qq . qk from 3 x 2 digit products in 4
// int32 shift groups (|group| <= 2 * 128 * 2^14 = 2^22), combined in int64; the score, then m, E and
// the flags of each row as exact maxima (shared-memory atomics). Pass 2: the scores again, p, L and
// the weights w = RNE(p 2^(ev - E + 21)) <= 2^21 as 3 balanced int8 digits in LDS; N_d += w . qv over
// the 64 keys (3 x 2 digit products, |group| <= 64 * 2 * 2^14 = 2^21), combined into int64 registers.
// The q digits sit in registers (each lane's MFMA fragments, loaded once), K row-major and V
// transposed ([digit][d][key]: the keys are MFMA's reduction dimension) in LDS. Fragments (cpu_prelude.h
// "Integer MFMA"): lane l gives row (column) l % 16 and reduction bytes KL (l / 16) .. + KL - 1 of a
// step of 4 KL; D's lane l holds column l % 16, rows 4 (l / 16) + r, r = 0..3.
// LDS, for padded head_dim DP: K 2 x 64 x (DP + 16), V 2 x DP x 80, weights 3 x 64 x 80 bytes (the
// q digits, 3 x 64 x (DP + 16), are staged over K and V before the first tile): 54,272 bytes at
// DP = 128. DP = 256 would need 91 KB, beyond 64 KiB: such heads take the portable kernel.
#define RLP_ATTF_ROWS 64
#define RLP_ATTF_KEYS 64
#define RLP_ATTF_THREADS 256
#define RLP_ATTF_LDW (RLP_ATTF_KEYS + 16)  // LDS stride of a weight row and of a transposed V column

typedef int rlp_attf_i32x4 __attribute__((vector_size(16)));

template <int KL>
struct RlpAttfMfma;
#if defined(__gfx942__) || defined(RLP_HIP_CPU)
template <>
struct RlpAttfMfma<8> {
    typedef long operand;
    static __device__ __forceinline__ rlp_attf_i32x4 run(operand a, operand b, rlp_attf_i32x4 c) {
        return __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, c, 0, 0, 0);
    }
};
#endif
#if defined(__gfx90a__) || defined(RLP_HIP_CPU)
template <>
struct RlpAttfMfma<4> {
    typedef int operand;
    static __device__ __forceinline__ rlp_attf_i32x4 run(operand a, operand b, rlp_attf_i32x4 c) {
        return __builtin_amdgcn_mfma_i32_16x16x16i8(a, b, c, 0, 0, 0);
    }
};
#endif

// S = sum_d 256^d G_d of register r of a 16 x 16 block's 4 shift groups, exact in int64.
__device__ __forceinline__ long long rlp_attf_combine(const rlp_attf_i32x4 (&g)[4], int r) {
    return (((long long)g[3][r] * 256 + g[2][r]) * 256 + g[1][r]) * 256 + g[0][r];
}

// Byte c of each of 4 words as one word: byte i of the result is byte c of word i.
__device__ __forceinline__ int rlp_attf_byte_column(const int (&w)[4], int c) {
    unsigned int out = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) out |= (((unsigned int)w[i] >> (8 * c)) & 255u) << (8 * i);
    return (int)out;
}

template <int DP, int KL>
__device__ __forceinline__ void rlp_attention_mfma(
    const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq,
    int hq, int hkv, int d, double scale, const int* __restrict__ block_tables, int num_seqs, int max_blocks,
    int block_size, long long num_slots, const signed char* __restrict__ k_digits,
    const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,
    const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats) {
    typedef typename RlpAttfMfma<KL>::operand operand;
    constexpr int LDK = DP + 16;             // LDS stride of a K (and staged q) digit row
    constexpr int STEP = 4 * KL;             // reduction bytes of one MFMA
    constexpr int QSTEPS = DP / STEP, VSTEPS = RLP_ATTF_KEYS / STEP, NBLOCKS = DP / 16;
    constexpr int K_BYTES = 2 * RLP_ATTF_KEYS * LDK, V_BYTES = 2 * DP * RLP_ATTF_LDW;
    static_assert(3 * RLP_ATTF_ROWS * LDK <= K_BYTES + V_BYTES, "the q digits are staged over K and V");
    __shared__ int4 lds4[(K_BYTES + V_BYTES + 3 * RLP_ATTF_ROWS * RLP_ATTF_LDW) / 16];
    __shared__ int row_seq[RLP_ATTF_ROWS], row_pos[RLP_ATTF_ROWS], row_eq[RLP_ATTF_ROWS], row_done[RLP_ATTF_ROWS];
    __shared__ unsigned int row_largest[RLP_ATTF_ROWS], row_mkey[RLP_ATTF_ROWS], row_ev[RLP_ATTF_ROWS];
    __shared__ unsigned int row_flags[RLP_ATTF_ROWS];
    __shared__ unsigned long long row_total[RLP_ATTF_ROWS];
    __shared__ long long key_row[RLP_ATTF_KEYS];
    __shared__ int key_ek[RLP_ATTF_KEYS], key_ev[RLP_ATTF_KEYS], key_flag[RLP_ATTF_KEYS];
    __shared__ int cur_seq, last_pos, wave_max[RLP_ATTF_THREADS / 64];
    signed char* ks = reinterpret_cast<signed char*>(lds4);  // [2][64 keys][LDK]
    signed char* vt = ks + K_BYTES;                           // [2][DP][LDW]
    signed char* ws = vt + V_BYTES;                           // [3][64 rows][LDW]
    signed char* qs = ks;                                     // [3][64 rows][LDK], before the first tile

    const int tid = threadIdx.x, lane = tid % 64, wave = tid / 64;
    const int frag = lane % 16, frag_k = KL * (lane / 16);
    const int h = blockIdx.y, gkv = h / (hq / hkv);
    const long long r0 = (long long)blockIdx.x * RLP_ATTF_ROWS;

    // ---- q rows: exponent, 3 balanced digits; rows that cannot run get the canonical NaN now
    if (tid < RLP_ATTF_ROWS) row_largest[tid] = 0u;
    __syncthreads();
    for (int idx = tid; idx < RLP_ATTF_ROWS * d; idx += RLP_ATTF_THREADS) {
        const long long row = r0 + idx / d;
        if (row < tq) atomicMax(&row_largest[idx / d], rlp_magnitude_bits(q[(row * hq + h) * (long long)d + idx % d]));
    }
    __syncthreads();
    if (tid < RLP_ATTF_ROWS) {
        const long long row = r0 + tid;
        const bool exists = row < tq;
        const int eq = rlp_row_exponent(row_largest[tid]);
        const int seq = exists ? q_seq[row] : -1;
        const int t = exists ? q_pos[row] : -1;
        const bool bad = exists && (eq == RLP_NONFINITE_EXPONENT || seq < 0 || seq >= num_seqs || t < 0);
        if (bad && row_stats != nullptr) {
            row_stats[3 * (row * hq + h)] = 0.0;
            row_stats[3 * (row * hq + h) + 1] = 0.0;
        }
        row_seq[tid] = seq;
        row_pos[tid] = t;
        row_eq[tid] = bad ? 0 : eq;
        row_done[tid] = (!exists || bad) ? 1 : 0;
        row_flags[tid] = bad ? 1u : 0u;  // only to mark the row for the NaN output below
    }
    __syncthreads();
    for (int idx = tid; idx < RLP_ATTF_ROWS * DP; idx += RLP_ATTF_THREADS) {
        const int rr = idx / DP, i = idx % DP;
        const long long row = r0 + rr;
        const bool bad = row_flags[rr] != 0u;
        long long v = (row < tq && !bad && i < d) ? rlp_quantize(q[(row * hq + h) * (long long)d + i], RLP_ATT_Q_BITS,
                                                                 row_eq[rr])
                                                  : 0;
#pragma unroll
        for (int digit = 0; digit < 3; ++digit) {
            const long long low = ((v + 128) & 255) - 128;
            v = (v - low) >> 8;
            qs[(digit * RLP_ATTF_ROWS + rr) * LDK + i] = (signed char)low;
        }
        if (bad && i < d) out[(row * hq + h) * (long long)d + i] = rlp_canonical_nan();
    }
    __syncthreads();
    operand qf[3][QSTEPS];  // this lane's A fragments of the wavefront's 16 rows, every digit and step
#pragma unroll
    for (int i = 0; i < 3; ++i)
#pragma unroll
        for (int s = 0; s < QSTEPS; ++s)
            qf[i][s] = *reinterpret_cast<const operand*>(qs + (i * RLP_ATTF_ROWS + 16 * wave + frag) * LDK + STEP * s + frag_k);

    for (;;) {  // one round per sequence among the tile's rows
        __syncthreads();  // the q fragments are read (first round); the previous round is written
        if (tid == 0) { cur_seq = 0x7fffffff; last_pos = -1; }
        if (tid < RLP_ATTF_THREADS / 64) wave_max[tid] = -1;
        if (tid < RLP_ATTF_ROWS) { row_mkey[tid] = 0u; row_ev[tid] = 0u; row_flags[tid] = 0u; row_total[tid] = 0ull; }
        __syncthreads();
        if (tid < RLP_ATTF_ROWS && !row_done[tid]) atomicMin(&cur_seq, row_seq[tid]);
        __syncthreads();
        const int seq = cur_seq;
        if (seq == 0x7fffffff) break;  // block-uniform
        if (tid < RLP_ATTF_ROWS && !row_done[tid] && row_seq[tid] == seq) {
            atomicMax(&last_pos, row_pos[tid]);
            atomicMax(&wave_max[tid / 16], row_pos[tid]);
        }
        __syncthreads();
        const int last = last_pos;
        const int my_max = wave_max[wave];  // -1: no row of this wavefront in the round (wave-uniform)
        bool act[4];
        int pos[4], eqr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int rr = 16 * wave + 4 * (lane / 16) + r;  // the row of D's register r
            act[r] = !row_done[rr] && row_seq[rr] == seq;
            pos[r] = act[r] ? row_pos[rr] : -1;
            eqr[r] = act[r] ? row_eq[rr] : 0;
        }

        // Stage one key tile: the keys' slot rows, exponents and flags, K digits and (pass 2) V transposed.
        auto stage = [&](int kb, bool values) {
            __syncthreads();  // the previous tile's readers are done
            if (tid < RLP_ATTF_KEYS) {
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
            constexpr int PIECES = DP / 16;  // 16-byte pieces of a digit row
            for (int p = tid; p < RLP_ATTF_KEYS * 2 * PIECES; p += RLP_ATTF_THREADS) {
                const int piece = p % PIECES, digit = (p / PIECES) % 2, key = p / (2 * PIECES);
                const long long row = key_row[key];
                const int4 v = row >= 0 ? *reinterpret_cast<const int4*>(k_digits + row * (2LL * DP) + (long long)digit * DP +
                                                                        16 * piece)
                                        : make_int4(0, 0, 0, 0);
                *reinterpret_cast<int4*>(ks + (digit * RLP_ATTF_KEYS + key) * LDK + 16 * piece) = v;
            }
            if (values) {  // 4 keys x 4 columns of one digit a thread, transposed through registers
                constexpr int GROUPS = DP / 4;
                for (int p = tid; p < 2 * (RLP_ATTF_KEYS / 4) * GROUPS; p += RLP_ATTF_THREADS) {
                    const int dg = p % GROUPS, kg = (p / GROUPS) % (RLP_ATTF_KEYS / 4), digit = p / (GROUPS * (RLP_ATTF_KEYS / 4));
                    int w[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const long long row = key_row[4 * kg + i];
                        w[i] = row >= 0 ? *reinterpret_cast<const int*>(v_digits + row * (2LL * DP) + (long long)digit * DP + 4 * dg)
                                        : 0;
                    }
#pragma unroll
                    for (int c = 0; c < 4; ++c)
                        *reinterpret_cast<int*>(vt + (digit * DP + 4 * dg + c) * RLP_ATTF_LDW + 4 * kg) = rlp_attf_byte_column(w, c);
                }
            }
            __syncthreads();
        };

        // The wavefront's 16 rows x 64 keys: s[nb][r] for row 4 (lane / 16) + r, key 16 nb + lane % 16.
        auto scores = [&](float (&s)[4][4]) {
#pragma unroll
            for (int nb = 0; nb < 4; ++nb) {
                rlp_attf_i32x4 g[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) g[x] = rlp_attf_i32x4{0, 0, 0, 0};
#pragma unroll
                for (int st = 0; st < QSTEPS; ++st) {
                    operand kf[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        kf[j] = *reinterpret_cast<const operand*>(ks + (j * RLP_ATTF_KEYS + 16 * nb + frag) * LDK + STEP * st + frag_k);
#pragma unroll
                    for (int i = 0; i < 3; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j) g[i + j] = RlpAttfMfma<KL>::run(qf[i][st], kf[j], g[i + j]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) s[nb][r] = rlp_att_score(rlp_attf_combine(g, r), eqr[r], key_ek[16 * nb + frag], scale);
            }
        };

        // ---- pass 1: m, E, flags
        unsigned int mkey[4] = {0u, 0u, 0u, 0u}, evk[4] = {0u, 0u, 0u, 0u}, flg[4] = {0u, 0u, 0u, 0u};
        for (int kb = 0; kb <= last; kb += RLP_ATTF_KEYS) {
            stage(kb, false);
            if (kb <= my_max) {  // wave-uniform
                float s[4][4];
                scores(s);
#pragma unroll
                for (int nb = 0; nb < 4; ++nb)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int jl = 16 * nb + frag;
                        if (act[r] && kb + jl <= pos[r]) {
                            if (key_flag[jl]) {
                                flg[r] |= (unsigned int)key_flag[jl];
                            } else {
                                mkey[r] = rlp_max_u32(mkey[r], rlp_att_order_key(s[nb][r]));
                                evk[r] = rlp_max_u32(evk[r], (unsigned int)(key_ev[jl] + RLP_ATT_EV_OFFSET));
                            }
                        }
                    }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            if (!act[r]) continue;
            const int rr = 16 * wave + 4 * (lane / 16) + r;
            atomicMax(&row_mkey[rr], mkey[r]);
            atomicMax(&row_ev[rr], evk[r]);
            if (flg[r]) atomicOr(&row_flags[rr], flg[r]);
        }
        __syncthreads();
        bool ok[4];
        float m[4];
        int e_max[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int rr = 16 * wave + 4 * (lane / 16) + r;
            m[r] = rlp_att_from_order_key(row_mkey[rr]);
            e_max[r] = (int)row_ev[rr] - RLP_ATT_EV_OFFSET;
            // a non-finite key/value row among 0..t, a missing slot, or m = +-inf (as attention_paged)
            ok[r] = act[r] && row_flags[rr] == 0u && rlp_magnitude_bits(m[r]) < 0x7f800000u;
        }

        // ---- pass 2: p, L, weights, N
        long long total[4] = {0, 0, 0, 0};
        long long num[NBLOCKS][4];
#pragma unroll
        for (int nd = 0; nd < NBLOCKS; ++nd)
#pragma unroll
            for (int r = 0; r < 4; ++r) num[nd][r] = 0;
        for (int kb = 0; kb <= last; kb += RLP_ATTF_KEYS) {
            stage(kb, true);
            const bool in = kb <= my_max;  // wave-uniform: a key of the tile reaches this wavefront's rows
            if (in) {
                float s[4][4];
                scores(s);
#pragma unroll
                for (int nb = 0; nb < 4; ++nb)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int jl = 16 * nb + frag;
                        long long w = 0;
                        if (ok[r] && kb + jl <= pos[r]) {
                            const double p = (double)rlp_exp_f32(s[nb][r] - m[r]);
                            total[r] += rlp_double2ll_rn(p * rlp_pow2_f64(RLP_ATT_P_SHIFT));
                            w = rlp_double2ll_rn(p * rlp_pow2_f64(key_ev[jl] - e_max[r] + RLP_ATT_P_SHIFT));
                        }
                        const int rr = 16 * wave + 4 * (lane / 16) + r;
#pragma unroll
                        for (int digit = 0; digit < 3; ++digit) {
                            const long long low = ((w + 128) & 255) - 128;
                            w = (w - low) >> 8;
                            ws[(digit * RLP_ATTF_ROWS + rr) * RLP_ATTF_LDW + jl] = (signed char)low;
                        }
                    }
            }
            __syncthreads();  // the weights are in LDS (each wavefront reads its own rows' only)
            if (!in) continue;
#pragma unroll
            for (int nd = 0; nd < NBLOCKS; ++nd) {
                rlp_attf_i32x4 g[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) g[x] = rlp_attf_i32x4{0, 0, 0, 0};
#pragma unroll
                for (int st = 0; st < VSTEPS; ++st) {
                    operand wf[3], vf[2];
#pragma unroll
                    for (int i = 0; i < 3; ++i)
                        wf[i] = *reinterpret_cast<const operand*>(ws + (i * RLP_ATTF_ROWS + 16 * wave + frag) * RLP_ATTF_LDW + STEP * st + frag_k);
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        vf[j] = *reinterpret_cast<const operand*>(vt + (j * DP + 16 * nd + frag) * RLP_ATTF_LDW + STEP * st + frag_k);
#pragma unroll
                    for (int i = 0; i < 3; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j) g[i + j] = RlpAttfMfma<KL>::run(wf[i], vf[j], g[i + j]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) num[nd][r] += rlp_attf_combine(g, r);
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
            if (ok[r] && total[r] != 0) atomicAdd(&row_total[16 * wave + 4 * (lane / 16) + r], (unsigned long long)total[r]);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            if (!act[r]) continue;
            const int rr = 16 * wave + 4 * (lane / 16) + r;
            float* orow = out + ((r0 + rr) * hq + h) * (long long)d;
            const long long denominator = (long long)row_total[rr];  // L < 2^53
            if (row_stats != nullptr && frag == 0) {  // m and L for the backward (0 when poisoned)
                double* stats = row_stats + 3 * ((r0 + rr) * hq + h);
                stats[0] = ok[r] ? (double)m[r] : 0.0;
                stats[1] = ok[r] ? rlp_ll2double_rn(denominator) : 0.0;
            }
#pragma unroll
            for (int nd = 0; nd < NBLOCKS; ++nd) {
                const int col = 16 * nd + frag;
                if (col < d) orow[col] = ok[r] ? rlp_att_output(num[nd][r], e_max[r], denominator) : rlp_canonical_nan();
            }
        }
        __syncthreads();
        if (tid < RLP_ATTF_ROWS && !row_done[tid] && row_seq[tid] == seq) row_done[tid] = 1;
    }
}

// The arguments of attention_paged (ops/attention.py launches either with the same list; dp is the
// kernel's own padded head_dim, checked by the op).
#define RLP_ATTENTION_MFMA_ENTRY(NAME, DP, KL)                                                                   \
    extern "C" __global__ void __launch_bounds__(RLP_ATTF_THREADS) NAME(                                         \
        const float* __restrict__ q, const int* __restrict__ q_seq, const int* __restrict__ q_pos, long long tq, \
        int hq, int hkv, int d, int dp, double scale, const int* __restrict__ block_tables, int num_seqs,        \
        int max_blocks, int block_size, long long num_slots, const signed char* __restrict__ k_digits,          \
        const int* __restrict__ k_exponents, const signed char* __restrict__ v_digits,                          \
        const int* __restrict__ v_exponents, float* __restrict__ out, double* __restrict__ row_stats) {          \
        rlp_attention_mfma<DP, KL>(q, q_seq, q_pos, tq, hq, hkv, d, scale, block_tables, num_seqs, max_blocks,  \
                                   block_size, num_slots, k_digits, k_exponents, v_digits, v_exponents, out,    \
                                   row_stats);                                                                  \
    }
#if defined(__gfx942__) || defined(RLP_HIP_CPU)
RLP_ATTENTION_MFMA_ENTRY(attention_paged_mfma_d64_gfx942, 64, 8)
RLP_ATTENTION_MFMA_ENTRY(attention_paged_mfma_d128_gfx942, 128, 8)
#endif
#if defined(__gfx90a__) || defined(RLP_HIP_CPU)
RLP_ATTENTION_MFMA_ENTRY(attention_paged_mfma_d64_gfx90a, 64, 4)
RLP_ATTENTION_MFMA_ENTRY(attention_paged_mfma_d128_gfx90a, 128, 4)
#endif
#endif
