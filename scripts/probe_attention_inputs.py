"""One split-KV attention call over a cache of each exponent mode (probe_attention.py's "spread" and
"flat"), for a profiler: `ncu --kernel-name attention_split_values python3 scripts/probe_attention_inputs.py`."""
import cupy as cp
import numpy as np

import probe_attention as probe
from rlportable.ops import attention
from rlportable.runtime import get_backend

backend = get_backend("cuda")
for mode in ("spread", "flat"):
    probe.EXPONENTS = mode
    cache, tables = probe.random_cache(backend, 384)
    q = cp.asarray(np.random.default_rng(1).standard_normal((probe.SEQUENCES, probe.HQ, probe.HEAD_DIM), np.float32))
    out = attention.attention_paged(backend, q, cp.arange(probe.SEQUENCES, dtype=np.int32),
                                    cp.full(probe.SEQUENCES, 383, np.int32), cache, tables, method="split")
    cp.cuda.get_current_stream().synchronize()
    print(mode, float(cp.abs(out).mean()))
