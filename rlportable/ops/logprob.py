"""Op family "logprob": log-probabilities and entropy of logits at a temperature, the LM head
that produces them block by block, and the log-probabilities' gradient with respect to the logits.

Contract: contracts/logprob.toml; reference: rlportable/contract/logprob.py (logprobs, entropy,
logprobs_backward, and the vocabulary-parallel shard_max_keys, shard_sums, shard_finish);
kernels: backends/portable/logprob.hip.
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
    if backend.runs_reference:
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
    if backend.runs_reference:
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
    if backend.runs_reference:
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


# --- Vocabulary-parallel log-probs (tensor parallelism): the rank holding logits[:, start:start + Vr]
# runs shard_max_keys, the ranks all-reduce MAX of the keys, each runs shard_sums with them, the ranks
# all-reduce SUM of the int64 pairs, and shard_finish gives logprobs' bits on the whole rows
# (contracts/logprob.toml, ops shard_max_keys, shard_sums, shard_finish).


def _check_shard(where: str, logits_shard) -> tuple[int, int]:
    rows, width = require_matrix("logits_shard", logits_shard)
    if not 1 <= width <= reference.MAX_VOCAB:
        raise InputError(f"{where}: the shard's width must lie in [1, 2^25], got {width}")
    return rows, width


def _check_keys(where: str, keys, rows: int) -> None:
    if shape_of(keys) != (rows,) or np.dtype(keys.dtype) != np.uint32:
        raise InputError(f"{where}: keys must be uint32 of shape ({rows},) (shard_max_keys, MAX over the ranks), "
                         f"got {np.dtype(keys.dtype).name} of shape {shape_of(keys)}")
    require_contiguous("keys", keys)


def _check_vocab_start(where: str, vocab_start, width: int) -> int:
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, (int, np.integer)) \
            or not 0 <= vocab_start <= 2**31 - width:
        raise InputError(f"{where}: vocab_start must be an integer in [0, 2^31 - {width}] (the shard's ids must "
                         f"be int32), got {vocab_start!r}")
    return int(vocab_start)


def _check_global_targets(where: str, backend, targets, rows: int) -> np.ndarray:
    """Global target ids: int32 [rows], >= 0 (the whole vocabulary is not known to a rank)."""
    if shape_of(targets) != (rows,) or np.dtype(targets.dtype) != np.int32:
        raise InputError(f"{where}: targets must be int32 of shape ({rows},), got "
                         f"{np.dtype(targets.dtype).name} of shape {shape_of(targets)}")
    require_contiguous("targets", targets)
    host = np.asarray(backend.to_numpy(targets))
    bad = host < 0
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise InputError(f"{where}: targets[{index}] = {int(host[index])} is negative")
    return host


def shard_max_keys(backend, logits_shard, temperature: float = 1.0):
    """uint32 [rows]: the order key of max_v RNE_f32(z_v / T) over this rank's columns (logits_shard float32
    [rows, Vr]), 0xFFFFFFFF where any of them is NaN. The MAX over the ranks is the whole row's key."""
    rows, width = _check_shard("shard_max_keys", logits_shard)
    temperature = check_temperature(temperature)
    if backend.runs_reference:
        return reference.shard_max_keys(backend.to_numpy(logits_shard), temperature)
    keys = backend.empty((rows,), np.uint32)
    if rows:
        backend.launch("logprob", "logprob_shard_max", (min(rows, MAX_GRID),), (THREADS,),
                       (logits_shard, np.int64(rows), np.int32(width), np.float64(temperature), keys))
    return keys


def shard_sums(backend, logits_shard, keys, targets, vocab_start, temperature: float = 1.0):
    """int64 [rows, 2]: this rank's (part of S, bits of RNE_f32(a_y - m) if it owns the target y else 0).

    logits_shard float32 [rows, Vr] holds the global columns [vocab_start, vocab_start + Vr); keys uint32
    [rows] is the MAX over every rank of shard_max_keys (m = the row's maximum); targets int32 [rows] are
    global ids (>= 0). A row whose m is not finite (a NaN or +-inf) writes (0, 0). The SUM over the ranks
    goes to shard_finish. The whole vocabulary must be at most 2^25 (the contract's bound on S)."""
    rows, width = _check_shard("shard_sums", logits_shard)
    _check_keys("shard_sums", keys, rows)
    vocab_start = _check_vocab_start("shard_sums", vocab_start, width)
    temperature = check_temperature(temperature)
    host_targets = _check_global_targets("shard_sums", backend, targets, rows)
    if backend.runs_reference:
        return reference.shard_sums(backend.to_numpy(logits_shard), backend.to_numpy(keys), host_targets,
                                    vocab_start, temperature)
    sums = backend.empty((rows, 2), np.int64)
    if rows:
        backend.launch("logprob", "logprob_shard_sums", (min(rows, MAX_GRID),), (THREADS,),
                       (logits_shard, keys, targets, np.int64(rows), np.int32(width), np.int32(vocab_start),
                        np.float64(temperature), sums))
    return sums


def shard_finish(backend, sums, keys):
    """float32 [rows]: logprobs' bits on the whole rows from sums int64 [rows, 2] (the SUM over the ranks
    of shard_sums) and keys uint32 [rows] (the MAX over the ranks of shard_max_keys)."""
    shape = shape_of(sums)
    if len(shape) != 2 or shape[1] != 2 or np.dtype(sums.dtype) != np.int64:
        raise InputError(f"shard_finish: sums must be int64 of shape (rows, 2), got {np.dtype(sums.dtype).name} "
                         f"of shape {shape}")
    require_contiguous("sums", sums)
    rows = shape[0]
    _check_keys("shard_finish", keys, rows)
    if backend.runs_reference:
        return reference.shard_finish(backend.to_numpy(sums), backend.to_numpy(keys))
    logp = backend.empty((rows,), np.float32)
    if rows:
        backend.launch("logprob", "logprob_shard_finish", (min(-(-rows // THREADS), MAX_GRID),), (THREADS,),
                       (sums, keys, np.int64(rows), logp))
    return logp
