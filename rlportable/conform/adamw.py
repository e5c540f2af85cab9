"""Conformance of the adamw family (contracts/adamw.toml): the exact global norm and several steps of the
whole optimiser (clip factor and update) over gradients of every class of value, bitwise against the
reference; and its golden cases."""

from __future__ import annotations

from typing import Callable

import numpy as np

from rlportable.conform.golden_case import Cases
from rlportable.conform.golden_digest import host
from rlportable.conform.golden_stream import STREAM_ROW_KINDS
from rlportable.conform.tally import Tally
from rlportable.contract import adamw as ref
from rlportable.ops import adamw as adamw_op
from rlportable.runtime.base import Backend

GRAD_KINDS = ("normal", "zeros", "subnormal", "huge", "mixed", "nan", "inf")


def _tensor(rng, shape, kind: str) -> np.ndarray:
    n = int(np.prod(shape))
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        x[:] = 0.0
        x[rng.random(n) < 0.5] = -0.0
    elif kind == "subnormal":
        x = (rng.integers(-(1 << 23) + 1, 1 << 23, n).astype(np.float64) * 2.0**-149).astype(np.float32)
    elif kind == "huge":
        x = (np.clip(x, -3.0, 3.0) * np.float32(1e38)).astype(np.float32)
        x[rng.random(n) < 0.05] = np.float32(3.4e38)
    elif kind == "mixed":
        scale = np.float32(2.0) ** rng.integers(-140, 120, n).astype(np.float32)
        x = (x * scale).astype(np.float32)
        x[rng.random(n) < 0.1] = 0.0
    elif kind == "nan" and n:
        x[rng.integers(0, n)] = np.float32(np.nan)
    elif kind == "inf" and n:
        x[rng.integers(0, n)] = np.float32(-np.inf)
    return x.reshape(shape)


def _shapes(rng, quick: bool):
    shapes = [(1,), (7, 13), (0,), (3, 64), (1000,)]
    if not quick:
        shapes += [(257, 129), (ref.NORM_CHUNK + 17,)]
    return shapes


def check_adamw_norm(backend: Backend, rng, quick: bool) -> Tally:
    """The exact global norm alone, on mixed tensor lists (several chunks, every class of value)."""
    tally = Tally()
    big = ref.NORM_CHUNK * (1 if quick else 3) + 5
    for kind in GRAD_KINDS:
        grads = [_tensor(rng, (big,), kind), _tensor(rng, (7, 13), "mixed"), _tensor(rng, (0,), "normal")]
        norm = adamw_op.global_norm(backend, [backend.asarray(g) for g in grads])
        tally.add(np.array([norm]), np.array([ref.global_norm(grads)]))
    return tally


def check_adamw_steps(backend: Backend, rng, quick: bool) -> Tally:
    """Several steps of the whole optimiser (clip factor + update) against the reference, bitwise."""
    tally = Tally()
    hypers = [ref.Hyper(lr=1e-3, weight_decay=0.01, max_norm=1.0),
              ref.Hyper(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, max_norm=None),
              ref.Hyper(lr=1e-4, weight_decay=0.0, max_norm=1e-3)]
    steps = 3 if quick else 6
    for kind in GRAD_KINDS:
        for hyper in hypers:
            shapes = _shapes(rng, quick)
            params = [_tensor(rng, s, "normal" if kind in ("nan", "inf") else kind) for s in shapes]
            m_ref = [np.zeros(s, np.float32) for s in shapes]
            v_ref = [np.zeros(s, np.float32) for s in shapes]
            p_ref = [p.copy() for p in params]
            p_dev = [backend.asarray(p) for p in params]
            m_dev = [backend.asarray(x) for x in m_ref]
            v_dev = [backend.asarray(x) for x in v_ref]
            for step in range(1, steps + 1):
                grads = [_tensor(rng, s, kind) for s in shapes]
                lr = ref.lr_at(step, hyper.lr, warmup=2, total=steps)
                c_ref = ref.clip_factor(grads, hyper.max_norm)
                p_ref, m_ref, v_ref = ref.adamw_step(p_ref, grads, m_ref, v_ref, step, hyper, lr)
                info = adamw_op.adamw_step(backend, p_dev, [backend.asarray(g) for g in grads], m_dev, v_dev,
                                           step, hyper, lr)
                tally.add(np.array([info.clip]), np.array([c_ref]))
                for dev, want in zip(p_dev + m_dev + v_dev, p_ref + m_ref + v_ref):
                    tally.add(backend.to_numpy(dev), want)
    return tally


CHECKS: list[tuple[str, Callable]] = [
    ("adamw.norm", check_adamw_norm),
    ("adamw.steps", check_adamw_steps),
]


# ---- golden

GOLDEN_CASES = Cases("adamw")
GOLDEN_ADAMW_SHAPES = [[1], [7, 13], [0], [3, 64], [1000]]
GOLDEN_ADAMW_HYPERS = [{"lr": 1e-3, "weight_decay": 0.01, "max_norm": 1.0},
                       {"lr": 3e-2, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "max_norm": None},
                       {"lr": 1e-4, "weight_decay": 0.0, "max_norm": 1e-3}]


def _stream_tensors(s, shapes, kind: str) -> list[np.ndarray]:
    return [s.floats(shape, kind) for shape in shapes]


@GOLDEN_CASES.case("global_norm", seed=90, shapes=GOLDEN_ADAMW_SHAPES + [[300000]], kinds=STREAM_ROW_KINDS + ["bits"])
def _adamw_global_norm(backend, s, r):
    return [(f"{kind}.norm", np.array([adamw_op.global_norm(backend, [backend.asarray(g) for g in
                                                                     _stream_tensors(s, r["shapes"], kind)])],
                                      np.float64))
            for kind in r["kinds"]]


@GOLDEN_CASES.case("steps", seed=91, shapes=GOLDEN_ADAMW_SHAPES, hypers=GOLDEN_ADAMW_HYPERS, steps=3, warmup=2,
                   grad_kinds=["uniform", "tiny", "huge", "zeros", "nonfinite"], params="uniform",
                   schedule="lr = contract.adamw.lr_at(step, hyper lr, warmup, steps)")
def _adamw_steps(backend, s, r):
    out = []
    for h, fields in enumerate(r["hypers"]):
        hyper = ref.Hyper(**fields)
        for kind in r["grad_kinds"]:
            params = [backend.asarray(p) for p in _stream_tensors(s, r["shapes"], "uniform")]
            m = [backend.zeros(tuple(shape), np.float32) for shape in r["shapes"]]
            v = [backend.zeros(tuple(shape), np.float32) for shape in r["shapes"]]
            for step in range(1, r["steps"] + 1):
                grads = [backend.asarray(g) for g in _stream_tensors(s, r["shapes"], kind)]
                lr = ref.lr_at(step, hyper.lr, r["warmup"], r["steps"])
                info = adamw_op.adamw_step(backend, params, grads, m, v, step, hyper, lr)
                tag = f"{h}.{kind}.{step}"
                out.append((f"{tag}.lr_norm_clip", np.array([info.lr, info.norm, info.clip], np.float64)))
                for name, tensors in (("p", params), ("m", m), ("v", v)):
                    out += [(f"{tag}.{name}{j}", host(backend, t)) for j, t in enumerate(tensors)]
    return out
