"""User reward functions, called the way TRL calls them, and weighted sets of them.

A reward function is given as ``"module:function"`` (an importable module) or
``"path/to/file.py:function"`` (a Python file, loaded under a private module
name). It is called with keywords only, as TRL's GRPOTrainer does::

    fn(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns)

where every dataset column other than "prompt" arrives as a list with one
value per completion (so functions should accept ``**kwargs``). For records
whose prompt is chat messages, as TRL's conversational format, ``prompts``
holds the message lists and each completion is ``[{"role": "assistant",
"content": text}]``. It returns one
number per completion. A sample for which the function returns None (or NaN)
is NaN in that function's column and is left out of the weighted sum, as TRL
does with ``nansum``; a sample for which every function returned None gets a
total of 0.0. Infinite values, non-numbers and a wrong count are errors.

``RewardSet([(fn_or_spec_or_task, weight), ...]).score(batch)`` returns the
weighted total per completion (float64) and the per-function columns.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rlportable.errors import InputError
from rlportable.train.datafiles import is_chat

RewardFunction = Callable[..., Sequence[float | None]]

_RESERVED = ("prompts", "completions", "completion_ids")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_file_spec(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def load_reward_function(spec: str) -> RewardFunction:
    """The callable named by ``spec`` ("module:function" or "path/to/file.py:function")."""
    if not isinstance(spec, str) or ":" not in spec:
        raise InputError(f"reward function {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise InputError(f"reward function {spec!r}: expected 'module:function' or 'path/to/file.py:function'")
    if _is_file_spec(module_part):
        path = os.path.abspath(module_part)
        if not os.path.isfile(path):
            raise InputError(f"reward function {spec!r}: no such file {module_part!r}")
        name = f"_rlportable_reward_{abs(hash(path)):x}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise InputError(f"reward function {spec!r}: cannot load {module_part!r} as Python")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise InputError(f"reward function {spec!r}: loading {module_part!r} failed: {_one_line(exc)}") from exc
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            if exc.name and (module_part == exc.name or module_part.startswith(exc.name + ".")):
                raise InputError(f"reward function {spec!r}: no module named {exc.name!r}") from None
            raise InputError(f"reward function {spec!r}: importing {module_part!r} failed: {_one_line(exc)}") from exc
        except Exception as exc:
            raise InputError(f"reward function {spec!r}: importing {module_part!r} failed: {_one_line(exc)}") from exc
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise InputError(f"reward function {spec!r}: {module_part!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise InputError(f"reward function {spec!r}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


def _to_float(value: Any, label: str, index: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise InputError(f"reward function {label!r} returned a {type(value).__name__} for sample {index}, not a number")
    result = float(value)
    if math.isinf(result):
        raise InputError(f"reward function {label!r} returned {result} for sample {index}")
    return result


class RewardSet:
    """Reward functions with weights; each item is (callable, "module:function" spec, or Task, weight)."""

    def __init__(self, items: Sequence[tuple[Any, float]]):
        if not items:
            raise InputError("a reward set needs at least one reward function")
        self.functions: list[RewardFunction] = []
        self.labels: list[str] = []
        self.names: list[str] = []
        weights = []
        for item in items:
            try:
                fn, weight = item
            except (TypeError, ValueError):
                raise InputError(f"reward set item {item!r}: expected (function, weight)") from None
            if isinstance(fn, str):
                label = name = fn
                fn = load_reward_function(fn)
            elif hasattr(fn, "reward") and isinstance(getattr(fn, "name", None), str):
                label = name = fn.name
                fn = fn.reward
            elif callable(fn):
                name = getattr(fn, "__name__", type(fn).__name__)
                label = f"{getattr(fn, '__module__', '?')}:{name}"
            else:
                raise InputError(f"reward set item {item!r}: {type(fn).__name__} is not callable")
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
                raise InputError(f"reward function {label!r}: weight must be a finite number, got {weight!r}")
            unique, k = name, 2
            while unique in self.names:
                unique, k = f"{name}_{k}", k + 1
            self.functions.append(fn)
            self.labels.append(label)
            self.names.append(unique)
            weights.append(float(weight))
        self.weights = np.array(weights, dtype=np.float64)

    def score(self, batch: Mapping[str, Any]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(weighted total per completion, {function name: its rewards with NaN for None}).

        ``batch`` holds "prompts" and "completions" (lists of str, one per
        completion), optionally "completion_ids", and every dataset column as a
        list of the same length.
        """
        for key in ("prompts", "completions"):
            if key not in batch:
                raise InputError(f"reward batch is missing {key!r}")
        n = len(batch["completions"])
        for key, values in batch.items():
            if key == "completion_ids" and values is None:
                continue
            if not hasattr(values, "__len__") or len(values) != n:
                got = len(values) if hasattr(values, "__len__") else type(values).__name__
                raise InputError(f"reward batch column {key!r} has {got} values for {n} completions")
        kwargs = dict(batch)
        kwargs.setdefault("completion_ids", None)
        columns: dict[str, np.ndarray] = {}
        for fn, label, name in zip(self.functions, self.labels, self.names):
            try:
                result = fn(**kwargs)
            except InputError:
                raise
            except Exception as exc:
                raise InputError(f"reward function {label!r} raised {_one_line(exc)}") from exc
            if result is None or isinstance(result, (str, bytes)) or not hasattr(result, "__len__"):
                raise InputError(f"reward function {label!r} returned {type(result).__name__}, not a list of {n} numbers")
            if len(result) != n:
                raise InputError(f"reward function {label!r} returned {len(result)} values for {n} completions")
            columns[name] = np.array([_to_float(v, label, i) for i, v in enumerate(result)], dtype=np.float64)
        matrix = np.stack([columns[name] for name in self.names], axis=1) if n else np.zeros((0, len(self.names)))
        total = np.nansum(matrix * self.weights[None, :], axis=1)
        return total, columns


def batch_from_records(
    records: Sequence[Mapping[str, Any]],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """A reward batch from one dataset record per completion (repeat a record G times for a GRPO group).
    Records whose prompt is chat messages give each completion as [{"role": "assistant", "content": text}]."""
    if len(records) != len(completions):
        raise InputError(f"{len(records)} records for {len(completions)} completions")
    if records and is_chat(records[0]["prompt"]):
        # conversational records, as TRL passes them: the prompt's messages, and the completion as the
        # assistant's message
        completions = [[{"role": "assistant", "content": text}] for text in completions]
    batch: dict[str, Any] = {"prompts": [r["prompt"] for r in records], "completions": list(completions)}
    if completion_ids is not None:
        batch["completion_ids"] = list(completion_ids)
    keys = [k for k in (records[0] if records else {}) if k != "prompt"]
    for key in keys:
        if key in _RESERVED:
            raise InputError(f"dataset column {key!r} clashes with a reward-function keyword")
        batch[key] = [r[key] for r in records]
    return batch
