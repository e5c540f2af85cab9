#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "residual": IEEE float32 additions (contracts/residual.toml).
// Reference: rlportable/ops/residual.py. Line-parallel to backends/cuda/residual.cu.
#include "common.h"

__device__ __forceinline__ float rlp_add(float a, float b) {
    const float y = a + b;
    return (y != y) ? rlp_canonical_nan() : y;
}

extern "C" __global__ void residual_add_f32(const float* __restrict__ a, const float* __restrict__ b,
                                            float* __restrict__ y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = rlp_add(a[i], b[i]);
}

extern "C" __global__ void residual_add_bias_f32(const float* __restrict__ x, const float* __restrict__ b,
                                                 float* __restrict__ y, long long rows, long long n) {
    const long long total = rows * n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total; i += (long long)gridDim.x * blockDim.x)
        y[i] = rlp_add(x[i], b[i % n]);
}
