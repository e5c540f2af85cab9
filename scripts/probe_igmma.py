"""The H200's int8 wgmma rate alone: a loop of wgmma on resident shared memory (no loads), per shape,
operand source (SS / RS) and warpgroups per block. PYTHONPATH=$PWD python3 scripts/probe_igmma.py"""
import pathlib

import cupy as cp

from rlportable.runtime import get_backend
from rlportable.runtime.cuda import _nvrtc_compile

backend = get_backend("cuda")
source = (pathlib.Path(__file__).parent / "probe_igmma.cu").read_text()
module = cp.cuda.function.Module()
module.load(_nvrtc_compile(source, "probe", backend.compile_options()))
sms = cp.cuda.Device().attributes["MultiProcessorCount"]
out = cp.zeros(sms * 4 * 512, cp.int32)
for name, n, accs in (("ss64x2", 64, 2), ("ss128x2", 128, 2), ("ss128x1", 128, 1), ("ss256x1", 256, 1),
                      ("rs64x2", 64, 2), ("rs128x2", 128, 2), ("rs256x1", 256, 1)):
    f = module.get_function(name)
    cp.cuda.driver.funcSetAttribute(f.ptr, 8, 100 * 1024)
    for wgs in (1, 2, 3):
        for blocks_per_sm in (1,):
            iters = 2000
            grid = sms * blocks_per_sm
            f((grid,), (128 * wgs,), (cp.int32(10), out), shared_mem=100 * 1024)
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            f((grid,), (128 * wgs,), (cp.int32(iters), out), shared_mem=100 * 1024)
            stop.record(); stop.synchronize()
            s = cp.cuda.get_elapsed_time(start, stop) * 1e-3
            ops = 2 * 64 * n * 32 * 4 * accs * iters * wgs * grid
            print(f"{name} wgs={wgs}: {ops / s / 1e12:.0f} int8 TOPS", flush=True)
