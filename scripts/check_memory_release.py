"""Device memory before and after a GRPO run at a Qwen3 shape, with its trainer, model and engine dropped.

    PYTHONPATH=. python3 scripts/check_memory_release.py [shape] [layers] [steps]
Defaults: qwen3-1.7b, all 28 layers, one warm-up step and one timed step of bench grpo's settings
(8 prompts x 8 samples, 64 + 256 tokens). bench.grpo.measure_ours drops the trainer and the model and
frees CuPy's pool when it returns; this prints (JSON) the device memory in use (cudaMemGetInfo) and
the pool's bytes before the run, at its end (the pool's peak) and after, so that what stays held, if
anything, shows as "after" above "before". On a non-CUDA backend it says so and stops.
"""

import gc
import json
import sys

from rlportable.bench.grpo import Settings, bench_prompts, measure_ours
from rlportable.errors import RlpError
from rlportable.model.synthetic import qwen3_config, random_weights
from rlportable.runtime import get_backend

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-1.7b"
layers = int(sys.argv[2]) if len(sys.argv) > 2 else None
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 1
try:
    backend = get_backend("cuda")
except RlpError as error:
    sys.exit(f"check_memory_release: {error}")
cupy = backend.cupy
GIB = float(1 << 30)


def in_use() -> dict:
    backend.synchronize()
    free, total = cupy.cuda.runtime.memGetInfo()
    pool = cupy.get_default_memory_pool()
    return {"device_used_gib": (total - free) / GIB, "pool_used_gib": pool.used_bytes() / GIB,
            "pool_held_gib": pool.total_bytes() / GIB}


config = qwen3_config(shape, layers)
settings = Settings(steps=steps, warmup=1)
weights = random_weights(config)
result = {"shape": shape, "layers": config.num_hidden_layers, "steps": settings.total_steps}
gc.collect()
result["before"] = in_use()
run = measure_ours(backend, config, weights, bench_prompts(config, settings), settings)
result["pool_peak_gib"] = run.get("memory_pool_bytes", 0) / GIB
result["logp_mismatches"] = max(step["logp_mismatches"] for step in run["steps"]) if "steps" in run else None
del run
gc.collect()
cupy.get_default_memory_pool().free_all_blocks()
cupy.get_default_pinned_memory_pool().free_all_blocks()
result["after"] = in_use()
result["held_after_gib"] = result["after"]["device_used_gib"] - result["before"]["device_used_gib"]
print(json.dumps(result, indent=1))
