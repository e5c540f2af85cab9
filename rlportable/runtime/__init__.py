"""Device choice: --device auto|cpu|cuda|hip|hip-cpu, with no silent fallback.

hip-cpu runs the HIP kernel sources on the CPU through AMD's HIP-CPU runtime (a 64-lane
wavefront; runtime/hip_cpu.py). It is never picked by auto: it checks kernels, it is not fast.
"""

from __future__ import annotations

import importlib

from rlportable.errors import BackendUnavailable, RlpError
from rlportable.runtime.base import Backend

DEVICES = ("auto", "cpu", "cuda", "hip", "hip-cpu")
AUTO_ORDER = ("cuda", "hip", "cpu")
KERNEL_SOURCES = ("native", "cuda", "hip")


def _module(name: str):
    return importlib.import_module(f"rlportable.runtime.{name.replace('-', '_')}")


def probe(name: str) -> tuple[bool, str]:
    """(available, reason) for one backend; never raises."""
    try:
        module = _module(name)
    except ImportError as error:
        return False, f"rlportable.runtime.{name} does not import: {error}"
    return module.probe()


def resolve_device(device: str) -> str:
    """The concrete backend name for `device`; 'auto' takes cuda, then hip, then cpu."""
    if device not in DEVICES:
        raise RlpError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if device != "auto":
        return device
    for name in AUTO_ORDER:
        if probe(name)[0]:
            return name
    raise AssertionError("the cpu backend is always available")


def get_backend(device: str = "auto", kernel_source: str = "native", device_index: int | None = None) -> Backend:
    """A backend object; raises BackendUnavailable naming what is missing.

    device_index: which GPU (a tensor-parallel rank's LOCAL_RANK); None keeps the current one.

    kernel_source="hip" with device cuda runs the HIP sources through the
    project's HIP-on-CUDA prelude (the HIP kernels' logic checked on NVIDIA).
    """
    name = resolve_device(device)
    if kernel_source not in KERNEL_SOURCES:
        raise RlpError(f"unknown kernel source {kernel_source!r}; choose one of {', '.join(KERNEL_SOURCES)}")
    if name == "cpu":
        if kernel_source != "native":
            raise RlpError("the cpu backend runs the NumPy reference; --kernel-source applies to cuda and hip "
                           "(--device hip-cpu runs the HIP sources on the CPU)")
        from rlportable.runtime.cpu import CpuBackend

        return CpuBackend()
    if name == "cuda":
        from rlportable.runtime.cuda import CudaBackend

        if device_index is not None and probe("cuda")[0]:
            import cupy

            cupy.cuda.Device(int(device_index)).use()
        return CudaBackend(kernel_source="cuda" if kernel_source == "native" else kernel_source)
    if kernel_source == "cuda":
        raise RlpError(f"CUDA sources cannot run on the {name} backend")
    if name == "hip-cpu":
        from rlportable.runtime.hip_cpu import HipCpuBackend

        return HipCpuBackend()
    available, reason = probe("hip")
    if not available:
        raise BackendUnavailable(f"device 'hip' is unavailable: {reason}")
    from rlportable.runtime.hip import HipBackend

    return HipBackend(device=device_index)
