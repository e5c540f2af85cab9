#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "norm": RMSNorm (and the per-head QK-norm: rows = tokens * heads), and two fused
// compositions: add_rmsnorm (the residual add, RMSNorm, optionally the gemm's encoding of the result)
// and rmsnorm_heads_rope (QK-norm, then RoPE). Contract: contracts/norm.toml. Reference:
// rlportable/contract/norm.py (rmsnorm, add_rmsnorm, rmsnorm_heads_rope, and rmsnorm_backward: the
// gradient, dx per row and dweight over rows).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA) (no warp-width assumption anywhere).
#include "common.h"

// Contraction off even where a compiler's default would fuse; the build options say the same.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#define RLP_NORM_BITS 23

// The row's exponent e is an integer max and its sum of squares ss an exact int64 sum, both made
// by common's exact integer reductions: order-free, whatever the block size or warp width. Then the
// reference's float64 steps:
//   mean = (double(ss) * 2^(2(e-21))) / double(H);  r = 1 / sqrt(mean + eps)
//   y_i  = RNE_f32((double(x_i) * r) * double(w_i))
// sqrt of a double is IEEE (correctly rounded): OCML's sqrt_f64 on AMD (HIP's math API: 0 ulp),
// CUDA's under the prelude. NaN results are the canonical NaN. A
// non-finite row (e the sentinel) takes r = NaN, which makes every y_i the canonical NaN, as the
// reference's NaN row. Two ways to walk rows, the same bits: norm_rmsnorm and norm_add_rmsnorm give a
// row to a whole block (hidden-size rows, a few hundred per decode step: eight warps a row keep a
// step's few rows busy), norm_rmsnorm_heads_rope to one segment of 32 lanes (many head rows of
// 64..256: no shared memory and no barrier; bench/results/row_kernels_probe_h200.json).

// r from the row's exponent and exact sum of squares.
__device__ __forceinline__ double rlp_rmsnorm_factor(int e, long long ss, int h, double eps) {
    if (e == RLP_NONFINITE_EXPONENT) return (double)rlp_canonical_nan();
    const double mean = (rlp_ll2double_rn(ss) * rlp_pow2_f64(2 * (e - (RLP_NORM_BITS - 2)))) / (double)h;
    return 1.0 / sqrt(mean + eps);
}

// y_i from x_i, the row's r and w_i; NaN results the canonical NaN.
__device__ __forceinline__ float rlp_rmsnorm_value(float x, double r, float w) {
    const float v = rlp_double2float_rn(((double)x * r) * (double)w);
    return (v != v) ? rlp_canonical_nan() : v;
}

// A row's ss at exponent e: each caller's share of q_i^2, q_i = the 23-bit quantization of x_i.
__device__ __forceinline__ long long rlp_rmsnorm_square(float x, int e) {
    const long long q = rlp_quantize(x, RLP_NORM_BITS, e);
    return q * q;  // < 2^44 each; the row's sum < 2^62 for H <= 2^18
}

// One row yr = RMSNorm(xr) by the whole block (every thread calls; largest and total are the block's
// shared scratch). xr may be shared memory (norm_add_rmsnorm's sums). Ends synchronised.
__device__ __forceinline__ void rlp_rmsnorm_row(const float* __restrict__ xr, const float* __restrict__ w, int h,
                                                double eps, float* __restrict__ yr, unsigned int* largest,
                                                unsigned long long* total) {
    if (threadIdx.x == 0) { *largest = 0u; *total = 0ull; }
    __syncthreads();
    const int e = rlp_block_row_exponent(xr, h, largest);
    long long local_sum = 0;
    if (e != RLP_NONFINITE_EXPONENT)
        for (int i = threadIdx.x; i < h; i += blockDim.x) local_sum += rlp_rmsnorm_square(xr[i], e);
    rlp_block_sum_i64(total, local_sum);
    __syncthreads();
    const double r = rlp_rmsnorm_factor(e, (long long)*total, h, eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = rlp_rmsnorm_value(xr[i], r, w[i]);
    __syncthreads();
}

// r of the row xr[0 .. h-1] by its segment (every lane returns it).
__device__ __forceinline__ double rlp_segment_rmsnorm_factor(const float* __restrict__ xr, int h, double eps) {
    const int e = rlp_segment_row_exponent(xr, h);
    long long local_sum = 0;
    if (e != RLP_NONFINITE_EXPONENT)
        for (int i = rlp_segment_lane(); i < h; i += RLP_SEGMENT) local_sum += rlp_rmsnorm_square(xr[i], e);
    return rlp_rmsnorm_factor(e, (long long)rlp_segment_sum_u64((unsigned long long)local_sum), h, eps);
}

extern "C" __global__ void norm_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, long long rows,
                                        int h, double eps, float* __restrict__ y) {
    __shared__ unsigned int largest;
    __shared__ unsigned long long total;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x)
        rlp_rmsnorm_row(x + row * (long long)h, w, h, eps, y + row * (long long)h, &largest, &total);
}

// The gemm's activation encoding that norm_add_rmsnorm may fuse (contracts/norm.toml add_rmsnorm):
// fixedpoint.encode_rows of y at gemm.DEFAULT_BITS_A = 23 bits, 3 digits, least significant first.
#define RLP_NORM_ENCODE_BITS 23
#define RLP_NORM_ENCODE_SLICES 3

// The residual add and the next RMSNorm in one launch (contracts/norm.toml add_rmsnorm): per row
// s = residual.add(a, b) (rlp_add, to `sum` and to shared memory), then y = RMSNorm(s) from there
// (rlp_rmsnorm_row): bitwise the two ops in turn. One block per row, grid-stride.
// digits != nullptr also encodes y for the gemm that reads it (the stacked q/k/v and gate/up
// projections), bitwise fixedpoint_encode_rows(y, k, k_padded, 23, 3, ascending): the same common
// helper (rlp_block_encode_row) on the same float32 row, kept in a second shared buffer (dynamic
// shared memory [2h] then), not read back from `y`: global memory this kernel writes, which
// __restrict__ lets the compiler read through the non-coherent read-only cache.
// digits [rows, 3, k_padded] int8, exponents [rows] int32. The branch is block-uniform (a kernel
// argument), as the block reductions require.
extern "C" __global__ void norm_add_rmsnorm(const float* __restrict__ a, const float* __restrict__ b,
                                            const float* __restrict__ w, long long rows, int h, double eps,
                                            float* __restrict__ sum, float* __restrict__ y,
                                            signed char* __restrict__ digits, int* __restrict__ exponents,
                                            int k_padded) {
    RLP_DYNAMIC_SHARED(float, rlp_norm_row);  // [h]: the row's sum; encoding, [h] more: its y
    __shared__ unsigned int largest;
    __shared__ unsigned long long total;
    float* y_row = rlp_norm_row + h;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * (long long)h;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            const float s = rlp_add(a[base + i], b[base + i]);
            sum[base + i] = s;
            rlp_norm_row[i] = s;
        }
        if (digits == nullptr) {
            rlp_rmsnorm_row(rlp_norm_row, w, h, eps, y + base, &largest, &total);  // syncs before reading the row
        } else {
            rlp_rmsnorm_row(rlp_norm_row, w, h, eps, y_row, &largest, &total);  // ends synchronised: y_row whole
            for (int i = threadIdx.x; i < h; i += blockDim.x) y[base + i] = y_row[i];
            // the norm's reads of `largest` ended before its last sync; the encoding ends synchronised
            rlp_block_encode_row(y_row, h, k_padded, RLP_NORM_ENCODE_BITS, RLP_NORM_ENCODE_SLICES, 0, &largest,
                                 exponents + row, digits + row * (long long)RLP_NORM_ENCODE_SLICES * k_padded);
        }
    }
}

// Qwen3's QK-norm then RoPE, for q and k in one launch (contracts/norm.toml rmsnorm_heads_rope): the
// rows are the tokens' q heads, then their k heads, one segment per row (grid-stride). Each row is
// normalised as norm_rmsnorm does (its r, then y_i) and each pair (y_j, y_{j + d/2}) rotated as
// rope_apply does (rlp_rope_pair): bitwise rope_apply(norm_rmsnorm(row)), one launch instead of four.
// q, q_out: [tokens, hq, d]; k, k_out: [tokens, hk, d]; positions [tokens]; tables [P, d / 2].
extern "C" __global__ void norm_rmsnorm_heads_rope(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ wq,
    const float* __restrict__ wk, long long tokens, int hq, int hk, int d, double eps,
    const int* __restrict__ positions, const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    float* __restrict__ q_out, float* __restrict__ k_out) {
    const long long q_rows = tokens * hq, rows = q_rows + tokens * hk;
    const int half = d / 2;
    for (long long row = rlp_segment_first_row(); row < rows; row += rlp_segment_row_stride()) {
        const bool is_q = row < q_rows;
        const long long head_row = is_q ? row : row - q_rows;  // token * heads + head
        const long long token = head_row / (is_q ? hq : hk);
        const float* xr = (is_q ? q : k) + head_row * d;
        const float* wr = is_q ? wq : wk;
        const double r = rlp_segment_rmsnorm_factor(xr, d, eps);
        float* yr = (is_q ? q_out : k_out) + head_row * d;
        const long long table_row = (long long)positions[token] * (long long)half;
        for (int j = rlp_segment_lane(); j < half; j += RLP_SEGMENT) {
            rlp_rope_pair((double)rlp_rmsnorm_value(xr[j], r, wr[j]), (double)rlp_rmsnorm_value(xr[half + j], r, wr[half + j]),
                          (double)cos_table[table_row + j], (double)sin_table[table_row + j], yr + j, yr + half + j);
        }
    }
}

// norm_rmsnorm_heads_rope and then attention_write_kv in one launch (contracts/norm.toml
// rmsnorm_heads_rope_write_kv; the decode and prefill steps of the engine): rows are the tokens' q heads,
// their k heads, then their v heads, one segment per row. q and k rows are normalised and rotated as
// norm_rmsnorm_heads_rope does, to q_out and k_out; a k row's outputs also stay in its lanes' registers
// and are encoded from there into the cache (common's KV encoding), and a v row is encoded as
// attention_write_kv encodes it. A token whose slot lies outside [0, num_slots) writes no cache row. d <= 512
// (the cache's head dims: RLP_NORM_KV_PAIRS pairs per lane). Bitwise the two launches.
#define RLP_NORM_KV_PAIRS 8  // rotation pairs per lane of a k row: d / 2 <= 8 * 32
extern "C" __global__ void norm_rmsnorm_heads_rope_write_kv(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ wq, const float* __restrict__ wk, long long tokens, int hq, int hk, int d, double eps,
    const int* __restrict__ positions, const float* __restrict__ cos_table, const float* __restrict__ sin_table,
    float* __restrict__ q_out, float* __restrict__ k_out, const int* __restrict__ slots, long long num_slots,
    int dp, signed char* __restrict__ k_digits, int* __restrict__ k_exponents, signed char* __restrict__ v_digits,
    int* __restrict__ v_exponents) {
    const long long q_rows = tokens * hq, k_rows = tokens * hk, rows = q_rows + 2 * k_rows;
    const int half = d / 2;
    for (long long row = rlp_segment_first_row(); row < rows; row += rlp_segment_row_stride()) {
        const int kind = row < q_rows ? 0 : (row < q_rows + k_rows ? 1 : 2);  // q, k or v: segment-uniform
        const long long head_row = row - (kind == 0 ? 0 : (kind == 1 ? q_rows : q_rows + k_rows));
        const long long token = head_row / (kind == 0 ? hq : hk);
        long long cache_row = -1;  // the k or v row's place in the cache (-1: none)
        if (kind != 0) {
            const long long slot = slots[token];
            if (slot >= 0 && slot < num_slots) cache_row = slot * hk + (head_row - token * hk);
        }
        if (kind == 2) {
            if (cache_row >= 0)
                rlp_segment_write_kv_row(v + head_row * d, d, dp, v_digits + cache_row * (2LL * dp), v_exponents + cache_row);
            continue;
        }
        const float* xr = (kind == 0 ? q : k) + head_row * d;
        const float* wr = kind == 0 ? wq : wk;
        const double r = rlp_segment_rmsnorm_factor(xr, d, eps);
        float* yr = (kind == 0 ? q_out : k_out) + head_row * d;
        const long long table_row = (long long)positions[token] * (long long)half;
        float low[RLP_NORM_KV_PAIRS], high[RLP_NORM_KV_PAIRS];  // the lane's outputs at j and half + j
        unsigned int largest = 0u;
#pragma unroll
        for (int p = 0; p < RLP_NORM_KV_PAIRS; ++p) {
            const int j = rlp_segment_lane() + p * RLP_SEGMENT;
            if (j >= half) break;
            rlp_rope_pair((double)rlp_rmsnorm_value(xr[j], r, wr[j]), (double)rlp_rmsnorm_value(xr[half + j], r, wr[half + j]),
                          (double)cos_table[table_row + j], (double)sin_table[table_row + j], &low[p], &high[p]);
            yr[j] = low[p];
            yr[half + j] = high[p];
            largest = rlp_max_u32(largest, rlp_max_u32(rlp_magnitude_bits(low[p]), rlp_magnitude_bits(high[p])));
        }
        if (kind == 0 || cache_row < 0) continue;  // segment-uniform
        // the k row's cache encoding from the lanes' own outputs: its exponent from their maximum, as
        // rlp_segment_row_exponent finds it in memory
        const int e = rlp_row_exponent(rlp_segment_max_u32(largest));
        signed char* out = k_digits + cache_row * (2LL * dp);
        if (rlp_segment_lane() == 0) k_exponents[cache_row] = e;
#pragma unroll
        for (int p = 0; p < RLP_NORM_KV_PAIRS; ++p) {
            const int j = rlp_segment_lane() + p * RLP_SEGMENT;
            if (j >= half) break;
            rlp_kv_store_element(low[p], true, e, j, dp, out);
            rlp_kv_store_element(high[p], true, e, half + j, dp, out);
        }
        for (int i = d + rlp_segment_lane(); i < dp; i += RLP_SEGMENT) rlp_kv_store_element(0.0f, false, e, i, dp, out);
    }
}

// ---- backward: rmsnorm_backward (contracts/norm.toml), reference norm.rmsnorm_backward.

#define RLP_NORM_GRAD_SUM_BITS 44
#define RLP_NORM_WEIGHT_GRAD_BITS 38
#define RLP_NORM_F64_NONFINITE 0x7ff0000000000000ull  // magnitude bits >= this: inf or NaN

__device__ __forceinline__ unsigned long long rlp_norm_max_u64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}

// |v| as the bits of a float64: an integer max over them is the largest magnitude (NaN > inf > finite).
__device__ __forceinline__ unsigned long long rlp_norm_magnitude_f64(double v) {
    return (unsigned long long)__double_as_longlong(v) & 0x7fffffffffffffffull;
}

// q = RNE((term * 2^half) * 2^(shift - half)), shift = bits - 2 - e, half = floor(shift / 2):
// quantize_f64_rows's two exact power-of-two steps.
__device__ __forceinline__ long long rlp_norm_quantize_f64(double term, double scale_hi, double scale_lo) {
    return rlp_double2ll_rn((term * scale_hi) * scale_lo);
}

// dx: one block per row (grid-stride over rows). r is the forward's (same steps as norm_rmsnorm).
// With g_j = dy_j w_j (exact) and t_j = RNE_f64(g_j x_j):
//   s = odd(Q) 2^(e-42), Q = sum_j RNE(t_j 2^(42-e)) exact int64, e = ilogb(max |t_j|)
//   c = (((r r) r) s) / H;  dx_j = RNE_f32((g_j r) - (x_j c))
// The max and the sums meet through rlp_block_* (as above): exact and order-free. row_scale[row]
// = r (NaN on a non-finite x row) for the dweight kernels. A non-finite x row or t gives a
// canonical-NaN row; any other NaN result is the canonical NaN.
extern "C" __global__ void norm_rmsnorm_backward(const float* __restrict__ x, const float* __restrict__ w,
                                                 const float* __restrict__ dy, long long rows, int h, double eps,
                                                 float* __restrict__ dx, double* __restrict__ row_scale) {
    __shared__ unsigned int largest;
    __shared__ unsigned long long total;
    __shared__ unsigned long long largest_t;
    __shared__ unsigned long long total_t;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long offset = row * (long long)h;
        if (threadIdx.x == 0) { largest = 0u; total = 0ull; largest_t = 0ull; total_t = 0ull; }
        __syncthreads();
        const int e = rlp_block_row_exponent(x + offset, h, &largest);
        if (e == RLP_NONFINITE_EXPONENT) {
            for (int i = threadIdx.x; i < h; i += blockDim.x) dx[offset + i] = rlp_canonical_nan();
            if (threadIdx.x == 0) row_scale[row] = __longlong_as_double(0x7ff8000000000000ll);
        } else {
            long long local_sum = 0;
            unsigned long long local_t = 0ull;
            for (int i = threadIdx.x; i < h; i += blockDim.x) {
                const float xi = x[offset + i];
                long long q = rlp_quantize(xi, RLP_NORM_BITS, e);
                local_sum += q * q;
                const double t = ((double)dy[offset + i] * (double)w[i]) * (double)xi;
                local_t = rlp_norm_max_u64(local_t, rlp_norm_magnitude_f64(t));
            }
            rlp_block_sum_i64(&total, local_sum);
            rlp_block_max_u64(&largest_t, local_t);
            __syncthreads();
            const double ss = rlp_ll2double_rn((long long)total);
            const double mean = (ss * rlp_pow2_f64(2 * (e - (RLP_NORM_BITS - 2)))) / (double)h;
            const double r = 1.0 / sqrt(mean + eps);
            if (threadIdx.x == 0) row_scale[row] = r;
            if (largest_t >= RLP_NORM_F64_NONFINITE) {
                for (int i = threadIdx.x; i < h; i += blockDim.x) dx[offset + i] = rlp_canonical_nan();
            } else {
                const int et = rlp_exponent_f64(largest_t);
                const int shift = (RLP_NORM_GRAD_SUM_BITS - 2) - et;
                const int half = shift >> 1;  // floor(shift / 2)
                const double scale_hi = rlp_pow2_f64(half);
                const double scale_lo = rlp_pow2_f64(shift - half);
                long long local_q = 0;
                for (int i = threadIdx.x; i < h; i += blockDim.x) {
                    const double t = ((double)dy[offset + i] * (double)w[i]) * (double)x[offset + i];
                    local_q += rlp_norm_quantize_f64(t, scale_hi, scale_lo);
                }
                rlp_block_sum_i64(&total_t, local_q);
                __syncthreads();
                const double s = rlp_round_to_odd_f64((long long)total_t) * rlp_pow2_f64(et - (RLP_NORM_GRAD_SUM_BITS - 2));
                const double c = (((r * r) * r) * s) / (double)h;
                for (int i = threadIdx.x; i < h; i += blockDim.x) {
                    const double g = (double)dy[offset + i] * (double)w[i];
                    float v = rlp_double2float_rn((g * r) - ((double)x[offset + i] * c));
                    dx[offset + i] = (v != v) ? rlp_canonical_nan() : v;
                }
            }
        }
        __syncthreads();
    }
}

// dweight's term: u = RNE_f64(RNE_f64(dy x) * r) (dy x exact; r = NaN poisons a non-finite x row).
__device__ __forceinline__ double rlp_norm_weight_term(const float* dy, const float* x, const double* row_scale,
                                                       long long row, int h, int column) {
    const long long k = row * (long long)h + column;
    return ((double)dy[k] * (double)x[k]) * row_scale[row];
}

// dweight, pass 1: largest[column] = max over rows of |u| (as float64 bits), global atomicMax.
// grid.x tiles columns (one thread each, consecutive threads on consecutive columns), grid.y
// chunks of rows_per_chunk rows; both grid-stride, so any grid gives the same maxima.
extern "C" __global__ void norm_rmsnorm_dweight_largest(const float* __restrict__ dy, const float* __restrict__ x,
                                                        const double* __restrict__ row_scale, long long rows, int h,
                                                        int rows_per_chunk, unsigned long long* __restrict__ largest) {
    for (long long column = (long long)blockIdx.x * blockDim.x + threadIdx.x; column < h;
         column += (long long)gridDim.x * blockDim.x) {
        for (long long first = (long long)blockIdx.y * rows_per_chunk; first < rows;
             first += (long long)gridDim.y * rows_per_chunk) {
            const long long last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
            unsigned long long local = 0ull;
            for (long long row = first; row < last; ++row)
                local = rlp_norm_max_u64(local, rlp_norm_magnitude_f64(rlp_norm_weight_term(dy, x, row_scale, row, h, (int)column)));
            atomicMax(&largest[column], local);
        }
    }
}

// dweight, pass 2: total[column] = sum over rows of RNE(u 2^(36-e)), e = ilogb(largest[column]),
// exact int64 through global atomicAdd (order-free). Columns with a non-finite u are skipped.
extern "C" __global__ void norm_rmsnorm_dweight_sum(const float* __restrict__ dy, const float* __restrict__ x,
                                                    const double* __restrict__ row_scale, long long rows, int h,
                                                    int rows_per_chunk, const unsigned long long* __restrict__ largest,
                                                    unsigned long long* __restrict__ total) {
    for (long long column = (long long)blockIdx.x * blockDim.x + threadIdx.x; column < h;
         column += (long long)gridDim.x * blockDim.x) {
        if (largest[column] >= RLP_NORM_F64_NONFINITE) continue;
        const int e = rlp_exponent_f64(largest[column]);
        const int shift = (RLP_NORM_WEIGHT_GRAD_BITS - 2) - e;
        const int half = shift >> 1;  // floor(shift / 2)
        const double scale_hi = rlp_pow2_f64(half);
        const double scale_lo = rlp_pow2_f64(shift - half);
        for (long long first = (long long)blockIdx.y * rows_per_chunk; first < rows;
             first += (long long)gridDim.y * rows_per_chunk) {
            const long long last = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
            long long local = 0;
            for (long long row = first; row < last; ++row)
                local += rlp_norm_quantize_f64(rlp_norm_weight_term(dy, x, row_scale, row, h, (int)column), scale_hi, scale_lo);
            atomicAdd(&total[column], (unsigned long long)local);
        }
    }
}

// dweight, pass 3: dweight[column] = RNE_f32(odd(total) 2^(e-36)), one rounding; canonical NaN
// for a non-finite column (or a NaN result).
extern "C" __global__ void norm_rmsnorm_dweight_round(const unsigned long long* __restrict__ largest,
                                                      const unsigned long long* __restrict__ total, int h,
                                                      float* __restrict__ dweight) {
    for (long long column = (long long)blockIdx.x * blockDim.x + threadIdx.x; column < h;
         column += (long long)gridDim.x * blockDim.x) {
        if (largest[column] >= RLP_NORM_F64_NONFINITE) {
            dweight[column] = rlp_canonical_nan();
        } else {
            const int e = rlp_exponent_f64(largest[column]);
            float v = rlp_round_scaled((long long)total[column], e - (RLP_NORM_WEIGHT_GRAD_BITS - 2));
            dweight[column] = (v != v) ? rlp_canonical_nan() : v;
        }
    }
}
