"""Continuous batching: which sequences compute how many tokens in the next engine step.

One engine step is
    out = scheduler.schedule()
    runner: apply out.copies to the KV cache (every layer, K and V), then run the forward over
            out.scheduled (for each entry: tokens seq.token_ids(start, start + num_new_tokens)
            at positions start.., written to slots seq.slots(start, start + num_new_tokens, bs),
            attending over seq.block_table), take the logits of the last position of every
            entry with needs_sample, and draw one token for each sequence in its sample_seqs
            (all of out.samples, in that order)
    finished = scheduler.postprocess(out, token_ids, logprobs, top_logprobs)

Policy, every step:
  1. Decode: every running sequence with one uncomputed token (its last sampled token) gets
     that token, oldest first. If blocks run out, the most recently arrived running sequences
     not yet scheduled this step are preempted (possibly the one being scheduled): their
     blocks are freed and they go back to the waiting queue, where they are recomputed from
     scratch (prompt and the tokens already generated, which are kept) when readmitted.
  2. Running sequences in the middle of a (chunked) prefill continue, oldest first, with as
     many tokens as the remaining token budget and the free blocks allow; if not even one
     token fits, newer unscheduled sequences are preempted, and if there are none it keeps
     its blocks and waits a step.
  3. If nothing was preempted, waiting sequences are admitted in order (preempted ones,
     being older, first) while the budget, max_num_seqs and the blocks allow, each with a
     chunk of at most the remaining budget (after its prefix-cache hit, if any). A waiting
     sequence that does not fit stops admission (first come, first served).
The n samples of a request: sample 0 is prefilled alone; when the step that computes its
last prompt token runs, the other samples are forked from it (they share every prompt block,
copy-on-write on the partial last one) and draw their first token from the same logits row
(its entry's sample_seqs). Samples that would exceed max_num_seqs at that moment are instead
queued as sequences of their own (they recompute the prompt, or hit the prefix cache).

Tokens never depend on this schedule: a token is a function of (seed, request, sample,
position) and logits that the exact kernels make independent of how the work was cut.

Asynchronous scheduling (LLM(async_scheduling=...)): while a pure decode step runs on the device,
schedule_ahead(out) plans the next one before out's tokens are known, and the runner feeds it
out's tokens on the device; then postprocess(out), then the step after (docs/engine.md,
"Asynchronous scheduling"). At most one step is in flight unrecorded when a step is
planned, so every sequence has num_computed_tokens = num_tokens - 1 then.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from rlportable.engine.block_manager import BlockCopy, BlockManager, InvariantError
from rlportable.engine.sequence import SamplingParams, Sequence, SequenceStatus
from rlportable.errors import InputError

#: stop_checker(seq) -> bool, called after each token is appended to an unfinished sequence;
#: True finishes it with reason "stop" (stop strings: the caller detokenizes and decides).
StopChecker = Callable[[Sequence], bool]


@dataclass(slots=True)  # one per sequence per step: slots make it cheaper to build and read
class ScheduledSequence:
    """One sequence's work in a step: compute its tokens [start, start + num_new_tokens)."""

    seq: Sequence
    start: int  # = seq.num_computed_tokens when scheduled (and when the runner runs); a step planned
    # ahead (Scheduler.schedule_ahead) is scheduled one token early: start = num_computed_tokens + 1 = the
    # position of the token the step before draws, and = num_computed_tokens at its postprocess
    num_new_tokens: int
    needs_sample: bool  # start + num_new_tokens == seq.num_tokens: the last row's logits give tokens
    sample_seqs: list[Sequence] = field(default_factory=list)  # who draws a token from that row (seq first)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One token, the last known one, after all others were computed."""
        return self.num_new_tokens == 1 and self.needs_sample

    def token_ids(self) -> list[int]:
        return self.seq.token_ids(self.start, self.end)

    def positions(self) -> range:
        return range(self.start, self.end)

    def slots(self, block_size: int) -> list[int]:
        return self.seq.slots(self.start, self.end, block_size)


@dataclass
class SchedulerOutput:
    """A step's plan. `scheduled`: decodes first (oldest first), then prefill chunks.

    `follows` is set on a step planned ahead (Scheduler.schedule_ahead): entry i feeds the token
    that the step before it draws for its sample follows[i], which the runner moves on the device
    (the host does not know it when this step is launched)."""

    scheduled: list[ScheduledSequence]
    copies: list[BlockCopy]  # copy-on-write copies to apply before the forward
    preempted: list[Sequence]  # sequences freed this step (now waiting)
    num_batched_tokens: int
    follows: list[int] | None = None

    @functools.cached_property
    def samples(self) -> list[Sequence]:
        """The sequences that get a token this step, in the order postprocess expects them (built at
        the first use: the runner and postprocess both read it; the plan never changes afterwards)."""
        return [s for entry in self.scheduled for s in entry.sample_seqs]

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching over a BlockManager.

    max_num_seqs            running sequences at most (the decode batch)
    max_num_batched_tokens  tokens computed per step at most (>= max_num_seqs, so decodes always fit)
    max_model_len           prompt + max_tokens at most, per request
    eos_token_ids           the model's end tokens (stop unless ignore_eos)
    stop_checker            optional hook for stop strings (see StopChecker)
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: Iterable[int] = (), stop_checker: StopChecker | None = None):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"Scheduler: {name} must be an integer >= 1, got {value!r}")
        if max_num_batched_tokens < max_num_seqs:
            raise InputError(f"Scheduler: max_num_batched_tokens ({max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({max_num_seqs}) so that every running sequence can decode each step")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.stop_checker = stop_checker
        self.waiting: list[Sequence] = []  # by priority (arrival, sample_index)
        self.running: list[Sequence] = []  # by priority
        self._pending: dict[int, list[Sequence]] = {}  # parent seq_id -> samples to fork when its prompt is done
        self._arrivals = 0
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_steps_ahead = 0  # statistics: steps planned by schedule_ahead
        self.num_discarded = 0  # statistics: tokens drawn ahead for sequences already finished (dropped)

    # ---- requests

    def add_request(self, request_id: int, prompt_token_ids, params: SamplingParams | None = None,
                    call_seed: int = 0) -> list[Sequence]:
        """Make and add the params.n sequences of one request; returns them (sample 0 first)."""
        params = SamplingParams() if params is None else params
        seqs = [Sequence(request_id, prompt_token_ids, params, sample_index=i, call_seed=call_seed)
                for i in range(params.n)]
        self.add(seqs)
        return seqs

    def add(self, seqs: Sequence | Seq[Sequence]) -> None:
        """Queue a sequence, or the sequences of one request (same request_id, prompt and params,
        distinct sample indices; the first is prefilled and the others forked from it).

        InputError if prompt + max_tokens exceeds max_model_len, or if one sequence alone would
        need more KV blocks than the cache has.
        """
        group = [seqs] if isinstance(seqs, Sequence) else list(seqs)
        if not group:
            return
        first = group[0]
        for seq in group:
            if not isinstance(seq, Sequence):
                raise InputError(f"Scheduler.add: expected Sequence objects, got {type(seq).__name__}")
            if seq.status is not SequenceStatus.WAITING or seq.num_output_tokens or seq.block_table:
                raise InputError(f"Scheduler.add: {seq!r} is not a new sequence")
            if (seq.request_id != first.request_id or seq.params is not first.params
                    and seq.params != first.params or seq.prompt_token_ids != first.prompt_token_ids):
                raise InputError("Scheduler.add: sequences added together must share request_id, prompt and params")
        if len({s.sample_index for s in group}) != len(group):
            raise InputError(f"Scheduler.add: request {first.request_id} has repeated sample indices")
        total = first.num_prompt_tokens + first.params.max_tokens
        if total > self.max_model_len:
            raise InputError(f"request {first.request_id}: prompt ({first.num_prompt_tokens} tokens) + max_tokens "
                             f"({first.params.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}")
        bm = self.block_manager
        blocks = -(-(total - 1) // bm.block_size)  # the last sampled token never needs K/V
        if blocks > bm.num_blocks:
            raise InputError(f"request {first.request_id}: prompt + max_tokens needs {blocks} KV blocks of "
                             f"{bm.block_size} tokens, the cache has {bm.num_blocks}")
        arrival = self._arrivals
        self._arrivals += 1
        group.sort(key=lambda s: s.sample_index)
        for seq in group:
            seq.arrival = arrival
        if len(group) > 1:
            self._pending[group[0].seq_id] = group[1:]
        self._insert(self.waiting, group[0])

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending)

    # ---- scheduling

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        bisect.insort(queue, seq, key=lambda s: s.priority)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    def _preempt_newest(self, scheduled: set[int], above: Sequence | None = None) -> Sequence | None:
        """Preempt the newest running sequence not scheduled this step; with `above`, only one
        newer than it (None if there is none)."""
        for seq in reversed(self.running):
            if seq is above:
                return None
            if seq.seq_id not in scheduled:
                self._preempt(seq)
                return seq
        raise InvariantError("Scheduler: nothing left to preempt")  # the current sequence is never scheduled

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        scheduled_ids: set[int] = set()
        copies: list[BlockCopy] = []
        preempted: list[Sequence] = []
        forks = 0  # running slots reserved for samples forked at the end of this step

        def plan(seq: Sequence, num_new: int, new_copies: list[BlockCopy]) -> None:
            nonlocal budget, forks
            if new_copies:
                copies.extend(new_copies)
            budget -= num_new
            scheduled_ids.add(seq.seq_id)
            start = seq.num_computed_tokens
            needs_sample = start + num_new == seq.num_tokens
            entry = ScheduledSequence(seq, start, num_new, needs_sample, [seq] if needs_sample else [])
            if needs_sample and self._pending:  # a request's first token: fork its other samples
                pending = self._pending.pop(seq.seq_id, None)
                if pending:
                    room = max(0, self.max_num_seqs - len(self.running) - forks)
                    entry.sample_seqs.extend(pending[:room])
                    forks += min(room, len(pending))
                    for child in pending[room:]:  # no room to fork: they run on their own later
                        self._insert(self.waiting, child)
            scheduled.append(entry)

        # 1. decodes, oldest first
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an older one above
            while (new_copies := bm.try_allocate(seq, 1)) is None:
                victim = self._preempt_newest(scheduled_ids)
                preempted.append(victim)
                if victim is seq:
                    break
            if new_copies is None:
                break  # seq itself was preempted, after every newer one
            plan(seq, 1, new_copies)

        # 2. running prefills (chunked, or recomputation after preemption), oldest first; none when
        # every running sequence decodes (the scheduled ones are running: victims never are)
        for seq in list(self.running) if len(scheduled) < len(self.running) else ():
            if budget <= 0:
                break
            if seq.seq_id in scheduled_ids or seq.status is not SequenceStatus.RUNNING:
                continue
            while bm.max_new_tokens(seq) == 0:
                victim = self._preempt_newest(scheduled_ids, above=seq)
                if victim is None:
                    break
                preempted.append(victim)
            if bm.max_new_tokens(seq) == 0:
                continue  # every newer running sequence is already scheduled: keep its K/V and wait
            num_new = min(seq.num_uncomputed_tokens, budget, bm.max_new_tokens(seq))
            plan(seq, num_new, bm.allocate(seq, num_new))

        # 3. admissions, first come first served
        while not preempted and self.waiting and budget > 0 and len(self.running) + forks < self.max_num_seqs:
            seq = self.waiting[0]
            hit = bm.cached_prefix_length(seq)
            num_new = min(seq.num_tokens - hit, budget)
            new_copies = bm.try_allocate(seq, num_new)
            if new_copies is None:
                break
            self.waiting.pop(0)
            if seq.num_computed_tokens != hit:
                raise InvariantError(f"Scheduler: {seq!r} expected a prefix-cache hit of {hit} tokens")
            seq.status = SequenceStatus.RUNNING
            self._insert(self.running, seq)
            plan(seq, num_new, new_copies)

        self.num_steps += 1
        return SchedulerOutput(scheduled, copies, preempted, self.max_num_batched_tokens - budget)

    # ---- asynchronous scheduling: the next decode step, planned while the current one runs

    def schedule_ahead(self, running_step: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after `running_step`, planned while that step runs (launched, its tokens not
        yet known: call this before postprocess(running_step)), assuming each of its sequences goes on.
        None when that cannot be planned now; then nothing changed (postprocess, then schedule()).

        Planned when running_step is a pure decode step (one token and one sample per entry) of every
        running sequence, no waiting sequence could be admitted in a place that opens (none waits, or
        max_num_seqs run), and the slots fit in the free blocks (this never preempts). Its entries are
        running_step's sequences, in order, less those whose token in flight is their last by length
        (max_tokens, max_model_len: known ahead); each feeds that token at position num_tokens (its
        slot allocated ahead, block_manager.allocate_ahead), drawing the next. A sequence that the token
        in flight stops otherwise (stop token, eos, stop string) is known only at postprocess: its row
        in this step is computed and dropped (postprocess skips finished sequences of such a step).

        Tokens are the same as with schedule(): each is a function of its sequence's own history. The
        schedule differs only in admitting a waiting sequence one step later when a place opens."""
        entries = running_step.scheduled
        if not entries or running_step.follows is None and not all(
                e.num_new_tokens == 1 and e.needs_sample and len(e.sample_seqs) == 1 for e in entries):
            return None  # (a step planned ahead is a pure decode step)
        running = SequenceStatus.RUNNING
        live = [(row, e.seq) for row, e in enumerate(entries) if e.seq.status is running]
        if len(live) != len(self.running) or (self.waiting and len(self.running) < self.max_num_seqs):
            return None  # someone else runs (a prefill to continue) or may be admitted: schedule() decides
        # those the token in flight does not end by length (_stop_reason's last test, one token on)
        max_model_len = self.max_model_len
        going_on = [(row, seq) for row, seq in live if len(seq.output_token_ids) + 1 < seq.params.max_tokens
                    and seq.num_tokens + 1 < max_model_len]
        bm = self.block_manager
        fresh = [bm.blocks_needed_ahead(seq) for _, seq in going_on]
        if not going_on or sum(fresh) > bm.num_free_blocks:
            return None
        for (_, seq), count in zip(going_on, fresh):
            if count:
                bm.allocate_ahead(seq)
        scheduled = [ScheduledSequence(seq, seq.num_tokens, 1, True, [seq]) for _, seq in going_on]
        self.num_steps += 1
        self.num_steps_ahead += 1
        return SchedulerOutput(scheduled, [], [], len(scheduled), follows=[row for row, _ in going_on])

    # ---- results

    def postprocess(self, output: SchedulerOutput, token_ids: Seq[int], logprobs: Seq[float] | None = None,
                    top_logprobs: Seq | None = None, routing: Seq | None = None) -> list[Sequence]:
        """Record a step: its computed tokens, forks, and one sampled token per sequence of
        output.samples (token_ids, and optional logprobs / top_logprobs / routing, in that order).
        Finishes sequences that hit a stop condition and frees their blocks; returns them.
        In a step planned ahead (output.follows), the rows of sequences that finished after it was
        planned (at the previous postprocess) are dropped: their tokens come after the end."""
        samples = output.samples
        for name, values in (("token_ids", token_ids), ("logprobs", logprobs), ("top_logprobs", top_logprobs),
                             ("routing", routing)):
            if values is not None and len(values) != len(samples):
                raise InputError(f"Scheduler.postprocess: {name} has {len(values)} entries for {len(samples)} samples")
        mark_computed = self.block_manager.mark_computed
        running, stopped = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        ahead = output.follows is not None
        finished: list[Sequence] = []
        k = 0
        for entry in output.scheduled:
            seq = entry.seq
            if ahead and seq.status is stopped:
                k += 1  # one sample per entry in such a step
                self.num_discarded += 1
                continue
            if seq.status is not running or seq.num_computed_tokens != entry.start:
                raise InputError(f"Scheduler.postprocess: {seq!r} does not match this output (postprocess each "
                                 f"schedule() output exactly once, in order)")
            mark_computed(seq, entry.num_new_tokens)
            if not entry.needs_sample:
                continue
            if len(entry.sample_seqs) > 1:
                self._fork(seq, entry.sample_seqs[1:])
            for s in entry.sample_seqs:
                token = int(token_ids[k])
                s.append_token(token, None if logprobs is None else float(logprobs[k]),
                               None if top_logprobs is None else top_logprobs[k],
                               None if routing is None else routing[k])
                k += 1
                reason = self._stop_reason(s, token)
                if reason is not None:
                    self._finish(s, reason)
                    finished.append(s)
        return finished

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        for child in children:
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self._insert(self.running, child)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why seq, which just got `token`, stops (None: it goes on)."""
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if self.stop_checker is not None and self.stop_checker(seq):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # ---- checks

    def check_invariants(self) -> None:
        """Raise InvariantError unless queues, sequences and blocks agree (between steps)."""
        def fail(message: str):
            raise InvariantError(f"Scheduler invariant: {message}")

        if len(self.running) > self.max_num_seqs:
            fail(f"{len(self.running)} running sequences exceed max_num_seqs {self.max_num_seqs}")
        for queue, status in ((self.waiting, SequenceStatus.WAITING), (self.running, SequenceStatus.RUNNING)):
            if [s.priority for s in queue] != sorted(s.priority for s in queue):
                fail(f"the {status.value} queue is out of order")
            for s in queue:
                if s.status is not status:
                    fail(f"{s!r} is in the {status.value} queue")
                if s.num_uncomputed_tokens < 1:
                    fail(f"{s!r} has no token left to compute")
        for s in self.waiting:
            if s.block_table or s.num_computed_tokens:
                fail(f"waiting {s!r} holds blocks")
        ids = [s.seq_id for s in self.waiting + self.running]
        pending = [c.seq_id for p in self._pending.values() for c in p]
        if len(set(ids + pending)) != len(ids) + len(pending):
            fail("a sequence is queued twice")
        self.block_manager.check_invariants(self.running)
