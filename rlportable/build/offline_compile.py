"""Compile every kernel source ahead of time, the way the runtime compiles it, with the offline compilers.

CI has no GPU, so this is where a kernel source that would not compile is
caught. Every target takes its source text and options from the runtime itself
(CudaBackend / HipBackend .source() and .compile_options(), so assemble_source
and runtime/flags.py), only the compiler differs:

  cuda sm_80, cuda sm_90   each family's CUDA source (backends/cuda/<family>.cu where NVIDIA has fast
                           paths, which includes the portable one, else backends/portable/<family>.hip)
                           behind cuda/prelude.h, nvcc -cubin
  hip gfx90a (hipcc)       the HIP source (backends/portable/<family>.hip) with hipcc, device code only,
                           to a code object
  hip gfx90a (hiprtc)      the same with hiprtc itself (the runtime's compiler), loaded from the
                           ROCm runtime library, no GPU needed
  hip-on-cuda sm_90        the HIP source behind cuda/prelude.h, nvcc -cubin

    python -m rlportable.build.offline_compile     # table family x target, exit 1 on any failure
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path


ELF_MAGIC = b"\x7fELF"
_HIPRTC_LOCK = threading.Lock()  # one in-process hiprtc compile at a time
# hipcc: HIP source, device code only, one plain code object (no offload bundle), as hiprtc gives.
# hipcc must also see HIP_PLATFORM=amd: it picks the NVIDIA platform when nvcc is on PATH.
HIPCC_DEVICE_ONLY = ("-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output")
COMPILE_TIMEOUT_S = 600


@dataclass(frozen=True)
class Target:
    name: str  # column title
    vendor: str  # which sources: "cuda" (with NVIDIA's fast paths) or "hip" (the portable ones)
    compiler: str  # "nvcc", "hipcc" or "hiprtc"
    arch: str  # compute capability ("90") or gfx name ("gfx90a")
    hip_on_cuda: bool = False


TARGETS = (
    Target("cuda sm_80", "cuda", "nvcc", "80"),
    Target("cuda sm_90", "cuda", "nvcc", "90"),
    Target("hip gfx90a (hipcc)", "hip", "hipcc", "gfx90a"),
    Target("hip gfx90a (hiprtc)", "hip", "hiprtc", "gfx90a"),
    Target("hip-on-cuda sm_90", "hip", "nvcc", "90", hip_on_cuda=True),
)


@dataclass
class Result:
    family: str
    target: Target
    status: str  # "ok", "failed" or "missing"
    detail: str = ""  # compiler log, or what is missing
    command: str = ""


def families() -> list[str]:
    """The kernel families: the contracts' list (contract/spec.py), less the reference_only ones."""
    from rlportable.contract.spec import kernel_families

    return kernel_families()


def runtime_source_and_options(target: Target, family: str) -> tuple[str, tuple[str, ...]]:
    """The exact text and options the runtime would compile for this target."""
    backend = _runtime_backend(target)
    return backend.source(family), backend.compile_options()


def runtime_options(target: Target) -> tuple[str, ...]:
    """The options the runtime compiles with for this target."""
    return _runtime_backend(target).compile_options()


def _runtime_backend(target: Target):
    """A backend object made without __init__ (which needs a GPU), given only the
    fields its source() and compile_options() read."""
    if target.vendor == "cuda" or target.hip_on_cuda:
        from rlportable.runtime.cuda import CudaBackend

        backend = CudaBackend.__new__(CudaBackend)
        backend.kernel_vendor = "hip" if target.hip_on_cuda else "cuda"
        backend.compute_capability = target.arch
    else:
        from rlportable.runtime.hip import HipBackend

        backend = HipBackend.__new__(HipBackend)
        backend.gcn_arch = target.arch
    return backend


def find_compiler(name: str) -> str | None:
    """Path of nvcc / hipcc, or the hiprtc library name, or None."""
    if name == "hiprtc":
        return hiprtc_library()
    found = shutil.which(name)
    if found is None:  # the toolkits' usual homes, when they are not on PATH
        home = {"nvcc": os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                "hipcc": os.environ.get("ROCM_PATH", "/opt/rocm")}[name]
        candidate = Path(home) / "bin" / name
        if candidate.is_file():
            return str(candidate)
    return found


_HIPRTC_NAMES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libamdhip64.so", "libamdhip64.so.5")


def hiprtc_library() -> str | None:
    """A loadable library that exports hiprtc (ROCm 6+: libhiprtc; ROCm 5: inside libamdhip64)."""
    for name in _HIPRTC_NAMES:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(library, "hiprtcCompileProgram"):
            return name
    return None


def _compile_with_tool(target: Target, family: str, tool: str, source: str, options: tuple[str, ...],
                       workdir: Path) -> Result:
    stem = f"{family}-{target.compiler}-{target.arch}{'-hip' if target.hip_on_cuda else ''}"
    env = dict(os.environ)
    if target.compiler == "nvcc":
        src = workdir / f"{stem}.cu"
        out = workdir / f"{stem}.cubin"
        command = [tool, "-cubin", *options, str(src), "-o", str(out)]
    else:
        src = workdir / f"{stem}.hip"
        out = workdir / f"{stem}.hsaco"
        command = [tool, *HIPCC_DEVICE_ONLY, "-c", *options, str(src), "-o", str(out)]
        env["HIP_PLATFORM"] = "amd"
    src.write_text(source)
    printable = " ".join(command)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return Result(family, target, "failed", f"timed out after {COMPILE_TIMEOUT_S} s", printable)
    log = (done.stdout + done.stderr).strip()
    if done.returncode != 0:
        return Result(family, target, "failed", log or f"exit status {done.returncode}", printable)
    if not out.is_file() or out.read_bytes()[:4] != ELF_MAGIC:
        return Result(family, target, "failed", f"{out.name} is not an ELF binary\n{log}", printable)
    return Result(family, target, "ok", log, printable)


def hiprtc_compile(library_name: str, source: str, name: str, options: tuple[str, ...]) -> tuple[int, str, bytes]:
    """(hiprtcResult, program log, code object) from hiprtc in library_name, through ctypes."""
    library = ctypes.CDLL(library_name)
    program = ctypes.c_void_p()
    size = ctypes.c_size_t()
    status = library.hiprtcCreateProgram(ctypes.byref(program), ctypes.c_char_p(source.encode()),
                                         ctypes.c_char_p(name.encode()), 0, None, None)
    if status != 0:
        return status, "hiprtcCreateProgram failed", b""
    try:
        encoded = (ctypes.c_char_p * len(options))(*[option.encode() for option in options])
        status = library.hiprtcCompileProgram(program, len(options), encoded)
        library.hiprtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        library.hiprtcGetProgramLog(program, log)
        text = log.value.decode(errors="replace").strip()
        if status != 0:
            return status, text, b""
        library.hiprtcGetCodeSize(program, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        library.hiprtcGetCode(program, code)
        return 0, text, code.raw
    finally:
        library.hiprtcDestroyProgram(ctypes.byref(program))


def _compile_with_hiprtc(target: Target, family: str, library_name: str, source: str,
                         options: tuple[str, ...]) -> Result:
    printable = f"hiprtcCompileProgram({library_name}) {' '.join(options)}"
    with _HIPRTC_LOCK:
        status, log, code = hiprtc_compile(library_name, source, f"{family}.hip", options)
    if status != 0:
        return Result(family, target, "failed", f"hiprtc returned {status}\n{log}", printable)
    if code[:4] != ELF_MAGIC:
        return Result(family, target, "failed", f"hiprtc gave no ELF code object\n{log}", printable)
    return Result(family, target, "ok", log, printable)


def compile_one(target: Target, family: str, workdir: Path | None = None) -> Result:
    tool = find_compiler(target.compiler)
    if tool is None:
        return Result(family, target, "missing", f"{target.compiler} not found")
    source, options = runtime_source_and_options(target, family)
    if target.compiler == "hiprtc":
        return _compile_with_hiprtc(target, family, tool, source, options)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="rlp-offline-") as temporary:
            return _compile_with_tool(target, family, tool, source, options, Path(temporary))
    return _compile_with_tool(target, family, tool, source, options, workdir)


def jobs() -> list[tuple[Target, str]]:
    return [(target, family) for target in TARGETS for family in families()]


def compile_all(workers: int | None = None) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="rlp-offline-") as temporary:
        workdir = Path(temporary)
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            return list(pool.map(lambda job: compile_one(job[0], job[1], workdir), jobs()))


def table(results: list[Result]) -> str:
    from tabulate import tabulate

    names = sorted({result.family for result in results})
    cell = {(r.family, r.target.name): ("ok" if r.status == "ok" else r.status.upper()) for r in results}
    rows = [[family] + [cell.get((family, target.name), "-") for target in TARGETS] for family in names]
    return tabulate(rows, headers=["family"] + [target.name for target in TARGETS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlportable.build.offline_compile",
        description="Compile every kernel source with nvcc, hipcc and hiprtc as the runtime would.",
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPU count)")
    parser.add_argument("--verbose", action="store_true", help="print each command and its compiler log")
    arguments = parser.parse_args(argv)
    results = compile_all(arguments.jobs)
    print(table(results))
    bad = [result for result in results if result.status != "ok"]
    for result in results if arguments.verbose else bad:
        print(f"\n== {result.family} / {result.target.name}: {result.status}")
        if result.command:
            print(f"$ {result.command}")
        if result.detail:
            print(result.detail)
    print(f"\n{len(results) - len(bad)} of {len(results)} compiled")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
