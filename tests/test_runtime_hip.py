"""The hip backend's parts that run without an AMD GPU: probe, argument packing, HipArray, GemmEx forms."""

from __future__ import annotations

import ctypes
import enum
import gc
import sys
import types

import numpy as np
import pytest

from rlportable.errors import BackendUnavailable, InputError, RlpError
from rlportable.runtime import hip as hip_runtime
from rlportable.runtime.hip_array import HipArray, check_hip


# ---- a stand-in device: host memory behind the HipMemory interface
class FakeMemory:
    def __init__(self):
        self.blocks: dict[int, ctypes.Array] = {}
        self.freed: list[int] = []

    def malloc(self, nbytes):
        if nbytes == 0:
            return 0
        block = ctypes.create_string_buffer(nbytes)
        self.blocks[ctypes.addressof(block)] = block
        return ctypes.addressof(block)

    def free(self, ptr):
        del self.blocks[ptr]
        self.freed.append(ptr)

    def host_to_device(self, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    device_to_host = device_to_device = host_to_device

    def memset(self, dst, value, nbytes):
        ctypes.memset(dst, value, nbytes)


# ---- probe


def test_probe_without_hip_python(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)  # makes `from hip import hip` raise ImportError
    available, reason = hip_runtime.probe()
    assert available is False
    assert "hip-python is not installed" in reason and "rlportable[hip]" in reason


def test_backend_without_hip_python_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)
    with pytest.raises(BackendUnavailable, match="device 'hip' is unavailable: hip-python is not installed"):
        hip_runtime.HipBackend()


class _Status(enum.IntEnum):
    hipSuccess = 0
    hipErrorNoDevice = 100


def _fake_hip_package(monkeypatch, get_device_count, with_hipblas=True):
    package = types.ModuleType("hip")
    package.__path__ = []  # a package whose only submodules are the ones set below
    runtime = types.ModuleType("hip.hip")
    runtime.hipGetDeviceCount = get_device_count
    package.hip = runtime
    package.hiprtc = types.ModuleType("hip.hiprtc")
    monkeypatch.setitem(sys.modules, "hip", package)
    monkeypatch.setitem(sys.modules, "hip.hip", runtime)
    monkeypatch.setitem(sys.modules, "hip.hiprtc", package.hiprtc)
    if with_hipblas:
        blas = types.ModuleType("hip.hipblas")
        package.hipblas = blas
        monkeypatch.setitem(sys.modules, "hip.hipblas", blas)


def test_probe_without_rocm_runtime(monkeypatch):
    def missing_library():
        raise RuntimeError("failed to dlopen 'libamdhip64.so': cannot open shared object file")

    _fake_hip_package(monkeypatch, missing_library)
    available, reason = hip_runtime.probe()
    assert available is False and "ROCm runtime library" in reason


def test_probe_without_device(monkeypatch):
    _fake_hip_package(monkeypatch, lambda: (_Status.hipErrorNoDevice, 0))
    available, reason = hip_runtime.probe()
    assert available is False and "hipErrorNoDevice" in reason


def test_probe_without_hipblas_bindings(monkeypatch):
    _fake_hip_package(monkeypatch, lambda: (_Status.hipSuccess, 1), with_hipblas=False)
    available, reason = hip_runtime.probe()
    assert available is False and "hipBLAS" in reason


def test_probe_with_a_device(monkeypatch):
    _fake_hip_package(monkeypatch, lambda: (_Status.hipSuccess, 2))
    assert hip_runtime.probe() == (True, "2 device(s)")


def test_probe_never_raises_on_odd_answers(monkeypatch):
    _fake_hip_package(monkeypatch, lambda: "not a tuple")
    available, reason = hip_runtime.probe()
    assert available is False and reason


def test_check_hip():
    assert check_hip((_Status.hipSuccess,), "call") is None
    assert check_hip((_Status.hipSuccess, 7), "call") == 7
    assert check_hip((_Status.hipSuccess, 1, 2), "call") == (1, 2)
    with pytest.raises(RlpError, match=r"hipMalloc failed: hipErrorNoDevice \(100\)"):
        check_hip((_Status.hipErrorNoDevice, None), "hipMalloc")


# ---- kernel arguments


def _struct_bytes(fields) -> bytes:
    """The C layout of the arguments, from ctypes (natural alignment, like the kernarg segment)."""
    layout = type("Args", (ctypes.Structure,), {"_fields_": [(f"f{i}", t) for i, (t, _) in enumerate(fields)]})
    return bytes(layout(*[v for _, v in fields]))


def test_pack_matches_the_c_layout_of_fixedpoint_encode_rows():
    memory = FakeMemory()
    x, digits, exponents = (HipArray((4, 8), dtype, memory=memory) for dtype in (np.float32, np.int8, np.int32))
    args = (x, np.int64(4), np.int32(8), np.int32(64), np.int32(23), np.int32(3), np.int32(1), digits, exponents)
    expected = _struct_bytes([
        (ctypes.c_void_p, x.ptr), (ctypes.c_longlong, 4), (ctypes.c_int, 8), (ctypes.c_int, 64),
        (ctypes.c_int, 23), (ctypes.c_int, 3), (ctypes.c_int, 1), (ctypes.c_void_p, digits.ptr),
        (ctypes.c_void_p, exponents.ptr),
    ])
    assert hip_runtime.pack_kernel_args(args) == expected
    assert len(expected) == 56  # the int before `digits` is followed by 4 bytes of padding


def test_pack_matches_the_c_layout_of_rowsum_and_gemm_combine():
    memory = FakeMemory()
    x, y = HipArray((3, 5), np.float32, memory=memory), HipArray((3,), np.float32, memory=memory)
    packed = hip_runtime.pack_kernel_args((x, np.int64(3), np.int32(5), np.int32(38), y))
    assert packed == _struct_bytes([(ctypes.c_void_p, x.ptr), (ctypes.c_longlong, 3), (ctypes.c_int, 5),
                                    (ctypes.c_int, 38), (ctypes.c_void_p, y.ptr)])
    g = HipArray((4, 2, 3), np.int32, memory=memory)
    packed = hip_runtime.pack_kernel_args(
        (g, np.int32(4), np.int64(2), np.int64(3), x, y, np.int32(-34), y[1:]))
    assert packed == _struct_bytes([
        (ctypes.c_void_p, g.ptr), (ctypes.c_int, 4), (ctypes.c_longlong, 2), (ctypes.c_longlong, 3),
        (ctypes.c_void_p, x.ptr), (ctypes.c_void_p, y.ptr), (ctypes.c_int, -34), (ctypes.c_void_p, y.ptr + 4),
    ])


def test_pack_scalars_of_every_width():
    packed = hip_runtime.pack_kernel_args((np.int8(-1), np.float32(1.5), np.uint16(7), np.float64(-2.0), np.int8(3)))
    assert packed == _struct_bytes([(ctypes.c_int8, -1), (ctypes.c_float, 1.5), (ctypes.c_uint16, 7),
                                    (ctypes.c_double, -2.0), (ctypes.c_int8, 3)])


def test_pack_takes_cuda_array_interface_objects():
    class Foreign:
        __cuda_array_interface__ = {"data": (0x1234, False), "shape": (1,), "typestr": "<f4", "version": 3}

    assert hip_runtime.pack_kernel_args((Foreign(),)) == (0x1234).to_bytes(8, "little")


@pytest.mark.parametrize("bad", [3, 2.5, True, "x", np.complex64(1)])
def test_pack_rejects_arguments_of_unclear_width(bad):
    with pytest.raises(InputError, match="kernel argument #1"):
        hip_runtime.pack_kernel_args((np.int32(0), bad))


def test_launch_extra_is_the_hip_launch_param_array():
    packed = hip_runtime.pack_kernel_args((np.int32(5), np.int64(6)))
    address, keep_alive = hip_runtime.launch_extra(packed)
    config = (ctypes.c_void_p * 5).from_address(address)
    assert config[0] == hip_runtime.HIP_LAUNCH_PARAM_BUFFER_POINTER == 1
    assert config[2] == hip_runtime.HIP_LAUNCH_PARAM_BUFFER_SIZE == 2
    assert config[4] == hip_runtime.HIP_LAUNCH_PARAM_END == 3
    assert ctypes.string_at(config[1], len(packed)) == packed
    assert ctypes.c_size_t.from_address(config[3]).value == len(packed) == 16
    del keep_alive


def test_launch_dims():
    assert hip_runtime.launch_dims(7, "grid") == (7, 1, 1)
    assert hip_runtime.launch_dims((7, 2), "grid") == (7, 2, 1)
    with pytest.raises(InputError):
        hip_runtime.launch_dims((0,), "block")
    with pytest.raises(InputError):
        hip_runtime.launch_dims((1, 1, 1, 1), "block")


def test_compile_options_follow_flags():
    from rlportable.runtime import flags

    options = hip_runtime.hip_compile_options("gfx942:sramecc+:xnack-")
    assert options == flags.HIP_OPTIONS + ("--offload-arch=gfx942",)
    assert "-ffp-contract=off" in options


# ---- HipArray on the stand-in memory


def test_hip_array_round_trip_and_views():
    memory = FakeMemory()
    host = np.arange(24, dtype=np.float32).reshape(4, 6)
    array = HipArray.from_numpy(host, memory=memory)
    assert (array.shape, array.dtype, array.size, array.nbytes, array.ndim) == ((4, 6), np.float32, 24, 96, 2)
    assert array.strides == (24, 4) and len(array) == 4
    np.testing.assert_array_equal(array.get(), host)
    np.testing.assert_array_equal(array[1:3].get(), host[1:3])
    np.testing.assert_array_equal(array[2].get(), host[2])
    np.testing.assert_array_equal(array[-1].get(), host[-1])
    np.testing.assert_array_equal(array[3:].get(), host[3:])
    assert array[4:].shape == (0, 6)
    np.testing.assert_array_equal(array.reshape(2, -1).get(), host.reshape(2, -1))
    np.testing.assert_array_equal(array.reshape((3, 8)).get(), host.reshape(3, 8))
    np.testing.assert_array_equal(array.ravel().get(), host.ravel())
    np.testing.assert_array_equal(array.view(np.int32).get(), host.view(np.int32))
    np.testing.assert_array_equal(array.copy().get(), host)
    interface = array.__cuda_array_interface__
    assert interface["data"] == (array.ptr, False) and interface["typestr"] == "<f4" and interface["shape"] == (4, 6)
    with pytest.raises(InputError):
        array.reshape(5, 5)
    with pytest.raises(InputError):
        array[::2]
    with pytest.raises(IndexError):
        array[4]


def test_hip_array_zeros_copy_in_and_empty():
    memory = FakeMemory()
    zeros = HipArray.zeros((3, 2), np.int64, memory=memory)
    np.testing.assert_array_equal(zeros.get(), np.zeros((3, 2), np.int64))
    zeros.copy_from_numpy(np.ones((3, 2)))
    np.testing.assert_array_equal(zeros.get(), np.ones((3, 2), np.int64))
    with pytest.raises(InputError):
        zeros.copy_from_numpy(np.ones(5))
    empty = HipArray((0, 4), np.float32, memory=memory)
    assert empty.ptr == 0 and empty.get().shape == (0, 4)


def test_hip_array_memory_is_freed_after_the_last_view():
    memory = FakeMemory()
    array = HipArray((8,), np.float32, memory=memory)
    ptr = array.ptr
    view = array[2:]
    del array
    gc.collect()
    assert memory.freed == []  # the view keeps the allocation
    del view
    gc.collect()
    assert memory.freed == [ptr]


# ---- hipblasGemmEx: the enum form this hip-python takes


def _fake_blas_backend(accepts: str):
    """A HipBackend without a GPU whose hipblas binding accepts one enum form."""
    Op = enum.IntEnum("hipblasOperation_t", {"HIPBLAS_OP_N": 111, "HIPBLAS_OP_T": 112})
    Algo = enum.IntEnum("hipblasGemmAlgo_t", {"HIPBLAS_GEMM_DEFAULT": 160})
    OldType = enum.IntEnum("hipblasDatatype_t", {"HIPBLAS_R_8I": 160, "HIPBLAS_R_32I": 162})
    NewType = enum.IntEnum("hipDataType", {"HIP_R_8I": 3, "HIP_R_32I": 10})
    Compute = enum.IntEnum("hipblasComputeType_t", {"HIPBLAS_COMPUTE_32I": 11})
    calls = []

    def gemm_ex(handle, ta, tb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc, compute, algo):
        wanted = OldType if accepts == "old" else NewType
        if not isinstance(a_type, wanted):
            raise TypeError("argument 'aType' must be of another enum type")
        calls.append(dict(ta=ta, tb=tb, m=m, n=n, k=k, a=a, b=b, c=c, lda=lda, ldb=ldb, ldc=ldc,
                          a_type=a_type, c_type=c_type, compute=compute, algo=algo,
                          alpha=ctypes.c_int32.from_address(alpha).value, beta=ctypes.c_int32.from_address(beta).value))
        return (_Status.hipSuccess,)

    hipblas = types.SimpleNamespace(hipblasOperation_t=Op, hipblasGemmAlgo_t=Algo, hipblasDatatype_t=OldType,
                                    hipblasComputeType_t=Compute, hipblasGemmEx=gemm_ex)
    hip = types.SimpleNamespace(hipDataType=NewType)
    backend = hip_runtime.HipBackend.__new__(hip_runtime.HipBackend)
    backend.hip, backend.hipblas = hip, hipblas
    backend._blas_handle, backend._gemm_form = object(), None
    backend.stream = backend._blas_stream = None  # kernels on the null stream: no hipblasSetStream
    return backend, calls, (OldType, NewType, Compute, Op)


@pytest.mark.parametrize("accepts", ["old", "new"])
def test_gemm_s8_s32_takes_the_form_hip_python_accepts(accepts):
    backend, calls, (OldType, NewType, Compute, Op) = _fake_blas_backend(accepts)
    memory = FakeMemory()
    a, b = HipArray((64,), np.int8, memory=memory), HipArray((64,), np.int8, memory=memory)
    c = HipArray((16,), np.int32, memory=memory)
    backend.gemm_s8_s32(2, 3, 32, a, 5, 64, b, 6, 64, c, 4, 2)
    (call,) = calls
    assert (call["ta"], call["tb"]) == (Op.HIPBLAS_OP_T, Op.HIPBLAS_OP_N)
    assert (call["m"], call["n"], call["k"], call["lda"], call["ldb"], call["ldc"]) == (2, 3, 32, 64, 64, 2)
    assert (call["a"], call["b"], call["c"]) == (a.ptr + 5, b.ptr + 6, c.ptr + 16)  # offsets in elements
    assert (call["alpha"], call["beta"]) == (1, 0)
    if accepts == "old":
        assert (call["a_type"], call["c_type"], call["compute"]) == (
            OldType.HIPBLAS_R_8I, OldType.HIPBLAS_R_32I, OldType.HIPBLAS_R_32I)
    else:
        assert (call["a_type"], call["c_type"], call["compute"]) == (
            NewType.HIP_R_8I, NewType.HIP_R_32I, Compute.HIPBLAS_COMPUTE_32I)
    backend.gemm_s8_s32(2, 3, 32, a, 0, 64, b, 0, 64, c, 0, 2)  # the learned form is used first
    assert len(calls) == 2
