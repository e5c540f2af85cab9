"""A stand-in backend for tests of the ops' device paths without a GPU: kernels are recorded, not run,
and the launches' arguments can be checked against the kernels' parameter lists in the sources."""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

from rlportable.resources import assemble_text, kernel_source_path


class Launch(NamedTuple):
    family: str
    kernel: str
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int


class RecordingDevice:
    """A backend with device kernels whose launches are recorded, not run (NumPy arrays)."""

    label = "fake"
    on_host = False  # as a GPU: the ops choose their kernels as on one

    def __init__(self, vendor: str | None = "cuda"):
        self.kernel_vendor = vendor
        self.launches: list[Launch] = []

    @property
    def runs_reference(self) -> bool:
        return self.kernel_vendor is None

    def asarray(self, array):
        return np.array(array)

    def to_numpy(self, array):
        return np.asarray(array)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def launch(self, family, kernel, grid, block, args, shared_mem: int = 0) -> None:
        self.launches.append(Launch(family, kernel, tuple(grid), tuple(block), tuple(args), shared_mem))


#: an extern "C" kernel's (name, parameter text) in a source
KERNEL_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:(?:__launch_bounds__|RLP_LAUNCH_BOUNDS)\([^)]*\)\s*)?'
                     r'(\w+)\s*\(([^)]*)\)')


def kernel_parameters(vendor: str, family: str) -> dict[str, list[Any]]:
    """kernel name -> parameter types (names and __restrict__ stripped), from the source `vendor` compiles
    for the family (its fast-path file with the portable source it includes, or the portable source)."""
    path = kernel_source_path(vendor, family)
    text = assemble_text(path.read_text(), folder=path.parent)
    return {name: [" ".join(p.replace("__restrict__", "").split()).rsplit(" ", 1)[0] for p in params.split(",")]
            for name, params in KERNEL_ENTRY.findall(text)}
