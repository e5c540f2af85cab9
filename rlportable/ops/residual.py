"""Op family "residual": float32 additions for residual streams and biases, and the matrix
transpose the backward needs (W^T, X^T as rows for the exact GEMM) (contracts/residual.toml).

Our own kernels, not CuPy's `+`: CuPy compiles its elementwise kernels with
flush-to-zero, and NaN payloads differ between vendors.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.checks import require_matrix, shape_of

THREADS = 256


def _canonical(y: np.ndarray) -> np.ndarray:
    y[np.isnan(y)] = fp.CANONICAL_NAN
    return y


def add_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return _canonical((a.astype(np.float32) + b.astype(np.float32)).astype(np.float32))


def add_bias_reference(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return _canonical((x.astype(np.float32) + b.astype(np.float32)[None, :]).astype(np.float32))


def _grid(n: int) -> tuple[int]:
    return (max(1, min(-(-n // THREADS), 65535)),)


def add(backend, a, b):
    if shape_of(a) != shape_of(b) or np.dtype(a.dtype) != np.float32 or np.dtype(b.dtype) != np.float32:
        raise InputError(f"add: a {shape_of(a)} {a.dtype} and b {shape_of(b)} {b.dtype} must be float32 of one shape")
    if backend.kernel_vendor is None:
        return add_reference(backend.to_numpy(a), backend.to_numpy(b))
    y = backend.empty(shape_of(a), np.float32)
    n = int(np.prod(shape_of(a), dtype=np.int64))
    if n:
        backend.launch("residual", "residual_add_f32", _grid(n), (THREADS,), (a, b, y, np.int64(n)))
    return y


def add_bias(backend, x, b):
    rows, n = shape_of(x)
    if shape_of(b) != (n,):
        raise InputError(f"add_bias: bias has shape {shape_of(b)}, expected ({n},) for x of shape {(rows, n)}")
    if backend.kernel_vendor is None:
        return add_bias_reference(backend.to_numpy(x), backend.to_numpy(b))
    y = backend.empty((rows, n), np.float32)
    if rows * n:
        backend.launch("residual", "residual_add_bias_f32", _grid(rows * n), (THREADS,),
                       (x, b, y, np.int64(rows), np.int64(n)))
    return y


TRANSPOSE_TILE = 32  # the kernel's square tile (RLP_TRANSPOSE_TILE): blockDim.x must equal it
TRANSPOSE_TILE_ROWS = 8  # blockDim.y: each thread moves TILE / TILE_ROWS elements of a tile
MAX_GRID_Y = 65535


def transpose_reference(x: np.ndarray) -> np.ndarray:
    """Contiguous x.T, a bit copy: moved as uint32, so NaN payloads and signed zeros are kept."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).view(np.uint32).T).view(np.float32)


def transpose(backend, x):
    """y [cols, rows] float32 = x.T for a C-contiguous float32 matrix x [rows, cols] (any size, 0 included)."""
    rows, cols = require_matrix("transpose: x", x)
    if backend.kernel_vendor is None:
        return transpose_reference(backend.to_numpy(x))
    y = backend.empty((cols, rows), np.float32)
    if rows and cols:
        grid = (min(-(-cols // TRANSPOSE_TILE), MAX_GRID_Y), min(-(-rows // TRANSPOSE_TILE), MAX_GRID_Y))
        backend.launch("residual", "residual_transpose_f32", grid, (TRANSPOSE_TILE, TRANSPOSE_TILE_ROWS),
                       (x, y, np.int64(rows), np.int64(cols)))
    return y
