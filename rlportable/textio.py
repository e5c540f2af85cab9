"""Text input from users: JSONL files and command-line texts, with one-line errors naming the file,
line or flag (never a UnicodeDecodeError or a tokenizer's TypeError)."""

from __future__ import annotations

import json
import os

from rlportable.errors import InputError


def check_utf8(where: str, text: str) -> str:
    """`text` if it is valid UTF-8 text; a command-line argument with undecodable bytes reaches
    Python as lone surrogates, which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"code point U+{ord(bad):04X}"
        raise InputError(f"{where}: not valid UTF-8 text ({byte} at character {error.start})") from None
    return text


def read_jsonl_objects(path: str | os.PathLike):
    """(where "file:line", object) for each non-blank line of a UTF-8 JSONL file; one-line errors."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise InputError(f"{path}:{line}: not valid UTF-8 (byte 0x{exc.object[exc.start]:02x})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({type(exc).__name__}: {exc.strerror or exc})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(record, dict):
            raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for key, value in record.items():
            if isinstance(value, str):
                check_utf8(f"{where}: \"{key}\"", value)
        yield where, record
