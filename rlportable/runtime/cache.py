"""On-disk cache of compiled kernel binaries, keyed by source, options and architecture."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    root = os.environ.get("RLPORTABLE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rlportable" / "kernels"


def cache_key(source: str, options: tuple[str, ...], arch: str, compiler: str) -> str:
    digest = hashlib.sha256()
    for part in (compiler, arch, "\0".join(options), source):
        digest.update(part.encode())
        digest.update(b"\1")
    return digest.hexdigest()


def cached_binary(key: str, suffix: str, build: Callable[[], bytes]) -> bytes:
    """The binary stored under key, building and storing it (atomically) when absent."""
    path = cache_root() / f"{key}{suffix}"
    if path.is_file():
        return path.read_bytes()
    binary = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as handle:
            handle.write(binary)
        os.replace(handle.name, path)
    except OSError:
        pass  # a read-only home only costs a recompile next time
    return binary
