"""Bad runs refused before any work, with one line naming the problem; interrupted runs leave nothing stale."""

import json

import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.model.load import load_model
from rlportable.train.grpo import GRPOConfig, check_prompt_lengths, truncated_prompt


def _tokenizer():
    return load_model("tiny")[2]


def test_one_generation_per_prompt_is_refused_with_the_reason():
    with pytest.raises(InputError, match="--num-generations 1.*advantage 0"):
        GRPOConfig(num_generations=1)
    result = CliRunner().invoke(main, ["grpo", "-G", "1", "--steps", "1", "--device", "cpu"])
    assert result.exit_code != 0 and "--num-generations 1" in result.output and clean_exit(result)


def test_a_prompt_past_the_models_positions_is_refused_naming_the_record():
    tokenizer = _tokenizer()
    dataset = [{"prompt": "1+1="}, {"prompt": "x" * 3000}, {"prompt": "2+2="}]
    config = GRPOConfig(max_completion_length=64)
    with pytest.raises(InputError, match=r"dataset record 1: its prompt has \d+ tokens.*more than the model's 1000"):
        check_prompt_lengths(tokenizer, dataset, config, 1000)
    # cut to their last tokens, the same prompts fit
    cut = GRPOConfig(max_completion_length=64, max_prompt_length=100)
    assert check_prompt_lengths(tokenizer, dataset, cut, 1000) == 100


def test_max_prompt_length_keeps_the_last_tokens():
    tokenizer = _tokenizer()
    ids = list(tokenizer.encode("12+34=46 and more text here"))
    assert truncated_prompt(tokenizer, "12+34=", None) == "12+34="
    assert truncated_prompt(tokenizer, "12+34=46 and more text here", 5) == ids[-5:]
    assert truncated_prompt(tokenizer, [1, 2, 3], 5) == [1, 2, 3]
    assert truncated_prompt(tokenizer, [1, 2, 3, 4, 5, 6], 2) == [5, 6]


def test_cli_grpo_refuses_a_long_prompt_before_any_step(tmp_path):
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "1" * 5000, "answer": "1"}) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text("def zero(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    result = CliRunner().invoke(main, ["grpo", "--model", "tiny", "--data", str(data), "--reward",
                                       f"{reward}:zero", "--steps", "1", "--device", "cpu"])
    assert result.exit_code != 0 and "dataset record 0" in result.output and "max_position_embeddings" in result.output
    assert clean_exit(result)


def test_a_failed_save_is_one_line_saying_what_survives(tmp_path, monkeypatch):
    import errno

    from rlportable.runtime import get_backend
    from rlportable.train import checkpoint, prepare, run
    from rlportable.train.sft import SFTConfig

    real = checkpoint.save_checkpoint
    calls = []

    def full_disk(directory, step, *args, **kwargs):
        calls.append(step)
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(directory))
        return real(directory, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", full_disk)
    options = prepare.RunOptions(model="tiny", out=str(tmp_path / "run"), resume=False, save_every=1,
                                log_jsonl=str(tmp_path / "run.jsonl"), plot=None, task="arithmetic:digits=1,ops=+",
                                data=None)
    with pytest.raises(checkpoint.CheckpointError) as caught:
        prepare.run_sft(get_backend("cpu"), options, SFTConfig(steps=3, batch_size=4), lambda r: None)
    message = str(caught.value)
    assert "\n" not in message and "saving step 2" in message and "No space left on device" in message
    assert "step-000001 is intact" in message and "--resume" in message and "run.jsonl" in message
    assert calls == [1, 2] and len((tmp_path / "run.jsonl").read_text().splitlines()) == 2
    assert run.save_failure(str(tmp_path / "none"), 1, OSError(errno.EACCES, "Permission denied"), None) == (
        f"saving step 1 to {tmp_path / 'none'} failed: Permission denied; no earlier checkpoint exists; make room "
        "and start again")


def test_task_options_and_sampling_flags_are_named():
    from rlportable.train.tasks import parse_task_spec

    with pytest.raises(InputError, match="unknown option digts; its options: digits, ops"):
        parse_task_spec("arithmetic:digts=2")
    with pytest.raises(InputError, match=r"^--top-p must be"):
        GRPOConfig(top_p=2.0)
    with pytest.raises(InputError, match=r"^--max-completion-length must be|^grpo: max_completion_length"):
        GRPOConfig(max_completion_length=0)
    result = CliRunner().invoke(main, ["generate", "--prompt", "hi", "--top-p", "3", "--device", "cpu"])
    assert result.exit_code != 0 and "--top-p must be" in result.output and "SamplingParams" not in result.output


def _sft(tmp_path, *extra):
    return CliRunner().invoke(main, ["sft", "--steps", "3", "--batch-size", "4", "--save-every", "1", "--out",
                                     str(tmp_path / "run"), "--device", "cpu", *extra])


def test_resume_says_where_it_starts_and_a_finished_run_says_so(tmp_path):
    first = _sft(tmp_path)
    assert first.exit_code == 0, first.output
    assert "sft: 3 steps; loss" in first.output and "(mean of the first 1)" in first.output  # halves, not 10 and 10
    again = _sft(tmp_path, "--resume")
    assert again.exit_code == 0 and "complete at step 3 (--steps 3)" in again.output and "--model" in again.output
    assert "sft: 0 steps" not in again.output
    # a run stopped after step 2: `latest` back to step 2, step 3 gone
    run = tmp_path / "run"
    import shutil

    shutil.rmtree(run / "step-000003")
    (run / "latest").write_text("step-000002\n")
    resumed = _sft(tmp_path, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert f"resuming {run / 'step-000002'} at step 2 of 3" in resumed.output
    assert "sft: 3 steps (1 in this process, resumed after step 2)" in resumed.output


def test_an_interrupt_says_which_checkpoint_survived(tmp_path, monkeypatch):
    from rlportable.train import prepare

    real = prepare.run_steps

    def interrupted(trainer, kind, settings, tokenizer, start, steps, out_dir, save_every, log, on_step, **kw):
        def stop_after_two(record):
            on_step(record)
            if record["step"] == 2:
                raise KeyboardInterrupt

        return real(trainer, kind, settings, tokenizer, start, steps, out_dir, save_every, log, stop_after_two, **kw)

    monkeypatch.setattr(prepare, "run_steps", interrupted)
    result = _sft(tmp_path)
    assert result.exit_code == 130
    assert f"interrupted after step 2; the latest checkpoint is {tmp_path / 'run' / 'step-000001'}" in result.output
    assert "--resume" in result.output and "Aborted" not in result.output


def test_summary_halves_short_runs_and_names_the_plot():
    from rlportable.train.metrics import summary_lines

    records = [{"step": i + 1, "loss": float(10 - i)} for i in range(6)]
    line = summary_lines("sft", records, None, "curve.png")
    assert line[0] == "sft: 6 steps; loss 9 (mean of the first 3) -> 6 (mean of the last 3)"
    assert line[-1] == "curve: curve.png"
    assert summary_lines("sft", records[:1], None)[0] == "sft: 1 steps; loss 10"


def test_models_engines_and_trainers_are_freed_when_dropped():
    """No module-level cache or reference cycle keeps a model alive: dropping the last reference frees
    it at once (reference counting, the collector off), so its device memory goes with it."""
    import gc
    import weakref

    import numpy as np

    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams
    from rlportable.model import backward
    from rlportable.model.forward import Model
    from rlportable.runtime import get_backend
    from rlportable.train import tasks
    from rlportable.train.grpo import GRPOTrainer
    from rlportable.train.rewards import RewardSet

    cpu = get_backend("cpu")
    config, weights, tokenizer = load_model("tiny")
    task = tasks.parse_task_spec("arithmetic:digits=1,ops=+")
    gc.collect()
    gc.disable()
    try:
        model = Model(cpu, config, weights, trainable=True)
        fwd = backward.forward(model, np.arange(12, dtype=np.int32) % config.vocab_size, np.array([0, 12]))
        backward.backward(model, fwd, np.ones(fwd.rows.size, np.float32))
        del fwd
        gone = weakref.ref(model)
        del model
        assert gone() is None, "a trained model outlived its last reference"
        llm = LLM("tiny", device=cpu)
        llm.generate(["1+1="], SamplingParams(max_tokens=3))
        gone = weakref.ref(llm)
        del llm
        assert gone() is None, "an engine outlived its last reference"
        trainer = GRPOTrainer(Model(cpu, config, weights, trainable=True), tokenizer, task.dataset(0, 16),
                              RewardSet([(task, 1.0)]), GRPOConfig(steps=1, prompts_per_step=2, num_generations=2,
                                                                   max_completion_length=3))
        trainer.step(0)
        gone_model, gone_trainer = weakref.ref(trainer.model), weakref.ref(trainer)
        del trainer
        assert gone_trainer() is None and gone_model() is None, "a trainer or its model outlived the trainer"
    finally:
        gc.enable()


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_each_default_has_one_home(kind, tmp_path, monkeypatch):
    """With no options the command runs the config dataclass's defaults, changed only by the embedded
    run's few values for the built-in models; docs/training.md states the same numbers."""
    import dataclasses
    import re
    from pathlib import Path

    import rlportable.cli as cli
    from rlportable.train import prepare
    from rlportable.train.sft import SFTConfig

    made = []
    build = getattr(prepare, f"{kind}_config")
    monkeypatch.setattr(prepare, f"{kind}_config", lambda *a, **k: made.append(build(*a, **k)) or made[-1])
    monkeypatch.setattr(cli, "_train_on_replicas", lambda *a, **k: None)
    cls, embedded = (SFTConfig, prepare.EMBEDDED_SFT) if kind == "sft" else (GRPOConfig, prepare.EMBEDDED_GRPO)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for model, want in ((None, cls(**embedded)), ("tiny", cls(**embedded)), (str(model_dir), cls())):
        args = [kind, "--device", "cpu"] + ([] if model is None else ["--model", model])
        assert CliRunner().invoke(main, args).exit_code == 0
        assert made[-1] == want, (model, dataclasses.asdict(made[-1]), dataclasses.asdict(want))
    text = (Path(__file__).resolve().parent.parent / "docs" / "training.md").read_text()
    rows = dict(re.findall(rf"^\| {kind} \| `(\w+)` \| ([^|]+?) \|", text, re.M))
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    assert rows, "docs/training.md has no defaults table for " + kind
    for name, stated in rows.items():
        default, run = (part.strip() for part in stated.split("/")) if "/" in stated else (stated.strip(), None)
        assert default == repr(fields[name]).strip("'"), (kind, name, stated)
        assert (run is None and name not in embedded) or run == repr(embedded.get(name)), (kind, name, stated)


def test_the_embedded_run_is_stated_as_train_prepare_defines_it():
    """README's quick start, docs/training.md and the --model help state the embedded default run's
    numbers, task and models: change train/prepare.py (or the config's defaults) and this fails until
    they say the same."""
    from pathlib import Path

    from rlportable.train import prepare

    root = Path(__file__).resolve().parent.parent
    grpo = prepare.grpo_config(prepare.DEFAULT_GRPO_MODEL)
    readme = " ".join((root / "README.md").read_text().split())
    assert (f"built-in tiny model (`{prepare.DEFAULT_GRPO_MODEL}`) on one-digit additions, {grpo.steps} steps of "
            f"{grpo.prompts_per_step} prompts x {grpo.num_generations} samples") in readme
    assert prepare.DEFAULT_TASK == "arithmetic:digits=1,ops=+"  # README's "one-digit additions"
    training = " ".join((root / "docs" / "training.md").read_text().split())
    assert (f"`rlportable sft` fine-tunes the {prepare.DEFAULT_SFT_MODEL} built-in model on the answers of the "
            f"built-in task `{prepare.DEFAULT_TASK}`; `rlportable grpo` starts from `{prepare.DEFAULT_GRPO_MODEL}`"
            ) in training
    helps = {name: next(p.help for p in main.commands[name].params if p.name == "model_spec") for name in ("sft", "grpo")}
    assert f"(default: {prepare.DEFAULT_SFT_MODEL};" in helps["sft"]
    assert f"(default: {prepare.DEFAULT_GRPO_MODEL})" in helps["grpo"]
    assert set(prepare.BUILT_IN_MODELS) == {prepare.DEFAULT_SFT_MODEL, prepare.DEFAULT_GRPO_MODEL, "tiny-moe"}
