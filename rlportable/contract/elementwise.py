"""The contract's float32 exp and log ("elementwise" family): the NumPy reference.

This module is the executable form of contracts/elementwise.toml; the kernel
source backends/portable/elementwise.hip (one for both vendors) must equal it to
the bit, and does so by performing the same sequence of IEEE-754 operations.

What is computed, to the bit
----------------------------
For every float32 input x, ``exp_f32(x)`` is RNE_f32(e^x) and ``log_f32(x)`` is
RNE_f32(ln x): the exact real value rounded ONCE to the nearest float32, ties to
even (ties never occur for finite x other than exp(0) = 1 and log(1) = 0, whose
results are exact). Subnormal results are rounded correctly (no flush to zero),
results above the float32 range round to +inf, and the special inputs are fixed:

  exp: NaN (any payload, either sign) -> canonical quiet NaN 0x7FC00000;
       +inf -> +inf; -inf -> +0; +-0 -> 1; x > 89 -> +inf (overflow);
       x < -104 -> +0 (underflow: e^x < 2^-150, which rounds to +0);
       |x| < 2^-30 -> 1 (computed as e^0; the exact value rounds to 1 anyway).
  log: NaN -> 0x7FC00000; x < 0, -inf included -> 0x7FC00000; +-0 -> -inf;
       +inf -> +inf; 1 -> +0; subnormal x handled exactly.

Why these bits
--------------
Correct rounding is the only definition of exp and log that does not depend on
an implementation; vendor libms (expf, __expf, OCML) differ between CUDA and
HIP. The functions below are a fixed sequence of binary64 add, subtract,
multiply and conversions, round-to-nearest-even, with no fma, no contraction
and no math library, plus integer manipulation of the bits. Every input is
exactly representable in binary64, the value is computed as an unevaluated
double-double V + Ve with a relative error below about 2^-66, V + Ve is rounded
to odd at 53 bits (V keeps its bits if Ve = 0 or its last bit is odd, otherwise
it moves one ulp toward Ve), the exact power-of-two scale is applied, and one
RNE conversion to float32 follows. Round-to-odd at 53 bits followed by RNE at
<= 24 bits equals one correct rounding of V + Ve (53 >= 24 + 2), subnormal
float32 results included. The remaining risk, an exact value within 2^-66 of a
float32 rounding boundary, was excluded by exhaustive checks of all 2^32
inputs of each function, on a GPU (elementwise_exhaustive_check, CUDA and
HIP-on-CUDA sources) and with this module on a CPU (``python -m
rlportable.contract.elementwise --exhaustive-cpu exp|log``): 0 inputs not
correctly rounded. The inputs closest to a boundary lie 2^-52.6 (exp) and
2^-57.8 (log) from it, relative, far outside the computation's error. (The
2^-66 is a rounding-error count, not a formal proof; the exhaustive checks are
the proof.)

exp: x = N ln2/64 + r, N = RNE(x * 64/ln2) (by the 1.5 * 2^52 shift), so
|r| <= ln2/128 (about 2^-7.5). ln2/64 = C1 + C2 with C1 of 39 bits, so
N * C1 is exact (|N| < 2^14) and x - N*C1 is exact; r = rh + rl exactly by a
TwoSum. e^x = 2^(N>>6) * T[N&63] * e^r with T[j] = 2^(j/64) as a double-double
(T_HI + T_LO), e^r = 1 + r + p(r), p(r) = r^2/2 + ... + r^7/7! (Taylor
coefficients rounded to binary64; truncation < 2^-75). T_HI * rh is exact by
Dekker's TwoProduct (Veltkamp split, no fma).

log: x = 2^e * m exactly with m in [sqrt(2)/2, sqrt(2)) (from the binary64
bits, so subnormal x need no special path). i = RNE((m - 1) * 128) in
[-37, 53]; C[i] ~ 1/(1 + i/128) has at most 20 significant bits (C[0] = 1), so
z = m*C[i] - 1 is exact and |z| < 2^-7.4. ln x = e*ln2 - ln C[i] + ln(1 + z),
ln2 = LN2_HI (44 bits, so e*LN2_HI is exact) + LN2_LO, -ln C[i] = H[i] + L[i]
(double-double), ln(1+z) = z + q(z), q(z) = -z^2/2 + z^3/3 - ... + z^9/9
(truncation < 2^-78). Near x = 1, i = e = 0 and the result is z + q(z) with z
exact, so the relative error stays small there too.

NumPy's fast path (exp_f32 without full=True): e^x in plain binary64 (the same
reduction, table and polynomial, no double-double) is within a few ulps, so its
RNE conversion to float32 is the correctly rounded one wherever the binary64
value lies more than NUMPY_FAST_EXP_WINDOW = 2^10 ulps from a float32 rounding
midpoint, for x in [-87, 88.5] (normal float32 results). Elsewhere, about 4e-6
of the inputs in that range and all outside it, the full evaluation decides.
The same bits for all 2^32 inputs (compared once; tests compare samples).

All constants are exact binary64 values written as hex floats; the CUDA and
HIP sources spell the same hex literals (tests/test_elementwise.py checks
that, and recomputes the tables with mpmath).
"""

from __future__ import annotations

import numpy as np

CANONICAL_NAN_BITS = np.uint32(0x7FC00000)  # the contract's one NaN (same as fixedpoint.CANONICAL_NAN_BITS)
_BLOCK = 1 << 16  # elements per internal block (keeps temporaries in cache; does not affect results)


def _hex_array(*values: str) -> np.ndarray:
    return np.array([float.fromhex(v) for v in values], dtype=np.float64)


def _h(value: str) -> float:
    return float.fromhex(value)


# ---- shared constants (the same hex literals in backends/portable/contract_math.h)
SHIFT = _h("0x1.8000000000000p+52")        # 1.5 * 2^52: t + SHIFT - SHIFT = RNE(t) for |t| < 2^51
SPLIT = _h("0x1.0000002000000p+27")        # 2^27 + 1, Veltkamp's splitter
EXP_INV_LN2_64 = _h("0x1.71547652b82fep+6")  # RN(64 / ln 2)
EXP_C1 = _h("0x1.62e42fefa4000p-7")        # ln2/64 rounded to 39 bits
EXP_C2 = _h("-0x1.8432a1b0e2634p-49")      # RN(ln2/64 - C1)
EXP_OVERFLOW_X = 89.0                      # x > 89: e^x > 2^128 -> +inf
EXP_UNDERFLOW_X = -104.0                   # x < -104: e^x < 2^-150 -> +0
EXP_TINY_X = _h("0x1.0000000000000p-30")    # |x| < 2^-30: e^x rounds to 1 (computed as e^0; keeps
                                           # float64 subnormals out of the polynomial)
EXP_P2 = _h("0x1.0000000000000p-1")        # 1/2!
EXP_P3 = _h("0x1.5555555555555p-3")        # RN(1/3!)
EXP_P4 = _h("0x1.5555555555555p-5")        # RN(1/4!)
EXP_P5 = _h("0x1.1111111111111p-7")        # RN(1/5!)
EXP_P6 = _h("0x1.6c16c16c16c17p-10")       # RN(1/6!)
EXP_P7 = _h("0x1.a01a01a01a01ap-13")       # RN(1/7!)
LOG_SQRT2 = _h("0x1.6a09e667f3bcdp+0")     # RN(sqrt 2): m >= this -> m/2, e+1
LOG_LN2_HI = _h("0x1.62e42fefa3a00p-1")    # ln 2 rounded to 44 bits
LOG_LN2_LO = _h("-0x1.0ca86c3898d00p-49")  # RN(ln 2 - LN2_HI)
LOG_Q2 = _h("-0x1.0000000000000p-1")       # -1/2
LOG_Q3 = _h("0x1.5555555555555p-2")        # RN(1/3)
LOG_Q4 = _h("-0x1.0000000000000p-2")       # -1/4
LOG_Q5 = _h("0x1.999999999999ap-3")        # RN(1/5)
LOG_Q6 = _h("-0x1.5555555555555p-3")       # RN(-1/6)
LOG_Q7 = _h("0x1.2492492492492p-3")        # RN(1/7)
LOG_Q8 = _h("-0x1.0000000000000p-3")       # -1/8
LOG_Q9 = _h("0x1.c71c71c71c71cp-4")        # RN(1/9)
LOG_INDEX_MIN = -37                        # i = RNE((m - 1) * 128) lies in [-37, 53]

# exp: T[j] = 2^(j/64) = _EXP_T_HI[j] + _EXP_T_LO[j] (RN of the value, RN of the remainder)
# log: _LOG_C[i+37] ~ 1/(1+i/128) (20 bits, _LOG_C[37] = 1); -ln(_LOG_C) = _LOG_H + _LOG_L
_EXP_T_HI = _hex_array(
    "0x1.0000000000000p+0", "0x1.02c9a3e778061p+0", "0x1.059b0d3158574p+0",
    "0x1.0874518759bc8p+0", "0x1.0b5586cf9890fp+0", "0x1.0e3ec32d3d1a2p+0",
    "0x1.11301d0125b51p+0", "0x1.1429aaea92de0p+0", "0x1.172b83c7d517bp+0",
    "0x1.1a35beb6fcb75p+0", "0x1.1d4873168b9aap+0", "0x1.2063b88628cd6p+0",
    "0x1.2387a6e756238p+0", "0x1.26b4565e27cddp+0", "0x1.29e9df51fdee1p+0",
    "0x1.2d285a6e4030bp+0", "0x1.306fe0a31b715p+0", "0x1.33c08b26416ffp+0",
    "0x1.371a7373aa9cbp+0", "0x1.3a7db34e59ff7p+0", "0x1.3dea64c123422p+0",
    "0x1.4160a21f72e2ap+0", "0x1.44e086061892dp+0", "0x1.486a2b5c13cd0p+0",
    "0x1.4bfdad5362a27p+0", "0x1.4f9b2769d2ca7p+0", "0x1.5342b569d4f82p+0",
    "0x1.56f4736b527dap+0", "0x1.5ab07dd485429p+0", "0x1.5e76f15ad2148p+0",
    "0x1.6247eb03a5585p+0", "0x1.6623882552225p+0", "0x1.6a09e667f3bcdp+0",
    "0x1.6dfb23c651a2fp+0", "0x1.71f75e8ec5f74p+0", "0x1.75feb564267c9p+0",
    "0x1.7a11473eb0187p+0", "0x1.7e2f336cf4e62p+0", "0x1.82589994cce13p+0",
    "0x1.868d99b4492edp+0", "0x1.8ace5422aa0dbp+0", "0x1.8f1ae99157736p+0",
    "0x1.93737b0cdc5e5p+0", "0x1.97d829fde4e50p+0", "0x1.9c49182a3f090p+0",
    "0x1.a0c667b5de565p+0", "0x1.a5503b23e255dp+0", "0x1.a9e6b5579fdbfp+0",
    "0x1.ae89f995ad3adp+0", "0x1.b33a2b84f15fbp+0", "0x1.b7f76f2fb5e47p+0",
    "0x1.bcc1e904bc1d2p+0", "0x1.c199bdd85529cp+0", "0x1.c67f12e57d14bp+0",
    "0x1.cb720dcef9069p+0", "0x1.d072d4a07897cp+0", "0x1.d5818dcfba487p+0",
    "0x1.da9e603db3285p+0", "0x1.dfc97337b9b5fp+0", "0x1.e502ee78b3ff6p+0",
    "0x1.ea4afa2a490dap+0", "0x1.efa1bee615a27p+0", "0x1.f50765b6e4540p+0",
    "0x1.fa7c1819e90d8p+0",
)
_EXP_T_LO = _hex_array(
    "0x0.0p+0", "-0x1.19083535b085dp-56", "0x1.d73e2a475b465p-55",
    "0x1.186be4bb284ffp-57", "0x1.8a62e4adc610bp-54", "0x1.03a1727c57b53p-59",
    "-0x1.6c51039449b3ap-54", "-0x1.32fbf9af1369ep-54", "-0x1.19041b9d78a76p-55",
    "0x1.e5b4c7b4968e4p-55", "0x1.e016e00a2643cp-54", "0x1.dc775814a8495p-55",
    "0x1.9b07eb6c70573p-54", "0x1.2bd339940e9d9p-55", "0x1.612e8afad1255p-55",
    "0x1.0024754db41d5p-54", "0x1.6f46ad23182e4p-55", "0x1.32721843659a6p-54",
    "-0x1.63aeabf42eae2p-54", "-0x1.5e436d661f5e3p-56", "0x1.ada0911f09ebcp-55",
    "-0x1.ef3691c309278p-58", "0x1.89b7a04ef80d0p-59", "0x1.3c1a3b69062f0p-56",
    "0x1.d4397afec42e2p-56", "-0x1.4b309d25957e3p-54", "-0x1.07abe1db13cadp-55",
    "0x1.9bb2c011d93adp-54", "0x1.6324c054647adp-54", "0x1.ba6f93080e65ep-54",
    "-0x1.383c17e40b497p-54", "-0x1.bb60987591c34p-54", "-0x1.bdd3413b26456p-54",
    "-0x1.bbe3a683c88abp-57", "-0x1.16e4786887a99p-55", "-0x1.0245957316dd3p-54",
    "-0x1.41577ee04992fp-55", "0x1.05d02ba15797ep-56", "-0x1.d4c1dd41532d8p-54",
    "-0x1.fc6f89bd4f6bap-54", "0x1.6e9f156864b27p-54", "0x1.5cc13a2e3976cp-55",
    "-0x1.75fc781b57ebcp-57", "-0x1.d185b7c1b85d1p-54", "0x1.c7c46b071f2bep-56",
    "-0x1.359495d1cd533p-54", "-0x1.d2f6edb8d41e1p-54", "0x1.0fac90ef7fd31p-54",
    "0x1.7a1cd345dcc81p-54", "-0x1.2805e3084d708p-57", "-0x1.5584f7e54ac3bp-56",
    "0x1.23dd07a2d9e84p-55", "0x1.11065895048ddp-55", "0x1.2884dff483cadp-54",
    "0x1.503cbd1e949dbp-56", "-0x1.cbc3743797a9cp-54", "0x1.2ed02d75b3707p-55",
    "0x1.c2300696db532p-54", "-0x1.1a5cd4f184b5cp-54", "0x1.39e8980a9cc8fp-55",
    "-0x1.e9c23179c2893p-54", "0x1.dc7f486a4b6b0p-54", "0x1.9d3e12dd8a18bp-54",
    "0x1.74853f3a5931ep-55",
)
_LOG_C = _hex_array(
    "0x1.6816800000000p+0", "0x1.642c800000000p+0", "0x1.6058200000000p+0", "0x1.5c98800000000p+0",
    "0x1.58ed200000000p+0", "0x1.5555600000000p+0", "0x1.51d0800000000p+0", "0x1.4e5e000000000p+0",
    "0x1.4afd600000000p+0", "0x1.47ae200000000p+0", "0x1.446f800000000p+0", "0x1.4141400000000p+0",
    "0x1.3e22c00000000p+0", "0x1.3b13c00000000p+0", "0x1.3813800000000p+0", "0x1.3521c00000000p+0",
    "0x1.323e400000000p+0", "0x1.2f68400000000p+0", "0x1.2c9fc00000000p+0", "0x1.29e4200000000p+0",
    "0x1.2735000000000p+0", "0x1.2492400000000p+0", "0x1.21fb800000000p+0", "0x1.1f70400000000p+0",
    "0x1.1cf0600000000p+0", "0x1.1a7ba00000000p+0", "0x1.1811800000000p+0", "0x1.15b1e00000000p+0",
    "0x1.135c800000000p+0", "0x1.1111200000000p+0", "0x1.0ecf600000000p+0", "0x1.0c97200000000p+0",
    "0x1.0a68200000000p+0", "0x1.0842200000000p+0", "0x1.0624e00000000p+0", "0x1.0410400000000p+0",
    "0x1.0204000000000p+0", "0x1.0000000000000p+0", "0x1.fc08000000000p-1", "0x1.f81f800000000p-1",
    "0x1.f446600000000p-1", "0x1.f07c200000000p-1", "0x1.ecc0800000000p-1", "0x1.e913200000000p-1",
    "0x1.e573a00000000p-1", "0x1.e1e1e00000000p-1", "0x1.de5d600000000p-1", "0x1.dae6000000000p-1",
    "0x1.d77b600000000p-1", "0x1.d41d400000000p-1", "0x1.d0cb600000000p-1", "0x1.cd85600000000p-1",
    "0x1.ca4b400000000p-1", "0x1.c71c800000000p-1", "0x1.c3f9000000000p-1", "0x1.c0e0800000000p-1",
    "0x1.bdd2c00000000p-1", "0x1.bacfa00000000p-1", "0x1.b7d6c00000000p-1", "0x1.b4e8200000000p-1",
    "0x1.b203600000000p-1", "0x1.af28600000000p-1", "0x1.ac57000000000p-1", "0x1.a98f000000000p-1",
    "0x1.a6d0200000000p-1", "0x1.a41a400000000p-1", "0x1.a16d400000000p-1", "0x1.9ec8e00000000p-1",
    "0x1.9c2d200000000p-1", "0x1.9999a00000000p-1", "0x1.970e400000000p-1", "0x1.948b000000000p-1",
    "0x1.920fc00000000p-1", "0x1.8f9c200000000p-1", "0x1.8d30200000000p-1", "0x1.8acba00000000p-1",
    "0x1.886e600000000p-1", "0x1.8618600000000p-1", "0x1.83c9800000000p-1", "0x1.8181800000000p-1",
    "0x1.7f40600000000p-1", "0x1.7d06000000000p-1", "0x1.7ad2200000000p-1", "0x1.78a4c00000000p-1",
    "0x1.767dc00000000p-1", "0x1.745d200000000p-1", "0x1.7242800000000p-1", "0x1.702e000000000p-1",
    "0x1.6e1f800000000p-1", "0x1.6c16c00000000p-1", "0x1.6a13c00000000p-1",
)
_LOG_H = _hex_array(
    "-0x1.5d5bd9f595f10p-2", "-0x1.522ad0738a1d8p-2", "-0x1.4718f9271bd89p-2",
    "-0x1.3c251f7333104p-2", "-0x1.314f151d35c42p-2", "-0x1.269641134d392p-2",
    "-0x1.1bf99a35a6b75p-2", "-0x1.1178c8227dc7cp-2", "-0x1.07136704d50e0p-2",
    "-0x1.f9920ecb39f39p-3", "-0x1.e530c7fe709d2p-3", "-0x1.d103772655e3bp-3",
    "-0x1.bd082783bc21dp-3", "-0x1.a93f33c8ab5e3p-3", "-0x1.95a5a5cf7013fp-3",
    "-0x1.823bae5517982p-3", "-0x1.6f0174b75542cp-3", "-0x1.5bf3b6b5424b2p-3",
    "-0x1.4914243339ed1p-3", "-0x1.3660270156f06p-3", "-0x1.23d6c2a49a902p-3",
    "-0x1.1178a8227d47cp-3", "-0x1.fe89839dbbce6p-4", "-0x1.da72063842e22p-4",
    "-0x1.b6abecdad2b94p-4", "-0x1.933675d592109p-4", "-0x1.700d20aeac061p-4",
    "-0x1.4d30bdd206f8cp-4", "-0x1.2aa03a4471725p-4", "-0x1.085a6b59dd807p-4",
    "-0x1.ccb854ddd663cp-5", "-0x1.894bf149f4503p-5", "-0x1.466cc542d0a5ap-5",
    "-0x1.0417b89e66344p-5", "-0x1.8493028c8bb9fp-6", "-0x1.0205258935647p-6",
    "-0x1.00fd57587de71p-7", "0x0.0p+0", "0x1.fdfaa6b126789p-8",
    "0x1.fc0b0b0fc07e4p-7", "0x1.7b90e87d5c4a3p-6", "0x1.f82990e783380p-6",
    "0x1.39e82b9fec3a0p-5", "0x1.774537632e48cp-5", "0x1.b42eab1199da3p-5",
    "0x1.f0a32c01163a6p-5", "0x1.1653e8ea397f3p-4", "0x1.341db961bd9d1p-4",
    "0x1.51b0a1f061c61p-4", "0x1.6f0d38ae56bccp-4", "0x1.8c341f631a2a3p-4",
    "0x1.a9271fa4ae0abp-4", "0x1.c5e4bcf5bed8bp-4", "0x1.e26ff6e2b12e6p-4",
    "0x1.fec8831dc133bp-4", "0x1.0d779fcd0a299p-3", "0x1.1b728b52f6c24p-3",
    "0x1.2954eb8200733p-3", "0x1.371fd401e90b8p-3", "0x1.44d2a0ccb7f02p-3",
    "0x1.526e713a1b5a1p-3", "0x1.5ff33f0a7a014p-3", "0x1.6d6106719d25dp-3",
    "0x1.7ab860210e209p-3", "0x1.87f9eb520cbeap-3", "0x1.9525b1cf456f4p-3",
    "0x1.a23bbffe2b567p-3", "0x1.af3cc2e80c837p-3", "0x1.bc283042d98a7p-3",
    "0x1.c8ff5c79a9e22p-3", "0x1.d5c264b4fd355p-3", "0x1.e270c6e2b0be6p-3",
    "0x1.ef0aa2bdc665ap-3", "0x1.fb9162d5e433bp-3", "0x1.040246cb4d2edp-2",
    "0x1.0a32272739cc5p-2", "0x1.1058bd1ae4ae2p-2", "0x1.1675cebaba62ep-2",
    "0x1.1c89761699dc3p-2", "0x1.229423bcf7986p-2", "0x1.2895a0bde86a4p-2",
    "0x1.2e8e0bae12531p-2", "0x1.347ddb2987d59p-2", "0x1.3a64db56949b2p-2",
    "0x1.40432f686b3c6p-2", "0x1.4618a421c6342p-2", "0x1.4be60f5777c69p-2",
    "0x1.51aae872dfa2dp-2", "0x1.5767577455fb4p-2", "0x1.5d1bdff5809eap-2",
    "0x1.62c8542b9d247p-2",
)
_LOG_L = _hex_array(
    "0x1.654169e2111f8p-56", "0x1.8fa945e3d1424p-57", "-0x1.97a52bcbd6569p-60",
    "0x1.2ad528fb57971p-56", "0x1.3d6d5c9e62a60p-56", "-0x1.e19a588085ad7p-56",
    "0x1.12ae0d979ef79p-57", "0x1.0fb8fb4d71be9p-57", "-0x1.cd16457c0dddep-56",
    "-0x1.f84b0662c78a7p-57", "-0x1.2128aec50baebp-59", "-0x1.6061e7979bef7p-57",
    "-0x1.cb58b440627f0p-60", "-0x1.c12fa9b61721cp-57", "-0x1.142afb2a614e8p-58",
    "0x1.17eb795331a50p-57", "0x1.8baa06dc7498fp-57", "0x1.4905f0a40a32ep-61",
    "0x1.08deda083577bp-58", "-0x1.852cef6c97929p-58", "0x1.70d2c0ce8481ep-57",
    "0x1.110e50aac7142p-58", "0x1.aad5ecca04e3bp-58", "-0x1.3e5651b87cac0p-58",
    "0x1.09ff8f18641e2p-59", "0x1.43be8589edcabp-58", "0x1.72610cbd807b0p-61",
    "-0x1.75c16d6e9bc76p-58", "0x1.d15e8e285094cp-58", "0x1.cf255f7b9141ep-58",
    "0x1.dd953b288548ap-59", "-0x1.c0dc96a81dea0p-60", "0x1.ac69841116b38p-59",
    "-0x1.e384f04bd174bp-59", "0x1.d123e5b7d9bfcp-60", "-0x1.27c392ec151cap-60",
    "-0x1.1bbb8196d23bfp-62", "0x0.0p+0", "-0x1.ce682ce31a038p-65",
    "-0x1.82f3d703fed4cp-62", "-0x1.5c02ed7767837p-60", "0x1.33e345a474878p-60",
    "-0x1.5c243e29b1a65p-59", "0x1.189c5532d6361p-59", "-0x1.e5888c4dc1676p-60",
    "0x1.85f5d07068577p-59", "-0x1.709ddbaca6cd7p-60", "-0x1.b5449cd169766p-58",
    "0x1.a4bde8f74265bp-58", "-0x1.906c43c2f543dp-58", "-0x1.4cd620018bdf8p-61",
    "0x1.94be2e01c350fp-58", "0x1.4f6c94a902b1fp-60", "-0x1.6c022a6c8ac26p-60",
    "-0x1.5b12b97e7a378p-58", "0x1.9877c5f5d38a6p-57", "0x1.47c9c89dc86d9p-58",
    "0x1.2e7e07238f390p-57", "0x1.de7be62b0b2b0p-58", "0x1.9f4187eea93bap-57",
    "-0x1.74670a4f0b95cp-57", "-0x1.ba979a5110a16p-58", "-0x1.caad7be421ecep-57",
    "0x1.bbf6b2e0c0605p-59", "-0x1.bf997cf9c7fa2p-57", "0x1.d9056c7f8e0d0p-57",
    "0x1.9371105cfef01p-59", "-0x1.388f848751cc9p-58", "0x1.4e1d2fa680548p-58",
    "-0x1.4f934a2e5eabcp-57", "0x1.70ae1da98b451p-57", "-0x1.56ecd50915690p-59",
    "0x1.47656c00ec33dp-57", "-0x1.cae7a64e54a4bp-57", "0x1.6b68f5189fa7bp-56",
    "0x1.7c9aea8934f83p-56", "-0x1.9d819228227f2p-56", "0x1.ce6e9563361c2p-61",
    "-0x1.11d3b7f6fad9ep-60", "-0x1.76f595b40cf5ap-56", "-0x1.0a5b682d74d38p-57",
    "-0x1.8ff7863c968a5p-56", "0x1.5915a1bfb7318p-56", "-0x1.c61766e7eb650p-57",
    "-0x1.0a9ac1ff59ae5p-56", "0x1.f3e5ece010f1cp-56", "-0x1.252c4b03d3e12p-57",
    "0x1.39d256c6a008ep-59", "0x1.520f507f49fa1p-56", "0x1.42368d931d936p-56",
    "0x1.7d8a9bce2731ep-57",
)

_SHIFT_BITS = np.float64(SHIFT).view(np.int64)


def _two_sum(a, b):
    s = a + b
    bv = s - a
    av = s - bv
    return s, (a - av) + (b - bv)


def _fast_two_sum(a, b):
    """|a| >= |b| (or a == 0)."""
    s = a + b
    return s, b - (s - a)


def _split(a):
    c = SPLIT * a
    hi = c - (c - a)
    return hi, a - hi


def _two_product(a, b):
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, (((ah * bh - p) + ah * bl) + al * bh) + al * bl


def _round_to_odd(v, ve):
    """The float64 round-to-odd of the exact sum v + ve, given v = RN(v + ve)."""
    bits = v.view(np.int64).copy()
    move = (ve != 0.0) & ((bits & 1) == 0)
    up = (ve > 0.0) == (v > 0.0)  # away from zero in magnitude
    bits += np.where(move, np.where(up, 1, -1), 0)
    return bits.view(np.float64)


def _exp_core(x: np.ndarray) -> np.ndarray:
    """float64 x (exact float32 values) in [-104, 89] -> float32 RNE(e^x)."""
    t = x * EXP_INV_LN2_64 + SHIFT
    n = t.view(np.int64) - _SHIFT_BITS
    fn = t - SHIFT
    a = x - fn * EXP_C1                      # exact
    b = fn * EXP_C2
    rh = a - b                               # TwoDiff(a, b): rh + rl = a - b exactly
    bv = rh - a
    av = rh - bv
    rl = (a - av) - (b + bv)
    poly = EXP_P6 + rh * EXP_P7
    poly = EXP_P5 + rh * poly
    poly = EXP_P4 + rh * poly
    poly = EXP_P3 + rh * poly
    poly = EXP_P2 + rh * poly
    p = (rh * rh) * poly
    q = rl + (p + rl * rh)
    j = n & 63
    th = _EXP_T_HI[j]
    tl = _EXP_T_LO[j]
    prod, prod_err = _two_product(th, rh)
    w = (1.0 + rh) + q
    small = prod_err + (th * q + tl * w)
    s, se = _fast_two_sum(th, prod)
    lo = se + small
    v, ve = _fast_two_sum(s, lo)
    odd = _round_to_odd(v, ve)
    scale = (((n >> 6) + 1023) << 52).view(np.float64)
    with np.errstate(over="ignore"):
        return (odd * scale).astype(np.float32)


def _log_core(x: np.ndarray) -> np.ndarray:
    """float64 x (exact positive finite float32 values) -> float32 RNE(ln x)."""
    xb = x.view(np.int64)
    e = (xb >> 52) - 1023
    m = ((xb & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(np.float64)
    big = m >= LOG_SQRT2
    m = np.where(big, m * 0.5, m)
    e = e + big
    t = (m - 1.0) * 128.0 + SHIFT
    idx = t.view(np.int64) - _SHIFT_BITS - LOG_INDEX_MIN
    c = _LOG_C[idx]
    h = _LOG_H[idx]
    low_table = _LOG_L[idx]
    z = m * c - 1.0                          # exact
    poly = LOG_Q8 + z * LOG_Q9
    poly = LOG_Q7 + z * poly
    poly = LOG_Q6 + z * poly
    poly = LOG_Q5 + z * poly
    poly = LOG_Q4 + z * poly
    poly = LOG_Q3 + z * poly
    poly = LOG_Q2 + z * poly
    tail = (z * z) * poly
    fe = e.astype(np.float64)
    s, se = _two_sum(fe * LOG_LN2_HI, h)    # fe * LN2_HI is exact
    s2, se2 = _two_sum(s, z)
    low = ((se + se2) + (fe * LOG_LN2_LO + low_table)) + tail
    v, ve = _fast_two_sum(s2, low)
    return _round_to_odd(v, ve).astype(np.float32)


def _blocked(core, x: np.ndarray, out: np.ndarray) -> None:
    for start in range(0, x.size, _BLOCK):
        out[start:start + _BLOCK] = core(x[start:start + _BLOCK])


#: the NumPy fast path's domain: results far inside float32's normal range (outside it, the full
#: evaluation); and its margin, in float64 units in the last place around a float32 rounding midpoint
#: (NumPy only: the device sources have their own fast path, RLP_EXP_FAST_*)
NUMPY_FAST_EXP_LOW, NUMPY_FAST_EXP_HIGH = -87.0, 88.5
NUMPY_FAST_EXP_WINDOW = 1 << 10


def _exp_fast_core(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float32 RNE(e^x) where `certain`, certain): e^x in plain float64 (table and degree-7 polynomial,
    a few float64 ulps of error) rounded to float32 where the float64 value lies more than
    NUMPY_FAST_EXP_WINDOW ulps from a float32 rounding midpoint, so that the exact value rounds the same way.
    x: exact float32 values in [NUMPY_FAST_EXP_LOW, NUMPY_FAST_EXP_HIGH]."""
    t = x * EXP_INV_LN2_64 + SHIFT
    n = t.view(np.int64) - _SHIFT_BITS
    fn = t - SHIFT
    r = (x - fn * EXP_C1) - fn * EXP_C2
    poly = EXP_P6 + r * EXP_P7
    poly = EXP_P5 + r * poly
    poly = EXP_P4 + r * poly
    poly = EXP_P3 + r * poly
    poly = EXP_P2 + r * poly
    j = n & 63
    th = _EXP_T_HI[j]
    v = th + (th * (r + (r * r) * poly) + _EXP_T_LO[j])
    wide = v * (((n >> 6) + 1023) << 52).view(np.float64)  # an exact power-of-two scaling
    low = wide.view(np.int64) & ((1 << 29) - 1)  # the 29 bits float32 rounds away; midpoint 2^28
    certain = np.abs(low - (1 << 28)) > NUMPY_FAST_EXP_WINDOW
    return wide.astype(np.float32), certain


def _exp_core_fast_first(x: np.ndarray) -> np.ndarray:
    """_exp_core's bits, by the fast path where it is certain and _exp_core elsewhere."""
    with np.errstate(over="ignore", invalid="ignore"):  # outside the domain the fast values are discarded
        y, certain = _exp_fast_core(x)
    certain &= (x >= NUMPY_FAST_EXP_LOW) & (x <= NUMPY_FAST_EXP_HIGH)
    rest = np.flatnonzero(~certain)
    if rest.size:
        y[rest] = _exp_core(x[rest])
    return y


def exp_f32(x: np.ndarray, full: bool = False) -> np.ndarray:
    """The contract's exp: float32 -> float32, RNE(e^x) for every input (see the module docstring).
    full: every element by the full evaluation (the fast path gives the same bits; tests compare)."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    flat = x.reshape(-1)
    with np.errstate(invalid="ignore"):
        wide = flat.astype(np.float64)
    nan = np.isnan(wide)
    over = wide > EXP_OVERFLOW_X
    under = wide < EXP_UNDERFLOW_X
    tiny = (wide > -EXP_TINY_X) & (wide < EXP_TINY_X)
    special = nan | over | under | tiny
    y = np.empty(flat.size, dtype=np.float32)
    _blocked(_exp_core if full else _exp_core_fast_first, np.where(special, 0.0, wide), y)
    y[over] = np.inf
    y[under] = 0.0
    y.view(np.uint32)[nan] = CANONICAL_NAN_BITS
    return y.reshape(shape)


def log_f32(x: np.ndarray) -> np.ndarray:
    """The contract's log: float32 -> float32, RNE(ln x) for every input (see the module docstring)."""
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    flat = x.reshape(-1)
    with np.errstate(invalid="ignore"):
        wide = flat.astype(np.float64)
    nan = np.isnan(wide) | (wide < 0.0)
    zero = wide == 0.0
    inf = wide == np.inf
    special = nan | zero | inf
    y = np.empty(flat.size, dtype=np.float32)
    _blocked(_log_core, np.where(special, 1.0, wide), y)
    y[inf] = np.inf
    y[zero] = -np.inf
    y.view(np.uint32)[nan] = CANONICAL_NAN_BITS
    return y.reshape(shape)


# ---------------------------------------------------------------------------
# Checking correct rounding (tests, the exhaustive checks, the GPU checker's
# ambiguous inputs). Libm and mpmath serve here as ORACLES only; they are no
# part of the contract's functions above.

ORACLE_TOLERANCE = 2.0**-45  # a float64 libm result is trusted to this relative error (libms achieve ~2^-52)
_F32_TOP = 0x7F800000  # bits of +inf; on the rounding grid it stands for 2^128


def _grid_value(bits: np.ndarray) -> np.ndarray:
    """float64 value of magnitude bits on the float32 grid extended past FLT_MAX (0x7F800000 -> 2^128)."""
    bits = np.asarray(bits, dtype=np.int64)
    inside = np.clip(bits, 0, _F32_TOP - 1).astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(bits >= _F32_TOP, 2.0**128 + (bits - _F32_TOP) * 2.0**104, inside)


def rounding_boundaries(magnitude_bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float32 rounding boundaries (midpoints) below and above each magnitude (exact in float64).

    Bits 0 (zero) has no boundary below (-inf); bits of +inf (overflow) have none above (+inf)."""
    a = np.asarray(magnitude_bits, dtype=np.int64)
    here = _grid_value(a)
    below = np.where(a > 0, (here + _grid_value(a - 1)) * 0.5, -np.inf)
    above = np.where(a < _F32_TOP, (here + _grid_value(a + 1)) * 0.5, np.inf)
    return below, above


def oracle_f32(which: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expected float32 bits from a float64 libm oracle, and a mask of inputs it cannot decide.

    An input is decided when the float64 value lies farther than ORACLE_TOLERANCE (relative)
    from every float32 rounding boundary; the others are 'ambiguous' (resolve_ambiguous
    decides them). Special inputs follow the contract's edge cases.
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    with np.errstate(all="ignore"):
        wide = x.astype(np.float64)
        y = np.exp(wide) if which == "exp" else np.log(wide)
        magnitude = np.abs(y)
        near = magnitude.astype(np.float32)
        a = near.view(np.uint32).astype(np.int64)
        below, above = rounding_boundaries(a)
        tol = magnitude * ORACLE_TOLERANCE
        ambiguous = ~((magnitude - below > tol) & (above - magnitude > tol))
        ambiguous &= np.isfinite(y) & (y != 0.0)
    expected = (a | np.where(y < 0.0, 0x80000000, 0)).astype(np.uint32)
    expected[np.isnan(y)] = CANONICAL_NAN_BITS
    return expected, ambiguous


def _mp_correct_bits(which: str, value: float) -> int:
    """RNE_f32 of exp(value) or ln(value) for one finite float, by mpmath with a Ziv loop."""
    import mpmath

    if which == "exp" and value == 0.0:
        return 0x3F800000
    if which == "log" and value == 1.0:
        return 0
    for precision in (100, 200, 400, 800):
        with mpmath.workprec(precision):
            x = mpmath.mpf(value)
            v = mpmath.exp(x) if which == "exp" else mpmath.log(x)
            sign = 0x80000000 if v < 0 else 0
            v = abs(v)
            err = v * mpmath.mpf(2) ** (4 - precision)  # mpmath errs by well under 2^-(prec-4)
            a = int(np.array(float(v), dtype=np.float64).astype(np.float32).view(np.uint32)) if float(v) < 2.0**128 else _F32_TOP
            for _ in range(4):
                below, above = (float(b[0]) for b in rounding_boundaries(np.array([a])))
                if v - err > above:
                    a += 1
                elif v + err < below:
                    a -= 1
                elif v - err > below and v + err < above:
                    return sign | a
                else:
                    break  # too close to a boundary at this precision
    raise ArithmeticError(f"cannot round {which}({value!r}) even at 800 bits")


def resolve_ambiguous(which: str, bits_array) -> np.ndarray:
    """Correct float32 bits of exp or log ('exp' | 'log') for the given float32 input bit patterns.

    For the inputs a float64 oracle (or the GPU checker) marks ambiguous; uses mpmath."""
    bits = np.asarray(bits_array, dtype=np.uint32).reshape(-1)
    x = bits.view(np.float32)
    out = np.empty(bits.size, dtype=np.uint32)
    with np.errstate(invalid="ignore"):
        wide = x.astype(np.float64)
    for k, value in enumerate(wide):
        if np.isnan(value) or (which == "log" and value < 0):
            out[k] = CANONICAL_NAN_BITS
        elif which == "log" and value == 0.0:
            out[k] = 0xFF800000
        elif np.isinf(value):
            out[k] = (0x7F800000 if value > 0 else 0) if which == "exp" else 0x7F800000
        else:
            out[k] = _mp_correct_bits(which, float(value))
    return out


def check_correct_rounding(which: str, bits: np.ndarray) -> dict:
    """Compare the contract function with the oracle on float32 inputs given as uint32 bit patterns.

    Returns counts: checked, ambiguous (resolved by mpmath), wrong, and up to 16 wrong inputs."""
    bits = np.asarray(bits, dtype=np.uint32).reshape(-1)
    x = bits.view(np.float32)
    ours = (exp_f32(x) if which == "exp" else log_f32(x)).view(np.uint32)
    expected, ambiguous = oracle_f32(which, x)
    if ambiguous.any():
        expected[ambiguous] = resolve_ambiguous(which, bits[ambiguous])
    wrong = np.flatnonzero(ours != expected)
    return {"checked": int(bits.size), "ambiguous": int(ambiguous.sum()), "wrong": int(wrong.size),
            "wrong_inputs": [int(b) for b in bits[wrong[:16]]], "ours": ours}


# ---- edge inputs: thresholds, specials and switch points, each with its neighbours
def _around(bits: int, radius: int = 2) -> list[int]:
    return [b for b in range(bits - radius, bits + radius + 1) if 0 <= b < 2**32]


_EDGE_BITS = sorted({
    b
    for center in (
        0x00000000, 0x80000000,  # +-0
        0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # subnormal min / max
        0x00800000, 0x80800000,  # FLT_MIN
        0x3F800000, 0xBF800000,  # +-1
        0x7F7FFFFF, 0xFF7FFFFF,  # +-FLT_MAX
        0x7F800000, 0xFF800000,  # +-inf
        0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFFC00000, 0xFFFFFFFF,  # NaNs
        0x42B17218, 0x42B20000,  # exp overflow threshold, 89
        0xC2CFF1B5, 0xC2D00000,  # exp underflow to 0 threshold, -104
        0xC2AEAC50,  # exp(x) ~ FLT_MIN (-87.33655)
        0x30800000, 0xB0800000,  # +-2^-30 (exp's "tiny" cut)
        0x33800000, 0xB3000000, 0x33000000,  # 2^-24, -2^-25, 2^-25: exp near 1 +- half ulp
        0x3F3504F3, 0x3FB504F3,  # sqrt(2)/2, sqrt(2): log's reduction switch
        0x3F7FFFFF, 0x3F800001,  # log near 1
        0x3F317218, 0x402DF854,  # ln 2, e
    )
    for b in _around(center)
})


def edge_inputs() -> np.ndarray:
    """float32 bit patterns (uint32) that every check of exp and log must include."""
    return np.array(_EDGE_BITS, dtype=np.uint32)


def _exhaustive_cpu(which: str, start: int, count: int, chunk: int, digest_path: str | None) -> int:
    import hashlib
    import sys
    import time

    totals = {"checked": 0, "ambiguous": 0, "wrong": 0}
    digests = []
    begin = time.time()
    for first in range(start, start + count, chunk):
        n = min(chunk, start + count - first)
        bits = np.arange(first, first + n, dtype=np.uint64).astype(np.uint32)
        result = check_correct_rounding(which, bits)
        for key in totals:
            totals[key] += result[key]
        digests.append(f"{first:#010x} {n} {hashlib.sha256(result['ours'].tobytes()).hexdigest()}")
        if result["wrong"]:
            print(f"WRONG {which} at {[hex(b) for b in result['wrong_inputs']]}", flush=True)
        print(f"{which} [{first:#010x}, +{n}) checked={totals['checked']} ambiguous={totals['ambiguous']} "
              f"wrong={totals['wrong']} {time.time() - begin:.0f}s", flush=True)
    if digest_path:
        with open(digest_path, "w") as handle:
            handle.write("\n".join(digests) + "\n")
    print(f"DONE {which}: {totals}", flush=True)
    sys.stdout.flush()
    return 1 if totals["wrong"] else 0


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Check the contract's exp/log for correct rounding on the CPU.")
    parser.add_argument("--exhaustive-cpu", choices=("exp", "log"), required=True)
    parser.add_argument("--start", type=lambda s: int(s, 0), default=0)
    parser.add_argument("--count", type=lambda s: int(s, 0), default=1 << 32)
    parser.add_argument("--chunk", type=lambda s: int(s, 0), default=1 << 24)
    parser.add_argument("--digests", default=None, help="write the SHA-256 of each chunk's output bits here")
    args = parser.parse_args()
    raise SystemExit(_exhaustive_cpu(args.exhaustive_cpu, args.start, args.count, args.chunk, args.digests))
