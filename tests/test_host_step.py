"""The host work of a decode step, made cheaper: each shortcut is checked against the general
path it stands for. The block manager's test for a decode token that needs nothing against its plan,
the runner's block-table rows kept between steps against rows rebuilt from the sequences' lists (after
new blocks, copy-on-write, preemption, frees and reused rows), the uploader's reused device views, and
LLM.generate's running count of output tokens."""

import random

import numpy as np
import pytest

from rlportable.engine.block_manager import BlockManager
from rlportable.engine.llm import LLM
from rlportable.engine.scheduler import ScheduledSequence
from rlportable.engine.sequence import SamplingParams, Sequence
from rlportable.engine.step_inputs import DecodeTables, StepUploader, plan_decode
from rlportable.model.load import load_model
from rlportable.runtime.cpu import CpuBackend


def make_seq(tokens, request=0, sample=0, n=1):
    return Sequence(request, tokens, SamplingParams(n=n, max_tokens=64), sample_index=sample)


def decode_entries(seqs):
    """Decode entries for sequences with exactly one uncomputed token."""
    return [ScheduledSequence(s, s.num_computed_tokens, 1, True, [s]) for s in seqs]


def random_block_traffic(seed: int, block_size: int, prefix_caching: bool):
    """Yield (block manager, the sequences holding blocks) after each of many random operations: whole
    prefills, decode tokens, forks (copy-on-write follows), frees (as preemption or finishing does),
    readmissions of freed sequences and new ones."""
    rng = random.Random(seed)
    bm = BlockManager(40, block_size, enable_prefix_caching=prefix_caching)
    live, freed = [], []
    prompts = [[rng.randrange(20) for _ in range(rng.randrange(1, 3 * block_size))] for _ in range(4)]
    for step in range(400):
        action = rng.random()
        if action < 0.15 and len(live) < 10:  # a new sequence, or a freed one readmitted: prefill
            seq = freed.pop() if freed and rng.random() < 0.5 else make_seq(rng.choice(prompts), request=step)
            seq.num_cached_tokens = 0
            num_new = seq.num_tokens - 1 - bm.cached_prefix_length(seq)
            if num_new > 0 and bm.can_allocate(seq, num_new):
                bm.allocate(seq, num_new)
                bm.mark_computed(seq, num_new)
                live.append(seq)
            elif num_new > 0:
                freed.append(seq)
        elif action < 0.25 and 0 < len(live) < 12:  # a fork: the child shares every block, the partial last one too
            parent = rng.choice(live)
            child = make_seq(parent.token_ids(0, parent.num_tokens), request=10_000 + step)
            bm.fork(parent, child)
            live.append(child)
        elif action < 0.35 and live:  # preempted or finished
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
            freed.append(seq)
        else:  # a decode token for one sequence (copy-on-write if it shares its partial block)
            for seq in rng.sample(live, min(len(live), 3)):
                if bm.can_allocate(seq, 1):
                    bm.allocate(seq, 1)
                    bm.mark_computed(seq, 1)
                    seq.append_token(rng.randrange(20))
        yield bm, list(live)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 4])
def test_the_decode_shortcut_is_exactly_when_the_plan_takes_nothing(prefix_caching, block_size):
    seen = set()  # (in place, copy-on-write) cases met
    for bm, live in random_block_traffic(3, block_size, prefix_caching):
        for seq in live:
            _, fresh, consumed = bm._plan(seq, 1)
            writable = bm._next_slot_is_writable(seq)
            assert writable == (fresh == consumed == 0), seq
            start = seq.num_computed_tokens
            seen.add((writable, start % block_size != 0 and bm.ref_count(seq.block_table[start // block_size]) > 1))
    assert seen == ({(True, False), (False, False), (False, True)} if block_size > 1 else {(False, False)})


@pytest.mark.parametrize("capacity", [1, 3, 64])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_kept_block_table_rows_equal_rows_built_from_the_lists(capacity, prefix_caching):
    block_size, width, bucket = 4, 40, 16  # 40: every block of the cache
    tables = DecodeTables(width, capacity)
    rng = random.Random(5)
    for bm, live in random_block_traffic(7, block_size, prefix_caching):
        ready = [s for s in live if s.num_computed_tokens < len(s.block_table) * block_size]  # slot allocated
        seqs = rng.sample(ready, len(ready))  # any order: rows follow the step's entries
        entries = decode_entries(seqs)
        kept = plan_decode(entries, bucket, width, block_size, tables)
        fresh = plan_decode(entries, bucket, width, block_size)
        for name in ("tokens", "positions", "q_seq", "slots", "block_tables", "sample_rows"):
            assert np.array_equal(getattr(kept, name), getattr(fresh, name)), name
    assert tables.store.shape[0] >= capacity  # grown when a step had more sequences than rows


def test_block_table_rows_are_written_only_when_a_table_changes():
    bm, block_size = BlockManager(64, 4), 4
    seqs = [make_seq(list(range(length)), request=i) for i, length in enumerate((6, 7, 8, 10, 11, 7))]
    for seq in seqs:  # computed up to the last token, which lies inside an allocated block
        bm.allocate(seq, seq.num_tokens - 1)
        bm.mark_computed(seq, seq.num_tokens - 1)
    tables = DecodeTables(8, 4)  # fewer rows than sequences: the store grows once

    def step(order):
        before = tables.rows_written
        plan = plan_decode(decode_entries(order), 8, 8, block_size, tables)
        assert np.array_equal(plan.block_tables, plan_decode(decode_entries(order), 8, 8, block_size).block_tables)
        return tables.rows_written - before

    def decode(seq):
        bm.allocate(seq, 1)
        bm.mark_computed(seq, 1)
        seq.append_token(1)

    assert step(seqs) == 6
    assert step(seqs) == 0 and step(seqs[::-1]) == 0  # same tables, any rows
    decode(seqs[0])  # a token inside its block: the table is unchanged
    assert step(seqs) == 0
    decode(seqs[2])  # position 7, the end of its block; then position 8 takes a new block
    bm.allocate(seqs[2], 1)
    assert step(seqs) == 1
    child = make_seq(seqs[1].token_ids(0, seqs[1].num_tokens), request=99)
    bm.fork(seqs[1], child)
    assert step(seqs + [child]) == 1  # the child's first row
    table = child.block_table
    assert bm.allocate(child, 1) and child.block_table is table  # copy-on-write: a block replaced in the list
    assert step(seqs + [child]) == 1
    bm.free(seqs[3])  # preempted, readmitted with other blocks
    bm.allocate(seqs[3], seqs[3].num_tokens - 1)
    assert step(seqs + [child]) == 1


def test_uploader_reuses_its_views_while_the_layout_holds():
    uploader = StepUploader(CpuBackend(), {"a": ((8,), np.int32)})
    arrays = {"a": np.arange(4, dtype=np.int32)}, {"x": np.ones(3, np.float32)}
    first = uploader.upload(*arrays)
    second = uploader.upload({"a": np.arange(4, 8, dtype=np.int32)}, {"x": np.full(3, 2, np.float32)})
    assert all(first[name] is second[name] for name in first)  # the same device views ...
    assert second["a"].tolist() == [4, 5, 6, 7] and second["x"].tolist() == [2, 2, 2]  # ... of the new bytes
    second["extra"] = None  # callers may add entries: the reused dictionary is a copy
    assert "extra" not in uploader.upload(*arrays)
    other = uploader.upload({"a": np.arange(5, dtype=np.int32)}, {"x": np.ones(3, np.float32)})
    assert other["a"] is not first["a"] and other["a"].shape == (5,)  # another layout: new views
    buffer = uploader.buffer
    uploader.reserve(buffer.shape[0] + 1)  # a new buffer: new views
    assert uploader.buffer is not buffer and uploader.upload(*arrays)["a"] is not first["a"]


def test_generate_reports_the_output_tokens_so_far():
    llm = LLM(device="cpu", loaded=load_model("tiny"), max_num_seqs=4, block_size=4, num_blocks=10)  # preempts
    seen = []
    outputs = llm.generate(["12+34=", "hello world", "7*8"], SamplingParams(n=2, max_tokens=9, seed=1),
                           progress=lambda done, budget: seen.append((done, budget)))
    assert llm.stats.preemptions > 0
    total = sum(len(c.token_ids) for r in outputs for c in r.outputs)
    assert seen[-1] == (total, 3 * 2 * 9) and len(seen) == llm.stats.steps
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_graphs_compare_the_weights_only_after_a_recheck():
    """Every replay compares the upload buffer, RoPE tables and KV caches with the captured ones; the
    weights (most of the arrays) only at the first replay after recheck_model_arrays (LLM.generate)."""
    llm = LLM(device="cpu", loaded=load_model("tiny"), max_num_seqs=4, cuda_graphs=True)
    runner = llm.runner
    runner.uploader.reserve(0)
    runner._graph_arrays, runner._weights_checked = runner._arrays_read_by_graphs(), True
    assert runner._graph_arrays_unchanged()
    layer = llm.model.layers[0]
    llm.model.layers[0] = type(layer)(**{**layer.__dict__, "attn_norm": layer.attn_norm.copy()})
    assert runner._graph_arrays_unchanged()  # not compared between rechecks
    runner.recheck_model_arrays()
    assert not runner._graph_arrays_unchanged()
    runner._graph_arrays, runner._weights_checked = runner._arrays_read_by_graphs(), True
    runner.uploader.reserve(runner.uploader.buffer.shape[0] + 1)  # a new upload buffer: always compared
    assert not runner._graph_arrays_unchanged()
