"""Data-parallel replicas: training bitwise independent of the replica count.

Every replica holds the whole model (under tensor parallelism, its T ranks together hold it). A
step's work is dealt out by position, never by timing:
  * rollout: replica r generates requests r, r + R, r + 2R, ... of the step, each under its
    global request id (the sampler's key), so every sample is the one a single device would draw;
    the samples are then gathered in request order on every replica;
  * training: a mini-batch's micro-batches (train.trainer.pack, the same on every replica) go
    round-robin: in round k replica r computes micro-batch kR + r. The optimiser is sharded over
    the replicas (train/optimizer.py, ZeRO stages 1 and 2): the round's gradients reach the owner
    of each piece by an all-to-all (a copy), and the owner adds them in micro-batch order, the
    order one device uses. So the accumulated gradient, the AdamW step and the new weights are
    bitwise those of one device, for any replica count.
Where this stops: the micro-batch split itself (`micro_batch_tokens`) is part of the result, as on
one device (float32 sums of micro-batch gradients; docs/training.md, "Gradients under the contracts").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlportable.runtime.collectives import Group, SingleGroup, ThreadGroup


@dataclass
class Replicas:
    dp_group: Group

    @classmethod
    def of(cls, dp_group: Group | None) -> "Replicas":
        return cls(dp_group or SingleGroup())

    @property
    def size(self) -> int:
        return self.dp_group.size

    @property
    def rank(self) -> int:
        return self.dp_group.rank

    @property
    def emulated(self) -> bool:
        """Several replicas as threads of this process, on one device."""
        return self.size > 1 and isinstance(self.dp_group, ThreadGroup)

    def share(self, count: int) -> list[int]:
        """The indices of `count` items this replica handles: rank, rank + R, ..."""
        return list(range(self.rank, count, self.size))

    def gather_in_order(self, mine: list) -> list:
        """Every replica's share() results, back in the global order."""
        parts = self.dp_group.all_gather_object(mine)
        out: list = []
        for index in range(sum(len(p) for p in parts)):
            out.append(parts[index % self.size][index // self.size])
        return out

    def rounds(self, count: int) -> list[int | None]:
        """For each round, this replica's item index (None when the last round has none for it)."""
        rounds = -(-count // self.size)
        return [k * self.size + self.rank if k * self.size + self.rank < count else None for k in range(rounds)]

    def train_rounds(self, optimizer, batches: list, compute: Callable) -> list:
        """Every micro-batch of `batches` through compute(batch, on_layer) -> (host result, the gradients
        by name that on_layer did not take), dealt out round-robin; each round's gradients go to the
        optimiser's shard owners layer by layer as the backward makes them (on_layer), the rest after
        it, and the owners add them in micro-batch order. Returns the host results of all
        micro-batches, in order."""
        results = []
        for mine in self.rounds(len(batches)):
            present = optimizer.round_members(mine is not None)
            if mine is None:
                optimizer.absent_round(present)
                result = None
            else:
                result, named = compute(batches[mine], optimizer.layer_stream(present))
                optimizer.exchange([name for name in optimizer.names if name in named], named, present)
            results.extend(r for r in self.dp_group.all_gather_object(result) if r is not None)
        return results
