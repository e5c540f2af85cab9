"""Accuracy of a float32-only exp for attention's p = exp(s - m) (a candidate contract revision), on the CPU.

    PYTHONPATH=. python3 scripts/measure_attention_exp_f32.py [--quick] > result.json
    PYTHONPATH=. python3 scripts/measure_attention_exp_f32.py --fit      # re-derive the coefficients

Today attention's p_j = exp_f32(s_j - m) is the contract's correctly rounded exp (contracts/elementwise.toml:
a float64 evaluation, about 45 GPU instructions a score with 3 slow conversions). The candidate, exp_neg_f32
below, is a fixed sequence of IEEE binary32 multiplies and adds (no fma, round to nearest even), a max and
one integer shift-add, for x <= 0 (s - m <= 0 always) and NaN; NumPy's float32 arithmetic performs the same
operations with the same roundings as a GPU built without contraction (--fmad=false, -ffp-contract=off):

    xc = max(x, -104)                       (fmaxf: -inf and x < -104 -> -104, whose result rounds to +0)
    y  = RN(RN(xc * LOG2E) + 0x1.8p23)      1.5 * 2^23 + n, n = RNE(RN(xc * log2 e)) in [-150, 0]
    nf = y - 0x1.8p23                       exact: n as a float
    r  = RN(xc - RN(nf * LN2_HI))           the product and the difference are exact (Cody-Waite, LN2_HI 15 bits)
    r  = RN(r - RN(nf * LN2_LO))            |r| <= ln2/2 + 2^-17
    p  = Horner, RN at each step: ((((c5 r + c4) r + c3) r + c2) r + c1) r + 1       (degree 5)
    s  = bits((bits(y) << 23) + (152 << 23))                                         2^(n + 25), as an integer op
    e  = RN(RN(p * s) * 2^-25)              p * 2^(n+25) is exact and normal; the last multiply rounds only
                                            a subnormal result (once), so results down to 2^-149 are kept
    NaN x -> the canonical NaN 0x7FC00000 (a select on x itself)

Expected GPU cost, degree 5: 21 instructions (1 max, 19 float32 mul/add, 1 integer shift-add), plus 2 (a
compare and a select) for the NaN, which no attention kernel needs: a row whose m is +-inf is poisoned
before p is formed, so s - m is never NaN there.

Measured:
  1. the candidate's error in float32 ulps against float64 exp (numpy.exp on the exact input), over every
     float32 x in [-104, 0] (1,120,927,745 bit patterns, vectorised in chunks over both cores; --quick:
     every 97th pattern), by range (x in [-1, 0], normal results, subnormal results): max, mean,
     distribution, the fraction equal to the correctly rounded result, results above 1 and steps where e
     rises as x falls (monotonicity); the special inputs (-0, -inf, every NaN, x < -104); degrees 3, 4 and
     6 of the same scheme on every 97th pattern;
  2. attention's forward output against float64 attention, for T = 256, 1024, 4096 (--quick: 256, 1024)
     and (Hq, Hkv) = (2, 1), (8, 2), (16, 8) (--quick: the first two), head_dim 128, q scaled so the scores
     spread ~4 (as scripts/measure_attention_backward_bits.py): the contract (exp_f32), the candidate and
     its other degrees (the reference rlportable.contract.attention with its module's exp_f32 swapped for
     the duration of the call: every other bit of the reference stays the contract's; the swap back is
     checked bitwise), and torch's bf16 attention (bf16 operands, float32 softmax rounded to bf16, as HF's
     eager attention); relative L2 and max abs error against float64 of the raw inputs (bf16 and the
     contract both quantize their inputs) and against float64 of the encoded inputs (the contract's
     arithmetic alone), and the fraction of output elements whose bits the candidate changes;
  3. whole models: log-probs and gradients of the random-weight test models (tests/test_model_forward.py:
     Qwen3, Qwen2, Llama shapes) against float64 HF transformers / float64 autograd, beside bf16's: the
     forward at 96 (the test's) and 256 tokens, the max abs log-prob error (the project's rule: at most 1/20
     of bf16's); the gradients as scripts/measure_attention_backward_bits.py (worst relative L2 over the
     weight tensors; at most 1/10 of bf16's). --quick: 96 tokens only.
The same measurements (2. and 3.) also cover a second candidate: q encoded at 15 bits (two digits, as k
and v) instead of 23, so that a score takes 2 x 2 int8 digit products instead of 3 x 2 (variants "q15",
with the contract's exp, and "q15_deg5", with the candidate exp; the reference's Q_BITS swapped like its
exp_f32, in the forward and the backward), and three more attention rows (T = 1024, 8/2 heads) whose q
rows carry a massive channel (channel 0 of q x 16, 64, 256, of k / the same: the scores keep their
spread), where a row encoding's other channels lose bits.
Prints JSON.
"""

import argparse
import contextlib
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rlportable.contract import attention as reference  # noqa: E402
from rlportable.contract.elementwise import exp_f32  # noqa: E402
from rlportable.provenance import host, provenance  # noqa: E402

F32 = np.float32
CANONICAL_NAN = np.array(0x7FC00000, dtype=np.uint32).view(F32)[()]

# ---- the candidate: constants as exact binary32 values (hex), the same literals a kernel would spell

X_MIN = F32(-104.0)                            # e^-104 < 2^-150: rounds to +0
LOG2E = F32(float.fromhex("0x1.715476p+0"))    # RN32(log2 e)
SHIFT = F32(float.fromhex("0x1.8p+23"))        # 1.5 * 2^23: y = t + SHIFT holds RNE(t) in its low bits
LN2_HI = F32(float.fromhex("0x1.62e4p-1"))     # ln 2 to 15 bits: nf * LN2_HI exact for |n| <= 2^8
LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))  # RN32(ln 2 - LN2_HI)
SCALE_BITS = np.uint32((127 + 25) << 23)       # bits(y) << 23 = n << 23 (mod 2^32): + this = bits of 2^(n+25)
UNSCALE = F32(2.0**-25)
# c1 .. c_degree of p(r) = 1 + c1 r + ... ~ e^r on |r| <= ln2/2 + 2e-5: minimax of the error in result ulps
# (weights 2^24 for e^r < 1, 2^23 above), rounded to binary32 one coefficient at a time from c1 (the rest
# refitted), then a search of +-4 ulps per coefficient for the smallest max error of the float32 Horner
# evaluation on 4M points (fit_coefficients, --fit).
COEFFICIENTS = {
    3: ("0x1.0012e2p+0", "0x1.0220f2p-1", "0x1.50c49ep-3"),
    4: ("0x1.fffc44p-1", "0x1.000558p-1", "0x1.57b706p-3", "0x1.534f1cp-5"),
    5: ("0x1.ffffeep-1", "0x1.fffdc2p-2", "0x1.555d46p-3", "0x1.573b7ap-5", "0x1.0ebb72p-7"),
    6: ("0x1.000000p+0", "0x1.fffffap-2", "0x1.555492p-3", "0x1.555a04p-5", "0x1.123980p-7", "0x1.697b9ep-10"),
}
CANDIDATE_DEGREE = 5
Q_BITS_CANDIDATE = 15  # the second candidate: q rows at 15 bits (k's and v's), S from 2 x 2 digit products
OUTLIERS = (16, 64, 256)  # q's channel 0 scaled up (k's down) in the extra attention rows
INSTRUCTIONS = {d: 11 + 2 * d for d in COEFFICIENTS}  # max 1, n 3, reduction 4, Horner 2d, scale 1 int + 2 mul
FIT_HALF_WIDTH = float(np.log(2.0) / 2 + 2e-5)


def coefficients(degree):
    return [F32(float.fromhex(c)) for c in COEFFICIENTS[degree]]


def exp_neg_f32(x, degree=CANDIDATE_DEGREE):
    """The candidate: e^x for float32 x <= 0 (or NaN) by binary32 multiplies and adds, as the docstring says.
    Returns float32. (x > 0 is not an input: attention's s - m <= 0.)"""
    x = np.asarray(x, dtype=F32)
    coef = coefficients(degree)
    with np.errstate(invalid="ignore", over="ignore"):
        xc = np.fmax(x, X_MIN)
        y = xc * LOG2E
        y += SHIFT
        nf = y - SHIFT
        r = xc - nf * LN2_HI
        r -= nf * LN2_LO
        p = np.full(r.shape, coef[-1], dtype=F32)
        for c in coef[-2::-1]:
            p *= r
            p += c
        p *= r
        p += F32(1.0)
        p *= ((y.view(np.uint32) << np.uint32(23)) + SCALE_BITS).view(F32)
        p *= UNSCALE
    p[np.isnan(x)] = CANONICAL_NAN
    return p


def ulp_error(x, e):
    """|e - e^x| in float32 ulps of e^x (float64 exp of the exact input; ulp 2^-149 below 2^-126)."""
    exact = np.exp(x.astype(np.float64))
    _, exponent = np.frexp(exact)
    return np.abs(e.astype(np.float64) - exact) / np.ldexp(1.0, np.maximum(exponent, -125) - 24), exact


# ---- 1. the candidate's own error

LO_BITS = 0x80000000                                     # -0
HI_BITS = int(np.array(-104.0, dtype=F32).view(np.uint32))  # -104: bits rise as x falls
NORMAL_MIN_X = float(np.log(2.0**-126))                  # below: subnormal results
BINS = [0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 8.0, 16.0, 32.0, 64.0, 1024.0, 8192.0]
CHUNK = 1 << 23
SAMPLE_STRIDE = 97


def _empty_region():
    return {"count": 0, "max_ulps": 0.0, "max_at": None, "sum_ulps": 0.0, "correctly_rounded": 0,
            "histogram": [0] * (len(BINS) + 1)}


def _chunk_stats(args):
    """Stats of patterns start, start + stride, ... < stop (and the one after, for monotonicity)."""
    start, stop, stride, degree = args
    bits = np.arange(start, min(stop + stride, HI_BITS + 1), stride, dtype=np.int64).astype(np.uint32)
    x = bits.view(F32)
    e = exp_neg_f32(x, degree)
    rises = int(np.count_nonzero(e[1:] > e[:-1]))  # x falls along the array
    keep = slice(0, np.count_nonzero(bits.astype(np.int64) < stop))
    x, e = x[keep], e[keep]
    ulps, exact = ulp_error(x, e)
    regions = {"x_in_[-1,0]": x >= -1, "normal_results_x_below_-1": (x < -1) & (x >= NORMAL_MIN_X),
               "subnormal_or_zero_results": x < NORMAL_MIN_X}
    out = {"rises": rises, "above_one": int(np.count_nonzero(e > 1))}
    rounded = e == exact.astype(F32)
    for name, where in regions.items():
        part = ulps[where]
        row = _empty_region()
        if part.size:
            i = int(np.argmax(part))
            row.update(count=int(part.size), max_ulps=float(part[i]), sum_ulps=float(part.sum()),
                       max_at=hex32(x[where][i]), correctly_rounded=int(np.count_nonzero(rounded[where])),
                       histogram=np.bincount(np.searchsorted(BINS, part), minlength=len(BINS) + 1).tolist())
        out[name] = row
    return out


def _merge(parts):
    total = {"rises": 0, "above_one": 0}
    for part in parts:
        total["rises"] += part["rises"]
        total["above_one"] += part["above_one"]
        for name, row in part.items():
            if not isinstance(row, dict):
                continue
            acc = total.setdefault(name, _empty_region())
            if row["count"] and row["max_ulps"] >= acc["max_ulps"]:
                acc["max_ulps"], acc["max_at"] = row["max_ulps"], row["max_at"]
            for key in ("count", "sum_ulps", "correctly_rounded"):
                acc[key] += row[key]
            acc["histogram"] = [a + b for a, b in zip(acc["histogram"], row["histogram"])]
    everything = _empty_region()
    for name in list(total):
        row = total[name]
        if not isinstance(row, dict):
            continue
        row["mean_ulps"] = row.pop("sum_ulps") / max(row["count"], 1)
        row["fraction_correctly_rounded"] = row["correctly_rounded"] / max(row["count"], 1)
        everything["count"] += row["count"]
        everything["correctly_rounded"] += row["correctly_rounded"]
        everything["sum_ulps"] += row["mean_ulps"] * row["count"]
        everything["histogram"] = [a + b for a, b in zip(everything["histogram"], row["histogram"])]
        if row["max_ulps"] >= everything["max_ulps"]:
            everything["max_ulps"], everything["max_at"] = row["max_ulps"], row["max_at"]
    everything["mean_ulps"] = everything.pop("sum_ulps") / max(everything["count"], 1)
    everything["fraction_correctly_rounded"] = everything["correctly_rounded"] / max(everything["count"], 1)
    total["all"] = everything
    total["histogram_upper_edges_ulps"] = BINS + ["inf"]
    return total


def ulp_survey(degree, stride, pool):
    """Error over the patterns -0 .. -104 with the given stride (1: every float32 in [-104, 0])."""
    step = CHUNK * stride
    jobs = [(s, min(s + step, HI_BITS + 1), stride, degree) for s in range(LO_BITS, HI_BITS + 1, step)]
    started = time.time()
    result = _merge(pool.map(_chunk_stats, jobs, chunksize=1))
    result.update(degree=degree, stride=stride, patterns=result["all"]["count"],
                  seconds=round(time.time() - started, 1))
    return result


def special_inputs():
    """-0, +0, -inf, every NaN pattern, every x < -104 (every 97th pattern), the extremes."""
    nan_bits = np.concatenate([np.arange(0x7F800001, 0x80000000, dtype=np.int64),
                               np.arange(0xFF800001, 0x100000000, dtype=np.int64)]).astype(np.uint32)
    below = np.arange(HI_BITS + 1, 0xFF800000, SAMPLE_STRIDE, dtype=np.int64).astype(np.uint32)
    e_nan = exp_neg_f32(nan_bits.view(F32))
    e_below = exp_neg_f32(below.view(F32))
    ones = exp_neg_f32(np.array([-0.0, 0.0], dtype=F32))
    tiny = exp_neg_f32(np.array([-2.0**-149, -2.0**-25, -2.0**-24], dtype=F32))
    edge = F32(-150 * np.log(2.0))  # e^x = 2^-150: the last x whose result is not +0 lies just above
    edge = np.array([np.nextafter(edge, F32(0)), edge, np.nextafter(edge, F32(-1)), X_MIN], dtype=F32)
    return {
        "minus_zero_and_zero": [float(v) for v in ones],
        "minus_inf": float(exp_neg_f32(np.array([-np.inf], dtype=F32))[0]),
        "nan_patterns": int(nan_bits.size),
        "nan_patterns_giving_canonical_nan": int(np.count_nonzero(e_nan.view(np.uint32) == 0x7FC00000)),
        "below_minus_104_checked": int(below.size),
        "below_minus_104_giving_plus_zero": int(np.count_nonzero(e_below.view(np.uint32) == 0)),
        "x_-2^-149_-2^-25_-2^-24": [hex32(v) for v in tiny],
        "x_near_underflow": {hex32(x): hex32(v) for x, v in zip(edge, exp_neg_f32(edge))},
    }


def contract_agreement_sample(stride):
    """On every `stride`-th pattern of [-104, 0]: how often the candidate's bits equal the contract's
    exp_f32 (correctly rounded), a check of the float64-based 'correctly rounded' count above."""
    bits = np.arange(LO_BITS, HI_BITS + 1, stride * 17, dtype=np.int64).astype(np.uint32)
    x = bits.view(F32)
    same = exp_neg_f32(x).view(np.uint32) == exp_f32(x).view(np.uint32)
    rounded = exp_neg_f32(x) == np.exp(x.astype(np.float64)).astype(F32)
    return {"patterns": int(x.size), "equal_to_contract_exp_f32": int(np.count_nonzero(same)),
            "equal_to_rne_of_float64_exp": int(np.count_nonzero(rounded))}


# ---- 2. attention alone

LENGTHS = (256, 1024, 4096)
HEADS = ((2, 1), (8, 2), (16, 8))
HEAD_DIM = 128


@contextlib.contextmanager
def attention_variant(variant):
    """The reference with its p = fn(s - m) and q encoded at q_bits, variant = (fn, q_bits):
    rlportable.contract.attention's module names exp_f32 and Q_BITS swapped (forward and backward both read
    them at call time), then restored."""
    saved = reference.exp_f32, reference.Q_BITS
    reference.exp_f32, reference.Q_BITS = variant
    try:
        yield
    finally:
        reference.exp_f32, reference.Q_BITS = saved


def variant_fns(degrees):
    """name -> (p's exp, q's bits): the contract, the candidate exp at each degree, and q at 15 bits (two
    digits, as k and v: 4 digit products a score instead of 6) with the contract's exp and the candidate's."""
    fns = {"contract": (exp_f32, reference.Q_BITS)}
    for d in degrees:
        fns[f"deg{d}"] = (lambda x, d=d: exp_neg_f32(x, d), reference.Q_BITS)
    fns["q15"] = (exp_f32, Q_BITS_CANDIDATE)
    fns[f"q15_deg{CANDIDATE_DEGREE}"] = (lambda x: exp_neg_f32(x, CANDIDATE_DEGREE), Q_BITS_CANDIDATE)
    return fns


def attention_inputs(length, hq, hkv, outlier=1):
    """outlier > 1: q's channel 0 that many times larger and k's that many times smaller (the scores keep
    their spread), a massive channel of the kind real q rows have, which a row encoding's other channels
    pay for with bits (at 15 bits and outlier 64, about 8 of them)."""
    rng = np.random.default_rng([length, hq, hkv])
    q = (rng.standard_normal((length, hq, HEAD_DIM)) * 2.0).astype(F32)  # scores with spread ~ 4
    k, v = (rng.standard_normal((length, hkv, HEAD_DIM)).astype(F32) for _ in range(2))
    q[..., 0] *= F32(outlier)
    k[..., 0] /= F32(outlier)
    return q, k, v


def decoded(x, bits):
    """The encoded values the contract computes with: integers times 2^(e - (bits - 2))."""
    ints, e = reference.encode_heads(x, bits)
    return ints * np.ldexp(1.0, e - (bits - 2))[..., None]


def torch_attention(q, k, v, dtype):
    """Causal GQA attention, one head at a time (memory), in float64 or as HF's eager bf16 attention (bf16
    operands and products, float32 softmax rounded to bf16). Returns float64 [T, Hq, D]."""
    import torch

    t, hq, d = q.shape
    group = hq // k.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    out = np.empty(q.shape)
    with torch.no_grad():
        for h in range(hq):
            tq, tk, tv = (torch.tensor(np.ascontiguousarray(x), dtype=dtype)
                          for x in (q[:, h], k[:, h // group], v[:, h // group]))
            if dtype == torch.bfloat16:
                scores = (tq @ tk.T).float() / np.sqrt(d)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(dtype)
            else:
                scores = (tq @ tk.T) / np.sqrt(d)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[:, h] = (probs @ tv).double().numpy()
    return out


def errors(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return {"rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(b)), "max_abs": float(np.abs(a - b).max())}


def attention_row(length, hq, hkv, fns, outlier=1):
    import torch

    q, k, v = attention_inputs(length, hq, hkv, outlier)
    cu = np.array([0, length])
    started = time.time()
    exact_raw = torch_attention(q, k, v, torch.float64)
    exact_enc = {bits: torch_attention(decoded(q, bits), decoded(k, reference.K_BITS), decoded(v, reference.V_BITS),
                                       torch.float64) for bits in {b for _, b in fns.values()}}
    bf16 = torch_attention(q, k, v, torch.bfloat16)
    row = {"length": length, "heads": [hq, hkv], "q_outlier": outlier, "bf16": errors(bf16, exact_raw)}
    outs = {}
    for name, variant in fns.items():
        with attention_variant(variant):
            outs[name] = reference.attention_packed_batched(q, k, v, cu)
        row[name] = errors(outs[name], exact_raw)
        row[name]["encoded_f64"] = errors(outs[name], exact_enc[variant[1]])
    plain = reference.attention_packed_batched(q, k, v, cu)  # after the swaps: the contract's own bits
    row["swap_restores_contract"] = bool(np.array_equal(plain.view(np.uint32), outs["contract"].view(np.uint32)))
    row["ratio_to_bf16"] = {name: {m: row[name][m] / row["bf16"][m] for m in ("rel_l2", "max_abs")} for name in fns}
    base = outs["contract"].view(np.uint32)
    row["changed_vs_contract"] = {name: {"fraction_of_outputs": float(np.mean(o.view(np.uint32) != base)),
                                         **errors(o, outs["contract"])}
                                  for name, o in outs.items() if name != "contract"}
    row["seconds"] = round(time.time() - started, 1)
    return row


# ---- 3. whole models


def model_logprobs(arch, lengths, fns):
    import torch

    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from test_model_forward import _hf_logprobs, hf_model_and_ours

    cpu = get_backend("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf, (rl_config, weights, _) = hf_model_and_ours(arch, Path(tmp))  # room for 256 positions
        model = Model(cpu, rl_config, weights)
        tokens = {n: np.random.default_rng(1).integers(0, hf.config.vocab_size, n).astype(np.int32) for n in lengths}
        # _hf_logprobs casts the model in place: every float64 forward before any bf16 one
        exact_all = {n: _hf_logprobs(hf, tokens[n], torch.float64) for n in lengths}
        bf16s = {n: _hf_logprobs(hf, tokens[n], torch.bfloat16) for n in lengths}
        for length in lengths:
            exact, bf16, toks = exact_all[length], bf16s[length], tokens[length]
            row = {"tokens": length, "bf16": float(np.abs(bf16 - exact).max())}
            outs = {}
            for name, variant in fns.items():
                with attention_variant(variant):
                    (outs[name],) = model.logprobs(toks, np.array([0, toks.size]))
                row[name] = float(np.abs(outs[name].astype(np.float64) - exact).max())
            row["ratio_to_bf16"] = {name: row[name] / row["bf16"] for name in fns}
            base = outs["contract"].view(np.uint32)
            row["changed_vs_contract"] = {
                name: {"logprobs_changed": int(np.count_nonzero(o.view(np.uint32) != base)),
                       "max_abs_diff": float(np.abs(o.astype(np.float64) - outs["contract"]).max())}
                for name, o in outs.items() if name != "contract"}
            rows.append(row)
    return rows


def model_gradients(arch, fns):
    """scripts/measure_attention_backward_bits.py's model errors with attention's exp swapped."""
    from rlportable.model import backward
    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from test_model_backward import _rel_error, gradient_case, torch_gradients
    from test_model_forward import hf_model_and_ours

    cpu = get_backend("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        hf, (rl_config, weights, _) = hf_model_and_ours(arch, Path(tmp))
        tokens, cu, rows, g = gradient_case(hf.config.vocab_size)
        exact, bf16 = torch_gradients(hf, tokens, cu, rows, g)
        row = {"bf16": max(_rel_error(bf16[n], r) for n, r in exact.items())}
        for name, variant in fns.items():
            with attention_variant(variant):
                model = Model(cpu, rl_config, weights, trainable=True)
                fwd = backward.forward(model, tokens, cu, rows=rows)
                grads = backward.backward(model, fwd, g).named_tensors(rl_config)
            row[name] = max(_rel_error(grads[n], r) for n, r in exact.items())
        row["ratio_to_bf16"] = {name: row[name] / row["bf16"] for name in fns}
    return row


# ---- the coefficients (--fit)


def fit_coefficients(degree):
    """COEFFICIENTS[degree] again: a weighted minimax fit (scipy's linprog on 12,000 points), the binary32
    rounding one coefficient at a time from c1 with the rest refitted, then a local search."""
    from scipy.optimize import linprog

    a = FIT_HALF_WIDTH

    def fit(fixed):
        r = np.concatenate([np.cos(np.linspace(0, np.pi, 6000)) * a, np.linspace(-a, a, 6000)])
        e = np.exp(r)
        w = np.where(e < 1, 2.0**24, 2.0**23)  # 1 / ulp of the result
        free = [k for k in range(1, degree + 1) if k not in fixed]
        base = (1 + sum(c * r**k for k, c in fixed.items()) - e) * w
        m = np.stack([r**k * w for k in free], 1)
        cost = np.zeros(len(free) + 1)
        cost[-1] = 1
        bound = np.block([[m, -np.ones((r.size, 1))], [-m, -np.ones((r.size, 1))]])
        res = linprog(cost, A_ub=bound, b_ub=np.concatenate([-base, base]), bounds=[(None, None)] * (len(free) + 1),
                      method="highs")
        return dict(zip(free, res.x[:-1]))

    fixed = {}
    for k in range(1, degree + 1):
        fixed[k] = float(F32(fit(fixed)[k]))
    coef = [F32(fixed[k]) for k in range(1, degree + 1)]
    rng = np.random.default_rng(1)
    rs = np.concatenate([rng.uniform(-a, a, 3_000_000), np.linspace(-a, a, 1_000_001)]).astype(F32)

    def worst(c):
        p = np.full(rs.shape, c[-1], dtype=F32)
        for ci in c[-2::-1]:
            p = p * rs + ci
        return float(ulp_error(rs, p * rs + F32(1.0))[0].max())

    best = worst(coef)
    for _ in range(3):
        improved = False
        for i in range(degree):
            for step in [s for s in range(-4, 5) if s]:
                trial = list(coef)
                trial[i] = np.array(int(np.array(coef[i]).view(np.uint32)) + step, dtype=np.uint32).view(F32)[()]
                u = worst(trial)
                if u < best:
                    best, coef, improved = u, trial, True
        if not improved:
            break
    return [hex32(c) for c in coef], best


def hex32(value):
    """A binary32 value as the shortest hex literal (0x1.0ebb72p-7)."""
    mantissa, exponent = float(value).hex().split("p")
    return (mantissa.rstrip("0").rstrip(".") if "." in mantissa else mantissa) + "p" + exponent


def machine():
    import torch

    return {**host(), "torch": torch.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sampled ulps, short attention, one model")
    parser.add_argument("--fit", action="store_true", help="print the coefficients' fit and exit")
    args = parser.parse_args()
    if args.fit:
        fits = {d: fit_coefficients(d) for d in COEFFICIENTS}
        print(json.dumps({d: {"coefficients": c, "max_ulps_horner": u,
                              "equal_to_COEFFICIENTS": [float.fromhex(a) for a in c]
                              == [float.fromhex(b) for b in COEFFICIENTS[d]]} for d, (c, u) in fits.items()}, indent=1))
        return
    started = time.time()
    degrees = sorted(COEFFICIENTS)
    fns = variant_fns(degrees)
    result = {
        "what": ("a float32-only exp for attention's p = exp(s - m) against the contract's correctly rounded "
                 "exp_f32: the candidate's ulps, attention's output error and the models' log-prob and "
                 "gradient errors, each beside bf16's"),
        "quick": args.quick,
        "candidate": {
            "name": "exp_neg_f32", "degree": CANDIDATE_DEGREE, "domain": "x <= 0 and NaN",
            "formula": ("xc = fmax(x, -104); y = RN(RN(xc * LOG2E) + 0x1.8p23); nf = y - 0x1.8p23; "
                        "r = RN(RN(xc - RN(nf * LN2_HI)) - RN(nf * LN2_LO)); p = Horner(c, r) with RN at each "
                        "multiply and add, + 1 last; e = RN(RN(p * bits((bits(y) << 23) + (152 << 23))) * 2^-25); "
                        "NaN x -> 0x7FC00000"),
            "constants": {"X_MIN": "-0x1.ap+6", "LOG2E": "0x1.715476p+0", "SHIFT": "0x1.8p+23",
                          "LN2_HI": "0x1.62e4p-1", "LN2_LO": "0x1.7f7d1cp-20", "UNSCALE": "0x1p-25",
                          "SCALE_BITS": hex(int(SCALE_BITS))},
            "coefficients_c1_up": {str(d): list(c) for d, c in COEFFICIENTS.items()},
            "gpu_instructions": {str(d): n for d, n in INSTRUCTIONS.items()},
            "gpu_instructions_note": ("1 max, 3 for n (mul, add, sub), 4 for r, 2 per degree (Horner, no fma), "
                                      "1 integer shift-add for 2^(n+25), 2 multiplies; + 2 (compare, select) "
                                      "where NaN can come, never in attention (m = +-inf rows are poisoned "
                                      "first). Today's exp_f32: about 45 with 3 slow conversions"),
        },
    }
    with multiprocessing.Pool(2) as pool:
        stride = SAMPLE_STRIDE if args.quick else 1
        result["ulps"] = {"candidate": ulp_survey(CANDIDATE_DEGREE, stride, pool),
                          "other_degrees": {str(d): ulp_survey(d, SAMPLE_STRIDE, pool)
                                            for d in degrees if d != CANDIDATE_DEGREE}}
    print(f"ulps done {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    result["provenance"] = {**provenance(), **machine()}  # imports torch: after the pool's fork
    result["ulps"]["special_inputs"] = special_inputs()
    result["ulps"]["contract_agreement_sample"] = contract_agreement_sample(SAMPLE_STRIDE)
    lengths = LENGTHS[:2] if args.quick else LENGTHS
    heads = HEADS[:2] if args.quick else HEADS
    result["attention"] = {
        "what": ("forward output o against float64 attention of the raw inputs (rel_l2 = ||o - o64|| / ||o64||, "
                 "max_abs), and against float64 of the contract's encoded inputs (encoded_f64); bf16: torch, "
                 "bf16 operands and products, float32 softmax rounded to bf16; the variants: the reference "
                 "with p = contract exp_f32 or the candidate scheme at degree 3-6, and q at 15 bits (q15, q15_deg5; their encoded_f64 against float64 of q at 15 bits); one sequence, head_dim "
                 f"{HEAD_DIM}, q ~ 2 N(0, 1), k, v ~ N(0, 1)"),
        "rows": []}
    for length in lengths:
        for hq, hkv in heads:
            result["attention"]["rows"].append(attention_row(length, hq, hkv, fns))
            print(f"attention T={length} heads {hq}/{hkv} done {time.time() - started:.0f} s", file=sys.stderr,
                  flush=True)
    for outlier in OUTLIERS:  # a massive q channel: what q's 15 bits would cost
        result["attention"]["rows"].append(attention_row(LENGTHS[1], *HEADS[1], fns, outlier))
    archs = ("qwen3", "qwen2", "llama")
    model_lengths = (96,) if args.quick else (96, 256)
    result["models"] = {
        "what": ("random-weight test models (tests/test_model_forward.py; 2 layers, hidden 64, 4 q / 2 kv heads): "
                 "logprobs: max abs log-prob error against HF float64 (rule: ratio_to_bf16 <= 0.05); gradients: "
                 "worst relative L2 error over the weight tensors against float64 autograd, two packed "
                 "sequences of 17 and 23 tokens (rule: <= 0.1)"),
        **{arch: {"logprobs": model_logprobs(arch, model_lengths, fns), "gradients": model_gradients(arch, fns)}
           for arch in archs}}
    result["seconds"] = round(time.time() - started, 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
