"""Conformance of the moe family (contracts/moe.toml): route, combine and the whole block, and their
backward ops (route_backward, combine_backward, block_backward), against the reference, and the
contract's invariances (a token alone and in a batch, any token order, any order of
the k experts, any grouping of tokens by expert), bitwise.

On a device the invariances are checked on the device's own results (route and combine and their
backward run the family's kernels, the block and its backward the gemm, activation and embedding
kernels between them)."""

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


def _route_backward(backend: Backend, logits, experts, weights, d_weights, norm: bool) -> np.ndarray:
    put = backend.asarray
    return backend.to_numpy(moe_op.route_backward(backend, put(logits), put(experts), put(weights), put(d_weights),
                                                  norm))


def check_moe_route_backward(backend: Backend, rng, quick: bool) -> Tally:
    """route_backward from route's own outputs on every row kind (undefined rows included), upstream rows
    of every kind, some all zero (a token not trained on) and some non-finite; each row alone, the rows
    permuted, a row's k slots permuted."""
    tally = Tally()
    for tokens, experts, k in ROUTE_SHAPES:
        for kind in ROW_KINDS:
            logits = random_rows(rng, tokens, experts, kind)
            if kind == "normal" and experts > 1:  # ties
                logits[:, 1::3] = logits[:, :1]
            for norm in (False, True):
                chosen, weights = moe_ref.route(logits, k, norm)
                d_weights = random_rows(rng, tokens, k, "normal" if kind != "special" else "nonfinite")
                d_weights[rng.random(tokens) < 0.2] = 0.0
                want = moe_ref.route_backward(logits, chosen, weights, d_weights, norm)
                tally.add(_route_backward(backend, logits, chosen, weights, d_weights, norm), want)
                _same_rows_alone(tally, lambda rows: (_route_backward(backend, logits[rows], chosen[rows],
                                                                      weights[rows], d_weights[rows], norm),),
                                 np.arange(tokens), (want,))
                order, slots = rng.permutation(tokens), rng.permutation(k)
                tally.add(_route_backward(backend, *(np.ascontiguousarray(a[order][:, slots]) if a is not logits
                                                     else np.ascontiguousarray(a[order])
                                                     for a in (logits, chosen, weights, d_weights)), norm),
                          want[order])
    return tally


def _combine_backward(backend: Backend, d_out, weights, outputs) -> tuple:
    put = backend.asarray
    return tuple(backend.to_numpy(x) for x in moe_op.combine_backward(backend, put(d_out), put(weights),
                                                                      put(outputs)))


def check_moe_combine_backward(backend: Backend, rng, quick: bool) -> Tally:
    """combine_backward on outputs and upstream rows of every kind, some weights 0 (removed slots);
    each row alone and a row's k slots permuted."""
    tally = Tally()
    for tokens, k, hidden in ((1, 1, 1), (7, 2, 13), (33, 8, 64), (3, 2, 300)):
        for kind in ROW_KINDS:
            outputs = random_rows(rng, tokens * k, hidden, kind).reshape(tokens, k, hidden)
            d_out = random_rows(rng, tokens, hidden, kind if kind != "special" else "normal")
            weights = rng.random((tokens, k)).astype(np.float32)
            weights[rng.random((tokens, k)) < 0.1] = 0.0
            want = moe_ref.combine_backward(d_out, weights, outputs)
            for got_part, want_part in zip(_combine_backward(backend, d_out, weights, outputs), want):
                tally.add(got_part, want_part)
            slots = rng.permutation(k)
            got = _combine_backward(backend, d_out, np.ascontiguousarray(weights[:, slots]),
                                    np.ascontiguousarray(outputs[:, slots]))
            tally.add(got[0], want[0][:, slots])
            tally.add(got[1], want[1][:, slots])
            _same_rows_alone(tally, lambda rows: _combine_backward(backend, d_out[rows], weights[rows], outputs[rows]),
                             np.arange(tokens), want)
    return tally


def _block_backward(backend: Backend, h, d_out, weights: tuple, k: int, norm: bool) -> list:
    """[d_h, d_router, d_logits, d_weights, d_gate..., d_up..., d_down...] as host arrays."""
    router, gate, up, down = weights
    put = backend.asarray
    got = moe_op.block_backward(backend, put(h), put(router), [put(w) for w in gate], [put(w) for w in up],
                                [put(w) for w in down], k, norm, put(d_out))
    return [backend.to_numpy(x) for x in (got.d_h, got.d_router, got.d_logits, got.d_weights,
                                          *got.d_gate, *got.d_up, *got.d_down)]


def check_moe_block_backward(backend: Backend, rng, quick: bool) -> Tally:
    """block_backward against the reference: k = 1, 2, 3 (and k = E), norm_topk_prob both ways, no token,
    one token, experts without a token, a non-finite h row and an upstream row of zeros; the tokens
    permuted (d_h, d_logits and d_weights permute, the weight gradients keep their bits)."""
    tally = Tally()
    weights = random_block(rng, scale=1.0)
    experts = weights[0].shape[0]
    for tokens, k, norm in ((0, 2, True), (1, 1, False), (3, 1, True), (9, 2, True), (12, 3, False),
                            (5, experts, True)):
        h = rng.standard_normal((tokens, weights[0].shape[1])).astype(np.float32)
        d_out = rng.standard_normal(h.shape).astype(np.float32)
        if tokens > 4:
            h[2, 3] = np.nan
            d_out[4] = 0.0
        want = moe_ref.moe_block_backward(h, *weights, k, norm, d_out)
        want = [want.d_h, want.d_router, want.d_logits, want.d_weights, *want.d_gate, *want.d_up, *want.d_down]
        for got_part, want_part in zip(_block_backward(backend, h, d_out, weights, k, norm), want):
            tally.add(got_part, want_part)
        if tokens > 1 and not np.isnan(h).any():
            order = rng.permutation(tokens)
            got = _block_backward(backend, np.ascontiguousarray(h[order]), np.ascontiguousarray(d_out[order]),
                                  weights, k, norm)
            for index, (got_part, want_part) in enumerate(zip(got, want)):
                tally.add(got_part, want_part[order] if index in (0, 2, 3) else want_part)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("moe.route", check_moe_route),
    ("moe.combine", check_moe_combine),
    ("moe.block", check_moe_block),
    ("moe.route_backward", check_moe_route_backward),
    ("moe.combine_backward", check_moe_combine_backward),
    ("moe.block_backward", check_moe_block_backward),
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


@GOLDEN_CASES.case("route_backward", seed=62, shapes=[[1, 1], [7, 8], [33, 128]], top_k=[1, 2, 8],
                   kinds=STREAM_ROW_KINDS)
def _golden_route_backward(backend, s, r):
    out = []
    for i, (shape, k) in enumerate(zip(r["shapes"], r["top_k"])):
        for kind in r["kinds"]:
            z = backend.asarray(s.floats(shape, kind))
            d_weights = backend.asarray(s.floats([shape[0], k], "uniform"))
            for norm in (False, True):
                experts, weights = moe_op.route(backend, z, k, norm)
                d_logits = moe_op.route_backward(backend, z, experts, weights, d_weights, norm)
                out.append((f"{i}.{kind}.{int(norm)}", host(backend, d_logits)))
    return out


@GOLDEN_CASES.case("combine_backward", seed=63, shapes=[[1, 1, 1], [7, 2, 13], [33, 8, 64]], kinds=STREAM_ROW_KINDS)
def _golden_combine_backward(backend, s, r):
    out = []
    for i, (tokens, k, hidden) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            weights = backend.asarray(np.abs(s.floats([tokens, k], "uniform")))
            outputs = backend.asarray(s.floats([tokens * k, hidden], kind).reshape(tokens, k, hidden))
            d_out = backend.asarray(s.floats([tokens, hidden], "uniform"))
            d_weights, d_outputs = moe_op.combine_backward(backend, d_out, weights, outputs)
            out += [(f"{i}.{kind}.d_outputs", host(backend, d_outputs)), (f"{i}.{kind}.d_weights", host(backend, d_weights))]
    return out
