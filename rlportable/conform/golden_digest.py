"""The golden digest format. The digest of a case is SHA-256 over its outputs in the case's order, each as
the ASCII header "<name> <dtype> <d0,d1,...>\\n" (dtype as NumPy writes it, little-endian: <f4, <i4, |i1,
<f8; the sizes joined by commas, empty for a scalar) followed by the array's raw bytes in C order.
Integer outputs are widened or narrowed to their canonical dtype first (values unchanged); float outputs
are digested as returned. The first 16 hex digits of each output's own SHA-256 (of the same header and
bytes) are stored too, so a failure names the first output that differs."""

from __future__ import annotations

import hashlib

import numpy as np

from rlportable.errors import RlpError
from rlportable.runtime.base import Backend

DIGEST_RULE = ("sha256 over the outputs in order, each as the ASCII header '<name> <dtype> <d0,d1,...>\\n' "
               "(NumPy dtype string, little-endian) then its raw C-order bytes; integer outputs in their "
               "canonical dtype")

_INT_DTYPES = {"int8": np.int8, "int32": np.int32, "int64": np.int64, "uint32": np.uint32}


def canonical(array, dtype: str | None = None) -> np.ndarray:
    """A C-contiguous host array; integers converted to `dtype` (an error if a value would change)."""
    array = np.ascontiguousarray(np.asarray(array))
    if dtype is not None and array.dtype != np.dtype(dtype):
        if array.dtype.kind not in "iu":
            return array  # a float of the wrong dtype stays so: its digest then differs
        converted = array.astype(_INT_DTYPES[dtype])
        if not np.array_equal(converted.astype(np.int64), array.astype(np.int64)):
            raise RlpError(f"golden: an integer output does not fit {dtype}")
        array = np.ascontiguousarray(converted)
    return array


def host(backend: Backend, array, dtype: str | None = None) -> np.ndarray:
    """A host COPY of an output, canonical: on cpu to_numpy returns the array itself, which a later
    in-place update (AdamW's next step) would change after it was recorded; a device's to_numpy copies."""
    return canonical(np.array(backend.to_numpy(array), copy=True), dtype)


def _record(name: str, array: np.ndarray) -> tuple[bytes, bytes]:
    little = array.astype(array.dtype.newbyteorder("<"), copy=False)
    header = f"{name} {little.dtype.str} {','.join(str(d) for d in little.shape)}\n".encode("ascii")
    return header, np.ascontiguousarray(little).tobytes()


def digest(outputs: list[tuple[str, np.ndarray]]) -> str:
    """The case digest of named outputs in order (module docstring)."""
    total = hashlib.sha256()
    for name, array in outputs:
        for part in _record(name, np.asarray(array)):
            total.update(part)
    return total.hexdigest()


def output_entries(outputs: list[tuple[str, np.ndarray]]) -> list[str]:
    """One line per output: "<name> <dtype> [<shape>] <first 16 hex digits of its own SHA-256>"."""
    entries = []
    for name, array in outputs:
        header, data = _record(name, np.asarray(array))
        dtype, shape = header.decode("ascii").split(" ")[1:]
        entries.append(f"{name} {dtype} [{shape.rstrip()}] {hashlib.sha256(header + data).hexdigest()[:16]}")
    return entries
