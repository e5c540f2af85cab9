"""The step loop SFT and GRPO share: metrics, atomic checkpoints, and resuming bitwise.

A checkpoint (train/checkpoint.py) holds the float32 master weights (they load
back with `--model DIR`), AdamW's m and v (one shard per rank; a resume at
another layout reads what it needs of them), and the trainer state: the next step,
the optimiser's step count and the run's settings. The data order and the
sampling keys are functions of (seed, step), so nothing else is needed to
continue exactly as if the run had never stopped; a resume with different
settings is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from rlportable.errors import InputError
from rlportable.model.weights import from_named
from rlportable.train import checkpoint
from rlportable.train.metrics import MetricsLog


RUN_CONFIG_FILE = "run_config.toml"  # a run's resolved options, written into --out before its first step


def resume_flags(out_dir: str) -> str:
    """The flags that continue the run in out_dir: its own options file (where it has one) and --resume."""
    config = os.path.join(out_dir, RUN_CONFIG_FILE)
    return (f"--config {config} " if os.path.isfile(config) else "") + f"--out {out_dir} --resume"


def resume_state(out_dir: str, kind: str, settings: dict) -> checkpoint.Checkpoint | None:
    """The latest checkpoint in out_dir (None if there is none), refused if it is another run's."""
    path = checkpoint.latest_checkpoint(out_dir)
    if path is None:
        return None
    ckpt = checkpoint.load_checkpoint(path)
    state = ckpt.trainer_state
    if state.get("kind") != kind:
        raise InputError(f"{path}: a {state.get('kind')} checkpoint cannot resume a {kind} run")
    saved = {k: v for k, v in state.get("settings", {}).items() if k != "steps"}
    wanted = {k: v for k, v in settings.items() if k != "steps"}
    # a setting added since the checkpoint was written reads as absent there: equal when it is at its None default
    changed = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
    if changed:
        raise InputError(f"{path}: --resume with different settings ({', '.join(changed)}); "
                         f"use the run's own settings ({resume_flags(out_dir)}) or a new --out")
    saved_steps, steps = state.get("settings", {}).get("steps"), settings.get("steps")
    if saved_steps != steps:
        # the warmup + cosine schedule runs to --steps: another total changes every step's learning rate
        raise InputError(f"{path}: --resume with --steps {steps}, but the run was started with --steps "
                         f"{saved_steps}, and its learning-rate schedule (warmup, then cosine to the last step) "
                         f"depends on it, so the result would differ from an unbroken run; resume with --steps "
                         f"{saved_steps}, or start a new run from the weights with --model {path}")
    return ckpt


def run_steps(trainer, kind: str, settings: dict, tokenizer, start_step: int, steps: int, out_dir: str | None,
              save_every: int, log: MetricsLog, on_step: Callable[[dict], None], keep_last: int | None = 3,
              history: list[dict] | None = None, curve: str | None = None,
              evaluate: Callable[[int], dict | None] | None = None) -> None:
    """Steps start_step..steps-1; a checkpoint every save_every steps and after the last. history: the
    run's curve so far ({"step", curve: value} a step, from the checkpoint resumed), extended in place
    with each step's and saved in the checkpoints (deterministic values only: the bytes of a checkpoint
    stay those of an unbroken run). evaluate(steps done): an evaluation record when one is due, else None
    (train/evaluation.py); called before the first step of a new run and after each step, before its
    checkpoint (a run resumed there has it already); its records go to the log and to on_step too, and
    never into the history or the checkpoints."""
    history = [] if history is None else history

    def evaluation(done: int) -> None:
        record = evaluate(done) if evaluate is not None else None
        if record is not None:
            log.write(record)
            on_step(record)

    if start_step == 0:
        evaluation(0)
    for step in range(start_step, steps):
        record = trainer.step(step)
        log.write(record)
        if curve is not None and curve in record:
            history.append({"step": record["step"], curve: record[curve]})
        on_step(record)
        evaluation(step + 1)
        if out_dir is not None and ((step + 1) % save_every == 0 or step + 1 == steps):
            state = {"kind": kind, "next_step": step + 1, "optimizer_steps": trainer.optimizer.step_count,
                     "settings": settings, "history": history}
            try:
                save(trainer.optimizer, out_dir, step + 1, tokenizer, state, keep_last)
            except OSError as error:  # no space left, a folder that refuses writes: one line, what is intact
                raise checkpoint.CheckpointError(save_failure(out_dir, step + 1, error, log.path)) from None


def save_failure(out_dir: str, step: int, error: OSError, log_path: str | None) -> str:
    """The one line a failed save ends the run with: what failed, what survives, how to go on."""
    what = error.strerror or type(error).__name__
    where = f" ({error.filename})" if error.filename else ""
    try:
        previous = checkpoint.latest_checkpoint(out_dir)
    except checkpoint.CheckpointError:
        previous = None
    kept = (f"the previous checkpoint {previous} is intact; make room and continue it with {resume_flags(out_dir)}"
            if previous else "no earlier checkpoint exists; make room and start again")
    log = f"; the steps so far are logged in {log_path}" if log_path else ""
    return f"saving step {step} to {out_dir} failed: {what}{where}; {kept}{log}"


def save(optimizer, out_dir: str, step: int, tokenizer, state: dict, keep_last: int | None) -> None:
    """One checkpoint: every rank writes its optimiser shard (its pieces of its tensor-parallel
    shards), rank 0 the weights, whole (gathered from the tensor-parallel shards), and the rest."""
    model, dp_group, tp_group, ep_group = optimizer.model, optimizer.dp_group, optimizer.tp_group, optimizer.ep_group
    writer = dp_group.rank == 0 and tp_group.rank == 0 and ep_group.rank == 0
    named = optimizer.whole_weights(writer)  # a gather under tensor or expert parallelism: every rank takes part
    checkpoint.save_checkpoint(out_dir, step, model.config, from_named(model.config, named) if writer else None,
                               tokenizer, optimizer.shard_state(), state, keep_last=keep_last, dp_group=dp_group,
                               tp_group=tp_group, ep_group=ep_group)
