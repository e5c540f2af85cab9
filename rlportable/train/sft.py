"""Supervised fine-tuning: the loss is the mean negative log-likelihood of completion tokens only.

Data: JSONL lines or Parquet rows {"prompt": ..., "completion": ...} or {"messages": [{"role", "content"}, ...]}
(the last message is the assistant's completion; the ones before it, through the
tokenizer's chat template with the generation prompt, are the prompt), or a
built-in task's generated records (completion = the task's answer). Every
completion ends with the tokenizer's end-of-sequence token, so the model learns
to stop. Samples are packed into micro-batches (train/trainer.py); each step
takes `batch_size` examples in the seeded epoch order (the same order rule as
GRPO), so a run resumes bitwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from rlportable.errors import InputError
from rlportable.model.forward import Model
from rlportable.runtime.collectives import Group
from rlportable.train import objectives
from rlportable.train.data_parallel import Replicas
from rlportable.train.datafiles import read_records
from rlportable.train.grpo import records_for_step
from rlportable.train.metrics import PhaseClock
from rlportable.train.optimizer import OptimiserSettings, Optimizer
from rlportable.train.trainer import Sample, load_balancing_scale, micro_batch_gradients, pack


@dataclass(frozen=True)
class SFTConfig(OptimiserSettings):
    steps: int = 100
    batch_size: int = 32
    learning_rate: float = 1e-4
    max_length: int = 1024

    def __post_init__(self):
        self.check_positive("sft", ("steps", "batch_size", "max_length"))


def load_sft_records(path) -> list[dict]:
    """Records {"prompt", "completion"} or {"messages"} of a JSONL or Parquet file; errors name the file's
    line or row and the field."""
    records = []
    for where, record in read_records(path):
        if "messages" in record:
            messages = record["messages"]
            if not isinstance(messages, list) or len(messages) < 2 or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise InputError(f"{where}: \"messages\" must be a list of at least two "
                                 "{\"role\": str, \"content\": str} objects")
            if messages[-1]["role"] != "assistant":
                raise InputError(f"{where}: the last message must be the assistant's (the completion)")
        elif not (isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str)):
            raise InputError(f"{where}: expected string fields \"prompt\" and \"completion\", or \"messages\"")
        records.append(record)
    if not records:
        raise InputError(f"{path}: no records")
    return records


def task_sft_records(records: list[dict]) -> list[dict]:
    """A built-in task's records as SFT pairs: the prompt and its exact answer."""
    answer = "answer" if "answer" in records[0] else "solution"
    return [{"prompt": r["prompt"], "completion": str(r[answer])} for r in records]


def to_sample(record: dict, tokenizer, max_length: int) -> Sample:
    """Token ids of one record; the completion ends with EOS. Too long: a one-line error."""
    if "messages" in record:
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(record["messages"][:-1],
                                                                    add_generation_prompt=True))
        completion_text = record["messages"][-1]["content"]
    else:
        prompt_ids, completion_text = tokenizer.encode(record["prompt"]), record["completion"]
    eos = tokenizer.eos_token_id
    completion_ids = tokenizer.encode(completion_text) + ([] if eos is None else [eos])
    if not prompt_ids:
        raise InputError(f"sft record {record!r:.80}: the prompt has no tokens")
    if len(prompt_ids) + len(completion_ids) > max_length:
        raise InputError(f"sft record {record!r:.80}: {len(prompt_ids) + len(completion_ids)} tokens exceed "
                         f"max_length {max_length}")
    return Sample(prompt_ids, completion_ids)


@dataclass
class SFTTrainer:
    model: Model
    tokenizer: object
    records: list[dict]
    config: SFTConfig
    dp_group: Group | None = None    # data-parallel replicas (train/data_parallel.py); None: one device
    optimizer: Optimizer = field(init=False)

    def __post_init__(self):
        cfg = self.config
        self.replicas = Replicas.of(self.dp_group)
        self.optimizer = Optimizer(self.model, cfg.hyper(), cfg.schedule(cfg.steps), self.replicas.dp_group)

    def step(self, step: int) -> dict:
        cfg = self.config
        started = time.perf_counter()
        clock = PhaseClock(self.model.backend)
        records = records_for_step(self.records, cfg.seed, step, cfg.batch_size)
        samples = [to_sample(r, self.tokenizer, cfg.max_length) for r in records]
        tokens = sum(len(s.completion_ids) for s in samples)
        batches = pack(samples, cfg.micro_batch_tokens)
        aux_scale = load_balancing_scale(self.model.config, len(batches))

        def compute(batch, on_layer):
            loss, _, grads = micro_batch_gradients(self.model, batch, 1.0,
                                                   lambda logp: objectives.sft_token_loss(logp, tokens), clock,
                                                   on_layer, aux_scale=aux_scale)
            return (loss.loss, loss.metrics.get("aux_loss")), grads.named_tensors(self.model.config)

        results = self.replicas.train_rounds(self.optimizer, batches, compute)
        with clock.phase("optimizer"):
            info = self.optimizer.step()
        seconds = time.perf_counter() - started
        trained = sum(s.length for s in samples)
        record = {"step": step + 1, "loss": float(np.sum([loss for loss, _ in results])), "grad_norm": info.norm,
                  "lr": info.lr, "completion_tokens": tokens, "step_s": seconds, "tokens_per_s": trained / seconds,
                  **clock.record(seconds)}
        if aux_scale:  # TRL's metric: the mean of the micro-batches' load-balancing losses (loss leaves it out)
            record["aux_loss"] = float(np.mean([aux for _, aux in results]))
        return record
