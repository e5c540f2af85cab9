"""Input validation shared by the ops: clear errors that name the tensor and the problem."""

from __future__ import annotations

import numpy as np

from rlportable.errors import InputError

#: a kernel's null pointer argument (an optional output left out): 8 bytes of zero, as a device address
NULL_POINTER = np.uint64(0)


def shape_of(array) -> tuple[int, ...]:
    return tuple(int(d) for d in array.shape)


def require_contiguous(name: str, array) -> None:
    """Kernels read row-major memory: a strided view (a slice of columns, a transpose) would be
    read wrongly on a device while NumPy's reference honours the strides."""
    flags = getattr(array, "flags", None)
    if flags is not None and not flags["C_CONTIGUOUS"]:
        raise InputError(f"{name} must be C-contiguous (row-major); pass a contiguous copy of the strided view")


def require_matrix(name: str, array, dtype=np.float32) -> tuple[int, int]:
    shape = shape_of(array)
    if len(shape) != 2:
        raise InputError(f"{name} must be a 2-D matrix, got shape {shape}")
    if np.dtype(array.dtype) != np.dtype(dtype):
        raise InputError(f"{name} must have dtype {np.dtype(dtype).name}, got {np.dtype(array.dtype).name}")
    require_contiguous(name, array)
    return shape


def require_bits(name: str, bits: int, low: int = 2, high: int = 53) -> int:
    if not isinstance(bits, (int, np.integer)) or not low <= int(bits) <= high:
        raise InputError(f"{name} must be an integer in [{low}, {high}], got {bits!r}")
    return int(bits)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
