#!/usr/bin/env bash
# GRPO step time against TRL's GRPOTrainer on the H200.
#
# The device machine has torch, transformers, accelerate, pandas, pyarrow, fsspec, xxhash, peft and
# rich but no trl, datasets, dill or multiprocess: those travel as wheels in .whl/ (ignored by git
# through .git/info/exclude; about 1.8 MB). Fetch them here once, in the repository root:
#   echo /.whl/ >> .git/info/exclude
#   for p in trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $p
#   done
# and run this with carry [".whl"]. trl 1.16.0 needs transformers >= 4.56.2 and accelerate >= 1.10.1
# (the machine has 5.17.0 and 1.15.0); its GRPOTrainer was tried on cpu with transformers 5.17.0.
#
# Usage on the device machine: bash scripts/device_bench_grpo.sh [bench grpo options]
#   no options: the full benchmark, $OUT/grpo_h200.json
#   with options (a smoke run, e.g. --layers 2 --steps 1): $OUT/grpo_smoke_h200.json
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 RLPORTABLE_CACHE_DIR=/tmp/rlp-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=grpo_h200
[ $# -gt 0 ] && name=grpo_smoke_h200
{
    date -u
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    for p in torch transformers accelerate trl datasets pyarrow fsspec huggingface_hub cupy-cuda13x; do
        python3 -c "import importlib.metadata as m; print('$p', m.version('$p'))" 2>/dev/null || echo "$p missing"
    done
} 2>&1 | tee "$OUT/env_grpo.txt"
python3 -m rlportable.cli bench grpo --device cuda --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
