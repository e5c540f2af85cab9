"""AMD's MFMA gemm kernels (backends/hip/gemm.hip): which backend takes them, and their bits on HIP-CPU.

The op's choice is pinned with stand-in backends (no AMD GPU here): an MI300X (gfx942) or MI200
(gfx90a) takes its own MFMA kernel for `auto`, another AMD target and NVIDIA's sources never do, and
HIP-CPU, which emulates both instructions in software, runs them only when asked (its `auto` keeps the
vendor product). The kernels themselves run on HIP-CPU (the 64-lane wavefront, MFMA emulated:
backends/hip/cpu_prelude.h) against the NumPy reference, bit for bit; `conform --device hip-cpu`
checks them too, over the conform shapes. A machine without HIP-CPU skips those, except in CI.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import hip_cpu_backend
from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.contract import exact
from rlportable.errors import InputError
from rlportable.ops import gemm as gemm_op
from rlportable.ops.fixedpoint import encode_rows
from rlportable.ops.gemm_mfma import MFMA_TILES, launch_mfma, mfma_tiles, pick_mfma_tile
from rlportable.runtime import hip_cpu
from rlportable.runtime.hip import HipBackend


class StandIn:
    """What resolve_method reads of a backend."""

    def __init__(self, vendor, archs=(), on_host=False):
        self.kernel_vendor, self.mfma_archs, self.on_host = vendor, archs, on_host
        self.label = f"stand-in {vendor} {archs}"


def _amd_gpu(arch: str) -> HipBackend:
    backend = HipBackend.__new__(HipBackend)  # no GPU: only the fields mfma_archs reads
    backend.gcn_arch = arch
    return backend


def _weight(bits_w=15):
    """A weight encoding stand-in: resolve_method reads its digit count only."""
    class Encoded:
        slices = 2 if bits_w == 15 else 1

    class Weight:
        encoded = Encoded()
        k = 64
    return Weight()


def test_amd_targets_name_their_mfma_kernels():
    assert _amd_gpu("gfx942:sramecc+:xnack-").mfma_archs == ("gfx942",)
    assert _amd_gpu("gfx90a:sramecc+:xnack-").mfma_archs == ("gfx90a",)
    assert _amd_gpu("gfx1100").mfma_archs == ()
    assert hip_cpu.HipCpuBackend.mfma_archs == ("gfx942", "gfx90a")
    assert {tile.arch for tile in MFMA_TILES.values()} == {"gfx942", "gfx90a"}


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_an_amd_gpu_with_mfma_takes_its_own_kernel(arch):
    backend = StandIn("hip", (arch,))
    for m in (1, 64, 4096):
        assert gemm_op.resolve_method(backend, m, 23, _weight(), "auto") == "fused"
    assert MFMA_TILES[pick_mfma_tile(backend)].arch == arch
    assert mfma_tiles(backend) == [f"{arch}_64x64"]
    # other operand widths have no MFMA build: the vendor product, and `fused` is refused in one line
    assert gemm_op.resolve_method(backend, 64, 31, _weight(), "auto") == "blas"
    with pytest.raises(InputError, match="fused kernel exists"):
        gemm_op.resolve_method(backend, 64, 31, _weight(), "fused")


def test_other_backends_keep_their_methods():
    no_mfma = StandIn("hip", ())
    assert gemm_op.resolve_method(no_mfma, 64, 23, _weight(), "auto") == "blas"
    with pytest.raises(InputError, match="fused kernel exists"):
        gemm_op.resolve_method(no_mfma, 64, 23, _weight(), "fused")
    assert mfma_tiles(StandIn("cuda")) == [] and pick_mfma_tile(StandIn("cuda")) is None
    emulated = StandIn("hip", ("gfx942", "gfx90a"), on_host=True)  # HIP-CPU
    assert gemm_op.resolve_method(emulated, 64, 23, _weight(), "auto") == "blas"
    assert gemm_op.resolve_method(emulated, 64, 23, _weight(), "fused") == "fused"
    assert pick_mfma_tile(emulated) == "gfx942_64x64"


@pytest.fixture(scope="module")
def backend():
    return hip_cpu_backend()


# (M, K, N): a partial 64 x 64 tile, several tiles with ragged edges, K beyond one 64-byte chunk and
# not a multiple of it, K = 0
SHAPES = [(1, 1, 1), (7, 13, 5), (70, 200, 65), (130, 257, 129), (3, 0, 4)]


@pytest.mark.parametrize("tile", list(MFMA_TILES))
def test_mfma_kernels_give_the_reference_bits(backend, tile):
    rng = np.random.default_rng(7)
    for m, k, n in SHAPES:
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            w = random_rows(rng, n, k, "nonfinite" if kind == "normal" and n > 2 else "normal")
            expected = exact.gemm(x, w, gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W)
            weight = gemm_op.encode_weight(backend, backend.asarray(w))
            y = np.asarray(gemm_op.gemm(backend, backend.asarray(x), weight, method="fused", tile=tile))
            assert y.view(np.uint32).tobytes() == expected.view(np.uint32).tobytes(), (tile, m, k, n, kind)


def test_mfma_kernels_at_the_longest_k(backend):
    """K at the contract's limit (65,535 for 23 x 15 bits: 1,024 chunks of 64 in the int32 shift groups).
    Row 0 of x and of w holds 1.0 (setting the row exponent) and then -128 units of the last place, so
    the least significant digit of every other element is -128 on both sides: shift group 0 sums
    65,534 products of 2^14, about 2^30, the largest an encoding can put there. Row 1 of each is
    random over the whole range. The sums must come back exact."""
    k = exact.gemm_max_k(gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W)
    rng = np.random.default_rng(11)
    x = rng.uniform(-1, 1, (2, k)).astype(np.float32)
    w = rng.uniform(-1, 1, (2, k)).astype(np.float32)
    x[0], w[0] = np.float32(-128 * 2.0 ** -(gemm_op.DEFAULT_BITS_A - 2)), np.float32(-128 * 2.0 ** -(gemm_op.DEFAULT_BITS_W - 2))
    x[0, 0] = w[0, 0] = 1.0
    encoded = encode_rows(backend, backend.asarray(x), gemm_op.DEFAULT_BITS_A)
    digits = np.asarray(encoded.digits).reshape(2, 3, -1)
    assert (digits[0, 0, 1:k] == -128).all()  # the extreme least significant digit, as intended
    expected = exact.gemm(x, w, gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W)
    weight = gemm_op.encode_weight(backend, backend.asarray(w))
    for tile in MFMA_TILES:
        y = backend.empty((2, 2), np.float32)
        launch_mfma(backend, tile, encoded, weight, y, -(gemm_op.DEFAULT_BITS_A - 2) - (gemm_op.DEFAULT_BITS_W - 2))
        assert np.asarray(y).view(np.uint32).tobytes() == expected.view(np.uint32).tobytes(), tile


def test_a_tile_of_another_target_is_refused(backend):
    weight = gemm_op.encode_weight(backend, backend.asarray(np.ones((2, 4), np.float32)))
    with pytest.raises(InputError, match="does not run on"):
        launch_mfma(StandIn("hip", ("gfx942",)), "gfx90a_64x64", None, weight, None, 0)
