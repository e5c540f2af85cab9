"""Conformance of the activation family (contracts/activation.toml): swiglu, swiglu with the down
projection's encoding in one launch (swiglu_encode) and swiglu_backward, over every row kind, every
float32 class and the exp contract's edge inputs, bitwise against the reference; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, elementwise_inputs, random_bits, random_rows, sizes
from rlportable.conform.tally import Tally
from rlportable.contract import activation as activation_ref, elementwise as elementwise_ref
from rlportable.ops import activation as activation_op, fixedpoint as fixedpoint_op
from rlportable.runtime.base import Backend

ACTIVATION_SHAPES = [(1, 1), (7, 13), (33, 257), (16, 3072)]


def check_activation_swiglu(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for shape in sizes(backend, quick, ACTIVATION_SHAPES, ACTIVATION_SHAPES + [(257, 11008)]):
        for kind in ROW_KINDS:
            gate = random_rows(rng, *shape, kind)
            up = random_rows(rng, *shape, "normal" if kind != "special" else "special")
            tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                      activation_ref.swiglu(gate, up))
    # gate over every float32 class and the exp edge inputs, up random bit patterns or ordinary values
    gate = elementwise_inputs(rng, quick or backend.runs_reference)
    for up in (random_bits(rng, gate.shape), rng.standard_normal(gate.shape).astype(np.float32)):
        tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                  activation_ref.swiglu(gate, up))
    gate = np.array([0.0, -0.0, -89.5, -100.0, 89.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45], dtype=np.float32)
    for up_value in (0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan):
        up = np.full(gate.shape, up_value, dtype=np.float32)
        tally.add(backend.to_numpy(activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up))),
                  activation_ref.swiglu(gate, up))
    return tally


def check_activation_swiglu_encode(backend: Backend, rng, quick: bool) -> Tally:
    """SwiGLU with the down projection's encoding in one launch, against swiglu then encode_rows (the
    references); every row kind, a row above the fused limit and other bits."""
    tally = Tally()
    limit = activation_op.MAX_FUSED_ENCODED_ROW
    shapes = ((1, 8, 23), (7, 96, 23), (0, 16, 23), (5, 40, 15)) if quick else \
        ((1, 8, 23), (7, 96, 23), (256, 3072, 23), (3, limit, 23), (2, limit + 64, 23), (0, 16, 23), (5, 40, 15))
    for rows, h, bits in shapes:
        for kind in ROW_KINDS:
            gate, up = random_rows(rng, rows, h, kind), random_rows(rng, rows, h, "normal")
            y_ref = activation_ref.swiglu(gate, up)
            expected = fixedpoint_op.encode_rows_reference(y_ref, bits)
            y, encoded = activation_op.swiglu_encode(backend, backend.asarray(gate), backend.asarray(up), bits)
            tally.add(backend.to_numpy(y), y_ref)
            tally.add(backend.to_numpy(encoded.digits), expected.digits)
            tally.add(backend.to_numpy(encoded.exponents), expected.exponents)
    return tally


# ---- backward

ACTIVATION_BACKWARD_SHAPES = [(1, 1), (7, 13), (33, 257), (16, 3072), (0, 5)]


def _swiglu_backward_case(tally: Tally, backend: Backend, gate, up, dy) -> None:
    got = activation_op.swiglu_backward(backend, backend.asarray(gate), backend.asarray(up), backend.asarray(dy))
    tally.add_outputs(backend, got, activation_ref.swiglu_backward(gate, up, dy))


def check_activation_swiglu_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for shape in sizes(backend, quick, ACTIVATION_BACKWARD_SHAPES, ACTIVATION_BACKWARD_SHAPES + [(257, 11008)]):
        for kind in ROW_KINDS:
            gate = random_rows(rng, *shape, kind)
            up = random_rows(rng, *shape, "normal" if kind != "special" else "special")
            dy = random_rows(rng, *shape, "normal" if kind != "nonfinite" else "nonfinite")
            _swiglu_backward_case(tally, backend, gate, up, dy)
    # gate over every float32 class and the exp edge inputs; up, dy random bit patterns or ordinary values
    gate = elementwise_inputs(rng, quick or backend.runs_reference)
    for up, dy in ((random_bits(rng, gate.shape), random_bits(rng, gate.shape)),
                   (rng.standard_normal(gate.shape).astype(np.float32), rng.standard_normal(gate.shape).astype(np.float32))):
        _swiglu_backward_case(tally, backend, gate, up, dy)
    # around the root of 1 + g (1 - sig(g)) (float64 cancellation) and the exp overflow at g = -88.72
    for centre in (-1.2784645, -88.72284, 38.0):
        gate = (np.float32(centre) + np.arange(-512, 512, dtype=np.float32) * np.float32(2.0**-20 * max(1.0, abs(centre))))
        _swiglu_backward_case(tally, backend, gate, rng.standard_normal(1024).astype(np.float32),
                              rng.standard_normal(1024).astype(np.float32))
    gate = np.array([0.0, -0.0, -89.5, -100.0, 89.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45], dtype=np.float32)
    for value in (0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, np.nan):
        filled = np.full(gate.shape, value, dtype=np.float32)
        _swiglu_backward_case(tally, backend, gate, filled, np.ones_like(gate))
        _swiglu_backward_case(tally, backend, gate, np.ones_like(gate), filled)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("activation.swiglu", check_activation_swiglu),
    ("activation.swiglu_encode", check_activation_swiglu_encode),
    ("activation.swiglu_backward", check_activation_swiglu_backward),
]


# ---- golden

GOLDEN_CASES = Cases("activation")
GOLDEN_ACTIVATION_SHAPES = [[1, 1], [7, 13], [33, 257], [0, 5]]


@GOLDEN_CASES.case("swiglu", seed=30, shapes=GOLDEN_ACTIVATION_SHAPES, kinds=STREAM_ROW_KINDS + ["bits"],
                   exp_edges="gate = the exp contract's edge_inputs(), up random bit patterns")
def _activation_swiglu(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            gate, up = (backend.asarray(s.floats(shape, k)) for k in (kind, "uniform"))
            out.append((f"{i}.{kind}.y", host(backend, activation_op.swiglu(backend, gate, up))))
    gate = elementwise_ref.edge_inputs().view(np.float32)
    up = s.floats(gate.shape, "bits")
    out.append(("edges.y", host(backend, activation_op.swiglu(backend, backend.asarray(gate), backend.asarray(up)))))
    return out


@GOLDEN_CASES.case("swiglu_backward", seed=31, shapes=GOLDEN_ACTIVATION_SHAPES, kinds=STREAM_ROW_KINDS + ["bits"],
                   exp_edges="gate = the exp contract's edge_inputs(), up and dy random bit patterns")
def _activation_swiglu_backward(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            gate, up, dy = (backend.asarray(s.floats(shape, k)) for k in (kind, "uniform", "uniform"))
            dgate, dup = activation_op.swiglu_backward(backend, gate, up, dy)
            out += [(f"{i}.{kind}.dgate", host(backend, dgate)), (f"{i}.{kind}.dup", host(backend, dup))]
    gate = elementwise_ref.edge_inputs().view(np.float32)
    up, dy = s.floats(gate.shape, "bits"), s.floats(gate.shape, "bits")
    dgate, dup = activation_op.swiglu_backward(backend, *(backend.asarray(a) for a in (gate, up, dy)))
    return out + [("edges.dgate", host(backend, dgate)), ("edges.dup", host(backend, dup))]
