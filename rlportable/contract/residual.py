"""NumPy reference of the residual family (contracts/residual.toml): float32 adds with the canonical NaN,
and bit copies (transpose, row copies) that keep NaN payloads and signed zeros."""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp


def _canonical(y: np.ndarray) -> np.ndarray:
    y[np.isnan(y)] = fp.CANONICAL_NAN
    return y


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return _canonical((a.astype(np.float32) + b.astype(np.float32)).astype(np.float32))


def add_bias(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return _canonical((x.astype(np.float32) + b.astype(np.float32)[None, :]).astype(np.float32))


def transpose(x: np.ndarray) -> np.ndarray:
    """Contiguous x.T, a bit copy: moved as uint32, so NaN payloads and signed zeros are kept."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).view(np.uint32).T).view(np.float32)


def copy_rows(a: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """In place: a[dst[i]] = a[src[i]]."""
    a[dst] = a[src]
