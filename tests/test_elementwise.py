"""The contract's float32 exp and log (rlportable.contract.elementwise).

Correct rounding on a large seeded sample plus every edge input (float64 libm as
the oracle where it is certain, mpmath where it is not), the exact bits of the
edge-case table, the tables recomputed from scratch with mpmath, and the CUDA and
HIP sources spelling the same constants as the reference.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

from rlportable.contract import elementwise as ew

mpmath = pytest.importorskip("mpmath")

ROOT = Path(__file__).resolve().parents[1]
# elementwise has one source for both vendors; the contract functions (constants, tables, rlp_exp_f32,
# rlp_log_f32) live in the portable header it includes, and in CUDA's twin of it, which the families
# with a CUDA source of their own (attention, gemm) include
SOURCE = ROOT / "backends" / "portable" / "elementwise.hip"
PORTABLE_HEADER = ROOT / "backends" / "portable" / "contract_math.h"
HEADERS = {SOURCE: PORTABLE_HEADER}


def _source_text(source: Path) -> str:
    """The family source with its contract-math header in front (the header's text is where
    the constants and the contract functions are spelled)."""
    return HEADERS[source].read_text() + "\n" + source.read_text()
FUNCTIONS = {"exp": ew.exp_f32, "log": ew.log_f32}


def _bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64).astype(np.uint32)


def _f32(bits) -> np.ndarray:
    return _bits(bits).view(np.float32)


EDGE_BITS = ew.edge_inputs().tolist()


def _check(which: str, bits: np.ndarray) -> dict:
    result = ew.check_correct_rounding(which, bits)
    assert result["wrong"] == 0, f"{which}: {result['wrong']} not correctly rounded, e.g. " + \
        ", ".join(hex(b) for b in result["wrong_inputs"])
    return result


@pytest.mark.parametrize("which", ["exp", "log"])
def test_correctly_rounded_on_a_large_sample(which):
    rng = np.random.default_rng(20240917 + (which == "log"))
    any_bits = rng.integers(0, 2**32, size=1 << 21, dtype=np.uint64)
    if which == "exp":  # the inputs with non-trivial results: 2^-30 <= |x| <= 104
        lo, hi = 0x30800000, 0x42D00000
        interesting = rng.integers(lo, hi + 1, size=1 << 21, dtype=np.uint64) | \
            (rng.integers(0, 2, size=1 << 21, dtype=np.uint64) << 31)
    else:  # every positive finite input, and a dense band around 1
        interesting = np.concatenate([rng.integers(0, 0x7F800000, size=1 << 20, dtype=np.uint64),
                                      rng.integers(0x3F000000, 0x40000000, size=1 << 20, dtype=np.uint64)])
    bits = _bits(np.concatenate([any_bits, interesting, np.array(EDGE_BITS, dtype=np.uint64)]))
    result = _check(which, bits)
    print(f"{which}: {result['checked']} inputs, {result['ambiguous']} ambiguous (decided by mpmath), 0 wrong")


# The inputs whose exact result lies closest to a float32 rounding boundary, found by the
# exhaustive GPU check (relative distance 2^-52.6 .. 2^-49.8 for exp, 2^-57.8 .. 2^-52.8 for log;
# the computation's error is about 2^-66).
HARDEST = {
    "exp": [0xC16912CD, 0xBBF0EDF1, 0xBAE0E25C, 0xB3000000, 0x377EFF81, 0x40315B33, 0x4001B249, 0x39C6BE5B,
            0x38E69CC1, 0x383A3EF1],
    "log": [0x65D890D3, 0x4C5D65A5, 0x4D604EBE, 0x66A8C860, 0x1F116AB8, 0x41178FEB, 0x3C413D3A, 0x6F31A8EC,
            0x38DCBE38, 0x5EE8984E],
}


@pytest.mark.parametrize("which", ["exp", "log"])
def test_hardest_inputs(which):
    bits = _bits(HARDEST[which])
    _check(which, bits)
    ours = FUNCTIONS[which](bits.view(np.float32)).view(np.uint32)
    assert np.array_equal(ours, ew.resolve_ambiguous(which, bits))


@pytest.mark.parametrize("which", ["exp", "log"])
def test_dense_ranges(which):
    ranges = {
        "exp": [(0xC2CF0000, 0xC2D00010), (0x42B10000, 0x42B20010), (0x33000000, 0x33000400),
                (0xB3000000, 0xB3000400), (0x3F800000, 0x3F820000)],
        "log": [(0x3F7E0000, 0x3F820000), (0x00000000, 0x00020000), (0x7F7E0000, 0x7F800001),
                (0x3F340000, 0x3F360000)],
    }[which]
    bits = np.concatenate([np.arange(a, b, dtype=np.uint64) for a, b in ranges]).astype(np.uint32)
    _check(which, bits)


def test_oracle_agrees_with_mpmath_where_certain():
    rng = np.random.default_rng(7)
    for which, lo, hi in (("exp", 0xC2D00000, 0xC2D00000), ("log", 0, 0x7F800000)):
        if which == "exp":
            bits = _bits(rng.integers(0x30800000, 0x42D00000, size=300, dtype=np.uint64)
                         | (rng.integers(0, 2, size=300, dtype=np.uint64) << 31))
        else:
            bits = _bits(rng.integers(lo, hi, size=300, dtype=np.uint64))
        expected, ambiguous = ew.oracle_f32(which, bits.view(np.float32))
        assert np.array_equal(expected[~ambiguous], ew.resolve_ambiguous(which, bits[~ambiguous]))


# (input bits, exp bits, log bits); None where the row does not apply
EDGE_TABLE = [
    (0x7FC00000, 0x7FC00000, 0x7FC00000),  # quiet NaN
    (0x7F800001, 0x7FC00000, 0x7FC00000),  # signalling NaN payload -> canonical
    (0xFFFFFFFF, 0x7FC00000, 0x7FC00000),  # negative NaN -> canonical
    (0x7F800000, 0x7F800000, 0x7F800000),  # +inf
    (0xFF800000, 0x00000000, 0x7FC00000),  # -inf: exp -> +0, log -> NaN
    (0x00000000, 0x3F800000, 0xFF800000),  # +0: exp -> 1, log -> -inf
    (0x80000000, 0x3F800000, 0xFF800000),  # -0
    (0x3F800000, 0x402DF854, 0x00000000),  # 1: exp -> e, log -> +0
    (0xBF800000, 0x3EBC5AB2, 0x7FC00000),  # -1: exp -> 1/e, log -> NaN
    (0x00000001, 0x3F800000, 0xC2CE8ED0),  # smallest subnormal: log -> -103.27893
    (0x007FFFFF, 0x3F800000, 0xC2AEAC50),  # largest subnormal: log -> -87.33655
    (0x7F7FFFFF, 0x7F800000, 0x42B17218),  # FLT_MAX: exp overflows, log -> 88.72284
    (0x42B17217, 0x7F7FFF84, None),        # largest x with finite exp
    (0x42B17218, 0x7F800000, None),        # smallest x whose exp rounds to +inf
    (0x42B20000, 0x7F800000, None),        # 89
    (0xC2CFF1B4, 0x00000001, None),        # exp -> 2^-149 (smallest subnormal)
    (0xC2CFF1B5, 0x00000000, None),        # exp < 2^-150 -> +0
    (0xC2D00001, 0x00000000, None),        # just below -104 -> +0
    (0xC2AEAC50, 0x007FFFE6, None),        # exp(-87.33655): a subnormal, correctly rounded
    (0x30800000, 0x3F800000, None),        # 2^-30 -> 1
    (0x33800000, 0x3F800001, None),        # exp(2^-24) rounds up past the midpoint 1 + 2^-24
    (0xB3000000, 0x3F800000, None),        # exp(-2^-25) stays 1 (above the midpoint 1 - 2^-25)
    (0xB3000001, 0x3F7FFFFF, None),        # exp(-2^-25 (1 + 2^-23)) drops below it
    (0x3F317218, 0x40000000, 0xBEBBA795),  # ln2 (float32): exp -> 2
    (0x402DF854, 0x417277DA, 0x3F7FFFFF),  # e (float32, below the real e): log -> 1 - 2^-24
    (0x3F800001, 0x402DF856, 0x33FFFFFF),  # 1 + 2^-23: log -> 2^-23 (1 - 2^-24) rounded
    (0x3F7FFFFF, 0x402DF854, 0xB3800000),  # 1 - 2^-24: log -> -2^-24 rounded
]


@pytest.mark.parametrize("which,column", [("exp", 1), ("log", 2)])
def test_edge_table(which, column):
    rows = [row for row in EDGE_TABLE if row[column] is not None]
    x = _f32([row[0] for row in rows])
    got = FUNCTIONS[which](x).view(np.uint32)
    for row, value in zip(rows, got):
        assert int(value) == row[column], f"{which}({row[0]:#010x}) = {int(value):#010x}, contract says {row[column]:#010x}"
    # the table itself is checked against mpmath (NaN, inf and zero rows follow the contract's edge cases)
    assert np.array_equal(ew.resolve_ambiguous(which, _bits([row[0] for row in rows])), [row[column] for row in rows])


def test_shapes_and_dtypes():
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(2, 3, 4)
    for f in FUNCTIONS.values():
        y = f(x)
        assert y.shape == x.shape and y.dtype == np.float32
        assert f(np.zeros(0, dtype=np.float32)).shape == (0,)
        assert np.array_equal(f(x[:, ::2, 1:]).view(np.uint32), f(np.ascontiguousarray(x[:, ::2, 1:])).view(np.uint32))


def test_tables_recomputed_with_mpmath():
    with mpmath.workprec(300):
        def rn(v) -> float:
            return float(v)

        def rn_bits(v, bits: int) -> float:
            m, e = mpmath.frexp(v)
            return float(mpmath.ldexp(mpmath.nint(m * 2**bits), e - bits))

        for j in range(64):
            t = mpmath.power(2, mpmath.mpf(j) / 64)
            assert ew._EXP_T_HI[j] == rn(t) and ew._EXP_T_LO[j] == rn(t - mpmath.mpf(rn(t))), j
        ln2 = mpmath.log(2)
        assert ew.EXP_C1 == rn_bits(ln2 / 64, 39) and ew.EXP_C2 == rn(ln2 / 64 - mpmath.mpf(ew.EXP_C1))
        assert ew.LOG_LN2_HI == rn_bits(ln2, 44) and ew.LOG_LN2_LO == rn(ln2 - mpmath.mpf(ew.LOG_LN2_HI))
        assert ew.EXP_INV_LN2_64 == rn(64 / ln2) and ew.LOG_SQRT2 == rn(mpmath.sqrt(2))
        for k, i in enumerate(range(ew.LOG_INDEX_MIN, 54)):
            c = 1.0 if i == 0 else rn_bits(1 / (1 + mpmath.mpf(i) / 128), 20)
            v = -mpmath.log(mpmath.mpf(c))
            assert (ew._LOG_C[k], ew._LOG_H[k], ew._LOG_L[k]) == (c, rn(v), rn(v - mpmath.mpf(rn(v)))), i
    for n, value in zip(range(2, 8), (ew.EXP_P2, ew.EXP_P3, ew.EXP_P4, ew.EXP_P5, ew.EXP_P6, ew.EXP_P7)):
        assert value == 1 / math.factorial(n)
    for n, value in zip(range(2, 10), (ew.LOG_Q2, ew.LOG_Q3, ew.LOG_Q4, ew.LOG_Q5, ew.LOG_Q6, ew.LOG_Q7,
                                       ew.LOG_Q8, ew.LOG_Q9)):
        assert value == (-1) ** (n + 1) / n


_HEX = r"-?0x[0-9a-fA-F]\.[0-9a-fA-F]+p[-+]\d+|-?\d+\.\d*"


def _device_constants(text: str) -> tuple[dict, dict]:
    scalars = {name: float.fromhex(value) if "x" in value else float(value)
               for name, value in re.findall(rf"#define (RLP_(?:EXP|LOG|EW)_\w+) \(?({_HEX})\)?", text)}
    arrays = {}
    for name, body in re.findall(r"const double (rlp_\w+)\[\d+\] = \{(.*?)\};", text, flags=re.DOTALL):
        arrays[name] = np.array([float.fromhex(v) for v in re.findall(_HEX, body)])
    return scalars, arrays


@pytest.mark.parametrize("source", [SOURCE], ids=["portable"])
def test_device_sources_spell_the_reference_constants(source):
    assert f'#include "{HEADERS[source].name}"' in source.read_text()
    text = _source_text(source)
    scalars, arrays = _device_constants(text)
    for name in ("SHIFT", "SPLIT"):
        assert scalars[f"RLP_EW_{name}"] == getattr(ew, name)
    names = [n for n in dir(ew) if re.fullmatch(r"(EXP|LOG)_[A-Z0-9_]+", n) and n != "LOG_INDEX_MIN"]
    for name in names:
        assert scalars[f"RLP_{name}"] == getattr(ew, name), name
    assert int(re.search(r"#define RLP_LOG_INDEX_MIN \((-?\d+)\)", text).group(1)) == ew.LOG_INDEX_MIN
    assert np.float64(ew.SHIFT).view(np.int64) == int(re.search(r"RLP_EW_SHIFT_BITS (0x[0-9a-fA-F]+)LL", text).group(1), 16)
    for name, reference in (("rlp_exp_t_hi", ew._EXP_T_HI), ("rlp_exp_t_lo", ew._EXP_T_LO),
                            ("rlp_log_c", ew._LOG_C), ("rlp_log_h", ew._LOG_H), ("rlp_log_l", ew._LOG_L)):
        assert np.array_equal(arrays[name], reference), name
    # the contract functions call no math library (the checker's oracle, at the end, may)
    contract_part = re.sub(r"//[^\n]*|/\*.*?\*/", "", text.split("// ---- exhaustive checker")[0], flags=re.DOTALL)
    assert not re.search(r"\b(exp|log|expf|logf|exp2|log2|fma|fmaf|__fma_rn|__expf|__logf|ldexp|frexp|rint|floor)\s*\(",
                         contract_part)


def test_exp_fast_path_gives_the_full_evaluations_bits():
    """exp_f32's NumPy fast path (plain float64, kept only where its float32 rounding is certain)
    against the full evaluation of every element, bitwise: random bit patterns, dense ranges across
    the fast domain's ends and the float32 range's, and inputs whose fast value falls inside the
    window around a rounding midpoint (so the full evaluation decides them). All 2^32 inputs were
    compared once (conformance/results/cpu/exp_fast_path_exhaustive_cpu.json)."""
    rng = np.random.default_rng(11)
    samples = [rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    for edge in (ew.NUMPY_FAST_EXP_LOW, ew.NUMPY_FAST_EXP_HIGH, -87.3365, 88.7228, 0.0, 1.0, -1.0):
        centre = np.float32(edge).view(np.uint32).astype(np.int64)
        samples.append((centre + np.arange(-2**15, 2**15)).astype(np.uint32).view(np.float32))
    near_one = (np.float32(0.25).view(np.uint32) + np.arange(1 << 22)).astype(np.uint32).view(np.float32)
    _, certain = ew._exp_fast_core(near_one.astype(np.float64))
    assert 0 < np.count_nonzero(~certain) < near_one.size // 1000  # some go the full way, few
    samples.append(near_one[~certain])
    for x in samples:
        assert np.array_equal(ew.exp_f32(x).view(np.uint32), ew.exp_f32(x, full=True).view(np.uint32))
