#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "fixedpoint": per-row fixed-point encoding into int8 digits.
// Contract: contracts/fixedpoint.toml. Reference: rlportable/contract/fixedpoint.py.
// Line-by-line port of backends/cuda/fixedpoint.cu.

// One segment of 32 lanes per row (grid-stride over rows; common's rlp_segment_* helpers). The row
// maximum is an exact integer max of magnitude bits, so its result is independent of thread count,
// warp width and order. digits: [rows, slices, k_padded] int8; positions k..k_padded-1 are written 0.
extern "C" __global__ void fixedpoint_encode_rows(
    const float* __restrict__ x, long long rows, int k, int k_padded, int bits, int slices,
    int descending, signed char* __restrict__ digits, int* __restrict__ exponents) {
    for (long long row = rlp_segment_first_row(); row < rows; row += rlp_segment_row_stride()) {
        rlp_segment_encode_row(RlpRowValues{x + row * (long long)k}, k, k_padded, bits, slices, descending,
                               exponents + row, digits + row * (long long)slices * k_padded);
    }
}

// fixedpoint.quantize_rows with given exponents: a K-shard of a row encoded with
// the whole row's exponent (all-reduced by MAX over the shards), so no row max
// here. The caller guarantees each exponent is the sentinel or in [the row's own
// exponent, 127] (contracts/fixedpoint.toml encode_rows_given). One segment per row.
extern "C" __global__ void fixedpoint_encode_rows_given(
    const float* __restrict__ x, long long rows, int k, int k_padded, int bits, int slices,
    int descending, const int* __restrict__ exponents, signed char* __restrict__ digits) {
    for (long long row = rlp_segment_first_row(); row < rows; row += rlp_segment_row_stride()) {
        rlp_encode_row_digits(RlpRowValues{x + row * (long long)k}, k, k_padded, bits, slices, descending, exponents[row],
                              rlp_segment_lane(), RLP_SEGMENT, digits + row * (long long)slices * k_padded);
    }
}

// fixedpoint.row_exponents: one segment per row (grid-stride), the exact integer
// max of magnitude bits (any block size, warp width or order gives the same e).
extern "C" __global__ void fixedpoint_row_exponents(
    const float* __restrict__ x, long long rows, int k, int* __restrict__ exponents) {
    for (long long row = rlp_segment_first_row(); row < rows; row += rlp_segment_row_stride()) {
        const int e = rlp_segment_row_exponent(RlpRowValues{x + row * (long long)k}, k);
        if (rlp_segment_lane() == 0) exponents[row] = e;
    }
}
