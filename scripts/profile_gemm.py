"""Run one exact GEMM shape with one tile a few times, for `ncu` (no timing of its own).

    ncu --clock-control none -k regex:gemm_ python3 scripts/profile_gemm.py M K N TILE
"""

import sys

import numpy as np

from rlportable.ops import gemm as gemm_op
from rlportable.runtime import get_backend

m, k, n, tile = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
backend = get_backend("cuda")
rng = np.random.default_rng(0)
x = backend.asarray(rng.standard_normal((m, k)).astype(np.float32))
weight = gemm_op.encode_weight(backend, backend.asarray((rng.standard_normal((n, k)) * 0.02).astype(np.float32)))
method = "blas" if tile == "blas" else "fused"
for _ in range(3):
    gemm_op.gemm(backend, x, weight, method=method, tile=None if tile == "blas" else tile)
backend.synchronize()
