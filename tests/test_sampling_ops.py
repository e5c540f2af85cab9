"""Op family "sampling" on the cpu backend: ops.sampling against the contract, a NumPy model of the
kernel's algorithm (per-thread contiguous ranges, exact prefix scan, 32-bit Philox) against the
contract at several block sizes, input errors, and the engine with sampler="device" against "host".

The device kernels are checked bitwise against the same reference by `rlportable conform`.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlportable.conform.sampling import SAMPLING_KINDS, SAMPLING_TEMPERATURES, _counters, _logit_rows
from rlportable.contract import sampling as reference
from rlportable.contract.elementwise import exp_f32
from rlportable.engine.llm import LLM
from rlportable.engine.runner import ModelRunner
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import InputError
from rlportable.model.load import load_model
from rlportable.ops import sampling
from rlportable.runtime import get_backend

CPU = get_backend("cpu")
M32 = 0xFFFFFFFF


# ---------------------------------------------------------------- a model of the kernel, in Python

def _umulhi(a: int, b: int) -> int:
    return (a * b) >> 32


def _kernel_random(seed: int, request: int, sample_index: int, position: int) -> int:
    """rlp_sampling_random, word for word (Python ints, 32-bit wraps written out)."""
    c0, c1, c2, c3 = request, sample_index, position, 0
    k0, k1 = seed & M32, seed >> 32
    for round_index in range(10):
        if round_index > 0:
            k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
        hi0, lo0 = _umulhi(0xD2511F53, c0), (0xD2511F53 * c0) & M32
        hi1, lo1 = _umulhi(0xCD9E8D57, c2), (0xCD9E8D57 * c2) & M32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0 | (c1 << 32)


def _key(a: np.ndarray) -> np.ndarray:
    bits = a.astype(np.float32).view(np.uint32).copy()
    bits[bits == 0x80000000] = 0
    return np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint32)


def _from_key(key: int) -> np.float32:
    bits = (key & 0x7FFFFFFF) if key & 0x80000000 else (~key & M32)
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _kernel_row(z: np.ndarray, t: float, seed: int, request: int, sample_index: int, position: int,
                threads: int) -> int:
    """sampling_rows for one row with blockDim = threads, step by step (-1: refused)."""
    vocab = z.shape[0]
    with np.errstate(all="ignore"):
        a = z if t == 0.0 else (z.astype(np.float64) / t).astype(np.float32)
    finite_or_inf = ~np.isnan(a)
    m_key = int(_key(a[finite_or_inf]).max()) if finite_or_inf.any() else 0
    m = _from_key(m_key)
    if np.isnan(a).any() or not np.isfinite(m):
        return -1
    if t == 0.0:
        firsts = [next((i for i in range(tid, vocab, threads) if _key(z[i:i + 1])[0] == m_key), vocab)
                  for tid in range(threads)]
        return min(firsts)
    with np.errstate(all="ignore"):
        w = np.rint(exp_f32((a - m).astype(np.float32)).astype(np.float64) * 2.0**36).astype(np.int64)
    chunk = -(-vocab // threads)
    bounds = [(min(vocab, tid * chunk), min(vocab, min(vocab, tid * chunk) + chunk)) for tid in range(threads)]
    local = [int(w[b:e].sum()) for b, e in bounds]
    prefix = list(local)
    offset = 1
    while offset < threads:  # Hillis-Steele, as the kernel: read all, then add
        prefix = [prefix[i] + (prefix[i - offset] if i >= offset else 0) for i in range(threads)]
        offset <<= 1
    total = prefix[-1]
    target = (_kernel_random(seed, request, sample_index, position) * total) >> 64
    found = []
    for tid, (b, e) in enumerate(bounds):
        exclusive = prefix[tid] - local[tid]
        if local[tid] > 0 and exclusive <= target < prefix[tid]:
            k = exclusive
            for i in range(b, e):
                if target < k + int(w[i]):
                    found.append(i)
                    break
                k += int(w[i])
    assert len(found) == 1, found  # exactly one thread writes the token
    return found[0]


@pytest.mark.parametrize("vocab", [1, 7, 513, 1000])
@pytest.mark.parametrize("threads", [1, 3, 32, 512, 1024])
def test_the_kernel_algorithm_equals_the_contract(vocab, threads):
    rng = np.random.default_rng([vocab, threads])
    for kind in SAMPLING_KINDS:
        z = _logit_rows(rng, 3, vocab, kind)
        counters = _counters(rng, 3)
        for temperature in SAMPLING_TEMPERATURES:
            try:
                expected = reference.sample(z, temperature, **counters)
            except InputError:
                expected = None
            got = [_kernel_row(z[r], temperature, int(counters["seed"][r]), int(counters["request"][r]),
                               int(counters["sample_index"][r]), int(counters["position"][r]), threads)
                   for r in range(3)]
            if expected is None:
                assert -1 in got, (kind, temperature)
            else:
                assert got == expected.tolist(), (kind, temperature)


def test_the_kernel_random_words_are_the_contracts():
    rng = np.random.default_rng(1)
    for _ in range(50):
        seed, request, sample_index, position = (int(rng.integers(0, 2**63)) * 2 + int(rng.integers(2)),
                                                 *(int(v) for v in rng.integers(0, 2**32, 3)))
        assert _kernel_random(seed, request, sample_index, position) == \
            int(reference.random_u64(seed, request, sample_index, position))
    assert _kernel_random(2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1) == \
        int(reference.random_u64(2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1))


# ---------------------------------------------------------------- the cpu path of the op

@pytest.mark.parametrize("vocab", [1, 7, 1000, 32000])
def test_cpu_op_equals_the_contract(vocab):
    rng = np.random.default_rng(vocab)
    for kind in ("logits", "ties", "neg_inf", "massive"):
        z = _logit_rows(rng, 5, vocab, kind)
        counters = _counters(rng, 5)
        temperature = rng.choice(np.array(SAMPLING_TEMPERATURES), size=5)
        expected = reference.sample(z, temperature, **counters)
        got = sampling.sample(CPU, z, temperature, **counters)
        assert got.dtype == np.int32 and np.array_equal(got, expected)
        tokens, logp = sampling.sample_and_logprobs(CPU, z, temperature, **counters)
        assert np.array_equal(tokens, expected)
        assert np.array_equal(np.asarray(logp).view(np.uint32),
                              reference.sampled_logprobs(z, expected, temperature).view(np.uint32))


def test_sample_on_device_with_logprobs_is_sample_then_sampled_logprobs():
    """The engine's path (one launch that also records the log-probs) on cpu: the reference's tokens
    and the recorded log-probs at each row's record temperature, mixed greedy and sampled rows."""
    rng = np.random.default_rng(5)
    for kind in ("logits", "ties", "neg_inf", "tiny"):
        z = _logit_rows(rng, 7, 500, kind)
        counters = _counters(rng, 7)
        temperature = np.array([0.0, 1.0, 0.5, 0.0, 1.7, 1.0, 1e-3])
        parameters = sampling.kernel_row_parameters(7, temperature, **counters)
        tokens, logp = sampling.sample_on_device(CPU, z, *parameters, with_logprobs=True)
        expected = reference.sample(z, temperature, **counters)
        assert np.array_equal(tokens, expected)
        assert np.array_equal(np.asarray(logp).view(np.uint32),
                              reference.sampled_logprobs(z, expected, temperature).view(np.uint32))
        assert np.array_equal(sampling.sample_on_device(CPU, z, *parameters), expected)


def test_sampled_logprobs_group_temperatures():
    rng = np.random.default_rng(2)
    z = (rng.standard_normal((9, 300)) * 3).astype(np.float32)
    temperature = np.array([0.0, 1.0, 0.5, 0.0, 1.7, 1.0, 0.5, 1e-3, 1.0])
    tokens = rng.integers(0, 300, 9).astype(np.int32)
    got = sampling.sampled_logprobs(CPU, z, tokens, temperature)
    assert np.array_equal(np.asarray(got).view(np.uint32),
                          reference.sampled_logprobs(z, tokens, temperature).view(np.uint32))


def test_device_rows():
    t = np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.7])
    top_k = np.array([5, 0, 5, 10, 0, 0, 0, 0])
    top_p = np.array([1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 1.0])
    min_p = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.2, 0.0])
    assert sampling.device_rows(10, t, top_k, top_p, min_p).tolist() == \
        [True, True, False, True, False, False, True, True]


def test_input_errors():
    z = np.zeros((2, 5), dtype=np.float32)
    c = dict(seed=1, request=0, sample_index=0, position=3)
    with pytest.raises(InputError, match="row 1 .*host"):
        sampling.sample(CPU, z, 1.0, top_k=np.array([0, 2]), **c)
    with pytest.raises(InputError, match="host"):
        sampling.sample(CPU, z, 0.5, top_p=0.9, **c)
    with pytest.raises(InputError, match="host"):
        sampling.sample(CPU, z, 0.5, min_p=0.05, **c)
    assert sampling.sample(CPU, z, 0.0, top_k=2, top_p=0.5, **c).tolist() == [0, 0]  # greedy ignores filters
    with pytest.raises(InputError, match="float32"):
        sampling.sample(CPU, z.astype(np.float64), 1.0, **c)
    with pytest.raises(InputError, match="2-D"):
        sampling.sample(CPU, z[0], 1.0, **c)
    with pytest.raises(InputError, match="vocabulary"):
        sampling.sample(CPU, np.zeros((2, 0), np.float32), 1.0, **c)
    with pytest.raises(InputError, match="temperature"):
        sampling.sample(CPU, z, -1.0, **c)
    with pytest.raises(InputError, match="temperature"):
        sampling.sample(CPU, z, np.array([1.0, 1.0, 1.0]), **c)
    with pytest.raises(InputError, match="threads"):
        sampling.sample(CPU, z, 1.0, threads=0, **c)
    with pytest.raises(InputError, match="threads"):
        sampling.sample(CPU, z, 1.0, threads=2048, **c)
    with pytest.raises(InputError, match="seed"):
        sampling.sample(CPU, z, 1.0, **dict(c, seed=2**64))
    with pytest.raises(InputError, match="position"):
        sampling.sample(CPU, z, 1.0, **dict(c, position=2**32))
    with pytest.raises(InputError, match="request"):
        sampling.sample(CPU, z, 1.0, **dict(c, request=np.array([1, 2, 3])))
    bad = z.copy()
    bad[1, 2] = np.nan
    with pytest.raises(InputError, match="row 1 .*NaN"):
        sampling.sample(CPU, bad, 1.0, **c)
    with pytest.raises(InputError, match="tokens"):
        sampling.sampled_logprobs(CPU, z, np.array([0, 1], dtype=np.int64), 1.0)
    with pytest.raises(InputError, match="outside"):
        sampling.sampled_logprobs(CPU, z, np.array([0, 5], dtype=np.int32), 1.0)
    assert sampling.sample(CPU, np.zeros((0, 5), np.float32), 1.0, seed=0, request=0, sample_index=0,
                           position=0).shape == (0,)


# ---------------------------------------------------------------- the engine

@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def _generate(tiny, sampler: str):
    llm = LLM(device="cpu", loaded=tiny, sampler=sampler, max_num_seqs=8)
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=9, ignore_eos=True),
              SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=8, seed=9, ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, top_k=3, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, temperature=1.3, min_p=0.05, max_tokens=8, seed=2**64 - 1, ignore_eos=True)]
    outputs = llm.generate(["12+34=", "hello world", "7*8", "the"], params)
    return [(c.token_ids, np.asarray(c.logprobs, dtype=np.float32).view(np.uint32).tolist(), c.top_logprobs)
            for r in outputs for c in r.outputs]


def test_device_sampler_equals_host_sampler_on_cpu(tiny):
    host = _generate(tiny, "host")
    assert _generate(tiny, "device") == host
    assert any(top for _, _, top in host)


def test_unknown_sampler_is_refused(tiny):
    with pytest.raises(InputError, match="sampler"):
        LLM(device="cpu", loaded=tiny, sampler="gpu")
    llm = LLM(device="cpu", loaded=tiny)
    assert llm.runner.sampler == "host"
    with pytest.raises(InputError, match="sampler"):
        ModelRunner(llm.model, 4, 16, sampler="")
