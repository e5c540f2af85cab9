"""HipArray: the hip backend's device array, a contiguous block of GPU memory with a shape.

Kept deliberately small: what the ops need (shape, dtype, copies to and from
NumPy, row slices and reshapes that stay contiguous) and nothing that would
need kernels of its own. Memory comes from hipMalloc and goes back through
hipFree when the last array viewing it is gone.

The memory calls sit behind `HipMemory` so the array logic can be tested on a
machine with no GPU by handing an array a stand-in memory (tests/test_runtime_hip.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rlportable.errors import InputError, RlpError


def check_hip(result: tuple, call: str):
    """The value(s) of a hip-python call, raising RlpError naming the call on any error.

    hip-python returns a tuple whose first entry is the status (hipError_t,
    hiprtcResult or hipblasStatus_t; success is 0 for all three) and whose other
    entries are the call's outputs: none -> None, one -> that value, several -> a tuple.
    """
    status, values = result[0], result[1:]
    if status is not None and int(status) != 0:
        name = getattr(status, "name", None) or str(status)
        raise RlpError(f"{call} failed: {name} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


class HipMemory:
    """hipMalloc / hipFree / hipMemcpy / hipMemset through hip-python, addresses as ints."""

    def __init__(self, hip_module=None):
        if hip_module is None:
            from hip import hip as hip_module
        self.hip = hip_module

    def malloc(self, nbytes: int) -> int:
        if nbytes == 0:
            return 0
        pointer = check_hip(self.hip.hipMalloc(nbytes), f"hipMalloc({nbytes} bytes)")
        return int(pointer)

    def free(self, ptr: int) -> None:
        if ptr:
            check_hip(self.hip.hipFree(ptr), "hipFree")

    def _memcpy(self, dst: int, src: int, nbytes: int, kind_name: str) -> None:
        if nbytes:
            kind = getattr(self.hip.hipMemcpyKind, kind_name)
            check_hip(self.hip.hipMemcpy(dst, src, nbytes, kind), f"hipMemcpy ({kind_name}, {nbytes} bytes)")

    def host_to_device(self, dst: int, src: int, nbytes: int) -> None:
        self._memcpy(dst, src, nbytes, "hipMemcpyHostToDevice")

    def device_to_host(self, dst: int, src: int, nbytes: int) -> None:
        self._memcpy(dst, src, nbytes, "hipMemcpyDeviceToHost")

    def device_to_device(self, dst: int, src: int, nbytes: int) -> None:
        self._memcpy(dst, src, nbytes, "hipMemcpyDeviceToDevice")

    def memset(self, dst: int, value: int, nbytes: int) -> None:
        if nbytes:
            check_hip(self.hip.hipMemset(dst, value, nbytes), f"hipMemset ({nbytes} bytes)")


_default_memory: HipMemory | None = None


def default_memory() -> HipMemory:
    global _default_memory
    if _default_memory is None:
        _default_memory = HipMemory()
    return _default_memory


class _Allocation:
    """One hipMalloc block; freed when the last array that views it is collected."""

    __slots__ = ("memory", "ptr", "nbytes")

    def __init__(self, memory, nbytes: int):
        self.memory = memory
        self.nbytes = nbytes
        self.ptr = 0  # set before malloc, so a failed malloc leaves nothing for __del__
        self.ptr = memory.malloc(nbytes)

    def __del__(self):
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                self.memory.free(ptr)
            except Exception:  # interpreter shutdown or a lost device: nothing left to do
                pass


def _normalize_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise InputError(f"array shape {shape} has a negative dimension")
    return shape


class HipArray:
    """A C-contiguous device array. `ptr` is the device address of element 0 (an int)."""

    __slots__ = ("shape", "dtype", "ptr", "_allocation", "memory", "__weakref__")

    def __init__(self, shape, dtype, *, memory=None, _allocation: _Allocation | None = None, _ptr: int | None = None):
        self.shape = _normalize_shape(shape)
        self.dtype = np.dtype(dtype)
        self.memory = memory if memory is not None else default_memory()
        if _allocation is None:
            _allocation = _Allocation(self.memory, self.nbytes)
            _ptr = _allocation.ptr
        self._allocation = _allocation
        self.ptr = int(_ptr)

    # ---- properties NumPy users expect
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        strides, step = [], self.itemsize
        for d in reversed(self.shape):
            strides.append(step)
            step *= max(d, 1)
        return tuple(reversed(strides))

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA array interface (v3), which ROCm builds of PyTorch and CuPy also read."""
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d HipArray")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"HipArray(shape={self.shape}, dtype={self.dtype.name}, ptr={self.ptr:#x})"

    # ---- construction and copies
    @classmethod
    def from_numpy(cls, array, memory=None) -> HipArray:
        host = np.ascontiguousarray(array)
        out = cls(host.shape, host.dtype, memory=memory)
        out.copy_from_numpy(host)
        return out

    @classmethod
    def zeros(cls, shape, dtype, memory=None) -> HipArray:
        out = cls(shape, dtype, memory=memory)
        out.memory.memset(out.ptr, 0, out.nbytes)
        return out

    def copy_from_numpy(self, array) -> None:
        host = np.ascontiguousarray(array, dtype=self.dtype)
        if host.shape != self.shape:
            raise InputError(f"cannot copy an array of shape {host.shape} into a HipArray of shape {self.shape}")
        self.memory.host_to_device(self.ptr, host.ctypes.data, self.nbytes)

    def get(self) -> np.ndarray:
        """A NumPy copy (blocking: hipMemcpy waits for the work queued before it)."""
        host = np.empty(self.shape, dtype=self.dtype)
        self.memory.device_to_host(host.ctypes.data, self.ptr, self.nbytes)
        return host

    to_numpy = get

    def copy(self) -> HipArray:
        out = HipArray(self.shape, self.dtype, memory=self.memory)
        self.memory.device_to_device(out.ptr, self.ptr, self.nbytes)
        return out

    # ---- views (same memory, no copy)
    def _view(self, shape, offset_bytes: int = 0) -> HipArray:
        return HipArray(shape, self.dtype, memory=self.memory, _allocation=self._allocation,
                        _ptr=self.ptr + offset_bytes)

    def reshape(self, *shape) -> HipArray:
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = tuple(shape[0])
        shape = [int(d) for d in shape]
        if shape.count(-1) > 1:
            raise InputError(f"reshape: at most one dimension may be -1, got {tuple(shape)}")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if known == 0 or self.size % known:
                raise InputError(f"reshape: cannot reshape {self.shape} into {tuple(shape)}")
            shape[shape.index(-1)] = self.size // known
        if math.prod(shape) != self.size:
            raise InputError(f"reshape: cannot reshape {self.shape} ({self.size} elements) into {tuple(shape)}")
        return self._view(tuple(shape))

    def ravel(self) -> HipArray:
        return self._view((self.size,))

    def view(self, dtype) -> HipArray:
        """The same bytes seen as another dtype of equal item size."""
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.itemsize:
            raise InputError(f"view: {self.dtype.name} -> {dtype.name} changes the item size")
        return HipArray(self.shape, dtype, memory=self.memory, _allocation=self._allocation, _ptr=self.ptr)

    def __getitem__(self, key) -> HipArray:
        """Row selection along axis 0 only: a[i], a[start:stop] (step 1). Both stay contiguous."""
        if not self.shape:
            raise InputError("a 0-d HipArray cannot be indexed")
        rows = self.shape[0]
        row_bytes = self.itemsize * math.prod(self.shape[1:])
        if isinstance(key, (int, np.integer)):
            index = int(key) + (rows if key < 0 else 0)
            if not 0 <= index < rows:
                raise IndexError(f"index {int(key)} is out of bounds for axis 0 of size {rows}")
            return self._view(self.shape[1:], index * row_bytes)
        if isinstance(key, slice):
            start, stop, step = key.indices(rows)
            if step != 1:
                raise InputError("HipArray slices must have step 1 (the result must stay contiguous)")
            count = max(0, stop - start)
            return self._view((count,) + self.shape[1:], start * row_bytes)
        raise InputError(f"HipArray supports a[i] and a[start:stop] along axis 0 only, got {key!r}")
