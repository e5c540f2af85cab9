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
