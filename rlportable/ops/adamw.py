"""Op family "adamw": exact global-norm clip factor and the in-place AdamW update.

Contract: contracts/adamw.toml; reference: rlportable/contract/adamw.py;
kernels: backends/portable/adamw.hip.

API
  clip_factor(backend, grads, max_norm, groups=(), counted=None) -> (c, norm)     host float64 scalars
  adamw_step(backend, params, grads, m, v, step, hyper, lr=None, groups=(), counted=None)
      -> StepInfo(lr, norm, clip)
      updates params, m and v IN PLACE (float32 backend arrays, C-contiguous, any shapes;
      m and v start as zeros); `hyper` is contract.adamw.Hyper; lr defaults to hyper.lr
      (pass contract.adamw.lr_at(step, ...) for the warmup + cosine schedule); step >= 1.
The gradients are the caller's accumulated gradients (their sum over micro-batches must be exact).
With groups, each rank passes its shard of every tensor (the update is element-wise; only the
global norm spans the ranks, and it is exact: integer MAX and SUM), so every shard gets the bits
one device computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.contract import adamw as ref
from rlportable.contract.adamw import Hyper, lr_at  # noqa: F401  (re-exported)
from rlportable.errors import InputError
from rlportable.ops.checks import require_contiguous, shape_of

THREADS = 256
MAX_GRID = 65535
#: elements per block of adamw_sumsq (<= the contract's 2^18, so every partial sum stays exact in
#: int64): small enough that a [1024, 1024] gradient fills 64 blocks, not 4
SUMSQ_CHUNK = 1 << 14


@dataclass(frozen=True)
class StepInfo:
    lr: float
    norm: float
    clip: float


def _size(name: str, array) -> int:
    if np.dtype(array.dtype) != np.float32:
        raise InputError(f"{name} must have dtype float32, got {np.dtype(array.dtype).name}")
    require_contiguous(name, array)
    return int(np.prod(shape_of(array), dtype=np.int64))


def _flat(array):
    return array.reshape(-1) if hasattr(array, "reshape") else array


def largest_bits(backend, grads) -> int:
    """The largest float32 magnitude bits over every element of every tensor (0 when none)."""
    sizes = [_size(f"grads[{i}]", g) for i, g in enumerate(grads)]
    if backend.runs_reference:
        return ref.max_magnitude_bits([backend.to_numpy(g) for g in grads])
    largest_dev = backend.zeros((1,), np.uint32)
    for g, n in zip(grads, sizes):
        if n:
            grid = min(MAX_GRID, -(-n // THREADS))
            backend.launch("adamw", "adamw_max_bits", (grid,), (THREADS,), (_flat(g), np.int64(n), largest_dev))
    return int(backend.to_numpy(largest_dev)[0])


def sum_of_squares(backend, grads, e: int) -> int:
    """The exact integer sum of every element's squared NORM_BITS fixed-point value at exponent e."""
    sizes = [_size(f"grads[{i}]", g) for i, g in enumerate(grads)]
    if backend.runs_reference:
        return sum(int(s) for g in grads for s in ref.chunk_sums(backend.to_numpy(g), e))
    # every tensor's chunk sums into one buffer, read back once (not a device wait per tensor)
    chunks = [-(-n // SUMSQ_CHUNK) for n in sizes]
    offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)
    out = backend.zeros((max(int(offsets[-1]), 1),), np.int64)
    for g, n, count, start in zip(grads, sizes, chunks, offsets):
        if n:
            backend.launch("adamw", "adamw_sumsq", (min(MAX_GRID, count),), (THREADS,),
                           (_flat(g), np.int64(n), np.int32(ref.NORM_BITS), np.int32(e),
                            np.int64(SUMSQ_CHUNK), out[int(start):int(start) + count]))
    return exact_sum(backend.to_numpy(out))


def global_norm(backend, grads, groups=(), counted=None) -> float:
    """The contract's global norm over every tensor. groups: the groups over which the tensors are cut
    (each rank passing its shards): MAX of the largest bits and exact SUM of the integer parts over
    each. counted: per tensor, whether this rank adds its squares (a tensor that every rank of a group
    holds whole is counted on one of them); default every tensor."""
    largest = largest_bits(backend, grads)
    for group in groups:
        if group.size > 1:
            largest = int(backend.to_numpy(group.all_reduce(backend.asarray(np.array([largest], np.uint32)),
                                                            "max"))[0])
    if largest >= 0x7F800000:
        return ref.norm_from_parts(largest, 0)
    chosen = grads if counted is None else [g for g, keep in zip(grads, counted) if keep]
    total = sum_of_squares(backend, chosen, ref.exponent_of(largest))
    for group in groups:
        if group.size > 1:
            total = sum(group.all_gather_object(total))  # Python ints: exact at any size
    return ref.norm_from_parts(largest, total)


def exact_sum(values: np.ndarray) -> int:
    """The exact sum of int64 values in [0, 2^62), as a Python int: numpy sums of the two 31-bit
    halves, which cannot overflow for fewer than 2^32 values."""
    values = np.asarray(values, dtype=np.int64)
    return (int(np.sum(values >> 31)) << 31) + int(np.sum(values & ((1 << 31) - 1)))


def clip_factor(backend, grads, max_norm, groups=(), counted=None) -> tuple[float, float]:
    """(c, norm): the contract's clip factor over every gradient tensor, and the global norm."""
    norm = global_norm(backend, grads, groups, counted)
    return ref.clip_from_norm(norm, max_norm), norm


def adamw_step(backend, params, grads, m, v, step: int, hyper: Hyper, lr: float | None = None,
               groups=(), counted=None) -> StepInfo:
    """One AdamW step over every tensor, in place (see the module docstring). groups, counted: the
    tensors are this rank's shards of the whole set, whose global norm clips every shard (global_norm)."""
    if not (len(params) == len(grads) == len(m) == len(v)):
        raise InputError("adamw_step: params, grads, m and v must be lists of the same length")
    for i, tensors in enumerate(zip(params, grads, m, v)):
        shapes = {shape_of(t) for t in tensors}
        if len(shapes) != 1:
            raise InputError(f"adamw_step: tensor {i}: params, grads, m, v shapes differ: {sorted(shapes)}")
    if int(step) < 1:
        raise InputError(f"adamw_step: steps count from 1, got {step}")
    lr = float(hyper.lr if lr is None else lr)
    c, norm = clip_factor(backend, grads, hyper.max_norm, groups, counted)
    s = ref.hyper_scalars(hyper, step, lr)
    for i, (p, g, mi, vi) in enumerate(zip(params, grads, m, v)):
        n = _size(f"params[{i}]", p)
        for name, t in (("m", mi), ("v", vi)):
            _size(f"{name}[{i}]", t)
        if backend.runs_reference:
            new_p, new_m, new_v = ref.adamw_update(np.ravel(p), np.ravel(g), np.ravel(mi), np.ravel(vi), c, s)
            p.reshape(-1)[...] = new_p
            mi.reshape(-1)[...] = new_m
            vi.reshape(-1)[...] = new_v
        elif n:
            grid = min(MAX_GRID, -(-n // THREADS))
            backend.launch("adamw", "adamw_update", (grid,), (THREADS,),
                           (_flat(p), _flat(g), _flat(mi), _flat(vi), np.int64(n), np.float64(c),
                            np.float64(s["beta1"]), np.float64(s["one_minus_beta1"]), np.float64(s["beta2"]),
                            np.float64(s["one_minus_beta2"]), np.float64(s["decay"]), np.float64(s["step_size"]),
                            np.float64(s["sqrt_bc2"]), np.float64(s["eps"])))
    return StepInfo(lr=lr, norm=norm, clip=c)
