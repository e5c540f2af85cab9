"""Built-in tasks, JSONL datasets and reward functions (rlportable.train.tasks / rewards)."""

from __future__ import annotations

import json
import math
import textwrap

import numpy as np
import pytest

from rlportable.errors import InputError
from rlportable.train.rewards import RewardSet, batch_from_records, load_reward_function
from rlportable.train.tasks import (
    ArithmeticTask,
    CountdownTask,
    Task,
    countdown_expression,
    evaluate_countdown,
    get_task,
    load_jsonl_dataset,
)

# ---------------------------------------------------------------- tasks


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_datasets_are_deterministic(name):
    task = get_task(name)
    assert isinstance(task, Task) and task.name == name
    a, b = task.dataset(seed=7, size=50), task.dataset(seed=7, size=50)
    assert a == b and len(a) == 50
    assert task.dataset(seed=8, size=50) != a
    assert task.dataset(seed=7, size=10) == a[:10]
    assert all(isinstance(r["prompt"], str) and r["prompt"] for r in a)
    json.dumps(a)  # plain Python values only


def test_arithmetic_answers_are_exact():
    task = ArithmeticTask(digits=3)
    records = task.dataset(seed=0, size=200)
    ops = set()
    for r in records:
        a, op, b = next((p[:i], p[i], p[i + 1 : -1]) for p in [r["prompt"]] for i in range(1, len(p)) if p[i] in "+-*")
        ops.add(op)
        assert len(a) <= 3 and len(b) <= 3 and r["prompt"].endswith("=")
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert r["answer"] == str(value) and value >= 0
    assert ops == {"+", "-", "*"}
    # the gold answer scores 1 on every record
    rewards = task.reward([r["prompt"] for r in records], [r["answer"] for r in records], answer=[r["answer"] for r in records])
    assert rewards == [1.0] * len(records)


def test_arithmetic_reward_on_known_completions():
    task = get_task("arithmetic", digits=2)
    completions = ["81", " 81\nsome more", "81<|endoftext|>", "80", "812", "= 81", "", "abc", "-81"]
    rewards = task.reward(["23+58="] * len(completions), completions, answer=["81"] * len(completions))
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert task.reward(["1-5="], ["-4"], answer=["-4"]) == [1.0]


def test_countdown_dataset_solutions_reach_target():
    task = CountdownTask(count=4, max_number=25)
    records = task.dataset(seed=3, size=100)
    for r in records:
        assert len(r["numbers"]) == 4 and all(1 <= n <= 25 for n in r["numbers"])
        assert r["target"] >= 1
        assert evaluate_countdown(r["solution"], r["numbers"]) == r["target"]
        assert str(r["target"]) in r["prompt"]
    rewards = task.reward(
        [r["prompt"] for r in records],
        [r["solution"] for r in records],
        numbers=[r["numbers"] for r in records],
        target=[r["target"] for r in records],
        completion_ids=[[0]] * len(records),
    )
    assert rewards == [1.0] * len(records)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3*7+25", 1.0),  # right
        ("(25+3*7)", 1.0),
        ("3*7+25 = 46\nbecause...", 1.0),
        ("25+21", 0.0),  # 21 not given
        ("3*7+25<|endoftext|>", 1.0),
        ("25*2-4", 0.0),
        ("25+7+3", 0.0),  # wrong value
        ("25+25-4", 0.0),  # 25 used twice, 4 not given
        ("7*7-3", 0.0),  # 7 used twice
        ("25/(7-7)+3", 0.0),  # division by zero
        ("(7*25+3*7*... )", 0.0),
        ("hello", 0.0),  # garbage
        ("", 0.0),
        ("__import__('os')", 0.0),
        ("3**7", 0.0),  # power not allowed
        ("-3+7*7", 0.0),  # unary minus not allowed
        ("0x19+21", 0.0),  # not a decimal literal
        ("3.0*7+25", 0.0),  # floats not allowed
    ],
)
def test_countdown_reward_on_known_completions(completion, expected):
    task = get_task("countdown")
    reward = task.reward(["Use 3, 7, 25 to make 46: "], [completion], numbers=[[3, 7, 25]], target=[46])
    assert reward == [expected]


def test_countdown_exact_division_and_duplicates():
    assert evaluate_countdown("(7+5)/3*2", [2, 3, 5, 7]) == 8
    assert evaluate_countdown("7/2", [2, 7]) * 2 == 7  # exact fraction, no float rounding
    task = get_task("countdown")
    assert task.reward(["p"], ["7/2*4"], numbers=[[2, 4, 7]], target=[14]) == [1.0]
    assert task.reward(["p"], ["7/2"], numbers=[[2, 7]], target=[3]) == [0.0]  # 3.5, no flooring
    assert task.reward(["p"], ["5+5"], numbers=[[5, 5, 1]], target=[10]) == [1.0]  # given twice, usable twice
    assert task.reward(["p"], ["5+5+5"], numbers=[[5, 5, 1]], target=[15]) == [0.0]
    assert countdown_expression(" 1+2 = 3\n4") == "1+2"
    assert evaluate_countdown("1+" * 200 + "1", [1]) is None  # too long / reuse


def test_get_task_errors():
    with pytest.raises(InputError, match=r"unknown task 'nope'; known tasks: arithmetic, countdown"):
        get_task("nope")
    with pytest.raises(InputError, match="digits"):
        get_task("arithmetic", digits=0)
    with pytest.raises(InputError, match="task 'countdown'"):
        get_task("countdown", colour="red")


# ---------------------------------------------------------------- JSONL


def test_load_jsonl_dataset(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"prompt": "3+3=", "answer": "6"}\n')
    assert load_jsonl_dataset(path) == [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\n{"prompt": "b",}\n', r"data\.jsonl:2: invalid JSON"),
        ('{"prompt": "a"}\n[1, 2]\n', r"data\.jsonl:2: expected a JSON object"),
        ('{"answer": "4"}\n', r"data\.jsonl:1: the \"prompt\" column is missing"),
        ('{"prompt": 4}\n', r"data\.jsonl:1: the \"prompt\" column is a int, not a string"),
        ('{"prompt": "a", "x": 1}\n{"prompt": "b"}\n', r"data\.jsonl:2: columns \['prompt'\] differ"),
        ("\n\n", r"data\.jsonl: no records"),
    ],
)
def test_load_jsonl_dataset_errors(tmp_path, text, message):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    with pytest.raises(InputError, match=message) as info:
        load_jsonl_dataset(path)
    assert "\n" not in str(info.value)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_jsonl_dataset(tmp_path / "absent.jsonl")


# ---------------------------------------------------------------- reward functions

REWARD_MODULE = textwrap.dedent(
    """
    SEEN = []

    def length_reward(prompts, completions, completion_ids=None, **kwargs):
        SEEN.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))
        return [float(len(c)) for c in completions]

    def maybe(completions, answer, **kwargs):
        return [None if a == "skip" else (1.0 if c == a else 0.0) for c, a in zip(completions, answer)]

    def short(completions, **kwargs):
        return [1.0]

    def strings(completions, **kwargs):
        return ["x" for _ in completions]

    def boom(completions, **kwargs):
        raise ValueError("bad\\nthing")

    NOT_CALLABLE = 3
    """
)


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARD_MODULE)
    return path


def test_load_reward_from_file_and_module(reward_file, tmp_path, monkeypatch):
    fn = load_reward_function(f"{reward_file}:length_reward")
    assert fn(prompts=["p"], completions=["abc"]) == [3.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    fn2 = load_reward_function("my_rewards:length_reward")
    assert fn2(prompts=["p"], completions=["ab"]) == [2.0]
    assert load_reward_function("math:sqrt") is math.sqrt


def test_reward_set_passes_trl_keywords(reward_file):
    records = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    batch = batch_from_records(records, ["4", "66"], completion_ids=[[1], [2, 2]])
    rs = RewardSet([(f"{reward_file}:length_reward", 1.0)])
    total, columns = rs.score(batch)
    assert total.tolist() == [1.0, 2.0] and list(columns) == [f"{reward_file}:length_reward"]
    module = __import__("sys").modules[rs.functions[0].__module__]
    seen = module.SEEN[-1]
    assert seen == {"prompts": ["2+2=", "3+3="], "completions": ["4", "66"], "completion_ids": [[1], [2, 2]], "answer": ["4", "6"]}


def test_reward_set_weights_and_none(reward_file):
    batch = {"prompts": ["a", "b", "c"], "completions": ["4", "5", "xy"], "answer": ["4", "6", "skip"]}
    rs = RewardSet([(f"{reward_file}:maybe", 2.0), (f"{reward_file}:length_reward", -0.5)])
    total, columns = rs.score(batch)
    maybe, length = columns.values()
    assert maybe[:2].tolist() == [1.0, 0.0] and math.isnan(maybe[2])
    assert length.tolist() == [1.0, 1.0, 2.0]
    assert total.tolist() == [2.0 - 0.5, 0.0 - 0.5, -1.0]  # None skipped in the sum
    # every function None for a sample: total 0.0, as TRL's nansum
    total, _ = RewardSet([(f"{reward_file}:maybe", 1.0)]).score(batch)
    assert total.tolist() == [1.0, 0.0, 0.0]


def test_reward_set_with_tasks_and_callables():
    task = get_task("arithmetic")

    def bonus(completions, **kwargs):
        return np.array([0.5] * len(completions))

    rs = RewardSet([(task, 1.0), (bonus, 1.0), (bonus, 2.0)])
    assert rs.names == ["arithmetic", "bonus", "bonus_2"]
    batch = batch_from_records([{"prompt": "1+1=", "answer": "2"}] * 2, ["2", "3"])
    total, columns = rs.score(batch)
    assert total.tolist() == [2.5, 1.5]
    assert columns["arithmetic"].tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_such_module_xyz:f", r"reward function 'no_such_module_xyz:f': no module named 'no_such_module_xyz'"),
        ("math:no_such_fn", r"reward function 'math:no_such_fn': 'math' has no attribute 'no_such_fn'"),
        ("math:pi", r"reward function 'math:pi': 'pi' is a float, not callable"),
        ("just_a_name", r"reward function 'just_a_name': expected 'module:function'"),
        ("missing/file.py:f", r"reward function 'missing/file.py:f': no such file"),
    ],
)
def test_bad_reward_specs(spec, message):
    with pytest.raises(InputError, match=message) as info:
        load_reward_function(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "fn, message",
    [
        ("short", r"returned 1 values for 2 completions"),
        ("strings", r"returned a str for sample 0, not a number"),
        ("boom", r"raised ValueError: bad thing"),
        ("NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not callable"),
    ],
)
def test_bad_reward_results_name_the_spec(reward_file, fn, message):
    spec = f"{reward_file}:{fn}"
    with pytest.raises(InputError, match=message) as info:
        RewardSet([(spec, 1.0)]).score({"prompts": ["a", "b"], "completions": ["x", "y"]})
    assert spec in str(info.value) and "\n" not in str(info.value)


def test_reward_file_with_import_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(InputError, match=r"loading .*broken\.py' failed: ModuleNotFoundError"):
        load_reward_function(f"{path}:f")


def test_reward_set_errors():
    with pytest.raises(InputError, match="weight must be a finite number"):
        RewardSet([(lambda completions, **k: [0.0], math.inf)])
    with pytest.raises(InputError, match="at least one"):
        RewardSet([])
    rs = RewardSet([(lambda completions, **k: [0.0] * len(completions), 1.0)])
    with pytest.raises(InputError, match=r"column 'answer' has 1 values for 2 completions"):
        rs.score({"prompts": ["a", "b"], "completions": ["x", "y"], "answer": ["1"]})
    with pytest.raises(InputError, match="missing 'completions'"):
        rs.score({"prompts": ["a"]})
    inf = RewardSet([(lambda completions, **k: [math.inf], 1.0)])
    with pytest.raises(InputError, match="returned inf"):
        inf.score({"prompts": ["a"], "completions": ["x"]})
