"""Two training runs, bit for bit: the final checkpoints' weights and the per-step metrics (timings aside).

    python3 scripts/compare_runs.py RUN_A_DIR RUN_B_DIR A.jsonl B.jsonl
"""

import json
import sys

import numpy as np

from rlportable.train import checkpoint

TIMINGS = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")


def weights(folder: str) -> dict:
    ckpt = checkpoint.load_checkpoint(checkpoint.latest_checkpoint(folder))
    return {name: array.view(np.uint32) for name, array in ckpt.weights.named_tensors(ckpt.config).items()}


def metrics(path: str) -> list[dict]:
    with open(path) as lines:
        return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def main(a_dir, b_dir, a_log, b_log) -> int:
    a, b = weights(a_dir), weights(b_dir)
    differing = sum(int(np.count_nonzero(a[name] != b[name])) for name in a)
    elements = sum(array.size for array in a.values())
    same_metrics = metrics(a_log) == metrics(b_log)
    print(f"weights: {elements} elements, {differing} differ; metrics of {len(metrics(a_log))} steps identical: "
          f"{same_metrics}")
    return 0 if differing == 0 and same_metrics else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
