"""The backward of exact causal GQA attention (contracts/attention.toml, op "attention_backward") on
the cpu backend: the exact wide sums, accuracy against float64 gradients (analytic, torch autograd,
central finite differences), the op against the reference bitwise, position-only ordering, NaN
propagation and input errors.

The device kernels are checked against the same reference, bitwise, by `rlportable conform`
(rlportable/conform/attention.py, the attention.backward_* checks); their sources compile in
tests/test_kernel_sources.py.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import attention as ref, fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops import attention as op
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
# (Hq, Hkv, D): GQA 2:1 and 4:1, multi-head, a ragged head_dim
HEADS = [(8, 4, 64), (8, 2, 128), (4, 4, 40), (6, 3, 40)]


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def inputs(rng, tokens, hq, hkv, d, kind="normal"):
    def rows(heads):
        return random_rows(rng, tokens * heads, d, kind).reshape(tokens, heads, d)

    return rows(hq), rows(hkv), rows(hkv), rows(hq)


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def dequantize(x, bits_):
    t, h, d = x.shape
    qi, e = fp.quantize_rows(x.reshape(t * h, d), bits_)
    return (qi * np.ldexp(1.0, e.astype(np.int64) - (bits_ - 2))[:, None]).reshape(t, h, d)


# ---- the exact wide sums: one correct rounding, any accumulation order


def rne_f32(x: Fraction) -> np.float32:
    """The float32 nearest to an exact rational (ties to even, overflow to inf): the definition."""
    if x == 0:
        return np.float32(0.0)
    sign, mag = (-1 if x < 0 else 1), abs(x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    n, rest = divmod(mag, ulp)
    if rest > ulp / 2 or (rest == ulp / 2 and n % 2 == 1):
        n += 1
    value = n * ulp
    if value >= Fraction(2) ** 128:
        return np.float32(sign * np.inf)
    return np.float32(sign * float(value))


def test_block_weighted_sum_follows_its_definition_exactly():
    """block_weighted_sum against the definition in exact rationals: per block, E from the largest
    exponent field, U = RNE(u 2^(13 - E)), the exact integer partial, then float64 adds in block order
    from +0 and one float32 rounding; blocks of mixed magnitudes, zeros, and a tie in U."""
    rng = np.random.default_rng(0)
    n_out, d = 5, 3
    blocks = []
    for scale in (1.0, 2.0**-30, 2.0**20, 0.0, 3.0):
        u = rng.normal(size=(n_out, 64)) * scale
        u[0, :3] = [1.5 * 2.0**-13, 2.5 * 2.0**-13, 1.0]  # ties at the coefficient unit: RNE to even
        rows = rng.integers(-(2**22 - 1), 2**22, (64, d))
        blocks.append((u, rows))
    got = ref.block_weighted_sum(blocks, 23, (n_out, d))
    for i in range(n_out):
        for c in range(d):
            acc = 0.0
            for u, rows in blocks:
                row = u[i]
                largest = max(abs(x) for x in row)
                e = int(np.floor(np.log2(largest))) if largest > 0 else 0
                big_u = [round(Fraction(float(x)) * Fraction(2) ** (13 - e)) for x in row]  # Python: half to even
                exact = sum(bu * int(r) for bu, r in zip(big_u, rows[:, c]))
                acc = acc + float(Fraction(exact) * Fraction(2) ** (e - 13 - 21))  # exact, then one float64 add
            assert bits(got[i, c]) == bits(np.float32(acc)), (i, c)


# ---- float64 gradients of softmax attention (the analytic formulas), checked by torch and by finite differences


def attention_terms_f64(q, k, v, do):
    """Per head: float64 softmax attention of one sequence and its gradient pieces.
    Returns (dq, dk, dv, parts) with parts[h] = dict(P, dP, delta, o, s)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    n, hq, d = q.shape
    group = hq // k.shape[1]
    c = 1.0 / np.sqrt(d)
    allowed = np.tril(np.ones((n, n), bool))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    parts = []
    for h in range(hq):
        g = h // group
        s = np.where(allowed, q[:, h] @ k[:, g].T * c, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        big_p = p / p.sum(axis=1, keepdims=True)
        o = big_p @ v[:, g]
        d_p = do[:, h] @ v[:, g].T
        delta = (do[:, h] * o).sum(axis=1)
        d_s = big_p * (d_p - delta[:, None]) * c
        dq[:, h] = d_s @ k[:, g]
        dk[:, g] += d_s.T @ q[:, h]
        dv[:, g] += big_p.T @ do[:, h]
        parts.append(dict(P=big_p, dP=d_p, delta=delta, o=o, s=np.where(allowed, s, 0.0)))
    return dq, dk, dv, parts


def attention_loss_f64(q, k, v, do) -> float:
    """sum(do * o) of float64 softmax attention: its gradient is the backward of o for do."""
    return float(sum((np.asarray(do[:, h], np.float64) * part["o"]).sum()
                     for h, part in enumerate(attention_terms_f64(q, k, v, do)[3])))


def test_float64_gradient_formulas_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v, do = inputs(rng, 23, 6, 2, 40)
    dq, dk, dv, _ = attention_terms_f64(q, k, v, do)
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    group = 3
    keys = tk.repeat_interleave(group, dim=1)
    values = tv.repeat_interleave(group, dim=1)
    s = torch.einsum("thd,jhd->htj", tq, keys) / np.sqrt(40)
    s = s.masked_fill(~torch.tril(torch.ones(23, 23, dtype=torch.bool)), float("-inf"))
    o = torch.einsum("htj,jhd->thd", torch.softmax(s, dim=-1), values)
    (o * torch.tensor(do, dtype=torch.float64)).sum().backward()
    for mine, theirs in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        # both are float64 evaluations of the same formula: differences are a few float64 ulps
        assert np.allclose(mine, theirs.numpy(), rtol=1e-12, atol=1e-12 * np.abs(mine).max())


def test_float64_gradient_formulas_match_central_differences():
    rng = np.random.default_rng(3)
    q, k, v, do = (x.astype(np.float64) for x in inputs(rng, 9, 4, 2, 8))
    grads = attention_terms_f64(q, k, v, do)[:3]
    step = 1e-5
    for which, (x, grad) in enumerate(zip((q, k, v), grads)):
        for index in zip(*(rng.integers(0, n, 6) for n in x.shape)):
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][index] += step
            minus[which][index] -= step
            numeric = (attention_loss_f64(*plus, do) - attention_loss_f64(*minus, do)) / (2 * step)
            # central differences: truncation O(step^2 |f'''|) ~ 1e-10, cancellation ~ 1e-16 |f| / step ~ 1e-10
            assert abs(numeric - grad[index]) <= 1e-8, (which, index, numeric, grad[index])


# ---- accuracy of the contract's gradients


def contract_error_bounds(q, k, v, do):
    """First-order bounds on |contract gradient - float64 gradient of the ENCODED inputs|, elementwise.

    With the inputs encoded (q, do: 23 bits; k, v: 15 bits) the dot products are exact, so only
    the contract's own roundings remain:
      * P_j: the float32 score s_j (2^-24 relative, after a float64 product) and m move s_j - m by
        at most 4 max|s| 2^-24, the correctly rounded exp adds 2^-24 relative (<= 2^-23 counted), so
        p_j = p*_j e^eta_j with |eta_j| <= (4 max|s| + 2) 2^-24; L counts p in units of 2^-21, off by at
        most n/2 units over a sum >= 1: |P_j / P*_j - 1| <= eps_P = (8 max|s| + 4) 2^-24 + n 2^-22.
      * delta reads the forward's float32 o; its products do_d o_d are exact and kept to 53 bits
        below the largest (2^-52 of it per term, then one float64 rounding):
        |delta - delta*| <= D_delta = sum_d |do_d| |o_d - o*_d| + (D + 1) 2^-52 max_d |do_d o_d|.
      * dP is exact; dS = P (dP - delta) c rounds three times in float64 (2^-53, negligible):
        |dS_j - dS*_j| <= c P*_j (eps_P |dP*_j - delta*| + D_delta).
      * each weighted sum: the coefficients quantized to 15 bits below their block's largest lose at
        most 2^-14 of it per term (here bounded by the largest |u_i| = |coefficient_i| 2^e_i <=
        |coefficient_i| max|row_i| of the whole sum); the float64 adds of the block partials 2^-53 of the
        running sum each; then one float32 rounding.
    Returns (bound_dq, bound_dk, bound_dv) and the float64 gradients of the encoded inputs."""
    qd, kd, vd, dod = dequantize(q, 23), dequantize(k, 15), dequantize(v, 15), dequantize(do, 23)
    n, hq, d = q.shape
    group = hq // k.shape[1]
    c = 1.0 / np.sqrt(d)
    o_contract = ref.attention(q, k, v, np.arange(n)).astype(np.float64)
    dq, dk, dv, parts = attention_terms_f64(qd, kd, vd, dod)
    bound_dq, bound_dk, bound_dv = np.zeros_like(dq), np.zeros_like(dk), np.zeros_like(dv)
    keys = np.arange(1, n + 1, dtype=np.float64)
    quant_dk, quant_dv = np.zeros(k.shape[:2]), np.zeros(k.shape[:2])
    sum_dk, sum_dv = np.zeros(k.shape), np.zeros(k.shape)  # sums of |terms|: the float64 adds' error scale
    for h, part in enumerate(parts):
        g = h // group
        big_p, d_p, delta = part["P"], part["dP"], part["delta"]
        eps_p = (8 * np.abs(part["s"]).max(axis=1) + 4) * 2.0**-24 + keys * 2.0**-22
        products = np.abs(dod[:, h] * o_contract[:, h])
        d_delta = (np.abs(dod[:, h]) * np.abs(o_contract[:, h] - part["o"])).sum(axis=1) \
            + (d + 1) * 2.0**-52 * products.max(axis=1)
        ds_err = c * big_p * (eps_p[:, None] * np.abs(d_p - delta[:, None]) + d_delta[:, None])
        d_s = big_p * (d_p - delta[:, None]) * c
        p_err = eps_p[:, None] * big_p
        kmax, qmax = np.abs(kd[:, g]).max(axis=1), np.abs(qd[:, h]).max(axis=1)
        domax = np.abs(dod[:, h]).max(axis=1)
        bound_dq[:, h] = ds_err @ np.abs(kd[:, g]) + keys[:, None] * 2.0**-14 * (np.abs(d_s) * kmax).max(axis=1)[:, None] \
            + 2.0**-52 * (np.abs(d_s) @ np.abs(kd[:, g]))
        bound_dk[:, g] += ds_err.T @ np.abs(qd[:, h])
        bound_dv[:, g] += p_err.T @ np.abs(dod[:, h])
        sum_dk[:, g] += np.abs(d_s).T @ np.abs(qd[:, h])
        sum_dv[:, g] += big_p.T @ np.abs(dod[:, h])
        quant_dk[:, g] = np.maximum(quant_dk[:, g], (np.abs(d_s) * qmax[:, None]).max(axis=0))
        quant_dv[:, g] = np.maximum(quant_dv[:, g], (big_p * domax[:, None]).max(axis=0))
    pairs = (n - np.arange(n))[:, None] * group  # terms of dk_j and dv_j
    bound_dk += (pairs * 2.0**-14 * quant_dk)[:, :, None] + 2.0**-52 * sum_dk
    bound_dv += (pairs * 2.0**-14 * quant_dv)[:, :, None] + 2.0**-52 * sum_dv
    bounds = [b + np.abs(x) * 2.0**-24 for b, x in ((bound_dq, dq), (bound_dk, dk), (bound_dv, dv))]
    return bounds, (dq, dk, dv)


@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("kind", ["normal", "massive"])
def test_reference_within_derived_bounds_of_float64_gradients(hq, hkv, d, kind):
    rng = np.random.default_rng(hq * 1000 + d + (kind == "massive"))
    n = 70
    q, k, _, _ = inputs(rng, n, hq, hkv, d)
    q *= np.float32(2.0)  # peakier softmax than unit scores
    # massive: v and do with one channel 25,000x the rest (massive q, k would give scores ~1e8: a
    # one-hot softmax that any 15-bit encoding of k may flip, so no bound near the originals holds)
    v = random_rows(rng, n * hkv, d, kind).reshape(n, hkv, d)
    do = random_rows(rng, n * hq, d, kind).reshape(n, hq, d)
    got = ref.attention_backward(q, k, v, do, np.arange(n))
    bounds, exact = contract_error_bounds(q, k, v, do)
    for name, g, b, x in zip(("dq", "dk", "dv"), got, bounds, exact):
        err = np.abs(g.astype(np.float64) - x)
        # first-order bounds: 1% slack for the neglected second-order terms
        assert (err <= 1.01 * b + 1e-37).all(), (name, (err / (b + 1e-37)).max())
    if kind != "normal":
        # A massive channel in v: the forward's 15-bit v rows keep the small channels only to
        # 2^-14 of the massive one, so dP = do . v_j moves by up to |do|_1 max|v_j| 2^-14 against the
        # original inputs. That is the forward contract's encoding (the function being
        # differentiated), bounded above for every kind; no norm bound near the originals applies.
        return
    # against the ORIGINAL float32 inputs the 15-bit k and v (2^-14 of a row's largest) dominate;
    # in norm the gradients stay far inside bf16 resolution (2^-8 relative)
    original = attention_terms_f64(q, k, v, do)[:3]
    for g, x in zip(got, original):
        assert np.abs(g - x).max() <= 2.0**-10 * np.abs(x).max()


def test_reference_matches_central_differences_at_the_encoded_inputs():
    """Finite differences of float64 attention (of the encoded inputs, so only the contract's own
    roundings separate the two), at sampled coordinates, within the derived bound plus the
    differences' own error (<= 1e-8, see test_float64_gradient_formulas_match_central_differences)."""
    rng = np.random.default_rng(5)
    n, hq, hkv, d = 17, 4, 2, 40
    q, k, v, do = inputs(rng, n, hq, hkv, d)
    got = ref.attention_backward(q, k, v, do, np.arange(n))
    bounds, _ = contract_error_bounds(q, k, v, do)
    point = [dequantize(q, 23), dequantize(k, 15), dequantize(v, 15)]
    dod = dequantize(do, 23)
    step = 1e-5
    for which in range(3):
        for index in zip(*(rng.integers(0, size, 8) for size in point[which].shape)):
            plus, minus = [a.copy() for a in point], [a.copy() for a in point]
            plus[which][index] += step
            minus[which][index] -= step
            numeric = (attention_loss_f64(*plus, dod) - attention_loss_f64(*minus, dod)) / (2 * step)
            assert abs(got[which][index] - numeric) <= 1.01 * bounds[which][index] + 1e-8


# ---- the op on cpu, bitwise, and position-only ordering


@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_op_equals_reference_and_packing_does_not_matter(hq, hkv, d):
    rng = np.random.default_rng(hq * 10 + d)
    lengths = [1, 7, 33, 20]
    cu = cu_of(lengths)
    q, k, v, do = inputs(rng, int(cu[-1]), hq, hkv, d, "massive")
    grads = op.attention_packed_backward(CPU, q, k, v, do, cu)
    for seq, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        alone = ref.attention_backward(q[a:b], k[a:b], v[a:b], do[a:b], np.arange(b - a))
        for got, want in zip(grads, alone):
            assert same_bits(got[a:b], want), seq
    # the forward's own output passed in: the same bits
    o = op.attention_packed(CPU, q, k, v, cu)
    for got, want in zip(op.attention_packed_backward(CPU, q, k, v, do, cu, o=o), grads):
        assert same_bits(got, want)


def test_position_in_batch():
    rng = np.random.default_rng(6)
    hq, hkv, d, n = 4, 2, 40, 30
    q, k, v, do = inputs(rng, n, hq, hkv, d)
    alone = op.attention_packed_backward(CPU, q, k, v, do, [0, n])
    for before, after in (([5], [9]), ([1, 17, 3], []), ([], [2, 2])):
        lengths = before + [n] + after
        pq, pk, pv, pdo = inputs(rng, sum(lengths), hq, hkv, d)
        at = sum(before)
        pq[at:at + n], pk[at:at + n], pv[at:at + n], pdo[at:at + n] = q, k, v, do
        packed = op.attention_packed_backward(CPU, pq, pk, pv, pdo, cu_of(lengths))
        for got, want in zip(packed, alone):
            assert same_bits(got[at:at + n], want)


def test_positions_subset_only_sum_the_given_queries():
    """attention_backward for queries at some positions: dk, dv sum only those queries' terms,
    keys beyond every query get +0, and the given rows' dq equal the full sequence's."""
    rng = np.random.default_rng(7)
    n, hq, hkv, d = 20, 4, 2, 16
    q, k, v, do = inputs(rng, n, hq, hkv, d)
    full = ref.attention_backward(q, k, v, do, np.arange(n))
    rows = np.array([0, 3, 11])
    dq, dk, dv = ref.attention_backward(q[rows], k, v, do[rows], rows)
    assert same_bits(dq, full[0][rows])
    assert (bits(dk[12:]) == 0).all() and (bits(dv[12:]) == 0).all()
    zero_do = do.copy()
    zero_do[np.setdiff1d(np.arange(n), rows)] = 0.0
    dq0, dk0, dv0 = ref.attention_backward(q, k, v, zero_do, np.arange(n))
    assert same_bits(dv, dv0)  # a zero do row contributes exactly 0 (P_tj do_t = 0)


def test_zero_gradient_is_positive_zero_and_tiny_values_survive():
    rng = np.random.default_rng(8)
    q, k, v, do = inputs(rng, 9, 4, 2, 8)
    grads = op.attention_packed_backward(CPU, q, k, v, np.zeros_like(do), [0, 9])
    assert all((bits(g) == 0).all() for g in grads)
    tiny = op.attention_packed_backward(CPU, q, k, v, (do * np.float32(1e-40)).astype(np.float32), [0, 9])
    assert all(np.isfinite(g).all() for g in tiny) and (tiny[2] != 0).any()  # subnormal do: dv ~ 1e-40


# ---- non-finite inputs


def _poison_case(case, q, k, v, do):
    """Put one non-finite value in; return the expected NaN masks (dq [n, hq], dk/dv [n, hkv]).
    n = 12, hq = 4, hkv = 2: heads 0, 1 use kv head 0, heads 2, 3 kv head 1."""
    n = q.shape[0]
    nan_q, nan_kv = np.zeros((n, 4), bool), np.zeros((n, 2), bool)
    if case == "q":
        q[2, 1, 0] = np.nan
        nan_q[2, 1], nan_kv[:3, 0] = True, True
    elif case == "k":
        k[5, 1, 3] = -np.inf  # rows t >= 5 of heads 2, 3 are NaN in the forward
        nan_q[5:, 2:], nan_kv[:, 1] = True, True
    elif case == "v":
        v[8, 0, 3] = np.nan
        nan_q[8:, :2], nan_kv[:, 0] = True, True
    elif case in ("do_nan", "do_inf"):
        do[4, 3, 7] = np.nan if case == "do_nan" else np.inf
        nan_q[4, 3], nan_kv[:5, 1] = True, True
    return nan_q, nan_kv


@pytest.mark.parametrize("case", ["q", "k", "v", "do_nan", "do_inf"])
def test_nonfinite_rows_give_canonical_nan_exactly_where_defined(case):
    rng = np.random.default_rng(9)
    q, k, v, do = inputs(rng, 12, 4, 2, 16)
    nan_q, nan_kv = _poison_case(case, q, k, v, do)
    dq, dk, dv = op.attention_packed_backward(CPU, q, k, v, do, [0, 12])
    for grad, mask in ((dq, nan_q), (dk, nan_kv), (dv, nan_kv)):
        assert np.array_equal(np.isnan(grad).any(axis=2), mask)
        assert (bits(grad[mask]) == 0x7FC00000).all() and np.isfinite(grad[~mask]).all()


def test_overflowing_scores_poison_every_row():
    big, big_kv = np.full((3, 2, 4), 3e38, np.float32), np.full((3, 1, 4), 3e38, np.float32)
    for grad in op.attention_packed_backward(CPU, big, big_kv, big_kv, np.ones_like(big), [0, 3]):
        assert (bits(grad) == 0x7FC00000).all()


# ---- input checks name the tensor and its shape


def test_bad_inputs_name_the_tensor():
    q, k, v = np.zeros((5, 4, 16), np.float32), np.zeros((5, 2, 16), np.float32), np.zeros((5, 2, 16), np.float32)
    do = np.zeros_like(q)
    name = "attention_packed_backward"
    with pytest.raises(InputError, match=rf"{name}: do must have the shape of q \(5, 4, 16\), got \(5, 4, 8\)"):
        op.attention_packed_backward(CPU, q, k, v, np.zeros((5, 4, 8), np.float32), [0, 5])
    with pytest.raises(InputError, match=r"do must have dtype float32, got float64 \(shape \(5, 4, 16\)\)"):
        op.attention_packed_backward(CPU, q, k, v, do.astype(np.float64), [0, 5])
    with pytest.raises(InputError, match=rf"{name}: o must have the shape of q"):
        op.attention_packed_backward(CPU, q, k, v, do, [0, 5], o=np.zeros((4, 4, 16), np.float32))
    with pytest.raises(InputError, match=rf"{name}: q's 4 heads are not a multiple of k's 3 kv heads"):
        op.attention_packed_backward(CPU, q, np.zeros((5, 3, 16), np.float32), np.zeros((5, 3, 16), np.float32),
                                     do, [0, 5])
    with pytest.raises(InputError, match=rf"{name}: v must have the shape of k"):
        op.attention_packed_backward(CPU, q, k, np.zeros((5, 2, 8), np.float32), do, [0, 5])
    with pytest.raises(InputError, match=rf"{name}: cu_seqlens must rise from 0 to the 5 packed tokens"):
        op.attention_packed_backward(CPU, q, k, v, do, [0, 3])
    with pytest.raises(InputError, match=rf"{name}: threads must be an integer in \[1, 1024\]"):
        op.attention_packed_backward(CPU, q, k, v, do, [0, 5], threads=0)
    with pytest.raises(InputError, match=r"C-contiguous"):
        op.attention_packed_backward(CPU, q, k, v, np.zeros((5, 16, 4), np.float32).transpose(0, 2, 1), [0, 5])
    with pytest.raises(InputError, match=rf"{name}: head_dim 600"):
        wide = np.zeros((1, 1, 600), np.float32)
        op.attention_packed_backward(CPU, wide, wide, wide, wide, [0, 1])
    many = np.zeros((0, 2**15, 1), np.float32)
    with pytest.raises(InputError, match=rf"{name}: 32768 q heads over 1 kv heads exceed the contract's group limit"):
        op.attention_packed_backward(CPU, many, np.zeros((0, 1, 1), np.float32), np.zeros((0, 1, 1), np.float32),
                                     many, [0])
    empty = op.attention_packed_backward(CPU, np.zeros((0, 4, 16), np.float32), np.zeros((0, 2, 16), np.float32),
                                         np.zeros((0, 2, 16), np.float32), np.zeros((0, 4, 16), np.float32), [0])
    assert [g.shape for g in empty] == [(0, 4, 16), (0, 2, 16), (0, 2, 16)]


def test_backward_kernels_are_in_the_contract():
    from rlportable.contract.spec import load_all

    contract = next(c for c in load_all() if c.name == "attention")
    backward = next(o for o in contract.ops if o.name == "attention_backward")
    assert backward.kernels == ["attention_backward_rows", "attention_backward_dq", "attention_backward_dkv"]
    assert backward.reference == "attention_backward"


# ---- the device path's launches agree with the kernels' signatures (no GPU needed)

_POINTER_DTYPES = {"float": np.float32, "double": np.float64, "int": np.int32, "long long": np.int64,
                   "signed char": np.int8, "unsigned int": np.uint32, "unsigned long long": np.uint64}


def _expand_tiled_entries(text: str, prefix: str) -> str:
    """The source with one set of tiled entry macros written out (PREFIX_ENTRIES(DP, names...); RLP_ATTT:
    the portable kernels, RLP_ATTD: CUDA's tensor-core ones), their argument-list macros expanded."""
    import re

    text = text.replace("\\\n", " ")
    lists = {name: re.search(rf"#define {name}(.*)", text).group(1) for name in ("RLP_ATTT_QUERY_ARGS", "RLP_ATTT_KEY_ARGS")}
    params, body = re.search(rf"#define {prefix}_ENTRIES\(([^)]*)\)(.*)", text).groups()
    params = [p.strip() for p in params.split(",")]
    body = re.sub(r"__launch_bounds__\([^)]*\) ", "", body)
    for name, expansion in lists.items():
        body = body.replace(name, expansion)
    entries = ""
    for call in re.findall(rf"^{prefix}_ENTRIES\(([^)]*)\)", text, re.M):
        names = [c.strip() for c in call.split(",")]
        entries += re.sub(r"\b(" + "|".join(params) + r")\b", lambda m: names[params.index(m.group(1))], body)
    return text + entries


def _kernel_parameters(vendor: str) -> dict[str, list[tuple[str, bool]]]:
    """kernel name -> [(C type, is_pointer)] parsed from the attention source `vendor` compiles."""
    import re

    from rlportable.resources import assemble_text, kernel_source_path

    path = kernel_source_path(vendor, "attention")
    text = assemble_text(path.read_text(), folder=path.parent)
    text = _expand_tiled_entries(text, "RLP_ATTT") + (_expand_tiled_entries(text, "RLP_ATTD") if vendor == "cuda" else "")
    kernels = {}
    for name, params in re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:(?:RLP_LAUNCH_BOUNDS|__launch_bounds__)\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)', text):
        parsed = []
        for param in params.split(","):
            words = param.replace("__restrict__", "").replace("const", "").split()
            pointer = "*" in param
            parsed.append((" ".join(w.strip("*") for w in words[:-1] if w.strip("*")), pointer))
        kernels[name] = parsed
    return kernels


class _RecordingDevice(CPU.__class__):
    """A cpu backend that claims to run CUDA (or HIP) sources and records launches instead of running them."""

    label = "fake-cuda"  # a plain attribute, shadowing the backend's property, so __init__ can set it
    on_host = False  # as a GPU: the op's choices are a GPU's

    def __init__(self, vendor: str = "cuda"):
        self.kernel_vendor = vendor
        self.label = f"fake-{vendor}"
        self.launches = []

    def launch(self, family, kernel, grid, block, args, shared_mem=0):
        self.launches.append((family, kernel, grid, block, args))


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_backward_launches_match_kernel_signatures(vendor):
    device = _RecordingDevice()
    rng = np.random.default_rng(10)
    q, k, v, do = inputs(rng, 11, 6, 2, 40)
    o = ref.attention(q, k, v, np.arange(11))
    op.attention_packed_backward(device, q, k, v, do, [0, 4, 11], o=o, threads=64, method="rows")
    signatures = _kernel_parameters(vendor)
    launched = [launch[1] for launch in device.launches]
    assert launched == ["attention_write_kv", "attention_backward_rows", "attention_backward_dq",
                        "attention_backward_dkv"]
    _check_arguments(device.launches, signatures)
    for _, kernel, grid, block, args in device.launches:
        assert block == (64,) or kernel == "attention_write_kv"
    rows_grid, dkv_grid = device.launches[1][2], device.launches[3][2]
    assert rows_grid == (11 * 6,) and dkv_grid == (11 * 2,)


def _check_arguments(launches, signatures) -> None:
    for _, kernel, grid, block, args in launches:
        params = signatures[kernel]
        assert len(args) == len(params), kernel
        for arg, (ctype, pointer) in zip(args, params):
            want = _POINTER_DTYPES[ctype]
            if pointer:
                assert isinstance(arg, np.ndarray) and arg.dtype == want and arg.flags.c_contiguous, (kernel, ctype)
            else:
                assert isinstance(arg, np.generic) and arg.dtype == want, (kernel, ctype, type(arg))


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
@pytest.mark.parametrize("dim,dpt", [(40, 64), (128, 128), (200, 256)])
def test_tiled_backward_launches_match_kernel_signatures(vendor, dim, dpt):
    """The tiled path ("auto" on GPU sources): its launches, their arguments against that vendor's
    kernels' signatures, and grids from that vendor's plan."""
    device = _RecordingDevice(vendor)
    rng = np.random.default_rng(11)
    q, k, v, do = inputs(rng, 75, 6, 2, dim)
    o = ref.attention(q, k, v, np.arange(75))
    cu = np.array([0, 4, 75])
    op.attention_packed_backward(device, q, k, v, do, cu, o=o)
    launched = [launch[1] for launch in device.launches]
    steps = "attention_backward_mma" if vendor == "cuda" else "attention_backward_tiled"  # CUDA: tensor cores
    # CUDA's dq and dkv copy digit tiles of q, do, k and v, written once per call
    digits = ["attention_backward_mma_digits"] * 4 if vendor == "cuda" else []
    assert launched == ["attention_write_kv", "attention_backward_tiled_keys", "attention_backward_tiled_rows",
                        f"{steps}_stats_d{dpt}"] + digits + [f"{steps}_{step}_d{dpt}" for step in ("dq", "dkv")]
    blocks = sum(-(-n // ref.BLOCK) for n in np.diff(cu))  # 64-position blocks: 1 + 2
    assert [launch[2] for launch in device.launches if launch[1] == "attention_backward_mma_digits"] == (
        [(blocks, 6), (blocks, 6), (blocks, 2), (blocks, 2)] if digits else [])
    _check_arguments(device.launches, _kernel_parameters(vendor))
    q_tiles, key_tiles = op.tiled_plan(cu, dpt, vendor)
    grids = {launch[1]: launch[2] for launch in device.launches}
    assert grids[f"{steps}_dq_d{dpt}"] == (q_tiles.shape[0], 6)
    assert grids[f"{steps}_dkv_d{dpt}"] == (key_tiles.shape[0], 2)
    for _, name, _, block, _ in device.launches:
        if name[-1].isdigit():
            assert block == (op.tiled_threads(dpt, name.split("_")[-2], vendor),), name


def test_tiled_plan_covers_every_pair_once():
    """Every (query row, key) pair j <= t of every sequence lies in exactly one dq tile and one dkv key
    tile; tiles start on their sequence's multiples of the tile size."""
    cu = np.array([0, 1, 64, 64 + 100, 64 + 100 + 33])
    for vendor, dpt in itertools.product(("cuda", "hip"), (128, 64, 256)):
        tiles = op.tiled_tiles(dpt, vendor)
        q_tiles, key_tiles = op.tiled_plan(cu, dpt, vendor)
        causal = np.zeros((cu[-1], cu[-1]), dtype=np.int64)
        for s in range(cu.size - 1):
            block = np.arange(cu[s], cu[s + 1])
            causal[block[:, None], block[None, :]] = block[:, None] >= block[None, :]
        for plan, size, axis in ((q_tiles, tiles["bq"], 0), (key_tiles, tiles["bkv"], 1)):
            seen = np.zeros_like(causal)
            for seq, first in plan:
                assert (first - cu[seq]) % size == 0
                rows = np.arange(first, min(first + size, cu[seq + 1]))
                span = np.arange(cu[seq], cu[seq + 1])
                if axis == 0:
                    seen[rows[:, None], span[None, :]] += 1
                else:
                    seen[span[:, None], rows[None, :]] += 1
            assert np.all(seen[causal == 1] == 1)


def test_portable_tiled_kernels_fit_mi300x_shared_memory():
    """The hip tiled kernels' dynamic shared memory stays within MI300X's 64 KiB per workgroup (the
    CUDA ones use up to the H200's 227 KiB), and the accumulators' thread mapping divides evenly."""
    for dpt in op.TILED_HEAD_DIMS:
        assert max(op.tiled_shared_bytes(dpt, "hip").values()) <= op.PORTABLE_SHARED_LIMIT
        t = op.tiled_tiles(dpt, "hip")
        assert t["bq"] * dpt % op.TILED_THREADS == 0 and t["bkv"] * dpt % op.TILED_THREADS == 0
        assert op.TILED_THREADS % t["bk"] == 0 and op.TILED_THREADS % t["bq2"] == 0
    assert max(op.tiled_shared_bytes(256, "cuda").values()) > op.PORTABLE_SHARED_LIMIT


def test_backward_method_errors():
    """A bad method names the argument; "tiled" where it does not exist says why."""
    rng = np.random.default_rng(12)
    q, k, v, do = inputs(rng, 5, 2, 1, 8)
    with pytest.raises(InputError, match="method must be one of"):
        op.attention_packed_backward(CPU, q, k, v, do, [0, 5], method="fast")
    with pytest.raises(InputError, match="the tiled kernels exist for GPU kernel sources"):
        op.attention_packed_backward(CPU, q, k, v, do, [0, 5], method="tiled")
    assert op.backward_methods(CPU, 128) == ("rows",)
    assert op.backward_methods(_RecordingDevice(), 128) == ("rows", "tiled")
    assert op.backward_methods(_RecordingDevice(), 320) == ("rows",)  # padded head_dim beyond 256
    assert op.backward_methods(_RecordingDevice("hip"), 128) == ("rows", "tiled")


# ---- the forward's statistics (m, L) handed to the backward


def test_tiled_backward_from_the_forwards_statistics_leaves_out_the_stats_step():
    device = _RecordingDevice("cuda")
    rng = np.random.default_rng(12)
    q, k, v, do = inputs(rng, 75, 6, 2, 128)
    o = ref.attention(q, k, v, np.arange(75))
    stats = np.zeros((75 * 6, 3), np.float64)
    op.attention_packed_backward(device, q, k, v, do, np.array([0, 4, 75]), o=o, row_stats=stats)
    launched = [launch[1] for launch in device.launches]
    assert "attention_backward_mma_stats_d128" not in launched
    assert launched[-2:] == [f"attention_backward_mma_{step}_d128" for step in ("dq", "dkv")]
    assert all(launch[4][13] is stats for launch in device.launches if "_dq_" in launch[1] or "_dkv_" in launch[1])
    _check_arguments(device.launches, _kernel_parameters("cuda"))


def test_packed_forward_keeps_statistics_from_the_mma_and_portable_kernels():
    rng = np.random.default_rng(13)
    q, k, v, _ = inputs(rng, 40, 4, 2, 64)
    cu = np.array([0, 16, 40])
    device = _RecordingDevice("cuda")
    o, stats = op.attention_packed(device, q, k, v, cu, keep_stats=True)
    mma = [launch for launch in device.launches if launch[1] == "attention_paged_mma_d128"]
    assert len(mma) == 1 and mma[0][4][-1] is stats and stats.shape == (40 * 4, 3) and stats.dtype == np.float64
    assert mma[0][4][-2] is o
    for vendor in ("cuda", "hip"):  # the portable kernel: HIP's prefill, and CUDA's "portable" method
        device = _RecordingDevice(vendor)
        o, stats = op.attention_packed(device, q, k, v, cu, method="portable", keep_stats=True)
        paged = [launch for launch in device.launches if launch[1] == "attention_paged"]
        assert len(paged) == 1 and paged[0][4][-1] is stats and paged[0][4][-2] is o and stats.shape == (160, 3)
    device = _RecordingDevice("cuda")
    assert op.attention_packed(device, q, k, v, cu, method="split", keep_stats=True)[1] is None
    assert op.attention_packed(device, q, k, v, cu).shape == (40, 4, 64)  # a plain array without keep_stats
    o_cpu, none = op.attention_packed(CPU, q, k, v, cu, keep_stats=True)
    assert none is None and np.array_equal(o_cpu.view(np.uint32), op.attention_packed(CPU, q, k, v, cu).view(np.uint32))


def test_statistics_errors_name_the_problem():
    rng = np.random.default_rng(14)
    q, k, v, do = inputs(rng, 20, 4, 2, 64)
    cu = np.array([0, 20])
    with pytest.raises(InputError, match="pass o with them"):
        op.attention_packed_backward(CPU, q, k, v, do, cu, row_stats=np.zeros((80, 3)))
    o = ref.attention(q, k, v, np.arange(20))
    with pytest.raises(InputError, match=r"row_stats must have the shape \(80, 3\)"):
        op.attention_packed_backward(CPU, q, k, v, do, cu, o=o, row_stats=np.zeros((20, 3)))
    device = _RecordingDevice("cuda")
    cache = op.KVCache.allocate(device, 32, 2, 64, block_size=16)
    with pytest.raises(InputError, match="not by the split kernels"):
        op.attention_paged(device, q[:2], np.zeros(2, np.int32), np.array([0, 1], np.int32), cache,
                           np.array([[0, 1]], np.int32), method="split", row_stats=np.zeros((8, 3)))
