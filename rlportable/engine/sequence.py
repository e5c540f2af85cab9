"""Sampling parameters and the sequence: the engine's unit of bookkeeping.

One request (a prompt and its SamplingParams) becomes `n` Sequences, one per sample, with
the same request_id and sample_index 0..n-1. A Sequence's known tokens are its prompt
followed by the tokens sampled so far; `num_computed_tokens` of them (a prefix) have their
K/V in the paged cache, in the blocks listed by `block_table`:
    position j lives in slot block_table[j // block_size] * block_size + j % block_size.
Between two engine steps every unfinished sequence has num_computed_tokens < num_tokens (the
last known token never has K/V yet: computing it gives the logits of the next token).
"""

from __future__ import annotations

import enum
import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Any

from rlportable.errors import InputError

U32 = 1 << 32
U64 = 1 << 64
#: the request key of a request with its own seed: it samples as the first request of a call with
#: that seed would, wherever it stands in its own call
SEEDED_REQUEST = 0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_list(values) -> list[int] | None:
    """values as a list of Python ints, or None where one is not an integer (bool included). A prompt's
    ids are checked once per request: plain ints by their types at once (a per-id isinstance against
    numbers.Integral is slow enough to show in a large batch's first step)."""
    items = list(values)
    if set(map(type, items)) <= {int}:
        return items
    return [int(v) for v in items] if all(_is_int(v) for v in items) else None


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class SamplingParamsError(InputError):
    """A bad SamplingParams field; `field` lets a command name its own flag for it (in_terms_of)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def in_terms_of(self, flags: dict[str, str]) -> InputError:
        """The same error naming flags[field] (else --field-with-dashes) instead of the field."""
        flag = flags.get(self.field, "--" + self.field.replace("_", "-"))
        return InputError(str(self).replace(f"SamplingParams: {self.field}", flag, 1))


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (shared by its n samples; immutable).

    n               samples per prompt (a GRPO group), each its own Sequence
    temperature     0 = greedy, else logits / temperature
    top_k           keep the k most likely tokens; 0 = off
    top_p           keep the smallest most-likely prefix of probability >= top_p; 1 = off
    min_p           keep tokens with p >= min_p * p_max; 0 = off
    max_tokens      tokens to generate at most
    stop_token_ids  stop after sampling any of these (always, ignore_eos or not)
    stop            stop strings: checked by the caller that detokenizes (Scheduler's stop_checker)
    ignore_eos      do not stop at the model's eos tokens
    seed            None, or this request's own key in [0, 2^64) (vLLM's convention): its draws depend on
                    (seed, sample, position) only, whatever else is in the call; None: on the call's
                    seed and the request's id (LLM.generate, Sequence.sampler_key)
    logprobs        how many top alternatives to return per token besides the sampled token's log-prob
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int = 0

    def __post_init__(self):
        def bad(field: str, value, what: str):
            raise SamplingParamsError(field, f"SamplingParams: {field} must be {what}, got {value!r}")

        def integer(field: str, low: int, high: int | None = None) -> int:
            value = getattr(self, field)
            if not _is_int(value) or value < low or (high is not None and value >= high):
                bad(field, value, f"an integer >= {low}" + (f" and < {high}" if high is not None else ""))
            object.__setattr__(self, field, int(value))
            return int(value)

        def real(field: str, ok, what: str) -> float:
            value = getattr(self, field)
            if not _is_real(value) or not math.isfinite(float(value)) or not ok(float(value)):
                bad(field, value, what)
            object.__setattr__(self, field, float(value))
            return float(value)

        integer("n", 1)
        real("temperature", lambda t: t >= 0, "a finite number >= 0 (0 = greedy)")
        integer("top_k", 0)
        real("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        real("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        integer("max_tokens", 1)
        if self.seed is not None:
            integer("seed", 0, U64)
        integer("logprobs", 0)
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", self.ignore_eos, "a bool")
        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        if _is_int(ids) or isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            bad("stop_token_ids", ids, "a sequence of token ids")
        ids = tuple(ids)
        for token in ids:
            if not _is_int(token) or token < 0:
                bad("stop_token_ids", self.stop_token_ids, "a sequence of integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        stop = self.stop
        if stop is None:
            stop = ()
        if isinstance(stop, str):
            stop = (stop,)
        if not hasattr(stop, "__iter__") or isinstance(stop, bytes):
            bad("stop", stop, "a string or a sequence of strings")
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop", self.stop, "a sequence of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no blocks: not admitted yet, or preempted (recomputed when readmitted)
    RUNNING = "running"  # holds blocks; computed a chunk of its tokens or decodes
    FINISHED = "finished"  # holds no blocks; finish_reason says why


_seq_ids = itertools.count()


class Sequence:
    """One sample of one request: its tokens, log-probs, status and KV blocks.

    Attributes the engine reads and writes:
      seq_id               unique in the process (dictionary key)
      request_id           the request's id, in [0, 2^32)
      sampler_key          (seed, request) of the sampler's counter: (params.seed, SEEDED_REQUEST) for a
                           request with its own seed, else (the call's seed, request_id)
      sample_index         0..n-1 within the request
      params               the request's SamplingParams
      prompt_token_ids     list[int], never empty
      output_token_ids     list[int], the sampled tokens (a stop token is kept)
      output_logprobs      list[float], the log-prob of each sampled token (as the runner gave it)
      output_top_logprobs  list, the runner's top-`params.logprobs` alternatives per token (or None)
      output_routing       list, per token the expert choices (Qwen3-MoE) of the row that gave its log-prob
                           (int32 [sparse layers, k]), or None
      status               SequenceStatus
      finish_reason        None, "stop" (eos, stop token or stop string) or "length" (max_tokens)
      block_table          list[int], the KV blocks of positions 0, block_size, 2 block_size, ...
      num_computed_tokens  how many leading tokens have K/V in the cache
      num_cached_tokens    tokens taken from the prefix cache at the last admission
      num_preemptions      how many times it was preempted (freed and recomputed)
      arrival              admission order given by the scheduler (smaller = older = higher priority)
      block_hashes         prefix-caching hash chain of its full blocks (the block manager fills it)
    """

    __slots__ = ("seq_id", "request_id", "sample_index", "params", "prompt_token_ids", "output_token_ids",
                 "output_logprobs", "output_top_logprobs", "output_routing", "status", "finish_reason",
                 "block_table", "num_computed_tokens", "num_cached_tokens", "num_preemptions", "arrival", "block_hashes",
                 "sampler_key", "_tokens")

    def __init__(self, request_id: int, prompt_token_ids, params: SamplingParams | None = None,
                 sample_index: int = 0, arrival: int | None = None, call_seed: int = 0):
        if not _is_int(request_id) or not 0 <= request_id < U32:
            raise InputError(f"Sequence: request_id must be an integer in [0, 2^32), got {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InputError(f"Sequence: params must be a SamplingParams, got {type(params).__name__}")
        if not _is_int(sample_index) or not 0 <= sample_index < params.n:
            raise InputError(f"Sequence: sample_index must be an integer in [0, n={params.n}), got {sample_index!r}")
        if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__iter__"):
            raise InputError(f"Sequence: prompt_token_ids must be a sequence of token ids, "
                             f"got {type(prompt_token_ids).__name__}")
        items = list(prompt_token_ids)
        prompt = int_list(items)
        if prompt == []:
            raise InputError(f"Sequence: request {request_id} has an empty prompt (at least one token is needed)")
        if prompt is None or min(prompt) < 0:
            found = next(t for t in items if not _is_int(t) or t < 0)
            raise InputError(f"Sequence: request {request_id}'s prompt_token_ids must be integers >= 0, "
                             f"found {found!r}")
        self.seq_id = next(_seq_ids)
        self.request_id = int(request_id)
        self.sample_index = int(sample_index)
        self.params = params
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[Any] = []
        self.output_routing: list[Any] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.arrival = arrival
        self.block_hashes: list[bytes] = []
        if not _is_int(call_seed) or not 0 <= call_seed < U64:
            raise InputError(f"the call's seed must be an integer in [0, 2^64), got {call_seed!r}")
        self.sampler_key = (int(call_seed), self.request_id) if params.seed is None else (params.seed, SEEDED_REQUEST)
        self._tokens = list(self.prompt_token_ids)  # prompt + output, kept in step

    # ---- tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens (a new list)."""
        return list(self._tokens)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Known tokens [start, stop) (a new list): what the runner feeds for a chunk."""
        return self._tokens[start:stop]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self._tokens[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens without K/V yet (>= 1 between steps for an unfinished sequence)."""
        return len(self._tokens) - self.num_computed_tokens

    @property
    def priority(self) -> tuple[int, int, int]:
        """Sort key: older requests first, then sample index (preemption takes the largest)."""
        return (self.arrival if self.arrival is not None else 1 << 62, self.sample_index, self.seq_id)

    def append_token(self, token_id: int, logprob: float | None = None, top_logprobs: Any = None,
                     routing: Any = None) -> None:
        self.output_token_ids.append(int(token_id))
        self.output_logprobs.append(logprob)
        self.output_top_logprobs.append(top_logprobs)
        self.output_routing.append(routing)
        self._tokens.append(int(token_id))

    # ---- KV slots

    def slot(self, position: int, block_size: int) -> int:
        """The cache slot of a position: block_table[j // block_size] * block_size + j % block_size."""
        return self.block_table[position // block_size] * block_size + position % block_size

    def slots(self, start: int, stop: int, block_size: int) -> list[int]:
        """Slots of positions [start, stop)."""
        table = self.block_table
        return [table[j // block_size] * block_size + j % block_size for j in range(start, stop)]

    def __repr__(self) -> str:
        return (f"Sequence(request={self.request_id}, sample={self.sample_index}, {self.status.value}, "
                f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")
