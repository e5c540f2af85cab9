export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
NCU="/usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv"
export RLP_PROBE_EXPONENTS=flat RLP_PROBE_KV_LENGTHS=1,384
RLP_PROBE_VARIANTS="as_built,empty (timing only),threads_64,scores_no_q_loads (timing only),values_no_weight_loads (timing only),scores_no_table (timing only)" \
  $NCU --kernel-name regex:attention_split python3 scripts/probe_attention.py /dev/null > $OUT/attention_fixed_ncu_h200.csv 2>/dev/null
RLP_PROBE_GRID=1056 RLP_PROBE_VARIANTS=as_built $NCU --kernel-name regex:attention_split python3 scripts/probe_attention.py /dev/null > $OUT/attention_fixed_grid1056_ncu_h200.csv 2>/dev/null
cd scripts
for K in 128 1024; do RLP_PROBE_K=$K RLP_PROBE_SHAPES=qkv,gate_up_grouped,o_grouped2,down_grouped2,lm_head_grouped python3 probe_wgmma_phases.py $OUT/wgmma_k${K}_h200.json 2>&1 | grep -v "^$" | cut -c1-200; done
