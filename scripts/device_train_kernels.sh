set -uo pipefail
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache PYTHONPATH=$PWD
timeout 120 python3 -m rlportable.cli conform --device cuda --only adamw --json "$OUT/conform_cuda_adamw_h200.json" 2>&1 | tail -2
timeout 150 python3 -m rlportable.cli bench grpo --device cuda --peer none --json "$OUT/grpo_ours_h200.json" 2>&1 | grep -v "step "
timeout 280 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_train.py 64 320 2 > /tmp/ncu.csv 2>/tmp/ncu.err
echo "ncu rc $?"; tail -3 /tmp/ncu.err
python3 scripts/profile_train_kernels.py /tmp/ncu.csv > "$OUT/train_kernels_2layers_h200.json"; head -c 5000 "$OUT/train_kernels_2layers_h200.json"
