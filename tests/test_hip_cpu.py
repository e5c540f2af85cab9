"""The hip-cpu backend: HIP sources on the CPU through HIP-CPU, with a 64-lane wavefront.

The whole check of the HIP sources against the reference is `rlportable conform --device hip-cpu
--quick` (CI runs it); these tests pin the backend's own parts: the prelude's segment shuffle where
HIP-CPU's would pair the wrong calls, the typed entry points, and the one-line refusals.
A machine without HIP-CPU (RLPORTABLE_HIP_CPU unset) skips them, except in CI, where .ci/run sets it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import hip_cpu_backend
from rlportable.errors import BackendUnavailable, InputError
from rlportable.runtime import hip_cpu


@pytest.fixture(scope="module")
def backend():
    return hip_cpu_backend()


# Segment s of each block shuffles 2 (s + 1) times (a butterfly per round), so the segments part
# around the shuffle; segment 0 may skip shuffling altogether. HIP-CPU's own __shfl_xor waits at a
# block-wide barrier and would pair calls of different segments (or find no fibers: thread 0 without
# a barrier runs the block's threads one after another).
SEGMENT_KERNELS = r"""
#include "common.h"
extern "C" __global__ void test_segment_rounds(const unsigned int* in, unsigned int* out, int skip_first) {
    const int lane = threadIdx.x & 31, segment = threadIdx.x >> 5;
    unsigned int value = in[blockIdx.x * blockDim.x + threadIdx.x];
    const int rounds = (skip_first && segment == 0) ? 0 : 2 * (segment + 1);
    for (int r = 0; r < rounds; ++r) value = value * 3u + rlp_segment_xor_u32(value, 1 << (r % 5));
    out[blockIdx.x * blockDim.x + threadIdx.x] = value + (unsigned int)lane;
}
extern "C" __global__ void test_segment_max(const unsigned int* in, unsigned int* out) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = rlp_segment_max_u32(in[blockIdx.x * blockDim.x + threadIdx.x]);
}
extern "C" __global__ void test_widths(long long a, int b, double c, float* out) {
    if (threadIdx.x == 0) out[blockIdx.x] = (float)((double)a + b + c);
}
"""


def _segment_rounds_reference(values: np.ndarray, threads: int, skip_first: bool) -> np.ndarray:
    out = values.astype(np.uint64).reshape(-1, threads // 32, 32)
    for segment in range(threads // 32):
        rounds = 0 if (skip_first and segment == 0) else 2 * (segment + 1)
        v = out[:, segment, :].copy()
        for r in range(rounds):
            partner = np.arange(32) ^ (1 << (r % 5))
            v = (v * np.uint64(3) + v[:, partner]) & np.uint64(0xFFFFFFFF)
        out[:, segment, :] = v
    lanes = np.tile(np.arange(32, dtype=np.uint64), values.size // 32)
    return ((out.reshape(-1) + lanes) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


@pytest.fixture(scope="module")
def test_backend(backend):
    backend.add_family("test_segments", SEGMENT_KERNELS)
    return backend


@pytest.mark.parametrize("threads", [32, 64, 256])
@pytest.mark.parametrize("skip_first", [False, True])
def test_segments_that_part_shuffle_with_their_own_lanes(test_backend, threads, skip_first):
    blocks = 3
    values = np.random.default_rng(threads).integers(0, 2**32, blocks * threads, dtype=np.uint32)
    out = test_backend.empty((blocks * threads,), np.uint32)
    test_backend.launch("test_segments", "test_segment_rounds", (blocks,), (threads,),
                        (test_backend.asarray(values), out, np.int32(skip_first)))
    expected = _segment_rounds_reference(values, threads, skip_first)
    assert np.array_equal(test_backend.to_numpy(out).view(np.uint32), expected)


def test_segment_max_is_per_32_lanes_of_the_64_lane_wavefront(test_backend):
    values = np.random.default_rng(1).integers(0, 2**32, 128, dtype=np.uint32)
    out = test_backend.empty((128,), np.uint32)
    test_backend.launch("test_segments", "test_segment_max", (1,), (128,), (test_backend.asarray(values), out))
    expected = np.repeat(values.reshape(4, 32).max(axis=1), 32)
    assert np.array_equal(test_backend.to_numpy(out), expected)


def test_arguments_are_checked_against_the_kernel_signature(test_backend):
    out = test_backend.empty((2,), np.float32)
    test_backend.launch("test_segments", "test_widths", (2,), (32,),
                        (np.int64(1), np.int32(2), np.float64(0.5), out))
    assert test_backend.to_numpy(out).tolist() == [3.5, 3.5]
    with pytest.raises(InputError, match=r"argument #0: a NumPy int32 where the kernel takes a 8-byte integer"):
        test_backend.launch("test_segments", "test_widths", (1,), (32,),
                            (np.int32(1), np.int32(2), np.float64(0.5), out))
    with pytest.raises(InputError, match=r"argument #3: a NumPy float32 where the kernel takes a 8-byte pointer"):
        test_backend.launch("test_segments", "test_widths", (1,), (32,),
                            (np.int64(1), np.int32(2), np.float64(0.5), np.float32(0)))
    with pytest.raises(InputError, match="takes 4 arguments, given 3"):
        test_backend.launch("test_segments", "test_widths", (1,), (32,), (np.int64(1), np.int32(2), out))
    with pytest.raises(InputError, match="Python int"):
        test_backend.launch("test_segments", "test_widths", (1,), (32,), (1, np.int32(2), np.float64(0.5), out))


def test_a_family_runs_against_its_reference(backend):
    from rlportable.contract import exact
    from rlportable.ops.rowsum import rowsum

    x = np.random.default_rng(2).standard_normal((67, 300)).astype(np.float32)
    x[5, 3], x[6, 0], x[7, 1], x[7, 2] = np.nan, np.inf, np.inf, -np.inf
    got = backend.to_numpy(rowsum(backend, backend.asarray(x)))
    assert np.array_equal(got.view(np.uint32), exact.rowsum(x, 38).view(np.uint32))


def test_without_hip_cpu_the_device_is_refused_with_exit_2(tmp_path, monkeypatch):
    env = {**os.environ, hip_cpu.ENVIRONMENT: str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "rlportable", "conform", "--device", "hip-cpu", "--quick"],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: device 'hip-cpu' is unavailable: {hip_cpu.ENVIRONMENT}={tmp_path}: no include/hip/hip_runtime.h "
        "there (not a HIP-CPU checkout)"]
    monkeypatch.delenv(hip_cpu.ENVIRONMENT, raising=False)
    with pytest.raises(BackendUnavailable, match=f"git clone https://github.com/ROCm/HIP-CPU .*export {hip_cpu.ENVIRONMENT}="):
        hip_cpu.HipCpuBackend()
