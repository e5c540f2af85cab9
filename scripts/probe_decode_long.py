"""Split-KV decode attention at long context: each kernel's time and the split count's effect.

    PYTHONPATH=$PWD python3 scripts/probe_decode_long.py [LENGTH:HQ ...]   (default 4096:16 4096:32 16384:16 16384:32)

bench attention's decode step (64 sequences, 8 KV heads, head_dim 128, one query each at the last of
LENGTH keys: rlportable.bench.attention.decode_inputs) through ops.attention.attention_paged, method
"split", at split_plan's keys per split and at RLP_PROBE_SPLITS (default 256,512,1024,2048). Each
call's output is compared bitwise with the default plan's (any split gives the same bits). Times:
median of CUDA events over 10 calls, and per kernel (events around each launch) for each plan.
One JSON line per (shape, plan): seconds, the kernels' seconds, the fraction of a device copy's
bandwidth (bench decode's bound).
"""
import json
import os
import statistics
import sys

import numpy as np

from rlportable.bench.attention import decode_inputs
from rlportable.bench.decode import copy_bandwidth
from rlportable.ops import attention
from rlportable.runtime import get_backend

SEQUENCES, HKV = 64, 8
SPLITS = tuple(int(n) for n in os.environ.get("RLP_PROBE_SPLITS", "256,512,1024,2048").split(",") if n)


def main(shapes):
    backend = get_backend("cuda")
    cupy = backend.cupy
    bandwidth = copy_bandwidth(backend)["bytes_per_s"]
    launch = backend.launch
    marks = []

    def timed_launch(family, kernel, grid, block, args, shared_mem=0):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        launch(family, kernel, grid, block, args, shared_mem=shared_mem)
        stop.record()
        marks.append((kernel, start, stop))

    for shape in shapes:
        length, hq = (int(n) for n in shape.split(":"))
        x = decode_inputs(backend, attention, length, hq, HKV, SEQUENCES, np.random.default_rng(length + hq))
        want = None
        for per_split in (None,) + SPLITS:
            def call():
                return attention.attention_paged(backend, x["q"], x["q_seq"], x["q_pos"], x["cache"], x["tables"],
                                                 method="split", keys_per_split=per_split)
            out = call()
            backend.synchronize()
            bits = cupy.asnumpy(out).view(np.uint32)
            if want is None:
                want = bits
            samples = []
            for _ in range(10):
                start, stop = cupy.cuda.Event(), cupy.cuda.Event()
                start.record()
                call()
                stop.record()
                stop.synchronize()
                samples.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
            backend.launch = timed_launch
            kernels = {}
            for _ in range(5):
                marks.clear()
                call()
                backend.synchronize()
                for kernel, start, stop in marks:
                    kernels.setdefault(kernel, []).append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
            backend.launch = launch
            splits, chunk = attention.split_plan(SEQUENCES, HKV, x["tables"].shape[1] * 16, per_split)
            seconds = statistics.median(samples)
            print(json.dumps({"length": length, "hq": hq, "hkv": HKV, "sequences": SEQUENCES,
                              "keys_per_split": chunk, "splits": splits, "default_plan": per_split is None,
                              "seconds": seconds, "bound_fraction": x["bytes"] / seconds / bandwidth,
                              "kernels_s": {k: statistics.median(v) for k, v in kernels.items()},
                              "bits_equal_default": bool(np.array_equal(bits, want)),
                              "device": backend.info()["device"]}), flush=True)
        del x
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1:] or ["4096:16", "4096:32", "16384:16", "16384:32"])
