"""Op family "residual": float32 additions for residual streams and biases (contracts/residual.toml).

Our own kernels, not CuPy's `+`: CuPy compiles its elementwise kernels with
flush-to-zero, and NaN payloads differ between vendors.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.checks import shape_of

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
