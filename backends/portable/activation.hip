#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif
// Kernel family "activation": SwiGLU, silu(gate) * up, with the contract's exp.
// Contract: contracts/activation.toml. Reference: rlportable/contract/activation.py (swiglu, swiglu_backward).
// One source for both vendors (backends/cuda/prelude.h on NVIDIA) (no warp-width assumption anywhere).
#include "common.h"
#include "contract_math.h"

// y = RNE_f32((double(g) / (1 + double(exp_f32(-g)))) * double(u)): the contract's exp
// (rlp_exp_f32, contract_math.h), then IEEE float64 add, divide, multiply, one conversion.
// Elementwise, grid-stride: any grid and block size gives the same bits. NaN -> canonical NaN.
__device__ __forceinline__ float rlp_swiglu(float g, float u) {
    const double e = (double)rlp_exp_f32(-g);
    const double silu = (double)g / (1.0 + e);
    const float v = rlp_double2float_rn(silu * (double)u);
    return (v != v) ? rlp_canonical_nan() : v;
}

extern "C" __global__ void activation_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                             long long n, float* __restrict__ y) {
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = rlp_swiglu(gate[i], up[i]);
}

// SwiGLU of rows with the gemm's encoding of the result (contracts/activation.toml swiglu_encode): one
// block per row (grid-stride); y as activation_swiglu computes it (rlp_swiglu), written out and kept in
// shared memory; then encoded as fixedpoint_encode_rows encodes it (23 bits, 3 ascending digits: the
// row's exponent an integer max, rlp_encode_row_digits). Bitwise swiglu then encode_rows, one launch.
// digits [rows, 3, k_padded] int8, exponents [rows] int32.
#define RLP_ACTIVATION_ENCODE_BITS 23
#define RLP_ACTIVATION_ENCODE_SLICES 3
extern "C" __global__ void activation_swiglu_encode(const float* __restrict__ gate, const float* __restrict__ up,
                                                    long long rows, int h, int k_padded, float* __restrict__ y,
                                                    signed char* __restrict__ digits, int* __restrict__ exponents) {
    RLP_DYNAMIC_SHARED(float, rlp_activation_row);  // [h]: the row's y
    __shared__ unsigned int largest;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = row * (long long)h;
        for (int i = threadIdx.x; i < h; i += blockDim.x) {
            const float v = rlp_swiglu(gate[base + i], up[base + i]);
            y[base + i] = v;
            rlp_activation_row[i] = v;
        }
        // syncs before reading the row, and after (the next row overwrites it)
        rlp_block_encode_row(rlp_activation_row, h, k_padded, RLP_ACTIVATION_ENCODE_BITS, RLP_ACTIVATION_ENCODE_SLICES, 0,
                             &largest, exponents + row, digits + row * (long long)RLP_ACTIVATION_ENCODE_SLICES * k_padded);
    }
}

// The gradient of y = silu(g) * u for an upstream dy (contracts/activation.toml swiglu_backward):
//   E = double(exp_f32(-g)), d = 1 + E, silu = g / d, sig = 1 / d
//   dup   = RNE_f32(double(dy) * silu)
//   dgate = RNE_f32((double(dy) * double(u)) * (sig * (1 + g * (1 - sig))))
// IEEE float64 operations in this order (dy * u exact), one conversion per output.
// Elementwise, grid-stride. NaN results (NaN inputs, g = +-inf) are the canonical NaN.
extern "C" __global__ void activation_swiglu_backward(const float* __restrict__ gate, const float* __restrict__ up,
                                                      const float* __restrict__ dy, long long n,
                                                      float* __restrict__ dgate, float* __restrict__ dup) {
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        const double e = (double)rlp_exp_f32(-g);
        const double denominator = 1.0 + e;
        const double silu = (double)g / denominator;
        const double sig = 1.0 / denominator;
        const double dsilu = sig * (1.0 + (double)g * (1.0 - sig));
        const double d_out = (double)dy[i];
        float du = rlp_double2float_rn(d_out * silu);
        float dg = rlp_double2float_rn((d_out * (double)up[i]) * dsilu);
        dup[i] = (du != du) ? rlp_canonical_nan() : du;
        dgate[i] = (dg != dg) ? rlp_canonical_nan() : dg;
    }
}
