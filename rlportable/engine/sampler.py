"""The engine's two samplers: how a step's logits become tokens and recorded log-probs.

HostSampling: the logits come back to the host, where the contract (rlportable/contract/sampling.py)
samples. DeviceSampling: the sampling kernels draw on the device and only tokens and log-probs come
back (rows the kernels do not serve, or that want top log-probs, take the host's way). Both give the
contract's bits; ModelRunner picks one per engine (sampler="host" or "device").
"""

from __future__ import annotations

import copy
import time

import numpy as np

from rlportable.contract import sampling
from rlportable.engine.sequence import Sequence
from rlportable.errors import InputError
from rlportable.ops import embedding
from rlportable.ops import sampling as sampling_op


def _sampling_arrays(samples: list[Sequence]) -> dict:
    """Per-row sampling parameters and the sampler's counters (the token being generated sits at
    position num_tokens of its sequence)."""
    params = [s.params for s in samples]
    return dict(
        temperature=np.array([p.temperature for p in params], dtype=np.float64),
        top_k=np.array([p.top_k for p in params]), top_p=np.array([p.top_p for p in params]),
        min_p=np.array([p.min_p for p in params]),
        seed=np.array([s.sampler_key[0] for s in samples], dtype=np.uint64),
        request=np.array([s.sampler_key[1] for s in samples]),
        sample_index=np.array([s.sample_index for s in samples]),
        position=np.array([s.num_tokens for s in samples]))


def _top_logprobs(host_logits: np.ndarray, samples: list[Sequence], temperature: np.ndarray,
                  rows: np.ndarray | None = None) -> list | None:
    """The top alternatives of every sample ([] where none were asked), None if no sample asks.
    host_logits holds the logits rows `rows` (default: every sample's)."""
    wanted = max(s.params.logprobs for s in samples)
    if not wanted:
        return None
    rows = np.arange(len(samples)) if rows is None else rows
    ids, values = sampling.top_logprobs(host_logits, temperature[rows], wanted)
    top: list = [[] for _ in samples]
    for i, row in enumerate(rows):
        count = samples[row].params.logprobs
        top[row] = list(zip(ids[i, :count].tolist(), values[i, :count].tolist()))
    return top


def sample_tokens(logits: np.ndarray, samples: list[Sequence]) -> tuple[list[int], list[float], list | None]:
    """One token per sequence from its logits row (the sampler's contract, keyed by the sequence's
    seed, request, sample index and the position of the token being generated)."""
    arrays = _sampling_arrays(samples)
    temperature = arrays.pop("temperature")
    tokens = sampling.sample(logits, temperature, **arrays)
    logprobs = sampling.sampled_logprobs(logits, tokens, temperature)
    return np.asarray(tokens).tolist(), np.asarray(logprobs).tolist(), _top_logprobs(logits, samples, temperature)


class HostSampling:
    """sampler="host": the logits [samples, V] come back to the host, where the contract samples."""

    def __init__(self, samples: list[Sequence]):
        self.samples = samples

    def uploads(self) -> dict[str, np.ndarray]:
        return {}

    def launch(self, backend, logits, views) -> list:
        return [logits]

    draws_all_on_device = False

    def finish(self, backend, host: list[np.ndarray], logits_overwritten: bool = False
               ) -> tuple[list[int], list[float], list | None]:
        start = time.perf_counter()
        result = sample_tokens(host[0], self.samples)
        self.host_s = time.perf_counter() - start  # the contract's sampler on the host
        return result


_KERNEL_PARAMETERS = ("temperature", "seed", "request", "sample_index", "position")


class DeviceSampling:
    """sampler="device": rows without filters are sampled on the device by the sampling kernel, which
    also gives each drawn token's log-prob at its row's record temperature (one launch for all of them);
    rows with top-k / top-p / min-p, and rows that want top alternatives, have their logits copied
    back and go through the contract on the host. The same tokens and log-probs as HostSampling, bit
    for bit. Parameters go up with the step's upload; results come back with its one download.

    Built for one list of sequences and reused while the same sequences sample (their parameters
    never change); `for_step` refreshes the one that does, the position."""

    def __init__(self, samples: list[Sequence], vocab: int):
        self.samples = samples
        arrays = self.arrays = _sampling_arrays(samples)
        self.temperature = arrays["temperature"]
        self.on_device = sampling_op.device_rows(vocab, self.temperature, arrays["top_k"], arrays["top_p"],
                                                 arrays["min_p"])
        wants_top = np.array([s.params.logprobs > 0 for s in samples])
        self.host_rows = np.flatnonzero(~self.on_device | wants_top).astype(np.int32)
        device = np.flatnonzero(self.on_device).astype(np.int32)
        self.groups = [device] if device.size else []  # the rows of each sampling launch: one
        self.order = device
        parameters = sampling_op.kernel_row_parameters(
            self.order.size, self.temperature[self.order], arrays["seed"][self.order], arrays["request"][self.order],
            arrays["sample_index"][self.order], arrays["position"][self.order])
        self._static = {f"sampler.{name}": array for name, array in zip(_KERNEL_PARAMETERS, parameters)}
        for k, rows in enumerate(self.groups):
            if rows.size != len(samples):
                self._static[f"sampler.rows{k}"] = rows
        if 0 < self.host_rows.size < len(samples):
            self._static["sampler.host_rows"] = self.host_rows
        self._uploads = self._static
        self._sampled_from: list = []

    @property
    def draws_all_on_device(self) -> bool:
        """Whether the kernel draws every row, in order (its tokens are then the step's, on the device)."""
        return not self.host_rows.size and len(self.groups) == 1 and self.groups[0].size == len(self.samples)

    def for_step(self, samples: list[Sequence], positions: np.ndarray | None = None) -> "DeviceSampling":
        """This sampler for a step of the same sequences: their positions now (the token each draws
        sits at position num_tokens of its sequence; `positions` gives them where the caller has them).
        A shallow copy that shares the parameters: two steps in flight each keep their own positions."""
        if positions is None:
            positions = np.fromiter((s.num_tokens for s in samples), dtype=np.int64, count=len(samples))
        positions = positions.astype(np.int64)
        if positions.size and positions.max() >= 1 << 32:
            raise InputError(f"sampling: position must lie in [0, 2^32), got {positions.max()}")
        step = copy.copy(self)
        step.samples = samples
        step.arrays = {**self.arrays, "position": positions}
        step._uploads = {**self._static, "sampler.position": positions[self.order].astype(np.uint32)}
        step._sampled_from = []
        return step

    def uploads(self) -> dict[str, np.ndarray]:
        return self._uploads

    def launch(self, backend, logits, views) -> list:
        """Queue the kernels; returns the device arrays to download: (tokens, log-probs) per group,
        then the host rows' logits if any."""
        everything = len(self.samples)
        pending, start = [], 0
        for k, rows in enumerate(self.groups):
            z = logits if rows.size == everything else embedding.gather(backend, logits, views[f"sampler.rows{k}"],
                                                                        host_ids=rows)
            part = slice(start, start + rows.size)
            start += rows.size
            pending += sampling_op.sample_on_device(backend, z, *(views[f"sampler.{name}"][part]
                                                                  for name in _KERNEL_PARAMETERS), with_logprobs=True)
            self._sampled_from.append(z)
        if self.host_rows.size:
            pending.append(logits if self.host_rows.size == everything else
                           embedding.gather(backend, logits, views["sampler.host_rows"], host_ids=self.host_rows))
        return pending

    def finish(self, backend, host: list[np.ndarray], logits_overwritten: bool = False
               ) -> tuple[list[int], list[float], list | None]:
        """The step's tokens, log-probs and top alternatives from its download. logits_overwritten: a later
        step may have written the logits array since (a graph's fixed output), so a refusal is reported
        without reading them again."""
        tokens = np.zeros(len(self.samples), dtype=np.int64)
        logprobs = np.zeros(len(self.samples), dtype=np.float32)
        for k, rows in enumerate(self.groups):
            group_tokens, group_logprobs = host[2 * k], host[2 * k + 1]
            if (group_tokens == sampling_op.REFUSED).any():
                if logits_overwritten:
                    row = int(np.flatnonzero(group_tokens == sampling_op.REFUSED)[0])
                    raise InputError(f"sampling: row {row} of the logits was refused by the sampling kernel "
                                     f"(a NaN, +inf or no finite value)")
                sampling_op.raise_refused(backend, self._sampled_from[k], group_tokens, self.temperature[rows])
            tokens[rows], logprobs[rows] = group_tokens, group_logprobs
        top = None
        if self.host_rows.size:
            host_logits = host[-1]
            filtered = ~self.on_device[self.host_rows]
            rows, z = self.host_rows[filtered], host_logits[filtered]
            if rows.size:
                a, t = self.arrays, self.temperature[rows]
                tokens[rows] = sampling.sample(z, t, top_k=a["top_k"][rows], top_p=a["top_p"][rows],
                                               min_p=a["min_p"][rows], seed=a["seed"][rows], request=a["request"][rows],
                                               sample_index=a["sample_index"][rows], position=a["position"][rows])
                logprobs[rows] = sampling.sampled_logprobs(z, tokens[rows], t)
            top = _top_logprobs(host_logits, self.samples, self.temperature, self.host_rows)
        return tokens.tolist(), logprobs.tolist(), top  # Python ints and floats (float32 values, exact)
