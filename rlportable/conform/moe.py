"""Conformance of the moe family (contracts/moe.toml): route, combine and the whole block against the
reference, and the contract's invariances (a token alone and in a batch, any token order, any order of
the k experts, any grouping of tokens by expert), bitwise.

The family is reference only (no kernels yet), so on a device backend every check compares nothing and
says so in its message rather than running the host reference in the device's place."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.inputs import ROW_KINDS, random_rows
from rlportable.conform.tally import Tally
from rlportable.contract import moe as moe_ref
from rlportable.ops import moe as moe_op
from rlportable.runtime.base import Backend

ROUTE_SHAPES = [(1, 1, 1), (7, 8, 2), (33, 128, 8), (5, 60, 60)]  # (tokens, experts, k)


def _not_run(backend: Backend) -> Tally | None:
    if backend.runs_reference:
        return None
    tally = Tally()
    tally.message = f"moe: not run on {backend.label}: the family has no kernels yet (contracts/moe.toml)"
    return tally


def _same_rows_alone(tally: Tally, function, rows: np.ndarray, whole: tuple) -> None:
    """Each row's outputs of function(rows[t:t+1]) against its row of the whole batch's outputs."""
    for t in range(rows.shape[0]):
        for got, want in zip(function(rows[t:t + 1]), whole):
            tally.add(got[0], want[t])


def check_moe_route(backend: Backend, rng, quick: bool) -> Tally:
    tally = _not_run(backend)
    if tally is not None:
        return tally
    tally = Tally()
    for tokens, experts, k in ROUTE_SHAPES:
        for kind in ROW_KINDS:
            logits = random_rows(rng, tokens, experts, kind)
            if kind == "normal" and experts > 1:  # ties: repeated logits, and +0 against -0
                logits[:, 1::3] = logits[:, :1]
                logits[0, :2] = (0.0, -0.0)
            for norm in (False, True):
                got = moe_op.route(backend, backend.asarray(logits), k, norm)
                want = moe_ref.route(logits, k, norm)
                tally.add_outputs(backend, got, want)
                _same_rows_alone(tally, lambda rows: moe_ref.route(rows, k, norm), logits, want)
                order = rng.permutation(tokens)
                for got_part, want_part in zip(moe_ref.route(logits[order], k, norm), want):
                    tally.add(got_part, want_part[order])
    return tally


def check_moe_combine(backend: Backend, rng, quick: bool) -> Tally:
    tally = _not_run(backend)
    if tally is not None:
        return tally
    tally = Tally()
    for tokens, k, hidden in ((1, 1, 1), (7, 2, 13), (33, 8, 64)):
        for kind in ROW_KINDS:
            outputs = random_rows(rng, tokens * k, hidden, kind).reshape(tokens, k, hidden)
            weights = rng.random((tokens, k)).astype(np.float32)
            weights[rng.random((tokens, k)) < 0.1] = 0.0  # underflowed experts contribute nothing
            want = moe_ref.combine(weights, outputs)
            tally.add(backend.to_numpy(moe_op.combine(backend, backend.asarray(weights), backend.asarray(outputs))),
                      want)
            slots = rng.permutation(k)  # the order of a token's experts
            tally.add(moe_ref.combine(weights[:, slots], outputs[:, slots]), want)
            _same_rows_alone(tally, lambda rows, o=outputs, w=weights: (moe_ref.combine(w[rows], o[rows]),),
                             np.arange(tokens), (want,))
    return tally


def random_block(rng, hidden: int = 24, inner: int = 16, experts: int = 6, scale: float = 0.3):
    """A random sparse layer's weights: router [E, H] and per expert gate, up [I, H], down [H, I]."""
    def matrix(n, k):
        return (rng.standard_normal((n, k)) * scale).astype(np.float32)

    return (matrix(experts, hidden), [matrix(inner, hidden) for _ in range(experts)],
            [matrix(inner, hidden) for _ in range(experts)], [matrix(hidden, inner) for _ in range(experts)])


def check_moe_block(backend: Backend, rng, quick: bool) -> Tally:
    tally = _not_run(backend)
    if tally is not None:
        return tally
    tally = Tally()
    router, gate, up, down = random_block(rng)
    for tokens, k, norm in ((1, 1, False), (9, 2, True), (40, 3, False)):
        h = rng.standard_normal((tokens, router.shape[1])).astype(np.float32)
        weight = moe_op.encode(backend, backend.asarray(router), gate, up, down, k, norm)
        want = moe_ref.moe_block(h, router, gate, up, down, k, norm)
        tally.add_outputs(backend, moe_op.block(backend, backend.asarray(h), weight), want)
        order = rng.permutation(tokens)
        for got_part, want_part in zip(moe_ref.moe_block(h[order], router, gate, up, down, k, norm), want):
            tally.add(got_part, want_part[order])
        _same_rows_alone(tally, lambda rows: moe_ref.moe_block(rows, router, gate, up, down, k, norm), h, want)
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

# No golden digests yet: a device has no MoE kernels to reproduce them with.
GOLDEN_CASES = Cases("moe")
