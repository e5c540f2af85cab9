#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
#include "common.h"
// Kernel family "adamw": exact global gradient norm and the AdamW update of fp32 master weights.
// Contract: contracts/adamw.toml. Reference: rlportable/contract/adamw.py.
// One source for both vendors (backends/cuda/prelude.h on NVIDIA).

// float64 -> float32, round to nearest even; a NaN is stored as the canonical NaN.
__device__ __forceinline__ float rlp_adamw_store(double x) {
    float y = rlp_double2float_rn(x);
    return (y != y) ? rlp_canonical_nan() : y;
}

// The largest float32 magnitude bits of a flat tensor, merged into *out with an integer
// atomicMax (exact, order-free). *out is zeroed by the host; several tensors may share it.
extern "C" __global__ void adamw_max_bits(const float* __restrict__ g, long long n, unsigned int* __restrict__ out) {
    unsigned int local = 0u;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        local = rlp_max_u32(local, rlp_magnitude_bits(g[i]));
    atomicMax(out, local);
}

// Exact sum of q^2 (q = rlp_quantize(g, bits, e)) over each chunk of `chunk` elements: one block per
// chunk (grid-stride over chunks), partial sums combined with 64-bit shared-memory integer atomics.
// |q| < 2^(bits-1) and chunk * 2^(2(bits-1)) <= 2^62 (the host checks), so the sum is exact in int64.
extern "C" __global__ void adamw_sumsq(const float* __restrict__ g, long long n, int bits, int e, long long chunk,
                                       long long* __restrict__ out) {
    __shared__ unsigned long long total;
    const long long chunks = (n + chunk - 1) / chunk;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        if (threadIdx.x == 0) total = 0ull;
        __syncthreads();
        const long long begin = c * chunk;
        const long long end = (begin + chunk < n) ? begin + chunk : n;
        long long local = 0;
        for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
            long long q = rlp_quantize(g[i], bits, e);
            local += q * q;
        }
        atomicAdd(&total, (unsigned long long)local);
        __syncthreads();
        if (threadIdx.x == 0) out[c] = (long long)total;
        __syncthreads();
    }
}

// The AdamW update, in place, grid-stride over a flat tensor; float64 with one rounding per stored value:
//   g' = g*c; m' = f32(beta1*m + (1-beta1)*g'); v' = f32(beta2*v + (1-beta2)*(g'*g'));
//   p' = f32(p*decay - step_size * (m' / (sqrt(v')/sqrt_bc2 + eps))).
// sqrt and / of doubles are IEEE (correctly rounded): OCML's sqrt_f64 on AMD (0 ulp), CUDA's on NVIDIA;
// contraction is off (-ffp-contract=off).
extern "C" __global__ void adamw_update(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                        float* __restrict__ v, long long n, double c, double beta1,
                                        double one_minus_beta1, double beta2, double one_minus_beta2, double decay,
                                        double step_size, double sqrt_bc2, double eps) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const double gc = (double)g[i] * c;
        const float m_new = rlp_adamw_store(beta1 * (double)m[i] + one_minus_beta1 * gc);
        const float v_new = rlp_adamw_store(beta2 * (double)v[i] + one_minus_beta2 * (gc * gc));
        const double p1 = (double)p[i] * decay;
        const double d = sqrt((double)v_new) / sqrt_bc2 + eps;
        p[i] = rlp_adamw_store(p1 - step_size * ((double)m_new / d));
        m[i] = m_new;
        v[i] = v_new;
    }
}
