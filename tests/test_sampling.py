"""The sampler's contract (rlportable/contract/sampling.py): Philox4x32-10 against Random123's known
answers, the exact integer helpers against Python integers, determinism and batch independence,
greedy, top-k / top-p / min-p against a float64 reference, sampled frequencies against the
probabilities (chi-square), edge cases and input errors, and the recorded log-probs.
"""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np
import pytest

from rlportable.contract import logprob, sampling
from rlportable.contract.elementwise import exp_f32
from rlportable.errors import InputError

# Known-answer vectors of Philox4x32-10 from Random123's known-answer file
# (https://github.com/DEShawResearch/random123, kat_vectors in its tests folder, the three "philox4x32 10" lines;
# columns: counter (4 words), key (2 words), expected output (4 words)). The last counter and key
# are the first hex digits of pi.
PHILOX_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# Upper 1e-6 quantiles of the chi-square distribution by degrees of freedom (mpmath:
# gammainc(k/2, x/2, inf, regularized=True) = 1e-6).
CHI2_1E6 = {1: 23.93, 2: 27.63, 3: 30.66, 4: 33.38, 5: 35.89, 6: 38.26, 7: 40.52, 8: 42.70, 9: 44.81,
            10: 46.86, 11: 48.87, 12: 50.83, 13: 52.75, 14: 54.64, 15: 56.49}

U64 = 2**64


def _sample(z, temperature=1.0, top_k=None, top_p=None, min_p=None, seed=0, request=0, sample_index=0,
            position=None):
    z = np.asarray(z, dtype=np.float32)
    if z.ndim == 1:
        z = z[None]
    if position is None:
        position = np.arange(z.shape[0])
    return sampling.sample(z, temperature, top_k, top_p, min_p, seed=seed, request=request,
                           sample_index=sample_index, position=position)


# ---------------------------------------------------------------- Philox and integer helpers

@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    out = sampling.philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert out.dtype == np.uint32
    assert [int(x) for x in out] == list(expected)


def test_philox_vectorized_equals_one_by_one():
    counters = np.array([c for c, _, _ in PHILOX_KAT], np.uint32)
    keys = np.array([k for _, k, _ in PHILOX_KAT], np.uint32)
    out = sampling.philox4x32_10(counters, keys)
    assert out.tolist() == [list(e) for _, _, e in PHILOX_KAT]
    # broadcasting one key over many counters
    rng = np.random.default_rng(0)
    many = rng.integers(0, 2**32, (50, 4), dtype=np.uint64).astype(np.uint32)
    together = sampling.philox4x32_10(many, keys[2])
    alone = np.stack([sampling.philox4x32_10(c, keys[2]) for c in many])
    assert np.array_equal(together, alone)


def test_random_u64_layout():
    # key = (seed low, seed high); counter = (request, sample, position, stream); r = x0 + 2^32 x1
    seed = 0x299F31D0A4093822
    r = sampling.random_u64(seed, 0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
    assert int(r) == 0xD16CFE09 + (0x94FDCCEB << 32)
    assert int(sampling.random_u64(U64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1)) == \
        0x408F276D + (0x41C83B0E << 32)


def test_random_u64_every_counter_field_matters():
    base = {"seed": 7, "request": 3, "sample_index": 2, "position": 11, "stream": 0}
    reference = int(sampling.random_u64(**base))
    for field, other in (("seed", 7 + 2**32), ("seed", 8), ("request", 4), ("sample_index", 3),
                         ("position", 12), ("stream", 1)):
        assert int(sampling.random_u64(**{**base, field: other})) != reference, field
    # vectorized over positions = one at a time
    many = sampling.random_u64(7, 3, 2, np.arange(100))
    assert [int(x) for x in many] == [int(sampling.random_u64(7, 3, 2, p)) for p in range(100)]


def test_random_bits_look_uniform():
    # 65536 draws over positions, top 4 bits in 16 bins and low 4 bits in 16 bins: chi-square with
    # 15 degrees of freedom below its 1e-6 quantile (fixed inputs, so this is deterministic; a
    # broken generator gives thousands)
    r = sampling.random_u64(12345, 0, 0, np.arange(65536))
    for bins in ((r >> np.uint64(60)).astype(np.int64), (r & np.uint64(15)).astype(np.int64)):
        counts = np.bincount(bins, minlength=16)
        expected = r.size / 16
        assert ((counts - expected) ** 2 / expected).sum() < CHI2_1E6[15]


def test_mul_u64_exact():
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64) * np.uint64(2) + np.uint64(1),
                        np.array([0, 1, 2**32 - 1, 2**32, U64 - 1, U64 - 1], np.uint64)])
    b = np.concatenate([rng.integers(0, 2**63, 500, dtype=np.uint64),
                        np.array([U64 - 1, U64 - 1, 2**32 - 1, 2**32 + 1, 1, U64 - 1], np.uint64)])
    high, low = sampling.mul_u64(a, b)
    for x, y, h, lo in zip(a, b, high, low):
        product = int(x) * int(y)
        assert (int(h), int(lo)) == (product >> 64, product % U64)


def test_top_p_threshold_exact():
    rng = np.random.default_rng(2)
    top_ps = [1.0, 0.5, 1e-9, 0.9, 0.95, 1 - 2**-53, 2**-1074, 2**-60, 0.3333333333333333, 0.1]
    top_ps += list(rng.random(200))
    totals = [2**36, 2**61, 2**61 - 1, 3 * 2**36 + 5, 2**36 + 1] + \
        [int(x) for x in rng.integers(2**36, 2**61, 200)]
    for i, p in enumerate(top_ps):
        for total in (totals[i % len(totals)], totals[(7 * i + 3) % len(totals)]):
            t = int(sampling.top_p_threshold(np.array([p]), np.array([total], np.uint64))[0])
            assert t == math.ceil(Fraction(p) * total), (p, total)


# ---------------------------------------------------------------- determinism and batch independence

def _mixed_batch(rows=24, vocab=300, seed=0):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((rows, vocab)) * 2.5).astype(np.float32)
    z[rng.random((rows, vocab)) < 0.05] = -np.inf
    params = {
        "temperature": rng.choice([0.0, 0.3, 0.7, 1.0, 1.5], rows),
        "top_k": rng.choice([0, -1, 1, 5, 50], rows),
        "top_p": rng.choice([1.0, 0.9, 0.5, 1e-9], rows),
        "min_p": rng.choice([0.0, 0.05, 0.3], rows),
        "seed": rng.integers(0, 2**63, rows, dtype=np.uint64) * np.uint64(2),
        "request": rng.integers(0, 2**32, rows, dtype=np.uint64),
        "sample_index": rng.integers(0, 16, rows),
        "position": rng.integers(0, 2**20, rows),
    }
    return z, params


def _call(z, params, rows=None):
    p = params if rows is None else {k: v[rows] for k, v in params.items()}
    z = z if rows is None else z[rows]
    return sampling.sample(z, p["temperature"], p["top_k"], p["top_p"], p["min_p"], seed=p["seed"],
                           request=p["request"], sample_index=p["sample_index"], position=p["position"])


def test_same_inputs_same_tokens():
    z, params = _mixed_batch()
    assert np.array_equal(_call(z, params), _call(z.copy(), {k: v.copy() for k, v in params.items()}))


def test_tokens_do_not_depend_on_the_batch(monkeypatch):
    z, params = _mixed_batch(rows=40)
    whole = _call(z, params)
    for r in range(40):  # each row alone
        assert _call(z, params, np.array([r]))[0] == whole[r]
    rng = np.random.default_rng(5)
    for _ in range(5):  # permuted sub-batches, and the same rows among other rows
        rows = rng.permutation(40)[: rng.integers(1, 40)]
        assert np.array_equal(_call(z, params, rows), whole[rows])
    other_z, other = _mixed_batch(rows=17, seed=9)
    joined_z = np.concatenate([other_z[:, :300], z])
    joined = {k: np.concatenate([other[k], params[k]]) for k in params}
    assert np.array_equal(_call(joined_z, joined)[17:], whole)
    # the internal row blocking does not matter either
    monkeypatch.setattr(sampling, "_BLOCK_ELEMENTS", 1)
    assert np.array_equal(_call(z, params), whole)


def test_different_samples_and_positions_give_different_streams():
    z = np.zeros((1, 1000), np.float32)  # uniform over 1000 tokens
    tokens = [int(_sample(z, sample_index=s, position=[0])[0]) for s in range(8)]
    assert len(set(tokens)) >= 6
    tokens = _sample(np.repeat(z, 8, axis=0), position=np.arange(8))
    assert len(set(tokens.tolist())) >= 6


def test_pinned_tokens():
    # A change here changes which tokens every seed produces: a contract change, to be made on purpose
    # (and mirrored in every kernel).
    z, params = _mixed_batch(rows=64, vocab=1000, seed=42)
    tokens = _call(z, params)
    digest = hashlib.sha256(tokens.astype("<i4").tobytes()).hexdigest()
    assert tokens[:8].tolist() == PINNED_FIRST_TOKENS
    assert digest == PINNED_DIGEST


PINNED_FIRST_TOKENS = [139, 616, 829, 304, 222, 246, 502, 536]
PINNED_DIGEST = "ad8ad2153ca3f6509af86e88a3e2c1c4126e3a3128c6ce9e9396f2bc9b54fa36"


# ---------------------------------------------------------------- greedy

def test_greedy_is_the_argmax_with_ties_to_the_lowest_id():
    z = np.array([[1.0, 3.0, -np.inf, 3.0, 2.0],
                  [-np.inf, -np.inf, -5.0, -np.inf, -6.0],
                  [-0.0, 0.0, -1.0, 0.0, -0.0],
                  [0.0, -0.0, -1.0, 0.0, -0.0]], np.float32)
    for seed in range(5):
        assert _sample(z, temperature=0.0, seed=seed, top_k=1, top_p=0.3).tolist() == [1, 2, 0, 0]
    weights = sampling.kept_weights(z, 0.0)
    assert np.array_equal(weights, np.eye(5, dtype=np.int64)[[1, 2, 0, 0]])


def test_greedy_logprob_is_recorded_at_temperature_one():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((6, 50)).astype(np.float32)
    temperature = np.array([0.0, 0.7, 0.0, 1.0, 1.3, 0.7])
    tokens = _sample(z, temperature=temperature)
    recorded = sampling.sampled_logprobs(z, tokens, temperature)
    for r in range(6):
        t = 1.0 if temperature[r] == 0 else temperature[r]
        expected = logprob.logprobs(z[r:r + 1], tokens[r:r + 1].astype(np.int64), t)
        assert recorded[r].view(np.uint32) == expected[0].view(np.uint32)
    assert sampling.record_temperature(temperature).tolist() == [1.0, 0.7, 1.0, 1.0, 1.3, 0.7]


# ---------------------------------------------------------------- the filters against float64

def _float64_reference(z, temperature, top_k, top_p, min_p):
    """Kept set and normalized probabilities in float64, and the smallest relative margin to any
    decision boundary (the test only uses cases far from one)."""
    a = z.astype(np.float64) / temperature
    p = np.exp(a - a.max())
    order = np.argsort(-a, kind="stable")
    margins = [np.inf]
    keep = np.ones(z.size, bool)
    if top_k >= 1:
        keep[order[top_k:]] = False
        if top_k < z.size:
            margins.append((a[order[top_k - 1]] - a[order[top_k]]) / (abs(a[order[top_k]]) + 1))
    keep &= p >= min_p
    if min_p > 0:
        margins.append(np.min(np.abs(p - min_p)) / min_p)
    ranked = [v for v in order if keep[v]]
    total = p[ranked].sum()
    cumulative = np.cumsum(p[ranked])
    n = int(np.searchsorted(cumulative, top_p * total * (1 - 1e-12))) + 1
    if top_p < 1:
        margins.append(np.min(np.abs(cumulative - top_p * total)) / total)
    kept = np.zeros(z.size, bool)
    kept[ranked[:n]] = True
    probs = np.where(kept, p, 0.0)
    return kept, probs / probs.sum(), min(margins)


@pytest.mark.parametrize("case", range(40))
def test_filters_match_float64(case):
    rng = np.random.default_rng(100 + case)
    vocab = int(rng.choice([5, 37, 300]))
    z = (rng.standard_normal(vocab) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
    temperature = float(rng.choice([0.5, 1.0, 1.7]))
    top_k = int(rng.choice([0, 1, 3, 10, vocab + 5]))
    top_p = float(rng.choice([1.0, 0.95, 0.7, 0.3]))
    min_p = float(rng.choice([0.0, 0.01, 0.2]))
    kept, probs, margin = _float64_reference(z, temperature, top_k, top_p, min_p)
    if margin < 1e-5:
        pytest.skip("a near tie; the float64 reference cannot decide it")
    weights = sampling.kept_weights(z[None], temperature, top_k, top_p, min_p)[0]
    assert not np.any((weights > 0) & ~kept)
    assert np.all(weights[kept & (probs > 2.0**-30)] > 0)  # below 2^-37 of the maximum: weight 0
    mass = weights / weights.sum()
    # w = RNE(p 2^36) with p correctly rounded from a float32 a: relative error ~2^-23 |a| per weight
    assert np.allclose(mass, probs, rtol=1e-5, atol=2.0**-34)


def test_unfiltered_weights_are_the_logprob_sum_terms():
    rng = np.random.default_rng(4)
    z = (rng.standard_normal((5, 700)) * 4).astype(np.float32)
    for temperature in (1.0, 0.6):
        weights = sampling.kept_weights(z, temperature)
        _, _, d = logprob._shifted(z, temperature)
        s, _ = logprob._log_sum(exp_f32(d))
        assert np.array_equal(weights.sum(axis=1), s)


def test_top_k_ties_and_signed_zeros():
    z = np.array([[1.0, 2.0, 2.0, 2.0, 0.0], [-0.0, 0.0, -0.0, -1.0, -2.0]], np.float32)
    w = sampling.kept_weights(z, 1.0, top_k=2)
    assert (w[0] > 0).tolist() == [False, True, True, False, False]
    assert (w[1] > 0).tolist() == [True, True, False, False, False]
    w = sampling.kept_weights(z, 1.0, top_k=1)
    assert (w > 0).sum(axis=1).tolist() == [1, 1] and w[0, 1] == w[1, 0] == 2**36


def test_min_p_keeps_the_maxima_at_one():
    z = np.array([[0.0, 3.0, 3.0, 2.999, -1.0]], np.float32)
    w = sampling.kept_weights(z, 1.0, min_p=1.0)
    assert w[0].tolist() == [0, 2**36, 2**36, 0, 0]
    w = sampling.kept_weights(z, 1.0, min_p=0.0)
    assert (w[0] > 0).all()


def test_top_p_prefix_rule_exactly():
    # ranked: id 1 (w = 2^36), then ids 0 and 3 (equal weights: lower id first), then id 2. Kept: the
    # shortest ranked prefix whose weight reaches top_p * W, decided in exact rationals here, at
    # top_p values on and one float64 step either side of every prefix boundary.
    z = np.array([[1.0, 2.0, -1.0, 1.0]], np.float32)
    full = sampling.kept_weights(z, 1.0)[0]
    ranked = [1, 0, 3, 2]
    weights = [int(full[v]) for v in ranked]
    total = sum(weights)
    assert weights[0] == 2**36 and weights[1] == weights[2] > weights[3] > 0
    checked = set()
    for prefix in range(1, 5):
        boundary = sum(weights[:prefix]) / total
        for top_p in (math.nextafter(boundary, 0), boundary, min(1.0, math.nextafter(boundary, 1))):
            cumulative = np.cumsum(weights)
            n = next(j + 1 for j in range(4) if cumulative[j] >= Fraction(top_p) * total)
            kept = sampling.kept_weights(z, 1.0, top_p=top_p)[0]
            assert sorted(np.flatnonzero(kept).tolist()) == sorted(ranked[:n]), top_p
            checked.add(n)
    assert checked == {1, 2, 3, 4}


# ---------------------------------------------------------------- the draw

def _draw_reference(weights, r):
    out = []
    for row, rand in zip(weights.tolist(), r.tolist()):
        total = sum(row)
        target = (int(rand) * total) >> 64
        acc = 0
        for v, w in enumerate(row):
            if acc <= target < acc + w:
                out.append(v)
                break
            acc += w
    return out


def test_draw_is_exact():
    rng = np.random.default_rng(6)
    weights = rng.integers(0, 2**36, (200, 30))
    weights[rng.random(weights.shape) < 0.3] = 0
    weights[:, 7] += 1
    weights[0] = 0
    weights[0, [3, 29]] = 2**60  # W = 2^61, the largest the contract produces
    r = rng.integers(0, 2**64 - 1, 200, dtype=np.uint64, endpoint=True)
    r[:4] = [0, U64 - 1, 2**63, 2**63 - 1]
    assert sampling.draw(weights, r).tolist() == _draw_reference(weights, r)
    assert sampling.draw(weights[:1], np.array([2**63 - 1], np.uint64))[0] == 3
    assert sampling.draw(weights[:1], np.array([2**63], np.uint64))[0] == 29


def _chi_square(tokens, weights):
    counts = np.bincount(tokens, minlength=weights.size)
    assert counts[weights == 0].sum() == 0
    expected = tokens.size * weights[weights > 0] / weights.sum()
    return float(((counts[weights > 0] - expected) ** 2 / expected).sum()), int((weights > 0).sum()) - 1


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,vary", [
    (1.0, 0, 1.0, 0.0, "position"),
    (0.8, 0, 1.0, 0.0, "request"),
    (1.3, 6, 0.9, 0.0, "sample_index"),
    (1.0, 0, 1.0, 0.05, "seed"),
])
def test_frequencies_match_the_probabilities(temperature, top_k, top_p, min_p, vary):
    # 40,000 draws of one row, the random counter varying along one field. The statistic is
    # compared with the chi-square distribution's 1e-6 upper quantile: a correct sampler exceeds it
    # with probability 1e-6, and with fixed inputs the outcome is deterministic anyway, so the loose
    # bound costs nothing. It still has teeth: the statistics here are 1 to 11, and checking these
    # draws against the weights of a temperature 10% off gives 70 to 250; a wrong mapping from
    # random bits to tokens or a filter error gives far more.
    z = np.array([0.0, 0.5, 1.0, -1.0, 2.0, -np.inf, 1.5, -0.3, 0.2, -2.0], np.float32)
    n = 40_000
    fields = {"seed": 11, "request": 5, "sample_index": 1, "position": 3}
    fields[vary] = np.arange(n) + (2**40 if vary == "seed" else 0)
    tokens = sampling.sample(np.repeat(z[None], n, axis=0), temperature, top_k, top_p, min_p, **fields)
    weights = sampling.kept_weights(z[None], temperature, top_k, top_p, min_p)[0]
    statistic, dof = _chi_square(tokens, weights)
    assert statistic < CHI2_1E6[dof], (statistic, dof)
    # and the kept weights are the float64 softmax of the kept tokens
    kept, probs, _ = _float64_reference(z, temperature, top_k, top_p, min_p)
    assert np.array_equal(weights > 0, kept)
    assert np.allclose(weights / weights.sum(), probs, rtol=1e-6, atol=1e-12)


# ---------------------------------------------------------------- edge cases

def test_vocabulary_of_one():
    z = np.array([[3.0], [-1e30], [0.0]], np.float32)
    for temperature in (0.0, 1.0, 0.01):
        for top_p, top_k, min_p in ((1.0, 0, 0.0), (1e-9, 1, 1.0)):
            assert _sample(z, temperature, top_k, top_p, min_p).tolist() == [0, 0, 0]
    ids, values = sampling.top_logprobs(z, 1.0, 1)
    assert ids.tolist() == [[0], [0], [0]] and values.tolist() == [[0.0], [0.0], [0.0]]


def test_all_minus_inf_but_one():
    z = np.full((3, 50), -np.inf, np.float32)
    z[0, 17] = -3.0
    z[1, 0] = 1e30
    z[2, 49] = 0.0
    for temperature in (0.0, 0.5, 1.0, 2.0):
        assert _sample(z, temperature, seed=3).tolist() == [17, 0, 49]
    lp = sampling.sampled_logprobs(z, np.array([17, 0, 49]), 1.0)
    assert lp.tolist() == [0.0, 0.0, 0.0]


def test_tiny_temperature_concentrates_on_the_maxima():
    rng = np.random.default_rng(8)
    z = rng.standard_normal((20, 100)).astype(np.float32)
    z[:10, 5] = z[:10].max(axis=1) + 1e-3
    tokens = _sample(z, 1e-6, seed=np.arange(20))
    assert np.array_equal(tokens, np.argmax(z, axis=1))
    # exact ties at the maximum stay a fair coin between them
    tie = np.zeros((400, 3), np.float32)
    tie[:, 0] = -1.0
    tokens = _sample(tie, 1e-6)
    assert set(tokens.tolist()) == {1, 2} and 150 < (tokens == 1).sum() < 250


def test_top_p_tiny_keeps_the_top_token():
    rng = np.random.default_rng(9)
    z = rng.standard_normal((30, 200)).astype(np.float32)
    z[0, [3, 7]] = 10.0  # a tie at the top: the lower id is the top token
    tokens = _sample(z, 1.0, top_p=1e-9, seed=np.arange(30))
    expected = np.argmax(z, axis=1)
    assert np.array_equal(tokens, expected) and tokens[0] == 3
    w = sampling.kept_weights(z, 1.0, top_p=1e-9)
    assert np.array_equal(w, np.eye(200, dtype=np.int64)[expected] * 2**36)


@pytest.mark.parametrize("bad,message", [
    (np.nan, "row 1 of the logits has a NaN"),
    (np.inf, "row 1 of the logits has \\+inf"),
])
def test_non_finite_logits_are_refused(bad, message):
    z = np.zeros((3, 8), np.float32)
    z[1, 4] = bad
    for temperature in (0.0, 1.0):
        with pytest.raises(InputError, match=message):
            _sample(z, temperature)
    with pytest.raises(InputError, match=message):
        sampling.top_logprobs(z, 1.0, 2)


def test_rows_without_a_finite_logit_or_overflowing_are_refused():
    z = np.zeros((2, 4), np.float32)
    z[1] = -np.inf
    with pytest.raises(InputError, match="row 1 of the logits has no finite value"):
        _sample(z)
    z = np.array([[1.0, 2.0]], np.float32)
    with pytest.raises(InputError, match="overflows float32"):
        _sample(z, 1e-40)
    assert _sample(z, 1e-30).tolist() == [1]


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": np.nan}, "temperature"),
    ({"temperature": np.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": np.nan}, "top_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.01}, "min_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": 1.0}, "seed"),
    ({"request": 2**32}, "request"),
    ({"position": -3}, "position"),
    ({"sample_index": np.array([1, 2, 3])}, "sample_index must be a scalar or have shape"),
    ({"temperature": np.array([1.0, 1.0, 1.0])}, "temperature"),
])
def test_bad_parameters_are_refused(kwargs, message):
    z = np.zeros((2, 5), np.float32)
    args = {"temperature": 1.0, "top_k": None, "top_p": None, "min_p": None, "seed": 0, "request": 0, "sample_index": 0,
                "position": 0}
    args.update(kwargs)
    with pytest.raises(InputError, match=message):
        _sample(z, **args)


def test_bad_logits_are_refused():
    with pytest.raises(InputError, match="float32"):
        sampling.sample(np.zeros((2, 5)), 1.0, seed=0, request=0, sample_index=0, position=0)
    with pytest.raises(InputError, match="matrix"):
        sampling.sample(np.zeros(5, np.float32), 1.0, seed=0, request=0, sample_index=0, position=0)
    with pytest.raises(InputError, match="vocabulary"):
        sampling.sample(np.zeros((2, 0), np.float32), 1.0, seed=0, request=0, sample_index=0, position=0)
    assert sampling.sample(np.zeros((0, 5), np.float32), 1.0, seed=0, request=0, sample_index=0,
                           position=0).shape == (0,)


def test_large_python_integers_are_exact():
    z = np.zeros((2, 1000), np.float32)
    a = sampling.sample(z, 1.0, seed=[1, U64 - 1], request=[2**32 - 1, 0], sample_index=0, position=0)
    b = [int(sampling.sample(z[:1], 1.0, seed=s, request=q, sample_index=0, position=0)[0])
         for s, q in ((1, 2**32 - 1), (U64 - 1, 0))]
    assert a.tolist() == b
    c = sampling.sample(z, 1.0, seed=np.array([1, U64 - 1], np.uint64),
                        request=np.array([2**32 - 1, 0], np.uint32), sample_index=0, position=0)
    assert np.array_equal(a, c)


# ---------------------------------------------------------------- top log-prob alternatives

def test_top_logprobs_are_the_contract_values():
    rng = np.random.default_rng(10)
    z = (rng.standard_normal((7, 400)) * 3).astype(np.float32)
    z[0, [10, 20, 30]] = z[0].max() + 1  # ties: ordered by id
    temperature = np.array([0.0, 1.0, 0.7, 1.3, 0.7, 0.0, 2.0])
    ids, values = sampling.top_logprobs(z, temperature, 5)
    assert ids[0, :3].tolist() == [10, 20, 30]
    for r in range(7):
        t = sampling.record_temperature(temperature[r])
        every = logprob.logprobs(np.repeat(z[r:r + 1], 400, axis=0), np.arange(400), float(t))
        order = np.lexsort((np.arange(400), -every))[:5]
        assert ids[r].tolist() == order.tolist()
        assert np.array_equal(values[r].view(np.uint32), every[order].view(np.uint32))
    assert sampling.top_logprobs(z, temperature, 0)[0].shape == (7, 0)
    all_ids, _ = sampling.top_logprobs(z[:2], 1.0, 400)
    assert sorted(all_ids[1].tolist()) == list(range(400))
    with pytest.raises(InputError, match="top log-probs"):
        sampling.top_logprobs(z, 1.0, 401)


def test_sampled_token_logprob_is_among_the_alternatives():
    rng = np.random.default_rng(11)
    z = (rng.standard_normal((16, 64)) * 2).astype(np.float32)
    tokens = _sample(z, 1.0, top_k=3)
    lp = sampling.sampled_logprobs(z, tokens, 1.0)
    ids, values = sampling.top_logprobs(z, 1.0, 3)
    for r in range(16):
        assert tokens[r] in ids[r]
        assert values[r, ids[r].tolist().index(tokens[r])].view(np.uint32) == lp[r].view(np.uint32)
