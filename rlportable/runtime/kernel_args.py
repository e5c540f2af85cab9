"""Kernel arguments as one packed buffer, for the driver launches that take them that way.

hipModuleLaunchKernel (runtime/hip.py) and cuLaunchKernelEx (runtime/cuda.py, programmatic
dependent launch) both accept the arguments as a C struct's bytes through their `extra` array
({BUFFER_POINTER, &buffer, BUFFER_SIZE, &size, END}); the two APIs differ only in END's value.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from rlportable.errors import InputError
from rlportable.runtime.hip_array import HipArray

LAUNCH_PARAM_BUFFER_POINTER = 0x01  # the same in hip_runtime_api.h and cuda.h
LAUNCH_PARAM_BUFFER_SIZE = 0x02
_POINTER_BYTES = 8  # 64-bit device addresses on every ROCm and CUDA target


def _argument_bytes(index: int, arg) -> tuple[bytes, int]:
    """(little-endian bytes, alignment) of one kernel argument."""
    if isinstance(arg, HipArray):
        return struct.pack("<Q", arg.ptr), _POINTER_BYTES
    if isinstance(arg, np.generic):
        if arg.dtype.kind not in "biuf":
            raise InputError(f"kernel argument #{index}: unsupported NumPy scalar type {arg.dtype.name}")
        value = np.asarray(arg).astype(arg.dtype.newbyteorder("<"))
        return value.tobytes(), arg.dtype.itemsize
    if isinstance(arg, (bool, int, float)):
        raise InputError(
            f"kernel argument #{index} is a Python {type(arg).__name__} ({arg!r}); pass a NumPy scalar "
            "(np.int32, np.int64, np.float32, ...) so that its width is explicit"
        )
    interface = getattr(arg, "__cuda_array_interface__", None)
    if isinstance(interface, dict) and "data" in interface:
        return struct.pack("<Q", int(interface["data"][0])), _POINTER_BYTES
    raise InputError(f"kernel argument #{index}: cannot pass an object of type {type(arg).__name__} to a kernel")


def pack_kernel_args(args) -> bytes:
    """The kernel argument buffer: each argument at its natural alignment, in order.

    This is the layout of a C struct holding the arguments (the AMDGPU kernarg ABI, CUDA's
    parameter layout, and what the BUFFER_POINTER launch parameter expects): device pointers as
    8-byte addresses, NumPy scalars by value with alignment = item size, the total padded to the
    largest alignment.
    """
    buffer = bytearray()
    largest = 1
    for index, arg in enumerate(args):
        data, align = _argument_bytes(index, arg)
        buffer += bytes(-len(buffer) % align)
        buffer += data
        largest = max(largest, align)
    buffer += bytes(-len(buffer) % largest)
    return bytes(buffer)


def launch_dims(dims, what: str) -> tuple[int, int, int]:
    """A grid or block given as an int or a 1-3 tuple -> (x, y, z)."""
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise InputError(f"kernel launch: {what} must be 1 to 3 positive sizes, got {dims}")
    return dims + (1,) * (3 - len(dims))


def launch_extra(packed: bytes, end_tag: int) -> tuple[int, tuple]:
    """(address of the `extra` config array, objects to keep alive until the launch returns).

    extra = {BUFFER_POINTER, &buffer, BUFFER_SIZE, &size, END}; both drivers copy the arguments
    before the launch call returns.
    """
    buffer = ctypes.create_string_buffer(packed, max(len(packed), 1))
    size = ctypes.c_size_t(len(packed))
    config = (ctypes.c_void_p * 5)(
        LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
        LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
        end_tag or None,
    )
    return ctypes.addressof(config), (buffer, size, config)
