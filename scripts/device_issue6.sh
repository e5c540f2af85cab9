#!/usr/bin/env bash
# GPU runs of the session's last changes. Usage on the device machine:
#   RLPORTABLE_COMMIT=<sha> bash scripts/device_issue6.sh attention|e2e|train
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cli="python3 -m rlportable.cli"
case "$1" in
attention)  # split-KV decode attention: bits, then speed
    $cli conform --device cuda --quick --only attention --json "$OUT/conform_cuda_attention_split_quick_h200.json" 2>&1 | grep -v "^  checking"
    $cli conform --device cuda --kernel-source hip --quick --only attention --json "$OUT/conform_cuda_hipsrc_attention_split_quick_h200.json" 2>&1 | tail -4
    timeout 120 python3 scripts/profile_decode.py > "$OUT/decode_profile_split_h200.json"
    timeout 60 python3 scripts/profile_decode.py 8 2048 > "$OUT/decode_profile_split_8x2048_h200.json"
    grep -A3 '"ops_ms"' "$OUT/decode_profile_split_h200.json"
    $cli bench decode --device cuda --time-limit 100 --json "$OUT/decode_split_h200.json" 2>&1 | tail -8 ;;
e2e)  # golden digests and the end-to-end sweep
    $cli conform --device cuda --only golden --json "$OUT/conform_cuda_golden_h200.json" 2>&1 | tail -4
    $cli conform --device cuda --only e2e. --peer hf --json "$OUT/conform_cuda_e2e_h200.json" 2>&1 | tail -45 ;;
train)  # where a training step's time goes (bench grpo's shape: 64 sequences of 320 tokens)
    python3 scripts/profile_train.py 64 320 > "$OUT/train_profile_h200.json"; head -c 3000 "$OUT/train_profile_h200.json" ;;
esac
