"""The small interface every device backend implements (cpu, cuda, hip)."""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from rlportable.resources import assemble_text, kernel_source_path

def assemble_source(vendor: str, family: str, prelude: str | None = None) -> str:
    """A kernel family's source (kernel_source_path) with its local #include "..." files inlined.

    Inlining makes the source self-contained, so the compile cache key (a hash
    of this text) covers every header it uses. A header is looked up beside the
    source, then in backends/portable (common.h, contract_math.h). `prelude`, a
    path under backends/ (cuda/prelude.h: the portable dialect on NVIDIA), is put
    in front.
    """
    path = kernel_source_path(vendor, family)
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} is missing")
    return assemble_text(path.read_text(), prelude, path.parent)


class Backend(ABC):
    """One device: arrays, kernel launches, and the vendor integer GEMM."""

    name: str = "?"
    #: which kernel sources it runs: "cuda" (the portable ones with NVIDIA's fast paths, backends/cuda),
    #: "hip" (the portable ones, backends/portable), or None (NumPy)
    kernel_vendor: str | None = None
    #: whether it computes on the host CPU (cpu, hip-cpu): the conformance suite sizes its inputs for
    #: a CPU there and leaves out the models only a GPU runs in reasonable time
    on_host: bool = False

    @property
    def runs_reference(self) -> bool:
        """Whether the ops run the NumPy reference here (no kernel sources: the cpu backend)."""
        return self.kernel_vendor is None

    @abstractmethod
    def asarray(self, array: np.ndarray) -> Any: ...

    @abstractmethod
    def to_numpy(self, array: Any) -> np.ndarray: ...

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype) -> Any: ...

    def zeros(self, shape: tuple[int, ...], dtype) -> Any:
        return self.asarray(np.zeros(shape, dtype=dtype))

    def synchronize(self) -> None:
        pass

    def copy_into(self, dst, src) -> None:
        """Copy the elements of `src` into `dst` (same shape and dtype, both C-contiguous)."""
        dst[...] = src

    def launch(self, family: str, kernel: str, grid, block, args, shared_mem: int = 0) -> None:
        raise NotImplementedError(f"the {self.name} backend runs no device kernels")

    def info(self) -> dict:
        return {"backend": self.name}

    # ---- the engine's step loop (rlportable/engine/runner.py): transfers, stream, graphs
    #: whether capture_graph works here (cuda: CUDA graphs; hip: HIP graphs). Elsewhere the engine
    #: runs the same padded decode buckets eagerly.
    supports_graphs: bool = False

    def engine_stream(self):
        """A context manager that runs the enclosed work on the engine's stream (graph capture needs a
        stream other than the legacy default one); nothing to do on cpu."""
        return contextlib.nullcontext()

    def capture_graph(self, function):
        """(graph, function()) with function's device work captured, not run; graph.replay() runs it."""
        raise NotImplementedError(f"the {self.label} backend has no graphs")

    def release_graph_memory(self) -> None:
        """Give back to the device the memory that dropped graphs' captured work allocated."""

    def upload(self, buffer, host: np.ndarray) -> None:
        """Copy the bytes of `host` (uint8 [n]) into the first n bytes of `buffer` (a uint8 backend
        array) in stream order, without waiting for the device where the backend can."""
        buffer[: host.size] = host

    #: whether start_download returns before the device has finished the work queued so far (cuda),
    #: so the host can queue more work meanwhile (the engine's asynchronous scheduling); elsewhere the
    #: copies are made at once
    async_downloads: bool = False

    def start_download(self, arrays: list) -> "Download":
        """Begin copying backend arrays to the host, behind the work queued so far; `.wait()` gives
        the host copies (C-contiguous). Here the copies are made at once."""
        return Download([np.array(self.to_numpy(array)) for array in arrays])

    def download(self, arrays: list) -> list[np.ndarray]:
        """Host copies of backend arrays (C-contiguous), with one wait for the device where the backend can."""
        return self.start_download(arrays).wait()

    def typed_view(self, buffer, offset: int, shape: tuple[int, ...], dtype):
        """`shape` elements of `dtype` at byte `offset` of a uint8 backend array (offset aligned to the item size)."""
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return buffer[offset: offset + nbytes].view(dtype).reshape(shape)

    @property
    def label(self) -> str:
        """Name shown to users, e.g. 'cuda' or 'cuda (hip sources)'."""
        return self.name


class Download:
    """Host copies of backend arrays, ready (Backend.start_download); a backend that copies
    asynchronously returns its own kind, whose wait() waits for the copies."""

    def __init__(self, arrays: list[np.ndarray]):
        self._arrays = arrays

    def wait(self) -> list[np.ndarray]:
        """The host copies (the same list at every call)."""
        return self._arrays
