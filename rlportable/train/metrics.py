"""Per-step training metrics: printed lines, a JSONL log, and a curve drawn to a PNG."""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager

from rlportable.errors import InputError
from rlportable.train.evaluation import is_eval, summary_line


class PhaseClock:
    """Seconds of each named phase of a training step. A phase ends with a device sync, so its
    time is the device work it queued, not only the host's launches; a step has a handful of
    phases, and the syncs stand where the loop waits for the device anyway (the log-probs the
    objective reads, the gradient norm the optimiser step reads)."""

    def __init__(self, backend=None):
        self.backend = backend
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.backend is not None:
                self.backend.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def record(self, total_s: float) -> dict[str, float]:
        """{"time/<phase>_s": seconds}, with "time/other_s": the step's time outside every phase."""
        out = {f"time/{name}_s": value for name, value in self.seconds.items()}
        out["time/other_s"] = max(total_s - sum(self.seconds.values()), 0.0)
        return out


class MetricsLog:
    """Appends one JSON object per step to `path` (flushed and fsynced, so a crash loses no step).

    On resume the log is cut back to the steps before the resumed one, so it never holds a step
    twice. Evaluation records (their keys under eval/, train/evaluation.py) are lines of their own in
    the file, kept apart from the steps' `records` in `evals`. mirror: called with each record written
    (--report-to's writer, train/report.py)."""

    def __init__(self, path: str | None, resume_from_step: int | None = None, mirror=None):
        self.path = path
        self.mirror = mirror
        self.records: list[dict] = []
        self.evals: list[dict] = []
        if path is None:
            return
        kept = []
        if resume_from_step is not None and os.path.exists(path):
            kept = [r for r in _read(path) if r.get("step", 0) <= resume_from_step]
        _rewrite(path, kept)
        for record in kept:
            (self.evals if is_eval(record) else self.records).append(record)

    def write(self, record: dict) -> None:
        (self.evals if is_eval(record) else self.records).append(record)
        if self.mirror is not None:
            self.mirror(record)
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def _read(path: str) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a torn last line from a crash
    return out


def _rewrite(path: str, records: list[dict]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
    os.replace(tmp, path)


def summary_lines(kind: str, records: list[dict], out_dir: str | None, plot: str | None = None) -> list[str]:
    """The end of a run: its steps, the means of its curve (GRPO: the mean reward; SFT: the loss) over
    its first and last ten steps (halves, when it has fewer than 20), where the trained weights went
    and the plot. A resumed run's records carry the whole run's curve (launch.RunRecords.history)."""
    from rlportable.train.checkpoint import step_dir_name

    key = "reward_mean" if kind == "grpo" else "loss"
    history = getattr(records, "history", None) or records
    values = [r[key] for r in history if isinstance(r.get(key), float) and math.isfinite(r[key])]
    lines = [f"{kind}: {len(history)} steps"]
    if len(history) > len(records):
        lines[0] += f" ({len(records)} in this process, resumed after step {len(history) - len(records)})"
    window = min(10, len(values) // 2)
    if window:
        first, last = sum(values[:window]) / window, sum(values[-window:]) / window
        lines[0] += f"; {key} {first:.4g} (mean of the first {window}) -> {last:.4g} (mean of the last {window})"
    elif values:
        lines[0] += f"; {key} {values[-1]:.4g}"
    evaluated = summary_line(getattr(records, "evals", None) or [])
    if evaluated is not None:
        lines.append(evaluated)
    if out_dir is None:
        lines.append("the trained weights are not kept (no --out); pass --out DIR to keep them")
    elif records:
        path = os.path.join(out_dir, step_dir_name(records[-1]["step"]))
        from rlportable.train.run import resume_flags

        lines.append(f"weights: {path} (load with --model {path}; continue with {resume_flags(out_dir)})")
    if plot is not None and records:
        lines.append(f"curve: {plot}")
    return lines


def format_line(record: dict, keys: list[str]) -> str:
    """'step 3 | reward 0.250 | loss -0.012 ...' for the keys present."""
    parts = [f"step {record['step']}"]
    for key in keys:
        if key in record:
            value = record[key]
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return " | ".join(parts)


def plot_curve(records: list[dict], key: str, path: str, title: str, evals: list[dict] | None = None) -> None:
    """Draw record[key] against the step to a PNG (matplotlib, the `plot` extra), with the held-out
    evaluations' eval/<key> (sampled) and eval/greedy/<key> where `evals` has them."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("drawing the curve needs matplotlib: pip install 'rlportable[plot]'") from None
    points = [(r["step"], r[key]) for r in records if key in r and math.isfinite(r[key])]
    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps, values = [p[0] for p in points], [p[1] for p in points]
    axes.plot(steps, values, marker="o", markersize=3, alpha=0.5, label=key)
    window = min(10, len(values))
    if window > 1:  # the trend through the per-step noise: the mean of the last `window` steps
        means = [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]
        axes.plot(steps, means, linewidth=2, label=f"mean of the last {window} steps")
    for name, label in ((f"eval/{key}", "held-out, sampled"), (f"eval/greedy/{key}", "held-out, greedy")):
        shown = [(r["step"], r[name]) for r in evals or [] if name in r and math.isfinite(r[name])]
        if shown:
            axes.plot([p[0] for p in shown], [p[1] for p in shown], marker="s", markersize=4, linewidth=1.5,
                      label=label)
    if window > 1 or evals:
        axes.legend(loc="best", fontsize=8)
    axes.set_xlabel("step")
    axes.set_ylabel(key)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.png"
    figure.savefig(tmp)
    plt.close(figure)
    os.replace(tmp, path)
