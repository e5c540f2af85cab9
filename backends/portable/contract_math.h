// The contract's float32 exp and log as device functions, rlp_exp_f32 and rlp_log_f32:
// the one HIP copy, included by every kernel family that needs them (elementwise.hip,
// activation.hip, logprob.hip; the runtime inlines it, so it is part of each family's
// cache key). Reference: rlportable/contract/elementwise.py (exp_f32, log_f32), which
// rlp_exp_f32_full and rlp_log_f32 follow operation for operation: binary64 add, subtract,
// multiply and conversions only (round to nearest even), no fma, no contraction
// (-ffp-contract=off, and the pragma below), no math library (no OCML). Integer
// manipulation of bits builds powers of two, reads exponents and rounds to odd.
// rlp_exp_f32 first tries a shorter evaluation with explicit fused multiply-adds
// (rlp_fma_f64: the IEEE operation) and keeps its result only where its
// float32 rounding is certain (the same bits: both are correctly rounded; see its comment).
// Both vendors compile this one header (behind their preludes). Nothing here depends on
// the warp width.
// Include guard rather than #pragma once: the runtime inlines this file into the
// compiled text.
#ifndef RLP_CONTRACT_MATH_H
#define RLP_CONTRACT_MATH_H
// common.h: rlp_pow2_f64 and rlp_round_scaled, used by the logprob pieces below
#include "common.h"

// Build only with the contract's options (rlportable.runtime.flags), through raw NVRTC as
// the runtime does. Not through cupy.RawModule / RawKernel: CuPy appends -ftz=true after the
// caller's options, which flushes subnormal float32 <-> float64 conversions (seen on an H200:
// exp's subnormal results came out 0, and log of a subnormal input became -inf).
// Contraction off even where the compiler's default would fuse (clang's HIP default is
// -ffp-contract=fast-honor-pragmas); the build options say the same (-ffp-contract=off).
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#define RLP_EW_CANONICAL_NAN_BITS 0x7fc00000u

// ---- constants (the same hex literals as the reference module)
#define RLP_EW_SHIFT 0x1.8000000000000p+52          /* 1.5 * 2^52 */
#define RLP_EW_SHIFT_BITS 0x4338000000000000LL
#define RLP_EW_SPLIT 0x1.0000002000000p+27          /* 2^27 + 1 */
#define RLP_EXP_INV_LN2_64 0x1.71547652b82fep+6
#define RLP_EXP_C1 0x1.62e42fefa4000p-7
#define RLP_EXP_C2 (-0x1.8432a1b0e2634p-49)
#define RLP_EXP_OVERFLOW_X 89.0
#define RLP_EXP_UNDERFLOW_X (-104.0)
#define RLP_EXP_TINY_X 0x1.0000000000000p-30
#define RLP_EXP_P2 0x1.0000000000000p-1
#define RLP_EXP_P3 0x1.5555555555555p-3
#define RLP_EXP_P4 0x1.5555555555555p-5
#define RLP_EXP_P5 0x1.1111111111111p-7
#define RLP_EXP_P6 0x1.6c16c16c16c17p-10
#define RLP_EXP_P7 0x1.a01a01a01a01ap-13
#define RLP_LOG_SQRT2 0x1.6a09e667f3bcdp+0
#define RLP_LOG_LN2_HI 0x1.62e42fefa3a00p-1
#define RLP_LOG_LN2_LO (-0x1.0ca86c3898d00p-49)
#define RLP_LOG_Q2 (-0x1.0000000000000p-1)
#define RLP_LOG_Q3 0x1.5555555555555p-2
#define RLP_LOG_Q4 (-0x1.0000000000000p-2)
#define RLP_LOG_Q5 0x1.999999999999ap-3
#define RLP_LOG_Q6 (-0x1.5555555555555p-3)
#define RLP_LOG_Q7 0x1.2492492492492p-3
#define RLP_LOG_Q8 (-0x1.0000000000000p-3)
#define RLP_LOG_Q9 0x1.c71c71c71c71cp-4
#define RLP_LOG_INDEX_MIN (-37)

// exp: 2^(j/64) = rlp_exp_t_hi[j] + rlp_exp_t_lo[j]; log: rlp_log_c[i+37] ~ 1/(1+i/128),
// -ln(rlp_log_c) = rlp_log_h + rlp_log_l (elementwise._EXP_T_HI, ... in the reference).
__device__ const double rlp_exp_t_hi[64] = {
    0x1.0000000000000p+0, 0x1.02c9a3e778061p+0, 0x1.059b0d3158574p+0,
    0x1.0874518759bc8p+0, 0x1.0b5586cf9890fp+0, 0x1.0e3ec32d3d1a2p+0,
    0x1.11301d0125b51p+0, 0x1.1429aaea92de0p+0, 0x1.172b83c7d517bp+0,
    0x1.1a35beb6fcb75p+0, 0x1.1d4873168b9aap+0, 0x1.2063b88628cd6p+0,
    0x1.2387a6e756238p+0, 0x1.26b4565e27cddp+0, 0x1.29e9df51fdee1p+0,
    0x1.2d285a6e4030bp+0, 0x1.306fe0a31b715p+0, 0x1.33c08b26416ffp+0,
    0x1.371a7373aa9cbp+0, 0x1.3a7db34e59ff7p+0, 0x1.3dea64c123422p+0,
    0x1.4160a21f72e2ap+0, 0x1.44e086061892dp+0, 0x1.486a2b5c13cd0p+0,
    0x1.4bfdad5362a27p+0, 0x1.4f9b2769d2ca7p+0, 0x1.5342b569d4f82p+0,
    0x1.56f4736b527dap+0, 0x1.5ab07dd485429p+0, 0x1.5e76f15ad2148p+0,
    0x1.6247eb03a5585p+0, 0x1.6623882552225p+0, 0x1.6a09e667f3bcdp+0,
    0x1.6dfb23c651a2fp+0, 0x1.71f75e8ec5f74p+0, 0x1.75feb564267c9p+0,
    0x1.7a11473eb0187p+0, 0x1.7e2f336cf4e62p+0, 0x1.82589994cce13p+0,
    0x1.868d99b4492edp+0, 0x1.8ace5422aa0dbp+0, 0x1.8f1ae99157736p+0,
    0x1.93737b0cdc5e5p+0, 0x1.97d829fde4e50p+0, 0x1.9c49182a3f090p+0,
    0x1.a0c667b5de565p+0, 0x1.a5503b23e255dp+0, 0x1.a9e6b5579fdbfp+0,
    0x1.ae89f995ad3adp+0, 0x1.b33a2b84f15fbp+0, 0x1.b7f76f2fb5e47p+0,
    0x1.bcc1e904bc1d2p+0, 0x1.c199bdd85529cp+0, 0x1.c67f12e57d14bp+0,
    0x1.cb720dcef9069p+0, 0x1.d072d4a07897cp+0, 0x1.d5818dcfba487p+0,
    0x1.da9e603db3285p+0, 0x1.dfc97337b9b5fp+0, 0x1.e502ee78b3ff6p+0,
    0x1.ea4afa2a490dap+0, 0x1.efa1bee615a27p+0, 0x1.f50765b6e4540p+0,
    0x1.fa7c1819e90d8p+0,
};
__device__ const double rlp_exp_t_lo[64] = {
    0x0.0p+0, -0x1.19083535b085dp-56, 0x1.d73e2a475b465p-55,
    0x1.186be4bb284ffp-57, 0x1.8a62e4adc610bp-54, 0x1.03a1727c57b53p-59,
    -0x1.6c51039449b3ap-54, -0x1.32fbf9af1369ep-54, -0x1.19041b9d78a76p-55,
    0x1.e5b4c7b4968e4p-55, 0x1.e016e00a2643cp-54, 0x1.dc775814a8495p-55,
    0x1.9b07eb6c70573p-54, 0x1.2bd339940e9d9p-55, 0x1.612e8afad1255p-55,
    0x1.0024754db41d5p-54, 0x1.6f46ad23182e4p-55, 0x1.32721843659a6p-54,
    -0x1.63aeabf42eae2p-54, -0x1.5e436d661f5e3p-56, 0x1.ada0911f09ebcp-55,
    -0x1.ef3691c309278p-58, 0x1.89b7a04ef80d0p-59, 0x1.3c1a3b69062f0p-56,
    0x1.d4397afec42e2p-56, -0x1.4b309d25957e3p-54, -0x1.07abe1db13cadp-55,
    0x1.9bb2c011d93adp-54, 0x1.6324c054647adp-54, 0x1.ba6f93080e65ep-54,
    -0x1.383c17e40b497p-54, -0x1.bb60987591c34p-54, -0x1.bdd3413b26456p-54,
    -0x1.bbe3a683c88abp-57, -0x1.16e4786887a99p-55, -0x1.0245957316dd3p-54,
    -0x1.41577ee04992fp-55, 0x1.05d02ba15797ep-56, -0x1.d4c1dd41532d8p-54,
    -0x1.fc6f89bd4f6bap-54, 0x1.6e9f156864b27p-54, 0x1.5cc13a2e3976cp-55,
    -0x1.75fc781b57ebcp-57, -0x1.d185b7c1b85d1p-54, 0x1.c7c46b071f2bep-56,
    -0x1.359495d1cd533p-54, -0x1.d2f6edb8d41e1p-54, 0x1.0fac90ef7fd31p-54,
    0x1.7a1cd345dcc81p-54, -0x1.2805e3084d708p-57, -0x1.5584f7e54ac3bp-56,
    0x1.23dd07a2d9e84p-55, 0x1.11065895048ddp-55, 0x1.2884dff483cadp-54,
    0x1.503cbd1e949dbp-56, -0x1.cbc3743797a9cp-54, 0x1.2ed02d75b3707p-55,
    0x1.c2300696db532p-54, -0x1.1a5cd4f184b5cp-54, 0x1.39e8980a9cc8fp-55,
    -0x1.e9c23179c2893p-54, 0x1.dc7f486a4b6b0p-54, 0x1.9d3e12dd8a18bp-54,
    0x1.74853f3a5931ep-55,
};
__device__ const double rlp_log_c[91] = {
    0x1.6816800000000p+0, 0x1.642c800000000p+0, 0x1.6058200000000p+0, 0x1.5c98800000000p+0,
    0x1.58ed200000000p+0, 0x1.5555600000000p+0, 0x1.51d0800000000p+0, 0x1.4e5e000000000p+0,
    0x1.4afd600000000p+0, 0x1.47ae200000000p+0, 0x1.446f800000000p+0, 0x1.4141400000000p+0,
    0x1.3e22c00000000p+0, 0x1.3b13c00000000p+0, 0x1.3813800000000p+0, 0x1.3521c00000000p+0,
    0x1.323e400000000p+0, 0x1.2f68400000000p+0, 0x1.2c9fc00000000p+0, 0x1.29e4200000000p+0,
    0x1.2735000000000p+0, 0x1.2492400000000p+0, 0x1.21fb800000000p+0, 0x1.1f70400000000p+0,
    0x1.1cf0600000000p+0, 0x1.1a7ba00000000p+0, 0x1.1811800000000p+0, 0x1.15b1e00000000p+0,
    0x1.135c800000000p+0, 0x1.1111200000000p+0, 0x1.0ecf600000000p+0, 0x1.0c97200000000p+0,
    0x1.0a68200000000p+0, 0x1.0842200000000p+0, 0x1.0624e00000000p+0, 0x1.0410400000000p+0,
    0x1.0204000000000p+0, 0x1.0000000000000p+0, 0x1.fc08000000000p-1, 0x1.f81f800000000p-1,
    0x1.f446600000000p-1, 0x1.f07c200000000p-1, 0x1.ecc0800000000p-1, 0x1.e913200000000p-1,
    0x1.e573a00000000p-1, 0x1.e1e1e00000000p-1, 0x1.de5d600000000p-1, 0x1.dae6000000000p-1,
    0x1.d77b600000000p-1, 0x1.d41d400000000p-1, 0x1.d0cb600000000p-1, 0x1.cd85600000000p-1,
    0x1.ca4b400000000p-1, 0x1.c71c800000000p-1, 0x1.c3f9000000000p-1, 0x1.c0e0800000000p-1,
    0x1.bdd2c00000000p-1, 0x1.bacfa00000000p-1, 0x1.b7d6c00000000p-1, 0x1.b4e8200000000p-1,
    0x1.b203600000000p-1, 0x1.af28600000000p-1, 0x1.ac57000000000p-1, 0x1.a98f000000000p-1,
    0x1.a6d0200000000p-1, 0x1.a41a400000000p-1, 0x1.a16d400000000p-1, 0x1.9ec8e00000000p-1,
    0x1.9c2d200000000p-1, 0x1.9999a00000000p-1, 0x1.970e400000000p-1, 0x1.948b000000000p-1,
    0x1.920fc00000000p-1, 0x1.8f9c200000000p-1, 0x1.8d30200000000p-1, 0x1.8acba00000000p-1,
    0x1.886e600000000p-1, 0x1.8618600000000p-1, 0x1.83c9800000000p-1, 0x1.8181800000000p-1,
    0x1.7f40600000000p-1, 0x1.7d06000000000p-1, 0x1.7ad2200000000p-1, 0x1.78a4c00000000p-1,
    0x1.767dc00000000p-1, 0x1.745d200000000p-1, 0x1.7242800000000p-1, 0x1.702e000000000p-1,
    0x1.6e1f800000000p-1, 0x1.6c16c00000000p-1, 0x1.6a13c00000000p-1,
};
__device__ const double rlp_log_h[91] = {
    -0x1.5d5bd9f595f10p-2, -0x1.522ad0738a1d8p-2, -0x1.4718f9271bd89p-2,
    -0x1.3c251f7333104p-2, -0x1.314f151d35c42p-2, -0x1.269641134d392p-2,
    -0x1.1bf99a35a6b75p-2, -0x1.1178c8227dc7cp-2, -0x1.07136704d50e0p-2,
    -0x1.f9920ecb39f39p-3, -0x1.e530c7fe709d2p-3, -0x1.d103772655e3bp-3,
    -0x1.bd082783bc21dp-3, -0x1.a93f33c8ab5e3p-3, -0x1.95a5a5cf7013fp-3,
    -0x1.823bae5517982p-3, -0x1.6f0174b75542cp-3, -0x1.5bf3b6b5424b2p-3,
    -0x1.4914243339ed1p-3, -0x1.3660270156f06p-3, -0x1.23d6c2a49a902p-3,
    -0x1.1178a8227d47cp-3, -0x1.fe89839dbbce6p-4, -0x1.da72063842e22p-4,
    -0x1.b6abecdad2b94p-4, -0x1.933675d592109p-4, -0x1.700d20aeac061p-4,
    -0x1.4d30bdd206f8cp-4, -0x1.2aa03a4471725p-4, -0x1.085a6b59dd807p-4,
    -0x1.ccb854ddd663cp-5, -0x1.894bf149f4503p-5, -0x1.466cc542d0a5ap-5,
    -0x1.0417b89e66344p-5, -0x1.8493028c8bb9fp-6, -0x1.0205258935647p-6,
    -0x1.00fd57587de71p-7, 0x0.0p+0, 0x1.fdfaa6b126789p-8,
    0x1.fc0b0b0fc07e4p-7, 0x1.7b90e87d5c4a3p-6, 0x1.f82990e783380p-6,
    0x1.39e82b9fec3a0p-5, 0x1.774537632e48cp-5, 0x1.b42eab1199da3p-5,
    0x1.f0a32c01163a6p-5, 0x1.1653e8ea397f3p-4, 0x1.341db961bd9d1p-4,
    0x1.51b0a1f061c61p-4, 0x1.6f0d38ae56bccp-4, 0x1.8c341f631a2a3p-4,
    0x1.a9271fa4ae0abp-4, 0x1.c5e4bcf5bed8bp-4, 0x1.e26ff6e2b12e6p-4,
    0x1.fec8831dc133bp-4, 0x1.0d779fcd0a299p-3, 0x1.1b728b52f6c24p-3,
    0x1.2954eb8200733p-3, 0x1.371fd401e90b8p-3, 0x1.44d2a0ccb7f02p-3,
    0x1.526e713a1b5a1p-3, 0x1.5ff33f0a7a014p-3, 0x1.6d6106719d25dp-3,
    0x1.7ab860210e209p-3, 0x1.87f9eb520cbeap-3, 0x1.9525b1cf456f4p-3,
    0x1.a23bbffe2b567p-3, 0x1.af3cc2e80c837p-3, 0x1.bc283042d98a7p-3,
    0x1.c8ff5c79a9e22p-3, 0x1.d5c264b4fd355p-3, 0x1.e270c6e2b0be6p-3,
    0x1.ef0aa2bdc665ap-3, 0x1.fb9162d5e433bp-3, 0x1.040246cb4d2edp-2,
    0x1.0a32272739cc5p-2, 0x1.1058bd1ae4ae2p-2, 0x1.1675cebaba62ep-2,
    0x1.1c89761699dc3p-2, 0x1.229423bcf7986p-2, 0x1.2895a0bde86a4p-2,
    0x1.2e8e0bae12531p-2, 0x1.347ddb2987d59p-2, 0x1.3a64db56949b2p-2,
    0x1.40432f686b3c6p-2, 0x1.4618a421c6342p-2, 0x1.4be60f5777c69p-2,
    0x1.51aae872dfa2dp-2, 0x1.5767577455fb4p-2, 0x1.5d1bdff5809eap-2,
    0x1.62c8542b9d247p-2,
};
__device__ const double rlp_log_l[91] = {
    0x1.654169e2111f8p-56, 0x1.8fa945e3d1424p-57, -0x1.97a52bcbd6569p-60,
    0x1.2ad528fb57971p-56, 0x1.3d6d5c9e62a60p-56, -0x1.e19a588085ad7p-56,
    0x1.12ae0d979ef79p-57, 0x1.0fb8fb4d71be9p-57, -0x1.cd16457c0dddep-56,
    -0x1.f84b0662c78a7p-57, -0x1.2128aec50baebp-59, -0x1.6061e7979bef7p-57,
    -0x1.cb58b440627f0p-60, -0x1.c12fa9b61721cp-57, -0x1.142afb2a614e8p-58,
    0x1.17eb795331a50p-57, 0x1.8baa06dc7498fp-57, 0x1.4905f0a40a32ep-61,
    0x1.08deda083577bp-58, -0x1.852cef6c97929p-58, 0x1.70d2c0ce8481ep-57,
    0x1.110e50aac7142p-58, 0x1.aad5ecca04e3bp-58, -0x1.3e5651b87cac0p-58,
    0x1.09ff8f18641e2p-59, 0x1.43be8589edcabp-58, 0x1.72610cbd807b0p-61,
    -0x1.75c16d6e9bc76p-58, 0x1.d15e8e285094cp-58, 0x1.cf255f7b9141ep-58,
    0x1.dd953b288548ap-59, -0x1.c0dc96a81dea0p-60, 0x1.ac69841116b38p-59,
    -0x1.e384f04bd174bp-59, 0x1.d123e5b7d9bfcp-60, -0x1.27c392ec151cap-60,
    -0x1.1bbb8196d23bfp-62, 0x0.0p+0, -0x1.ce682ce31a038p-65,
    -0x1.82f3d703fed4cp-62, -0x1.5c02ed7767837p-60, 0x1.33e345a474878p-60,
    -0x1.5c243e29b1a65p-59, 0x1.189c5532d6361p-59, -0x1.e5888c4dc1676p-60,
    0x1.85f5d07068577p-59, -0x1.709ddbaca6cd7p-60, -0x1.b5449cd169766p-58,
    0x1.a4bde8f74265bp-58, -0x1.906c43c2f543dp-58, -0x1.4cd620018bdf8p-61,
    0x1.94be2e01c350fp-58, 0x1.4f6c94a902b1fp-60, -0x1.6c022a6c8ac26p-60,
    -0x1.5b12b97e7a378p-58, 0x1.9877c5f5d38a6p-57, 0x1.47c9c89dc86d9p-58,
    0x1.2e7e07238f390p-57, 0x1.de7be62b0b2b0p-58, 0x1.9f4187eea93bap-57,
    -0x1.74670a4f0b95cp-57, -0x1.ba979a5110a16p-58, -0x1.caad7be421ecep-57,
    0x1.bbf6b2e0c0605p-59, -0x1.bf997cf9c7fa2p-57, 0x1.d9056c7f8e0d0p-57,
    0x1.9371105cfef01p-59, -0x1.388f848751cc9p-58, 0x1.4e1d2fa680548p-58,
    -0x1.4f934a2e5eabcp-57, 0x1.70ae1da98b451p-57, -0x1.56ecd50915690p-59,
    0x1.47656c00ec33dp-57, -0x1.cae7a64e54a4bp-57, 0x1.6b68f5189fa7bp-56,
    0x1.7c9aea8934f83p-56, -0x1.9d819228227f2p-56, 0x1.ce6e9563361c2p-61,
    -0x1.11d3b7f6fad9ep-60, -0x1.76f595b40cf5ap-56, -0x1.0a5b682d74d38p-57,
    -0x1.8ff7863c968a5p-56, 0x1.5915a1bfb7318p-56, -0x1.c61766e7eb650p-57,
    -0x1.0a9ac1ff59ae5p-56, 0x1.f3e5ece010f1cp-56, -0x1.252c4b03d3e12p-57,
    0x1.39d256c6a008ep-59, 0x1.520f507f49fa1p-56, 0x1.42368d931d936p-56,
    0x1.7d8a9bce2731ep-57,
};

// ---- double-double helpers (elementwise._split, _two_product, _round_to_odd)
__device__ __forceinline__ void rlp_ew_split(double a, double* hi, double* lo) {
    double c = RLP_EW_SPLIT * a;
    *hi = c - (c - a);
    *lo = a - *hi;
}

__device__ __forceinline__ double rlp_ew_two_product_err(double a, double b, double p) {
    double ah, al, bh, bl;
    rlp_ew_split(a, &ah, &al);
    rlp_ew_split(b, &bh, &bl);
    return (((ah * bh - p) + ah * bl) + al * bh) + al * bl;
}

// The float64 round-to-odd of the exact sum v + ve, given v = RN(v + ve).
__device__ __forceinline__ double rlp_ew_round_to_odd(double v, double ve) {
    long long bits = __double_as_longlong(v);
    if (ve != 0.0 && (bits & 1LL) == 0LL) bits += ((ve > 0.0) == (v > 0.0)) ? 1LL : -1LL;
    return __longlong_as_double(bits);
}

// ---- exp_f32 (elementwise.exp_f32 / _exp_core)
__device__ __forceinline__ float rlp_exp_f32_full(float xf) {
    double x = (double)xf;
    if (x != x) return __uint_as_float(RLP_EW_CANONICAL_NAN_BITS);
    if (x > RLP_EXP_OVERFLOW_X) return __uint_as_float(0x7f800000u);
    if (x < RLP_EXP_UNDERFLOW_X) return 0.0f;
    if (x > -RLP_EXP_TINY_X && x < RLP_EXP_TINY_X) x = 0.0;
    double t = x * RLP_EXP_INV_LN2_64 + RLP_EW_SHIFT;
    long long n = __double_as_longlong(t) - RLP_EW_SHIFT_BITS;
    double fn = t - RLP_EW_SHIFT;
    double a = x - fn * RLP_EXP_C1;
    double b = fn * RLP_EXP_C2;
    double rh = a - b;
    double bv = rh - a;
    double av = rh - bv;
    double rl = (a - av) - (b + bv);
    double poly = RLP_EXP_P6 + rh * RLP_EXP_P7;
    poly = RLP_EXP_P5 + rh * poly;
    poly = RLP_EXP_P4 + rh * poly;
    poly = RLP_EXP_P3 + rh * poly;
    poly = RLP_EXP_P2 + rh * poly;
    double p = (rh * rh) * poly;
    double q = rl + (p + rl * rh);
    int j = (int)(n & 63LL);
    double th = rlp_exp_t_hi[j];
    double tl = rlp_exp_t_lo[j];
    double prod = th * rh;
    double prod_err = rlp_ew_two_product_err(th, rh, prod);
    double w = (1.0 + rh) + q;
    double small = prod_err + (th * q + tl * w);
    double s = th + prod;
    double se = prod - (s - th);
    double lo = se + small;
    double v = s + lo;
    double ve = lo - (v - s);
    double odd = rlp_ew_round_to_odd(v, ve);
    double scale = __longlong_as_double(((n >> 6) + 1023LL) << 52);
    return __double2float_rn(odd * scale);
}

// ---- exp_f32, fast path (the same bits: the contract's exp is correctly rounded, so any evaluation whose
// float32 rounding is certain gives them; `rlportable conform --exhaustive` grades all 2^32 inputs).
// For |x| <= 87 (normal float32 results): n = RN(x 64/ln2), r = x - n ln2/64 (|r| <= 0.0055) through two
// fused multiply-adds with ln2/64 in two parts, e^r - 1 by its degree-6 Taylor polynomial (truncation
// below 2^-64), y = 2^(j/64) (1 + p) from the table's two parts, j = n mod 64: y in [0.99, 2), within 3
// float64 ulps of T e^r (the roundings: 2^-52 at the last add, below 2^-58 elsewhere). Unless y lies within
// RLP_EXP_FAST_WINDOW float64 ulps of a float32 rounding boundary (the low 29 bits of its significand
// near 2^28: about 2.4e-7 of inputs), RNE_f32(y 2^(n >> 6)) is the correctly rounded e^x; otherwise, and
// outside the range, the full evaluation above decides. The fused multiply-add is one IEEE 754 operation
// on both vendors (rlp_fma_f64, common header), so the fast path is also the same on both.
#define RLP_EXP_FAST_X_BITS 0x42AE0000u  /* 87.0f */
#define RLP_EXP_LN2_64_HI 0x1.62e42fefa39efp-7
#define RLP_EXP_LN2_64_LO 0x1.abc9e3b39803fp-62
#define RLP_EXP_FAST_WINDOW 64
__device__ __forceinline__ float rlp_exp_f32(float xf) {
    if (rlp_magnitude_bits(xf) > RLP_EXP_FAST_X_BITS) return rlp_exp_f32_full(xf);  // also NaN and inf
    const double x = (double)xf;
    const double t = rlp_fma_f64(x, RLP_EXP_INV_LN2_64, RLP_EW_SHIFT);
    const long long n = __double_as_longlong(t) - RLP_EW_SHIFT_BITS;
    const double fn = t - RLP_EW_SHIFT;
    const double r = rlp_fma_f64(-fn, RLP_EXP_LN2_64_LO, rlp_fma_f64(-fn, RLP_EXP_LN2_64_HI, x));
    double c = rlp_fma_f64(r, RLP_EXP_P6, RLP_EXP_P5);
    c = rlp_fma_f64(r, c, RLP_EXP_P4);
    c = rlp_fma_f64(r, c, RLP_EXP_P3);
    c = rlp_fma_f64(r, c, RLP_EXP_P2);
    const double p = rlp_fma_f64(r * r, c, r);
    const int j = (int)(n & 63LL);
    const double y = rlp_exp_t_hi[j] + rlp_fma_f64(rlp_exp_t_hi[j], p, rlp_exp_t_lo[j]);
    const long long low = __double_as_longlong(y) & ((1LL << 29) - 1);
    if (low - (1LL << 28) <= RLP_EXP_FAST_WINDOW && (1LL << 28) - low <= RLP_EXP_FAST_WINDOW)
        return rlp_exp_f32_full(xf);
    return __double2float_rn(y * rlp_pow2_f64((int)(n >> 6)));
}

// ---- log_f32 (elementwise.log_f32 / _log_core)
__device__ __forceinline__ float rlp_log_f32(float xf) {
    double x = (double)xf;
    if (x != x || x < 0.0) return __uint_as_float(RLP_EW_CANONICAL_NAN_BITS);
    if (x == 0.0) return __uint_as_float(0xff800000u);
    if (x > 0x1.fffffffffffffp+1023) return __uint_as_float(0x7f800000u);
    long long xb = __double_as_longlong(x);
    long long e = (xb >> 52) - 1023LL;
    double m = __longlong_as_double((xb & 0x000fffffffffffffLL) | 0x3ff0000000000000LL);
    if (m >= RLP_LOG_SQRT2) {
        m = m * 0.5;
        e = e + 1LL;
    }
    double t = (m - 1.0) * 128.0 + RLP_EW_SHIFT;
    int idx = (int)(__double_as_longlong(t) - RLP_EW_SHIFT_BITS) - RLP_LOG_INDEX_MIN;
    double c = rlp_log_c[idx];
    double h = rlp_log_h[idx];
    double low_table = rlp_log_l[idx];
    double z = m * c - 1.0;
    double poly = RLP_LOG_Q8 + z * RLP_LOG_Q9;
    poly = RLP_LOG_Q7 + z * poly;
    poly = RLP_LOG_Q6 + z * poly;
    poly = RLP_LOG_Q5 + z * poly;
    poly = RLP_LOG_Q4 + z * poly;
    poly = RLP_LOG_Q3 + z * poly;
    poly = RLP_LOG_Q2 + z * poly;
    double tail = (z * z) * poly;
    double fe = (double)e;
    double a1 = fe * RLP_LOG_LN2_HI;
    double s = a1 + h;
    double bv = s - a1;
    double av = s - bv;
    double se = (a1 - av) + (h - bv);
    double s2 = s + z;
    double bv2 = s2 - s;
    double av2 = s2 - bv2;
    double se2 = (s - av2) + (z - bv2);
    double low = ((se + se2) + (fe * RLP_LOG_LN2_LO + low_table)) + tail;
    double v = s2 + low;
    double ve = low - (v - s2);
    return __double2float_rn(rlp_ew_round_to_odd(v, ve));
}

// ---- The logprob contract's pieces (contracts/logprob.toml) that the sampling family's fused
// log-prob of the drawn token uses too (one formula for both families).
#define RLP_LOGPROB_SUM_BITS 38

// An order-preserving integer key of a non-NaN float32 (a < b <=> key(a) < key(b); -0 < +0),
// so the row's maximum is an integer max: exact and order-free.
__device__ __forceinline__ unsigned int rlp_logprob_key(float a) {
    unsigned int bits = (unsigned int)__float_as_int(a);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

__device__ __forceinline__ float rlp_logprob_from_key(unsigned int key) {
    unsigned int bits = (key & 0x80000000u) ? (key & 0x7fffffffu) : ~key;
    return __int_as_float((int)bits);
}

// S's term RNE(p_v * 2^36), p_v = exp_f32(a_v - m) in [0, 1]: exact in int64 and order-free to sum.
__device__ __forceinline__ long long rlp_logprob_sum_term(float p) {
    return rlp_double2ll_rn((double)p * rlp_pow2_f64(RLP_LOGPROB_SUM_BITS - 2));
}

// ls = log_f32(RNE_f32(S * 2^-36)): one rounding, contract log.
__device__ __forceinline__ float rlp_logprob_log_sum(long long s) {
    return rlp_log_f32(rlp_round_scaled(s, -(RLP_LOGPROB_SUM_BITS - 2)));
}

// logp = d_y - ls, d_y = RNE_f32(a_y - m): one float32 subtraction.
__device__ __forceinline__ float rlp_logprob_value(float d_target, float ls) {
    return d_target - ls;
}

#endif  // RLP_CONTRACT_MATH_H
