"""`rlportable bench memory`: the memory model per rank (train/memory.py) for model shapes and layouts,
and, with --measure on a GPU, the peak a training step really takes against the model's number.

The measurement trains a Qwen3 shape (random weights, few layers) on random tokens: micro-batches of
--tokens tokens through the SFT loss, at each TPxDP layout with the ranks emulated as threads on the
one GPU, three optimiser steps (the backward's transposed encodings exist from the first). Emulated
ranks share the GPU, so the measured peak covers all of them: it is compared with tp x dp times the
model's per-rank peak. The weights after the steps are compared bitwise with a one-rank run of the
same steps.
"""

from __future__ import annotations

import copy
import hashlib

import numpy as np

from rlportable.errors import RlpError
from rlportable.train import memory

MEASURE_STEPS = 3


def model_rows(shapes: list[str], layouts: list[memory.Layout], work: memory.Workload,
               layers: int | None = None) -> list[dict]:
    rows = []
    for shape in shapes:
        rows += memory.table(shape, layouts, work, layers)
    return rows


def train_random_tokens(backend, config, weights, tokens: int, micro_batches: int, dp_group, tp_group=None) -> str:
    """MEASURE_STEPS optimiser steps of `micro_batches` micro-batches of random tokens each (the same
    at any rank count); the digest of the final weights."""
    from rlportable.model.forward import Model
    from rlportable.train import objectives
    from rlportable.train.data_parallel import Replicas
    from rlportable.train.optimizer import Optimizer, Schedule
    from rlportable.train.sft import SFTConfig
    from rlportable.train.trainer import Sample, micro_batch_gradients, pack

    # a copy: cpu arrays would be shared with the caller's, and updated in place
    model = Model(backend, config, copy.deepcopy(weights), trainable=True, tp_group=tp_group)
    replicas = Replicas.of(dp_group)
    optimizer = Optimizer(model, SFTConfig().hyper(), Schedule(1e-5, 0, MEASURE_STEPS), replicas.dp_group)
    rng = np.random.default_rng(0)
    for _ in range(MEASURE_STEPS):
        samples = []
        for _ in range(micro_batches):
            ids = rng.integers(0, config.vocab_size, size=tokens).tolist()
            samples.append(Sample(ids[: tokens // 2], ids[tokens // 2:]))
        batches = pack(samples, tokens)
        count = sum(len(s.completion_ids) for s in samples)

        def compute(batch, on_layer):
            loss, _, grads = micro_batch_gradients(model, batch, 1.0,
                                                   lambda logp: objectives.sft_token_loss(logp, count),
                                                   on_layer=on_layer)
            return loss.loss, grads.named_tensors(config)

        replicas.train_rounds(optimizer, batches, compute)
        optimizer.step()
    digest = hashlib.sha256()
    for name, array in optimizer.whole_weights().items():
        digest.update(name.encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def measure(backend, shape: str, layers: int, tp: int, dp: int, tokens: int, ep: int = 1) -> dict:
    """Peak bytes of the training steps at tp x dp emulated ranks, against tp x dp times the model's
    per-rank peak; and whether the weights equal a one-rank run's. Expert-parallel layouts are modelled,
    not measured (ep must be 1)."""
    from rlportable.bench.forward import PeakTracker
    from rlportable.model.synthetic import random_weights
    from rlportable.runtime.collectives import run_threads
    from rlportable.runtime.world import layout_groups

    if ep != 1:
        raise RlpError(f"bench memory --measure: the layout with EP {ep} is modelled only; measure TPxDP layouts")
    if backend.name != "cuda":
        raise RlpError("bench memory --measure reads CuPy's memory pool: use --device cuda")
    import cupy

    config = memory.shape_config(shape, layers)
    weights = random_weights(config, seed=1)
    with PeakTracker(cupy) as tracker:
        def rank(world_group):
            tp_group, dp_group = layout_groups(world_group, tp)
            return train_random_tokens(backend, config, weights, tokens, dp, dp_group, tp_group)

        digests = run_threads(backend, tp * dp, rank)
        backend.synchronize()
    measured = tracker.peak
    single = train_random_tokens(backend, config, weights, tokens, dp, None) if tp * dp > 1 else digests[0]
    parts = memory.components(config, memory.Layout(tp, dp), memory.Workload(tokens, 0))
    predicted = tp * dp * memory.peak(parts)
    return {"shape": shape, "layers": layers, "tp": tp, "dp": dp, "tokens": tokens, "measured_peak_bytes": measured,
            "model_peak_bytes": predicted, "measured_over_model": measured / predicted,
            "components_per_rank_bytes": parts, "weights_equal_one_rank": all(d == single for d in digests)}
