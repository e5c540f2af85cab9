#!/usr/bin/env bash
# One device call: the sharded optimiser on a GPU. The adamw kernels' conformance, the golden training
# trajectories at 1, 2 and 3 emulated data-parallel ranks, and the memory model against measured peaks
# (Qwen3-1.7B's shape, 4 layers, DP 1, 2 and 4 emulated).
#   RLPORTABLE_COMMIT=<commit> bash scripts/device_sharded_training.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
status=0
python3 -m rlportable conform --device cuda --quick --only adamw --json "$OUT/conform_cuda_adamw_h100.json" || status=1
python3 scripts/check_sharded_trajectories.py --device cuda "$OUT/sharded_trajectories_h100.json" || status=1
python3 -m rlportable bench memory --device cuda --model qwen3-1.7b --layouts 1x1,1x2,1x4 --tokens 4096 \
    --layers 4 --measure --json "$OUT/memory_h100.json" || status=1
exit $status
