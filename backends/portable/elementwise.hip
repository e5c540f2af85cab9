// Kernel family "elementwise": the contract's float32 exp and log, correctly rounded.
// Contract: contracts/elementwise.toml. Reference: rlportable/contract/elementwise.py
// (exp_f32, log_f32), which this file follows operation for operation: binary64
// add, subtract, multiply and conversions only (round to nearest even), no fma,
// no contraction (-ffp-contract=off, and the pragma below), no math library (no
// OCML). Integer manipulation of bits builds powers of two, reads exponents and
// rounds to odd. One source for both vendors (backends/cuda/prelude.h on NVIDIA).
// Nothing here depends on the warp width (64 on CDNA, 32 under the HIP-on-CUDA
// prelude): every lane works alone, and the checker counts with atomic adds.
//
// The one exception: elementwise_exhaustive_check calls the device double exp()/log()
// as an ORACLE that grades the contract functions; nothing else uses libm.

#ifndef RLP_HIP_ON_CUDA
#include <hip/hip_runtime.h>
#endif

// The contract functions themselves (constants, tables, rlp_exp_f32, rlp_log_f32) live in
// contract_math.h, shared with the other families that use them.
#include "contract_math.h"

// ---- kernels
extern "C" __global__ void elementwise_exp_f32(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = rlp_exp_f32(x[i]);
}

extern "C" __global__ void elementwise_log_f32(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) y[i] = rlp_log_f32(x[i]);
}

// ---- exhaustive checker (elementwise.oracle_f32 on the GPU)
#define RLP_EW_ORACLE_TOLERANCE 0x1.0p-45
#define RLP_EW_MAX_RECORDED 1024u

// The float32 grid extended past FLT_MAX: bits 0x7f800000 stand for 2^128 (elementwise._grid_value).
__device__ __forceinline__ double rlp_ew_grid_value(long long bits) {
    if (bits >= 0x7f800000LL) return 0x1.0p+128 + (double)(bits - 0x7f800000LL) * 0x1.0p+104;
    return (double)__uint_as_float((unsigned int)bits);
}

// counters (3 x u64, zeroed by the caller): [0] inputs checked, [1] not correctly rounded
// (the oracle is certain and the bits differ), [2] ambiguous (the oracle lies within
// tolerance of a rounding boundary). first_bad (3 * 1024 x u32): [0, 1024) the first
// not-correctly-rounded inputs, [1024, 2048) the first ambiguous inputs, to be decided on
// the CPU (elementwise.resolve_ambiguous), [2048, 3072) the contract's bits for those.
// Counts are atomic adds (order-free); which inputs fill the slots depends on scheduling.
extern "C" __global__ void elementwise_exhaustive_check(unsigned int start, unsigned long long count, int which,
                                                        unsigned long long* counters, unsigned int* first_bad) {
    unsigned long long stride = (unsigned long long)gridDim.x * (unsigned long long)blockDim.x;
    unsigned long long checked = 0ull;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < count; k += stride) {
        unsigned int bits = (unsigned int)((unsigned long long)start + k);
        float xf = __uint_as_float(bits);
        float ours = which == 0 ? rlp_exp_f32(xf) : rlp_log_f32(xf);
        unsigned int got = __float_as_uint(ours);
        double x = (double)xf;
        double y = which == 0 ? exp(x) : log(x);  // the oracle (libm), not the contract
        unsigned int expected;
        bool certain = true;
        if (y != y) {
            expected = RLP_EW_CANONICAL_NAN_BITS;
        } else {
            double magnitude = y < 0.0 ? -y : y;
            unsigned int sign = y < 0.0 ? 0x80000000u : 0u;
            unsigned int a = __float_as_uint(__double2float_rn(magnitude));
            expected = sign | a;
            if (magnitude != 0.0 && magnitude <= 0x1.fffffffffffffp+1023) {
                double here = rlp_ew_grid_value((long long)a);
                double tol = magnitude * RLP_EW_ORACLE_TOLERANCE;
                if (a > 0u) {
                    double below = (here + rlp_ew_grid_value((long long)a - 1LL)) * 0.5;
                    if (!(magnitude - below > tol)) certain = false;
                }
                if (a < 0x7f800000u) {
                    double above = (here + rlp_ew_grid_value((long long)a + 1LL)) * 0.5;
                    if (!(above - magnitude > tol)) certain = false;
                }
            }
        }
        checked += 1ull;
        if (!certain) {
            unsigned long long slot = atomicAdd(&counters[2], 1ull);
            if (slot < RLP_EW_MAX_RECORDED) {
                first_bad[RLP_EW_MAX_RECORDED + slot] = bits;
                first_bad[2u * RLP_EW_MAX_RECORDED + slot] = got;
            }
        } else if (got != expected) {
            unsigned long long slot = atomicAdd(&counters[1], 1ull);
            if (slot < RLP_EW_MAX_RECORDED) first_bad[slot] = bits;
        }
    }
    atomicAdd(&counters[0], checked);
}
