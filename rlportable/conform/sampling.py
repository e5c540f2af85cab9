"""Conformance of the sampling family (contracts/sampling.toml): tokens bitwise against
contract.sampling.sample for rows without filters, recorded log-probs against
contract.sampling.sampled_logprobs, refusals, batch and launch-shape invariance, and the engine's device
sampler against the host one; and its golden case."""

from __future__ import annotations

import re

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import Stream
from rlportable.conform.inputs import random_rows
from rlportable.conform.logprob import golden_logits
from rlportable.conform.tally import Tally
from rlportable.contract import sampling as reference
from rlportable.errors import InputError
from rlportable.ops import sampling as sampling_op
from rlportable.runtime.base import Backend

# vocabulary sizes: 1, ragged, one past a block of 512 threads, a real vocabulary (and Qwen's in full)
SAMPLING_VOCABS_QUICK = [(6, 1), (9, 7), (8, 513), (8, 1000), (4, 32000)]  # (rows, V)
SAMPLING_VOCABS_FULL = [(6, 1), (9, 7), (16, 513), (16, 1000), (16, 32000), (4, 151936)]
SAMPLING_TEMPERATURES = (0.0, 0.5, 1.0, 1.7, 1e-3)
SAMPLING_KINDS = ("logits", "sharp", "flat", "ties", "neg_inf", "one_hot", "massive", "huge", "tiny")
LAUNCH_THREADS = (1, 7, 32, 64, 96, 256, 1024)
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def _sizes(backend: Backend, quick: bool) -> list:
    return SAMPLING_VOCABS_FULL if not quick and not backend.runs_reference else SAMPLING_VOCABS_QUICK


def _logit_rows(rng, rows: int, vocab: int, kind: str) -> np.ndarray:
    """float32 [rows, V] of one kind; every row keeps a finite value (refused rows are tested apart)."""
    if kind == "logits":  # ordinary logits: a spread of a few units
        return (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
    if kind == "sharp":  # a few tokens hold the mass, most weights are 0 (p < 2^-37)
        return (rng.standard_normal((rows, vocab)) * 30.0).astype(np.float32)
    if kind == "flat":  # every weight 2^36: the draw is uniform, ranges meet at every multiple
        return np.full((rows, vocab), rng.standard_normal(), dtype=np.float32)
    if kind == "ties":  # several equal maxima, +0 and -0 among them
        x = np.zeros((rows, vocab), dtype=np.float32)
        x[rng.random((rows, vocab)) < 0.5] = -0.0
        x[:, ::3] = -1.0
        return x
    if kind == "neg_inf":  # masked entries, at least one finite value per row
        x = (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
        x[rng.random((rows, vocab)) < 0.3] = -np.inf
        x[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
        return x
    if kind == "one_hot":  # one finite value: that token whatever the draw
        x = np.full((rows, vocab), -np.inf, dtype=np.float32)
        x[np.arange(rows), rng.integers(0, vocab, rows)] = rng.standard_normal(rows).astype(np.float32)
        return x
    if kind == "huge":  # near FLT_MAX: a_v - m rounds to -inf; z / T overflows (refused) for T < 1
        return random_rows(rng, rows, vocab, "huge")
    return random_rows(rng, rows, vocab, kind)  # massive (one channel 25,000x), tiny (subnormals)


def _counters(rng, rows: int) -> dict:
    """Random counters with the extremes: seed 0 and 2^64-1, request / position near 2^32-1."""
    seed = rng.integers(0, 2**64, size=rows, dtype=np.uint64, endpoint=False)
    request = rng.integers(0, 2**32, size=rows, dtype=np.uint64).astype(np.uint32)
    sample_index = rng.integers(0, 64, size=rows).astype(np.uint32)
    position = rng.integers(0, 2**32, size=rows, dtype=np.uint64).astype(np.uint32)
    extremes = [(U64_MAX, U32_MAX, U32_MAX, U32_MAX), (0, 0, 0, 0), (U64_MAX, U32_MAX - 1, 7, U32_MAX - 1)]
    for row, (s, r, i, p) in zip(range(rows), extremes):
        seed[row], request[row], sample_index[row], position[row] = s, r, i, p
    return {"seed": seed, "request": request, "sample_index": sample_index, "position": position}


def _pick(counters: dict, rows) -> dict:
    return {name: value[rows] for name, value in counters.items()}


def _expected(z, temperature, counters):
    """The reference's tokens, or the refusal (an InputError) where it refuses the batch."""
    try:
        return reference.sample(z, temperature, **counters)
    except InputError as error:
        return error


def _refused_row(error: InputError) -> str | None:
    """The row a refusal names ("row 3"), if it names one."""
    match = re.search(r"row (\d+)", str(error))
    return match.group(1) if match else None


def _compare(tally: Tally, backend: Backend, z, temperature, counters, expected=None, **kwargs) -> None:
    """Tokens of the op against the reference; a refusal must match a refusal of the same row
    (one element)."""
    expected = _expected(z, temperature, counters) if expected is None else expected
    try:
        got = backend.to_numpy(sampling_op.sample(backend, backend.asarray(z), temperature, **counters, **kwargs))
    except InputError as error:
        got = error
    if isinstance(expected, InputError) or isinstance(got, InputError):
        tally.compared += 1
        same = isinstance(expected, InputError) and isinstance(got, InputError) and \
            _refused_row(expected) == _refused_row(got)
        tally.mismatches += int(not same)
        return
    tally.add(np.asarray(got), expected)


def check_sample(backend: Backend, rng, quick: bool) -> Tally:
    """Every kind x temperature (one T per batch, and mixed per row), against the reference."""
    tally = Tally()
    for rows, vocab in _sizes(backend, quick):
        for kind in SAMPLING_KINDS:
            z = _logit_rows(rng, rows, vocab, kind)
            counters = _counters(rng, rows)
            for temperature in SAMPLING_TEMPERATURES:
                _compare(tally, backend, z, np.full(rows, temperature), counters)
            if kind != "huge":
                mixed = np.array([SAMPLING_TEMPERATURES[i % len(SAMPLING_TEMPERATURES)] for i in range(rows)])
                _compare(tally, backend, z, rng.permutation(mixed), counters)
    return tally


def check_sample_invariance(backend: Backend, rng, quick: bool) -> Tally:
    """A row's token does not depend on its batch, its place in it, or the kernel's block size."""
    tally = Tally()
    rows, vocab = (24, 5000) if quick else (64, 32000)
    z = (rng.standard_normal((rows, vocab)) * 3.0).astype(np.float32)
    temperature = rng.choice(np.array(SAMPLING_TEMPERATURES), size=rows)
    counters = _counters(rng, rows)
    full = reference.sample(z, temperature, **counters)
    _compare(tally, backend, z, temperature, counters, full)
    permutation = rng.permutation(rows)
    _compare(tally, backend, z[permutation], temperature[permutation], _pick(counters, permutation), full[permutation])
    for row in rng.choice(rows, size=4, replace=False):
        _compare(tally, backend, z[row:row + 1], temperature[row:row + 1], _pick(counters, slice(row, row + 1)),
                 full[row:row + 1])
    for threads in LAUNCH_THREADS:
        _compare(tally, backend, z, temperature, counters, full, threads=threads)
    # another seed, same counters
    other = dict(counters, seed=counters["seed"] ^ np.uint64(1))
    _compare(tally, backend, z, temperature, other)
    return tally


def check_sampled_logprobs(backend: Backend, rng, quick: bool) -> Tally:
    """Recorded log-probs (logprob kernel at T, T = 1 for greedy; and the sampling kernel's own, fused
    with the draw) against the reference."""
    tally = Tally()
    for rows, vocab in ((7, 13), (20, 1000)) + (() if quick else ((32, 32000),)):
        z = (rng.standard_normal((rows, vocab)) * 4.0).astype(np.float32)
        counters = _counters(rng, rows)
        for temperature in (np.full(rows, 1.0), np.full(rows, 0.0),
                            rng.choice(np.array(SAMPLING_TEMPERATURES), size=rows)):
            tokens = reference.sample(z, temperature, **counters)
            expected = reference.sampled_logprobs(z, tokens, temperature)
            z_dev = backend.asarray(z)
            got = sampling_op.sampled_logprobs(backend, z_dev, backend.asarray(tokens), temperature)
            tally.add(backend.to_numpy(got), expected)
            got_tokens, got_logp = sampling_op.sample_and_logprobs(backend, z_dev, temperature, **counters)
            tally.add(backend.to_numpy(got_tokens), tokens)
            tally.add(backend.to_numpy(got_logp), expected)
    # the sampling kernel's own log-probs (the engine's path): every kind of row (signed-zero ties,
    # masked entries, subnormals, massive channels) at every temperature, mixed per row too
    rows, vocab = (8, 1000) if quick else (16, 32000)
    for kind in SAMPLING_KINDS:
        if kind == "huge":  # z / T overflows for T < 1: refused rows (check_sample_refusals)
            continue
        z = _logit_rows(rng, rows, vocab, kind)
        counters = _counters(rng, rows)
        for temperature in [np.full(rows, t) for t in SAMPLING_TEMPERATURES] + [
                rng.choice(np.array(SAMPLING_TEMPERATURES), size=rows)]:
            tokens = reference.sample(z, temperature, **counters)
            parameters = sampling_op.kernel_row_parameters(rows, temperature, **counters)
            got_tokens, got_logp = sampling_op.sample_on_device(
                backend, backend.asarray(z), *(backend.asarray(p) for p in parameters), with_logprobs=True)
            tally.add(backend.to_numpy(got_tokens), tokens)
            tally.add(backend.to_numpy(got_logp), reference.sampled_logprobs(z, tokens, temperature))
    return tally


def check_sample_refusals(backend: Backend, rng, quick: bool) -> Tally:
    """Rows the contract refuses (NaN, +inf, all -inf, z / T overflowing) and filtered rows raise."""
    tally = Tally()
    vocab = 700
    base = (rng.standard_normal((5, vocab)) * 2.0).astype(np.float32)
    counters = _counters(rng, 5)
    for row, value, temperature in ((0, np.nan, 1.0), (3, np.inf, 0.7), (4, np.nan, 0.0), (2, np.inf, 0.0)):
        z = base.copy()
        z[row, rng.integers(vocab)] = value
        _compare(tally, backend, z, np.full(5, temperature), counters)
    z = base.copy()
    z[1] = -np.inf
    for temperature in (0.0, 1.0):
        _compare(tally, backend, z, np.full(5, temperature), counters)
    z = base.copy()
    z[2, 5] = np.float32(3e38)
    _compare(tally, backend, z, np.full(5, 1e-3), counters)  # 3e38 / 1e-3 overflows float32
    # filters: refused by the op (the host samples them), ignored by greedy rows
    z_dev = backend.asarray(base)
    for filters in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        try:
            sampling_op.sample(backend, z_dev, 1.0, **filters, **counters)
            refused = False
        except InputError:
            refused = True
        tally.compared += 1
        tally.mismatches += int(not refused)
        got = sampling_op.sample(backend, z_dev, 0.0, **filters, **counters)
        tally.add(backend.to_numpy(got), reference.sample(base, 0.0, **filters, **counters))
    # filters that keep everything are no filters
    got = sampling_op.sample(backend, z_dev, 0.8, top_k=vocab, top_p=1.0, min_p=0.0, **counters)
    tally.add(backend.to_numpy(got), reference.sample(base, 0.8, **counters))
    return tally


def check_engine_device_sampler(backend: Backend, rng, quick: bool) -> Tally:
    """The rollout engine with sampler="device" on the backend against the cpu engine with the host
    sampler: the same tokens and log-prob bits, with unfiltered, greedy and filtered (host-routed)
    rows in the same steps, n samples sharing their prompt, and a small batch."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams
    from rlportable.model.forward import Model
    from rlportable.model.tiny import tiny_model

    tally = Tally()
    config, weights, tokenizer = tiny_model()
    prompts = ["12+34=", "a longer prompt that spans more than one block of the cache", "7", "the"]
    seed = int(rng.integers(1 << 62)) * 4 + 3
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=8 if quick else 24, seed=seed, ignore_eos=True),
              SamplingParams(n=2, temperature=0.0, max_tokens=8 if quick else 24, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=8 if quick else 24, seed=seed,
                             ignore_eos=True),
              SamplingParams(n=1, temperature=1.3, max_tokens=8 if quick else 24, seed=2**64 - 1, ignore_eos=True)]

    def run(model_backend, sampler: str, **engine):
        llm = LLM(device=model_backend.name, loaded=(Model(model_backend, config, weights), tokenizer),
                  sampler=sampler, **engine)
        return [(np.array(c.token_ids, np.int32), np.array(c.logprobs, np.float32))
                for r in llm.generate(prompts, params) for c in r.outputs]

    from rlportable.runtime import get_backend

    expected = run(get_backend("cpu"), "host", max_num_seqs=64, block_size=16)
    for engine in (dict(max_num_seqs=64, block_size=16), dict(max_num_seqs=3, block_size=32, max_num_batched_tokens=8)):
        for (tokens, lp), (tokens_ref, lp_ref) in zip(run(backend, "device", **engine), expected):
            tally.add(tokens, tokens_ref)
            tally.add(lp, lp_ref)
    return tally


CHECKS = [
    ("sampling.sample", check_sample),
    ("sampling.sample_invariance", check_sample_invariance),
    ("sampling.sampled_logprobs", check_sampled_logprobs),
    ("sampling.refusals", check_sample_refusals),
    ("sampling.engine_device_sampler", check_engine_device_sampler),
]


# ---- golden

GOLDEN_CASES = Cases("sampling")
GOLDEN_SAMPLING_SHAPES = [[6, 1], [9, 7], [8, 513], [4, 32000]]
GOLDEN_SAMPLING_TEMPERATURES = [0.0, 0.5, 1.0, 1.7, 0.001]


def _sampling_logits(s: Stream, rows: int, vocab: int, kind: str) -> np.ndarray:
    if kind == "sharp":  # a few tokens hold the mass
        return np.ldexp(s.floats((rows, vocab), "uniform"), 4).astype(np.float32)
    if kind == "one_hot":
        z = np.full((rows, vocab), -np.inf, dtype=np.float32)
        z[np.arange(rows), s.ints((rows,), 0, vocab)] = s.floats((rows,), "uniform")
        return z
    if kind == "neg_inf":  # masked entries, at least one finite value per row
        z = s.floats((rows, vocab), "logits")
        z[s.ints((rows, vocab), 0, 10) < 3] = -np.inf
        z[np.arange(rows), s.ints((rows,), 0, vocab)] = 1.0
        return z
    return golden_logits(s, rows, vocab, kind)


def _sampling_rows(s: Stream, rows: int) -> dict:
    """Per-row temperatures (cycled, then permuted) and counters, with the extremes in the first rows."""
    temperature = np.array(GOLDEN_SAMPLING_TEMPERATURES * rows)[:rows][s.permutation(rows)]
    counters = {"seed": s.u64(rows), "request": s.ints((rows,), 0, 1 << 32, np.uint32),
                "sample_index": s.ints((rows,), 0, 64, np.uint32), "position": s.ints((rows,), 0, 1 << 32, np.uint32)}
    extremes = [(2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1), (0, 0, 0, 0)]
    for row, values in zip(range(rows), extremes):
        for name, value in zip(("seed", "request", "sample_index", "position"), values):
            counters[name][row] = value
    return {"temperature": temperature, **counters}


@GOLDEN_CASES.case("sample_and_logprobs", seed=80, shapes=GOLDEN_SAMPLING_SHAPES,
                   kinds=["logits", "sharp", "ties", "neg_inf", "one_hot", "tiny"],
                   temperatures=GOLDEN_SAMPLING_TEMPERATURES,
                   counters="seed u64, request u32, sample_index in [0, 64), position u32; rows 0 and 1 at the extremes")
def _sampling_sample(backend, s, r):
    out = []
    for i, (rows, vocab) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            z = backend.asarray(_sampling_logits(s, rows, vocab, kind))
            params = _sampling_rows(s, rows)
            temperature = params.pop("temperature")
            tokens, logp = sampling_op.sample_and_logprobs(backend, z, temperature, **params)
            out += [(f"{i}.{kind}.tokens", host(backend, tokens, "int32")),
                    (f"{i}.{kind}.logp", host(backend, logp))]
    return out
