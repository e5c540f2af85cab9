#!/usr/bin/env bash
# The GPU runs behind the committed results: conform (CUDA sources, then HIP sources through the
# prelude, with the exhaustive exp/log grading), and the benchmarks.
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_run.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
python3 -m rlportable.cli conform --device cuda --exhaustive --json "$OUT/conform_cuda_h200.json"
python3 -m rlportable.cli conform --device cuda --kernel-source hip --json "$OUT/conform_cuda_hipsrc_h200.json"
python3 -m rlportable.cli bench gemm --device cuda --json "$OUT/gemm_h200.json"
python3 -m rlportable.cli bench forward --device cuda --json "$OUT/forward_h200.json"
python3 -m rlportable.cli bench decode --device cuda --json "$OUT/decode_h200.json"
python3 scripts/profile_forward.py 16 1024 > "$OUT/forward_profile_h200.json"
