"""The built-in math answer reward (train/math_rewards.py): what it reads as the answer, on both sides."""

from fractions import Fraction

import pytest

from rlportable.errors import InputError
from rlportable.train.math_rewards import boxed_format, final_answer, last_boxed, math_answer, parse_number, reference_answer
from rlportable.train.rewards import RewardSet, load_reward_function


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("-7", Fraction(-7)), ("1,234", Fraction(1234)), ("3.50", Fraction(7, 2)),
    ("3/4", Fraction(3, 4)), ("\\frac{3}{4}", Fraction(3, 4)), ("\\dfrac{10}{4}", Fraction(5, 2)), ("$18", Fraction(18)),
    ("50%", Fraction(50)), (" 12. ", Fraction(12)), (".5", Fraction(1, 2)),
    ("x = 4", None), ("4 apples", None), ("1/0", None), ("", None), ("1,23", None),
])
def test_parse_number_is_exact_or_nothing(text, value):
    assert parse_number(text) == value


def test_the_final_answer_is_the_last_box_else_the_last_number():
    assert last_boxed("so \\boxed{\\frac{1}{2}} and later \\boxed{7}") == "7"
    assert last_boxed("\\boxed{\\frac{3}{4}}") == "\\frac{3}{4}"
    assert last_boxed("\\boxed{unclosed") is None
    assert final_answer("3 + 4 = 7, then \\boxed{12}; 99 was a guess") == 12
    assert final_answer("Natalia sold 48 + 24 = 72 clips.") == 72
    assert final_answer("no numbers here") is None


def test_reference_answers_read_gsm8k_markers_and_numbers():
    assert reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 72
    assert reference_answer("1,080") == 1080
    assert reference_answer(5) == 5 and reference_answer(2.5) == Fraction(5, 2)
    assert reference_answer(True) is None and reference_answer(None) is None and reference_answer("seven") is None


def test_math_answer_scores_exact_equality():
    completions = ["The answer is 72.", "\\boxed{72.0}", "\\boxed{71}", "I think 72 or 73", "nothing"]
    assert math_answer(completions=completions, answer=["#### 72"] * 5, prompts=[""] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert math_answer(completions=["\\boxed{3/4}"], answer=["0.75"]) == [1.0]
    assert math_answer(completions=["\\boxed{1}"], answer=["one"]) == [0.0]  # an unreadable answer rewards nothing
    assert boxed_format(completions=completions) == [0.0, 1.0, 1.0, 0.0, 0.0]
    with pytest.raises(InputError, match="needs an 'answer' column"):
        math_answer(completions=["1"])


def test_math_answer_loads_as_a_reward_spec():
    fn = load_reward_function("rlportable.train.math_rewards:math_answer")
    total, columns = RewardSet([(fn, 1.0), (load_reward_function("rlportable.train.math_rewards:boxed_format"), 0.1)]).score(
        {"prompts": ["q", "q"], "completions": ["\\boxed{4}", "4"], "completion_ids": [[1], [2]], "answer": ["4", "4"]})
    assert list(total) == [1.1, 1.0]
