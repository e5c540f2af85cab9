"""AdamW over a trainable Model's float32 master weights, with gradient accumulation.

The model's `params` (device float32, the engine's weights too) are updated in
place by the adamw kernel (contracts/adamw.toml: exact global-norm clipping,
torch's AdamW order in float64, one rounding per stored value), then the GEMM
encodings are refreshed. Gradients of several micro-batches are added in their
fixed order (ops.residual.add), so a run is deterministic; the schedule is
warmup + cosine on the contract's float64 cos.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract.adamw import Hyper, lr_at
from rlportable.errors import InputError
from rlportable.model.forward import Model
from rlportable.model.weights import ModelWeights
from rlportable.ops import adamw, residual
from rlportable.ops.checks import shape_of


@dataclass(frozen=True)
class Schedule:
    peak_lr: float = 1e-5
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr: float = 0.0

    def lr(self, step: int) -> float:
        return lr_at(step, self.peak_lr, self.warmup_steps, max(self.total_steps, 1), self.min_lr)


@dataclass(frozen=True)
class OptimiserSettings:
    """What SFT and GRPO runs share: AdamW, the schedule, the micro-batch budget, the seed."""

    learning_rate: float = 1e-5
    warmup_steps: int = 0
    min_lr: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    micro_batch_tokens: int = 16384
    seed: int = 0

    def hyper(self) -> Hyper:
        return Hyper(self.learning_rate, self.adam_beta1, self.adam_beta2, self.adam_eps, self.weight_decay,
                     self.max_grad_norm)

    def schedule(self, steps: int) -> Schedule:
        return Schedule(self.learning_rate, self.warmup_steps, steps, self.min_lr)

    def check_positive(self, kind: str, names: tuple[str, ...]) -> None:
        for name in names + ("micro_batch_tokens",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{kind}: {name} must be a positive integer, got {value!r}")


class Optimizer:
    """AdamW state (m, v per tensor, by Hugging Face name) and the gradient being accumulated."""

    def __init__(self, model: Model, hyper: Hyper, schedule: Schedule):
        if not model.trainable:
            raise InputError("the optimiser needs a Model built with trainable=True")
        self.model, self.hyper, self.schedule = model, hyper, schedule
        self.names = list(model.params.named_tensors(model.config))
        backend = model.backend
        self.m = {name: backend.zeros(shape_of(p), np.float32) for name, p in self._params().items()}
        self.v = {name: backend.zeros(shape_of(p), np.float32) for name, p in self._params().items()}
        self.grads: dict | None = None
        self.step_count = 0

    def _params(self) -> dict:
        return self.model.params.named_tensors(self.model.config)

    def accumulate(self, grads: ModelWeights) -> None:
        """Add one micro-batch's gradients (in call order: the sum is deterministic)."""
        self.accumulate_named(grads.named_tensors(self.model.config))

    def accumulate_named(self, named: dict) -> None:
        """accumulate() of gradients given by tensor name (as `names`)."""
        if self.grads is None:
            self.grads = dict(named)
        else:
            backend = self.model.backend
            self.grads = {name: residual.add(backend, self.grads[name], named[name]) for name in self.names}

    def step(self) -> adamw.StepInfo:
        """One AdamW step with the accumulated gradients; refreshes the model's encodings."""
        if self.grads is None:
            raise InputError("optimiser step without gradients: call accumulate() first")
        self.step_count += 1
        params = self._params()
        info = adamw.adamw_step(self.model.backend, [params[n] for n in self.names],
                                [self.grads[n] for n in self.names], [self.m[n] for n in self.names],
                                [self.v[n] for n in self.names], self.step_count, self.hyper,
                                self.schedule.lr(self.step_count))
        self.grads = None
        self.model.reencode()
        return info

    # ---- checkpoints
    def state(self) -> dict[str, np.ndarray]:
        backend = self.model.backend
        out = {f"m.{name}": backend.to_numpy(self.m[name]) for name in self.names}
        out.update({f"v.{name}": backend.to_numpy(self.v[name]) for name in self.names})
        return out

    def load_state(self, state: dict[str, np.ndarray], step_count: int) -> None:
        backend = self.model.backend
        for name in self.names:
            for key, store in ((f"m.{name}", self.m), (f"v.{name}", self.v)):
                if key not in state or state[key].shape != shape_of(store[name]):
                    raise InputError(f"optimiser state: {key} is missing or has the wrong shape")
                store[name] = backend.asarray(np.ascontiguousarray(state[key], dtype=np.float32))
        self.step_count = int(step_count)
