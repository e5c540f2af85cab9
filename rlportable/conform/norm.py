"""Conformance of the norm family (contracts/norm.toml): rmsnorm (and QK-norm's rmsnorm_heads), the
fused add_rmsnorm with and without the gemm encoding, rmsnorm_heads_rope and its cache-writing variant,
and rmsnorm_backward, bitwise against the reference, with row invariance; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, random_rows, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import norm as norm_ref, rope as rope_ref
from rlportable.ops import attention as attention_op, fixedpoint as fixedpoint_op, norm as norm_op, rope as rope_op
from rlportable.runtime import get_backend
from rlportable.runtime.base import Backend

# (rows, H): ragged (1x1, 7x13, H not a multiple of 16), model-like, and H = 0
NORM_SHAPES_QUICK = [(1, 1), (7, 13), (3, 100), (17, 257), (9, 1024), (5, 0), (0, 8)]
NORM_SHAPES_FULL = NORM_SHAPES_QUICK + [(130, 1000), (64, 4096), (33, 5120), (2, 2**18)]
NORM_EPS = (1e-6, 1e-5, 0.0)


def _permutation_invariance(tally: Tally, rng, full: np.ndarray, x: np.ndarray, run) -> None:
    """Each row's bits must not depend on its neighbours: permuted rows, single rows, a prefix."""
    m = x.shape[0]
    if m == 0:
        return
    permutation = rng.permutation(m)
    tally.add(run(x[permutation]), full[permutation])
    for row in rng.choice(m, size=min(m, 3), replace=False):
        tally.add(run(x[row:row + 1]), full[row:row + 1])
    tally.add(run(x[: max(1, m // 3)]), full[: max(1, m // 3)])


def check_norm_rmsnorm(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for rows, h in sizes(backend, quick, NORM_SHAPES_QUICK, NORM_SHAPES_FULL):
        weights = [random_rows(rng, 1, h, "normal")[0], np.ones(h, dtype=np.float32),
                   random_rows(rng, 1, h, "special")[0], random_rows(rng, 2, h, "nonfinite")[0]]
        for kind in ROW_KINDS:
            x = random_rows(rng, rows, h, kind)
            for w in weights if kind == "normal" else weights[:2]:
                for eps in NORM_EPS if kind in ("normal", "zeros", "tiny") else NORM_EPS[:1]:
                    expected = norm_ref.rmsnorm(x, w, eps) if rows and h else np.empty((rows, h), np.float32)
                    got = norm_op.rmsnorm(backend, backend.asarray(x), backend.asarray(w), eps)
                    tally.add(backend.to_numpy(got), expected)
    # invariance: a row's bits do not depend on the batch around it
    x = random_rows(rng, 37, 300, "massive")
    w = random_rows(rng, 1, 300, "normal")[0]
    w_dev = backend.asarray(w)

    def run(rows):
        return backend.to_numpy(norm_op.rmsnorm(backend, backend.asarray(rows), w_dev, 1e-6))

    _permutation_invariance(tally, rng, run(x), x, run)
    # QK-norm: [tokens, heads, head_dim], each head's row alone
    for tokens, heads, head_dim in ((1, 1, 128), (7, 5, 64), (33, 16, 128)):
        x = random_rows(rng, tokens * heads, head_dim, "normal").reshape(tokens, heads, head_dim)
        w = random_rows(rng, 1, head_dim, "normal")[0]
        got = norm_op.rmsnorm_heads(backend, backend.asarray(x), backend.asarray(w), 1e-6)
        tally.add(backend.to_numpy(got), norm_ref.rmsnorm(x.reshape(-1, head_dim), w, 1e-6).reshape(x.shape))
    return tally


def check_norm_add_rmsnorm(backend: Backend, rng, quick: bool) -> Tally:
    """A layer's residual add and the next RMSNorm in one launch, against the two references in turn;
    every row kind in either operand (overflowing sums and NaN rows included). With encode_bits, also y's
    gemm encoding (digits and exponents) against fixedpoint's reference encoding of the expected y: the
    kernel's own (rows up to norm.MAX_FUSED_ENCODED_ROW) and the fallback's (longer rows, H = 0, other
    bits: encode_rows after the op)."""
    tally = Tally()
    above = norm_op.MAX_FUSED_ENCODED_ROW + 64  # fused without the encoding, then fixedpoint_encode_rows
    shapes = ((1, 8), (7, 96), (0, 16), (2, 0), (2, above)) if quick else \
        ((1, 8), (7, 96), (0, 16), (2, 0), (64, 1024), (130, 4096), (2, above), (3, 8192), (2, 8194))
    bits = norm_ref.ENCODE_BITS
    for rows, h in shapes:
        w = random_rows(rng, 1, h, "normal")[0]
        for kind in ROW_KINDS:
            a, b = random_rows(rng, rows, h, kind), random_rows(rng, rows, h, "normal" if kind == "zeros" else kind)
            expected = norm_ref.add_rmsnorm(a, b, w, 1e-6)
            a_dev, b_dev, w_dev = backend.asarray(a), backend.asarray(b), backend.asarray(w)
            tally.add_outputs(backend, norm_op.add_rmsnorm(backend, a_dev, b_dev, w_dev, 1e-6), expected)
            for encode_bits in (bits, 15) if kind == "normal" else (bits,):  # 15: not the kernel's, encoded after
                want = fixedpoint_op.encode_rows_reference(expected[1], encode_bits)
                s, y, encoded = norm_op.add_rmsnorm(backend, a_dev, b_dev, w_dev, 1e-6, encode_bits=encode_bits)
                tally.add(backend.to_numpy(s), expected[0])
                tally.add(backend.to_numpy(y), expected[1])
                tally.add(backend.to_numpy(encoded.digits), want.digits)
                tally.add(backend.to_numpy(encoded.exponents), want.exponents)
                tally.add(np.array([encoded.bits, encoded.k, int(encoded.descending)], np.int64),
                          np.array([want.bits, want.k, int(want.descending)], np.int64))
    return tally


def check_norm_rmsnorm_heads_rope(backend: Backend, rng, quick: bool) -> Tally:
    """Qwen3's QK-norm and RoPE of q and k in one launch, against the two references in turn; every
    row kind (non-finite rows included) in q and in k."""
    tally = Tally()
    shapes = ((1, 2, 1, 8, 3), (7, 4, 2, 64, 50), (0, 2, 1, 8, 4)) if quick else \
        ((1, 2, 1, 8, 3), (7, 4, 2, 64, 50), (33, 16, 8, 128, 4096), (130, 14, 2, 128, 40000), (0, 2, 1, 8, 4))
    for tokens, hq, hk, d, table_rows in shapes:
        cos, sin = rope_op.tables(backend, table_rows, d, 1_000_000.0)
        cos_ref, sin_ref = rope_ref.tables(np.arange(table_rows), rope_ref.inverse_frequencies(d, 1_000_000.0))
        positions = rng.integers(0, table_rows, size=tokens).astype(np.int32)
        wq, wk = random_rows(rng, 1, d, "normal")[0], random_rows(rng, 1, d, "normal")[0]
        for kind in ROW_KINDS:
            q = random_rows(rng, tokens * hq, d, kind).reshape(tokens, hq, d)
            k = random_rows(rng, tokens * hk, d, "normal" if kind == "zeros" else kind).reshape(tokens, hk, d)
            expected = norm_ref.rmsnorm_heads_rope(q, k, wq, wk, 1e-6, cos_ref[positions], sin_ref[positions])
            got = norm_op.rmsnorm_heads_rope(backend, backend.asarray(q), backend.asarray(k), backend.asarray(wq),
                                             backend.asarray(wk), 1e-6, backend.asarray(positions), cos, sin)
            tally.add_outputs(backend, got, expected)
    return tally


def check_norm_rmsnorm_heads_rope_write_kv(backend: Backend, rng, quick: bool) -> Tally:
    """The engine step's QK-norm, RoPE and cache write in one launch, against rmsnorm_heads_rope's reference
    and the reference cache writer (cpu) in turn: q', k' and every byte of both caches, every row kind in q, k
    and v, a skipped (negative) slot and the cache's widest head_dim."""
    tally = Tally()
    cpu = get_backend("cpu")
    shapes = ((3, 2, 1, 8), (7, 16, 8, 128)) if quick else ((3, 2, 1, 8), (7, 16, 8, 128), (33, 4, 2, 512),
                                                            (130, 14, 2, 64))
    for tokens, hq, hk, d in shapes:
        table_rows = 64
        cos, sin = rope_op.tables(backend, table_rows, d, 1_000_000.0)
        cos_ref, sin_ref = rope_ref.tables(np.arange(table_rows), rope_ref.inverse_frequencies(d, 1_000_000.0))
        positions = rng.integers(0, table_rows, size=tokens).astype(np.int32)
        slots = rng.permutation(2 * tokens)[:tokens].astype(np.int32)
        slots[tokens // 2] = -1  # skipped
        wq, wk = random_rows(rng, 1, d, "normal")[0], random_rows(rng, 1, d, "normal")[0]
        for kind in ROW_KINDS:
            q = random_rows(rng, tokens * hq, d, kind).reshape(tokens, hq, d)
            k = random_rows(rng, tokens * hk, d, "normal" if kind == "zeros" else kind).reshape(tokens, hk, d)
            v = random_rows(rng, tokens * hk, d, kind).reshape(tokens, hk, d)
            expected = norm_ref.rmsnorm_heads_rope(q, k, wq, wk, 1e-6, cos_ref[positions], sin_ref[positions])
            want = attention_op.KVCache.allocate(cpu, 2 * tokens, hk, d, block_size=4)
            attention_op.write_kv(cpu, want, expected[1], v, slots)
            cache = attention_op.KVCache.allocate(backend, 2 * tokens, hk, d, block_size=4)
            got = norm_op.rmsnorm_heads_rope_write_kv(
                backend, backend.asarray(q), backend.asarray(k), backend.asarray(v), backend.asarray(wq),
                backend.asarray(wk), 1e-6, backend.asarray(positions), cos, sin, cache, backend.asarray(slots))
            tally.add_outputs(backend, got, expected)
            for name in ("k_digits", "k_exponents", "v_digits", "v_exponents"):
                tally.add(backend.to_numpy(getattr(cache, name)), getattr(want, name))
    return tally


# ---- backward

# (rows, H): ragged (H not a multiple of the block or of 256 columns), several chunks of 256 rows
# for dweight's column kernels, H = 0 and rows = 0
NORM_BACKWARD_SHAPES_QUICK = [(1, 1), (7, 13), (3, 100), (17, 257), (300, 64), (5, 0), (0, 8)]
NORM_BACKWARD_SHAPES_FULL = NORM_BACKWARD_SHAPES_QUICK + [(9, 1024), (130, 1000), (1000, 300), (64, 4096),
                                                          (2, 2**18), (4100, 128)]


def check_norm_rmsnorm_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for rows, h in sizes(backend, quick, NORM_BACKWARD_SHAPES_QUICK, NORM_BACKWARD_SHAPES_FULL):
        weights = [random_rows(rng, 1, h, "normal")[0], random_rows(rng, 1, h, "special")[0],
                   random_rows(rng, 2, h, "nonfinite")[0]]
        for kind in ROW_KINDS:
            x = random_rows(rng, rows, h, kind)
            for dy_kind in ("normal", "special", "nonfinite") if kind == "normal" else ("normal",):
                dy = random_rows(rng, rows, h, dy_kind)
                for w in weights if kind == "normal" and dy_kind == "normal" else weights[:1]:
                    for eps in NORM_EPS if kind in ("normal", "zeros", "tiny") else NORM_EPS[:1]:
                        expected = norm_ref.rmsnorm_backward(x, w, eps, dy)
                        got = norm_op.rmsnorm_backward(backend, backend.asarray(x), backend.asarray(w), eps,
                                                       backend.asarray(dy))
                        tally.add_outputs(backend, got, expected)
    # invariance: dx rows do not depend on their neighbours; dweight (an exact sum) not on row order
    x, dy = random_rows(rng, 37, 300, "massive"), random_rows(rng, 37, 300, "normal")
    w_dev = backend.asarray(random_rows(rng, 1, 300, "normal")[0])

    def run(x_rows, dy_rows):
        return [backend.to_numpy(a) for a in norm_op.rmsnorm_backward(
            backend, backend.asarray(x_rows), w_dev, 1e-6, backend.asarray(dy_rows))]

    full_dx, full_dweight = run(x, dy)
    _permutation_invariance(tally, rng, full_dx, np.concatenate([x, dy], axis=1),
                            lambda both: run(both[:, :300], both[:, 300:])[0])
    permutation = rng.permutation(37)
    tally.add(run(x[permutation], dy[permutation])[1], full_dweight)
    # QK-norm: [tokens, heads, head_dim], dweight summed over tokens and heads
    for tokens, heads, head_dim in ((1, 1, 128), (7, 5, 64), (33, 16, 128)):
        x = random_rows(rng, tokens * heads, head_dim, "normal")
        dy = random_rows(rng, tokens * heads, head_dim, "normal")
        w = random_rows(rng, 1, head_dim, "normal")[0]
        dx_ref, dweight_ref = norm_ref.rmsnorm_backward(x, w, 1e-6, dy)
        got = norm_op.rmsnorm_heads_backward(backend, backend.asarray(x.reshape(tokens, heads, head_dim)),
                                             backend.asarray(w), 1e-6,
                                             backend.asarray(dy.reshape(tokens, heads, head_dim)))
        tally.add_outputs(backend, got, (dx_ref.reshape(tokens, heads, head_dim), dweight_ref))
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("norm.rmsnorm", check_norm_rmsnorm),
    ("norm.rmsnorm_heads_rope", check_norm_rmsnorm_heads_rope),
    ("norm.rmsnorm_heads_rope_write_kv", check_norm_rmsnorm_heads_rope_write_kv),
    ("norm.add_rmsnorm", check_norm_add_rmsnorm),
    ("norm.rmsnorm_backward", check_norm_rmsnorm_backward),
]


# ---- golden

GOLDEN_CASES = Cases("norm")


@GOLDEN_CASES.case("rmsnorm", seed=10, shapes=[[1, 1], [7, 13], [17, 257], [9, 1024], [5, 0], [0, 8]],
                   kinds=STREAM_ROW_KINDS, weights=["uniform", "special"], eps=[1e-6, 0.0])
def _norm_rmsnorm(backend, s, r):
    out = []
    for i, (rows, h) in enumerate(r["shapes"]):
        weights = [backend.asarray(s.floats((h,), kind)) for kind in r["weights"]]
        for kind in r["kinds"]:
            x = backend.asarray(s.floats((rows, h), kind))
            for w_kind, w in zip(r["weights"], weights):
                for eps in r["eps"]:
                    out.append((f"{i}.{kind}.{w_kind}.{eps}.y", host(backend, norm_op.rmsnorm(backend, x, w, eps))))
    return out


@GOLDEN_CASES.case("rmsnorm_heads", seed=11, shapes=[[1, 1, 128], [7, 5, 64], [33, 16, 128]],
                   kinds=["uniform", "massive", "special"], eps=1e-6)
def _norm_rmsnorm_heads(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        w = backend.asarray(s.floats(shape[-1:], "uniform"))
        for kind in r["kinds"]:
            y = norm_op.rmsnorm_heads(backend, backend.asarray(s.floats(shape, kind)), w, r["eps"])
            out.append((f"{i}.{kind}.y", host(backend, y)))
    return out


@GOLDEN_CASES.case("rmsnorm_backward", seed=12, shapes=[[1, 1], [7, 13], [17, 257], [300, 64], [5, 0], [0, 8]],
                   kinds=STREAM_ROW_KINDS, dy_kinds=["uniform", "special", "nonfinite"], eps=[1e-6, 0.0])
def _norm_rmsnorm_backward(backend, s, r):
    out = []
    for i, (rows, h) in enumerate(r["shapes"]):
        w = backend.asarray(s.floats((h,), "uniform"))
        for kind in r["kinds"]:
            x = backend.asarray(s.floats((rows, h), kind))
            for dy_kind in r["dy_kinds"] if kind == "uniform" else r["dy_kinds"][:1]:
                dy = backend.asarray(s.floats((rows, h), dy_kind))
                for eps in r["eps"]:
                    dx, dweight = norm_op.rmsnorm_backward(backend, x, w, eps, dy)
                    tag = f"{i}.{kind}.{dy_kind}.{eps}"
                    out += [(f"{tag}.dx", host(backend, dx)), (f"{tag}.dweight", host(backend, dweight))]
    return out


@GOLDEN_CASES.case("rmsnorm_heads_backward", seed=13, shapes=[[1, 1, 128], [7, 5, 64], [33, 16, 128]], eps=1e-6)
def _norm_rmsnorm_heads_backward(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        w = backend.asarray(s.floats(shape[-1:], "uniform"))
        x, dy = (backend.asarray(s.floats(shape, kind)) for kind in ("massive", "uniform"))
        dx, dweight = norm_op.rmsnorm_heads_backward(backend, x, w, r["eps"], dy)
        out += [(f"{i}.dx", host(backend, dx)), (f"{i}.dweight", host(backend, dweight))]
    return out
