"""The processes of a parallel run (TP x DP ranks): who am I, who else, and how the groups are formed.

Two ways to start N ranks, one per GPU:
  * `rlportable <command> --tp T [--dp R] ...` starts N = T x R copies of the same command
    (rlportable/launch.py, which starts every multi-rank run), one per GPU, with the environment
    variables below;
  * an external launcher (`torchrun --nproc-per-node N -m rlportable <command> ...`, or any that
    sets the same variables) starts them itself.
Either way a rank reads RANK, WORLD_SIZE, LOCAL_RANK (its GPU), MASTER_ADDR and MASTER_PORT.
Rank 0 creates the NCCL/RCCL unique id and hands it to the others over a TCP socket at
MASTER_ADDR:(MASTER_PORT + 1) (torchrun's own agent may hold MASTER_PORT itself), or at
RLPORTABLE_RENDEZVOUS_PORT when that is set; RLPORTABLE_RENDEZVOUS_KEY (default "rlportable")
authenticates it.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Listener

from rlportable.errors import InputError
from rlportable.runtime.collectives import Group, device_group_class

RENDEZVOUS_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def rendezvous(self) -> tuple[str, int]:
        port = os.environ.get("RLPORTABLE_RENDEZVOUS_PORT")
        return self.master_addr, int(port) if port else self.master_port + 1


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise InputError(f"environment variable {name} is not set (a tensor-parallel rank needs RANK, "
                             "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun sets them)")
        return default
    try:
        return int(value)
    except ValueError:
        raise InputError(f"environment variable {name}={value!r} is not an integer") from None


def world_from_env() -> World | None:
    """The rank's World when WORLD_SIZE > 1 is set (by `--tp` or torchrun), else None."""
    size = _env_int("WORLD_SIZE", 1)
    if size <= 1:
        return None
    rank = _env_int("RANK")
    if not 0 <= rank < size:
        raise InputError(f"RANK={rank} must lie in [0, WORLD_SIZE={size})")
    return World(rank, size, _env_int("LOCAL_RANK", rank), os.environ.get("MASTER_ADDR", "127.0.0.1"),
                 _env_int("MASTER_PORT"))


def _authkey() -> bytes:
    return os.environ.get("RLPORTABLE_RENDEZVOUS_KEY", "rlportable").encode()


def share_unique_id(world: World, make_id):
    """Rank 0 calls make_id() and sends the result to every other rank; all return it."""
    if world.rank == 0:
        unique_id = make_id()
        with Listener(world.rendezvous, authkey=_authkey()) as listener:
            for _ in range(world.size - 1):
                with listener.accept() as connection:
                    connection.send(unique_id)
        return unique_id
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while True:
        try:
            with Client(world.rendezvous, authkey=_authkey()) as connection:
                return connection.recv()
        except (ConnectionRefusedError, FileNotFoundError, OSError):
            if time.monotonic() > deadline:
                raise InputError(f"rank {world.rank}: rank 0 did not answer at {world.rendezvous} within "
                                 f"{RENDEZVOUS_TIMEOUT_S:.0f} s") from None
            time.sleep(0.2)


def connect(backend, world: World) -> Group:
    """This process's rank of the device group (NCCL on cuda, RCCL on hip)."""
    group_class = device_group_class(backend)
    unique_id = share_unique_id(world, group_class.new_unique_id)
    return group_class(backend, world.rank, world.size, unique_id)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def layout_groups(world_group: Group, tp: int) -> tuple[Group, Group]:
    """(tp_group, dp_group) of this rank in a world of tp x dp ranks:
    consecutive ranks share a model (tensor parallelism, the fast links within a node); ranks with
    the same place in their model are the data-parallel replicas of that shard."""
    tp_group, _, dp_group = model_groups(world_group, tp, 1)
    return tp_group, dp_group


def model_groups(world_group: Group, tp: int, ep: int) -> tuple[Group, Group, Group]:
    """(tp_group, ep_group, dp_group) of this rank in a world of dp x ep x tp ranks: consecutive ranks
    share a tensor-parallel group; ep of those groups in a row make one model replica, whose ranks hold
    the same tokens (model/expert_parallel.py: each group its own experts), and ranks with the same
    place in their replica are the data-parallel replicas of that place."""
    for flag, value in (("--tp", tp), ("--ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{flag} must be an integer >= 1, got {value!r}")
    model = tp * ep
    if world_group.size % model:
        raise InputError(f"--tp {tp}" + (f" x --ep {ep}" if ep > 1 else "") + f" must divide the "
                         f"{world_group.size} ranks")
    rank = world_group.rank
    tp_group = world_group.split(rank // tp, rank)
    ep_group = world_group.split((rank // model) * tp + rank % tp, rank)
    dp_group = world_group.split(rank % model, rank)
    return tp_group, ep_group, dp_group
