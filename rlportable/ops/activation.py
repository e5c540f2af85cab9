"""Op family "activation": SwiGLU, silu(gate) * up, with the contract's exp.

Contract: contracts/activation.toml; reference: rlportable/contract/activation.py swiglu;
kernels: backends/{cuda,hip}/activation.*.
"""

from __future__ import annotations

import math

import numpy as np

from rlportable.contract import activation as reference
from rlportable.errors import InputError
from rlportable.ops.checks import shape_of

THREADS = 256
MAX_GRID = 4096


def swiglu(backend, gate, up):
    """y = silu(gate) * up, float32, any shape (gate and up alike)."""
    shape = shape_of(gate)
    for name, array in (("gate", gate), ("up", up)):
        if np.dtype(array.dtype) != np.float32:
            raise InputError(f"swiglu: {name} must have dtype float32, got {np.dtype(array.dtype).name}")
    if shape_of(up) != shape:
        raise InputError(f"swiglu: gate {shape} and up {shape_of(up)} must have the same shape")
    if backend.kernel_vendor is None:
        return reference.swiglu(backend.to_numpy(gate), backend.to_numpy(up))
    y = backend.empty(shape, np.float32)
    n = math.prod(shape)
    if n:
        backend.launch("activation", "activation_swiglu", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (gate, up, np.int64(n), y))
    return y


def swiglu_backward(backend, gate, up, dy):
    """(dgate, dup) float32, the gradient of swiglu(gate, up) for the upstream dy (all one shape)."""
    shape = shape_of(gate)
    for name, array in (("gate", gate), ("up", up), ("dy", dy)):
        if np.dtype(array.dtype) != np.float32:
            raise InputError(f"swiglu_backward: {name} must have dtype float32, got {np.dtype(array.dtype).name}")
        if shape_of(array) != shape:
            raise InputError(f"swiglu_backward: {name} {shape_of(array)} must have gate's shape {shape}")
    if backend.kernel_vendor is None:
        return reference.swiglu_backward(backend.to_numpy(gate), backend.to_numpy(up), backend.to_numpy(dy))
    dgate = backend.empty(shape, np.float32)
    dup = backend.empty(shape, np.float32)
    n = math.prod(shape)
    if n:
        backend.launch("activation", "activation_swiglu_backward", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (gate, up, dy, np.int64(n), dgate, dup))
    return dgate, dup
