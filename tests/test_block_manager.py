"""Block manager: reference counts, fork + copy-on-write, prefix caching, invariants (CPU, no model)."""

import random

import pytest

from rlportable.engine.block_manager import BlockCopy, BlockManager, InvariantError, OutOfBlocks
from rlportable.engine.sequence import SamplingParams, Sequence
from rlportable.errors import InputError



def _decode_slot(bm, seq):
    """allocate(seq, 1) for a decode token: (the slot of position num_computed_tokens, its copy or None)."""
    copies = bm.allocate(seq, 1)
    return seq.slot(seq.num_computed_tokens, bm.block_size), (copies[0] if copies else None)

def make_seq(tokens, request=0, sample=0, n=1):
    return Sequence(request, tokens, SamplingParams(n=n, max_tokens=64), sample_index=sample)


def compute(bm, seq, num_new):
    """allocate + (pretend the step ran) mark_computed; returns the copies."""
    copies = bm.allocate(seq, num_new)
    bm.mark_computed(seq, num_new)
    return copies


def test_constructor_checks():
    with pytest.raises(InputError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(InputError, match="block_size"):
        BlockManager(4, 0)


def test_allocate_and_free_counts():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    assert bm.num_blocks_needed(seq, 10) == 3 and bm.can_allocate(seq, 10)
    assert compute(bm, seq, 6) == []
    assert len(seq.block_table) == 2 and seq.num_computed_tokens == 6
    assert bm.num_blocks_needed(seq, 4) == 1  # positions 6..9: the rest of block 1 and one more block
    compute(bm, seq, 4)
    assert bm.num_free_blocks == 5 and bm.num_used_blocks == 3
    assert seq.slots(0, 10, 4) == [seq.block_table[j // 4] * 4 + j % 4 for j in range(10)]
    bm.check_invariants([seq])
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and seq.num_computed_tokens == 0
    bm.check_invariants([])


def test_out_of_blocks():
    bm = BlockManager(2, 4)
    seq = make_seq(list(range(12)))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(OutOfBlocks):
        bm.allocate(seq, 12)
    bm.check_invariants([])  # nothing taken on failure
    compute(bm, seq, 8)
    assert not bm.can_allocate(seq, 1) and bm.max_new_tokens(seq) == 0
    with pytest.raises(InputError):
        bm.allocate(seq, 5)  # more than the known tokens


def fork_group(bm, prompt, n, bs):
    parent = make_seq(prompt, n=n)
    compute(bm, parent, len(prompt))
    children = [make_seq(prompt, sample=i, n=n) for i in range(1, n)]
    for child in children:
        bm.fork(parent, child)
    group = [parent] + children
    for i, s in enumerate(group):
        s.append_token(1000 + i)  # each sample draws its own first token
    return group


def test_fork_shares_prompt_blocks_and_copies_the_partial_one():
    bs = 4
    bm = BlockManager(16, bs)
    group = fork_group(bm, list(range(10)), 4, bs)
    assert bm.num_used_blocks == 3  # the prompt's blocks, once for the 4 samples
    assert all(s.block_table == group[0].block_table and s.num_computed_tokens == 10 for s in group)
    assert [bm.ref_count(b) for b in group[0].block_table] == [4, 4, 4]
    bm.check_invariants(group)
    shared = group[0].block_table[2]
    results = [_decode_slot(bm, s) for s in group]
    for s, (slot, copy) in zip(group[:3], results[:3]):
        assert copy == BlockCopy(shared, s.block_table[2], 2)  # positions 8, 9 are valid
        assert slot == s.block_table[2] * bs + 2
    slot, copy = results[3]
    assert copy is None and group[3].block_table[2] == shared and slot == shared * bs + 2  # last sharer: in place
    assert bm.num_used_blocks == 6
    assert [bm.ref_count(b) for b in group[0].block_table[:2]] == [4, 4]
    for s in group:
        bm.mark_computed(s, 1)
    bm.check_invariants(group)
    for s in group:
        bm.free(s)
    assert bm.num_free_blocks == 16
    bm.check_invariants([])


def test_fork_with_a_full_last_block_copies_nothing():
    bm = BlockManager(16, 4)
    group = fork_group(bm, list(range(8)), 3, 4)
    assert bm.num_used_blocks == 2
    for s in group:
        slot, copy = _decode_slot(bm, s)
        assert copy is None and slot == s.block_table[2] * 4
    assert bm.num_used_blocks == 5


def test_fork_refuses_mismatched_tokens():
    bm = BlockManager(8, 4)
    parent = make_seq([1, 2, 3, 4, 5], n=2)
    compute(bm, parent, 5)
    with pytest.raises(InputError, match="does not start"):
        bm.fork(parent, make_seq([1, 2, 3, 9, 5], sample=1, n=2))
    bm.check_invariants([parent])


def test_prefix_cache_reuses_full_blocks():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_seq(list(range(10)), request=0)
    compute(bm, a, 10)
    assert bm.num_cached_blocks == 0
    b = make_seq(list(range(8)) + [77, 78, 79], request=1)
    assert bm.cached_prefix_length(b) == 8  # in use by a: shared at once
    compute(bm, b, 3)
    assert b.num_computed_tokens == 11 and b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert bm.num_used_blocks == 4
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # two full blocks stay cached (block 2: a's partial)
    c = make_seq(list(range(10)), request=2)
    assert bm.cached_prefix_length(c) == 8
    assert bm.num_blocks_needed(c, 2) == 3  # two evictable hits leave the pool, plus one fresh block
    compute(bm, c, 2)
    assert bm.num_cached_blocks == 0 and bm.num_used_blocks == 3
    bm.check_invariants([c])


def test_prefix_cache_leaves_the_last_token_to_compute():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    b = make_seq(list(range(8)), request=1)
    assert bm.cached_prefix_length(b) == 4  # not 8: the model must compute token 7 for the logits
    compute(bm, b, 4)
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 8
    bm.check_invariants([b])


def test_prefix_cache_evicts_least_recently_freed_tail_first():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5, 6, 7])  # blocks [1,2] [3,4] [5,6] [7]: three full
    compute(bm, a, 7)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 4
    b = make_seq([9, 9, 9, 9, 9], request=1)  # 3 fresh blocks: the plain free one, then evictions
    compute(bm, b, 5)
    assert bm.num_evictions == 2
    assert b.block_table == [table[3], table[2], table[1]]  # a's tail went first
    c = make_seq([1, 2, 3, 4, 5, 6, 7], request=2)
    assert bm.cached_prefix_length(c) == 2  # only a's head block survived
    bm.check_invariants([b])


def test_check_invariants_catches_corruption():
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3])
    compute(bm, a, 3)
    bm.check_invariants([a])
    with pytest.raises(InvariantError, match="tracked"):
        bm.check_invariants([])
    bm._refs[a.block_table[0]] += 1
    with pytest.raises(InvariantError, match="reference counts"):
        bm.check_invariants([a])
    bm._refs[a.block_table[0]] -= 1
    b = make_seq([1, 9, 3], request=1)
    b.block_table = [a.block_table[0]]  # wrong sharing: different tokens in a computed slot
    b.num_computed_tokens = 2
    bm._refs[a.block_table[0]] += 1
    bm._seqs[b.seq_id] = b
    with pytest.raises(InvariantError, match="different tokens"):
        bm.check_invariants()


# ---- random operations against a fake KV store


class FakeKV:
    """slot -> the content it holds. The K/V of position j depends on tokens 0..j, so the
    content a sequence needs at position j is a hash chain of its tokens up to j."""

    def __init__(self, block_size):
        self.bs = block_size
        self.store = {}
        self.chains = {}  # seq_id -> prefix hashes

    def expected(self, seq, j):
        chain = self.chains.setdefault(seq.seq_id, [])
        tokens = seq.token_ids(len(chain), j + 1)
        for t in tokens:
            chain.append(hash((chain[-1] if chain else 0, t)))
        return chain[j]

    def apply(self, copies):
        # one gather of every source, then one scatter: what cache[dst] = cache[src] does
        pairs = [p for c in copies for p in zip(*c.slot_pairs(self.bs))]
        values = [self.store.get(src) for src, _ in pairs]
        for (_, dst), value in zip(pairs, values):
            self.store[dst] = value

    def write(self, seq, start, stop):
        for j in range(start, stop):
            self.store[seq.slot(j, self.bs)] = self.expected(seq, j)

    def verify(self, seq):
        for j in range(seq.num_computed_tokens):
            assert self.store.get(seq.slot(j, self.bs)) == self.expected(seq, j), (seq, j)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_random_operations_keep_kv_right(prefix_caching, block_size):
    rng = random.Random(block_size * 2 + prefix_caching)
    num_blocks = max(10, 30 // block_size)  # tight enough that allocations fail at times
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    kv = FakeKV(block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live = []
    next_request = 0
    total_hits = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.15 and len(live) < 10:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
            live.append(make_seq(prompt or [1], request=next_request, n=4))
            next_request += 1
        elif op < 0.75 and live:
            seq = rng.choice(live)
            if seq.num_uncomputed_tokens == 0:  # all known tokens computed: sample (and maybe fork first)
                if not seq.num_output_tokens and seq.sample_index == 0 and rng.random() < 0.5:
                    for i in range(1, rng.randrange(2, 5)):
                        child = make_seq(seq.prompt_token_ids, request=seq.request_id, sample=i, n=4)
                        bm.fork(seq, child)
                        child.append_token(rng.randrange(50))
                        live.append(child)
                seq.append_token(rng.randrange(50))
                continue
            hit = bm.cached_prefix_length(seq)
            num_new = rng.randrange(1, seq.num_tokens - max(hit, seq.num_computed_tokens) + 1)
            if not bm.can_allocate(seq, num_new):
                with pytest.raises(OutOfBlocks):
                    bm.allocate(seq, num_new)
                continue
            before = bm.num_free_blocks
            need = bm.num_blocks_needed(seq, num_new)
            copies = bm.allocate(seq, num_new)
            assert bm.num_free_blocks == before - need
            assert seq.num_computed_tokens >= hit
            total_hits += seq.num_cached_tokens if hit else 0
            kv.apply(copies)
            kv.verify(seq)  # the copied / cached prefix holds the right contents
            kv.write(seq, seq.num_computed_tokens, seq.num_computed_tokens + num_new)
            bm.mark_computed(seq, num_new)
        elif live:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants(s for s in live if s.block_table)
        for seq in live:
            kv.verify(seq)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks
    assert bm.num_cached_blocks == 0 or prefix_caching
    assert (total_hits > 0) == prefix_caching
