// Contract helpers shared by every HIP kernel family: the line-by-line port of
// backends/cuda/common.cuh (inlined by the runtime's source assembly, so they are
// part of each family's cache key). The NumPy reference of each helper is named
// beside it; CUDA, HIP and NumPy must agree to the bit.
//
// Spelling rules of the HIP sources (they also compile on NVIDIA through
// hip_on_cuda.h, so they must mean the same thing under both compilers):
//   * Only names that HIP and CUDA define identically are used as they are:
//     threadIdx/blockIdx/blockDim/gridDim, __syncthreads, the bit casts
//     __int_as_float, __float_as_int, __double_as_longlong, __longlong_as_double,
//     __clz, and the shared-memory atomics atomicMax(unsigned int*),
//     atomicOr(unsigned int*), atomicAdd(unsigned long long*).
//   * Conversions with a rounding suffix (__ll2double_rn, __double2float_rn,
//     __double2ll_rn) are written as the C++ conversions they are under the
//     default round-to-nearest-even mode (HIP's own headers define them that way;
//     rint is IEEE roundToIntegralTiesToEven, exact).
//   * No warp-width assumption anywhere: block-wide results go through
//     shared-memory atomics and __syncthreads only.
// Include guard rather than #pragma once: the runtime inlines this file into
// the compiled text, where #pragma once would draw a warning.
#ifndef RLP_HIP_COMMON_H
#define RLP_HIP_COMMON_H

#define RLP_NONFINITE_EXPONENT 2147483647
#define RLP_ZERO_ROW_EXPONENT (-149)

// fixedpoint.CANONICAL_NAN: the one NaN every contract returns.
__device__ __forceinline__ float rlp_canonical_nan() { return __int_as_float(0x7fc00000); }

// fixedpoint.pow2_f64: 2^s built from exponent bits, s in [-1022, 1023].
__device__ __forceinline__ double rlp_pow2_f64(int s) {
    return __longlong_as_double((long long)(s + 1023) << 52);
}

// int64 -> float64, round to nearest even (CUDA's __ll2double_rn).
__device__ __forceinline__ double rlp_ll2double_rn(long long s) { return (double)s; }

// float64 -> float32, round to nearest even (CUDA's __double2float_rn).
__device__ __forceinline__ float rlp_double2float_rn(double x) { return (float)x; }

// float64 -> int64, round half to even (CUDA's __double2ll_rn) for |x| < 2^63:
// rint rounds to an integral double exactly (ties to even), the cast is then exact.
__device__ __forceinline__ long long rlp_double2ll_rn(double x) { return (long long)rint(x); }

// Unsigned max without relying on an overload set that differs between vendors.
__device__ __forceinline__ unsigned int rlp_max_u32(unsigned int a, unsigned int b) { return a > b ? a : b; }

// fixedpoint.round_to_odd_f64: int64 -> float64, inexact values take the odd neighbour.
// |s| < 2^62, so the nearest double converts back to int64 without overflow.
__device__ __forceinline__ double rlp_round_to_odd_f64(long long s) {
    double nearest = rlp_ll2double_rn(s);
    long long remainder = s - (long long)nearest;
    long long raw = __double_as_longlong(nearest);
    if ((s > 0 && remainder < 0) || (s < 0 && remainder > 0)) raw -= 1;
    if (remainder != 0) raw |= 1;
    return __longlong_as_double(raw);
}

// fixedpoint.round_scaled: RNE_f32(s * 2^e), one rounding (round-to-odd at 53 bits,
// an exact power-of-two scaling, then one RNE conversion).
__device__ __forceinline__ float rlp_round_scaled(long long s, int e) {
    return rlp_double2float_rn(rlp_round_to_odd_f64(s) * rlp_pow2_f64(e));
}

// fixedpoint.row_exponents for one row, from the largest magnitude's bits.
__device__ __forceinline__ int rlp_row_exponent(unsigned int largest_magnitude_bits) {
    if (largest_magnitude_bits == 0u) return RLP_ZERO_ROW_EXPONENT;
    unsigned int field = largest_magnitude_bits >> 23;
    if (field == 255u) return RLP_NONFINITE_EXPONENT;
    if (field != 0u) return (int)field - 127;
    return (31 - __clz((int)largest_magnitude_bits)) - 149;  // subnormal: m * 2^-149
}

// fixedpoint.quantize_rows for one element: RNE(x * 2^(bits-2-e)), clamped to B signed bits.
__device__ __forceinline__ long long rlp_quantize(float x, int bits, int e) {
    double scaled = (double)x * rlp_pow2_f64(bits - 2 - e);
    long long q = rlp_double2ll_rn(scaled);
    long long limit = (1LL << (bits - 1)) - 1;
    return q > limit ? limit : (q < -limit ? -limit : q);
}

// Largest magnitude bits of a float, for an exact integer max over a row (NaN > inf > finite).
__device__ __forceinline__ unsigned int rlp_magnitude_bits(float x) {
    return (unsigned int)__float_as_int(x) & 0x7fffffffu;
}

// The exact exponent of a row, computed by a whole block: every thread reads a strided
// share of the row and the maxima meet through a shared-memory atomicMax (exact for any
// block size or warp width). `largest` is shared, zeroed and synchronised by the caller;
// every thread returns the same exponent.
__device__ __forceinline__ int rlp_block_row_exponent(const float* row, int k, unsigned int* largest) {
    unsigned int local = 0u;
    for (int i = threadIdx.x; i < k; i += blockDim.x) local = rlp_max_u32(local, rlp_magnitude_bits(row[i]));
    atomicMax(largest, local);
    __syncthreads();
    return rlp_row_exponent(*largest);
}

#endif  // RLP_HIP_COMMON_H
