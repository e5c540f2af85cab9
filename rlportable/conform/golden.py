"""Golden digests: SHA-256 digests of canonical outputs, computed by the
NumPy reference and committed under conformance/golden/, that every backend must reproduce.

A run on an H100 and a run on an MI300X that both reproduce the committed digests agree with each
other through the reference, even when they never meet. Each digest covers one contract op (forward
and backward, every kernel family) or one end-to-end result (a model's packed log-probs, the
engine's tokens and log-probs, a training step's gradients and updated weights) on canonical
inputs: a recipe (seed, shapes, parameters) that rebuilds them exactly.

Canonical inputs come from a SplitMix64 stream (`Stream`: value i of seed s is splitmix64's output
for the state s + (i + 1) * 0x9E3779B97F4A7C15 mod 2^64, consumed in the order the case draws),
turned into float32 by exact constructions only (a 24-bit integer times a power of two, raw bit
patterns, constants), never by NumPy's random generators or float arithmetic, so the inputs are
the same on any machine and NumPy release. Exceptions, named in their recipes: the Qwen3-0.6B-shaped
model's weights are `rlportable.model.synthetic.random_weights(config, seed)` and the tiny model's
are `tiny_model()`'s (NumPy normal streams, pinned by tests/test_tiny_model.py for the tiny model).

Digest of a case: SHA-256 over its outputs in the case's order, each as the ASCII header
"<name> <dtype> <d0,d1,...>\\n" (dtype as NumPy writes it, little-endian: <f4, <i4, |i1, <f8; the
sizes joined by commas, empty for a scalar) followed by the array's raw bytes in C order. Integer
outputs are widened or narrowed to their canonical dtype first (values unchanged); float outputs
are digested as returned. The first 16 hex digits of each output's own SHA-256 (of the same
header and bytes) are stored too, so a failure names the first output that differs.

`rlportable conform --write-golden` (cpu only) rewrites the files; `rlportable conform` on any
backend recomputes every case there and reports one check per digest ("golden.<group>.<case>"):
compared = the elements the digest covers, mismatches = the elements of the outputs whose
digests differ (a digest cannot say which elements), with a one-line message naming the digest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from rlportable.conform.inputs import SPECIAL_VALUES
from rlportable.conform.tally import Settings, SettingsCheck, Tally
from rlportable.contract import elementwise as elementwise_ref, rope as rope_ref
from rlportable.contract.adamw import Hyper, lr_at
from rlportable.errors import RlpError
from rlportable.ops import (
    activation, adamw, attention, elementwise, embedding, fixedpoint, gemm, logprob, norm, residual, rope, rowsum,
    sampling,
)
from rlportable.runtime.base import Backend

FORMAT = "rlportable-golden-v1"
DIGEST_RULE = ("sha256 over the outputs in order, each as the ASCII header '<name> <dtype> <d0,d1,...>\\n' "
               "(NumPy dtype string, little-endian) then its raw C-order bytes; integer outputs in their "
               "canonical dtype")
INPUT_RULE = ("rlportable.conform.golden.Stream(seed): SplitMix64 values drawn in the case's order, made "
              "into float32 by exact constructions (24-bit integers times powers of two, raw bit patterns)")
REGENERATE = "rlportable conform --device cpu --write-golden"


# ----------------------------------------------------------------------------- canonical inputs

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(seed: int, start: int, count: int) -> np.ndarray:
    """uint64 [count]: splitmix64 outputs number start .. start + count - 1 of the stream `seed`."""
    index = np.arange(start + 1, start + count + 1, dtype=np.uint64)
    z = np.uint64(seed) + index * _GAMMA  # uint64 arrays wrap modulo 2^64
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


class Stream:
    """The canonical inputs of one case: every draw takes the next values of one splitmix64 stream."""

    def __init__(self, seed: int):
        self.seed, self.used = int(seed), 0

    def u64(self, count: int) -> np.ndarray:
        values = splitmix64(self.seed, self.used, int(count))
        self.used += int(count)
        return values

    def ints(self, shape, low: int, high: int, dtype=np.int32) -> np.ndarray:
        """Integers in [low, high) (value mod the range: a tiny bias, but the same everywhere)."""
        count = int(np.prod(shape, dtype=np.int64))
        values = (self.u64(count) % np.uint64(high - low)).astype(np.int64) + low
        return values.astype(dtype).reshape(shape)

    def permutation(self, n: int) -> np.ndarray:
        return np.argsort(self.u64(n), kind="stable").astype(np.int64)

    def _int24(self, count: int) -> np.ndarray:
        return (self.u64(count) >> np.uint64(40)).astype(np.int64) - (1 << 23)

    def floats(self, shape, kind: str = "uniform") -> np.ndarray:
        """float32 of one kind, every value exact:
        uniform   m * 2^-22 for a 24-bit signed integer m: [-2, 2)
        logits    m * 2^-20: [-8, 8)
        massive   uniform, one column (per matrix) times 2^15, as LLM activations have
        tiny      m * 2^-149 for 23-bit m: subnormals
        huge      m * 2^104: up to 2^127, near FLT_MAX
        zeros     +0 and -0
        special   uniform, a quarter replaced by conform.inputs.SPECIAL_VALUES
        nonfinite uniform, one NaN / +inf / -inf in every other row
        bits      uniformly random float32 bit patterns (NaN payloads, infinities, subnormals)"""
        shape = tuple(int(d) for d in shape)
        count = int(np.prod(shape, dtype=np.int64))
        if kind == "bits":
            return (self.u64(count) >> np.uint64(32)).astype(np.uint32).view(np.float32).reshape(shape)
        exponent = {"uniform": -22, "logits": -20, "massive": -22, "special": -22, "nonfinite": -22,
                    "tiny": -149, "huge": 104, "zeros": 0}
        if kind not in exponent:
            raise ValueError(f"unknown input kind {kind!r}")
        m = self._int24(count)
        if kind == "tiny":
            m >>= 1
        x = np.ldexp(m.astype(np.float64), exponent[kind]).astype(np.float32).reshape(shape)
        if kind == "zeros":
            x = np.where(m.reshape(shape) < 0, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        rows = x.reshape(-1, shape[-1]) if x.ndim and shape[-1] else None
        if kind == "massive" and rows is not None and rows.size:
            rows[:, int(self.ints((), 0, shape[-1]))] *= np.float32(2.0**15)
        if kind == "special" and count:
            pick = self.u64(count)
            replace = (pick & np.uint64(3)) == 0
            values = SPECIAL_VALUES[((pick >> np.uint64(2)) % np.uint64(SPECIAL_VALUES.size)).astype(np.int64)]
            x.reshape(-1)[replace] = values[replace]
        if kind == "nonfinite" and rows is not None and rows.size:
            specials = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
            for row in range(0, rows.shape[0], 2):
                rows[row, int(self.ints((), 0, shape[-1]))] = specials[row // 2 % 3]
        return x


# ----------------------------------------------------------------------------- digests

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


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    group: str      # the file conformance/golden/<group>.json
    name: str       # the digest's name within the group
    recipe: dict    # JSON: seed, shapes, parameters
    compute: Callable  # compute(backend, stream, recipe) -> [(output name, host array)] in canonical order
    expensive: bool = False  # skipped by --quick

    @property
    def check_name(self) -> str:
        return f"golden.{self.group}.{self.name}"

    def outputs(self, backend: Backend) -> list[tuple[str, np.ndarray]]:
        return self.compute(backend, Stream(self.recipe["seed"]), self.recipe)


CASES: list[Case] = []


def _case(group: str, name: str, expensive: bool = False, **recipe):
    def register(compute):
        CASES.append(Case(group, name, json.loads(json.dumps(recipe)), compute, expensive))
        return compute

    return register


def _host(backend: Backend, array, dtype: str | None = None) -> np.ndarray:
    """A host COPY: on cpu to_numpy returns the array itself, which a later in-place update (AdamW's
    next step) would change after it was recorded; a device's to_numpy copies."""
    return canonical(np.array(backend.to_numpy(array), copy=True), dtype)


# ---- fixedpoint, gemm, rowsum, elementwise

ROW_KINDS = ["uniform", "massive", "tiny", "huge", "zeros", "special", "nonfinite"]


@_case("fixedpoint", "encode_rows", seed=1, shapes=[[1, 1], [7, 13], [4, 100], [3, 0]], kinds=ROW_KINDS,
       bits_descending=[[23, False], [15, True], [53, False], [9, False]])
def _fixedpoint_encode_rows(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x = backend.asarray(s.floats(shape, kind))
            for bits, descending in r["bits_descending"]:
                encoded = fixedpoint.encode_rows(backend, x, bits, descending)
                tag = f"{i}.{kind}.{bits}{'d' if descending else ''}"
                out += [(f"{tag}.exponents", _host(backend, encoded.exponents, "int32")),
                        (f"{tag}.digits", _host(backend, encoded.digits, "int8"))]
    return out


def _gemm_outputs(backend, s, shapes, kinds, bits_a, bits_w):
    out = []
    for i, (m, k, n) in enumerate(shapes):
        for kind in kinds:
            x = s.floats((m, k), kind)
            w = s.floats((n, k), "uniform" if kind == "nonfinite" else kind)
            if kind == "uniform" and n and k:
                w[n // 2, k // 2] = np.float32(np.nan)  # a non-finite weight row: its output column is NaN
            weight = gemm.encode_weight(backend, backend.asarray(w), bits_w)
            out.append((f"{i}.{kind}.y", _host(backend, gemm.gemm(backend, backend.asarray(x), weight, bits_a))))
    return out


@_case("gemm", "gemm", seed=2, shapes=[[1, 1, 1], [7, 13, 5], [17, 257, 33], [64, 1024, 96], [5, 0, 3]],
       kinds=ROW_KINDS, bits_a=23, bits_w=15)
def _gemm_default_bits(backend, s, r):
    return _gemm_outputs(backend, s, r["shapes"], r["kinds"], r["bits_a"], r["bits_w"])


@_case("gemm", "other_bits", seed=3, shapes=[[7, 13, 5], [17, 257, 33]], kinds=["uniform", "massive", "special"],
       bits=[[15, 15], [22, 15], [8, 8], [31, 15]])
def _gemm_other_bits(backend, s, r):
    out = []
    for bits_a, bits_w in r["bits"]:
        out += [(f"{bits_a}x{bits_w}.{name}", y)
                for name, y in _gemm_outputs(backend, s, r["shapes"], r["kinds"], bits_a, bits_w)]
    return out


@_case("rowsum", "rowsum", seed=4, shapes=[[1, 1], [7, 13], [5, 1000], [3, 0]], kinds=ROW_KINDS, bits=[38, 24])
def _rowsum(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x = backend.asarray(s.floats(shape, kind))
            out += [(f"{i}.{kind}.{bits}", _host(backend, rowsum.rowsum(backend, x, bits))) for bits in r["bits"]]
    return out


def _elementwise(name: str):
    def compute(backend, s, r):
        random_bits = (s.u64(r["random_inputs"]) >> np.uint64(32)).astype(np.uint32)
        x = np.concatenate([elementwise_ref.edge_inputs(), random_bits])
        return [("y", _host(backend, elementwise.apply(backend, name, backend.asarray(x.view(np.float32)))))]

    compute.__name__ = f"_elementwise_{name}"
    return compute


_case("elementwise", "exp_f32", seed=5, inputs="the contract's edge_inputs() then random bit patterns",
      random_inputs=1 << 16)(_elementwise("exp"))
_case("elementwise", "log_f32", seed=6, inputs="the contract's edge_inputs() then random bit patterns",
      random_inputs=1 << 16)(_elementwise("log"))


# ---- forward and backward ops

@_case("norm", "rmsnorm", seed=10, shapes=[[1, 1], [7, 13], [17, 257], [9, 1024], [5, 0], [0, 8]],
       kinds=ROW_KINDS, weights=["uniform", "special"], eps=[1e-6, 0.0])
def _norm_rmsnorm(backend, s, r):
    out = []
    for i, (rows, h) in enumerate(r["shapes"]):
        weights = [backend.asarray(s.floats((h,), kind)) for kind in r["weights"]]
        for kind in r["kinds"]:
            x = backend.asarray(s.floats((rows, h), kind))
            for w_kind, w in zip(r["weights"], weights):
                for eps in r["eps"]:
                    out.append((f"{i}.{kind}.{w_kind}.{eps}.y", _host(backend, norm.rmsnorm(backend, x, w, eps))))
    return out


@_case("norm", "rmsnorm_heads", seed=11, shapes=[[1, 1, 128], [7, 5, 64], [33, 16, 128]],
       kinds=["uniform", "massive", "special"], eps=1e-6)
def _norm_rmsnorm_heads(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        w = backend.asarray(s.floats(shape[-1:], "uniform"))
        for kind in r["kinds"]:
            y = norm.rmsnorm_heads(backend, backend.asarray(s.floats(shape, kind)), w, r["eps"])
            out.append((f"{i}.{kind}.y", _host(backend, y)))
    return out


@_case("norm", "rmsnorm_backward", seed=12, shapes=[[1, 1], [7, 13], [17, 257], [300, 64], [5, 0], [0, 8]],
       kinds=ROW_KINDS, dy_kinds=["uniform", "special", "nonfinite"], eps=[1e-6, 0.0])
def _norm_rmsnorm_backward(backend, s, r):
    out = []
    for i, (rows, h) in enumerate(r["shapes"]):
        w = backend.asarray(s.floats((h,), "uniform"))
        for kind in r["kinds"]:
            x = backend.asarray(s.floats((rows, h), kind))
            for dy_kind in r["dy_kinds"] if kind == "uniform" else r["dy_kinds"][:1]:
                dy = backend.asarray(s.floats((rows, h), dy_kind))
                for eps in r["eps"]:
                    dx, dweight = norm.rmsnorm_backward(backend, x, w, eps, dy)
                    tag = f"{i}.{kind}.{dy_kind}.{eps}"
                    out += [(f"{tag}.dx", _host(backend, dx)), (f"{tag}.dweight", _host(backend, dweight))]
    return out


@_case("norm", "rmsnorm_heads_backward", seed=13, shapes=[[1, 1, 128], [7, 5, 64], [33, 16, 128]], eps=1e-6)
def _norm_rmsnorm_heads_backward(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        w = backend.asarray(s.floats(shape[-1:], "uniform"))
        x, dy = (backend.asarray(s.floats(shape, kind)) for kind in ("massive", "uniform"))
        dx, dweight = norm.rmsnorm_heads_backward(backend, x, w, r["eps"], dy)
        out += [(f"{i}.dx", _host(backend, dx)), (f"{i}.dweight", _host(backend, dweight))]
    return out


def _rope_scaling(spec):
    return None if spec is None else rope_ref.Llama3Scaling(*spec)


# (table rows, head_dim, theta, llama3 scaling (factor, low, high, original max positions) or None)
ROPE_TABLES = [[50, 14, 10000.0, None], [4096, 128, 1000000.0, None], [300, 64, 500000.0, [8.0, 1.0, 4.0, 8192]]]


@_case("rope", "tables", seed=20, tables=ROPE_TABLES)
def _rope_tables(backend, s, r):
    out = []
    for i, (rows, head_dim, theta, scaling) in enumerate(r["tables"]):
        cos, sin = rope.tables(backend, rows, head_dim, theta, _rope_scaling(scaling))
        out += [(f"{i}.cos", _host(backend, cos)), (f"{i}.sin", _host(backend, sin))]
    return out


def _rope_rotation(backward: bool):
    def compute(backend, s, r):
        out = []
        for i, (tokens, heads, head_dim, table) in enumerate(r["shapes"]):
            rows, theta, scaling = ROPE_TABLES[table][0], ROPE_TABLES[table][2], ROPE_TABLES[table][3]
            cos, sin = rope.tables(backend, rows, head_dim, theta, _rope_scaling(scaling))
            positions = s.ints((tokens,), 0, rows)
            if tokens >= 2:
                positions[0], positions[-1] = 0, rows - 1
            positions_dev = backend.asarray(positions)
            for kind in r["kinds"]:
                x = backend.asarray(s.floats((tokens, heads, head_dim), kind))
                op = rope.apply_backward if backward else rope.apply
                out.append((f"{i}.{kind}.{'dx' if backward else 'y'}",
                            _host(backend, op(backend, x, positions_dev, cos, sin, host_positions=positions))))
        return out

    compute.__name__ = "_rope_apply_backward" if backward else "_rope_apply"
    return compute


# (tokens, heads, head_dim, index into ROPE_TABLES: its rows, theta and scaling; head_dim its own)
ROPE_SHAPES = [[1, 1, 2, 0], [7, 3, 14, 0], [17, 4, 64, 2], [9, 8, 128, 1], [0, 2, 8, 0]]
_case("rope", "apply", seed=21, shapes=ROPE_SHAPES, kinds=ROW_KINDS + ["bits"])(_rope_rotation(False))
_case("rope", "apply_backward", seed=22, shapes=ROPE_SHAPES, kinds=ROW_KINDS + ["bits"])(_rope_rotation(True))


ACTIVATION_SHAPES = [[1, 1], [7, 13], [33, 257], [0, 5]]


@_case("activation", "swiglu", seed=30, shapes=ACTIVATION_SHAPES, kinds=ROW_KINDS + ["bits"],
       exp_edges="gate = the exp contract's edge_inputs(), up random bit patterns")
def _activation_swiglu(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            gate, up = (backend.asarray(s.floats(shape, k)) for k in (kind, "uniform"))
            out.append((f"{i}.{kind}.y", _host(backend, activation.swiglu(backend, gate, up))))
    gate = elementwise_ref.edge_inputs().view(np.float32)
    up = s.floats(gate.shape, "bits")
    out.append(("edges.y", _host(backend, activation.swiglu(backend, backend.asarray(gate), backend.asarray(up)))))
    return out


@_case("activation", "swiglu_backward", seed=31, shapes=ACTIVATION_SHAPES, kinds=ROW_KINDS + ["bits"],
       exp_edges="gate = the exp contract's edge_inputs(), up and dy random bit patterns")
def _activation_swiglu_backward(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            gate, up, dy = (backend.asarray(s.floats(shape, k)) for k in (kind, "uniform", "uniform"))
            dgate, dup = activation.swiglu_backward(backend, gate, up, dy)
            out += [(f"{i}.{kind}.dgate", _host(backend, dgate)), (f"{i}.{kind}.dup", _host(backend, dup))]
    gate = elementwise_ref.edge_inputs().view(np.float32)
    up, dy = s.floats(gate.shape, "bits"), s.floats(gate.shape, "bits")
    dgate, dup = activation.swiglu_backward(backend, *(backend.asarray(a) for a in (gate, up, dy)))
    return out + [("edges.dgate", _host(backend, dgate)), ("edges.dup", _host(backend, dup))]


RESIDUAL_SHAPES = [[1, 1], [7, 13], [17, 257], [5, 0]]


@_case("residual", "add", seed=40, shapes=RESIDUAL_SHAPES, kinds=ROW_KINDS)
def _residual_add(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            a, b = (backend.asarray(s.floats(shape, kind)) for _ in range(2))
            out.append((f"{i}.{kind}.y", _host(backend, residual.add(backend, a, b))))
    return out


@_case("residual", "add_bias", seed=41, shapes=RESIDUAL_SHAPES, kinds=ROW_KINDS)
def _residual_add_bias(backend, s, r):
    out = []
    for i, shape in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            x, bias = backend.asarray(s.floats(shape, kind)), backend.asarray(s.floats(shape[-1:], kind))
            out.append((f"{i}.{kind}.y", _host(backend, residual.add_bias(backend, x, bias))))
    return out


@_case("residual", "transpose", seed=42, shapes=[[1, 1], [7, 13], [32, 32], [33, 31], [64, 96], [0, 5], [5, 0]],
       kind="bits")
def _residual_transpose(backend, s, r):
    return [(f"{i}.y", _host(backend, residual.transpose(backend, backend.asarray(s.floats(shape, r["kind"])))))
            for i, shape in enumerate(r["shapes"])]


@_case("embedding", "gather", seed=50, shapes=[[1, 1, 1], [13, 7, 5], [1000, 257, 64], [50, 16, 0]],
       table_kind="bits", shape_order="[V, H, T]")
def _embedding_gather(backend, s, r):
    out = []
    for i, (vocab, hidden, tokens) in enumerate(r["shapes"]):
        table = backend.asarray(s.floats((vocab, hidden), r["table_kind"]))
        ids = s.ints((tokens,), 0, vocab)
        if tokens >= 2:
            ids[0], ids[-1] = 0, vocab - 1
        out.append((f"{i}.y", _host(backend, embedding.gather(backend, table, backend.asarray(ids)))))
    return out


@_case("embedding", "gather_backward", seed=51,
       shapes=[[1, 1, 1], [13, 7, 5], [20, 33, 300], [1000, 257, 64], [50, 16, 0], [9, 0, 4]],
       dy_kinds=["uniform", "huge", "zeros", "bits"], shape_order="[V, H, T]",
       ids="repeated: ids in [0, min(V, 8)) for every other shape, else [0, V)")
def _embedding_gather_backward(backend, s, r):
    out = []
    for i, (vocab, hidden, tokens) in enumerate(r["shapes"]):
        ids = s.ints((tokens,), 0, min(vocab, 8) if i % 2 else vocab)
        ids_dev = backend.asarray(ids)
        for kind in r["dy_kinds"]:
            dy = backend.asarray(s.floats((tokens, hidden), kind))
            d_table = embedding.gather_backward(backend, ids_dev, ids, dy, vocab)
            out.append((f"{i}.{kind}.dtable", _host(backend, d_table)))
    return out


# ---- logprob

LOGPROB_SHAPES = [[1, 1], [7, 13], [5, 1000], [3, 4099]]
LOGPROB_KINDS = ["logits", "neg_inf", "ties", "tiny", "huge", "special", "nonfinite"]
LOGPROB_TEMPERATURES = [1.0, 0.7, 0.001]


def _logits(s: Stream, rows: int, vocab: int, kind: str) -> np.ndarray:
    if kind == "neg_inf":  # masked entries; row 0 entirely -inf, row 1 one finite value
        z = s.floats((rows, vocab), "logits")
        z[s.ints((rows, vocab), 0, 10) < 3] = -np.inf
        z[0] = -np.inf
        if rows > 1:
            z[1] = -np.inf
            z[1, int(s.ints((), 0, vocab))] = 2.0
        return z
    if kind == "ties":  # several equal maxima, +0 and -0 among them
        z = np.where(s.ints((rows, vocab), 0, 2) == 0, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        z[:, ::3] = -1.0
        return z
    return s.floats((rows, vocab), kind)


def _logprob_inputs(backend, s, r):
    """Yield (tag, rows, logits, targets, temperature) over shapes x kinds x temperatures."""
    for i, (rows, vocab) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            z = backend.asarray(_logits(s, rows, vocab, kind))
            targets = backend.asarray(s.ints((rows,), 0, vocab))
            for temperature in r["temperatures"] if kind in ("logits", "neg_inf", "huge") else [1.0]:
                yield f"{i}.{kind}.{temperature}", rows, z, targets, temperature


@_case("logprob", "logprobs", seed=60, shapes=LOGPROB_SHAPES, kinds=LOGPROB_KINDS, temperatures=LOGPROB_TEMPERATURES)
def _logprob_logprobs(backend, s, r):
    return [(f"{tag}.logp", _host(backend, logprob.logprobs(backend, z, targets, t)))
            for tag, _rows, z, targets, t in _logprob_inputs(backend, s, r)]


@_case("logprob", "entropy", seed=61, shapes=LOGPROB_SHAPES, kinds=LOGPROB_KINDS, temperatures=LOGPROB_TEMPERATURES)
def _logprob_entropy(backend, s, r):
    return [(f"{tag}.entropy", _host(backend, logprob.entropy(backend, z, t)))
            for tag, _rows, z, _targets, t in _logprob_inputs(backend, s, r)]


@_case("logprob", "logprobs_and_entropy", seed=62, shapes=LOGPROB_SHAPES, kinds=LOGPROB_KINDS,
       temperatures=LOGPROB_TEMPERATURES)
def _logprob_logprobs_and_entropy(backend, s, r):
    out = []
    for tag, _rows, z, targets, t in _logprob_inputs(backend, s, r):
        logp, ent = logprob.logprobs_and_entropy(backend, z, targets, t)
        out += [(f"{tag}.logp", _host(backend, logp)), (f"{tag}.entropy", _host(backend, ent))]
    return out


@_case("logprob", "lm_head_logprobs", seed=63, shapes=[[1, 16, 7], [37, 200, 1000]], shape_order="[T, H, V]",
       hidden_kind="massive", weight="uniform * 2^-4", temperature=0.8, token_blocks=[1, 7, 256])
def _logprob_lm_head(backend, s, r):
    out = []
    for i, (tokens, hidden_size, vocab) in enumerate(r["shapes"]):
        hidden = backend.asarray(s.floats((tokens, hidden_size), r["hidden_kind"]))
        w = np.ldexp(s.floats((vocab, hidden_size), "uniform"), -4).astype(np.float32)
        weight = gemm.encode_weight(backend, backend.asarray(w))
        targets = backend.asarray(s.ints((tokens,), 0, vocab))
        for block in r["token_blocks"]:
            logp, ent = logprob.lm_head_logprobs(backend, hidden, weight, targets, r["temperature"],
                                                 want_entropy=True, token_block=block)
            out += [(f"{i}.{block}.logp", _host(backend, logp)), (f"{i}.{block}.entropy", _host(backend, ent))]
    return out


# upstream gradients that are not ordinary values: masked (+-0), non-finite, huge (|g| / T overflows), subnormal
SPECIAL_GRAD_BITS = [f"0x{int(b):08x}" for b in np.array(
    [0.0, -0.0, np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-40, 1.0], dtype=np.float32).view(np.uint32)]


@_case("logprob", "logprobs_backward", seed=64, shapes=LOGPROB_SHAPES, kinds=LOGPROB_KINDS,
       temperatures=LOGPROB_TEMPERATURES,
       grads="uniform with a third +0; then drawn from special_grad_bits (float32 bits)",
       special_grad_bits=SPECIAL_GRAD_BITS)
def _logprob_backward(backend, s, r):
    out = []
    specials = np.array([int(bits, 16) for bits in r["special_grad_bits"]], dtype=np.uint32).view(np.float32)
    for tag, rows, z, targets, t in _logprob_inputs(backend, s, r):
        ordinary = s.floats((rows,), "uniform")
        ordinary[s.ints((rows,), 0, 3) == 0] = np.float32(0.0)
        for name, grad in (("ordinary", ordinary), ("special", specials[s.ints((rows,), 0, specials.size)])):
            dz = logprob.logprobs_backward(backend, z, targets, t, backend.asarray(grad))
            out.append((f"{tag}.{name}.dlogits", _host(backend, dz)))
    return out


# ---- attention

def _cu(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _qkv(s: Stream, tokens: int, hq: int, hkv: int, d: int, kind: str):
    return tuple(s.floats((tokens, heads, d), kind) for heads in (hq, hkv, hkv))


@_case("attention", "packed", seed=70, lengths=[7, 1, 33, 70], heads=[[8, 2, 64], [4, 4, 128], [8, 2, 20]],
       kinds=["uniform", "massive", "tiny", "huge", "zeros", "special"], heads_order="[Hq, Hkv, D]",
       nonfinite="heads[0], massive, with q[5, 3, 17] = NaN, k[cu[2] + 20, 1, 2] = inf, v[cu[3] + 3, 0, 0] = NaN")
def _attention_packed(backend, s, r):
    out, cu = [], _cu(r["lengths"])
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        for kind in r["kinds"] if i == 0 else r["kinds"][:2]:
            q, k, v = (backend.asarray(a) for a in _qkv(s, int(cu[-1]), hq, hkv, d, kind))
            out.append((f"{i}.{kind}.o", _host(backend, attention.attention_packed(backend, q, k, v, cu))))
    hq, hkv, d = r["heads"][0]
    q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, "massive")
    q[5, 3, 17], k[cu[2] + 20, 1, 2], v[cu[3] + 3, 0, 0] = np.nan, np.inf, np.nan
    o = attention.attention_packed(backend, *(backend.asarray(a) for a in (q, k, v)), cu)
    return out + [("nonfinite.o", _host(backend, o))]


@_case("attention", "write_kv", seed=71, layouts=[[2, 64], [4, 128], [2, 20], [1, 1]], layouts_order="[Hkv, D]",
       kinds=ROW_KINDS, tokens=13, num_slots=40, block_size=4, skipped_tokens=[2, 7])
def _attention_write_kv(backend, s, r):
    out, tokens = [], r["tokens"]
    for i, (hkv, d) in enumerate(r["layouts"]):
        for kind in r["kinds"]:
            k, v = s.floats((tokens, hkv, d), kind), s.floats((tokens, hkv, d), kind)
            slots = s.permutation(r["num_slots"])[:tokens].astype(np.int32)
            slots[r["skipped_tokens"]] = -1
            cache = attention.KVCache.allocate(backend, r["num_slots"], hkv, d, r["block_size"])
            attention.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
            for name in ("k_digits", "k_exponents", "v_digits", "v_exponents"):
                out.append((f"{i}.{kind}.{name}", _host(backend, getattr(cache, name),
                                                        "int8" if name.endswith("digits") else "int32")))
    return out


@_case("attention", "paged", seed=72, lengths=[45, 1, 130], heads=[[8, 2, 64], [4, 2, 20]], block_size=16,
       spare_blocks=3, kind="massive", heads_order="[Hq, Hkv, D]",
       queries="every position of every sequence, then the rows in a random order, then each last position alone")
def _attention_paged(backend, s, r):
    out, lengths, block = [], r["lengths"], r["block_size"]
    cu = _cu(lengths)
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, r["kind"])
        needed = [-(-n // block) for n in lengths]
        physical = s.permutation(sum(needed) + r["spare_blocks"])
        tables = np.full((len(lengths), max(needed) + 1), -1, dtype=np.int32)
        used = 0
        for seq, count in enumerate(needed):
            tables[seq, :count] = physical[used:used + count]
            used += count
        cache = attention.KVCache.allocate(backend, (sum(needed) + r["spare_blocks"]) * block, hkv, d, block)
        q_seq = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
        q_pos = (np.arange(int(cu[-1])) - cu[:-1][q_seq]).astype(np.int32)
        slots = (tables[q_seq, q_pos // block].astype(np.int64) * block + q_pos % block).astype(np.int32)
        attention.write_kv(backend, cache, backend.asarray(k), backend.asarray(v), backend.asarray(slots))
        tables_dev = backend.asarray(tables)

        def query(rows, name):
            o = attention.attention_paged(backend, backend.asarray(np.ascontiguousarray(q[rows])),
                                          backend.asarray(q_seq[rows]), backend.asarray(q_pos[rows]), cache, tables_dev)
            out.append((f"{i}.{name}.o", _host(backend, o)))

        query(np.arange(int(cu[-1])), "all")
        query(s.permutation(int(cu[-1])), "shuffled")
        query(cu[1:] - 1, "last")
    return out


@_case("attention", "packed_backward", seed=73, lengths=[1, 7, 33, 40], heads=[[4, 1, 64], [4, 2, 40], [3, 3, 20]],
       kinds=["uniform", "massive", "special"], heads_order="[Hq, Hkv, D]")
def _attention_packed_backward(backend, s, r):
    out, cu = [], _cu(r["lengths"])
    for i, (hq, hkv, d) in enumerate(r["heads"]):
        for kind in r["kinds"] if i == 0 else r["kinds"][:2]:
            q, k, v = _qkv(s, int(cu[-1]), hq, hkv, d, kind)
            do = s.floats((int(cu[-1]), hq, d), kind)
            grads = attention.attention_packed_backward(backend, *(backend.asarray(a) for a in (q, k, v, do)), cu)
            out += [(f"{i}.{kind}.{name}", _host(backend, g)) for name, g in zip(("dq", "dk", "dv"), grads)]
    return out


# ---- sampling

SAMPLING_SHAPES = [[6, 1], [9, 7], [8, 513], [4, 32000]]
SAMPLING_TEMPERATURES = [0.0, 0.5, 1.0, 1.7, 0.001]


def _sampling_logits(s: Stream, rows: int, vocab: int, kind: str) -> np.ndarray:
    if kind == "sharp":  # a few tokens hold the mass
        return np.ldexp(s.floats((rows, vocab), "uniform"), 4).astype(np.float32)
    if kind == "one_hot":
        z = np.full((rows, vocab), -np.inf, dtype=np.float32)
        z[np.arange(rows), s.ints((rows,), 0, vocab)] = s.floats((rows,), "uniform")
        return z
    if kind == "neg_inf":  # masked entries, at least one finite value per row
        z = s.floats((rows, vocab), "logits")
        z[s.ints((rows, vocab), 0, 10) < 3] = -np.inf
        z[np.arange(rows), s.ints((rows,), 0, vocab)] = 1.0
        return z
    return _logits(s, rows, vocab, kind)


def _sampling_rows(s: Stream, rows: int) -> dict:
    """Per-row temperatures (cycled, then permuted) and counters, with the extremes in the first rows."""
    temperature = np.array(SAMPLING_TEMPERATURES * rows)[:rows][s.permutation(rows)]
    counters = {"seed": s.u64(rows), "request": s.ints((rows,), 0, 1 << 32, np.uint32),
                "sample_index": s.ints((rows,), 0, 64, np.uint32), "position": s.ints((rows,), 0, 1 << 32, np.uint32)}
    extremes = [(2**64 - 1, 2**32 - 1, 2**32 - 1, 2**32 - 1), (0, 0, 0, 0)]
    for row, values in zip(range(rows), extremes):
        for name, value in zip(("seed", "request", "sample_index", "position"), values):
            counters[name][row] = value
    return {"temperature": temperature, **counters}


@_case("sampling", "sample_and_logprobs", seed=80, shapes=SAMPLING_SHAPES,
       kinds=["logits", "sharp", "ties", "neg_inf", "one_hot", "tiny"], temperatures=SAMPLING_TEMPERATURES,
       counters="seed u64, request u32, sample_index in [0, 64), position u32; rows 0 and 1 at the extremes")
def _sampling_sample(backend, s, r):
    out = []
    for i, (rows, vocab) in enumerate(r["shapes"]):
        for kind in r["kinds"]:
            z = backend.asarray(_sampling_logits(s, rows, vocab, kind))
            params = _sampling_rows(s, rows)
            temperature = params.pop("temperature")
            tokens, logp = sampling.sample_and_logprobs(backend, z, temperature, **params)
            out += [(f"{i}.{kind}.tokens", _host(backend, tokens, "int32")),
                    (f"{i}.{kind}.logp", _host(backend, logp))]
    return out


# ---- adamw

ADAMW_SHAPES = [[1], [7, 13], [0], [3, 64], [1000]]
ADAMW_HYPERS = [{"lr": 1e-3, "weight_decay": 0.01, "max_norm": 1.0},
                {"lr": 3e-2, "beta1": 0.8, "beta2": 0.95, "eps": 1e-6, "weight_decay": 0.1, "max_norm": None},
                {"lr": 1e-4, "weight_decay": 0.0, "max_norm": 1e-3}]


def _grads(s: Stream, shapes, kind: str) -> list[np.ndarray]:
    return [s.floats(shape, kind) for shape in shapes]


@_case("adamw", "global_norm", seed=90, shapes=ADAMW_SHAPES + [[300000]], kinds=ROW_KINDS + ["bits"])
def _adamw_global_norm(backend, s, r):
    return [(f"{kind}.norm", np.array([adamw.global_norm(backend, [backend.asarray(g) for g in
                                                                  _grads(s, r["shapes"], kind)])], np.float64))
            for kind in r["kinds"]]


@_case("adamw", "steps", seed=91, shapes=ADAMW_SHAPES, hypers=ADAMW_HYPERS, steps=3, warmup=2,
       grad_kinds=["uniform", "tiny", "huge", "zeros", "nonfinite"], params="uniform",
       schedule="lr = contract.adamw.lr_at(step, hyper lr, warmup, steps)")
def _adamw_steps(backend, s, r):
    out = []
    for h, fields in enumerate(r["hypers"]):
        hyper = Hyper(**fields)
        for kind in r["grad_kinds"]:
            params = [backend.asarray(p) for p in _grads(s, r["shapes"], "uniform")]
            m = [backend.zeros(tuple(shape), np.float32) for shape in r["shapes"]]
            v = [backend.zeros(tuple(shape), np.float32) for shape in r["shapes"]]
            for step in range(1, r["steps"] + 1):
                grads = [backend.asarray(g) for g in _grads(s, r["shapes"], kind)]
                lr = lr_at(step, hyper.lr, r["warmup"], r["steps"])
                info = adamw.adamw_step(backend, params, grads, m, v, step, hyper, lr)
                tag = f"{h}.{kind}.{step}"
                out.append((f"{tag}.lr_norm_clip", np.array([info.lr, info.norm, info.clip], np.float64)))
                for name, tensors in (("p", params), ("m", m), ("v", v)):
                    out += [(f"{tag}.{name}{j}", _host(backend, t)) for j, t in enumerate(tensors)]
    return out


# ----------------------------------------------------------------------------- end to end

class _Shared:
    """One expensive object at a time (a built model, a training step), kept while the next case of
    its group needs it: keyed by (name, backend), replaced when another key is asked for."""

    key = None
    value = None

    @classmethod
    def get(cls, name: str, backend: Backend, build: Callable):
        key = (name, id(backend))
        if cls.key != key:
            cls.key, cls.value = None, None  # free the previous object before building the next
            cls.value, cls.key = build(), key
        return cls.value

    @classmethod
    def clear(cls) -> None:
        cls.key, cls.value = None, None


def _packed_logprobs(model, s: Stream, r) -> list[tuple[str, np.ndarray]]:
    out = []
    for temperature in r["temperatures"]:
        tokens = s.ints((sum(r["lengths"]),), 0, model.config.vocab_size)
        logp, ent = model.logprobs(tokens, _cu(r["lengths"]), temperature, with_entropy=True)
        out += [(f"{temperature}.logp", canonical(np.concatenate(logp))),
                (f"{temperature}.entropy", canonical(np.concatenate(ent)))]
    return out


def _generated(outputs) -> list[tuple[str, np.ndarray]]:
    out = []
    for request in outputs:
        out.append((f"{request.request_id}.prompt", canonical(np.array(request.prompt_token_ids), "int32")))
        for c in request.outputs:
            out += [(f"{request.request_id}.{c.index}.tokens", canonical(np.array(c.token_ids), "int32")),
                    (f"{request.request_id}.{c.index}.logp", canonical(np.array(c.logprobs, np.float32)))]
    return out


def _sampling_params(r) -> list:
    from rlportable.engine.sequence import SamplingParams

    return [SamplingParams(**params) for params in r["params"]]


def _tiny(backend, trainable: bool = False):
    from rlportable.model.forward import Model
    from rlportable.model.tiny import tiny_model

    config, weights, tokenizer = tiny_model()
    return Model(backend, config, weights, trainable=trainable), tokenizer


@_case("tiny", "model.logprobs", seed=100, model="rlportable.model.tiny.tiny_model()",
       lengths=[1, 7, 33, 64], temperatures=[1.0, 0.7], tokens="ints in [0, vocab) per temperature")
def _tiny_logprobs(backend, s, r):
    model, _ = _tiny(backend)
    return _packed_logprobs(model, s, r)


_ENGINE = dict(max_num_seqs=64, block_size=16)


@_case("tiny", "engine.generate", seed=101, model="rlportable.model.tiny.tiny_model()",
       prompts=["12+34=", "a longer prompt that spans more than one block of the cache", "7"],
       params=[dict(n=3, temperature=1.0, max_tokens=16, seed=12345, ignore_eos=True),
               dict(n=2, temperature=0.6, top_p=0.9, top_k=50, max_tokens=16, seed=2**64 - 1, ignore_eos=True),
               dict(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)],
       engine=_ENGINE)
def _tiny_generate(backend, s, r):
    from rlportable.engine.llm import LLM

    llm = LLM(device=backend, loaded=_tiny(backend), **r["engine"])
    return _generated(llm.generate(r["prompts"], _sampling_params(r)))


TRAIN_RECIPE = dict(seed=102, model="rlportable.model.tiny.tiny_model(), Model(trainable=True)",
                    lengths=[12, 30], rows="every token followed by one of its sequence, except the first 4 of each",
                    temperature=1.0, grad_logp="uniform * 2^-4",
                    hyper={"lr": 1e-3, "weight_decay": 0.01, "max_norm": 1.0},
                    step="rlportable.model.backward.forward/backward, then train.optimizer.Optimizer "
                         "accumulate + step (Schedule(peak_lr=lr, warmup_steps=1, total_steps=1): the step's lr is lr)")


def _train_step(backend, r) -> dict:
    """One training step of the tiny model: gradients, then the weights after the optimiser."""
    from rlportable.model import backward
    from rlportable.train.optimizer import Optimizer, Schedule

    s = Stream(r["seed"])
    model, _ = _tiny(backend, trainable=True)
    config, cu = model.config, _cu(r["lengths"])
    tokens = s.ints((int(cu[-1]),), 0, config.vocab_size)
    rows = np.concatenate([np.arange(a + 4, b - 1) for a, b in zip(cu[:-1], cu[1:])]).astype(np.int64)
    fwd = backward.forward(model, tokens, cu, r["temperature"], rows=rows)
    grad_logp = np.ldexp(s.floats((rows.size,), "uniform"), -4).astype(np.float32)
    grads = backward.backward(model, fwd, grad_logp)
    named = grads.named_tensors(config)
    result = {"logp": [("logp", _host(backend, fwd.logp))],
              "gradients": [(name, _host(backend, g)) for name, g in named.items()]}
    hyper = Hyper(**r["hyper"])
    optimizer = Optimizer(model, hyper, Schedule(peak_lr=hyper.lr, warmup_steps=1, total_steps=1))
    optimizer.accumulate(grads)
    info = optimizer.step()
    result["updated_weights"] = ([("lr_norm_clip", np.array([info.lr, info.norm, info.clip], np.float64))]
                                 + [(name, _host(backend, p)) for name, p in
                                    model.params.named_tensors(config).items()])
    return result


@_case("tiny", "train.gradients", **TRAIN_RECIPE)
def _tiny_train_gradients(backend, s, r):
    step = _Shared.get("tiny.train", backend, lambda: _train_step(backend, r))
    return step["logp"] + step["gradients"]


@_case("tiny", "train.updated_weights", **TRAIN_RECIPE)
def _tiny_train_updated(backend, s, r):
    step = _Shared.get("tiny.train", backend, lambda: _train_step(backend, r))
    _Shared.clear()
    return step["updated_weights"]


# ---- whole training runs: the weights and AdamW state after a few steps of `rlportable sft` and
# `rlportable grpo` as their defaults run them (the embedded models and task), shortened; matching these
# digests proves the whole loop on a device (sampling, rewards, log-probs, gradients, optimiser), not
# only its parts. The metrics that are functions of the bits (not of time) are recorded too.

TRAJECTORY_TASK = "arithmetic:digits=1,ops=+"  # train/launch.py DEFAULT_TASK
SFT_RUN = dict(seed=120, model="tiny", task=TRAJECTORY_TASK,
               config=dict(steps=3, batch_size=8, learning_rate=3e-3, warmup_steps=1, seed=0),
               run="SFTTrainer(model, tokenizer, task_sft_records(task dataset), SFTConfig(**config)).step(i), "
                   "i < steps, as rlportable sft runs them")
GRPO_RUN = dict(seed=121, model="tiny-sft", task=TRAJECTORY_TASK,
                config=dict(steps=2, prompts_per_step=4, num_generations=4, max_completion_length=8,
                            learning_rate=4e-4, warmup_steps=1, seed=0),
                run="GRPOTrainer(model, tokenizer, task dataset, the task's reward, GRPOConfig(**config)).step(i), "
                    "i < steps, as rlportable grpo runs them")
SFT_METRICS = ("loss", "grad_norm", "lr", "completion_tokens")
GRPO_METRICS = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction", "logp_mismatches", "grad_norm", "lr")


def _trajectory(backend, model, optimizer, records: list[dict], keys) -> list[tuple[str, np.ndarray]]:
    out = [(f"step{i + 1}.{key}", np.array([float(record[key])], np.float64))
           for i, record in enumerate(records) for key in keys if key in record]
    out += [(f"weights.{name}", _host(backend, p)) for name, p in model.params.named_tensors(model.config).items()]
    return out + [(f"optimizer.{name}", canonical(np.array(a, copy=True))) for name, a in optimizer.state().items()]


def _run_setup(backend, r, seed: int):
    """(model, tokenizer, task records, task) of a trajectory recipe: the embedded model, trainable."""
    from rlportable.model.forward import Model
    from rlportable.model.load import load_model
    from rlportable.train.launch import task_records

    model_config, weights, tokenizer = load_model(r["model"])
    records, task = task_records(r["task"], None, seed)
    return Model(backend, model_config, weights, trainable=True), tokenizer, records, task


@_case("training", "sft.trajectory", **SFT_RUN)
def _sft_trajectory(backend, s, r):
    from rlportable.train.sft import SFTConfig, SFTTrainer, task_sft_records

    config = SFTConfig(**r["config"])
    model, tokenizer, records, _ = _run_setup(backend, r, config.seed)
    trainer = SFTTrainer(model, tokenizer, task_sft_records(records), config)
    steps = [trainer.step(i) for i in range(config.steps)]
    return _trajectory(backend, model, trainer.optimizer, steps, SFT_METRICS)


@_case("training", "grpo.trajectory", **GRPO_RUN)
def _grpo_trajectory(backend, s, r):
    from rlportable.train.grpo import GRPOConfig, GRPOTrainer
    from rlportable.train.rewards import RewardSet

    config = GRPOConfig(**r["config"])
    model, tokenizer, records, task = _run_setup(backend, r, config.seed)
    trainer = GRPOTrainer(model, tokenizer, records, RewardSet([(task, 1.0)]), config)
    steps = [trainer.step(i) for i in range(config.steps)]
    del trainer.engine  # its KV cache
    return _trajectory(backend, model, trainer.optimizer, steps, GRPO_METRICS)


# Layers of the Qwen3-0.6B-shaped model: each has the full shape (hidden 1024, 16 / 8 heads of 128, MLP 3072,
# vocabulary 151,936), but 28 of them cost the NumPy reference about 140 s of CPU time here (the engine's
# every step re-reads all weights), too slow for CI; 4 keep the whole group near 50 s. The device check
# model.qwen3-0.6b-shape.logprobs runs all 28 against the reference.
QWEN3_LAYERS = 4


def _qwen3_model(backend, r):
    from rlportable.model.synthetic import qwen3_06b_config, random_weights
    from rlportable.model.forward import Model

    config = qwen3_06b_config(r["layers"])
    return Model(backend, config, random_weights(config, seed=r["weights_seed"]))


class _NoTokenizer:
    """Token-id prompts only: no stop tokens (random weights may sample any id), empty texts."""

    eos_token_id = None
    stop_token_ids: list = []

    def decode(self, _ids) -> str:
        return ""


QWEN3_RECIPE = dict(model="rlportable.model.synthetic.qwen3_06b_config(layers), random_weights(config, weights_seed)",
                    layers=QWEN3_LAYERS, weights_seed=7)


@_case("qwen3-0.6b-shape", "model.logprobs", expensive=True, seed=110, lengths=[16, 16], temperatures=[1.0],
       tokens="ints in [0, vocab)", **QWEN3_RECIPE)
def _qwen3_logprobs(backend, s, r):
    model = _Shared.get("qwen3", backend, lambda: _qwen3_model(backend, r))
    return _packed_logprobs(model, s, r)


@_case("qwen3-0.6b-shape", "engine.generate", expensive=True, seed=111, prompt_lengths=[16, 16],
       prompts="token ids: ints in [0, vocab)", tokenizer="none: no stop tokens",
       params=[dict(n=1, temperature=1.0, max_tokens=3, seed=2024, ignore_eos=True),
               dict(n=1, temperature=0.0, max_tokens=3, ignore_eos=True)],
       engine=dict(max_num_seqs=4, block_size=16, max_model_len=64), **QWEN3_RECIPE)
def _qwen3_generate(backend, s, r):
    from rlportable.engine.llm import LLM

    model = _Shared.get("qwen3", backend, lambda: _qwen3_model(backend, r))
    prompts = [s.ints((n,), 0, model.config.vocab_size).tolist() for n in r["prompt_lengths"]]
    llm = LLM(device=backend, loaded=(model, _NoTokenizer()), **r["engine"])
    outputs = llm.generate(prompts, _sampling_params(r))
    del llm
    _Shared.clear()
    return _generated(outputs)


# ----------------------------------------------------------------------------- files

def directory(folder: Path | None = None) -> Path:
    """The golden digests' folder: `folder` (conform --golden-dir), else conformance/golden."""
    if folder is not None:
        return Path(folder)
    from rlportable.resources import resource_dir

    return resource_dir("conformance") / "golden"


def groups() -> list[str]:
    return list(dict.fromkeys(case.group for case in CASES))


def entry(case: Case, outputs: list[tuple[str, np.ndarray]]) -> dict:
    return {"name": case.name, "recipe": case.recipe, "function": f"{__name__}.{case.compute.__name__}",
            "elements": int(sum(np.asarray(a).size for _, a in outputs)), "sha256": digest(outputs),
            "outputs": output_entries(outputs)}


def group_document(group: str, entries: list[dict]) -> str:
    """The file's text: indented JSON with each recipe on one line (readable, and a stable diff)."""
    placeholders = [dict(item, recipe=f"@recipe{i}@") for i, item in enumerate(entries)]
    document = {"format": FORMAT, "group": group, "computed_by": "the NumPy reference (--device cpu)",
                "regenerate": REGENERATE, "inputs": INPUT_RULE, "digest": DIGEST_RULE, "digests": placeholders}
    text = json.dumps(document, indent=1)
    for i, item in enumerate(entries):
        text = text.replace(f'"@recipe{i}@"', json.dumps(item["recipe"]))
    return text + "\n"


def write_golden(backend: Backend, folder=None, only_groups=None, progress=None) -> list[Path]:
    """Compute every case on the cpu backend (the reference) and write one file per group."""
    if backend.name != "cpu":
        raise RlpError(f"--write-golden computes the digests with the NumPy reference: use --device cpu, "
                       f"not {backend.label}")
    folder = Path(folder) if folder is not None else directory()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for group in groups():
        if only_groups is not None and group not in only_groups:
            continue
        entries = []
        for case in (c for c in CASES if c.group == group):
            if progress:
                progress(case.check_name)
            entries.append(entry(case, case.outputs(backend)))
        path = folder / f"{group}.json"
        path.write_text(group_document(group, entries))
        written.append(path)
    return written


def _expected(case: Case, folder: Path | None) -> tuple[dict | None, str | None]:
    """The committed entry of a case, or why there is none (a one-line message)."""
    path = directory(folder) / f"{case.group}.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return None, f"cannot read {path}: {error}"
    for item in document.get("digests", []):
        if item.get("name") == case.name:
            if item.get("recipe") != case.recipe:
                return None, f"{path} holds another recipe for {case.name}: regenerate with `{REGENERATE}`"
            return item, None
    return None, f"{path} has no digest {case.name}: regenerate with `{REGENERATE}`"


def verify(backend: Backend, case: Case, folder: Path | None = None) -> tuple[int, int, str | None]:
    """(compared, mismatches, message): the case's outputs on the backend against its committed digest."""
    expected, problem = _expected(case, folder)
    try:
        outputs = case.outputs(backend)
    except RlpError as error:
        outputs, problem = None, problem or f"raised: {error}"
    if outputs is None or expected is None:
        size = expected["elements"] if expected else sum(np.asarray(a).size for _, a in outputs or [])
        return size, max(size, 1), f"golden digest {case.check_name}: {problem}"
    got = entry(case, outputs)
    if got["sha256"] == expected["sha256"]:
        return got["elements"], 0, None
    wanted = set(expected["outputs"])
    differing = [(line, int(np.asarray(a).size)) for line, (_, a) in zip(got["outputs"], outputs)
                 if line not in wanted]
    bad = sum(size for _, size in differing)
    first = (f"first differing output: {differing[0][0].rsplit(' ', 1)[0]} (of {len(got['outputs'])})"
             if differing else "the outputs' order differs")
    message = (f"golden digest {case.check_name} differs: expected {expected['sha256'][:16]}..., got "
               f"{got['sha256'][:16]}... ({directory(folder) / (case.group + '.json')}); {first}")
    return got["elements"], max(bad, 1), message


def _check(case: Case) -> SettingsCheck:
    def check(backend: Backend, rng, quick: bool, settings: Settings) -> Tally:
        tally = Tally()
        tally.compared, tally.mismatches, tally.message = verify(backend, case, settings.golden_dir)
        return tally

    return SettingsCheck(check)


GOLDEN_CHECKS: list[tuple[str, Callable]] = [(case.check_name, _check(case)) for case in CASES]

#: the end-to-end digests that `--quick` skips (the per-kernel ones always run)
QUICK_SKIPPED = {case.check_name for case in CASES if case.expensive}
