"""Op family "norm": RMSNorm, and the per-head QK-norm (the same op on rows = tokens * heads).

Contract: contracts/norm.toml; reference: rlportable/contract/norm.py rmsnorm;
kernels: backends/{cuda,hip}/norm.*.
"""

from __future__ import annotations

import math

import numpy as np

from rlportable.contract import norm as reference
from rlportable.errors import InputError
from rlportable.ops.checks import require_matrix, shape_of

NORM_THREADS = 256
MAX_GRID = 65535


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) or not math.isfinite(eps) \
            or eps < 0:
        raise InputError(f"rmsnorm: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def rmsnorm(backend, x, weight, eps: float):
    """y [rows, H] float32 = RMSNorm of x [rows, H] float32 with weight [H] float32 under the contract."""
    rows, h = require_matrix("x", x)
    if shape_of(weight) != (h,) or np.dtype(weight.dtype) != np.float32:
        raise InputError(f"rmsnorm: weight must be float32 of shape ({h},) to match x {(rows, h)}, "
                         f"got {np.dtype(weight.dtype).name} of shape {shape_of(weight)}")
    if h > reference.MAX_ROW:
        raise InputError(f"rmsnorm: row length {h} exceeds the contract's limit {reference.MAX_ROW}")
    eps = check_eps(eps)
    if backend.kernel_vendor is None:
        if rows == 0 or h == 0:
            return np.empty((rows, h), dtype=np.float32)
        return reference.rmsnorm(backend.to_numpy(x), backend.to_numpy(weight), eps)
    y = backend.empty((rows, h), np.float32)
    if rows and h:
        backend.launch("norm", "norm_rmsnorm", (min(rows, MAX_GRID),), (NORM_THREADS,),
                       (x, weight, np.int64(rows), np.int32(h), np.float64(eps), y))
    return y


def rmsnorm_heads(backend, x, weight, eps: float):
    """QK-norm: x [tokens, heads, head_dim] float32, weight [head_dim]; each head's row normalised alone."""
    shape = shape_of(x)
    if len(shape) != 3:
        raise InputError(f"rmsnorm_heads: x must be [tokens, heads, head_dim], got shape {shape}")
    tokens, heads, head_dim = shape
    y = rmsnorm(backend, x.reshape(tokens * heads, head_dim), weight, eps)
    return y.reshape(tokens, heads, head_dim)
