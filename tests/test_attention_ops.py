"""Exact causal GQA attention (contracts/attention.toml) on the cpu backend: the encoded KV cache,
the paged and packed paths, the contract's invariances, and accuracy against float64 attention.

The device kernels are checked against the same reference, bitwise, by `rlportable conform`
(rlportable/conform/attention.py); their sources compile in tests/test_kernel_sources.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.inputs import random_rows
from rlportable.contract import attention as ref, fixedpoint as fp
from rlportable.contract.elementwise import exp_f32
from rlportable.errors import InputError
from rlportable.ops import attention as op
from rlportable.ops.fixedpoint import encode_rows_reference
from rlportable.runtime import get_backend

CPU = get_backend("cpu")


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def qkv(rng, tokens, hq, hkv, d, kind="normal"):
    def rows(heads):
        return random_rows(rng, tokens * heads, d, kind).reshape(tokens, heads, d)

    return rows(hq), rows(hkv), rows(hkv)


def cu_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def reference_packed(q, k, v, cu):
    out = np.empty(q.shape, dtype=np.float32)
    for a, b in zip(cu[:-1], cu[1:]):
        out[a:b] = ref.attention(q[a:b], k[a:b], v[a:b], np.arange(b - a))
    return out


def paged_tables(rng, lengths, block_size):
    needed = [-(-n // block_size) for n in lengths]
    physical = rng.permutation(sum(needed) + 2)
    tables = np.full((len(lengths), max(needed) + 1), -1, dtype=np.int32)
    used = 0
    for seq, count in enumerate(needed):
        tables[seq, :count] = physical[used:used + count]
        used += count
    return tables, (sum(needed) + 2) * block_size


def slots_of(tables, seq, positions, block_size):
    return (tables[seq, positions // block_size] * block_size + positions % block_size).astype(np.int32)


# ---- the reference refactor (attention -> encode + attention_encoded) kept the bits

def _original_encode_heads(x, bits_):
    rows, heads, dim = x.shape
    q, e = fp.quantize_rows(x.reshape(rows * heads, dim), bits_)
    return q.reshape(rows, heads, dim).astype(np.float64), e.reshape(rows, heads).astype(np.int64)


def _original_attention(q, k, v, q_positions):
    """rlportable/contract/attention.py as of commit fda8907, verbatim but for the names."""
    tq, hq, dim = q.shape
    length, hkv, _ = k.shape
    positions = np.asarray(q_positions, dtype=np.int64)
    qq, eq = _original_encode_heads(q, 23)
    qk, ek = _original_encode_heads(k, 15)
    qv, ev = _original_encode_heads(v, 15)
    allowed = np.arange(length)[None, :] <= positions[:, None]
    scale = 1.0 / np.sqrt(np.float64(dim))
    out = np.empty((tq, hq, dim), dtype=np.float32)
    group = hq // hkv
    for h in range(hq):
        g = h // group
        out[:, h, :] = _original_one_head(qq[:, h], eq[:, h], qk[:, g], ek[:, g], qv[:, g], ev[:, g], allowed, scale)
    return out


def _original_one_head(qq, eq, qk, ek, qv, ev, allowed, scale):
    bad_q = eq == fp.NONFINITE_EXPONENT
    bad_kv = (ek == fp.NONFINITE_EXPONENT) | (ev == fp.NONFINITE_EXPONENT)
    eq_s = np.where(bad_q, 0, eq)
    ek_s = np.where(bad_kv, 0, ek)
    ev_s = np.where(bad_kv, fp.ZERO_ROW_EXPONENT, ev)
    sums = qq @ qk.T
    shift = eq_s[:, None] + ek_s[None, :] - 21 - 13
    scores = ((sums * fp.pow2_f64(shift)) * scale).astype(np.float32)
    scores = np.where(allowed, scores, np.float32(-np.inf))
    m = scores.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.where(allowed, exp_f32(scores - m), np.float32(0)).astype(np.float64)
    total = np.rint(p * 2.0 ** 21).sum(axis=1)
    e_max = np.where(allowed, ev_s[None, :], np.iinfo(np.int64).min).max(axis=1)
    weights = np.rint(p * fp.pow2_f64(np.where(allowed, ev_s[None, :] - e_max[:, None] + 21, 0)))
    weights = np.where(allowed, weights, 0.0)
    numerator = weights @ qv
    out = ((numerator * fp.pow2_f64(e_max - 13)[:, None]) / total[:, None]).astype(np.float32)
    poisoned = bad_q | (allowed & bad_kv[None, :]).any(axis=1)
    out[poisoned] = fp.CANONICAL_NAN
    return out


@pytest.mark.parametrize("kind", ["normal", "massive", "tiny", "huge", "zeros", "special", "nonfinite"])
def test_refactored_reference_is_bit_identical(kind):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, 29, 6, 2, 20, kind)
    positions = np.sort(rng.choice(29, size=12, replace=False))
    q = np.ascontiguousarray(q[:12])
    with np.errstate(all="ignore"):
        before = _original_attention(q, k, v, positions)
    assert np.array_equal(bits(ref.attention(q, k, v, positions)), bits(before))


# ---- the KV cache format

@pytest.mark.parametrize("vendor", ["cuda", "hip"])
def test_write_kv_launch_gives_each_row_a_segment(vendor):
    """attention_write_kv walks the 2 * tokens * hkv K and V rows one segment of 32 lanes each (8 to a
    256-thread block, grid-stride, no shared memory), its arguments matching the kernel's parameters."""
    from recording_device import RecordingDevice, kernel_parameters

    from rlportable.ops import segments

    device = RecordingDevice(vendor)
    tokens, hkv, d = 5, 3, 16
    cache = op.KVCache.allocate(CPU, 32, hkv, d, block_size=4)
    k, v = np.zeros((tokens, hkv, d), np.float32), np.zeros((tokens, hkv, d), np.float32)
    op.write_kv(device, cache, k, v, np.arange(tokens, dtype=np.int32))
    (launch,) = device.launches
    assert launch.kernel == "attention_write_kv"
    assert (launch.grid, launch.block, launch.shared_mem) == ((-(-2 * tokens * hkv // 8),), (256,), 0)
    assert len(launch.args) == len(kernel_parameters(vendor, "attention")["attention_write_kv"])
    assert segments.segment_launch_shape(10 ** 9) == ((segments.MAX_GRID,), (segments.SEGMENT_BLOCK,))


def test_write_kv_stores_fixedpoint_rows_in_slots():
    rng = np.random.default_rng(1)
    hkv, d, tokens = 2, 20, 9
    k, v, _ = qkv(rng, tokens, hkv, hkv, d, "special")
    cache = op.KVCache.allocate(CPU, 16, hkv, d, block_size=4)
    assert cache.k_digits.shape == (16, hkv, 2, 64) and cache.k_exponents.shape == (16, hkv)
    slots = np.array([3, 0, -1, 15, 7, 8, 9, 1, 2], dtype=np.int32)
    op.write_kv(CPU, cache, k, v, slots)
    for x, digits, exponents in ((k, cache.k_digits, cache.k_exponents), (v, cache.v_digits, cache.v_exponents)):
        enc = encode_rows_reference(x.reshape(tokens * hkv, d), 15)
        want = enc.digits.reshape(tokens, hkv, 2, 64)
        for i, slot in enumerate(slots):
            if slot >= 0:
                assert np.array_equal(digits[slot], want[i]) and np.array_equal(exponents[slot], enc.exponents.reshape(tokens, hkv)[i])
        assert not digits[[4, 5, 6, 10, 11, 12, 13, 14]].any()  # untouched (slot -1 wrote nothing)
        joined = fp.join_digits(np.moveaxis(digits[slots[slots >= 0]][..., :d], 2, 0))
        assert np.array_equal(joined, fp.quantize_rows(x[slots >= 0].reshape(-1, d), 15)[0].reshape(joined.shape))


# ---- packed, paged, and the invariances

@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 128), (8, 2, 20), (3, 1, 7)])
def test_packed_equals_reference_per_sequence(hq, hkv, d):
    rng = np.random.default_rng(hq * 100 + d)
    lengths = [1, 7, 33, 60]
    cu = cu_of(lengths)
    q, k, v = qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
    out = op.attention_packed(CPU, q, k, v, cu)
    assert np.array_equal(bits(out), bits(reference_packed(q, k, v, cu)))
    # the same through the paged cache path (contiguous slots, block size 1 tables)
    q_seq, q_pos, tables = op.packed_layout(cu)
    cache = op.KVCache.allocate(CPU, int(cu[-1]), hkv, d, block_size=1)
    op.write_kv(CPU, cache, k, v, np.arange(int(cu[-1]), dtype=np.int32))
    assert np.array_equal(bits(op.attention_paged(CPU, q, q_seq, q_pos, cache, tables)), bits(out))


def test_position_in_batch_and_offsets():
    rng = np.random.default_rng(2)
    hq, hkv, d, n = 4, 2, 32, 40
    q, k, v = qkv(rng, n, hq, hkv, d)
    alone = op.attention_packed(CPU, q, k, v, [0, n])
    for before, after in (([5], [9]), ([1, 17, 3], []), ([], [2, 2])):
        lengths = before + [n] + after
        pq, pk, pv = qkv(rng, sum(lengths), hq, hkv, d)
        o = sum(before)
        pq[o:o + n], pk[o:o + n], pv[o:o + n] = q, k, v
        packed = op.attention_packed(CPU, pq, pk, pv, cu_of(lengths))
        assert np.array_equal(bits(packed[o:o + n]), bits(alone))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_chunked_and_decode_agree_at_every_block_size(block_size):
    rng = np.random.default_rng(3 + block_size)
    hq, hkv, d, n, partner = 8, 2, 64, 45, 12
    q, k, v = qkv(rng, n, hq, hkv, d, "massive")
    pq, pk, pv = qkv(rng, partner, hq, hkv, d)
    alone = reference_packed(q, k, v, cu_of([n]))
    positions = np.arange(n)

    def fresh():
        tables, num_slots = paged_tables(rng, [n, partner], block_size)
        return op.KVCache.allocate(CPU, num_slots, hkv, d, block_size), tables

    # prefill at once
    cache, tables = fresh()
    op.write_kv(CPU, cache, k, v, slots_of(tables, 0, positions, block_size))
    out = op.attention_paged(CPU, q, np.zeros(n, np.int32), positions.astype(np.int32), cache, tables)
    assert np.array_equal(bits(out), bits(alone))
    # chunked prefill
    cache, tables = fresh()
    for a, b in ((0, 1), (1, 20), (20, 21), (21, n)):
        op.write_kv(CPU, cache, k[a:b], v[a:b], slots_of(tables, 0, positions[a:b], block_size))
        out = op.attention_paged(CPU, q[a:b], np.zeros(b - a, np.int32), positions[a:b].astype(np.int32), cache, tables)
        assert np.array_equal(bits(out), bits(alone[a:b]))
    # decode, batched with a second sequence while it lasts
    cache, tables = fresh()
    for t in range(n):
        op.write_kv(CPU, cache, k[t:t + 1], v[t:t + 1], slots_of(tables, 0, positions[t:t + 1], block_size))
        if t < partner:
            op.write_kv(CPU, cache, pk[t:t + 1], pv[t:t + 1], slots_of(tables, 1, positions[t:t + 1], block_size))
            out = op.attention_paged(CPU, np.concatenate([pq[t:t + 1], q[t:t + 1]]), np.array([1, 0], np.int32),
                                     np.array([t, t], np.int32), cache, tables)[1]
        else:
            out = op.attention_paged(CPU, q[t:t + 1], np.zeros(1, np.int32), np.array([t], np.int32), cache, tables)[0]
        assert np.array_equal(bits(out), bits(alone[t]))


def test_nonfinite_rows_give_canonical_nan_exactly_where_defined():
    rng = np.random.default_rng(4)
    hq, hkv, d, n = 4, 2, 16, 12
    q, k, v = qkv(rng, n, hq, hkv, d)
    q[2, 1, 0] = np.nan
    k[5, 0, 3] = -np.inf  # kv head 0 -> heads 0, 1 from position 5 on
    v[8, 1, 3] = np.nan  # kv head 1 -> heads 2, 3 from position 8 on
    out = op.attention_packed(CPU, q, k, v, [0, n])
    nan_rows = np.zeros((n, hq), bool)
    nan_rows[2, 1] = True
    nan_rows[5:, :2] = True
    nan_rows[8:, 2:] = True
    assert np.array_equal(np.isnan(out).all(axis=2), nan_rows)
    assert (bits(out[nan_rows]) == 0x7FC00000).all() and not np.isnan(out[~nan_rows]).any()
    # a score that overflows float32 (m = +inf) also gives the canonical NaN
    big = np.full((2, 1, 4), 3e38, np.float32)
    assert (bits(op.attention_packed(CPU, big, big, big, [0, 2])) == 0x7FC00000).all()


def test_zero_rows_and_tiny_values():
    q = np.zeros((3, 2, 8), np.float32)
    k = np.zeros((3, 1, 8), np.float32)
    v = np.zeros((3, 1, 8), np.float32)
    out = op.attention_packed(CPU, q, k, v, [0, 3])
    assert (bits(out) == 0).all()  # +0
    v[:, 0, :] = np.arange(1, 4, dtype=np.float32)[:, None]
    out = op.attention_packed(CPU, q, k, v, [0, 3])  # equal scores: the mean of v_0..v_t
    assert np.array_equal(out[:, 0, 0], np.array([1.0, 1.5, 2.0], np.float32))
    tiny = (v * np.float32(1e-42)).astype(np.float32)
    out = op.attention_packed(CPU, q, k, tiny, [0, 3])
    assert out[0, 0, 0] == tiny[0, 0, 0] and np.isfinite(out).all()


# ---- accuracy against float64 softmax attention

def attention_f64(q, k, v, positions):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    out = np.empty(q.shape)
    allowed = np.arange(k.shape[0])[None, :] <= np.asarray(positions)[:, None]
    for h in range(hq):
        s = q[:, h] @ k[:, h // group].T / np.sqrt(d)
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p @ v[:, h // group]) / p.sum(axis=1, keepdims=True)
    return out


def dequantize(x, bits_):
    t, h, d = x.shape
    qi, e = fp.quantize_rows(x.reshape(t * h, d), bits_)
    return (qi * np.ldexp(1.0, e.astype(np.int64) - (bits_ - 2))[:, None]).reshape(t, h, d)


@pytest.mark.parametrize("kind,d", [("normal", 64), ("massive", 128), ("normal", 20)])
def test_accuracy_against_float64_attention(kind, d):
    """Two bounds, both derived, neither fitted.

    (a) Against float64 attention of the ENCODED inputs, only the contract's own roundings remain:
        the float32 score (relative 2^-24, so p_j moves by a factor exp(+-2|s_j| 2^-24)), the
        correctly rounded exp (2^-24), p counted in units of 2^-21 (|dL|/L <= n 2^-22 with
        L >= 2^21; the weights' rounding moves o by at most n 2^-22 max|v| / sum p <= n 2^-22 max|v|),
        and the final float32 rounding:
          |o - o64q| <= max|v| (n 2^-21 + 4 (max|s| + 1) 2^-24) + |o| 2^-24.
    (b) Against float64 attention of the ORIGINAL inputs, the encoding adds at most half a unit
        per element: q at 2^(eq-22) <= max|q| 2^-22, k_j and v_j at <= max|row| 2^-14. A score then
        moves by at most delta_j = (sum_d |q_d| max|k_j| 2^-14 + max|q| sum_d |k_jd| 2^-22) / sqrt(D),
        the softmax weights by a factor within exp(+-2 delta), and each value by max|v| 2^-14:
          |o - o64| <= (exp(2 max_j delta_j) - 1) max|v| + max|v| 2^-14 + bound (a).
    The measured errors are checked against these bounds (first order, with 1% slack).
    """
    rng = np.random.default_rng(d)
    hq, hkv, n = 4, 2, 150
    q, k, _ = qkv(rng, n, hq, hkv, d)
    q *= np.float32(2.0)  # peakier softmax than unit scores
    v = random_rows(rng, n * hkv, d, kind).reshape(n, hkv, d)  # massive: one channel 25,000x the rest
    positions = np.arange(n)
    got = op.attention_packed(CPU, q, k, v, [0, n]).astype(np.float64)
    group = hq // hkv
    qd, kd, vd = dequantize(q, 23), dequantize(k, 15), dequantize(v, 15)
    exact_encoded = attention_f64(qd, kd, vd, positions)
    exact = attention_f64(q, k, v, positions)
    keys = positions + 1
    for h in range(hq):
        g = h // group
        vmax = np.abs(v[:, g]).max()
        scores = np.abs(qd[:, h] @ kd[:, g].T) / np.sqrt(d)
        smax = np.where(np.arange(n)[None, :] <= positions[:, None], scores, 0).max(axis=1)
        bound_a = vmax * (keys * 2.0**-21 + 4 * (smax + 1) * 2.0**-24) + np.abs(got[:, h]).max(axis=1) * 2.0**-24
        err_a = np.abs(got[:, h] - exact_encoded[:, h]).max(axis=1)
        assert (err_a <= 1.01 * bound_a).all(), (err_a / bound_a).max()
        qabs, kabs = np.abs(q[:, h]).astype(np.float64), np.abs(k[:, g]).astype(np.float64)
        delta = (qabs.sum(axis=1)[:, None] * kabs.max(axis=1)[None, :] * 2.0**-14
                 + qabs.max(axis=1)[:, None] * kabs.sum(axis=1)[None, :] * 2.0**-22) / np.sqrt(d)
        delta = np.where(np.arange(n)[None, :] <= positions[:, None], delta, 0).max(axis=1)
        bound_b = (np.expm1(2 * delta) + 2.0**-14) * vmax + bound_a
        err_b = np.abs(got[:, h] - exact[:, h]).max(axis=1)
        assert (err_b <= 1.01 * bound_b).all(), (err_b / bound_b).max()
        # and in absolute terms: far below bf16 resolution of the output (2^-8 relative)
        assert err_b.max() <= 2.0**-10 * vmax


# ---- input checks name the tensor and its shape

def test_bad_inputs_name_the_tensor():
    cache = op.KVCache.allocate(CPU, 8, 2, 16, block_size=4)
    q = np.zeros((3, 4, 16), np.float32)
    seq, pos = np.zeros(3, np.int32), np.arange(3, dtype=np.int32)
    tables = np.array([[0, 1]], np.int32)
    with pytest.raises(InputError, match=r"q must have dtype float32.*\(3, 4, 16\)"):
        op.attention_paged(CPU, q.astype(np.float64), seq, pos, cache, tables)
    with pytest.raises(InputError, match=r"q has head_dim 8 but the cache has 16"):
        op.attention_paged(CPU, np.zeros((3, 4, 8), np.float32), seq, pos, cache, tables)
    with pytest.raises(InputError, match=r"3 heads are not a multiple"):
        op.attention_paged(CPU, np.zeros((3, 3, 16), np.float32), seq, pos, cache, tables)
    with pytest.raises(InputError, match=r"q_pos must have shape \[Tq=3\], got \(2,\)"):
        op.attention_paged(CPU, q, seq, pos[:2], cache, tables)
    with pytest.raises(InputError, match=r"q_seq must have dtype int32"):
        op.attention_paged(CPU, q, seq.astype(np.int64), pos, cache, tables)
    with pytest.raises(InputError, match=r"needs 3 blocks"):
        op.attention_paged(CPU, q, seq, np.array([0, 1, 9], np.int32), cache, tables)
    with pytest.raises(InputError, match=r"outside the cache"):
        op.attention_paged(CPU, q, seq, pos, cache, np.array([[2, 1]], np.int32))
    with pytest.raises(InputError, match=r"q_seq must lie in"):
        op.attention_paged(CPU, q, np.array([0, 1, 0], np.int32), pos, cache, tables)
    with pytest.raises(InputError, match=r"k must have shape \[T, Hkv=2, D=16\], got \(2, 3, 16\)"):
        op.write_kv(CPU, cache, np.zeros((2, 3, 16), np.float32), np.zeros((2, 3, 16), np.float32), np.zeros(2, np.int32))
    with pytest.raises(InputError, match=r"slots must be distinct"):
        op.write_kv(CPU, cache, np.zeros((2, 2, 16), np.float32), np.zeros((2, 2, 16), np.float32), np.zeros(2, np.int32))
    with pytest.raises(InputError, match=r"slots must be distinct"):  # not sorted: the full check
        op.write_kv(CPU, cache, np.zeros((3, 2, 16), np.float32), np.zeros((3, 2, 16), np.float32),
                    np.array([5, 2, 5], np.int32))
    op.write_kv(CPU, cache, np.zeros((3, 2, 16), np.float32), np.zeros((3, 2, 16), np.float32),
                np.array([5, -1, 2], np.int32))  # distinct, not sorted, one skipped: accepted
    with pytest.raises(InputError, match=r"block_tables row 1 names a block outside"):  # a missing block
        op.attention_paged(CPU, q, np.array([0, 1, 1], np.int32), np.array([0, 0, 5], np.int32), cache,
                           np.array([[0, 1], [1, -1]], np.int32))
    with pytest.raises(InputError, match=r"block_tables row 0 names a block outside"):  # slot 8 of 8, one row
        op.attention_paged(CPU, q, seq, np.array([0, 1, 4], np.int32), cache, np.array([[0, 2]], np.int32))
    op.attention_paged(CPU, q, seq, pos, cache, np.array([[1, 2]], np.int32))  # block 2 named but not reached
    with pytest.raises(InputError, match=r"slot 8 is outside"):
        op.write_kv(CPU, cache, np.zeros((1, 2, 16), np.float32), np.zeros((1, 2, 16), np.float32), np.array([8], np.int32))
    with pytest.raises(InputError, match=r"cu_seqlens must rise from 0 to the 3"):
        op.attention_packed(CPU, q, np.zeros((3, 2, 16), np.float32), np.zeros((3, 2, 16), np.float32), [0, 2])
    with pytest.raises(InputError, match=r"head_dim 600"):
        op.KVCache.allocate(CPU, 4, 1, 600)
    assert op.attention_packed(CPU, np.zeros((0, 4, 16), np.float32), np.zeros((0, 2, 16), np.float32),
                               np.zeros((0, 2, 16), np.float32), [0]).shape == (0, 4, 16)


# ---- kernel variants: "portable" everywhere, "mma" (tensor cores) only for CUDA sources


def test_methods_dispatch_and_reject():

    cpu = get_backend("cpu")
    assert op.available_methods(cpu, 128) == ("portable",)
    assert op.resolve_method(cpu, 1024, 1, 128, "auto") == "portable"
    with pytest.raises(InputError, match="mma"):
        op.resolve_method(cpu, 1024, 1, 128, "mma")
    with pytest.raises(InputError, match="method"):
        op.resolve_method(cpu, 1024, 1, 128, "fast")

    class FakeCuda:
        kernel_vendor = "cuda"
        runs_reference = False
        on_host = False
        label = "cuda"

    cuda = FakeCuda()
    assert op.available_methods(cuda, 128) == ("portable", "mma", "split")
    assert op.available_methods(cuda, 256) == ("portable", "mma", "split")
    assert op.available_methods(cuda, 257) == ("portable", "split")
    assert op.resolve_method(cuda, 1024, 16, 128, "auto") == "mma"  # prefill
    assert op.resolve_method(cuda, 16, 16, 128, "auto") == "split"  # decode
    assert op.resolve_method(cuda, 16, 16, 128, "mma") == "mma"
    assert op.resolve_method(cuda, 16, 16, 128, "portable") == "portable"
    assert op.mma_shared_bytes(128) == 7 * 64 * 128 + 3 * 64 * 64

    hopper = FakeCuda()
    hopper.compute_capability = "90"
    assert op.available_methods(hopper, 128) == ("portable", "mma", "wgmma", "split")
    assert op.available_methods(hopper, 100) == ("portable", "mma", "wgmma", "split")
    assert op.available_methods(hopper, 64) == ("portable", "mma", "split")  # padded to 64, not 128
    assert op.available_methods(hopper, 256) == ("portable", "mma", "split")
    assert op.resolve_method(hopper, 1024, 16, 128, "auto") == ("wgmma" if op.AUTO_WGMMA else "mma")
    assert op.resolve_method(hopper, 1024, 16, 256, "auto") == "mma"
    assert op.resolve_method(hopper, 16, 16, 128, "auto") == "split"
    with pytest.raises(InputError, match="wgmma"):
        op.resolve_method(cuda, 1024, 16, 128, "wgmma")


def test_wgmma_refuses_tables_beyond_its_key_limit():
    """The wgmma kernel keeps its value sums in int32 for tables of at most WGMMA_MAX_KEYS keys: asked for
    by name with wider tables it says so before any launch."""
    class FakeHopper:
        kernel_vendor, compute_capability, label = "cuda", "90", "cuda"
        runs_reference = on_host = False

    backend = FakeHopper()
    cache = op.KVCache(None, None, None, None, num_slots=1 << 18, num_kv_heads=1, head_dim=128, block_size=1)
    q = np.zeros((64, 1, 128), np.float32)
    rows = np.zeros(64, np.int32)
    wide = np.zeros((1, op.WGMMA_MAX_KEYS + 1), np.int32)
    with pytest.raises(InputError, match="at most 65536 keys"):
        op.attention_paged(backend, q, rows, rows, cache, wide, method="wgmma")


def test_mma_kernels_are_declared_cuda_only():
    from rlportable.contract.spec import load_all

    contract = next(c for c in load_all() if c.name == "attention")
    assert contract.cuda_only_kernels[:3] == ["attention_paged_mma_d128", "attention_paged_mma_d256",
                                              "attention_paged_wgmma_d128"]
    assert all(name.startswith("attention_backward_mma_") for name in contract.cuda_only_kernels[3:])
