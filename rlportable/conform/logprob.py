"""Conformance of the logprob family (contracts/logprob.toml): logprobs and entropy (alone and from one
pass), lm_head_logprobs block by block, logprobs_backward, and the vocabulary-parallel steps
shard_max_keys, shard_sums and shard_finish on every shard of ragged splits with the ranks' MAX and SUM
emulated in NumPy, bitwise against the reference, with row invariance; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import Stream
from rlportable.conform.inputs import ROW_KINDS, SHARD_COUNTS, ragged_cuts, random_rows, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import exact, logprob as logprob_ref
from rlportable.ops import gemm as gemm_op, logprob as logprob_op
from rlportable.runtime.base import Backend

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
    for rows, vocab in sizes(backend, quick, LOGPROB_SHAPES_QUICK, LOGPROB_SHAPES_FULL):
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
    cases = sizes(backend, quick, [(1, 16, 7), (37, 200, 1000)], [(1, 16, 7), (37, 200, 1000), (300, 1024, 32000)])  # (T, H, V)
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


# ---- backward: the gradient with respect to the logits

# upstream gradients that are not ordinary values: masked (+-0), non-finite, huge (|g| / T overflows), subnormal
SPECIAL_GRADS = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-40, 1.0], dtype=np.float32)


def _grads(rng, rows: int, special: bool) -> np.ndarray:
    """float32 [rows]: ordinary gradients with a third masked (+0 or -0), or drawn from SPECIAL_GRADS."""
    if special:
        return rng.choice(SPECIAL_GRADS, size=rows)
    g = rng.standard_normal(rows).astype(np.float32)
    g[rng.random(rows) < 0.3] = 0.0
    g[rng.random(rows) < 0.1] = -0.0
    return g


def check_logprob_backward(backend: Backend, rng, quick: bool) -> Tally:
    """logprobs_backward on every logits kind and temperature, then row-chunk and permutation invariance."""
    tally = Tally()
    for kind, z, targets, z_dev, targets_dev, temperature in logprob_cases(backend, rng, quick):
        for special in (False, True) if kind in ("logits", "special") else (False,):
            grad = _grads(rng, z.shape[0], special)
            got = logprob_op.logprobs_backward(backend, z_dev, targets_dev, temperature, backend.asarray(grad))
            tally.add(backend.to_numpy(got), logprob_ref.logprobs_backward(z, targets, temperature, grad))
    # invariance: a row's bits do not depend on the rows around it (chunks of device rows, a permutation)
    rows, vocab = 40, 3001
    z = _logprob_rows(rng, rows, vocab, "logits")
    targets = rng.integers(0, vocab, size=rows).astype(np.int32)
    grad = _grads(rng, rows, False)
    z_dev, targets_dev, grad_dev = backend.asarray(z), backend.asarray(targets), backend.asarray(grad)
    full = logprob_ref.logprobs_backward(z, targets, 0.9, grad)
    for chunk in (1, 7, 16):
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            got = logprob_op.logprobs_backward(backend, z_dev[start:stop], targets_dev[start:stop], 0.9,
                                               grad_dev[start:stop])
            tally.add(backend.to_numpy(got), full[start:stop])
    permutation = rng.permutation(rows)
    got = logprob_op.logprobs_backward(backend, backend.asarray(z[permutation]), backend.asarray(targets[permutation]),
                                       0.9, backend.asarray(grad[permutation]))
    tally.add(backend.to_numpy(got), full[permutation])
    return tally


# ---- sharded: the vocabulary-parallel steps (on cpu the reference against itself, and the sharding identity)

def targets_in_every_shard(rng, rows: int, cuts: list[int]) -> np.ndarray:
    """int32 [rows]: row r's target lies in shard r mod n (at a random column of it)."""
    targets = np.empty(rows, dtype=np.int32)
    for row in range(rows):
        shard = row % (len(cuts) - 1)
        targets[row] = rng.integers(cuts[shard], cuts[shard + 1])
    return targets


def sharded_edge_rows(rng, rows: int, cuts: list[int]) -> np.ndarray:
    """float32 [rows, V]: ordinary logits with, row by row in turn, one shard holding a NaN, one a +inf, one
    shard entirely -inf, a +0/-0 maximum split across shards, scattered -inf entries, an all -inf row."""
    vocab = cuts[-1]
    z = (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
    for row in range(rows):
        shard = int(rng.integers(len(cuts) - 1))
        lo, hi = cuts[shard], cuts[shard + 1]
        case = row % 6
        if case == 0:
            z[row, rng.integers(lo, hi)] = np.nan
        elif case == 1:
            z[row, rng.integers(lo, hi)] = np.inf
        elif case == 2:
            z[row, lo:hi] = -np.inf
        elif case == 3:  # the maximum 0 as +0 in one place and -0 in another (often in two shards)
            z[row] = -np.abs(z[row]) - np.float32(1.0)
            z[row, rng.integers(vocab)] = 0.0
            z[row, rng.integers(vocab)] = -0.0
        elif case == 4:
            z[row, rng.random(vocab) < 0.4] = -np.inf
        else:
            z[row] = -np.inf
    return z


def sharded_logprobs(backend: Backend, z: np.ndarray, targets: np.ndarray, cuts: list[int], temperature: float,
                     tally: Tally | None = None) -> np.ndarray:
    """The vocabulary-parallel pipeline with the ranks emulated in NumPy: MAX of the shards' keys, SUM of their
    int64 pairs, then shard_finish. With a tally, each rank's step is also compared with its reference."""
    shards = [np.ascontiguousarray(z[:, lo:hi]) for lo, hi in zip(cuts, cuts[1:])]
    targets_dev = backend.asarray(targets)
    shard_devs = [backend.asarray(shard) for shard in shards]
    keys = np.zeros(z.shape[0], dtype=np.uint32)
    for shard, shard_dev in zip(shards, shard_devs):
        got = backend.to_numpy(logprob_op.shard_max_keys(backend, shard_dev, temperature))
        if tally is not None:
            tally.add(got, logprob_ref.shard_max_keys(shard, temperature))
        keys = np.maximum(keys, got)  # the all-reduce MAX
    keys_dev = backend.asarray(keys)
    sums = np.zeros((z.shape[0], 2), dtype=np.int64)
    for start, shard, shard_dev in zip(cuts, shards, shard_devs):
        got = backend.to_numpy(logprob_op.shard_sums(backend, shard_dev, keys_dev, targets_dev, start, temperature))
        if tally is not None:
            tally.add(got, logprob_ref.shard_sums(shard, keys, targets, start, temperature))
        sums += got  # the all-reduce SUM
    logp = backend.to_numpy(logprob_op.shard_finish(backend, backend.asarray(sums), keys_dev))
    if tally is not None:
        tally.add(logp, logprob_ref.shard_finish(sums, keys))
    return logp


def check_logprob_shards(backend: Backend, rng, quick: bool) -> Tally:
    """Every rank's step against its reference, and the sharded pipeline against logprobs on the whole rows,
    for 1, 2, 3, 4 and 8 ragged shards, every logits kind and the sharded edge rows."""
    tally = Tally()
    for rows, vocab in sizes(backend, quick, LOGPROB_SHAPES_QUICK, LOGPROB_SHAPES_FULL):
        for shards in SHARD_COUNTS:
            cuts = ragged_cuts(rng, vocab, shards)
            targets = targets_in_every_shard(rng, rows, cuts)
            for kind in LOGPROB_KINDS + ("sharded_edges",):
                if kind == "sharded_edges":
                    z = sharded_edge_rows(rng, max(rows, 12), cuts)
                    kind_targets = targets_in_every_shard(rng, z.shape[0], cuts)
                else:
                    z, kind_targets = _logprob_rows(rng, rows, vocab, kind), targets
                for temperature in LOGPROB_TEMPERATURES if kind in ("logits", "sharded_edges") else (1.0, 0.7):
                    got = sharded_logprobs(backend, z, kind_targets, cuts, temperature, tally)
                    tally.add(got, logprob_ref.logprobs(z, kind_targets, temperature))
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("logprob.logprobs_entropy", check_logprob),
    ("logprob.lm_head_logprobs", check_lm_head_logprobs),
    ("logprob.backward", check_logprob_backward),
    ("logprob.shards", check_logprob_shards),
]


# ---- golden

GOLDEN_CASES = Cases("logprob")
GOLDEN_LOGPROB_SHAPES = [[1, 1], [7, 13], [5, 1000], [3, 4099]]
GOLDEN_LOGPROB_KINDS = ["logits", "neg_inf", "ties", "tiny", "huge", "special", "nonfinite"]
GOLDEN_LOGPROB_TEMPERATURES = [1.0, 0.7, 0.001]


def golden_logits(s: Stream, rows: int, vocab: int, kind: str) -> np.ndarray:
    """float32 [rows, V] logits of one kind from the stream: masked (neg_inf), ties, or Stream.floats' kinds."""
    if kind == "neg_inf":  # masked entries; row 0 entirely -inf, row 1 one finite value
        z = s.floats((rows, vocab), "logits")
        z[s.ints((rows, vocab), 0, 10) < 3] = -np.inf
        z[0] = -np.inf
        if rows > 1:
            z[1] = -np.inf
            z[1, int(s.ints((), 0, vocab))] = 2.0
        return z
    if kind == "ties":  # several equal maxima, +0 and -0 among them
        z = np.where(s.ints((rows, vocab), 0, 2) == 0, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        z[:, ::3] = -1.0
        return z
    return s.floats((rows, vocab), kind)


def _logprob_inputs(backend, s, r):
    """Yield (tag, rows, logits, targets, temperature) over shapes x kinds x temperatures."""
    for i, (rows, vocab) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            z = backend.asarray(golden_logits(s, rows, vocab, kind))
            targets = backend.asarray(s.ints((rows,), 0, vocab))
            for temperature in r["temperatures"] if kind in ("logits", "neg_inf", "huge") else [1.0]:
                yield f"{i}.{kind}.{temperature}", rows, z, targets, temperature


@GOLDEN_CASES.case("logprobs", seed=60, shapes=GOLDEN_LOGPROB_SHAPES, kinds=GOLDEN_LOGPROB_KINDS,
                   temperatures=GOLDEN_LOGPROB_TEMPERATURES)
def _logprob_logprobs(backend, s, r):
    return [(f"{tag}.logp", host(backend, logprob_op.logprobs(backend, z, targets, t)))
            for tag, _rows, z, targets, t in _logprob_inputs(backend, s, r)]


@GOLDEN_CASES.case("entropy", seed=61, shapes=GOLDEN_LOGPROB_SHAPES, kinds=GOLDEN_LOGPROB_KINDS,
                   temperatures=GOLDEN_LOGPROB_TEMPERATURES)
def _logprob_entropy(backend, s, r):
    return [(f"{tag}.entropy", host(backend, logprob_op.entropy(backend, z, t)))
            for tag, _rows, z, _targets, t in _logprob_inputs(backend, s, r)]


@GOLDEN_CASES.case("logprobs_and_entropy", seed=62, shapes=GOLDEN_LOGPROB_SHAPES, kinds=GOLDEN_LOGPROB_KINDS,
                   temperatures=GOLDEN_LOGPROB_TEMPERATURES)
def _logprob_logprobs_and_entropy(backend, s, r):
    out = []
    for tag, _rows, z, targets, t in _logprob_inputs(backend, s, r):
        logp, ent = logprob_op.logprobs_and_entropy(backend, z, targets, t)
        out += [(f"{tag}.logp", host(backend, logp)), (f"{tag}.entropy", host(backend, ent))]
    return out


@GOLDEN_CASES.case("lm_head_logprobs", seed=63, shapes=[[1, 16, 7], [37, 200, 1000]], shape_order="[T, H, V]",
                   hidden_kind="massive", weight="uniform * 2^-4", temperature=0.8, token_blocks=[1, 7, 256])
def _logprob_lm_head(backend, s, r):
    out = []
    for i, (tokens, hidden_size, vocab) in enumerate(r["shapes"]):
        hidden = backend.asarray(s.floats((tokens, hidden_size), r["hidden_kind"]))
        w = np.ldexp(s.floats((vocab, hidden_size), "uniform"), -4).astype(np.float32)
        weight = gemm_op.encode_weight(backend, backend.asarray(w))
        targets = backend.asarray(s.ints((tokens,), 0, vocab))
        for block in r["token_blocks"]:
            logp, ent = logprob_op.lm_head_logprobs(backend, hidden, weight, targets, r["temperature"],
                                                    want_entropy=True, token_block=block)
            out += [(f"{i}.{block}.logp", host(backend, logp)), (f"{i}.{block}.entropy", host(backend, ent))]
    return out


#: SPECIAL_GRADS as float32 bit patterns (the recipe names the exact values)
SPECIAL_GRAD_BITS = [f"0x{int(b):08x}" for b in SPECIAL_GRADS.view(np.uint32)]


@GOLDEN_CASES.case("logprobs_backward", seed=64, shapes=GOLDEN_LOGPROB_SHAPES, kinds=GOLDEN_LOGPROB_KINDS,
                   temperatures=GOLDEN_LOGPROB_TEMPERATURES,
                   grads="uniform with a third +0; then drawn from special_grad_bits (float32 bits)",
                   special_grad_bits=SPECIAL_GRAD_BITS)
def _logprob_backward(backend, s, r):
    out = []
    specials = np.array([int(bits, 16) for bits in r["special_grad_bits"]], dtype=np.uint32).view(np.float32)
    for tag, rows, z, targets, t in _logprob_inputs(backend, s, r):
        ordinary = s.floats((rows,), "uniform")
        ordinary[s.ints((rows,), 0, 3) == 0] = np.float32(0.0)
        for name, grad in (("ordinary", ordinary), ("special", specials[s.ints((rows,), 0, specials.size)])):
            dz = logprob_op.logprobs_backward(backend, z, targets, t, backend.asarray(grad))
            out.append((f"{tag}.{name}.dlogits", host(backend, dz)))
    return out
