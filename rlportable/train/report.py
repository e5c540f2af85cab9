"""--report-to tensorboard: each step's and each evaluation's metrics as TensorBoard scalars, in event
files in --out (`tensorboard --logdir OUT`, or the folder above several runs' --out).

A record's numbers become scalars at its "step" (steps done, as in the JSONL log), under tags grouped
the way TensorBoard shows them: evaluation's `eval/...` and the phases' `time/...` as the JSONL names
them, the log-prob comparison with the engine under verl's `rollout_corr/` (`rollout_corr/logp_mismatches`,
`rollout_corr/logp_compared`, `rollout_corr/max_abs_dlogp`; Qwen3-MoE's `rollout_corr/routing_mismatches`
and `rollout_corr/routing_compared`), and every other number of a step under
`train/` (`train/reward_mean`, `train/loss`, `train/kl`, `train/clip_fraction`, ...). Texts ("notes")
are left out.

The writer is the tensorboard package's own event-file writer (the `tensorboard` extra, which is what
shows the files anyway): it needs numpy and protobuf, and TensorFlow only where TensorFlow is installed
(tensorboard's compat layer then imports it), where tensorboardX imports torch whenever torch is
installed, and rlportable never imports torch. The scalars are written as plain
`simple_value` summaries, which every TensorBoard reads. A resumed run writes a new event file that
starts with TensorBoard's purge marker (a SessionLog START at the first resumed step), so the points an
interrupted run logged after its last checkpoint are replaced rather than drawn twice, as the JSONL log
is cut back.
"""

from __future__ import annotations

import importlib.util
import numbers
import time

from rlportable.errors import InputError

REPORT_TO = ("none", "tensorboard")
TENSORBOARD_INSTALL = "pip install 'rlportable[tensorboard]'"
# the metrics that compare the engine's log-probs with the trainer's: verl's rollout-correction group
ROLLOUT_CORR = ("logp_mismatches", "logp_compared", "max_abs_dlogp", "routing_mismatches", "routing_compared")


def check_report_to(report_to: str | None, out: str | None) -> None:
    """Before any work: the event files go into --out, and need the tensorboard package."""
    if report_to in (None, "none"):
        return
    if report_to not in REPORT_TO:
        raise InputError(f"--report-to {report_to}: expected one of {', '.join(REPORT_TO)}")
    if out is None:
        raise InputError("--report-to tensorboard writes its event files into --out; give --out DIR")
    if importlib.util.find_spec("tensorboard") is None:
        raise InputError(f"--report-to tensorboard needs the tensorboard package: {TENSORBOARD_INSTALL}")


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics key (module docstring)."""
    if key.startswith(("eval/", "time/")):
        return key
    if key in ROLLOUT_CORR:
        return f"rollout_corr/{key}"
    return f"train/{key}"


def scalars(record: dict) -> dict[str, float]:
    """{tag: value} of a metrics record's numbers (not its step, texts or flags)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        out[tensorboard_tag(key)] = float(value)
    return out


class TensorBoardLog:
    """Writes metrics records to a new event file in `folder`; resumed_after: the steps a resumed run
    had done (its points after them, from before the resume, are purged)."""

    def __init__(self, folder: str, resumed_after: int | None = None):
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError:
            raise InputError(f"--report-to tensorboard needs the tensorboard package: {TENSORBOARD_INSTALL}") from None
        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._writer = EventFileWriter(folder)
        if resumed_after is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=resumed_after + 1, session_log=start))
        self._writer.flush()

    def write(self, record: dict) -> None:
        """The record's scalars at its step, flushed (a crash loses no step, as the JSONL log)."""
        values = [self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
                  for tag, value in scalars(record).items()]
        if values:
            self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(record["step"]),
                                                         summary=self._summary_pb2.Summary(value=values)))
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()
