#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "rowsum": exact sum of each row's fixed-point integers, rounded once.
// Contract: contracts/rowsum.toml. Reference: rlportable/contract/exact.py (rowsum).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA).

#define RLP_HAS_NAN 1u
#define RLP_HAS_POS_INF 2u
#define RLP_HAS_NEG_INF 4u

// One block per row (grid-stride over rows). Partial sums are combined with
// 64-bit integer atomics in shared memory: exact and order-free, whatever the
// block size or warp width.
extern "C" __global__ void rowsum_exact(const float* __restrict__ x, long long rows, int k, int bits,
                                        float* __restrict__ y) {
    __shared__ unsigned int largest;
    __shared__ unsigned long long total;
    __shared__ unsigned int specials;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * (long long)k;
        if (threadIdx.x == 0) { largest = 0u; total = 0ull; specials = 0u; }
        __syncthreads();
        const int e = rlp_block_row_exponent(xr, k, &largest);
        if (e == RLP_NONFINITE_EXPONENT) {
            unsigned int seen = 0u;
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                float v = xr[i];
                if (v != v) seen |= RLP_HAS_NAN;
                else if (rlp_magnitude_bits(v) == 0x7f800000u) seen |= (v > 0.0f) ? RLP_HAS_POS_INF : RLP_HAS_NEG_INF;
            }
            atomicOr(&specials, seen);
            __syncthreads();
            if (threadIdx.x == 0) {
                bool nan = (specials & RLP_HAS_NAN) ||
                           ((specials & RLP_HAS_POS_INF) && (specials & RLP_HAS_NEG_INF));
                y[row] = nan ? rlp_canonical_nan()
                             : __int_as_float((specials & RLP_HAS_POS_INF) ? 0x7f800000 : (int)0xff800000u);
            }
        } else {
            long long local_sum = 0;
            for (int i = threadIdx.x; i < k; i += blockDim.x) local_sum += rlp_quantize(xr[i], bits, e);
            atomicAdd(&total, (unsigned long long)local_sum);
            __syncthreads();
            if (threadIdx.x == 0) y[row] = rlp_round_scaled((long long)total, e - (bits - 2));
        }
        __syncthreads();
    }
}
