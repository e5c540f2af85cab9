"""Where a training step's time goes: exclusive device time per op (synchronising after each call),
the optimiser step (AdamW and the weights' re-encoding) included.

    PYTHONPATH=. python3 scripts/profile_train.py sequences length [layers] [--recompute-attention]
One forward + backward of packed sequences (all next-token rows scored), Qwen3-0.6B shape, random
weights. Synchronising after every op makes the total a little larger than the real run's.
"""

import json
import sys
import time

import numpy as np

from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.model import backward, forward
from rlportable.ops import (activation, adamw, attention, embedding, fixedpoint, gemm, logprob, norm, residual, rope,
                            rowsum)
from rlportable.runtime import get_backend
from rlportable.train.optimizer import Hyper, Optimizer, Schedule
from profiling import op_timer

numbers = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
sequences, length = numbers[0], numbers[1]
layers = numbers[2] if len(numbers) > 2 else None
KEEP_ATTENTION = "--recompute-attention" not in sys.argv
backend = get_backend("cuda")
config = qwen3_06b_config(layers)
model = forward.Model(backend, config, random_weights(config), trainable=True)
tokens = np.random.default_rng(1).integers(0, config.vocab_size, sequences * length).astype(np.int32)
cu = np.arange(0, sequences * length + 1, length)
totals, calls, timed = op_timer(backend)


PATCHES = ((gemm, ["gemm", "gemm_columns", "encode_weight"]), (fixedpoint, ["encode_rows"]),
           (attention, ["attention_packed", "attention_packed_backward"]),
           (norm, ["rmsnorm", "rmsnorm_heads", "add_rmsnorm", "rmsnorm_heads_rope", "rmsnorm_backward",
                   "rmsnorm_heads_backward"]),
           (rope, ["apply", "apply_backward"]), (activation, ["swiglu", "swiglu_encode", "swiglu_backward"]),
           (residual, ["add", "add_bias", "transpose"]), (rowsum, ["rowsum"]),
           (embedding, ["gather", "gather_backward"]),
           (logprob, ["lm_head_logprobs", "logprobs_backward"]))
for module, names in PATCHES:
    for name in names:
        setattr(module, name, timed(f"{module.__name__.split('.')[-1]}.{name}", getattr(module, name)))
for name in ("input_grad", "weight_grad", "weight_grad_operand", "_layer_backward", "_recompute",
             "_lm_head_backward"):
    setattr(backward, name, timed(f"backward.{name}", getattr(backward, name)))


optimizer = Optimizer(model, Hyper(lr=1e-6), Schedule(total_steps=10))
optimizer.step = timed("optimizer.step", optimizer.step)
model.reencode = timed("model.reencode", model.reencode)
for name in ("adamw_step", "global_norm"):
    setattr(adamw, name, timed(f"adamw.{name}", getattr(adamw, name)))


def step():
    fwd = backward.forward(model, tokens, cu, keep_attention=KEEP_ATTENTION)
    grads = backward.backward(model, fwd, np.full(fwd.rows.size, -1.0 / fwd.rows.size, np.float32))
    optimizer.accumulate(grads)
    optimizer.step()


step()  # warm-up (compiles)
totals.clear()
calls.clear()
backend.synchronize()
start = time.perf_counter()
step()
backend.synchronize()
wall = time.perf_counter() - start
rows = sorted(totals.items(), key=lambda kv: -kv[1])
print(json.dumps({"sequences": sequences, "length": length, "layers": config.num_hidden_layers,
                  "keep_attention": KEEP_ATTENTION, "wall_s": wall,
                  "exclusive_s": dict(rows), "calls": dict(calls)}, indent=1))
