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
from rlportable.errors import InputError, RlpError
from rlportable.model.forward import Model
from rlportable.ops import embedding
from rlportable.ops import sampling as sampling_op

#: where tokens are sampled: "host" (the contract's NumPy reference on the logits copied to the
#: host) or "device" (the sampling kernel for rows without filters, the host for filtered rows).
#: Both give the same tokens and log-probs, bit for bit, by contract.
SAMPLERS = ("host", "device")


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, sampler: str = "host"):
        if sampler not in SAMPLERS:
            raise InputError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
        self.sampler = sampler
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
        rows = np.asarray(rows, dtype=np.int32)
        picked = embedding.gather(self.backend, hidden, self.backend.asarray(rows), host_ids=rows)
        per_sample_rows = [i for i, e in enumerate(e for e in entries if e.needs_sample) for _ in e.sample_seqs]
        if self.sampler == "device":
            logits = self.model.logits(picked)
            if per_sample_rows != list(range(len(rows))):
                logits = embedding.gather(self.backend, logits,
                                          self.backend.asarray(np.asarray(per_sample_rows, dtype=np.int32)))
            return sample_tokens_on_device(self.backend, logits, out.samples)
        logits = self.backend.to_numpy(self.model.logits(picked))
        return sample_tokens(logits[per_sample_rows], out.samples)


def _block_tables(seqs: list[Sequence]) -> np.ndarray:
    width = max(1, max(len(s.block_table) for s in seqs))
    tables = np.zeros((len(seqs), width), dtype=np.int32)
    for i, seq in enumerate(seqs):
        tables[i, : len(seq.block_table)] = seq.block_table
    return tables


def _sampling_arrays(samples: list[Sequence]) -> dict:
    """Per-row sampling parameters and the sampler's counters (the token being generated sits at
    position num_tokens of its sequence)."""
    params = [s.params for s in samples]
    return dict(
        temperature=np.array([p.temperature for p in params], dtype=np.float64),
        top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]),
        min_p=np.array([p.min_p for p in params]),
        seed=np.array([p.seed for p in params], dtype=np.uint64),
        request=np.array([s.request_id for s in samples]),
        sample_index=np.array([s.sample_index for s in samples]),
        position=np.array([s.num_tokens for s in samples]))


def _top_logprobs(host_logits: np.ndarray, samples: list[Sequence], temperature: np.ndarray) -> list | None:
    wanted = max(s.params.logprobs for s in samples)
    if not wanted:
        return None
    ids, values = sampling.top_logprobs(host_logits, temperature, wanted)
    return [list(zip(ids[i, : s.params.logprobs].tolist(), values[i, : s.params.logprobs].tolist()))
            for i, s in enumerate(samples)]


def sample_tokens(logits: np.ndarray, samples: list[Sequence]) -> tuple[list[int], list[float], list | None]:
    """One token per sequence from its logits row (the sampler's contract, keyed by the sequence's
    seed, request, sample index and the position of the token being generated)."""
    arrays = _sampling_arrays(samples)
    temperature = arrays.pop("temperature")
    tokens = sampling.sample(logits, temperature, **arrays)
    logprobs = sampling.sampled_logprobs(logits, tokens, temperature)
    return [int(t) for t in tokens], [float(v) for v in logprobs], _top_logprobs(logits, samples, temperature)


def sample_tokens_on_device(backend, logits, samples: list[Sequence]) -> tuple[list[int], list[float], list | None]:
    """`sample_tokens` with the logits left on the device (a backend array [len(samples), V]): rows
    without filters go through the sampling kernel, filtered rows through the contract on the host,
    log-probs through the logprob kernel. The same tokens and log-probs as `sample_tokens`, bit for bit."""
    vocab = int(logits.shape[1])
    arrays = _sampling_arrays(samples)
    temperature, top_k, top_p, min_p = (arrays[k] for k in ("temperature", "top_k", "top_p", "min_p"))
    seed, request, sample_index, position = (arrays[k] for k in ("seed", "request", "sample_index", "position"))
    on_device = sampling_op.device_rows(vocab, temperature, top_k, top_p, min_p)
    tokens = np.zeros(len(samples), dtype=np.int32)
    groups = [(np.flatnonzero(on_device), True), (np.flatnonzero(~on_device), False)]
    for rows, device in groups:
        if rows.size == 0:
            continue
        z = logits if rows.size == len(samples) else embedding.gather(
            backend, logits, backend.asarray(rows.astype(np.int32)))
        counters = dict(seed=seed[rows], request=request[rows], sample_index=sample_index[rows],
                        position=position[rows])
        if device:
            tokens[rows] = backend.to_numpy(sampling_op.sample(backend, z, temperature[rows], **counters))
        else:
            tokens[rows] = sampling.sample(backend.to_numpy(z), temperature[rows], top_k=top_k[rows],
                                           top_p=top_p[rows], min_p=min_p[rows], **counters)
    logprobs = backend.to_numpy(sampling_op.sampled_logprobs(backend, logits, backend.asarray(tokens), temperature))
    top = _top_logprobs(backend.to_numpy(logits), samples, temperature) if max(s.params.logprobs for s in samples) else None
    return [int(t) for t in tokens], [float(v) for v in logprobs], top
