#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "embedding": gather rows of a table by token id (a bit copy), and its gradient.
// Contract: contracts/embedding.toml. Reference: rlportable/contract/embedding.py (gather,
// gather_backward).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA) (no warp-width assumption anywhere).
#include "common.h"

// out[t, :] = table[ids[t], :], copied as 32-bit words (every bit kept: NaN payloads, -0,
// subnormals). The host checked 0 <= ids[t] < V before the launch. Grid-stride over
// tokens * hidden: any grid and block size gives the same bits.
extern "C" __global__ void embedding_gather(const unsigned int* __restrict__ table, const int* __restrict__ ids,
                                            long long tokens, int hidden, unsigned int* __restrict__ out) {
    const long long n = tokens * (long long)hidden;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const long long token = k / hidden;
        const long long column = k - token * (long long)hidden;
        out[k] = table[(long long)ids[token] * (long long)hidden + column];
    }
}

// dtable[v, h] = RNE_f32(((+0 + dy[t1, h]) + dy[t2, h]) + ...), t1 < t2 < ... the tokens with id v:
// order[offsets[v] .. offsets[v + 1]) lists them in increasing token index (built on the host by a
// stable sort of the ids). One thread per (v, h) walks its list, so the float64 additions happen in
// token order whatever the launch shape; a row with no tokens is +0, a NaN result canonical.
// Grid-stride over vocab * hidden (consecutive threads read consecutive columns of one dy row).
extern "C" __global__ void embedding_gather_backward(const float* __restrict__ dy, const int* __restrict__ offsets,
                                                     const int* __restrict__ order, int vocab, int hidden,
                                                     float* __restrict__ dtable) {
    const long long n = (long long)vocab * (long long)hidden;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const long long v = k / hidden;
        const long long column = k - v * (long long)hidden;
        double total = 0.0;
        for (int j = offsets[v]; j < offsets[v + 1]; ++j) total += (double)dy[(long long)order[j] * (long long)hidden + column];
        const float rounded = rlp_double2float_rn(total);
        dtable[k] = rounded != rounded ? rlp_canonical_nan() : rounded;
    }
}

// The vocabulary-parallel gather: this rank holds the table rows [vocab_start, vocab_start + shard_rows).
// out[t, :] = table_shard[ids[t] - vocab_start, :] as 32-bit words when this rank owns ids[t], else +0
// bits, so the uint32 sum over the ranks (one owner per id) is embedding_gather's output. The host
// checked ids[t] >= 0 (global ids; the whole vocabulary is not known here). Grid-stride over
// tokens * hidden: any grid and block size gives the same bits.
extern "C" __global__ void embedding_gather_shard(const unsigned int* __restrict__ table_shard,
                                                  const int* __restrict__ ids, long long tokens, int hidden,
                                                  int vocab_start, int shard_rows, unsigned int* __restrict__ out) {
    const long long n = tokens * (long long)hidden;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        const long long token = k / hidden;
        const long long column = k - token * (long long)hidden;
        const long long local = (long long)ids[token] - (long long)vocab_start;
        const bool owned = local >= 0 && local < (long long)shard_rows;
        out[k] = owned ? table_shard[local * (long long)hidden + column] : 0u;
    }
}
