"""Decode buckets and graphs on the cpu backend: padded decode steps give the same tokens and bitwise the
same log-probs as unpadded ones; the graph bookkeeping (capture per bucket, inputs read from the fixed
upload region at every replay, recapture when an array a graph reads is replaced) is checked with a stand-in
backend whose "graphs" re-run the padded forward on whatever the upload buffer holds at replay time."""

import numpy as np
import pytest

from rlportable.engine import step_inputs
from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams
from rlportable.engine.step_inputs import GRAPH_INPUTS, StepPlan, StepUploader, decode_buckets, plan_decode
from rlportable.errors import InputError
from rlportable.model.forward import StepInputs
from rlportable.model.load import load_model
from rlportable.runtime.cpu import CpuBackend

PROMPTS = ["12+34=", "hello world, this is a longer prompt that spans blocks", "7*8", "the", "a"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def params():
    """Mixed settings, and lengths that make sequences finish at different steps (odd batch sizes)."""
    return [SamplingParams(n=3, temperature=t, top_p=p, max_tokens=m, seed=5, ignore_eos=True, logprobs=k)
            for t, p, k, m in ((1.0, 1.0, 0, 10), (0.7, 0.9, 0, 7), (1.3, 1.0, 2, 12), (0.0, 1.0, 0, 5),
                               (0.9, 1.0, 0, 9))]


def run(tiny, device="cpu", **engine):
    """(results, the buckets of the decode steps, the LLM)."""
    llm = LLM(device=device, loaded=tiny, **engine)
    if isinstance(device, ReplayBackend):
        device.runner = llm.runner
    buckets = []
    execute = llm.runner.execute

    def recorded(out):
        result = execute(out)
        buckets.append((len(out.scheduled), llm.runner.last_step["bucket"], llm.runner.last_step["graph"]))
        return result

    llm.runner.execute = recorded
    outputs = llm.generate(PROMPTS, params())
    results = [(c.token_ids, np.asarray(c.logprobs, dtype=np.float32).view(np.uint32).tolist(), c.top_logprobs)
               for r in outputs for c in r.outputs]
    return results, buckets, llm


@pytest.fixture(scope="module")
def baseline(tiny):
    results, buckets, _ = run(tiny, max_num_seqs=64, block_size=16)
    assert all(bucket is None for _, bucket, _ in buckets)  # off by default on cpu
    return results


@pytest.mark.parametrize("engine", [
    dict(max_num_seqs=1, block_size=16),
    dict(max_num_seqs=3, block_size=32),
    dict(max_num_seqs=5, block_size=16, sampler="device"),
    dict(max_num_seqs=64, block_size=16, enable_prefix_caching=True),
    dict(max_num_seqs=16, block_size=16, num_blocks=7),  # preemption by recompute
    dict(max_num_seqs=16, block_size=16, num_blocks=7, sampler="device"),
])
def test_padded_decode_steps_give_the_same_tokens_and_logprob_bits(tiny, baseline, engine):
    results, buckets, llm = run(tiny, cuda_graphs=True, **engine)
    assert results == baseline
    padded = [(count, bucket) for count, bucket, _ in buckets if bucket is not None]
    assert padded and all(bucket in llm.runner.buckets and bucket >= count for count, bucket in padded)
    if engine["max_num_seqs"] >= 5:
        assert any(bucket > count for count, bucket in padded)  # some steps really had padding rows
    if engine.get("num_blocks"):
        assert llm.stats.preemptions > 0


def test_decode_buckets():
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 3)
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert decode_buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_padding_rows_write_no_kv_and_leave_real_rows_alone(tiny):
    llm = LLM(device="cpu", loaded=tiny, max_num_seqs=4, cuda_graphs=True)
    model, caches = llm.model, llm.runner.caches
    rng = np.random.default_rng(0)
    for cache in caches:  # a cache full of data, so a stray write would show
        cache.k_digits[...] = rng.integers(-128, 128, cache.k_digits.shape)
        cache.k_exponents[...] = rng.integers(-10, 10, cache.k_exponents.shape)
    before = [c.k_digits.copy() for c in caches]
    plan = plan_decode([], 4, llm.runner.table_width, llm.block_size)  # all padding rows
    device = StepInputs(*(getattr(plan, name) for name in StepInputs._fields))
    hidden = model.step(plan.tokens, plan.positions, plan.q_seq, plan.block_tables, plan.slots, caches, device=device)
    assert hidden.shape == (4, model.config.hidden_size)
    assert all(np.array_equal(b, c.k_digits) for b, c in zip(before, caches))


def test_uploader_views_and_fixed_offsets():
    backend = CpuBackend()
    uploader = StepUploader(backend, {"a": ((4,), np.int32), "t": ((4, 3), np.int32)})
    views = uploader.upload({"a": np.arange(2, dtype=np.int32), "t": np.ones((2, 3), np.int32)},
                            {"f": np.array([0.5, -2.0]), "u": np.array([7], np.uint64)})
    assert views["a"].tolist() == [0, 1] and views["t"].tolist() == [[1, 1, 1]] * 2
    assert views["f"].tolist() == [0.5, -2.0] and views["f"].dtype == np.float64 and views["u"].tolist() == [7]
    assert np.shares_memory(views["a"], uploader.buffer)  # views of the one buffer, no copies
    buffer = uploader.buffer
    again = uploader.upload({"a": np.array([5, 6, 7], np.int32)}, {})
    assert again["a"].tolist() == [5, 6, 7] and uploader.buffer is buffer
    assert np.shares_memory(again["a"], views["a"])  # the fixed region does not move
    uploader.upload({}, {"big": np.zeros(1 << 21, np.uint8)})
    assert uploader.buffer is not buffer  # grown: a new buffer (graphs on the old one must go)
    with pytest.raises(Exception, match="does not fit"):
        uploader.upload({"a": np.zeros(5, np.int32)}, {})


# ---------------------------------------------------------------- graphs, with a stand-in backend

class ReplayBackend(CpuBackend):
    """A cpu backend with "graphs": a replay re-runs the runner's padded forward on the inputs the
    upload buffer's fixed region holds at replay time and writes the captured output array in place,
    as a real graph reads fixed input buffers and writes fixed output buffers."""

    supports_graphs = True

    def __init__(self):
        self.captures = 0
        self.released = 0
        self.runner = None

    def capture_graph(self, function):
        self.captures += 1
        return ReplayGraph(self), function()

    def release_graph_memory(self):
        self.released += 1


class ReplayGraph:
    def __init__(self, backend):
        self.backend = backend
        self.output = None

    def replay(self):
        runner = self.backend.runner
        bucket = next(b for b, (graph, _) in runner.graphs.items() if graph is self)
        buffer, views = runner.uploader.buffer, {}
        for name in GRAPH_INPUTS:
            offset, shape, dtype = runner.uploader.fixed[name]
            count = bucket * int(np.prod(shape[1:], dtype=np.int64))
            views[name] = buffer[offset: offset + count * dtype.itemsize].view(dtype).reshape((bucket,) + shape[1:])
        plan = StepPlan(*(views[name].copy() for name in ("tokens", "positions", "q_seq", "slots", "block_tables")),
                        sample_rows=np.arange(bucket, dtype=np.int32), bucket=bucket)
        runner.graphs[bucket][1][...] = runner._decode_logits(plan, views)


def test_graphs_replay_the_uploaded_inputs_and_are_recaptured_when_arrays_change(tiny, baseline):
    backend = ReplayBackend()
    results, buckets, llm = run(tiny, device=backend, max_num_seqs=16, block_size=16, sampler="device")
    assert llm.runner.cuda_graphs  # on by default where the backend has graphs
    assert results == baseline
    replayed = {bucket for _, bucket, graph in buckets if graph}
    assert len(replayed) > 1 and backend.captures == len(replayed)  # one capture per bucket used

    # on one engine: keeps graphs across generate calls, recaptures after release/restore and
    # after the model's arrays are replaced (Model.reencode does that)
    llm = LLM(device=backend, loaded=tiny, max_num_seqs=16, block_size=16)
    backend.captures, backend.runner = 0, llm.runner
    first = [(c.token_ids, c.logprobs) for r in llm.generate(PROMPTS, params()) for c in r.outputs]
    captured = backend.captures
    assert captured == len(llm.runner.graphs) > 0
    assert [(c.token_ids, c.logprobs) for r in llm.generate(PROMPTS, params()) for c in r.outputs] == first
    assert backend.captures == captured
    llm.release_kv_cache()
    assert llm.runner.graphs == {} and backend.released >= 1
    with pytest.raises(InputError, match="released"):
        llm.generate(PROMPTS, params())
    llm.restore_kv_cache()
    assert [(c.token_ids, c.logprobs) for r in llm.generate(PROMPTS, params()) for c in r.outputs] == first
    assert backend.captures == 2 * captured
    layer = llm.model.layers[0]
    llm.model.layers[0] = type(layer)(**{**layer.__dict__, "attn_norm": layer.attn_norm.copy()})
    assert [(c.token_ids, c.logprobs) for r in llm.generate(PROMPTS, params()) for c in r.outputs] == first
    assert backend.captures == 3 * captured


def test_capture_graphs_captures_every_bucket(tiny):
    backend = ReplayBackend()
    llm = LLM(device=backend, loaded=tiny, max_num_seqs=5)
    assert llm.runner.capture_graphs() == len(decode_buckets(5)) == backend.captures
    assert LLM(device="cpu", loaded=tiny, cuda_graphs=True).runner.capture_graphs() == 0  # cpu: padded, no graphs
    llm_off = LLM(device=backend, loaded=tiny, max_num_seqs=5, cuda_graphs=False)
    assert llm_off.runner.capture_graphs() == 0


def test_cuda_graphs_option_is_checked(tiny):
    with pytest.raises(InputError, match="cuda_graphs"):
        LLM(device="cpu", loaded=tiny, cuda_graphs="yes")


def test_an_invalid_decode_plan_is_refused_before_a_replay():
    plan = plan_decode([], 2, 3, 16)
    plan.tokens[0] = 10_000
    with pytest.raises(Exception, match="token ids"):
        step_inputs.check_decode_plan(plan, 1, vocab=512, num_blocks=4, block_size=16, rope_rows=64)
    plan = plan_decode([], 2, 3, 16)
    plan.slots[:] = 5
    with pytest.raises(Exception, match="slots"):
        step_inputs.check_decode_plan(plan, 2, vocab=512, num_blocks=4, block_size=16, rope_rows=64)
