"""Dataset files for sft and grpo: Parquet read as JSONL is, chat records through the model's chat
template, the prompt and answer columns named by flags; each bad input one line naming the file, row,
column or flag."""

import json
import sys

import pytest
import tokenizers
from click.testing import CliRunner

from rlportable.cli import main
from rlportable.errors import InputError
from rlportable.model.tiny import EOS_TOKEN, tiny_tokenizer_json
from rlportable.model.tokenizer import Tokenizer
from rlportable.runtime import get_backend
from rlportable.train import datafiles, prepare
from rlportable.train.grpo import GRPOConfig, check_prompt_lengths, engine_prompt, truncated_prompt
from rlportable.train.math_rewards import boxed_format, math_answer
from rlportable.train.rewards import batch_from_records
from rlportable.train.sft import load_sft_records

CPU = get_backend("cpu")
MATH = "rlportable.train.math_rewards:math_answer"
TIMING = ("rollout_s", "train_s", "step_s", "rollout_tokens_per_s", "tokens_per_s")

RECORDS = [
    {"prompt": "2+3=", "answer": "5", "numbers": [2, 3], "weight": 0.5, "note": None},
    {"prompt": "4+4=", "answer": "8", "numbers": [4, 4], "weight": 1.5, "note": "x"},
    {"prompt": "1+7=", "answer": "8", "numbers": [1, 7], "weight": 2.0, "note": None},
    {"prompt": "6+2=", "answer": "8", "numbers": [6, 2], "weight": 0.0, "note": "y"},
]
CHAT = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": r["prompt"]}],
         "answer": r["answer"]} for r in RECORDS]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path, records):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def _options(data, **kw):
    return prepare.RunOptions(model="tiny-sft", out=None, resume=False, save_every=1, log_jsonl=None, plot=None,
                             task=None, data=str(data), **kw)


def _grpo(data, **kw):
    config = GRPOConfig(steps=2, prompts_per_step=2, num_generations=3, max_completion_length=4,
                        learning_rate=3e-3, seed=5)
    records = prepare.run_grpo(CPU, _options(data, **kw), config, [(MATH, 1.0)], lambda r: None)
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in records]


# ---------------------------------------------------------------- Parquet


def test_a_parquet_file_reads_as_the_same_jsonl_file_does(tmp_path):
    jsonl, parquet = _jsonl(tmp_path / "d.jsonl", RECORDS), _parquet(tmp_path / "d.parquet", RECORDS)
    assert datafiles.load_prompt_records(parquet) == datafiles.load_prompt_records(jsonl) == RECORDS
    # SFT's records too, chat messages (a list of structs in Parquet) included
    pairs = [{"prompt": r["prompt"], "completion": r["answer"]} for r in RECORDS]
    talks = [{"messages": r["messages"] + [{"role": "assistant", "content": r["answer"]}]} for r in CHAT]
    for name, records in (("pairs", pairs), ("talks", talks)):
        read = load_sft_records(_parquet(tmp_path / f"{name}.parquet", records))
        assert read == load_sft_records(_jsonl(tmp_path / f"{name}.jsonl", records)) == records
    chat = datafiles.load_prompt_records(_parquet(tmp_path / "c.parquet", CHAT))
    assert chat == datafiles.load_prompt_records(_jsonl(tmp_path / "c.jsonl", CHAT))
    assert chat[0]["prompt"] == CHAT[0]["messages"]


def test_grpo_on_parquet_is_the_run_on_jsonl(tmp_path):
    jsonl, parquet = _jsonl(tmp_path / "d.jsonl", RECORDS), _parquet(tmp_path / "d.parquet", RECORDS)
    assert _grpo(parquet) == _grpo(jsonl)


def test_a_parquet_file_is_known_by_its_magic_bytes_whatever_its_name(tmp_path):
    odd = _parquet(tmp_path / "records.dat", RECORDS)
    assert datafiles.is_parquet(odd) and not datafiles.is_parquet(_jsonl(tmp_path / "d.jsonl", RECORDS))
    assert datafiles.load_prompt_records(odd) == RECORDS


def test_bad_parquet_input_is_one_line_naming_file_and_row(tmp_path):
    broken = tmp_path / "broken.parquet"
    broken.write_text('{"prompt": "not parquet"}\n')
    with pytest.raises(InputError, match=r"broken\.parquet: not a readable Parquet file") as info:
        datafiles.load_prompt_records(broken)
    assert "\n" not in str(info.value)
    numbers = _parquet(tmp_path / "numbers.parquet", [{"prompt": "a"}, {"prompt": None}])
    with pytest.raises(InputError, match=r"numbers\.parquet row 1: the \"prompt\" column is a NoneType"):
        datafiles.load_prompt_records(numbers)
    with pytest.raises(InputError, match=r"absent\.parquet: no such file"):
        datafiles.load_prompt_records(tmp_path / "absent.parquet")


def test_without_pyarrow_a_parquet_file_names_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(InputError, match=r"d\.parquet: reading Parquet needs pyarrow: "
                                         r"pip install 'rlportable\[parquet\]'"):
        datafiles.load_prompt_records(path)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else real(name, *a))
    for command in ("sft", "grpo"):  # before any work
        reward = ["--reward", MATH] if command == "grpo" else []
        result = CliRunner().invoke(main, [command, "--device", "cpu", "--data", str(path)] + reward)
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines() == [
            f"error: --data {path}: reading Parquet needs pyarrow: pip install 'rlportable[parquet]'"]


# ---------------------------------------------------------------- chat records


def _templated_tokenizer(template):
    backend = tokenizers.Tokenizer.from_str(tiny_tokenizer_json())
    return Tokenizer(backend, eos_token=EOS_TOKEN, chat_template=template, source="test tokenizer")


def test_chat_messages_go_through_the_models_chat_template():
    tokenizer = _templated_tokenizer("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                                     "{% if add_generation_prompt %}[assistant] {% endif %}")
    messages = CHAT[0]["messages"]
    assert engine_prompt(tokenizer, messages) == "[system] Add.\n[user] 2+3=\n[assistant] "
    assert engine_prompt(tokenizer, "2+3=") == "2+3=" and engine_prompt(tokenizer, [1, 2]) == [1, 2]
    ids = tokenizer.encode("[system] Add.\n[user] 2+3=\n[assistant] ")
    assert truncated_prompt(tokenizer, messages, 4) == ids[-4:]
    config = GRPOConfig(max_completion_length=4)
    assert check_prompt_lengths(tokenizer, [{"prompt": messages}], config, 1000) == len(ids)


def test_grpo_on_chat_records_is_the_run_on_their_rendered_prompts(tmp_path):
    """The engine gets the template's text: a run on {"messages"} records is the run on {"prompt"}
    records holding what the tiny-sft model's template renders (math_answer reads both completions)."""
    from rlportable.model.load import load_model

    tokenizer = load_model("tiny-sft")[2]
    rendered = [{"prompt": tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True),
                 "answer": r["answer"]} for r in CHAT]
    assert rendered[0]["prompt"].endswith("<|im_start|>assistant\n")
    chat = _grpo(_jsonl(tmp_path / "chat.jsonl", CHAT))
    text = _grpo(_jsonl(tmp_path / "text.jsonl", rendered))
    assert chat == text and any(r["completion_length"] > 0 for r in chat)


def test_a_chat_record_without_a_chat_template_is_one_line_naming_the_record(tmp_path):
    tokenizer = _templated_tokenizer(None)
    with pytest.raises(InputError, match=r"dataset record 0: its prompt is chat messages, but the model's "
                                         r"tokenizer \(test tokenizer\) has no chat template"):
        check_prompt_lengths(tokenizer, [{"prompt": CHAT[0]["messages"]}], GRPOConfig(), 1000)


@pytest.mark.parametrize("messages, message", [
    ([], "must be a non-empty list"),
    ([{"role": "user"}], "must be a non-empty list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "5"}], "is the assistant's"),
])
def test_bad_chat_messages_are_one_line_naming_file_and_line(tmp_path, messages, message):
    path = _jsonl(tmp_path / "chat.jsonl", [CHAT[0], {"messages": messages, "answer": "1"}])
    with pytest.raises(InputError, match=rf"chat\.jsonl:2: .*{message}"):
        datafiles.load_prompt_records(path)


def test_a_file_mixing_text_and_chat_prompts_is_refused_naming_the_line(tmp_path):
    """The reward functions get one completion format for a run (strings, or TRL's message lists), so a
    file's prompts are all texts or all chat messages."""
    path = _jsonl(tmp_path / "mixed.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": CHAT[0]["messages"], "answer": "2"}])
    with pytest.raises(InputError, match=r"mixed\.jsonl:2: .*chat messages where the first record's is a text"):
        datafiles.load_prompt_records(path)


def test_chat_completions_reach_rewards_as_trl_passes_them():
    records = [{"prompt": CHAT[0]["messages"], "answer": "5"}] * 2
    batch = batch_from_records(records, ["\\boxed{5}", "4"])
    assert batch["prompts"] == [CHAT[0]["messages"]] * 2
    assert batch["completions"] == [[{"role": "assistant", "content": "\\boxed{5}"}],
                                    [{"role": "assistant", "content": "4"}]]
    assert math_answer(**batch) == [1.0, 0.0] and boxed_format(**batch) == [1.0, 0.0]


# ---------------------------------------------------------------- column flags


def test_the_prompt_and_answer_columns_can_be_named(tmp_path):
    qa = [{"question": r["prompt"], "solution": r["answer"]} for r in RECORDS]
    loaded = datafiles.load_prompt_records(_jsonl(tmp_path / "qa.jsonl", qa), "question", "solution")
    assert loaded[0] == {"question": "2+3=", "solution": "5", "prompt": "2+3=", "answer": "5"}
    plain = [{"prompt": r["prompt"], "answer": r["answer"]} for r in RECORDS]
    # the same prompts and answers, the same run (the renamed columns also reach the rewards by their names)
    named = _grpo(tmp_path / "qa.jsonl", prompt_column="question", answer_column="solution")
    assert named == _grpo(_jsonl(tmp_path / "plain.jsonl", plain))


def test_column_flags_on_the_command_line(tmp_path):
    qa = _jsonl(tmp_path / "qa.jsonl", [{"problem": r["prompt"], "solution": r["answer"]} for r in RECORDS])
    base = ["grpo", "--device", "cpu", "--steps", "1", "--prompts-per-step", "2", "-G", "2",
            "--max-completion-length", "2", "--data", str(qa), "--reward", MATH]
    result = CliRunner().invoke(main, base + ["--prompt-column", "problem", "--answer-column", "solution",
                                              "--print-config"])
    assert 'prompt-column = "problem"' in result.output and 'answer-column = "solution"' in result.output
    result = CliRunner().invoke(main, base + ["--prompt-column", "problem", "--answer-column", "solution"])
    assert result.exit_code == 0, result.output
    assert "step 1 | reward_mean" in result.output
    # each bad input: one line naming the flag or the file's line, before the first step
    for extra, line in (
            ([], f"error: {qa}:1: the \"prompt\" column is missing (nor is there a \"messages\" column); name the "
                 "prompts' column with --prompt-column (its columns: problem, solution)"),
            (["--prompt-column", "question"], f"error: --prompt-column question: {qa}:1 has no 'question' column "
                                              "(its columns: problem, solution)"),
            (["--prompt-column", "problem", "--answer-column", "answer"],
             f"error: --answer-column answer: {qa}:1 has no 'answer' column (its columns: problem, solution)")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 1 and result.output.strip().splitlines() == [line], result.output
    result = CliRunner().invoke(main, ["grpo", "--device", "cpu", "--steps", "1", "--prompt-column", "problem"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "error: --prompt-column names a column of --data; a built-in task's records have \"prompt\" and its own "
        "answer columns"], result.output


def test_a_named_column_that_would_hide_another_is_refused(tmp_path):
    both = _jsonl(tmp_path / "both.jsonl", [{"prompt": "a", "question": "b", "answer": "1", "solution": "2"}])
    with pytest.raises(InputError, match=r"--prompt-column question: .*both\.jsonl:1 has a \"prompt\" column too"):
        datafiles.load_prompt_records(both, "question")
    with pytest.raises(InputError, match=r"--answer-column solution: .*both\.jsonl:1 has an \"answer\" column too"):
        datafiles.load_prompt_records(both, None, "solution")
