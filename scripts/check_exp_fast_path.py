"""The NumPy exp's fast path against its full evaluation on every float32 bit pattern, bitwise.

    PYTHONPATH=. python3 scripts/check_exp_fast_path.py PART PARTS   (run PARTS processes, PART = 0..PARTS-1)
Prints one JSON line per part: inputs compared and mismatches (about 5 minutes per half on this CPU).
"""

import json
import sys
import time

import numpy as np

from rlportable.contract import elementwise

part, parts = int(sys.argv[1]), int(sys.argv[2])
chunk, total = 1 << 24, 1 << 32
starts = range(part * chunk, total, parts * chunk)
mismatches, start_time = 0, time.time()
for start in starts:
    x = np.arange(start, start + chunk, dtype=np.uint64).astype(np.uint32).view(np.float32)
    fast = elementwise.exp_f32(x).view(np.uint32)
    full = elementwise.exp_f32(x, full=True).view(np.uint32)
    mismatches += int(np.count_nonzero(fast != full))
print(json.dumps({"part": part, "parts": parts, "inputs": len(starts) * chunk, "mismatches": mismatches,
                  "seconds": time.time() - start_time}))
