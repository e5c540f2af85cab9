"""`rlportable bench learning`: does a GRPO run learn as TRL's GRPOTrainer's does, from the same start?

Both sides train the same starting model on the same task with the same hyperparameters, for
several seeds each, and the benchmark compares what they learn, not how fast.

- Model: the built-in `tiny-sft`, exported with `save_model` as a Hugging Face directory in float32
  (config.json, model.safetensors, tokenizer files: the very weights, bit for bit), which TRL loads
  with transformers (Qwen3ForCausalLM, float32, on the CPU or the GPU our side runs on).
- Task and reward: each of `tasks` (built-in specs; the embedded default `arithmetic:digits=1,ops=+`
  and `countdown:count=2,max_number=3`), its exact reward as the only reward function on both sides.
- Prompts: step s of seed k takes the same records on both sides (`records_for_step` over the task's
  dataset of seed k; TRL gets them in that order with shuffle_dataset off, each repeated G times by
  its sampler); the JSON's `prompts_match` says whether every step's prompts were the same.
- Hyperparameters (Settings): prompts x G samples a step, completions of at most L tokens ending at
  the model's eos, temperature 1 with no top-k / top-p / min-p, loss "dapo", scale_rewards "group",
  beta 0, epsilon 0.2, num_iterations 1, one optimiser step a rollout (TRL: one micro-batch of all
  samples, gradient_accumulation_steps 1), AdamW betas (0.9, 0.99), eps 1e-8, weight decay 0,
  gradient clipping at 1, warmup then cosine to 0 (TRL: lr_scheduler_type "cosine" with the same
  warmup_steps). The two schedules differ by one step (docs/training.md, "The learning-rate schedule
  against TRL's"); `lr` per step is recorded on both sides.
- What differs by design: the sampling (our counter-based sampler against torch's generator: the
  same distribution, other draws, which is why each side runs several seeds) and the arithmetic (our
  exact contracts against torch float32).

Criteria (`criteria` in the JSON):
1. Curves: for each task, the mean over the last `window` steps of each seed's reward; each side's
   mean over its seeds must lie within the other side's seed spread, mean +- 2 standard deviations
   (ddof 1) of its seeds' values (about 95% of single runs, for roughly normal seed-to-seed spread).
2. First step given the same completions: our first step's rollout (seed 0) is handed to TRL's
   trainer through its `rollout_func`, so TRL's own code scores it, computes the advantages, the
   loss and the gradient of the same weights; its logged loss and gradient norm must agree with ours
   to FIRST_STEP_LOSS_ATOL (absolute) and FIRST_STEP_GRAD_RTOL (relative): float32 sums on TRL's
   side, and the contracts' 15-bit weight and 23-bit activation encodings in our backward.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from collections import defaultdict, deque
from dataclasses import asdict, dataclass


from rlportable.errors import InputError, RlpError

TASKS = ("arithmetic:digits=1,ops=+", "countdown:count=2,max_number=3")
FIRST_STEP_LOSS_ATOL = 1e-6
FIRST_STEP_GRAD_RTOL = 1e-4
SIDES = ("ours", "trl")
STEP_KEYS = ("reward_mean", "loss", "grad_norm", "lr", "completion_length")


@dataclass(frozen=True)
class Settings:
    tasks: tuple[str, ...] = TASKS
    steps: int = 50
    seeds: int = 3
    window: int = 20
    prompts_per_step: int = 32
    num_generations: int = 8
    max_completion_length: int = 8
    learning_rate: float = 4e-4
    warmup_steps: int = 5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    epsilon: float = 0.2
    beta: float = 0.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = 1
    temperature: float = 1.0

    def __post_init__(self):
        for name, flag in (("steps", "--steps"), ("seeds", "--seeds"), ("window", "--window"),
                           ("prompts_per_step", "--prompts-per-step"), ("num_generations", "--num-generations"),
                           ("max_completion_length", "--max-completion-length")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"bench learning: {flag} must be a positive integer, got {value!r}")
        if self.num_generations < 2:
            raise InputError(f"bench learning: --num-generations must be at least 2 (a group's advantages are its "
                             f"rewards less their mean), got {self.num_generations}")
        if self.seeds < 2:
            raise InputError(f"bench learning: --seeds must be at least 2 (the criterion is a spread over seeds), "
                             f"got {self.seeds}")
        if self.window > self.steps:
            raise InputError(f"bench learning: --window {self.window} is more than --steps {self.steps}")
        if self.warmup_steps >= self.steps:
            raise InputError(f"bench learning: --steps {self.steps} must be more than the {self.warmup_steps} "
                             "warm-up steps")
        if not self.tasks:
            raise InputError("bench learning: --task: give at least one task")
        from rlportable.train import tasks

        for spec in self.tasks:
            try:
                tasks.parse_task_spec(spec)
            except InputError as error:
                raise InputError(f"bench learning: --task {spec}: {error}") from None

    def grpo_config(self, seed: int):
        """Our GRPOConfig of one seed's run."""
        from rlportable.train.grpo import GRPOConfig

        return GRPOConfig(
            steps=self.steps, prompts_per_step=self.prompts_per_step, num_generations=self.num_generations,
            max_completion_length=self.max_completion_length, temperature=self.temperature, top_p=1.0, top_k=0,
            min_p=0.0, learning_rate=self.learning_rate, warmup_steps=self.warmup_steps, adam_beta1=self.adam_beta1,
            adam_beta2=self.adam_beta2, adam_eps=self.adam_eps, weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm, epsilon=self.epsilon, beta=self.beta, loss_type=self.loss_type,
            scale_rewards=self.scale_rewards, num_iterations=self.num_iterations, mini_batches=1, seed=seed)

    def trl_args(self, output_dir: str, seed: int, device: str, steps: int | None = None) -> dict:
        """TRL GRPOConfig keywords for the same run: all samples in one micro-batch, one generation and
        one optimiser step a step, float32, no gradient checkpointing (it changes no number)."""
        samples = self.prompts_per_step * self.num_generations
        return dict(
            output_dir=output_dir, max_steps=steps or self.steps, per_device_train_batch_size=samples,
            gradient_accumulation_steps=1, num_generations=self.num_generations,
            max_completion_length=self.max_completion_length, temperature=self.temperature, top_p=1.0, top_k=0,
            min_p=None, beta=self.beta, num_iterations=self.num_iterations, epsilon=self.epsilon,
            loss_type=self.loss_type, scale_rewards=self.scale_rewards, mask_truncated_completions=False,
            learning_rate=self.learning_rate, lr_scheduler_type="cosine", warmup_steps=self.warmup_steps,
            adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_epsilon=self.adam_eps,
            weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm, bf16=False, fp16=False,
            use_cpu=device == "cpu", gradient_checkpointing=False, shuffle_dataset=False, use_vllm=False,
            report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            seed=seed)


def _task(spec: str):
    from rlportable.train import tasks

    return tasks.parse_task_spec(spec)


def _dataset(spec: str, seed: int) -> list[dict]:
    from rlportable.train.prepare import DATASET_SIZE

    return _task(spec).dataset(seed, DATASET_SIZE)  # as `rlportable grpo --task` makes it


def step_records(spec: str, seed: int, settings: Settings, steps: int | None = None) -> list[list[dict]]:
    """The records of each step of one seed's run (ours draws them this way; TRL is given them in order)."""
    from rlportable.train.grpo import records_for_step

    dataset = _dataset(spec, seed)
    return [records_for_step(dataset, seed, step, settings.prompts_per_step)
            for step in range(steps or settings.steps)]


def export_model(directory: str) -> str:
    """tiny-sft as a Hugging Face directory, float32 (the weights bit for bit)."""
    from rlportable.model.load import load_model, save_model

    config, weights, tokenizer = load_model("tiny-sft")
    save_model(directory, config, weights, tokenizer, dtype="fp32")
    return directory


# ---------------------------------------------------------------- ours

def _our_trainer(backend, spec: str, seed: int, settings: Settings):
    from rlportable.model.forward import Model
    from rlportable.model.load import load_model
    from rlportable.train.grpo import GRPOTrainer
    from rlportable.train.rewards import RewardSet

    config, weights, tokenizer = load_model("tiny-sft")
    task = _task(spec)
    return GRPOTrainer(Model(backend, config, weights, trainable=True), tokenizer, _dataset(spec, seed),
                       RewardSet([(task, 1.0)]), settings.grpo_config(seed))


def run_ours(backend, spec: str, seed: int, settings: Settings, progress=None) -> dict:
    """One seed's run of rlportable's GRPOTrainer: the metrics of every step."""
    trainer = _our_trainer(backend, spec, seed, settings)
    steps, mismatches = [], 0
    for step in range(settings.steps):
        metrics = trainer.step(step)
        mismatches += metrics["logp_mismatches"]
        steps.append({key: float(metrics[key]) for key in STEP_KEYS})
        if progress and (step + 1) % 10 == 0:
            progress(f"ours {spec} seed {seed}: step {step + 1}, reward {metrics['reward_mean']:.3f}")
    return {"steps": steps, "logp_mismatches": mismatches}


# ---------------------------------------------------------------- TRL

def _trl_modules():
    try:
        import datasets
        import torch
        import transformers
        import trl
    except ImportError as error:
        raise RlpError(f"bench learning needs TRL for its peer: pip install 'rlportable[trl]' ({error})") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    # transformers' notices about TRL's use of its deprecated names, once per trainer: noise here
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    warnings.filterwarnings("ignore", message=".*'rollout_func'.*experimental", category=UserWarning)
    return torch, transformers, datasets, trl


def _trl_reward(spec: str, calls: list | None = None):
    """The task's reward as a TRL reward function (TRL passes the dataset's columns as keywords);
    calls: where to record each call's prompts."""
    task = _task(spec)

    def reward(prompts, completions, **columns):
        if calls is not None:
            calls.append(list(prompts))
        return task.reward(prompts, completions, **columns)

    reward.__name__ = task.name  # TRL logs each reward function under its name
    return reward


def _trl_trainer(model_dir: str, spec: str, records: list[dict], settings: Settings, seed: int, device: str,
                 output_dir: str, steps: int, calls: list | None = None, rollout_func=None):
    torch, transformers, datasets, trl = _trl_modules()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    args = trl.GRPOConfig(**settings.trl_args(output_dir, seed, device, steps))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[_trl_reward(spec, calls)], args=args,
                              train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
                              rollout_func=rollout_func)
    trainer.remove_callback(transformers.PrinterCallback)  # its per-step dicts would flood stdout
    return trainer


def _trl_steps(trainer) -> list[dict]:
    """TRL's logged metrics of each optimiser step, under our keys."""
    names = {"reward_mean": "reward", "loss": "loss", "grad_norm": "grad_norm", "lr": "learning_rate",
             "completion_length": "completions/mean_length"}
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "reward" in entry]
    return [{key: float(entry[name]) for key, name in names.items()} for entry in logged]


def run_trl(model_dir: str, spec: str, seed: int, settings: Settings, device: str = "cpu") -> dict:
    """One seed's run of TRL's GRPOTrainer, given our steps' prompts in order."""
    torch = _trl_modules()[0]
    per_step = step_records(spec, seed, settings)
    calls: list = []
    with tempfile.TemporaryDirectory(prefix="rlp-bench-learning-") as folder:
        trainer = _trl_trainer(model_dir, spec, [r for step in per_step for r in step], settings, seed, device,
                               folder, settings.steps, calls)
        torch.manual_seed(seed)
        trainer.train()
    steps = _trl_steps(trainer)
    if len(steps) != settings.steps:
        raise RlpError(f"bench learning: TRL logged {len(steps)} steps of {settings.steps}")
    match = len(calls) == len(per_step) and all(
        sorted(prompts) == sorted(r["prompt"] for r in records for _ in range(settings.num_generations))
        for prompts, records in zip(calls, per_step))
    return {"steps": steps, "prompts_match": match}


# ---------------------------------------------------------------- the first step, same completions

def first_step_same_completions(backend, model_dir: str, spec: str, settings: Settings, seed: int = 0,
                                device: str = "cpu") -> dict:
    """Our first step (seed `seed`), then TRL's first step on our rollout's completions (its
    `rollout_func` hands them over): loss, gradient norm (before clipping) and reward of each."""
    trainer = _our_trainer(backend, spec, seed, settings)
    rollouts = []
    rollout = trainer._rollout

    def recorded(*args, **kwargs):
        samples, texts = rollout(*args, **kwargs)
        rollouts.append(samples)
        return samples, texts

    trainer._rollout = recorded
    ours = trainer.step(0)
    queues: dict[tuple, deque] = defaultdict(deque)  # prompt ids -> our completions of that prompt, in order
    for sample in rollouts[0]:
        queues[tuple(sample.prompt_ids)].append(list(sample.completion_ids))

    def rollout_func(prompts, trl_trainer):
        ids = [list(trl_trainer.processing_class(text=p, add_special_tokens=False)["input_ids"]) for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [queues[tuple(p)].popleft() for p in ids], "logprobs": None}

    records = step_records(spec, seed, settings, steps=1)[0]
    with tempfile.TemporaryDirectory(prefix="rlp-bench-learning-") as folder:
        trl_trainer = _trl_trainer(model_dir, spec, records, settings, seed, device, folder, 1,
                                   rollout_func=rollout_func)
        trl_trainer.train()
    left = sum(len(q) for q in queues.values())
    if left:
        raise RlpError(f"bench learning: TRL's first step took {len(rollouts[0]) - left} of our "
                       f"{len(rollouts[0])} completions")
    trl = _trl_steps(trl_trainer)[0]
    out = {"samples": len(rollouts[0]),
           "ours": {"loss": float(ours["loss"]), "grad_norm": float(ours["grad_norm"]),
                    "reward_mean": float(ours["reward_mean"])},
           "trl": {key: trl[key] for key in ("loss", "grad_norm", "reward_mean")}}
    out["loss_abs_diff"] = abs(out["ours"]["loss"] - out["trl"]["loss"])
    norm = max(out["trl"]["grad_norm"], 1e-30)
    out["grad_norm_rel_diff"] = abs(out["ours"]["grad_norm"] - out["trl"]["grad_norm"]) / norm
    out["pass"] = bool(out["loss_abs_diff"] <= FIRST_STEP_LOSS_ATOL and
                       (out["grad_norm_rel_diff"] <= FIRST_STEP_GRAD_RTOL or out["trl"]["grad_norm"] == 0.0
                        and out["ours"]["grad_norm"] == 0.0)
                       and out["ours"]["reward_mean"] == out["trl"]["reward_mean"])
    return out


# ---------------------------------------------------------------- the comparison

def seed_spread(values: list[float]) -> tuple[float, float, float, float]:
    """(mean, std with ddof 1, low, high) of per-seed values: the spread is mean +- 2 std."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std, mean - 2 * std, mean + 2 * std


def compare_curves(task: dict, window: int) -> dict:
    """Criterion 1 for one task: task = {side: {"runs": [one seed's {"steps": [...]}, ...]}}."""
    out = {}
    for side in SIDES:
        last = [statistics.fmean(s["reward_mean"] for s in run["steps"][-window:]) for run in task[side]["runs"]]
        first = [run["steps"][0]["reward_mean"] for run in task[side]["runs"]]
        mean, std, low, high = seed_spread(last)
        out[side] = {"last_window_by_seed": last, "last_window_mean": mean, "last_window_std": std,
                     "spread": [low, high], "first_step_by_seed": first}
    for side, other in (("ours", "trl"), ("trl", "ours")):
        low, high = out[other]["spread"]
        out[side]["within_other_spread"] = bool(low <= out[side]["last_window_mean"] <= high)
    out["pass"] = out["ours"]["within_other_spread"] and out["trl"]["within_other_spread"]
    return out


def mean_curve(runs: list[dict], key: str = "reward_mean") -> list[float]:
    return [statistics.fmean(run["steps"][i][key] for run in runs) for i in range(len(runs[0]["steps"]))]


def plot(result: dict, path: str) -> None:
    """Both sides' reward curves, one panel a task: each seed thin, the seeds' mean thick."""
    try:
        import matplotlib
    except ImportError:
        raise InputError("bench learning: --plot needs matplotlib: pip install 'rlportable[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    colours = {"ours": "tab:blue", "trl": "tab:orange"}
    labels = {"ours": "rlportable", "trl": f"TRL {result['versions'].get('trl', '')}".strip()}
    for ax, (spec, task) in zip(axes[0], tasks.items()):
        for side in SIDES:
            for run in task[side]["runs"]:
                ax.plot(range(1, len(run["steps"]) + 1), [s["reward_mean"] for s in run["steps"]],
                        color=colours[side], alpha=0.25, linewidth=0.8)
            curve = task[side]["mean_reward_by_step"]
            crit = task["criterion"][side]
            ax.plot(range(1, len(curve) + 1), curve, color=colours[side], linewidth=2,
                    label=f"{labels[side]}: last {result['settings']['window']} steps "
                          f"{crit['last_window_mean']:.3f} +- {crit['last_window_std']:.3f}")
        verdict = "within each other's seed spread" if task["criterion"]["pass"] else "NOT within the spreads"
        ax.set_title(f"{spec}\n{verdict}", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward (thin: seeds, thick: their mean)")
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    settings = result["settings"]
    fig.suptitle(f"GRPO from tiny-sft, {settings['prompts_per_step']} prompts x {settings['num_generations']} samples, "
                 f"{settings['seeds']} seeds a side, lr {settings['learning_rate']:g} (warmup {settings['warmup_steps']}, "
                 f"cosine), {settings['loss_type']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(backend, settings: Settings, progress=None) -> dict:
    """The whole benchmark: for each task, every seed on both sides, then the first-step check."""
    torch, transformers, datasets, trl = _trl_modules()
    device = "cuda" if backend.name == "cuda" else "cpu"
    result = {"device": backend.info(), "trl_device": device, "settings": asdict(settings),
              "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                           "torch": torch.__version__, "datasets": datasets.__version__},
              "criteria": {"curves": "per task, each side's mean over seeds of the last-window mean reward lies "
                                     "within the other side's mean +- 2 std (ddof 1) over its seeds",
                           "first_step": f"given our first rollout's completions, TRL's loss within "
                                         f"{FIRST_STEP_LOSS_ATOL:g} of ours and its gradient norm within "
                                         f"{FIRST_STEP_GRAD_RTOL:g} relative, rewards equal"},
              "tasks": {}, "seconds": {"ours": 0.0, "trl": 0.0}}
    with tempfile.TemporaryDirectory(prefix="rlp-tiny-sft-hf-") as model_dir:
        export_model(model_dir)
        for spec in settings.tasks:
            task: dict = {"ours": {"runs": []}, "trl": {"runs": []}}
            for seed in range(settings.seeds):
                for side in SIDES:
                    if progress:
                        progress(f"{side} {spec} seed {seed}: {settings.steps} steps")
                    start = time.perf_counter()
                    one = (run_ours(backend, spec, seed, settings, progress) if side == "ours"
                           else run_trl(model_dir, spec, seed, settings, device))
                    one["seed"], one["seconds"] = seed, time.perf_counter() - start
                    result["seconds"][side] += one["seconds"]
                    task[side]["runs"].append(one)
            for side in SIDES:
                task[side]["mean_reward_by_step"] = mean_curve(task[side]["runs"])
            task["prompts_match"] = all(r["prompts_match"] for r in task["trl"]["runs"])
            task["logp_mismatches"] = sum(r["logp_mismatches"] for r in task["ours"]["runs"])
            task["criterion"] = compare_curves(task, settings.window)
            if progress:
                progress(f"{spec}: first step on the same completions")
            task["first_step_same_completions"] = first_step_same_completions(backend, model_dir, spec, settings,
                                                                              device=device)
            result["tasks"][spec] = task
    result["pass"] = all(t["criterion"]["pass"] and t["first_step_same_completions"]["pass"] and t["prompts_match"]
                         for t in result["tasks"].values())
    return result


def summary_lines(result: dict) -> list[str]:
    """What the command prints: per task, the criterion's numbers and verdicts."""
    lines = []
    window = result["settings"]["window"]
    for spec, task in result["tasks"].items():
        crit, first = task["criterion"], task["first_step_same_completions"]
        for side in SIDES:
            c = crit[side]
            lines.append(f"{spec} {side}: last-{window}-step reward {c['last_window_mean']:.4f} +- "
                         f"{c['last_window_std']:.4f} (seeds {', '.join(f'{v:.3f}' for v in c['last_window_by_seed'])}); "
                         f"within the other's spread: {c['within_other_spread']}")
        lines.append(f"{spec} first step, same {first['samples']} completions: loss {first['ours']['loss']:.6g} "
                     f"against TRL {first['trl']['loss']:.6g}, grad norm {first['ours']['grad_norm']:.6g} against "
                     f"{first['trl']['grad_norm']:.6g} (rel {first['grad_norm_rel_diff']:.2g}): "
                     f"{'pass' if first['pass'] else 'FAIL'}")
        lines.append(f"{spec}: prompts the same on both sides: {task['prompts_match']}; our log-prob mismatches "
                     f"{task['logp_mismatches']}")
    lines.append(f"seconds: ours {result['seconds']['ours']:.1f}, TRL {result['seconds']['trl']:.1f}; "
                 f"{'PASS' if result['pass'] else 'FAIL'}")
    return lines


def check_plot_path(path: str | None) -> None:
    """Before the run: --plot's folder can be written and matplotlib is there."""
    if path is None:
        return
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise InputError("bench learning: --plot needs matplotlib: pip install 'rlportable[plot]'")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.exists(folder) and not os.access(folder, os.W_OK):
        raise InputError(f"bench learning: --plot {path}: {folder} is not writable")
