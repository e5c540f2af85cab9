"""The suite behind `rlportable conform`: every contract's kernels against the NumPy reference, bitwise.

Each check returns how many elements it compared and how many differ in their
raw bits (NaN payloads and signed zeros included). Later issues add checks to
CHECKS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from rlportable.contract import exact, fixedpoint as fp
from rlportable.conform_inputs import GEMM_SHAPES_FULL, GEMM_SHAPES_QUICK, ROW_KINDS, random_rows
from rlportable.contract import elementwise as elementwise_ref
from rlportable.ops import elementwise as elementwise_op, fixedpoint as fixedpoint_op, gemm as gemm_op, rowsum as rowsum_op
from rlportable.ops.gemm_fused import FUSED_TILES
from rlportable.runtime.base import Backend


@dataclass
class CheckResult:
    name: str
    compared: int
    mismatches: int

    @property
    def passed(self) -> bool:
        return self.mismatches == 0

    def as_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def bit_mismatches(actual: np.ndarray, expected: np.ndarray) -> int:
    """Elements whose raw bits differ (shapes must match)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return max(actual.size, expected.size, 1)
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[expected.dtype.itemsize]
    return int(np.count_nonzero(actual.view(width) != expected.view(width)))


class Tally:
    def __init__(self):
        self.compared = 0
        self.mismatches = 0

    def add(self, actual, expected) -> None:
        self.compared += int(np.asarray(expected).size)
        self.mismatches += bit_mismatches(actual, expected)


def _shapes(quick: bool):
    return GEMM_SHAPES_QUICK if quick else GEMM_SHAPES_FULL


def check_fixedpoint(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            for bits, descending in ((23, False), (15, True), (53, False), (9, False), (24, False)):
                expected = fixedpoint_op.encode_rows_reference(x, bits, descending)
                actual = fixedpoint_op.encode_rows(backend, backend.asarray(x), bits, descending)
                tally.add(backend.to_numpy(actual.exponents), expected.exponents)
                tally.add(backend.to_numpy(actual.digits), expected.digits)
    return tally


def gemm_methods(backend: Backend) -> list[tuple[str, str | None]]:
    """(method, tile) pairs this backend can run with the default bits."""
    if backend.kernel_vendor is None:
        return [("auto", None)]
    methods = [("blas", None)]
    if backend.kernel_vendor == "cuda":
        methods += [("fused", tile) for tile in FUSED_TILES]
    return methods


def _gemm_cases(rng, quick: bool):
    for m, k, n in _shapes(quick):
        for kind in ROW_KINDS:
            yield random_rows(rng, m, k, kind), random_rows(rng, n, k, "normal" if kind == "nonfinite" else kind)
    x = random_rows(rng, 9, 40, "normal")
    yield x, random_rows(rng, 6, 40, "nonfinite")  # non-finite weight rows


def check_gemm(backend: Backend, rng, quick: bool, bits_a=gemm_op.DEFAULT_BITS_A, bits_w=gemm_op.DEFAULT_BITS_W) -> Tally:
    tally = Tally()
    for x, w in _gemm_cases(rng, quick):
        if x.shape[1] > exact.gemm_max_k(bits_a, bits_w):
            continue
        expected = exact.gemm(x, w, bits_a, bits_w)
        weight = gemm_op.encode_weight(backend, backend.asarray(w), bits_w)
        for method, tile in gemm_methods(backend) if (bits_a, bits_w) == (gemm_op.DEFAULT_BITS_A, gemm_op.DEFAULT_BITS_W) else [("auto", None)]:
            y = gemm_op.gemm(backend, backend.asarray(x), weight, bits_a, method=method, tile=tile)
            tally.add(backend.to_numpy(y), expected)
    return tally


def check_gemm_other_bits(backend: Backend, rng, quick: bool) -> Tally:
    """Non-default operand widths (blas path on devices), shapes within each K limit."""
    tally = Tally()
    for bits_a, bits_w in ((15, 15), (22, 15), (8, 8), (31, 15)):
        tally_bits = check_gemm(backend, rng, True, bits_a, bits_w)
        tally.compared += tally_bits.compared
        tally.mismatches += tally_bits.mismatches
    return tally


def check_gemm_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """Row permutation and batch size: each row's bits must not depend on its neighbours."""
    tally = Tally()
    m, k, n = (37, 300, 50) if quick else (300, 1024, 256)
    x = random_rows(rng, m, k, "massive")
    weight = gemm_op.encode_weight(backend, backend.asarray(random_rows(rng, n, k, "normal")))
    for method, tile in gemm_methods(backend):
        def run(rows):
            return backend.to_numpy(gemm_op.gemm(backend, backend.asarray(rows), weight, method=method, tile=tile))

        full = run(x)
        permutation = rng.permutation(m)
        tally.add(run(x[permutation]), full[permutation])
        for row in rng.choice(m, size=min(m, 5), replace=False):
            tally.add(run(x[row:row + 1]), full[row:row + 1])
        tally.add(run(x[: m // 3]), full[: m // 3])
    return tally


def check_rowsum(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            x = random_rows(rng, m, k, kind)
            if kind == "normal":
                x = (x * x).astype(np.float32)  # a sum of squares
            for bits in (rowsum_op.DEFAULT_BITS, 24):
                tally.add(backend.to_numpy(rowsum_op.rowsum(backend, backend.asarray(x), bits)), exact.rowsum(x, bits))
    return tally


def elementwise_inputs(rng, quick: bool) -> np.ndarray:
    """Random float32 bit patterns (every class: NaN, inf, subnormal, normal) plus the edge cases."""
    count = (1 << 18) if quick else (1 << 24)
    random_bits = rng.integers(0, 1 << 32, size=count, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([random_bits, elementwise_ref.edge_inputs()]).view(np.float32)


def _check_elementwise(name: str):
    def check(backend: Backend, rng, quick: bool) -> Tally:
        tally = Tally()
        x = elementwise_inputs(rng, quick)
        expected = getattr(elementwise_ref, f"{name}_f32")(x)
        tally.add(backend.to_numpy(elementwise_op.apply(backend, name, backend.asarray(x))), expected)
        return tally

    return check


def _check_elementwise_exhaustive(name: str):
    def check(backend: Backend, rng, quick: bool) -> Tally:
        tally = Tally()
        result = elementwise_op.exhaustive_check(backend, name)
        tally.compared, tally.mismatches = result["checked"], result["not_correctly_rounded"]
        EXHAUSTIVE_REPORTS.append(result)
        return tally

    return check


def check_residual(backend: Backend, rng, quick: bool) -> Tally:
    from rlportable.ops import residual as residual_op

    tally = Tally()
    for m, k, _ in _shapes(quick):
        for kind in ROW_KINDS:
            a, b = random_rows(rng, m, k, kind), random_rows(rng, m, k, kind)
            tally.add(backend.to_numpy(residual_op.add(backend, backend.asarray(a), backend.asarray(b))),
                      residual_op.add_reference(a, b))
            bias = random_rows(rng, 1, k, kind)[0]
            tally.add(backend.to_numpy(residual_op.add_bias(backend, backend.asarray(a), backend.asarray(bias))),
                      residual_op.add_bias_reference(a, bias))
    return tally


EXHAUSTIVE_REPORTS: list[dict] = []

CHECKS: list[tuple[str, Callable]] = [
    ("fixedpoint.encode_rows", check_fixedpoint),
    ("gemm", check_gemm),
    ("gemm.other_bits", check_gemm_other_bits),
    ("gemm.invariance", check_gemm_invariance),
    ("rowsum", check_rowsum),
    ("residual", check_residual),
    ("elementwise.exp_f32", _check_elementwise("exp")),
    ("elementwise.log_f32", _check_elementwise("log")),
]

#: added by --exhaustive: all 2^32 inputs graded for correct rounding on the device
EXHAUSTIVE_CHECKS: list[tuple[str, Callable]] = [
    ("elementwise.exp_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("exp")),
    ("elementwise.log_f32.all_2^32_correctly_rounded", _check_elementwise_exhaustive("log")),
]


def run(backend: Backend, quick: bool = False, seed: int = 0, only: str | None = None,
        progress: Callable[[str], None] | None = None, exhaustive: bool = False) -> list[CheckResult]:
    results = []
    for name, check in CHECKS + (EXHAUSTIVE_CHECKS if exhaustive else []):
        if (only and only not in name) or (backend.kernel_vendor is None and name in device_only_checks()):
            continue
        if progress:
            progress(name)
        rng = np.random.default_rng([seed, len(results)])
        tally = check(backend, rng, quick)
        results.append(CheckResult(name, tally.compared, tally.mismatches))
    return results


def device_only_checks() -> set[str]:
    """Checks whose reference is the cpu backend itself: they run on devices only."""
    from rlportable.conform_model import DEVICE_ONLY

    return DEVICE_ONLY


def report(device: str, backend_info: dict, results: list[CheckResult]) -> dict:
    return {
        "device": device,
        "backend": backend_info,
        "checks": [r.as_json() for r in results],
        "compared": sum(r.compared for r in results),
        "mismatches": sum(r.mismatches for r in results),
        "passed": all(r.passed for r in results),
    }


# ---- forward ops of issue 3: norm, rope, activation, embedding, logprob (each against its reference, bitwise)

from rlportable.contract import (  # noqa: E402
    activation as activation_ref, embedding as embedding_ref, logprob as logprob_ref, norm as norm_ref,
    rope as rope_ref,
)
from rlportable.ops import (  # noqa: E402
    activation as activation_op, embedding as embedding_op, logprob as logprob_op, norm as norm_op, rope as rope_op,
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
    # every float32 bit pattern class in x (NaN payloads, inf * 0 at position 0, inf - inf)
    cos_ref, sin_ref = rope_ref.tables(np.arange(64), rope_ref.inverse_frequencies(32, 10000.0))
    positions = rng.integers(0, 64, size=200).astype(np.int32)
    positions[:10] = 0
    x = _random_bits(rng, (200, 3, 32))
    got = rope_op.apply(backend, backend.asarray(x), backend.asarray(positions), backend.asarray(cos_ref),
                        backend.asarray(sin_ref))
    tally.add(backend.to_numpy(got), rope_ref.apply(x, cos_ref[positions], sin_ref[positions]))
    return tally


ACTIVATION_SHAPES = [(1, 1), (7, 13), (33, 257), (16, 3072)]


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


def check_logprob(backend: Backend, rng, quick: bool) -> Tally:
    """logprobs and entropy, alone and from one pass (logprobs_and_entropy)."""
    tally = Tally()
    for rows, vocab in _sizes(backend, quick, LOGPROB_SHAPES_QUICK, LOGPROB_SHAPES_FULL):
        for kind in LOGPROB_KINDS:
            z = _logprob_rows(rng, rows, vocab, kind)
            targets = rng.integers(0, vocab, size=rows).astype(np.int32)
            z_dev, targets_dev = backend.asarray(z), backend.asarray(targets)
            for temperature in LOGPROB_TEMPERATURES if kind in ("logits", "neg_inf", "huge") else (1.0,):
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


CHECKS += [
    ("norm.rmsnorm", check_norm_rmsnorm),
    ("rope.apply", check_rope_apply),
    ("activation.swiglu", check_activation_swiglu),
    ("embedding.gather", check_embedding_gather),
    ("logprob.logprobs_entropy", check_logprob),
    ("logprob.lm_head_logprobs", check_lm_head_logprobs),
]


# ---- attention (contracts/attention.toml): exact causal GQA attention over the encoded KV cache

from rlportable.contract import attention as attention_ref  # noqa: E402
from rlportable.ops import attention as attention_op  # noqa: E402
from rlportable.ops.fixedpoint import encode_rows_reference as _encode_rows_reference  # noqa: E402

# (Hq, Hkv, D): GQA 4:1, plain multi-head, a ragged head_dim, a wide one
ATTENTION_HEADS = ((8, 2, 64), (4, 4, 128), (8, 2, 20))
ATTENTION_LENGTHS = (1, 7, 33, 200)
ATTENTION_KINDS = ("normal", "massive", "tiny", "huge", "zeros", "special")


def _attention_qkv(rng, tokens: int, hq: int, hkv: int, d: int, kind: str = "normal"):
    def rows(heads):
        return random_rows(rng, tokens * heads, d, kind).reshape(tokens, heads, d)

    return rows(hq), rows(hkv), rows(hkv)


def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _attention_expected(q, k, v, cu) -> np.ndarray:
    """The reference, one sequence at a time (the contract's definition of a packed batch)."""
    out = np.empty(q.shape, dtype=np.float32)
    for start, stop in zip(cu[:-1], cu[1:]):
        if stop > start:
            out[start:stop] = attention_ref.attention(q[start:stop], k[start:stop], v[start:stop],
                                                      np.arange(stop - start))
    return out


def _attention_packed(backend: Backend, q, k, v, cu, threads: int = attention_op.THREADS,
                      method: str = "portable") -> np.ndarray:
    return backend.to_numpy(attention_op.attention_packed(backend, backend.asarray(q), backend.asarray(k),
                                                          backend.asarray(v), cu, threads=threads, method=method))


def _attention_methods(backend: Backend, d: int) -> tuple[str, ...]:
    """Every kernel variant of attention_paged this backend runs (each must give the reference's bits)."""
    return attention_op.available_methods(backend, d)


def _paged_layout(rng, lengths, block_size: int, spare_blocks: int = 3):
    """Block tables for sequences of these lengths over shuffled physical blocks (plus unused ones)."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    physical = rng.permutation(num_blocks)
    tables = np.full((len(lengths), max(max(needed), 1) + 1), -1, dtype=np.int32)
    used = 0
    for seq, count in enumerate(needed):
        tables[seq, :count] = physical[used:used + count]
        used += count
    return tables, num_blocks


def _seq_slots(tables: np.ndarray, seq: int, positions: np.ndarray, block_size: int) -> np.ndarray:
    return (tables[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size).astype(np.int32)


class _PagedRun:
    """One paged cache on the backend: write K/V rows of sequences, run queries against it."""

    def __init__(self, backend: Backend, rng, lengths, hkv: int, d: int, block_size: int):
        self.backend, self.block_size = backend, block_size
        self.tables, num_blocks = _paged_layout(rng, lengths, block_size)
        self.cache = attention_op.KVCache.allocate(backend, num_blocks * block_size, hkv, d, block_size)
        self.device_tables = backend.asarray(self.tables)

    def write(self, seq: int, positions: np.ndarray, k, v) -> None:
        slots = _seq_slots(self.tables, seq, positions, self.block_size)
        attention_op.write_kv(self.backend, self.cache, self.backend.asarray(k), self.backend.asarray(v),
                              self.backend.asarray(slots))

    def query(self, q, q_seq, q_pos, threads: int = attention_op.THREADS, method: str = "portable") -> np.ndarray:
        b = self.backend
        return b.to_numpy(attention_op.attention_paged(
            b, b.asarray(q), b.asarray(np.asarray(q_seq, dtype=np.int32)), b.asarray(np.asarray(q_pos, dtype=np.int32)),
            self.cache, self.device_tables, threads=threads, method=method))


def check_attention_packed(backend: Backend, rng, quick: bool) -> Tally:
    """Packed ragged sequences (1, 7, 33, 200 tokens) against the reference, every head layout and input kind."""
    tally = Tally()
    lengths = list(ATTENTION_LENGTHS)
    order = rng.permutation(len(lengths))
    lengths = [lengths[i] for i in order] + ([] if quick else [517, 3])
    cu = _cu(lengths)
    for hq, hkv, d in ATTENTION_HEADS:
        for kind in ATTENTION_KINDS if (hq, hkv, d) == ATTENTION_HEADS[0] or not quick else ("normal", "massive"):
            q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, kind)
            expected = _attention_expected(q, k, v, cu)
            for method in _attention_methods(backend, d):
                tally.add(_attention_packed(backend, q, k, v, cu, method=method), expected)
    return tally


def check_attention_nonfinite(backend: Backend, rng, quick: bool) -> Tally:
    """A NaN q row, an inf k row and a NaN v row: NaN exactly where the contract says, nothing else touched."""
    tally = Tally()
    lengths = [33, 40, 7]
    cu = _cu(lengths)
    hq, hkv, d = 8, 2, 64
    q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
    q[5, 3, 17] = np.nan  # sequence 0, position 5, head 3 only
    k[cu[1] + 20, 1, 2] = np.inf  # sequence 1, positions >= 20, kv head 1 (heads 4..7)
    v[cu[2] + 3, 0, 0] = -np.nan  # sequence 2, positions >= 3, kv head 0 (heads 0..3)
    expected = _attention_expected(q, k, v, cu)
    nan_rows = np.isnan(expected).all(axis=2)
    assert nan_rows.sum() == 1 + 20 * 4 + 4 * 4 and not np.isnan(expected[~nan_rows]).any()
    for method in _attention_methods(backend, d):
        tally.add(_attention_packed(backend, q, k, v, cu, method=method), expected)
    return tally


def check_attention_write_kv(backend: Backend, rng, quick: bool) -> Tally:
    """The cache writer against fixedpoint's reference encoding (15 bits, 2 digits), scattered to slots."""
    tally = Tally()
    for hkv, d in ((2, 64), (4, 128), (2, 20), (1, 1)):
        for kind in ROW_KINDS:
            tokens, num_slots = 13, 40
            k = random_rows(rng, tokens * hkv, d, kind).reshape(tokens, hkv, d)
            v = random_rows(rng, tokens * hkv, d, "normal" if kind == "nonfinite" else kind).reshape(tokens, hkv, d)
            slots = rng.permutation(num_slots)[:tokens].astype(np.int32)
            slots[[2, 7]] = -1  # skipped
            cache = attention_op.KVCache.allocate(backend, num_slots, hkv, d, block_size=4)
            attention_op.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
            dp = cache.head_dim_padded
            for x, digits, exponents in ((k, cache.k_digits, cache.k_exponents), (v, cache.v_digits, cache.v_exponents)):
                encoded = _encode_rows_reference(x.reshape(tokens * hkv, d), attention_op.KV_BITS)
                want_digits = np.zeros((num_slots, hkv, attention_op.KV_SLICES, dp), dtype=np.int8)
                want_exponents = np.zeros((num_slots, hkv), dtype=np.int32)
                keep = slots >= 0
                want_digits[slots[keep]] = encoded.digits.reshape(tokens, hkv, attention_op.KV_SLICES, dp)[keep]
                want_exponents[slots[keep]] = encoded.exponents.reshape(tokens, hkv)[keep]
                tally.add(backend.to_numpy(digits), want_digits)
                tally.add(backend.to_numpy(exponents), want_exponents)
    return tally


def check_attention_paged(backend: Backend, rng, quick: bool) -> Tally:
    """Paged cache (shuffled blocks of 16) against the reference, plus a sequence longer than the
    kernel's shared score cache (4096 keys: later scores are recomputed in pass 2)."""
    tally = Tally()
    for hq, hkv, d in ATTENTION_HEADS:
        lengths = [45, 1, 130]
        cu = _cu(lengths)
        q, k, v = _attention_qkv(rng, int(cu[-1]), hq, hkv, d, "massive")
        run = _PagedRun(backend, rng, lengths, hkv, d, 16)
        for seq, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
            run.write(seq, np.arange(stop - start), k[start:stop], v[start:stop])
        q_seq = np.repeat(np.arange(len(lengths)), lengths)
        q_pos = np.arange(int(cu[-1])) - cu[:-1][q_seq]
        expected = _attention_expected(q, k, v, cu)
        for method in _attention_methods(backend, d):
            tally.add(run.query(q, q_seq, q_pos, method=method), expected)
        # the same queries shuffled: tiles of rows from several sequences at scattered positions
        order = rng.permutation(q_seq.size)
        for method in _attention_methods(backend, d):
            tally.add(run.query(np.ascontiguousarray(q[order]), q_seq[order], q_pos[order], method=method),
                      expected[order])
    # long sequence: a few queries at positions around and beyond the score cache
    length = 4200 if quick else 9000
    hq, hkv, d = 4, 2, 64
    q, k, v = _attention_qkv(rng, length, hq, hkv, d, "normal")
    positions = np.array([0, 1, 4094, 4095, 4096, 4097, 4150, length - 1])
    run = _PagedRun(backend, rng, [length], hkv, d, 32)
    run.write(0, np.arange(length), k, v)
    expected = attention_ref.attention(q[positions], k, v, positions)
    for method in _attention_methods(backend, d):
        tally.add(run.query(np.ascontiguousarray(q[positions]), np.zeros(positions.size), positions, method=method),
                  expected)
    # a prefill-shaped slice of the long sequence: 130 consecutive queries ending at the last key
    tail = np.arange(length - 130, length)
    tail_expected = attention_ref.attention(q[tail], k, v, tail)
    for method in _attention_methods(backend, d):
        tally.add(run.query(np.ascontiguousarray(q[tail]), np.zeros(tail.size), tail, method=method), tail_expected)
    for threads in (64, 1024):
        tally.add(run.query(np.ascontiguousarray(q[positions]), np.zeros(positions.size), positions, threads), expected)
    return tally


def check_attention_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """position_in_batch, prefill_decode, kv_block_size, launch_shape: bitwise equal outputs."""
    tally = Tally()
    hq, hkv, d = 8, 2, 64
    target = 70 if quick else 300
    others = [7, 50, 1, 33]
    q, k, v = _attention_qkv(rng, target, hq, hkv, d, "massive")
    alone = _attention_packed(backend, q, k, v, _cu([target]))
    tally.add(alone, _attention_expected(q, k, v, _cu([target])))
    methods = _attention_methods(backend, d)
    # position in batch: packed after (and before) other sequences, at several slot offsets
    for before in ([7], [50, 1], [33, 7, 50], []):
        after = [n for n in others if n not in before][:2]
        lengths = before + [target] + after
        oq, ok, ov = _attention_qkv(rng, sum(lengths), hq, hkv, d, "normal")
        offset = sum(before)
        oq[offset:offset + target], ok[offset:offset + target], ov[offset:offset + target] = q, k, v
        for method in methods:
            packed = _attention_packed(backend, oq, ok, ov, _cu(lengths), method=method)
            tally.add(packed[offset:offset + target], alone)
    # launch shape: any thread count
    for threads in (32, 100, 1024):
        tally.add(_attention_packed(backend, q, k, v, _cu([target]), threads=threads), alone)
    # prefill at once, chunked prefill, one-token decode steps (next to a second sequence), block sizes 1, 16, 32
    partner = 41
    pq, pk, pv = _attention_qkv(rng, partner, hq, hkv, d, "normal")
    positions = np.arange(target)
    for block_size in (1, 16, 32):
        run = _PagedRun(backend, rng, [target, partner], hkv, d, block_size)
        run.write(0, positions, k, v)
        for method in methods:
            tally.add(run.query(q, np.zeros(target), positions, method=method), alone)
        run = _PagedRun(backend, rng, [target, partner], hkv, d, block_size)
        cuts = [0, 1, 17, 40, target]
        for start, stop in zip(cuts[:-1], cuts[1:]):
            run.write(0, positions[start:stop], k[start:stop], v[start:stop])
            for method in methods:
                tally.add(run.query(q[start:stop], np.zeros(stop - start), positions[start:stop], method=method),
                          alone[start:stop])
    run = _PagedRun(backend, rng, [target, partner], hkv, d, 16)
    run.write(1, np.arange(partner // 2), pk[: partner // 2], pv[: partner // 2])  # the partner's prompt
    decoded = np.empty_like(alone)
    for t in range(target):  # continuous batching: both sequences decode in one call while the partner lasts
        run.write(0, positions[t:t + 1], k[t:t + 1], v[t:t + 1])
        pt = partner // 2 + t
        if pt < partner:
            run.write(1, np.array([pt]), pk[pt:pt + 1], pv[pt:pt + 1])
            rows = np.concatenate([pq[pt:pt + 1], q[t:t + 1]])
            out = run.query(rows, [1, 0], [pt, t])
            decoded[t] = out[1]
            for method in methods:  # a tile holding rows of two sequences (one round per sequence)
                tally.add(run.query(rows, [1, 0], [pt, t], method=method)[1], out[1])
        else:
            decoded[t] = run.query(q[t:t + 1], [0], [t])[0]
    tally.add(decoded, alone)
    return tally


CHECKS += [
    ("attention.packed", check_attention_packed),
    ("attention.nonfinite_rows", check_attention_nonfinite),
    ("attention.write_kv", check_attention_write_kv),
    ("attention.paged", check_attention_paged),
    ("attention.invariance", check_attention_invariance),
]


from rlportable.conform_model import DEVICE_ONLY, MODEL_CHECKS  # noqa: E402  (they use Tally above)

CHECKS += MODEL_CHECKS
