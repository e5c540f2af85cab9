"""Evaluation while GRPO trains: pass@k by hand, the schedule, the eval/... records and lines, bad input
refused in one line, and a run that evaluates trains bitwise as one that does not."""

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.cli import main
from rlportable.runtime import get_backend
from rlportable.train import prepare
from rlportable.train.evaluation import EVAL_REQUEST_BASE, eval_due, eval_metrics, is_eval, pass_at_k

CPU = get_backend("cpu")
TIMINGS = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")


def test_pass_at_k_against_hand_computed_values():
    # 1 - C(n - c, k) / C(n, k)
    assert pass_at_k(4, 1, 1) == 0.25
    assert math.isclose(pass_at_k(4, 1, 2), 1 - 3 / 6)
    assert math.isclose(pass_at_k(5, 2, 2), 1 - 3 / 10)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_eval_metrics_against_a_hand_computed_case():
    sampled = [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0.5, 1]]  # 1, 0 and 3 of 4 samples reach the threshold 1
    greedy = [1, 0.5, 1]
    got = eval_metrics(np.array(sampled), np.array(greedy), 1.0)
    assert math.isclose(got["eval/pass@1"], (1 / 4 + 0 + 3 / 4) / 3)
    assert math.isclose(got["eval/pass@4"], 2 / 3)  # a prompt passes when any of its 4 samples does
    assert math.isclose(got["eval/reward_mean"], 4.5 / 12)
    assert math.isclose(got["eval/greedy/pass@1"], 2 / 3) and math.isclose(got["eval/greedy/reward_mean"], 2.5 / 3)
    lower = eval_metrics(np.array(sampled), np.array(greedy), 0.5)  # the 0.5s pass too
    assert math.isclose(lower["eval/pass@1"], (1 / 4 + 0 + 1) / 3) and lower["eval/greedy/pass@1"] == 1.0


def test_evaluations_come_before_the_first_step_every_n_and_after_the_last():
    assert [d for d in range(6) if eval_due(d, 5, 2)] == [0, 2, 4, 5]
    assert [d for d in range(6) if eval_due(d, 5, 10)] == [0, 5]
    assert not any(eval_due(d, 5, every) for d in range(6) for every in (0, None))


def _config(**kw):
    # the embedded default run (tiny-sft, one-digit additions), three steps
    return prepare.grpo_config("tiny-sft", steps=3, **kw)


def _options(tmp_path, name, **kw):
    return prepare.RunOptions(model="tiny-sft", out=str(tmp_path / name), resume=False, save_every=1,
                             log_jsonl=str(tmp_path / f"{name}.jsonl"), plot=None, task=prepare.DEFAULT_TASK, data=None,
                             **kw)


def _training_lines(path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMINGS and not k.startswith("time/")}
            for r in lines if not is_eval(r)]


def _checkpoint_files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_evaluating_changes_none_of_the_runs_bits(tmp_path, monkeypatch):
    """With held-out prompts evaluated before the first step and after every step, the training lines of
    the metrics log, the checkpoints (weights, optimiser state, trainer state) and so the final weights
    are byte for byte those of the run without evaluation; with two data-parallel replicas too, whose
    evaluations equal one device's. The held-out prompts (two-digit additions) are longer than the
    training ones, so the engine is sized for them."""
    from rlportable.runtime.collectives import run_threads

    from rlportable.engine.llm import LLM

    monkeypatch.setattr(prepare, "EVAL_TASK_SIZE", 12)
    plain = prepare.run_grpo(CPU, _options(tmp_path, "plain"), _config(), [], lambda r: None)
    assert any(r["reward_std"] > 0 for r in plain)  # the weights move
    evaluating = _config(eval_every=1, eval_samples=3)
    seen, keys = [], []
    generate = LLM.generate

    def recording(self, prompts, params=None, progress=None, request_ids=None, seed=0):
        keys.append({(seed, i) for i in request_ids})  # the sampler's (key, request) of each request
        return generate(self, prompts, params, progress, request_ids, seed)

    monkeypatch.setattr(LLM, "generate", recording)
    evaluated = prepare.run_grpo(CPU, _options(tmp_path, "evaluated", eval_task="arithmetic:digits=2,ops=+"),
                                evaluating, [], seen.append)
    monkeypatch.setattr(LLM, "generate", generate)
    # calls: evaluation, then each step's rollout and evaluation; no (key, request) of both
    training, evaluations = set().union(*keys[1::2]), set().union(*keys[0::2])
    assert len(keys) == 7 and len(training) == 3 * evaluating.prompts_per_step and not training & evaluations
    assert min(i for _, i in evaluations) == EVAL_REQUEST_BASE
    assert [r["step"] for r in evaluated.evals] == [0, 1, 2, 3]
    assert [r["step"] for r in seen] == [0, 1, 1, 2, 2, 3, 3]  # each evaluation after its step's line
    assert _training_lines(tmp_path / "plain.jsonl") == _training_lines(tmp_path / "evaluated.jsonl")
    for step in ("step-000001", "step-000002", "step-000003"):
        assert _checkpoint_files(tmp_path / "plain" / step) == _checkpoint_files(tmp_path / "evaluated" / step), step

    replicated = run_threads(CPU, 2, lambda dp_group: prepare.run_grpo(
        CPU, _options(tmp_path, "replicated", eval_task="arithmetic:digits=2,ops=+"), evaluating, [],
        lambda r: None, dp_group))
    assert _training_lines(tmp_path / "replicated.jsonl") == _training_lines(tmp_path / "plain.jsonl")
    sharded, single = (_checkpoint_files(tmp_path / name / "step-000003") for name in ("replicated", "plain"))
    for name in ("model.safetensors", "trainer_state.json"):  # the optimiser state is in one shard per replica
        assert sharded[name] == single[name], name
    for records in replicated:
        assert [{k: v for k, v in r.items() if k != "eval/time_s"} for r in records.evals] == \
            [{k: v for k, v in r.items() if k != "eval/time_s"} for r in evaluated.evals]


def test_evaluation_requests_have_ids_of_their_own():
    """A training rollout's request ids are its prompts' indices in the step, below prompts_per_step,
    which the config holds below the first evaluation id."""
    from rlportable.errors import InputError
    from rlportable.train.grpo import GRPOConfig

    assert EVAL_REQUEST_BASE == 1 << 31
    with pytest.raises(InputError, match="--prompts-per-step must be below 2"):
        GRPOConfig(prompts_per_step=EVAL_REQUEST_BASE)


def test_cli_eval_every_prints_and_logs_eval_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, "EVAL_TASK_SIZE", 6)
    log, plot = tmp_path / "m.jsonl", tmp_path / "reward.png"
    args = ["grpo", "--steps", "3", "--prompts-per-step", "2", "-G", "2", "--device", "cpu", "--log-jsonl", str(log),
            "--eval-task", "arithmetic:digits=1,ops=+", "--eval-every", "2", "--eval-samples", "3"]
    plot_args = ["--plot", str(plot)] if _has_matplotlib() else []
    result = CliRunner().invoke(main, args + plot_args)
    assert result.exit_code == 0, result.output
    assert "evaluating 6 held-out prompts" in result.output
    for step in (0, 2, 3):
        assert f"eval after step {step} (6 prompts) | greedy pass@1 " in result.output
    assert "pass@3 " in result.output
    assert "eval (6 held-out prompts, 3 evaluations), step 0 -> step 3: greedy pass@1" in result.output
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    evals = [r for r in lines if is_eval(r)]
    assert [r["step"] for r in evals] == [0, 2, 3] and [r["step"] for r in lines if not is_eval(r)] == [1, 2, 3]
    for record in evals:
        for key in ("eval/reward_mean", "eval/pass@1", "eval/pass@3", "eval/greedy/reward_mean", "eval/greedy/pass@1"):
            assert 0.0 <= record[key] <= 1.0, (key, record)
        assert record["eval/pass@1"] <= record["eval/pass@3"] and record["eval/samples"] == 3
    if plot_args:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the resolved options say it, and rerun it
    printed = CliRunner().invoke(main, ["grpo", "--print-config", "--eval-task", "countdown"])
    assert "eval-task = \"countdown\"" in printed.output and f"eval-every = {prepare.EVAL_EVERY}" in printed.output


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


@pytest.mark.parametrize("extra, words", [
    (["--eval-every", "5"], "error: --eval-every 5: no held-out prompts to evaluate; give --eval-data"),
    (["--eval-data", "MISSING"], "error: --eval-data MISSING: no such file"),
    (["--eval-task", "arithmetic", "--eval-data", "MISSING"], "error: give at most one of --eval-task and --eval-data"),
    (["--eval-task", "arithmetic:digit=2"], "error: --eval-task arithmetic:digit=2: task 'arithmetic': unknown option"),
    (["--eval-data", "COLUMNS"], "error: --eval-data: the held-out records' columns ['prompt', 'solution'] differ"),
    (["--eval-task", "arithmetic", "--eval-samples", "0"], "Invalid value for '--eval-samples'"),
    (["--eval-task", "arithmetic", "--eval-every", "-1"], "Invalid value for '--eval-every'"),
])
def test_bad_evaluation_input_is_one_line_before_any_step(extra, words, tmp_path):
    missing = tmp_path / "missing.jsonl"
    columns = tmp_path / "columns.jsonl"
    columns.write_text(json.dumps({"prompt": "1+1=", "solution": "2"}) + "\n")
    extra = [str(missing) if a == "MISSING" else str(columns) if a == "COLUMNS" else a for a in extra]
    words = words.replace("MISSING", str(missing))
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["grpo", "--steps", "1", "--device", "cpu", "--out", str(out), *extra])
    assert result.exit_code != 0 and words in result.output, result.output
    assert clean_exit(result) and "step 1 |" not in result.output
    assert sum(line.startswith(("error:", "Error:")) for line in result.output.splitlines()) == 1
