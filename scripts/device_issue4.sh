#!/usr/bin/env bash
# First GPU run of the sampling and adamw families, and a decode-bench smoke run.
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_issue4.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
cli="python3 -m rlportable.cli"
$cli conform --device cuda --only sampling --json "$OUT/conform_cuda_sampling_h200.json" 2>&1 | tail -15
$cli conform --device cuda --only adamw --json "$OUT/conform_cuda_adamw_h200.json" 2>&1 | tail -15
$cli conform --device cuda --kernel-source hip --quick --only sampling --json "$OUT/conform_cuda_hipsrc_sampling_h200.json" 2>&1 | tail -5
$cli conform --device cuda --kernel-source hip --quick --only adamw --json "$OUT/conform_cuda_hipsrc_adamw_h200.json" 2>&1 | tail -5
$cli bench decode --device cuda --layers 2 --sequences 32 --new-tokens 16 --time-limit 60 --json "$OUT/decode_smoke_h200.json" 2>&1 | tail -20
$cli conform --device cuda --quick --json "$OUT/conform_cuda_quick_h200.json" 2>&1 | tail -8
