"""Conformance of the embedding family (contracts/embedding.toml): gather, gather_backward (skewed and
uniform ids, every dy kind) and the vocabulary-parallel gather_shard on every shard of ragged splits with
the ranks' uint32 SUM emulated in NumPy, bitwise against the reference; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.inputs import SHARD_COUNTS, ragged_cuts, random_bits, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import embedding as embedding_ref
from rlportable.ops import embedding as embedding_op
from rlportable.runtime.base import Backend

EMBEDDING_SHAPES = [(1, 1, 1), (13, 7, 5), (1000, 257, 64), (50, 16, 0)]  # (V, H, T)


def check_embedding_gather(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for vocab, hidden, tokens in sizes(backend, quick, EMBEDDING_SHAPES, EMBEDDING_SHAPES + [(151936, 64, 4096)]):
        table = random_bits(rng, (vocab, hidden))
        ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
        if tokens >= 2:
            ids[0], ids[-1] = 0, vocab - 1
        got = embedding_op.gather(backend, backend.asarray(table), backend.asarray(ids))
        tally.add(backend.to_numpy(got), embedding_ref.gather(table, ids))
    return tally


# ---- backward: the table's gradient

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
        return random_bits(rng, (tokens, hidden))
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
    shapes = sizes(backend, quick, EMBEDDING_BACKWARD_SHAPES_QUICK, EMBEDDING_BACKWARD_SHAPES_FULL)
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


# ---- sharded: gather_shard (on cpu the reference against itself, and the sharding identity)

# (V, H, T): 1x1, ragged, a model-like table; T = 0 and H = 0
GATHER_SHARD_SHAPES_QUICK = [(1, 1, 1), (13, 7, 5), (1000, 257, 64), (50, 16, 0), (9, 0, 4)]
GATHER_SHARD_SHAPES_FULL = GATHER_SHARD_SHAPES_QUICK + [(151936, 64, 4096)]


def check_embedding_gather_shard(backend: Backend, rng, quick: bool) -> Tally:
    """gather_shard on every shard of ragged splits against its reference (host ids given and copied back),
    and the uint32 sum over the shards against gather on the whole table."""
    tally = Tally()
    for vocab, hidden, tokens in sizes(backend, quick, GATHER_SHARD_SHAPES_QUICK, GATHER_SHARD_SHAPES_FULL):
        table = random_bits(rng, (vocab, hidden))  # every float32 class: NaN payloads, -0, subnormals
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


CHECKS: list[tuple[str, Callable]] = [
    ("embedding.gather", check_embedding_gather),
    ("embedding.gather_backward", check_embedding_gather_backward),
    ("embedding.gather_shard", check_embedding_gather_shard),
]


# ---- golden

GOLDEN_CASES = Cases("embedding")


@GOLDEN_CASES.case("gather", seed=50, shapes=[[1, 1, 1], [13, 7, 5], [1000, 257, 64], [50, 16, 0]],
                   table_kind="bits", shape_order="[V, H, T]")
def _embedding_gather(backend, s, r):
    out = []
    for i, (vocab, hidden, tokens) in enumerate(r["shapes"]):
        table = backend.asarray(s.floats((vocab, hidden), r["table_kind"]))
        ids = s.ints((tokens,), 0, vocab)
        if tokens >= 2:
            ids[0], ids[-1] = 0, vocab - 1
        out.append((f"{i}.y", host(backend, embedding_op.gather(backend, table, backend.asarray(ids)))))
    return out


@GOLDEN_CASES.case("gather_backward", seed=51,
                   shapes=[[1, 1, 1], [13, 7, 5], [20, 33, 300], [1000, 257, 64], [50, 16, 0], [9, 0, 4]],
                   dy_kinds=["uniform", "huge", "zeros", "bits"], shape_order="[V, H, T]",
                   ids="repeated: ids in [0, min(V, 8)) for every other shape, else [0, V)")
def _embedding_gather_backward(backend, s, r):
    out = []
    for i, (vocab, hidden, tokens) in enumerate(r["shapes"]):
        ids = s.ints((tokens,), 0, min(vocab, 8) if i % 2 else vocab)
        ids_dev = backend.asarray(ids)
        for kind in r["dy_kinds"]:
            dy = backend.asarray(s.floats((tokens, hidden), kind))
            d_table = embedding_op.gather_backward(backend, ids_dev, ids, dy, vocab)
            out.append((f"{i}.{kind}.dtable", host(backend, d_table)))
    return out
