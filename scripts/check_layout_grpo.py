"""GRPO on a Qwen3-shaped model (random weights, few layers) at several TP x DP layouts, ranks emulated as
threads on one device: every step's log-prob mismatches (engine against trainer) must be 0, and the
metrics and the final weights must equal the one-rank run's, bitwise.

    PYTHONPATH=$PWD python3 scripts/check_layout_grpo.py --device cuda OUT.json [--shape qwen3-1.7b --layers 4]
"""

import argparse
import hashlib
import json
import time

from rlportable.bench.grpo import hash_reward
from rlportable.bench.decode import random_prompts
from rlportable.model.forward import Model
from rlportable.model.synthetic import IdsOnlyTokenizer, qwen3_config, random_weights
from rlportable.provenance import provenance
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import run_threads
from rlportable.runtime.world import layout_groups
from rlportable.train.memory import parse_layouts
from rlportable.train.grpo import GRPOConfig, GRPOTrainer
from rlportable.train.rewards import RewardSet

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--device", default="cuda")
parser.add_argument("--shape", default="qwen3-1.7b")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="TPxDP, comma-separated")
args = parser.parse_args()

backend = get_backend(args.device)
config = qwen3_config(args.shape, args.layers)
weights = random_weights(config, seed=1)
grpo = GRPOConfig(steps=args.steps, prompts_per_step=4, num_generations=4, max_completion_length=64,
                  ignore_eos=True, learning_rate=1e-5, micro_batch_tokens=256, seed=0)
records = [{"prompt": row.tolist()} for row in random_prompts(config, args.steps * 4, 32, seed=1)]
TIMING = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")


def run(world_group, tp):
    tp_group, dp_group = layout_groups(world_group, tp)
    model = Model(backend, config, weights, trainable=True, tp_group=tp_group)
    trainer = GRPOTrainer(model, IdsOnlyTokenizer(), records, RewardSet([(hash_reward, 1.0)]), grpo, None, dp_group)
    steps = [trainer.step(i) for i in range(args.steps)]
    digest = hashlib.sha256()
    for name, array in trainer.optimizer.whole_weights().items():
        digest.update(name.encode() + array.tobytes())
    return ([{k: v for k, v in s.items() if k not in TIMING and not k.startswith("time/")} for s in steps],
            digest.hexdigest())


results, first = [], None
for tp, dp in ((layout.tp, layout.dp) for layout in parse_layouts(args.layouts)):
    started = time.perf_counter()
    ranks = run_threads(backend, tp * dp, lambda world_group, tp=tp: run(world_group, tp))
    metrics, digest = ranks[0]
    first = first or ranks[0]
    row = {"tp": tp, "dp": dp, "logp_mismatches": [m["logp_mismatches"] for m in metrics],
           "logp_compared": [m["logp_compared"] for m in metrics],
           "ranks_agree": all(r == ranks[0] for r in ranks), "metrics_equal_first": metrics == first[0],
           "weights_equal_first": digest == first[1], "seconds": time.perf_counter() - started}
    print(row, flush=True)
    results.append(row)
with open(args.out, "w") as handle:
    json.dump({"device": backend.label, "shape": args.shape, "layers": args.layers, "results": results,
               "provenance": provenance()}, handle, indent=1)
ok = all(r["ranks_agree"] and r["metrics_equal_first"] and r["weights_equal_first"] and not any(r["logp_mismatches"])
         for r in results)
raise SystemExit(0 if ok else 1)
