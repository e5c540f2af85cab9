"""Conformance of the vocabulary-parallel ops: the log-prob's per-rank steps
(shard_max_keys, shard_sums, shard_finish) and the embedding's gather_shard, each bitwise against its
reference on every shard of ragged splits, and the ranks' combination (MAX of the keys, SUM of the int64
pairs, uint32 SUM of the gathers, emulated here in NumPy) against the unsharded reference.

On cpu each check compares the reference with itself through the op (and proves the sharding identity);
on a GPU the same checks run the kernels.
"""

from __future__ import annotations

import numpy as np

from rlportable.conform.forward_ops import (
    LOGPROB_KINDS,
    LOGPROB_SHAPES_FULL,
    LOGPROB_SHAPES_QUICK,
    LOGPROB_TEMPERATURES,
    _logprob_rows,
    _random_bits,
    _sizes,
)
from rlportable.conform.tally import Tally
from rlportable.contract import embedding as embedding_ref
from rlportable.contract import logprob as logprob_ref
from rlportable.ops import embedding as embedding_op
from rlportable.ops import logprob as logprob_op
from rlportable.runtime.base import Backend

SHARD_COUNTS = (1, 2, 3, 4, 8)


def ragged_cuts(rng, vocab: int, shards: int) -> list[int]:
    """Cut points 0 = c_0 < c_1 < ... < c_n = vocab of min(shards, vocab) contiguous shards of random widths >= 1."""
    shards = min(shards, vocab)
    inner = np.sort(rng.choice(np.arange(1, vocab), size=shards - 1, replace=False)) if shards > 1 else []
    return [0, *[int(c) for c in inner], vocab]


def targets_in_every_shard(rng, rows: int, cuts: list[int]) -> np.ndarray:
    """int32 [rows]: row r's target lies in shard r mod n (at a random column of it)."""
    targets = np.empty(rows, dtype=np.int32)
    for row in range(rows):
        shard = row % (len(cuts) - 1)
        targets[row] = rng.integers(cuts[shard], cuts[shard + 1])
    return targets


def sharded_edge_rows(rng, rows: int, cuts: list[int]) -> np.ndarray:
    """float32 [rows, V]: ordinary logits with, row by row in turn, one shard holding a NaN, one a +inf, one
    shard entirely -inf, a +0/-0 maximum split across shards, scattered -inf entries, an all -inf row."""
    vocab = cuts[-1]
    z = (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
    for row in range(rows):
        shard = int(rng.integers(len(cuts) - 1))
        lo, hi = cuts[shard], cuts[shard + 1]
        case = row % 6
        if case == 0:
            z[row, rng.integers(lo, hi)] = np.nan
        elif case == 1:
            z[row, rng.integers(lo, hi)] = np.inf
        elif case == 2:
            z[row, lo:hi] = -np.inf
        elif case == 3:  # the maximum 0 as +0 in one place and -0 in another (often in two shards)
            z[row] = -np.abs(z[row]) - np.float32(1.0)
            z[row, rng.integers(vocab)] = 0.0
            z[row, rng.integers(vocab)] = -0.0
        elif case == 4:
            z[row, rng.random(vocab) < 0.4] = -np.inf
        else:
            z[row] = -np.inf
    return z


def sharded_logprobs(backend: Backend, z: np.ndarray, targets: np.ndarray, cuts: list[int], temperature: float,
                     tally: Tally | None = None) -> np.ndarray:
    """The vocabulary-parallel pipeline with the ranks emulated in NumPy: MAX of the shards' keys, SUM of their
    int64 pairs, then shard_finish. With a tally, each rank's step is also compared with its reference."""
    shards = [np.ascontiguousarray(z[:, lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
    targets_dev = backend.asarray(targets)
    shard_devs = [backend.asarray(shard) for shard in shards]
    keys = np.zeros(z.shape[0], dtype=np.uint32)
    for shard, shard_dev in zip(shards, shard_devs):
        got = backend.to_numpy(logprob_op.shard_max_keys(backend, shard_dev, temperature))
        if tally is not None:
            tally.add(got, logprob_ref.shard_max_keys(shard, temperature))
        keys = np.maximum(keys, got)  # the all-reduce MAX
    keys_dev = backend.asarray(keys)
    sums = np.zeros((z.shape[0], 2), dtype=np.int64)
    for start, shard, shard_dev in zip(cuts, shards, shard_devs):
        got = backend.to_numpy(logprob_op.shard_sums(backend, shard_dev, keys_dev, targets_dev, start, temperature))
        if tally is not None:
            tally.add(got, logprob_ref.shard_sums(shard, keys, targets, start, temperature))
        sums += got  # the all-reduce SUM
    logp = backend.to_numpy(logprob_op.shard_finish(backend, backend.asarray(sums), keys_dev))
    if tally is not None:
        tally.add(logp, logprob_ref.shard_finish(sums, keys))
    return logp


def check_logprob_shards(backend: Backend, rng, quick: bool) -> Tally:
    """Every rank's step against its reference, and the sharded pipeline against logprobs on the whole rows,
    for 1, 2, 3, 4 and 8 ragged shards, every logits kind and the sharded edge rows."""
    tally = Tally()
    for rows, vocab in _sizes(backend, quick, LOGPROB_SHAPES_QUICK, LOGPROB_SHAPES_FULL):
        for shards in SHARD_COUNTS:
            cuts = ragged_cuts(rng, vocab, shards)
            targets = targets_in_every_shard(rng, rows, cuts)
            for kind in LOGPROB_KINDS + ("sharded_edges",):
                if kind == "sharded_edges":
                    z = sharded_edge_rows(rng, max(rows, 12), cuts)
                    kind_targets = targets_in_every_shard(rng, z.shape[0], cuts)
                else:
                    z, kind_targets = _logprob_rows(rng, rows, vocab, kind), targets
                for temperature in LOGPROB_TEMPERATURES if kind in ("logits", "sharded_edges") else (1.0, 0.7):
                    got = sharded_logprobs(backend, z, kind_targets, cuts, temperature, tally)
                    tally.add(got, logprob_ref.logprobs(z, kind_targets, temperature))
    return tally


# (V, H, T): 1x1, ragged, a model-like table; T = 0 and H = 0
GATHER_SHARD_SHAPES_QUICK = [(1, 1, 1), (13, 7, 5), (1000, 257, 64), (50, 16, 0), (9, 0, 4)]
GATHER_SHARD_SHAPES_FULL = GATHER_SHARD_SHAPES_QUICK + [(151936, 64, 4096)]


def check_embedding_gather_shard(backend: Backend, rng, quick: bool) -> Tally:
    """gather_shard on every shard of ragged splits against its reference (host ids given and copied back),
    and the uint32 sum over the shards against gather on the whole table."""
    tally = Tally()
    for vocab, hidden, tokens in _sizes(backend, quick, GATHER_SHARD_SHAPES_QUICK, GATHER_SHARD_SHAPES_FULL):
        table = _random_bits(rng, (vocab, hidden))  # every float32 class: NaN payloads, -0, subnormals
        for shards in SHARD_COUNTS:
            cuts = ragged_cuts(rng, vocab, shards)
            ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
            edges = np.array([c for cut in cuts for c in (cut - 1, cut) if 0 <= c < vocab], dtype=np.int32)
            ids[: min(tokens, edges.size)] = edges[:tokens]  # the first and last row of every shard
            ids_dev = backend.asarray(ids)
            total = np.zeros((tokens, hidden), dtype=np.uint32)
            for lo, hi in zip(cuts, cuts[1:]):
                shard = np.ascontiguousarray(table[lo:hi])
                expected = embedding_ref.gather_shard(shard, ids, lo)
                shard_dev = backend.asarray(shard)
                got = backend.to_numpy(embedding_op.gather_shard(backend, shard_dev, ids_dev, lo, host_ids=ids))
                tally.add(got, expected)
                tally.add(backend.to_numpy(embedding_op.gather_shard(backend, shard_dev, ids_dev, lo)), expected)
                total += got.view(np.uint32)  # the all-reduce SUM of the words
            tally.add(total.view(np.float32), embedding_ref.gather(table, ids))
    return tally


PARALLEL_VOCAB_CHECKS = [
    ("logprob.shards", check_logprob_shards),
    ("embedding.gather_shard", check_embedding_gather_shard),
]
