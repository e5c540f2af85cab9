"""Op family "embedding": token embedding lookup, a bit copy of table rows.

Contract: contracts/embedding.toml; reference: rlportable/contract/embedding.py gather;
kernels: backends/{cuda,hip}/embedding.*.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import embedding as reference
from rlportable.errors import InputError
from rlportable.ops.checks import require_matrix, shape_of

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
    if backend.kernel_vendor is None:
        return reference.gather(backend.to_numpy(table), host_ids)
    out = backend.empty((tokens, hidden), np.float32)
    n = tokens * hidden
    if n:
        backend.launch("embedding", "embedding_gather", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (table, ids, np.int64(tokens), np.int32(hidden), out))
    return out


#: the name the model code uses for the lookup (also a plain row gather of any float32 matrix)
embed = gather
