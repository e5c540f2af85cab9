"""The hip backend: hip-python arrays (HipArray), hiprtc-compiled kernels from backends/portable, hipBLAS int8 GEMM.

It mirrors the cuda backend (runtime/cuda.py) call for call. hip-python's
conventions it relies on (hip-python 6.x, the `hip` package: modules hip.hip,
hip.hiprtc, hip.hipblas):
  * every call returns a tuple whose first entry is the status (hipError_t,
    hiprtcResult, hipblasStatus_t; 0 is success) followed by the outputs, e.g.
    `err, count = hip.hipGetDeviceCount()`; `check_hip` unpacks and raises;
  * pointer arguments accept Python ints (device addresses), buffers
    (bytearray, NumPy arrays) and objects with __cuda_array_interface__;
  * the ROCm libraries are opened lazily, at the first call, so `import hip`
    works without ROCm and the first call raises RuntimeError("failed to dlopen ...");
  * hipModuleLaunchKernel's `extra` takes a pointer (an int) to the standard
    HIP_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END array; the argument buffer is
    packed here by `pack_kernel_args` (natural alignment, the kernarg ABI).

Decode steps replay HIP graphs (hipStreamBeginCapture / EndCapture / GraphInstantiateWithFlags /
GraphLaunch), the same design as the cuda backend's CUDA graphs: kernels launch on the engine's
stream while it is current, and memory freed during a capture is kept until its graph is dropped
(a replay still uses it). This path has never run on an AMD GPU (none was available); like
everything else here, `rlportable conform --device hip` is what checks it.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct

import numpy as np

from rlportable.errors import BackendUnavailable, InputError, KernelCompileError
from rlportable.runtime import cache, flags
from rlportable.runtime.base import Backend, assemble_source
from rlportable.runtime.hip_array import HipArray, HipMemory, check_hip

# hip_runtime_api.h
HIP_LAUNCH_PARAM_BUFFER_POINTER = 0x01
HIP_LAUNCH_PARAM_BUFFER_SIZE = 0x02
HIP_LAUNCH_PARAM_END = 0x03
_POINTER_BYTES = 8  # 64-bit device addresses on every ROCm target


def hip_compile_options(gcn_arch: str) -> tuple[str, ...]:
    """hiprtc options for a device, e.g. 'gfx942:sramecc+:xnack-' (CI's hipcc build uses the same)."""
    return flags.HIP_OPTIONS + (flags.hip_arch_option(gcn_arch),)


def probe() -> tuple[bool, str]:
    """(available, reason) without raising: hip-python installed, ROCm runtime loadable, a device present."""
    try:
        from hip import hip
    except ImportError as error:
        return False, f"hip-python is not installed ({error}); pip install 'rlportable[hip]'"
    except Exception as error:  # a broken installation
        return False, f"hip-python failed to import ({type(error).__name__}: {error})"
    try:
        from hip import hipblas, hiprtc  # noqa: F401
    except Exception as error:  # hip-python 7+ ships hipBLAS in an extra
        return False, (f"hip-python's hiprtc/hipBLAS bindings are missing ({error}); "
                       "pip install 'hip-python[libraries]'")
    try:
        status, count = hip.hipGetDeviceCount()
    except Exception as error:  # hip-python raises RuntimeError when libamdhip64.so cannot be opened
        text = str(error)
        if "dlopen" in text or isinstance(error, OSError):
            return False, f"the ROCm runtime library (libamdhip64.so) cannot be loaded ({text})"
        return False, f"the HIP runtime failed ({type(error).__name__}: {text})"
    try:
        code = int(status)
    except Exception:
        code = -1
    if code != 0:
        name = getattr(status, "name", str(status))
        return False, f"no usable AMD GPU: hipGetDeviceCount returned {name}"
    if count == 0:
        return False, "the HIP runtime sees no device"
    return True, f"{count} device(s)"


# ---- kernel arguments


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

    This is the layout of a C struct holding the arguments (the AMDGPU kernarg
    ABI, and what HIP_LAUNCH_PARAM_BUFFER_POINTER expects): device pointers as
    8-byte addresses, NumPy scalars by value with alignment = item size, the
    total padded to the largest alignment.
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


def launch_extra(packed: bytes) -> tuple[int, tuple]:
    """(address of the `extra` config array, objects to keep alive until the launch returns).

    extra = {HIP_LAUNCH_PARAM_BUFFER_POINTER, &buffer, HIP_LAUNCH_PARAM_BUFFER_SIZE, &size,
             HIP_LAUNCH_PARAM_END}; hipModuleLaunchKernel copies the arguments before it returns.
    """
    buffer = ctypes.create_string_buffer(packed, max(len(packed), 1))
    size = ctypes.c_size_t(len(packed))
    config = (ctypes.c_void_p * 5)(
        HIP_LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(buffer),
        HIP_LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size),
        HIP_LAUNCH_PARAM_END,
    )
    return ctypes.addressof(config), (buffer, size, config)


def launch_dims(dims, what: str) -> tuple[int, int, int]:
    """A grid or block given as an int or a 1-3 tuple -> (x, y, z)."""
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    dims = tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise InputError(f"kernel launch: {what} must be 1 to 3 positive sizes, got {dims}")
    return dims + (1,) * (3 - len(dims))


class GraphMemory(HipMemory):
    """HipMemory whose frees are held back while a graph is captured: memory that captured work
    used must stay allocated for every replay, so it is freed only when its graph is dropped."""

    def __init__(self, hip_module=None):
        super().__init__(hip_module)
        self.held: list[int] | None = None  # a list while a capture is open

    def free(self, ptr: int) -> None:
        if self.held is not None and ptr:
            self.held.append(ptr)
            return
        super().free(ptr)


class HipGraph:
    """An instantiated HIP graph, replayed on the engine stream; owns the memory its capture freed."""

    def __init__(self, hip, graph, graph_exec, stream, held: list[int], memory: HipMemory):
        self.hip, self.graph, self.graph_exec, self.stream = hip, graph, graph_exec, stream
        self.held, self.memory = held, memory

    def replay(self) -> None:
        check_hip(self.hip.hipGraphLaunch(self.graph_exec, self.stream), "hipGraphLaunch")

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown or a lost device
            self.hip.hipGraphExecDestroy(self.graph_exec)
            self.hip.hipGraphDestroy(self.graph)
        for ptr in self.held:  # hipFree waits for the device, so no replay still uses them
            with contextlib.suppress(Exception):
                HipMemory.free(self.memory, ptr)


def _text(value) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


#: AMD targets with integer MFMA kernels in backends/hip (v_mfma_i32_16x16x32_i8; 16x16x16i8)
MFMA_ARCHS = ("gfx942", "gfx90a")


class HipBackend(Backend):
    name = "hip"
    kernel_vendor = "hip"

    def __init__(self, device: int | None = None):
        available, reason = probe()
        if not available:
            raise BackendUnavailable(f"device 'hip' is unavailable: {reason}")
        from hip import hip, hipblas, hiprtc

        self.hip, self.hiprtc, self.hipblas = hip, hiprtc, hipblas
        if device is not None:
            check_hip(hip.hipSetDevice(int(device)), f"hipSetDevice({device})")
        self.device_id = check_hip(hip.hipGetDevice(), "hipGetDevice")
        properties = hip.hipDeviceProp_t()
        check_hip(hip.hipGetDeviceProperties(properties, self.device_id), "hipGetDeviceProperties")
        self.gcn_arch = _text(properties.gcnArchName)  # e.g. "gfx942:sramecc+:xnack-"
        self.device_name = _text(properties.name)
        self.memory = GraphMemory(hip)
        self.stream = None  # where kernels launch: None (the null stream), or the engine stream while current
        self._engine_stream = None
        self.supports_graphs = True
        self._modules: dict[str, object] = {}
        self._images: dict[str, bytearray] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._blas_handle = None
        self._blas_stream = None  # the stream the hipBLAS handle was last set to
        self._gemm_form = None  # which hipblasGemmEx enum form this hip-python takes

    @property
    def label(self):
        return "hip"

    # ---- arrays
    def asarray(self, array):
        if isinstance(array, HipArray):
            return array
        return HipArray.from_numpy(np.ascontiguousarray(array), memory=self.memory)

    def to_numpy(self, array):
        if isinstance(array, HipArray):
            return array.get()
        return np.asarray(array)

    def empty(self, shape, dtype):
        return HipArray(shape, dtype, memory=self.memory)

    def zeros(self, shape, dtype):
        return HipArray.zeros(shape, dtype, memory=self.memory)

    def synchronize(self):
        check_hip(self.hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    # ---- kernels
    @property
    def mfma_archs(self) -> tuple[str, ...]:
        """The targets whose MFMA kernels it runs (backends/hip): its own, where one is built for it."""
        arch = self.gcn_arch.split(":")[0]
        return (arch,) if arch in MFMA_ARCHS else ()

    def compile_options(self) -> tuple[str, ...]:
        return hip_compile_options(self.gcn_arch)

    def source(self, family: str) -> str:
        return assemble_source("hip", family)

    def compiler_version(self) -> str:
        major, minor = check_hip(self.hiprtc.hiprtcVersion(), "hiprtcVersion")
        runtime = check_hip(self.hip.hipRuntimeGetVersion(), "hipRuntimeGetVersion")
        return f"hiprtc-{major}.{minor}-hip-{runtime}"

    def module(self, family: str):
        if family not in self._modules:
            source = self.source(family)
            options = self.compile_options()
            key = cache.cache_key(source, options, self.gcn_arch, self.compiler_version())
            code = cache.cached_binary(key, ".hsaco", lambda: self._hiprtc_compile(source, family, options))
            image = bytearray(code)
            module = check_hip(self.hip.hipModuleLoadData(image), f"hipModuleLoadData (kernel family '{family}')")
            self._images[family] = image
            self._modules[family] = module
        return self._modules[family]

    def function(self, family: str, kernel: str):
        key = (family, kernel)
        if key not in self._functions:
            self._functions[key] = check_hip(
                self.hip.hipModuleGetFunction(self.module(family), kernel.encode()),
                f"hipModuleGetFunction('{kernel}' in family '{family}')",
            )
        return self._functions[key]

    def launch(self, family, kernel, grid, block, args, shared_mem=0):
        function = self.function(family, kernel)
        gx, gy, gz = launch_dims(grid, "grid")
        bx, by, bz = launch_dims(block, "block")
        extra, keep_alive = launch_extra(pack_kernel_args(args))
        check_hip(
            self.hip.hipModuleLaunchKernel(function, gx, gy, gz, bx, by, bz, int(shared_mem), self.stream, None, extra),
            f"hipModuleLaunchKernel('{kernel}', grid={grid}, block={block}, shared_mem={shared_mem})",
        )
        del keep_alive

    # ---- the engine's step loop: stream, transfers, graphs
    @contextlib.contextmanager
    def engine_stream(self):
        """Kernels launch on the engine's stream inside this block. It is a blocking stream, so the
        synchronous copies of HipArray (null stream) stay ordered with it."""
        if self._engine_stream is None:
            self._engine_stream = check_hip(self.hip.hipStreamCreate(), "hipStreamCreate")
        previous, self.stream = self.stream, self._engine_stream
        try:
            yield self._engine_stream
        finally:
            self.stream = previous

    def upload(self, buffer, host):
        """A synchronous hipMemcpy (HipArray has no pinned staging yet)."""
        self.memory.host_to_device(buffer.ptr, np.ascontiguousarray(host).ctypes.data, int(host.nbytes))

    def copy_into(self, dst, src):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise InputError(f"copy_into: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
        dst.memory.device_to_device(dst.ptr, src.ptr, src.nbytes)

    def typed_view(self, buffer, offset, shape, dtype):
        return HipArray(shape, dtype, memory=buffer.memory, _allocation=buffer._allocation,
                        _ptr=buffer.ptr + int(offset))

    def capture_graph(self, function):
        """(HipGraph, function()) with function's kernels captured on the engine stream, not run.
        Captured code may allocate (hipMalloc, relaxed capture mode) but not copy or memset: HipArray
        does those synchronously on the null stream, which a capture refuses (a loud error)."""
        hip = self.hip
        with self.engine_stream() as stream:
            self.memory.held = []
            graph = graph_exec = None
            try:
                mode = hip.hipStreamCaptureMode.hipStreamCaptureModeRelaxed
                check_hip(hip.hipStreamBeginCapture(stream, mode), "hipStreamBeginCapture")
                try:
                    result = function()
                except BaseException:
                    with contextlib.suppress(Exception):  # end the capture; the error that matters is this one
                        graph = check_hip(hip.hipStreamEndCapture(stream), "hipStreamEndCapture")
                    raise
                graph = check_hip(hip.hipStreamEndCapture(stream), "hipStreamEndCapture")
                graph_exec = check_hip(hip.hipGraphInstantiateWithFlags(graph, 0), "hipGraphInstantiateWithFlags")
            except BaseException:
                held, self.memory.held = self.memory.held, None
                if graph is not None:
                    with contextlib.suppress(Exception):
                        hip.hipGraphDestroy(graph)
                for ptr in held:
                    self.memory.free(ptr)
                raise
            held, self.memory.held = self.memory.held, None
        return HipGraph(hip, graph, graph_exec, stream, held, self.memory), result

    def _hiprtc_compile(self, source: str, family: str, options: tuple[str, ...]) -> bytes:
        hiprtc = self.hiprtc
        program = check_hip(
            hiprtc.hiprtcCreateProgram(source.encode(), f"{family}.hip".encode(), 0, [], []),
            f"hiprtcCreateProgram('{family}')",
        )
        try:
            encoded = [option.encode() for option in options]
            (status,) = hiprtc.hiprtcCompileProgram(program, len(encoded), encoded)
            if int(status) != 0:
                log_size = check_hip(hiprtc.hiprtcGetProgramLogSize(program), "hiprtcGetProgramLogSize")
                log = bytearray(max(int(log_size), 1))
                check_hip(hiprtc.hiprtcGetProgramLog(program, log), "hiprtcGetProgramLog")
                name = getattr(status, "name", str(status))
                raise KernelCompileError(
                    f"hiprtc failed on kernel family '{family}' ({name}) "
                    f"with options {' '.join(options)}:\n{_text(log)}"
                )
            size = check_hip(hiprtc.hiprtcGetCodeSize(program), "hiprtcGetCodeSize")
            code = bytearray(int(size))
            check_hip(hiprtc.hiprtcGetCode(program, code), "hiprtcGetCode")
            return bytes(code)
        finally:
            hiprtc.hiprtcDestroyProgram(program.createRef())

    # ---- vendor integer GEMM
    def blas_handle(self):
        if self._blas_handle is None:
            self._blas_handle = check_hip(self.hipblas.hipblasCreate(), "hipblasCreate")
        return self._blas_handle

    def _gemm_forms(self):
        """hipblasGemmEx's enum arguments (a/b type, c type, compute type), in the forms hip-python may take.

        hip-python for ROCm 6.x binds the classic API (hipblasDatatype_t for all
        four); with hipBLAS's V2 API (the default from ROCm 7) the types are
        hipDataType and the compute type hipblasComputeType_t. hip-python checks
        the enum types before calling, so a wrong form fails with TypeError and
        never reaches the library.
        """
        hip, hipblas = self.hip, self.hipblas
        forms = []
        if hasattr(hipblas, "hipblasDatatype_t"):
            t = hipblas.hipblasDatatype_t
            forms.append(("hipblasDatatype_t", t.HIPBLAS_R_8I, t.HIPBLAS_R_32I, t.HIPBLAS_R_32I))
        data_type = getattr(hipblas, "hipDataType", None) or getattr(hip, "hipDataType", None)
        if data_type is not None and hasattr(hipblas, "hipblasComputeType_t"):
            forms.append(("hipDataType", data_type.HIP_R_8I, data_type.HIP_R_32I,
                          hipblas.hipblasComputeType_t.HIPBLAS_COMPUTE_32I))
        if self._gemm_form is not None:
            forms = [form for form in forms if form[0] == self._gemm_form] or forms
        return forms

    def gemm_s8_s32(self, m, n, k, a, a_offset, lda, b, b_offset, ldb, c, c_offset, ldc):
        """Column-major C[m, n] (int32) = A^T B with A [k, m] and B [k, n], int8 inputs, int32 compute.

        The same TN call as the cuda backend: in row-major terms C_rm[n, m] =
        B_rm[n, k] @ A_rm[m, k].T, every output the exact int32 dot product of a
        row of A and a row of B. Offsets are in elements.
        """
        hipblas = self.hipblas
        if self._blas_stream is not self.stream:  # hipBLAS runs on the stream kernels launch on (the engine's)
            check_hip(hipblas.hipblasSetStream(self.blas_handle(), self.stream), "hipblasSetStream")
            self._blas_stream = self.stream
        one = np.array(1, dtype=np.int32)
        zero = np.array(0, dtype=np.int32)
        a_ptr, b_ptr, c_ptr = a.ptr + int(a_offset), b.ptr + int(b_offset), c.ptr + 4 * int(c_offset)
        op_t, op_n = hipblas.hipblasOperation_t.HIPBLAS_OP_T, hipblas.hipblasOperation_t.HIPBLAS_OP_N
        algo = hipblas.hipblasGemmAlgo_t.HIPBLAS_GEMM_DEFAULT
        last_error = None
        for form, ab_type, c_type, compute in self._gemm_forms():
            try:
                result = hipblas.hipblasGemmEx(
                    self.blas_handle(), op_t, op_n, int(m), int(n), int(k),
                    one.ctypes.data, a_ptr, ab_type, int(lda),
                    b_ptr, ab_type, int(ldb),
                    zero.ctypes.data, c_ptr, c_type, int(ldc),
                    compute, algo,
                )
            except TypeError as error:  # this hip-python takes the other enum form
                last_error = error
                continue
            self._gemm_form = form
            check_hip(result, f"hipblasGemmEx (int8 x int8 -> int32, m={m} n={n} k={k})")
            return
        raise BackendUnavailable(f"hipblasGemmEx: this hip-python takes no known int8 GEMM form ({last_error})")

    def info(self):
        hip = self.hip
        try:
            from importlib.metadata import version

            hip_python = version("hip-python")
        except Exception:
            hip_python = "unknown"
        return {
            "backend": self.label,
            "device": self.device_name,
            "arch": self.gcn_arch,
            "hip_python": hip_python,
            "hip_runtime": check_hip(hip.hipRuntimeGetVersion(), "hipRuntimeGetVersion"),
            "hip_driver": check_hip(hip.hipDriverGetVersion(), "hipDriverGetVersion"),
            "hiprtc": self.compiler_version(),
        }

    def close(self) -> None:
        """Unload modules and the hipBLAS handle (also done at exit by the runtime)."""
        for module in self._modules.values():
            try:
                self.hip.hipModuleUnload(module)
            except Exception:
                pass
        self._modules.clear()
        self._functions.clear()
        self._images.clear()
        if self._blas_handle is not None:
            try:
                self.hipblas.hipblasDestroy(self._blas_handle)
            except Exception:
                pass
            self._blas_handle = None
