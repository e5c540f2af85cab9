"""Every kernel source compiles, as the runtime compiles it, for every target (no GPU needed).

Each family's CUDA source (backends/cuda/<family>.cu where NVIDIA has fast paths, which includes
backends/portable/<family>.hip, else the portable source; behind cuda/prelude.h) with nvcc for sm_80
and sm_90; the portable sources with hipcc and with hiprtc for gfx90a, and behind cuda/prelude.h with
nvcc for sm_90. Sources and options come from the runtime
(rlportable.build.offline_compile).

A missing compiler fails the test when the CI environment variable is set (.ci/run
installs hipcc; nvcc is on the machine) and skips it otherwise.
"""

from __future__ import annotations

import os
import re

import pytest

from conftest import in_ci
from recording_device import KERNEL_ENTRY

from rlportable import resources
from rlportable.resources import kernel_source_path, portable_source_path, resource_dir
from rlportable.build import offline_compile

# hip_runtime.h for hipcc and hiprtc, never under the HIP-on-CUDA prelude (NVRTC has no such header)
HIP_HEADER = "#ifndef RLP_HIP_ON_CUDA\n#include <hip/hip_runtime.h>\n#endif\n"
# Names that tie a kernel to one warp width or one vendor: the HIP sources must run at 64 (CDNA)
# and at 32 (NVIDIA, through the prelude), so block-wide results use shared-memory atomics, after
# common.h's reductions over segments of 32 lanes (its one shuffle, SEGMENT_SHUFFLE below).
_WARP_OR_VENDOR_SPECIFIC = ("__shfl", "__ballot", "__activemask", "__any_sync", "__all_sync", "warpSize",
                            "__builtin_amdgcn_", "asm(", "asm volatile")


@pytest.fixture(scope="module")
def compile_results():
    results = offline_compile.compile_all()
    return {(result.target.name, result.family): result for result in results}


JOBS = offline_compile.jobs()


def test_there_are_kernel_families():
    assert offline_compile.families(), "no kernel sources in backends/portable"


@pytest.mark.parametrize("target,family", JOBS, ids=[f"{family}-{target.name}" for target, family in JOBS])
def test_kernel_source_compiles(compile_results, target, family):
    result = compile_results[(target.name, family)]
    if result.status == "missing":
        message = f"{result.detail}: cannot compile {family} for {target.name}"
        if in_ci():
            pytest.fail(f"{message} (CI must install every kernel compiler; see .ci/run)")
        pytest.skip(message)
    assert result.status == "ok", f"{family} / {target.name} failed\n$ {result.command}\n{result.detail}"


def _kernels(text: str) -> dict[str, str]:
    """Kernel name -> parameters, as written (entry macros' NAME-style parameters left out)."""
    return {name: " ".join(params.split()) for name, params in KERNEL_ENTRY.findall(text) if not name.isupper()}


VENDOR_FILES = [(vendor, path) for vendor, suffix in resources.VENDOR_SUFFIX.items()
                for path in sorted((resource_dir("backends") / vendor).glob(f"*{suffix}"))]


@pytest.mark.parametrize("vendor,path", VENDOR_FILES, ids=[f"{v}-{p.name}" for v, p in VENDOR_FILES])
def test_vendor_files_add_fast_paths_to_a_portable_family(vendor, path):
    """backends/cuda/<family>.cu (NVIDIA) and backends/hip/<family>.hip (AMD) hold a vendor's fast paths
    only: each includes the family's portable source, defines the contract's cuda_only_kernels or
    hip_only_kernels (most through entry macros), and redefines no portable kernel; the portable source
    never names a fast path."""
    from rlportable.contract import spec

    family = path.stem
    assert portable_source_path(family).is_file(), f"{path} has no backends/portable/{family}.hip"
    text, portable_text = path.read_text(), portable_source_path(family).read_text()
    # the HIP file shares the portable file's name, so it names the portable folder
    include = f"{family}.hip" if vendor == "cuda" else f"../portable/{family}.hip"
    assert re.search(rf'^#include "{re.escape(include)}"$', text, re.MULTILINE), f"{path} must include \"{include}\""
    contract = next(c for c in spec.load_all() if c.name == family)
    only = contract.cuda_only_kernels if vendor == "cuda" else contract.hip_only_kernels
    key = "cuda_only_kernels" if vendor == "cuda" else "hip_only_kernels"
    assert only, f"{path}: contracts/{family}.toml lists no {key}"
    for kernel in only:
        assert re.search(rf"\b{kernel}\b", text), f"{path} does not define the fast path {kernel}"
        assert not re.search(rf"\b{kernel}\b", portable_text), f"portable/{family}.hip names the fast path {kernel}"
    for kernel in _kernels(portable_text):
        assert not re.search(rf"\bvoid\s+{kernel}\s*\(", text), f"{path} redefines the portable kernel {kernel}"
    assert kernel_source_path(vendor, family) == path


def test_vendor_folders_hold_preludes_and_fast_paths_only():
    backends = resource_dir("backends")
    # cuda: the HIP-on-CUDA prelude, and the tensor-core and cp.async pieces gemm and attention share
    assert sorted(p.name for p in (backends / "cuda").iterdir() if p.suffix != ".cu") == ["pipeline.h", "prelude.h"]
    # hip: the HIP-CPU prelude, and the MFMA wrapper the AMD fast paths share
    assert sorted(p.name for p in (backends / "hip").iterdir() if p.suffix != ".hip") == ["cpu_prelude.h", "mfma.h"]


@pytest.mark.parametrize("family", offline_compile.families())
def test_portable_source_layout(family):
    text = portable_source_path(family).read_text()
    first_code = re.sub(r"\A(?:[ \t]*(?://[^\n]*)?\n)*", "", text)  # leading comment lines may come first
    assert first_code.startswith(HIP_HEADER), f"{family}.hip must begin with the guarded runtime include:\n{HIP_HEADER}"
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)  # comments may name anything
    for name in _WARP_OR_VENDOR_SPECIFIC:
        assert name not in code, f"{family}.hip uses {name!r}: warp-width or vendor specific"
    assert kernel_source_path("hip", family) in (portable_source_path(family), resource_dir("backends") / "hip" / f"{family}.hip")


# The one shuffle allowed, in common.h only: width 32, a segment that divides either vendor's warp
# width (32 or 64); the block reductions built on it (rlp_block_*) are what the family sources call.
SEGMENT_SHUFFLE = "__shfl_xor(value, lane_mask, 32)"


def test_hip_common_header_is_warp_and_vendor_neutral():
    text = (resource_dir("backends") / "portable" / "common.h").read_text()
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)
    assert code.count(SEGMENT_SHUFFLE) == 1, f"portable/common.h must shuffle in exactly one place: {SEGMENT_SHUFFLE}"
    code = code.replace(SEGMENT_SHUFFLE, "")
    for name in _WARP_OR_VENDOR_SPECIFIC:
        assert name not in code, f"portable/common.h uses {name!r}: warp-width or vendor specific"


# ---- the runtime's options switch contraction off in every compiler (contract rule 2)

_CONTRACTION_PROBE = """
extern "C" __global__ void contraction_probe(const float* a, float* y, const double* d, double* z) {
    int i = threadIdx.x;
    y[i] = a[i] * a[i + 1] + a[i + 2];
    z[i] = d[i] * d[i + 1] + d[i + 2];
}
"""
# fused multiply-adds in PTX (nvcc) and in AMDGPU assembly (hipcc, hiprtc)
_FUSED = re.compile(r"\bfma\.|\bmad\.|\bv_(?:pk_)?(?:fma|fmac|mad|mac)\w*_f(?:16|32|64)\b")


def _disassemble_amdgpu(code: bytes, tmp_path) -> str:
    import shutil
    import subprocess

    objdump = shutil.which("llvm-objdump") or next(
        (shutil.which(f"llvm-objdump-{v}") for v in range(30, 13, -1) if shutil.which(f"llvm-objdump-{v}")), None)
    if objdump is None:
        if in_ci():
            pytest.fail("llvm-objdump not found (it comes with hipcc's LLVM)")
        pytest.skip("llvm-objdump not found")
    path = tmp_path / "probe.hsaco"
    path.write_bytes(code)
    return subprocess.run([objdump, "-d", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("target", offline_compile.TARGETS, ids=[t.name for t in offline_compile.TARGETS])
def test_runtime_options_forbid_contraction(target, tmp_path):
    import subprocess

    tool = offline_compile.find_compiler(target.compiler)
    if tool is None:
        if in_ci():
            pytest.fail(f"{target.compiler} not found")
        pytest.skip(f"{target.compiler} not found")
    options = offline_compile.runtime_options(target)
    if target.compiler == "nvcc":
        src, out = tmp_path / "probe.cu", tmp_path / "probe.ptx"
        src.write_text(("#define RLP_HIP_ON_CUDA 1\n" if target.hip_on_cuda else "") + _CONTRACTION_PROBE)
        subprocess.run([tool, "-ptx", *options, str(src), "-o", str(out)], check=True, capture_output=True)
        text = out.read_text()
    elif target.compiler == "hipcc":
        src, out = tmp_path / "probe.hip", tmp_path / "probe.s"
        src.write_text(HIP_HEADER + _CONTRACTION_PROBE)
        subprocess.run([tool, *offline_compile.HIPCC_DEVICE_ONLY, "-S", *options, str(src), "-o", str(out)],
                       check=True, capture_output=True, env=dict(os.environ, HIP_PLATFORM="amd"))
        text = out.read_text()
    else:
        status, log, code = offline_compile.hiprtc_compile(tool, HIP_HEADER + _CONTRACTION_PROBE, "probe.hip", options)
        assert status == 0, log
        text = _disassemble_amdgpu(code, tmp_path)
    assert re.search(r"mul", text), "the probe's multiplies are missing from the output"
    fused = sorted(set(_FUSED.findall(text)))
    assert not fused, f"{target.name}: contraction with options {' '.join(options)}: {fused}"
