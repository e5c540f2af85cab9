"""What each HIP kernel needs on AMD GPUs, read off the compiler, and the checks CI makes on it.

No AMD GPU runs here, but clang (Debian's clang-19 with lld-19, rocm-device-libs and libamdhip64-dev)
compiles every family's HIP source (backends/portable) for MI300X (gfx942, wave 64) and MI250X (gfx90a) with the options the runtime
gives hiprtc, and prints every kernel's registers, scratch, occupancy and static LDS
(-Rpass-analysis=kernel-resource-usage). Two things would stop a kernel on the GPU and are checked:

  * scratch: a kernel that spills registers to scratch memory runs, but far slower than measured
    on NVIDIA; none may.
  * LDS: static LDS plus the largest dynamic shared memory the ops ask for on hip must fit the
    64 KiB a workgroup may have (an H200 allows 227 KiB: a kernel sized for it would not launch).

Debian's device libraries (ROCm 5.2) predate gfx942 and lack oclc_isa_version_942.bc; the library
directory given to clang links it to the gfx940 file. That constant selects a few ISA-dependent
paths in the device library (none of the functions these kernels call differ between 940 and 942).

    python -m rlportable.build.amd_resources            # check, exit 1 on a problem
    python -m rlportable.build.amd_resources --table F  # also write the gfx942 table (markdown) to F,
                                                          # after TABLE_MARK where F has it
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ARCHES = ("gfx942", "gfx90a")
LDS_LIMIT = 64 * 1024  # bytes of LDS per workgroup on gfx90a and gfx942
CLANG = "clang++-19"
DEVICE_LIBS = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")  # Debian's rocm-device-libs
_ALIAS = ("oclc_isa_version_942.bc", "oclc_isa_version_940.bc")  # (missing file, what it links to)
TABLE_MARK = "<!-- table: python -m rlportable.build.amd_resources --table -->\n"
CLANG_DEVICE_ONLY = ("-x", "hip", "-O3", "--offload-device-only", "--no-gpu-bundle-output",
                     "-Rpass-analysis=kernel-resource-usage")


@dataclass
class KernelResources:
    family: str
    kernel: str
    arch: str
    vgprs: int
    agprs: int
    sgprs: int
    scratch: int  # bytes per lane
    occupancy: int  # waves per SIMD
    lds_static: int  # bytes per workgroup
    lds_dynamic: int  # the most the ops ask for at launch on hip

    @property
    def lds_total(self) -> int:
        return self.lds_static + self.lds_dynamic


def missing_tools() -> str | None:
    """What is missing to compile for AMD here, or None."""
    if shutil.which(CLANG) is None:
        return f"{CLANG} not found (Debian packages clang-19 and lld-19)"
    if not (DEVICE_LIBS / "ockl.bc").is_file():
        return f"AMD device libraries not found in {DEVICE_LIBS} (Debian package rocm-device-libs)"
    if not Path("/usr/include/hip/hip_runtime.h").is_file():
        return "HIP headers not found (Debian package libamdhip64-dev)"
    return None


def device_lib_dir(root: Path) -> Path:
    """A directory of links to the device libraries, with the gfx942 ISA file the Debian set lacks."""
    out = root / "amdgcn-bitcode"
    out.mkdir(exist_ok=True)
    for lib in DEVICE_LIBS.glob("*.bc"):
        if not (out / lib.name).exists():
            os.symlink(lib, out / lib.name)
    missing, target = _ALIAS
    if not (out / missing).exists():
        os.symlink(DEVICE_LIBS / target, out / missing)
    return out


def dynamic_lds() -> dict[str, int]:
    """kernel -> the largest dynamic shared memory (bytes) the ops launch it with on hip, over every
    shape they allow, as each family's op module declares it (hip_dynamic_lds(); a module without one
    launches none)."""
    import importlib

    from rlportable.contract.spec import kernel_families

    sizes: dict[str, int] = {}
    for family in kernel_families():
        declared = getattr(importlib.import_module(f"rlportable.ops.{family}"), "hip_dynamic_lds", None)
        sizes.update(declared() if declared else {})
    return sizes


def _options(arch: str) -> tuple[str, ...]:
    from rlportable.runtime.hip import hip_compile_options

    return hip_compile_options(arch)


def parse_remarks(text: str, family: str, arch: str, dynamic: dict[str, int]) -> list[KernelResources]:
    """The kernel-resource-usage remarks of one compile, kernel by kernel."""
    kernels, current = [], None
    fields = {"SGPRs": "sgprs", "VGPRs": "vgprs", "AGPRs": "agprs", "ScratchSize [bytes/lane]": "scratch",
              "Occupancy [waves/SIMD]": "occupancy", "LDS Size [bytes/block]": "lds_static"}
    for line in text.splitlines():
        match = re.search(r"remark:\s+(Function Name|[A-Za-z \[\]/]+):\s+(\S+)", line)
        if not match:
            continue
        key, value = match.group(1).strip(), match.group(2)
        if key == "Function Name":
            current = {"kernel": value}
            kernels.append(current)
        elif current is not None and key in fields:
            current[fields[key]] = int(value)
    return [KernelResources(family, k["kernel"], arch, k.get("vgprs", 0), k.get("agprs", 0), k.get("sgprs", 0),
                            k.get("scratch", 0), k.get("occupancy", 0), k.get("lds_static", 0),
                            dynamic.get(k["kernel"], 0)) for k in kernels]


def compile_family(family: str, arch: str, workdir: Path, libs: Path, dynamic: dict[str, int]) -> list[KernelResources]:
    """Compile one family's HIP source (as the runtime assembles it) for arch with the device libraries
    in libs (device_lib_dir); its kernels' resources."""
    from rlportable.runtime.base import assemble_source

    src = workdir / f"{family}-{arch}.hip"
    src.write_text(assemble_source("hip", family))
    command = [CLANG, *CLANG_DEVICE_ONLY, *_options(arch), f"--rocm-device-lib-path={libs}",
               "-c", str(src), "-o", str(workdir / f"{family}-{arch}.o")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{family} for {arch}: {' '.join(command)}\n{done.stderr[-4000:]}")
    return parse_remarks(done.stderr, family, arch, dynamic)


def collect(arches: tuple[str, ...] = ARCHES, workers: int | None = None) -> list[KernelResources]:
    from rlportable.build.offline_compile import families

    dynamic = dynamic_lds()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        libs = device_lib_dir(root)
        jobs = [(family, arch) for arch in arches for family in families()]
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            results = pool.map(lambda job: compile_family(job[0], job[1], root, libs, dynamic), jobs)
            return [kernel for family in results for kernel in family]


def problems(kernels: list[KernelResources]) -> list[str]:
    """One line per kernel that would spill or not launch; every dynamic size must name a compiled kernel."""
    out = [f"{k.kernel} ({k.arch}): {k.scratch} bytes of scratch per lane (register spills)"
           for k in kernels if k.scratch]
    out += [f"{k.kernel} ({k.arch}): {k.lds_static} static + {k.lds_dynamic} dynamic = {k.lds_total} bytes of LDS, "
            f"beyond {LDS_LIMIT}" for k in kernels if k.lds_total > LDS_LIMIT]
    names = {k.kernel for k in kernels}
    out += [f"{name}: given a dynamic LDS size but not compiled" for name in dynamic_lds() if name not in names]
    return out


def table(kernels: list[KernelResources], arch: str = "gfx942") -> str:
    rows = ["| family | kernel | VGPRs | AGPRs | SGPRs | scratch (B/lane) | occupancy (waves/SIMD) | LDS static | "
            "LDS dynamic (max) | LDS total |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in sorted((k for k in kernels if k.arch == arch), key=lambda k: (k.family, k.kernel)):
        rows.append(f"| {k.family} | {k.kernel} | {k.vgprs} | {k.agprs} | {k.sgprs} | {k.scratch} | {k.occupancy} | "
                    f"{k.lds_static} | {k.lds_dynamic} | {k.lds_total} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="write the gfx942 table (markdown) here")
    args = parser.parse_args(argv)
    missing = missing_tools()
    if missing:
        print(f"amd_resources: {missing}", file=sys.stderr)
        return 2
    kernels = collect()
    found = problems(kernels)
    for arch in ARCHES:
        mine = [k for k in kernels if k.arch == arch]
        print(f"{arch}: {len(mine)} kernels, most VGPRs {max(k.vgprs for k in mine)}, "
              f"most LDS {max(k.lds_total for k in mine)} bytes, scratch in {sum(1 for k in mine if k.scratch)}")
    if args.table:
        head = args.table.read_text().split(TABLE_MARK, 1)[0] + TABLE_MARK if args.table.is_file() else ""
        args.table.write_text(head + table(kernels))
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
