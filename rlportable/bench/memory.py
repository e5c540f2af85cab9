"""`rlportable bench memory`: the memory model per rank (train/memory.py) for model shapes and layouts,
and, with --measure on a GPU, the peak a training step really takes against the model's number.

The measurement trains a Qwen3 shape (random weights, few layers) on random tokens: micro-batches of
--tokens tokens through the SFT loss, the sharded optimiser over --dp data-parallel ranks emulated as
threads on the one GPU, three optimiser steps (the backward's transposed encodings exist from the
first). Emulated ranks share the GPU, so the measured peak covers all of them: it is compared with
dp times the model's per-rank peak. The weights after the steps are compared bitwise with a
one-rank run of the same steps.
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


def _train(backend, config, weights, tokens: int, micro_batches: int, group) -> str:
    """MEASURE_STEPS optimiser steps of `micro_batches` micro-batches of random tokens each (the same
    at any rank count); the digest of the final weights."""
    from rlportable.model.forward import Model
    from rlportable.train import objectives
    from rlportable.train.data_parallel import Replicas
    from rlportable.train.optimizer import Optimizer, Schedule
    from rlportable.train.sft import SFTConfig
    from rlportable.train.trainer import Sample, micro_batch_gradients, pack

    model = Model(backend, config, copy.deepcopy(weights), trainable=True)  # cpu arrays would be shared
    replicas = Replicas.of(group)
    optimizer = Optimizer(model, SFTConfig().hyper(), Schedule(1e-5, 0, MEASURE_STEPS), replicas.group)
    rng = np.random.default_rng(0)
    for _ in range(MEASURE_STEPS):
        samples = []
        for _ in range(micro_batches):
            ids = rng.integers(0, config.vocab_size, size=tokens).tolist()
            samples.append(Sample(ids[: tokens // 2], ids[tokens // 2:]))
        batches = pack(samples, tokens)
        count = sum(len(s.completion_ids) for s in samples)

        def compute(batch):
            loss, _, grads = micro_batch_gradients(model, batch, 1.0,
                                                   lambda logp: objectives.sft_token_loss(logp, count))
            return loss.loss, grads.named_tensors(config)

        replicas.train_rounds(optimizer, batches, compute)
        optimizer.step()
    digest = hashlib.sha256()
    for name, array in model.params.named_tensors(config).items():
        digest.update(name.encode())
        digest.update(backend.to_numpy(array).tobytes())
    return digest.hexdigest()


def measure(backend, shape: str, layers: int, dp: int, tokens: int) -> dict:
    """Peak bytes of the training steps at dp emulated ranks, against dp x the model's per-rank peak."""
    from rlportable.bench.forward import PeakTracker
    from rlportable.model.synthetic import qwen3_config, random_weights
    from rlportable.runtime.collectives import run_threads

    if backend.name != "cuda":
        raise RlpError("bench memory --measure reads CuPy's memory pool: use --device cuda")
    import cupy

    config = qwen3_config(shape, layers)
    weights = random_weights(config, seed=1)
    with PeakTracker(cupy) as tracker:
        digests = run_threads(backend, dp, lambda group: _train(backend, config, weights, tokens, dp, group))
        backend.synchronize()
    measured = tracker.peak
    single = _train(backend, config, weights, tokens, dp, None) if dp > 1 else digests[0]
    parts = memory.components(config, memory.Layout(1, dp), memory.Workload(tokens, 0))
    predicted = dp * memory.peak(parts)
    return {"shape": shape, "layers": layers, "dp": dp, "tokens": tokens, "measured_peak_bytes": measured,
            "model_peak_bytes": predicted, "measured_over_model": measured / predicted,
            "components_per_rank_bytes": parts, "weights_equal_one_rank": all(d == single for d in digests)}
