"""The batched NumPy reference of exact attention (rlportable/contract/attention.py, "batched
evaluation") against the per-sequence, per-head definition, bitwise: forward and backward (dq, dk, dv)
on many random packings (1..7 sequences of 1..40 tokens, MHA and GQA, D 16/40/64/128), every input
kind (NaN/inf rows, zero rows, huge, tiny and subnormal values, overflowing scores), chunked into
pieces by tiny budgets, query subsets and paged caches; and the cpu ops run the batched path.

Every reduction of the contract is an exact integer sum or a max, so padding, batching heads and
sequences and reordering sums cannot change a bit: these tests check that claim, never a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import attention as ref
from rlportable.ops import attention as op
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
# (Hq, Hkv): multi-head, GQA 2:1, 3:1 (odd group), 4:1, 8:1 (one kv head), a single head
HEADS = [(4, 4), (8, 4), (6, 2), (8, 2), (8, 1), (1, 1)]
DIMS = [16, 40, 64, 128]
KINDS = ("normal", "massive", "tiny", "huge", "zeros", "special", "nonfinite")
# budgets (entries per chunk): one sequence and one kv head per piece, a few sequences, the default, all
BUDGETS = (1, 3000, ref.BATCH_ELEMENTS, 2**24)


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def same_bits(a, b) -> bool:
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def tensor(rng, tokens, heads, d, kind):
    return random_rows(rng, tokens * heads, d, kind).reshape(tokens, heads, d)


def mixed_inputs(rng, tokens, hq, hkv, d):
    """q, k, v, do: each tensor mostly one kind, plus a few rows poisoned or zeroed at random."""
    tensors = []
    for heads in (hq, hkv, hkv, hq):
        kind = KINDS[rng.integers(len(KINDS))] if rng.random() < 0.6 else "normal"
        x = tensor(rng, tokens, heads, d, kind)
        for _ in range(rng.integers(0, 3)):
            row, head = rng.integers(tokens), rng.integers(heads)
            x[row, head, rng.integers(d)] = rng.choice(np.array([np.nan, np.inf, -np.inf, 0.0], np.float32))
        if rng.random() < 0.3:
            x[rng.integers(tokens), rng.integers(heads)] = 0.0  # a zero row: exponent -149
        tensors.append(x)
    return tensors


def random_packing(rng):
    lengths = list(rng.integers(1, 41, rng.integers(1, 8)))
    if rng.random() < 0.3:
        lengths[rng.integers(len(lengths))] = 1  # a 1-token sequence
    return lengths


def forward_per_sequence(q, k, v, cu):
    """The definition: attention() one sequence at a time."""
    out = np.empty(q.shape, dtype=np.float32)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            out[a:b] = ref.attention(q[a:b], k[a:b], v[a:b], np.arange(b - a))
    return out


# ---- packed forward and backward against the per-sequence definition


@pytest.mark.parametrize("seed", range(24))
def test_packed_forward_and_backward_equal_the_per_sequence_definition(seed):
    rng = np.random.default_rng(1000 + seed)
    hq, hkv = HEADS[seed % len(HEADS)]
    d = DIMS[(seed // len(HEADS)) % len(DIMS)]
    for _ in range(3):
        lengths = random_packing(rng)
        cu = cu_of(lengths)
        q, k, v, do = mixed_inputs(rng, int(cu[-1]), hq, hkv, d)
        want_o = forward_per_sequence(q, k, v, cu)
        want = ref.attention_packed_backward(q, k, v, do, cu)
        for budget in BUDGETS:
            assert same_bits(ref.attention_packed_batched(q, k, v, cu, budget=budget), want_o), (lengths, budget)
            got = ref.attention_packed_backward_batched(q, k, v, do, cu, budget=budget)
            for name, g, w in zip(("dq", "dk", "dv"), got, want):
                assert same_bits(g, w), (name, lengths, budget)


@pytest.mark.parametrize("kind", KINDS)
def test_every_input_kind_in_every_tensor(kind):
    rng = np.random.default_rng(hash(kind) % 2**32)
    lengths = [1, 13, 40, 2, 27]
    cu = cu_of(lengths)
    tokens, hq, hkv, d = int(cu[-1]), 8, 2, 40
    for target in range(4):  # the kind in q, k, v or do; the others normal
        x = [tensor(rng, tokens, h, d, kind if i == target else "normal") for i, h in enumerate((hq, hkv, hkv, hq))]
        want_o = forward_per_sequence(*x[:3], cu)
        assert same_bits(ref.attention_packed_batched(*x[:3], cu), want_o)
        for got, want in zip(ref.attention_packed_backward_batched(*x, cu),
                             ref.attention_packed_backward(*x, cu)):
            assert same_bits(got, want), (kind, target)


def test_overflowing_scores_and_poisoned_forward_outputs():
    """Scores beyond FLT_MAX (m = inf: every row poisoned), and an o passed in with NaN or inf rows."""
    rng = np.random.default_rng(5)
    lengths = [9, 1, 30]
    cu = cu_of(lengths)
    hq, hkv, d = 6, 2, 64
    q, k, v, do = (tensor(rng, int(cu[-1]), h, d, "normal") for h in (hq, hkv, hkv, hq))
    huge_q, huge_k = q * np.float32(3e18), k * np.float32(3e18)
    assert same_bits(ref.attention_packed_batched(huge_q, huge_k, v, cu), forward_per_sequence(huge_q, huge_k, v, cu))
    for got, want in zip(ref.attention_packed_backward_batched(huge_q, huge_k, v, do, cu),
                         ref.attention_packed_backward(huge_q, huge_k, v, do, cu)):
        assert same_bits(got, want)
    o = forward_per_sequence(q, k, v, cu)
    o[3, 1, 7], o[12, 4, 0], o[39, 5, 2] = np.nan, np.inf, -np.inf
    for got, want in zip(ref.attention_packed_backward_batched(q, k, v, do, cu, o=o),
                         ref.attention_packed_backward(q, k, v, do, cu, o=o)):
        assert same_bits(got, want) and np.isnan(got).any()


def test_any_o_passed_in_is_read_as_given():
    """delta reads o as given: a finite o that is not the forward's (beside non-finite k and v rows,
    which poison by themselves) gives the definition's bits too."""
    rng = np.random.default_rng(11)
    lengths = [14, 3, 25]
    cu = cu_of(lengths)
    hq, hkv, d = 8, 2, 16
    q, k, v, do, o = (tensor(rng, int(cu[-1]), h, d, "normal") for h in (hq, hkv, hkv, hq, hq))
    k[4, 1, 3], v[20, 0, 0], k[cu[2] + 7, 0, 5] = np.inf, np.nan, -np.inf
    for got, want in zip(ref.attention_packed_backward_batched(q, k, v, do, cu, o=o),
                         ref.attention_packed_backward(q, k, v, do, cu, o=o)):
        assert same_bits(got, want) and np.isnan(got).any()


def test_empty_sequences_and_empty_batch():
    rng = np.random.default_rng(6)
    lengths = [0, 5, 0, 0, 3, 0]
    cu = cu_of(lengths)
    q, k, v, do = (tensor(rng, int(cu[-1]), h, 16, "normal") for h in (4, 2, 2, 4))
    assert same_bits(ref.attention_packed_batched(q, k, v, cu), forward_per_sequence(q, k, v, cu))
    for got, want in zip(ref.attention_packed_backward_batched(q, k, v, do, cu),
                         ref.attention_packed_backward(q, k, v, do, cu)):
        assert same_bits(got, want)
    empty = [np.zeros((0, h, 16), np.float32) for h in (4, 2, 2, 4)]
    assert ref.attention_packed_batched(*empty[:3], [0]).shape == (0, 4, 16)
    shapes = [g.shape for g in ref.attention_packed_backward_batched(*empty, [0, 0])]
    assert shapes == [(0, 4, 16), (0, 2, 16), (0, 2, 16)]


# ---- padded sequences with any query positions (chunked prefill, decode, subsets)


def encoded(x, bits_):
    return ref.encode_heads(np.asarray(x, np.float32), bits_)


def test_encoded_batches_with_query_subsets_equal_the_per_sequence_definition():
    """attention_encoded_batched and attention_backward_encoded_batched, sequences of different key
    counts and queries at arbitrary positions (decode: one query at the last position; chunked
    prefill: a tail; a scattered subset), padded to the chunk's longest."""
    rng = np.random.default_rng(7)
    hq, hkv, d = 8, 2, 40
    lengths = [23, 1, 40, 9, 17]
    subsets = [np.array([22]), np.array([0]), np.arange(31, 40), np.array([0, 3, 8]), np.arange(17)]
    width_q, width_k = max(map(len, subsets)), max(lengths)
    shapes = {"q": (hq, 23), "k": (hkv, 15), "v": (hkv, 15), "do": (hq, 23)}
    padded = {name: np.zeros((len(lengths), width_k, h, d), np.float64) for name, (h, _) in shapes.items()}
    exps = {name: np.zeros((len(lengths), width_k, h), np.int64) for name, (h, _) in shapes.items()}
    rows_q = np.full((len(lengths), width_q), -1, dtype=np.int64)
    positions = np.full((len(lengths), width_q), -1, dtype=np.int64)
    o_pad = np.zeros((len(lengths), width_q, hq, d), np.float32)
    want_o, want_grads = [], []
    for s, (n, subset) in enumerate(zip(lengths, subsets)):
        q, k, v, do = mixed_inputs(rng, n, hq, hkv, d)
        for name, x in zip(shapes, (q, k, v, do)):
            padded[name][s, :n], exps[name][s, :n] = encoded(x, shapes[name][1])
        want_o.append(ref.attention(q[subset], k, v, subset))
        want_grads.append(ref.attention_backward(q[subset], k, v, do[subset], subset))
        rows_q[s, :subset.size] = subset
        positions[s, :subset.size] = subset
        o_pad[s, :subset.size] = want_o[-1]
    take = np.maximum(rows_q, 0)
    gather = (lambda x: np.take_along_axis(x, take.reshape(take.shape + (1,) * (x.ndim - 2)), axis=1))
    qq, eq, qdo, edo = gather(padded["q"]), gather(exps["q"]), gather(padded["do"]), gather(exps["do"])
    # integers as int64 and exponents as int32, as the KV cache holds them
    qq, qdo, eq, edo = qq.astype(np.int64), qdo.astype(np.int64), eq.astype(np.int32), edo.astype(np.int32)
    keys = (padded["k"].astype(np.int64), exps["k"].astype(np.int32), padded["v"].astype(np.int64),
            exps["v"].astype(np.int32))
    for budget in BUDGETS:
        out = ref.attention_encoded_batched(qq, eq, *keys, positions, budget=budget)
        grads = ref.attention_backward_encoded_batched(qq, eq, *keys, qdo, edo, o_pad, positions, budget=budget)
        for s, (n, subset) in enumerate(zip(lengths, subsets)):
            assert same_bits(out[s, :subset.size], want_o[s]), (s, budget)
            assert same_bits(grads[0][s, :subset.size], want_grads[s][0]), (s, budget)
            assert same_bits(grads[1][s, :n], want_grads[s][1]), (s, budget)
            assert same_bits(grads[2][s, :n], want_grads[s][2]), (s, budget)


# (kind, scale) of k and v per sequence: small rows have negative exponents (the cache stores int32 ones)
PAGED_KINDS = [(("massive", 1.0), ("normal", 1e-3)), (("normal", 1e-2), ("tiny", 1.0)),
               (("zeros", 1.0), ("special", 1.0)), (("huge", 1.0), ("normal", 1.0)),
               (("normal", 1.0), ("massive", 1e-6))]


def paged_case(rng, lengths, block_size, hkv, d):
    """A cache with sequences in shuffled blocks, written through write_kv: (cache, tables, k, v per sequence)."""
    needed = [-(-n // block_size) for n in lengths]
    physical = rng.permutation(sum(needed) + 2)
    tables = np.full((len(lengths), max(needed) + 1), -1, dtype=np.int32)
    cache = op.KVCache.allocate(CPU, (sum(needed) + 2) * block_size, hkv, d, block_size)
    keys, used = [], 0
    for seq, (n, count) in enumerate(zip(lengths, needed)):
        tables[seq, :count] = physical[used:used + count]
        used += count
        positions = np.arange(n)
        slots = (tables[seq, positions // block_size] * block_size + positions % block_size).astype(np.int32)
        kinds = PAGED_KINDS[seq % len(PAGED_KINDS)]
        k, v = (tensor(rng, n, hkv, d, kind) * np.float32(scale) for kind, scale in kinds)
        op.write_kv(CPU, cache, k, v, slots)
        keys.append((k, v))
    return cache, tables, keys


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_reference_equals_the_per_sequence_definition(block_size):
    """attention_paged on cpu (batched over sequences) for a decode step, a chunked-prefill step with
    interleaved rows, and sequences absent from the call."""
    rng = np.random.default_rng(block_size)
    hq, hkv, d = 8, 2, 64
    lengths = [17, 1, 40, 6, 33, 12]
    cache, tables, keys = paged_case(rng, lengths, block_size, hkv, d)
    decode = (np.arange(len(lengths)), np.array(lengths) - 1)
    seq_rows = np.array([4, 0, 4, 2, 4, 0, 2, 5])
    pos_rows = np.array([30, 16, 31, 39, 32, 2, 0, 11])
    for q_seq, q_pos in (decode, (seq_rows, pos_rows)):
        q = tensor(rng, q_seq.size, hq, d, "normal")
        got = op.attention_paged(CPU, q, q_seq.astype(np.int32), q_pos.astype(np.int32), cache, tables)
        for row, (seq, pos) in enumerate(zip(q_seq, q_pos)):
            k, v = keys[seq]
            want = ref.attention(q[row:row + 1], k[:pos + 1], v[:pos + 1], np.array([pos]))
            assert same_bits(got[row:row + 1], want), (row, seq, pos)


# ---- chunking bounds memory; the ops use the batched path


def test_batch_chunks_cover_every_sequence_within_budget():
    rng = np.random.default_rng(8)
    for _ in range(50):
        queries = rng.integers(0, 50, rng.integers(1, 200))
        keys = queries + rng.integers(0, 30, queries.size)
        heads, width, budget = int(rng.integers(1, 16)), int(rng.integers(0, 64)), int(rng.integers(1, 200000))
        chunks = ref.batch_chunks(queries, keys, heads, width, budget)
        covered = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        assert np.array_equal(np.sort(covered), np.nonzero(queries > 0)[0])
        for chunk in chunks:
            cost = chunk.size * heads * queries[chunk].max() * max(keys[chunk].max(), width)
            assert chunk.size == 1 or cost <= budget


def test_cpu_ops_run_the_batched_reference(monkeypatch):
    """The ops' cpu paths never fall back to the per-sequence functions (they would be the slow path)."""
    rng = np.random.default_rng(9)
    cu = cu_of([5, 1, 12])
    q, k, v, do = (tensor(rng, int(cu[-1]), h, 16, "normal") for h in (4, 2, 2, 4))
    want_o = forward_per_sequence(q, k, v, cu)
    want = ref.attention_packed_backward(q, k, v, do, cu)

    def forbidden(*args, **kwargs):
        raise AssertionError("per-sequence reference called")

    for name in ("attention", "attention_encoded", "attention_backward", "attention_packed_backward"):
        monkeypatch.setattr(ref, name, forbidden)
    assert same_bits(op.attention_packed(CPU, q, k, v, cu), want_o)
    for got, w in zip(op.attention_packed_backward(CPU, q, k, v, do, cu), want):
        assert same_bits(got, w)


def test_long_sequences_run_in_query_row_blocks_with_the_same_bits(monkeypatch):
    """One sequence's forward in blocks of query rows: the same bits at any block size, and peak
    memory linear in the length (doubling it at most ~doubles the peak; [T, T] arrays would
    quadruple it)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((300, h, 16)).astype(np.float32) for h in (4, 2, 2))
    whole = ref.attention_packed_batched(q, k, v, [0, 120, 300])
    monkeypatch.setattr(ref, "ROW_BLOCK_ELEMENTS", 1)
    for budget in (1, 1000):  # one row a block; a few rows
        assert np.array_equal(bits(ref.attention_packed_batched(q, k, v, [0, 120, 300], budget=budget)), bits(whole))
    monkeypatch.setattr(ref, "ROW_BLOCK_ELEMENTS", 2**18)
    peaks = []
    for length in (1500, 3000):
        q, k, v = (rng.standard_normal((length, 1, 64)).astype(np.float32) for _ in range(3))
        tracemalloc.start()
        ref.attention_packed_batched(q, k, v, [0, length])
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < 2.5 * peaks[0], peaks
