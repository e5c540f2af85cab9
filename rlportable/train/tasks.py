"""Built-in tasks with generated data (no download), and dataset files of the user's own prompts.

A task makes a dataset deterministically from a seed (NumPy's PCG64 generator)
and scores completions with an exact-answer reward, called like a TRL reward
function: ``task.reward(prompts, completions, **columns)`` where each dataset
column other than "prompt" arrives as a list, one value per completion.

- ``arithmetic``: prompts like ``"23+58="`` (+, - with a non-negative result,
  *), column "answer" (the exact result as a string). Reward 1.0 when the
  completion, after leading whitespace, starts with that integer as a whole
  run of digits ("81", "81\\n...", "81<|endoftext|>"; not "812", not " = 81").
- ``countdown``: prompts like ``"Use 3, 7, 25 to make 46: "``, columns
  "numbers" (list of int), "target" (int) and "solution" (one expression that
  reaches the target, using every number once). Reward 1.0 when the
  completion's expression (its first line, cut at "=" or "<|") is built from
  non-negative integer literals, + - * / and parentheses only, uses each given
  number at most once (a number given twice may be used twice), and evaluates
  exactly, in fractions, to the target. Division by zero, unknown characters,
  unary minus, powers and anything else score 0.0. The expression is parsed
  with ``ast`` and evaluated by walking the tree; nothing is ever eval()'d.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlportable.errors import InputError
from rlportable.train.datafiles import load_prompt_records


@runtime_checkable
class Task(Protocol):
    """What a built-in task offers: a name, generated data and an exact reward."""

    name: str

    def dataset(self, seed: int, size: int) -> list[dict[str, Any]]:
        """``size`` records, each with a "prompt" string and the task's answer columns; same seed, same list."""
        ...

    def reward(self, prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        """One reward per completion (TRL reward-function keywords; extra keywords are ignored)."""
        ...


def _check_size(seed: int, size: int) -> None:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise InputError(f"dataset seed must be a non-negative integer, got {seed!r}")
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
        raise InputError(f"dataset size must be a non-negative integer, got {size!r}")


def _check_lengths(name: str, completions: list, **columns: Any) -> None:
    for key, values in columns.items():
        if len(values) != len(completions):
            raise InputError(
                f"{name} reward: column {key!r} has {len(values)} values for {len(completions)} completions"
            )


# ---------------------------------------------------------------- arithmetic

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def parse_leading_int(completion: str) -> int | None:
    """The integer a completion starts with (after whitespace), as a whole run of digits; None if none."""
    match = _LEADING_INT.match(completion)
    return int(match.group(1)) if match else None


class ArithmeticTask:
    """Multi-digit ``a OP b=`` problems; ``digits`` is the most digits of each operand."""

    name = "arithmetic"

    def __init__(self, digits: int = 2, ops: str = "+-*"):
        if not isinstance(digits, int) or isinstance(digits, bool) or not 1 <= digits <= 18:
            raise InputError(f"arithmetic: digits must be an integer from 1 to 18, got {digits!r}")
        if not ops or any(op not in "+-*" for op in ops) or len(set(ops)) != len(ops):
            raise InputError(f"arithmetic: ops must be distinct characters from '+-*', got {ops!r}")
        self.digits = digits
        self.ops = ops

    def dataset(self, seed: int, size: int) -> list[dict[str, Any]]:
        _check_size(seed, size)
        rng = np.random.default_rng(seed)
        high = 10**self.digits
        records = []
        for _ in range(size):
            op = self.ops[int(rng.integers(len(self.ops)))]
            a, b = int(rng.integers(high)), int(rng.integers(high))
            if op == "-" and a < b:
                a, b = b, a
            value = a + b if op == "+" else a - b if op == "-" else a * b
            records.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
        return records

    def reward(self, prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        _check_lengths(self.name, completions, answer=answer)
        out = []
        for completion, expected in zip(completions, answer):
            got = parse_leading_int(completion) if isinstance(completion, str) else None
            out.append(1.0 if got is not None and got == int(expected) else 0.0)
        return out


# ---------------------------------------------------------------- countdown

_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() \t]*")
MAX_EXPRESSION_CHARS = 256


class _Invalid(Exception):
    pass


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise _Invalid("division by zero")
            return left / right
    raise _Invalid(f"not allowed: {type(node).__name__}")


def countdown_expression(completion: str) -> str:
    """The part of a completion that is scored: its first line, cut at '=' or '<|', stripped."""
    text = completion.split("\n", 1)[0]
    for stop in ("=", "<|"):
        text = text.split(stop, 1)[0]
    return text.strip()


def evaluate_countdown(expression: str, numbers: list[int]) -> Fraction | None:
    """The exact value of ``expression`` if it is valid for ``numbers`` (each used at most once), else None."""
    if not expression or len(expression) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError):
        return None
    used: list[int] = []
    try:
        value = _evaluate(tree, used)
    except _Invalid:
        return None
    if Counter(used) - Counter(int(n) for n in numbers):
        return None
    return value


class CountdownTask:
    """Reach a target from ``count`` numbers in 1..``max_number`` with + - * / (each number at most once)."""

    name = "countdown"

    def __init__(self, count: int = 3, max_number: int = 20):
        if not isinstance(count, int) or isinstance(count, bool) or not 2 <= count <= 8:
            raise InputError(f"countdown: count must be an integer from 2 to 8, got {count!r}")
        if not isinstance(max_number, int) or isinstance(max_number, bool) or not 1 <= max_number <= 10**6:
            raise InputError(f"countdown: max_number must be an integer from 1 to 1000000, got {max_number!r}")
        self.count = count
        self.max_number = max_number

    def dataset(self, seed: int, size: int) -> list[dict[str, Any]]:
        _check_size(seed, size)
        rng = np.random.default_rng(seed)
        records = []
        for _ in range(size):
            numbers = [int(n) for n in rng.integers(1, self.max_number + 1, size=self.count)]
            order = [numbers[int(i)] for i in rng.permutation(self.count)]
            value, expression = order[0], str(order[0])
            for x in order[1:]:
                op = "+-*"[int(rng.integers(3))]
                if op == "-" and value - x <= 0:
                    op = "+"
                if op == "*":
                    expression = f"({expression})*{x}" if any(c in expression for c in "+-") else f"{expression}*{x}"
                    value *= x
                else:
                    expression = f"{expression}{op}{x}"
                    value = value + x if op == "+" else value - x
            numbers_text = ", ".join(str(n) for n in numbers)
            records.append({
                "prompt": f"Use {numbers_text} to make {value}: ",
                "numbers": numbers,
                "target": value,
                "solution": expression,
            })
        return records

    def reward(
        self, prompts: list[str], completions: list[str], numbers: list[list[int]], target: list[int], **_: Any
    ) -> list[float]:
        _check_lengths(self.name, completions, numbers=numbers, target=target)
        out = []
        for completion, nums, goal in zip(completions, numbers, target):
            value = evaluate_countdown(countdown_expression(completion), nums) if isinstance(completion, str) else None
            out.append(1.0 if value is not None and value == goal else 0.0)
        return out


# ---------------------------------------------------------------- registry

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "countdown": CountdownTask}


def get_task(name: str, **options: Any) -> Task:
    """The built-in task called ``name``, built with ``options`` (e.g. ``digits=3``)."""
    cls = TASKS.get(name)
    if cls is None:
        raise InputError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    valid = [p for p in inspect.signature(cls).parameters if p != "self"]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise InputError(f"task {name!r}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                         f"its options: {', '.join(valid) or 'none'}")
    try:
        return cls(**options)
    except TypeError as exc:
        raise InputError(f"task {name!r}: {exc}") from None


def parse_task_spec(spec: str) -> Task:
    """A task from "name" or "name:key=value,key=value" (integers where the value is all digits),
    e.g. "arithmetic:digits=1,ops=+"."""
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InputError(f"task {spec!r}: options must be key=value, got {item!r}")
        options[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return get_task(name.strip(), **options)


# ---------------------------------------------------------------- dataset files


def load_jsonl_dataset(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSONL (or Parquet) file, each with a "prompt" (a string, or chat messages); every
    record with the same columns as the first (train/datafiles.py). Errors name ``file:line``."""
    return load_prompt_records(path)
