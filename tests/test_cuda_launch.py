"""The programmatic launch path (runtime/cuda_launch.py) without a GPU: the launch configuration it
hands the driver, the switch, and that every kernel of both vendors' sources waits first."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from rlportable.errors import InputError, RlpError
from rlportable.runtime import cuda_launch
from rlportable.resources import kernel_source_path
from rlportable.runtime.offline_compile import families



class FakeDevicePointer:
    def __init__(self, address: int):
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (1,), "typestr": "<f4", "version": 3}


class FakeDriver:
    """Stands for cuLaunchKernelEx: records what one launch passed, returns a given CUresult."""

    def __init__(self, status: int = 0, sizes: tuple[int, ...] = ()):
        self.status, self.calls, self.sizes = status, [], sizes  # sizes: the kernel's parameter sizes

    def __call__(self, config_ref, function_ptr, params, extra):
        config = config_ref._obj
        attribute = config.attrs[0]
        values = (ctypes.c_void_p * len(self.sizes)).from_address(params)
        self.calls.append({
            "grid": (config.grid_x, config.grid_y, config.grid_z),
            "block": (config.block_x, config.block_y, config.block_z),
            "shared": config.shared_mem_bytes, "stream": config.stream, "num_attrs": config.num_attrs,
            "attribute": (attribute.id, attribute.value), "function": function_ptr, "extra": extra,
            "values": [ctypes.string_at(address, size) for address, size in zip(values, self.sizes)],
        })
        return self.status


def test_the_launch_carries_the_programmatic_attribute_and_the_packed_arguments():
    driver = FakeDriver(sizes=(8, 4, 8, 8, 4))
    launch = cuda_launch.ProgrammaticLauncher(driver)
    pointer = FakeDevicePointer(0x7F00_0000_1000)
    args = (np.int64(7), np.int32(-3), np.float64(0.5), pointer, np.float32(2.0))
    launch("kernel_name", 0xABC0, (5, 2), 128, args, 4096, 0x5000)
    (call,) = driver.calls
    assert call["grid"] == (5, 2, 1) and call["block"] == (128, 1, 1)
    assert call["shared"] == 4096 and call["stream"] == 0x5000 and call["function"] == 0xABC0
    assert call["num_attrs"] == 1
    assert call["attribute"] == (cuda_launch.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1) == (6, 1)
    assert call["extra"] is None
    # one pointer per argument, to its own bytes: no packed buffer whose padding CUDA could refuse
    assert call["values"] == [np.int64(7).tobytes(), np.int32(-3).tobytes(), np.float64(0.5).tobytes(),
                              (0x7F00_0000_1000).to_bytes(8, "little"), np.float32(2.0).tobytes()]


def test_the_default_stream_is_passed_as_null():
    driver = FakeDriver()
    cuda_launch.ProgrammaticLauncher(driver)("k", 1, 1, 32, (), 0, 0)
    assert driver.calls[0]["stream"] is None


def test_the_launch_config_matches_cuda_h_sizes():
    assert ctypes.sizeof(cuda_launch.LaunchAttribute) == 72  # id, pad to 8, a 64-byte union
    assert ctypes.sizeof(cuda_launch.LaunchConfig) == 7 * 4 + 4 + 8 + 8 + 8  # 7 uints, padding, 2 pointers, uint + pad


def test_a_failed_launch_names_the_kernel():
    launch = cuda_launch.ProgrammaticLauncher(FakeDriver(status=1))
    with pytest.raises(RlpError, match="kernel_x.*CUresult 1"):
        launch("kernel_x", 1, 4, 64, (np.int32(1),), 0, 0)


def test_bad_dimensions_are_refused_before_the_driver():
    driver = FakeDriver()
    with pytest.raises(InputError, match="grid"):
        cuda_launch.ProgrammaticLauncher(driver)("k", 1, (0,), 64, (), 0, 0)
    assert not driver.calls


def test_wanted_only_for_the_cuda_sources_on_hopper(monkeypatch):
    monkeypatch.delenv(cuda_launch.ENVIRONMENT_SWITCH, raising=False)
    assert cuda_launch.wanted("cuda", "90")
    assert cuda_launch.wanted("cuda", "100")
    assert not cuda_launch.wanted("cuda", "80")
    assert not cuda_launch.wanted("hip", "90")  # the HIP sources' kernels do not wait
    monkeypatch.setenv(cuda_launch.ENVIRONMENT_SWITCH, "0")
    assert not cuda_launch.wanted("cuda", "90")


def _kernel_bodies(text: str):
    """(name, the first statement of the body) of each extern "C" __global__ kernel."""
    for match in re.finditer(r'extern "C" __global__[^{]*?(\w+)\(', text):
        body = text.index("{", match.end())
        first = text[body + 1:].lstrip(" \\\n").split(";", 1)[0]
        yield match.group(1), first.strip()


@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_every_kernel_waits_for_its_predecessors_first(vendor):
    # A kernel launched programmatically that touched memory before RLP_GRID_DEPENDENCY() would race
    # with the kernel before it; the HIP sources keep the (empty) call so both read line for line.
    for family in families(vendor):
        text = kernel_source_path(vendor, family).read_text()
        kernels = list(_kernel_bodies(text))
        assert len(kernels) == text.count('extern "C" __global__') > 0, family
        for name, first in kernels:
            assert first == "RLP_GRID_DEPENDENCY()", f"{vendor} {family}: kernel {name} starts with {first!r}"
