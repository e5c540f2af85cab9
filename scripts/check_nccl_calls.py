"""The NCCL calls of runtime/collectives.py on a one-rank communicator (the most one GPU allows: NCCL
refuses two ranks on one device): all-reduce, all-gather, the all-to-all's grouped send and receive
(to itself), and a split group's communicator made from an id the parent group carried. It checks the
calls and their arguments, not an exchange between GPUs.

    PYTHONPATH=$PWD python3 scripts/check_nccl_calls.py OUT.json
"""

import json
import sys

import numpy as np

from rlportable.provenance import provenance
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import NcclGroup

backend = get_backend("cuda")
group = NcclGroup(backend, 0, 1, NcclGroup.new_unique_id())
rng = np.random.default_rng(0)
values = rng.standard_normal((1, 1000)).astype(np.float32)
ints = rng.integers(-2**40, 2**40, size=7).astype(np.int64)
checks = {
    "all_to_all": np.array_equal(backend.to_numpy(group.all_to_all(backend.asarray(values))).view(np.uint32),
                                 values.view(np.uint32)),
    "all_reduce_sum": np.array_equal(backend.to_numpy(group.all_reduce(backend.asarray(ints), "sum")), ints),
    "all_gather": np.array_equal(backend.to_numpy(group.all_gather(backend.asarray(values[0]))), values),
    "all_gather_object": group.all_gather_object({"a": 1}) == [{"a": 1}],
}
sub = NcclGroup(backend, 0, 1, group.all_gather_object(NcclGroup.new_unique_id())[0])  # as Group.split makes one
checks["split_all_to_all"] = np.array_equal(backend.to_numpy(sub.all_to_all(backend.asarray(values))), values)
sub.close()
group.close()
print(checks)
with open(sys.argv[1], "w") as handle:
    json.dump({"checks": {k: bool(v) for k, v in checks.items()}, "provenance": provenance()}, handle, indent=1)
raise SystemExit(0 if all(checks.values()) else 1)
