"""Tensor parallelism on cpu: emulated ranks (threads) give bitwise the single-device results.

The ranks of an emulated group run the same per-rank code as NCCL ranks, with the collectives
done in NumPy (runtime/collectives.py ThreadGroup); the 2-GPU run is in conformance/results/.
"""

import dataclasses
import threading

import numpy as np
import pytest

from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.errors import InputError
from rlportable.launch import run_ranks
from rlportable.model.forward import Model
from rlportable.model.load import load_model
from rlportable.model.parallel import TensorParallel, shard_weights
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import SingleGroup, ThreadGroup, run_threads
from rlportable.runtime.world import world_from_env


@pytest.fixture(scope="module")
def cpu():
    return get_backend("cpu")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def bits(arrays):
    return [np.asarray(a, np.float32).view(np.uint32) for a in arrays]


def same_bits(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(bits(a), bits(b)))


# ---- collectives
def test_thread_group_reduces_exactly_and_gathers_in_rank_order(cpu):
    def work(group):
        value = np.array([group.rank, -group.rank, 2**40 + group.rank], np.int64)
        return (group.all_reduce(value, "sum"), group.all_reduce(value.astype(np.int32)[:2], "max"),
                group.all_gather(np.full((2,), group.rank, np.float32)))

    for total, largest, gathered in run_threads(cpu, 4, work):
        assert total.tolist() == [6, -6, 4 * 2**40 + 6]
        assert largest.tolist() == [3, 0]
        assert gathered.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_all_to_all_sends_row_j_to_rank_j(cpu):
    def work(group):
        rows = np.array([[100 * group.rank + j, -(100 * group.rank + j)] for j in range(group.size)], np.float32)
        return group.all_to_all(rows)

    for rank, received in enumerate(run_threads(cpu, 3, work)):
        assert received.tolist() == [[100 * j + rank, -(100 * j + rank)] for j in range(3)]
    with pytest.raises(InputError, match="first dimension must be the group size 1"):
        SingleGroup().all_to_all(np.zeros((2, 3), np.float32))


def test_floats_are_never_summed_across_ranks(cpu):
    with pytest.raises(InputError, match="float32 is not exact"):
        SingleGroup().all_reduce(np.zeros(2, np.float32), "sum")
    with pytest.raises(InputError, match="op must be one of"):
        SingleGroup().all_reduce(np.zeros(2, np.int32), "min")


def test_an_error_in_one_rank_is_raised_and_does_not_hang_the_others(cpu):
    def work(group):
        if group.rank == 1:
            raise InputError("rank 1 failed")
        return group.all_reduce(np.zeros(1, np.int32), "sum")

    with pytest.raises(InputError, match="rank 1 failed"):
        run_threads(cpu, 3, work)
    assert threading.active_count() < 10


def test_world_from_the_launcher_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world_from_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    world = world_from_env()
    assert (world.rank, world.size, world.local_rank, world.master_port) == (1, 2, 1, 29500)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(InputError, match="RANK=2"):
        world_from_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(InputError, match="MASTER_PORT is not set"):
        world_from_env()


def test_run_ranks_checks_tp(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(InputError, match="must be an integer >= 1"):
        run_ranks("cpu", 0, False, lambda backend, world_group: None)
    reports, sizes = run_ranks("cpu", 3, False, lambda backend, world_group: world_group.size)
    assert reports and sizes == 3


# ---- the sharding plan
def test_what_must_divide_is_named(tiny):
    config = tiny[0]
    with pytest.raises(InputError, match="num_attention_heads=4 is not divisible by the TP size 8"):
        TensorParallel(0, 8).check(config)
    odd = dataclasses.replace(config, num_key_value_heads=3, num_attention_heads=6)
    with pytest.raises(InputError, match="num_key_value_heads=3 and the TP size 2"):
        TensorParallel(0, 2).check(odd)


def test_shards_cover_the_weights_once(tiny):
    config, weights, _ = tiny
    for size in (2, 4):
        shards = [shard_weights(weights, config, TensorParallel(rank, size)) for rank in range(size)]
        np.testing.assert_array_equal(np.concatenate([s.embed for s in shards]), weights.embed)
        np.testing.assert_array_equal(np.concatenate([s.layers[0].gate for s in shards]), weights.layers[0].gate)
        np.testing.assert_array_equal(np.concatenate([s.layers[1].o for s in shards], axis=1), weights.layers[1].o)
        # tiny has 2 KV heads: at TP=4 ranks 0,1 keep head 0 and ranks 2,3 head 1
        kv = [TensorParallel(rank, size).kv_heads(config) for rank in range(size)]
        assert [list(r) for r in kv] == ([[0], [1]] if size == 2 else [[0], [0], [1], [1]])


# ---- the model: bitwise independent of the TP degree
def _sequences(rng, vocab, lengths):
    tokens = [rng.integers(0, vocab, size=n).astype(np.int32) for n in lengths]
    return np.concatenate(tokens), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _logprobs_at(cpu, loaded, size, tokens, cu, temperature=1.0):
    config, weights = loaded[0], loaded[1]
    results = run_threads(cpu, size, lambda tp_group: Model(cpu, config, weights, tp_group=tp_group).logprobs(
        tokens, cu, temperature))
    for other in results[1:]:
        assert same_bits(other, results[0])  # every rank returns the same log-probs
    return results[0]


@pytest.mark.parametrize("size", [2, 4])
def test_tiny_logprobs_at_tp_equal_tp1(cpu, tiny, size):
    rng = np.random.default_rng(size)
    tokens, cu = _sequences(rng, tiny[0].vocab_size, [5, 17, 1, 30])
    single = Model(cpu, tiny[0], tiny[1]).logprobs(tokens, cu, 0.7)
    assert same_bits(_logprobs_at(cpu, tiny, size, tokens, cu, 0.7), single)


def _small_qwen3(arch="Qwen3ForCausalLM", **changes):
    fields = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=16)
    fields.update(changes)
    config = dataclasses.replace(qwen3_06b_config(2), architecture=arch, **fields)
    return config, random_weights(config, seed=3)


@pytest.mark.parametrize("size", [2, 8])
def test_qwen3_shaped_logprobs_at_tp_equal_tp1(cpu, size):
    config, weights = _small_qwen3()
    rng = np.random.default_rng(0)
    tokens, cu = _sequences(rng, config.vocab_size, [9, 40, 3])
    single = Model(cpu, config, weights).logprobs(tokens, cu)
    assert same_bits(_logprobs_at(cpu, (config, weights), size, tokens, cu), single)


def test_qwen2_biases_and_shared_kv_heads_at_tp4(cpu):
    config, weights = _small_qwen3("Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    rng = np.random.default_rng(1)
    tokens, cu = _sequences(rng, config.vocab_size, [12, 7])
    single = Model(cpu, config, weights).logprobs(tokens, cu)
    assert same_bits(_logprobs_at(cpu, (config, weights), 4, tokens, cu), single)


@pytest.mark.parametrize("size", [2, 4])
def test_entropy_at_tp_equals_tp1(cpu, tiny, size):
    rng = np.random.default_rng(5)
    tokens, cu = _sequences(rng, tiny[0].vocab_size, [6, 21, 2])
    single_lp, single_ent = Model(cpu, tiny[0], tiny[1]).logprobs(tokens, cu, 0.9, with_entropy=True)
    for lp, ent in run_threads(cpu, size, lambda tp_group: Model(cpu, tiny[0], tiny[1], tp_group=tp_group).logprobs(
            tokens, cu, 0.9, with_entropy=True)):
        assert same_bits(lp, single_lp) and same_bits(ent, single_ent)


def test_training_with_shared_kv_heads_is_a_clear_error(cpu, tiny):
    tp_group = ThreadGroup.create(cpu, 4)[0]  # 2 KV heads over 4 ranks: shared
    with pytest.raises(InputError, match="training needs num_key_value_heads \\(2\\) divisible by the TP size \\(4\\)"):
        Model(cpu, tiny[0], tiny[1], trainable=True, tp_group=tp_group)


def _gradients_at(cpu, loaded, size, tokens, cu, rows, grad, temperature):
    from rlportable.model import backward

    config, weights = loaded

    def work(tp_group):
        model = Model(cpu, config, weights, trainable=True, tp_group=tp_group)
        fwd = backward.forward(model, tokens, cu, temperature, rows=rows)
        grads = backward.backward(model, fwd, grad)
        return cpu.to_numpy(fwd.logp), grads  # cpu: NumPy arrays

    return run_threads(cpu, size, work) if size > 1 else [work(SingleGroup())]


@pytest.mark.parametrize("loaded,size", [("tiny", 2), ("qwen3", 2), ("qwen3", 8), ("qwen2", 2)])
def test_gradients_at_tp_are_the_single_device_shards(cpu, tiny, loaded, size):
    """The trainer's forward and backward under tensor parallelism: the log-probs are the single-device
    ones and each rank's gradients are exactly its shard of the single-device gradients (QK-norm and
    norm weights whole on every rank), bitwise."""
    import copy

    from rlportable.model.parallel import TensorParallel, shard_weights

    loaded = {"tiny": tiny, "qwen3": _small_qwen3(),
              "qwen2": _small_qwen3("Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, num_key_value_heads=2,
                                    tie_word_embeddings=False)}[loaded]
    config = loaded[0]
    rng = np.random.default_rng(size)
    tokens, cu = _sequences(rng, config.vocab_size, [9, 30, 2, 14])
    rows = np.array([3, 4, 5, 10, 20, 37, 41, 45, 52], np.int64)
    grad = rng.standard_normal(rows.size).astype(np.float32)
    (logp, single), = _gradients_at(cpu, (config, copy.deepcopy(loaded[1])), 1, tokens, cu, rows, grad, 0.8)
    for rank, (rank_logp, grads) in enumerate(_gradients_at(cpu, (config, copy.deepcopy(loaded[1])), size, tokens,
                                                            cu, rows, grad, 0.8)):
        assert same_bits([rank_logp], [logp])
        expected = shard_weights(single, config, TensorParallel(rank, size)).named_tensors(config)
        got = grads.named_tensors(config)
        assert expected.keys() == got.keys()
        for name in got:
            assert same_bits([got[name]], [expected[name]]), (rank, name)


# ---- the engine
def _generate(cpu, loaded, size, prompts, params, **engine):
    def work(tp_group):
        llm = LLM(device=cpu, loaded=loaded, tp_group=tp_group, **engine)
        return [[(c.token_ids, c.logprobs) for c in r.outputs] for r in llm.generate(prompts, params)]

    results = run_threads(cpu, size, work)
    assert all(r == results[0] for r in results[1:])
    return results[0]


def _same_completions(a, b) -> bool:
    return all(ta == tb and same_bits([la], [lb]) for ra, rb in zip(a, b) for (ta, la), (tb, lb) in zip(ra, rb))


@pytest.mark.parametrize("size,engine", [(2, dict(block_size=16)), (4, dict(block_size=1, enable_prefix_caching=True,
                                                                           max_num_seqs=3))])
def test_engine_at_tp_equals_tp1(cpu, tiny, size, engine):
    prompts = ["12+34=", "7*8=", "hello"]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    single = _generate(cpu, tiny, 1, prompts, params, **engine)
    assert _same_completions(_generate(cpu, tiny, size, prompts, params, **engine), single)
