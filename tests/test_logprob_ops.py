"""Op family "logprob" on the cpu backend: log-probabilities and entropy against float64 NumPy,
order and chunk invariance, the blockwise LM head, input checks.

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import exact, logprob as reference
from rlportable.errors import InputError
from rlportable.ops import gemm, logprob
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
NAN_BITS = 0x7FC00000


def _float64_log_softmax(z: np.ndarray, temperature: float) -> np.ndarray:
    a = z.astype(np.float64) / temperature
    shifted = a - a.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("vocab,temperature", [(13, 1.0), (1000, 0.7), (32000, 1.3)])
def test_close_to_float64_math(vocab, temperature):
    # Tolerances: a_v rounds to float32 (2^-24 relative, at most 2^-24 |a| absolute in a_v - m, plus
    # the float32 subtraction); exp_f32 is correctly rounded (2^-24 relative per term); S is exact
    # up to 2^-37 per term, i.e. <= V 2^-37 relative since S >= 1; log_f32 is correctly rounded.
    # So |logp - exact| <= ~2^-23 (|a| + |logp| + 1) + V 2^-37 ; entropy likewise, with 38-bit terms.
    rng = np.random.default_rng(vocab)
    z = (rng.standard_normal((6, vocab)) * 3.0).astype(np.float32)
    targets = rng.integers(0, vocab, 6).astype(np.int32)
    exact_lsm = _float64_log_softmax(z, temperature)
    logp = logprob.logprobs(CPU, z, targets, temperature)
    scale = np.abs(z / temperature).max(axis=1) + np.abs(exact_lsm[np.arange(6), targets]) + 1.0
    assert np.all(np.abs(logp - exact_lsm[np.arange(6), targets]) <= 2.0**-22 * scale + vocab * 2.0**-36)
    p = np.exp(exact_lsm)
    exact_entropy = -(p * exact_lsm).sum(axis=1)
    ent = logprob.entropy(CPU, z, temperature)
    assert np.all(np.abs(ent - exact_entropy) <= 2.0**-20 * (np.abs(z / temperature).max(axis=1) + exact_entropy + 1.0))


def test_vocabulary_order_does_not_matter():
    # every sum is exact, so permuting the vocabulary (with the targets) keeps every bit
    rng = np.random.default_rng(3)
    z = (rng.standard_normal((5, 3001)) * 5.0).astype(np.float32)
    targets = rng.integers(0, 3001, 5).astype(np.int32)
    permutation = rng.permutation(3001)
    inverse = np.argsort(permutation)
    for temperature in (1.0, 0.6):
        a = logprob.logprobs_and_entropy(CPU, z, targets, temperature)
        b = logprob.logprobs_and_entropy(CPU, np.ascontiguousarray(z[:, permutation]), inverse[targets].astype(np.int32),
                                         temperature)
        assert np.array_equal(_bits(a[0]), _bits(b[0])) and np.array_equal(_bits(a[1]), _bits(b[1]))


def test_temperature_one_uses_the_logits_exactly():
    z = (np.random.default_rng(4).standard_normal((3, 50)) * 2).astype(np.float32)
    targets = np.array([0, 1, 2], dtype=np.int32)
    d = z - z.max(axis=1, keepdims=True)
    assert np.array_equal(_bits(logprob.logprobs(CPU, z, targets, 1.0)),
                          _bits(reference.logprobs(d, targets, 1.0)))  # shift invariance at T = 1


def test_edge_rows():
    z = np.array([
        [1.0, np.nan, 0.0],        # NaN -> canonical NaN
        [np.inf, 0.0, 0.0],        # +inf maximum -> canonical NaN
        [-np.inf, -np.inf, -np.inf],  # all -inf -> canonical NaN
        [-np.inf, 2.0, -np.inf],   # one-hot: logp(1) = 0, entropy 0, logp(0) = -inf
        [0.0, -0.0, 0.0],          # ties with signed zeros: uniform
    ], dtype=np.float32)
    targets = np.array([0, 1, 0, 1, 1], dtype=np.int32)
    logp, ent = logprob.logprobs_and_entropy(CPU, z, targets, 1.0)
    assert _bits(logp)[:3].tolist() == [NAN_BITS] * 3 and _bits(ent)[:3].tolist() == [NAN_BITS] * 3
    assert logp[3] == 0.0 and ent[3] == 0.0 and _bits(ent)[3] == 0
    assert logprob.logprobs(CPU, z[3:4], np.array([0], np.int32))[0] == -np.inf
    assert abs(float(logp[4]) + np.log(3.0)) < 1e-6 and abs(float(ent[4]) - np.log(3.0)) < 1e-6
    # a tiny temperature pushes a_v beyond FLT_MAX: the +inf maximum makes the row NaN
    big = np.array([[1e36, -1e36, 0.0]], dtype=np.float32)
    assert _bits(logprob.logprobs(CPU, big, np.array([0], np.int32), 1e-3)).tolist() == [NAN_BITS]
    # ... while -inf entries below a finite maximum only drop out
    low = np.array([[-1e36, 0.0, 1.0]], dtype=np.float32)
    lp, en = logprob.logprobs_and_entropy(CPU, low, np.array([0], np.int32), 1e-3)
    assert lp[0] == -np.inf and np.isfinite(en[0])


def test_rows_are_independent():
    rng = np.random.default_rng(8)
    z = (rng.standard_normal((12, 700)) * 4).astype(np.float32)
    targets = rng.integers(0, 700, 12).astype(np.int32)
    full = logprob.logprobs_and_entropy(CPU, z, targets, 0.9)
    for row in (0, 5, 11):
        one = logprob.logprobs_and_entropy(CPU, z[row:row + 1], targets[row:row + 1], 0.9)
        assert _bits(one[0])[0] == _bits(full[0])[row] and _bits(one[1])[0] == _bits(full[1])[row]


def _lm_head_case(tokens=45, hidden_size=96, vocab=517, seed=0):
    rng = np.random.default_rng(seed)
    hidden = random_rows(rng, tokens, hidden_size, "massive")
    w = (random_rows(rng, vocab, hidden_size, "normal") * np.float32(0.1)).astype(np.float32)
    targets = rng.integers(0, vocab, tokens).astype(np.int32)
    return hidden, w, gemm.encode_weight(CPU, w), targets


def test_lm_head_equals_gemm_then_logprobs():
    hidden, w, weight, targets = _lm_head_case()
    logits = exact.gemm(hidden, w, gemm.DEFAULT_BITS_A, gemm.DEFAULT_BITS_W)
    logp, ent = logprob.lm_head_logprobs(CPU, hidden, weight, targets, 0.8, want_entropy=True, token_block=16)
    assert np.array_equal(_bits(logp), _bits(reference.logprobs(logits, targets, 0.8)))
    assert np.array_equal(_bits(ent), _bits(reference.entropy(logits, 0.8)))


def test_lm_head_is_chunk_invariant():
    hidden, _, weight, targets = _lm_head_case(seed=1)
    results = [logprob.lm_head_logprobs(CPU, hidden, weight, targets, 1.1, want_entropy=True, token_block=block)
               for block in (1, 2, 7, 16, 45, 256)]
    for logp, ent in results[1:]:
        assert np.array_equal(_bits(logp), _bits(results[0][0])) and np.array_equal(_bits(ent), _bits(results[0][1]))
    alone = logprob.lm_head_logprobs(CPU, hidden, weight, targets, 1.1, token_block=5)
    assert np.array_equal(_bits(alone), _bits(results[0][0]))
    empty = logprob.lm_head_logprobs(CPU, hidden[:0], weight, targets[:0], 1.0)
    assert empty.shape == (0,)


@pytest.mark.parametrize("call,message", [
    (lambda z, t: logprob.logprobs(CPU, z, np.array([0, 9], np.int32)), r"targets\[1\] = 9 is outside the vocabulary \[0, 9\)"),
    (lambda z, t: logprob.logprobs(CPU, z, np.array([-1, 0], np.int32)), r"targets\[0\] = -1"),
    (lambda z, t: logprob.logprobs(CPU, z, t.astype(np.int64)), "targets must be int32"),
    (lambda z, t: logprob.logprobs(CPU, z, t[:1]), r"targets must be int32 of shape \(2,\)"),
    (lambda z, t: logprob.logprobs(CPU, z, t, 0.0), "temperature must be a finite number > 0"),
    (lambda z, t: logprob.entropy(CPU, z, float("nan")), "temperature must be"),
    (lambda z, t: logprob.entropy(CPU, z[:, :0]), r"vocabulary size must lie in \[1, 2\^25\]"),
    (lambda z, t: logprob.entropy(CPU, z[0]), "logits must be a 2-D"),
    (lambda z, t: logprob.entropy(CPU, z.astype(np.float64)), "logits must have dtype float32"),
])
def test_input_errors(call, message):
    z = np.zeros((2, 9), dtype=np.float32)
    with pytest.raises(InputError, match=message):
        call(z, np.array([0, 1], np.int32))


def test_lm_head_input_errors():
    hidden, w, weight, targets = _lm_head_case(tokens=4, hidden_size=8, vocab=11)
    with pytest.raises(InputError, match="hidden has H=7 columns but the weight has K=8"):
        logprob.lm_head_logprobs(CPU, hidden[:, :7].copy(), weight, targets)
    with pytest.raises(InputError, match="weight must be a GemmWeight"):
        logprob.lm_head_logprobs(CPU, hidden, w, targets)
    with pytest.raises(InputError, match="token_block must be a positive integer"):
        logprob.lm_head_logprobs(CPU, hidden, weight, targets, token_block=0)
    with pytest.raises(InputError, match=r"targets\[0\] = 11"):
        logprob.lm_head_logprobs(CPU, hidden, weight, np.array([11, 0, 0, 0], np.int32))
