"""Built-in rewards for math answers (GSM8K-style data), usable as `--reward` specs:

    rlportable grpo --model DIR --data gsm8k.jsonl --reward rlportable.train.math_rewards:math_answer
                    [--reward rlportable.train.math_rewards:boxed_format --reward-weight 1 --reward-weight 0.1]

math_answer: 1.0 where the completion's final answer equals the record's `answer` column exactly, else
0.0. The completion's final answer is the content of its last `\\boxed{...}` if it has one, else its last
number; the record's answer is the text after GSM8K's `####` marker if it has one, else the whole
column. Both are read as exact rationals: integers (thousands commas allowed), decimals, fractions
(`3/4`, `\\frac{3}{4}`), a leading sign, a trailing `%` or `$` stripped. Anything else, on either side,
scores 0 (a record whose answer cannot be read never rewards a guess).
boxed_format: 1.0 where the completion puts an answer in `\\boxed{...}`, else 0.0 (a format reward).
Both take completions as strings or as TRL's conversational messages (chat records, train/rewards.py).
The answer column may be another, named with `--answer-column` (`solution`, say).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from rlportable.errors import InputError

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces nested inside it kept), None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    begin = i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin:i - 1] if depth == 0 else None


def parse_number(text: str) -> Fraction | None:
    """An exact rational from an answer's text, None if it is not one number."""
    text = _FRAC.sub(r"(\1)/(\2)", text.strip())
    text = text.replace("\\!", "").replace("\\,", "").replace("$", "").replace("%", "").replace("(", "").replace(")", "")
    text = text.strip().rstrip(".")
    match = _NUMBER.fullmatch(text)
    if match is None:
        return None
    value = text.replace(",", "").replace(" ", "")
    try:
        if "/" in value:
            numerator, denominator = value.split("/")
            return Fraction(Fraction(numerator), Fraction(denominator)) if Fraction(denominator) else None
        return Fraction(value)
    except (ValueError, ZeroDivisionError):
        return None


def final_answer(completion: str) -> Fraction | None:
    """The completion's answer: its last \\boxed{...}, else its last number."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return parse_number(boxed)
    numbers = _NUMBER.findall(completion)
    return parse_number(numbers[-1]) if numbers else None


def reference_answer(answer: Any) -> Fraction | None:
    """The record's answer: the text after GSM8K's '####' marker, else the whole value."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, (int, float)):
        return Fraction(answer) if answer == answer and abs(answer) != float("inf") else None
    if not isinstance(answer, str):
        return None
    return parse_number(answer.rsplit("####", 1)[-1])


def completion_text(completion: Any) -> str:
    """A completion's text: a string, or TRL's conversational [{"role": "assistant", "content": text}]
    (the last message's content); "" for anything else (which scores 0)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        return content if isinstance(content, str) else ""
    return ""


def math_answer(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float]:
    """1.0 per completion whose final answer equals its record's answer, exactly, else 0.0."""
    if answer is None:
        raise InputError("math_answer needs an 'answer' column in the dataset (GSM8K's 'answer', '#### 42' or 42); "
                         "name another column with --answer-column")
    if len(answer) != len(completions):
        raise InputError(f"math_answer: {len(completions)} completions for {len(answer)} answers")
    scores = []
    for completion, expected in zip(completions, answer):
        want, got = reference_answer(expected), final_answer(completion_text(completion))
        scores.append(1.0 if want is not None and got is not None and got == want else 0.0)
    return scores


def boxed_format(completions: list[Any], **_: Any) -> list[float]:
    """1.0 per completion that puts its answer in \\boxed{...}, else 0.0."""
    return [1.0 if last_boxed(completion_text(completion)) is not None else 0.0 for completion in completions]
