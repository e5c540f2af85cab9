"""`LLM`: the rollout engine's front door, in the spirit of vLLM's `LLM.generate`.

    llm = LLM("tiny", device="cpu")
    outputs = llm.generate(["12+34="], SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=1))
    outputs[0].outputs[2].token_ids, .text, .logprobs

A request with its own seed (SamplingParams.seed, vLLM's convention) draws by (seed, sample,
position): the same tokens alone or inside any batch. A request without one draws by the call's
seed (generate's `seed`) and its id, by default its index in the call. Never on batching or
scheduling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import numpy as np

from rlportable.engine.block_manager import BlockManager
from rlportable.engine.runner import LaunchedStep, ModelRunner
from rlportable.engine.scheduler import Scheduler, SchedulerOutput
from rlportable.engine.sequence import SamplingParams, Sequence, int_list
from rlportable.errors import InputError
from rlportable.model.forward import Model
from rlportable.model.load import load_model
from rlportable.runtime import get_backend
from rlportable.runtime.base import Backend


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str | None
    top_logprobs: list | None = None
    # Qwen3-MoE: per token, the expert choices (int32 [sparse layers, k]) of the row that gave its log-prob
    # (the previous token's); the trainer recomputes them. None for a dense model.
    routing: list | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class GenerationStats:
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    seconds: float = 0.0
    steps_ahead: int = 0  # decode steps planned and launched while the step before them ran
    discarded_tokens: int = 0  # tokens drawn ahead for sequences that had stopped (dropped)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def _check_engine_sizes(**sizes) -> None:
    for name, value in sizes.items():
        optional = name in ("max_model_len", "num_blocks")
        if optional and value is None:
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise InputError(f"LLM: {name} must be an integer >= 1, got {value!r}")


def _check_request_ids(request_ids, count: int) -> list[int]:
    if request_ids is None:
        return list(range(count))
    ids = list(request_ids)
    if len(ids) != count or len(set(ids)) != count or not all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise InputError(f"request_ids must be {count} distinct integers >= 0, one per prompt")
    return [int(i) for i in ids]


class LLM:
    def __init__(self, model: str = "tiny", device: str = "auto", block_size: int = 16, num_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 4096, max_model_len: int | None = None,
                 enable_prefix_caching: bool = False, loaded=None, sampler: str = "host",
                 cuda_graphs: bool | None = None, tp_group=None, async_scheduling: bool | None = None,
                 ep_group=None):
        """`loaded`: an already loaded (config, weights, tokenizer), or an existing Model with its tokenizer.
        `sampler`: "host" (the contract's NumPy sampler) or "device" (the sampling kernel for rows
        without top-k/top-p/min-p, the host for the others); the same tokens and log-probs either way.
        `cuda_graphs`: decode steps padded to batch-size buckets and replayed as CUDA / HIP graphs
        (engine/runner.py); None = on where the backend has graphs (cuda, hip), off on cpu, where
        True runs the same padded steps eagerly. The same tokens and log-probs either way.
        `tp_group`: this process's (or thread's) tensor-parallel rank (runtime/collectives.py). Every rank
        runs the same engine loop on its shard of the model (the scheduler and the sampler are
        deterministic, so the ranks agree without talking); the outputs are the same on every rank.
        `ep_group`: its expert-parallel rank (a Qwen3-MoE's whole experts per rank, model/expert_parallel.py),
        the same way.
        `async_scheduling`: while a pure decode step runs on the device, plan and launch the next one,
        fed the tokens it draws on the device, before reading its results (docs/engine.md, "Asynchronous
        scheduling"); needs sampler="device" and decode buckets (cuda_graphs). Other steps
        run one at a time. None = on where the backend's downloads are asynchronous (cuda) and those
        hold. The same tokens and log-probs either way."""
        _check_engine_sizes(block_size=block_size, max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                            num_blocks=num_blocks)
        self.backend = device if isinstance(device, Backend) else get_backend(device)
        if isinstance(loaded, tuple) and len(loaded) == 2 and isinstance(loaded[0], Model):
            self.model, self.tokenizer = loaded
        else:
            config, weights, self.tokenizer = loaded if loaded is not None else load_model(model)
            self.model = Model(self.backend, config, weights, tp_group=tp_group, ep_group=ep_group)
        config = self.model.config
        self.max_model_len = max_model_len or min(config.max_position_embeddings, 4096)
        self.block_size = block_size
        self.num_blocks = num_blocks or max_num_seqs * -(-self.max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.enable_prefix_caching = enable_prefix_caching
        self.runner = ModelRunner(self.model, self.num_blocks, block_size, sampler=sampler, cuda_graphs=cuda_graphs,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        self.async_scheduling = self._async_scheduling(async_scheduling)
        self.stats = GenerationStats()

    def _async_scheduling(self, asked: bool | None) -> bool:
        """The async_scheduling option, checked: it needs tokens drawn on the device and decode buckets."""
        if asked is not None and not isinstance(asked, bool):
            raise InputError(f"async_scheduling must be True, False or None (the default), got {asked!r}")
        possible = self.runner.sampler == "device" and self.runner.cuda_graphs
        if asked and not possible:
            raise InputError("async_scheduling needs sampler='device' (tokens drawn on the device feed the next "
                             "step) and decode buckets (cuda_graphs)")
        return possible and self.backend.async_downloads if asked is None else asked

    def release_kv_cache(self) -> None:
        """Free the KV cache between rollouts (GRPO trains in that memory); generate() needs it back."""
        self.runner.release_caches()

    def restore_kv_cache(self) -> None:
        self.runner.restore_caches()

    def _scheduler(self, stop_checker) -> Scheduler:
        manager = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_caching)
        eos = getattr(self.tokenizer, "stop_token_ids", None) or [self.tokenizer.eos_token_id]
        return Scheduler(manager, self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len,
                         eos_token_ids=[t for t in eos if t is not None], stop_checker=stop_checker)

    def _encode(self, prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise InputError(f"prompt {index} ({prompt!r}) encodes to no tokens")
            return prompt, ids
        vocab = self.model.config.vocab_size
        if isinstance(prompt, bytes) or not hasattr(prompt, "__iter__"):
            raise InputError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
        ids = int_list(prompt)
        if not ids or not 0 <= min(ids) <= max(ids) < vocab:
            raise InputError(f"prompt {index}: token ids must be a non-empty list of integers in [0, {vocab})")
        return None, ids

    def generate(self, prompts: Seq, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 request_ids: Seq[int] | None = None, seed: int = 0) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); returns one RequestOutput per prompt, in order.

        progress(done_tokens, total_budget) is called after every step. seed: the key, with the
        request's id, of the requests without a seed of their own. request_ids: those ids (default
        0, 1, ...; distinct integers >= 0), so a share of a batch (a data-parallel replica's) samples
        exactly what it would have in the whole batch."""
        if isinstance(prompts, (str, bytes)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        params = [SamplingParams() if p is None else p for p in params]
        for index, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise InputError(f"sampling params {index} must be a SamplingParams, got {type(p).__name__}")
        if self.runner.caches is None:
            raise InputError("generate: the KV cache is released; call restore_kv_cache() first")
        request_ids = _check_request_ids(request_ids, len(prompts))
        self.runner.recheck_model_arrays()  # the weights may have been replaced since the last call
        # the stop-string hook detokenizes; without stop strings it would answer False for every token
        scheduler = self._scheduler(self._stop_checker if any(p.stop for p in params) else None)
        requests, groups = [], []
        for index, (prompt, p, request_id) in enumerate(zip(prompts, params, request_ids)):
            text, ids = self._encode(prompt, index)
            requests.append(RequestOutput(request_id, text, ids))
            groups.append(scheduler.add_request(request_id, ids, p, call_seed=seed))
        budget = sum(p.n * p.max_tokens for p in params)
        start = time.perf_counter()
        run = self._run_overlapped if self.async_scheduling else self._run_in_turn
        steps = run(scheduler, lambda done: progress(done, budget) if progress else None)
        self.backend.synchronize()
        for request, group in zip(requests, groups):
            request.outputs = [self._completion(seq) for seq in group]
        self._record(groups, steps, scheduler, time.perf_counter() - start)
        return requests

    def _run_in_turn(self, scheduler: Scheduler, progress: Callable[[int], None]) -> int:
        """Steps one at a time: schedule, run (waiting for the device), record. Returns the step count."""
        steps = done = 0
        while scheduler.has_unfinished():
            out = self._schedule(scheduler)
            tokens, logprobs, top = self.runner.execute(out)
            scheduler.postprocess(out, tokens, logprobs, top, self.runner.last_routing)
            steps += 1
            done += len(tokens)  # every sample of the step got one token (kept through preemption)
            progress(done)
        return steps

    def _run_overlapped(self, scheduler: Scheduler, progress: Callable[[int], None]) -> int:
        """Asynchronous scheduling: after launching a step whose tokens stay on the device, plan the next
        decode step (Scheduler.schedule_ahead) and launch it, fed those tokens on the device, before
        waiting for the first; then record the first while the device runs the second. In steady decode
        the device always has the next step queued when it finishes one. Returns the step count."""
        runner = self.runner
        in_flight: list[tuple[SchedulerOutput, LaunchedStep]] = []  # launched, not yet recorded; oldest first
        steps = done = 0
        try:
            while in_flight or scheduler.has_unfinished():
                if not in_flight:
                    out = self._schedule(scheduler)
                    in_flight.append((out, runner.launch(out)))
                out, step = in_flight[0]
                ahead = scheduler.schedule_ahead(out) if step.feeds_next else None
                if ahead is not None:
                    in_flight.append((ahead, runner.launch(ahead, after=step)))
                tokens, logprobs, top = runner.wait(step)
                in_flight.pop(0)
                dropped = scheduler.num_discarded
                scheduler.postprocess(out, tokens, logprobs, top, step.routing)
                steps += 1
                done += len(tokens) - (scheduler.num_discarded - dropped)
                progress(done)
        finally:
            for _, step in in_flight:  # stopped by an error: let the device finish what it has
                runner.discard(step)
        return steps

    @staticmethod
    def _schedule(scheduler: Scheduler) -> SchedulerOutput:
        out = scheduler.schedule()
        if out.is_empty:
            raise InputError("the scheduler cannot make progress: the KV cache is too small for one sequence")
        return out

    def _stop_checker(self, seq: Sequence) -> bool:
        if not seq.params.stop:
            return False
        text = self.tokenizer.decode(seq.output_token_ids)
        return any(stop in text for stop in seq.params.stop)

    def _completion(self, seq: Sequence) -> CompletionOutput:
        text = self.tokenizer.decode(seq.output_token_ids)
        for stop in seq.params.stop:
            if stop in text:
                text = text[: text.index(stop)]
        top = seq.output_top_logprobs if seq.params.logprobs else None
        routing = list(seq.output_routing) if self.model.config.is_moe else None
        return CompletionOutput(seq.sample_index, list(seq.output_token_ids), text, list(seq.output_logprobs),
                                seq.finish_reason, top, routing)

    def _record(self, groups, steps: int, scheduler: Scheduler, seconds: float) -> None:
        self.stats = GenerationStats(
            steps=steps, prompt_tokens=sum(g[0].num_prompt_tokens for g in groups),
            output_tokens=sum(s.num_output_tokens for g in groups for s in g), preemptions=scheduler.num_preemptions,
            seconds=seconds, steps_ahead=scheduler.num_steps_ahead, discarded_tokens=scheduler.num_discarded)
