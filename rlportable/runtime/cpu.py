"""The cpu backend: NumPy arrays; every op runs its NumPy reference."""

from __future__ import annotations

import platform

import numpy as np

from rlportable.runtime.base import Backend


class CpuBackend(Backend):
    name = "cpu"
    kernel_vendor = None
    on_host = True

    def asarray(self, array):
        return np.ascontiguousarray(array)

    def to_numpy(self, array):
        return np.asarray(array)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def info(self):
        return {
            "backend": "cpu",
            "device": platform.processor() or platform.machine(),
            "numpy": np.__version__,
        }


def probe() -> tuple[bool, str]:
    return True, "NumPy reference"
