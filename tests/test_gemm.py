from fractions import Fraction

import numpy as np
import pytest

from exact_oracle import quantize, round_fraction_to_f32
from rlportable.contract import exact, fixedpoint as fp
from rlportable.conform.inputs import random_rows
from rlportable.errors import InputError
from rlportable.ops import gemm as gemm_op
from rlportable.runtime import get_backend

BA, BW = gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W
CPU = get_backend("cpu")


def bits_equal(a, b):
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def oracle_gemm(x, w, bits_a, bits_w):
    out = np.zeros((x.shape[0], w.shape[0]), dtype=np.uint32)
    for i in range(x.shape[0]):
        qa, ea = quantize([float(v) for v in x[i]], bits_a)
        for j in range(w.shape[0]):
            qw, ew = quantize([float(v) for v in w[j]], bits_w)
            s = sum(a * b for a, b in zip(qa, qw))
            out[i, j] = round_fraction_to_f32(Fraction(s) * Fraction(2) ** (ea + ew - (bits_a - 2) - (bits_w - 2)))
    return out


@pytest.mark.parametrize("kind", ["normal", "massive", "tiny", "huge", "special", "zeros"])
def test_reference_equals_exact_oracle(kind):
    rng = np.random.default_rng(len(kind))
    x, w = random_rows(rng, 4, 29, kind), random_rows(rng, 5, 29, kind)
    assert np.array_equal(exact.gemm(x, w, BA, BW).view(np.uint32), oracle_gemm(x, w, BA, BW))


def test_nonfinite_rows_give_canonical_nan_and_zero_gives_plus_zero():
    x = np.array([[1.0, np.nan], [-0.0, 0.0], [1.0, 2.0]], dtype=np.float32)
    w = np.array([[1.0, 1.0], [np.inf, 0.0]], dtype=np.float32)
    y = exact.gemm(x, w, BA, BW).view(np.uint32)
    assert (y[0] == 0x7FC00000).all() and (y[:, 1] == 0x7FC00000).all()
    assert y[1, 0] == 0  # +0, not -0
    assert y[2, 0] == np.float32(3.0).view(np.uint32)


def test_row_permutation_and_batch_invariance():
    rng = np.random.default_rng(7)
    x, w = random_rows(rng, 50, 300, "massive"), random_rows(rng, 40, 300, "normal")
    weight = gemm_op.encode_weight(CPU, w)
    full = gemm_op.gemm(CPU, x, weight)
    perm = rng.permutation(50)
    assert bits_equal(gemm_op.gemm(CPU, x[perm], weight), full[perm])
    for row in (0, 17, 49):
        assert bits_equal(gemm_op.gemm(CPU, x[row:row + 1], weight), full[row:row + 1])


def test_k_sharding_with_max_exponent_is_exact():
    """The tensor-parallel case: shards encode with the all-reduced MAX exponent and add integer sums."""
    rng = np.random.default_rng(11)
    x, w = random_rows(rng, 8, 512, "massive"), random_rows(rng, 6, 512, "normal")
    full = exact.gemm(x, w, BA, BW)
    for shards in (2, 4, 8):
        parts = np.array_split(np.arange(512), shards)
        ea = np.max([fp.row_exponents(x[:, p]) for p in parts], axis=0)
        ew = np.max([fp.row_exponents(w[:, p]) for p in parts], axis=0)
        total = np.zeros((8, 6), dtype=np.int64)
        for p in parts:
            qa = _quantize_with(x[:, p], ea, BA)
            qw = _quantize_with(w[:, p], ew, BW)
            total += exact.exact_int_matmul(qa, qw)
        scale = fp.scale_exponent(ea, BA)[:, None] + fp.scale_exponent(ew, BW)[None, :]
        assert bits_equal(fp.round_scaled(total, scale), full)


def _quantize_with(x, e, bits):
    scaled = x.astype(np.float64) * np.ldexp(1.0, (bits - 2 - e.astype(np.int64)))[:, None]
    limit = float(2 ** (bits - 1) - 1)
    return np.clip(np.rint(scaled), -limit, limit).astype(np.int64)


def relative_error(y, reference):
    return float(np.linalg.norm(y.astype(np.float64) - reference) / np.linalg.norm(reference))


@pytest.mark.parametrize("kind", ["normal", "massive"])
@pytest.mark.parametrize("k", [1024, 3072])
def test_default_bits_beat_a_bf16_gemm(kind, k):
    """The issue's criterion for choosing the bits: per-GEMM error below bf16 with fp32 accumulation."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(k)
    x = random_rows(rng, 64, k, kind)
    w = (random_rows(rng, 128, k, "normal") * np.float32(0.02)).astype(np.float32)
    reference = x.astype(np.float64) @ w.astype(np.float64).T
    bf16 = lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)
    bf16_error = relative_error(bf16(x) @ bf16(w).T, reference)
    ours = relative_error(exact.gemm(x, w, BA, BW), reference)
    assert ours < bf16_error / 10, (ours, bf16_error)


def test_bad_inputs_name_the_problem():
    weight = gemm_op.encode_weight(CPU, np.zeros((4, 8), np.float32))
    with pytest.raises(InputError, match="K=9"):
        gemm_op.gemm(CPU, np.zeros((2, 9), np.float32), weight)
    with pytest.raises(InputError, match="float32"):
        gemm_op.gemm(CPU, np.zeros((2, 8), np.float64), weight)
    with pytest.raises(InputError, match="2-D"):
        gemm_op.gemm(CPU, np.zeros((8,), np.float32), weight)
    big = gemm_op.encode_weight(CPU, np.zeros((1, 70000), np.float32))
    with pytest.raises(InputError, match="limit"):
        gemm_op.gemm(CPU, np.zeros((1, 70000), np.float32), big)


def test_empty_shapes():
    weight = gemm_op.encode_weight(CPU, np.zeros((3, 0), np.float32))
    y = gemm_op.gemm(CPU, np.zeros((2, 0), np.float32), weight)
    assert y.shape == (2, 3) and (y.view(np.uint32) == 0).all()


def test_strided_views_are_refused():
    """Kernels read row-major memory: a strided view would be read wrongly on a device."""
    weight = gemm_op.encode_weight(CPU, np.zeros((4, 8), np.float32))
    x = np.zeros((3, 16), np.float32)[:, ::2]
    with pytest.raises(InputError, match="C-contiguous"):
        gemm_op.gemm(CPU, x, weight)


def test_a_shared_encoding_must_be_the_one_of_x():
    from rlportable.errors import InputError
    from rlportable.ops import fixedpoint, gemm as gemm_op
    from rlportable.runtime import get_backend

    cpu = get_backend("cpu")
    x = np.ones((3, 8), np.float32)
    weight = gemm_op.encode_weight(cpu, np.ones((4, 8), np.float32))
    shared = fixedpoint.encode_rows(cpu, x, gemm_op.DEFAULT_BITS_A)
    assert np.array_equal(gemm_op.gemm(cpu, x, weight, encoded=shared), gemm_op.gemm(cpu, x, weight))
    with pytest.raises(InputError, match="shared encoding is 3x8 at 23 bits; x is 2x8"):
        gemm_op.gemm(cpu, x[:2], weight, encoded=shared)


class _FakeCuda:
    """What gemm's method and tile choice read from a CUDA backend (no GPU needed)."""

    kernel_vendor = "cuda"
    runs_reference = False
    label = "cuda"

    def __init__(self, compute_capability):
        self.compute_capability = compute_capability


def _encoded_weight(n, k):
    return gemm_op.encode_weight(get_backend("cpu"), np.ones((n, k), np.float32))


def test_method_choice_by_device_and_shape():
    hopper, ampere = _FakeCuda("90"), _FakeCuda("80")
    narrow, wide_k, wider_k = _encoded_weight(8, 1024), _encoded_weight(8, 2048), _encoded_weight(8, 4096)
    # below BLAS_FROM_M always fused (decode steps are captured in graphs: no vendor BLAS inside)
    assert gemm_op.resolve_method(ampere, 256, 23, wide_k, "auto") == "fused"
    assert gemm_op.resolve_method(hopper, 256, 23, wide_k, "auto") == "fused"
    # large M: the wgmma kernel up to WGMMA_LARGE_M_MAX_K, the vendor GEMM beyond and without wgmma
    assert gemm_op.resolve_method(hopper, 4096, 23, narrow, "auto") == "fused"
    assert gemm_op.resolve_method(hopper, 4096, 23, wide_k, "auto") == "fused"
    assert gemm_op.resolve_method(hopper, 4096, 23, wider_k, "auto") == "blas"
    assert gemm_op.resolve_method(ampere, 4096, 23, narrow, "auto") == "blas"
    with pytest.raises(InputError, match="fused kernel exists"):
        gemm_op.resolve_method(ampere, 4, 15, narrow, "fused")  # 2 activation digits


def test_tile_choice_and_availability():
    from rlportable.ops import gemm_fused

    assert gemm_fused.pick_tile(256, 1024, wgmma=True) == "w64x32"  # few tiles: the narrow ones
    assert gemm_fused.pick_tile(256, 1024, wgmma=True, k=2048) == "w64x64g2s2"  # ... unless K is long: split-K
    assert gemm_fused.pick_tile(128, 1024, wgmma=True, k=3072) == "w64x32s2"  # ... in 64 x 32 for fewer rows
    assert gemm_fused.pick_tile(256, 2048, wgmma=True) == "w64x64"
    assert gemm_fused.pick_tile(256, 4096, wgmma=True) == "w64x128"  # q/k/v stacked: one wave of 64 x 128
    assert gemm_fused.pick_tile(256, 6144, wgmma=True) == "w64x192g"  # gate/up stacked: one wave of grouped 64 x 192
    assert gemm_fused.pick_tile(256, 151936, wgmma=True) == "w64x192g"  # the LM head: many tiles
    assert gemm_fused.pick_tile(128, 6144, wgmma=True) == "w64x96g"  # one wave of grouped 64 x 96
    assert gemm_fused.pick_tile(128, 4096, wgmma=True) == "w64x64"
    assert gemm_fused.pick_tile(4096, 1024, wgmma=True) == "w64x192g"  # prefill: grouped from 120 tiles on
    assert gemm_fused.pick_tile(64, 151936, wgmma=True) == "w64x128"  # no grouped tiles up to 64 rows (unmeasured)
    assert gemm_fused.tile_spec("w64x64g2s2").kernel == "gemm_wgmma_a3w2_64x64_groups2_split2"
    assert gemm_fused.tile_spec("w64x64g2s2").threads == 256
    assert gemm_fused.pick_tile(64, 6144, wgmma=True) == "w64x64"  # wide outputs from 17 rows
    assert gemm_fused.pick_tile(64, 1024, wgmma=True) == "16x16k8"  # small: the direct kernels
    assert gemm_fused.pick_tile(8, 151936, wgmma=True) == "16x32k4"
    assert gemm_fused.pick_tile(256, 1024, wgmma=False) == "16x32k4"
    assert not any(t.startswith("w") for t in gemm_fused.available_tiles(_FakeCuda("80")))
    assert {"w64x32", "w64x64", "w64x128"} <= set(gemm_fused.available_tiles(_FakeCuda("90")))
    spec = gemm_fused.tile_spec("w64x128")
    assert (spec.kind, spec.threads, spec.shared_bytes) == ("wgmma", 384, 4 * (3 * 64 + 2 * 128) * 128 + 1024)
    assert all(t.shared_bytes <= 227 * 1024 for t in gemm_fused.FUSED_TILES.values())  # the H100/H200 per-block limit
    grouped = gemm_fused.tile_spec("w64x192g")
    assert (grouped.kernel, grouped.cols, grouped.shared_bytes) == ("gemm_wgmma_a3w2_64x192_groups", 192,
                                                                    3 * (3 * 64 + 2 * 192) * 128 + 1024)
    assert 2 * gemm_fused.tile_spec("w64x32").shared_bytes <= 228 * 1024  # two 64 x 32 blocks per multiprocessor
    encoded = fixedpoint_encode_ones(64)
    with pytest.raises(InputError, match="compute capability 9.0"):
        gemm_fused.launch_fused(_FakeCuda("80"), spec, encoded, _encoded_weight(8, 64), None, 0)


class _RecordingCuda(_FakeCuda):
    """A Hopper stand-in that records its launches."""

    def __init__(self):
        super().__init__("90")
        self.launches = []

    def launch(self, family, kernel, grid, block, args, shared_mem=0):
        self.launches.append((kernel, grid, args))


def test_wgmma_launch_splits_k_over_clusters_and_writes_column_ranges():
    from rlportable.ops import gemm_fused

    backend, encoded, weight = _RecordingCuda(), fixedpoint_encode_ones(64), _encoded_weight(100, 64)
    outputs = [np.empty((4, 60), np.float32), np.empty((4, 24), np.float32), np.empty((4, 16), np.float32)]
    gemm_fused.launch_fused(backend, gemm_fused.tile_spec("w64x64s2"), encoded, weight, outputs, -34)
    kernel, grid, args = backend.launches[0]
    assert kernel == "gemm_wgmma_a3w2_64x64_split2"
    assert grid == (2, 2)  # one row block x two splits (a cluster), two column blocks
    assert args[8:11] == tuple(outputs) and (int(args[11]), int(args[12])) == (60, 84)
    gemm_fused.launch_fused(backend, gemm_fused.tile_spec("w64x32"), encoded, weight, [np.empty((4, 100), np.float32)],
                            -34)
    assert [int(c) for c in backend.launches[1][2][11:]] == [100, 100]  # one output: c1 = c2 = N
    with pytest.raises(InputError, match="output 1 must be a contiguous float32"):
        gemm_fused.launch_fused(backend, gemm_fused.tile_spec("w64x64"), encoded, weight,
                                [outputs[0], np.empty((3, 24), np.float32), outputs[2]], -34)
    with pytest.raises(InputError, match="do not add up"):
        gemm_fused.launch_fused(backend, gemm_fused.tile_spec("w64x64"), encoded, weight, outputs[:2], -34)
    with pytest.raises(InputError, match="writes one output"):
        gemm_fused.launch_fused(backend, gemm_fused.tile_spec("t64x64"), encoded, weight, outputs, -34)


def test_stacked_weight_parts_are_their_own_encodings_and_gemm_columns_their_gemms():
    cpu = get_backend("cpu")
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal((n, 40)).astype(np.float32) for n in (7, 3, 5)]
    stacked = gemm_op.encode_stacked_weight(cpu, parts)
    assert (stacked.whole.n, stacked.whole.k) == (15, 40)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    for part, w, y in zip(stacked.parts, parts, gemm_op.gemm_columns(cpu, x, stacked)):
        alone = gemm_op.encode_weight(cpu, w)
        assert np.array_equal(part.encoded.digits, alone.encoded.digits)
        assert np.array_equal(part.encoded.exponents, alone.encoded.exponents)
        assert np.array_equal(y.view(np.uint32), gemm_op.gemm(cpu, x, alone).view(np.uint32))
    with pytest.raises(InputError, match="must share K"):
        gemm_op.encode_stacked_weight(cpu, [parts[0], np.ascontiguousarray(parts[1][:, :30])])


def test_gemm_columns_is_one_wgmma_launch_writing_every_part_on_hopper():
    """The device path of gemm_columns without a GPU (launches recorded): one wgmma launch that writes the
    parts' own arrays from the shared encoding (none made when one is given), the tile chosen for the
    stacked N and K; a forced non-wgmma tile gives one gemm per part in that tile."""
    from recording_device import RecordingDevice

    from rlportable.ops import fixedpoint

    cpu = get_backend("cpu")
    stacked = gemm_op.encode_stacked_weight(cpu, [np.ones((n, 256), np.float32) for n in (128, 64, 64)])
    x = np.ones((256, 256), np.float32)
    hopper = RecordingDevice("cuda")
    hopper.compute_capability = "90"
    ys = gemm_op.gemm_columns(hopper, x, stacked, encoded=fixedpoint.encode_rows(cpu, x, gemm_op.DEFAULT_BITS_A))
    [launch] = hopper.launches
    assert launch.kernel == "gemm_wgmma_a3w2_64x32" and launch.grid == (4, 8)
    assert [y.shape for y in ys] == [(256, 128), (256, 64), (256, 64)]
    assert all(arg is y for arg, y in zip(launch.args[8:11], ys))
    assert [int(c) for c in launch.args[11:]] == [128, 192]
    hopper.launches.clear()
    gemm_op.gemm_columns(hopper, x, stacked, tile="16x16k8")  # encodes x once, then a gemm per part
    assert [launch.kernel for launch in hopper.launches] == ["fixedpoint_encode_rows"] + ["gemm_fused_a3w2_16x16k8"] * 3
    assert all(launch.args[1] is part.encoded.digits for launch, part in zip(hopper.launches[1:], stacked.parts))


def fixedpoint_encode_ones(k):
    from rlportable.ops import fixedpoint

    return fixedpoint.encode_rows(get_backend("cpu"), np.ones((4, k), np.float32), gemm_op.DEFAULT_BITS_A)


def test_hopper_builds_target_the_arch_specific_sm_90a():
    from rlportable.runtime import flags

    assert flags.cuda_arch_option("90") == "--gpu-architecture=sm_90a"  # wgmma exists only there
    assert flags.cuda_arch_option("80") == "--gpu-architecture=sm_80"
