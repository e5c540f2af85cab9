#!/usr/bin/env bash
# A tree's short GPU check: conform of the golden digests, the norm backward, the engine and the
# sampler (CUDA sources), then bench grpo without the peer (our phase times).
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_session_check.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m rlportable.cli conform --device cuda \
    --only golden,norm.rmsnorm_backward,engine.tiny,model.tiny,sampling.engine_device_sampler \
    --json "$OUT/conform_cuda_golden_norm_engine_h200.json" 2>&1 | tail -4
timeout 150 python3 -m rlportable.cli bench grpo --device cuda --peer none --json "$OUT/grpo_ours_h200.json" \
    2>&1 | grep -v "step [0-9]"
