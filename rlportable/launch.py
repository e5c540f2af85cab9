"""Between the command line and the work: where a command runs and as how many ranks.

Every command that can run on several ranks (generate, conform, bench decode with --tp; sft and grpo
with --tp x --dp) comes through here. The backend is made once per rank (device and kernel source),
the ranks are formed once, and the work gets its groups under one name each: `tp_group` and, for
training, `dp_group` and `ep_group` (runtime/world.py `model_groups`: consecutive ranks share a model).

How the ranks run:
  * launched as a rank (WORLD_SIZE > 1 in the environment, by this module or torchrun): this GPU's
    rank of the NCCL/RCCL group (runtime/world.py);
  * one rank: one device, a group of one;
  * emulated (--emulate), or on cpu: threads of this process on one backend;
  * otherwise: this same command started once per GPU (spawn_ranks), which waits for them; when one
    fails the others are stopped (they would wait in a collective for it forever), and the command
    exits with the first failure's code.
The cli parses, calls one of these and prints; rank 0 alone reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable

from rlportable.errors import InputError
from rlportable.runtime.collectives import SingleGroup, run_threads
from rlportable.runtime.world import connect, free_port, model_groups, world_from_env


def spawn_ranks(size: int, argv: list[str], poll_s: float = 0.1) -> int:
    """Run `python -m rlportable *argv` as `size` ranks (rank r on GPU r); 0, or the exit code of the first
    rank that failed (the others are then terminated). Rank 0 keeps stdout; the other ranks' stdout is
    dropped (they compute the same results)."""
    port, rendezvous = free_port(), free_port()
    running = []
    for rank in range(size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RLPORTABLE_RENDEZVOUS_PORT=str(rendezvous))
        stdout = None if rank == 0 else subprocess.DEVNULL
        running.append(subprocess.Popen([sys.executable, "-m", "rlportable", *argv], env=env, stdout=stdout))
    failure = 0
    while [process.poll() for process in running].count(None):  # every rank polled each round
        if not failure:
            failure = next((p.returncode for p in running if p.returncode not in (None, 0)), 0)
            if failure:  # a rank failed: the others would wait for it in a collective
                for process in running:
                    if process.poll() is None:
                        process.terminate()
        time.sleep(poll_s)
    return failure or next((p.returncode for p in running if p.returncode), 0)


def run_ranks(device: str, world_size: int, emulate: bool, work: Callable,
              kernel_source: str = "native") -> tuple[bool, Any]:
    """(reports, work(backend, world_group)) for this process's rank of a run of `world_size` ranks;
    reports: whether this process prints the results (rank 0; the others computed the same). Started
    ranks exit through SystemExit with their worst exit code (see the module's docstring)."""
    from rlportable.runtime import get_backend, resolve_device

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"the number of ranks (--tp, --dp) must be an integer >= 1, got {world_size!r}")
    world = world_from_env()
    if world is not None:
        if world_size not in (1, world.size):
            raise InputError(f"{world_size} ranks asked for, but the launcher set WORLD_SIZE={world.size}")
        backend = get_backend(device, kernel_source, device_index=world.local_rank)
        world_group = connect(backend, world)
        try:
            return world.rank == 0, work(backend, world_group)
        finally:
            backend.synchronize()
            world_group.close()
    if world_size == 1:
        return True, work(get_backend(device, kernel_source), SingleGroup())
    if emulate or resolve_device(device) == "cpu":
        backend = get_backend(device, kernel_source)
        return True, run_threads(backend, world_size, lambda world_group: work(backend, world_group))[0]
    raise SystemExit(spawn_ranks(world_size, sys.argv[1:]))


def _check_counts(**counts) -> None:
    """--tp, --dp, --ep: each an integer >= 1, else one line naming the flag."""
    for flag, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"--{flag} must be an integer >= 1, got {value!r}")


def run_model(device: str, tp: int, ep: int, emulate: bool, work: Callable,
              kernel_source: str = "native") -> tuple[bool, Any]:
    """(reports, work(backend, tp_group, ep_group)) for this rank of one model over tp x ep ranks (the
    engine's: no data-parallel replicas)."""
    def layout(backend, world_group):
        if ep == 1:  # the world is the tensor-parallel group, as without expert parallelism
            return work(backend, world_group, SingleGroup())
        tp_group, ep_group, _ = model_groups(world_group, tp, ep)
        return work(backend, tp_group, ep_group)

    _check_counts(tp=tp, ep=ep)
    return run_ranks(device, tp * ep, emulate, layout, kernel_source)


def run_layout(device: str, tp: int, dp: int, emulate: bool, work: Callable,
               kernel_source: str = "native", ep: int = 1) -> tuple[bool, Any]:
    """(reports, work(backend, tp_group, dp_group, ep_group)) for this rank of tp x ep x dp ranks: each model
    cut over `tp` ranks, `ep` groups of those holding its experts (model/expert_parallel.py), `dp` replicas
    of it."""
    _check_counts(tp=tp, dp=dp, ep=ep)
    world = world_from_env()
    if world is not None and dp == 1 and world.size % (tp * ep) == 0:
        dp = world.size // (tp * ep)  # a launcher's ranks beyond the model cut are replicas, whatever --tp is

    def layout(backend, world_group):
        tp_group, ep_group, dp_group = model_groups(world_group, tp, ep)
        return work(backend, tp_group, dp_group, ep_group)

    return run_ranks(device, tp * ep * dp, emulate, layout, kernel_source)
