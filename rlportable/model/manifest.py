"""A checkpoint's manifest.json (written by train/checkpoint.py): every file of a step directory
with its size and SHA-256. Loading a model from a step directory checks it, as --resume does."""

from __future__ import annotations

import hashlib
import json
import os

MANIFEST = "manifest.json"


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def files_problem(directory: str, files: dict) -> str | None:
    """The first listed file that is missing, misnamed or differs in size or SHA-256, as a message;
    None when every file matches."""
    manifest_path = os.path.join(directory, MANIFEST)
    for rel, entry in files.items():
        path = os.path.join(directory, *rel.split("/"))
        if ".." in rel.split("/") or not isinstance(entry, dict):
            return f"{manifest_path}: bad entry {rel!r}"
        if not os.path.isfile(path):
            return f"{path}: missing (listed in {MANIFEST})"
        if os.path.getsize(path) != entry.get("size") or sha256(path) != entry.get("sha256"):
            return f"{path}: corrupt (SHA-256 or size differs from {MANIFEST})"
    return None


def directory_problem(directory: str) -> str | None:
    """For a directory holding manifest.json: its first problem (unreadable, or a file that does not
    match), else None. A directory without one (a Hugging Face model) has nothing to check: None."""
    manifest_path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(manifest_path):
        return None
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{manifest_path}: corrupt: {' '.join(str(error).split())}"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return f"{manifest_path}: lists no files"
    return files_problem(directory, files)
