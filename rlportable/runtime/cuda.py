"""The cuda backend: CuPy arrays, NVRTC-compiled kernels, cuBLAS int8 GEMM.

Every family has one portable source (backends/portable), compiled behind the
prelude backends/cuda/prelude.h that maps the portable dialect's few HIP names
to CUDA ones; where NVIDIA has fast paths for a family, backends/cuda/<family>.cu
adds them (it includes the portable source). With kernel_source="hip" the
portable source alone compiles: what an AMD GPU runs, here with a warp of 32.

The engine's step loop (engine/runner.py) runs on one non-default stream (graph
capture cannot use the legacy default stream), copies its metadata to the device
through pinned staging buffers (asynchronous copies), and replays decode steps as
CUDA graphs captured with CuPy's stream capture (native CUDA sources only: the
graph must use the fused GEMM, and CuPy refuses cuBLAS calls inside a capture).
"""

from __future__ import annotations

import contextlib

import numpy as np

from rlportable.errors import BackendUnavailable, KernelCompileError
from rlportable.runtime import cache, flags
from rlportable.runtime.base import Backend, assemble_source

PORTABLE_PRELUDE = "cuda/prelude.h"  # the portable dialect (and the HIP sources) on NVIDIA, under backends/

# cuBLAS enums (cublas_api.h, library_types.h)
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_R_8I, _CUDA_R_32I = 3, 10
_CUBLAS_COMPUTE_32I = 72
_CUBLAS_GEMM_DEFAULT = -1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h CUfunction_attribute


def probe() -> tuple[bool, str]:
    """(available, reason) without raising."""
    try:
        import cupy
    except ImportError as error:
        return False, f"CuPy is not installed ({error}); pip install 'rlportable[cuda]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: no driver, or driver too old
        return False, f"no usable CUDA driver ({error})"
    if count == 0:
        return False, "the CUDA driver sees no device"
    return True, f"{count} device(s)"


class CudaBackend(Backend):
    name = "cuda"
    async_downloads = True  # start_download queues the copies and an event; the host waits at wait()

    def __init__(self, kernel_source: str = "cuda"):
        available, reason = probe()
        if not available:
            raise BackendUnavailable(f"device 'cuda' is unavailable: {reason}")
        import cupy

        self.cupy = cupy
        self.kernel_vendor = kernel_source
        self.device = cupy.cuda.Device()
        self.compute_capability = self.device.compute_capability  # e.g. "90"
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._shared_limits: dict[int, int] = {}  # function pointer -> dynamic shared memory it opted in to
        self.supports_graphs = kernel_source == "cuda"
        self._stream = None  # the engine's stream
        self._graph_pool = None  # memory of captured work (see capture_graph)
        self._uploads: list[list] = []  # [pinned host buffer, event after the last copy from it]
        self._free_downloads: list[_PinnedDownload] = []  # pinned buffers no pending download uses

    @property
    def label(self):
        return "cuda" if self.kernel_vendor == "cuda" else "cuda (hip sources)"

    # ---- arrays
    def asarray(self, array):
        return self.cupy.asarray(np.ascontiguousarray(array))

    def to_numpy(self, array):
        return self.cupy.asnumpy(array)

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return self.cupy.zeros(shape, dtype=dtype)

    def synchronize(self):
        self.cupy.cuda.runtime.deviceSynchronize()

    # ---- kernels
    def compile_options(self) -> tuple[str, ...]:
        options = flags.CUDA_OPTIONS + (flags.cuda_arch_option(self.compute_capability),)
        if self.kernel_vendor == "hip":
            options += ("-DRLP_HIP_ON_CUDA=1",)
        return options

    def source(self, family: str) -> str:
        """The family's source behind the CUDA prelude: backends/cuda/<family>.cu where NVIDIA has fast
        paths for it (that file includes the portable source), else backends/portable/<family>.hip; with
        kernel_source="hip" the source an AMD GPU compiles."""
        return assemble_source(self.kernel_vendor, family, prelude=PORTABLE_PRELUDE)

    def module(self, family: str):
        if family not in self._modules:
            source = self.source(family)
            options = self.compile_options()
            key = cache.cache_key(source, options, f"sm_{self.compute_capability}", _nvrtc_version())
            cubin = cache.cached_binary(key, ".cubin", lambda: _nvrtc_compile(source, family, options))
            module = self.cupy.cuda.function.Module()
            module.load(cubin)
            self._modules[family] = module
        return self._modules[family]

    def function(self, family: str, kernel: str):
        key = (family, kernel)
        if key not in self._functions:
            self._functions[key] = self.module(family).get_function(kernel)
        return self._functions[key]

    def launch(self, family, kernel, grid, block, args, shared_mem=0):
        function = self.function(family, kernel)
        if shared_mem > max(48 * 1024, self._shared_limits.get(function.ptr, 0)):
            # above the default limit a kernel must opt in (once per size, not at every launch)
            self.cupy.cuda.driver.funcSetAttribute(function.ptr, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                   shared_mem)
            self._shared_limits[function.ptr] = shared_mem
        function(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)

    # ---- the engine's step loop: stream, transfers, graphs
    def engine_stream(self):
        """The engine's stream (a CuPy Stream is the context manager that makes it current). It is a
        blocking stream, so it stays ordered with work on the legacy default stream."""
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=False)
        return self._stream

    @staticmethod
    def _pinned(nbytes: int, previous: np.ndarray | None) -> np.ndarray:
        """A pinned host buffer of at least nbytes (at least twice the one it replaces)."""
        import cupyx

        size = max(nbytes, 1 << 16, 2 * (previous.size if previous is not None else 0))
        return cupyx.empty_pinned((size,), dtype=np.uint8)

    def upload(self, buffer, host):
        """One asynchronous host-to-device copy on the current stream, from a pinned staging buffer
        that no pending copy still reads: the first of a small ring whose event has completed (a
        non-blocking query), or a new one. So the host never waits for the device here."""
        cupy = self.cupy
        nbytes = int(host.nbytes)
        if nbytes == 0:
            return
        slot = next((slot for slot in self._uploads if slot[1].done), None)
        if slot is None:
            slot = [None, cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)]
            self._uploads.append(slot)
        if slot[0] is None or slot[0].size < nbytes:
            slot[0] = self._pinned(nbytes, slot[0])
        slot[0][:nbytes] = host
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(buffer.data.ptr, slot[0].ctypes.data, nbytes,
                                      cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        slot[1].record(stream)

    def start_download(self, arrays):
        """Asynchronous device-to-host copies of every array into one pinned buffer, behind the work
        queued so far on the current stream, and an event after them; the host does not wait here.
        Each pending download has a pinned buffer of its own (a small pool), so a later step's download
        never overwrites copies the host has not read yet."""
        cupy = self.cupy
        arrays = [a if a.flags.c_contiguous else cupy.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += -(-int(array.nbytes) // 16) * 16
        staging = self._free_downloads.pop() if self._free_downloads else _PinnedDownload(cupy)
        if staging.buffer is None or staging.buffer.size < total:
            staging.buffer = self._pinned(total, staging.buffer)
        stream = cupy.cuda.get_current_stream()
        for array, offset in zip(arrays, offsets):
            if array.nbytes:
                cupy.cuda.runtime.memcpyAsync(staging.buffer.ctypes.data + offset, array.data.ptr, int(array.nbytes),
                                              cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        staging.event.record(stream)
        return _CudaDownload(self, staging, arrays, offsets)

    def capture_graph(self, function):
        """(CudaGraph, function()) with function's kernels captured on the engine stream, not run.

        Arrays the captured work allocates come from a private memory pool (only captures use it):
        a buffer freed after the capture goes back to that pool, never to the eager code, so no
        eager array can ever alias memory a replay writes. Later captures reuse those buffers,
        which is safe because graphs replay one at a time on the engine stream; what `function`
        returns (the graph's outputs) stays alive with the caller, so no other capture reuses it."""
        cupy = self.cupy
        if self._graph_pool is None:
            self._graph_pool = cupy.cuda.MemoryPool()
        stream = self.engine_stream()
        with stream, cupy.cuda.using_allocator(self._graph_pool.malloc):
            stream.begin_capture()
            try:
                result = function()
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return CudaGraph(graph, stream), result

    def release_graph_memory(self):
        if self._graph_pool is not None:
            self._graph_pool.free_all_blocks()

    # ---- vendor integer GEMM
    def gemm_s8_s32(self, m, n, k, a, a_offset, lda, b, b_offset, ldb, c, c_offset, ldc):
        """Column-major C[m, n] (int32) = op(A)^T-form: C = A^T B with A [k, m] and B [k, n].

        In row-major terms: C_rm[n, m] = B_rm[n, k] @ A_rm[m, k].T, i.e. each output
        is the exact int32 dot product of a row of A and a row of B (cuBLAS TN form,
        the one int8 tensor-core layout every architecture supports).
        Offsets are in elements.
        """
        from cupy.cuda import cublas

        handle = self.device.cublas_handle
        cublas.setStream(handle, self.cupy.cuda.get_current_stream().ptr)
        one = np.array(1, dtype=np.int32)
        zero = np.array(0, dtype=np.int32)
        cublas.gemmEx(
            handle, _CUBLAS_OP_T, _CUBLAS_OP_N, m, n, k,
            one.ctypes.data, a.data.ptr + a_offset, _CUDA_R_8I, lda,
            b.data.ptr + b_offset, _CUDA_R_8I, ldb,
            zero.ctypes.data, c.data.ptr + 4 * c_offset, _CUDA_R_32I, ldc,
            _CUBLAS_COMPUTE_32I, _CUBLAS_GEMM_DEFAULT,
        )

    def info(self):
        cupy = self.cupy
        properties = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        name = properties["name"]
        return {
            "backend": self.label,
            "device": name.decode() if isinstance(name, bytes) else str(name),
            "arch": f"sm_{self.compute_capability}",
            "cupy": cupy.__version__,
            "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
            "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
            "nvrtc": _nvrtc_version(),
            "cublas": cupy.cuda.cublas.getVersion(self.device.cublas_handle),
        }


class _PinnedDownload:
    """A pinned host buffer that device-to-host copies land in, and the event recorded after them."""

    def __init__(self, cupy):
        self.buffer = None
        self.event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)


class _CudaDownload:
    """A download in flight (CudaBackend.start_download): wait() waits for its event only (not for work
    queued after it), copies the arrays out of the pinned buffer and gives the buffer back."""

    def __init__(self, backend: CudaBackend, staging: _PinnedDownload, arrays: list, offsets: list[int]):
        self._backend, self._staging = backend, staging
        self._arrays = arrays  # kept alive until the copies have run
        self._offsets = offsets
        self._result = None

    def wait(self) -> list[np.ndarray]:
        if self._result is None:
            staging = self._staging
            staging.event.synchronize()
            self._result = [staging.buffer[offset: offset + array.nbytes].view(array.dtype).reshape(array.shape).copy()
                            for array, offset in zip(self._arrays, self._offsets)]
            self._arrays = None
            self._backend._free_downloads.append(staging)
        return self._result


class CudaGraph:
    """A captured CUDA graph (cupy.cuda.Graph), replayed on the engine stream."""

    def __init__(self, graph, stream):
        self.graph = graph
        self.stream = stream

    def replay(self) -> None:
        self.graph.launch(self.stream)


def _nvrtc_version() -> str:
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return f"nvrtc-{major}.{minor}"


def _nvrtc_compile(source: str, family: str, options: tuple[str, ...]) -> bytes:
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, f"{family}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(f"NVRTC failed on kernel family '{family}': {error}\n{log}") from None
        return nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
