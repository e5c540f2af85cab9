"""The golden training trajectories (whole SFT and GRPO runs) on a device with the optimiser sharded over
1, 2 and 3 data-parallel ranks emulated as threads: each must give the committed digest.

    PYTHONPATH=$PWD python3 scripts/check_sharded_trajectories.py --device cuda OUT.json
"""

import argparse
import json
import time

from rlportable.conform import golden, golden_digest, golden_stream
from rlportable.provenance import provenance
from rlportable.resources import resource_dir
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import run_threads

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--device", default="cuda")
parser.add_argument("--ranks", default="1,2,3")
args = parser.parse_args()

backend = get_backend(args.device)
results = []
for check in ("golden.training.sft.trajectory", "golden.training.grpo.trajectory"):
    case = next(c for c in golden.CASES if c.check_name == check)
    committed = json.loads((resource_dir("conformance") / "golden" / f"{case.group}.json").read_text())
    want = next(item["sha256"] for item in committed["digests"] if item["name"] == case.name)
    for ranks in (int(r) for r in args.ranks.split(",")):
        started = time.perf_counter()
        outputs = run_threads(backend, ranks, lambda group: case.compute(
            backend, golden_stream.Stream(case.recipe["seed"]), case.recipe, group))
        digests = [golden_digest.digest(o) for o in outputs]
        row = {"check": check, "ranks": ranks, "elements": int(sum(a.size for _, a in outputs[0])),
               "equal_committed": all(d == want for d in digests), "seconds": time.perf_counter() - started}
        print(row, flush=True)
        results.append(row)
with open(args.out, "w") as handle:
    json.dump({"device": backend.label, "results": results, "provenance": provenance()}, handle, indent=1)
if not all(r["equal_committed"] for r in results):
    raise SystemExit(1)
