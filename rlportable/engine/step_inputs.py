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

import functools
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


def plan_decode(entries, bucket: int, width: int, block_size: int, tables: "DecodeTables | None" = None) -> StepPlan:
    """A decode step padded to `bucket` rows (module docstring); block tables `width` columns wide.
    `tables`: the runner's DecodeTables (its rows of the sequences' block tables, kept between
    steps); None builds every row from the sequences' lists.
    Whole-array assignments: this runs at every decode step, for up to max_num_seqs rows."""
    count = len(entries)
    if count > bucket:
        raise InvariantError(f"runner: {count} decodes do not fit the bucket of {bucket}")
    seqs = [entry.seq for entry in entries]
    tokens = np.zeros(bucket, dtype=np.int32)
    positions = np.zeros(bucket, dtype=np.int32)
    slots = np.full(bucket, -1, dtype=np.int32)
    block_tables = np.zeros((bucket, width), dtype=np.int32)
    if count:
        if tables is None:
            tables = DecodeTables(width, count)
        rows = tables.rows(seqs)  # before reading tables.store, which this may grow
        np.take(tables.store, rows, axis=0, out=block_tables[:count])
        # a decode feeds its last known token, at position num_tokens - 1 (= entry.start)
        tokens[:count] = np.fromiter((s.last_token for s in seqs), dtype=np.int32, count=count)
        start = np.fromiter((entry.start for entry in entries), dtype=np.int32, count=count)
        positions[:count] = start
        slots[:count] = block_tables[np.arange(count), start // block_size] * block_size + start % block_size
    return StepPlan(tokens, positions, _arange(bucket), slots, block_tables, _arange(count), bucket)


@functools.lru_cache(maxsize=1024)
def _arange(count: int) -> np.ndarray:
    """0, 1, ..., count - 1 (int32): q_seq and sample_rows of decode steps, one read-only array per
    count, shared by every step of that size."""
    array = np.arange(count, dtype=np.int32)
    array.flags.writeable = False
    return array


class DecodeTables:
    """The block-table rows of decode steps' sequences, kept between steps (one per runner).

    A decode step uploads a [bucket, width] table, one row per sequence. Rebuilding it from the
    sequences' lists at every step was most of a step's planning, yet a sequence's table changes
    only when it takes a block (every block_size tokens), at a copy-on-write, or when it is freed
    (preempted, finished). So each sequence keeps a row of `store`, with a copy of the list that
    row was written from; a step rewrites only the rows whose sequence's list differs from its
    copy (a C-level list comparison: a row is never stale, whatever changed the table) and
    gathers the step's rows in order. Rows of sequences missing from a step are reclaimed when
    the store runs out of free rows."""

    def __init__(self, width: int, capacity: int):
        self.width = width
        self.store = np.zeros((max(capacity, 1), width), dtype=np.int32)
        self._row_of: dict[int, int] = {}  # seq_id -> its row of store
        self._written: list[list[int] | None] = [None] * self.store.shape[0]  # the list each row holds
        self._free = list(range(self.store.shape[0] - 1, -1, -1))
        self.rows_written = 0  # statistics (tests): rows (re)written since construction

    def rows(self, seqs) -> np.ndarray:
        """The rows of store that hold seqs' block tables now (written where missing or changed)."""
        row_of, written = self._row_of, self._written
        rows = []
        for seq in seqs:
            row = row_of.get(seq.seq_id)
            if row is None or written[row] != seq.block_table:
                row = self._write(seq, row, seqs)
            rows.append(row)
        return np.array(rows, dtype=np.intp)

    def _write(self, seq, row: int | None, step_seqs) -> int:
        table = seq.block_table
        if len(table) > self.width:
            raise InvariantError(f"runner: a sequence holds {len(table)} blocks, more than the {self.width} a "
                                 f"sequence of max_model_len tokens can need")
        if row is None:
            if not self._free:
                self._reclaim(step_seqs)
            row = self._free.pop()
            self._row_of[seq.seq_id] = row
        self.store[row, : len(table)] = table
        self.store[row, len(table):] = 0
        self._written[row] = list(table)  # a copy: the block manager changes the list in place
        self.rows_written += 1
        return row

    def _reclaim(self, step_seqs) -> None:
        """Free the rows of sequences absent from this step (finished or preempted ones, mostly)."""
        keep = {seq.seq_id for seq in step_seqs}
        for seq_id in [i for i in self._row_of if i not in keep]:
            row = self._row_of.pop(seq_id)
            self._written[row] = None
            self._free.append(row)
        if not self._free:  # more sequences in one step than rows: grow
            old = self.store.shape[0]
            self.store = np.concatenate([self.store, np.zeros_like(self.store)])
            self._written += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))


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
        self._views: tuple = (None, None, {})  # the last upload's (buffer, layout, device views)

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
        return self._device_views(placed)

    def _device_views(self, placed: list) -> dict:
        """Views of the buffer for the placed arrays: the last upload's own view objects when the
        layout is the same (consecutive decode steps), since a device view costs microseconds to
        make (a CuPy ndarray each) and a step uploads about ten arrays."""
        layout = [(name, offset, array.shape, array.dtype) for name, offset, array in placed]
        buffer, last_layout, views = self._views
        if buffer is not self.buffer or layout != last_layout:
            views = {name: self.backend.typed_view(self.buffer, offset, shape, dtype)
                     for name, offset, shape, dtype in layout}
            self._views = (self.buffer, layout, views)
        return dict(views)  # a copy: callers may add to it
