"""`rlportable bench decode`: rollout throughput of the engine on a Qwen3-0.6B-shaped model.

N concurrent sequences of random token-id prompts, each generating exactly `new_tokens`
tokens (ignore_eos, temperature 1, no top-k / top-p / min-p filter). Ours: `LLM.generate`
(paged KV cache, continuous batching, the sampler's contract). Peer: HF transformers
`generate` in bf16 with sdpa attention on the same batch of prompts (do_sample, temperature 1,
top_k 0, top_p 1, min_new_tokens = max_new_tokens), in the same process on the same GPU.
Weights are random (no download): throughput does not depend on their values.

Reported for both: end-to-end output tokens/s (prefill included, the whole generate call),
the time of every decode step (each side records a timestamp after every step; a step is
"pure decode" when every sequence fed exactly its last sampled token: for ours, read from the
scheduler's plan of the step, since chunked prefill leaves sequences a few tokens apart; for HF,
every step after the first), peak memory, and the fraction of the memory-bandwidth bound reached
in the pure decode steps:

    bound time of a step = bytes it must read / measured device-to-device copy bandwidth
    bytes of a step      = weights as the kernels read them + the KV cache rows it attends to
    bound fraction       = sum of bound times / sum of measured times (same steps)

Byte accounting (`step_bytes`), ours: every projection and the LM head as stored for the
exact GEMM (2 int8 digits per element, K padded to K_ALIGN, one int32 exponent per output
row), read once per step; the embedding's float32 rows gathered (one per sequence), not the
whole table; the float32 norm weights; the KV cache: for each sequence, layer, KV head and
attended position, K and V rows of 2 int8 digits per element (head_dim padded to K_ALIGN) and
one int32 exponent each. HF bf16: 2 bytes per weight element and per K/V element, the tied
LM head read once, embedding rows gathered. A step that feeds the token at position p attends
to p + 1 positions (its own K/V included).

Ratios: throughput_ratio = our end-to-end tokens/s / HF's (only when both ran to the end);
decode_step_ratio = HF's decode time / ours over the same step indices (> 1: ours is faster);
memory_ratio = our peak / HF's peak.

A slow side is stopped after `time_limit` seconds of generation (then "complete" is false and
the end-to-end numbers cover what ran); decode steps are compared at the same step indices (ours:
the mean output tokens per sequence after the step, rounded down), so a truncated run still gives
a fair per-step ratio. The engine samples on the device when it has a device sampler
(`sampler="auto"` on cuda), else with the contract's NumPy sampler on the host, and replays decode
steps as CUDA graphs unless `cuda_graphs` is False (all buckets are captured before the timed run;
`graph_capture_s`). Per decode step the medians of: `execute` (the runner's whole step), its host
part (planning, the upload and every launch), its wait for the device (the step's one download),
its host post-processing, and the host sampler. If the peer fails (say, out of memory), our
numbers are kept and the failure is recorded as `peer_error`.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from rlportable.bench.forward import PeakTracker
from rlportable.model.synthetic import IdsOnlyTokenizer, qwen3_06b_config, random_weights
from rlportable.errors import InputError, RlpError

TARGETS = {"throughput_ratio_at_least": 10.0, "bound_fraction_at_least": 0.30}
EXPONENT_BYTES = 4  # int32 per encoded row (weights' output channels, KV (token, head) rows)
FLOAT32_BYTES = 4
BF16_BYTES = 2


# ---------------------------------------------------------------- byte accounting

def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _layout():
    """(weight digits per element, KV digits per element, K alignment) of the stored encodings."""
    from rlportable.contract.fixedpoint import slice_count
    from rlportable.ops.attention import KV_SLICES
    from rlportable.ops.fixedpoint import K_ALIGN
    from rlportable.ops.gemm import DEFAULT_BITS_W

    return slice_count(DEFAULT_BITS_W), KV_SLICES, K_ALIGN


def _matrices(config) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's projections (Y = X @ W.T, W [N, K])."""
    h, q, kv, i = config.hidden_size, config.num_attention_heads * config.head_dim, \
        config.num_key_value_heads * config.head_dim, config.intermediate_size
    return [("q", q, h), ("k", kv, h), ("v", kv, h), ("o", h, q), ("gate", i, h), ("up", i, h), ("down", h, i)]


def _layer_vectors(config) -> int:
    """Elements of one layer's norm weights and biases."""
    h, d = config.hidden_size, config.head_dim
    count = 2 * h + (2 * d if config.qk_norm else 0)
    if config.qkv_bias:
        count += (config.num_attention_heads + 2 * config.num_key_value_heads) * d
    return count


def step_bytes(config, kv_lengths, scheme: str = "ours") -> dict:
    """Bytes one decode step must read from device memory.

    kv_lengths: for each sequence in the step, the positions it attends to (its own included).
    scheme "ours": the contract encodings as stored; "bf16": HF transformers' bf16 tensors.
    Returns the parts and their "total"."""
    lengths = np.asarray(kv_lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths.size and lengths.min() < 1):
        raise InputError(f"step_bytes: kv_lengths must be a list of lengths >= 1, got {kv_lengths!r}")
    sequences, tokens = int(lengths.size), int(lengths.sum())
    h, v, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
    hkv, d = config.num_key_value_heads, config.head_dim
    if scheme == "ours":
        weight_digits, kv_digits, align = _layout()

        def matrix(n: int, k: int) -> int:
            return n * (weight_digits * _round_up(k, align) + EXPONENT_BYTES)

        projections = layers * sum(matrix(n, k) for _, n, k in _matrices(config))
        vectors = (layers * _layer_vectors(config) + h) * FLOAT32_BYTES  # + the final norm
        embedding_rows = sequences * h * FLOAT32_BYTES
        lm_head = matrix(v, h)
        kv_row = kv_digits * _round_up(d, align) + EXPONENT_BYTES  # one (token, kv head) row of K or of V
        kv = tokens * layers * hkv * 2 * kv_row
    elif scheme == "bf16":
        projections = layers * sum(n * k for _, n, k in _matrices(config)) * BF16_BYTES
        vectors = (layers * _layer_vectors(config) + h) * BF16_BYTES
        embedding_rows = sequences * h * BF16_BYTES
        lm_head = v * h * BF16_BYTES
        kv = tokens * layers * hkv * 2 * d * BF16_BYTES
    else:
        raise InputError(f"step_bytes: unknown scheme {scheme!r} (ours, bf16)")
    parts = {"projections": projections, "norms_and_biases": vectors, "embedding_rows": embedding_rows,
             "lm_head": lm_head, "kv_cache": kv}
    parts = {key: int(value) for key, value in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def decode_kv_lengths(prompt_len: int, step_index: int, sequences: int) -> list[int]:
    """KV lengths of the decode step after which every sequence holds `step_index` output tokens:
    it feeds output token step_index - 1 at position prompt_len + step_index - 2, attending to
    prompt_len + step_index - 1 positions."""
    return [prompt_len + step_index - 1] * sequences


# ---------------------------------------------------------------- copy bandwidth

def copy_bandwidth(backend, nbytes: int = 1 << 31, repeats: int = 10) -> dict:
    """Device-to-device copy bandwidth, counting read + write bytes; the best of `repeats` copies
    of `nbytes` is the bound's bandwidth (the most the device showed it can move)."""
    samples = []
    if backend.name == "cuda":
        cupy = backend.cupy
        src = cupy.ones(nbytes // 4, dtype=cupy.float32)
        dst = cupy.empty_like(src)
        kind = cupy.cuda.runtime.memcpyDeviceToDevice
        stream = cupy.cuda.get_current_stream()
        for index in range(repeats + 1):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, kind, stream.ptr)
            stop.record(stream)
            stop.synchronize()
            if index:  # the first copy is a warm-up
                samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        nbytes = src.nbytes
        del src, dst
        cupy.get_default_memory_pool().free_all_blocks()
    elif backend.name == "cpu":
        nbytes = min(nbytes, 1 << 26)
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        for index in range(repeats + 1):
            start = time.perf_counter()
            np.copyto(dst, src)
            if index:
                samples.append(time.perf_counter() - start)
        nbytes = src.nbytes
    else:
        raise RlpError(f"bench decode: no copy-bandwidth measurement on {backend.label}")
    best, median = min(samples), statistics.median(samples)
    return {"method": "cudaMemcpyAsync device to device" if backend.name == "cuda" else "numpy copyto",
            "bytes_copied": nbytes, "counted_bytes": 2 * nbytes, "best_s": best, "median_s": median,
            "bytes_per_s": 2 * nbytes / best, "median_bytes_per_s": 2 * nbytes / median}


# ---------------------------------------------------------------- step records

@dataclass
class StepLog:
    """Timestamps after every generation step, with the output tokens each sequence held then."""

    sequences: int
    new_tokens: int
    time_limit: float | None = None
    start: float = 0.0
    times: list[float] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)  # total output tokens after each step
    stopped: bool = False
    #: where the engine tells (ours): {step index: the KV length of each sequence of a pure decode
    #: step}; None: tell pure decode steps from the output counts alone (HF)
    decode_kv: dict[int, list[int]] | None = None

    def begin(self) -> None:
        self.start = time.perf_counter()

    def record(self, total_outputs: int) -> bool:
        """Log one step; True when the time limit has run out."""
        now = time.perf_counter()
        self.times.append(now)
        self.outputs.append(int(total_outputs))
        return self.time_limit is not None and now - self.start > self.time_limit

    def decode_indices(self) -> list[int]:
        """Indices of the pure decode steps (never the first step: its time has no start)."""
        if self.decode_kv is None:
            return pure_decode_indices(self.outputs, self.sequences)
        return [i for i in sorted(self.decode_kv) if 0 < i < len(self.times)]

    def decode_steps(self) -> dict[int, float]:
        """{k: seconds} of the pure decode steps, k the output tokens per sequence after it (the mean,
        rounded down: sequences a few tokens apart after chunked prefill still give one k per step)."""
        return {self.outputs[i] // self.sequences: self.times[i] - self.times[i - 1] for i in self.decode_indices()}

    def kv_lengths(self, prompt_len: int, index: int) -> list[int]:
        """The KV length of every sequence in pure decode step `index` (as recorded, or from k)."""
        if self.decode_kv is not None:
            return self.decode_kv[index]
        return decode_kv_lengths(prompt_len, self.outputs[index] // self.sequences, self.sequences)

    def summary(self, config, prompt_len: int, scheme: str, bandwidth: float | None) -> dict:
        seconds = (self.times[-1] - self.start) if self.times else 0.0
        produced = self.outputs[-1] if self.outputs else 0
        indices = self.decode_indices()
        decode = self.decode_steps()
        out = {
            "complete": produced == self.sequences * self.new_tokens and not self.stopped,
            "sequences": self.sequences,
            "steps": len(self.times), "output_tokens": produced, "seconds": seconds,
            "tokens_per_s": produced / seconds if seconds else None,
            "first_step_s": (self.times[0] - self.start) if self.times else None,
            "decode_steps": len(indices),
            "decode_step_indices": [min(decode), max(decode)] if decode else None,
            "step_log": {"times_s": [t - self.start for t in self.times], "outputs": list(self.outputs)},
        }
        if self.decode_kv is not None:
            out["step_log"]["pure_decode"] = indices
        if indices:
            times = [self.times[i] - self.times[i - 1] for i in indices]
            total = sum(times)
            out.update({"decode_step_s_median": statistics.median(times), "decode_step_s_mean": total / len(times),
                        "decode_tokens_per_s": self.sequences * len(times) / total})
            byte_parts = [step_bytes(config, self.kv_lengths(prompt_len, i), scheme)
                          for i in indices]
            read = sum(parts["total"] for parts in byte_parts)
            out["decode_bytes_per_step_mean"] = read / len(times)
            out["decode_bytes_parts_mean"] = {key: sum(p[key] for p in byte_parts) / len(times)
                                              for key in byte_parts[0]}
            if bandwidth:
                bound = read / bandwidth
                out["bound_step_s_mean"] = bound / len(times)
                out["bound_fraction"] = bound / total
        return out


def pure_decode_indices(outputs: list[int], sequences: int) -> list[int]:
    """Indices i of the logged steps that were pure decode: before step i every sequence held
    k - 1 >= 1 output tokens and after it k (every sequence fed its last token, nothing else ran)."""
    n = sequences
    return [i for i in range(1, len(outputs))
            if outputs[i - 1] % n == 0 and outputs[i - 1] >= n and outputs[i] == outputs[i - 1] + n]


#: ModelRunner.step_records entries and the timing key of each (execute_s: launch and wait together)
RUNNER_PARTS = {"host_s": "runner_host_s", "wait_s": "runner_wait_s", "finish_s": "runner_finish_s",
                "host_sampler_s": "host_sampler_s"}


def engine_sampler(backend_name: str, sampler: str = "auto") -> tuple[dict, str]:
    """LLM keyword arguments for the sampler asked for, and its name. "auto": the device sampler on
    cuda when this engine has one, else the host sampler (the contract's NumPy reference)."""
    if sampler not in ("auto", "host", "device"):
        raise InputError(f"bench decode: unknown sampler {sampler!r} (auto, host, device)")
    if sampler == "auto":
        sampler = "device" if backend_name == "cuda" else "host"
    return {"sampler": sampler}, sampler


class _TimeLimit(Exception):
    """Raised from the engine's progress callback to stop a run that exceeds its time limit."""


@contextlib.contextmanager
def _timed_runner(llm, log: StepLog, timings: dict):
    """Reads the runner's record of every step (ModelRunner.step_records) while the benchmark runs:
    execute_s (its launch and wait calls) and their parts, keyed by the step's index in `log`, and the KV
    lengths of the steps that decode every sequence. Steps are recorded in the order they are launched,
    with asynchronous scheduling too, so the n-th record is step n of the log."""
    records = llm.runner.step_records = []
    try:
        yield
    finally:
        llm.runner.step_records = None
        log.decode_kv = {index: record["decode_kv"] for index, record in enumerate(records)
                         if record["decode_kv"] is not None and len(record["decode_kv"]) == log.sequences}
        for index, record in enumerate(records):
            timings.setdefault("execute_s", {})[index] = record["launch_s"] + record.get("wait_call_s", 0.0)
            for part, key in RUNNER_PARTS.items():
                if record.get(part) is not None:
                    timings.setdefault(key, {})[index] = record[part]


def random_prompts(config, sequences: int, prompt_len: int, seed: int = 1) -> np.ndarray:
    if sequences < 1 or prompt_len < 1:
        raise InputError(f"bench decode needs sequences >= 1 and prompt_len >= 1, got {sequences}, {prompt_len}")
    return np.random.default_rng(seed).integers(0, config.vocab_size, (sequences, prompt_len)).astype(np.int64)


# ---------------------------------------------------------------- ours

def measure_engine(backend, config, weights, prompts: np.ndarray, new_tokens: int, block_size: int = 16,
                   max_num_batched_tokens: int = 4096, time_limit: float | None = None,
                   bandwidth: float | None = None, sampler: str = "auto", progress=None,
                   cuda_graphs: bool | None = None, tp_group=None, async_scheduling: bool | None = None) -> dict:
    """Our engine on `backend`: warm-up (and every decode graph captured), then generate
    `new_tokens` tokens for every prompt. cuda_graphs, async_scheduling: the engine's options (None:
    its defaults).
    tp_group: a tensor-parallel rank (every rank calls this; no time limit then, or the ranks
    would stop at different steps)."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams

    if new_tokens < 1:
        raise InputError(f"bench decode needs new_tokens >= 1, got {new_tokens}")
    sequences, prompt_len = prompts.shape
    max_len = prompt_len + new_tokens
    sampler_kwargs, sampler = engine_sampler(backend.name, sampler)
    params = SamplingParams(n=1, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=new_tokens,
                            ignore_eos=True)  # no seed of its own: each request keyed by its index
    log = StepLog(sequences, new_tokens, time_limit)
    timings: dict[str, dict[int, float]] = {}
    tracker = PeakTracker(backend.cupy) if backend.name == "cuda" else contextlib.nullcontext()
    with tracker:
        if progress:
            progress("ours: building the model and the KV cache")
        llm = LLM(device=backend, block_size=block_size,
                  num_blocks=sequences * -(-max_len // block_size), max_num_seqs=sequences,
                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                  loaded=(config, weights, IdsOnlyTokenizer()), cuda_graphs=cuda_graphs, tp_group=tp_group,
                  async_scheduling=async_scheduling, **sampler_kwargs)
        if progress:
            progress("ours: warm-up")
        # one full prefill step's worth of prompts (as vLLM's start-up profiling run fills the token budget):
        # the first timed step then finds its 4,096-row activations' memory in the pool, not cudaMalloc.
        # Other ids than the timed prompts', so that no cache of any kind could serve the timed run.
        warm = min(sequences, max(4, llm.max_num_batched_tokens // max(prompt_len, 1)))
        warm_prompts = (prompts[:warm].astype(np.int64) + 1) % config.vocab_size
        llm.generate([row.tolist() for row in warm_prompts],
                     SamplingParams(temperature=1.0, max_tokens=min(new_tokens, 2), ignore_eos=True, seed=1))
        backend.synchronize()
        start = time.perf_counter()
        graphs = llm.runner.capture_graphs()
        backend.synchronize()
        capture_s = time.perf_counter() - start
        if progress:
            progress(f"ours: {sequences} sequences x {new_tokens} tokens"
                     + (f" (time limit {time_limit:.0f} s)" if time_limit else ""))
        ids = [row.tolist() for row in prompts]

        def on_step(done: int, _budget: int) -> None:
            if log.record(done):
                raise _TimeLimit

        with _timed_runner(llm, log, timings):
            log.begin()
            try:
                outputs = llm.generate(ids, params, progress=on_step)
            except _TimeLimit:
                log.stopped, outputs = True, None
        backend.synchronize()
    result = log.summary(config, prompt_len, "ours", bandwidth)
    result["peak_bytes"] = tracker.peak if backend.name == "cuda" else None
    result["engine"] = {"sampler": sampler, "block_size": block_size, "num_blocks": llm.num_blocks,
                        "max_num_seqs": sequences, "max_num_batched_tokens": llm.max_num_batched_tokens,
                        "max_model_len": max_len, "cuda_graphs": llm.runner.cuda_graphs,
                        "graphs": graphs, "graph_capture_s": capture_s, "async_scheduling": llm.async_scheduling}
    result["preemptions"] = llm.stats.preemptions if outputs is not None else None
    result["steps_ahead"] = llm.stats.steps_ahead if outputs is not None else None
    if outputs is not None:
        result["all_lengths_equal_new_tokens"] = all(len(c.token_ids) == new_tokens for r in outputs
                                                     for c in r.outputs)
    decode = log.decode_indices()
    for name, values in timings.items():  # where a pure decode step's time goes
        picked = [values[i] for i in decode if i in values]
        result[f"decode_{name}_median"] = statistics.median(picked) if picked else None
    del llm
    if backend.name == "cuda":
        backend.cupy.get_default_memory_pool().free_all_blocks()
    return result


# ---------------------------------------------------------------- peer

def hf_config(config):
    import transformers

    fields = {key: getattr(config, key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "tie_word_embeddings")}
    return transformers.Qwen3Config(**fields)


def measure_hf(config, prompts: np.ndarray, new_tokens: int, device: str = "cuda", time_limit: float | None = None,
               bandwidth: float | None = None, progress=None, static: bool = False) -> dict:
    """HF transformers Qwen3ForCausalLM, bf16, sdpa: generate on the same token-id prompts, twice. The first
    full-length call is the warm-up (its own numbers under "first_call"); the second is the peer. HF's first
    call in a process pays for every new KV length once (the caching allocator grows the cache tensor by
    tensor, kernels load and select per shape): in a fresh process 2.4-2.6x slower on the H200 than a later
    call with the same shapes, which is what a long-lived process (an RL loop) sees (docs/engine.md,
    "The peer is HF generate measured warm"). Each call gets the whole time limit; "warm" is False where
    the first call stopped early. static: HF's strongest generate setup, a static KV cache
    (cache_implementation="static") with the forward under torch.compile (mode "reduce-overhead", which
    replays CUDA graphs) on cuda; the first call compiles. On cpu (tests) the static cache runs uncompiled;
    result["setup"] says which ran."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise RlpError(f"bench decode needs torch and transformers for the peer (or --peer none): {error}") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise RlpError("bench decode: torch cannot see a CUDA device for the peer (or use --peer none)")
    sequences, prompt_len = prompts.shape
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    class Recorder(transformers.StoppingCriteria):
        """A timestamp after every generated token (after a sync) into `log`, and the time limit."""

        log: StepLog | None = None

        def __call__(self, input_ids, scores, **kwargs):
            stop = False
            if self.log is not None:
                sync()
                stop = self.log.record((input_ids.shape[1] - prompt_len) * sequences)
                self.log.stopped = self.log.stopped or stop
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    if progress:
        progress("HF transformers bf16 sdpa: building")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="sdpa",
                                                       dtype=torch.bfloat16).to(device).eval()
    hf.generation_config.eos_token_id = None
    compiled = static and device == "cuda"
    if compiled:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    cache = {"cache_implementation": "static"} if static else {}
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)  # equal-length prompts: no padding
    recorder = Recorder()

    def generate(tokens: int):
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                               top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=0,
                               stopping_criteria=transformers.StoppingCriteriaList([recorder]), **cache)

    def timed(what: str) -> tuple[dict, object]:
        if progress:
            progress(f"HF transformers bf16 sdpa: {sequences} sequences x {new_tokens} tokens ({what})")
        recorder.log = StepLog(sequences, new_tokens, time_limit)
        recorder.log.begin()
        out = generate(new_tokens)
        sync()
        summary, recorder.log = recorder.log.summary(config, prompt_len, "bf16", bandwidth), None
        return summary, out

    if progress:
        progress("HF transformers bf16 sdpa: warm-up")
    generate(min(new_tokens, 2))
    sync()
    first, first_out = timed("first call, the warm-up")  # each call gets the whole time limit
    del first_out
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result, out = timed("measured")
    result["first_call"] = {key: first.get(key) for key in ("complete", "tokens_per_s", "seconds",
                                                            "decode_step_s_median")}
    result["warm"] = bool(first["complete"])  # False: the first call stopped early, some lengths were new
    result["generated_shape"] = list(out.shape)
    result["setup"] = {"kv_cache": "static" if static else "dynamic", "torch_compile": compiled}
    result["peak_bytes"] = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    return result


# ---------------------------------------------------------------- the benchmark

def compare(ours: dict, hf: dict | None) -> dict:
    """Ratios of ours to the peer: end-to-end tokens/s (when both ran to the end), decode steps at
    the same step indices, peak memory."""
    if hf is None:
        return {}
    out = {}
    if ours["complete"] and hf["complete"]:
        out["throughput_ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
    else:
        out["throughput_ratio"] = None
    mine = _decode_by_index(ours)
    theirs = _decode_by_index(hf)
    common = sorted(set(mine) & set(theirs))
    if common:
        out["decode_step_ratio"] = sum(theirs[k] for k in common) / sum(mine[k] for k in common)
        out["decode_steps_compared"] = len(common)
    if ours.get("peak_bytes") and hf.get("peak_bytes"):
        out["memory_ratio"] = ours["peak_bytes"] / hf["peak_bytes"]
    return out


def _decode_by_index(result: dict) -> dict[int, float]:
    times, outputs = result["step_log"]["times_s"], result["step_log"]["outputs"]
    n = result["sequences"]
    indices = result["step_log"].get("pure_decode")
    if indices is None:
        indices = pure_decode_indices(outputs, n)
    return {outputs[i] // n: times[i] - times[i - 1] for i in indices}


def median_run(results: list[dict]) -> dict:
    """The run whose end-to-end tokens/s is the median (the lower middle one of an even count): a real
    run, with its own step log, rather than an average of several."""
    return sorted(results, key=lambda result: result["tokens_per_s"])[(len(results) - 1) // 2]


#: bench decode's peers: HF generate with its default (dynamic) KV cache, with a static cache under
#: torch.compile (HF's fastest generate setup), or none
PEERS = ("hf", "hf-static", "none")


def measure(backend, config, weights, sequences: int, prompt_len: int, new_tokens: int, peer: str = "hf",
            time_limit: float | None = None, sampler: str = "auto", progress=None,
            cuda_graphs: bool | None = None, async_scheduling: bool | None = None, runs: int = 1) -> dict:
    """The whole benchmark on any backend (the CLI's run() checks for cuda): copy bandwidth, then `runs`
    times ours and the peer in turn (HF on the same device kind; none with peer "none"), so that a drift of
    the machine or of the peer's host-bound rate falls on both. "ours" and "hf_bf16" are each side's median
    run and "ratios" compare those two; "runs" has every pair's numbers."""
    if peer not in PEERS:
        raise InputError(f"bench decode: unknown peer {peer!r} ({', '.join(PEERS)})")
    if not isinstance(runs, int) or runs < 1:
        raise InputError(f"bench decode: runs must be a positive integer, got {runs!r}")
    prompts = random_prompts(config, sequences, prompt_len)
    if progress:
        progress("copy bandwidth")
    bandwidth = copy_bandwidth(backend)
    ours_runs, hf_runs, peer_error = [], [], None
    for index in range(runs):
        if progress and runs > 1:
            progress(f"run {index + 1} of {runs}")
        ours_runs.append(measure_engine(backend, config, weights, prompts, new_tokens, time_limit=time_limit,
                                        bandwidth=bandwidth["bytes_per_s"], sampler=sampler, progress=progress,
                                        cuda_graphs=cuda_graphs, async_scheduling=async_scheduling))
        if peer != "none" and peer_error is None:
            try:
                hf_runs.append(measure_hf(config, prompts, new_tokens,
                                          device="cuda" if backend.name == "cuda" else "cpu",
                                          time_limit=time_limit, bandwidth=bandwidth["bytes_per_s"],
                                          progress=progress, static=peer == "hf-static"))
            except (RlpError, RuntimeError, ValueError, TypeError, AttributeError) as error:  # OOM, API changes
                peer_error = f"{type(error).__name__}: {error}"  # keep ours; no ratio from a partial peer
            _release_peer_memory(backend)
    peers = hf_runs if peer_error is None else []  # a peer that failed once gives no ratio at all
    ours, hf = median_run(ours_runs), median_run(peers) if peers else None
    # the process's first full-length HF call (run 1's warm-up; later runs' first calls meet known shapes)
    cold = peers[0]["first_call"] if peers else None
    ratios = compare(ours, hf)
    if cold and ours["complete"] and cold["complete"]:  # information only: the peer is the warm call
        ratios["throughput_ratio_first_call"] = ours["tokens_per_s"] / cold["tokens_per_s"]
    pairs = [{"ours_tokens_per_s": mine["tokens_per_s"], "hf_tokens_per_s": theirs["tokens_per_s"] if theirs else None,
              "ratios": compare(mine, theirs)}
             for mine, theirs in zip(ours_runs, peers + [None] * (runs - len(peers)))]
    lengths = [prompt_len + new_tokens // 2] * sequences
    return {
        "device": backend.info(), "model": "Qwen3 shape, random weights", "layers": config.num_hidden_layers,
        "config": {key: getattr(config, key) for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")},
        "sequences": sequences, "prompt_len": prompt_len, "new_tokens": new_tokens, "peer": peer,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "ignore_eos": True},
        "time_limit_s": time_limit,
        "copy_bandwidth": bandwidth,
        "step_bytes_at_mid_decode": {"kv_length": lengths[0], "ours": step_bytes(config, lengths, "ours"),
                                     "bf16": step_bytes(config, lengths, "bf16")},
        "ours": ours, "hf_bf16": hf, "hf_first_call": cold, "peer_error": peer_error, "ratios": ratios,
        "runs": pairs, "targets": dict(TARGETS),
    }


def _release_peer_memory(backend) -> None:
    """The HF model and its cache went out of scope with measure_hf: free them before the next run."""
    gc.collect()
    if backend.name == "cuda":
        with contextlib.suppress(ImportError):
            import torch

            torch.cuda.empty_cache()


def run_tensor_parallel(backend, tp_group, sequences: int = 256, prompt_len: int = 128, new_tokens: int = 256,
                        layers: int | None = None, sampler: str = "auto", progress=None) -> dict | None:
    """`rlportable bench decode --tp N`: the engine at TP=N (every rank), then, on rank 0 alone, the
    same workload at TP=1 with and without graphs; the scaling is TP=N tokens/s over TP=1's."""
    if backend.name != "cuda":
        raise RlpError(f"bench decode runs on the cuda backend; got {backend.label}")
    config = qwen3_06b_config(layers)
    weights = random_weights(config)
    prompts = random_prompts(config, sequences, prompt_len)
    bandwidth = copy_bandwidth(backend)["bytes_per_s"]
    say = progress if tp_group.rank == 0 else None
    sharded = measure_engine(backend, config, weights, prompts, new_tokens, bandwidth=bandwidth, sampler=sampler,
                             progress=say, cuda_graphs=False, tp_group=tp_group)
    if tp_group.rank:
        return None
    single = {graphs: measure_engine(backend, config, weights, prompts, new_tokens, bandwidth=bandwidth,
                                     sampler=sampler, progress=say, cuda_graphs=graphs) for graphs in (False, True)}

    def speed(result):
        return result["tokens_per_s"]

    return {
        "device": backend.info(), "model": "Qwen3 shape, random weights", "layers": config.num_hidden_layers,
        "sequences": sequences, "prompt_len": prompt_len, "new_tokens": new_tokens, "tp": tp_group.size,
        "group": tp_group.label, "ours_tp": sharded, "ours_tp1_eager": single[False], "ours_tp1_graphs": single[True],
        "scaling": {"tp_over_tp1_eager": speed(sharded) / speed(single[False]),
                    "tp_over_tp1_graphs": speed(sharded) / speed(single[True])},
    }


def run(backend, sequences: int = 256, prompt_len: int = 128, new_tokens: int = 512, layers: int | None = None,
        peer: str = "hf", time_limit: float | None = 240.0, sampler: str = "auto", progress=None,
        cuda_graphs: bool = True, async_scheduling: bool | None = None, runs: int = 1) -> dict:
    """`rlportable bench decode`: the Qwen3-0.6B-shaped model on cuda."""
    if backend.name != "cuda":
        raise RlpError(f"bench decode runs on the cuda backend (peer: HF transformers on CUDA); got {backend.label}")
    config = qwen3_06b_config(layers)
    if progress:
        progress("random weights")
    weights = random_weights(config)
    return measure(backend, config, weights, sequences, prompt_len, new_tokens, peer, time_limit, sampler, progress,
                   cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, runs=runs)
