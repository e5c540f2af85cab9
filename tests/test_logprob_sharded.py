"""Vocabulary-parallel ops on the cpu backend (tensor parallelism): the log-prob's per-rank steps
(shard_max_keys -> MAX over ranks -> shard_sums -> SUM over ranks -> shard_finish) equal logprobs on
the whole rows bit for bit, and the uint32 sum of the ranks' gather_shard equals gather; input checks;
the sharded conformance checks of rlportable/conform/logprob.py and embedding.py.

The ranks are emulated in NumPy (np.maximum of the keys, integer sums); the device kernels are checked
bitwise against the same references by `rlportable conform`.
"""

from __future__ import annotations


import numpy as np
import pytest

from rlportable.conform import embedding as embedding_conform, logprob as logprob_conform
from rlportable.conform.inputs import SHARD_COUNTS, ragged_cuts
from rlportable.conform.logprob import sharded_edge_rows, sharded_logprobs, targets_in_every_shard
from rlportable.contract import logprob as reference
from rlportable.errors import InputError
from rlportable.ops import embedding, logprob
from rlportable.conform.tally import check_rng
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
NAN_BITS = 0x7FC00000


def _bits(a):
    return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize("shards", SHARD_COUNTS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sharded_pipeline_equals_logprobs(shards, temperature):
    rng = np.random.default_rng([shards, int(temperature * 10)])
    vocab = 1001
    cuts = ragged_cuts(rng, vocab, shards)
    assert len(cuts) == shards + 1 and all(b > a for a, b in zip(cuts, cuts[1:]))
    ordinary = (rng.standard_normal((16, vocab)) * 4.0).astype(np.float32)
    edges = sharded_edge_rows(rng, 24, cuts)  # NaN / +inf / all -inf in one shard, +-0 maxima, -inf entries
    for z in (ordinary, edges):
        targets = targets_in_every_shard(rng, z.shape[0], cuts)
        got = sharded_logprobs(CPU, z, targets, cuts, temperature)
        assert np.array_equal(_bits(got), _bits(logprob.logprobs(CPU, z, targets, temperature)))


def test_one_shard_edge_cases():
    # columns [0, 3) and [3, 6): the marked value sits in one shard only
    finite = np.array([0.5, -1.0, 2.0, 1.0, -3.0, 0.25], dtype=np.float32)
    rows = []
    for column, value in ((4, np.nan), (1, np.inf)):  # NaN / +inf in one shard: the row is NaN
        row = finite.copy()
        row[column] = value
        rows.append(row)
    shard_neg_inf = finite.copy()
    shard_neg_inf[3:] = -np.inf  # a whole shard -inf under a finite maximum: its target gives -inf
    rows += [shard_neg_inf, shard_neg_inf, np.full(6, -np.inf, np.float32)]
    ties = np.full(6, -1000.0, np.float32)  # exp_f32(-1000) = 0: two equal maxima, logp = -log 2
    ties[1], ties[4] = -0.0, 0.0  # the maximum 0 as -0 in shard 0 and +0 in shard 1
    rows += [ties, ties]
    z = np.stack(rows)
    targets = np.array([0, 0, 4, 2, 1, 1, 4], dtype=np.int32)
    cuts = [0, 3, 6]
    got = sharded_logprobs(CPU, z, targets, cuts, 1.0)
    expected = logprob.logprobs(CPU, z, targets, 1.0)
    assert np.array_equal(_bits(got), _bits(expected))
    assert _bits(got)[[0, 1, 4]].tolist() == [NAN_BITS] * 3
    assert got[2] == -np.inf and np.isfinite(got[3])
    assert abs(float(got[5]) + np.log(2.0)) < 1e-6 and _bits(got)[5] == _bits(got)[6]
    # the keys: NaN marker in the NaN row's shard only; +0 beats -0 under MAX
    keys = [logprob.shard_max_keys(CPU, np.ascontiguousarray(z[:, lo:hi])) for lo, hi in zip(cuts, cuts[1:])]
    assert keys[1][0] == reference.NAN_KEY and keys[0][0] != reference.NAN_KEY
    assert reference.from_key(np.maximum(*keys))[5:].view(np.uint32).tolist() == [0, 0]
    # a shard whose every a_v is -inf: S part 0 and, owning the target, the bits of -inf
    both = np.maximum(*keys)
    sums = logprob.shard_sums(CPU, np.ascontiguousarray(z[:, 3:]), both, targets, 3)
    assert sums[2].tolist() == [0, 0xFF800000] and sums[0].tolist() == [0, 0] and sums[4].tolist() == [0, 0]


def test_target_owner_writes_the_bits_of_d():
    rng = np.random.default_rng(5)
    z = (rng.standard_normal((4, 40)) * 3).astype(np.float32)
    targets = np.array([0, 9, 10, 39], dtype=np.int32)
    keys = logprob.shard_max_keys(CPU, z)
    m = reference.from_key(keys)
    assert np.array_equal(m, z.max(axis=1))
    owned = logprob.shard_sums(CPU, np.ascontiguousarray(z[:, 10:]), keys, targets, 10)
    d = (z[np.arange(4), targets] - m).astype(np.float32)
    assert owned[:, 1].tolist() == [0, 0, int(_bits(d)[2]), int(_bits(d)[3])]
    assert (owned[:, 0] > 0).all() and owned.dtype == np.int64


def test_shard_sums_are_additive_in_any_split():
    rng = np.random.default_rng(6)
    z = (rng.standard_normal((3, 300)) * 5).astype(np.float32)
    targets = np.array([1, 150, 299], dtype=np.int32)
    keys = logprob.shard_max_keys(CPU, z, 0.8)
    whole = logprob.shard_sums(CPU, z, keys, targets, 0, 0.8)
    for shards in (2, 5, 8):
        cuts = ragged_cuts(rng, 300, shards)
        parts = sum(logprob.shard_sums(CPU, np.ascontiguousarray(z[:, lo:hi]), keys, targets, lo, 0.8)
                    for lo, hi in zip(cuts, cuts[1:]))
        assert np.array_equal(parts, whole)


@pytest.mark.parametrize("shards", SHARD_COUNTS)
def test_gather_shard_sum_equals_gather(shards):
    rng = np.random.default_rng(shards)
    vocab, hidden = 57, 9
    table = rng.integers(0, 2**32, size=(vocab, hidden), dtype=np.uint64).astype(np.uint32).view(np.float32)
    ids = np.concatenate([np.arange(vocab), rng.integers(0, vocab, 40)]).astype(np.int32)
    total = np.zeros((ids.size, hidden), dtype=np.uint32)
    cuts = ragged_cuts(rng, vocab, shards)
    for lo, hi in zip(cuts, cuts[1:]):
        out = embedding.gather_shard(CPU, np.ascontiguousarray(table[lo:hi]), ids, lo)
        assert out.dtype == np.float32 and out.shape == (ids.size, hidden)
        owned = (ids >= lo) & (ids < hi)
        assert not _bits(out)[~owned].any()  # +0 bits where another rank owns the id
        total += _bits(out)
    assert np.array_equal(total, _bits(embedding.gather(CPU, table, ids)))  # NaN payloads and -0 kept


def test_gather_shard_ignores_ids_beyond_the_shard():
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    out = embedding.gather_shard(CPU, table, np.array([0, 9, 10, 13, 14, 1000], np.int32), 10)
    assert out[[2, 3]].tolist() == [[0, 1, 2], [9, 10, 11]] and not _bits(out)[[0, 1, 4, 5]].any()
    assert embedding.gather_shard(CPU, table, np.zeros(0, np.int32), 0).shape == (0, 3)


@pytest.mark.parametrize("call,message", [
    (lambda z, k, t, s: logprob.shard_max_keys(CPU, z[:, :0]), r"shard's width must lie in \[1, 2\^25\]"),
    (lambda z, k, t, s: logprob.shard_max_keys(CPU, z, 0.0), "temperature must be a finite number > 0"),
    (lambda z, k, t, s: logprob.shard_max_keys(CPU, z[0]), "logits_shard must be a 2-D"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k.astype(np.int32), t, 0), "keys must be uint32 of shape"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k[:1], t, 0), r"keys must be uint32 of shape \(2,\)"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k, np.array([0, -3], np.int32), 0), r"targets\[1\] = -3 is negative"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k, t.astype(np.int64), 0), "targets must be int32"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k, t, -1), "vocab_start must be an integer"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k, t, 2**31 - 8), "vocab_start must be an integer"),
    (lambda z, k, t, s: logprob.shard_sums(CPU, z, k, t, 1.5), "vocab_start must be an integer"),
    (lambda z, k, t, s: logprob.shard_finish(CPU, s[:, :1].copy(), k), r"sums must be int64 of shape \(rows, 2\)"),
    (lambda z, k, t, s: logprob.shard_finish(CPU, s.astype(np.int32), k), "sums must be int64"),
    (lambda z, k, t, s: logprob.shard_finish(CPU, s, k[:1]), "keys must be uint32"),
])
def test_logprob_shard_input_errors(call, message):
    z = np.zeros((2, 9), dtype=np.float32)
    keys = logprob.shard_max_keys(CPU, z)
    targets = np.array([0, 1], np.int32)
    sums = logprob.shard_sums(CPU, z, keys, targets, 0)
    with pytest.raises(InputError, match=message):
        call(z, keys, targets, sums)


@pytest.mark.parametrize("table,ids,start,message", [
    (np.ones((4, 2), np.float32), np.array([0, -1], np.int32), 0, r"ids\[1\] = -1 is negative"),
    (np.ones((4, 2), np.float32), np.array([0, 1], np.int64), 0, "ids must be a 1-D int32 array"),
    (np.ones((0, 2), np.float32), np.array([0], np.int32), 0, "table_shard must hold at least one row"),
    (np.ones((4, 2), np.float64), np.array([0], np.int32), 0, "table_shard must have dtype float32"),
    (np.ones((4, 2), np.float32), np.array([0], np.int32), -4, "vocab_start must be an integer"),
    (np.ones((4, 2), np.float32), np.array([0], np.int32), 2**31 - 3, "vocab_start must be an integer"),
])
def test_gather_shard_input_errors(table, ids, start, message):
    with pytest.raises(InputError, match=message):
        embedding.gather_shard(CPU, table, ids, start)


#: the vocabulary-parallel conformance checks (rlportable/conform/logprob.py and embedding.py)
PARALLEL_VOCAB_CHECKS = [(name, dict(family.CHECKS)[name]) for family, name in (
    (logprob_conform, "logprob.shards"), (embedding_conform, "embedding.gather_shard"))]


@pytest.mark.parametrize("name,check", PARALLEL_VOCAB_CHECKS, ids=[name for name, _ in PARALLEL_VOCAB_CHECKS])
def test_parallel_vocab_check_passes_on_cpu(name, check):
    rng = check_rng(0, name)  # as rlportable.conform.run seeds a check
    tally = check(CPU, rng, True)
    assert tally.compared > 0
    assert tally.mismatches == 0
