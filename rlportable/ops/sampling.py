"""Op family "sampling": the sampler's contract on the device, for rows without filters.

Contract: contracts/sampling.toml; reference: rlportable/contract/sampling.py (sample,
sampled_logprobs); kernels: backends/portable/sampling.hip.

The kernel samples greedy rows (T = 0) and rows with T > 0 and no top-k / top-p / min-p: the
settings RL rollouts use. A row with a filter is an InputError here on every backend (cpu
included, so an op behaves alike everywhere); the engine samples those rows on the host with
the reference (`device_rows` tells which), which gives the same bits by contract.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import sampling as reference
from rlportable.errors import InputError
from rlportable.ops import embedding as embedding_op
from rlportable.ops import logprob as logprob_op
from rlportable.ops.checks import require_matrix, shape_of

THREADS = 512        # any block size up to 1024 gives the same tokens (the kernel's scan is exact)
MAX_THREADS = 1024   # RLP_SAMPLING_MAX_THREADS: the kernel's shared prefix array
MAX_GRID = 65535
REFUSED = -1         # the kernel's token for a row the contract refuses


def device_rows(vocab: int, temperature, top_k=None, top_p=None, min_p=None) -> np.ndarray:
    """bool [rows]: the rows the kernel samples: greedy (T = 0; the contract ignores filters there),
    or T > 0 with no filter (top_k < 1 or >= V, top_p = 1, min_p = 0). The others need the host."""
    temperature = np.atleast_1d(np.asarray(temperature, dtype=np.float64))
    rows = temperature.shape[0]
    temperature, top_k, top_p, min_p = reference.check_parameters(rows, temperature, top_k, top_p, min_p)
    unfiltered = ((top_k < 1) | (top_k >= vocab)) & (top_p == 1.0) & (min_p == 0.0)
    return (temperature == 0) | unfiltered


def _row_counters(rows: int, seed, request, sample_index, position) -> list[np.ndarray]:
    """seed uint64, request / sample_index / position uint32, each [rows] (the reference's checks)."""
    counters = reference.row_counters(rows, seed, request, sample_index, position)
    return [np.ascontiguousarray(array.astype(dtype))
            for array, dtype in zip(counters, (np.uint64, np.uint32, np.uint32, np.uint32))]


def _refuse(backend, logits, host_tokens: np.ndarray, temperature: np.ndarray) -> None:
    """Raise the reference's InputError for the first row the kernel refused."""
    bad = np.flatnonzero(host_tokens == REFUSED)
    if bad.size == 0:
        return
    row = int(bad[0])
    picked = embedding_op.gather(backend, logits, backend.asarray(np.array([row], dtype=np.int32)))
    z = np.asarray(backend.to_numpy(picked))
    reference.scaled_logits(z, temperature[row:row + 1], row)  # raises, naming the row
    raise InputError(f"sampling: row {row} of the logits was refused by the kernel")  # pragma: no cover


def sample(backend, logits, temperature, top_k=None, top_p=None, min_p=None, *, seed, request, sample_index,
           position, threads: int = THREADS):
    """int32 [rows] (a backend array): contract.sampling.sample of each row, bit for bit, for rows
    without filters (top_k, top_p, min_p: None or off; a filtered row with T > 0 is an InputError).

    logits float32 [rows, V] (a backend array); temperature (float64 >= 0, 0 = greedy), seed
    ([0, 2^64)), request, sample_index, position ([0, 2^32)): scalars or host arrays [rows].
    A row with a NaN, +inf (also from z / T) or no finite logit raises the reference's InputError.
    `threads`: the kernel's block size (any value in [1, 1024] gives the same tokens)."""
    rows, vocab = require_matrix("logits", logits)
    reference.check_vocab(vocab)
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or not 1 <= threads <= MAX_THREADS:
        raise InputError(f"sampling: threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
    temperature, top_k, top_p, min_p = reference.check_parameters(rows, temperature, top_k, top_p, min_p)
    on_device = device_rows(vocab, temperature, top_k, top_p, min_p) if rows else np.zeros(0, bool)
    if not on_device.all():
        row = int(np.flatnonzero(~on_device)[0])
        raise InputError(f"sampling: row {row} has top_k={int(top_k[row])}, top_p={float(top_p[row])!r}, "
                         f"min_p={float(min_p[row])!r} at temperature {float(temperature[row])!r}: filtered rows "
                         f"are sampled on the host (rlportable.contract.sampling.sample), not by this op")
    seeds, requests, samples, positions = _row_counters(rows, seed, request, sample_index, position)
    if backend.runs_reference:
        return reference.sample(backend.to_numpy(logits), temperature, seed=seeds, request=requests,
                                sample_index=samples, position=positions)
    temperature = np.ascontiguousarray(temperature, dtype=np.float64)
    tokens = sample_on_device(backend, logits, *(backend.asarray(a) for a in (temperature, seeds, requests, samples,
                                                                             positions)), threads=threads)
    if rows:
        _refuse(backend, logits, np.asarray(backend.to_numpy(tokens)), temperature)
    return tokens


def sampled_logprobs(backend, logits, tokens, temperature):
    """float32 [rows]: the log-prob the engine records for each sampled token, the logprob op at
    record_temperature(T) (T, or 1 for greedy rows), as contract.sampling.sampled_logprobs.
    logits float32 [rows, V] and tokens int32 [rows] are backend arrays; temperature host [rows]."""
    rows, vocab = require_matrix("logits", logits)
    if shape_of(tokens) != (rows,) or np.dtype(tokens.dtype) != np.int32:
        raise InputError(f"sampling: tokens must be int32 of shape ({rows},), got "
                         f"{np.dtype(tokens.dtype).name} of shape {shape_of(tokens)}")
    t = reference.record_temperature(reference.temperatures(temperature, rows))
    values = np.unique(t)
    if values.size == 1:
        return logprob_op.logprobs(backend, logits, tokens, float(values[0]))
    host_tokens = np.asarray(backend.to_numpy(tokens))
    out = np.empty(rows, dtype=np.float32)
    for value in values:
        group = np.flatnonzero(t == value).astype(np.int32)
        z = embedding_op.gather(backend, logits, backend.asarray(group))  # a bit copy of the rows
        out[group] = backend.to_numpy(logprob_op.logprobs(backend, z, backend.asarray(host_tokens[group]),
                                                          float(value)))
    return out if backend.runs_reference else backend.asarray(out)


# ---- the engine's step loop: parameters already on the device, nothing read back


def kernel_row_parameters(rows: int, temperature, seed, request, sample_index, position) -> list[np.ndarray]:
    """The sampling kernel's per-row arrays on the host, checked as `sample` checks them:
    temperature float64, seed uint64, request / sample_index / position uint32, each [rows]."""
    temperature = np.ascontiguousarray(reference.temperatures(temperature, rows))
    return [temperature] + _row_counters(rows, seed, request, sample_index, position)


def sample_on_device(backend, logits, temperature, seed, request, sample_index, position, threads: int = THREADS,
                     with_logprobs: bool = False):
    """`sample` for rows whose parameters are already backend arrays [rows] (kernel_row_parameters'
    dtypes; the caller checked its host copies and that every row is unfiltered, `device_rows`).
    Returns tokens int32 [rows] without copying anything back: a row the contract refuses gets
    REFUSED (-1), and the caller raises with `raise_refused` once it has its host copy of the tokens.
    with_logprobs: returns (tokens, log-probs float32 [rows]), each drawn token's log-prob under the
    logprob contract at its row's record temperature (T, or 1 for greedy rows), the bits
    `logprob.logprobs` gives, from the kernel's own maximum and sum (contracts/sampling.toml); refused
    rows get the canonical NaN. On cpu this is the reference, which raises at once."""
    rows, vocab = require_matrix("logits", logits)
    reference.check_vocab(vocab)
    for name, array, dtype in (("temperature", temperature, np.float64), ("seed", seed, np.uint64),
                               ("request", request, np.uint32), ("sample_index", sample_index, np.uint32),
                               ("position", position, np.uint32)):
        if shape_of(array) != (rows,) or np.dtype(array.dtype) != np.dtype(dtype):
            raise InputError(f"sampling: {name} must be {np.dtype(dtype).name} of shape ({rows},), got "
                             f"{np.dtype(array.dtype).name} of shape {shape_of(array)}")
    if backend.runs_reference:
        tokens = np.asarray(reference.sample(np.asarray(logits), np.asarray(temperature), seed=np.asarray(seed),
                                             request=np.asarray(request), sample_index=np.asarray(sample_index),
                                             position=np.asarray(position)), dtype=np.int32)
        if not with_logprobs:
            return tokens
        return tokens, sampled_logprobs(backend, np.asarray(logits), tokens, np.asarray(temperature))
    tokens = backend.empty((rows,), np.int32)
    logp = backend.empty((rows,) if with_logprobs else (1,), np.float32)
    if rows:
        backend.launch("sampling", "sampling_rows", (min(rows, MAX_GRID),), (int(threads),),
                       (logits, np.int64(rows), np.int32(vocab), temperature, seed, request, sample_index, position,
                        tokens, np.int32(1 if with_logprobs else 0), logp))
    return (tokens, logp) if with_logprobs else tokens


def raise_refused(backend, logits, host_tokens: np.ndarray, temperature) -> None:
    """Raise the reference's InputError for the first row whose token is REFUSED (no-op if none).
    logits: the backend array the tokens were drawn from; temperature: host [rows]."""
    _refuse(backend, logits, np.asarray(host_tokens), np.asarray(temperature, dtype=np.float64))


def sample_and_logprobs(backend, logits, temperature, *, seed, request, sample_index, position):
    """(tokens int32 [rows], log-probs float32 [rows]): `sample` then `sampled_logprobs`."""
    tokens = sample(backend, logits, temperature, seed=seed, request=request, sample_index=sample_index,
                    position=position)
    return tokens, sampled_logprobs(backend, logits, tokens, temperature)


# ---- the engine's asynchronous scheduling: a step's drawn tokens become the next step's input


def token_id_table(backend, vocab: int):
    """int32 [vocab] with entry v = v, a backend array: feed_tokens reads drawn tokens through it."""
    return backend.asarray(np.arange(reference.check_vocab(vocab), dtype=np.int32))


def feed_tokens(backend, drawn, rows, host_rows: np.ndarray, id_table, out) -> None:
    """out[i] = drawn[rows[i]] if that is a token id (in [0, vocab), vocab = id_table's size), else 0,
    for every i: the tokens one step drew (the sampling kernel's output, which the host has not read)
    as the next step's input tokens, with no round trip through the host.

    A row the kernel refused (REFUSED) becomes token 0, so the next step reads a real embedding row;
    the host raises the refusal when it reads the drawn tokens (and drops the next step). drawn: int32
    [m]; rows: int32 [n] (a backend array) and host_rows its host copy, each in [0, m); id_table:
    token_id_table(vocab); out: int32 [n], a backend array (a view of the next step's input).

    On a device this is two existing kernels that move 32-bit words and compute nothing: the embedding
    gather of drawn seen as a table of one-word rows, at rows (skipped when rows is 0, 1, ..., m - 1),
    then the vocabulary-parallel gather of id_table's one-word rows at those tokens with the whole
    vocabulary as the shard, which gives 0 for an id outside [0, vocab)."""
    host_rows = np.asarray(host_rows)
    m, n, vocab = (shape_of(a)[0] if shape_of(a) else 0 for a in (drawn, host_rows, id_table))
    for name, array, length in (("drawn", drawn, m), ("rows", rows, n), ("out", out, n), ("id_table", id_table, vocab)):
        if shape_of(array) != (length,) or np.dtype(array.dtype) != np.int32:
            raise InputError(f"feed_tokens: {name} must be int32 of shape ({length},), got "
                             f"{np.dtype(array.dtype).name} of shape {shape_of(array)}")
    if n and (host_rows.min() < 0 or host_rows.max() >= m):
        raise InputError(f"feed_tokens: rows must lie in [0, {m}), the rows drawn")
    if backend.runs_reference:
        picked = np.asarray(drawn)[host_rows]
        out[...] = np.where((picked >= 0) & (picked < vocab), picked, 0)
        return
    if not n:
        return
    grid, block = (min(-(-n // embedding_op.THREADS), embedding_op.MAX_GRID),), (embedding_op.THREADS,)
    picked = drawn
    if n != m or not np.array_equal(host_rows, np.arange(m)):
        picked = backend.empty((n,), np.int32)
        backend.launch("embedding", "embedding_gather", grid, block, (drawn, rows, np.int64(n), np.int32(1), picked))
    backend.launch("embedding", "embedding_gather_shard", grid, block,
                   (id_table, picked, np.int64(n), np.int32(1), np.int32(0), np.int32(vocab), out))
