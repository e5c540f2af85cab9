"""Embedding lookup and its gradient: reference of contracts/embedding.toml.

  out[t, :] = table[ids[t], :]      for a float32 table [V, H] and int32 ids [T]

a bit copy (NaN payloads, -0 and subnormals kept). Every id must lie in [0, V);
the op checks that on the host before any launch (an id out of range is an error,
never a wrap-around or a clamp).

Vocabulary parallelism (gather_shard): a rank holding the rows [start, start + Vr) copies the
rows it owns and writes +0 bits for the other ids, so a SUM (or OR) of the ranks' outputs as
uint32 is the full gather, bit for bit.

The gradient (gather_backward) of the table, for an upstream gradient dy [T, H]:

  dtable[v, h] = RNE_f32(((+0 + dy[t1, h]) + dy[t2, h]) + ...)    t1 < t2 < ... the tokens with id v

float64 IEEE additions in increasing token index, from +0, rounded once to float32; a NaN
result is the canonical NaN, a row with no tokens +0. The order depends on token positions
only, so every backend, launch shape and vendor gives the same bits.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract.fixedpoint import CANONICAL_NAN


def gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float32 [V, H], int [T] -> float32 [T, H], the rows' raw bits."""
    table = np.asarray(table, dtype=np.float32)
    ids = np.asarray(ids).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {table.shape[0]})")
    return table.view(np.uint32)[ids].view(np.float32)


def gather_shard(table_shard: np.ndarray, ids: np.ndarray, vocab_start: int) -> np.ndarray:
    """float32 [T, H]: the rows of the vocabulary shard table_shard [Vr, H] (global rows [start, start + Vr))
    at the global ids [T], raw bits; +0 for an id another shard owns. The uint32 sum over the shards of
    a vocabulary split is then gather(table, ids) bit for bit (exactly one shard owns each id)."""
    table_shard = np.asarray(table_shard, dtype=np.float32)
    ids = np.asarray(ids).astype(np.int64)
    if ids.size and ids.min() < 0:
        raise ValueError("embedding ids must be >= 0")
    local = ids - int(vocab_start)
    owned = (local >= 0) & (local < table_shard.shape[0])
    out = np.zeros((ids.shape[0], table_shard.shape[1]), dtype=np.uint32)
    out[owned] = table_shard.view(np.uint32)[local[owned]]
    return out.view(np.float32)


def token_lists(ids: np.ndarray, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int32 [V + 1], order int32 [T]): order[offsets[v]:offsets[v + 1]] are the token indices t
    with ids[t] == v, increasing (a stable sort by id), so every row's list is in token order."""
    ids = np.asarray(ids).astype(np.int64)
    order = np.argsort(ids, kind="stable").astype(np.int32)
    offsets = np.zeros(vocab + 1, dtype=np.int32)
    np.cumsum(np.bincount(ids, minlength=vocab), out=offsets[1:])
    return offsets, order


@np.errstate(over="ignore", invalid="ignore")  # +-inf and NaN are defined results, not warnings
def gather_backward(ids: np.ndarray, dy: np.ndarray, vocab: int) -> np.ndarray:
    """float32 [V, H]: dtable[v] = the float64 sum of dy[t] over the tokens t with ids[t] == v, in increasing t,
    from +0, rounded once to float32; NaN results canonical, rows with no tokens +0."""
    dy = np.asarray(dy, dtype=np.float32)
    ids = np.asarray(ids).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"embedding ids must lie in [0, {vocab})")
    offsets, order = token_lists(ids, vocab)
    counts = np.diff(offsets)
    total = np.zeros((vocab, dy.shape[1]), dtype=np.float64)
    rows = np.flatnonzero(counts)
    for k in range(int(counts.max(initial=0))):
        # the k-th token of every row that has one: one IEEE float64 addition per row and column
        rows = rows[counts[rows] > k]
        total[rows] += dy[order[offsets[rows] + k]].astype(np.float64)
    out = total.astype(np.float32)
    out[np.isnan(out)] = CANONICAL_NAN
    return out
