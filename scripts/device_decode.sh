#!/usr/bin/env bash
# Decode speed on one H200: the checks and measurements of the decode path. Usage on the device machine:
#   RLPORTABLE_COMMIT=<sha> bash scripts/device_decode.sh gemm|attention|decode|all|step
#   gemm:   the exact gemm's kernels (every tile, wgmma included) bitwise against the reference,
#           then the tile sweep against torch bf16 (bench gemm --sweep-tiles)
#   attention: the split-KV decode kernels (CUDA and HIP sources) bitwise against the reference, then
#           scripts/probe_attention.py (RLP_PROBE_BASELINE=<earlier attention.cu> adds a baseline)
#   gemm_step: the gemm's checks (every tile, the stacked projections) and the golden digests, then step
#   fused_step: the norm family's checks (the fused add + RMSNorm, QK-norm + RoPE) on both sources and the
#           golden digests, then step
#   step:   one pass over what a decode step runs (quick): the sampling, split-attention and engine
#           checks on both sources, the engine against the trainer at batch 64, bench decode, the profile
#   decode: the engine's conform checks, bench decode (256 x 128 + 512) and the step profile
#   kernels: each kernel of one graph replay timed by Nsight Compute (RLP_PROFILE_NVTX), then the gemm
#           probe (scripts/probe_wgmma_phases.py)
#   fixed:  what does not scale: the first steps of a bench-decode-sized run (scripts/profile_first_steps.py),
#           each kernel of one replay (as kernels), the split attention kernels at 1, 128 and 384 keys (ncu)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{ date -u; echo "commit ${RLPORTABLE_COMMIT:-unknown}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee "$OUT/env.txt"
cli="python3 -m rlportable"
if [[ $1 == gemm || $1 == all ]]; then
    $cli conform --device cuda --only gemm --json "$OUT/conform_cuda_gemm_h200.json" 2>&1 | tail -6
    $cli bench gemm --device cuda --sweep-tiles --m 64 --m 256 --m 4096 --m 16384 --json "$OUT/gemm_sweep_h200.json" 2>&1 | tail -30
fi
if [[ $1 == attention || $1 == all ]]; then
    $cli conform --device cuda --only attention.split,attention.paged --json "$OUT/conform_cuda_attention_split_h200.json" 2>&1 | tail -6
    $cli conform --device cuda --kernel-source hip --only attention.split --json "$OUT/conform_cuda_hipsrc_attention_split_h200.json" 2>&1 | tail -6
    python3 scripts/probe_attention.py "$OUT/attention_probe_h200.json"
fi
if [[ $1 == decode || $1 == all ]]; then
    $cli conform --device cuda --quick --only gemm,engine,model.qwen3 --json "$OUT/conform_cuda_engine_quick_h200.json" 2>&1 | tail -6
    $cli bench decode --device cuda --json "$OUT/decode_h200.json" 2>&1 | tail -12
    python3 scripts/profile_decode.py > "$OUT/decode_profile_h200.json"; tail -c 1500 "$OUT/decode_profile_h200.json"
fi
if [[ $1 == gemm_step ]]; then
    $cli conform --device cuda --only gemm,gemm.invariance,gemm.columns,golden --json "$OUT/conform_cuda_gemm_columns_h200.json" 2>&1 | tail -6
fi
if [[ $1 == fused_step ]]; then
    $cli conform --device cuda --only norm,golden --json "$OUT/conform_cuda_norm_fused_h200.json" 2>&1 | tail -6
    $cli conform --device cuda --kernel-source hip --only norm --json "$OUT/conform_cuda_hipsrc_norm_fused_h200.json" 2>&1 | tail -3
fi
if [[ $1 == step || $1 == gemm_step || $1 == fused_step ]]; then
    $cli conform --device cuda --quick --only sampling,attention.split,engine,e2e.batch-64 --json "$OUT/conform_cuda_step_quick_h200.json" 2>&1 | tail -4
    $cli conform --device cuda --kernel-source hip --quick --only sampling,attention.split --json "$OUT/conform_cuda_hipsrc_step_quick_h200.json" 2>&1 | tail -3
    $cli bench decode --device cuda --json "$OUT/decode_h200.json" 2>&1 | tail -12
    python3 scripts/profile_decode.py > "$OUT/decode_profile_h200.json"; tail -c 1200 "$OUT/decode_profile_h200.json"
fi
if [[ $1 == kernels ]]; then
    RLP_PROFILE_NVTX=1 /usr/local/cuda/bin/ncu --nvtx --nvtx-include "replay/" --graph-profiling node \
        --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        python3 scripts/profile_decode.py 256 384 2 > "$OUT/kernel_times_h200.csv" 2>/dev/null
    (cd scripts && python3 probe_wgmma_phases.py "$OUT/wgmma_phases_h200.json")
fi
if [[ $1 == fixed ]]; then
    python3 scripts/profile_first_steps.py > "$OUT/first_steps_h200.json"; head -c 2500 "$OUT/first_steps_h200.json"
    RLP_PROFILE_NVTX=1 /usr/local/cuda/bin/ncu --nvtx --nvtx-include "replay/" --graph-profiling node \
        --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \
        python3 scripts/profile_decode.py 256 384 2 > "$OUT/kernel_times_h200.csv" 2>/dev/null
    RLP_PROBE_EXPONENTS=flat RLP_PROBE_KV_LENGTHS=1,128,384 RLP_PROBE_VARIANTS=as_built \
        /usr/local/cuda/bin/ncu --kernel-name regex:attention_split --metrics gpu__time_duration.sum \
        --cache-control none --clock-control none --csv python3 scripts/probe_attention.py /dev/null \
        > "$OUT/attention_lengths_ncu_h200.csv" 2>/dev/null
fi
