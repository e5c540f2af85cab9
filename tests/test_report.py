"""--report-to tensorboard: the metrics of every step and evaluation as scalars in event files in --out,
read back here with TensorBoard's own loader; a resumed run's points replace the interrupted run's."""

import importlib.util

import numpy as np
import pytest
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.runtime import get_backend
from rlportable.train import prepare, report
from rlportable.train.grpo import GRPOConfig

CPU = get_backend("cpu")
TASK = "arithmetic:digits=1,ops=+"


def _options(tmp_path, name, resume=False):
    return prepare.RunOptions(model="tiny-sft", out=str(tmp_path / name), resume=resume, save_every=1,
                             log_jsonl=str(tmp_path / f"{name}.jsonl"), plot=None, task=TASK, data=None,
                             eval_task=TASK, report_to="tensorboard")


def _config():
    return GRPOConfig(steps=3, prompts_per_step=3, num_generations=4, max_completion_length=4, learning_rate=3e-3,
                      seed=5, eval_every=2, eval_samples=2)


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard loads the folder (all its event files, in order)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_tags_group_the_metrics_as_tensorboard_shows_them():
    assert report.tensorboard_tag("reward_mean") == "train/reward_mean"
    assert report.tensorboard_tag("logp_mismatches") == "rollout_corr/logp_mismatches"
    assert report.tensorboard_tag("eval/pass@1") == "eval/pass@1"
    assert report.tensorboard_tag("time/rollout_s") == "time/rollout_s"
    assert report.scalars({"step": 3, "loss": 0.5, "notes": ["x"], "logp_compared": 12, "flag": True}) == \
        {"train/loss": 0.5, "rollout_corr/logp_compared": 12.0}


def test_a_grpo_run_writes_scalars_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard")
    records = prepare.run_grpo(CPU, _options(tmp_path, "run"), _config(), [], lambda r: None)
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))
    scalars = _scalars(tmp_path / "run")
    for key, tag in (("reward_mean", "train/reward_mean"), ("loss", "train/loss"), ("kl", "train/kl"),
                     ("clip_fraction", "train/clip_fraction"), ("completion_length", "train/completion_length"),
                     ("rollout_tokens_per_s", "train/rollout_tokens_per_s"),
                     ("logp_mismatches", "rollout_corr/logp_mismatches"),
                     ("max_abs_dlogp", "rollout_corr/max_abs_dlogp")):
        assert scalars[tag] == [(r["step"], float(np.float32(r[key]))) for r in records], tag
    evals = records.evals
    assert [e["step"] for e in evals] == [0, 2, 3]
    for key in ("eval/pass@1", "eval/pass@2", "eval/greedy/pass@1", "eval/reward_mean"):
        assert scalars[key] == [(e["step"], float(np.float32(e[key]))) for e in evals], key


def test_a_resumed_run_replaces_the_points_logged_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    straight = prepare.run_grpo(CPU, _options(tmp_path, "straight"), _config(), [], lambda r: None)

    def crash_after_three(record):
        if record.get("step") == 3 and "reward_mean" in record:
            raise KeyboardInterrupt  # step 3 logged (to TensorBoard too), its checkpoint not written

    with pytest.raises(KeyboardInterrupt):
        prepare.run_grpo(CPU, _options(tmp_path, "crashed"), _config(), [], crash_after_three)
    prepare.run_grpo(CPU, _options(tmp_path, "crashed", resume=True), _config(), [], lambda r: None)
    assert len(list((tmp_path / "crashed").glob("events.out.tfevents.*"))) == 2
    scalars = _scalars(tmp_path / "crashed")
    assert scalars["train/reward_mean"] == [(r["step"], float(np.float32(r["reward_mean"]))) for r in straight]
    assert [step for step, _ in scalars["eval/pass@1"]] == [0, 2, 3]


def test_sft_reports_its_loss_from_the_command_line(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "sft"
    result = CliRunner().invoke(main, ["sft", "--device", "cpu", "--steps", "2", "--out", str(out),
                                       "--report-to", "tensorboard"])
    assert result.exit_code == 0, result.output
    scalars = _scalars(out)
    assert [step for step, _ in scalars["train/loss"]] == [1, 2] and "train/tokens_per_s" in scalars
    assert 'report-to = "tensorboard"' in (out / "run_config.toml").read_text()


def test_report_to_errors_are_one_line_before_any_work(tmp_path, monkeypatch):
    result = CliRunner().invoke(main, ["grpo", "--device", "cpu", "--steps", "1", "--report-to", "tensorboard"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "error: --report-to tensorboard writes its event files into --out; give --out DIR"], result.output
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    result = CliRunner().invoke(main, ["sft", "--device", "cpu", "--steps", "1", "--out", str(tmp_path / "o"),
                                       "--report-to", "tensorboard"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "error: --report-to tensorboard needs the tensorboard package: pip install 'rlportable[tensorboard]'"]
    assert not (tmp_path / "o").exists()
    with pytest.raises(InputError, match="expected one of none, tensorboard"):
        report.check_report_to("wandb", str(tmp_path))
