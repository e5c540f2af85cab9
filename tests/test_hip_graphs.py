"""The hip backend's graph capture without an AMD GPU: a stand-in hip-python module records the calls.

What this checks is the call sequence (capture on the engine stream, kernels launched there, memory
freed during the capture held until the graph goes, the capture ended on errors); that HIP graphs
run correctly needs `rlportable conform --device hip` on an AMD GPU."""

import gc

import numpy as np
import pytest

from rlportable.errors import RlpError
from rlportable.runtime import hip as hip_runtime


class FakeHip:
    """hip-python's calling convention: a tuple (status, outputs...), status 0 = success."""

    class hipStreamCaptureMode:
        hipStreamCaptureModeRelaxed = 2

    def __init__(self):
        self.calls = []
        self.freed = []
        self.next_pointer = 0x1000
        self.fail_instantiate = False

    def _call(self, name, *args, result=None):
        self.calls.append((name,) + args)
        return (0,) if result is None else (0, result)

    def hipMalloc(self, nbytes):
        self.next_pointer += 0x1000
        return self._call("hipMalloc", nbytes, result=self.next_pointer)

    def hipFree(self, ptr):
        self.freed.append(ptr)
        return self._call("hipFree", ptr)

    def hipStreamCreate(self):
        return self._call("hipStreamCreate", result="engine-stream")

    def hipStreamBeginCapture(self, stream, mode):
        return self._call("hipStreamBeginCapture", stream, mode)

    def hipStreamEndCapture(self, stream):
        return self._call("hipStreamEndCapture", stream, result="graph")

    def hipGraphInstantiateWithFlags(self, graph, flags):
        if self.fail_instantiate:
            return (1,)
        return self._call("hipGraphInstantiateWithFlags", graph, flags, result="graph-exec")

    def hipGraphLaunch(self, graph_exec, stream):
        return self._call("hipGraphLaunch", graph_exec, stream)

    def hipGraphExecDestroy(self, graph_exec):
        return self._call("hipGraphExecDestroy", graph_exec)

    def hipGraphDestroy(self, graph):
        return self._call("hipGraphDestroy", graph)

    def hipModuleLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        return self._call("hipModuleLaunchKernel", function, stream)


@pytest.fixture
def backend():
    fake = FakeHip()
    made = hip_runtime.HipBackend.__new__(hip_runtime.HipBackend)
    made.hip = fake
    made.memory = hip_runtime.GraphMemory(fake)
    made.stream = None
    made._engine_stream = None
    made.supports_graphs = True
    made.function = lambda family, kernel: f"{family}.{kernel}"
    return made


def launches(fake):
    return [call for call in fake.calls if call[0] == "hipModuleLaunchKernel"]


def test_kernels_launch_on_the_engine_stream_only_inside_it(backend):
    backend.launch("f", "k", (1,), (1,), (np.int32(1),))
    with backend.engine_stream():
        backend.launch("f", "k", (1,), (1,), (np.int32(1),))
    backend.launch("f", "k", (1,), (1,), (np.int32(1),))
    assert [call[2] for call in launches(backend.hip)] == [None, "engine-stream", None]


def test_capture_holds_freed_memory_until_the_graph_goes(backend):
    fake = backend.hip

    def captured():
        scratch = backend.empty((16,), np.float32)  # freed inside the capture: a replay still uses it
        pointer = scratch.ptr
        backend.launch("f", "k", (1,), (1,), (scratch,))
        del scratch
        out = backend.empty((4,), np.float32)
        return out, pointer

    graph, (out, scratch_pointer) = backend.capture_graph(captured)
    names = [call[0] for call in fake.calls]
    order = [names.index(name) for name in ("hipStreamBeginCapture", "hipModuleLaunchKernel", "hipStreamEndCapture")]
    assert order == sorted(order)
    assert launches(fake)[0][2] == "engine-stream" and backend.stream is None
    assert ("hipGraphInstantiateWithFlags", "graph", 0) in fake.calls
    assert scratch_pointer not in fake.freed and graph.held == [scratch_pointer]
    graph.replay()
    assert fake.calls[-1] == ("hipGraphLaunch", "graph-exec", "engine-stream")
    del graph
    gc.collect()
    assert scratch_pointer in fake.freed
    assert ("hipGraphExecDestroy", "graph-exec") in fake.calls and ("hipGraphDestroy", "graph") in fake.calls
    assert out.ptr not in fake.freed  # the graph's output belongs to the caller
    backend.empty((8,), np.float32)  # after the capture, frees are immediate again
    gc.collect()
    assert len(fake.freed) == 2


def test_a_failed_capture_ends_it_and_frees_what_it_held(backend):
    fake = backend.hip

    def broken():
        backend.empty((16,), np.float32)  # allocated and dropped at once: held
        raise ValueError("inside the capture")

    with pytest.raises(ValueError, match="inside the capture"):
        backend.capture_graph(broken)
    assert ("hipStreamEndCapture", "engine-stream") in fake.calls and ("hipGraphDestroy", "graph") in fake.calls
    assert len(fake.freed) == 1 and backend.memory.held is None and backend.stream is None
    fake.fail_instantiate = True
    with pytest.raises(RlpError, match="hipGraphInstantiateWithFlags"):
        backend.capture_graph(lambda: backend.empty((4,), np.float32))
    assert backend.memory.held is None and backend.stream is None


def test_typed_views_share_the_upload_buffer(backend):
    buffer = backend.empty((1024,), np.uint8)
    view = backend.typed_view(buffer, 256, (3, 2), np.float64)
    assert view.shape == (3, 2) and view.dtype == np.float64 and view.ptr == buffer.ptr + 256
    assert view._allocation is buffer._allocation
