"""Dataset files for --data and --eval-data: JSONL (a JSON object a line) or Parquet (a record a row).

GRPO's records each get a "prompt": the text of the prompt column ("prompt" by default, `--prompt-column`
to name another, as TRL's and verl's data often hold `question` or `problem`), or chat messages
(a list of {"role", "content"}, such as a "messages" column) that the model's chat template turns into
the prompt. `--answer-column` names the column whose values reach the reward functions as `answer`
(what math_answer reads). Both columns also keep their own names. Every error is one line naming the
file and its line (JSONL) or row (Parquet, from 0), or the flag.

Parquet needs pyarrow, an optional extra (`pip install 'rlportable[parquet]'`): it is imported only
when a Parquet file is read.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

from rlportable.errors import InputError
from rlportable.textio import read_jsonl_objects

PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_MAGIC = b"PAR1"
PARQUET_INSTALL = "pip install 'rlportable[parquet]'"
CHAT_COLUMN = "messages"  # the prompt column of chat records when the data has no "prompt"


def is_parquet(path: str | os.PathLike) -> bool:
    """Whether `path` is read as Parquet: by its suffix, or by the magic bytes a Parquet file starts with
    (so a Parquet file with another name is not read as broken JSONL)."""
    path = os.fspath(path)
    if path.lower().endswith(PARQUET_SUFFIXES):
        return True
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == PARQUET_MAGIC
    except OSError:
        return False  # the JSONL reader names what is wrong with it


def check_readable(flag: str, path: str | os.PathLike | None) -> None:
    """Before any work: a Parquet file needs pyarrow installed."""
    if path is not None and is_parquet(path) and importlib.util.find_spec("pyarrow") is None:
        raise InputError(f"{flag} {os.fspath(path)}: reading Parquet needs pyarrow: {PARQUET_INSTALL}")


def read_records(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for each record of a JSONL or Parquet file; `where` is "file:line" or "file row N"."""
    if is_parquet(path):
        yield from _read_parquet(os.fspath(path))
    else:
        yield from read_jsonl_objects(path)


def _read_parquet(path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise InputError(f"{path}: reading Parquet needs pyarrow: {PARQUET_INSTALL}") from None
    try:
        table = pyarrow.parquet.read_table(path)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, pyarrow.ArrowException) as error:
        raise InputError(f"{path}: not a readable Parquet file ({' '.join(str(error).split())})") from None
    # to_pylist: Python values (str, int, float, lists, dicts for structs), as json.loads gives for JSONL
    for index, record in enumerate(table.to_pylist()):
        yield f"{path} row {index}", record


def is_chat(prompt: Any) -> bool:
    """Whether a prompt is chat messages (a list of {"role", "content"}), not a text or token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)


def load_prompt_records(path: str | os.PathLike, prompt_column: str | None = None,
                        answer_column: str | None = None) -> list[dict[str, Any]]:
    """GRPO's records of a JSONL or Parquet file, each with "prompt" (a text or chat messages) and, with
    answer_column, "answer"; every other column as it is (they reach the reward functions). Every record
    must carry the same columns as the first, and every prompt be of the first's kind (text or chat: the
    reward functions get one completion format for the whole run)."""
    records: list[dict[str, Any]] = []
    keys: set[str] | None = None
    column = prompt_column
    for where, record in read_records(path):
        if keys is None:
            keys = set(record)
            column = _prompt_column(where, record, prompt_column)
            _check_answer_column(where, record, answer_column)
        elif set(record) != keys:
            raise InputError(f"{where}: columns {sorted(record)} differ from the first record's {sorted(keys)}")
        records.append(_prompt_record(where, record, column, answer_column))
        if is_chat(records[-1]["prompt"]) != is_chat(records[0]["prompt"]):
            kinds = ("chat messages", "a text") if is_chat(records[0]["prompt"]) else ("a text", "chat messages")
            raise InputError(f"{where}: the \"{column}\" column is {kinds[1]} where the first record's is {kinds[0]}; "
                             "a file's prompts are all texts or all chat messages")
    if not records:
        raise InputError(f"{os.fspath(path)}: no records")
    return records


def _columns(record: dict) -> str:
    return ", ".join(sorted(record)) or "none"


def _prompt_column(where: str, record: dict, given: str | None) -> str:
    if given is not None:
        if given not in record:
            raise InputError(f"--prompt-column {given}: {where} has no {given!r} column (its columns: "
                             f"{_columns(record)})")
        if given != "prompt" and "prompt" in record:
            # the prompts reach reward functions as `prompts` and the column "prompt" would be lost
            raise InputError(f"--prompt-column {given}: {where} has a \"prompt\" column too; drop or rename it")
        return given
    if "prompt" in record:
        return "prompt"
    if CHAT_COLUMN in record:
        return CHAT_COLUMN
    raise InputError(f"{where}: the \"prompt\" column is missing (nor is there a \"{CHAT_COLUMN}\" column); name "
                     f"the prompts' column with --prompt-column (its columns: {_columns(record)})")


def _check_answer_column(where: str, record: dict, given: str | None) -> None:
    if given is None:
        return
    if given not in record:
        raise InputError(f"--answer-column {given}: {where} has no {given!r} column (its columns: "
                         f"{_columns(record)})")
    if given != "answer" and "answer" in record:
        raise InputError(f"--answer-column {given}: {where} has an \"answer\" column too, which the answer "
                         "would replace; drop or rename it")


def _prompt_record(where: str, record: dict, column: str, answer_column: str | None) -> dict[str, Any]:
    prompt = record[column]
    if isinstance(prompt, list):
        check_messages(where, column, prompt)
    elif not isinstance(prompt, str):
        raise InputError(f"{where}: the \"{column}\" column is a {type(prompt).__name__}, not a string or a list "
                         "of chat messages")
    out = dict(record)
    out["prompt"] = prompt
    if answer_column is not None:
        out["answer"] = record[answer_column]
    return out


def check_messages(where: str, column: str, messages: list) -> None:
    """A GRPO prompt's chat messages: {"role": str, "content": str} objects, the last not the
    assistant's (the model writes the assistant's turn)."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise InputError(f"{where}: the \"{column}\" column must be a non-empty list of "
                         "{\"role\": str, \"content\": str} objects")
    if messages[-1]["role"] == "assistant":
        raise InputError(f"{where}: the last message of \"{column}\" is the assistant's; a prompt ends before "
                         "the turn the model writes")
