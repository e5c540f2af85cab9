"""Asynchronous scheduling: a decode step planned while the step before it runs, fed that step's
tokens on the device. The same tokens and log-prob bits as the synchronous engine, no block leak, every
request finishes.

Scheduler level: a fake device that runs each step at launch, in launch order (as the stream does), on the
plan as it was when launched (slots and block tables read then), feeding a step planned ahead the tokens the
step before drew; the host learns a step's tokens only when it postprocesses it. Every read of the K/V is
checked, so a dropped row's write that landed where another sequence (or the prefix cache) reads would show.
Engine level: the tiny model on the cpu backend, async scheduling on and off, bitwise."""

import numpy as np
import pytest

from rlportable.engine.block_manager import BlockManager, InvariantError
from rlportable.engine.llm import LLM
from rlportable.engine.scheduler import Scheduler
from rlportable.engine.sequence import SamplingParams, Sequence, SequenceStatus
from rlportable.errors import InputError
from rlportable.model.load import load_model
from rlportable.ops import sampling as sampling_op
from rlportable.runtime.cpu import CpuBackend
from test_scheduler import check_against_expected, chain, fake_token, make_workload, tight_num_blocks


class FakeDevice:
    """Runs a step when it is launched, reading block tables and slots as they are then; a step planned
    ahead feeds, at its one position, the token the step launched before it drew for sample follows[i]."""

    def __init__(self, block_size, block_manager):
        self.bs = block_size
        self.bm = block_manager
        self.store = {}  # slot -> K/V content: the hash chain of the tokens up to its position
        self.chains = {}  # seq_id -> chain of its host-known tokens (they only grow)
        self.drawn = []  # the last launched step's tokens (on the device)
        self.launches = self.ahead_launches = 0

    def content(self, seq, j, fed=None):
        """The K/V of seq's position j: from its known tokens, and `fed` at position num_tokens."""
        c = self.chains.setdefault(seq.seq_id, [])
        for t in seq.token_ids(len(c), min(j + 1, seq.num_tokens)):
            c.append(chain(c[-1] if c else 0, t))
        if j < seq.num_tokens:
            return c[j]
        assert j == seq.num_tokens and fed is not None
        return chain(c[-1], fed)

    def launch(self, out):
        """Run the step now; returns what the host will get at its postprocess: (tokens, log-probs)."""
        self.launches += 1
        self.ahead_launches += out.follows is not None
        pairs = [p for c in out.copies for p in zip(*c.slot_pairs(self.bs))]
        values = [self.store.get(src) for src, _ in pairs]
        for (_, dst), value in zip(pairs, values):
            self.store[dst] = value
        fed = [None] * len(out.scheduled) if out.follows is None else [self.drawn[row] for row in out.follows]
        for e, token in zip(out.scheduled, fed):
            for j, slot in zip(e.positions(), e.slots(self.bs)):
                assert self.bm._hash[slot // self.bs] is None, "a write into a block of the prefix cache"
                self.store[slot] = self.content(e.seq, j, token)
        tokens = []
        for e, token in zip(out.scheduled, fed):
            seq = e.seq
            for j in range(e.end):  # what attention reads
                assert self.store.get(seq.slot(j, self.bs)) == self.content(seq, j, token), (seq, j)
            if e.needs_sample:
                kv = self.store[seq.slot(e.end - 1, self.bs)]
                tokens += [fake_token(s.request_id, s.sample_index, e.end, kv) for s in e.sample_seqs]
        assert len(tokens) == len(out.samples)
        self.drawn = tokens
        return tokens, [-t / 7.0 for t in tokens]


def run_async(requests, *, block_size, num_blocks, max_num_seqs, max_batched, prefix_caching, eos=()):
    """The engine's asynchronous loop (LLM.generate) over the fake device; returns (results, scheduler,
    device). Invariants are checked after every postprocess, with a step planned ahead in flight."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs, max_batched, max_model_len=200, eos_token_ids=eos)
    device = FakeDevice(block_size, bm)
    results, queue, all_seqs, step, in_flight = {}, list(requests), [], 0, []
    while queue or in_flight or sched.has_unfinished():
        while queue and queue[0][0] <= step:
            _, r, prompt, params = queue.pop(0)
            all_seqs += sched.add_request(r, prompt, params)
        if not in_flight:
            out = sched.schedule()
            if out.is_empty:
                assert not sched.has_unfinished()
                step += 1
                continue
            in_flight.append((out, device.launch(out)))
        out, drawn = in_flight[0]
        ahead = sched.schedule_ahead(out)
        if ahead is not None:
            assert len(ahead.scheduled) <= max_num_seqs and ahead.num_batched_tokens <= max_batched
            in_flight.append((ahead, device.launch(ahead)))
        in_flight.pop(0)
        for seq in sched.postprocess(out, *drawn):
            key = (seq.request_id, seq.sample_index)
            assert key not in results
            results[key] = (seq.output_token_ids, seq.output_logprobs, seq.finish_reason)
        sched.check_invariants()
        for planned, _ in in_flight:  # what the step in flight writes is never hashed meanwhile
            for e in planned.scheduled:
                if e.seq.status is SequenceStatus.RUNNING:
                    assert bm._hash[e.seq.block_table[e.start // block_size]] is None
        step += 1
        assert step < 20000
    assert all(s.status is SequenceStatus.FINISHED and not s.block_table for s in all_seqs)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks  # no leak
    return results, sched, device


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [16, 32])
def test_async_tokens_equal_the_synchronous_ones_under_every_configuration(block_size, prefix_caching):
    requests = make_workload(seed=block_size + prefix_caching)
    tight = tight_num_blocks(requests, block_size)
    ahead = dropped = preemptions = 0
    for max_num_seqs, max_batched in ((1, 5), (3, 16), (64, 64)):
        for num_blocks in (400, tight):
            results, sched, device = run_async(requests, block_size=block_size, num_blocks=num_blocks,
                                               max_num_seqs=max_num_seqs, max_batched=max_batched,
                                               prefix_caching=prefix_caching)
            check_against_expected(requests, results)
            ahead += device.ahead_launches
            assert sched.num_steps_ahead == device.ahead_launches and sched.num_discarded == 0  # ignore_eos
            preemptions += sched.num_preemptions
    assert ahead > 0 and preemptions > 0


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64])
def test_rows_of_sequences_that_stopped_are_dropped(max_num_seqs):
    requests = make_workload(seed=7, ignore_eos=False)
    eos = tuple(range(0, 1000, 37))  # about 3% of tokens
    ahead = dropped = 0
    for num_blocks in (12, 400):
        results, sched, device = run_async(requests, block_size=16, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                                           max_batched=max(32, max_num_seqs), prefix_caching=True, eos=eos)
        check_against_expected(requests, results, eos)
        assert {reason for _, _, reason in results.values()} == {"stop", "length"}
        ahead, dropped = ahead + device.ahead_launches, dropped + sched.num_discarded
    assert ahead > 0 and dropped > 0


def test_a_step_is_planned_ahead_only_when_it_is_the_next_decode_of_everyone():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    device = FakeDevice(4, bm)
    a, b, c = (sched.add_request(i, [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))[0] for i in range(3))
    prefill = sched.schedule()
    assert sched.schedule_ahead(prefill) is None  # not a pure decode step
    sched.postprocess(prefill, *device.launch(prefill))
    decode = sched.schedule()
    drawn = device.launch(decode)
    ahead = sched.schedule_ahead(decode)  # c waits, but the two places are taken
    assert [e.seq for e in ahead.scheduled] == [a, b] and ahead.follows == [0, 1]
    assert [e.start for e in ahead.scheduled] == [4, 4] and all(len(s.block_table) == 2 for s in (a, b))
    assert a.num_computed_tokens == 3  # recorded only at postprocess
    sched.postprocess(decode, *drawn)
    drawn = device.launch(ahead)
    sched.postprocess(ahead, *drawn)
    assert a.num_output_tokens == 3 and a.num_computed_tokens == 5
    sched.check_invariants()
    # max_tokens is known ahead: the step that draws a sequence's last token has no step after it
    while a.num_output_tokens < 5:
        out = sched.schedule()
        sched.postprocess(out, *device.launch(out))
    out = sched.schedule()
    device.launch(out)
    assert sched.schedule_ahead(out) is None


def test_a_step_ahead_needs_free_blocks_and_never_preempts():
    bm = BlockManager(2, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=64)
    device = FakeDevice(4, bm)
    a = sched.add_request(0, [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    b = sched.add_request(1, [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    out = sched.schedule()
    sched.postprocess(out, *device.launch(out))  # both prefilled: one block each, positions 0..2
    out = sched.schedule()  # position 3, the last of the block
    device.launch(out)
    free = bm.num_free_blocks
    assert free == 0 and sched.schedule_ahead(out) is None  # position 4 needs a block each: none left
    assert bm.num_free_blocks == free and len(a.block_table) == len(b.block_table) == 1  # nothing taken


def test_block_manager_allocates_the_slot_of_the_token_being_drawn():
    bm = BlockManager(8, 4)
    seq = Sequence(0, [1, 2, 3, 4], SamplingParams(max_tokens=8))
    bm.allocate(seq, 3)  # positions 0..2, as a step in flight computes them
    with pytest.raises(InvariantError, match="in flight"):
        bm.allocate_ahead(seq)  # position 3 is not being computed: nothing to plan ahead of
    bm.mark_computed(seq, 3)
    bm.allocate(seq, 1)  # the step in flight computes position 3 and draws position 4
    assert bm.blocks_needed_ahead(seq) == 1
    bm.allocate_ahead(seq)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    bm.mark_computed(seq, 1)  # recorded: block 0 is full
    seq.append_token(9)
    assert bm.blocks_needed_ahead(seq) == 0  # position 5: in the block taken ahead, held alone
    bm.check_invariants([seq])
    child = Sequence(1, seq.all_token_ids, SamplingParams(max_tokens=8))
    bm.fork(seq, child)
    with pytest.raises(InvariantError, match="ahead"):  # a shared partial block is never written ahead
        bm.allocate_ahead(child)


# ---------------------------------------------------------------- the device feed (cpu reference)

def test_feed_tokens_moves_the_drawn_tokens_and_maps_refused_rows_to_token_zero():
    backend = CpuBackend()
    vocab = 50
    ids = sampling_op.token_id_table(backend, vocab)
    drawn = np.array([7, sampling_op.REFUSED, 49, 3], dtype=np.int32)
    out = np.full(6, 99, dtype=np.int32)
    rows = np.array([3, 0, 1, 2], dtype=np.int32)
    sampling_op.feed_tokens(backend, drawn, rows, rows, ids, out[:4])
    assert out.tolist() == [3, 7, 0, 49, 99, 99]
    sampling_op.feed_tokens(backend, drawn, np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int32), ids, out[:4])
    assert out[:4].tolist() == [7, 0, 49, 3]
    with pytest.raises(InputError, match="rows"):
        sampling_op.feed_tokens(backend, drawn, rows, np.array([0, 4, 1, 2], np.int32), ids, out[:4])


# ---------------------------------------------------------------- the engine (tiny model, cpu)

PROMPTS = ["12+34=", "hello world, this is a longer prompt that spans blocks", "7*8", "the", "a"]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def sampling_params(stop_token=None):
    """Mixed settings and lengths (sequences finish at different steps); a request with a top-p filter and
    one that asks for top log-probs (their rows go to the host: steps with them run one at a time)."""
    stop = () if stop_token is None else (stop_token,)
    return [SamplingParams(n=n, temperature=t, top_p=p, max_tokens=m, seed=5, ignore_eos=True, logprobs=k,
                           stop_token_ids=stop)
            for n, t, p, k, m in ((3, 1.0, 1.0, 0, 10), (2, 0.7, 1.0, 0, 17), (3, 1.3, 1.0, 0, 12), (1, 0.0, 1.0, 2, 3),
                                  (2, 0.9, 0.8, 0, 4))]


def generate(tiny, params, prompts=PROMPTS, **engine):
    llm = LLM(device="cpu", loaded=tiny, sampler="device", cuda_graphs=True, **engine)
    outputs = llm.generate(prompts, params)
    results = [(c.token_ids, np.asarray(c.logprobs, dtype=np.float32).view(np.uint32).tolist(), c.finish_reason)
               for r in outputs for c in r.outputs]
    return results, llm


@pytest.mark.parametrize("engine", [
    dict(max_num_seqs=1, block_size=16),
    dict(max_num_seqs=3, block_size=32),
    dict(max_num_seqs=64, block_size=16),
    dict(max_num_seqs=64, block_size=32, enable_prefix_caching=True),
    dict(max_num_seqs=8, block_size=16, max_num_batched_tokens=8),  # chunked prefill
    dict(max_num_seqs=16, block_size=16, num_blocks=7),  # preemption by recompute
])
def test_engine_async_equals_sync_bitwise(tiny, engine):
    sync, _ = generate(tiny, sampling_params(), async_scheduling=False, **engine)
    results, llm = generate(tiny, sampling_params(), async_scheduling=True, **engine)
    assert results == sync
    assert llm.stats.steps_ahead > 0
    if engine.get("num_blocks"):
        assert llm.stats.preemptions > 0


def test_engine_async_with_stop_tokens_and_stop_strings(tiny):
    sync, _ = generate(tiny, sampling_params(), async_scheduling=False, max_num_seqs=64)
    common = max(set(t for tokens, _, _ in sync for t in tokens[1:4]), key=lambda t: sum(
        t in tokens for tokens, _, _ in sync))  # a token that stops several sequences early
    params = sampling_params(stop_token=common)
    sync, _ = generate(tiny, params, async_scheduling=False, max_num_seqs=64)
    results, llm = generate(tiny, params, async_scheduling=True, max_num_seqs=64)
    assert results == sync and any(reason == "stop" for _, _, reason in results)
    assert llm.stats.discarded_tokens > 0  # rows drawn ahead for sequences that had stopped
    text = llm.tokenizer.decode(sync[0][0][2:4])  # a stop string: the caller detokenizes after every token
    params = [SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, stop=(text,))] * len(PROMPTS)
    sync, _ = generate(tiny, params, async_scheduling=False, max_num_seqs=8)
    results, llm = generate(tiny, params, async_scheduling=True, max_num_seqs=8)
    assert results == sync and any(reason == "stop" for _, _, reason in results)


def test_async_scheduling_option(tiny):
    assert not LLM(device="cpu", loaded=tiny).async_scheduling  # the default on cpu: off
    with pytest.raises(InputError, match="async_scheduling"):
        LLM(device="cpu", loaded=tiny, async_scheduling=True)  # the host sampler: nothing to feed on the device
    with pytest.raises(InputError, match="async_scheduling"):
        LLM(device="cpu", loaded=tiny, sampler="device", async_scheduling=True)  # no decode buckets
    with pytest.raises(InputError, match="async_scheduling"):
        LLM(device="cpu", loaded=tiny, async_scheduling="yes")


def test_progress_counts_kept_tokens_and_an_error_leaves_the_engine_usable(tiny):
    params = sampling_params()
    llm = LLM(device="cpu", loaded=tiny, sampler="device", cuda_graphs=True, async_scheduling=True, max_num_seqs=64)
    seen = []
    outputs = llm.generate(PROMPTS, params, progress=lambda done, budget: seen.append(done))
    total = sum(len(c.token_ids) for r in outputs for c in r.outputs)
    assert seen[-1] == total and seen == sorted(seen) and len(seen) == llm.stats.steps

    class Stop(Exception):
        pass

    def stop_midway(done, budget):
        if done > total // 2:
            raise Stop  # with a step planned ahead in flight

    with pytest.raises(Stop):
        llm.generate(PROMPTS, params, progress=stop_midway)
    again = llm.generate(PROMPTS, params)
    assert [(c.token_ids, c.logprobs) for r in again for c in r.outputs] == \
        [(c.token_ids, c.logprobs) for r in outputs for c in r.outputs]
