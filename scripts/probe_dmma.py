"""The H200's FP64 tensor-core shapes: each one's fragment layout against a host product, and its
rate alone (independent mma on registers). PYTHONPATH=$PWD python3 scripts/probe_dmma.py"""
import pathlib

import cupy as cp
import numpy as np

from rlportable.runtime import get_backend
from rlportable.runtime.cuda import _nvrtc_compile

backend = get_backend("cuda")
source = (pathlib.Path(__file__).parent / "probe_dmma.cu").read_text()
module = cp.cuda.function.Module()
module.load(_nvrtc_compile(source, "probe_dmma", backend.compile_options()))
rng = np.random.default_rng(0)
a = rng.integers(-1000, 1000, (16, 16)).astype(np.float64)
b = rng.integers(-1000, 1000, (16, 8)).astype(np.float64)
outs = [cp.zeros((16, 8), cp.float64) for _ in range(4)]
module.get_function("layout")((1,), (32,), (cp.asarray(a), cp.asarray(b), *outs))
want = a @ b
for name, out, rows in zip(("m8n8k4", "m16n8k4", "m16n8k8", "m16n8k16"), outs, (8, 16, 16, 16)):
    print(name, "layout", "ok" if np.array_equal(cp.asnumpy(out)[:rows], want[:rows]) else "WRONG", flush=True)
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
for name, flops_per in (("rate_884", 8 * 8 * 8 * 4 * 2), ("rate_1684", 8 * 16 * 8 * 4 * 2),
                        ("rate_1688", 8 * 16 * 8 * 8 * 2), ("rate_16816", 4 * 16 * 8 * 16 * 2)):
    f = module.get_function(name)
    for warps in (4, 8, 16):
        grid, iters = sms * 2, 4000
        out = cp.zeros(grid * 32 * warps, cp.float64)
        f((grid,), (32 * warps,), (cp.int32(10), out))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        f((grid,), (32 * warps,), (cp.int32(iters), out))
        stop.record(); stop.synchronize()
        seconds = cp.cuda.get_elapsed_time(start, stop) * 1e-3
        print(f"{name} warps/block={warps}: {flops_per * iters * warps * grid / seconds / 1e12:.1f} FP64 TFLOPS",
              flush=True)
