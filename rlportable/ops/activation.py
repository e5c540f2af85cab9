"""Op family "activation": SwiGLU, silu(gate) * up, with the contract's exp.

Contract: contracts/activation.toml; reference: rlportable/contract/activation.py swiglu;
kernels: backends/portable/activation.hip.
"""

from __future__ import annotations

import math

import numpy as np

from rlportable.contract import activation as reference, fixedpoint as fixedpoint_ref
from rlportable.errors import InputError
from rlportable.ops import fixedpoint
from rlportable.ops.checks import require_bits, require_contiguous, require_matrix, shape_of

THREADS = 256
MAX_GRID = 4096
#: swiglu_encode keeps a row of y in shared memory (32 KB); longer rows run swiglu then encode_rows
MAX_FUSED_ENCODED_ROW = 8192
#: the one encoding activation_swiglu_encode computes (RLP_ACTIVATION_ENCODE_BITS in backends/portable/activation.hip):
#: gemm.DEFAULT_BITS_A, the activations' bits
FUSED_ENCODE_BITS = fixedpoint_ref.ACTIVATION_BITS
#: swiglu_encode's block per row: the fastest of 256, 512 and 1024 at decode's rows on the H200
#: (bench/results/row_threads_probe_h200.json)
ENCODE_THREADS = 512


def hip_dynamic_lds() -> dict[str, int]:
    """The dynamic shared memory this family's kernels take at most on hip (build/amd_resources.py)."""
    return {"activation_swiglu_encode": 4 * MAX_FUSED_ENCODED_ROW}


def _check(gate, up) -> tuple[int, ...]:
    shape = shape_of(gate)
    for name, array in (("gate", gate), ("up", up)):
        if np.dtype(array.dtype) != np.float32:
            raise InputError(f"swiglu: {name} must have dtype float32, got {np.dtype(array.dtype).name}")
    if shape_of(up) != shape:
        raise InputError(f"swiglu: gate {shape} and up {shape_of(up)} must have the same shape")
    return shape


def swiglu_encode(backend, gate, up, bits: int = FUSED_ENCODE_BITS):
    """(y, fixedpoint.encode_rows(y, bits)) for y = swiglu(gate, up) of rows [M, H] (contracts/activation.toml
    swiglu_encode): the MLP's activation with the down projection's encoding of it. On devices at
    FUSED_ENCODE_BITS one launch writes both (the gemm's own encode launch saved); otherwise, and for
    rows longer than MAX_FUSED_ENCODED_ROW, swiglu then encode_rows (the same bits either way)."""
    rows, h = require_matrix("swiglu_encode: gate", gate)
    _check(gate, up)
    require_contiguous("swiglu_encode: gate", gate)
    require_contiguous("swiglu_encode: up", up)
    bits = require_bits("swiglu_encode: bits", bits)
    if backend.runs_reference or bits != FUSED_ENCODE_BITS or not 0 < h <= MAX_FUSED_ENCODED_ROW:
        y = swiglu(backend, gate, up)
        return y, fixedpoint.encode_rows(backend, y, bits)
    y, encoded = backend.empty((rows, h), np.float32), fixedpoint.empty_encoding(backend, rows, h, bits)
    if rows:
        backend.launch("activation", "activation_swiglu_encode", (min(rows, 65535),), (ENCODE_THREADS,),
                       (gate, up, np.int64(rows), np.int32(h), np.int32(encoded.k_padded), y, encoded.digits,
                        encoded.exponents), shared_mem=4 * h)
    return y, encoded


def swiglu(backend, gate, up):
    """y = silu(gate) * up, float32, any shape (gate and up alike)."""
    shape = _check(gate, up)
    if backend.runs_reference:
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
    if backend.runs_reference:
        return reference.swiglu_backward(backend.to_numpy(gate), backend.to_numpy(up), backend.to_numpy(dy))
    dgate = backend.empty(shape, np.float32)
    dup = backend.empty(shape, np.float32)
    n = math.prod(shape)
    if n:
        backend.launch("activation", "activation_swiglu_backward", (min(-(-n // THREADS), MAX_GRID),), (THREADS,),
                       (gate, up, dy, np.int64(n), dgate, dup))
    return dgate, dup
