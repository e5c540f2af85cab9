#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "fixedpoint": per-row fixed-point encoding into int8 digits.
// Contract: contracts/fixedpoint.toml. Reference: rlportable/contract/fixedpoint.py.
// Line-by-line port of backends/cuda/fixedpoint.cu.

// One block per row (grid-stride over rows). The row maximum is an exact integer
// max of magnitude bits, so its result is independent of thread count, warp width
// and order.
// digits: [rows, slices, k_padded] int8; positions k..k_padded-1 are written 0.
// descending != 0 stores the most significant digit first (slot 0).
extern "C" __global__ void fixedpoint_encode_rows(
    const float* __restrict__ x, long long rows, int k, int k_padded, int bits, int slices,
    int descending, signed char* __restrict__ digits, int* __restrict__ exponents) {
    __shared__ unsigned int largest;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * (long long)k;
        if (threadIdx.x == 0) largest = 0u;
        __syncthreads();
        const int e = rlp_block_row_exponent(xr, k, &largest);
        if (threadIdx.x == 0) exponents[row] = e;
        signed char* out = digits + row * (long long)slices * k_padded;
        for (int i = threadIdx.x; i < k_padded; i += blockDim.x) {
            long long q = (i < k && e != RLP_NONFINITE_EXPONENT) ? rlp_quantize(xr[i], bits, e) : 0;
            for (int j = 0; j < slices; ++j) {
                long long d = ((q + 128) & 255) - 128;
                q = (q - d) >> 8;
                int slot = descending ? slices - 1 - j : j;
                out[(long long)slot * k_padded + i] = (signed char)d;
            }
        }
        __syncthreads();
    }
}
