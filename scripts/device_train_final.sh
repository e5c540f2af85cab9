#!/usr/bin/env bash
# The training-speed results of a tree: conform adamw, bench grpo against TRL (64 + 256 and
# 64 + 1024 tokens), the op-level training profile. Needs .whl/ (scripts/device_bench_grpo.sh) and
# carry [".whl"]. Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_train_final.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=$PWD timeout 100 python3 -m rlportable.cli conform --device cuda --only adamw \
    --json "$OUT/conform_cuda_adamw_h200.json" 2>&1 | tail -1
timeout 280 bash scripts/device_bench_grpo.sh 2>&1 | grep -v "step [0-9]"
PYTHONPATH=$PWD timeout 60 python3 scripts/profile_train.py 64 320 > "$OUT/train_profile_h200.json" 2>/dev/null
head -c 1500 "$OUT/train_profile_h200.json"
timeout 230 bash scripts/device_bench_grpo.sh --steps 1 --completion-len 1024 2>&1 | grep -v "step [0-9]"
mv "$OUT/grpo_smoke_h200.json" "$OUT/grpo_1024_h200.json" 2>/dev/null
