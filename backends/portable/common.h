// Contract helpers shared by every kernel family, both vendors (inlined by the runtime's
// source assembly, so they are part of each family's cache key). The NumPy reference of each helper is named
// beside it; CUDA, HIP and NumPy must agree to the bit.
//
// Spelling rules of the HIP sources (they also compile on NVIDIA through
// cuda/prelude.h, so they must mean the same thing under both compilers):
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
//     shared-memory atomics and __syncthreads, after an exact integer reduction
//     over segments of 32 lanes (rlp_block_max_u32 and its siblings below; 32
//     divides the warp width of either vendor). __shfl_xor(value, lane_mask, 32)
//     in rlp_segment_xor_u32 is the only shuffle; the family sources call the
//     rlp_block_* helpers, never a shuffle themselves.
// Include guard rather than #pragma once: the runtime inlines this file into
// the compiled text, where #pragma once would draw a warning.
#ifndef RLP_HIP_COMMON_H
#define RLP_HIP_COMMON_H

// Dynamic shared memory (the bytes a launch asks for): `extern __shared__ T name[]` on both
// vendors; the HIP-CPU prelude (hip/cpu_prelude.h) spells it its own way.
#ifndef RLP_DYNAMIC_SHARED
#define RLP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// __launch_bounds__ with NVIDIA's minimum of resident blocks per multiprocessor (cuda/prelude.h);
// HIP's second argument means something else (waves per execution unit), so HIP gets the threads only.
#ifndef RLP_LAUNCH_BOUNDS
#define RLP_LAUNCH_BOUNDS(threads, nvidia_min_blocks) __launch_bounds__(threads)
#endif

#define RLP_NONFINITE_EXPONENT 2147483647
#define RLP_ZERO_ROW_EXPONENT (-149)

// fixedpoint.CANONICAL_NAN: the one NaN every contract returns.
__device__ __forceinline__ float rlp_canonical_nan() { return __int_as_float(0x7fc00000); }

// a * b + c with one rounding to nearest even (IEEE 754 fusedMultiplyAdd, HIP's __fma_rn: the hardware's
// fused multiply-add, exact by IEEE 754 whatever library provides it).
__device__ __forceinline__ double rlp_fma_f64(double a, double b, double c) { return __fma_rn(a, b, c); }

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

// residual.add's float32 sum (contracts/residual.toml), NaN canonical. Shared by the residual family
// and norm's fused add + RMSNorm.
__device__ __forceinline__ float rlp_add(float a, float b) {
    const float y = a + b;
    return (y != y) ? rlp_canonical_nan() : y;
}

// rope.apply's rotation of one pair (contracts/rope.toml): the products exact in float64 (24 x 24
// bits), each sum rounded once in float64, then to float32; NaN results are the canonical NaN. Shared
// by the rope family and norm's fused QK-norm + RoPE, so both rotate one way.
__device__ __forceinline__ void rlp_rope_pair(double first, double second, double c, double s, float* lo, float* hi) {
    const float a = rlp_double2float_rn(first * c - second * s);
    const float b = rlp_double2float_rn(second * c + first * s);
    *lo = (a != a) ? rlp_canonical_nan() : a;
    *hi = (b != b) ? rlp_canonical_nan() : b;
}

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

// ilogb of a float64 magnitude from its bits (subnormals included), 0 for zero: the e of
// logprob.quantize_f64_rows and of every grid sum below a float64 row's largest term.
__device__ __forceinline__ int rlp_exponent_f64(unsigned long long magnitude_bits) {
    if (magnitude_bits == 0ull) return 0;
    const int field = (int)(magnitude_bits >> 52);
    if (field != 0) return field - 1023;
    return (63 - __clzll((long long)magnitude_bits)) - 1074;  // subnormal: m * 2^-1074
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

// ---- Block-wide exact integer reductions (max, sum, or), in two steps: xor shuffles of
// width 32 combine each aligned segment of 32 lanes (threads 32j .. 32j+31), then lane 0 of
// each segment does the one shared-memory atomic (not 256 threads on one address). 32 divides
// both warp widths (32 on NVIDIA, 64 on AMD), so no warp width is assumed. Integer max, sum
// (mod 2^64, as atomicAdd) and or are exact and order-free: the bits are those of one atomic
// per thread. Preconditions (a shuffle reads its partner lane's value):
//   * the block is one-dimensional with a multiple of 32 threads;
//   * every thread of the block calls the helper (block-uniform control flow).
// The shared word is zeroed and synchronised by the caller, who synchronises again before
// reading it. HIP's __shfl_xor (width 32: segments of 32 lanes of a 64-wide wavefront;
// cuda/prelude.h maps it to __shfl_xor_sync, hip/cpu_prelude.h to a segment-local wait).
#define RLP_SEGMENT 32

// The one shuffle: value of lane (this lane xor lane_mask), lane_mask < 32, within the segment.
__device__ __forceinline__ unsigned int rlp_segment_xor_u32(unsigned int value, int lane_mask) {
    return __shfl_xor(value, lane_mask, 32);
}

// 64 bits as two 32-bit shuffles (no reliance on either vendor's 64-bit overload).
__device__ __forceinline__ unsigned long long rlp_segment_xor_u64(unsigned long long value, int lane_mask) {
    const unsigned int low = rlp_segment_xor_u32((unsigned int)value, lane_mask);
    const unsigned int high = rlp_segment_xor_u32((unsigned int)(value >> 32), lane_mask);
    return ((unsigned long long)high << 32) | (unsigned long long)low;
}

__device__ __forceinline__ bool rlp_segment_leader() { return (threadIdx.x & (RLP_SEGMENT - 1)) == 0; }

// ---- The same reductions within one segment, every lane getting the result: the block helpers
// above end with them, and kernels that give a row to a segment (below) use them alone.

// max(value) over the segment, in every lane.
__device__ __forceinline__ unsigned int rlp_segment_max_u32(unsigned int value) {
    for (int lane_mask = RLP_SEGMENT / 2; lane_mask > 0; lane_mask >>= 1) {
        const unsigned int other = rlp_segment_xor_u32(value, lane_mask);
        value = other > value ? other : value;
    }
    return value;
}

// max(value) over the segment, in every lane.
__device__ __forceinline__ unsigned long long rlp_segment_max_u64(unsigned long long value) {
    for (int lane_mask = RLP_SEGMENT / 2; lane_mask > 0; lane_mask >>= 1) {
        const unsigned long long other = rlp_segment_xor_u64(value, lane_mask);
        value = other > value ? other : value;
    }
    return value;
}

// sum(value) over the segment mod 2^64 (two's complement: the caller bounds the true sum inside
// int64, so this is that sum, whatever the order), in every lane.
__device__ __forceinline__ unsigned long long rlp_segment_sum_u64(unsigned long long value) {
    for (int lane_mask = RLP_SEGMENT / 2; lane_mask > 0; lane_mask >>= 1) value += rlp_segment_xor_u64(value, lane_mask);
    return value;
}

// or(value) over the segment, in every lane.
__device__ __forceinline__ unsigned int rlp_segment_or_u32(unsigned int value) {
    for (int lane_mask = RLP_SEGMENT / 2; lane_mask > 0; lane_mask >>= 1) value |= rlp_segment_xor_u32(value, lane_mask);
    return value;
}

// *largest = max(*largest, value over the block).
__device__ __forceinline__ void rlp_block_max_u32(unsigned int* largest, unsigned int value) {
    value = rlp_segment_max_u32(value);
    if (rlp_segment_leader()) atomicMax(largest, value);
}

// *largest = max(*largest, value over the block).
__device__ __forceinline__ void rlp_block_max_u64(unsigned long long* largest, unsigned long long value) {
    value = rlp_segment_max_u64(value);
    if (rlp_segment_leader()) atomicMax(largest, value);
}

// *total += the sum of value over the block, in two's complement mod 2^64 (the caller bounds
// the true sum inside int64, so the wrapped sum is that sum, whatever the order).
__device__ __forceinline__ void rlp_block_sum_i64(unsigned long long* total, long long value) {
    const unsigned long long sum = rlp_segment_sum_u64((unsigned long long)value);
    if (rlp_segment_leader()) atomicAdd(total, sum);
}

// *bits |= the or of value over the block.
__device__ __forceinline__ void rlp_block_or_u32(unsigned int* bits, unsigned int value) {
    value = rlp_segment_or_u32(value);
    if (rlp_segment_leader()) atomicOr(bits, value);
}

// The exact exponent of a row, computed by a whole block: every thread reads a strided
// share of the row and the maxima meet through rlp_block_max_u32 (exact for any block size
// that is a multiple of 32, any warp width; every thread of the block calls it). `largest`
// is shared, zeroed and synchronised by the caller; every thread returns the same exponent.
__device__ __forceinline__ int rlp_block_row_exponent(const float* row, int k, unsigned int* largest) {
    unsigned int local = 0u;
    for (int i = threadIdx.x; i < k; i += blockDim.x) local = rlp_max_u32(local, rlp_magnitude_bits(row[i]));
    rlp_block_max_u32(largest, local);
    __syncthreads();
    return rlp_row_exponent(*largest);
}

// fixedpoint.quantize_rows + split_digits for one row with exponent e: the quantize and digit-split
// loop shared by the fixedpoint encoders and norm's fused add + RMSNorm + encoding (one definition,
// so the two give the same digits). The block's threads take strided positions; positions
// k..k_padded-1 and non-finite rows get q = 0. descending != 0 stores the most significant digit
// first (slot 0). out: [slices, k_padded] int8. xr may be global or shared memory.
__device__ __forceinline__ void rlp_encode_row_digits(
    const float* xr, int k, int k_padded, int bits, int slices, int descending, int e, signed char* out) {
    for (int i = threadIdx.x; i < k_padded; i += blockDim.x) {
        long long q = (i < k && e != RLP_NONFINITE_EXPONENT) ? rlp_quantize(xr[i], bits, e) : 0;
        for (int j = 0; j < slices; ++j) {
            long long d = ((q + 128) & 255) - 128;
            q = (q - d) >> 8;
            int slot = descending ? slices - 1 - j : j;
            out[(long long)slot * k_padded + i] = (signed char)d;
        }
    }
}

// fixedpoint_encode_rows's row: the block (every thread calling, the row complete in xr) takes the row's
// exponent as an integer max (largest: the block's scratch; to *exponent) and writes its digits. Ends
// synchronised, so the caller may overwrite xr or reuse largest. Shared by the encoders and the fused
// kernels that encode their output (norm_add_rmsnorm, activation_swiglu_encode).
__device__ __forceinline__ void rlp_block_encode_row(const float* xr, int k, int k_padded, int bits, int slices,
                                                     int descending, unsigned int* largest, int* exponent,
                                                     signed char* out) {
    if (threadIdx.x == 0) *largest = 0u;
    __syncthreads();
    const int e = rlp_block_row_exponent(xr, k, largest);
    if (threadIdx.x == 0) *exponent = e;
    rlp_encode_row_digits(xr, k, k_padded, bits, slices, descending, e, out);
    __syncthreads();
}


// ---- Rows given to segments: a kernel over many short rows (the QK-norm + RoPE's head rows) gives
// each row to one segment of 32 lanes, which walks it at stride 32 (lane l takes positions l, l + 32,
// ...) and reduces it with the segment helpers above: no shared memory, no barrier, and the same
// exact integers as a block would get. Preconditions: a one-dimensional block of a multiple of 32
// threads; the 32 lanes of a segment take one path (segments of one 64-wide wavefront may part: each
// keeps to its own lanes).

__device__ __forceinline__ int rlp_segment_lane() { return threadIdx.x & (RLP_SEGMENT - 1); }

// A grid-stride walk over rows, one segment per row: this segment's first row, and the stride.
__device__ __forceinline__ long long rlp_segment_first_row() {
    return (long long)blockIdx.x * (blockDim.x / RLP_SEGMENT) + threadIdx.x / RLP_SEGMENT;
}
__device__ __forceinline__ long long rlp_segment_row_stride() {
    return (long long)gridDim.x * (blockDim.x / RLP_SEGMENT);
}

// fixedpoint.row_exponents of row[0 .. k-1], by its segment; every lane returns it.
__device__ __forceinline__ int rlp_segment_row_exponent(const float* row, int k) {
    unsigned int local = 0u;
    for (int i = rlp_segment_lane(); i < k; i += RLP_SEGMENT) local = rlp_max_u32(local, rlp_magnitude_bits(row[i]));
    return rlp_row_exponent(rlp_segment_max_u32(local));
}

// ---- The KV cache's row encoding (contracts/attention.toml: fixedpoint.encode_rows at 15 bits, 2 ascending
// digits, the row padded to dp with zero digits), shared by attention_write_kv and norm's fused QK-norm +
// RoPE + cache write, so that both write the same bytes.
#define RLP_KV_BITS 15
#define RLP_KV_SLICES 2

// The KV digits of element i (its value x) of a row with exponent e, to out[i] and out[dp + i]; an element
// past the row (i >= d) or of a non-finite row gets zero digits.
__device__ __forceinline__ void rlp_kv_store_element(float x, bool in_row, int e, int i, int dp, signed char* out) {
    long long qv = (in_row && e != RLP_NONFINITE_EXPONENT) ? rlp_quantize(x, RLP_KV_BITS, e) : 0;
    for (int j = 0; j < RLP_KV_SLICES; ++j) {
        const long long digit = ((qv + 128) & 255) - 128;
        qv = (qv - digit) >> 8;
        out[(long long)j * dp + i] = (signed char)digit;
    }
}

// One KV row xr[0 .. d-1] encoded by its segment: the exponent to *exponent (lane 0), the digits to out
// ([2, dp] int8).
__device__ __forceinline__ void rlp_segment_write_kv_row(const float* xr, int d, int dp, signed char* out,
                                                         int* exponent) {
    const int e = rlp_segment_row_exponent(xr, d);
    if (rlp_segment_lane() == 0) *exponent = e;
    for (int i = rlp_segment_lane(); i < dp; i += RLP_SEGMENT) rlp_kv_store_element(i < d ? xr[i] : 0.0f, i < d, e, i, dp, out);
}

#endif  // RLP_HIP_COMMON_H
