"""Conformance of the backward kernels of the small op families: rmsnorm_backward,
swiglu_backward, rope's apply_backward and the residual family's transpose, each bitwise against
its reference (on cpu the reference against itself)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rlportable.conform.forward_ops import NORM_EPS, _permutation_invariance, _random_bits, _sizes, rope_bit_patterns
from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.conform.primitives import elementwise_inputs
from rlportable.conform.tally import Tally
from rlportable.contract import activation as activation_ref, norm as norm_ref, rope as rope_ref
from rlportable.ops import activation as activation_op, norm as norm_op, residual as residual_op, rope as rope_op
from rlportable.runtime.base import Backend

# (rows, H): ragged (H not a multiple of the block or of 256 columns), several chunks of 256 rows
# for dweight's column kernels, H = 0 and rows = 0
NORM_BACKWARD_SHAPES_QUICK = [(1, 1), (7, 13), (3, 100), (17, 257), (300, 64), (5, 0), (0, 8)]
NORM_BACKWARD_SHAPES_FULL = NORM_BACKWARD_SHAPES_QUICK + [(9, 1024), (130, 1000), (1000, 300), (64, 4096),
                                                          (2, 2**18), (4100, 128)]


def _add_pair(tally: Tally, backend: Backend, got: tuple, expected: tuple) -> None:
    for actual, wanted in zip(got, expected):
        tally.add(backend.to_numpy(actual), wanted)


def check_norm_rmsnorm_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for rows, h in _sizes(backend, quick, NORM_BACKWARD_SHAPES_QUICK, NORM_BACKWARD_SHAPES_FULL):
        weights = [random_rows(rng, 1, h, "normal")[0], random_rows(rng, 1, h, "special")[0],
                   random_rows(rng, 2, h, "nonfinite")[0]]
        for kind in ROW_KINDS:
            x = random_rows(rng, rows, h, kind)
            for dy_kind in ("normal", "special", "nonfinite") if kind == "normal" else ("normal",):
                dy = random_rows(rng, rows, h, dy_kind)
                for w in weights if kind == "normal" and dy_kind == "normal" else weights[:1]:
                    for eps in NORM_EPS if kind in ("normal", "zeros", "tiny") else NORM_EPS[:1]:
                        expected = norm_ref.rmsnorm_backward(x, w, eps, dy)
                        got = norm_op.rmsnorm_backward(backend, backend.asarray(x), backend.asarray(w), eps,
                                                       backend.asarray(dy))
                        _add_pair(tally, backend, got, expected)
    # invariance: dx rows do not depend on their neighbours; dweight (an exact sum) not on row order
    x, dy = random_rows(rng, 37, 300, "massive"), random_rows(rng, 37, 300, "normal")
    w_dev = backend.asarray(random_rows(rng, 1, 300, "normal")[0])

    def run(x_rows, dy_rows):
        return [backend.to_numpy(a) for a in norm_op.rmsnorm_backward(
            backend, backend.asarray(x_rows), w_dev, 1e-6, backend.asarray(dy_rows))]

    full_dx, full_dweight = run(x, dy)
    _permutation_invariance(tally, rng, full_dx, np.concatenate([x, dy], axis=1),
                            lambda both: run(both[:, :300], both[:, 300:])[0])
    permutation = rng.permutation(37)
    tally.add(run(x[permutation], dy[permutation])[1], full_dweight)
    # QK-norm: [tokens, heads, head_dim], dweight summed over tokens and heads
    for tokens, heads, head_dim in ((1, 1, 128), (7, 5, 64), (33, 16, 128)):
        x = random_rows(rng, tokens * heads, head_dim, "normal")
        dy = random_rows(rng, tokens * heads, head_dim, "normal")
        w = random_rows(rng, 1, head_dim, "normal")[0]
        dx_ref, dweight_ref = norm_ref.rmsnorm_backward(x, w, 1e-6, dy)
        got = norm_op.rmsnorm_heads_backward(backend, backend.asarray(x.reshape(tokens, heads, head_dim)),
                                             backend.asarray(w), 1e-6,
                                             backend.asarray(dy.reshape(tokens, heads, head_dim)))
        _add_pair(tally, backend, got, (dx_ref.reshape(tokens, heads, head_dim), dweight_ref))
    return tally


ACTIVATION_BACKWARD_SHAPES = [(1, 1), (7, 13), (33, 257), (16, 3072), (0, 5)]


def _swiglu_backward_case(tally: Tally, backend: Backend, gate, up, dy) -> None:
    got = activation_op.swiglu_backward(backend, backend.asarray(gate), backend.asarray(up), backend.asarray(dy))
    _add_pair(tally, backend, got, activation_ref.swiglu_backward(gate, up, dy))


def check_activation_swiglu_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for shape in _sizes(backend, quick, ACTIVATION_BACKWARD_SHAPES, ACTIVATION_BACKWARD_SHAPES + [(257, 11008)]):
        for kind in ROW_KINDS:
            gate = random_rows(rng, *shape, kind)
            up = random_rows(rng, *shape, "normal" if kind != "special" else "special")
            dy = random_rows(rng, *shape, "normal" if kind != "nonfinite" else "nonfinite")
            _swiglu_backward_case(tally, backend, gate, up, dy)
    # gate over every float32 class and the exp edge inputs; up, dy random bit patterns or ordinary values
    gate = elementwise_inputs(rng, quick or backend.kernel_vendor is None)
    for up, dy in ((_random_bits(rng, gate.shape), _random_bits(rng, gate.shape)),
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


# (tokens, heads, head_dim, table positions)
ROPE_BACKWARD_SHAPES_QUICK = [(1, 1, 2, 1), (7, 3, 14, 50), (17, 4, 64, 300), (9, 8, 128, 4096), (0, 2, 8, 4)]
ROPE_BACKWARD_SHAPES_FULL = ROPE_BACKWARD_SHAPES_QUICK + [(130, 16, 128, 32768), (64, 40, 80, 65536)]


def check_rope_backward(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    scaling = rope_ref.Llama3Scaling(8.0, 1.0, 4.0, 8192)
    for tokens, heads, head_dim, table_rows in _sizes(backend, quick, ROPE_BACKWARD_SHAPES_QUICK, ROPE_BACKWARD_SHAPES_FULL):
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


# (rows, cols): 1x1, ragged edges of the 32 x 32 tile, exact tiles, 0-sized, model-like
TRANSPOSE_SHAPES_QUICK = [(1, 1), (7, 13), (32, 32), (33, 31), (1, 1000), (1000, 1), (64, 96), (0, 5), (5, 0), (0, 0)]
TRANSPOSE_SHAPES_FULL = TRANSPOSE_SHAPES_QUICK + [(1024, 4096), (4097, 33), (3000, 1001), (151936 // 16, 64)]


def check_residual_transpose(backend: Backend, rng, quick: bool) -> Tally:
    """A bit copy: random bit patterns (NaN payloads, signalling NaNs, -0, subnormals) must survive."""
    tally = Tally()
    for rows, cols in _sizes(backend, quick, TRANSPOSE_SHAPES_QUICK, TRANSPOSE_SHAPES_FULL):
        x = _random_bits(rng, (rows, cols))
        got = residual_op.transpose(backend, backend.asarray(x))
        tally.add(backend.to_numpy(got), residual_op.transpose_reference(x))
    return tally


BACKWARD_OP_CHECKS: list[tuple[str, Callable]] = [
    ("norm.rmsnorm_backward", check_norm_rmsnorm_backward),
    ("activation.swiglu_backward", check_activation_swiglu_backward),
    ("rope.backward", check_rope_backward),
    ("residual.transpose", check_residual_transpose),
]
