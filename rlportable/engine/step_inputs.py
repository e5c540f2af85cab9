"""A step's metadata on the host, its padding to a decode bucket, and its one upload to the device.

The runner turns a scheduler step into host arrays (`StepPlan`): token ids, positions, the
block-table row of every token, the cache slot it writes, the block tables, and which rows give
logits. A decode step (every entry one token of a sequence drawing one sample) is padded to a
*bucket* size (`decode_buckets`), so that a few fixed shapes cover every batch and each can be
replayed as a captured graph. Padding rows are inert:
  * token 0 at position 0, slot -1: attention_write_kv skips a negative slot, so a padding row
    writes no K/V anywhere (nothing to reserve, and no two rows writing one slot);
  * query row i attends through its own block-table row, all zeros: position 0 of block 0, which
    it only reads (whatever is there), so its output is finite or NaN but never used;
  * every op works row by row (the contracts' per-row encodings), so the real rows' bits are
    those of an unpadded step, and the padding rows' logits are never sampled.
The padding is backend-neutral: the cpu backend runs it too, so CI checks it.

`StepUploader` copies everything a step needs (this metadata, copy-on-write slots, the sampler's
parameters) in one host-to-device copy, into one persistent device buffer. The decode inputs sit
at fixed offsets (a captured graph reads them there at every replay); the rest follows them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from rlportable.engine.block_manager import InvariantError
from rlportable.ops.attention import MAX_KEYS

ALIGN = 256  # bytes between the starts of uploaded arrays (any multiple of 8 keeps float64 views aligned)
GRAPH_INPUTS = ("tokens", "positions", "q_seq", "slots", "block_tables")


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, ... below max_num_seqs, then max_num_seqs: the padded sizes of decode steps."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return tuple(sizes) + (max_num_seqs,)


@dataclass
class StepPlan:
    """One step's inputs on the host (int32). rows = tokens.size (the bucket, if padded)."""

    tokens: np.ndarray  # [rows]
    positions: np.ndarray  # [rows]
    q_seq: np.ndarray  # [rows], a row of block_tables
    slots: np.ndarray  # [rows], -1 for a padding row (writes nothing)
    block_tables: np.ndarray  # [sequences, width]
    sample_rows: np.ndarray  # [samples]: the row whose hidden state gives each sample's logits
    bucket: int | None = None  # the padded decode size, or None (exact sizes)

    def graph_inputs(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in GRAPH_INPUTS}


def plan_decode(entries, bucket: int, width: int, block_size: int) -> StepPlan:
    """A decode step padded to `bucket` rows (module docstring); block tables `width` columns wide.
    Whole-array assignments: this runs at every decode step, for up to max_num_seqs rows."""
    count = len(entries)
    if count > bucket:
        raise InvariantError(f"runner: {count} decodes do not fit the bucket of {bucket}")
    seqs = [entry.seq for entry in entries]
    tokens = np.zeros(bucket, dtype=np.int32)
    positions = np.zeros(bucket, dtype=np.int32)
    slots = np.full(bucket, -1, dtype=np.int32)
    tables = np.zeros((bucket, width), dtype=np.int32)
    if count:
        lengths = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=count)
        if lengths.max() > width:
            raise InvariantError(f"runner: a sequence holds {lengths.max()} blocks, more than the {width} a "
                                 f"sequence of max_model_len tokens can need")
        rows = np.repeat(np.arange(count), lengths)
        columns = np.arange(rows.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tables[rows, columns] = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs),
                                            dtype=np.int32, count=rows.size)
        # a decode feeds its last known token, at position num_tokens - 1 (= entry.start)
        tokens[:count] = np.fromiter((s.last_token for s in seqs), dtype=np.int32, count=count)
        start = np.fromiter((entry.start for entry in entries), dtype=np.int32, count=count)
        positions[:count] = start
        slots[:count] = tables[np.arange(count), start // block_size] * block_size + start % block_size
    return StepPlan(tokens, positions, np.arange(bucket, dtype=np.int32), slots, tables,
                    np.arange(count, dtype=np.int32), bucket)


def plan_step(entries, block_size: int) -> StepPlan:
    """Any step (prefill chunks and decodes), at its exact sizes. Each sample's logits come from
    the last row of its entry (forked samples share their parent's row)."""
    tokens = np.concatenate([np.asarray(e.token_ids(), dtype=np.int32) for e in entries])
    positions = np.concatenate([np.arange(e.start, e.end, dtype=np.int32) for e in entries])
    slots = np.concatenate([np.asarray(e.slots(block_size), dtype=np.int32) for e in entries])
    q_seq = np.repeat(np.arange(len(entries), dtype=np.int32), [e.num_new_tokens for e in entries])
    width = max(1, max(len(e.seq.block_table) for e in entries))
    tables = np.zeros((len(entries), width), dtype=np.int32)
    for row, entry in enumerate(entries):
        tables[row, : len(entry.seq.block_table)] = entry.seq.block_table
    ends = np.cumsum([e.num_new_tokens for e in entries]) - 1
    sample_rows = [int(end) for end, e in zip(ends, entries) if e.needs_sample for _ in e.sample_seqs]
    return StepPlan(tokens, positions, q_seq, slots, tables, np.asarray(sample_rows, dtype=np.int32))


def check_decode_plan(plan: StepPlan, real_rows: int, vocab: int, num_blocks: int, block_size: int,
                      rope_rows: int) -> None:
    """The checks the ops make on their host arguments, for a plan a graph replays (no op runs then).
    The scheduler builds valid plans; this turns a bookkeeping bug into an error, not a silent read."""
    tokens, positions, slots = plan.tokens[:real_rows], plan.positions[:real_rows], np.sort(plan.slots[:real_rows])
    tables = plan.block_tables
    problems = []
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        problems.append(f"token ids outside [0, {vocab})")
    if positions.size and (positions.min() < 0 or positions.max() >= min(rope_rows, MAX_KEYS)):
        problems.append(f"positions outside [0, {min(rope_rows, MAX_KEYS)})")
    if tables.size and (tables.min() < 0 or tables.max() >= num_blocks):
        problems.append(f"block tables name blocks outside [0, {num_blocks})")
    if slots.size and (slots[0] < 0 or slots[-1] >= num_blocks * block_size or (slots[1:] == slots[:-1]).any()):
        problems.append("slots outside the cache, or repeated")
    if problems:
        raise InvariantError(f"runner: invalid decode step ({'; '.join(problems)})")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StepUploader:
    """One host-to-device copy per step into one persistent uint8 device buffer.

    `fixed` names arrays at fixed offsets (each with its largest shape; a step passes a prefix of
    rows, and gets views of that prefix): a graph captured on views of them reads whatever the
    latest upload put there. Other arrays follow the fixed region, at offsets of this step. When
    a step needs more room, the buffer is replaced (`buffer` is a new object: graphs that read the
    old one must be dropped; the runner compares it by identity)."""

    def __init__(self, backend, fixed: dict[str, tuple[tuple[int, ...], type]]):
        self.backend = backend
        self.fixed: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        offset = 0
        for name, (shape, dtype) in fixed.items():
            dtype = np.dtype(dtype)
            self.fixed[name] = (offset, tuple(shape), dtype)
            offset += _aligned(int(np.prod(shape)) * dtype.itemsize)
        self.fixed_bytes = offset
        self.buffer = None

    def _layout(self, fixed: dict[str, np.ndarray], extra: dict[str, np.ndarray]) -> tuple[list, int]:
        """[(name, offset, host array)] and the bytes to copy."""
        placed = []
        for name, array in fixed.items():
            offset, shape, dtype = self.fixed[name]
            if array.dtype != dtype or array.ndim != len(shape) or array.shape[0] > shape[0] \
                    or array.shape[1:] != shape[1:]:
                raise InvariantError(f"runner: upload {name} {array.dtype.name} {array.shape} does not fit "
                               f"{dtype.name} {shape}")
            placed.append((name, offset, array))
        offset = self.fixed_bytes
        for name, array in extra.items():
            placed.append((name, offset, array))
            offset += _aligned(array.nbytes)
        return placed, offset

    def reserve(self, nbytes: int) -> None:
        """Make the buffer hold at least nbytes (call before capturing graphs on it)."""
        if self.buffer is None or self.buffer.shape[0] < nbytes:
            current = 0 if self.buffer is None else self.buffer.shape[0]
            self.buffer = self.backend.empty((max(nbytes, 2 * current, self.fixed_bytes + (1 << 20)),), np.uint8)

    def size_of(self, fixed: dict[str, np.ndarray], extra: dict[str, np.ndarray]) -> int:
        return self._layout(fixed, extra)[1]

    def upload(self, fixed: dict[str, np.ndarray], extra: dict[str, np.ndarray]) -> dict:
        """Device views of every array (same names), after one copy of all of them."""
        fixed = {name: np.ascontiguousarray(a) for name, a in fixed.items()}
        extra = {name: np.ascontiguousarray(a) for name, a in extra.items()}
        placed, total = self._layout(fixed, extra)
        self.reserve(total)
        host = np.empty(total, dtype=np.uint8)  # gaps between arrays are never read
        for _, offset, array in placed:
            host[offset: offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        self.backend.upload(self.buffer, host)
        return {name: self.backend.typed_view(self.buffer, offset, array.shape, array.dtype)
                for name, offset, array in placed}
