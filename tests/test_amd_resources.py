"""The HIP kernels on AMD targets (rlportable.build.amd_resources): compiled for gfx942 and gfx90a
with the runtime's options, none spills to scratch, each fits 64 KiB of LDS with the largest dynamic
shared memory the ops ask for on hip, and the committed gfx942 table is the compiler's.

The compilers are missing on a plain machine: the tests skip there and fail in CI (.ci/run installs
clang-19, lld-19, rocm-device-libs and libamdhip64-dev)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlportable.build import amd_resources
from conftest import in_ci

TABLE = Path(__file__).resolve().parent.parent / "conformance" / "results" / "hip_resources_gfx942.md"
TABLE_MARK = amd_resources.TABLE_MARK


@pytest.fixture(scope="module")
def kernels():
    missing = amd_resources.missing_tools()
    if missing:
        if in_ci():
            pytest.fail(f"{missing} (CI must install the AMD compilers; see .ci/run)")
        pytest.skip(missing)
    return amd_resources.collect()


def test_no_hip_kernel_spills_or_exceeds_lds(kernels):
    assert amd_resources.problems(kernels) == []


def test_both_targets_compile_the_same_kernels(kernels):
    """The portable kernels on both targets; each target's own MFMA kernels (backends/hip: the contracts'
    hip_only_kernels, named after their target) on it alone."""
    from rlportable.contract import spec

    mfma = {kernel for contract in spec.load_all() for kernel in contract.hip_only_kernels}
    assert mfma and all(name.endswith(("_gfx942", "_gfx90a")) for name in mfma)
    by_arch = {arch: sorted(k.kernel for k in kernels if k.arch == arch) for arch in amd_resources.ARCHES}
    portable = {arch: [name for name in names if name not in mfma] for arch, names in by_arch.items()}
    assert portable["gfx942"] and portable["gfx942"] == portable["gfx90a"]
    assert "attention_backward_tiled_dkv_d256" in by_arch["gfx942"]
    for arch in amd_resources.ARCHES:
        assert sorted(set(by_arch[arch]) & mfma) == sorted(name for name in mfma if name.endswith(f"_{arch}"))


def test_committed_gfx942_table_is_current(kernels):
    text = TABLE.read_text()
    assert TABLE_MARK in text, f"{TABLE} lost its table marker"
    assert text.split(TABLE_MARK, 1)[1] == amd_resources.table(kernels), (
        f"{TABLE} is stale: python -m rlportable.build.amd_resources --table FILE rewrites it")


REMARKS = """\
x.hip:10:1: remark: Function Name: fits [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     SGPRs: 20 [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     VGPRs: 30 [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     AGPRs: 0 [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     ScratchSize [bytes/lane]: 0 [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     Occupancy [waves/SIMD]: 8 [-Rpass-analysis=kernel-resource-usage]
x.hip:10:1: remark:     LDS Size [bytes/block]: 1024 [-Rpass-analysis=kernel-resource-usage]
x.hip:20:1: remark: Function Name: spills [-Rpass-analysis=kernel-resource-usage]
x.hip:20:1: remark:     VGPRs: 512 [-Rpass-analysis=kernel-resource-usage]
x.hip:20:1: remark:     ScratchSize [bytes/lane]: 48 [-Rpass-analysis=kernel-resource-usage]
x.hip:20:1: remark:     LDS Size [bytes/block]: 0 [-Rpass-analysis=kernel-resource-usage]
x.hip:30:1: remark: Function Name: too_big [-Rpass-analysis=kernel-resource-usage]
x.hip:30:1: remark:     ScratchSize [bytes/lane]: 0 [-Rpass-analysis=kernel-resource-usage]
x.hip:30:1: remark:     LDS Size [bytes/block]: 4096 [-Rpass-analysis=kernel-resource-usage]
"""


def test_checks_catch_spills_and_lds_beyond_64_kib():
    """The parser reads every field, and problems() names a spilling kernel and one whose static LDS
    plus its ops' dynamic shared memory passes 64 KiB (without needing a compiler)."""
    parsed = amd_resources.parse_remarks(REMARKS, "x", "gfx942", {"too_big": amd_resources.LDS_LIMIT - 4095})
    fits, spills, too_big = parsed
    assert (fits.kernel, fits.sgprs, fits.vgprs, fits.scratch, fits.occupancy, fits.lds_static) == (
        "fits", 20, 30, 0, 8, 1024)
    found = [line for line in amd_resources.problems(parsed) if "not compiled" not in line]
    assert len(found) == 2
    assert found[0].startswith("spills (gfx942): 48 bytes of scratch")
    assert found[1].startswith("too_big (gfx942): 4096 static + 61441 dynamic")
