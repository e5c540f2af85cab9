"""What SFT and GRPO share: samples packed into micro-batches, the completion tokens' log-probs,
and one backward per micro-batch into the optimiser's accumulated gradient.

A sample is a prompt and a completion (token ids); only completion tokens are
scored (their log-probs) and trained on. Micro-batches pack whole samples, in
order, up to `max_tokens` tokens each (a longer sample goes alone), so the
packing is a function of the sample list and the budget only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rlportable.errors import InputError
from rlportable.model import backward
from rlportable.model.config import ModelConfig
from rlportable.model.forward import Model
from rlportable.train.metrics import PhaseClock
from rlportable.train.objectives import TokenLoss


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    logp: np.ndarray | None = None       # the engine's log-prob of each completion token (GRPO)
    advantage: float = 0.0
    extra: dict = field(default_factory=dict)
    # Qwen3-MoE (GRPO): the engine's expert choices of each completion token's log-prob row,
    # int32 [tokens, sparse layers, k]; the trainer recomputes them and counts the differences
    routing: np.ndarray | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise InputError("a training sample needs at least one prompt token")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class MicroBatch:
    samples: list[Sample]
    tokens: np.ndarray        # int32 [T], the samples one after another
    cu_seqlens: np.ndarray    # int64 [S + 1]
    rows: np.ndarray          # int64 [R]: the rows predicting completion tokens, sample by sample
    splits: np.ndarray        # where each sample's completion rows end in `rows`


def pack(samples: list[Sample], max_tokens: int) -> list[MicroBatch]:
    """Consecutive samples into micro-batches of at most max_tokens tokens (a longer sample goes alone)."""
    if max_tokens < 1:
        raise InputError(f"micro-batch token budget must be positive, got {max_tokens}")
    groups: list[list[Sample]] = []
    used = 0
    for sample in samples:
        if not groups or used + sample.length > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += sample.length
    return [_micro_batch(group) for group in groups]


def _micro_batch(samples: list[Sample]) -> MicroBatch:
    tokens = np.array([t for s in samples for t in s.prompt_ids + s.completion_ids], dtype=np.int32)
    cu = np.concatenate([[0], np.cumsum([s.length for s in samples])]).astype(np.int64)
    rows = [np.arange(start + len(s.prompt_ids) - 1, start + s.length - 1) for start, s in zip(cu[:-1], samples)]
    splits = np.cumsum([r.size for r in rows])[:-1]
    return MicroBatch(samples, tokens, cu, np.concatenate(rows).astype(np.int64), splits)


def completion_logprobs(model: Model, batch: MicroBatch, temperature: float, for_backward: bool = False):
    """(forward state, per-sample completion-token log-probs on the host); for_backward: keep what
    the backward reuses (the attention outputs)."""
    fwd = backward.forward(model, batch.tokens, batch.cu_seqlens, temperature, rows=batch.rows,
                           keep_attention=for_backward)
    return fwd, np.split(model.backend.to_numpy(fwd.logp), batch.splits)


def completion_routing(fwd: backward.TrainingForward, batch: MicroBatch) -> list[np.ndarray] | None:
    """Per sample, the forward's expert choices of its completion tokens' log-prob rows, int32
    [tokens, sparse layers, k] (the engine's record's layout); None for a dense model."""
    if fwd.routing is None:
        return None
    rows = np.stack([np.asarray(layer)[batch.rows] for layer in fwd.routing], axis=1)
    return np.split(rows, batch.splits)


def load_balancing_scale(config: ModelConfig, micro_batches: int) -> float:
    """Each micro-batch's weight of its load-balancing loss: router_aux_loss_coef over the optimiser step's
    micro-batches where the config turns the loss on (config.load_balancing), else 0. TRL divides each
    micro-batch's coef x aux by its gradient-accumulation steps: the step adds coef x their mean."""
    return config.router_aux_loss_coef / max(micro_batches, 1) if config.load_balancing else 0.0


def micro_batch_gradients(model: Model, batch: MicroBatch, temperature: float,
                          objective: Callable[[list[np.ndarray]], TokenLoss], clock: PhaseClock | None = None,
                          on_layer=None, routing: list | None = None, aux_scale: float = 0.0):
    """Forward, the objective on the host, backward: (loss, per-sample log-probs, gradients).
    clock: times the phases "forward", "loss" and "backward"; on_layer: model.backward's. routing, a
    list: receives completion_routing's arrays (Qwen3-MoE). aux_scale (load_balancing_scale's): nonzero
    adds that times the micro-batch's load-balancing loss, whose value goes to loss.metrics["aux_loss"]."""
    clock = clock or PhaseClock()
    with clock.phase("forward"):
        fwd, logp = completion_logprobs(model, batch, temperature, for_backward=True)
        if routing is not None:
            routing.extend(completion_routing(fwd, batch) or [])
    with clock.phase("loss"):
        loss = objective(logp)
    with clock.phase("backward"):
        grads = backward.backward(model, fwd, loss.grad, on_layer, aux_scale=aux_scale)
    if fwd.aux_loss is not None:
        loss.metrics["aux_loss"] = fwd.aux_loss
    return loss, logp, grads
