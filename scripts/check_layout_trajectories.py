"""The golden training trajectories (whole SFT and GRPO runs) on a device at several layouts, TP x DP
ranks emulated as threads (the model cut over TP ranks, the optimiser sharded over DP replicas): each
rank must give the committed single-device digest.

    PYTHONPATH=$PWD python3 scripts/check_layout_trajectories.py --device cuda OUT.json
"""

import argparse
import json
import time

from rlportable.conform import golden, golden_digest, golden_stream
from rlportable.provenance import provenance
from rlportable.resources import resource_dir
from rlportable.runtime import get_backend
from rlportable.runtime.collectives import run_threads
from rlportable.runtime.world import layout_groups
from rlportable.train.memory import parse_layouts

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--device", default="cuda")
parser.add_argument("--layouts", default="1x1,1x2,1x3,2x1,2x2", help="TPxDP, comma-separated")
args = parser.parse_args()

backend = get_backend(args.device)
results = []
for check in ("golden.training.sft.trajectory", "golden.training.grpo.trajectory"):
    case = next(c for c in golden.CASES if c.check_name == check)
    committed = json.loads((resource_dir("conformance") / "golden" / f"{case.group}.json").read_text())
    want = next(item["sha256"] for item in committed["digests"] if item["name"] == case.name)
    for tp, dp in ((layout.tp, layout.dp) for layout in parse_layouts(args.layouts)):
        started = time.perf_counter()

        def rank(world_group, tp=tp):
            tp_group, dp_group = layout_groups(world_group, tp)
            return case.compute(backend, golden_stream.Stream(case.recipe["seed"]), case.recipe, dp_group, tp_group)

        outputs = run_threads(backend, tp * dp, rank)
        digests = [golden_digest.digest(o) for o in outputs]
        row = {"check": check, "tp": tp, "dp": dp, "elements": int(sum(a.size for _, a in outputs[0])),
               "equal_committed": all(d == want for d in digests), "seconds": time.perf_counter() - started}
        print(row, flush=True)
        results.append(row)
with open(args.out, "w") as handle:
    json.dump({"device": backend.label, "results": results, "provenance": provenance()}, handle, indent=1)
if not all(r["equal_committed"] for r in results):
    raise SystemExit(1)
