"""Device time of attention_packed (the training forward, tensor-core method) at one layer's call.

    PYTHONPATH=. python3 scripts/profile_attention_forward.py [sequences] [length] [hq] [hkv] [head_dim] [methods]
methods: comma-separated attention methods to time in turn (default "auto"; e.g. "mma,wgmma").
Qwen3-0.6B's attention (16 q heads, 8 kv heads, head_dim 128) over 8 packed sequences of 4160 tokens by
default. Prints JSON: milliseconds per call (median of 5 after a warm-up), split into the cache write and
the attention kernel, torch sdpa's (bf16, causal, GQA) on the same shapes when torch is there, and a
digest of the output's bits (two trees give the same bits when the digests agree).
"""

import hashlib
import json
import sys

import numpy as np

from rlportable.ops import attention
from rlportable.runtime import get_backend

sequences, length = (int(x) for x in sys.argv[1:3]) if len(sys.argv) > 2 else (8, 4160)
hq, hkv, dim = (int(x) for x in sys.argv[3:6]) if len(sys.argv) > 5 else (16, 8, 128)
methods = sys.argv[6].split(",") if len(sys.argv) > 6 else ["auto"]
backend = get_backend("cuda")
cupy = backend.cupy
rng = np.random.default_rng(0)
tokens = sequences * length
q, k, v = (backend.asarray(rng.standard_normal((tokens, heads, dim)).astype(np.float32)) for heads in (hq, hkv, hkv))
cu = np.arange(0, tokens + 1, length, dtype=np.int64)


def median_ms(call, runs=5):
    times = []
    for run in range(runs + 1):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        call()
        stop.record()
        stop.synchronize()
        if run:
            times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


result = {"sequences": sequences, "length": length, "hq": hq, "hkv": hkv, "head_dim": dim}
suffixes = {method: "" if methods == ["auto"] else f"_{method}" for method in methods}  # of the result's keys
for method, suffix in suffixes.items():
    result["attention_packed_ms" + suffix] = median_ms(
        lambda: attention.attention_packed(backend, q, k, v, cu, keep_stats=True, method=method))
    o, stats = attention.attention_packed(backend, q, k, v, cu, keep_stats=True, method=method)
    result["digest" + suffix] = hashlib.sha256(backend.to_numpy(o).view(np.uint32).tobytes()
                                               + backend.to_numpy(stats)[:, :2].tobytes()).hexdigest()[:16]
try:
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.randn(sequences, heads, length, dim, device="cuda", dtype=torch.bfloat16)
                  for heads in (hq, hkv, hkv))
    result["sdpa_bf16_ms"] = median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                              enable_gqa=True))
    for suffix in suffixes.values():
        result["ratio" + suffix] = result["attention_packed_ms" + suffix] / result["sdpa_bf16_ms"]
except ImportError:
    pass
print(json.dumps(result))
