// Kernel family "activation": SwiGLU, silu(gate) * up, with the contract's exp.
// Contract: contracts/activation.toml. Reference: rlportable/contract/activation.py (swiglu).
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
