"""The model runner: executes one scheduler step on the model and its paged KV caches.

A step's tokens (decodes and prefill chunks of any number of sequences) go
through `Model.step` in one batch; the last row of every entry that needs a
token gives float32 logits (the exact gemm), and the sampler's contract draws
the tokens and records their log-probs. Because every op is a contract op, a
sequence's tokens and log-probs do not depend on the batch it ran in, on the
chunking, the block size, sharing or preemption, nor on the device.

Speed:
  * One host-to-device copy per step: the step's metadata, copy-on-write slots and sampler
    parameters are packed into one upload (step_inputs.StepUploader); the ops' range checks
    run on the host arrays the runner already has.
  * One wait for the device per step: the sampled tokens, their log-probs and any logits rows
    the host needs come back in one download at the end of the step.
  * Decode steps (every entry one token of a sequence that draws one sample) are padded to a
    bucket size (step_inputs.decode_buckets) when `cuda_graphs` is on; on cuda and hip each
    bucket's forward + LM head is captured once as a graph and replayed with the step's
    metadata in fixed device buffers. On cpu the same padded steps run eagerly (CI checks the
    padding: tokens and log-prob bits equal those of unpadded steps).
  * launch() queues a step (upload, forward, sampler, the download of its results) and wait()
    reads its results, so the host can queue the next step first (asynchronous scheduling, LLM):
    a step planned ahead takes the tokens the step before drew on the device (feed_tokens) and is
    queued before the host waits for that step (docs/engine.md, "Asynchronous scheduling").
  * Graphs read the weights, the KV cache, the RoPE tables and the upload buffer at the
    addresses they had at capture. Whenever one of those arrays is replaced (release_caches /
    restore_caches, Model.reencode after a training step, a larger upload buffer), the graphs
    are dropped and captured again at the next decode of each bucket: every replay first
    checks, by identity, that the upload buffer, the RoPE tables and the KV cache are the captured
    ones, and the first replay after recheck_model_arrays() (LLM.generate calls it first: no
    weight is replaced while a generate call runs) checks every weight too (about 600 arrays for
    28 layers, 0.1 ms: too much for every step).
"""

from __future__ import annotations

import dataclasses
import operator
import time

import numpy as np

from rlportable.engine.block_manager import BlockCopy, InvariantError
from rlportable.engine.sampler import DeviceSampling, HostSampling
from rlportable.engine.scheduler import SchedulerOutput
from rlportable.engine.sequence import Sequence
from rlportable.engine.step_inputs import (DecodeTables, StepPlan, StepUploader, check_decode_plan, decode_buckets,
                                           plan_decode, plan_step)
from rlportable.errors import InputError
from rlportable.model.forward import Model, StepInputs
from rlportable.ops import attention, embedding, gemm, residual
from rlportable.ops.checks import shape_of
from rlportable.ops import sampling as sampling_op

#: where tokens are sampled: "host" (the contract's NumPy reference on the logits copied to the
#: host) or "device" (the sampling kernel for rows without filters, the host for filtered rows).
#: Both give the same tokens and log-probs, bit for bit, by contract.
SAMPLERS = ("host", "device")
#: Graphs only for buckets below this: larger ones would take the vendor-BLAS GEMM, which CuPy
#: refuses inside a capture (they run padded but eagerly).
GRAPH_MAX_ROWS = gemm.BLAS_FROM_M


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, sampler: str = "host",
                 cuda_graphs: bool | None = None, max_num_seqs: int = 256, max_model_len: int | None = None):
        """cuda_graphs: pad decode steps to buckets and, where the backend has graphs (cuda, hip),
        replay them as captured graphs; None = on where the backend has graphs. max_num_seqs: the
        largest decode bucket; max_model_len: the longest sequence (the block tables' width)."""
        if sampler not in SAMPLERS:
            raise InputError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
            raise InputError(f"cuda_graphs must be True, False or None (the backend's default), got {cuda_graphs!r}")
        self.sampler = sampler
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.caches = model.allocate_caches(num_blocks, block_size)
        self.cuda_graphs = self.backend.supports_graphs if cuda_graphs is None else cuda_graphs
        if model.tp.size > 1 and self.backend.supports_graphs:
            # the collectives of the row-parallel layers run cuBLAS and NCCL, which are not captured here
            if cuda_graphs:
                raise InputError("cuda_graphs: decode graphs are not captured under tensor parallelism; "
                                 "use cuda_graphs=False (--no-cuda-graphs)")
            self.cuda_graphs = False
        self.buckets = decode_buckets(max_num_seqs)
        self.max_model_len = max_model_len or num_blocks * block_size
        self.table_width = min(-(-self.max_model_len // block_size), num_blocks)
        rows = self.buckets[-1]
        self.uploader = StepUploader(self.backend, {
            "tokens": ((rows,), np.int32), "positions": ((rows,), np.int32), "q_seq": ((rows,), np.int32),
            "slots": ((rows,), np.int32), "block_tables": ((rows, self.table_width), np.int32)})
        self.decode_tables = DecodeTables(self.table_width, 2 * rows)  # block-table rows kept between steps
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, its logits output [bucket, V])
        self._graph_arrays: list = []  # the device arrays the graphs read, as captured (_arrays_read_by_graphs)
        self._weights_checked = False  # whether the weights were compared with the captured ones since recheck
        self._device_sampling = None  # the last step's DeviceSampling (reused for the same sequences)
        # sampling.token_id_table, for steps planned ahead (made here: a copy to the device inside a chain of
        # steps in flight could wait for them)
        self._token_ids = sampling_op.token_id_table(self.backend, model.config.vocab_size) if self.cuda_graphs \
            else None
        #: the last waited-for step's expert choices per sample (Qwen3-MoE; LaunchedStep.routing), or None
        self.last_routing: list | None = None
        #: where the last step's time went: bucket, graph (replayed one), host_s (planning, the
        #: upload and every launch), wait_s (the download: the device finishing the step), finish_s
        #: (with host_sampler_s: the host sampler's share of it)
        self.last_step: dict = {}
        #: None, or a list that gets one record per launched step, in launch order (a benchmark's
        #: view of the step loop; the engine never reads it): launch_s and wait_call_s (the two
        #: calls' durations), last_step's entries once waited for, and decode_kv (each entry's KV
        #: length) for a step that only decodes
        self.step_records: list[dict] | None = None

    # ---- KV cache maintenance
    def release_caches(self) -> None:
        """Free the KV cache (the trainer needs the memory); restore_caches() allocates it again.
        The decode graphs read the cache, so they go with it (captured again after restore)."""
        self.caches = None
        self._device_sampling = None  # it holds the last step's logits
        self.drop_graphs()

    def restore_caches(self) -> None:
        if self.caches is None:
            self.caches = self.model.allocate_caches(self.num_blocks, self.block_size)

    def _copy_uploads(self, copies: list[BlockCopy]) -> dict[str, np.ndarray]:
        if not copies:
            return {}
        pairs = [c.slot_pairs(self.block_size) for c in copies]
        src = np.concatenate([p[0] for p in pairs]).astype(np.int32)
        dst = np.concatenate([p[1] for p in pairs]).astype(np.int32)
        residual.check_copy_pairs(src, dst, self.num_blocks * self.block_size)
        return {"copy.src": src, "copy.dst": dst}

    def _apply_copies(self, views: dict) -> None:
        """Copy-on-write: the valid slots of each source block into its destination block, every
        layer (ops.residual.copy_rows: a bit copy, on every backend)."""
        if "copy.src" not in views:
            return
        src, dst = views["copy.src"], views["copy.dst"]
        count = shape_of(src)[0]
        for cache in self.caches:
            for array in (cache.k_digits, cache.k_exponents, cache.v_digits, cache.v_exponents):
                residual.copy_rows(self.backend, array, src, dst, count)

    # ---- one step
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[float], list | None]:
        """Run a scheduled step; returns (token, log-prob, top alternatives or None) per out.samples."""
        return self.wait(self.launch(out))

    def launch(self, out: SchedulerOutput, after: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue a scheduled step on the device (its upload, copy-on-write copies, forward, sampler and
        the download of its results) without waiting for it; wait(step) gives the results. A step planned
        ahead (out.follows, Scheduler.schedule_ahead) needs `after`, the step launched just before it,
        whose tokens it feeds on the device (after.feeds_next)."""
        start = time.perf_counter()
        step = self._launch(out, after)
        if self.step_records is not None:
            decodes = bool(out.scheduled) and all(e.is_decode for e in out.scheduled)
            step.record = {"launch_s": time.perf_counter() - start,
                           "decode_kv": [e.end for e in out.scheduled] if decodes else None}
            self.step_records.append(step.record)
        return step

    def _launch(self, out: SchedulerOutput, after: "LaunchedStep | None") -> "LaunchedStep":
        if self.caches is None:
            raise InputError("runner: the KV cache is released; call restore_caches() first")
        start = time.perf_counter()
        entries = out.scheduled
        bucket = self._bucket(entries)
        follows = self._follows(out, bucket, after)
        graph = bucket is not None and self._graphs_on(bucket)
        with self.backend.engine_stream():
            if bucket is None:
                plan = plan_step(entries, self.block_size)
                fixed, extra = {}, {f"step.{name}": a for name, a in plan.graph_inputs().items()}
                extra["step.sample_rows"] = plan.sample_rows
            else:
                plan = plan_decode(entries, bucket, self.table_width, self.block_size, self.decode_tables)
                fixed, extra = plan.graph_inputs(), {}
            # a decode's sample is its sequence, drawing the token at position start + 1
            positions = plan.positions[: len(entries)] + 1 if bucket is not None else None
            sampler = self._sampling(out.samples, positions) if plan.sample_rows.size else None
            extra.update(self._copy_uploads(out.copies))
            extra.update(sampler.uploads() if sampler else {})
            if follows is not None:
                extra["feed.rows"] = follows
            if graph:
                size = self.uploader.size_of(fixed, extra)
                if after is not None and not self._replay_ready(bucket, size):
                    # capturing, or replacing what graphs read, only with nothing in flight
                    self.backend.synchronize()
                self.uploader.reserve(size)  # before capturing on the buffer
                replay = self._graph(bucket)
                check_decode_plan(plan, len(entries), self.model.config.vocab_size, self.num_blocks,
                                  self.block_size, self.model.rope_tables(self.max_model_len)[0].shape[0])
            views = self.uploader.upload(fixed, extra)
            self._apply_copies(views)
            if follows is not None:
                self._feed_tokens(plan, views, after.drawn, follows)
            # Qwen3-MoE: each sparse layer's expert choices, recorded beside the sampled tokens (its
            # steps run eagerly, never as graphs: _graphs_on; the choices are host arrays)
            routing = [] if self.model.config.is_moe else None
            if graph:
                replay[0].replay()
                logits = replay[1][: len(entries)]
            elif bucket is not None:
                logits = self._decode_logits(plan, views, routing)[: len(entries)]
            else:
                logits = self._step_logits(plan, views, routing)
            timing = {"bucket": bucket, "graph": graph, "fed": follows is not None}
            if sampler is None:
                return LaunchedStep(out, None, None, None, {**timing, "host_s": time.perf_counter() - start})
            if routing is not None:
                rows = plan.sample_rows if bucket is None else np.arange(len(entries))
                routing = list(np.stack([np.asarray(layer)[rows] for layer in routing], axis=1))
            pending = sampler.launch(self.backend, logits, views)
            download = self.backend.start_download(pending)  # the step's results, behind its work
        if after is not None:
            after.followed = True
        drawn = pending[0] if bucket is not None and sampler.draws_all_on_device else None
        return LaunchedStep(out, sampler, download, drawn, {**timing, "host_s": time.perf_counter() - start},
                            routing=routing)

    def wait(self, step: "LaunchedStep") -> tuple[list[int], list[float], list | None]:
        """A launched step's results, once the device has made them: (token, log-prob, top alternatives
        or None) per out.samples. The step's one wait for the device (not for steps launched after it)."""
        start = time.perf_counter()
        self.last_routing = step.routing
        if step.sampler is None:
            self.last_step = {**step.timing, "wait_s": 0.0, "finish_s": 0.0}
            result = [], [], None
        else:
            host = step.download.wait()
            waited = time.perf_counter()
            result = step.sampler.finish(self.backend, host, logits_overwritten=step.followed)
            self.last_step = {**step.timing, "wait_s": waited - start, "finish_s": time.perf_counter() - waited,
                              "host_sampler_s": getattr(step.sampler, "host_s", None)}
        if step.record is not None:
            step.record.update(self.last_step, wait_call_s=time.perf_counter() - start)
        return result

    def discard(self, step: "LaunchedStep") -> None:
        """Let a launched step finish and drop its results (the caller stopped on an error)."""
        if step.download is not None:
            step.download.wait()

    def _follows(self, out: SchedulerOutput, bucket: int | None, after: "LaunchedStep | None") -> np.ndarray | None:
        """out.follows as int32, checked: a step planned ahead is a decode bucket step right after a step
        whose tokens were all drawn on the device."""
        if out.follows is None:
            return None
        follows = np.asarray(out.follows, dtype=np.int32)
        if bucket is None or after is None or not after.feeds_next or follows.size != len(out.scheduled) or (
                follows.size and (follows.min() < 0 or follows.max() >= len(after.out.samples))):
            raise InvariantError("runner: a step planned ahead must be a decode step launched right after a step "
                                 "whose tokens it feeds, all drawn on the device")
        return follows

    def _feed_tokens(self, plan: StepPlan, views: dict, drawn, follows: np.ndarray) -> None:
        """A step planned ahead reads the tokens the step before drew, moved on the device into its input
        (sampling.feed_tokens: a refused row becomes token 0; the host raises when it reads the refusal)."""
        count = follows.size
        tokens = views["tokens"][:count]
        sampling_op.feed_tokens(self.backend, drawn, views["feed.rows"], follows, self._token_ids, tokens)
        if self.backend.runs_reference:
            # the NumPy reference ops read the host's token ids (plan.tokens); on cpu the fed ones are host memory
            plan.tokens[:count] = tokens

    def _replay_ready(self, bucket: int, upload_bytes: int) -> bool:
        """Whether a replay of `bucket` needs no capture and no new upload buffer."""
        buffer = self.uploader.buffer
        return (bucket in self.graphs and buffer is not None and buffer.shape[0] >= upload_bytes
                and self._graph_arrays_unchanged())

    def _bucket(self, entries) -> int | None:
        """The padded size of a decode step (cuda_graphs on), or None for an exact-size step."""
        if not self.cuda_graphs or not entries or len(entries) > self.buckets[-1]:
            return None
        if not all(e.num_new_tokens == 1 and e.needs_sample and len(e.sample_seqs) == 1 for e in entries):
            return None  # (is_decode spelled out: this runs for every entry of every step)
        return next(size for size in self.buckets if size >= len(entries))

    def _graphs_on(self, bucket: int) -> bool:
        # a Qwen3-MoE sparse layer brings its expert ids to the host inside the step (each expert's group
        # size sets its products' shapes), which no graph captures: its padded decode steps run eagerly
        return self.backend.supports_graphs and bucket < GRAPH_MAX_ROWS and not self.model.config.is_moe

    def _sampling(self, samples: list[Sequence], positions: np.ndarray | None = None):
        """The step's sampler; `positions`: where each sample's token goes (default: num_tokens)."""
        if self.sampler == "host":
            return HostSampling(samples)
        # consecutive decode steps mostly sample the same sequences (a list comparison by identity)
        if self._device_sampling is None or self._device_sampling.samples != samples:
            self._device_sampling = DeviceSampling(samples, self.model.config.vocab_size)
        return self._device_sampling.for_step(samples, positions)

    def _step_logits(self, plan: StepPlan, views: dict, routing: list | None = None):
        """An exact-size step: the forward, then the LM head on each sample's row (routing: Model.step's)."""
        device = StepInputs(*(views[f"step.{name}"] for name in StepInputs._fields))
        hidden = self.model.step(plan.tokens, plan.positions, plan.q_seq, plan.block_tables, plan.slots, self.caches,
                                 device=device, routing=routing)
        if not plan.sample_rows.size:
            return None
        picked = embedding.gather(self.backend, hidden, views["step.sample_rows"], host_ids=plan.sample_rows)
        return self.model.logits(picked)

    def _decode_logits(self, plan: StepPlan, views: dict, routing: list | None = None):
        """A padded decode step: the forward and the LM head on every row [bucket, V] (a graph's body)."""
        device = StepInputs(*(views[name] for name in StepInputs._fields))
        hidden = self.model.step(plan.tokens, plan.positions, plan.q_seq, plan.block_tables, plan.slots, self.caches,
                                 device=device, routing=routing)
        return self.model.logits(hidden)

    # ---- graphs
    def drop_graphs(self) -> None:
        """Forget every captured graph and give back its memory."""
        self.graphs.clear()
        self._graph_arrays = []
        self.backend.release_graph_memory()

    def recheck_model_arrays(self) -> None:
        """Have the next graph replay compare every weight with the arrays the graphs captured (call it
        after replacing any, e.g. Model.reencode; LLM.generate calls it at its start)."""
        self._weights_checked = False

    def _arrays_read_by_graphs(self, weights: bool = True) -> list:
        """The upload buffer, the RoPE tables, the KV caches' arrays, then (weights) every weight."""
        model = self.model
        cos, sin = model.rope_tables(self.max_model_len)  # grown once to every position a step can use
        arrays = _device_arrays(self.caches, [self.uploader.buffer, cos, sin])
        return _device_arrays((model.embed, model.final_norm, model.lm_head, *model.layers), arrays) if weights \
            else arrays

    def _graph_arrays_unchanged(self) -> bool:
        """Whether the arrays the graphs read are the captured ones (the weights only when unchecked)."""
        weights = not self._weights_checked
        arrays = self._arrays_read_by_graphs(weights)
        captured = self._graph_arrays if weights else self._graph_arrays[: len(arrays)]
        return len(arrays) == len(captured) and all(map(operator.is_, arrays, captured))

    def _graph(self, bucket: int) -> tuple:
        """The bucket's (graph, logits), captured now if missing or if an array it reads was replaced."""
        if not self._graph_arrays_unchanged():
            self.drop_graphs()
            self._graph_arrays = self._arrays_read_by_graphs()
        self._weights_checked = True
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        return self.graphs[bucket]

    def _capture(self, bucket: int) -> tuple:
        """Capture the padded decode of `bucket` rows, reading its inputs from the uploader's fixed
        region. Its inputs while capturing are all padding rows (they write no K/V); one eager run
        first loads every kernel and sets its attributes outside the capture."""
        plan = plan_decode([], bucket, self.table_width, self.block_size)
        views = self.uploader.upload(plan.graph_inputs(), {})
        self._decode_logits(plan, views)
        return self.backend.capture_graph(lambda: self._decode_logits(plan, views))

    def capture_graphs(self) -> int:
        """Capture every decode bucket's graph now (else each is captured at its first use);
        returns how many graphs exist. A no-op unless cuda_graphs is on and the backend has graphs."""
        if self.caches is None:
            raise InputError("runner: the KV cache is released; call restore_caches() first")
        with self.backend.engine_stream():
            for bucket in self.buckets:
                if self.cuda_graphs and self._graphs_on(bucket):
                    self.uploader.reserve(0)
                    self._graph(bucket)
        return len(self.graphs)


def _device_arrays(objects, found: list | None = None) -> list:
    """Every array held by these model or cache objects (GemmWeight, StackedWeight, KVCache, DeviceLayer and
    other dataclasses, arrays). Runs at every graph replay (about 600 arrays for 28 layers), hence
    the plain type tests, the iterables passed down rather than unpacked, and the per-type memo of
    dataclasses.is_dataclass."""
    found = [] if found is None else found
    for obj in objects:
        kind = type(obj)
        if kind is gemm.GemmWeight:
            found += (obj.encoded.digits, obj.encoded.exponents)
        elif kind is gemm.StackedWeight:  # its parts are views of the whole
            found += (obj.whole.encoded.digits, obj.whole.encoded.exponents)
        elif kind is attention.KVCache:
            found += (obj.k_digits, obj.k_exponents, obj.v_digits, obj.v_exponents)
        elif obj is None:
            continue
        else:
            container = _IS_DATACLASS.get(kind)
            if container is None:
                container = _IS_DATACLASS[kind] = dataclasses.is_dataclass(kind)
            if container:
                _device_arrays(vars(obj).values(), found)
            else:
                found.append(obj)
    return found


_IS_DATACLASS: dict[type, bool] = {}


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device whose results the host has not read (ModelRunner.launch)."""

    out: SchedulerOutput
    sampler: object | None  # its HostSampling or DeviceSampling; None when nothing samples
    download: object | None  # its results on their way to the host (Backend.start_download)
    drawn: object | None  # the drawn tokens on the device, when every row was drawn there in a decode bucket
    timing: dict  # bucket, graph, fed (its tokens came from the step before), host_s (planning, upload, launches)
    followed: bool = False  # another step was launched before this one's results were read
    record: dict | None = None  # its entry of ModelRunner.step_records, where those are kept
    # Qwen3-MoE: per sample, the expert choices (int32 [sparse layers, k]) of the row whose hidden state
    # gave its token's log-prob; None for a dense model
    routing: list | None = None

    @property
    def feeds_next(self) -> bool:
        """Whether a step planned ahead can take its tokens from this one on the device."""
        return self.drawn is not None
