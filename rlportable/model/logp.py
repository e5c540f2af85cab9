"""`rlportable logp`: per-token log-probabilities of texts under a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from rlportable.errors import InputError


def read_texts(text: str | None, jsonl: str | None) -> list[str]:
    """The texts to score: --text, or the "text" field of each JSONL line (prompt + completion also accepted)."""
    if (text is None) == (jsonl is None):
        raise InputError("give exactly one of --text or --jsonl")
    if text is not None:
        return [text]
    texts = []
    path = Path(jsonl)
    for number, record in _jsonl_records(jsonl):
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            texts.append(record["prompt"] + record["completion"])
        else:
            raise InputError(f"{path}:{number}: expected an object with a string field 'text' (or 'prompt' and 'completion')")
    return texts


def read_prompts(prompts: list[str], jsonl: str | None) -> list[str]:
    """Prompts from --prompt options, or the "prompt" (or "text") field of each JSONL line."""
    if bool(prompts) == (jsonl is not None):
        raise InputError("give --prompt (one or more) or --jsonl, not both and not neither")
    if prompts:
        return list(prompts)
    records = _jsonl_records(jsonl)
    texts = []
    for number, record in records:
        text = record.get("prompt", record.get("text")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise InputError(f"{jsonl}:{number}: expected an object with a string field 'prompt'")
        texts.append(text)
    return texts


def _jsonl_records(jsonl: str) -> list[tuple[int, object]]:
    path = Path(jsonl)
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as error:
            raise InputError(f"{path}:{number}: not JSON ({error.msg})") from None
    if not records:
        raise InputError(f"{path}: no records")
    return records


def score(model, tokenizer, texts: list[str], temperature: float = 1.0) -> list[dict]:
    """For each text: its tokens and the log-probability of every token after the first."""
    ids = [tokenizer.encode(t) for t in texts]
    for text, seq in zip(texts, ids):
        if len(seq) < 2:
            raise InputError(f"text {text[:40]!r} has {len(seq)} token(s); log-probs need at least 2")
    cu = np.concatenate([[0], np.cumsum([len(s) for s in ids])])
    lps = model.logprobs(np.concatenate(ids).astype(np.int32), cu, temperature)
    results = []
    for seq, lp in zip(ids, lps):
        results.append({
            "tokens": [int(t) for t in seq],
            "pieces": [tokenizer.decode([int(t)]) for t in seq],
            "logprobs": [None] + [float(v) for v in lp],
            "sum_logprob": float(np.sum(lp.astype(np.float64))),
        })
    return results
