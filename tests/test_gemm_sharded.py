"""Row-parallel gemm pieces (tensor parallelism) on cpu: the k_sharding identity of contracts/gemm.toml.

The ranks are emulated here with NumPy in place of the collectives: an all-reduce MAX of the
shards' row exponents (np.maximum), per-rank encodings and exact int64 sums, an all-reduce SUM
(int64 addition in any order) and one rounding. Every comparison is bitwise.
"""

import numpy as np
import pytest

from rlportable.conform import fixedpoint as fixedpoint_conform, gemm as gemm_conform
from rlportable.conform.inputs import ROW_KINDS, random_rows, shard_bounds, split_columns
from rlportable.contract import exact, fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops import fixedpoint as fixedpoint_op, gemm as gemm_op
from rlportable.runtime import get_backend

BA, BW = gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W
CPU = get_backend("cpu")
NAN_BITS = int(fp.CANONICAL_NAN_BITS)


def bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def unsharded_gemm(x, w, bits_a=BA, bits_w=BW):
    return gemm_op.gemm(CPU, x, gemm_op.encode_weight(CPU, w, bits_w), bits_a)


def emulated_ranks(x, w, bounds, bits_a=BA, bits_w=BW, sum_order=None):
    """One rank per K-shard [b_s, b_s+1): MAX of exponents, per-rank exact sums, SUM, one rounding."""
    x_shards, w_shards = split_columns(x, bounds), split_columns(w, bounds)
    ea = np.maximum.reduce([fixedpoint_op.row_exponents(CPU, shard) for shard in x_shards])  # all-reduce MAX
    ew = np.maximum.reduce([fixedpoint_op.row_exponents(CPU, shard) for shard in w_shards])
    partial = []
    for x_s, w_s in zip(x_shards, w_shards):  # each rank
        weight = gemm_op.encode_weight(CPU, w_s, bits_w, exponents=ew)
        partial.append(gemm_op.gemm_sums(CPU, fixedpoint_op.encode_rows(CPU, x_s, bits_a, exponents=ea), weight))
        assert partial[-1].dtype == np.int64
    total = np.zeros((x.shape[0], w.shape[0]), np.int64)
    for rank in sum_order if sum_order is not None else range(len(partial)):  # all-reduce SUM
        total += partial[rank]
    return gemm_op.round_sums(CPU, total, ea, bits_a, weight)


@pytest.mark.parametrize("shards", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_k_sharded_gemm_is_bitwise_the_gemm(shards, kind):
    rng = np.random.default_rng([shards, len(kind)])
    k = 203  # not a multiple of 64: shards end inside the K padding
    x = random_rows(rng, 11, k, kind)
    w = random_rows(rng, 9, k, "normal" if kind == "nonfinite" else kind)
    expected = unsharded_gemm(x, w)
    assert bits_equal(expected, exact.gemm(x, w, BA, BW))
    for bounds in (shard_bounds(rng, k, shards), np.linspace(0, k, shards + 1).astype(np.int64)):
        assert bits_equal(emulated_ranks(x, w, bounds, sum_order=rng.permutation(shards)), expected), bounds


@pytest.mark.parametrize("bounds", [[0, 1, 64, 65, 203], [0, 0, 100, 100, 203], [0, 203, 203], [0, 7, 203]])
def test_ragged_and_empty_shard_widths(bounds):
    rng = np.random.default_rng(len(bounds))
    x, w = random_rows(rng, 6, 203, "massive"), random_rows(rng, 5, 203, "normal")
    assert bits_equal(emulated_ranks(x, w, np.array(bounds)), unsharded_gemm(x, w))


def test_nonfinite_in_one_shard_only_makes_the_row_nan():
    rng = np.random.default_rng(1)
    bounds = np.array([0, 50, 120, 200])
    x, w = random_rows(rng, 6, 200, "normal"), random_rows(rng, 5, 200, "normal")
    x[1, 130], x[4, 3] = np.nan, -np.inf  # row 1 in shard 2, row 4 in shard 0
    w[2, 60] = np.inf  # weight row 2 in shard 1
    y = emulated_ranks(x, w, bounds)
    assert bits_equal(y, unsharded_gemm(x, w))
    bits = y.view(np.uint32)
    assert (bits[[1, 4]] == NAN_BITS).all() and (bits[:, 2] == NAN_BITS).all()
    assert np.isfinite(np.delete(np.delete(y, [1, 4], axis=0), 2, axis=1)).all()


def test_all_zero_shards_and_zero_rows():
    rng = np.random.default_rng(2)
    bounds = np.array([0, 40, 90, 150])
    x, w = random_rows(rng, 5, 150, "normal"), random_rows(rng, 4, 150, "normal")
    x[:, 40:90] = -0.0  # one shard is zero in every row: its exponents are -149, MAX ignores them
    w[:, 0:40] = 0.0
    x[3] = 0.0  # a row zero in every shard: +0 everywhere
    y = emulated_ranks(x, w, bounds)
    assert bits_equal(y, unsharded_gemm(x, w))
    assert (y[3].view(np.uint32) == 0).all()


def test_subnormals_and_a_huge_row():
    rng = np.random.default_rng(3)
    bounds = np.array([0, 33, 64, 97])
    x = random_rows(rng, 6, 97, "tiny")  # subnormal rows: exponents down to -149
    x[1, 33:64] *= np.float32(1e30)  # a shard far above the row's others: they round to 0 as unsharded
    x[2] = random_rows(rng, 1, 97, "huge")[0]  # near FLT_MAX: results overflow to +-inf as unsharded
    x[2, 70] = np.finfo(np.float32).max
    w = random_rows(rng, 7, 97, "normal")
    w[0] = random_rows(rng, 1, 97, "tiny")[0]
    for bits_a, bits_w in ((BA, BW), (15, 15), (31, 15)):
        expected = unsharded_gemm(x, w, bits_a, bits_w)
        assert bits_equal(emulated_ranks(x, w, bounds, bits_a, bits_w), expected)
    assert np.isinf(unsharded_gemm(x, w)[2]).any()


@pytest.mark.parametrize("bits_a,bits_w", [(BA, BW), (15, 15), (8, 8), (31, 15)])
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_round_sums_of_gemm_sums_is_the_gemm(kind, bits_a, bits_w):
    rng = np.random.default_rng([bits_a, len(kind)])
    x = random_rows(rng, 13, 150, kind)
    w = random_rows(rng, 10, 150, "nonfinite" if kind == "normal" else kind)
    weight = gemm_op.encode_weight(CPU, w, bits_w)
    encoded = fixedpoint_op.encode_rows(CPU, x, bits_a)
    sums = gemm_op.gemm_sums(CPU, encoded, weight)
    assert sums.dtype == np.int64 and sums.shape == (13, 10)
    qa, qw = fp.quantize_rows(x, bits_a)[0], fp.quantize_rows(w, bits_w)[0]
    assert np.array_equal(sums, qa @ qw.T)  # int64 matmul: exact, |S| < 2^53
    y = gemm_op.round_sums(CPU, sums, encoded.exponents, bits_a, weight)
    assert bits_equal(y, gemm_op.gemm(CPU, x, weight, bits_a))


def test_empty_shapes():
    weight = gemm_op.encode_weight(CPU, np.zeros((3, 0), np.float32))
    sums = gemm_op.gemm_sums(CPU, fixedpoint_op.encode_rows(CPU, np.zeros((2, 0), np.float32), BA), weight)
    assert sums.shape == (2, 3) and sums.dtype == np.int64 and not sums.any()
    y = gemm_op.round_sums(CPU, sums, np.full(2, -149, np.int32), BA, weight)
    assert (y.view(np.uint32) == 0).all()
    assert fixedpoint_op.row_exponents(CPU, np.zeros((0, 4), np.float32)).shape == (0,)
    assert fixedpoint_op.row_exponents(CPU, np.zeros((2, 0), np.float32)).tolist() == [-149, -149]


@pytest.mark.parametrize("bits,descending", [(BA, False), (BW, True), (53, False), (9, False)])
def test_given_exponents_encode_a_shard_as_the_whole_row(bits, descending):
    rng = np.random.default_rng(bits)
    x = random_rows(rng, 8, 300, "special")
    x[5, 250] = np.nan
    whole = fixedpoint_op.encode_rows(CPU, x, bits, descending)
    for a, b in ((0, 300), (0, 64), (64, 65), (100, 300), (7, 7)):
        shard = fixedpoint_op.encode_rows(CPU, np.ascontiguousarray(x[:, a:b]), bits, descending,
                                          exponents=whole.exponents)
        assert shard.exponents is whole.exponents  # the given array itself
        assert np.array_equal(shard.digits[:, :, : b - a], whole.digits[:, :, a:b])
        assert not shard.digits[:, :, b - a:].any()  # K padding stays zero


def test_sentinel_given_to_a_finite_row_encodes_zero():
    x = np.array([[1.5, -2.0], [3.0, 4.0]], np.float32)
    given = np.array([fp.NONFINITE_EXPONENT, 5], np.int32)
    encoded = fixedpoint_op.encode_rows(CPU, x, BA, exponents=given)
    assert not encoded.digits[0].any()
    q, e = fp.quantize_rows(x, BA, given)
    assert q[1].tolist() == [3 * 2 ** (BA - 2 - 5), 4 * 2 ** (BA - 2 - 5)] and e is given


def test_exponents_that_do_not_cover_the_row_are_refused():
    x = np.array([[1.0, 8.0], [np.inf, 0.0], [0.0, 0.0]], np.float32)  # own exponents 3, sentinel, -149
    for given in ([2, fp.NONFINITE_EXPONENT, -149], [3, 127, -149], [3, fp.NONFINITE_EXPONENT, -150],
                  [128, fp.NONFINITE_EXPONENT, 0]):
        given = np.array(given, np.int32)
        with pytest.raises(InputError, match="encode_rows: given exponent of row"):
            fixedpoint_op.encode_rows(CPU, x, BA, exponents=given)
        with pytest.raises(ValueError):
            fp.quantize_rows(x, BA, given)
    fixedpoint_op.encode_rows(CPU, x, BA, exponents=np.array([127, fp.NONFINITE_EXPONENT, 0], np.int32))
    with pytest.raises(InputError, match=r"int32 \[3\]"):
        fixedpoint_op.encode_rows(CPU, x, BA, exponents=np.array([3, 3], np.int32))
    with pytest.raises(InputError, match=r"int32 \[3\]"):
        gemm_op.encode_weight(CPU, x, exponents=np.array([3, 3, 3], np.int64))
    with pytest.raises(InputError, match="C-contiguous"):
        fixedpoint_op.encode_rows(CPU, x, BA, exponents=np.array([3, 0, 127, 0, 0, 0], np.int32)[::2])


def test_bad_operands_name_the_problem():
    x, w = np.ones((2, 8), np.float32), np.ones((4, 8), np.float32)
    weight = gemm_op.encode_weight(CPU, w)
    encoded = fixedpoint_op.encode_rows(CPU, x, BA)
    with pytest.raises(InputError, match="gemm_sums: x_encoded has K=9"):
        gemm_op.gemm_sums(CPU, fixedpoint_op.encode_rows(CPU, np.ones((2, 9), np.float32), BA), weight)
    with pytest.raises(InputError, match="gemm_sums: activations must be encoded ascending"):
        gemm_op.gemm_sums(CPU, fixedpoint_op.encode_rows(CPU, x, BA, descending=True), weight)
    big = gemm_op.encode_weight(CPU, np.zeros((1, 70000), np.float32))
    with pytest.raises(InputError, match="limit"):
        gemm_op.gemm_sums(CPU, fixedpoint_op.encode_rows(CPU, np.zeros((1, 70000), np.float32), BA), big)
    sums = gemm_op.gemm_sums(CPU, encoded, weight)
    with pytest.raises(InputError, match="sums must have dtype int64"):
        gemm_op.round_sums(CPU, sums.astype(np.float64), encoded.exponents, BA, weight)
    with pytest.raises(InputError, match="round_sums: sums has N=4"):
        gemm_op.round_sums(CPU, sums, encoded.exponents, BA, gemm_op.encode_weight(CPU, np.ones((3, 8), np.float32)))
    with pytest.raises(InputError, match=r"round_sums: exponents_a must be int32 \[2\]"):
        gemm_op.round_sums(CPU, sums, encoded.exponents[:1], BA, weight)


#: the conformance checks of the row-parallel pieces (rlportable/conform/fixedpoint.py and gemm.py)
SHARDED_CHECKS = [(name, dict(family.CHECKS)[name]) for family, name in (
    (fixedpoint_conform, "fixedpoint.row_exponents"), (fixedpoint_conform, "fixedpoint.encode_rows_given"),
    (gemm_conform, "gemm.sums"), (gemm_conform, "gemm.round_sums"), (gemm_conform, "gemm.k_sharded"))]


@pytest.mark.parametrize("name,check", SHARDED_CHECKS, ids=[name for name, _ in SHARDED_CHECKS])
def test_conformance_checks_pass_on_cpu(name, check):
    tally = check(CPU, np.random.default_rng(0), True)
    assert tally.compared > 0 and tally.mismatches == 0
