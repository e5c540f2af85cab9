"""Conformance of the rope family (contracts/rope.toml): the cos / sin tables (plain and Llama-3 scaled),
apply and apply_backward over every row kind and every float32 bit pattern class, bitwise against the
reference; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, random_bits, random_rows, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import rope as rope_ref
from rlportable.ops import rope as rope_op
from rlportable.runtime.base import Backend

# (tokens, heads, head_dim, table positions)
ROPE_SHAPES_QUICK = [(1, 1, 2, 1), (7, 3, 14, 50), (17, 4, 64, 300), (9, 8, 128, 4096), (0, 2, 8, 4)]
ROPE_SHAPES_FULL = ROPE_SHAPES_QUICK + [(130, 16, 128, 32768), (64, 40, 80, 65536)]


def rope_bit_patterns(backend: Backend, rng, tally: Tally, op, reference) -> None:
    """Every float32 bit pattern class in the rotated tensor (NaN payloads, inf * 0 at position 0,
    inf - inf), through op (rope.apply or apply_backward) against its reference."""
    cos_ref, sin_ref = rope_ref.tables(np.arange(64), rope_ref.inverse_frequencies(32, 10000.0))
    positions = rng.integers(0, 64, size=200).astype(np.int32)
    positions[:10] = 0
    x = random_bits(rng, (200, 3, 32))
    got = op(backend, backend.asarray(x), backend.asarray(positions), backend.asarray(cos_ref),
             backend.asarray(sin_ref))
    tally.add(backend.to_numpy(got), reference(x, cos_ref[positions], sin_ref[positions]))


def check_rope_apply(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    scalings = (None, rope_ref.Llama3Scaling(8.0, 1.0, 4.0, 8192))
    for tokens, heads, head_dim, table_rows in sizes(backend, quick, ROPE_SHAPES_QUICK, ROPE_SHAPES_FULL):
        for theta, scaling in ((10000.0, None), (1_000_000.0, None), (500000.0, scalings[1])):
            cos, sin = rope_op.tables(backend, table_rows, head_dim, theta, scaling)
            inv_freq = rope_ref.inverse_frequencies(head_dim, theta, scaling)
            cos_ref, sin_ref = rope_ref.tables(np.arange(table_rows), inv_freq)
            tally.add(backend.to_numpy(cos), cos_ref)
            tally.add(backend.to_numpy(sin), sin_ref)
            positions = rng.integers(0, table_rows, size=tokens).astype(np.int32)
            if tokens >= 2:
                positions[0], positions[-1] = 0, table_rows - 1
            positions_dev = backend.asarray(positions)
            for kind in ROW_KINDS if theta == 10000.0 else ("normal",):
                x = random_rows(rng, tokens * heads, head_dim, kind).reshape(tokens, heads, head_dim)
                expected = rope_ref.apply(x, cos_ref[positions], sin_ref[positions])
                got = rope_op.apply(backend, backend.asarray(x), positions_dev, cos, sin)
                tally.add(backend.to_numpy(got), expected)
    rope_bit_patterns(backend, rng, tally, rope_op.apply, rope_ref.apply)
    return tally


# ---- backward

# (tokens, heads, head_dim, table positions)
ROPE_BACKWARD_SHAPES_QUICK = [(1, 1, 2, 1), (7, 3, 14, 50), (17, 4, 64, 300), (9, 8, 128, 4096), (0, 2, 8, 4)]
ROPE_BACKWARD_SHAPES_FULL = ROPE_BACKWARD_SHAPES_QUICK + [(130, 16, 128, 32768), (64, 40, 80, 65536)]


def check_rope_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    scaling = rope_ref.Llama3Scaling(8.0, 1.0, 4.0, 8192)
    for tokens, heads, head_dim, table_rows in sizes(backend, quick, ROPE_BACKWARD_SHAPES_QUICK, ROPE_BACKWARD_SHAPES_FULL):
        for theta, scale in ((10000.0, None), (500000.0, scaling)):
            cos_ref, sin_ref = rope_ref.tables(np.arange(table_rows), rope_ref.inverse_frequencies(head_dim, theta, scale))
            cos, sin = backend.asarray(cos_ref), backend.asarray(sin_ref)
            positions = rng.integers(0, table_rows, size=tokens).astype(np.int32)
            if tokens >= 2:
                positions[0], positions[-1] = 0, table_rows - 1
            positions_dev = backend.asarray(positions)
            for kind in ROW_KINDS if theta == 10000.0 else ("normal",):
                dy = random_rows(rng, tokens * heads, head_dim, kind).reshape(tokens, heads, head_dim)
                expected = rope_ref.apply_backward(dy, cos_ref[positions], sin_ref[positions])
                got = rope_op.apply_backward(backend, backend.asarray(dy), positions_dev, cos, sin,
                                             host_positions=positions)
                tally.add(backend.to_numpy(got), expected)
    rope_bit_patterns(backend, rng, tally, rope_op.apply_backward, rope_ref.apply_backward)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("rope.apply", check_rope_apply),
    ("rope.backward", check_rope_backward),
]


# ---- golden

GOLDEN_CASES = Cases("rope")


def _rope_scaling(spec):
    return None if spec is None else rope_ref.Llama3Scaling(*spec)


# (table rows, head_dim, theta, llama3 scaling (factor, low, high, original max positions) or None)
GOLDEN_ROPE_TABLES = [[50, 14, 10000.0, None], [4096, 128, 1000000.0, None],
                      [300, 64, 500000.0, [8.0, 1.0, 4.0, 8192]]]


@GOLDEN_CASES.case("tables", seed=20, tables=GOLDEN_ROPE_TABLES)
def _rope_tables(backend, s, r):
    out = []
    for i, (rows, head_dim, theta, scaling) in enumerate(r["tables"]):
        cos, sin = rope_op.tables(backend, rows, head_dim, theta, _rope_scaling(scaling))
        out += [(f"{i}.cos", host(backend, cos)), (f"{i}.sin", host(backend, sin))]
    return out


def _rope_rotation(backward: bool):
    def compute(backend, s, r):
        out = []
        for i, (tokens, heads, head_dim, table) in enumerate(r["shapes"]):
            rows, theta, scaling = GOLDEN_ROPE_TABLES[table][0], GOLDEN_ROPE_TABLES[table][2], GOLDEN_ROPE_TABLES[table][3]
            cos, sin = rope_op.tables(backend, rows, head_dim, theta, _rope_scaling(scaling))
            positions = s.ints((tokens,), 0, rows)
            if tokens >= 2:
                positions[0], positions[-1] = 0, rows - 1
            positions_dev = backend.asarray(positions)
            for kind in r["kinds"]:
                x = backend.asarray(s.floats((tokens, heads, head_dim), kind))
                op = rope_op.apply_backward if backward else rope_op.apply
                out.append((f"{i}.{kind}.{'dx' if backward else 'y'}",
                            host(backend, op(backend, x, positions_dev, cos, sin, host_positions=positions))))
        return out

    compute.__name__ = "_rope_apply_backward" if backward else "_rope_apply"
    return compute


# (tokens, heads, head_dim, index into GOLDEN_ROPE_TABLES: its rows, theta and scaling; head_dim its own)
GOLDEN_ROPE_SHAPES = [[1, 1, 2, 0], [7, 3, 14, 0], [17, 4, 64, 2], [9, 8, 128, 1], [0, 2, 8, 0]]
GOLDEN_CASES.case("apply", seed=21, shapes=GOLDEN_ROPE_SHAPES, kinds=STREAM_ROW_KINDS + ["bits"])(_rope_rotation(False))
GOLDEN_CASES.case("apply_backward", seed=22, shapes=GOLDEN_ROPE_SHAPES,
                  kinds=STREAM_ROW_KINDS + ["bits"])(_rope_rotation(True))
