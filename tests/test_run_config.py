"""A run is a file: --config FILE (TOML, the command's option names; flags win), --print-config, and the
resolved options written to OUT/run_config.toml, which reruns or resumes the run."""

import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.cli import main


def _invoke(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_print_config_round_trips_and_flags_win(kind, tmp_path):
    printed = _invoke(kind, "--print-config", "--steps", "3", "--lr", "0.002")
    assert printed.exit_code == 0 and "steps = 3" in printed.output and "lr = 0.002" in printed.output
    path = tmp_path / "run.toml"
    path.write_text(printed.output)
    again = _invoke(kind, "--config", str(path), "--print-config")
    assert again.exit_code == 0 and again.output == printed.output
    override = _invoke(kind, "--config", str(path), "--print-config", "--steps", "5")
    assert "steps = 5" in override.output and "lr = 0.002" in override.output


@pytest.mark.parametrize("text, problem", [
    ("stepz = 3\n", "'stepz' is not an option of `rlportable grpo`"),
    ("out = \"x\"\n", "'out' is not an option of `rlportable grpo` that a config sets"),
    ("steps = \n", "not TOML"),
])
def test_a_bad_config_is_one_line_naming_the_file(text, problem, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = _invoke("grpo", "--config", str(path))
    assert result.exit_code == 2 and problem in result.output and str(path) in result.output
    assert clean_exit(result)


def test_a_run_writes_its_config_and_the_file_resumes_it(tmp_path):
    out = tmp_path / "run"
    first = _invoke("sft", "--steps", "2", "--batch-size", "4", "--lr", "0.001", "--save-every", "1", "--out", str(out),
                    "--device", "cpu")
    assert first.exit_code == 0, first.output
    saved = (out / "run_config.toml").read_text()
    assert "steps = 2" in saved and "batch-size = 4" in saved and "lr = 0.001" in saved and "out" not in saved
    (out / "latest").write_text("step-000001\n")  # stopped after step 1
    resumed = _invoke("sft", "--config", str(out / "run_config.toml"), "--out", str(out), "--resume", "--device", "cpu")
    assert resumed.exit_code == 0, resumed.output
    assert "resuming" in resumed.output and "sft: 2 steps" in resumed.output


def test_gspo_is_a_flag_and_a_config_key(tmp_path):
    """--importance-sampling-level (GRPOConfig's, TRL's name) reaches the config and its file."""
    printed = _invoke("grpo", "--print-config", "--importance-sampling-level", "sequence").output
    assert 'importance-sampling-level = "sequence"' in printed
    path = tmp_path / "run.toml"
    path.write_text(printed)
    assert 'importance-sampling-level = "sequence"' in _invoke("grpo", "--config", str(path), "--print-config").output
    result = CliRunner().invoke(main, ["grpo", "--importance-sampling-level", "tokens"])
    assert result.exit_code == 2 and "--importance-sampling-level" in result.output
