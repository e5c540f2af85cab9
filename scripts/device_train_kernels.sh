#!/usr/bin/env bash
# Kernel times of one training step (2 layers of the Qwen3-0.6B shape, 64 x 320 tokens, the
# optimiser step included) under ncu, and the op-level profile of the 28-layer step.
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_train_kernels.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 90 python3 scripts/profile_train.py 64 320 > "$OUT/train_profile_h200.json" 2> "$OUT/train_profile.log"
timeout 300 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv \
    python3 scripts/profile_train.py 64 320 2 > "$OUT/train_kernels_ncu_h200.csv" 2> "$OUT/ncu.log"
echo "ncu rc $?"
python3 scripts/profile_train_kernels.py "$OUT/train_kernels_ncu_h200.csv" > "$OUT/train_kernels_2layers_h200.json"
head -c 6000 "$OUT/train_kernels_2layers_h200.json"
gzip "$OUT/train_kernels_ncu_h200.csv"
