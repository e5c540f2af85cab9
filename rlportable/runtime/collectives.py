"""Collectives between tensor-parallel ranks: NCCL (cuda), RCCL (hip), and an in-process emulation.

Every collective the model uses is exact by construction (docs/parallelism.md, "Collectives only on
integers"):
  * all_reduce(x, "max") of int32 row exponents or uint32 order-preserving keys;
  * all_reduce(x, "sum") of int64 exact partial sums, or of uint32 bit patterns where one rank
    holds the value and every other rank holds 0 (a vocabulary-parallel gather);
  * all_gather(x), a copy;
  * all_to_all(x), a copy: rank r's x[j] reaches rank j as its out[r] (the sharded optimiser's
    gradient exchange; the ranks add what they receive in a fixed order themselves).
Integer MAX and integer SUM do not depend on the reduction order, the algorithm (ring, tree) or
the number of ranks, so any library and any topology give the same bits. No float is ever
summed across ranks.

Groups:
  * `SingleGroup`: one rank; every collective is the identity.
  * `ThreadGroup`: `size` ranks as threads of one process, on one backend (cpu, or one GPU): the
    emulation that CI runs and `--emulate` offers. The reduction happens on the host, in NumPy,
    with the same integer semantics as NCCL.
  * `NcclGroup` (cupy.cuda.nccl) and `RcclGroup` (hip-python's hip.rccl): one process per GPU.
"""

from __future__ import annotations

import pickle
import threading
from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np

from rlportable.errors import BackendUnavailable, InputError

OPS = ("sum", "max")
#: dtypes a collective may carry: the exact ones (and float32 for all_gather, a copy)
REDUCE_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.int64))
GATHER_DTYPES = REDUCE_DTYPES + (np.dtype(np.float32), np.dtype(np.uint8))


def _check(where: str, dtype, allowed) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype not in allowed:
        raise InputError(f"{where}: dtype {dtype} is not exact across ranks; use one of "
                         f"{', '.join(str(d) for d in allowed)}")
    return dtype


def check_reduce(array, op: str) -> np.dtype:
    """The dtype of an all_reduce's array, after checking the op and that the dtype is exact."""
    if op not in OPS:
        raise InputError(f"all_reduce: op must be one of {OPS}, got {op!r}")
    return _check("all_reduce", array.dtype, REDUCE_DTYPES)


class Group(ABC):
    """The ranks of one tensor-parallel model. rank in [0, size)."""

    rank: int = 0
    size: int = 1
    label: str = "?"

    @abstractmethod
    def all_reduce(self, array, op: str):
        """A new array: the element-wise SUM or MAX of `array` over the ranks (integer dtypes only)."""

    @abstractmethod
    def all_gather(self, array):
        """A new array [size, *array.shape]: every rank's `array`, in rank order."""

    @abstractmethod
    def all_to_all(self, array):
        """A new array [size, *rest] from `array` [size, *rest]: out[j] is rank j's array[rank]."""

    def split(self, color: int, key: int) -> "Group":
        """The ranks that pass the same color, as a group of their own ordered by key (every rank calls)."""
        if self.size == 1:
            return self
        wanted = self.all_gather_object((color, key))
        members = sorted((r for r in range(self.size) if wanted[r][0] == color), key=lambda r: (wanted[r][1], r))
        return self._subgroup(members, wanted)  # every rank takes part, whatever its own group's size

    def _subgroup(self, members: list[int], wanted: list) -> "Group":
        """This rank's group of `members` (parent ranks, in the new order); wanted: every rank's (color, key).
        One process a rank (NCCL, RCCL): the first member makes the communicator's id, the parent group
        carries it to the others; a group of one needs no communicator."""
        alone = len(members) == 1
        uid = self.new_unique_id() if self.rank == members[0] and not alone else None
        ids = self.all_gather_object(uid)
        return SingleGroup() if alone else type(self)(self.backend, members.index(self.rank), len(members),
                                                      ids[members[0]])

    def barrier(self) -> None:
        """Every rank reaches this point before any leaves it."""

    def close(self) -> None:
        """Release the communicator."""

    def all_gather_object(self, value) -> list:
        """Every rank's picklable `value`, in rank order (host data: samples, metrics, flags)."""
        if self.size == 1:
            return [value]
        backend = self.backend
        payload = np.frombuffer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
        lengths = backend.to_numpy(self.all_gather(backend.asarray(np.array([payload.size], np.int64))))
        padded = np.zeros(int(lengths.max()), np.uint8)
        padded[: payload.size] = payload
        everything = backend.to_numpy(self.all_gather(backend.asarray(padded)))
        return [pickle.loads(everything[rank, : int(lengths[rank, 0])].tobytes()) for rank in range(self.size)]


def _check_all_to_all(array, size: int) -> np.dtype:
    dtype = _check("all_to_all", array.dtype, GATHER_DTYPES)
    if not array.shape or array.shape[0] != size:
        raise InputError(f"all_to_all: the array's first dimension must be the group size {size}, "
                         f"got shape {tuple(array.shape)}")
    return dtype


class SingleGroup(Group):
    label = "single"
    backend = None

    def all_reduce(self, array, op: str):
        check_reduce(array, op)
        return array

    def all_gather(self, array):
        _check("all_gather", array.dtype, GATHER_DTYPES)
        return array.reshape((1,) + tuple(array.shape))

    def all_to_all(self, array):
        _check_all_to_all(array, 1)
        return array


# ---- the in-process emulation
class _Meeting:
    """Where the threads of a ThreadGroup leave their arrays and wait for each other."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.children: list["_Meeting"] = []  # the meetings of groups split from this one
        self.slots: list[Any] = [None] * size

    def exchange(self, rank: int, host: np.ndarray) -> list[np.ndarray]:
        self.slots[rank] = host
        self.barrier.wait()
        everything = list(self.slots)
        self.barrier.wait()  # nobody posts the next collective before everyone has read this one
        return everything

    def abort(self) -> None:
        """Break every wait here and in the split groups' meetings (a rank failed)."""
        self.barrier.abort()
        for child in self.children:
            child.abort()


class ThreadGroup(Group):
    """One rank of an emulated group: the ranks are threads of this process sharing one backend."""

    label = "threads"

    def __init__(self, backend, rank: int, meeting: _Meeting):
        self.backend = backend
        self.rank = rank
        self.size = meeting.size
        self._meeting = meeting

    @classmethod
    def create(cls, backend, size: int, timeout: float = 600.0) -> list["ThreadGroup"]:
        if not isinstance(size, int) or size < 1:
            raise InputError(f"the number of ranks must be an integer >= 1, got {size!r}")
        meeting = _Meeting(size, timeout)
        return [cls(backend, rank, meeting) for rank in range(size)]

    def _exchange(self, array) -> list[np.ndarray]:
        return self._meeting.exchange(self.rank, np.array(self.backend.to_numpy(array)))

    def all_reduce(self, array, op: str):
        dtype = check_reduce(array, op)
        parts = self._exchange(array)
        reduce = np.maximum.reduce if op == "max" else np.add.reduce  # integer: exact, wraps like NCCL
        return self.backend.asarray(reduce(np.stack(parts), axis=0).astype(dtype))

    def all_gather(self, array):
        _check("all_gather", array.dtype, GATHER_DTYPES)
        return self.backend.asarray(np.stack(self._exchange(array)))

    def _subgroup(self, members, wanted):
        meetings = None
        if self.rank == 0:  # one meeting per color, made once and handed to every thread
            counts: dict = {}
            for color, _ in wanted:
                counts[color] = counts.get(color, 0) + 1
            meetings = {color: _Meeting(count, self._meeting.timeout) for color, count in counts.items()}
            self._meeting.children.extend(meetings.values())
        meetings = self.all_gather_object(meetings)[0]
        if len(members) == 1:
            return SingleGroup()
        return ThreadGroup(self.backend, members.index(self.rank), meetings[wanted[self.rank][0]])

    def all_to_all(self, array):
        _check_all_to_all(array, self.size)
        parts = self._exchange(array)
        return self.backend.asarray(np.stack([part[self.rank] for part in parts]))

    def barrier(self) -> None:
        self._meeting.barrier.wait()

    def all_gather_object(self, value) -> list:
        return self._meeting.exchange(self.rank, value)


def run_threads(backend, world_size: int, work: Callable[[Group], Any]) -> list:
    """work(world_group) on `world_size` emulated ranks (threads); the results in rank order. An
    exception in any rank breaks the others' waits and is raised here (the first rank's that failed)."""
    groups = ThreadGroup.create(backend, world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            results[rank] = work(groups[rank])
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = error
            groups[rank]._meeting.abort()

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"rank-{rank}") for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    failures = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if failures:
        raise failures[0]
    if any(e is not None for e in errors):
        raise next(e for e in errors if e is not None)
    return results


# ---- one process per GPU
class NcclGroup(Group):
    """NCCL through cupy.cuda.nccl, on the current CuPy stream."""

    label = "nccl"

    def __init__(self, backend, rank: int, size: int, unique_id):
        """unique_id: what new_unique_id() returned on rank 0 (pickled across processes as is)."""
        from cupy.cuda import nccl

        self.backend, self.rank, self.size, self._nccl = backend, rank, size, nccl
        self._comm = nccl.NcclCommunicator(size, unique_id, rank)
        self._types = {np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
                       np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.uint8): nccl.NCCL_UINT8}
        self._ops = {"sum": nccl.NCCL_SUM, "max": nccl.NCCL_MAX}

    @staticmethod
    def new_unique_id():
        from cupy.cuda import nccl

        return nccl.get_unique_id()

    def _stream(self) -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    @staticmethod
    def _contiguous(array):
        import cupy

        return cupy.ascontiguousarray(array)

    def all_reduce(self, array, op: str):
        dtype = check_reduce(array, op)
        source = self._contiguous(array)
        out = self.backend.empty(tuple(array.shape), dtype)
        self._comm.allReduce(source.data.ptr, out.data.ptr, int(source.size), self._types[dtype], self._ops[op],
                             self._stream())
        return out

    def all_gather(self, array):
        dtype = _check("all_gather", array.dtype, GATHER_DTYPES)
        source = self._contiguous(array)
        out = self.backend.empty((self.size,) + tuple(array.shape), dtype)
        self._comm.allGather(source.data.ptr, out.data.ptr, int(source.size), self._types[dtype], self._stream())
        return out

    def all_to_all(self, array):
        dtype = _check_all_to_all(array, self.size)
        source = self._contiguous(array)
        out = self.backend.empty(tuple(array.shape), dtype)
        count, stream = int(source[0].size), self._stream()
        self._nccl.groupStart()  # one fused exchange: every send and receive in flight together
        for peer in range(self.size):
            self._comm.send(source[peer].data.ptr, count, self._types[dtype], peer, stream)
            self._comm.recv(out[peer].data.ptr, count, self._types[dtype], peer, stream)
        self._nccl.groupEnd()
        return out

    def barrier(self) -> None:
        self.all_reduce(self.backend.zeros((1,), np.int32), "sum")
        self.backend.synchronize()

    def close(self) -> None:
        self._comm.destroy()


class RcclGroup(Group):
    """RCCL through hip-python (hip.rccl), on the backend's stream. Never run: no AMD GPU here."""

    label = "rccl"

    def __init__(self, backend, rank: int, size: int, unique_id: bytes):
        from hip import rccl

        from rlportable.runtime.hip_array import check_hip

        self.backend, self.rank, self.size, self._rccl, self._check = backend, rank, size, rccl, check_hip
        self._comm = check_hip(rccl.ncclCommInitRank(size, bytearray(unique_id), rank), "ncclCommInitRank")
        types = rccl.ncclDataType_t
        self._types = {np.dtype(np.int32): types.ncclInt32, np.dtype(np.uint32): types.ncclUint32,
                       np.dtype(np.int64): types.ncclInt64, np.dtype(np.float32): types.ncclFloat32,
                       np.dtype(np.uint8): types.ncclUint8}
        self._ops = {"sum": rccl.ncclRedOp_t.ncclSum, "max": rccl.ncclRedOp_t.ncclMax}

    @staticmethod
    def new_unique_id() -> bytes:
        from hip import rccl

        from rlportable.runtime.hip_array import check_hip

        buffer = bytearray(128)  # NCCL_UNIQUE_ID_BYTES; hip-python writes through the buffer protocol
        check_hip(rccl.ncclGetUniqueId(buffer), "ncclGetUniqueId")
        return bytes(buffer)

    def all_reduce(self, array, op: str):
        dtype = check_reduce(array, op)
        source = array  # HipArrays are always C-contiguous
        out = self.backend.empty(tuple(array.shape), dtype)
        self._check(self._rccl.ncclAllReduce(source, out, int(source.size), self._types[dtype], self._ops[op],
                                             self._comm, self.backend.stream), "ncclAllReduce")
        return out

    def all_gather(self, array):
        dtype = _check("all_gather", array.dtype, GATHER_DTYPES)
        source = array  # HipArrays are always C-contiguous
        out = self.backend.empty((self.size,) + tuple(array.shape), dtype)
        self._check(self._rccl.ncclAllGather(source, out, int(source.size), self._types[dtype], self._comm,
                                             self.backend.stream), "ncclAllGather")
        return out

    def all_to_all(self, array):
        dtype = _check_all_to_all(array, self.size)
        out = self.backend.empty(tuple(array.shape), dtype)
        count, rccl = int(array[0].size), self._rccl
        self._check(rccl.ncclGroupStart(), "ncclGroupStart")
        for peer in range(self.size):
            self._check(rccl.ncclSend(array[peer], count, self._types[dtype], peer, self._comm, self.backend.stream),
                        "ncclSend")
            self._check(rccl.ncclRecv(out[peer], count, self._types[dtype], peer, self._comm, self.backend.stream),
                        "ncclRecv")
        self._check(rccl.ncclGroupEnd(), "ncclGroupEnd")
        return out

    def barrier(self) -> None:
        self.all_reduce(self.backend.zeros((1,), np.int32), "sum")
        self.backend.synchronize()

    def close(self) -> None:
        self._rccl.ncclCommDestroy(self._comm)


def device_group_class(backend) -> type:
    if backend.name == "cuda":  # CuPy arrays, whichever kernel sources
        return NcclGroup
    if backend.name == "hip":
        return RcclGroup
    raise BackendUnavailable(f"no multi-process collectives for the {backend.label} backend: run its ranks as "
                             "threads of one process (--emulate), or use --device cuda / hip")
