#!/usr/bin/env bash
# Issue 2 on the GPU: conform (CUDA sources, then HIP sources through the prelude) and bench gemm.
# Usage on the device machine: bash scripts/device_issue2.sh [quick]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; } | tee "$OUT/env.txt"
python3 -m rlportable.cli info | tee -a "$OUT/env.txt"
python3 -m rlportable.cli conform --device cuda ${1:+--quick} --json "$OUT/conform_cuda.json" 2>&1 | tee "$OUT/conform_cuda.log"
python3 -m rlportable.cli conform --device cuda --kernel-source hip ${1:+--quick} --json "$OUT/conform_cuda_hipsrc.json" 2>&1 | tee "$OUT/conform_hipsrc.log"
python3 -m rlportable.cli bench gemm --device cuda --json "$OUT/bench_gemm.json" 2>&1 | tee "$OUT/bench_gemm.log"
