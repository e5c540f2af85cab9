"""The engine on the cpu backend: tokens and log-probs independent of batching, paging, sharing and
preemption (bitwise), and equal to the trainer's forward (bitwise)."""

import numpy as np
import pytest

from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams, Sequence, int_list
from rlportable.errors import InputError
from rlportable.model.load import load_model

PROMPTS = ["12+34=", "hello world, this is a longer prompt that spans blocks", "7*8", "the"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def run(tiny, **engine):
    llm = LLM(device="cpu", loaded=tiny, **engine)
    params = [SamplingParams(n=3, temperature=t, top_p=p, max_tokens=12, seed=5, ignore_eos=True)
              for t, p in ((1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.0, 1.0))]
    outputs = llm.generate(PROMPTS, params)
    return llm, [(c.token_ids, np.asarray(c.logprobs, dtype=np.float32).view(np.uint32).tolist())
                 for r in outputs for c in r.outputs]


@pytest.fixture(scope="module")
def baseline(tiny):
    return run(tiny, max_num_seqs=64, block_size=16)[1]


@pytest.mark.parametrize("engine", [
    dict(max_num_seqs=1, block_size=16),
    dict(max_num_seqs=3, block_size=32),
    dict(max_num_seqs=64, block_size=16, enable_prefix_caching=True),
    dict(max_num_seqs=8, block_size=16, max_num_batched_tokens=8),  # chunked prefill
    dict(max_num_seqs=16, block_size=16, num_blocks=6),  # preemption by recompute
])
def test_same_tokens_and_logprob_bits_under_any_engine_configuration(tiny, baseline, engine):
    llm, results = run(tiny, **engine)
    assert results == baseline
    if engine.get("num_blocks"):
        assert llm.stats.preemptions > 0


def test_recorded_logprobs_equal_the_trainer_forward(tiny):
    llm, _ = run(tiny, max_num_seqs=4, block_size=16)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=10, seed=11, ignore_eos=True)
    (request,) = llm.generate([PROMPTS[1]], params)
    for completion in request.outputs:
        tokens = np.array(request.prompt_token_ids + completion.token_ids, dtype=np.int32)
        (trainer,) = llm.model.logprobs(tokens, np.array([0, tokens.size]), temperature=0.8)
        recomputed = trainer[len(request.prompt_token_ids) - 1:]
        assert np.array_equal(recomputed.view(np.uint32), np.asarray(completion.logprobs, np.float32).view(np.uint32))


def test_samples_of_a_request_differ_and_greedy_is_deterministic(tiny):
    _, results = run(tiny, max_num_seqs=64, block_size=16)
    first_request = [tokens for tokens, _ in results[:3]]
    assert len({tuple(t) for t in first_request}) == 3
    greedy = [tokens for tokens, _ in results[9:12]]
    assert greedy[0] == greedy[1] == greedy[2]


def test_stop_conditions(tiny):
    llm = LLM(device="cpu", loaded=tiny)
    (request,) = llm.generate(["12+34="], SamplingParams(max_tokens=5, temperature=0.0))
    assert len(request.outputs[0].token_ids) <= 5
    first = request.outputs[0].token_ids[0]
    (stopped,) = llm.generate(["12+34="], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(first,)))
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("prompt", [[1, 2, True], [1, -2, 3], [1, 2.0], [], [1, 10 ** 9]])
def test_a_bad_prompt_is_refused_by_name(tiny, prompt):
    llm = LLM(loaded=tiny, max_num_seqs=2)
    with pytest.raises(InputError, match="prompt 1"):
        llm.generate([[1, 2], prompt], SamplingParams(max_tokens=1))


def test_prompt_ids_of_numpy_and_python_integers_are_the_same_request():
    ids = [3, 1, 4, 1, 5]
    for prompt in (ids, np.array(ids, np.int64), [np.int32(t) for t in ids]):
        assert int_list(prompt) == ids and all(type(t) is int for t in int_list(prompt))
    assert int_list([1, True]) is None and int_list([1, 2.0]) is None
    with pytest.raises(InputError, match="found -1"):
        Sequence(0, iter([1, -1]))


def test_a_request_with_its_own_seed_samples_the_same_alone_or_in_a_batch_of_300(tiny):
    """vLLM's convention: SamplingParams(seed=...) keys the request's draws by that seed and the
    sample index, wherever it stands in the call and whatever else is in it; a request without one
    is keyed by the call's seed and its index."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, tiny[0].vocab_size, int(rng.integers(1, 9))).tolist() for _ in range(300)]
    others = SamplingParams(n=1, temperature=1.0, max_tokens=3, ignore_eos=True)
    own = SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True, seed=2**64 - 3)
    params = [others] * 300
    params[137] = own

    def samples(output):
        return [(c.token_ids, np.asarray(c.logprobs, np.float32).view(np.uint32).tolist()) for c in output.outputs]

    batch = LLM(device="cpu", loaded=tiny, max_num_seqs=64).generate(prompts, params, seed=11)
    alone = LLM(device="cpu", loaded=tiny).generate([prompts[137]], own)
    assert samples(batch[137]) == samples(alone[0])
    # without a seed of its own, a request's draws follow the call's seed and its index
    moved = LLM(device="cpu", loaded=tiny).generate([prompts[5], prompts[4]], others, seed=11, request_ids=[5, 4])
    assert samples(moved[0]) == samples(batch[5]) and samples(moved[1]) == samples(batch[4])
    other_seed = LLM(device="cpu", loaded=tiny).generate(prompts[:8], others, seed=12)
    assert [samples(o) for o in other_seed] != [samples(o) for o in batch[:8]]
    with pytest.raises(InputError, match="seed"):
        SamplingParams(seed=-1)
