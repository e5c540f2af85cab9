#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "sampling": one token per row of logits, the sampler's contract for rows
// without top-k / top-p / min-p (the settings RL rollouts use: temperature > 0 and no filter,
// or greedy). Contract: contracts/sampling.toml. Reference: rlportable/contract/sampling.py
// (sample, philox4x32_10, random_u64, mul_u64, draw). One source for both vendors
// (backends/cuda/prelude.h on NVIDIA). __umulhi and __umul64hi are defined by HIP and CUDA alike (HIP's
// __umul64hi composes the 128-bit product from 32-bit halves, exactly as sampling.mul_u64 does).
#include "common.h"
#include "contract_math.h"

#define RLP_SAMPLING_MAX_THREADS 1024   // the prefix scan's shared array; every GPU's block limit
#define RLP_SAMPLING_REFUSED (-1)       // the token of a row the contract refuses (the host raises)
#define RLP_SAMPLING_STREAM_DRAW 0u
// Logits per thread in flight in the passes over a row (one load at a time left each thread waiting a
// full memory round trip per logit: 147 us a row, bench/results/prefill_kernels_ncu_h200.csv)
#define RLP_SAMPLING_LOADS 8
// Philox4x32-10 constants (Random123 philox.h: PHILOX_M4x32_0/1, PHILOX_W32_0/1)
#define RLP_PHILOX_M0 0xD2511F53u
#define RLP_PHILOX_M1 0xCD9E8D57u
#define RLP_PHILOX_W0 0x9E3779B9u
#define RLP_PHILOX_W1 0xBB67AE85u
#define RLP_PHILOX_ROUNDS 10

// sampling.random_u64: r = x0 + 2^32 x1 of Philox4x32-10(counter = (request, sample_index,
// position, stream 0), key = (seed mod 2^32, seed >> 32)). One round maps (c0, c1, c2, c3) to
// (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)); the key gets the Weyl
// increments before rounds 2..10. Integer operations only: exact everywhere.
__device__ __forceinline__ unsigned long long rlp_sampling_random(unsigned long long seed, unsigned int request,
                                                                  unsigned int sample_index, unsigned int position) {
    unsigned int c0 = request, c1 = sample_index, c2 = position, c3 = RLP_SAMPLING_STREAM_DRAW;
    unsigned int k0 = (unsigned int)(seed & 0xffffffffull), k1 = (unsigned int)(seed >> 32);
    for (int round = 0; round < RLP_PHILOX_ROUNDS; ++round) {
        if (round > 0) {
            k0 += RLP_PHILOX_W0;  // mod 2^32
            k1 += RLP_PHILOX_W1;
        }
        const unsigned int hi0 = __umulhi(RLP_PHILOX_M0, c0), lo0 = RLP_PHILOX_M0 * c0;
        const unsigned int hi1 = __umulhi(RLP_PHILOX_M1, c2), lo1 = RLP_PHILOX_M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return (unsigned long long)c0 | ((unsigned long long)c1 << 32);
}

// The high 64 bits of the exact 128-bit product a * b (sampling.mul_u64's high half).
__device__ __forceinline__ unsigned long long rlp_sampling_mul_hi_u64(unsigned long long a, unsigned long long b) {
    return __umul64hi(a, b);
}

// An order-preserving integer key of a non-NaN float32 with -0 ranked as +0 (the contract's
// "+0 = -0"): a < b <=> key(a) < key(b), and key(-0) = key(+0). The row's maximum is then an
// integer max (exact, order-free), and greedy's "first maximum" compares keys.
__device__ __forceinline__ unsigned int rlp_sampling_key(float a) {
    unsigned int bits = (unsigned int)__float_as_int(a);
    if (bits == 0x80000000u) bits = 0u;
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float rlp_sampling_from_key(unsigned int key) {
    unsigned int bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    return __int_as_float((int)bits);
}

// a_v = z_v for greedy (T = 0), else RNE_f32(double(z_v) / T). T = 1 gives z exactly, so it skips the
// float64 division (the one difference, a signalling NaN left unquieted, only ever marks a refused row).
__device__ __forceinline__ float rlp_sampling_scaled(float z, double temperature) {
    return (temperature == 0.0 || temperature == 1.0) ? z : rlp_double2float_rn((double)z / temperature);
}

// w_v = RNE(exp_f32(RNE_f32(a_v - m)) * 2^36): the logprob contract's integer terms (contract_math).
__device__ __forceinline__ long long rlp_sampling_weight(float a, float m) {
    return rlp_logprob_sum_term(rlp_exp_f32(a - m));
}

// z[u] = zr[base + u threads] for u < RLP_SAMPLING_LOADS (0 past the row's end): a strided pass's loads,
// issued together so that each thread has several in flight.
__device__ __forceinline__ void rlp_sampling_load(float (&z)[RLP_SAMPLING_LOADS], const float* zr, int base, int threads,
                                                  int vocab) {
#pragma unroll
    for (int u = 0; u < RLP_SAMPLING_LOADS; ++u) {
        const int i = base + u * threads;
        z[u] = i < vocab ? zr[i] : 0.0f;
    }
}

// In-place inclusive prefix sums of prefix[0 .. threads-1] (Hillis-Steele in shared memory, log2(threads)
// steps of exact integer adds). Every thread of the block calls it; it ends synchronised.
__device__ __forceinline__ void rlp_sampling_block_scan(long long* prefix, int tid, int threads) {
    __syncthreads();
    for (int offset = 1; offset < threads; offset <<= 1) {
        const long long add = tid >= offset ? prefix[tid - offset] : 0;
        __syncthreads();
        prefix[tid] += add;
        __syncthreads();
    }
}

// One block per row (grid-stride over rows), any block size up to 1024, no warp-width
// assumption. Per-row parameters come from device arrays. tokens[row] receives the sampled
// token, or RLP_SAMPLING_REFUSED for a row the contract refuses (a NaN a_v, a +inf a_v, or no
// finite a_v); the host then raises the reference's InputError.
//   pass 1 (strided, RLP_SAMPLING_LOADS loads in flight a thread): a_v, m = max a_v (integer keys,
//     shared atomicMax), any NaN.
//   greedy (T = 0): the smallest id whose key equals the maximum's (shared atomicMin).
//   otherwise: thread t owns the contiguous ids [t c, t c + c), c = ceil(V / blockDim), and sums
//     its weights w_v exactly in int64 (pass 2); an inclusive prefix scan of those sums over the
//     block (Hillis-Steele in shared memory, log2(blockDim) steps, exact integer adds) gives every
//     thread its exclusive start K_t and the total W = the last inclusive sum. target = the high
//     64 bits of r * W; the one thread t with K_t <= target < K_t + its sum owns the drawn id. Pass 3:
//     the block recomputes that thread's weights, one id per thread (in pieces of blockDim ids), and
//     scans them the same way; the thread of the v with K_v <= target < K_v + w_v, w_v > 0, writes it
//     (the same v as a walk in ascending order: exact integer sums, one v satisfies it).
// With want_logp != 0, logp[row] receives the logprob contract's log-prob of the drawn token at the
// record temperature (T, or 1 for greedy rows: the same a_v), the bits logprob_rows gives: its m is
// the maximum under logprob's key (-0 < +0; pass 1 keeps both maxima), its S is W (the weights use
// a_v - m, and where the two maxima differ, only in the sign of a zero, exp_f32 gives 1 either way;
// greedy rows add W in a pass of their own). Refused rows get the canonical NaN, as logprob_rows gives.
extern "C" __global__ void sampling_rows(const float* __restrict__ logits, long long rows, int vocab,
                                         const double* __restrict__ temperature,
                                         const unsigned long long* __restrict__ seed,
                                         const unsigned int* __restrict__ request,
                                         const unsigned int* __restrict__ sample_index,
                                         const unsigned int* __restrict__ position, int* __restrict__ tokens,
                                         int want_logp, float* __restrict__ logp) {
    __shared__ unsigned int largest_key;
    __shared__ unsigned int largest_logprob_key;
    __shared__ unsigned long long greedy_total;
    __shared__ unsigned int has_nan;
    __shared__ unsigned int first_max;
    __shared__ long long prefix[RLP_SAMPLING_MAX_THREADS];
    __shared__ int owner_begin, owner_end;  // pass 3: the ids of the thread that holds the target
    __shared__ long long owner_start;       // and their K
    const int tid = (int)threadIdx.x;
    const int threads = (int)blockDim.x;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* zr = logits + row * (long long)vocab;
        const double t = temperature[row];
        if (tid == 0) {
            largest_key = 0u;
            largest_logprob_key = 0u;
            has_nan = 0u;
            first_max = (unsigned int)vocab;
            greedy_total = 0ull;
        }
        __syncthreads();
        unsigned int local_key = 0u;
        unsigned int local_logprob_key = 0u;
        unsigned int nan = 0u;
        for (int base = tid; base < vocab; base += RLP_SAMPLING_LOADS * threads) {
            float z[RLP_SAMPLING_LOADS];
            rlp_sampling_load(z, zr, base, threads, vocab);
#pragma unroll
            for (int u = 0; u < RLP_SAMPLING_LOADS; ++u) {
                if (base + u * threads >= vocab) break;
                const float a = rlp_sampling_scaled(z[u], t);
                if (a != a) {
                    nan = 1u;
                } else {
                    local_key = rlp_max_u32(local_key, rlp_sampling_key(a));
                    local_logprob_key = rlp_max_u32(local_logprob_key, rlp_logprob_key(a));
                }
            }
        }
        atomicMax(&largest_key, local_key);
        atomicMax(&largest_logprob_key, local_logprob_key);
        atomicOr(&has_nan, nan);
        __syncthreads();
        const unsigned int m_key = largest_key;
        const float m = rlp_sampling_from_key(m_key);
        const float m_logprob = rlp_logprob_from_key(largest_logprob_key);
        if (has_nan != 0u || rlp_magnitude_bits(m) >= 0x7f800000u) {
            // a NaN, a +inf maximum, or an all -inf row: refused
            if (tid == 0) {
                tokens[row] = RLP_SAMPLING_REFUSED;
                if (want_logp != 0) logp[row] = rlp_canonical_nan();
            }
        } else if (t == 0.0) {
            unsigned int local_first = (unsigned int)vocab;
            for (int i = tid; i < vocab; i += threads) {
                if (rlp_sampling_key(zr[i]) == m_key) { local_first = (unsigned int)i; break; }
            }
            atomicMin(&first_max, local_first);
            if (want_logp != 0) {  // W for the log-prob (the other rows' W comes with their draw)
                long long local_w = 0;
                for (int base = tid; base < vocab; base += RLP_SAMPLING_LOADS * threads) {
                    float z[RLP_SAMPLING_LOADS];
                    rlp_sampling_load(z, zr, base, threads, vocab);
#pragma unroll
                    for (int u = 0; u < RLP_SAMPLING_LOADS; ++u)
                        if (base + u * threads < vocab) local_w += rlp_logprob_sum_term(rlp_exp_f32(z[u] - m_logprob));
                }
                if (local_w != 0) atomicAdd(&greedy_total, (unsigned long long)local_w);
            }
            __syncthreads();
            if (tid == 0) {
                tokens[row] = (int)first_max;
                if (want_logp != 0)
                    logp[row] = rlp_logprob_value(zr[first_max] - m_logprob, rlp_logprob_log_sum((long long)greedy_total));
            }
        } else {
            const int chunk = (vocab + threads - 1) / threads;
            const int begin = tid * chunk < vocab ? tid * chunk : vocab;
            const int end = begin + chunk < vocab ? begin + chunk : vocab;
            long long local = 0;  // exact int64 sums: any grouping gives the same total
            int i = begin;
            for (; i + RLP_SAMPLING_LOADS <= end; i += RLP_SAMPLING_LOADS) {
                float z[RLP_SAMPLING_LOADS];
#pragma unroll
                for (int u = 0; u < RLP_SAMPLING_LOADS; ++u) z[u] = zr[i + u];
#pragma unroll
                for (int u = 0; u < RLP_SAMPLING_LOADS; ++u) local += rlp_sampling_weight(rlp_sampling_scaled(z[u], t), m);
            }
            for (; i < end; ++i) local += rlp_sampling_weight(rlp_sampling_scaled(zr[i], t), m);
            prefix[tid] = local;
            if (tid == 0) {  // no owner (not possible: 0 <= target < W) leaves the row's token unwritten, as before
                owner_begin = 0;
                owner_end = 0;
                owner_start = 0;
            }
            rlp_sampling_block_scan(prefix, tid, threads);
            const long long inclusive = prefix[tid];
            const long long exclusive = inclusive - local;
            const unsigned long long total = (unsigned long long)prefix[threads - 1];  // in [2^36, 2^61]
            const unsigned long long r = rlp_sampling_random(seed[row], request[row], sample_index[row], position[row]);
            const unsigned long long target = rlp_sampling_mul_hi_u64(r, total);  // < total
            if (local > 0 && (unsigned long long)exclusive <= target && target < (unsigned long long)inclusive) {
                owner_begin = begin;
                owner_end = end;
                owner_start = exclusive;
            }
            __syncthreads();  // the owner is known, and every thread has read prefix
            long long k = owner_start;  // K of the piece's first id
            for (int piece = owner_begin; piece < owner_end; piece += threads) {  // block-uniform
                const int i = piece + tid;
                const long long w = i < owner_end ? rlp_sampling_weight(rlp_sampling_scaled(zr[i], t), m) : 0;
                prefix[tid] = w;
                rlp_sampling_block_scan(prefix, tid, threads);
                const long long k_v = k + prefix[tid] - w;
                if (w > 0 && (unsigned long long)k_v <= target && target < (unsigned long long)(k_v + w)) {
                    tokens[row] = i;
                    if (want_logp != 0)
                        logp[row] = rlp_logprob_value(rlp_sampling_scaled(zr[i], t) - m_logprob,
                                                      rlp_logprob_log_sum((long long)total));
                }
                k += prefix[threads - 1];
                __syncthreads();  // prefix is rewritten by the next piece
            }
        }
        __syncthreads();
    }
}
