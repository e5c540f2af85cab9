"""GRPO: the engine samples G completions per prompt, rewards rank them inside their group, and the
trainer follows the clipped surrogate (TRL's GRPOTrainer semantics, train/objectives.py).

Engine and trainer share one Model: its float32 `params` are the weights the
optimiser updates in place and the engine samples from (never copied). The KV
cache is released for training and allocated again for the next rollout.

The old log-probs are the engine's. Before the first optimiser step of a
rollout the trainer recomputes every completion token's log-prob, and the
contracts make them bitwise equal: each step logs the mismatch count and the
max |dlogp| (0 and 0) and the ratio's range on the first pass (1 and 1), and a
single differing bit stops the run with LogprobMismatchError. For Qwen3-MoE the engine
also records each completion token's expert choices and the trainer recomputes them:
routing_mismatches (0) beside logp_mismatches, and a difference stops the run with
RoutingMismatchError (the router logits are exact, so there is nothing to replay).

Data order: epoch e visits the dataset in the permutation of PCG64([seed, e]);
step s takes the next `prompts_per_step` records. The engine's sampling seed of
step s is derived from (seed, s). So a run's result is a function of its
settings, and `--resume` continues it bitwise. Evaluation on held-out prompts
(train/evaluation.py) samples under request ids of its own and leaves the run's
bits as they are.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from rlportable.engine.llm import LLM
from rlportable.engine.sequence import SamplingParams, SamplingParamsError
from rlportable.errors import InputError, RlpError
from rlportable.model.config import ModelError
from rlportable.model.forward import Model
from rlportable.runtime.collectives import Group
from rlportable.train import objectives
from rlportable.train.data_parallel import Replicas
from rlportable.train.datafiles import is_chat
from rlportable.train.evaluation import EVAL_REQUEST_BASE, eval_due, evaluate
from rlportable.train.metrics import PhaseClock
from rlportable.train.optimizer import OptimiserSettings, Optimizer
from rlportable.train.rewards import RewardSet, batch_from_records
from rlportable.train.trainer import (Sample, completion_logprobs, completion_routing, load_balancing_scale,
                                      micro_batch_gradients, pack)


class LogprobMismatchError(RlpError):
    """The trainer's recomputed log-probs differ from the engine's: the contract is broken."""


class RoutingMismatchError(RlpError):
    """The trainer's recomputed expert choices (Qwen3-MoE) differ from the engine's: the contract is broken."""


@dataclass(frozen=True)
class GRPOConfig(OptimiserSettings):
    steps: int = 20
    prompts_per_step: int = 8
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False   # every completion runs to max_completion_length (the eos does not stop it)
    sampler: str = "host"      # the engine's: "host" or "device" (the same tokens and log-probs either way)
    learning_rate: float = 1e-6
    adam_beta2: float = 0.99
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    importance_sampling_level: str = "token"  # "sequence": GSPO (TRL's option), for dense and MoE models
    num_iterations: int = 1
    mini_batches: int = 1
    block_size: int = 16
    max_prompt_length: int | None = None  # longer prompts keep their last tokens (TRL's left truncation)
    mask_truncated_completions: bool = False  # DAPO: completions cut at max_completion_length leave the loss
    # evaluation on held-out prompts (train/evaluation.py); not part of what a run computes, so left out
    # of the settings a --resume compares and a checkpoint keeps (train/prepare.py settings_dict)
    eval_every: int | None = None     # steps between evaluations; None: launch.EVAL_EVERY with held-out prompts
    eval_samples: int = 8             # K: samples a held-out prompt at the training temperature (pass@K)
    eval_pass_threshold: float = 1.0  # a completion passes (pass@k) when its reward is at least this

    def __post_init__(self):
        self.check_positive("grpo", ("steps", "prompts_per_step", "num_generations", "max_completion_length",
                                     "num_iterations", "mini_batches", "block_size", "eval_samples"))
        if self.prompts_per_step >= EVAL_REQUEST_BASE:  # the request ids above are evaluation's
            raise InputError(f"grpo: --prompts-per-step must be below 2^31, got {self.prompts_per_step}")
        if self.eval_every is not None and (isinstance(self.eval_every, bool) or not isinstance(self.eval_every, int)
                                            or self.eval_every < 0):
            raise InputError(f"grpo: --eval-every must be an integer >= 0 (0: never), got {self.eval_every!r}")
        if not math.isfinite(self.eval_pass_threshold):
            raise InputError(f"grpo: --eval-pass-threshold must be a finite number, got {self.eval_pass_threshold}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise InputError(f"grpo: --max-prompt-length must be at least 1, got {self.max_prompt_length}")
        if self.num_generations < 2:
            raise InputError(f"grpo: --num-generations {self.num_generations}: a group's advantages are its rewards "
                             "less the group's mean, so one sample per prompt has advantage 0 and nothing trains; "
                             "use at least 2")
        try:  # the engine's sampling settings, checked before any work, in the command's flags
            self.sampling_params()
        except SamplingParamsError as error:
            raise error.in_terms_of({"n": "--num-generations", "max_tokens": "--max-completion-length"}) from None
        if (self.prompts_per_step * self.num_generations) % self.mini_batches:
            raise InputError(f"grpo: {self.prompts_per_step} x {self.num_generations} samples do not split into "
                             f"{self.mini_batches} mini-batches")
        self.settings()  # the objective's (loss type, clip range, ratio level), checked before any work

    def sampling_params(self, **changes) -> SamplingParams:
        """The rollout's SamplingParams (evaluation's with `changes`: n, temperature)."""
        return SamplingParams(**{"n": self.num_generations, "temperature": self.temperature, "top_k": self.top_k,
                                 "top_p": self.top_p, "min_p": self.min_p, "max_tokens": self.max_completion_length,
                                 "ignore_eos": self.ignore_eos, **changes})

    def settings(self) -> objectives.GRPOSettings:
        return objectives.GRPOSettings(self.epsilon, self.epsilon_high, self.beta, self.loss_type,
                                       self.max_completion_length, self.importance_sampling_level)


def epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(size)


def records_for_step(dataset: list[dict], seed: int, step: int, count: int) -> list[dict]:
    """The `count` records of step `step` (0-based) in the seeded epoch order."""
    if not dataset:
        raise InputError("the training dataset is empty")
    out = []
    for position in range(step * count, (step + 1) * count):
        epoch, index = divmod(position, len(dataset))
        out.append(dataset[int(epoch_order(seed, epoch, len(dataset))[index])])
    return out


@dataclass
class GRPOTrainer:
    model: Model
    tokenizer: object
    dataset: list[dict]
    rewards: RewardSet
    config: GRPOConfig
    reference: Model | None = None   # frozen initial weights, for beta > 0
    dp_group: Group | None = None    # data-parallel replicas (train/data_parallel.py); None: one device
    eval_dataset: list[dict] | None = None  # held-out prompts (train/evaluation.py); None: no evaluation
    optimizer: Optimizer = field(init=False)
    engine: LLM = field(init=False)

    def __post_init__(self):
        cfg = self.config
        self.replicas = Replicas.of(self.dp_group)
        if cfg.beta > 0 and self.reference is None:
            raise InputError("grpo: beta > 0 needs a reference model")
        # the schedule spans the run's optimizer steps (TRL's max_steps counts those too): each GRPO step
        # takes num_iterations x mini_batches of them
        self.optimizer = Optimizer(self.model, cfg.hyper(), cfg.schedule(cfg.steps * cfg.num_iterations * cfg.mini_batches),
                                   self.replicas.dp_group)
        longest_prompt = check_prompt_lengths(self.tokenizer, self.dataset, cfg, self.model.config.max_position_embeddings)
        if self.eval_dataset:  # the engine is sized for the held-out prompts too (the same tokens at any size)
            longest_prompt = max(longest_prompt, check_prompt_lengths(
                self.tokenizer, self.eval_dataset, cfg, self.model.config.max_position_embeddings, "held-out"))
        # this replica's share of the prompts, each with its group of samples: what its KV cache must hold
        mine = -(-cfg.prompts_per_step // self.replicas.size) * cfg.num_generations
        self.engine = LLM(device=self.model.backend, loaded=(self.model, self.tokenizer),
                          block_size=cfg.block_size, max_num_seqs=mine,
                          max_model_len=longest_prompt + cfg.max_completion_length,
                          max_num_batched_tokens=max(4096, mine), sampler=cfg.sampler,
                          # replicas emulated as threads share one GPU: another thread's launches would
                          # invalidate a graph capture, so their engines run eagerly (the same bits)
                          cuda_graphs=False if self.replicas.emulated else None)

    def step(self, step: int) -> dict:
        """One GRPO step (0-based index): rollout, rewards, training; returns the step's metrics,
        with the seconds of each phase ("time/<phase>_s", train/metrics.PhaseClock)."""
        cfg = self.config
        started = time.perf_counter()
        clock = PhaseClock(self.model.backend)
        records = records_for_step(self.dataset, cfg.seed, step, cfg.prompts_per_step)
        with clock.phase("rollout"):
            samples, texts = self._rollout(records, step)
        rollout_s = time.perf_counter() - started
        with clock.phase("rewards"):
            grouped = [r for r in records for _ in range(cfg.num_generations)]
            total, columns = self.rewards.score(batch_from_records(grouped, texts,
                                                                   [s.completion_ids for s in samples]))
            advantages = objectives.group_advantages(total, cfg.num_generations, cfg.scale_rewards)
            for sample, advantage in zip(samples, advantages):
                sample.advantage = float(advantage)
        with clock.phase("kv_cache"):
            self.engine.release_kv_cache()
        try:
            metrics = self._train(samples, clock)
        finally:
            with clock.phase("kv_cache"):
                self.engine.restore_kv_cache()
        seconds = time.perf_counter() - started
        tokens = sum(len(s.completion_ids) for s in samples)
        empty = [name for name, values in columns.items() if not np.any(~np.isnan(values))]
        if empty:
            metrics["notes"] = [f"reward function {name!r} gave no value (None or NaN) for any of the "
                                f"{len(samples)} completions: it added nothing to the rewards" for name in empty]
        metrics.update({
            "step": step + 1, "reward_mean": float(total.mean()), "reward_std": float(total.std()),
            **{f"reward/{name}": _mean_of_values(values) for name, values in columns.items()},
            "completion_length": tokens / len(samples), "rollout_s": rollout_s, "train_s": seconds - rollout_s,
            "step_s": seconds, "rollout_tokens_per_s": tokens / rollout_s if rollout_s else 0.0,
            **clock.record(seconds),
        })
        return metrics

    def evaluate(self, done: int) -> dict | None:
        """The evaluation record after `done` steps (0: before the first) when one is due, else None."""
        if not self.eval_dataset or not eval_due(done, self.config.steps, self.config.eval_every):
            return None
        return evaluate(self, self.eval_dataset, done)

    def _rollout(self, records: list[dict], step: int) -> tuple[list[Sample], list[str]]:
        cfg = self.config
        params = cfg.sampling_params()
        mine = self.replicas.share(len(records))  # this replica's requests, keyed by their global index
        prompts = [truncated_prompt(self.tokenizer, records[i]["prompt"], cfg.max_prompt_length) for i in mine]
        outputs = self.engine.generate(prompts, params, request_ids=mine,
                                       seed=sampling_seed(cfg.seed, step)) if mine else []
        requests = self.replicas.gather_in_order([
            [(Sample(list(request.prompt_token_ids), list(completion.token_ids),
                     np.asarray(completion.logprobs, dtype=np.float32),
                     extra={"truncated": completion.finish_reason == "length"},
                     routing=_routing_record(completion.routing)), completion.text)
             for completion in request.outputs] for request in outputs])
        samples = [sample for request in requests for sample, _ in request]
        texts = [text for request in requests for _, text in request]
        return samples, texts

    def _train(self, samples: list[Sample], clock: PhaseClock) -> dict:
        cfg, settings = self.config, self.config.settings()
        size = len(samples) // cfg.mini_batches
        minis = [samples[i:i + size] for i in range(0, len(samples), size)]
        with clock.phase("old_logp"):
            check = self._check_before_update(minis[1:])
        losses, kls, clips, ratio_min, ratio_max, infos, aux_losses = [], [], [], [], [], [], []
        for iteration in range(cfg.num_iterations):
            for index, mini in enumerate(minis):
                counts = (len(mini), sum(len(s.completion_ids) for s in mini if self._active(s)))
                batches = pack(mini, cfg.micro_batch_tokens)
                aux_scale = load_balancing_scale(self.model.config, len(batches))
                results = self.replicas.train_rounds(
                    self.optimizer, batches,
                    lambda batch, on_layer, first=iteration == 0 and index == 0: self._micro_batch(
                        batch, settings, counts, first, clock, on_layer, aux_scale))
                for loss in results:
                    if "aux_loss" in loss:
                        aux_losses.append(loss["aux_loss"])
                    if loss["check"] is not None:
                        check.append(loss["check"])
                        _raise_on_mismatch(check[-1])
                    losses.append(loss["loss"])
                    kls.append(loss["kl"])
                    clips.append(loss["clip_fraction"])
                    if iteration == 0:
                        ratio_min.append(loss["ratio_min"])
                        ratio_max.append(loss["ratio_max"])
                with clock.phase("optimizer"):
                    infos.append(self.optimizer.step())
        metrics = {
            "loss": float(np.mean(losses)), "kl": float(np.mean(kls)), "clip_fraction": float(np.mean(clips)),
            "logp_mismatches": sum(c["mismatches"] for c in check),
            "logp_compared": sum(c["compared"] for c in check),
            "max_abs_dlogp": max(c["max_abs_dlogp"] for c in check),
            "ratio_min": min(ratio_min), "ratio_max": max(ratio_max),
            "grad_norm": infos[0].norm, "lr": infos[-1].lr,
        }
        if aux_losses:  # TRL's metric: the mean of the micro-batches' load-balancing losses (loss leaves it out)
            metrics["aux_loss"] = float(np.mean(aux_losses))
        if self.model.config.is_moe:
            metrics["routing_mismatches"] = sum(c["routing"]["mismatches"] for c in check)
            metrics["routing_compared"] = sum(c["routing"]["compared"] for c in check)
        return metrics

    def _micro_batch(self, batch, settings, counts: tuple[int, int], check_logp: bool,
                     clock: PhaseClock, on_layer=None, aux_scale: float = 0.0) -> tuple[dict, dict]:
        """(host metrics, gradients by name) of one micro-batch on this replica (on_layer: the backward's;
        aux_scale: the load-balancing loss's weight, trainer.load_balancing_scale)."""
        cfg = self.config
        reference = None
        if cfg.beta > 0:
            with clock.phase("reference"):
                reference = self._reference_logp(batch)

        def objective(logp):
            return objectives.grpo_token_loss(logp, [s.logp for s in batch.samples],
                                              np.array([s.advantage for s in batch.samples]), settings, reference,
                                              counts, np.array([self._active(s) for s in batch.samples]))

        routing: list | None = [] if check_logp and self.model.config.is_moe else None
        loss, logp, grads = micro_batch_gradients(self.model, batch, cfg.temperature, objective, clock, on_layer,
                                                  routing, aux_scale)
        check = _check(batch.samples, logp, routing) if check_logp else None
        metrics = {"loss": loss.loss, "check": check, **{key: loss.metrics[key] for key in (
            "kl", "clip_fraction", "ratio_min", "ratio_max", "aux_loss") if key in loss.metrics}}
        return metrics, grads.named_tensors(self.model.config)

    def _active(self, sample: Sample) -> bool:
        """Whether the sample's tokens enter the loss (not so for a truncated one under
        mask_truncated_completions)."""
        return not (self.config.mask_truncated_completions and sample.extra.get("truncated", False))

    def _check_before_update(self, later_minis: list[list[Sample]]) -> list[dict]:
        """The log-probs of mini-batches trained after the first update, recomputed before it (the
        micro-batches dealt out over the replicas; every replica raises on any mismatch)."""
        out = []
        for mini in later_minis:
            batches = pack(mini, self.config.micro_batch_tokens)
            mine = []
            for index in self.replicas.share(len(batches)):
                fwd, logp = completion_logprobs(self.model, batches[index], self.config.temperature)
                mine.append(_check(batches[index].samples, logp, completion_routing(fwd, batches[index])))
            for check in self.replicas.gather_in_order(mine):
                out.append(check)
                _raise_on_mismatch(check)
        return out

    def _reference_logp(self, batch) -> list[np.ndarray]:
        _, logp = completion_logprobs(self.reference, batch, self.config.temperature)
        return logp


def _mean_of_values(values: np.ndarray) -> float:
    """The mean over the completions a reward function scored (NaN: it scored none; the step's
    "notes" say so)."""
    scored = values[~np.isnan(values)]
    return float(scored.mean()) if scored.size else float("nan")


def _routing_record(routing: list | None) -> np.ndarray | None:
    """A completion's recorded expert choices as one int32 [tokens, sparse layers, k] array (None: dense)."""
    return None if routing is None else np.asarray(routing, dtype=np.int32)


def _check(samples: list[Sample], logp: list[np.ndarray], routing: list[np.ndarray] | None) -> dict:
    """The log-prob comparison of a micro-batch with the engine's, and (Qwen3-MoE: routing, the
    recomputed expert choices) the routing comparison under "routing"."""
    check = objectives.logp_mismatch(logp, [s.logp for s in samples])
    check["routing"] = None if routing is None else objectives.routing_mismatch(routing,
                                                                                [s.routing for s in samples])
    return check


def _raise_on_mismatch(check: dict) -> None:
    if check["mismatches"]:
        raise LogprobMismatchError(
            f"the trainer's log-probs differ from the engine's on {check['mismatches']} of {check['compared']} "
            f"completion tokens (max |dlogp| {check['max_abs_dlogp']:.3g}): the rollout/trainer contract is "
            "broken; please report it with `rlportable conform` output")
    routing = check.get("routing")
    if routing is not None and routing["mismatches"]:
        raise RoutingMismatchError(
            f"the trainer's expert choices differ from the engine's on {routing['mismatches']} of "
            f"{routing['compared']} completion tokens: the rollout/trainer contract is broken; please report it "
            "with `rlportable conform` output")


def engine_prompt(tokenizer, prompt):
    """A record's prompt as the engine takes it: a text or token ids as they are; chat messages through
    the model's chat template, ending with the generation prompt (the assistant's turn begins), as TRL
    renders a conversational prompt."""
    if is_chat(prompt):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    return prompt


def prompt_length(tokenizer, prompt) -> int:
    """Tokens of a record's prompt: a text (encoded), chat messages (rendered, encoded) or a list of
    token ids (as the engine takes them)."""
    prompt = engine_prompt(tokenizer, prompt)
    return len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)


def truncated_prompt(tokenizer, prompt, max_prompt_length: int | None):
    """The prompt as the engine gets it (engine_prompt): unchanged, or its last max_prompt_length token
    ids when longer."""
    prompt = engine_prompt(tokenizer, prompt)
    if max_prompt_length is None:
        return prompt
    ids = list(tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)
    return ids[-max_prompt_length:] if len(ids) > max_prompt_length else prompt


def check_prompt_lengths(tokenizer, dataset: list[dict], cfg: GRPOConfig, max_positions: int,
                         name: str = "dataset") -> int:
    """The longest prompt (after --max-prompt-length), checked before any work: each prompt with its
    completion must fit the model's positions, or the engine would be sized past them."""
    longest, index = 0, 0
    for i, record in enumerate(dataset):
        length = _checked_prompt_length(tokenizer, record["prompt"], f"{name} record {i}")
        if cfg.max_prompt_length is not None:
            length = min(length, cfg.max_prompt_length)
        if length > longest:
            longest, index = length, i
    if longest + cfg.max_completion_length > max_positions:
        raise InputError(f"{name} record {index}: its prompt has {longest} tokens, and with --max-completion-length "
                         f"{cfg.max_completion_length} that is {longest + cfg.max_completion_length} positions, more "
                         f"than the model's {max_positions} (max_position_embeddings); shorten the prompts, lower "
                         "--max-completion-length, or set --max-prompt-length (prompts keep their last tokens)")
    return longest


def _checked_prompt_length(tokenizer, prompt, where: str) -> int:
    """prompt_length, with a chat prompt's missing or failing template one line naming the record."""
    if is_chat(prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"{where}: its prompt is chat messages, but the model's tokenizer "
                             f"({getattr(tokenizer, 'source', 'tokenizer')}) has no chat template; give the prompt "
                             "as text, or use a model with one (tokenizer_config.json's chat_template, or "
                             "chat_template.jinja)")
        try:
            return prompt_length(tokenizer, prompt)
        except ModelError as error:
            raise InputError(f"{where}: {error}") from None
    return prompt_length(tokenizer, prompt)


def sampling_seed(seed: int, step: int) -> int:
    """The engine's sampling key of one step: distinct per (run seed, step), in [0, 2^64)."""
    return (int(seed) * 0x9E3779B97F4A7C15 + int(step) + 1) % (1 << 64)
