"""Embedding lookup: reference of contracts/embedding.toml.

  out[t, :] = table[ids[t], :]      for a float32 table [V, H] and int32 ids [T]

a bit copy (NaN payloads, -0 and subnormals kept). Every id must lie in [0, V);
the op checks that on the host before any launch (an id out of range is an error,
never a wrap-around or a clamp).
"""

from __future__ import annotations

import numpy as np


def gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float32 [V, H], int [T] -> float32 [T, H], the rows' raw bits."""
    table = np.asarray(table, dtype=np.float32)
    ids = np.asarray(ids).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= table.shape[0]):
        raise ValueError(f"embedding ids must lie in [0, {table.shape[0]})")
    return table.view(np.uint32)[ids].view(np.float32)
