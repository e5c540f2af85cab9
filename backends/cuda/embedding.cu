// Kernel family "embedding": gather rows of a table by token id, a bit copy.
// Contract: contracts/embedding.toml. Reference: rlportable/contract/embedding.py (gather).
// backends/hip/embedding.hip is the same logic, line for line, in HIP spellings.

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
