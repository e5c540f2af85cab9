"""Op family "rope": rotary position embedding with host-made tables.

Contract: contracts/rope.toml; reference: rlportable/contract/rope.py (inverse_frequencies,
tables, apply, apply_backward); kernels: backends/portable/rope.hip.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import rope as reference
from rlportable.errors import InputError
from rlportable.ops.checks import require_contiguous, shape_of

ROPE_THREADS = 256
MAX_GRID = 4096


def tables(backend, max_positions: int, head_dim: int, theta: float, scaling: reference.Llama3Scaling | None = None):
    """(cos, sin) float32 [max_positions, head_dim / 2] for positions 0 .. max_positions - 1, made on
    the host with the contract's float64 functions and put on the backend."""
    if head_dim <= 0 or head_dim % 2:
        raise InputError(f"rope: head_dim must be a positive even number, got {head_dim}")
    if not 0 <= max_positions <= reference.MAX_POSITIONS:
        raise InputError(f"rope: max_positions must lie in [0, {reference.MAX_POSITIONS}], got {max_positions}")
    inv_freq = reference.inverse_frequencies(head_dim, theta, scaling)
    cos, sin = reference.tables(np.arange(max_positions), inv_freq)
    return backend.asarray(cos), backend.asarray(sin)


def _check(x, positions, cos, sin, op: str = "rope", name: str = "x") -> tuple[int, int, int, int]:
    shape = shape_of(x)
    if len(shape) != 3 or np.dtype(x.dtype) != np.float32:
        raise InputError(f"{op}: {name} must be float32 [tokens, heads, head_dim], got {np.dtype(x.dtype).name} of shape {shape}")
    tokens, heads, head_dim = shape
    if head_dim % 2:
        raise InputError(f"{op}: head_dim must be even, got {name} of shape {shape}")
    if shape_of(positions) != (tokens,) or np.dtype(positions.dtype) != np.int32:
        raise InputError(f"{op}: positions must be int32 of shape ({tokens},), got "
                         f"{np.dtype(positions.dtype).name} of shape {shape_of(positions)}")
    for table_name, table in (("cos", cos), ("sin", sin)):
        table_shape = shape_of(table)
        if len(table_shape) != 2 or table_shape[1] != head_dim // 2 or np.dtype(table.dtype) != np.float32:
            raise InputError(f"{op}: {table_name} must be float32 [positions, {head_dim // 2}], got "
                             f"{np.dtype(table.dtype).name} of shape {table_shape}")
    if shape_of(cos) != shape_of(sin):
        raise InputError(f"{op}: cos {shape_of(cos)} and sin {shape_of(sin)} differ in shape")
    return tokens, heads, head_dim // 2, shape_of(cos)[0]


def _check_positions(backend, positions, host_positions, table_rows: int, op: str = "rope") -> np.ndarray:
    host_positions = np.asarray(backend.to_numpy(positions) if host_positions is None else host_positions)
    if host_positions.size and (host_positions.min() < 0 or host_positions.max() >= table_rows):
        bad = host_positions[(host_positions < 0) | (host_positions >= table_rows)][0]
        raise InputError(f"{op}: position {int(bad)} is outside the tables' [0, {table_rows})")
    return host_positions


def apply(backend, x, positions, cos, sin, host_positions=None):
    """y [tokens, heads, D] = x rotated by the table rows cos[positions], sin[positions].

    host_positions: the same positions as a NumPy array, when the caller has them; they are
    checked instead of copying `positions` back from the device (the model's per-layer calls)."""
    return _rotate(backend, x, positions, cos, sin, host_positions, "rope", "x", "rope_apply", reference.apply)


def apply_backward(backend, dy, positions, cos, sin, host_positions=None):
    """dx [tokens, heads, D] = R(position)^T dy: the gradient of apply for the upstream dy
    (contracts/rope.toml apply_backward); arguments as for apply, with dy in x's place."""
    require_contiguous("rope.apply_backward: dy", dy)
    return _rotate(backend, dy, positions, cos, sin, host_positions, "rope.apply_backward", "dy",
                   "rope_apply_backward", reference.apply_backward)


def _rotate(backend, x, positions, cos, sin, host_positions, op: str, name: str, kernel: str, reference_fn):
    tokens, heads, half, table_rows = _check(x, positions, cos, sin, op, name)
    host_positions = _check_positions(backend, positions, host_positions, table_rows, op)
    if backend.runs_reference:
        cos, sin = backend.to_numpy(cos), backend.to_numpy(sin)
        return reference_fn(backend.to_numpy(x), cos[host_positions], sin[host_positions])
    y = backend.empty((tokens, heads, 2 * half), np.float32)
    n = tokens * heads * half
    if n:
        backend.launch("rope", kernel, (min(-(-n // ROPE_THREADS), MAX_GRID),), (ROPE_THREADS,),
                       (x, positions, cos, sin, np.int64(tokens), np.int32(heads), np.int32(half), y))
    return y
