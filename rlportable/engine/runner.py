"""The model runner: executes one scheduler step on the model and its paged KV caches.

A step's tokens (decodes and prefill chunks of any number of sequences) go
through `Model.step` in one batch; the last row of every entry that needs a
token gives float32 logits (the exact gemm), and the sampler's contract draws
the tokens and records their log-probs. Because every op is a contract op, a
sequence's tokens and log-probs do not depend on the batch it ran in, on the
chunking, the block size, sharing or preemption, nor on the device.
"""

from __future__ import annotations

import numpy as np

from rlportable.contract import sampling
from rlportable.engine.block_manager import BlockCopy
from rlportable.engine.scheduler import SchedulerOutput
from rlportable.engine.sequence import Sequence
from rlportable.errors import RlpError
from rlportable.model.forward import Model
from rlportable.ops import embedding


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int):
        self.model = model
        self.backend = model.backend
        self.block_size = block_size
        self.caches = model.allocate_caches(num_blocks, block_size)

    # ---- KV cache maintenance
    def apply_copies(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: the valid slots of each source block into its destination block, every layer."""
        if not copies:
            return
        if self.backend.name == "hip":
            raise RlpError("copy-on-write of KV blocks is not implemented on the hip backend yet "
                           "(it needs indexed copies of HipArray); run n=1 requests or the cuda/cpu backends")
        pairs = [c.slot_pairs(self.block_size) for c in copies]
        src = self.backend.asarray(np.concatenate([p[0] for p in pairs]).astype(np.int64))
        dst = self.backend.asarray(np.concatenate([p[1] for p in pairs]).astype(np.int64))
        for cache in self.caches:
            for array in (cache.k_digits, cache.k_exponents, cache.v_digits, cache.v_exponents):
                array[dst] = array[src]  # a bit copy (int8 / int32), no arithmetic

    # ---- one step
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[float], list | None]:
        """Run a scheduled step; returns (token, log-prob, top alternatives or None) per out.samples."""
        self.apply_copies(out.copies)
        entries = out.scheduled
        tokens = np.concatenate([np.asarray(e.token_ids(), dtype=np.int32) for e in entries])
        positions = np.concatenate([np.arange(e.start, e.end, dtype=np.int64) for e in entries])
        slots = np.concatenate([np.asarray(e.slots(self.block_size), dtype=np.int32) for e in entries])
        q_seq = np.repeat(np.arange(len(entries), dtype=np.int32), [e.num_new_tokens for e in entries])
        tables = _block_tables([e.seq for e in entries])
        hidden = self.model.step(tokens, positions, q_seq, tables, slots, self.caches)
        ends = np.cumsum([e.num_new_tokens for e in entries]) - 1
        rows = [int(end) for end, e in zip(ends, entries) if e.needs_sample]
        if not rows:
            return [], [], None
        picked = embedding.gather(self.backend, hidden, self.backend.asarray(np.asarray(rows, dtype=np.int32)))
        logits = self.backend.to_numpy(self.model.logits(picked))
        per_sample_rows = [i for i, e in enumerate(e for e in entries if e.needs_sample) for _ in e.sample_seqs]
        return sample_tokens(logits[per_sample_rows], out.samples)


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    width = max(1, max(len(s.block_table) for s in seqs))
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return tables


def sample_tokens(logits: np.ndarray, samples: list[Sequence]) -> tuple[list[int], list[float], list | None]:
    """One token per sequence from its logits row (the sampler's contract, keyed by the sequence's
    seed, request, sample index and the position of the token being generated)."""
    params = [s.params for s in samples]
    temperature = np.array([p.temperature for p in params], dtype=np.float64)
    tokens = sampling.sample(
        logits, temperature,
        top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]),
        min_p=np.array([p.min_p for p in params]),
        seed=np.array([p.seed for p in params], dtype=np.uint64),
        request=np.array([s.request_id for s in samples]), sample_index=np.array([s.sample_index for s in samples]),
        position=np.array([s.num_tokens for s in samples]))
    logprobs = sampling.sampled_logprobs(logits, tokens, temperature)
    top = None
    wanted = max(p.logprobs for p in params)
    if wanted:
        ids, values = sampling.top_logprobs(logits, temperature, wanted)
        top = [list(zip(ids[i, : p.logprobs].tolist(), values[i, : p.logprobs].tolist())) for i, p in enumerate(params)]
    return [int(t) for t in tokens], [float(v) for v in logprobs], top
