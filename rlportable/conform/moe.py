"""Conformance of the moe family (contracts/moe.toml): route, combine and the whole block against the
reference, and the contract's invariances (a token alone and in a batch, any token order, any order of
the k experts, any grouping of tokens by expert), bitwise.

On a device the invariances are checked on the device's own results (route and combine run the family's
kernels, the block the gemm kernels between them)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.conform.tally import Tally
from rlportable.contract import moe as moe_ref
from rlportable.ops import moe as moe_op
from rlportable.runtime.base import Backend

ROUTE_SHAPES = [(1, 1, 1), (7, 8, 2), (33, 128, 8), (5, 60, 60)]  # (tokens, experts, k)


def _same_rows_alone(tally: Tally, function, rows: np.ndarray, whole: tuple) -> None:
    """Each row's outputs of function(rows[t:t+1]) against its row of the whole batch's outputs."""
    for t in range(rows.shape[0]):
        for got, want in zip(function(rows[t:t + 1]), whole):
            tally.add(got[0], want[t])


def _route(backend: Backend, logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    return tuple(backend.to_numpy(x) for x in moe_op.route(backend, backend.asarray(logits), k, norm))


def check_moe_route(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for tokens, experts, k in ROUTE_SHAPES:
        for kind in ROW_KINDS:
            logits = random_rows(rng, tokens, experts, kind)
            if kind == "normal" and experts > 1:  # ties: repeated logits, and +0 against -0
                logits[:, 1::3] = logits[:, :1]
                logits[0, :2] = (0.0, -0.0)
            for norm in (False, True):
                want = moe_ref.route(logits, k, norm)
                for got_part, want_part in zip(_route(backend, logits, k, norm), want):
                    tally.add(got_part, want_part)
                _same_rows_alone(tally, lambda rows: _route(backend, rows, k, norm), logits, want)
                order = rng.permutation(tokens)
                for got_part, want_part in zip(_route(backend, np.ascontiguousarray(logits[order]), k, norm), want):
                    tally.add(got_part, want_part[order])
    return tally


def _combine(backend: Backend, weights: np.ndarray, outputs: np.ndarray) -> np.ndarray:
    return backend.to_numpy(moe_op.combine(backend, backend.asarray(weights), backend.asarray(outputs)))


def check_moe_combine(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    for tokens, k, hidden in ((1, 1, 1), (7, 2, 13), (33, 8, 64)):
        for kind in ROW_KINDS:
            outputs = random_rows(rng, tokens * k, hidden, kind).reshape(tokens, k, hidden)
            weights = rng.random((tokens, k)).astype(np.float32)
            weights[rng.random((tokens, k)) < 0.1] = 0.0  # underflowed experts contribute nothing
            want = moe_ref.combine(weights, outputs)
            tally.add(_combine(backend, weights, outputs), want)
            slots = rng.permutation(k)  # the order of a token's experts
            tally.add(_combine(backend, np.ascontiguousarray(weights[:, slots]),
                               np.ascontiguousarray(outputs[:, slots])), want)
            _same_rows_alone(tally, lambda rows, o=outputs, w=weights: (_combine(backend, w[rows], o[rows]),),
                             np.arange(tokens), (want,))
    return tally


def random_block(rng, hidden: int = 24, inner: int = 16, experts: int = 6, scale: float = 0.3):
    """A random sparse layer's weights: router [E, H] and per expert gate, up [I, H], down [H, I]."""
    def matrix(n, k):
        return (rng.standard_normal((n, k)) * scale).astype(np.float32)

    return (matrix(experts, hidden), [matrix(inner, hidden) for _ in range(experts)],
            [matrix(inner, hidden) for _ in range(experts)], [matrix(hidden, inner) for _ in range(experts)])


def check_moe_block(backend: Backend, rng, quick: bool) -> Tally:
    tally = Tally()
    router, gate, up, down = random_block(rng)
    device = [[backend.asarray(w) for w in ws] for ws in (gate, up, down)]
    for tokens, k, norm in ((1, 1, False), (9, 2, True), (40, 3, False)):
        h = rng.standard_normal((tokens, router.shape[1])).astype(np.float32)
        weight = moe_op.encode(backend, backend.asarray(router), *device, k, norm)

        def block(rows, weight=weight):
            return tuple(backend.to_numpy(x) for x in moe_op.block(backend, backend.asarray(rows), weight))

        want = moe_ref.moe_block(h, router, gate, up, down, k, norm)
        for got_part, want_part in zip(block(h), want):
            tally.add(got_part, want_part)
        order = rng.permutation(tokens)
        for got_part, want_part in zip(block(np.ascontiguousarray(h[order])), want):
            tally.add(got_part, want_part[order])
        _same_rows_alone(tally, block, h, want)
        # any grouping of the (token, expert) pairs into products gives the expert outputs' bits
        experts = want[1]
        grouped = moe_ref.expert_outputs(h, experts, gate, up, down)
        for group_rows in (1, 2, 5):
            tally.add(moe_ref.expert_outputs(h, experts, gate, up, down, order=rng.permutation(tokens * k),
                                             group_rows=group_rows), grouped)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("moe.route", check_moe_route),
    ("moe.combine", check_moe_combine),
    ("moe.block", check_moe_block),
]

GOLDEN_CASES = Cases("moe")


@GOLDEN_CASES.case("route", seed=60, shapes=[[1, 1], [7, 8], [33, 128], [5, 60]], top_k=[1, 2, 8, 60],
                   kinds=STREAM_ROW_KINDS)
def _golden_route(backend, s, r):
    out = []
    for i, (shape, k) in enumerate(zip(r["shapes"], r["top_k"])):
        for kind in r["kinds"]:
            z = backend.asarray(s.floats(shape, kind))
            for norm in (False, True):
                experts, weights = moe_op.route(backend, z, k, norm)
                out += [(f"{i}.{kind}.{int(norm)}.experts", host(backend, experts)),
                        (f"{i}.{kind}.{int(norm)}.weights", host(backend, weights))]
    return out


@GOLDEN_CASES.case("combine", seed=61, shapes=[[1, 1, 1], [7, 2, 13], [33, 8, 64]], kinds=STREAM_ROW_KINDS)
def _golden_combine(backend, s, r):
    out = []
    for i, (tokens, k, hidden) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            weights = backend.asarray(np.abs(s.floats([tokens, k], "uniform")))
            outputs = backend.asarray(s.floats([tokens * k, hidden], kind).reshape(tokens, k, hidden))
            out.append((f"{i}.{kind}", host(backend, moe_op.combine(backend, weights, outputs))))
    return out
