#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "norm": RMSNorm (and the per-head QK-norm: rows = tokens * heads).
// Contract: contracts/norm.toml. Reference: rlportable/contract/norm.py (rmsnorm).
// Line-by-line port of backends/cuda/norm.cu (no warp-width assumption anywhere).
#include "common.h"

// Contraction off even where a compiler's default would fuse; the build options say the same.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#define RLP_NORM_BITS 23

// One block per row (grid-stride over rows). The row's exponent is an integer max and its
// sum of squares an exact int64 sum, both combined with shared-memory atomics: exact and
// order-free, whatever the block size or warp width. Then the reference's float64 steps:
//   mean = (double(ss) * 2^(2(e-21))) / double(H);  r = 1 / sqrt(mean + eps)
//   y_i  = RNE_f32((double(x_i) * r) * double(w_i))
// sqrt of a double is IEEE (correctly rounded): OCML's sqrt_f64 on AMD (HIP's math API: 0 ulp),
// CUDA's under the prelude. NaN results are the canonical NaN.
extern "C" __global__ void norm_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, long long rows,
                                        int h, double eps, float* __restrict__ y) {
    __shared__ unsigned int largest;
    __shared__ unsigned long long total;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* xr = x + row * (long long)h;
        float* yr = y + row * (long long)h;
        if (threadIdx.x == 0) { largest = 0u; total = 0ull; }
        __syncthreads();
        const int e = rlp_block_row_exponent(xr, h, &largest);
        if (e == RLP_NONFINITE_EXPONENT) {
            for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = rlp_canonical_nan();
        } else {
            long long local_sum = 0;
            for (int i = threadIdx.x; i < h; i += blockDim.x) {
                long long q = rlp_quantize(xr[i], RLP_NORM_BITS, e);
                local_sum += q * q;  // < 2^44 each; the row's sum < 2^62 for H <= 2^18
            }
            atomicAdd(&total, (unsigned long long)local_sum);
            __syncthreads();
            const double ss = rlp_ll2double_rn((long long)total);
            const double mean = (ss * rlp_pow2_f64(2 * (e - (RLP_NORM_BITS - 2)))) / (double)h;
            const double r = 1.0 / sqrt(mean + eps);
            for (int i = threadIdx.x; i < h; i += blockDim.x) {
                float v = rlp_double2float_rn(((double)xr[i] * r) * (double)w[i]);
                yr[i] = (v != v) ? rlp_canonical_nan() : v;
            }
        }
        __syncthreads();
    }
}
