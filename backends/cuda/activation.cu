// Kernel family "activation": SwiGLU, silu(gate) * up, with the contract's exp.
// Contract: contracts/activation.toml. Reference: rlportable/contract/activation.py (swiglu, swiglu_backward).
// backends/hip/activation.hip is the same logic, line for line, in HIP spellings.
#include "common.cuh"
#include "contract_math.cuh"

// y = RNE_f32((double(g) / (1 + double(exp_f32(-g)))) * double(u)): the contract's exp
// (rlp_exp_f32, contract_math.cuh), then IEEE float64 add, divide, multiply, one conversion.
// Elementwise, grid-stride: any grid and block size gives the same bits. NaN -> canonical NaN.
extern "C" __global__ void activation_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                             long long n, float* __restrict__ y) {
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        const double e = (double)rlp_exp_f32(-g);
        const double silu = (double)g / (1.0 + e);
        float v = __double2float_rn(silu * (double)up[i]);
        y[i] = (v != v) ? rlp_canonical_nan() : v;
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
        float du = __double2float_rn(d_out * silu);
        float dg = __double2float_rn((d_out * (double)up[i]) * dsilu);
        dup[i] = (du != du) ? rlp_canonical_nan() : du;
        dgate[i] = (dg != dg) ? rlp_canonical_nan() : dg;
    }
}
