#!/usr/bin/env bash
# One device call for the training-speed work: bench grpo against TRL (with its phase times), the
# training profile with and without the kept attention outputs, then conform (quick suite, and the
# attention backward in full). Needs .whl/ (scripts/device_bench_grpo.sh says how) and carry [".whl"].
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_train_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 260 bash scripts/device_bench_grpo.sh
export PYTHONPATH=$PWD
for mode in "" --recompute-attention; do
    name=train_profile${mode:+_recompute}_h200.json
    timeout 60 python3 scripts/profile_train.py 64 320 $mode > "$OUT/$name" 2> "$OUT/$name.log"
    tail -c 600 "$OUT/$name"
done
timeout 150 python3 -m rlportable.cli conform --device cuda --quick --json "$OUT/conform_cuda_quick_h200.json" \
    2>&1 | tail -5
timeout 100 python3 -m rlportable.cli conform --device cuda --only attention.backward \
    --json "$OUT/conform_cuda_backward_tiled_h200.json" 2>&1 | tail -3
