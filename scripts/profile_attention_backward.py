"""Device time of attention_packed_backward per method (rows, tiled), one layer's call, and their bits.

    PYTHONPATH=. python3 scripts/profile_attention_backward.py [sequences] [length] [hq] [hkv] [head_dim] [source]
source: "native" (default, backends/cuda) or "hip" (backends/hip through the HIP-on-CUDA prelude).
Qwen3-0.6B's attention by default (16 q heads, 8 kv heads, head_dim 128) over 64 packed sequences of
320 tokens (bench grpo's default step: 64 + 256 tokens). Prints JSON: milliseconds per call (median
of 5 after a warm-up), each kernel's mean, and whether the two methods' outputs are bitwise equal.
"""

import json
import sys

import numpy as np

from rlportable.ops import attention
from rlportable.runtime import get_backend

sequences, length = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (64, 320)
hq, hkv, dim = (int(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (16, 8, 128)
source = sys.argv[6] if len(sys.argv) > 6 else "native"
backend = get_backend("cuda", kernel_source=source)
cupy = backend.cupy
rng = np.random.default_rng(0)
tokens = sequences * length
q, k, v, do = (backend.asarray(rng.standard_normal((tokens, heads, dim)).astype(np.float32))
               for heads in (hq, hkv, hkv, hq))
cu = np.arange(0, tokens + 1, length, dtype=np.int64)
o = attention.attention_packed(backend, q, k, v, cu)
result = {"kernel_source": source, "sequences": sequences, "length": length, "hq": hq, "hkv": hkv, "head_dim": dim, "ms": {}}
outputs = {}
kernels = {}  # method -> kernel -> (start, stop) events of the timed runs
current = [None]
launch = backend.launch


def timed_launch(family, kernel, *args, **kwargs):
    """Each kernel's device time (events around its launch), summed by name over the timed runs."""
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    launch(family, kernel, *args, **kwargs)
    stop.record()
    kernels.setdefault(current[0], {}).setdefault(kernel, []).append((start, stop))


backend.launch = timed_launch
RUNS = 5
for method in ("tiled", "rows"):
    current[0] = method
    times = []
    for run in range(RUNS + 1):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        grads = attention.attention_packed_backward(backend, q, k, v, do, cu, o=o, method=method)
        stop.record()
        stop.synchronize()
        if run:
            times.append(cupy.cuda.get_elapsed_time(start, stop))
        else:  # the warm-up (compiles)
            kernels.pop(method, None)
    result["ms"][method] = float(np.median(times))
    outputs[method] = [backend.to_numpy(g).view(np.uint32) for g in grads]
result["kernel_ms_per_call"] = {method: {name: sum(cupy.cuda.get_elapsed_time(a, b) for a, b in pairs) / RUNS
                                         for name, pairs in named.items()}
                                for method, named in kernels.items()}
result["bitwise_equal"] = all(np.array_equal(a, b) for a, b in zip(outputs["tiled"], outputs["rows"]))
result["speedup"] = result["ms"]["rows"] / result["ms"]["tiled"]
print(json.dumps(result))
