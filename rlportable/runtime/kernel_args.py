"""Kernel arguments for the driver launches that runtime/hip.py and runtime/cuda_launch.py make.

hipModuleLaunchKernel takes them as one packed buffer (a C struct's bytes) through its `extra` array
({BUFFER_POINTER, &buffer, BUFFER_SIZE, &size, END}). cuLaunchKernelEx takes an array of pointers,
one per argument (`argument_pointers`): CUDA refuses a packed buffer whose size is not exactly its
parameter block's, which has no padding after the last argument (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np

from rlportable.errors import InputError
from rlportable.runtime.hip_array import HipArray

LAUNCH_PARAM_BUFFER_POINTER = 0x01  # hip_runtime_api.h
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

    This is the layout of a C struct holding the arguments (the AMDGPU kernarg ABI, and what
    HIP_LAUNCH_PARAM_BUFFER_POINTER expects): device pointers as
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


def argument_pointers(args) -> tuple[int, tuple]:
    """(address of the void* array with one pointer per argument's bytes, objects to keep alive until the
    launch returns): cuLaunchKernelEx's kernelParams. The driver copies the values before it returns."""
    values = [ctypes.create_string_buffer(_argument_bytes(index, arg)[0]) for index, arg in enumerate(args)]
    pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(value) for value in values])
    return ctypes.addressof(pointers), (values, pointers)
