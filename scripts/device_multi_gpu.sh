#!/usr/bin/env bash
# Tensor parallelism on the 2 x H200 machine (kind nvidia-h200-x2). Usage there:
#   RLPORTABLE_COMMIT=<sha> bash scripts/device_multi_gpu.sh tp|kernels|dp
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
# NVLink multicast stays off (the device notes: it can take the host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# CuPy's NCCL binding loads libnccl.so.2: the nvidia-nccl wheel's copy, where it is installed
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null) \
    && export LD_LIBRARY_PATH=$nccl_lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cli="python3 -m rlportable"
nvidia-smi -L
python3 -c "from cupy.cuda import nccl; print('NCCL', nccl.get_version())"
case "$1" in
tp)  # real ranks, one process per GPU, NCCL: bitwise against one device; then decode scaling
    $cli conform --device cuda --tp 2 --json "$OUT/conform_cuda_tp2_h200x2.json" 2>&1 | grep -v "^  checking"
    $cli conform --device cuda --kernel-source hip --tp 2 --quick --json "$OUT/conform_cuda_hipsrc_tp2_quick_h200x2.json" 2>&1 | tail -9
    $cli bench decode --device cuda --tp 2 --sequences 256 --prompt-len 128 --new-tokens 128 --json "$OUT/decode_tp2_h200x2.json" 2>&1 | tail -6 ;;
kernels)  # one GPU: the new per-rank kernels against the reference (both sources), emulated TP end to end
    $cli conform --device cuda --only row_exponents,encode_rows_given,gemm.sums,round_sums,k_sharded,logprob.shards,gather_shard --json "$OUT/conform_cuda_parallel_ops_h200.json" 2>&1 | tail -12
    $cli conform --device cuda --kernel-source hip --only row_exponents,encode_rows_given,gemm.sums,round_sums,k_sharded,logprob.shards,gather_shard --json "$OUT/conform_cuda_hipsrc_parallel_ops_h200.json" 2>&1 | tail -4
    $cli conform --device cuda --only e2e.tp --json "$OUT/conform_cuda_e2e_tp_emulated_h200.json" 2>&1 | tail -14 ;;
dp)  # data-parallel GRPO, one process per GPU, against one GPU: same metrics, same final weight bits
    $cli grpo --device cuda --dp 2 --steps 3 --log-jsonl "$OUT/grpo_dp2_cuda_h200x2.jsonl" --out /tmp/dp2 2>&1 | tail -2
    $cli grpo --device cuda --steps 3 --log-jsonl "$OUT/grpo_dp1_cuda_h200x2.jsonl" --out /tmp/dp1 2>&1 | tail -1
    python3 scripts/compare_runs.py /tmp/dp1 /tmp/dp2 "$OUT/grpo_dp1_cuda_h200x2.jsonl" "$OUT/grpo_dp2_cuda_h200x2.jsonl" \
        | tee "$OUT/grpo_dp2_vs_dp1_h200x2.txt" ;;
esac
