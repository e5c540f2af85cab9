"""`rlportable logp`: per-token log-probabilities of texts under a model."""

from __future__ import annotations

import numpy as np

from rlportable.errors import InputError
from rlportable.textio import check_utf8, read_jsonl_objects


def read_texts(text: str | None, jsonl: str | None) -> list[str]:
    """The texts to score: --text, or the "text" field of each JSONL line (prompt + completion also accepted)."""
    if (text is None) == (jsonl is None):
        raise InputError("give exactly one of --text or --jsonl")
    if text is not None:
        return [check_utf8("--text", text)]
    texts = []
    for where, record in _records(jsonl):
        if isinstance(record.get("text"), str):
            texts.append(record["text"])
        elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            texts.append(record["prompt"] + record["completion"])
        else:
            raise InputError(f"{where}: expected an object with a string field 'text' (or 'prompt' and 'completion')")
    return texts


def read_prompts(prompts: list[str], jsonl: str | None) -> list[tuple[str, int | None]]:
    """(prompt, its own seed or None) from --prompt options, or from each JSONL line's "prompt" (or
    "text") field and optional "seed" (an integer in [0, 2^64))."""
    if bool(prompts) == (jsonl is not None):
        raise InputError("give --prompt (one or more) or --jsonl, not both and not neither")
    if prompts:
        return [(check_utf8("--prompt", p), None) for p in prompts]
    out = []
    for where, record in _records(jsonl):
        text = record.get("prompt", record.get("text"))
        if not isinstance(text, str):
            raise InputError(f"{where}: expected an object with a string field 'prompt'")
        seed = record.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise InputError(f"{where}: \"seed\" must be an integer in [0, 2^64), got {seed!r}")
        out.append((text, seed))
    return out


def _records(jsonl: str) -> list[tuple[str, dict]]:
    records = list(read_jsonl_objects(jsonl))
    if not records:
        raise InputError(f"{jsonl}: no records")
    return records


def score(model, tokenizer, texts: list[str], temperature: float = 1.0) -> list[dict]:
    """For each text: its tokens and the log-probability of every token after the first."""
    ids = [tokenizer.encode(t) for t in texts]
    limit = model.config.max_position_embeddings
    for text, seq in zip(texts, ids):
        if len(seq) < 2:
            raise InputError(f"text {text[:40]!r} has {len(seq)} token(s); log-probs need at least 2")
        if len(seq) > limit:
            raise InputError(f"text {text[:40]!r} has {len(seq)} tokens, more than the model's maximum length "
                             f"{limit} (max_position_embeddings)")
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
