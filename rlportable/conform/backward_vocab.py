"""Conformance of the vocabulary-side backward ops: the log-prob gradient with respect to the
logits and the embedding table's gradient, each bitwise against its reference."""

from __future__ import annotations

import numpy as np

from rlportable.conform.forward_ops import _logprob_rows, _random_bits, _sizes, logprob_cases
from rlportable.conform.tally import Tally
from rlportable.contract import embedding as embedding_ref
from rlportable.contract import logprob as logprob_ref
from rlportable.ops import embedding as embedding_op
from rlportable.ops import logprob as logprob_op
from rlportable.runtime.base import Backend

# upstream gradients that are not ordinary values: masked (+-0), non-finite, huge (|g| / T overflows), subnormal
SPECIAL_GRADS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-40, 1.0], dtype=np.float32)


def _grads(rng, rows: int, special: bool) -> np.ndarray:
    """float32 [rows]: ordinary gradients with a third masked (+0 or -0), or drawn from SPECIAL_GRADS."""
    if special:
        return rng.choice(SPECIAL_GRADS, size=rows)
    g = rng.standard_normal(rows).astype(np.float32)
    g[rng.random(rows) < 0.3] = 0.0
    g[rng.random(rows) < 0.1] = -0.0
    return g


def check_logprob_backward(backend: Backend, rng, quick: bool) -> Tally:
    """logprobs_backward on every logits kind and temperature, then row-chunk and permutation invariance."""
    tally = Tally()
    for kind, z, targets, z_dev, targets_dev, temperature in logprob_cases(backend, rng, quick):
        for special in (False, True) if kind in ("logits", "special") else (False,):
            grad = _grads(rng, z.shape[0], special)
            got = logprob_op.logprobs_backward(backend, z_dev, targets_dev, temperature, backend.asarray(grad))
            tally.add(backend.to_numpy(got), logprob_ref.logprobs_backward(z, targets, temperature, grad))
    # invariance: a row's bits do not depend on the rows around it (chunks of device rows, a permutation)
    rows, vocab = 40, 3001
    z = _logprob_rows(rng, rows, vocab, "logits")
    targets = rng.integers(0, vocab, size=rows).astype(np.int32)
    grad = _grads(rng, rows, False)
    z_dev, targets_dev, grad_dev = backend.asarray(z), backend.asarray(targets), backend.asarray(grad)
    full = logprob_ref.logprobs_backward(z, targets, 0.9, grad)
    for chunk in (1, 7, 16):
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            got = logprob_op.logprobs_backward(backend, z_dev[start:stop], targets_dev[start:stop], 0.9,
                                               grad_dev[start:stop])
            tally.add(backend.to_numpy(got), full[start:stop])
    permutation = rng.permutation(rows)
    got = logprob_op.logprobs_backward(backend, backend.asarray(z[permutation]), backend.asarray(targets[permutation]),
                                       0.9, backend.asarray(grad[permutation]))
    tally.add(backend.to_numpy(got), full[permutation])
    return tally


# (V, H, T): 1x1, ragged, many repeats of few ids, a real vocabulary with few tokens, T = 0, H = 0
EMBEDDING_BACKWARD_SHAPES_QUICK = [(1, 1, 1), (13, 7, 5), (20, 33, 300), (1000, 257, 64), (50, 16, 0), (9, 0, 4)]
EMBEDDING_BACKWARD_SHAPES_FULL = EMBEDDING_BACKWARD_SHAPES_QUICK + [(151936, 64, 4096), (32000, 1024, 2048)]


def _skewed_ids(rng, vocab: int, tokens: int) -> np.ndarray:
    """int32 [T]: Zipf-like ids (a few very frequent, as in text), with the first and last id present."""
    ids = np.minimum(rng.zipf(1.3, size=tokens) - 1, vocab - 1).astype(np.int32)
    ids = rng.permutation(vocab).astype(np.int32)[ids]
    if tokens >= 2:
        ids[0], ids[-1] = 0, vocab - 1
    return ids


def _dy(rng, tokens: int, hidden: int, kind: str) -> np.ndarray:
    if kind == "bits":  # every float32 class: NaN payloads, +-inf, subnormals, -0
        return _random_bits(rng, (tokens, hidden))
    dy = rng.standard_normal((tokens, hidden)).astype(np.float32)
    if kind == "spread":  # exponents over the whole float32 range: float64 roundings and float32 overflow
        with np.errstate(over="ignore"):
            dy *= np.ldexp(np.float32(1.0), rng.integers(-149, 128, (tokens, hidden))).astype(np.float32)
    if kind == "zeros":
        dy[:] = -0.0
        dy[rng.random((tokens, hidden)) < 0.3] = 0.0
    return dy


def check_embedding_gather_backward(backend: Backend, rng, quick: bool) -> Tally:
    """gather_backward on skewed and uniform ids and every dy kind, host ids given and copied back."""
    tally = Tally()
    shapes = _sizes(backend, quick, EMBEDDING_BACKWARD_SHAPES_QUICK, EMBEDDING_BACKWARD_SHAPES_FULL)
    for vocab, hidden, tokens in shapes:
        for ids in (_skewed_ids(rng, vocab, tokens), rng.integers(0, vocab, size=tokens).astype(np.int32)):
            ids_dev = backend.asarray(ids)
            for kind in ("normal", "spread", "zeros", "bits"):
                dy = _dy(rng, tokens, hidden, kind)
                expected = embedding_ref.gather_backward(ids, dy, vocab)
                got = embedding_op.gather_backward(backend, ids_dev, ids, backend.asarray(dy), vocab)
                tally.add(backend.to_numpy(got), expected)
            got = embedding_op.gather_backward(backend, ids_dev, None, backend.asarray(dy), vocab)
            tally.add(backend.to_numpy(got), expected)
    return tally


BACKWARD_VOCAB_CHECKS = [
    ("logprob.backward", check_logprob_backward),
    ("embedding.gather_backward", check_embedding_gather_backward),
]
