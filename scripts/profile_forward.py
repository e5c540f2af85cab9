"""Where the forward's time goes: exclusive device time per op family (synchronising after each call).

    PYTHONPATH=. python3 scripts/profile_forward.py [sequences] [length] [layers]
Synchronising after every op makes the total a little larger than the real run's.
"""

import json
import sys
import time

import numpy as np

from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.model import forward
from rlportable.ops import activation, attention, embedding, gemm, logprob, norm, residual, rope
from rlportable.runtime import get_backend
from profiling import op_timer

sequences, length = int(sys.argv[1]), int(sys.argv[2])
layers = int(sys.argv[3]) if len(sys.argv) > 3 else None
backend = get_backend("cuda")
config = qwen3_06b_config(layers)
model = forward.Model(backend, config, random_weights(config))
tokens = np.random.default_rng(1).integers(0, config.vocab_size, sequences * length).astype(np.int32)
cu = np.arange(0, sequences * length + 1, length)

totals, _, timed = op_timer(backend)


for module, names in ((gemm, ["gemm"]), (attention, ["attention_packed"]), (norm, ["rmsnorm", "rmsnorm_heads"]),
                      (rope, ["apply"]), (activation, ["swiglu"]), (residual, ["add", "add_bias"]),
                      (embedding, ["gather"]), (logprob, ["lm_head_logprobs", "logprobs", "logprobs_and_entropy"])):
    for name in names:
        setattr(module, name, timed(f"{module.__name__.split('.')[-1]}.{name}", getattr(module, name)))

model.logprobs(tokens, cu)  # warm-up
totals.clear()
backend.synchronize()
start = time.perf_counter()
model.logprobs(tokens, cu)
backend.synchronize()
wall = time.perf_counter() - start
rows = sorted(totals.items(), key=lambda kv: -kv[1])
print(json.dumps({"sequences": sequences, "length": length, "layers": config.num_hidden_layers, "wall_s": wall,
                  "exclusive_s": dict(rows)}, indent=1))
