"""Op family "logprob": log-probabilities and entropy of logits at a temperature, the LM head
that produces them block by block, and the log-probabilities' gradient with respect to the logits.

Contract: contracts/logprob.toml; reference: rlportable/contract/logprob.py (logprobs, entropy,
logprobs_backward);
kernels: backends/{cuda,hip}/logprob.*.
"""

from __future__ import annotations

import math

import numpy as np

from rlportable.contract import logprob as reference
from rlportable.errors import InputError
from rlportable.ops import gemm as gemm_op
from rlportable.ops.checks import require_contiguous, require_matrix, shape_of

THREADS = 512
MAX_GRID = 65535
WANT_LOGP = 1
WANT_ENTROPY = 2
DEFAULT_TOKEN_BLOCK = 256


def check_temperature(temperature) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not math.isfinite(temperature) or temperature <= 0:
        raise InputError(f"logprob: temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_vocab(where: str, vocab: int) -> None:
    if not 1 <= vocab <= reference.MAX_VOCAB:
        raise InputError(f"{where}: the vocabulary size must lie in [1, 2^25], got {vocab}")


def _check_targets(where: str, backend, targets, rows: int, vocab: int) -> np.ndarray:
    if shape_of(targets) != (rows,) or np.dtype(targets.dtype) != np.int32:
        raise InputError(f"{where}: targets must be int32 of shape ({rows},), got "
                         f"{np.dtype(targets.dtype).name} of shape {shape_of(targets)}")
    host = np.asarray(backend.to_numpy(targets))
    bad = (host < 0) | (host >= vocab)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise InputError(f"{where}: targets[{index}] = {int(host[index])} is outside the vocabulary [0, {vocab})")
    return host


def _launch(backend, logits, targets, temperature: float, logp, entropy) -> None:
    """One launch of logprob_rows over the rows of logits; logp / entropy None when not wanted."""
    rows, vocab = shape_of(logits)
    if rows == 0:
        return
    mode = (WANT_LOGP if logp is not None else 0) | (WANT_ENTROPY if entropy is not None else 0)
    dummy_f32 = backend.empty((1,), np.float32) if logp is None or entropy is None else None
    dummy_i32 = backend.zeros((1,), np.int32) if targets is None else None
    backend.launch("logprob", "logprob_rows", (min(rows, MAX_GRID),), (THREADS,),
                   (logits, dummy_i32 if targets is None else targets, np.int64(rows), np.int32(vocab),
                    np.float64(temperature), np.int32(mode),
                    dummy_f32 if logp is None else logp, dummy_f32 if entropy is None else entropy))


def _logprob_pass(backend, logits, targets, temperature: float, want_logp: bool, want_entropy: bool):
    """(logp or None, entropy or None) from one pass of the kernel (or the reference on cpu)."""
    rows, vocab = require_matrix("logits", logits)
    _check_vocab("logprobs" if want_logp else "entropy", vocab)
    temperature = check_temperature(temperature)
    host_targets = _check_targets("logprobs", backend, targets, rows, vocab) if want_logp else None
    if backend.kernel_vendor is None:
        host_logits = backend.to_numpy(logits)
        return (reference.logprobs(host_logits, host_targets, temperature) if want_logp else None,
                reference.entropy(host_logits, temperature) if want_entropy else None)
    logp = backend.empty((rows,), np.float32) if want_logp else None
    ent = backend.empty((rows,), np.float32) if want_entropy else None
    _launch(backend, logits, targets if want_logp else None, temperature, logp, ent)
    return logp, ent


def logprobs(backend, logits, targets, temperature: float = 1.0):
    """float32 [rows]: log softmax(logits / T) at targets, logits float32 [rows, V], targets int32 [rows]."""
    return _logprob_pass(backend, logits, targets, temperature, True, False)[0]


def entropy(backend, logits, temperature: float = 1.0):
    """float32 [rows]: entropy of softmax(logits / T), logits float32 [rows, V]."""
    return _logprob_pass(backend, logits, None, temperature, False, True)[1]


def logprobs_and_entropy(backend, logits, targets, temperature: float = 1.0):
    """(logp, entropy), each float32 [rows], from one pass of the kernel over the logits."""
    return _logprob_pass(backend, logits, targets, temperature, True, True)


def logprobs_backward(backend, logits, targets, temperature, grad):
    """float32 [rows, V]: the gradient of grad[r] * logprobs(logits, targets, T)[r] with respect to logits.

    dlogits[r, v] = (grad[r] / T) * ([v == targets[r]] - softmax(logits[r] / T)[v]), the softmax from the
    forward contract's own exp_f32 terms and exact sum (contracts/logprob.toml). logits float32 [rows, V],
    targets int32 [rows], grad float32 [rows]; a row with grad 0 (a masked token) is +0. Rows are
    independent: a caller may pass any slice of rows (e.g. one LM-head block of logits) and the bits
    of each row do not change.
    """
    rows, vocab = require_matrix("logits", logits)
    _check_vocab("logprobs_backward", vocab)
    temperature = check_temperature(temperature)
    host_targets = _check_targets("logprobs_backward", backend, targets, rows, vocab)
    if shape_of(grad) != (rows,) or np.dtype(grad.dtype) != np.float32:
        raise InputError(f"logprobs_backward: grad must be float32 of shape ({rows},), got "
                         f"{np.dtype(grad.dtype).name} of shape {shape_of(grad)}")
    require_contiguous("grad", grad)
    if backend.kernel_vendor is None:
        return reference.logprobs_backward(backend.to_numpy(logits), host_targets, temperature, backend.to_numpy(grad))
    dlogits = backend.empty((rows, vocab), np.float32)
    if rows:
        backend.launch("logprob", "logprob_backward_rows", (min(rows, MAX_GRID),), (THREADS,),
                       (logits, targets, grad, np.int64(rows), np.int32(vocab), np.float64(temperature), dlogits))
    return dlogits


def lm_head_logprobs(backend, hidden, weight: gemm_op.GemmWeight, targets, temperature: float = 1.0,
                     want_entropy: bool = False, token_block: int = DEFAULT_TOKEN_BLOCK):
    """Log-probabilities of targets [T] under the LM head: logits = gemm(hidden [T, H], weight [V, H]).

    Tokens go through in blocks of token_block: the gemm makes one block's logits [block, V], the
    logprob kernel reduces them, and the next block reuses the memory, so the full [T, V] logits
    never exist at once. Both contracts are per row (the gemm encodes each token's row alone), so
    the bits do not depend on token_block. Returns logp [T], or (logp, entropy) with want_entropy.
    """
    tokens, hidden_size = require_matrix("hidden", hidden)
    if not isinstance(weight, gemm_op.GemmWeight):
        raise InputError(f"lm_head_logprobs: weight must be a GemmWeight (gemm.encode_weight), got {type(weight).__name__}")
    if weight.k != hidden_size:
        raise InputError(f"lm_head_logprobs: hidden has H={hidden_size} columns but the weight has K={weight.k}")
    vocab = weight.n
    _check_vocab("lm_head_logprobs", vocab)
    temperature = check_temperature(temperature)
    if isinstance(token_block, bool) or not isinstance(token_block, (int, np.integer)) or token_block < 1:
        raise InputError(f"lm_head_logprobs: token_block must be a positive integer, got {token_block!r}")
    token_block = int(token_block)
    host_targets = _check_targets("lm_head_logprobs", backend, targets, tokens, vocab)
    if backend.kernel_vendor is None:
        logp = np.empty((tokens,), dtype=np.float32)
        ent = np.empty((tokens,), dtype=np.float32) if want_entropy else None
        host_hidden = backend.to_numpy(hidden)
        for start in range(0, tokens, token_block):
            stop = min(start + token_block, tokens)
            logits = gemm_op.gemm(backend, host_hidden[start:stop], weight)
            logp[start:stop] = reference.logprobs(logits, host_targets[start:stop], temperature)
            if want_entropy:
                ent[start:stop] = reference.entropy(logits, temperature)
        return (logp, ent) if want_entropy else logp
    logp = backend.empty((tokens,), np.float32)
    ent = backend.empty((tokens,), np.float32) if want_entropy else None
    for start in range(0, tokens, token_block):
        stop = min(start + token_block, tokens)
        logits = gemm_op.gemm(backend, hidden[start:stop], weight)
        _launch(backend, logits, targets[start:stop], temperature, logp[start:stop],
                ent[start:stop] if want_entropy else None)
        del logits
    return (logp, ent) if want_entropy else logp
