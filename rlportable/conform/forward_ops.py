"""Conformance of the forward ops: norm, rope, activation, embedding, logprob, each bitwise
against its reference."""

from __future__ import annotations

import numpy as np

from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.conform.primitives import elementwise_inputs
from rlportable.conform.tally import Tally
from rlportable.contract import exact
from rlportable.ops import gemm as gemm_op
from rlportable.runtime import get_backend
from rlportable.runtime.base import Backend

from rlportable.contract import (
    activation as activation_ref, embedding as embedding_ref, logprob as logprob_ref, norm as norm_ref,
    rope as rope_ref,
)
from rlportable.ops import (
    activation as activation_op, embedding as embedding_op, fixedpoint as fixedpoint_op, logprob as logprob_op,
    norm as norm_op, rope as rope_op,
)

# (rows, H): ragged (1x1, 7x13, H not a multiple of 16), model-like, and H = 0
NORM_SHAPES_QUICK = [(1, 1), (7, 13), (3, 100), (17, 257), (9, 1024), (5, 0), (0, 8)]
NORM_SHAPES_FULL = NORM_SHAPES_QUICK + [(130, 1000), (64, 4096), (33, 5120), (2, 2**18)]
NORM_EPS = (1e-6, 1e-5, 0.0)


def _sizes(backend: Backend, quick: bool, quick_sizes: list, full_sizes: list) -> list:
    """The full list on devices; on cpu (the reference against itself) the quick one, to keep CI short."""
    return full_sizes if not quick and backend.kernel_vendor is not None else quick_sizes


def _random_bits(rng, shape) -> np.ndarray:
    """float32 of uniformly random bit patterns: every class (NaN payloads, inf, subnormal, normal)."""
    return rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32)


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
    for rows, h in _sizes(backend, quick, NORM_SHAPES_QUICK, NORM_SHAPES_FULL):
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
            got = norm_op.add_rmsnorm(backend, a_dev, b_dev, w_dev, 1e-6)
            for g, e in zip(got, expected):
                tally.add(backend.to_numpy(g), e)
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
            for g, e in zip(got, expected):
                tally.add(backend.to_numpy(g), e)
    return tally


def check_norm_rmsnorm_heads_rope_write_kv(backend: Backend, rng, quick: bool) -> Tally:
    """The engine step's QK-norm, RoPE and cache write in one launch, against rmsnorm_heads_rope's reference
    and the reference cache writer (cpu) in turn: q', k' and every byte of both caches, every row kind in q, k
    and v, a skipped (negative) slot and the cache's widest head_dim."""
    from rlportable.ops import attention as attention_op

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
            for g, e in zip(got, expected):
                tally.add(backend.to_numpy(g), e)
            for name in ("k_digits", "k_exponents", "v_digits", "v_exponents"):
                tally.add(backend.to_numpy(getattr(cache, name)), getattr(want, name))
    return tally


# (tokens, heads, head_dim, table positions)
ROPE_SHAPES_QUICK = [(1, 1, 2, 1), (7, 3, 14, 50), (17, 4, 64, 300), (9, 8, 128, 4096), (0, 2, 8, 4)]
ROPE_SHAPES_FULL = ROPE_SHAPES_QUICK + [(130, 16, 128, 32768), (64, 40, 80, 65536)]


def check_rope_apply(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    scalings = (None, rope_ref.Llama3Scaling(8.0, 1.0, 4.0, 8192))
    for tokens, heads, head_dim, table_rows in _sizes(backend, quick, ROPE_SHAPES_QUICK, ROPE_SHAPES_FULL):
        for theta, scaling in ((10000.0, None), (1_000_000.0, None), (500000.0, scalings[1])):
            cos, sin = rope_op.tables(backend, table_rows, head_dim, theta, scaling)
            inv_freq = rope_ref.inverse_frequencies(head_dim, theta, scaling)
            cos_ref, sin_ref = rope_ref.tables(np.arange(table_rows), inv_freq)
            tally.add(backend.to_numpy(cos), cos_ref)
            tally.add(backend.to_numpy(sin), sin_ref)
            positions = rng.integers(0, table_rows, size=tokens).astype(np.int32)
            if tokens >= 2:
                positions[0], positions[-1] = 0, table_rows - 1
            positions_dev = backend.asarray(positions)
            for kind in ROW_KINDS if theta == 10000.0 else ("normal",):
                x = random_rows(rng, tokens * heads, head_dim, kind).reshape(tokens, heads, head_dim)
                expected = rope_ref.apply(x, cos_ref[positions], sin_ref[positions])
                got = rope_op.apply(backend, backend.asarray(x), positions_dev, cos, sin)
                tally.add(backend.to_numpy(got), expected)
    rope_bit_patterns(backend, rng, tally, rope_op.apply, rope_ref.apply)
    return tally


def rope_bit_patterns(backend: Backend, rng, tally: Tally, op, reference) -> None:
    """Every float32 bit pattern class in the rotated tensor (NaN payloads, inf * 0 at position 0,
    inf - inf), through op (rope.apply or apply_backward) against its reference."""
    cos_ref, sin_ref = rope_ref.tables(np.arange(64), rope_ref.inverse_frequencies(32, 10000.0))
    positions = rng.integers(0, 64, size=200).astype(np.int32)
    positions[:10] = 0
    x = _random_bits(rng, (200, 3, 32))
    got = op(backend, backend.asarray(x), backend.asarray(positions), backend.asarray(cos_ref),
             backend.asarray(sin_ref))
    tally.add(backend.to_numpy(got), reference(x, cos_ref[positions], sin_ref[positions]))


ACTIVATION_SHAPES = [(1, 1), (7, 13), (33, 257), (16, 3072)]


def check_activation_swiglu_encode(backend: Backend, rng, quick: bool) -> Tally:
    """SwiGLU with the down projection's encoding in one launch, against swiglu then encode_rows (the
    references); every row kind, a row above the fused limit and other bits."""
    tally = Tally()
    limit = activation_op.MAX_FUSED_ENCODED_ROW
    shapes = ((1, 8, 23), (7, 96, 23), (0, 16, 23), (5, 40, 15)) if quick else \
        ((1, 8, 23), (7, 96, 23), (256, 3072, 23), (3, limit, 23), (2, limit + 64, 23), (0, 16, 23), (5, 40, 15))
    for rows, h, bits in shapes:
        for kind in ROW_KINDS:
            gate, up = random_rows(rng, rows, h, kind), random_rows(rng, rows, h, "normal")
            y_ref = activation_ref.swiglu(gate, up)
            expected = fixedpoint_op.encode_rows_reference(y_ref, bits)
            y, encoded = activation_op.swiglu_encode(backend, backend.asarray(gate), backend.asarray(up), bits)
            tally.add(backend.to_numpy(y), y_ref)
            tally.add(backend.to_numpy(encoded.digits), expected.digits)
            tally.add(backend.to_numpy(encoded.exponents), expected.exponents)
    return tally


def check_activation_swiglu(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for shape in _sizes(backend, quick, ACTIVATION_SHAPES, ACTIVATION_SHAPES + [(257, 11008)]):
        for kind in ROW_KINDS:
            gate = random_rows(rng, *shape, kind)
            up = random_rows(rng, *shape, "normal" if kind != "special" else "special")
            tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                      activation_ref.swiglu(gate, up))
    # gate over every float32 class and the exp edge inputs, up random bit patterns or ordinary values
    gate = elementwise_inputs(rng, quick or backend.kernel_vendor is None)
    for up in (_random_bits(rng, gate.shape), rng.standard_normal(gate.shape).astype(np.float32)):
        tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                  activation_ref.swiglu(gate, up))
    gate = np.array([0.0, -0.0, -89.5, -100.0, 89.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45], dtype=np.float32)
    for up_value in (0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan):
        up = np.full(gate.shape, up_value, dtype=np.float32)
        tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                  activation_ref.swiglu(gate, up))
    return tally


EMBEDDING_SHAPES = [(1, 1, 1), (13, 7, 5), (1000, 257, 64), (50, 16, 0)]  # (V, H, T)


def check_embedding_gather(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for vocab, hidden, tokens in _sizes(backend, quick, EMBEDDING_SHAPES, EMBEDDING_SHAPES + [(151936, 64, 4096)]):
        table = _random_bits(rng, (vocab, hidden))
        ids = rng.integers(0, vocab, size=tokens).astype(np.int32)
        if tokens >= 2:
            ids[0], ids[-1] = 0, vocab - 1
        got = embedding_op.gather(backend, backend.asarray(table), backend.asarray(ids))
        tally.add(backend.to_numpy(got), embedding_ref.gather(table, ids))
    return tally


# (rows, V): 1x1, ragged, a real vocabulary
LOGPROB_SHAPES_QUICK = [(1, 1), (7, 13), (5, 1000), (3, 4099)]
LOGPROB_SHAPES_FULL = LOGPROB_SHAPES_QUICK + [(64, 32000), (4, 151936)]
LOGPROB_TEMPERATURES = (1.0, 0.7, 1.3, 1e-3)


def _logprob_rows(rng, rows: int, vocab: int, kind: str) -> np.ndarray:
    if kind == "logits":  # ordinary logits: a spread of a few units, some far below the top
        return (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
    if kind == "neg_inf":  # masked entries; one row entirely -inf
        x = (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.3] = -np.inf
        x[0] = -np.inf
        if rows > 1:
            x[1, :] = -np.inf
            x[1, rng.integers(vocab)] = 2.0  # one finite value: a one-hot distribution
        return x
    if kind == "ties":  # several equal maxima, +0 and -0 among them
        x = np.zeros((rows, vocab), dtype=np.float32)
        x[rng.random((rows, vocab)) < 0.5] = -0.0
        x[:, ::3] = -1.0
        return x
    return random_rows(rng, rows, vocab, kind)


LOGPROB_KINDS = ("logits", "neg_inf", "ties") + ROW_KINDS


def logprob_cases(backend: Backend, rng, quick: bool):
    """The log-prob checks' cases, forward and backward: (kind, z, targets, z and targets on the backend,
    temperature) for every logits shape and kind, the temperatures where a kind has finite scores to scale."""
    for rows, vocab in _sizes(backend, quick, LOGPROB_SHAPES_QUICK, LOGPROB_SHAPES_FULL):
        for kind in LOGPROB_KINDS:
            z = _logprob_rows(rng, rows, vocab, kind)
            targets = rng.integers(0, vocab, size=rows).astype(np.int32)
            z_dev, targets_dev = backend.asarray(z), backend.asarray(targets)
            for temperature in LOGPROB_TEMPERATURES if kind in ("logits", "neg_inf", "huge") else (1.0,):
                yield kind, z, targets, z_dev, targets_dev, temperature


def check_logprob(backend: Backend, rng, quick: bool) -> Tally:
    """logprobs and entropy, alone and from one pass (logprobs_and_entropy)."""
    tally = Tally()
    for _, z, targets, z_dev, targets_dev, temperature in logprob_cases(backend, rng, quick):
        expected_logp = logprob_ref.logprobs(z, targets, temperature)
        expected_entropy = logprob_ref.entropy(z, temperature)
        tally.add(backend.to_numpy(logprob_op.logprobs(backend, z_dev, targets_dev, temperature)), expected_logp)
        tally.add(backend.to_numpy(logprob_op.entropy(backend, z_dev, temperature)), expected_entropy)
        logp, ent = logprob_op.logprobs_and_entropy(backend, z_dev, targets_dev, temperature)
        tally.add(backend.to_numpy(logp), expected_logp)
        tally.add(backend.to_numpy(ent), expected_entropy)
    # invariance: a row's bits do not depend on the rows around it
    z = _logprob_rows(rng, 40, 3000, "logits")
    targets = rng.integers(0, 3000, size=40).astype(np.int32)
    full_logp, full_entropy = (backend.to_numpy(a) for a in logprob_op.logprobs_and_entropy(
        backend, backend.asarray(z), backend.asarray(targets), 0.9))
    permutation = rng.permutation(40)
    logp, ent = logprob_op.logprobs_and_entropy(backend, backend.asarray(z[permutation]),
                                                backend.asarray(targets[permutation]), 0.9)
    tally.add(backend.to_numpy(logp), full_logp[permutation])
    tally.add(backend.to_numpy(ent), full_entropy[permutation])
    for row in rng.choice(40, size=3, replace=False):
        logp, ent = logprob_op.logprobs_and_entropy(backend, backend.asarray(z[row:row + 1]),
                                                    backend.asarray(targets[row:row + 1]), 0.9)
        tally.add(backend.to_numpy(logp), full_logp[row:row + 1])
        tally.add(backend.to_numpy(ent), full_entropy[row:row + 1])
    return tally


def check_lm_head_logprobs(backend: Backend, rng, quick: bool) -> Tally:
    """gemm + logprob block by block, against the references of both, for several token blocks."""
    tally = Tally()
    cases = _sizes(backend, quick, [(1, 16, 7), (37, 200, 1000)], [(1, 16, 7), (37, 200, 1000), (300, 1024, 32000)])  # (T, H, V)
    for tokens, hidden_size, vocab in cases:
        hidden = random_rows(rng, tokens, hidden_size, "massive")
        w = (random_rows(rng, vocab, hidden_size, "normal") * np.float32(0.05)).astype(np.float32)
        targets = rng.integers(0, vocab, size=tokens).astype(np.int32)
        logits = exact.gemm(hidden, w, gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W)
        expected_logp = logprob_ref.logprobs(logits, targets, 0.8)
        expected_entropy = logprob_ref.entropy(logits, 0.8)
        weight = gemm_op.encode_weight(backend, backend.asarray(w))
        hidden_dev, targets_dev = backend.asarray(hidden), backend.asarray(targets)
        for block in (1, 7, 256):
            logp, ent = logprob_op.lm_head_logprobs(backend, hidden_dev, weight, targets_dev, 0.8,
                                                    want_entropy=True, token_block=block)
            tally.add(backend.to_numpy(logp), expected_logp)
            tally.add(backend.to_numpy(ent), expected_entropy)
        logp = logprob_op.lm_head_logprobs(backend, hidden_dev, weight, targets_dev, 0.8, token_block=16)
        tally.add(backend.to_numpy(logp), expected_logp)
    return tally


FORWARD_OP_CHECKS = [
    ("norm.rmsnorm", check_norm_rmsnorm),
    ("rope.apply", check_rope_apply),
    ("norm.rmsnorm_heads_rope", check_norm_rmsnorm_heads_rope),
    ("norm.rmsnorm_heads_rope_write_kv", check_norm_rmsnorm_heads_rope_write_kv),
    ("norm.add_rmsnorm", check_norm_add_rmsnorm),
    ("activation.swiglu", check_activation_swiglu),
    ("activation.swiglu_encode", check_activation_swiglu_encode),
    ("embedding.gather", check_embedding_gather),
    ("logprob.logprobs_entropy", check_logprob),
    ("logprob.lm_head_logprobs", check_lm_head_logprobs),
]
