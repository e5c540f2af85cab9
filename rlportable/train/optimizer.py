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
from rlportable.model import expert_parallel, parallel
from rlportable.model.weights import ModelWeights, expected_tensors, layer_named
from rlportable.ops import adamw, residual
from rlportable.ops.checks import shape_of
from rlportable.runtime.collectives import Group, SingleGroup


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


def piece_size(size: int, ranks: int) -> int:
    """ceil(size / ranks): the length of every rank's piece of a tensor, the last ones padded."""
    return -(-size // ranks)


def shard_range(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """The elements [lo, hi) of a flattened tensor of `size` elements that `rank` of `ranks` owns:
    consecutive pieces of piece_size, the last ones shorter or empty."""
    piece = piece_size(size, ranks)
    return min(rank * piece, size), min((rank + 1) * piece, size)


class Optimizer:
    """AdamW state (m, v per tensor, by Hugging Face name) and the gradient being accumulated,
    sharded over the data-parallel ranks of `dp_group` (ZeRO stages 1 and 2).

    Each rank owns one consecutive piece of every flattened tensor (shard_range): the moments and
    the accumulated gradient exist for that piece only, and the model's float32 weights there are
    the master copy this rank updates. A round's gradients reach their owners by an all-to-all (a
    copy), and each owner adds them in micro-batch order, the order one device uses; the global
    norm is exact over the shards; after the update every rank's piece is all-gathered (a copy)
    into every rank's weights. So weights, moments and metrics are bitwise those of one device for
    any number of ranks. With one rank the pieces are the whole tensors.

    Under tensor parallelism (the model's tp_group) the tensors are the rank's shards, and the pieces
    are cut from them; the global norm then also spans the tensor-parallel ranks, each norm weight
    (held whole by every rank) counted once."""

    def __init__(self, model: Model, hyper: Hyper, schedule: Schedule, dp_group: Group | None = None):
        if not model.trainable:
            raise InputError("the optimiser needs a Model built with trainable=True")
        self.model, self.hyper, self.schedule = model, hyper, schedule
        self.dp_group = dp_group or SingleGroup()
        self.tp_group = model.tp_group
        self.ep_group = model.ep_group
        self.names = list(model.params.named_tensors(model.config))
        # a tensor every tensor-parallel rank holds whole adds its squares to the norm on rank 0 only, and
        # so does one that every expert-parallel rank holds (all but the experts)
        self.counted = [(self.tp_group.rank == 0 or parallel.tensor_axis(name) is not None)
                        and (self.ep_group.rank == 0 or expert_parallel.is_expert(name)) for name in self.names]
        backend = model.backend
        self.sizes = {name: int(np.prod(shape_of(p), dtype=np.int64)) for name, p in self._params().items()}
        self.ranges = {name: shard_range(n, self.dp_group.size, self.dp_group.rank) for name, n in self.sizes.items()}
        self.m = {name: backend.zeros((hi - lo,), np.float32) for name, (lo, hi) in self.ranges.items()}
        self.v = {name: backend.zeros((hi - lo,), np.float32) for name, (lo, hi) in self.ranges.items()}
        self.grads: dict = {}  # name -> this rank's piece of the gradient accumulated so far
        self.step_count = 0

    def _params(self) -> dict:
        return self.model.params.named_tensors(self.model.config)

    def _piece(self, name: str, array):
        """This rank's piece of a whole tensor (a view)."""
        lo, hi = self.ranges[name]
        return array.reshape(-1)[lo:hi]

    def accumulate(self, grads: ModelWeights) -> None:
        """Add one micro-batch's gradients (in call order: the sum is deterministic)."""
        self.accumulate_named(grads.named_tensors(self.model.config))

    def accumulate_named(self, named: dict) -> None:
        """accumulate() of whole gradients given by tensor name (as `names`): one rank only (replicas
        exchange their gradients through Replicas.train_rounds)."""
        if self.dp_group.size > 1:
            raise InputError("accumulate: with several data-parallel ranks the gradients go through "
                             "Replicas.train_rounds, which exchanges them")
        for name in self.names:
            self._add(name, self._piece(name, named[name]))

    def _add(self, name: str, piece) -> None:
        current = self.grads.get(name)
        self.grads[name] = piece if current is None else residual.add(self.model.backend, current, piece)

    # ---- data-parallel rounds (train/data_parallel.py Replicas.train_rounds): who has a micro-batch,
    # then each layer's gradients as the backward streams them, then the rest; or, without a
    # micro-batch, the same exchanges with zeros
    def round_members(self, mine: bool) -> list[bool]:
        """Which data-parallel ranks have a micro-batch in this round (every rank calls)."""
        return self.dp_group.all_gather_object(mine) if self.dp_group.size > 1 else [mine]

    def layer_names(self, index: int) -> list[str]:
        prefix = f"model.layers.{index}."
        return [name for name in self.names if name.startswith(prefix)]

    def layer_stream(self, present: list[bool]):
        """on_layer(index, that layer's gradients) for model.backward: each layer's gradients are
        exchanged and added as soon as the backward made them, so no whole gradient exists at once."""
        config = self.model.config

        def on_layer(index: int, grads) -> None:
            self.exchange(self.layer_names(index), layer_named(config, index, grads), present)

        return on_layer

    def absent_round(self, present: list[bool]) -> None:
        """This rank's part of a round in which it has no micro-batch: the exchanges of the ranks that
        have one (layers last to first, then the rest, as the backward streams them), with zeros."""
        layers = self.model.config.num_hidden_layers
        for index in reversed(range(layers)):
            self.exchange(self.layer_names(index), None, present)
        streamed = {name for index in range(layers) for name in self.layer_names(index)}
        self.exchange([name for name in self.names if name not in streamed], None, present)

    def exchange(self, names: list[str], named: dict | None, present: list[bool]) -> None:
        """The gradients `names` of this round: each owner adds the present ranks' pieces in rank order.
        named: this rank's whole tensors (popped as they go), or None where it has no micro-batch."""
        dp_group, backend = self.dp_group, self.model.backend
        if dp_group.size == 1:
            for name in names:
                self._add(name, self._piece(name, named.pop(name)))
            return
        for name in names:
            size, piece = self.sizes[name], piece_size(self.sizes[name], dp_group.size)
            whole = None if named is None else named.pop(name).reshape(-1)
            if whole is not None and size == dp_group.size * piece:
                send = whole  # already [ranks, piece]: no padded copy
            else:
                send = backend.zeros((dp_group.size * piece,), np.float32)
                if whole is not None:
                    backend.copy_into(send[:size], whole)
            del whole
            received = dp_group.all_to_all(send.reshape(dp_group.size, piece))
            del send
            lo, hi = self.ranges[name]
            for rank in range(dp_group.size):
                if present[rank]:  # a first piece is copied: a view would hold all ranks' pieces
                    piece = received[rank][:hi - lo]
                    self._add(name, piece if name in self.grads else piece.copy())

    def step(self) -> adamw.StepInfo:
        """One AdamW step with the accumulated gradients; refreshes the model's encodings."""
        if not self.grads:
            raise InputError("optimiser step without gradients: call accumulate() first")
        self.step_count += 1
        params = self._params()
        info = adamw.adamw_step(self.model.backend, [self._piece(n, params[n]) for n in self.names],
                                [self.grads[n] for n in self.names], [self.m[n] for n in self.names],
                                [self.v[n] for n in self.names], self.step_count, self.hyper,
                                self.schedule.lr(self.step_count), (self.dp_group, self.tp_group, self.ep_group),
                                self.counted)
        self.grads = {}
        for name in self.names:
            self._gather_into(params[name], self._piece(name, params[name]), name)
        self.model.reencode()
        return info

    def _gather_into(self, whole, piece, name: str) -> None:
        """Every rank's piece of a tensor, all-gathered into `whole` (no-op with one rank)."""
        dp_group, backend = self.dp_group, self.model.backend
        if dp_group.size == 1:
            return
        n, size = self.sizes[name], piece_size(self.sizes[name], dp_group.size)
        send = backend.zeros((size,), np.float32)
        if piece.size:
            backend.copy_into(send[:piece.size], piece)
        backend.copy_into(whole.reshape(-1), dp_group.all_gather(send).reshape(-1)[:n])

    # ---- checkpoints
    def shard_state(self) -> dict[str, np.ndarray]:
        """This rank's pieces of m and v (flat float32), as a checkpoint shard stores them."""
        backend = self.model.backend
        out = {f"m.{name}": backend.to_numpy(self.m[name]) for name in self.names}
        out.update({f"v.{name}": backend.to_numpy(self.v[name]) for name in self.names})
        return out

    def _local(self, name: str, store, shape: tuple) -> object:
        """A moment of one tensor in the tensor's (this rank's) shape, gathered from the pieces."""
        if self.dp_group.size == 1:
            return store[name].reshape(shape)
        whole = self.model.backend.zeros(shape, np.float32)
        self._gather_into(whole, store[name], name)
        return whole

    def state(self, keep: bool = True) -> dict[str, np.ndarray] | None:
        """The whole m and v of every tensor, in its whole shape, as host arrays: gathered over the
        data-parallel pieces and the tensor-parallel shards (every rank must call; keep=False: this
        rank only takes part and gets None)."""
        out, shapes = {}, {name: shape_of(p) for name, p in self._params().items()}
        for kind, store in (("m", self.m), ("v", self.v)):
            named = {name: parallel.unshard(self.model.backend, self.tp_group, name,
                                            self._local(name, store, shapes[name]), self._keep(name, keep))
                     for name in self.names}
            named = expert_parallel.gather_experts(self.model.backend, self.ep_group, self.model.config, named, keep)
            out.update({f"{kind}.{name}": array for name, array in (named or {}).items()})
        return out if keep else None

    def _keep(self, name: str, keep: bool) -> bool:
        """Whether this rank keeps a tensor unsharded over TP: where it keeps the result, and its experts
        under expert parallelism (it sends them on to the rank that keeps them)."""
        return keep or (self.ep_group.size > 1 and expert_parallel.is_expert(name))

    def whole_weights(self, keep: bool = True) -> dict[str, np.ndarray] | None:
        """The model's whole float32 weights by name, as host arrays (gathered over tensor-parallel
        shards; every rank must call, keep=False: this rank only takes part)."""
        params = self._params()
        out = {name: parallel.unshard(self.model.backend, self.tp_group, name, params[name], self._keep(name, keep))
               for name in self.names}
        return expert_parallel.gather_experts(self.model.backend, self.ep_group, self.model.config, out, keep)

    def load_state(self, state, step_count: int) -> None:
        """This rank's pieces from a checkpoint's optimiser state (checkpoint.OptimizerShards), written
        at any data-parallel, tensor-parallel and expert-parallel layout (the names are this rank's: its
        experts and the tensors every expert-parallel rank holds)."""
        backend, config = self.model.backend, self.model.config
        if self.tp_group.size > 1 and state.tp == self.tp_group.size:  # this rank's shard's files only
            def read(key, size, lo, hi):
                return state.read_shard(key, self.tp_group.rank, size, lo, hi)
        elif self.tp_group.size > 1:  # each whole tensor read, then this rank's shard, then its piece of that
            shapes = expected_tensors(config)

            def read(key, size, lo, hi):
                name = key[2:]
                whole = int(np.prod(shapes[name]))
                array = state.read(key, whole, 0, whole).reshape(shapes[name])
                return parallel.shard_tensor(config, self.model.tp, name, array).reshape(-1)[lo:hi]
        else:
            read = state.read
        for name in self.names:
            lo, hi = self.ranges[name]
            for key, store in ((f"m.{name}", self.m), (f"v.{name}", self.v)):
                store[name] = backend.asarray(np.ascontiguousarray(read(key, self.sizes[name], lo, hi),
                                                                   dtype=np.float32))
        self.step_count = int(step_count)
