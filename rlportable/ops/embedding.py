"""Op family "embedding": token embedding lookup, a bit copy of table rows, and its gradient.

Contract: contracts/embedding.toml; reference: rlportable/contract/embedding.py gather, gather_shard, gather_backward;
kernels: backends/portable/embedding.hip.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import embedding as reference
from rlportable.errors import InputError
from rlportable.ops.checks import require_contiguous, require_matrix, shape_of

THREADS = 256
MAX_GRID = 4096


def gather(backend, table, ids, host_ids=None):
    """out [T, H] float32 = table [V, H] float32 rows at ids [T] int32; ids outside [0, V) are an InputError.

    host_ids: the same ids as a NumPy array, when the caller has them (checked without a copy back)."""
    vocab, hidden = require_matrix("table", table)
    if len(shape_of(ids)) != 1 or np.dtype(ids.dtype) != np.int32:
        raise InputError(f"embedding: ids must be a 1-D int32 array, got {np.dtype(ids.dtype).name} of shape {shape_of(ids)}")
    tokens = shape_of(ids)[0]
    host_ids = np.asarray(backend.to_numpy(ids) if host_ids is None else host_ids)
    bad = (host_ids < 0) | (host_ids >= vocab)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise InputError(f"embedding: ids[{index}] = {int(host_ids[index])} is outside the table's [0, {vocab})")
    if backend.runs_reference:
        return reference.gather(backend.to_numpy(table), host_ids)
    out = backend.empty((tokens, hidden), np.float32)
    n = tokens * hidden
    if n:
        backend.launch("embedding", "embedding_gather", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (table, ids, np.int64(tokens), np.int32(hidden), out))
    return out


def gather_shard(backend, table_shard, ids, vocab_start, host_ids=None):
    """out [T, H] float32: the vocabulary-parallel gather on the rank holding table rows [start, start + Vr).

    table_shard [Vr, H] float32 (Vr >= 1) holds the global rows vocab_start .. vocab_start + Vr - 1; ids [T]
    int32 are global ids (>= 0; the whole vocabulary is not known here). out[t] = table_shard[ids[t] - start]
    bit for bit when this rank owns ids[t], else +0 bits, so the uint32 sum (one owner per id) of every
    rank's output is gather(table, ids). host_ids: the same ids as a NumPy array, when the caller has them."""
    rows, hidden = require_matrix("table_shard", table_shard)
    if rows < 1:
        raise InputError(f"embedding gather_shard: table_shard must hold at least one row, got shape {(rows, hidden)}")
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, (int, np.integer)) \
            or not 0 <= vocab_start <= 2**31 - rows:
        raise InputError(f"embedding gather_shard: vocab_start must be an integer in [0, 2^31 - {rows}] "
                         f"(the shard's ids must be int32), got {vocab_start!r}")
    vocab_start = int(vocab_start)
    if len(shape_of(ids)) != 1 or np.dtype(ids.dtype) != np.int32:
        raise InputError(f"embedding gather_shard: ids must be a 1-D int32 array, got {np.dtype(ids.dtype).name} "
                         f"of shape {shape_of(ids)}")
    require_contiguous("ids", ids)
    tokens = shape_of(ids)[0]
    host_ids = np.asarray(backend.to_numpy(ids) if host_ids is None else host_ids)
    bad = host_ids < 0
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise InputError(f"embedding gather_shard: ids[{index}] = {int(host_ids[index])} is negative")
    if backend.runs_reference:
        return reference.gather_shard(backend.to_numpy(table_shard), host_ids, vocab_start)
    out = backend.empty((tokens, hidden), np.float32)
    n = tokens * hidden
    if n:
        backend.launch("embedding", "embedding_gather_shard", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (table_shard, ids, np.int64(tokens), np.int32(hidden), np.int32(vocab_start), np.int32(rows),
                        out))
    return out


def gather_backward(backend, ids, host_ids, dy, vocab: int):
    """dtable [vocab, H] float32: row v is the sum of dy [T, H] float32 over the tokens t with ids[t] == v.

    The sum is float64 in increasing token index, rounded once (contracts/embedding.toml), so it is
    deterministic and vendor-free; rows with no tokens are +0. ids: the device ids [T] int32 (checked
    for shape and dtype); host_ids: the same ids as a NumPy array (None: copied back from ids), from
    which the host builds each row's token list for the kernel."""
    tokens, hidden = require_matrix("dy", dy)
    if isinstance(vocab, bool) or not isinstance(vocab, (int, np.integer)) or not 1 <= vocab < 2**31:
        raise InputError(f"embedding gather_backward: vocab must be an integer in [1, 2^31), got {vocab!r}")
    vocab = int(vocab)
    if shape_of(ids) != (tokens,) or np.dtype(ids.dtype) != np.int32:
        raise InputError(f"embedding gather_backward: ids must be int32 of shape ({tokens},) (dy's rows), got "
                         f"{np.dtype(ids.dtype).name} of shape {shape_of(ids)}")
    host_ids = np.asarray(backend.to_numpy(ids) if host_ids is None else host_ids)
    if host_ids.shape != (tokens,) or host_ids.dtype.kind not in "iu":
        raise InputError(f"embedding gather_backward: host_ids must be integers of shape ({tokens},), got "
                         f"{host_ids.dtype.name} of shape {host_ids.shape}")
    bad = (host_ids < 0) | (host_ids >= vocab)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        raise InputError(f"embedding gather_backward: ids[{index}] = {int(host_ids[index])} "
                         f"is outside the table's [0, {vocab})")
    if backend.runs_reference:
        return reference.gather_backward(host_ids, backend.to_numpy(dy), vocab)
    offsets, order = reference.token_lists(host_ids, vocab)
    dtable = backend.empty((vocab, hidden), np.float32)
    n = vocab * hidden
    if n:
        order_dev = backend.asarray(order) if tokens else backend.zeros((1,), np.int32)
        backend.launch("embedding", "embedding_gather_backward", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (dy, backend.asarray(offsets), order_dev, np.int32(vocab), np.int32(hidden), dtable))
    return dtable


#: the name the model code uses for the lookup (also a plain row gather of any float32 matrix)
embed = gather
