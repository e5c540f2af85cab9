"""Op family "attention": exact causal GQA attention over an encoded (fixed-point) KV cache.

Contract: contracts/attention.toml; reference: rlportable/contract/attention.py;
kernels: backends/portable/attention.hip (NVIDIA's fast paths: backends/cuda/attention.cu) (attention_paged, attention_write_kv; the split-KV decode
path attention_split_scores / _values (or _values_h2 for groups of at most 2 q heads per kv head) /
_combine, METHODS "split").

The KV cache stores every (slot, kv head) row of K and V ENCODED, exactly as
fixedpoint_encode_rows writes rows with 15 bits and 2 ascending digits:
  k_digits, v_digits         int8  [num_slots, Hkv, 2, round_up(D, 64)]  (qk = d0 + 256 d1)
  k_exponents, v_exponents   int32 [num_slots, Hkv]
Sequence s, position j lives in slot block_tables[s, j // block_size] * block_size + j % block_size.
One kernel serves paged decode, chunked prefill and packed prefill: `attention_packed`
writes the packed rows to contiguous slots and calls it with block_size 1 tables. Because
every reduction of the contract is exact, each query's bits depend only on its own row and
keys 0..t of its sequence, however the calls are cut.

On cpu the same encoded cache is kept in NumPy arrays; attention_paged decodes the
sequences' rows exactly (fixedpoint.join_digits) and runs the reference's
attention_encoded_batched; attention_packed and attention_packed_backward run the reference's
batched forms (many sequences and all heads per NumPy call, the per-sequence bits).

attention_packed_backward (op "attention_backward"): dq, dk, dv of attention_packed for an
incoming gradient do, from three kernels (attention_backward_rows, _dq, _dkv) over a block-size-1
encoded cache; every sum is exact, so the bits match the reference's for any block size.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from rlportable.contract import attention as reference, fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops import segments
from rlportable.ops.checks import NULL_POINTER, round_up, shape_of
from rlportable.ops.fixedpoint import K_ALIGN, encode_rows_reference
from rlportable.runtime.base import Backend
from rlportable.runtime.flags import WGMMA_CAPABILITIES, has_wgmma
from rlportable.runtime.hip import MFMA_ARCHS

Q_BITS = reference.Q_BITS  # 23: 3 int8 digits
KV_BITS = reference.K_BITS  # 15: 2 int8 digits, as weights
KV_SLICES = fp.slice_count(KV_BITS)
MAX_HEAD_DIM = 512  # the kernel's shared-memory arrays (RLP_ATT_MAX_HEAD_DIM)
MAX_KEYS = reference.MAX_KEYS
THREADS = 256  # attention_paged block size (any value in [1, MAX_THREADS] gives the same bits)
MAX_THREADS = 1024
GRID_LIMIT = 1 << 20  # grid-stride beyond this many blocks
#: Kernel variants of attention_paged (every one gives the reference's bits):
#:   "portable": attention_paged, one block per (query, head), scalar int64 arithmetic (CUDA and HIP);
#:   "mma": attention_paged_mma_d128 / _d256, CUDA sources only (mma.sync int8 tensor cores), 64 query
#:          rows x one head per block, padded head_dim <= 256;
#:   "wgmma": attention_paged_wgmma_d128, CUDA sources on compute capability 9.0 (sm_90a warpgroup MMA),
#:          the mma kernel's blocks with the products on wgmma; padded head_dim 128 and tables of at most
#:          WGMMA_MAX_KEYS keys (its value sums stay int32 over a row);
#:   "split": attention_split_scores / _values / _combine (CUDA and HIP), split-KV decode: one block per
#:          (query row, kv head, key range) with all the group's q heads, K and V read once per group;
#:   "auto": "mma" (or "wgmma" where AUTO_WGMMA, it exists and the tables fit it) where the call has enough
#:          queries per sequence (prefill); else "split" where it exists (decode), else "portable".
METHODS = ("auto", "portable", "mma", "wgmma", "split")
MMA_ROWS = 64  # query rows per block of the mma kernels
MMA_THREADS = 256
MMA_MAX_HEAD_DIM_PADDED = 256
WGMMA_HEAD_DIM_PADDED = 128
WGMMA_MAX_KEYS = 65536  # RLP_ATTW_MAX_KEYS: keys a table may address for the wgmma kernel
#: whether "auto" takes "wgmma" where it exists: only once it is measured faster than "mma" on the device
#: (docs/training.md, "The attention forward on the GPU")
AUTO_WGMMA = False
#: the MFMA forward's largest padded head_dim: 256 would need 91 KB of LDS (backends/hip/attention.hip)
MFMA_MAX_HEAD_DIM_PADDED = 128
MMA_MIN_ROWS_PER_SEQ = 8  # "auto": fewer query rows per sequence (decode) run the split kernels
SPLIT_THREADS = 128  # RLP_ATTS_THREADS: the split kernels' block size (their shared arrays are sized for it)
SPLIT_TARGET_BLOCKS = 1024  # (row, kv head, split) blocks wanted per pass: several per SM of the largest GPUs
SPLIT_MIN_KEYS = 128  # keys per split at least: more, emptier splits cost more than they spread (probe_attention)
SPLIT_MAX_KEYS = 1 << 14  # keys per split at most: keeps the value pass's float64 sums below 2^51, exact
SPLIT_SCRATCH_BYTES = 256 << 20  # scores and key exponents per launch at most (more rows: several launches)
SPLIT_VALUE_HEADS = 4  # RLP_ATTS_VALUE_HEADS: q heads per round of attention_split_values at most
SPLIT_COLUMNS = 4  # RLP_ATTS_COLUMNS: value columns per thread of attention_split_values


@dataclass
class KVCache:
    """The encoded K/V cache of one attention layer (device arrays, or NumPy on cpu)."""

    k_digits: Any  # int8 [num_slots, Hkv, 2, Dp]
    k_exponents: Any  # int32 [num_slots, Hkv]
    v_digits: Any
    v_exponents: Any
    num_slots: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def head_dim_padded(self) -> int:
        return round_up(self.head_dim, K_ALIGN)

    @property
    def num_blocks(self) -> int:
        return self.num_slots // self.block_size

    @classmethod
    def allocate(cls, backend: Backend, num_slots: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                 zero: bool = True) -> "KVCache":
        """A cache of num_slots slots (zero-filled: unwritten slots read as zero rows with e = 0)."""
        for name, value, low in (("num_slots", num_slots, 0), ("num_kv_heads", num_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("block_size", block_size, 1)):
            if not isinstance(value, (int, np.integer)) or int(value) < low:
                raise InputError(f"KVCache: {name} must be an integer >= {low}, got {value!r}")
        if head_dim > MAX_HEAD_DIM:
            raise InputError(f"KVCache: head_dim {head_dim} exceeds the contract's limit {MAX_HEAD_DIM}")
        num_slots, num_kv_heads, head_dim, block_size = int(num_slots), int(num_kv_heads), int(head_dim), int(block_size)
        make = backend.zeros if zero else backend.empty
        dp = round_up(head_dim, K_ALIGN)
        return cls(make((num_slots, num_kv_heads, KV_SLICES, dp), np.int8), make((num_slots, num_kv_heads), np.int32),
                   make((num_slots, num_kv_heads, KV_SLICES, dp), np.int8), make((num_slots, num_kv_heads), np.int32),
                   num_slots, num_kv_heads, head_dim, block_size)


# ---- input checks


def _require(name: str, array, ndim: int, dtype) -> tuple[int, ...]:
    shape = shape_of(array)
    if len(shape) != ndim:
        raise InputError(f"{name} must have {ndim} dimensions, got shape {shape}")
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise InputError(f"{name} must have dtype {np.dtype(dtype).name}, got {np.dtype(array.dtype).name} "
                         f"(shape {shape})")
    if getattr(getattr(array, "flags", None), "c_contiguous", True) is False:
        raise InputError(f"{name} (shape {shape}) must be C-contiguous")
    return shape


def _host(array) -> np.ndarray | None:
    """The array if it lives on the host (values can be checked without a device sync), else None. A
    subclass is a backend's device array (hip-cpu's DeviceArray), not host data."""
    return array if type(array) is np.ndarray else None


def check_kv(cache: KVCache, k, v, slots) -> int:
    shape = _require("k", k, 3, np.float32)
    expected = (shape[0], cache.num_kv_heads, cache.head_dim)
    if shape != expected:
        raise InputError(f"write_kv: k must have shape [T, Hkv={cache.num_kv_heads}, D={cache.head_dim}], got {shape}")
    if _require("v", v, 3, np.float32) != shape:
        raise InputError(f"write_kv: v must have the shape of k {shape}, got {shape_of(v)}")
    if _require("slots", slots, 1, np.int32) != (shape[0],):
        raise InputError(f"write_kv: slots must have shape [T={shape[0]}], got {shape_of(slots)}")
    host = _host(slots)
    if host is not None:
        used = host[host >= 0]
        if used.size and used.max() >= cache.num_slots:
            raise InputError(f"write_kv: slot {int(used.max())} is outside the cache's {cache.num_slots} slots")
        increasing = used.size < 2 or bool(np.all(used[1:] > used[:-1]))  # the usual case, without a sort
        if not increasing and np.unique(used).size != used.size:
            raise InputError("write_kv: slots must be distinct (a negative slot writes nothing)")
    return shape[0]


def _key_slots(table_row: np.ndarray, length: int, block_size: int, num_slots: int, seq: int) -> np.ndarray:
    """Slots of positions 0..length-1 of one sequence; InputError if the tables or the cache lack one."""
    positions = np.arange(length, dtype=np.int64)
    blocks_needed = -(-length // block_size)
    if blocks_needed > table_row.shape[0]:
        raise InputError(f"attention: sequence {seq} needs {blocks_needed} blocks for position {length - 1}, "
                         f"but block_tables has {table_row.shape[0]} columns")
    blocks = table_row[positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    if blocks.size and (blocks.min() < 0 or slots.max() >= num_slots):
        raise InputError(f"attention: block_tables row {seq} names a block outside the cache "
                         f"({num_slots} slots of block size {block_size})")
    return slots


def _check_query(q, q_seq, q_pos, cache: KVCache, block_tables) -> tuple[int, int]:
    shape = _require("q", q, 3, np.float32)
    tq, hq, dim = shape
    if dim != cache.head_dim:
        raise InputError(f"attention: q has head_dim {dim} but the cache has {cache.head_dim} (q shape {shape})")
    if hq < cache.num_kv_heads or hq % cache.num_kv_heads:
        raise InputError(f"attention: q's {hq} heads are not a multiple of the cache's {cache.num_kv_heads} kv heads")
    for name, array in (("q_seq", q_seq), ("q_pos", q_pos)):
        if _require(name, array, 1, np.int32) != (tq,):
            raise InputError(f"attention: {name} must have shape [Tq={tq}], got {shape_of(array)}")
    _require("block_tables", block_tables, 2, np.int32)
    seqs, positions, tables = _host(q_seq), _host(q_pos), _host(block_tables)
    if seqs is not None and positions is not None and tables is not None and tq:
        if positions.min() < 0 or positions.max() >= MAX_KEYS:
            raise InputError(f"attention: q_pos must lie in [0, {MAX_KEYS}), got [{positions.min()}, {positions.max()}]")
        if seqs.min() < 0 or seqs.max() >= tables.shape[0]:
            raise InputError(f"attention: q_seq must lie in [0, {tables.shape[0]}) (rows of block_tables), "
                             f"got [{seqs.min()}, {seqs.max()}]")
        _check_key_blocks(tables, seqs, positions, cache)
    return tq, hq


def _check_key_blocks(tables: np.ndarray, seqs: np.ndarray, positions: np.ndarray, cache: KVCache) -> None:
    """_key_slots' checks for every sequence the queries name, at the block level and at once: each
    needs blocks 0..ceil(length / block_size) - 1 present in its row and inside the cache, length being
    its largest query position + 1. A failing sequence raises through _key_slots (its message)."""
    lengths = np.zeros(tables.shape[0], dtype=np.int64)
    np.maximum.at(lengths, seqs, positions.astype(np.int64) + 1)
    present = np.flatnonzero(lengths)
    size = cache.block_size
    needed = -(-lengths[present] // size)
    column = np.arange(tables.shape[1], dtype=np.int64)[None, :]
    in_use = column < needed[:, None]
    blocks = tables[present].astype(np.int64)
    last = np.where(column == needed[:, None] - 1, ((lengths[present] - 1) % size)[:, None], size - 1)
    bad = (needed > tables.shape[1]) | (in_use & ((blocks < 0) | (blocks * size + last >= cache.num_slots))).any(axis=1)
    for row in np.flatnonzero(bad):
        _key_slots(tables[present[row]], int(lengths[present[row]]), size, cache.num_slots, int(present[row]))


# ---- ops


def write_kv(backend: Backend, cache: KVCache, k, v, slots) -> None:
    """Encode k, v [T, Hkv, D] float32 (15 bits per row) into cache slots [T] int32 (negative: skipped)."""
    tokens = check_kv(cache, k, v, slots)
    if backend.runs_reference:
        slots = np.asarray(slots)
        keep = slots >= 0
        for x, digits, exponents in ((k, cache.k_digits, cache.k_exponents), (v, cache.v_digits, cache.v_exponents)):
            x = backend.to_numpy(x)
            encoded = encode_rows_reference(x.reshape(tokens * cache.num_kv_heads, cache.head_dim), KV_BITS)
            shaped = encoded.digits.reshape(tokens, cache.num_kv_heads, KV_SLICES, cache.head_dim_padded)
            digits[slots[keep]] = shaped[keep]
            exponents[slots[keep]] = encoded.exponents.reshape(tokens, cache.num_kv_heads)[keep]
        return
    if isinstance(slots, np.ndarray):
        slots = backend.asarray(slots)
    rows = 2 * tokens * cache.num_kv_heads
    if rows:
        backend.launch("attention", "attention_write_kv", *segments.segment_launch_shape(rows),
                       (k, v, slots, np.int64(tokens), np.int32(cache.num_kv_heads), np.int32(cache.head_dim),
                        np.int32(cache.head_dim_padded), np.int64(cache.num_slots), cache.k_digits,
                        cache.k_exponents, cache.v_digits, cache.v_exponents))


def available_methods(backend: Backend, head_dim: int) -> tuple[str, ...]:
    """The kernel variants this backend runs for this head_dim (cpu: the reference only, "portable")."""
    if backend.runs_reference:
        return ("portable",)
    if backend.kernel_vendor == "cuda" and round_up(head_dim, K_ALIGN) <= MMA_MAX_HEAD_DIM_PADDED:
        wgmma = has_wgmma(backend) and round_up(head_dim, K_ALIGN) == WGMMA_HEAD_DIM_PADDED
        return ("portable", "mma", "wgmma", "split") if wgmma else ("portable", "mma", "split")
    if mfma_arch(backend) is not None and round_up(head_dim, K_ALIGN) <= MFMA_MAX_HEAD_DIM_PADDED:
        return ("portable", "mma", "split")
    return ("portable", "split")


def mfma_arch(backend: Backend) -> str | None:
    """The AMD target whose MFMA forward this backend runs (backends/hip/attention.hip): the first of its
    mfma_archs (runtime/hip.py, hip_cpu.py), None where it has none."""
    archs = getattr(backend, "mfma_archs", ()) if backend.kernel_vendor == "hip" else ()
    return archs[0] if archs else None


def resolve_method(backend: Backend, tq: int, num_seqs: int, head_dim: int, method: str) -> str:
    if method not in METHODS:
        raise InputError(f"attention: method must be one of {METHODS}, got {method!r}")
    available = available_methods(backend, head_dim)
    if method == "mma" and "mma" not in available:
        raise InputError(f"attention: the mma kernel exists for CUDA sources with padded head_dim <= "
                         f"{MMA_MAX_HEAD_DIM_PADDED} and for AMD's {', '.join(MFMA_ARCHS)} (MFMA) with padded head_dim <= "
                         f"{MFMA_MAX_HEAD_DIM_PADDED}; got {backend.label} with head_dim {head_dim}")
    if method == "wgmma" and "wgmma" not in available:
        raise InputError(f"attention: the wgmma kernel exists for CUDA sources on compute capability "
                         f"{', '.join(WGMMA_CAPABILITIES)} with padded head_dim {WGMMA_HEAD_DIM_PADDED}; got "
                         f"{backend.label} with head_dim {head_dim}")
    if method == "split" and "split" not in available:
        raise InputError(f"attention: the split kernels exist for CUDA and HIP sources; got {backend.label}")
    if method == "auto":
        if tq >= MMA_MIN_ROWS_PER_SEQ * max(num_seqs, 1):  # prefill-shaped
            # HIP-CPU emulates each MFMA in software: there the portable kernel is the default and the
            # MFMA one runs when asked for (conform asks)
            if AUTO_WGMMA and "wgmma" in available:
                return "wgmma"
            return "mma" if "mma" in available and not backend.on_host else "portable"
        return "split" if "split" in available else "portable"  # decode-shaped
    return method


def split_plan(rows: int, num_kv_heads: int, capacity: int, keys_per_split: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) of the split kernels for `rows` query rows over block tables that
    address `capacity` keys (max_blocks * block_size); splits * keys >= capacity, so every key a
    table can name lies in a split. Depends only on the launch's shapes, never on the lengths (they
    stay in device buffers): a captured decode graph (fixed rows and table width) replays for any
    lengths. keys_per_split None: enough splits for SPLIT_TARGET_BLOCKS blocks, whole tiles of
    SPLIT_MIN_KEYS keys, at most SPLIT_MAX_KEYS keys per split."""
    capacity = max(int(capacity), 1)
    _check_keys_per_split(keys_per_split)
    if keys_per_split is None:
        wanted = -(-SPLIT_TARGET_BLOCKS // max(rows * num_kv_heads, 1))
        keys_per_split = min(max(round_up(-(-capacity // wanted), SPLIT_MIN_KEYS), SPLIT_MIN_KEYS), SPLIT_MAX_KEYS)
    keys_per_split = int(keys_per_split)
    return -(-capacity // keys_per_split), keys_per_split


def _check_keys_per_split(keys_per_split) -> None:
    if keys_per_split is not None and (not isinstance(keys_per_split, (int, np.integer))
                                       or not 1 <= int(keys_per_split) <= SPLIT_MAX_KEYS):
        raise InputError(f"attention: keys_per_split must be None or an integer in [1, {SPLIT_MAX_KEYS}], "
                         f"got {keys_per_split!r}")


def mma_shared_bytes(head_dim_padded: int) -> int:
    """Dynamic shared memory of attention_paged_mma_*: q digits 3*64*dp, K digits 2*64*dp,
    V digits (transposed) 2*64*dp, weight digits 3*64*64."""
    return 7 * MMA_ROWS * head_dim_padded + 3 * MMA_ROWS * 64


#: attention_paged_wgmma_d128's dynamic shared memory: 12 planes of 64 x 128 bytes (q 3, K 2, V transposed 4,
#: weights 3) and 1 KB to align them to 1024 bytes (the 128-byte swizzle's period)
WGMMA_SHARED_BYTES = 12 * MMA_ROWS * 128 + 1024


def split_values_kernel(group: int) -> str:
    """The value kernel for a group of q heads per kv head: groups of 1 or 2 take the build with 2 heads
    per round (half the register sums, more keys in flight), larger groups rounds of SPLIT_VALUE_HEADS."""
    return "attention_split_values_h2" if group <= 2 else "attention_split_values"


def split_values_shared_bytes(group: int, head_dim_padded: int) -> int:
    """Dynamic shared memory of attention_split_values: the int64 numerators [lanes, heads, dp] of its
    largest round, one part per key lane (SPLIT_THREADS // (dp / SPLIT_COLUMNS) lanes of threads walk
    the keys; the weights and row offsets of a tile are static arrays)."""
    lanes = SPLIT_THREADS // (head_dim_padded // SPLIT_COLUMNS)
    return lanes * min(group, SPLIT_VALUE_HEADS) * 8 * head_dim_padded


def attention_paged(backend: Backend, q, q_seq, q_pos, cache: KVCache, block_tables, threads: int = THREADS,
                    method: str = "auto", keys_per_split: int | None = None, num_seqs: int | None = None,
                    out=None, row_stats=None):
    """o [Tq, Hq, D] float32: query row i (sequence q_seq[i], position q_pos[i]) attends to keys
    0..q_pos[i] of its sequence in the paged cache (block_tables [num_seqs, max_blocks] int32).
    method: "auto", "portable", "mma", "wgmma" or "split" (METHODS; all give the same bits). threads: the
    portable kernel's block size. keys_per_split: the split kernels' key range per block (None:
    split_plan's choice; any value gives the same bits). num_seqs: how many sequences the rows
    belong to, for "auto" (None: every row of block_tables). out: a C-contiguous float32 [Tq, Hq, D]
    device array to write o into (a slice of a larger output; devices only), else a new one.
    row_stats: a float64 [Tq * Hq, 3] device array (row t * Hq + h) into whose first two columns the
    "mma", "wgmma" and "portable" kernels write each row's m and L (0 and 0 for a NaN row): the backward's
    statistics."""
    tq, hq = _check_query(q, q_seq, q_pos, cache, block_tables)
    if not isinstance(threads, (int, np.integer)) or not 1 <= int(threads) <= MAX_THREADS:
        raise InputError(f"attention: threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
    seqs = shape_of(block_tables)[0] if num_seqs is None else num_seqs
    requested, method = method, resolve_method(backend, tq, seqs, cache.head_dim, method)
    capacity = shape_of(block_tables)[1] * cache.block_size
    if method == "wgmma" and capacity > WGMMA_MAX_KEYS:
        if requested != "auto":
            raise InputError(f"attention: the wgmma kernel takes block tables of at most {WGMMA_MAX_KEYS} keys; "
                             f"these address {capacity}")
        method = "mma"
    _check_keys_per_split(keys_per_split)
    if row_stats is not None:
        if method == "split":
            raise InputError("attention: row_stats are written by the \"mma\" and \"portable\" kernels, not by "
                             "the split kernels")
        _check_row_stats("attention", row_stats, tq * hq)
    dim = cache.head_dim
    if backend.runs_reference:
        if out is not None:
            raise InputError("attention: out= is for device backends (the reference returns a new array)")
        return _attention_paged_reference(backend.to_numpy(q), np.asarray(q_seq), np.asarray(q_pos), cache,
                                          np.asarray(block_tables))
    out = _output(backend, out, (tq, hq, dim))
    if tq == 0:
        return out
    q_seq, q_pos, block_tables = (backend.asarray(a) if isinstance(a, np.ndarray) else a
                                  for a in (q_seq, q_pos, block_tables))
    num_seqs, max_blocks = shape_of(block_tables)
    scale = np.float64(1.0 / np.sqrt(np.float64(dim)))  # the reference's float64 1/sqrt(D)
    if method == "split":
        _attention_paged_split(backend, q, q_seq, q_pos, cache, block_tables, scale, keys_per_split, out)
        return out
    if method == "mma" and backend.kernel_vendor == "hip":  # the MFMA forward: static LDS only
        kernel = f"attention_paged_mfma_d{cache.head_dim_padded}_{mfma_arch(backend)}"
        grid, block, shared = (-(-tq // MMA_ROWS), hq), (MMA_THREADS,), 0
    elif method == "mma":
        dp = cache.head_dim_padded
        kernel = "attention_paged_mma_d128" if dp <= 128 else "attention_paged_mma_d256"
        grid, block, shared = (-(-tq // MMA_ROWS), hq), (MMA_THREADS,), mma_shared_bytes(dp)
    elif method == "wgmma":
        kernel, grid, block = "attention_paged_wgmma_d128", (-(-tq // MMA_ROWS), hq), (MMA_THREADS,)
        shared = WGMMA_SHARED_BYTES
    else:
        kernel, grid, block, shared = "attention_paged", (min(tq * hq, GRID_LIMIT),), (int(threads),), 0
    backend.launch("attention", kernel, grid, block,
                   (q, q_seq, q_pos, np.int64(tq), np.int32(hq), np.int32(cache.num_kv_heads), np.int32(dim),
                    np.int32(cache.head_dim_padded), scale, block_tables, np.int32(num_seqs), np.int32(max_blocks),
                    np.int32(cache.block_size), np.int64(cache.num_slots), cache.k_digits, cache.k_exponents,
                    cache.v_digits, cache.v_exponents, out, NULL_POINTER if row_stats is None else row_stats),
                   shared_mem=shared)
    return out


def _output(backend: Backend, out, shape: tuple[int, int, int]):
    if out is None:
        return backend.empty(shape, np.float32)
    if shape_of(out) != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InputError(f"attention: out must be a C-contiguous float32 array of shape {list(shape)}, got "
                         f"{out.dtype} {list(shape_of(out))}")
    return out


def leading_single_rows(q_seq: np.ndarray) -> int:
    """How many leading query rows belong to sequences with exactly one row in the call: an engine
    step's decodes, which the scheduler puts before its prefill chunks."""
    q_seq = np.asarray(q_seq)
    if not q_seq.size:
        return 0
    _, inverse, counts = np.unique(q_seq, return_inverse=True, return_counts=True)
    repeated = np.flatnonzero(counts[inverse] != 1)
    return int(repeated[0]) if repeated.size else int(q_seq.size)


def step_parts(host_q_seq: np.ndarray) -> tuple[tuple[slice, int | None], ...]:
    """An engine step's query rows as attention_step runs them, each range with its number of
    sequences: the leading decodes (one row per sequence, leading_single_rows) and the prefill chunks
    after them; a step of one kind is one range (None: attention_paged's default count). Made once per
    step on the host, not per layer."""
    host_q_seq = np.asarray(host_q_seq)
    tq = int(host_q_seq.size)
    decodes = leading_single_rows(host_q_seq)
    if decodes in (0, tq):
        return ((slice(0, tq), None),)
    return (slice(0, decodes), decodes), (slice(decodes, tq), len(np.unique(host_q_seq[decodes:])))


def attention_step(backend: Backend, q, q_seq, q_pos, cache: KVCache, block_tables,
                   parts: tuple[tuple[slice, int | None], ...]):
    """attention_paged over an engine step's query rows, each kind by the kernels built for it: the
    ranges of step_parts (the leading decodes, then the prefill chunks) in separate calls, so that the
    decodes of a mixed step do not fall into the prefill kernel's 64-row tiles (the mma kernel serves
    the sequences of a tile one per round: 64 decode rows would cost 64 rounds). Each row's bits are
    those of one call over all rows (the contract's batch invariance; every method gives the same bits)."""
    if backend.runs_reference or len(parts) == 1:
        return attention_paged(backend, q, q_seq, q_pos, cache, block_tables)
    out = backend.empty(shape_of(q), np.float32)
    for rows, num_seqs in parts:
        attention_paged(backend, q[rows], q_seq[rows], q_pos[rows], cache, block_tables, num_seqs=num_seqs,
                        out=out[rows])
    return out


def _attention_paged_split(backend: Backend, q, q_seq, q_pos, cache: KVCache, block_tables, scale,
                           keys_per_split: int | None, out) -> None:
    """attention_paged by the split kernels (backends/portable/attention.hip: "Split-KV path"), in slices of
    query rows whose scores fit SPLIT_SCRATCH_BYTES (the slicing depends on the shapes only)."""
    tq, hq, _ = shape_of(q)
    capacity = shape_of(block_tables)[1] * cache.block_size
    splits, chunk = split_plan(tq, cache.num_kv_heads, capacity, keys_per_split)
    per_row = (hq * 4 + cache.num_kv_heads * 8) * splits * chunk  # scores and key_rows of one query row
    step = max(1, min(tq, SPLIT_SCRATCH_BYTES // per_row))
    for start in range(0, tq, step):
        stop = min(start + step, tq)
        _launch_split(backend, q[start:stop], q_seq[start:stop], q_pos[start:stop], cache, block_tables, scale,
                      keys_per_split, out[start:stop])


def _launch_split(backend: Backend, q, q_seq, q_pos, cache: KVCache, block_tables, scale,
                  keys_per_split: int | None, out) -> None:
    """The split kernels over these query rows: scores with each split's maxima, then the global
    maxima and each split's exact partial sums, then their exact sums and o (with one split, the value
    kernel's sums are whole and it writes o: no combine). The scratch arrays come from the backend's
    allocator (in a graph capture, the capture's pool)."""
    tq, hq, dim = shape_of(q)
    hkv, dp = cache.num_kv_heads, cache.head_dim_padded
    num_seqs, max_blocks = shape_of(block_tables)
    splits, chunk = split_plan(tq, hkv, max_blocks * cache.block_size, keys_per_split)
    group_rows, rows = tq * hkv, tq * hq
    scores = backend.empty((group_rows * splits * chunk * (hq // hkv),), np.float32)
    key_rows = backend.empty((group_rows * splits * chunk,), np.int64)
    split_keys = backend.empty((rows * splits,), np.uint32)
    split_info = backend.empty((group_rows * splits,), np.uint32)
    query_bad = backend.empty((rows,), np.uint32)
    # the splits' partial sums (one split: the value kernel writes o, and there is no combine)
    partials = splits > 1
    part_total = backend.empty((rows * splits if partials else 1,), np.int64)
    part_num = backend.empty((rows * splits * dim if partials else 1,), np.int64)
    sizes = (np.int64(tq), np.int32(hq), np.int32(hkv), np.int32(dim), np.int32(dp))
    table = (block_tables, np.int32(num_seqs), np.int32(max_blocks), np.int32(cache.block_size),
             np.int64(cache.num_slots))
    cut = (np.int32(splits), np.int32(chunk))
    grid, block = (min(group_rows * splits, GRID_LIMIT),), (SPLIT_THREADS,)
    backend.launch("attention", "attention_split_scores", grid, block,
                   (q, q_seq, q_pos) + sizes + (scale,) + table + (cache.k_digits, cache.k_exponents,
                                                                   cache.v_exponents) + cut +
                   (scores, key_rows, split_keys, split_info, query_bad))
    backend.launch("attention", split_values_kernel(hq // hkv), grid, block,
                   (q_seq, q_pos) + sizes + (np.int32(num_seqs), cache.v_digits) + cut +
                   (scores, key_rows, split_keys, split_info, query_bad, part_total, part_num, out),
                   shared_mem=split_values_shared_bytes(hq // hkv, dp))
    if partials:
        backend.launch("attention", "attention_split_combine", (min(rows, GRID_LIMIT),), block,
                       (np.int64(tq), np.int32(hq), np.int32(hkv), np.int32(dim), np.int32(splits), split_keys,
                        split_info, query_bad, part_total, part_num, out))


def _decode_rows(digits: np.ndarray, dim: int) -> np.ndarray:
    """Cache digits [L, Hkv, 2, Dp] -> the 15-bit integers [L, Hkv, D] (exact)."""
    return fp.join_digits(np.moveaxis(digits[..., :dim], 2, 0))


def _chunk_key_slots(block_tables: np.ndarray, seqs: np.ndarray, lengths: np.ndarray, cache: KVCache) -> np.ndarray:
    """[S, max length] slots of positions 0..lengths[s]-1 of sequences seqs (-1 beyond): _key_slots of
    every sequence at once; InputError (from _key_slots, naming the sequence) if a table lacks a block."""
    positions = np.arange(int(lengths.max()), dtype=np.int64)[None, :]
    used = positions < lengths[:, None]
    columns = positions // cache.block_size
    tables = block_tables[seqs]
    if tables.shape[1] == 0:
        _key_slots(tables[0], int(lengths[0]), cache.block_size, cache.num_slots, int(seqs[0]))  # raises
    blocks = tables[np.arange(seqs.size)[:, None], np.minimum(columns, tables.shape[1] - 1)].astype(np.int64)
    slots = blocks * cache.block_size + positions % cache.block_size
    bad = used & ((columns >= tables.shape[1]) | (blocks < 0) | (slots >= cache.num_slots))
    for row in np.nonzero(bad.any(axis=1))[0]:
        _key_slots(block_tables[seqs[row]], int(lengths[row]), cache.block_size, cache.num_slots, int(seqs[row]))
    return np.where(used, slots, -1)


def _attention_paged_reference(q: np.ndarray, q_seq: np.ndarray, q_pos: np.ndarray, cache: KVCache,
                               block_tables: np.ndarray) -> np.ndarray:
    """The reference's attention_encoded for every sequence of the call, batched over sequences
    (reference.attention_encoded_batched: the same bits as one sequence at a time)."""
    qq, eq = reference.encode_heads(q, Q_BITS)
    out = np.empty(q.shape, dtype=np.float32)
    seqs, inverse = np.unique(q_seq, return_inverse=True)
    order = np.argsort(inverse, kind="stable")  # each sequence's query rows, in row order
    counts = np.bincount(inverse, minlength=seqs.size)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    lengths = np.zeros(seqs.size, dtype=np.int64)
    np.maximum.at(lengths, inverse, q_pos.astype(np.int64) + 1)
    k_digits, v_digits = np.asarray(cache.k_digits), np.asarray(cache.v_digits)
    k_exponents, v_exponents = np.asarray(cache.k_exponents), np.asarray(cache.v_exponents)
    for chunk in reference.batch_chunks(counts, lengths, q.shape[1], cache.head_dim):
        index = reference.padded_rows(starts[chunk], counts[chunk])
        rows = np.where(index >= 0, order[np.maximum(index, 0)], -1)  # [S, Tq] query rows, -1 padding
        key_slots = _chunk_key_slots(block_tables, seqs[chunk], lengths[chunk], cache)
        keys = [reference.gather_rows(x, key_slots) for x in (k_digits, k_exponents, v_digits, v_exponents)]
        qk, qv = (_decode_rows(d.reshape((-1,) + d.shape[2:]), cache.head_dim).reshape(key_slots.shape + (
            cache.num_kv_heads, cache.head_dim)) for d in (keys[0], keys[2]))
        positions = reference.gather_rows(q_pos.astype(np.int64), rows, fill=-1)
        valid = rows >= 0
        result = reference.attention_encoded_batched(reference.gather_rows(qq, rows), reference.gather_rows(eq, rows),
                                                     qk, keys[1], qv, keys[3], positions)
        out[rows[valid]] = result[valid]
    return out


def _check_cu_seqlens(cu_seqlens, tokens: int, name: str = "attention_packed") -> np.ndarray:
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 1 or not np.issubdtype(cu.dtype, np.integer):
        raise InputError(f"{name}: cu_seqlens must be a 1-D integer array [num_seqs + 1], got "
                         f"{cu.dtype.name} of shape {cu.shape}")
    cu = cu.astype(np.int64)
    lengths = np.diff(cu)
    if cu[0] != 0 or cu[-1] != tokens or (lengths < 0).any():
        raise InputError(f"{name}: cu_seqlens must rise from 0 to the {tokens} packed tokens, got {cu.tolist()}")
    if lengths.size and lengths.max() > MAX_KEYS:
        raise InputError(f"{name}: a sequence of {lengths.max()} tokens exceeds the contract's limit {MAX_KEYS}")
    return cu


def _check_packed(name: str, q, k, v) -> tuple[int, int, int, int]:
    """(T, Hq, Hkv, D) of packed q [T, Hq, D], k, v [T, Hkv, D] float32; InputError naming `name` otherwise."""
    tokens, hq, dim = _require("q", q, 3, np.float32)
    kshape = _require("k", k, 3, np.float32)
    if kshape[0] != tokens or kshape[2] != dim:
        raise InputError(f"{name}: k must have shape [T={tokens}, Hkv, D={dim}], got {kshape}")
    if _require("v", v, 3, np.float32) != kshape:
        raise InputError(f"{name}: v must have the shape of k {kshape}, got {shape_of(v)}")
    hkv = kshape[1]
    if hkv < 1 or hq % hkv:
        raise InputError(f"{name}: q's {hq} heads are not a multiple of k's {hkv} kv heads")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise InputError(f"{name}: head_dim {dim} outside the contract's [1, {MAX_HEAD_DIM}]")
    return tokens, hq, hkv, dim


def packed_layout(cu_seqlens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q_seq, q_pos, block_tables) of packed sequences in contiguous slots, block size 1."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    lengths = np.diff(cu)
    tokens = int(cu[-1])
    q_seq = np.repeat(np.arange(lengths.size), lengths).astype(np.int32)
    q_pos = (np.arange(tokens) - cu[:-1][q_seq]).astype(np.int32)
    width = max(int(lengths.max()) if lengths.size else 0, 1)
    tables = (cu[:-1, None] + np.arange(width)[None, :]).astype(np.int32)
    return q_seq, q_pos, tables


def attention_packed(backend: Backend, q, k, v, cu_seqlens, threads: int = THREADS, method: str = "auto",
                     keep_stats: bool = False):
    """Packed variable-length causal prefill: q [T, Hq, D], k, v [T, Hkv, D] float32; sequence i
    holds tokens cu_seqlens[i]..cu_seqlens[i+1]-1 at positions 0, 1, ... Returns o [T, Hq, D].

    keep_stats: return (o, row_stats) instead, row_stats the rows' m and L as attention_paged writes
    them (for attention_packed_backward, which then skips its own statistics pass), or None where the
    kernel taken does not write them (the split kernels, and the NumPy reference on cpu: the backward
    computes them)."""
    tokens, hq, hkv, dim = _check_packed("attention_packed", q, k, v)
    cu = _check_cu_seqlens(backend.to_numpy(cu_seqlens) if not isinstance(cu_seqlens, (list, tuple)) else cu_seqlens,
                           tokens)
    if backend.runs_reference:
        o = reference.attention_packed_batched(backend.to_numpy(q), backend.to_numpy(k), backend.to_numpy(v), cu)
        return (o, None) if keep_stats else o
    if tokens == 0:
        o = backend.empty((0, hq, dim), np.float32)
        return (o, None) if keep_stats else o
    cache = KVCache.allocate(backend, tokens, hkv, dim, block_size=1, zero=False)
    write_kv(backend, cache, k, v, np.arange(tokens, dtype=np.int32))
    q_seq, q_pos, tables = packed_layout(cu)
    row_stats = None
    if keep_stats and resolve_method(backend, tokens, cu.size - 1, dim, method) != "split":
        row_stats = backend.empty((tokens * hq, 3), np.float64)
    o = attention_paged(backend, q, q_seq, q_pos, cache, tables, threads=threads, method=method, row_stats=row_stats)
    return (o, row_stats) if keep_stats else o


# ---- backward (contracts/attention.toml, op "attention_backward")
#
# Three variants, the same bits (method "rows", "tiled" or "mma"; "auto" takes "mma" on an AMD GPU with
# MFMA kernels, else "tiled" where it exists):
# "rows", three portable kernels, none of them holding a [T, T] matrix:
#   attention_backward_rows  one block per (token, q head): encodes the q and do rows (23 bits, int32
#                            rows in q_int / do_int), m and L of the forward (two passes over the keys),
#                            delta = do . o (exact), the poisoned flag: row_info [rows, 3] int32
#                            (eq, edo, poisoned), row_stats [rows, 3] float64 (m, L, delta);
#   attention_backward_dq    one block per (token, q head): dq over keys j <= t (P and dS recomputed);
#   attention_backward_dkv   one block per (key token, kv head): dk and dv over t >= j and the group's heads.
# "tiled", GPU sources, padded head_dim <= 256: tiles of query rows x keys in shared memory (on CUDA the
# products on the tensor cores: attention.cu "Tiled backward"): _rows and _keys (the encoded rows as
# int32, padded to the kernels' head_dim), _stats (m, L, poisoned; left out when the forward gave m and
# L), _dq (per query tile, key blocks ascending) and _dkv (per key tile, query blocks ascending, the
# group's heads in order within each block).
# "mma", AMD's gfx942 and gfx90a (and HIP-CPU, emulated), padded head_dim <= 128: "tiled" with dq and dkv
# on MFMA (backends/hip/attention.hip), the portable _rows, _keys and _stats around them.

BACKWARD_THREADS = 256
BACKWARD_METHODS = ("auto", "rows", "tiled", "mma")
TILED_THREADS = 256  # the tiled kernels' block size (their tiling assumes it)
TILED_ROWS_THREADS = 256  # attention_backward_tiled_rows: one 32-lane segment per row
TILED_HEAD_DIMS = (64, 128, 256)  # the padded head_dim each tiled kernel is built for
#: keys of a dkv tile of the MFMA backward (RLP_ATTF_DKV_KEYS): q and do transposed fill most of the LDS
MFMA_BACKWARD_KEYS = 32
#: shared memory per workgroup the portable (hip) tiled kernels stay within: MI300X's LDS
PORTABLE_SHARED_LIMIT = 64 * 1024


def backward_methods(backend: Backend, head_dim: int) -> tuple[str, ...]:
    """The backward variants this backend runs for this head_dim (cpu: the reference, "rows"). "mma": the
    tiled method with dq and dkv on AMD's MFMA (backends/hip/attention.hip), where the backend has them
    ("auto" takes it on an AMD GPU; on HIP-CPU, which emulates MFMA, it runs when asked); "tiled" there
    is the portable tiled kernels. CUDA's "tiled" is its tensor-core kernels already."""
    if backend.runs_reference or round_up(head_dim, K_ALIGN) > TILED_HEAD_DIMS[-1]:
        return ("rows",)
    if mfma_arch(backend) is not None and round_up(head_dim, K_ALIGN) <= MFMA_MAX_HEAD_DIM_PADDED:
        return ("rows", "tiled", "mma")
    return ("rows", "tiled")


def tiled_head_dim(head_dim: int) -> int:
    """The padded head_dim of the tiled kernels that serve head_dim (64, 128 or 256)."""
    return next(dp for dp in TILED_HEAD_DIMS if dp >= head_dim)


def tiled_tiles(dpt: int, vendor: str = "cuda") -> dict[str, int]:
    """The tiled kernels' tile sizes: query rows and keys per step of the per-query-tile kernels, key
    rows and query rows per step of dkv. cuda: RlpAttd (stats, FP64 mma) and RlpAtt8 (dq and dkv, int8
    mma, a step of one coefficient block) in backends/cuda/attention.cu, up to 227 KiB of shared
    memory; hip: RlpAttp in backends/portable/attention.hip
    (within PORTABLE_SHARED_LIMIT); mfma: the MFMA dq and dkv of backends/hip/attention.hip."""
    if vendor == "cuda":
        return {"bq": 64 if dpt <= 128 else 32, "bk": 64 if dpt <= 128 else 32, "bkv": 4096 // dpt,
                "bq2": reference.BLOCK}
    if vendor == "mfma":  # backends/hip/attention.hip's dq and dkv: 4 wavefronts, static LDS
        return {"bq": 64, "bk": reference.BLOCK, "bkv": MFMA_BACKWARD_KEYS, "bq2": reference.BLOCK}
    b = 2048 // dpt  # bkv divides 64: a key tile lies in one block of 64 positions
    return {"bq": b, "bk": 16, "bkv": b, "bq2": 8 if dpt == 64 else 16}


def tiled_threads(dpt: int, step: str, vendor: str = "cuda") -> int:
    """The block size of a tiled kernel step ("stats", "dq", "dkv"): RlpAtt8::THREADS for CUDA's int8 dq
    and dkv (16 warps where the tiles have work for them), else TILED_THREADS."""
    if vendor == "cuda" and step in ("dq", "dkv") and dpt <= 128:
        return 2 * TILED_THREADS
    return TILED_THREADS


def _struct_bytes(fields: list[tuple[str, Any, int]]) -> int:
    """sizeof a C struct of arrays (name, ctypes type, length), by ctypes' C layout rules."""
    return ctypes.sizeof(type("_S", (ctypes.Structure,), {"_fields_": [(n, t * k) for n, t, k in fields]}))


def _portable_parts(rows: int, cols: int) -> int:
    """RlpAttpDots<rows, cols>::PARTS: the partial sums of a tile of dot products."""
    groups = TILED_THREADS // cols
    per_slice = min(groups, rows)
    return (groups // per_slice) * rows * cols


def tiled_shared_bytes(dpt: int, vendor: str = "cuda") -> dict[str, int]:
    """Dynamic shared memory of each tiled kernel. cuda: the layouts in cuda/attention.cu plus slack for
    the scalars' struct padding; hip: portable/attention.hip's layouts, exactly."""
    t = tiled_tiles(dpt, vendor)
    i32, u32, f32, f64, u64 = ctypes.c_int32, ctypes.c_uint32, ctypes.c_float, ctypes.c_double, ctypes.c_uint64
    if vendor == "cuda":
        bq, bk, bkv, block, ld = t["bq"], t["bk"], t["bkv"], t["bq2"], dpt + 4
        stats = _struct_bytes([("eq", i32, bq), ("edo", i32, bq), ("bad", i32, bq), ("m", f32, bq), ("total", f64, bq),
                               ("delta", f64, bq), ("ek", i32, bk), ("ev", i32, bk), ("key", u32, bq),
                               ("flag", u32, bq), ("field", u32, bq), ("sum", u64, bq)])  # RlpAttdRows
        query = [("total", f64), ("delta", f64), ("m", f32), ("eq", i32), ("edo", i32), ("bad", i32)]
        rows8 = _struct_bytes([(n, c, bq) for n, c in query] + [("ek", i32, block), ("ev", i32, block),
                                                                  ("field", u32, bq)])  # RlpAtt8Rows
        keys8 = _struct_bytes([(n, c, block) for n, c in query] + [(n, c, bkv) for n, c in (
            ("ek", i32), ("ev", i32), ("field_k", u32), ("field_v", u32), ("bad_key", u32))])  # RlpAtt8Keys
        # int8 digit tiles: q, do 3 digits; k, v, k transposed 2; coefficients 2 (dkv: q, do also transposed)
        return {"stats": 8 * (bq + bk) * ld + stats,
                "dq": 6 * bq * dpt + 6 * block * dpt + 2 * bq * block + rows8,
                "dkv": 12 * block * dpt + 4 * bkv * dpt + 4 * bkv * block + keys8}
    bq, bk, bkv, bq2, ld, block = t["bq"], t["bk"], t["bkv"], t["bq2"], dpt + 1, reference.BLOCK
    rows = _struct_bytes([("eq", i32, bq), ("edo", i32, bq), ("bad", i32, bq), ("m", f32, bq), ("total", f64, bq),
                          ("delta", f64, bq), ("ek", i32, bk), ("ev", i32, bk), ("key", u32, bq), ("flag", u32, bq),
                          ("field", u32, bq), ("sum", u64, bq)])  # RlpAtttRows
    keys = _struct_bytes([("r_eq", i32, bq2), ("r_edo", i32, bq2), ("r_bad", i32, bq2), ("r_m", f32, bq2),
                          ("r_total", f64, bq2), ("r_delta", f64, bq2), ("c_ek", i32, bkv), ("c_ev", i32, bkv),
                          ("c_fk", u32, bkv), ("c_fv", u32, bkv), ("c_bad", u32, bkv)])  # RlpAtttKeys
    words = lambda ints: 8 * (-(-ints // 2))  # int32 arrays rounded up to whole 8-byte words
    query_parts, key_parts = _portable_parts(bq, bk), _portable_parts(bkv, bq2)
    # partial sums of the dot products (S, dP), coefficient tiles of one block ([rows][64] float64),
    # int32 operand rows, scalars
    return {"stats": 8 * query_parts + words((bq + bk) * ld) + rows,
            "dq": 8 * (2 * query_parts + bq * block) + words(2 * (bq + bk) * ld) + rows,
            "dkv": 8 * (2 * key_parts + 2 * bkv * block) + words(2 * (bkv + bq2) * ld) + keys}


def hip_dynamic_lds() -> dict[str, int]:
    """The dynamic shared memory this family's kernels take at most on hip, over every head_dim and group
    the op allows (build/amd_resources.py)."""
    dims = range(K_ALIGN, MAX_HEAD_DIM + 1, K_ALIGN)  # padded head_dim
    sizes = {"attention_split_values": max(split_values_shared_bytes(reference.MAX_GROUP, dp) for dp in dims),
             "attention_split_values_h2": max(split_values_shared_bytes(2, dp) for dp in dims)}
    for dpt in TILED_HEAD_DIMS:
        shared = tiled_shared_bytes(dpt, "hip")
        for step in ("stats", "dq", "dkv"):
            sizes[f"attention_backward_tiled_{step}_d{dpt}"] = shared[step]
    return sizes


def _tiles(cu: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first token) of every tile of `size` rows, each sequence tiled from its start."""
    lengths = np.diff(cu)
    counts = -(-lengths // size)
    seqs = np.repeat(np.arange(lengths.size, dtype=np.int64), counts)
    first = np.arange(seqs.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return seqs, cu[:-1][seqs] + first * size


class _DevicePlan(NamedTuple):
    """tiled_plan's lists on the device, with their counts; blocks: every sequence's blocks of
    reference.BLOCK positions in sequence order (int32 [n_blocks, 2]: sequence, first token) and
    block_first (int32 [num_seqs]: the index of each sequence's first block), for the CUDA digit tiles."""
    q_tiles: Any
    key_tiles: Any
    cu: Any
    n_tiles: int
    n_key_tiles: int
    blocks: Any
    block_first: Any
    n_blocks: int


_PLANS: dict[tuple, _DevicePlan] = {}  # the last few packings: a model's layers share one cu_seqlens


def _device_plan(backend: Backend, cu: np.ndarray, dpt: int, kind: str | None = None) -> _DevicePlan:
    """tiled_plan for the backend's kernels (kind: "mfma" for the MFMA dq and dkv, else its vendor's)."""
    kind = kind or backend.kernel_vendor
    key = (id(backend), kind, cu.tobytes(), dpt)
    if key not in _PLANS:
        q_tiles, key_tiles = tiled_plan(cu, dpt, kind)
        blocks = np.stack(_tiles(cu, reference.BLOCK), axis=1).astype(np.int32)
        block_first = np.searchsorted(blocks[:, 0], np.arange(cu.size - 1)).astype(np.int32)
        if len(_PLANS) >= 8:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = _DevicePlan(backend.asarray(q_tiles), backend.asarray(key_tiles),
                                  backend.asarray(cu.astype(np.int64)), q_tiles.shape[0], key_tiles.shape[0],
                                  backend.asarray(blocks), backend.asarray(block_first), blocks.shape[0])
    return _PLANS[key]


def tiled_plan(cu: np.ndarray, dpt: int, vendor: str = "cuda") -> tuple[np.ndarray, np.ndarray]:
    """The tiled kernels' launch lists, int32 [n, 2] (sequence, first token) each: q_tiles for the
    per-query-tile kernels (tiles of bq rows, the longest first), key_tiles for dkv (tiles of bkv keys);
    each sequence tiled from its start, with the tiles of `vendor`'s kernels (tiled_tiles)."""
    t = tiled_tiles(dpt, vendor)
    seqs, first = _tiles(cu, t["bq"])
    longest = np.argsort(cu[seqs] - first, kind="stable")  # the most keys first: the last wave is short
    q_tiles = np.stack([seqs[longest], first[longest]], axis=1).astype(np.int32)
    key_tiles = np.stack(_tiles(cu, t["bkv"]), axis=1).astype(np.int32)  # the most queries first already
    return q_tiles, key_tiles


def _check_backward_extra(name: str, array, shape: tuple[int, ...]) -> None:
    if _require(name, array, 3, np.float32) != shape:
        raise InputError(f"attention_packed_backward: {name} must have the shape of q {shape}, got {shape_of(array)}")


def _check_row_stats(name: str, array, rows: int) -> None:
    if _require("row_stats", array, 2, np.float64) != (rows, 3):
        raise InputError(f"{name}: row_stats must have the shape ({rows}, 3) (query rows x heads, m L delta), "
                         f"got {shape_of(array)}")


def attention_packed_backward(backend: Backend, q, k, v, do, cu_seqlens, o=None, threads: int = BACKWARD_THREADS,
                              method: str = "auto", row_stats=None):
    """Gradients of attention_packed(q, k, v, cu_seqlens) for the incoming gradient do [T, Hq, D]:
    (dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D]) float32, under the contract's "attention_backward".

    o: the forward's output attention_packed(q, k, v, cu_seqlens) if the caller kept it (the contract's
    delta = do . o reads it; passing it saves one forward), else None and it is recomputed here.
    threads: the rows kernels' block size (any value in [1, MAX_THREADS] gives the same bits).
    method: "auto", "rows", "tiled" or "mma" (BACKWARD_METHODS; the same bits). row_stats: the statistics attention_packed(q, k, v, cu_seqlens, keep_stats=True)
    returned beside o (with o, or None): the tiled kernels then skip their statistics pass (the same
    bits) and write delta into its third column; the other methods compute their own."""
    name = "attention_packed_backward"
    tokens, hq, hkv, dim = _check_packed(name, q, k, v)
    _check_backward_extra("do", do, (tokens, hq, dim))
    if o is not None:
        _check_backward_extra("o", o, (tokens, hq, dim))
    if row_stats is not None:
        if o is None:
            raise InputError(f"{name}: row_stats come from the forward that gave o; pass o with them")
        _check_row_stats(name, row_stats, tokens * hq)
    if hq // hkv > reference.MAX_GROUP:
        raise InputError(f"{name}: {hq} q heads over {hkv} kv heads exceed the contract's group limit "
                         f"{reference.MAX_GROUP}")
    if not isinstance(threads, (int, np.integer)) or not 1 <= int(threads) <= MAX_THREADS:
        raise InputError(f"{name}: threads must be an integer in [1, {MAX_THREADS}], got {threads!r}")
    if method not in BACKWARD_METHODS:
        raise InputError(f"{name}: method must be one of {BACKWARD_METHODS}, got {method!r}")
    available = backward_methods(backend, dim)
    if method == "tiled" and "tiled" not in available:
        raise InputError(f"{name}: the tiled kernels exist for GPU kernel sources, padded head_dim <= "
                         f"{TILED_HEAD_DIMS[-1]}; got {backend.label} with head_dim {dim}")
    if method == "mma" and "mma" not in available:
        raise InputError(f"{name}: the mma backward (dq and dkv on MFMA) exists for AMD's {', '.join(MFMA_ARCHS)}, "
                         f"padded head_dim <= {MFMA_MAX_HEAD_DIM_PADDED}; got {backend.label} with head_dim {dim}")
    if method == "auto":
        mma = "mma" in available and not backend.on_host
        method = "mma" if mma else ("tiled" if "tiled" in available else "rows")
    cu = _check_cu_seqlens(backend.to_numpy(cu_seqlens) if not isinstance(cu_seqlens, (list, tuple)) else cu_seqlens,
                           tokens, name)
    if backend.runs_reference:
        return reference.attention_packed_backward_batched(*(backend.to_numpy(x) for x in (q, k, v, do)), cu,
                                                           None if o is None else backend.to_numpy(o))
    dq = backend.empty((tokens, hq, dim), np.float32)
    dk = backend.empty((tokens, hkv, dim), np.float32)
    dv = backend.empty((tokens, hkv, dim), np.float32)
    if tokens == 0:
        return dq, dk, dv
    if o is None:
        o = attention_packed(backend, q, k, v, cu)
    cache = KVCache.allocate(backend, tokens, hkv, dim, block_size=1, zero=False)
    write_kv(backend, cache, k, v, np.arange(tokens, dtype=np.int32))
    scale = np.float64(1.0 / np.sqrt(np.float64(dim)))  # the forward's float64 1/sqrt(D)
    if method in ("tiled", "mma"):
        _backward_tiled(backend, q, do, o, cu, cache, scale, dq, dk, dv, row_stats,
                        mfma_arch(backend) if method == "mma" else None)
        return dq, dk, dv
    rows = tokens * hq
    q_int, do_int = backend.empty((rows, dim), np.int32), backend.empty((rows, dim), np.int32)
    row_info, row_stats = backend.empty((rows, 3), np.int32), backend.empty((rows, 3), np.float64)
    token_seq = backend.asarray(np.repeat(np.arange(cu.size - 1), np.diff(cu)).astype(np.int32))
    device_cu = backend.asarray(cu)
    shape_args = (token_seq, device_cu, np.int64(tokens), np.int32(hq), np.int32(hkv), np.int32(dim),
                  np.int32(cache.head_dim_padded), scale)
    block = (int(threads),)
    backend.launch("attention", "attention_backward_rows", (min(rows, GRID_LIMIT),), block,
                   (q, do, o) + shape_args + (cache.k_digits, cache.k_exponents, cache.v_exponents, q_int, do_int,
                                              row_info, row_stats))
    encoded = (q_int, do_int, row_info, row_stats) + shape_args + (cache.k_digits, cache.k_exponents,
                                                                   cache.v_digits, cache.v_exponents)
    backend.launch("attention", "attention_backward_dq", (min(rows, GRID_LIMIT),), block, encoded + (dq,))
    backend.launch("attention", "attention_backward_dkv", (min(tokens * hkv, GRID_LIMIT),), block,
                   encoded + (dk, dv))
    return dq, dk, dv


def _backward_tiled(backend: Backend, q, do, o, cu: np.ndarray, cache, scale, dq, dk, dv, row_stats=None,
                    mfma: str | None = None) -> None:
    """The tiled kernels' launches (method "tiled"), writing dq, dk, dv; row_stats: the forward's m and L
    (the statistics step is then left out), else None; mfma: the AMD target whose MFMA dq and dkv run
    (the portable statistics step stays), else None."""
    tokens, hq, dim = q.shape
    hkv, dp = cache.num_kv_heads, cache.head_dim_padded
    dpt = tiled_head_dim(dp)
    rows, key_rows = tokens * hq, tokens * hkv
    plan = _device_plan(backend, cu, dpt)
    q_int, do_int = backend.empty((rows, dpt), np.int32), backend.empty((rows, dpt), np.int32)
    k_int, v_int = backend.empty((key_rows, dpt), np.int32), backend.empty((key_rows, dpt), np.int32)
    row_info = backend.empty((rows, 3), np.int32)
    steps_run = ("dq",) if row_stats is not None else ("stats", "dq")
    row_stats = backend.empty((rows, 3), np.float64) if row_stats is None else row_stats
    backend.launch("attention", "attention_backward_tiled_keys", (min(-(-key_rows * dpt // 256), GRID_LIMIT),),
                   (256,), (cache.k_digits, cache.v_digits, np.int64(key_rows), np.int32(dp), np.int32(dpt),
                            k_int, v_int))
    backend.launch("attention", "attention_backward_tiled_rows",
                   (min(-(-rows // (TILED_ROWS_THREADS // 32)), GRID_LIMIT),), (TILED_ROWS_THREADS,),
                   (q, do, o, np.int64(rows), np.int32(dim), np.int32(dpt), q_int, do_int, row_info, row_stats))
    shared = tiled_shared_bytes(dpt, backend.kernel_vendor)
    operands = (np.int32(hq), np.int32(hkv), np.int32(dim), scale, q_int, do_int, k_int, v_int, cache.k_exponents,
                cache.v_exponents, row_info, row_stats)
    vendor = backend.kernel_vendor
    steps = "attention_backward_mma" if vendor == "cuda" else "attention_backward_tiled"
    if "stats" in steps_run:
        backend.launch("attention", f"{steps}_stats_d{dpt}", (plan.n_tiles, hq), (tiled_threads(dpt, "stats", vendor),),
                       (plan.q_tiles, plan.cu) + operands + (dq,), shared_mem=shared["stats"])
    kernels = {step: f"{steps}_{step}_d{dpt}" for step in ("dq", "dkv")}
    if mfma is not None:  # AMD's MFMA dq and dkv: tiles of their own, static LDS, TILED_THREADS
        plan = _device_plan(backend, cu, dpt, "mfma")
        kernels = {step: f"attention_backward_mfma_{step}_d{dpt}_{mfma}" for step in ("dq", "dkv")}
        vendor, shared = "mfma", {"dq": 0, "dkv": 0}
    # CUDA's int8 dq and dkv copy the operands' digit tiles at each step
    tiles = _digit_tiles(backend, plan, hq, hkv, dpt, q_int, do_int, k_int, v_int) if vendor == "cuda" else ()
    backend.launch("attention", kernels["dq"], (plan.n_tiles, hq), (tiled_threads(dpt, "dq", vendor),),
                   (plan.q_tiles, plan.cu) + operands + (dq,) + tiles, shared_mem=shared["dq"])
    backend.launch("attention", kernels["dkv"], (plan.n_key_tiles, hkv), (tiled_threads(dpt, "dkv", vendor),),
                   (plan.key_tiles, plan.cu) + operands + (dk, dv) + tiles, shared_mem=shared["dkv"])


def _digit_tiles(backend: Backend, plan: _DevicePlan, hq: int, hkv: int, dpt: int, q_int, do_int, k_int,
                 v_int) -> tuple:
    """(block_first, q, do, k, v digit tiles): every block of reference.BLOCK positions and head of the
    int32 rows as int8 digit planes (3 digits for q and do, 2 for k and v), in the layout the CUDA dq and
    dkv hold in shared memory (attention_backward_mma_digits), written once instead of at every step."""
    tiles = []
    for rows, heads, digits in ((q_int, hq, 3), (do_int, hq, 3), (k_int, hkv, 2), (v_int, hkv, 2)):
        out = backend.empty((plan.n_blocks * heads * digits * dpt * reference.BLOCK,), np.int8)
        backend.launch("attention", "attention_backward_mma_digits", (plan.n_blocks, heads), (256,),
                       (plan.blocks, plan.cu, np.int32(heads), np.int32(dpt), np.int32(digits), rows, out))
        tiles.append(out)
    return (plan.block_first,) + tuple(tiles)
