#!/usr/bin/env bash
# One device call: sharded training on a GPU. The adamw kernels' conformance, the golden training
# trajectories at TP x DP layouts emulated as threads, and the memory model against measured peaks
# (Qwen3-1.7B's shape, 4 layers, layouts 1x1, 1x2, 2x1, 2x2 emulated).
#   RLPORTABLE_COMMIT=<commit> bash scripts/device_sharded_training.sh   (results: name them by the card)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
python3 -m rlportable conform --device cuda --quick --only adamw --json "$OUT/conform_cuda_adamw.json" || status=1
python3 scripts/check_layout_trajectories.py --device cuda "$OUT/layout_trajectories.json" || status=1
python3 -m rlportable bench memory --device cuda --model qwen3-1.7b --layouts 1x1,1x2,2x1,2x2 --tokens 4096 \
    --layers 4 --measure --json "$OUT/memory.json" || status=1
exit $status
