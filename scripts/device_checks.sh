#!/usr/bin/env bash
# One device call per phase, for the checks a CPU-only session leaves for the GPU:
#   conform    conform --quick of the CUDA sources and of the HIP sources through the prelude (the HIP
#              vendor files' MFMA kernels are not built there: their #if leaves them out)
#   attention  the training forward's attention against torch sdpa (8 x 4160, 2 x 16448), bench attention
#   memory     device memory around a GRPO run at the Qwen3-1.7B shape (scripts/check_memory_release.py)
# Usage on the device machine: RLPORTABLE_COMMIT=<sha> bash scripts/device_checks.sh PHASE...
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -d ' ' | tr 'A-Z' 'a-z' | sed 's/nvidia//')
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
for phase in "$@"; do
    case "$phase" in
        conform)
            python3 -m rlportable.cli conform --device cuda --quick --json "$OUT/conform_cuda_quick_$card.json" | tail -3
            python3 -m rlportable.cli conform --device cuda --kernel-source hip --quick \
                --json "$OUT/conform_cuda_hipsrc_quick_$card.json" | tail -3 ;;
        attention)
            python3 scripts/profile_attention_forward.py 8 4160 | tee "$OUT/attention_forward_8x4160_$card.json"
            python3 scripts/profile_attention_forward.py 2 16448 | tee "$OUT/attention_forward_2x16448_$card.json"
            python3 -m rlportable.cli bench attention --device cuda --json "$OUT/attention_$card.json" | tail -12 ;;
        memory)
            python3 scripts/check_memory_release.py qwen3-1.7b | tee "$OUT/memory_release_qwen3_1.7b_$card.json" ;;
        *) echo "unknown phase $phase (conform, attention, memory)" >&2; exit 2 ;;
    esac
done
