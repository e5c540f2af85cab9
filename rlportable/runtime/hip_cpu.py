"""The hip-cpu backend: the HIP kernel sources run on the CPU through AMD's HIP-CPU runtime.

HIP-CPU (github.com/ROCm/HIP-CPU, header-only, MIT) compiles HIP code with g++ and runs it on
the CPU: a block's threads are fibers on one OS thread, blocks spread over TBB's workers, and
warpSize is 64, the wavefront of AMD Instinct GPUs (MI300X). This backend compiles each kernel
family's HIP source (backends/portable, what an AMD GPU compiles) behind
backends/hip/cpu_prelude.h into a shared library, with one generated C entry point per kernel,
and launches it through ctypes on NumPy arrays (host memory is the device memory). It is how the
HIP sources run with a 64-lane wavefront where no AMD GPU is at hand: `rlportable conform
--device hip-cpu` checks them bit for bit against the NumPy reference.

Where HIP-CPU is: the environment variable RLPORTABLE_HIP_CPU (a checkout of it, the folder that
holds include/hip/hip_runtime.h). It needs g++ (or $CXX) with C++17 and TBB (Debian: libtbb-dev).
The vendor integer GEMM, hipBLAS on an AMD GPU, is NumPy's exact integer product here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from rlportable.errors import BackendUnavailable, InputError, KernelCompileError
from rlportable.runtime import cache
from rlportable.resources import assemble_text
from rlportable.runtime.base import Backend, assemble_source
from rlportable.runtime.hip import MFMA_ARCHS

ENVIRONMENT = "RLPORTABLE_HIP_CPU"
PRELUDE = "hip/cpu_prelude.h"  # under backends/
# The contract's arithmetic rules in g++'s spelling (flags.HIP_OPTIONS for clang): no contraction
# into fma, no fast math; x86-64 has no flush-to-zero unless fast math asks for it.
OPTIONS = ("-std=c++17", "-O1", "-fno-fast-math", "-ffp-contract=off", "-fPIC", "-shared",
           "-fvisibility=hidden", "-w")
MAX_BLOCK_THREADS = 1024  # HIP's limit, and the size of the prelude's shuffle slots
# cpu_prelude.h defines __global__ as this attribute, so a kernel can be found in the preprocessed text
_KERNEL = re.compile(r'extern\s+"C"\s+__attribute__\s*\(\(\s*flatten\s*\)\)\s+void\s+(\w+)\s*\(')
_ARG_KINDS = {0: "pointer", 1: "integer", 2: "float"}

# One entry point per kernel: argv[i] points at the i-th argument, converted to the kernel's own
# parameter type (the C++ types, so no packing rule is guessed), then a wait for the launch.
_LAUNCHER = r"""
#include <type_traits>
#include <utility>
template <typename T> constexpr int rlp_cpu_kind() {
    return std::is_pointer_v<T> ? 0 : std::is_integral_v<T> ? 1 : std::is_floating_point_v<T> ? 2 : -1;
}
// The block's threads start with a barrier: HIP-CPU runs them as fibers only once thread 0 has met a
// barrier or a shuffle, else one after another, where a shuffle of a later segment finds no partner
// (thread 0's segment may skip every shuffle: a segment skips rows it does not serve).
template <typename... Args, std::size_t... I>
static void rlp_cpu_launch_impl(void (*kernel)(Args...), const unsigned int* dims, unsigned int shared,
                                void** argv, std::index_sequence<I...>) {
    auto fibers = [kernel](Args... args) { __syncthreads(); kernel(args...); };
    hipLaunchKernelGGL(fibers, dim3(dims[0], dims[1], dims[2]), dim3(dims[3], dims[4], dims[5]), shared, 0,
                       (*static_cast<std::remove_cv_t<Args>*>(argv[I]))...);
}
template <typename... Args>
static int rlp_cpu_launch(void (*kernel)(Args...), const unsigned int* dims, unsigned int shared, void** argv) {
    rlp_cpu_launch_impl(kernel, dims, shared, argv, std::index_sequence_for<Args...>{});
    return (int)hipDeviceSynchronize();
}
template <typename... Args>
static int rlp_cpu_signature(void (*)(Args...), int* kinds, int* sizes) {
    int i = 0;
    ((kinds[i] = rlp_cpu_kind<Args>(), sizes[i] = (int)sizeof(Args), ++i), ...);
    return i;
}
"""
_ENTRY = r"""
extern "C" __attribute__((visibility("default"))) int rlp_cpu_launch_{name}(const unsigned int* dims, unsigned int shared, void** argv) {{
    return rlp_cpu_launch({name}, dims, shared, argv);
}}
extern "C" __attribute__((visibility("default"))) int rlp_cpu_signature_{name}(int* kinds, int* sizes) {{
    return rlp_cpu_signature({name}, kinds, sizes);
}}
"""
MAX_ARGS = 64


def hip_cpu_root() -> Path | None:
    value = os.environ.get(ENVIRONMENT, "").strip()
    return Path(value).expanduser() if value else None


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def probe() -> tuple[bool, str]:
    """(available, reason) without raising: HIP-CPU found, a C++ compiler, TBB."""
    root = hip_cpu_root()
    if root is None:
        return False, (f"HIP-CPU is not configured: git clone https://github.com/ROCm/HIP-CPU (CI uses commit "
                       f"e112c935), then export {ENVIRONMENT}=/path/to/HIP-CPU (the folder holding "
                       "include/hip/hip_runtime.h); it also needs g++ and TBB (apt-get install libtbb-dev)")
    if not (root / "include" / "hip" / "hip_runtime.h").is_file():
        return False, f"{ENVIRONMENT}={root}: no include/hip/hip_runtime.h there (not a HIP-CPU checkout)"
    if compiler() is None:
        return False, f"no C++ compiler: {os.environ.get('CXX', 'g++')} is not on PATH"
    if ctypes.util.find_library("tbb") is None:
        return False, "TBB is not installed (HIP-CPU runs blocks on it; Debian: apt-get install libtbb-dev)"
    return True, f"HIP-CPU at {root}"


def family_source(family: str) -> str:
    """A family's HIP source behind the HIP-CPU prelude (what the backend compiles, without entry points)."""
    return assemble_source("hip", family, prelude=PRELUDE)


def _run(command: list[str], family: str, what: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "error" in line][:20]
        raise KernelCompileError(f"{what} of kernel family '{family}' for HIP-CPU failed:\n"
                                 + "\n".join(lines or result.stderr.splitlines()[-20:]))
    return result


def kernel_names(source: str, family: str, root: Path) -> list[str]:
    """The extern "C" kernels of a source, read from the preprocessed text (macros define some)."""
    result = _run([compiler(), "-std=c++17", "-E", "-P", "-I", str(root / "include"), "-x", "c++", "-"],
                  family, "preprocessing", input=source)
    names = _KERNEL.findall(result.stdout)
    if not names:
        raise KernelCompileError(f"kernel family '{family}': no kernels found in its HIP source")
    return names


def build_library(family: str, source: str, root: Path) -> bytes:
    """The shared library of a family's source (behind the prelude), with its entry points."""
    names = kernel_names(source, family, root)
    text = source + _LAUNCHER + "".join(_ENTRY.format(name=name) for name in names)
    with tempfile.TemporaryDirectory(prefix="rlp-hip-cpu-") as folder:
        path = Path(folder) / f"{family}.cpp"
        path.write_text(text)
        output = Path(folder) / f"{family}.so"
        _run([compiler(), *OPTIONS, "-I", str(root / "include"), str(path), "-o", str(output), "-ltbb", "-lpthread"],
             family, "compilation")
        return output.read_bytes()


def _compiler_version() -> str:
    result = subprocess.run([compiler(), "--version"], capture_output=True, text=True)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else "unknown"


class _Kernel:
    """One kernel's entry point and parameter list (kind, size) from its C++ signature."""

    def __init__(self, library: ctypes.CDLL, family: str, name: str):
        try:
            self.launch = getattr(library, f"rlp_cpu_launch_{name}")
            signature = getattr(library, f"rlp_cpu_signature_{name}")
        except AttributeError:
            raise KernelCompileError(f"kernel family '{family}' has no kernel named '{name}'") from None
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = (ctypes.POINTER(ctypes.c_uint), ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p))
        kinds, sizes = (ctypes.c_int * MAX_ARGS)(), (ctypes.c_int * MAX_ARGS)()
        count = signature(kinds, sizes)
        self.name = name
        self.parameters = [(_ARG_KINDS.get(kinds[i], "other"), sizes[i]) for i in range(count)]


def _argument(kernel: _Kernel, index: int, arg, expected: tuple[str, int]):
    """A ctypes object holding one argument, checked against the kernel's parameter type."""
    kind, size = expected
    where = f"kernel {kernel.name} argument #{index}"
    if isinstance(arg, np.ndarray):
        if kind != "pointer":
            raise InputError(f"{where}: an array where the kernel takes a {size}-byte {kind}")
        if not (arg.flags.c_contiguous or arg.size == 0):
            raise InputError(f"{where}: a non-contiguous array")
        return ctypes.c_void_p(arg.ctypes.data)
    if kind == "pointer" and isinstance(arg, np.uint64) and arg == 0:  # ops' NULL_POINTER: an output not asked for
        return ctypes.c_void_p(0)
    if isinstance(arg, np.generic):
        wanted = {"integer": "biu", "float": "f"}.get(kind, "")
        if arg.dtype.kind not in wanted or arg.dtype.itemsize != size:
            raise InputError(f"{where}: a NumPy {arg.dtype.name} where the kernel takes a {size}-byte {kind}")
        return ctypes.create_string_buffer(np.asarray(arg).tobytes(), size)
    if isinstance(arg, (bool, int, float)):
        raise InputError(f"{where} is a Python {type(arg).__name__} ({arg!r}); pass a NumPy scalar (np.int32, "
                         "np.int64, np.float32, ...) so that its width is explicit")
    raise InputError(f"{where}: cannot pass an object of type {type(arg).__name__} to a kernel")


class DeviceArray(np.ndarray):
    """A NumPy array standing for device memory: the ops treat it as a GPU array (its values are not
    read on the host to validate them), so the kernels meet the inputs they meet on a GPU."""


class HipCpuBackend(Backend):
    name = "hip-cpu"
    kernel_vendor = "hip"
    on_host = True
    #: the AMD targets whose MFMA kernels it runs: every one, the instructions emulated (cpu_prelude.h)
    mfma_archs = MFMA_ARCHS

    def __init__(self):
        available, reason = probe()
        if not available:
            raise BackendUnavailable(f"device 'hip-cpu' is unavailable: {reason}")
        self.root = hip_cpu_root()
        self._libraries: dict[str, ctypes.CDLL] = {}
        self._sources: dict[str, str] = {}  # families given as text (add_family)
        self._kernels: dict[tuple[str, str], _Kernel] = {}
        self._lock = threading.Lock()  # tensor-parallel ranks emulated as threads share the backend's caches
        self._compiler = _compiler_version()
        self._folder = tempfile.TemporaryDirectory(prefix="rlp-hip-cpu-libs-")

    @property
    def label(self):
        return "hip-cpu (HIP sources on HIP-CPU, wavefront 64)"

    def asarray(self, array):
        return np.ascontiguousarray(array).view(DeviceArray)

    def to_numpy(self, array):
        return np.asarray(array)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype).view(DeviceArray)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype).view(DeviceArray)

    # ---- kernels
    def add_family(self, family: str, source: str) -> None:
        """A kernel family from source text, compiled as the others are (HIP code written to include
        common.h's helpers behind the prelude; tests use it for kernels of their own)."""
        self._sources[family] = assemble_text(source, PRELUDE)

    def library(self, family: str) -> ctypes.CDLL:
        with self._lock:
            if family not in self._libraries:
                source = self._sources.get(family) or family_source(family)
                text = source + _LAUNCHER + _ENTRY  # all the text the library is built from
                key = cache.cache_key(text, OPTIONS, "hip-cpu", f"{self._compiler} {self.root.resolve()}")
                binary = cache.cached_binary(key, ".so", lambda: build_library(family, source, self.root))
                path = Path(self._folder.name) / f"{family}.so"
                path.write_bytes(binary)
                self._libraries[family] = ctypes.CDLL(str(path))
            return self._libraries[family]

    def kernel(self, family: str, name: str) -> _Kernel:
        key = (family, name)
        if key not in self._kernels:
            library = self.library(family)
            self._kernels[key] = _Kernel(library, family, name)
        return self._kernels[key]

    def launch(self, family, kernel, grid, block, args, shared_mem=0):
        entry = self.kernel(family, kernel)
        dims = [*_dims(grid, "grid", kernel), *_dims(block, "block", kernel)]
        threads = dims[3] * dims[4] * dims[5]
        if threads > MAX_BLOCK_THREADS:
            raise InputError(f"kernel {kernel}: a block of {threads} threads (HIP allows {MAX_BLOCK_THREADS})")
        if len(args) != len(entry.parameters):
            raise InputError(f"kernel {kernel} takes {len(entry.parameters)} arguments, given {len(args)}")
        if 0 in dims:
            return
        held = [_argument(entry, i, arg, expected) for i, (arg, expected) in enumerate(zip(args, entry.parameters))]
        argv = (ctypes.c_void_p * max(len(held), 1))(*[ctypes.addressof(value) for value in held])
        status = entry.launch((ctypes.c_uint * 6)(*dims), int(shared_mem), argv)
        if status != 0:
            raise KernelCompileError(f"kernel {kernel}: HIP-CPU's launch returned status {status}")

    # ---- vendor integer GEMM
    def gemm_s8_s32(self, m, n, k, a, a_offset, lda, b, b_offset, ldb, c, c_offset, ldc):
        """The cuda and hip backends' TN call: C_rm[n, m] = B_rm[n, k] @ A_rm[m, k].T, int8 inputs,
        exact int32 dot products (offsets in elements). NumPy's integer product is exact."""
        m, n, k = int(m), int(n), int(k)
        if not (m and n):
            return
        a_rows = _rows(a, int(a_offset), m, k, int(lda))
        b_rows = _rows(b, int(b_offset), n, k, int(ldb))
        out = _rows(c, int(c_offset), n, m, int(ldc))
        product = b_rows.astype(np.int64) @ a_rows.astype(np.int64).T
        out[...] = product.astype(np.int32)  # int32 wraps as the GPU's accumulator would

    def info(self):
        return {"backend": "hip-cpu", "runtime": f"HIP-CPU at {self.root}", "compiler": self._compiler,
                "warp_size": 64, "numpy": np.__version__}


def _dims(value, what: str, kernel: str) -> tuple[int, int, int]:
    dims = (int(value),) if np.isscalar(value) else tuple(int(v) for v in value)
    if not 1 <= len(dims) <= 3 or any(d < 0 for d in dims):
        raise InputError(f"kernel {kernel}: bad {what} {value!r}")
    return dims + (1,) * (3 - len(dims))


def _rows(array: np.ndarray, offset: int, rows: int, columns: int, leading: int) -> np.ndarray:
    """A [rows, columns] view of a flat array starting at element `offset`, rows `leading` apart."""
    flat = array.reshape(-1)
    if rows and (offset + (rows - 1) * leading + columns > flat.size or columns > leading):
        raise InputError(f"gemm_s8_s32: a [{rows}, {columns}] operand at offset {offset}, leading dimension "
                         f"{leading}, does not fit its array of {flat.size} elements")
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=(rows, columns),
                                           strides=(leading * flat.itemsize, flat.itemsize))
