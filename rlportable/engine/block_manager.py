"""The paged KV cache's block manager: reference-counted blocks, sharing, copy-on-write, prefix caching.

The cache has `num_blocks` blocks of `block_size` slots; block b holds slots
b * block_size .. (b + 1) * block_size - 1. A sequence's `block_table` lists its blocks in
position order. A block is referenced by every sequence whose table lists it; its reference
count is that number. Blocks with count 0 are in the pool: either plain free, or (prefix
caching) "cached": full blocks whose K/V and hash are kept so a later prompt can reuse them,
evicted least recently freed first when a fresh block is needed.

Sharing happens two ways:
  fork(parent, child)  the child (another sample of the same prompt) takes the parent's whole
                       table, full blocks and the last partial block alike;
  prefix caching       a sequence without blocks takes cached full blocks whose hash chain
                       matches the start of its tokens, and skips computing them.
Only positions >= num_computed_tokens are ever written, so full computed blocks are never
written again. The one block that can be written while shared is a partial last block after
a fork: the first sharer to write into it gets a fresh copy (copy-on-write). The manager
returns a BlockCopy(src, dst, num_slots): the runner copies slots src*bs + i to dst*bs + i
for i < num_slots (the positions already computed), in every layer's K and V, before it
writes the step's K/V.

The runner applies a step's copies as one gather of every source and one scatter to every
destination, before the forward pass. It refuses a step whose copies chain (a block the
destination of one copy and the source of another: ops/residual.check_copy_pairs) with an
error rather than guess an order; no scheduler workload has been seen to produce one.

Block hashes (prefix caching) form a chain: hash_i = sha256(hash_{i-1} || token ids of block
i as little-endian int64), hash_{-1} = b"". A block gets its hash once all its slots are
computed (mark_computed, after the step that wrote them), so a cached block's K/V is always
complete. The last block of a sequence's known tokens is never taken from the cache when
that would leave no token to compute: the model must compute the last token to produce the
logits of the next one.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from rlportable.engine.sequence import Sequence
from rlportable.errors import InputError, RlpError


class OutOfBlocks(RlpError):
    """allocate was called without enough free blocks (check can_allocate first)."""


class InvariantError(RlpError):
    """check_invariants found the block bookkeeping inconsistent (a bug, never a user error)."""


@dataclass(frozen=True)
class BlockCopy:
    """Copy the first `num_slots` slots of block `src` into block `dst` (all layers, K and V)."""

    src: int
    dst: int
    num_slots: int

    def slot_pairs(self, block_size: int) -> tuple[list[int], list[int]]:
        """(source slots, destination slots)."""
        return ([self.src * block_size + i for i in range(self.num_slots)],
                [self.dst * block_size + i for i in range(self.num_slots)])


def _hash_block(previous: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(previous + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class BlockManager:
    """Reference-counted KV blocks with fork/copy-on-write sharing and optional prefix caching.

    Sequences are tracked by identity from their first allocate/fork until free.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"BlockManager: {name} must be an integer >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # count 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # count 0, hashed; least recently freed first
        self._cached: dict[bytes, int] = {}  # hash -> block (blocks in use or evictable)
        self._seqs: dict[int, Sequence] = {}  # seq_id -> sequence holding blocks
        self.num_cache_hit_tokens = 0  # statistics: tokens taken from the prefix cache
        self.num_evictions = 0

    # ---- pool

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: plain free plus cached-evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Evictable blocks kept for the prefix cache (count 0, hashed)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def _take_fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._cached[self._hash[block]]
            self._hash[block] = None
            self.num_evictions += 1
        else:
            raise OutOfBlocks("BlockManager: no free block (the caller must check can_allocate first)")
        self._refs[block] = 1
        return block

    def _acquire(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._hash[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ---- prefix caching

    def _block_hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """The hash chain of seq's first `count` full blocks of known tokens (memoized on seq)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < count:
            i = len(hashes)
            hashes.append(_hash_block(hashes[-1] if hashes else b"", seq.token_ids(i * bs, (i + 1) * bs)))
        return hashes[:count]

    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of a block-less sequence (leaving >= 1 token to compute)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for h in self._block_hashes(seq, limit):
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_prefix_length(self, seq: Sequence) -> int:
        """Tokens a block-less sequence would take from the prefix cache (a multiple of block_size,
        < seq.num_tokens; 0 without prefix caching or when seq already holds blocks). Changes nothing."""
        return len(self._match(seq)) * self.block_size

    # ---- allocation

    def _plan(self, seq: Sequence, num_new_tokens: int) -> tuple[list[int], int, int]:
        """(prefix-cache hits, fresh blocks needed, pool blocks consumed) to compute num_new_tokens more."""
        if num_new_tokens < 0:
            raise InputError(f"BlockManager: num_new_tokens must be >= 0, got {num_new_tokens}")
        bs = self.block_size
        hits = self._match(seq)
        if hits:
            start, table_len, cow = len(hits) * bs, len(hits), 0
            reused = sum(1 for b in hits if self._refs[b] == 0)  # evictable hits leave the pool
        else:
            start, table_len, reused = seq.num_computed_tokens, len(seq.block_table), 0
            cow = int(num_new_tokens > 0 and start % bs != 0 and self._refs[seq.block_table[start // bs]] > 1)
        end = start + num_new_tokens
        if end > seq.num_tokens:
            raise InputError(f"BlockManager: {seq!r} has {seq.num_tokens} known tokens; cannot compute "
                             f"{num_new_tokens} from position {start}")
        fresh = max(0, -(-end // bs) - table_len) + cow
        return hits, fresh, fresh + reused

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pool blocks that allocate(seq, num_new_tokens) would take (fresh, copy-on-write, and
        evictable prefix-cache hits)."""
        return self._plan(seq, num_new_tokens)[2]

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether allocate(seq, num_new_tokens) would succeed now."""
        return self._plan(seq, num_new_tokens)[2] <= self.num_free_blocks

    def max_new_tokens(self, seq: Sequence) -> int:
        """The most tokens a sequence that holds blocks can compute next with the free blocks now."""
        bs = self.block_size
        start, table = seq.num_computed_tokens, seq.block_table
        room = len(table) * bs - start
        cow = int(start % bs != 0 and self._refs[table[start // bs]] > 1)
        if cow and not self.num_free_blocks:
            return 0
        return min(seq.num_uncomputed_tokens, room + (self.num_free_blocks - cow) * bs)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Give seq writable blocks for positions [num_computed_tokens, num_computed_tokens + num_new_tokens).

        A sequence without blocks first takes its matching prefix-cache blocks (prefix caching
        on): its num_computed_tokens and num_cached_tokens become the tokens they hold, and the
        new tokens start after them (use cached_prefix_length to size num_new_tokens). Returns
        the copy-on-write copies to apply before writing (at most one). Raises OutOfBlocks if
        can_allocate is False.
        """
        copies = self.try_allocate(seq, num_new_tokens)
        if copies is None:
            raise OutOfBlocks(f"BlockManager: {seq!r} needs {self.num_blocks_needed(seq, num_new_tokens)} blocks "
                              f"for {num_new_tokens} tokens, {self.num_free_blocks} are free")
        return copies

    def try_allocate(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy] | None:
        """allocate(seq, num_new_tokens) if the free blocks allow it, else None (nothing changed)."""
        if num_new_tokens == 1 and self._next_slot_is_writable(seq):
            self._seqs[seq.seq_id] = seq
            return []  # most decode tokens: the general plan below would take nothing either
        hits, _, consumed = self._plan(seq, num_new_tokens)
        if consumed > len(self._free) + len(self._evictable):
            return None
        bs, table = self.block_size, seq.block_table
        if not table:
            if seq.num_computed_tokens:
                raise InputError(f"BlockManager: {seq!r} has computed tokens but no blocks")
            seq.num_cached_tokens = 0
        if hits:
            for block in hits:
                self._acquire(block)
            table.extend(hits)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * bs
            self.num_cache_hit_tokens += len(hits) * bs
        self._seqs[seq.seq_id] = seq
        copies = []
        start = seq.num_computed_tokens
        if num_new_tokens and start % bs:
            j = start // bs
            shared = table[j]
            if self._refs[shared] > 1:
                fresh_block = self._take_fresh()
                copies.append(BlockCopy(shared, fresh_block, start % bs))
                self._release(shared)
                table[j] = fresh_block
        end = start + num_new_tokens
        while len(table) * bs < end:
            table.append(self._take_fresh())
        return copies

    def _next_slot_is_writable(self, seq: Sequence) -> bool:
        """Whether seq can compute one more token in place: the position num_computed_tokens (a
        known token) lies in a block of seq's table that needs no copy-on-write (seq holds it
        alone, or the position starts the block). Exactly the case where _plan(seq, 1) finds no
        prefix-cache hit (seq holds blocks), no fresh block and no copy; a quick test for the
        decode steps, which call try_allocate(seq, 1) for every running sequence."""
        table, start, bs = seq.block_table, seq.num_computed_tokens, self.block_size
        j = start // bs
        return j < len(table) and start < seq.num_tokens and (start % bs == 0 or self._refs[table[j]] == 1)

    # ---- asynchronous scheduling: a decode step planned while the one before it still runs

    def blocks_needed_ahead(self, seq: Sequence) -> int:
        """Fresh blocks (0 or 1) that allocate_ahead(seq) takes: a slot for position num_tokens, the
        token that seq's step in flight is drawing now (it computes num_computed_tokens = num_tokens - 1).

        That slot lies in the block the step in flight writes, which seq holds alone (the step's own
        allocation made it writable, and nothing forks or shares a partial block while only decode
        steps run), or it starts a new block. Anything else is a bookkeeping bug."""
        table, position, bs = seq.block_table, seq.num_tokens, self.block_size
        if seq.num_computed_tokens != position - 1 or seq.seq_id not in self._seqs:
            raise InvariantError(f"BlockManager: {seq!r} has no decode step in flight to plan ahead of")
        j, offset = divmod(position, bs)
        if offset and j == len(table) - 1 and self._refs[table[j]] == 1:
            return 0  # most steps: the block being written
        if not offset and j == len(table):
            return 1
        raise InvariantError(f"BlockManager: {seq!r} cannot write position {position} ahead (table {table})")

    def allocate_ahead(self, seq: Sequence) -> None:
        """Give seq a writable slot for position num_tokens before the token there is known (see
        blocks_needed_ahead; check the free blocks first). Nothing is hashed until mark_computed, which
        comes after the token is known and the step that writes the slot has been recorded."""
        if self.blocks_needed_ahead(seq):
            seq.block_table.append(self._take_fresh())

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let child (another sample of parent's prompt, holding no blocks) share all of parent's blocks.

        child's known tokens must start with parent's computed ones; child.num_computed_tokens
        becomes parent's. The shared partial last block is copied on the first write into it.
        """
        if child.block_table or child.num_computed_tokens:
            raise InputError(f"BlockManager.fork: the child {child!r} already holds blocks")
        if parent.seq_id not in self._seqs:
            raise InputError(f"BlockManager.fork: the parent {parent!r} holds no blocks")
        computed = parent.num_computed_tokens
        if child.num_tokens < computed or child.token_ids(0, computed) != parent.token_ids(0, computed):
            raise InputError(f"BlockManager.fork: {child!r} does not start with the {computed} computed tokens "
                             f"of {parent!r}")
        for block in parent.block_table:
            self._acquire(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = computed
        child.num_cached_tokens = 0
        full = computed // self.block_size
        if len(parent.block_hashes) >= full and not child.block_hashes:
            child.block_hashes = parent.block_hashes[:full]
        self._seqs[child.seq_id] = child

    def mark_computed(self, seq: Sequence, num_new_tokens: int) -> None:
        """After a step wrote K/V of num_new_tokens more positions of seq: advance its
        num_computed_tokens and (prefix caching) publish the hashes of the blocks it filled."""
        bs = self.block_size
        before = seq.num_computed_tokens
        after = before + num_new_tokens
        if num_new_tokens < 0 or after > len(seq.block_table) * bs or after > seq.num_tokens:
            raise InputError(f"BlockManager.mark_computed: {seq!r} cannot have {num_new_tokens} more tokens computed")
        seq.num_computed_tokens = after
        if not self.enable_prefix_caching:
            return
        first, last = before // bs, after // bs
        if last <= first:
            return
        hashes = self._block_hashes(seq, last)
        for i in range(first, last):
            block = seq.block_table[i]
            if self._hash[block] is None and hashes[i] not in self._cached:
                self._hash[block] = hashes[i]
                self._cached[hashes[i]] = block

    def free(self, seq: Sequence) -> None:
        """Release all of seq's blocks (last block first, so a cached sequence's tail is evicted
        before its head) and forget it; its num_computed_tokens becomes 0."""
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._seqs.pop(seq.seq_id, None)

    # ---- checks

    def check_invariants(self, sequences: Iterable[Sequence] | None = None) -> None:
        """Raise InvariantError unless the bookkeeping is consistent.

        Reference counts equal the number of tracked sequences listing each block; a block is in
        the pool exactly when its count is 0 (evictable iff it has a hash); no table lists a
        block twice or too few blocks for its computed tokens; every hash maps to its block and
        matches the hash chain of every sequence that holds it; sequences sharing a block agree
        on the tokens of its computed slots. `sequences`, if given, must be exactly the
        sequences the manager tracks.
        """
        def fail(message: str):
            raise InvariantError(f"BlockManager invariant: {message}")

        bs = self.block_size
        seqs = list(self._seqs.values())
        if sequences is not None:
            given = {s.seq_id for s in sequences}
            if given != set(self._seqs):
                fail(f"tracked sequences {sorted(self._seqs)} differ from the given {sorted(given)}")
        counts = [0] * self.num_blocks
        holders: dict[int, list[tuple[Sequence, int]]] = {}
        for seq in seqs:
            table = seq.block_table
            if len(set(table)) != len(table):
                fail(f"{seq!r} lists a block twice")
            if not table:
                fail(f"{seq!r} is tracked but holds no blocks")
            if seq.num_computed_tokens > len(table) * bs or seq.num_computed_tokens > seq.num_tokens:
                fail(f"{seq!r} has more computed tokens than blocks or tokens")
            for i, block in enumerate(table):
                if not 0 <= block < self.num_blocks:
                    fail(f"{seq!r} lists block {block} outside [0, {self.num_blocks})")
                counts[block] += 1
                holders.setdefault(block, []).append((seq, i))
        if counts != self._refs:
            bad = [b for b in range(self.num_blocks) if counts[b] != self._refs[b]]
            fail(f"reference counts differ from the tables for blocks {bad[:10]}")
        free, evictable = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evictable:
            fail("a block is listed twice in the pool")
        for block in range(self.num_blocks):
            in_pool = block in free or block in evictable
            if in_pool != (self._refs[block] == 0):
                fail(f"block {block} has count {self._refs[block]} and is {'' if in_pool else 'not '}in the pool")
            if block in free and self._hash[block] is not None:
                fail(f"free block {block} keeps a hash")
            if block in evictable and self._hash[block] is None:
                fail(f"evictable block {block} has no hash")
        hashed = {b: h for b, h in enumerate(self._hash) if h is not None}
        if len(hashed) != len(self._cached) or any(self._cached.get(h) != b for b, h in hashed.items()):
            fail("the hash table and the blocks' hashes disagree")
        if not self.enable_prefix_caching and hashed:
            fail("hashed blocks without prefix caching")
        for block, users in holders.items():
            first_seq, first_index = users[0]
            if any(i != first_index for _, i in users):
                fail(f"block {block} sits at different table positions in {[s for s, _ in users]}")
            lo = first_index * bs
            hi = min(lo + bs, min(s.num_computed_tokens for s, _ in users))
            if hi > lo:
                reference = first_seq.token_ids(lo, hi)
                for s, _ in users[1:]:
                    if s.token_ids(lo, hi) != reference:
                        fail(f"block {block} is shared by sequences with different tokens: {first_seq!r}, {s!r}")
            if self._hash[block] is not None:
                for s, i in users:
                    if s.num_computed_tokens < (i + 1) * bs:
                        fail(f"hashed block {block} is not fully computed in {s!r}")
                    if self._block_hashes(s, i + 1)[i] != self._hash[block]:
                        fail(f"block {block}'s hash does not match the tokens of {s!r}")
