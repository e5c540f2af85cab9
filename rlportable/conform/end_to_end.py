"""End-to-end conformance: the engine's recorded log-probs against the trainer's forward, bitwise.

One check `e2e.<configuration>` per change the contracts promise to survive:
  1. the rollout engine (LLM) samples completions of seeded token-id prompts under that configuration
     (batch size, position in the batch, prefill chunk size, KV block size, prefix sharing, preemption,
     CUDA graphs, temperature);
  2. the trainer recomputes the log-prob of every completion token the way GRPO's mismatch check does
     (train.trainer.pack into micro-batches, then completion_logprobs: model.backward.forward on the
     packed samples), in one or several packings (order, other sequences in the pack, padding);
  3. every log-prob is compared bit for bit, and beside the exact counts come the metrics people
     watch for the rollout/trainer gap (`logprob_metrics`: verl's rollout correction, slime).
The model is the tiny built-in one everywhere; on devices a seeded Qwen3-0.6B-shaped random-weight
model runs too, with larger workloads, so that a default run there compares over 10^6 log-probs.
Tensor parallelism (`e2e.tp-N`) is emulated on one device: N ranks as threads, each with its shard of the
model and the exact collectives done on the host (runtime/collectives.py ThreadGroup; the same per-rank
code NCCL ranks run). The engine samples at TP=N, the trainer recomputes at TP=1, and the model's own
log-prob forward at TP=N is compared too. A model whose shape TP=N cannot split is reported "not applicable".

A mismatch is localized by conform.e2e_bisect (first diverging op, layer, token and element, found by
replaying the engine and the trainer with every layer's intermediate values recorded) and leaves a
reproducer (.npz + .json) in the run's Settings.repro_dir (`rlportable conform --repro-dir`).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field

import numpy as np

from rlportable.conform.e2e_bisect import locate
from rlportable.conform.tally import Settings, SettingsCheck, Tally
from rlportable.engine.sequence import SamplingParams

TINY = "tiny"
QWEN3_06B = "qwen3-0.6b-shape"
QWEN3_06B_SEED = 0  # model/synthetic.py's random_weights seed
TRAINER_TOKENS = {"cpu": 2048, "device": 16384}  # the trainer's micro-batch budget (tokens per forward)
PACKINGS = ("in-order", "alone", "reversed", "shuffled", "padded", "fillers")
MIXED_TEMPERATURES = (1.0, 0.7, 1.3, 0.0)  # a mixed workload cycles through these (0 = greedy)
PAD_TOKEN = 0
PAD_MULTIPLE = 16
SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exponentiating (chi-square)


# ----------------------------------------------------------------------------- metrics


def logprob_metrics(engine: list[np.ndarray], trainer: list[np.ndarray]) -> dict:
    """The rollout/trainer mismatch metrics people already log, per sequence lists of float32 log-probs.

    d = trainer - engine (verl's log_ratio = old_log_prob - rollout_log_prob), in float64, 0 where
    the bits agree (so equal infinities give 0). Definitions followed:
      mean_abs_dlogp  slime's train_rollout_logprob_abs_diff: the per-sample token mean of |d|,
                      averaged over samples (THUDM/slime slime/backends/megatron_utils/loss.py)
      max_abs_dlogp   max |d| over tokens
      k3_kl, log_ppl_diff, chi2_token, chi2_seq: verl's compute_offpolicy_metrics
                      (volcengine/verl verl/trainer/ppo/rollout_corr_helper.py): token mean of
                      exp(d) - d - 1; mean over samples of (mean engine - mean trainer log-prob);
                      token mean of exp(clamp(d, +-20))^2 - 1; sample mean of
                      exp(2 clamp(sum d, +-20)) - 1.
    Bitwise equal inputs give exactly 0 for every metric. Non-finite results are None (JSON)."""
    pairs = [(np.asarray(e, np.float32), np.asarray(t, np.float32)) for e, t in zip(engine, trainer)]
    pairs = [(e, t) for e, t in pairs if e.size]
    if not pairs:
        return {"tokens": 0}
    with np.errstate(all="ignore"):  # inf - inf where the bits differ gives NaN, reported as None
        diffs = [np.where(e.view(np.uint32) == t.view(np.uint32), 0.0,
                          t.astype(np.float64) - e.astype(np.float64)) for e, t in pairs]
        d = np.concatenate(diffs)
        metrics = {
            "mean_abs_dlogp": float(np.mean([np.mean(np.abs(x)) for x in diffs])),
            "max_abs_dlogp": float(np.max(np.abs(d))),
            "k3_kl": float(np.mean(np.exp(d) - d - 1.0)),
            "log_ppl_diff": float(np.mean([e.astype(np.float64).mean() - t.astype(np.float64).mean()
                                           for e, t in pairs])),
            "chi2_token": float(np.mean(np.exp(np.clip(d, -SAFETY_BOUND, SAFETY_BOUND)) ** 2) - 1.0),
            "chi2_seq": float(np.mean([np.exp(2.0 * np.clip(x.sum(), -SAFETY_BOUND, SAFETY_BOUND))
                                       for x in diffs]) - 1.0),
        }
    return {"tokens": int(d.size), **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()}}


METRIC_COLUMNS = (("mean_abs_dlogp", "mean |dlogp|"), ("max_abs_dlogp", "max |dlogp|"), ("k3_kl", "k3 KL"),
                  ("log_ppl_diff", "log-ppl diff"), ("chi2_token", "chi2 token"), ("chi2_seq", "chi2 seq"))


def metric_cells(metrics: dict) -> list[str]:
    return ["-" if metrics.get(key) is None else f"{metrics[key]:.3g}" for key, _ in METRIC_COLUMNS]


def not_applicable(result) -> bool:
    """An end-to-end check none of whose models could run it (e.g. TP=8 of a 4-head model)."""
    parts = ((result.details or {}).get("models") or {}).values()
    return bool(parts) and all(part.get("status") == "not applicable" for part in parts)


def metrics_table(results) -> tuple[list[list], list[str]]:
    """(rows, headers) of the end-to-end checks: one row per check and model, exact counts and metrics."""
    rows = []
    for result in results:
        details = result.details or {}
        for model, part in details.get("models", {}).items():
            if part.get("status") == "not applicable":
                rows.append([result.name, model, 0, 0] + ["-"] * len(METRIC_COLUMNS) + ["not applicable"])
                continue
            where = part.get("first_divergence")
            note = ("" if where is None else
                    f"first divergence: {where['op']} layer {where['layer']} token {where['position']}")
            rows.append([result.name, model, part["compared"], part["mismatches"], *metric_cells(part["metrics"]),
                         note])
    return rows, ["check", "model", "compared", "mismatches", *(title for _, title in METRIC_COLUMNS), "note"]


# ----------------------------------------------------------------------------- models and workloads


@dataclass
class Loaded:
    spec: str
    model: object  # rlportable.model.forward.Model, shared by the engine and the trainer (as in GRPO)
    tokenizer: object
    weights: object  # the host ModelWeights (reproducers take small weights from here)
    describe: dict


_LOADED: dict = {}


def load(backend, spec: str, quick: bool) -> Loaded:
    """The tiny model or the seeded Qwen3-0.6B-shaped one (2 layers with --quick) on `backend`,
    encoded once per run and reused by every check."""
    from rlportable.model.forward import Model

    key = (type(backend).__name__, backend.kernel_vendor, spec, quick if spec == QWEN3_06B else None)
    if key not in _LOADED:
        if spec == TINY:
            from rlportable.model.tiny import tiny_model

            config, weights, tokenizer = tiny_model()
            describe = {"name": TINY, "weights": "rlportable.model.tiny.tiny_model() (seed 0)"}
        else:
            from rlportable.model.synthetic import IdsOnlyTokenizer
            from rlportable.model.synthetic import qwen3_06b_config, random_weights

            layers = 2 if quick else None
            config = qwen3_06b_config(layers)
            weights, tokenizer = random_weights(config, QWEN3_06B_SEED), IdsOnlyTokenizer()
            describe = {"name": QWEN3_06B, "layers": config.num_hidden_layers,
                        "weights": f"rlportable.model.synthetic.random_weights(qwen3_06b_config({layers}), "
                                   f"seed={QWEN3_06B_SEED})"}
        for other in [k for k in _LOADED if k[:3] == key[:3]]:
            del _LOADED[other]  # one copy of a model per backend kind
        _LOADED[key] = Loaded(spec, Model(backend, config, weights), tokenizer, weights, describe)
    return _LOADED[key]


def models_for(backend) -> tuple[str, ...]:
    return (TINY,) if backend.on_host else (TINY, QWEN3_06B)


@dataclass(frozen=True)
class Size:
    requests: int
    n: int  # samples per request
    prompt: tuple[int, int]  # prompt length range, inclusive
    max_tokens: int
    fixed_length: bool = False  # every request generates max_tokens (controls the count of compared tokens)


# (model, tier) -> scale -> Size; tiers: cpu-quick, cpu, device-quick, device
_TINY_SMALL = {"cpu-quick": Size(6, 2, (1, 40), 8), "cpu": Size(12, 2, (1, 70), 24),
               "device-quick": Size(6, 2, (1, 40), 8), "device": Size(32, 2, (1, 100), 48)}
SIZES = {
    TINY: {
        "small": _TINY_SMALL, "large": _TINY_SMALL, "packing": _TINY_SMALL,
        "batch-256": {"cpu-quick": Size(64, 4, (1, 8), 2, True), "cpu": Size(64, 4, (1, 24), 6, True),
                      "device-quick": Size(64, 4, (1, 8), 2, True), "device": Size(64, 4, (1, 48), 32, True)},
        "long-prompts": {"cpu-quick": Size(3, 1, (40, 120), 4), "cpu": Size(6, 1, (100, 300), 8),
                         "device-quick": Size(3, 1, (40, 120), 4), "device": Size(16, 1, (200, 600), 32)},
    },
    QWEN3_06B: {  # devices only
        "small": {"device-quick": Size(4, 2, (1, 40), 16), "device": Size(8, 2, (1, 100), 64)},
        "large": {"device-quick": Size(4, 2, (1, 40), 16), "device": Size(64, 4, (16, 128), 256, True)},
        "packing": {"device-quick": Size(4, 2, (1, 40), 16), "device": Size(64, 4, (16, 128), 512, True)},
        "batch-256": {"device-quick": Size(64, 4, (1, 16), 4, True), "device": Size(64, 4, (16, 128), 512, True)},
        "long-prompts": {"device-quick": Size(2, 1, (100, 300), 4), "device": Size(8, 1, (500, 2000), 16)},
    },
}


def tier(backend, quick: bool) -> str:
    return ("cpu" if backend.on_host else "device") + ("-quick" if quick else "")


def workload(rng, vocab: int, size: Size, temperature: float | None, prefix: list[int] = ()) -> tuple[list, list]:
    """Seeded token-id prompts (`prefix` + a random part) and their SamplingParams: n samples each,
    temperature fixed or cycling through MIXED_TEMPERATURES, every 4th request stopping at eos."""
    prompts, params = [], []
    for index in range(size.requests):
        length = int(rng.integers(size.prompt[0], size.prompt[1] + 1))
        prompts.append(list(prefix) + rng.integers(0, vocab, length).tolist())
        tokens = size.max_tokens if size.fixed_length else int(rng.integers(max(1, size.max_tokens // 2),
                                                                             size.max_tokens + 1))
        t = MIXED_TEMPERATURES[index % len(MIXED_TEMPERATURES)] if temperature is None else temperature
        params.append(SamplingParams(n=size.n, temperature=t, max_tokens=tokens, seed=int(rng.integers(1 << 62)),
                                     ignore_eos=size.fixed_length or index % 4 != 3))
    return prompts, params


# ----------------------------------------------------------------------------- the engine side


@dataclass
class Completion:
    request: int
    sample: int
    prompt: list[int]
    tokens: list[int]
    logprobs: np.ndarray  # float32, as the engine recorded them
    temperature: float  # the log-probs' temperature (greedy records T = 1)


@dataclass
class EngineRun:
    """One generate() call: the LLM's keyword arguments, token-id prompts, their SamplingParams."""

    engine: dict
    prompts: list
    params: list
    label: str = "run"

    def generate(self, loaded: Loaded, recorder=None, eager: bool = False) -> tuple[list[Completion], dict]:
        """Sample with a fresh LLM on the loaded model; eager: no graphs (a recorder reads every op).
        engine["tp"] > 1: on that many emulated tensor-parallel ranks (rank 0's outputs)."""
        from rlportable.engine.llm import LLM

        engine = dict(self.engine)
        tp = engine.pop("tp", 1)
        if eager and loaded.model.backend.supports_graphs:
            engine["cuda_graphs"] = False
        if tp > 1:
            outputs, llm = tensor_parallel_generate(loaded, tp, engine, self.prompts, self.params)
        else:
            llm = LLM(device=loaded.model.backend, loaded=(loaded.model, loaded.tokenizer), **engine)
            if recorder is not None:
                recorder.attach_engine(llm.runner)
            try:
                outputs = llm.generate(self.prompts, self.params)
            finally:
                if recorder is not None:
                    recorder.detach_engine(llm.runner)
            llm.release_kv_cache()
        completions = [Completion(r.request_id, c.index, list(r.prompt_token_ids), list(c.token_ids),
                                  np.asarray(c.logprobs, dtype=np.float32),
                                  self.params[r.request_id].temperature or 1.0)
                       for r in outputs for c in r.outputs]
        return completions, {"steps": llm.stats.steps, "preemptions": llm.stats.preemptions,
                             "steps_ahead": llm.stats.steps_ahead}

    def describe(self) -> dict:
        return {"label": self.label, "engine": self.engine, "requests": len(self.prompts),
                "sequences": sum(p.n for p in self.params)}


def tensor_parallel_generate(loaded: Loaded, tp: int, engine: dict, prompts, params):
    """(rank 0's outputs, its LLM) of generate() on `tp` emulated ranks; every rank must agree."""
    from rlportable.engine.llm import LLM
    from rlportable.model.forward import Model
    from rlportable.runtime.collectives import run_threads

    backend = loaded.model.backend

    def rank(tp_group):
        model = Model(backend, loaded.model.config, loaded.weights, tp_group=tp_group)
        llm = LLM(device=backend, loaded=(model, loaded.tokenizer), **engine)
        outputs = llm.generate(prompts, params)
        llm.release_kv_cache()
        return outputs, llm

    results = run_threads(backend, tp, rank)
    tokens = [[[c.token_ids for c in r.outputs] for r in outputs] for outputs, _ in results]
    if any(t != tokens[0] for t in tokens[1:]):
        raise AssertionError(f"the {tp} emulated ranks sampled different tokens")
    return results[0]


def tensor_parallel_forward(loaded: Loaded, tp: int, completions: list[Completion]) -> list[np.ndarray]:
    """Per completion, its tokens' log-probs from Model.logprobs at `tp` emulated ranks (prompt +
    completion packed, one forward per temperature)."""
    from rlportable.model.forward import Model
    from rlportable.runtime.collectives import run_threads

    backend = loaded.model.backend
    out: list = [None] * len(completions)
    for temperature in dict.fromkeys(c.temperature for c in completions):
        indices = [i for i, c in enumerate(completions) if c.temperature == temperature and c.tokens]
        sequences = [completions[i].prompt + completions[i].tokens for i in indices]
        tokens = np.concatenate([np.asarray(s, np.int32) for s in sequences])
        cu = np.concatenate([[0], np.cumsum([len(s) for s in sequences])]).astype(np.int64)
        results = run_threads(backend, tp, lambda tp_group: Model(backend, loaded.model.config, loaded.weights,
                                                                  tp_group=tp_group).logprobs(tokens, cu, temperature))
        for i, logp in zip(indices, results[0]):
            first = len(completions[i].prompt) - 1
            out[i] = np.asarray(logp[first: first + len(completions[i].tokens)], np.float32)
    return [np.zeros(0, np.float32) if o is None else o for o in out]


def base_engine(loaded: Loaded, backend, prompts, params, scale: str) -> dict:
    """The LLM arguments every configuration starts from (it overrides some)."""
    longest = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
    engine = {"block_size": 16, "max_num_seqs": 256 if scale in ("large", "packing", "batch-256") else 64,
              "max_num_batched_tokens": 4096, "max_model_len": longest}
    if loaded.spec == QWEN3_06B:  # the host sampler takes ~50 ms a row at a 151,936 vocabulary
        engine["sampler"] = "device"
    return engine


# ----------------------------------------------------------------------------- the trainer side


@dataclass
class PackRef:
    """Where the trainer computed a completion: its micro-batch, the offset of its first token there."""

    batch: object  # train.trainer.MicroBatch
    index: int  # the completion's sample index in batch.samples
    start: int
    temperature: float
    packing: str


def _assembled(entries) -> tuple[object, list[int]]:
    """A MicroBatch of (tokens, sample or None) sequences: only samples' completion tokens are scored
    (padding and filler sequences are not); and each sample's first-token offset."""
    from rlportable.train.trainer import MicroBatch

    tokens, cu, rows, starts = [], [0], [], []
    for sequence, sample in entries:
        start = cu[-1]
        if sample is not None:
            first = start + len(sample.prompt_ids) - 1
            rows.append(np.arange(first, first + len(sample.completion_ids)))
            starts.append(start)
        tokens.extend(sequence)
        cu.append(start + len(sequence))
    samples = [sample for _, sample in entries if sample is not None]
    return MicroBatch(samples, np.asarray(tokens, np.int32), np.asarray(cu, np.int64),
                      np.concatenate(rows).astype(np.int64), np.cumsum([r.size for r in rows])[:-1]), starts


def micro_batches(samples: list, packing: str, budget: int, rng, vocab: int):
    """[(MicroBatch, indices of its samples, their offsets)] for one packing:
    in-order, alone, reversed, shuffled (smaller budget): train.trainer.pack itself; padded: each pack's
    samples right-padded with token 0 to a common length; fillers: random unscored sequences between them."""
    from rlportable.train.trainer import pack

    order = {"reversed": list(reversed(range(len(samples)))),
             "shuffled": rng.permutation(len(samples)).tolist()}.get(packing, list(range(len(samples))))
    size = {"alone": 1, "shuffled": max(1, budget // 3)}.get(packing, budget)
    batches, done = [], 0
    for batch in pack([samples[i] for i in order], size):
        members = order[done: done + len(batch.samples)]
        done += len(batch.samples)
        if packing == "padded":
            width = -(-max(s.length for s in batch.samples) // PAD_MULTIPLE) * PAD_MULTIPLE
            batch, starts = _assembled([(s.prompt_ids + s.completion_ids + [PAD_TOKEN] * (width - s.length), s)
                                        for s in batch.samples])
        elif packing == "fillers":
            entries = []
            for s in batch.samples:
                entries += [(rng.integers(0, vocab, int(rng.integers(1, 48))).tolist(), None),
                            (s.prompt_ids + s.completion_ids, s)]
            batch, starts = _assembled(entries)
        else:
            starts = batch.cu_seqlens[:-1].tolist()
        batches.append((batch, members, starts))
    return batches


def trainer_logprobs(loaded: Loaded, completions: list[Completion], packing: str, budget: int, rng):
    """Per completion (trainer's float32 log-probs, PackRef): samples of one temperature per forward."""
    from rlportable.train.trainer import Sample, completion_logprobs

    out: list = [None] * len(completions)
    for temperature in dict.fromkeys(c.temperature for c in completions):
        indices = [i for i, c in enumerate(completions) if c.temperature == temperature]
        samples = [Sample(completions[i].prompt, completions[i].tokens) for i in indices]
        for batch, members, starts in micro_batches(samples, packing, budget, rng,
                                                    loaded.model.config.vocab_size):
            _, logps = completion_logprobs(loaded.model, batch, temperature)
            for k, (member, start, logp) in enumerate(zip(members, starts, logps)):
                out[indices[member]] = (np.asarray(logp, np.float32),
                                        PackRef(batch, k, start, temperature, packing))
    return out


# ----------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Sweep:
    name: str
    what: str
    engine: dict = field(default_factory=dict)
    scale: str = "small"
    temperature: float | None = None  # None: a mix of temperatures (and greedy)
    packings: tuple = ("in-order",)
    kind: str = "plain"  # plain, position, sharing-on, sharing-off, preemption, tp


SWEEPS = [
    Sweep("batch-1", "max_num_seqs 1", {"max_num_seqs": 1}),
    Sweep("batch-7", "max_num_seqs 7", {"max_num_seqs": 7}),
    Sweep("batch-64", "max_num_seqs 64", {"max_num_seqs": 64}, scale="large"),
    Sweep("batch-256", "max_num_seqs 256, 256 sequences", {"max_num_seqs": 256}, scale="batch-256"),
    Sweep("batch-position", "one request alone (max_num_seqs 1) and at row 5 among others", kind="position"),
    Sweep("packing", "the trainer packs in order, alone, reversed, shuffled, right-padded, with fillers",
          scale="packing", packings=PACKINGS),
    Sweep("prefill-chunk-small", "max_num_batched_tokens 5 (chunked prefill)",
          {"max_num_seqs": 4, "max_num_batched_tokens": 5}),
    Sweep("prefill-chunk-large", "max_num_batched_tokens 16384, long prompts in one chunk",
          {"max_num_batched_tokens": 16384}, scale="long-prompts"),
    Sweep("block-1-token", "KV block size 1", {"block_size": 1}),
    Sweep("block-16-tokens", "KV block size 16", {"block_size": 16}),
    Sweep("block-32-tokens", "KV block size 32", {"block_size": 32}),
    Sweep("prefix-sharing-on", "prefix caching on, n=4 groups forked, a shared system prefix",
          {"enable_prefix_caching": True}, kind="sharing-on"),
    Sweep("prefix-sharing-off", "prefix caching off, no fork (the same prompts as n=1 requests)",
          {"enable_prefix_caching": False}, kind="sharing-off"),
    Sweep("preemption", "a KV cache of one sequence and a block: preemption by recompute",
          {"max_num_seqs": 16}, kind="preemption"),
    Sweep("cuda-graphs-on", "decode through CUDA/HIP graphs (cpu: padded buckets, eager)",
          {"cuda_graphs": True}, scale="large"),
    Sweep("cuda-graphs-off", "decode eagerly at exact sizes", {"cuda_graphs": False}, scale="large"),
    Sweep("async-scheduling-on", "the device sampler, decode buckets, each decode step planned and launched while "
          "the one before runs, fed its tokens on the device",
          {"sampler": "device", "cuda_graphs": True, "async_scheduling": True}, scale="large"),
    Sweep("async-scheduling-off", "the device sampler, decode buckets, steps in turn",
          {"sampler": "device", "cuda_graphs": True, "async_scheduling": False}, scale="large"),
    Sweep("temperature-0.7", "temperature 0.7", scale="large", temperature=0.7),
    Sweep("temperature-1.0", "temperature 1.0", scale="large", temperature=1.0),
    Sweep("temperature-1.3", "temperature 1.3", scale="large", temperature=1.3),
    Sweep("tp-2", "tensor-parallel degree 2, emulated on one device", {"tp": 2}, kind="tp"),
    Sweep("tp-4", "tensor-parallel degree 4, emulated on one device", {"tp": 4}, kind="tp"),
    Sweep("tp-8", "tensor-parallel degree 8, emulated on one device", {"tp": 8}, kind="tp"),
]


def engine_runs(sweep: Sweep, loaded: Loaded, backend, size: Size, rng) -> list[EngineRun]:
    """The generate() calls of one configuration."""
    vocab = loaded.model.config.vocab_size
    if sweep.kind in ("sharing-on", "sharing-off"):
        prefix = rng.integers(0, vocab, 40 if size.prompt[1] > 40 else 20).tolist()
        prompts, params = workload(rng, vocab, Size(size.requests, 4, (1, max(1, size.prompt[1] // 2)),
                                                    size.max_tokens), sweep.temperature, prefix)
        prompts.append(list(prompts[0]))  # the same prompt twice: whole blocks from the cache
        params.append(params[0])
        if sweep.kind == "sharing-off":  # every sample its own request: nothing forked, nothing cached
            prompts = [p for p in prompts for _ in range(4)]
            params = [SamplingParams(**{**_fields(q), "n": 1, "seed": q.seed + k}) for q in params for k in range(4)]
    else:
        prompts, params = workload(rng, vocab, size, sweep.temperature)
    engine = {**base_engine(loaded, backend, prompts, params, sweep.scale), **sweep.engine}
    if sweep.kind == "preemption":  # room for the longest sequence and one more block
        longest = max(len(p) + q.max_tokens - 1 for p, q in zip(prompts, params))
        engine["num_blocks"] = -(-longest // engine["block_size"]) + 1
    if sweep.kind == "position":
        return position_runs(engine, prompts, params)
    return [EngineRun(engine, prompts, params, sweep.name)]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


PROBE_ROW = 5


def position_runs(engine: dict, prompts: list, params: list) -> list[EngineRun]:
    """The probe (request PROBE_ROW, one sample) alone: PROBE_ROW one-token stubs before it and
    max_num_seqs 1; and among others: the workload's requests before and after it, decoding with it."""
    others = [SamplingParams(**{**_fields(q), "n": 1, "max_tokens": max(q.max_tokens, 2)}) for q in params]
    probe_prompt, probe = prompts[0], SamplingParams(**{**_fields(params[0]), "n": 1})
    stubs = [[1]] * PROBE_ROW
    stub = SamplingParams(max_tokens=1, seed=1, ignore_eos=True)
    alone = EngineRun({**engine, "max_num_seqs": 1}, stubs + [probe_prompt], [stub] * PROBE_ROW + [probe], "alone")
    among_prompts = prompts[1:PROBE_ROW + 1] + [probe_prompt] + prompts[PROBE_ROW + 1:]
    among_params = others[1:PROBE_ROW + 1] + [probe] + others[PROBE_ROW + 1:]
    while len(among_prompts) <= PROBE_ROW:  # small workloads: more company
        among_prompts.insert(0, list(prompts[-1]))
        among_params.insert(0, others[-1])
    return [alone, EngineRun(engine, among_prompts, among_params, "among")]


# ----------------------------------------------------------------------------- the check


class E2ETally(Tally):
    """A Tally with the check's own report (CheckResult.details): per model, counts and metrics."""

    def __init__(self):
        super().__init__()
        self.details: dict = {"models": {}}


@dataclass
class Failure:
    """The first completion token whose log-prob differs: enough to replay both sides."""

    check: str
    run: EngineRun
    completion: Completion
    index: int  # the output token's index in the completion
    engine_logprob: np.float32
    trainer_logprob: np.float32
    pack: PackRef


def first_mismatch(check: str, run: EngineRun, completions, trainer) -> Failure | None:
    for completion, (logp, ref) in zip(completions, trainer):
        bad = np.flatnonzero(completion.logprobs.view(np.uint32) != logp.view(np.uint32))
        if bad.size:
            j = int(bad[0])
            return Failure(check, run, completion, j, completion.logprobs[j], logp[j], ref)
    return None


def run_model(check: str, sweep: Sweep, loaded: Loaded, backend, rng, quick: bool, tally: Tally,
              settings: Settings = Settings()) -> dict:
    """One configuration on one model: generate, recompute in each packing, compare, measure, localize."""
    size = SIZES[loaded.spec][sweep.scale][tier(backend, quick)]
    budget = TRAINER_TOKENS["cpu" if backend.on_host else "device"]
    runs = engine_runs(sweep, loaded, backend, size, rng)
    part = {"compared": 0, "mismatches": 0, "sequences": 0, "completion_tokens": 0, "runs": [],
            "packings": list(sweep.packings)}
    engine_lp, trainer_lp, failure, generated = [], [], None, {}
    before = (tally.compared, tally.mismatches)
    for run in runs:
        completions, stats = run.generate(loaded)
        generated[run.label] = completions
        part["runs"].append({**run.describe(), **stats})
        part["sequences"] += len(completions)
        part["completion_tokens"] += sum(c.logprobs.size for c in completions)
        for packing in sweep.packings:
            trainer = trainer_logprobs(loaded, completions, packing, budget, rng)
            for completion, (logp, _) in zip(completions, trainer):
                tally.add(logp, completion.logprobs)
                engine_lp.append(completion.logprobs)
                trainer_lp.append(logp)
            failure = failure or first_mismatch(check, run, completions, trainer)
    if sweep.kind == "position":
        part["engine_vs_engine"] = compare_probe(generated["alone"], generated["among"], tally)
    if sweep.kind == "tp":
        part["forward_at_tp_vs_engine"] = compare_forward_at_tp(loaded, sweep.engine["tp"], generated, tally)
    part["compared"], part["mismatches"] = tally.compared - before[0], tally.mismatches - before[1]
    part["metrics"] = logprob_metrics(engine_lp, trainer_lp)
    if sweep.kind == "preemption" and not any(r["preemptions"] for r in part["runs"]):
        part["note"] = "no sequence was preempted: the configuration did not exercise preemption"
    if failure is not None:
        part.update(locate(loaded, failure, reproduce_command(backend, check, quick, settings), settings.repro_dir))
    return part


def compare_probe(alone: list[Completion], among: list[Completion], tally: Tally) -> dict:
    """The probe request's tokens and log-prob bits, alone against among others."""
    (solo,) = [c for c in alone if c.request == PROBE_ROW]
    (crowd,) = [c for c in among if c.request == PROBE_ROW]
    before = (tally.compared, tally.mismatches)
    tally.add(np.asarray(crowd.tokens, np.int32), np.asarray(solo.tokens, np.int32))
    tally.add(crowd.logprobs, solo.logprobs)
    return {"compared": tally.compared - before[0], "mismatches": tally.mismatches - before[1]}


def compare_forward_at_tp(loaded: Loaded, tp: int, generated: dict, tally: Tally) -> dict:
    """Model.logprobs at TP=tp on every completion, bitwise against the engine's records."""
    before = (tally.compared, tally.mismatches)
    for completions in generated.values():
        for completion, logp in zip(completions, tensor_parallel_forward(loaded, tp, completions)):
            tally.add(logp, completion.logprobs)
    return {"compared": tally.compared - before[0], "mismatches": tally.mismatches - before[1]}


def reproduce_command(backend, check: str, quick: bool, settings: Settings) -> str:
    args = ["rlportable", "conform", "--device", backend.name]
    if backend.name == "cuda" and backend.kernel_vendor == "hip":
        args += ["--kernel-source", "hip"]
    args += ["--only", check, "--seed", str(settings.seed)] + (["--quick"] if quick else [])
    return shlex.join(args + ["--repro-dir", str(settings.repro_dir)])


def cannot_split(loaded: Loaded, sweep: Sweep) -> str | None:
    """Why the model's shape cannot be cut `tp` ways (None if it can, or for other sweeps)."""
    from rlportable.errors import InputError
    from rlportable.model.parallel import TensorParallel

    if sweep.kind != "tp":
        return None
    try:
        TensorParallel(0, sweep.engine["tp"]).check(loaded.model.config)
    except InputError as error:
        return str(error)
    return None


def make_check(sweep: Sweep) -> SettingsCheck:
    check_name = f"e2e.{sweep.name}"

    def check(backend, rng, quick: bool, settings: Settings):
        tally = E2ETally()
        tally.details["what"] = sweep.what
        for spec in models_for(backend):
            loaded = load(backend, spec, quick)
            reason = cannot_split(loaded, sweep)
            tally.details["models"][spec] = ({"status": "not applicable", "reason": reason} if reason else
                                             run_model(check_name, sweep, loaded, backend, rng, quick, tally,
                                                       settings))
        return tally

    check.__name__ = f"check_e2e_{sweep.name.replace('-', '_').replace('.', '_')}"
    return SettingsCheck(check)


E2E_CHECKS = [(f"e2e.{sweep.name}", make_check(sweep)) for sweep in SWEEPS]
