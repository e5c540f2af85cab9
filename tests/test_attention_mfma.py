"""AMD's MFMA attention forward (backends/hip/attention.hip): which backend takes it, and its bits on HIP-CPU.

An AMD GPU whose target has the kernels (gfx942, gfx90a) takes method "mma" for prefill-shaped calls at
padded head_dim 64 and 128; 256 (91 KB of LDS) and other targets take the portable kernel; HIP-CPU,
which emulates the MFMA instructions, runs it only when asked. On HIP-CPU both targets' kernels must
give the reference's bits over several sequences per 64-row tile, ragged head dims and poisoned rows
(`conform --device hip-cpu` checks the gfx942 build over the whole attention suite). A machine without
HIP-CPU skips those, except in CI.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hip_cpu_backend
from rlportable.contract import attention as reference
from rlportable.errors import InputError
from rlportable.ops import attention as attention_op


class StandIn:
    def __init__(self, vendor, archs=(), on_host=False):
        self.kernel_vendor, self.mfma_archs, self.on_host = vendor, archs, on_host
        self.label = f"stand-in {vendor} {archs}"

    @property
    def runs_reference(self):
        return self.kernel_vendor is None


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_an_amd_gpu_with_mfma_takes_the_mfma_forward(arch):
    gpu = StandIn("hip", (arch,))
    assert attention_op.mfma_arch(gpu) == arch
    for dim in (64, 100, 128):
        assert attention_op.resolve_method(gpu, 4096, 8, dim, "auto") == "mma"
        assert attention_op.resolve_method(gpu, 8, 8, dim, "auto") == "split"  # decode-shaped
    assert attention_op.resolve_method(gpu, 4096, 8, 256, "auto") == "portable"
    with pytest.raises(InputError, match="MFMA"):
        attention_op.resolve_method(gpu, 4096, 8, 256, "mma")


def test_other_backends_keep_their_forward():
    assert attention_op.resolve_method(StandIn("hip", ()), 4096, 8, 128, "auto") == "portable"
    assert attention_op.mfma_arch(StandIn("cuda", ("gfx942",))) is None  # CUDA sources never take it
    emulated = StandIn("hip", ("gfx942", "gfx90a"), on_host=True)  # HIP-CPU
    assert attention_op.resolve_method(emulated, 4096, 8, 128, "auto") == "portable"
    assert attention_op.resolve_method(emulated, 4096, 8, 128, "mma") == "mma"


@pytest.fixture(scope="module")
def backend():
    return hip_cpu_backend()


# (sequence lengths, hq, hkv, head_dim): sequences that share 64-row tiles and cross them, a group of
# 4 q heads per kv head, a head_dim padded to 128 and one to 64
CASES = [([70, 3, 130], 4, 1, 128), ([5, 64], 2, 2, 40), ([129], 2, 1, 100)]


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_mfma_forward_gives_the_reference_bits(backend, arch, monkeypatch):
    monkeypatch.setattr(backend, "mfma_archs", (arch,))
    rng = np.random.default_rng(3)
    for lengths, hq, hkv, dim in CASES:
        tokens = sum(lengths)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        q = (rng.standard_normal((tokens, hq, dim)) * 4).astype(np.float32)
        k, v = (rng.standard_normal((tokens, hkv, dim)).astype(np.float32) for _ in range(2))
        q[1, 0, 3] = np.inf  # a poisoned query row
        v[min(lengths[0] + 1, tokens - 1), 0, 0] = np.nan  # a poisoned value row: its later queries are NaN
        expected = reference.attention_packed_batched(q, k, v, cu)
        out, stats = attention_op.attention_packed(backend, backend.asarray(q), backend.asarray(k),
                                                   backend.asarray(v), cu, method="mma", keep_stats=True)
        assert np.asarray(out).view(np.uint32).tobytes() == expected.view(np.uint32).tobytes(), (arch, lengths)
        _, portable_stats = attention_op.attention_packed(backend, backend.asarray(q), backend.asarray(k),
                                                          backend.asarray(v), cu, method="portable", keep_stats=True)
        # the statistics the backward reads (m, L): the same as the portable kernel's
        assert np.asarray(stats)[:, :2].tobytes() == np.asarray(portable_stats)[:, :2].tobytes()


def test_the_backward_takes_mfma_where_the_forward_does():
    gpu, emulated = StandIn("hip", ("gfx942",)), StandIn("hip", ("gfx942", "gfx90a"), on_host=True)
    assert attention_op.backward_methods(gpu, 128) == ("rows", "tiled", "mma")
    assert attention_op.backward_methods(emulated, 64) == ("rows", "tiled", "mma")
    assert attention_op.backward_methods(gpu, 256) == ("rows", "tiled")  # beyond the MFMA kernels' LDS
    assert attention_op.backward_methods(StandIn("hip", ()), 128) == ("rows", "tiled")
    assert attention_op.tiled_tiles(128, "mfma") == {"bq": 64, "bk": 64, "bkv": 32, "bq2": 64}
    # a dkv tile of the MFMA kernels lies inside one block of 64 positions of its sequence
    cu = np.array([0, 100, 229], dtype=np.int64)
    _, key_tiles = attention_op.tiled_plan(cu, 128, "mfma")
    assert all((first - cu[seq]) % 64 + 32 <= 64 for seq, first in key_tiles)


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_mfma_backward_gives_the_reference_bits(backend, arch, monkeypatch):
    """dq, dk, dv from the MFMA kernels (method "mma", as an AMD GPU's "tiled"), with and without the
    forward's statistics, over sequences that share tiles, a group of 4 and poisoned rows."""
    monkeypatch.setattr(backend, "mfma_archs", (arch,))
    rng = np.random.default_rng(5)
    for lengths, hq, hkv, dim in CASES:
        tokens = sum(lengths)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        q, do = ((rng.standard_normal((tokens, hq, dim)) * 3).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((tokens, hkv, dim)).astype(np.float32) for _ in range(2))
        q[2, 1, 0], v[tokens - 3, 0, 1] = np.nan, np.inf
        expected = reference.attention_packed_backward_batched(q, k, v, do, cu, None)
        inputs = [backend.asarray(x) for x in (q, k, v, do)]
        o, stats = attention_op.attention_packed(backend, *inputs[:3], cu, method="mma", keep_stats=True)
        for extra in ({}, {"o": o, "row_stats": stats}):
            grads = attention_op.attention_packed_backward(backend, *inputs, cu, method="mma", **extra)
            for got, want in zip(grads, expected):
                assert np.asarray(got).view(np.uint32).tobytes() == want.view(np.uint32).tobytes(), (arch, lengths)


def test_an_amd_gpu_trains_with_the_mfma_backward_and_forward():
    """What the model's calls (method "auto") launch on an AMD GPU with MFMA kernels: the MFMA forward
    and the MFMA dq and dkv; "tiled" stays the portable tiled kernels (so conform checks both there)."""
    from recording_device import RecordingDevice

    device = RecordingDevice("hip")
    device.mfma_archs = ("gfx942",)
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((70, heads, 128)).astype(np.float32) for heads in (4, 2, 2, 4))
    cu = np.array([0, 70])
    attention_op.attention_packed(device, q, k, v, cu, keep_stats=True)
    assert "attention_paged_mfma_d128_gfx942" in [launch.kernel for launch in device.launches]
    for method, prefix in (("auto", "attention_backward_mfma_"), ("tiled", "attention_backward_tiled_")):
        device.launches.clear()
        attention_op.attention_packed_backward(device, q, k, v, do, cu, o=q, method=method)
        kernels = [launch.kernel for launch in device.launches]
        assert any(name.startswith(prefix + "dq") for name in kernels), (method, kernels)
        assert any(name.startswith(prefix + "dkv") for name in kernels), (method, kernels)
