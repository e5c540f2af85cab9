"""Kernel launches with programmatic dependent launch (cuLaunchKernelEx), for sm_90 and later.

A kernel launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may be scheduled before
the kernel ahead of it in the stream has finished; inside a stream capture the edge between the two
becomes a programmatic one in the graph. Our CUDA kernels begin with RLP_GRID_DEPENDENCY()
(backends/cuda/common.cuh): they wait for the kernels ahead to complete before touching memory, and
only then let the next kernel in. A decode step is ~300 kernels in a row; each boundary's launch and
block dispatch then overlap the tail of the kernel before it. The bits cannot change: no kernel reads or
writes anything before its wait.

Only the backend's own CUDA sources are launched this way (runtime/cuda.py): the HIP sources compiled
for NVIDIA have no wait (HIP has no such launch) and go through CuPy's ordinary launch, like any kernel
of CuPy or cuBLAS. RLPORTABLE_PROGRAMMATIC_LAUNCH=0 turns it off (to measure what it gives).

CuPy has no binding of cuLaunchKernelEx, so it is called from libcuda through ctypes, with the
arguments as an array of pointers to their bytes (runtime/kernel_args.py).
"""

from __future__ import annotations

import ctypes
import os

from rlportable.errors import RlpError
from rlportable.runtime.kernel_args import argument_pointers, launch_dims

ENVIRONMENT_SWITCH = "RLPORTABLE_PROGRAMMATIC_LAUNCH"
MIN_COMPUTE_CAPABILITY = 90  # griddepcontrol and the launch attribute: Hopper and later

# cuda.h
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (here its int member)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int), ("value_rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def wanted(kernel_vendor: str, compute_capability: str) -> bool:
    """Whether a backend launches its kernels programmatically: the CUDA sources (their kernels wait
    first) on sm_90 or later, unless the environment switch is "0"."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0":
        return False
    return kernel_vendor == "cuda" and int(compute_capability) >= MIN_COMPUTE_CAPABILITY


def _driver_launch():
    """libcuda's cuLaunchKernelEx (CUDA 12.0 and later)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuLaunchKernelEx
    except (OSError, AttributeError) as error:
        raise RlpError(f"programmatic launch: cannot load cuLaunchKernelEx from libcuda.so.1 ({error}); "
                       f"set {ENVIRONMENT_SWITCH}=0 to launch through CuPy") from error
    function.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


class ProgrammaticLauncher:
    """Launches a CUfunction with the programmatic-serialization attribute on a given stream."""

    def __init__(self, driver_launch=None):
        self._launch = driver_launch if driver_launch is not None else _driver_launch()
        self._attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)

    def config(self, grid, block, shared_mem: int, stream: int) -> LaunchConfig:
        gx, gy, gz = launch_dims(grid, "grid")
        bx, by, bz = launch_dims(block, "block")
        return LaunchConfig(gx, gy, gz, bx, by, bz, int(shared_mem), stream or None,
                            ctypes.pointer(self._attribute), 1)

    def __call__(self, kernel: str, function_ptr: int, grid, block, args, shared_mem: int, stream: int) -> None:
        config = self.config(grid, block, shared_mem, stream)
        params, keep_alive = argument_pointers(args)
        status = self._launch(ctypes.byref(config), function_ptr, params, None)
        del keep_alive
        if status != 0:
            raise RlpError(f"cuLaunchKernelEx('{kernel}', grid={grid}, block={block}, shared_mem={shared_mem}) "
                           f"failed with CUresult {status}")
