"""Scheduler: continuous batching, chunked prefill, preemption by recompute, n-sample forks,
prefix caching, stop conditions; driven by a fake model over a fake KV store (CPU, no model)."""

import random

import pytest

from rlportable.engine.block_manager import BlockManager
from rlportable.engine.scheduler import Scheduler
from rlportable.engine.sequence import SamplingParams, Sequence, SequenceStatus
from rlportable.errors import InputError

VOCAB = 1000


def chain(prev, token):
    return hash((prev, token))


def fake_token(request, sample, position, kv):
    """The fake model's token: a function of who samples, where, and the K/V it read."""
    return hash((request, sample, position, kv)) % VOCAB


def expected_outputs(prompt, request, sample, params, eos=()):
    """What any schedule must produce: the fake model run one token at a time, no cache."""
    h = 0
    for t in prompt:
        h = chain(h, t)
    out = []
    while True:
        token = fake_token(request, sample, len(prompt) + len(out), h)
        out.append(token)
        h = chain(h, token)
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return out, "stop"
        if len(out) == params.max_tokens:
            return out, "length"


class FakeRunner:
    """Applies copies, writes K/V contents (hash chains of tokens) to slots, checks every position a
    step attends over holds the right content, and samples with fake_token."""

    def __init__(self, block_size):
        self.bs = block_size
        self.store = {}
        self.chains = {}
        self.copied_slots = 0

    def expected(self, seq, j):
        c = self.chains.setdefault(seq.seq_id, [])
        for t in seq.token_ids(len(c), j + 1):
            c.append(chain(c[-1] if c else 0, t))
        return c[j]

    def step(self, out):
        pairs = [p for c in out.copies for p in zip(*c.slot_pairs(self.bs))]
        values = [self.store.get(src) for src, _ in pairs]
        for (_, dst), value in zip(pairs, values):
            self.store[dst] = value
        self.copied_slots += len(pairs)
        for e in out.scheduled:
            for j, slot in zip(e.positions(), e.slots(self.bs)):
                self.store[slot] = self.expected(e.seq, j)
        tokens, logprobs = [], []
        for e in out.scheduled:
            seq = e.seq
            for j in range(e.end):  # what attention reads
                assert self.store.get(seq.slot(j, self.bs)) == self.expected(seq, j), (seq, j)
            if e.needs_sample:
                kv = self.store[seq.slot(e.end - 1, self.bs)]
                for s in e.sample_seqs:
                    assert s.num_tokens == seq.num_tokens
                    token = fake_token(s.request_id, s.sample_index, s.num_tokens, kv)
                    tokens.append(token)
                    logprobs.append(-token / 7.0)
        assert len(tokens) == len(out.samples)
        return tokens, logprobs


def tight_num_blocks(requests, block_size: int) -> int:
    """KV blocks for the longest request plus one: one sequence fits, so there is preemption all the time."""
    biggest = max(len(p) + params.max_tokens for _, _, p, params in requests)
    return -(-biggest // block_size) + 1


def make_workload(seed, num_requests=24, ignore_eos=True):
    rng = random.Random(seed)
    shared = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(3)]
    requests = []
    for r in range(num_requests):
        prompt = rng.choice(shared)[: rng.randrange(0, 41)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
        params = SamplingParams(n=rng.choice([1, 1, 2, 4]), max_tokens=rng.randrange(1, 40), ignore_eos=ignore_eos,
                                stop_token_ids=() if ignore_eos else (rng.randrange(VOCAB),))
        requests.append((rng.randrange(0, 30), r, prompt, params))
    return sorted(requests, key=lambda x: x[0])


def run_workload(requests, *, block_size, num_blocks, max_num_seqs, max_batched, prefix_caching, eos=(),
                 check_every_step=True):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs, max_batched, max_model_len=200, eos_token_ids=eos)
    runner = FakeRunner(block_size)
    results = {}
    queue = list(requests)
    step = 0
    all_seqs = []
    while queue or sched.has_unfinished():
        while queue and queue[0][0] <= step:
            _, r, prompt, params = queue.pop(0)
            all_seqs += sched.add_request(r, prompt, params)
        busy = sched.has_unfinished()
        out = sched.schedule()
        assert out.is_empty != busy  # something runs whenever something is unfinished: no livelock
        if check_every_step:
            sched.check_invariants()
        assert out.num_batched_tokens <= max_batched
        assert len(sched.running) <= max_num_seqs
        tokens, logprobs = runner.step(out)
        for seq in sched.postprocess(out, tokens, logprobs):
            key = (seq.request_id, seq.sample_index)
            assert key not in results
            results[key] = (seq.output_token_ids, seq.output_logprobs, seq.finish_reason)
        if check_every_step:
            sched.check_invariants()
        step += 1
        assert step < 20000
    assert all(s.status is SequenceStatus.FINISHED and not s.block_table for s in all_seqs)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks  # no leak: every block free, or cached and evictable
    assert prefix_caching or bm.num_cached_blocks == 0
    return results, sched, bm, runner


def check_against_expected(requests, results, eos=()):
    for _, r, prompt, params in requests:
        for i in range(params.n):
            tokens, logprobs, reason = results[(r, i)]
            want, want_reason = expected_outputs(prompt, r, i, params, eos)
            assert (tokens, reason) == (want, want_reason), (r, i)
            assert logprobs == [-t / 7.0 for t in tokens]
            if params.ignore_eos and not params.stop_token_ids:
                assert len(tokens) == params.max_tokens


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [16, 32])
def test_tokens_do_not_depend_on_the_schedule(block_size, prefix_caching):
    requests = make_workload(seed=block_size + prefix_caching)
    tight = tight_num_blocks(requests, block_size)
    reference = None
    preemptions = 0
    for max_num_seqs, max_batched in ((1, 5), (3, 16), (64, 64)):
        for num_blocks in (400, tight):
            results, sched, bm, _ = run_workload(
                requests, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                max_batched=max_batched, prefix_caching=prefix_caching)
            check_against_expected(requests, results)
            reference = reference or results
            assert results == reference
            if num_blocks == tight and max_num_seqs > 1:
                preemptions += sched.num_preemptions
            if prefix_caching and num_blocks == 400:
                assert bm.num_cache_hit_tokens > 0
    assert preemptions > 0


def test_eos_and_stop_tokens_finish_early():
    requests = make_workload(seed=7, ignore_eos=False)
    eos = tuple(range(0, VOCAB, 37))  # about 3% of tokens
    results, *_ = run_workload(requests, block_size=16, num_blocks=12, max_num_seqs=4, max_batched=32,
                               prefix_caching=True, eos=eos)
    check_against_expected(requests, results, eos)
    assert any(reason == "stop" for _, _, reason in results.values())
    assert any(reason == "length" for _, _, reason in results.values())


# ---- targeted cases


def step(sched, runner):
    out = sched.schedule()
    tokens, logprobs = runner.step(out)
    finished = sched.postprocess(out, tokens, logprobs)
    sched.check_invariants()
    return out, finished


@pytest.mark.parametrize("prompt_len, copies", [(40, 3), (32, 0)])
def test_samples_of_a_request_share_the_prompt_blocks(prompt_len, copies):
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    runner = FakeRunner(16)
    seqs = sched.add_request(5, list(range(prompt_len)), SamplingParams(n=4, max_tokens=8, ignore_eos=True))
    out, _ = step(sched, runner)
    assert [(e.seq, e.num_new_tokens, e.needs_sample) for e in out.scheduled] == [(seqs[0], prompt_len, True)]
    assert out.samples == seqs  # sample 0's last row gives the first token of all four
    assert bm.num_used_blocks == -(-prompt_len // 16)  # prefilled once, shared four times
    assert all(s.block_table == seqs[0].block_table for s in seqs) and len(sched.running) == 4
    out, _ = step(sched, runner)
    assert all(e.is_decode for e in out.scheduled) and len(out.scheduled) == 4
    assert len(out.copies) == copies and all(c.num_slots == prompt_len % 16 for c in out.copies)
    assert bm.num_used_blocks == -(-prompt_len // 16) + (3 if copies else 4)
    while sched.has_unfinished():
        step(sched, runner)
    assert len({tuple(s.output_token_ids) for s in seqs}) == 4 and all(s.num_output_tokens == 8 for s in seqs)


def test_samples_beyond_max_num_seqs_run_on_their_own():
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128)
    runner = FakeRunner(16)
    params = SamplingParams(n=4, max_tokens=3, ignore_eos=True)
    seqs = sched.add_request(1, list(range(20)), params)
    out, _ = step(sched, runner)
    assert out.samples == seqs[:2] and sched.running == seqs[:2] and sched.waiting == seqs[2:]
    while sched.has_unfinished():
        step(sched, runner)
    for s in seqs:
        assert (s.output_token_ids, s.finish_reason) == expected_outputs(s.prompt_token_ids, 1, s.sample_index, params)


def test_chunked_prefill_splits_a_long_prompt():
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=256)
    runner = FakeRunner(16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    long = sched.add_request(0, list(range(100)), params)[0]
    chunks = []
    while long.num_output_tokens == 0:
        out, _ = step(sched, runner)
        chunks.append([(e.start, e.num_new_tokens, e.needs_sample) for e in out.scheduled if e.seq is long])
    assert chunks == [[(s, min(24, 100 - s), s + 24 >= 100)] for s in range(0, 100, 24)]
    short = sched.add_request(1, [7, 8, 9], params)[0]
    out, _ = step(sched, runner)  # decode first, then the newcomer's prefill in the remaining budget
    assert [(e.seq, e.num_new_tokens) for e in out.scheduled] == [(long, 1), (short, 3)]


def test_preemption_recomputes_and_keeps_generated_tokens():
    bs = 4
    bm = BlockManager(6, bs)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    runner = FakeRunner(bs)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = sched.add_request(0, [1, 2, 3], params)[0]
    b = sched.add_request(1, [4, 5, 6], params)[0]
    seen_preempted = False
    while sched.has_unfinished():
        before = (list(b.output_token_ids), b.status)
        out, _ = step(sched, runner)
        if b in out.preempted:
            seen_preempted = True
            assert b.status is SequenceStatus.WAITING and b.output_token_ids == before[0]
            assert b.block_table == [] and b.num_computed_tokens == 0 and sched.waiting[0] is b
            assert a in [e.seq for e in out.scheduled]  # the older one keeps decoding
    assert seen_preempted and b.num_preemptions >= 1 and a.num_preemptions == 0
    for s in (a, b):
        assert (s.output_token_ids, s.finish_reason) == expected_outputs(s.prompt_token_ids, s.request_id, 0, params)
    assert bm.num_free_blocks == 6


def test_prefix_cache_across_requests():
    bm = BlockManager(32, 16, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    runner = FakeRunner(16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(50))
    first = sched.add_request(0, prompt, params)[0]
    step(sched, runner)
    second = sched.add_request(1, prompt + [99], params)[0]
    out, _ = step(sched, runner)
    entry = next(e for e in out.scheduled if e.seq is second)
    assert second.num_cached_tokens == 48 and (entry.start, entry.num_new_tokens) == (48, 3)
    assert second.block_table[:3] == first.block_table[:3]
    while sched.has_unfinished():
        step(sched, runner)
    assert bm.num_cached_blocks > 0 and bm.num_free_blocks == 32


def test_stop_conditions():
    scripted = iter([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])

    def run(params, eos=(), stop_checker=None):
        bm = BlockManager(16, 4)
        sched = Scheduler(bm, 4, 16, 64, eos_token_ids=eos, stop_checker=stop_checker)
        seq = sched.add_request(0, [1, 2], params)[0]
        while sched.has_unfinished():
            out = sched.schedule()
            sched.postprocess(out, [next(scripted) for _ in out.samples], [0.0] * len(out.samples))
        assert bm.num_free_blocks == 16
        return seq.output_token_ids, seq.finish_reason

    assert run(SamplingParams(max_tokens=3)) == ([5, 6, 7], "length")
    assert run(SamplingParams(max_tokens=9), eos=(9,)) == ([8, 9], "stop")  # the stop token is kept
    assert run(SamplingParams(max_tokens=3, ignore_eos=True), eos=(10,)) == ([10, 11, 12], "length")
    assert run(SamplingParams(max_tokens=9, ignore_eos=True, stop_token_ids=[13]), eos=(13,)) == ([13], "stop")
    assert run(SamplingParams(max_tokens=9), stop_checker=lambda s: s.last_token == 15) == ([14, 15], "stop")


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -1),
    ("top_p", 0.0), ("top_p", 1.5), ("min_p", -0.5), ("min_p", 2), ("max_tokens", 0), ("stop_token_ids", 5),
    ("stop_token_ids", [-1]), ("stop", [""]), ("stop", [3]), ("ignore_eos", 1), ("seed", -1), ("seed", 1 << 64),
    ("logprobs", -1), ("n", True)])
def test_sampling_params_validation(field, value):
    with pytest.raises(InputError, match=f"SamplingParams: {field} "):
        SamplingParams(**{field: value})


def test_sampling_params_normalises():
    p = SamplingParams(stop="###", stop_token_ids=[3, 4], temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (3, 4) and p.greedy and isinstance(p.temperature, float)


def test_add_refuses_what_can_never_run():
    bm = BlockManager(4, 16)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    with pytest.raises(InputError, match="max_model_len"):
        sched.add_request(0, list(range(90)), SamplingParams(max_tokens=11))
    with pytest.raises(InputError, match="KV blocks"):
        sched.add_request(1, list(range(60)), SamplingParams(max_tokens=10))
    sched.add_request(2, list(range(60)), SamplingParams(max_tokens=5))  # 64 tokens with K/V: exactly 4 blocks
    with pytest.raises(InputError, match="empty prompt"):
        sched.add_request(3, [], SamplingParams())
    with pytest.raises(InputError, match="share"):
        sched.add([Sequence(4, [1], SamplingParams(n=2)), Sequence(4, [2], SamplingParams(n=2), sample_index=1)])
    with pytest.raises(InputError, match="max_num_batched_tokens"):
        Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=4, max_model_len=100)
