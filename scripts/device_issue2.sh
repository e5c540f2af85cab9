#!/usr/bin/env bash
# Issue 2 on the GPU: conform (CUDA sources, then HIP sources through the prelude), with the
# exhaustive exp/log grading, and bench gemm. Usage on the device machine: bash scripts/device_issue2.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
python3 -m rlportable.cli conform --device cuda --exhaustive --json "$OUT/conform_cuda_h200.json"
python3 -m rlportable.cli conform --device cuda --kernel-source hip --exhaustive --json "$OUT/conform_cuda_hipsrc_h200.json"
python3 -m rlportable.cli bench gemm --device cuda --json "$OUT/gemm_h200.json"
python3 -m rlportable.cli bench gemm --device cuda --sweep-tiles --json "$OUT/gemm_sweep_h200.json"
