"""Conformance of the attention family (contracts/attention.toml): exact causal GQA attention over the
encoded KV cache, packed and paged, the cache writer, the split decode kernels, and attention_backward,
every kernel variant, bitwise against the reference, with batch, block-size and launch-shape
invariance; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS, Stream
from rlportable.conform.inputs import ROW_KINDS, cu_seqlens, random_rows
from rlportable.conform.tally import Tally
from rlportable.runtime.base import Backend

from rlportable.contract import attention as attention_ref
from rlportable.contract.fixedpoint import CANONICAL_NAN
from rlportable.ops import attention as attention_op
from rlportable.ops.fixedpoint import encode_rows_reference as _encode_rows_reference

# (Hq, Hkv, D): GQA 4:1, plain multi-head, a ragged head_dim, a wide one
ATTENTION_HEADS = ((8, 2, 64), (4, 4, 128), (8, 2, 20))
ATTENTION_LENGTHS = (1, 7, 33, 200)
ATTENTION_KINDS = ("normal", "massive", "tiny", "huge", "zeros", "special")


def _attention_qkv(rng, tokens: int, hq: int, hkv: int, d: int, kind: str = "normal"):
    def rows(heads):
        return random_rows(rng, tokens * heads, d, kind).reshape(tokens, heads, d)

    return rows(hq), rows(hkv), rows(hkv)


def _attention_expected(q, k, v, cu) -> np.ndarray:
    """The reference, one sequence at a time (the contract's definition of a packed batch)."""
    out = np.empty(q.shape, dtype=np.float32)
    for start, stop in zip(cu[:-1], cu[1:]):
        if stop > start:
            out[start:stop] = attention_ref.attention(q[start:stop], k[start:stop], v[start:stop],
                                                      np.arange(stop - start))
    return out


def _packed_output(backend: Backend, q, k, v, cu, threads: int = attention_op.THREADS,
                      method: str = "portable") -> np.ndarray:
    return backend.to_numpy(attention_op.attention_packed(backend, backend.asarray(q), backend.asarray(k),
                                                          backend.asarray(v), cu, threads=threads, method=method))


def _attention_methods(backend: Backend, d: int) -> tuple[str, ...]:
    """Every kernel variant of attention_paged this backend runs (each must give the reference's bits)."""
    return attention_op.available_methods(backend, d)


def _paged_layout(rng, lengths, block_size: int, spare_blocks: int = 3):
    """Block tables for sequences of these lengths over shuffled physical blocks (plus unused ones)."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    physical = rng.permutation(num_blocks)
    tables = np.full((len(lengths), max(max(needed), 1) + 1), -1, dtype=np.int32)
    used = 0
    for seq, count in enumerate(needed):
        tables[seq, :count] = physical[used:used + count]
        used += count
    return tables, num_blocks


def _seq_slots(tables: np.ndarray, seq: int, positions: np.ndarray, block_size: int) -> np.ndarray:
    return (tables[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size).astype(np.int32)


class _PagedRun:
    """One paged cache on the backend: write K/V rows of sequences, run queries against it."""

    def __init__(self, backend: Backend, rng, lengths, hkv: int, d: int, block_size: int):
        self.backend, self.block_size = backend, block_size
        self.tables, num_blocks = _paged_layout(rng, lengths, block_size)
        self.cache = attention_op.KVCache.allocate(backend, num_blocks * block_size, hkv, d, block_size)
        self.device_tables = backend.asarray(self.tables)

    def write(self, seq: int, positions: np.ndarray, k, v) -> None:
        slots = _seq_slots(self.tables, seq, positions, self.block_size)
        attention_op.write_kv(self.backend, self.cache, self.backend.asarray(k), self.backend.asarray(v),
                              self.backend.asarray(slots))

    def query(self, q, q_seq, q_pos, threads: int = attention_op.THREADS, method: str = "portable",
              tables=None, keys_per_split: int | None = None) -> np.ndarray:
        """Outputs of query rows q (sequence q_seq, position q_pos); tables: other block tables (host), else
        the run's own."""
        b = self.backend
        tables = self.device_tables if tables is None else b.asarray(np.asarray(tables, dtype=np.int32))
        return b.to_numpy(attention_op.attention_paged(
            b, b.asarray(q), b.asarray(np.asarray(q_seq, dtype=np.int32)), b.asarray(np.asarray(q_pos, dtype=np.int32)),
            self.cache, tables, threads=threads, method=method, keys_per_split=keys_per_split))


def check_attention_packed(backend: Backend, rng, quick: bool) -> Tally:
    """Packed ragged sequences (1, 7, 33, 200 tokens) against the reference, every head layout and input kind."""
    tally = Tally()
    lengths = list(ATTENTION_LENGTHS)
    order = rng.permutation(len(lengths))
    lengths = [lengths[i] for i in order] + ([] if quick else [517, 3])
    cu = cu_seqlens(lengths)
    for hq, hkv, d in ATTENTION_HEADS:
        for kind in ATTENTION_KINDS if (hq, hkv, d) == ATTENTION_HEADS[0] or not quick else ("normal", "massive"):
            q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, kind)
            expected = _attention_expected(q, k, v, cu)
            for method in _attention_methods(backend, d):
                tally.add(_packed_output(backend, q, k, v, cu, method=method), expected)
    return tally


def check_attention_nonfinite(backend: Backend, rng, quick: bool) -> Tally:
    """A NaN q row, an inf k row and a NaN v row: NaN exactly where the contract says, nothing else touched."""
    tally = Tally()
    lengths = [33, 40, 7]
    cu = cu_seqlens(lengths)
    hq, hkv, d = 8, 2, 64
    q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
    q[5, 3, 17] = np.nan  # sequence 0, position 5, head 3 only
    k[cu[1] + 20, 1, 2] = np.inf  # sequence 1, positions >= 20, kv head 1 (heads 4..7)
    v[cu[2] + 3, 0, 0] = -np.nan  # sequence 2, positions >= 3, kv head 0 (heads 0..3)
    expected = _attention_expected(q, k, v, cu)
    nan_rows = np.isnan(expected).all(axis=2)
    assert nan_rows.sum() == 1 + 20 * 4 + 4 * 4 and not np.isnan(expected[~nan_rows]).any()
    for method in _attention_methods(backend, d):
        tally.add(_packed_output(backend, q, k, v, cu, method=method), expected)
    return tally


def check_attention_write_kv(backend: Backend, rng, quick: bool) -> Tally:
    """The cache writer against fixedpoint's reference encoding (15 bits, 2 digits), scattered to slots."""
    tally = Tally()
    for hkv, d in ((2, 64), (4, 128), (2, 20), (1, 1)):
        for kind in ROW_KINDS:
            tokens, num_slots = 13, 40
            k = random_rows(rng, tokens * hkv, d, kind).reshape(tokens, hkv, d)
            v = random_rows(rng, tokens * hkv, d, "normal" if kind == "nonfinite" else kind).reshape(tokens, hkv, d)
            slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
            slots[[2, 7]] = -1  # skipped
            cache = attention_op.KVCache.allocate(backend, num_slots, hkv, d, block_size=4)
            attention_op.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
            dp = cache.head_dim_padded
            for x, digits, exponents in ((k, cache.k_digits, cache.k_exponents), (v, cache.v_digits, cache.v_exponents)):
                encoded = _encode_rows_reference(x.reshape(tokens * hkv, d), attention_op.KV_BITS)
                want_digits = np.zeros((num_slots, hkv, attention_op.KV_SLICES, dp), dtype=np.int8)
                want_exponents = np.zeros((num_slots, hkv), dtype=np.int32)
                keep = slots >= 0
                want_digits[slots[keep]] = encoded.digits.reshape(tokens, hkv, attention_op.KV_SLICES, dp)[keep]
                want_exponents[slots[keep]] = encoded.exponents.reshape(tokens, hkv)[keep]
                tally.add(backend.to_numpy(digits), want_digits)
                tally.add(backend.to_numpy(exponents), want_exponents)
    return tally


def check_attention_paged(backend: Backend, rng, quick: bool) -> Tally:
    """Paged cache (shuffled blocks of 16) against the reference, plus a sequence longer than the
    kernel's shared score cache (4096 keys: later scores are recomputed in pass 2)."""
    tally = Tally()
    for hq, hkv, d in ATTENTION_HEADS:
        lengths = [45, 1, 130]
        cu = cu_seqlens(lengths)
        q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
        run = _PagedRun(backend, rng, lengths, hkv, d, 16)
        for seq, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
            run.write(seq, np.arange(stop - start), k[start:stop], v[start:stop])
        q_seq = np.repeat(np.arange(len(lengths)), lengths)
        q_pos = np.arange(int(cu[-1])) - cu[:-1][q_seq]
        expected = _attention_expected(q, k, v, cu)
        for method in _attention_methods(backend, d):
            tally.add(run.query(q, q_seq, q_pos, method=method), expected)
        # the same queries shuffled: tiles of rows from several sequences at scattered positions
        order = rng.permutation(q_seq.size)
        for method in _attention_methods(backend, d):
            tally.add(run.query(np.ascontiguousarray(q[order]), q_seq[order], q_pos[order], method=method),
                      expected[order])
    # long sequence: a few queries at positions around and beyond the score cache
    length = 4200 if quick else 9000
    hq, hkv, d = 4, 2, 64
    q, k, v = _attention_qkv(rng, length, hq, hkv, d, "normal")
    positions = np.array([0, 1, 4094, 4095, 4096, 4097, 4150, length - 1])
    run = _PagedRun(backend, rng, [length], hkv, d, 32)
    run.write(0, np.arange(length), k, v)
    expected = attention_ref.attention(q[positions], k, v, positions)
    for method in _attention_methods(backend, d):
        tally.add(run.query(np.ascontiguousarray(q[positions]), np.zeros(positions.size), positions, method=method),
                  expected)
    # a prefill-shaped slice of the long sequence: 130 consecutive queries ending at the last key
    tail = np.arange(length - 130, length)
    tail_expected = attention_ref.attention(q[tail], k, v, tail)
    for method in _attention_methods(backend, d):
        tally.add(run.query(np.ascontiguousarray(q[tail]), np.zeros(tail.size), tail, method=method), tail_expected)
    for threads in (64, 1024):
        tally.add(run.query(np.ascontiguousarray(q[positions]), np.zeros(positions.size), positions, threads), expected)
    return tally


def check_attention_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """position_in_batch, prefill_decode, kv_block_size, launch_shape: bitwise equal outputs."""
    tally = Tally()
    hq, hkv, d = 8, 2, 64
    target = 70 if quick else 300
    others = [7, 50, 1, 33]
    q, k, v = _attention_qkv(rng, target, hq, hkv, d, "massive")
    alone = _packed_output(backend, q, k, v, cu_seqlens([target]))
    tally.add(alone, _attention_expected(q, k, v, cu_seqlens([target])))
    methods = _attention_methods(backend, d)
    # position in batch: packed after (and before) other sequences, at several slot offsets
    for before in ([7], [50, 1], [33, 7, 50], []):
        after = [n for n in others if n not in before][:2]
        lengths = before + [target] + after
        oq, ok, ov = _attention_qkv(rng, sum(lengths), hq, hkv, d, "normal")
        offset = sum(before)
        oq[offset:offset + target], ok[offset:offset + target], ov[offset:offset + target] = q, k, v
        for method in methods:
            packed = _packed_output(backend, oq, ok, ov, cu_seqlens(lengths), method=method)
            tally.add(packed[offset:offset + target], alone)
    # launch shape: any thread count
    for threads in (32, 100, 1024):
        tally.add(_packed_output(backend, q, k, v, cu_seqlens([target]), threads=threads), alone)
    # prefill at once, chunked prefill, one-token decode steps (next to a second sequence), block sizes 1, 16, 32
    partner = 41
    pq, pk, pv = _attention_qkv(rng, partner, hq, hkv, d, "normal")
    positions = np.arange(target)
    for block_size in (1, 16, 32):
        run = _PagedRun(backend, rng, [target, partner], hkv, d, block_size)
        run.write(0, positions, k, v)
        for method in methods:
            tally.add(run.query(q, np.zeros(target), positions, method=method), alone)
        run = _PagedRun(backend, rng, [target, partner], hkv, d, block_size)
        cuts = [0, 1, 17, 40, target]
        for start, stop in zip(cuts[:-1], cuts[1:]):
            run.write(0, positions[start:stop], k[start:stop], v[start:stop])
            for method in methods:
                tally.add(run.query(q[start:stop], np.zeros(stop - start), positions[start:stop], method=method),
                          alone[start:stop])
    run = _PagedRun(backend, rng, [target, partner], hkv, d, 16)
    run.write(1, np.arange(partner // 2), pk[: partner // 2], pv[: partner // 2])  # the partner's prompt
    decoded = np.empty_like(alone)
    for t in range(target):  # continuous batching: both sequences decode in one call while the partner lasts
        run.write(0, positions[t:t + 1], k[t:t + 1], v[t:t + 1])
        pt = partner // 2 + t
        if pt < partner:
            run.write(1, np.array([pt]), pk[pt:pt + 1], pv[pt:pt + 1])
            rows = np.concatenate([pq[pt:pt + 1], q[t:t + 1]])
            out = run.query(rows, [1, 0], [pt, t])
            decoded[t] = out[1]
            for method in methods:  # a tile holding rows of two sequences (one round per sequence)
                tally.add(run.query(rows, [1, 0], [pt, t], method=method)[1], out[1])
        else:
            decoded[t] = run.query(q[t:t + 1], [0], [t])[0]
    tally.add(decoded, alone)
    return tally


# ---- decode-shaped calls: the split kernels (method "split") beside every other variant

# (Hq, Hkv, D, KV block size): Qwen3-0.6B's shape, GQA 4:1, plain multi-head at D 256, ragged head_dims,
# a group of 12 q heads (more than one round of the split kernels' heads), padded head_dims 192 and 384
# (threads per key that are not a power of two: idle threads in the kernels' key sets)
SPLIT_HEADS = ((16, 8, 128, 16), (8, 2, 64, 1), (4, 4, 256, 32), (6, 2, 20, 16), (24, 2, 200, 16),
               (8, 4, 160, 16), (4, 2, 384, 16))
SPLIT_HEADS_QUICK = SPLIT_HEADS[:4]
# lengths around the split kernels' tiles (128 keys) and splits, up to 2000 keys
SPLIT_LENGTHS = (1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 700, 1000, 2000)
SPLIT_LENGTHS_QUICK = (1, 2, 64, 65, 129, 300, 2000)


def _methods_and_splits(backend: Backend, d: int):
    """(method, keys_per_split) pairs: every variant, and the split kernels with several key ranges."""
    pairs = [(method, None) for method in _attention_methods(backend, d)]
    if "split" in _attention_methods(backend, d):
        pairs += [("split", 64), ("split", 200), ("split", 1000)]
    return pairs


def _expected_rows(q, k, v, cu, q_seq, q_pos) -> np.ndarray:
    """The reference for query rows (sequence q_seq[i] of the packed k, v at cu, position q_pos[i])."""
    out = np.empty(q.shape, dtype=np.float32)
    for seq in np.unique(q_seq):
        rows = np.nonzero(q_seq == seq)[0]
        start, stop = cu[seq], cu[seq + 1]
        out[rows] = attention_ref.attention(q[rows], k[start:stop], v[start:stop], q_pos[rows])
    return out


def _decode_rows(rng, lengths, extra: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_seq, q_pos): every sequence's last position (a decode step) and `extra` random earlier ones, shuffled."""
    lengths = np.asarray(lengths)
    seqs = np.concatenate([np.arange(lengths.size), rng.integers(0, lengths.size, extra)])
    positions = np.concatenate([lengths - 1, rng.integers(0, lengths[seqs[lengths.size:]])])
    order = rng.permutation(seqs.size)
    return seqs[order], positions[order]


def _graph_tables(tables: np.ndarray, padding_rows: int, width: int) -> np.ndarray:
    """A decode graph's tables (engine/step_inputs.plan_decode): `width` columns and `padding_rows` more
    rows, zeros wherever no block is named (a zero block 0 is a valid block no key past t reads)."""
    wide = np.zeros((tables.shape[0] + padding_rows, max(width, tables.shape[1])), dtype=np.int32)
    wide[: tables.shape[0], : tables.shape[1]] = np.maximum(tables, 0)
    return wide


def check_attention_split(backend: Backend, rng, quick: bool) -> Tally:
    """Decode-shaped calls (one query row per sequence and a few more) over ragged lengths 1..2000, GQA,
    MHA, D 64/128/256 and ragged D, KV block sizes 1/16/32, every kernel variant and the split kernels at
    several key ranges, against the reference; then the same rows through a decode graph's wider tables
    with padding rows (more splits, the same bits; the padding rows against the portable kernel)."""
    tally = Tally()
    lengths = list(SPLIT_LENGTHS_QUICK if quick else SPLIT_LENGTHS)
    for hq, hkv, d, block_size in SPLIT_HEADS_QUICK if quick else SPLIT_HEADS:
        order = rng.permutation(len(lengths))
        seq_lengths = [lengths[i] for i in order]
        cu = cu_seqlens(seq_lengths)
        q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
        run = _PagedRun(backend, rng, seq_lengths, hkv, d, block_size)
        for seq, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
            run.write(seq, np.arange(stop - start), k[start:stop], v[start:stop])
        q_seq, q_pos = _decode_rows(rng, seq_lengths, extra=5)
        rows = np.ascontiguousarray(q[cu[q_seq] + q_pos])
        expected = _expected_rows(rows, k, v, cu, q_seq, q_pos)
        for method, keys in _methods_and_splits(backend, d):
            tally.add(run.query(rows, q_seq, q_pos, method=method, keys_per_split=keys), expected)
        # a decode graph's launch: tables as wide as a 4096-token max_model_len, 3 padding rows at position 0
        padding = 3
        tables = _graph_tables(run.tables, padding, -(-4096 // block_size))
        pad_seq = np.concatenate([q_seq, np.arange(len(seq_lengths), len(seq_lengths) + padding)])
        pad_pos = np.concatenate([q_pos, np.zeros(padding, dtype=np.int64)])
        pad_rows = np.concatenate([rows, q[:padding]])
        padded = run.query(pad_rows, pad_seq, pad_pos, method="portable", tables=tables)
        tally.add(padded[: rows.shape[0]], expected)
        for method, keys in _methods_and_splits(backend, d):
            tally.add(run.query(pad_rows, pad_seq, pad_pos, method=method, tables=tables, keys_per_split=keys), padded)
    return tally


def check_attention_split_nonfinite(backend: Backend, rng, quick: bool) -> Tally:
    """Decode rows with a NaN q row, an inf k row and a NaN v row among their keys (the canonical NaN
    exactly where the contract says), every variant. On a device also the rows the kernels poison
    instead of raising (contract: invalid_indices): a missing block among keys 0..t, a position beyond
    the tables, a sequence index outside them; their rows are the canonical NaN, nothing else touched."""
    tally = Tally()
    for hq in (8, 4):  # groups of 4 and 2 (the two value kernels)
        _split_nonfinite_rows(backend, rng, tally, hq)
    return tally


def _split_nonfinite_rows(backend: Backend, rng, tally: Tally, hq: int) -> None:
    hkv, d = 2, 64
    group = hq // hkv
    lengths = [300, 40, 7, 129]
    cu = cu_seqlens(lengths)
    q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
    q[cu[0] + 299, 3, 17] = np.nan  # sequence 0's decode row, head 3 only
    k[cu[1] + 20, 1, 2] = np.inf  # sequence 1, positions >= 20, kv head 1 (its group's q heads)
    v[cu[2] + 3, 0, 0] = -np.nan  # sequence 2, positions >= 3, kv head 0
    run = _PagedRun(backend, rng, lengths, hkv, d, 16)
    for seq, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
        run.write(seq, np.arange(stop - start), k[start:stop], v[start:stop])
    q_seq = np.array([0, 1, 1, 2, 2, 3, 0])
    q_pos = np.array([299, 19, 39, 2, 6, 128, 200])
    rows = np.ascontiguousarray(q[cu[q_seq] + q_pos])
    expected = _expected_rows(rows, k, v, cu, q_seq, q_pos)
    nan_rows = np.isnan(expected).all(axis=2)
    assert nan_rows.sum() == 1 + 2 * group and not np.isnan(expected[~nan_rows]).any()
    for method, keys in _methods_and_splits(backend, d):
        tally.add(run.query(rows, q_seq, q_pos, method=method, keys_per_split=keys), expected)
    if backend.runs_reference:
        return  # the reference raises an input error for invalid indices (tests/test_attention_ops.py)
    tables = run.tables.copy()
    tables[3, 5] = -1  # sequence 3 loses its keys 80..95: rows at positions >= 80 are poisoned
    q_seq = np.array([3, 3, 0, 2, 9, -1, 1])
    q_pos = np.array([79, 128, tables.shape[1] * 16, 6, 0, 0, 39])  # a position beyond the tables' keys
    rows = np.ascontiguousarray(q[:q_seq.size])
    want = np.full(rows.shape, CANONICAL_NAN)
    valid = np.array([0, 3, 6])
    want[valid] = _expected_rows(rows[valid], k, v, cu, q_seq[valid], q_pos[valid])
    for method, keys in _methods_and_splits(backend, d):
        tally.add(run.query(rows, q_seq, q_pos, method=method, tables=tables, keys_per_split=keys), want)


# ---- backward (contracts/attention.toml, op "attention_backward")

# (Hq, Hkv, D): GQA 4:1 and 2:1, plain multi-head, ragged head_dims, wide ones
BACKWARD_HEADS_QUICK = ((4, 1, 64), (4, 2, 40), (3, 3, 20))
BACKWARD_HEADS_FULL = ((8, 2, 64), (8, 4, 128), (4, 4, 40), (16, 2, 128), (6, 3, 7), (2, 1, 512))
BACKWARD_LENGTHS_QUICK = (1, 7, 33, 70)
BACKWARD_LENGTHS_FULL = (1, 7, 33, 200, 300, 3)


def _backward_inputs(rng, tokens: int, hq: int, hkv: int, d: int, kind: str = "normal"):
    q, k, v = _attention_qkv(rng, tokens, hq, hkv, d, kind)
    return q, k, v, random_rows(rng, tokens * hq, d, kind).reshape(tokens, hq, d)


def _attention_backward(backend: Backend, q, k, v, do, cu, o=None, threads: int = attention_op.BACKWARD_THREADS,
                        method: str = "rows") -> tuple[np.ndarray, ...]:
    b = backend
    grads = attention_op.attention_packed_backward(b, b.asarray(q), b.asarray(k), b.asarray(v), b.asarray(do), cu,
                                                   o=None if o is None else b.asarray(o), threads=threads,
                                                   method=method)
    return tuple(b.to_numpy(g) for g in grads)


def _add_grads(tally: Tally, got, expected) -> None:
    for actual, want in zip(got, expected):
        tally.add(actual, want)


def _backward_from_forward_stats(backend: Backend, q, k, v, do, cu, method: str = "tiled") -> tuple[np.ndarray, ...] | None:
    """The tiled backward (or "mma") given the forward's o and row statistics (attention_packed(keep_stats=True)),
    as the trainer calls it; None where the forward's kernel gives no statistics."""
    b = backend
    dq, dk, dv, ddo = (b.asarray(x) for x in (q, k, v, do))
    o, row_stats = attention_op.attention_packed(b, dq, dk, dv, cu, keep_stats=True)
    if row_stats is None:
        return None
    grads = attention_op.attention_packed_backward(b, dq, dk, dv, ddo, cu, o=o, method=method, row_stats=row_stats)
    return tuple(b.to_numpy(g) for g in grads)


def _add_all_methods(tally: Tally, backend: Backend, expected, q, k, v, do, cu, rows=slice(None), **options) -> None:
    """Every backward variant this backend runs for these shapes (rows, and tiled and mma where they exist;
    those also from the forward's statistics), each against the expected bits (of the token rows
    `rows` of its gradients)."""
    for method in attention_op.backward_methods(backend, q.shape[2]):
        got = _attention_backward(backend, q, k, v, do, cu, method=method, **options)
        _add_grads(tally, (g[rows] for g in got), expected)
        if method in ("tiled", "mma") and not options:
            got = _backward_from_forward_stats(backend, q, k, v, do, cu, method)
            if got is not None:
                _add_grads(tally, (g[rows] for g in got), expected)


def check_attention_backward_packed(backend: Backend, rng, quick: bool) -> Tally:
    """dq, dk, dv of packed ragged sequences against the reference (one sequence at a time), every
    head layout; every input kind on the first layout, massive rows (ordinary channels plus one
    25,000x channel) on the others."""
    tally = Tally()
    lengths = BACKWARD_LENGTHS_QUICK if quick else BACKWARD_LENGTHS_FULL
    cu = cu_seqlens([lengths[i] for i in rng.permutation(len(lengths))])
    for index, (hq, hkv, d) in enumerate(BACKWARD_HEADS_QUICK if quick else BACKWARD_HEADS_FULL):
        for kind in ATTENTION_KINDS if index == 0 else ("massive",):
            q, k, v, do = _backward_inputs(rng, int(cu[-1]), hq, hkv, d, kind)
            expected = attention_ref.attention_packed_backward(q, k, v, do, cu)
            _add_all_methods(tally, backend, expected, q, k, v, do, cu)
    return tally


def check_attention_backward_nonfinite(backend: Backend, rng, quick: bool) -> Tally:
    """A NaN q row, an inf k row, a NaN v row and an inf do row: the canonical NaN exactly where the
    contract says (dq of the poisoned rows, dk and dv of their kv head at j <= t), nothing else touched."""
    tally = Tally()
    lengths = [33, 40, 7, 20]
    cu = cu_seqlens(lengths)
    hq, hkv, d = 8, 2, 64
    q, k, v, do = _backward_inputs(rng, int(cu[-1]), hq, hkv, d, "massive")
    q[5, 3, 17] = np.nan  # sequence 0, position 5, head 3 (kv head 0)
    k[cu[1] + 20, 1, 2] = np.inf  # sequence 1, positions >= 20, heads 4..7
    v[cu[2] + 3, 0, 0] = -np.nan  # sequence 2, positions >= 3, heads 0..3
    do[cu[3] + 9, 6, 5] = -np.inf  # sequence 3, position 9, head 6 (kv head 1)
    expected = attention_ref.attention_packed_backward(q, k, v, do, cu)
    nan_q = np.isnan(expected[0]).all(axis=2)
    nan_kv = np.isnan(expected[1]).all(axis=2)
    assert nan_q.sum() == 1 + 20 * 4 + 4 * 4 + 1 and not np.isnan(expected[0][~nan_q]).any()
    assert nan_kv.sum() == 6 + 40 + 7 + 10 and np.array_equal(nan_kv, np.isnan(expected[2]).all(axis=2))
    _add_all_methods(tally, backend, expected, q, k, v, do, cu)
    return tally


def check_attention_backward_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """position_in_batch and launch_shape: a sequence alone, packed among others at several offsets,
    with any thread count, and with the forward's o passed in, gives the reference's bits."""
    tally = Tally()
    hq, hkv, d = 8, 2, 64
    target = 70 if quick else 300
    q, k, v, do = _backward_inputs(rng, target, hq, hkv, d, "massive")
    expected = attention_ref.attention_packed_backward(q, k, v, do, cu_seqlens([target]))
    _add_all_methods(tally, backend, expected, q, k, v, do, cu_seqlens([target]))
    for before, after in (([7], [50, 1]), ([50, 1, 33], []), ([], [7, 33])):
        lengths = before + [target] + after
        pq, pk, pv, pdo = _backward_inputs(rng, sum(lengths), hq, hkv, d)
        at = sum(before)
        for packed, alone in zip((pq, pk, pv, pdo), (q, k, v, do)):
            packed[at:at + target] = alone
        _add_all_methods(tally, backend, expected, pq, pk, pv, pdo, cu_seqlens(lengths), rows=slice(at, at + target))
    for threads in (1, 32, 100, 1024) if not quick else (32, 1024):
        _add_grads(tally, _attention_backward(backend, q, k, v, do, cu_seqlens([target]), threads=threads), expected)
    o = _packed_output(backend, q, k, v, cu_seqlens([target]))
    _add_all_methods(tally, backend, expected, q, k, v, do, cu_seqlens([target]), o=o)
    return tally


def check_attention_backward_long(backend: Backend, rng, quick: bool) -> Tally:
    """A long sequence (more keys than any block has threads: pass 2 runs in many chunks, the dk/dv
    blocks loop over thousands of (t, h) pairs), beside a short one."""
    tally = Tally()
    lengths = [300, 5] if quick else [2100, 5]
    hq, hkv, d = 4, 2, 64
    cu = cu_seqlens(lengths)
    q, k, v, do = _backward_inputs(rng, int(cu[-1]), hq, hkv, d, "normal")
    _add_all_methods(tally, backend, attention_ref.attention_packed_backward(q, k, v, do, cu), q, k, v, do, cu)
    return tally


# (Hq, Hkv, D, lengths): the tiled kernels' edges: one token, sequences of 1, 63 and 1000 packed,
# head_dim 64 and 256 (and 192, padded to 256), GQA groups 1, 2 and 8
BACKWARD_SHAPES_QUICK = ((2, 1, 64, (1,)), (8, 1, 64, (1, 63, 130)), (2, 2, 256, (63, 1)), (4, 2, 192, (40,)))
BACKWARD_SHAPES_FULL = ((2, 1, 64, (1,)), (8, 1, 64, (1, 63, 1000)), (4, 4, 256, (63, 1, 300)),
                        (4, 2, 128, (1000, 63, 1)), (16, 2, 128, (257, 64, 65)), (4, 2, 192, (100,)))


def check_attention_backward_shapes(backend: Backend, rng, quick: bool) -> Tally:
    """Odd shapes for every variant: single tokens, sequences that end inside a tile and span many,
    head_dim 64 / 192 / 256, groups 1 to 8, massive rows."""
    tally = Tally()
    for hq, hkv, d, lengths in BACKWARD_SHAPES_QUICK if quick else BACKWARD_SHAPES_FULL:
        cu = cu_seqlens(list(lengths))
        q, k, v, do = _backward_inputs(rng, int(cu[-1]), hq, hkv, d, "massive")
        _add_all_methods(tally, backend, attention_ref.attention_packed_backward(q, k, v, do, cu),
                         q, k, v, do, cu)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("attention.packed", check_attention_packed),
    ("attention.nonfinite_rows", check_attention_nonfinite),
    ("attention.write_kv", check_attention_write_kv),
    ("attention.paged", check_attention_paged),
    ("attention.invariance", check_attention_invariance),
    ("attention.split_decode", check_attention_split),
    ("attention.split_nonfinite_rows", check_attention_split_nonfinite),
    ("attention.backward_packed", check_attention_backward_packed),
    ("attention.backward_nonfinite_rows", check_attention_backward_nonfinite),
    ("attention.backward_invariance", check_attention_backward_invariance),
    ("attention.backward_long", check_attention_backward_long),
    ("attention.backward_shapes", check_attention_backward_shapes),
]


# ---- golden

GOLDEN_CASES = Cases("attention")


def _qkv(s: Stream, tokens: int, hq: int, hkv: int, d: int, kind: str):
    return tuple(s.floats((tokens, heads, d), kind) for heads in (hq, hkv, hkv))


@GOLDEN_CASES.case("packed", seed=70, lengths=[7, 1, 33, 70], heads=[[8, 2, 64], [4, 4, 128], [8, 2, 20]],
                   kinds=["uniform", "massive", "tiny", "huge", "zeros", "special"], heads_order="[Hq, Hkv, D]",
                   nonfinite="heads[0], massive, with q[5, 3, 17] = NaN, k[cu[2] + 20, 1, 2] = inf, "
                             "v[cu[3] + 3, 0, 0] = NaN")
def _attention_packed(backend, s, r):
    out, cu = [], cu_seqlens(r["lengths"])
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        for kind in r["kinds"] if i == 0 else r["kinds"][:2]:
            q, k, v = (backend.asarray(a) for a in _qkv(s, int(cu[-1]), hq, hkv, d, kind))
            out.append((f"{i}.{kind}.o", host(backend, attention_op.attention_packed(backend, q, k, v, cu))))
    hq, hkv, d = r["heads"][0]
    q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, "massive")
    q[5, 3, 17], k[cu[2] + 20, 1, 2], v[cu[3] + 3, 0, 0] = np.nan, np.inf, np.nan
    o = attention_op.attention_packed(backend, *(backend.asarray(a) for a in (q, k, v)), cu)
    return out + [("nonfinite.o", host(backend, o))]


@GOLDEN_CASES.case("write_kv", seed=71, layouts=[[2, 64], [4, 128], [2, 20], [1, 1]], layouts_order="[Hkv, D]",
                   kinds=STREAM_ROW_KINDS, tokens=13, num_slots=40, block_size=4, skipped_tokens=[2, 7])
def _attention_write_kv(backend, s, r):
    out, tokens = [], r["tokens"]
    for i, (hkv, d) in enumerate(r["layouts"]):
        for kind in r["kinds"]:
            k, v = s.floats((tokens, hkv, d), kind), s.floats((tokens, hkv, d), kind)
            slots = s.permutation(r["num_slots"])[:tokens].astype(np.int32)
            slots[r["skipped_tokens"]] = -1
            cache = attention_op.KVCache.allocate(backend, r["num_slots"], hkv, d, r["block_size"])
            attention_op.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
            for name in ("k_digits", "k_exponents", "v_digits", "v_exponents"):
                out.append((f"{i}.{kind}.{name}", host(backend, getattr(cache, name),
                                                       "int8" if name.endswith("digits") else "int32")))
    return out


@GOLDEN_CASES.case("paged", seed=72, lengths=[45, 1, 130], heads=[[8, 2, 64], [4, 2, 20]], block_size=16,
                   spare_blocks=3, kind="massive", heads_order="[Hq, Hkv, D]",
                   queries="every position of every sequence, then the rows in a random order, then each last "
                           "position alone")
def _attention_paged(backend, s, r):
    out, lengths, block = [], r["lengths"], r["block_size"]
    cu = cu_seqlens(lengths)
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, r["kind"])
        needed = [-(-n // block) for n in lengths]
        physical = s.permutation(sum(needed) + r["spare_blocks"])
        tables = np.full((len(lengths), max(needed) + 1), -1, dtype=np.int32)
        used = 0
        for seq, count in enumerate(needed):
            tables[seq, :count] = physical[used:used + count]
            used += count
        cache = attention_op.KVCache.allocate(backend, (sum(needed) + r["spare_blocks"]) * block, hkv, d, block)
        q_seq = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
        q_pos = (np.arange(int(cu[-1])) - cu[:-1][q_seq]).astype(np.int32)
        slots = (tables[q_seq, q_pos // block].astype(np.int64) * block + q_pos % block).astype(np.int32)
        attention_op.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
        tables_dev = backend.asarray(tables)

        def query(rows, name):
            o = attention_op.attention_paged(backend, backend.asarray(np.ascontiguousarray(q[rows])),
                                             backend.asarray(q_seq[rows]), backend.asarray(q_pos[rows]), cache,
                                             tables_dev)
            out.append((f"{i}.{name}.o", host(backend, o)))

        query(np.arange(int(cu[-1])), "all")
        query(s.permutation(int(cu[-1])), "shuffled")
        query(cu[1:] - 1, "last")
    return out


@GOLDEN_CASES.case("packed_backward", seed=73, lengths=[1, 7, 33, 40], heads=[[4, 1, 64], [4, 2, 40], [3, 3, 20]],
                   kinds=["uniform", "massive", "special"], heads_order="[Hq, Hkv, D]")
def _attention_packed_backward(backend, s, r):
    out, cu = [], cu_seqlens(r["lengths"])
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        for kind in r["kinds"] if i == 0 else r["kinds"][:2]:
            q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, kind)
            do = s.floats((int(cu[-1]), hq, d), kind)
            grads = attention_op.attention_packed_backward(backend, *(backend.asarray(a) for a in (q, k, v, do)), cu)
            out += [(f"{i}.{kind}.{name}", host(backend, g)) for name, g in zip(("dq", "dk", "dv"), grads)]
    return out
