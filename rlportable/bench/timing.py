"""Device timing by CUDA graph replay: launch gaps and Python overhead stay out of the numbers."""

from __future__ import annotations

import statistics
from typing import Callable


def time_cupy_graph(cupy, step: Callable[[], None], replays: int = 20, repeats: int = 5) -> float:
    """Median seconds per call of `step`, captured once in a CUDA graph and replayed."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # warm-up: compiles kernels, fills the memory pool
        stream.synchronize()
        stream.begin_capture()
        for _ in range(replays):
            step()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        samples = []
        for _ in range(repeats):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / replays)
    return statistics.median(samples)


# A timing aid, not a compute kernel: it holds the stream busy while the host queues work.
_SPIN_SOURCE = r"""
extern "C" __global__ void bench_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def replay_ms(cupy, graph, stream, repeats: int = 10) -> float:
    """Median milliseconds of one replay of a captured graph (anything with .replay()) on `stream`, each
    replay between two CUDA events after the one before has finished (the profiling scripts)."""
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        graph.replay()
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def time_cupy_loop(cupy, step: Callable[[], None], replays: int = 20, repeats: int = 5,
                   spin_seconds: float = 0.02) -> float:
    """Median device seconds per call of `step`, for code CuPy cannot capture in a graph
    (its cuBLAS wrappers). A spin kernel keeps the GPU busy while Python queues the
    launches, so they then run back to back: host overhead stays out of the number."""
    spin = cupy.RawKernel(_SPIN_SOURCE, "bench_spin")
    cycles = int(spin_seconds * cupy.cuda.Device().attributes["ClockRate"] * 1e3)
    step()
    cupy.cuda.runtime.deviceSynchronize()
    samples = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        spin((1,), (1,), (cupy.int64(cycles),))
        start.record()
        for _ in range(replays):
            step()
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3 / replays)
    return statistics.median(samples)


def time_torch_graph(torch, step: Callable[[], None], replays: int = 20, repeats: int = 5) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(replays):
            step()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / 1e3 / replays)
    return statistics.median(samples)
