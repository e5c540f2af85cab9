#!/usr/bin/env bash
# First GPU run of the backward kernels (issue 5), GRPO on cuda, and the decode graphs (issue 4).
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_issue5.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
cli="python3 -m rlportable.cli"
$cli conform --device cuda --quick --only backward --json "$OUT/conform_cuda_backward_quick_h200.json" 2>&1 | grep -v "^  checking"
$cli conform --device cuda --quick --only transpose --json "$OUT/conform_cuda_transpose_quick_h200.json" 2>&1 | tail -3
$cli conform --device cuda --kernel-source hip --quick --only backward --json "$OUT/conform_cuda_hipsrc_backward_quick_h200.json" 2>&1 | tail -12
$cli conform --device cuda --kernel-source hip --quick --only transpose --json "$OUT/conform_cuda_hipsrc_transpose_quick_h200.json" 2>&1 | tail -3
$cli conform --device cuda --quick --only engine --json "$OUT/conform_cuda_engine_graphs_h200.json" 2>&1 | tail -6
$cli grpo --device cuda --steps 3 --log-jsonl "$OUT/grpo_tiny_sft_cuda_h200.jsonl" 2>&1 | grep "^step"
$cli bench decode --device cuda --layers 2 --sequences 32 --new-tokens 16 --time-limit 60 --json "$OUT/decode_smoke_graphs_h200.json" 2>&1 | tail -8
