// Kernel family "attention", AMD's fast path: the forward on the integer matrix cores (MFMA),
// attention_paged_mfma_d{64,128}_{gfx942,gfx90a} (v_mfma_i32_16x16x32_i8 on CDNA3, 16x16x16i8 on
// CDNA2). Contract: contracts/attention.toml, op "attention"; reference: rlportable/contract/attention.py.
// The family's portable kernels are backends/portable/attention.hip, included here. Each kernel is
// built only where its instruction exists (clang's __gfx942__ / __gfx90a__) and on HIP-CPU, which
// emulates both (backends/hip/cpu_prelude.h); `rlportable conform --device hip-cpu` checks them bit
// for bit. The same bits as attention_paged: every sum is an exact integer sum, every max exact.

// The split score pass's four byte products (the portable rlp_atts_dot4) on the dot instruction
// v_dot4_i32_i8: c + the four products of the signed bytes, without clamp, the same integer. clang builds
// the portable loop byte by byte (about 9 instructions a product on gfx90a), as nvcc did on NVIDIA, where
// the instruction itself made the score pass 4x faster. HIP-CPU emulates it (cpu_prelude.h).
#if defined(__gfx942__) || defined(__gfx90a__) || defined(RLP_HIP_CPU)
#define RLP_ATTS_DOT4(a, b, c) __builtin_amdgcn_sdot4((a), (b), (c), false)
#endif
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

#include "mfma.h"

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
    typedef typename RlpMfma<KL>::operand operand;
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
                rlp_mfma_i32x4 g[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) g[x] = rlp_mfma_i32x4{0, 0, 0, 0};
#pragma unroll
                for (int st = 0; st < QSTEPS; ++st) {
                    operand kf[2];
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        kf[j] = *reinterpret_cast<const operand*>(ks + (j * RLP_ATTF_KEYS + 16 * nb + frag) * LDK + STEP * st + frag_k);
#pragma unroll
                    for (int i = 0; i < 3; ++i)
#pragma unroll
                        for (int j = 0; j < 2; ++j) g[i + j] = RlpMfma<KL>::run(qf[i][st], kf[j], g[i + j]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) s[nb][r] = rlp_att_score(rlp_mfma_combine<4>(g, r), eqr[r], key_ek[16 * nb + frag], scale);
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
                rlp_mfma_i32x4 g[4];
#pragma unroll
                for (int x = 0; x < 4; ++x) g[x] = rlp_mfma_i32x4{0, 0, 0, 0};
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
                        for (int j = 0; j < 2; ++j) g[i + j] = RlpMfma<KL>::run(wf[i], vf[j], g[i + j]);
                }
#pragma unroll
                for (int r = 0; r < 4; ++r) num[nd][r] += rlp_mfma_combine<4>(g, r);
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

// ---- The backward's dq and dkv on MFMA (ops/attention.py method "tiled" on an AMD GPU, "mma" anywhere
// the kernels run). Every product of the backward is an int8 digit product once the coefficients have
// 15 bits: S = qq . qk and dP = qdo . qv as the forward's 3 x 2 digits; a block's partial U . qk as
// 2 x 2 digits (dq), U^T . qq and U^T . qdo as 2 x 3 (dk, dv), with the block's 64 positions as the
// reduction dimension. Shift groups in int32 (|group| <= 2 * 128 * 2^14 = 2^22 for the scores,
// 2 * 64 * 2^14 = 2^21 for the partials), combined in int64; each block's partial is scaled into the
// float64 sum in the contract's order (rlp_attb_add_block). The operands read along d (q, do in dq;
// k, v in dkv: the wavefront's own rows, every block) are MFMA fragments in registers, split into
// digits from the int32 rows once; the operands read along d by every wavefront for each block (k, v
// in dq; q, do in dkv) are split from the int32 rows in global memory per fragment; the operands whose
// reduction dimension is the block's positions sit in LDS transposed ([digit][d][64 positions]), and
// the coefficients' digits in LDS as [digit][row][64 positions] once the block's exponent is known.
// 256 threads = 4 wavefronts. dq: 64 query rows a tile, wavefront w rows 16 w ..; LDS: K transposed
// 2 x DP x 64, U 2 x 64 x 64 (24,576 bytes at DP = 128). dkv: 32 keys a tile (a key tile lies in one
// block of 64 positions); wavefront w takes keys 16 (w % 2) .. and queries 32 (w / 2) .. of the scores,
// and columns (w / 2) DP / 2 .. of the partials; LDS: q and do transposed 3 x DP x 64 each, U^T for dk
// and dv 2 x 32 x 64 each (57,344 bytes at DP = 128).
#define RLP_ATTF_BLOCK RLP_ATTB_BLOCK  // positions of a coefficient block: the partials' reduction
#define RLP_ATTF_DKV_KEYS 32

// An MFMA operand (KL int8, byte e = element e) from KL consecutive int32 of a row, one operand per
// balanced digit, least significant first (|v| <= 2^22: 3 digits; 2^14: 2 digits); zeros when !in.
template <int KL, int NDIG>
__device__ __forceinline__ void rlp_attf_split(typename RlpMfma<KL>::operand (&out)[NDIG],
                                               const int* __restrict__ src, bool in) {
    unsigned long long packed[NDIG];
#pragma unroll
    for (int k = 0; k < NDIG; ++k) packed[k] = 0ull;
#pragma unroll
    for (int e = 0; e < KL; ++e) {
        int v = in ? src[e] : 0;
#pragma unroll
        for (int k = 0; k < NDIG; ++k) {
            const int low = ((v + 128) & 255) - 128;
            v = (v - low) >> 8;
            packed[k] |= (unsigned long long)(low & 255) << (8 * e);
        }
    }
#pragma unroll
    for (int k = 0; k < NDIG; ++k) out[k] = (typename RlpMfma<KL>::operand)packed[k];
}

// 64 rows (block positions c, row r at src + (first + c step) DP) transposed into NDIG digit planes
// [digit][DP][64]; rows at or beyond count are 0.
template <int DP, int NDIG>
__device__ __forceinline__ void rlp_attf_load_transposed(signed char* dst, const int* __restrict__ src, long long first,
                                                         long long step, int count) {
    for (int i = threadIdx.x; i < RLP_ATTF_BLOCK * DP; i += RLP_ATTF_THREADS) {
        const int c = i % RLP_ATTF_BLOCK, col = i / RLP_ATTF_BLOCK;
        int v = c < count ? src[(first + c * step) * DP + col] : 0;
#pragma unroll
        for (int k = 0; k < NDIG; ++k) {
            const int low = ((v + 128) & 255) - 128;
            v = (v - low) >> 8;
            dst[(k * DP + col) * RLP_ATTF_BLOCK + c] = (signed char)low;
        }
    }
}

// A coefficient quantized with its block's exponent, as two digits into a [digit][rows][64] tile.
__device__ __forceinline__ void rlp_attf_store_u(signed char* u, int rows, int row, int pos, long long big_u) {
    int v = (int)big_u;
    const int low = ((v + 128) & 255) - 128;
    u[row * RLP_ATTF_BLOCK + pos] = (signed char)low;
    u[(rows + row) * RLP_ATTF_BLOCK + pos] = (signed char)((v - low) >> 8);
}

// The 16 x 16 block partial A . B over the block's 64 positions: A 2 digits [digit][rows][64] (rows
// a0 + lane % 16), B NB digits transposed [digit][DP][64] (columns b0 + lane % 16), exact in int64.
template <int DP, int KL, int NB>
__device__ __forceinline__ void rlp_attf_partial(long long (&x)[4], const signed char* a, int a_rows, int a0,
                                                 const signed char* b, int b0) {
    typedef typename RlpMfma<KL>::operand operand;
    const int lane = threadIdx.x % 64, frag = lane % 16, frag_k = KL * (lane / 16);
    rlp_mfma_i32x4 g[NB + 1];
#pragma unroll
    for (int k = 0; k <= NB; ++k) g[k] = rlp_mfma_i32x4{0, 0, 0, 0};
#pragma unroll
    for (int st = 0; st < RLP_ATTF_BLOCK / (4 * KL); ++st) {
        operand fa[2], fb[NB];
#pragma unroll
        for (int i = 0; i < 2; ++i)
            fa[i] = *reinterpret_cast<const operand*>(a + (i * a_rows + a0 + frag) * RLP_ATTF_BLOCK + 4 * KL * st + frag_k);
#pragma unroll
        for (int j = 0; j < NB; ++j)
            fb[j] = *reinterpret_cast<const operand*>(b + (j * DP + b0 + frag) * RLP_ATTF_BLOCK + 4 * KL * st + frag_k);
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NB; ++j) g[i + j] = RlpMfma<KL>::run(fa[i], fb[j], g[i + j]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) x[r] = rlp_mfma_combine<NB + 1>(g, r);
}

// The 16 x 16 blocks S (a . b) and dP (c . e) of one wavefront over DP: a and c are the wavefront's own
// rows as A fragments in registers (NA digits, every step), b and e one B row each, split into NB
// digits per step from the int32 rows at b_row and e_row (zeros when !in); shift groups i + j in int32.
template <int DP, int KL, int NA, int NB>
__device__ __forceinline__ void rlp_attf_score_blocks(rlp_mfma_i32x4 (&gs)[4], rlp_mfma_i32x4 (&gp)[4],
                                                      const typename RlpMfma<KL>::operand (&a)[DP / (4 * KL)][NA],
                                                      const typename RlpMfma<KL>::operand (&c)[DP / (4 * KL)][NA],
                                                      const int* b_row, const int* e_row, bool in) {
    typedef typename RlpMfma<KL>::operand operand;
    const int frag_k = KL * ((threadIdx.x % 64) / 16);
#pragma unroll
    for (int x = 0; x < 4; ++x) { gs[x] = rlp_mfma_i32x4{0, 0, 0, 0}; gp[x] = rlp_mfma_i32x4{0, 0, 0, 0}; }
#pragma unroll
    for (int st = 0; st < DP / (4 * KL); ++st) {
        operand bf[NB], ef[NB];
        rlp_attf_split<KL, NB>(bf, b_row + 4 * KL * st + frag_k, in);
        rlp_attf_split<KL, NB>(ef, e_row + 4 * KL * st + frag_k, in);
#pragma unroll
        for (int i = 0; i < NA; ++i)
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                gs[i + j] = RlpMfma<KL>::run(a[st][i], bf[j], gs[i + j]);
                gp[i + j] = RlpMfma<KL>::run(c[st][i], ef[j], gp[i + j]);
            }
    }
}

// The scalars of the query rows a tile or block serves (rows beyond count: poisoned, no terms).
struct RlpAttfRows {
    double total[RLP_ATTF_BLOCK], delta[RLP_ATTF_BLOCK];
    float m[RLP_ATTF_BLOCK];
    int eq[RLP_ATTF_BLOCK], edo[RLP_ATTF_BLOCK], bad[RLP_ATTF_BLOCK];
};

__device__ __forceinline__ void rlp_attf_row_scalars(RlpAttfRows& s, const int* __restrict__ row_info,
                                                     const double* __restrict__ row_stats, long long t0, int count,
                                                     int hq, int h) {
    for (int r = threadIdx.x; r < RLP_ATTF_BLOCK; r += RLP_ATTF_THREADS) {
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

// dq of a query tile (grid (tiles, hq)): per block of 64 keys, S and dP of the wavefront's 16 rows x 64
// keys, u = dS 2^ek in registers, each row's E over the block (shared atomics), U's digits into LDS,
// the block's partial U . qk and acc = acc + partial 2^(E - 26), blocks ascending.
template <int DP, int KL>
__device__ __forceinline__ void rlp_attf_dq(const int* __restrict__ q_tiles, const long long* __restrict__ cu_seqlens,
                                            int hq, int hkv, int d, double scale, const int* __restrict__ q_int,
                                            const int* __restrict__ do_int, const int* __restrict__ k_int,
                                            const int* __restrict__ v_int, const int* __restrict__ k_exponents,
                                            const int* __restrict__ v_exponents, const int* __restrict__ row_info,
                                            const double* __restrict__ row_stats, float* __restrict__ dq) {
    typedef typename RlpMfma<KL>::operand operand;
    constexpr int STEP = 4 * KL, QSTEPS = DP / STEP, NBLOCKS = DP / 16, BQ = RLP_ATTF_ROWS, BK = RLP_ATTF_BLOCK;
    __shared__ int4 lds4[(2 * DP * BK + 2 * BQ * BK) / 16];
    __shared__ RlpAttfRows s;
    __shared__ int ek[BK], ev[BK];
    __shared__ unsigned int field[BQ];
    signed char* kt = reinterpret_cast<signed char*>(lds4);  // [2][DP][64 keys]
    signed char* u8 = kt + 2 * DP * BK;                       // [2][64 rows][64 keys]
    const int tid = threadIdx.x, lane = tid % 64, wave = tid / 64, frag = lane % 16, frag_k = KL * (lane / 16);
    const RlpAtttTile tile = rlp_attt_query_tile_of(q_tiles, cu_seqlens, BQ, hq, hkv);
    const long long t0 = tile.t0, start = tile.start, t_end = tile.t0 + tile.rows;
    const int rows = tile.rows, h = tile.h, g = tile.g;
    rlp_attf_row_scalars(s, row_info, row_stats, t0, rows, hq, h);
    // this lane's A fragments of q and do (row 16 w + lane % 16), every digit and step
    operand qf[QSTEPS][3], df[QSTEPS][3];
    {
        const int r = 16 * wave + frag;
        const long long item = (t0 + r) * hq + h;
#pragma unroll
        for (int st = 0; st < QSTEPS; ++st) {
            rlp_attf_split<KL, 3>(qf[st], q_int + item * DP + STEP * st + frag_k, r < rows);
            rlp_attf_split<KL, 3>(df[st], do_int + item * DP + STEP * st + frag_k, r < rows);
        }
    }
    double acc[NBLOCKS][4];
#pragma unroll
    for (int nd = 0; nd < NBLOCKS; ++nd)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nd][r] = 0.0;
    for (long long j0 = start; j0 < t_end; j0 += BK) {
        const int keys = (int)(t_end - j0 < (long long)BK ? t_end - j0 : (long long)BK);
        __syncthreads();  // the previous block's partials have read kt, u8 and field
        rlp_attf_load_transposed<DP, 2>(kt, k_int, j0 * hkv + g, hkv, keys);
        for (int c = tid; c < BK; c += RLP_ATTF_THREADS) {
            ek[c] = c < keys ? k_exponents[(j0 + c) * hkv + g] : 0;
            ev[c] = c < keys ? v_exponents[(j0 + c) * hkv + g] : 0;
        }
        for (int r = tid; r < BQ; r += RLP_ATTF_THREADS) field[r] = 0u;
        __syncthreads();
        double u[4][4];
        unsigned int f[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int nb = 0; nb < 4; ++nb) {
            const int c = 16 * nb + frag;  // the key of this lane's B fragments and D column
            const long long key = (j0 + c) * hkv + g;
            rlp_mfma_i32x4 gs[4], gp[4];
            rlp_attf_score_blocks<DP, KL, 3, 2>(gs, gp, qf, df, k_int + key * DP, v_int + key * DP, c < keys);
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = 16 * wave + 4 * (lane / 16) + r;
                u[nb][r] = 0.0;
                if (row < rows && c < keys && j0 + c <= t0 + row && s.bad[row] == 0) {
                    double big_p, ds;
                    rlp_attt_pair((double)rlp_mfma_combine<4>(gs, r), (double)rlp_mfma_combine<4>(gp, r), s.eq[row], ek[c],
                                  s.edo[row], ev[c], s.m[row], s.total[row], s.delta[row], scale, &big_p, &ds);
                    u[nb][r] = ds * rlp_pow2_f64(ek[c]);
                    f[r] = rlp_max_u32(f[r], rlp_attb_field(u[nb][r]));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r)
            if (f[r]) atomicMax(&field[16 * wave + 4 * (lane / 16) + r], f[r]);
        __syncthreads();
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int row = 16 * wave + 4 * (lane / 16) + r;
                rlp_attf_store_u(u8, BQ, row, 16 * nb + frag, rlp_attb_quantize(u[nb][r], rlp_attb_exponent(field[row])));
            }
        __syncthreads();
#pragma unroll
        for (int nd = 0; nd < NBLOCKS; ++nd) {
            long long part[4];
            rlp_attf_partial<DP, KL, 2>(part, u8, BQ, 16 * wave, kt, 16 * nd);
#pragma unroll
            for (int r = 0; r < 4; ++r)
                acc[nd][r] = rlp_attb_add_block(acc[nd][r], part[r], field[16 * wave + 4 * (lane / 16) + r],
                                                RLP_ATT_KV_BITS - 2);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int row = 16 * wave + 4 * (lane / 16) + r;
        if (row >= rows) continue;
        float* out = dq + ((t0 + row) * hq + h) * (long long)d;
#pragma unroll
        for (int nd = 0; nd < NBLOCKS; ++nd) {
            const int col = 16 * nd + frag;
            if (col < d) out[col] = s.bad[row] ? rlp_canonical_nan() : rlp_double2float_rn(acc[nd][r]);
        }
    }
}

// dk and dv of a key tile (grid (key tiles, hkv)): per block of 64 queries (from the block holding the
// tile's keys) and within it per q head of the group in order: S and dP as [key][query] blocks, the
// coefficients dS 2^eq and P 2^edo in registers, each key's E over the block (shared atomics), U^T's
// digits into LDS, the block's partials U^T . qq and U^T . qdo, acc = acc + partial 2^(E - 34). A key
// that a poisoned row reaches gets the canonical NaN.
template <int DP, int KL>
__device__ __forceinline__ void rlp_attf_dkv(const int* __restrict__ key_tiles, const long long* __restrict__ cu_seqlens,
                                             int hq, int hkv, int d, double scale, const int* __restrict__ q_int,
                                             const int* __restrict__ do_int, const int* __restrict__ k_int,
                                             const int* __restrict__ v_int, const int* __restrict__ k_exponents,
                                             const int* __restrict__ v_exponents, const int* __restrict__ row_info,
                                             const double* __restrict__ row_stats, float* __restrict__ dk,
                                             float* __restrict__ dv) {
    typedef typename RlpMfma<KL>::operand operand;
    constexpr int STEP = 4 * KL, QSTEPS = DP / STEP, BKV = RLP_ATTF_DKV_KEYS, BQ = RLP_ATTF_BLOCK;
    constexpr int HALF_BLOCKS = DP / 32;  // 16-column output blocks of a wavefront's half of DP
    __shared__ int4 lds4[(6 * DP * BQ + 4 * BKV * BQ) / 16];
    __shared__ RlpAttfRows s;
    __shared__ int ek[BKV], ev[BKV];
    __shared__ unsigned int field_k[BKV], field_v[BKV], bad_key[BKV];
    signed char* qt = reinterpret_cast<signed char*>(lds4);  // [3][DP][64 queries]
    signed char* dot = qt + 3 * DP * BQ;                      // [3][DP][64 queries]
    signed char* uk8 = dot + 3 * DP * BQ;                     // [2][32 keys][64 queries]
    signed char* uv8 = uk8 + 2 * BKV * BQ;
    const int tid = threadIdx.x, lane = tid % 64, wave = tid / 64, frag = lane % 16, frag_k = KL * (lane / 16);
    const int kw = wave % 2, half = wave / 2;
    const int seq = key_tiles[2 * blockIdx.x];
    const long long j0 = key_tiles[2 * blockIdx.x + 1], start = cu_seqlens[seq], end = cu_seqlens[seq + 1];
    const int keys = (int)(end - j0 < (long long)BKV ? end - j0 : (long long)BKV);
    const int g = blockIdx.y, group = hq / hkv;
    for (int c = tid; c < BKV; c += RLP_ATTF_THREADS) {
        const long long kr = (j0 + c) * hkv + g;
        ek[c] = c < keys ? k_exponents[kr] : 0;
        ev[c] = c < keys ? v_exponents[kr] : 0;
        bad_key[c] = 0u;
    }
    // this lane's A fragments of k and v (key 16 kw + lane % 16), every digit and step
    operand kf[QSTEPS][2], vf[QSTEPS][2];
    {
        const int c = 16 * kw + frag;
        const long long kr = (j0 + c) * hkv + g;
#pragma unroll
        for (int st = 0; st < QSTEPS; ++st) {
            rlp_attf_split<KL, 2>(kf[st], k_int + kr * DP + STEP * st + frag_k, c < keys);
            rlp_attf_split<KL, 2>(vf[st], v_int + kr * DP + STEP * st + frag_k, c < keys);
        }
    }
    double acc_k[HALF_BLOCKS][4], acc_v[HALF_BLOCKS][4];
#pragma unroll
    for (int n = 0; n < HALF_BLOCKS; ++n)
#pragma unroll
        for (int r = 0; r < 4; ++r) { acc_k[n][r] = 0.0; acc_v[n][r] = 0.0; }
    for (long long t0 = start + (j0 - start) / BQ * BQ; t0 < end; t0 += BQ)
        for (int hh = 0; hh < group; ++hh) {
            const int h = g * group + hh;
            const int qrows = (int)(end - t0 < (long long)BQ ? end - t0 : (long long)BQ);
            __syncthreads();  // the previous (block, head)'s partials have read the tiles and fields
            rlp_attf_load_transposed<DP, 3>(qt, q_int, t0 * hq + h, hq, qrows);
            rlp_attf_load_transposed<DP, 3>(dot, do_int, t0 * hq + h, hq, qrows);
            rlp_attf_row_scalars(s, row_info, row_stats, t0, qrows, hq, h);
            for (int c = tid; c < BKV; c += RLP_ATTF_THREADS) { field_k[c] = 0u; field_v[c] = 0u; }
            __syncthreads();
            double uk[2][4], uv[2][4];
            unsigned int fk[4] = {0u, 0u, 0u, 0u}, fv[4] = {0u, 0u, 0u, 0u}, bad[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int nb = 0; nb < 2; ++nb) {
                const int rq = 32 * half + 16 * nb + frag;  // the query of this lane's B fragments and D column
                const long long item = (t0 + rq) * hq + h;
                rlp_mfma_i32x4 gs[4], gp[4];
                rlp_attf_score_blocks<DP, KL, 2, 3>(gs, gp, kf, vf, q_int + item * DP, do_int + item * DP, rq < qrows);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int c = 16 * kw + 4 * (lane / 16) + r;  // the key of D's register r
                    uk[nb][r] = 0.0;
                    uv[nb][r] = 0.0;
                    if (rq < qrows && c < keys && j0 + c <= t0 + rq) {
                        if (s.bad[rq] != 0) {
                            bad[r] = 1u;
                        } else {
                            double big_p, ds;
                            rlp_attt_pair((double)rlp_mfma_combine<4>(gs, r), (double)rlp_mfma_combine<4>(gp, r), s.eq[rq],
                                          ek[c], s.edo[rq], ev[c], s.m[rq], s.total[rq], s.delta[rq], scale, &big_p,
                                          &ds);
                            uk[nb][r] = ds * rlp_pow2_f64(s.eq[rq]);
                            uv[nb][r] = big_p * rlp_pow2_f64(s.edo[rq]);
                            fk[r] = rlp_max_u32(fk[r], rlp_attb_field(uk[nb][r]));
                            fv[r] = rlp_max_u32(fv[r], rlp_attb_field(uv[nb][r]));
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int c = 16 * kw + 4 * (lane / 16) + r;
                if (fk[r]) atomicMax(&field_k[c], fk[r]);
                if (fv[r]) atomicMax(&field_v[c], fv[r]);
                if (bad[r]) bad_key[c] = 1u;
            }
            __syncthreads();
#pragma unroll
            for (int nb = 0; nb < 2; ++nb)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int c = 16 * kw + 4 * (lane / 16) + r, rq = 32 * half + 16 * nb + frag;
                    rlp_attf_store_u(uk8, BKV, c, rq, rlp_attb_quantize(uk[nb][r], rlp_attb_exponent(field_k[c])));
                    rlp_attf_store_u(uv8, BKV, c, rq, rlp_attb_quantize(uv[nb][r], rlp_attb_exponent(field_v[c])));
                }
            __syncthreads();
#pragma unroll
            for (int n = 0; n < HALF_BLOCKS; ++n) {
                long long pk[4], pv[4];
                const int col0 = half * (DP / 2) + 16 * n;
                rlp_attf_partial<DP, KL, 3>(pk, uk8, BKV, 16 * kw, qt, col0);
                rlp_attf_partial<DP, KL, 3>(pv, uv8, BKV, 16 * kw, dot, col0);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const int c = 16 * kw + 4 * (lane / 16) + r;
                    acc_k[n][r] = rlp_attb_add_block(acc_k[n][r], pk[r], field_k[c], RLP_ATTB_ROW_SHIFT);
                    acc_v[n][r] = rlp_attb_add_block(acc_v[n][r], pv[r], field_v[c], RLP_ATTB_ROW_SHIFT);
                }
            }
        }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const int c = 16 * kw + 4 * (lane / 16) + r;
        if (c >= keys) continue;
        const long long at = ((j0 + c) * hkv + g) * (long long)d;
        const bool poisoned = bad_key[c] != 0u;
#pragma unroll
        for (int n = 0; n < HALF_BLOCKS; ++n) {
            const int col = half * (DP / 2) + 16 * n + frag;
            if (col >= d) continue;
            dk[at + col] = poisoned ? rlp_canonical_nan() : rlp_double2float_rn(acc_k[n][r]);
            dv[at + col] = poisoned ? rlp_canonical_nan() : rlp_double2float_rn(acc_v[n][r]);
        }
    }
}

#define RLP_ATTF_BACKWARD_ENTRIES(DP, KL, DQ, DKV)                                                               \
    extern "C" __global__ void __launch_bounds__(RLP_ATTF_THREADS) DQ(RLP_ATTT_QUERY_ARGS) {                     \
        rlp_attf_dq<DP, KL>(q_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents,    \
                            v_exponents, row_info, row_stats, dq);                                              \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(RLP_ATTF_THREADS) DKV(RLP_ATTT_KEY_ARGS) {                      \
        rlp_attf_dkv<DP, KL>(key_tiles, cu_seqlens, hq, hkv, d, scale, q_int, do_int, k_int, v_int, k_exponents, \
                             v_exponents, row_info, row_stats, dk, dv);                                         \
    }
#if defined(__gfx942__) || defined(RLP_HIP_CPU)
RLP_ATTF_BACKWARD_ENTRIES(64, 8, attention_backward_mfma_dq_d64_gfx942, attention_backward_mfma_dkv_d64_gfx942)
RLP_ATTF_BACKWARD_ENTRIES(128, 8, attention_backward_mfma_dq_d128_gfx942, attention_backward_mfma_dkv_d128_gfx942)
#endif
#if defined(__gfx90a__) || defined(RLP_HIP_CPU)
RLP_ATTF_BACKWARD_ENTRIES(64, 4, attention_backward_mfma_dq_d64_gfx90a, attention_backward_mfma_dkv_d64_gfx90a)
RLP_ATTF_BACKWARD_ENTRIES(128, 4, attention_backward_mfma_dq_d128_gfx90a, attention_backward_mfma_dkv_d128_gfx90a)
#endif

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
