"""Device time per kernel of one training forward + backward, from an ncu CSV (gpu__time_duration).

    ncu --metrics gpu__time_duration.sum --csv python3 scripts/profile_train.py 64 320 2 > ncu.csv
    python3 scripts/profile_train_kernels.py ncu.csv [steps]
profile_train.py runs the step twice (warm-up, then timed): the totals are divided by `steps` (2).
Prints JSON: kernels sorted by total microseconds, with their launch counts.
"""

import csv
import io
import json
import sys
from collections import Counter

path = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2
text = open(path, encoding="utf-8", errors="replace").read()
start = text.find('"ID"')
rows = csv.DictReader(io.StringIO(text[start:]))
totals, calls = Counter(), Counter()
for row in rows:
    if row.get("Metric Name") != "gpu__time_duration.sum":
        continue
    name = row["Kernel Name"].split("(")[0]
    value = float(row["Metric Value"].replace(",", ""))
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
             "second": 1e6, "s": 1e6}[row["Metric Unit"]]
    totals[name] += value * scale / steps
    calls[name] += 1 / steps
print(json.dumps({"total_us": sum(totals.values()),
                  "kernels": [{"kernel": k, "us": round(v, 1), "calls": round(calls[k], 1)}
                              for k, v in totals.most_common()]}, indent=1))
