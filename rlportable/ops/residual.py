"""Op family "residual": float32 additions for residual streams and biases, and the matrix
transpose the backward needs (W^T, X^T as rows for the exact GEMM) (contracts/residual.toml).

Our own kernels, not CuPy's `+`: CuPy compiles its elementwise kernels with
flush-to-zero, and NaN payloads differ between vendors.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import residual as reference
from rlportable.errors import InputError
from rlportable.ops.checks import require_matrix, shape_of

THREADS = 256


def _grid(n: int) -> tuple[int]:
    return (max(1, min(-(-n // THREADS), 65535)),)


def add(backend, a, b):
    if shape_of(a) != shape_of(b) or np.dtype(a.dtype) != np.float32 or np.dtype(b.dtype) != np.float32:
        raise InputError(f"add: a {shape_of(a)} {a.dtype} and b {shape_of(b)} {b.dtype} must be float32 of one shape")
    if backend.runs_reference:
        return reference.add(backend.to_numpy(a), backend.to_numpy(b))
    y = backend.empty(shape_of(a), np.float32)
    n = int(np.prod(shape_of(a), dtype=np.int64))
    if n:
        backend.launch("residual", "residual_add_f32", _grid(n), (THREADS,), (a, b, y, np.int64(n)))
    return y


def add_bias(backend, x, b):
    rows, n = shape_of(x)
    if shape_of(b) != (n,):
        raise InputError(f"add_bias: bias has shape {shape_of(b)}, expected ({n},) for x of shape {(rows, n)}")
    if backend.runs_reference:
        return reference.add_bias(backend.to_numpy(x), backend.to_numpy(b))
    y = backend.empty((rows, n), np.float32)
    if rows * n:
        backend.launch("residual", "residual_add_bias_f32", _grid(rows * n), (THREADS,),
                       (x, b, y, np.int64(rows), np.int64(n)))
    return y


TRANSPOSE_TILE = 32  # the kernel's square tile (RLP_TRANSPOSE_TILE): blockDim.x must equal it
TRANSPOSE_TILE_ROWS = 8  # blockDim.y: each thread moves TILE / TILE_ROWS elements of a tile
MAX_GRID_Y = 65535


def transpose(backend, x):
    """y [cols, rows] float32 = x.T for a C-contiguous float32 matrix x [rows, cols] (any size, 0 included)."""
    rows, cols = require_matrix("transpose: x", x)
    if backend.runs_reference:
        return reference.transpose(backend.to_numpy(x))
    y = backend.empty((cols, rows), np.float32)
    if rows and cols:
        grid = (min(-(-cols // TRANSPOSE_TILE), MAX_GRID_Y), min(-(-rows // TRANSPOSE_TILE), MAX_GRID_Y))
        backend.launch("residual", "residual_transpose_f32", grid, (TRANSPOSE_TILE, TRANSPOSE_TILE_ROWS),
                       (x, y, np.int64(rows), np.int64(cols)))
    return y


def check_copy_pairs(src: np.ndarray, dst: np.ndarray, rows: int) -> None:
    """The pairs copy_rows accepts: in range, distinct destinations, no destination a source."""
    src, dst = np.asarray(src), np.asarray(dst)
    if src.shape != dst.shape or src.ndim != 1:
        raise InputError(f"copy_rows: src {src.shape} and dst {dst.shape} must be 1-D of one length")
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= rows):
        raise InputError(f"copy_rows: a row index is outside [0, {rows})")
    if np.unique(dst).size != dst.size or np.intersect1d(src, dst).size:
        raise InputError("copy_rows: destinations must be distinct and must not be sources")


def copy_rows(backend, array, src, dst, count: int) -> None:
    """In place: array[dst[i]] = array[src[i]] for i < count (src, dst: device int32 [>= count], pairs
    already checked by check_copy_pairs on the host). array: C-contiguous, rows of 32-bit words."""
    rows = shape_of(array)[0]
    if backend.runs_reference:
        reference.copy_rows(array, np.asarray(src)[:count], np.asarray(dst)[:count])
        return
    row_bytes = int(np.prod(shape_of(array)[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize
    if row_bytes % 4:
        raise InputError(f"copy_rows: rows of {row_bytes} bytes are not whole 32-bit words")
    words = row_bytes // 4
    if count and words:
        flat = array.reshape(rows, -1).view(np.uint32)
        backend.launch("residual", "residual_copy_rows_u32", _grid(count * words), (THREADS,),
                       (src, dst, np.int64(count), np.int64(words), flat))
