"""Which side differs in golden.adamw.steps: the reference on this host, or the device kernel.

    PYTHONPATH=. python3 scripts/probe_golden_adamw.py
Prints the digest of the case computed on cpu and on cuda here, the committed digest, and the first
outputs where cpu and cuda differ (with both values' bits)."""
import json

import numpy as np

from rlportable.conform import golden
from rlportable.runtime import get_backend

case = next(c for c in golden.CASES if (c.group, c.name) == ("adamw", "steps"))
committed = json.load(open("conformance/golden/adamw.json"))
outputs = {dev: case.outputs(get_backend(dev)) for dev in ("cpu", "cuda")}
print("committed", json.dumps(committed)[:300])
for dev, out in outputs.items():
    print(dev, golden.digest(out))
shown = 0
for (name, a), (_, b) in zip(outputs["cpu"], outputs["cuda"]):
    if a.tobytes() != b.tobytes() and shown < 8:
        shown += 1
        ai, bi = a.reshape(-1).view(np.uint32 if a.itemsize == 4 else np.uint64), b.reshape(-1).view(np.uint32 if b.itemsize == 4 else np.uint64)
        k = int(np.flatnonzero(ai != bi)[0])
        print(name, a.dtype, a.shape, "first index", k, "cpu", a.reshape(-1)[k], hex(ai[k]), "cuda", b.reshape(-1)[k], hex(bi[k]))
