"""Model-level conformance: whole-model log-probs on the backend against the cpu reference, bitwise."""

from __future__ import annotations

import numpy as np

from rlportable.runtime import get_backend


def _packed_batch(rng, vocab: int, lengths) -> tuple[np.ndarray, np.ndarray]:
    tokens = rng.integers(0, vocab, int(sum(lengths))).astype(np.int32)
    return tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _compare_models(backend, config, weights, rng, lengths, temperature, tally) -> None:
    from rlportable.model.forward import Model

    tokens, cu = _packed_batch(rng, config.vocab_size, lengths)
    expected_lp, expected_ent = Model(get_backend("cpu"), config, weights).logprobs(tokens, cu, temperature, with_entropy=True)
    model = Model(backend, config, weights)
    got_lp, got_ent = model.logprobs(tokens, cu, temperature, with_entropy=True)
    for got, expected in zip(got_lp + got_ent, expected_lp + expected_ent):
        tally.add(got, expected)
    # the same sequence alone: bits independent of the pack and of its offset in it
    for index in range(len(lengths)):
        alone = tokens[cu[index]:cu[index + 1]]
        (lp,) = model.logprobs(alone, np.array([0, alone.size]), temperature)
        tally.add(lp, expected_lp[index])


def check_model_tiny(backend, rng, quick: bool):
    from rlportable.conform.tally import Tally
    from rlportable.model.tiny import tiny_model

    tally = Tally()
    config, weights, _ = tiny_model()
    lengths = [1, 7, 33, 64] if quick else [1, 2, 7, 33, 64, 130, 257]
    for temperature in (1.0, 0.7):
        _compare_models(backend, config, weights, rng, lengths, temperature, tally)
    return tally


def check_model_qwen3_06b_shape(backend, rng, quick: bool):
    """A Qwen3-0.6B-shaped model with random weights (all 28 layers; 2 layers with --quick),
    on GPUs only (DEVICE_ONLY): on cpu it would compare the reference with itself, on hip-cpu it takes
    too long for the CPU."""
    from rlportable.model.synthetic import qwen3_06b_config
    from rlportable.conform.tally import Tally
    from rlportable.model.tiny import tiny_weights

    tally = Tally()
    config = qwen3_06b_config(2 if quick else None)
    weights = tiny_weights(config, seed=3)
    _compare_models(backend, config, weights, rng, [5, 40, 83], 1.0, tally)
    return tally


DEVICE_ONLY = {"model.qwen3-0.6b-shape.logprobs"}

MODEL_CHECKS = [
    ("model.tiny.logprobs", check_model_tiny),
    ("model.qwen3-0.6b-shape.logprobs", check_model_qwen3_06b_shape),
]


def check_engine_tiny(backend, rng, quick: bool):
    """The rollout engine on the backend against the cpu engine: the same tokens and log-prob bits,
    with prefix sharing (n samples), chunked prefill and a small batch; and the recorded log-probs
    against the trainer's forward on the backend."""
    from rlportable.conform.tally import Tally
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams
    from rlportable.model.tiny import tiny_model

    tally = Tally()
    loaded = tiny_model()
    prompts = ["12+34=", "a longer prompt that spans more than one block of the cache", "7"]
    params = [SamplingParams(n=3, temperature=t, max_tokens=8 if quick else 24, seed=int(rng.integers(1 << 30)),
                             ignore_eos=True) for t in (1.0, 0.6, 0.0)]

    def run(device_backend, **engine):
        llm = LLM(device=device_backend, loaded=loaded, **engine)
        outputs = llm.generate(prompts, params)
        return llm, [(np.array(c.token_ids, np.int32), np.array(c.logprobs, np.float32))
                     for r in outputs for c in r.outputs], outputs

    _, expected, _ = run("cpu", max_num_seqs=64, block_size=16)
    # decode graphs (cuda, hip) or padded decode buckets (cpu) on and off, odd batch sizes included; the last:
    # the device sampler with asynchronous scheduling (decode steps fed the tokens drawn on the device)
    for engine in (dict(max_num_seqs=64, block_size=16), dict(max_num_seqs=2, block_size=32, max_num_batched_tokens=8),
                   dict(max_num_seqs=5, block_size=16, cuda_graphs=True),
                   dict(max_num_seqs=5, block_size=16, cuda_graphs=False),
                   dict(max_num_seqs=5, block_size=16, cuda_graphs=True, sampler="device", async_scheduling=True)):
        llm, got, outputs = run(backend.name, **engine)
        for (tokens, lp), (tokens_ref, lp_ref) in zip(got, expected):
            tally.add(tokens, tokens_ref)
            tally.add(lp, lp_ref)
    for request in outputs:  # recorded log-probs == the trainer's forward, on this backend
        for completion in request.outputs:
            tokens = np.array(request.prompt_token_ids + completion.token_ids, dtype=np.int32)
            temperature = params[request.request_id].temperature or 1.0
            (trainer,) = llm.model.logprobs(tokens, np.array([0, tokens.size]), temperature)
            tally.add(trainer[len(request.prompt_token_ids) - 1:], np.array(completion.logprobs, np.float32))
    return tally


MODEL_CHECKS.append(("engine.tiny.generate", check_engine_tiny))
