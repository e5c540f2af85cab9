import json

import pytest
from click.testing import CliRunner

from conftest import clean_exit
from rlportable.cli import main
from rlportable.runtime import probe


def test_conform_cpu_quick_passes_and_writes_json(tmp_path):
    out = tmp_path / "conform.json"
    result = CliRunner().invoke(main, ["conform", "--device", "cpu", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert set(payload) == {"device", "backend", "checks", "compared", "mismatches", "passed", "provenance"}
    assert set(payload["provenance"]) == {"commit", "date"}
    assert payload["passed"] and payload["mismatches"] == 0 and payload["compared"] > 1_000_000
    assert {c["name"] for c in payload["checks"]} >= {"gemm", "rowsum", "fixedpoint.encode_rows", "gemm.invariance"}


def test_unavailable_device_exits_2_with_a_clear_message():
    for device in ("cuda", "hip"):
        if probe(device)[0]:
            continue
        result = CliRunner().invoke(main, ["conform", "--device", device, "--quick"])
        assert result.exit_code == 2
        assert f"device '{device}' is unavailable" in result.output


def test_info_lists_every_backend():
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    for name in ("cuda", "hip", "cpu"):
        assert name in result.output


def test_auto_says_which_device_it_took():
    result = CliRunner().invoke(main, ["conform", "--device", "auto", "--quick", "--only", "rowsum"])
    assert "device auto -> " in result.output


def test_logp_prints_per_token_logprobs_as_json(tmp_path):
    data = tmp_path / "texts.jsonl"
    data.write_text('{"text": "12+34=46"}\n{"prompt": "7*6=", "completion": "42"}\n')
    result = CliRunner().invoke(main, ["logp", "--model", "tiny", "--device", "cpu", "--jsonl", str(data), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert len(payload["results"]) == 2
    first = payload["results"][0]
    assert first["logprobs"][0] is None and len(first["logprobs"]) == len(first["tokens"]) >= 2
    assert all(lp <= 0 for lp in first["logprobs"][1:])


def test_logp_bad_input_is_one_line():
    result = CliRunner().invoke(main, ["logp", "--model", "tiny", "--device", "cpu"])
    assert result.exit_code == 1 and "exactly one of --text or --jsonl" in result.output
    result = CliRunner().invoke(main, ["logp", "--model", "/no/such/dir", "--device", "cpu", "--text", "hi there"])
    assert result.exit_code == 1 and "/no/such/dir" in result.output and clean_exit(result)


def test_generate_json_gives_tokens_text_and_logprobs():
    result = CliRunner().invoke(main, ["generate", "--device", "cpu", "--prompt", "12+34=", "-n", "2",
                                       "--max-tokens", "5", "--ignore-eos", "--seed", "1", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    samples = payload["results"][0]["samples"]
    assert len(samples) == 2 and all(len(s["token_ids"]) == 5 == len(s["logprobs"]) for s in samples)


@pytest.mark.parametrize("args,flag", [
    (["sft", "--steps", "0"], "--steps"), (["grpo", "--steps", "-3"], "--steps"),
    (["sft", "--lr", "-1e-4"], "--lr"), (["grpo", "--lr", "nan"], "--lr"), (["sft", "--lr", "inf"], "--lr"),
    (["sft", "--max-grad-norm", "-1"], "--max-grad-norm"), (["grpo", "--save-every", "0"], "--save-every"),
    (["sft", "--save-every", "-1"], "--save-every"), (["sft", "--batch-size", "0"], "--batch-size"),
    (["grpo", "-G", "0"], "--num-generations"), (["grpo", "--beta", "-0.1"], "--beta"),
    (["sft", "--dp", "0"], "--dp"), (["generate", "--model", "tiny", "--prompt", "x", "--max-batch", "0"], "--max-batch"),
    (["sft", "--tp", "0"], "--tp"), (["generate", "--model", "tiny", "--prompt", "x", "--tp", "0"], "--tp"),
])
def test_numeric_options_are_checked_before_any_work(args, flag, tmp_path):
    """A zero, negative or non-finite value where the option cannot take it is one line naming the
    flag, exit status 2, and nothing written (the run never starts)."""
    out = tmp_path / "run"
    result = CliRunner().invoke(main, args + (["--out", str(out)] if args[0] != "generate" else []))
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{flag}'" in result.output or f"Invalid value for '-G' / '{flag}'" in result.output
    assert not out.exists()


RANK_COMMANDS = (("generate",), ("conform",), ("bench", "decode"), ("sft",), ("grpo",))


@pytest.mark.parametrize("path", RANK_COMMANDS)
def test_every_command_that_runs_ranks_has_the_same_tp_and_emulate(path):
    """--tp (an integer >= 1) and --emulate (the ranks as threads) are one declaration each, the same
    in every command; no other emulation flag is left."""
    command = main
    for name in path:
        command = command.commands[name]
    options = {opt: param for param in command.params for opt in param.opts}
    tp = options["--tp"]
    assert (tp.type.name, tp.type.min, tp.type.max, tp.default) == ("integer range", 1, None, 1)
    assert options["--emulate"].is_flag
    assert [opt for opt in options if "emulate" in opt] == ["--emulate"]


@pytest.mark.parametrize("args", [["generate", "--tp-emulate"], ["conform", "--tp-emulate"],
                                  ["sft", "--dp-emulate"], ["grpo", "--dp-emulate"]])
def test_the_old_emulation_flags_are_gone_and_the_error_names_the_new_one(args):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and f"No such option '{args[1]}'" in result.output
    assert "--emulate" in result.output


def test_zero_learning_rate_is_taken_not_replaced_by_the_default():
    """--lr 0 is a learning rate of 0 (the weights stay), not "not given"."""
    result = CliRunner().invoke(main, ["sft", "--steps", "1", "--lr", "0", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "lr 0 " in result.output.splitlines()[-1] + " "


def test_out_folder_is_never_overwritten_and_resume_needs_a_checkpoint(tmp_path):
    """A second run into an --out that holds checkpoints is refused (naming --resume and a new --out)
    with the first run's checkpoints and `latest` untouched; --resume on an empty --out is refused."""
    out = tmp_path / "run"
    args = ["sft", "--steps", "1", "--device", "cpu", "--out", str(out)]
    assert CliRunner().invoke(main, args).exit_code == 0
    latest = (out / "latest").read_text()
    files = sorted(p.name for p in out.rglob("*"))
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "already holds a run" in again.output and "--resume" in again.output
    assert (out / "latest").read_text() == latest and sorted(p.name for p in out.rglob("*")) == files
    empty = CliRunner().invoke(main, ["sft", "--steps", "1", "--device", "cpu", "--resume", "--out",
                                      str(tmp_path / "none")])
    assert empty.exit_code != 0 and "holds no checkpoint" in empty.output
    assert not (tmp_path / "none").exists()


def test_unwritable_paths_are_refused_before_the_first_step(tmp_path, monkeypatch):
    """--out, --log-jsonl and --plot that cannot be written, and --plot without matplotlib, are one
    line naming the flag before any step runs (not a traceback at the first save or after the run)."""
    import importlib.util

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = ["sft", "--steps", "1", "--device", "cpu"]
    for extra, words in ((["--out", str(blocker)], "--out"), (["--log-jsonl", str(blocker / "m.jsonl")], "--log-jsonl"),
                         (["--plot", str(tmp_path)], "--plot"), (["--out", str(blocker / "sub" / "run")], "--out")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code != 0 and words in result.output and "step 1" not in result.output, result.output
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    result = CliRunner().invoke(main, base + ["--plot", str(tmp_path / "curve.png")])
    assert result.exit_code != 0 and "--plot needs matplotlib" in result.output and "step 1" not in result.output


def test_a_reward_with_no_values_is_a_note_not_a_numpy_warning(tmp_path):
    """A reward function that returns NaN for every completion: the step says so in one line, and
    no numpy RuntimeWarning ("Mean of empty slice") leaks out."""
    import warnings

    (tmp_path / "nan_reward.py").write_text("def nothing(completions, **kw):\n"
                                            "    return [float('nan')] * len(completions)\n")
    args = ["grpo", "--steps", "1", "--device", "cpu", "--prompts-per-step", "2", "-G", "2",
            "--max-completion-length", "2", "--reward", f"{tmp_path / 'nan_reward.py'}:nothing"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "note: reward function" in result.output and "gave no value" in result.output
    assert "Mean of empty slice" not in result.output


@pytest.mark.parametrize("command", ["logp", "generate", "sft", "grpo"])
def test_non_utf8_jsonl_is_one_line_naming_file_and_line(tmp_path, command):
    """The same reader for every command's JSONL: invalid UTF-8 bytes and lone surrogates name the
    file and line, no UnicodeDecodeError or tokenizer TypeError."""
    field = {"logp": "text", "generate": "prompt"}.get(command, "prompt")
    flag = "--data" if command in ("sft", "grpo") else "--jsonl"
    extra = '"completion": "1", ' if command == "sft" else ""
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(b'{"' + field.encode() + b'": "ok", ' + extra.encode() + b'"answer": "1"}\n'
                    b'{"' + field.encode() + b'": "bad \xff byte", ' + extra.encode() + b'"answer": "1"}\n')
    escaped = tmp_path / "escaped.jsonl"
    escaped.write_text('{"' + field + '": "lone \\udcff surrogate", ' + extra + '"answer": "1"}\n')
    args = [command, "--device", "cpu"] + (["--steps", "1"] if command in ("sft", "grpo") else [])
    for path, line, problem in ((raw, 2, "byte 0xff"), (escaped, 1, "byte 0xff")):
        result = CliRunner().invoke(main, args + [flag, str(path)])
        assert result.exit_code == 1, result.output
        assert f"{path}:{line}" in result.output and "not valid UTF-8" in result.output and problem in result.output
        assert clean_exit(result) and "Error:" not in result.output.replace("error:", "")


@pytest.mark.parametrize("args", [["logp", "--text"], ["generate", "--prompt"]])
def test_non_utf8_text_arguments_are_one_line(args):
    """Undecodable bytes in an argument reach Python as lone surrogates: refused, naming the flag."""
    result = CliRunner().invoke(main, args + ["12+\udcff=", "--device", "cpu"])
    assert result.exit_code == 1 and f"{args[1]}: not valid UTF-8" in result.output, result.output
    assert clean_exit(result)


def test_logp_refuses_a_text_longer_than_the_model(tmp_path):
    from rlportable.model.load import load_model

    limit = load_model("tiny")[0].max_position_embeddings
    result = CliRunner().invoke(main, ["logp", "--device", "cpu", "--text", "1" * (limit + 10)])
    assert result.exit_code == 1, result.output
    assert f"more than the model's maximum length {limit}" in result.output and clean_exit(result)


def test_generate_takes_a_seed_per_jsonl_record(tmp_path):
    """A record's "seed" is that request's own: the same samples alone or after other prompts."""
    def samples(lines):
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        result = CliRunner().invoke(main, ["generate", "--device", "cpu", "--jsonl", str(path), "-n", "2",
                                           "--max-tokens", "4", "--ignore-eos", "--json"])
        assert result.exit_code == 0, result.output
        return [r["samples"] for r in json.loads(result.stdout)["results"]]

    seeded = {"prompt": "12+34=", "seed": 7}
    among = samples([{"prompt": "a"}, {"prompt": "bb"}, seeded])
    assert among[2] == samples([seeded])[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1", "seed": -4}\n')
    result = CliRunner().invoke(main, ["generate", "--device", "cpu", "--jsonl", str(bad)])
    assert result.exit_code == 1 and f"{bad}:1" in result.output and '"seed" must be an integer' in result.output


def test_training_ends_with_a_summary_saying_where_the_weights_went(tmp_path):
    result = CliRunner().invoke(main, ["sft", "--steps", "2", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "sft: 2 steps; loss" in result.output and "(mean of the last 1)" in result.output  # halves of 2
    assert "the trained weights are not kept (no --out)" in result.output
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["sft", "--steps", "2", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"weights: {out / 'step-000002'}" in result.output and "--resume" in result.output


def test_logp_table_keeps_a_pieces_leading_space_visible():
    result = CliRunner().invoke(main, ["logp", "--device", "cpu", "--text", "12 + 34"])
    assert result.exit_code == 0, result.output
    assert '" ' in result.output  # a piece starting with a space, quoted as in --json


@pytest.mark.parametrize("args, flag", [
    (["bench", "train", "--shapes", "64x"], "--shapes"),
    (["bench", "train", "--shapes", "1x320"], "--shapes"),
    (["bench", "train", "--shapes", "axb"], "--shapes"),
    (["bench", "attention", "--length", "0"], "--length"),
])
def test_bench_options_are_one_line_naming_the_flag(args, flag):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and flag in result.output and clean_exit(result)


@pytest.mark.parametrize("command", ["attention", "train"])
def test_gpu_benchmarks_name_the_backend_they_need(command):
    result = CliRunner().invoke(main, ["bench", command, "--device", "cpu"])
    assert result.exit_code != 0 and "cuda backend" in result.output and clean_exit(result)
