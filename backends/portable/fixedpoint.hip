#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "fixedpoint": per-row fixed-point encoding into int8 digits.
// Contract: contracts/fixedpoint.toml. Reference: rlportable/contract/fixedpoint.py.
// One source for both vendors (backends/cuda/prelude.h on NVIDIA).

// rlp_encode_row_digits (the quantize and digit-split loop of one row) lives in common, shared
// with the fused kernels that encode their output.

// One block per row (grid-stride over rows: a model's activation rows are long and, at decode, a few
// hundred, so eight warps a row beat one segment of 32 lanes a row, row_kernels_probe_h200.json in
// bench/results). The row maximum is an exact integer max of magnitude bits, so its result is
// independent of thread count, warp width and order.
// digits: [rows, slices, k_padded] int8; positions k..k_padded-1 are written 0.
extern "C" __global__ void fixedpoint_encode_rows(
    const float* __restrict__ x, long long rows, int k, int k_padded, int bits, int slices,
    int descending, signed char* __restrict__ digits, int* __restrict__ exponents) {
    __shared__ unsigned int largest;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        rlp_block_encode_row(x + row * (long long)k, k, k_padded, bits, slices, descending, &largest, exponents + row,
                             digits + row * (long long)slices * k_padded);
    }
}

// fixedpoint.quantize_rows with given exponents: a K-shard of a row encoded with
// the whole row's exponent (all-reduced by MAX over the shards), so no row max
// here. The caller guarantees each exponent is the sentinel or in [the row's own
// exponent, 127] (contracts/fixedpoint.toml encode_rows_given).
extern "C" __global__ void fixedpoint_encode_rows_given(
    const float* __restrict__ x, long long rows, int k, int k_padded, int bits, int slices,
    int descending, const int* __restrict__ exponents, signed char* __restrict__ digits) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        rlp_encode_row_digits(x + row * (long long)k, k, k_padded, bits, slices, descending, exponents[row],
                              digits + row * (long long)slices * k_padded);
    }
}

// fixedpoint.row_exponents: one block per row (grid-stride), the exact integer
// max of magnitude bits (any block size, warp width or order gives the same e).
extern "C" __global__ void fixedpoint_row_exponents(
    const float* __restrict__ x, long long rows, int k, int* __restrict__ exponents) {
    __shared__ unsigned int largest;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        if (threadIdx.x == 0) largest = 0u;
        __syncthreads();
        const int e = rlp_block_row_exponent(x + row * (long long)k, k, &largest);
        if (threadIdx.x == 0) exponents[row] = e;
        __syncthreads();
    }
}
