"""Setting up an SFT or GRPO run from command-line choices: model, data, rewards, resume.

The embedded default (no download, a 2-core CPU): `rlportable sft` fine-tunes
the tiny built-in model on the answers of DEFAULT_TASK; `rlportable grpo`
starts from `tiny-sft`, weights that run produced and that ship inside the
package (rlportable/model/data/tiny-sft), and raises the task's reward.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from rlportable.errors import InputError
from rlportable.model.forward import Model
from rlportable.model.load import load_model
from rlportable.model.weights import atomic_write
from rlportable.train import checkpoint, datafiles, report, tasks
from rlportable.train.grpo import GRPOConfig, GRPOTrainer
from rlportable.train.metrics import MetricsLog, plot_curve
from rlportable.train.rewards import RewardSet
from rlportable.train.run import RUN_CONFIG_FILE, resume_state, run_steps
from rlportable.train.sft import SFTConfig, SFTTrainer, load_sft_records, task_sft_records

DATASET_SIZE = 10000  # records generated for a built-in task (the epoch length)
DEFAULT_TASK = "arithmetic:digits=1,ops=+"
DEFAULT_SFT_MODEL, DEFAULT_GRPO_MODEL = "tiny", "tiny-sft"
#: the built-in models, trained by the embedded default runs below when no option says otherwise (tiny-moe
#: is tiny-sft upcycled to a Qwen3-MoE: the same task and settings suit it)
BUILT_IN_MODELS = ("tiny", "tiny-sft", "tiny-moe")
# The embedded default runs: SFTConfig / GRPOConfig with these fields changed (every other default is
# the config's own, TRL's where TRL has one). Chosen by runs on a 2-core CPU (docs/training.md): SFT as
# the run that made tiny-sft; GRPO raises the sampled reward of tiny-sft from ~0.35 to ~0.47 in 100 steps.
EMBEDDED_SFT = {"steps": 300, "learning_rate": 3e-3, "warmup_steps": 10}
EMBEDDED_GRPO = {"steps": 100, "learning_rate": 4e-4, "warmup_steps": 5, "prompts_per_step": 32,
                 "max_completion_length": 8}
# Evaluation (train/evaluation.py): with held-out prompts and no --eval-every, every EVAL_EVERY steps (and
# before the first and after the last); --eval-task generates EVAL_TASK_SIZE records, from a seed of their
# own (EVAL_SEED_OFFSET + the run's seed), not the training data's
EVAL_EVERY = 10
EVAL_TASK_SIZE = 200
EVAL_SEED_OFFSET = 1 << 32


def sft_config(model: str, **given) -> SFTConfig:
    """The run's SFTConfig: the fields given, else the embedded run's values for a built-in model, else
    SFTConfig's own defaults (each default has this one home)."""
    return _config(SFTConfig, EMBEDDED_SFT, model, given)


def grpo_config(model: str, held_out: bool = False, **given) -> GRPOConfig:
    """The run's GRPOConfig, as sft_config; held_out: the run has held-out prompts (--eval-data or
    --eval-task), which it then evaluates every EVAL_EVERY steps unless --eval-every says otherwise."""
    if held_out:
        given = {"eval_every": EVAL_EVERY, **given}
    return _config(GRPOConfig, EMBEDDED_GRPO, model, given)


def _config(cls, embedded: dict, model: str, given: dict):
    base = dict(embedded) if model in BUILT_IN_MODELS else {}
    return cls(**{**base, **given})


@dataclass
class RunOptions:
    model: str
    out: str | None
    resume: bool
    save_every: int
    log_jsonl: str | None
    plot: str | None
    task: str | None
    data: str | None
    eval_task: str | None = None   # held-out prompts (GRPO): a task spec, or
    eval_data: str | None = None   # a file in --data's format
    prompt_column: str | None = None  # --data's columns (GRPO; train/datafiles.py): None, the defaults
    answer_column: str | None = None
    report_to: str | None = None   # "tensorboard": event files in --out too (train/report.py)


def check_paths(options: RunOptions) -> None:
    """Before any work: an --out holding a run is continued with --resume or not touched (its checkpoints
    and `latest` would be overwritten), --resume has a checkpoint to continue, every path the run writes
    (--out, --log-jsonl, --plot) can be written, --plot's matplotlib and --report-to's tensorboard are
    installed, and a Parquet --data or --eval-data has pyarrow; else the first save, the end of the run or
    the data's reading would fail. (--resume without --out: _load.)"""
    if options.out is not None:
        latest = checkpoint.latest_checkpoint(options.out) if os.path.isdir(options.out) else None
        if latest is not None and not options.resume:
            raise InputError(f"--out {options.out} already holds a run (latest checkpoint {latest}); continue it "
                             "with --resume, or give a new --out")
        if latest is None and options.resume:
            raise InputError(f"--resume: --out {options.out} holds no checkpoint to continue (start without "
                             "--resume)")
    for flag, path, folder in (("--out", options.out, True), ("--log-jsonl", options.log_jsonl, False),
                               ("--plot", options.plot, False)):
        if path is not None:
            _check_writable(flag, os.fspath(path), folder)
    if options.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise InputError("--plot needs matplotlib: pip install 'rlportable[plot]'")
    report.check_report_to(options.report_to, options.out)
    datafiles.check_readable("--data", options.data)
    datafiles.check_readable("--eval-data", options.eval_data)


@dataclass
class ResumePoint:
    path: str        # the checkpoint a --resume continues
    next_step: int   # steps done (the first step it runs, 0-based)


def resume_point(options: RunOptions) -> ResumePoint | None:
    """Where a --resume starts (after check_paths), None without --resume: for the command to say it
    before any work, and to tell a finished run from one to continue."""
    if not options.resume or options.out is None:
        return None
    path = checkpoint.latest_checkpoint(options.out)
    if path is None:
        return None
    return ResumePoint(path, int(checkpoint.read_trainer_state(path).get("next_step", 0)))


def write_run_config(options: RunOptions, text: str) -> None:
    """A new run's resolved options into --out (before its first step), as `--config` reads them."""
    if options.out is None or options.resume:
        return
    os.makedirs(options.out, exist_ok=True)
    atomic_write(os.path.join(options.out, RUN_CONFIG_FILE), [text.encode("utf-8")])


def _check_writable(flag: str, path: str, folder: bool) -> None:
    if os.path.exists(path):
        if folder != os.path.isdir(path):
            raise InputError(f"{flag} {path}: {'not a folder' if folder else 'is a folder, not a file'}")
        if not os.access(path, os.W_OK):
            raise InputError(f"{flag} {path}: not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the folders the run would create
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot be created ({parent} is not a writable folder)")


def _load(spec: str, backend, options: RunOptions, kind: str, settings: dict, tp_group=None, ep_group=None) -> tuple:
    """(model, tokenizer, first step, checkpoint or None): from --resume's checkpoint or --model; under
    tensor parallelism the model is this rank's shard."""
    ckpt = None
    if options.resume:
        if options.out is None:
            raise InputError("--resume needs --out (the run's checkpoint folder)")
        ckpt = resume_state(options.out, kind, settings)
    if ckpt is not None:
        config, weights, tokenizer = ckpt.config, ckpt.weights, ckpt.tokenizer
    else:
        config, weights, tokenizer = load_model(spec)
    model = Model(backend, config, weights, trainable=True, tp_group=tp_group, ep_group=ep_group)
    return model, tokenizer, (ckpt.trainer_state["next_step"] if ckpt else 0), ckpt


def settings_dict(config, options: RunOptions, rewards: list | None = None) -> dict:
    """Everything that defines a run (compared on --resume): the config, model, data and rewards. Not the
    evaluation's settings: they change none of the run's bits, so a checkpoint is the same with or without
    evaluation, and a run may be resumed with other ones."""
    fields = {key: value for key, value in asdict(config).items() if not key.startswith("eval_")}
    if fields.get("importance_sampling_level") == "token":  # the default: earlier runs' settings lack it
        del fields["importance_sampling_level"]
    # the columns only where given: the settings (and checkpoints) of runs with the default columns stay
    # as they were, and resume as before
    columns = {key: value for key, value in (("prompt_column", options.prompt_column),
                                             ("answer_column", options.answer_column)) if value is not None}
    return {**fields, "model": options.model, "task": options.task, "data": options.data, **columns,
            "rewards": [[item if isinstance(item, str) else getattr(item, "name", repr(item)), weight]
                        for item, weight in (rewards or [])]}


def task_records(task: str | None, data: str | None, seed: int, prompt_column: str | None = None,
                 answer_column: str | None = None) -> tuple[list[dict], object | None]:
    """(records, the task object or None) from --task or --data (exactly one); the columns: --data's
    (train/datafiles.py)."""
    if (task is None) == (data is None):
        raise InputError("give exactly one of --task and --data")
    if data is not None:
        return datafiles.load_prompt_records(data, prompt_column, answer_column), None
    for flag, column in (("--prompt-column", prompt_column), ("--answer-column", answer_column)):
        if column is not None:
            raise InputError(f"{flag} names a column of --data; a built-in task's records have \"prompt\" and "
                             "its own answer columns")
    chosen = tasks.parse_task_spec(task)
    return chosen.dataset(seed, DATASET_SIZE), chosen


def check_data(options: RunOptions, kind: str) -> None:
    """Before any work: --data's records (kind "sft" or "grpo") read and checked, each error one line
    naming the file's line or row, the column or the flag (the run reads them again); the column flags
    checked against --task."""
    if kind == "sft":
        if options.data is not None:
            _sft_records(options, 0)
    elif options.data is not None or options.prompt_column is not None or options.answer_column is not None:
        task_records(options.task, options.data, 0, options.prompt_column, options.answer_column)


def _sft_records(options: RunOptions, seed: int) -> list[dict]:
    if options.data is not None and options.task is None:
        return load_sft_records(options.data)
    return task_sft_records(task_records(options.task, options.data, seed)[0])


def held_out_records(options: RunOptions, config: GRPOConfig) -> list[dict] | None:
    """The held-out prompts of --eval-data or --eval-task (None without either), each error one line
    naming the flag; called before any work to check them, and by run_grpo. An --eval-every above 0 needs
    them."""
    if options.eval_task is not None and options.eval_data is not None:
        raise InputError("give at most one of --eval-task and --eval-data")
    if options.eval_task is None and options.eval_data is None:
        if config.eval_every:
            raise InputError(f"--eval-every {config.eval_every}: no held-out prompts to evaluate; give "
                             "--eval-data FILE.jsonl or --eval-task SPEC")
        return None
    if options.eval_data is not None:
        try:
            return datafiles.load_prompt_records(options.eval_data, options.prompt_column, options.answer_column)
        except InputError as error:
            raise InputError(f"--eval-data {error}") from None
    try:
        task = tasks.parse_task_spec(options.eval_task)
    except InputError as error:
        raise InputError(f"--eval-task {options.eval_task}: {error}") from None
    return task.dataset(EVAL_SEED_OFFSET + config.seed, EVAL_TASK_SIZE)


def run_grpo(backend, options: RunOptions, config: GRPOConfig, reward_specs: list[tuple[str, float]],
             on_step: Callable[[dict], None], dp_group=None, tp_group=None, ep_group=None) -> list[dict]:
    """dp_group: this process's data-parallel replica (train/data_parallel.py); tp_group: its tensor-parallel
    group (model/parallel.py); ep_group: its expert-parallel group (model/expert_parallel.py). Only rank 0
    of all writes metrics and the plot (every rank computes the same); the checkpoints are written as
    train/run.py says."""
    records, task = task_records(options.task, options.data, config.seed, options.prompt_column,
                                 options.answer_column)
    items = [(spec, weight) for spec, weight in reward_specs] or ([(task, 1.0)] if task is not None else [])
    if not items:
        raise InputError("--data needs at least one --reward module:function")
    rewards = RewardSet(items)
    held_out = held_out_records(options, config)
    if held_out is not None and set(held_out[0]) != set(records[0]):
        # the run's reward functions take the columns of the training data: the held-out prompts need them
        flag = "--eval-data" if options.eval_data is not None else "--eval-task"
        raise InputError(f"{flag}: the held-out records' columns {sorted(held_out[0])} differ from the training "
                         f"data's {sorted(records[0])}, which the run's reward functions take")
    if held_out is not None and config.eval_every is None:
        config = dataclasses.replace(config, eval_every=EVAL_EVERY)  # as grpo_config(held_out=True) resolves it
    settings = settings_dict(config, options, items)
    model, tokenizer, start, ckpt = _load(options.model, backend, options, "grpo", settings, tp_group, ep_group)
    trainer = GRPOTrainer(model, tokenizer, records, rewards, config,
                          _reference(backend, options, config, tp_group, ep_group),
                          dp_group, eval_dataset=held_out if config.eval_every else None)
    options = _writer_options(options, dp_group, tp_group, ep_group)
    return _run(trainer, "grpo", settings, tokenizer, start, ckpt, options, config.steps, on_step,
                "reward_mean", "GRPO reward", evaluate=trainer.evaluate if trainer.eval_dataset else None)


def _writer_options(options: RunOptions, dp_group, tp_group=None, ep_group=None) -> RunOptions:
    """Only rank 0 writes metrics and plots (all compute the same); the checkpoints are written as
    train/run.py says."""
    if all(group is None or group.rank == 0 for group in (dp_group, tp_group, ep_group)):
        return options
    return dataclasses.replace(options, log_jsonl=None, plot=None, report_to=None)


def _reference(backend, options: RunOptions, config: GRPOConfig, tp_group=None, ep_group=None):
    """The frozen reference for the KL term: the starting model's weights (beta > 0 only)."""
    if config.beta <= 0:
        return None
    model_config, weights, _ = load_model(options.model)
    return Model(backend, model_config, weights, tp_group=tp_group, ep_group=ep_group)


def run_sft(backend, options: RunOptions, config: SFTConfig, on_step: Callable[[dict], None], dp_group=None,
            tp_group=None, ep_group=None) -> list[dict]:
    """dp_group, tp_group, ep_group: as run_grpo's."""
    records = _sft_records(options, config.seed)
    settings = settings_dict(config, options)
    model, tokenizer, start, ckpt = _load(options.model, backend, options, "sft", settings, tp_group, ep_group)
    trainer = SFTTrainer(model, tokenizer, records, config, dp_group)
    options = _writer_options(options, dp_group, tp_group, ep_group)
    return _run(trainer, "sft", settings, tokenizer, start, ckpt, options, config.steps, on_step, "loss", "SFT loss")


def _run(trainer, kind, settings, tokenizer, start, ckpt, options: RunOptions, steps, on_step, curve, title,
         evaluate=None):
    if ckpt is not None:
        trainer.optimizer.load_state(ckpt.optimizer_state, ckpt.trainer_state["optimizer_steps"])
    report.check_report_to(options.report_to, options.out)
    board = (report.TensorBoardLog(options.out, resumed_after=start if ckpt is not None else None)
             if options.report_to == "tensorboard" else None)
    log = MetricsLog(options.log_jsonl, resume_from_step=start if ckpt is not None else None,
                     mirror=board.write if board is not None else None)
    history = list(ckpt.trainer_state.get("history", [])) if ckpt is not None else []
    try:
        run_steps(trainer, kind, settings, tokenizer, start, steps, options.out, options.save_every, log, on_step,
                  history=history, curve=curve, evaluate=evaluate)
    finally:
        if board is not None:
            board.close()
    if options.plot:
        # the whole run's curve: the log's records, or the checkpoint's history where the log lacks them
        logged = {r["step"] for r in log.records}
        plot_curve([h for h in history if h["step"] not in logged] + log.records, curve, os.fspath(options.plot), title,
                   evals=log.evals)
    return RunRecords(log.records, history, log.evals)


class RunRecords(list):
    """The steps this process ran (the list), and the whole run's curve (`history`: {"step", curve key}
    of every step since the run began, kept in the checkpoints, so that a resumed run's summary covers
    all of it), and its evaluations (`evals`: the eval/... records, train/evaluation.py)."""

    def __init__(self, records: list[dict], history: list[dict], evals: list[dict] | None = None):
        super().__init__(records)
        self.history = history
        self.evals = evals or []
