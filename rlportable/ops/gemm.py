"""Op family "gemm": Y = X @ W.T with exact integer accumulation, rounded once to float32.

Contract: contracts/gemm.toml; reference: rlportable/contract/exact.py gemm;
kernels: backends/portable/gemm.hip (both vendors) and backends/cuda/gemm.cu (the tensor-core
kernels), after backends/portable/fixedpoint.hip encodes rows.

Weights are encoded once per update (GemmWeight); activations are encoded on
every call. Two device methods give the same bits:
  * "blas": the vendor int8 GEMM (cuBLAS / hipBLAS, int32 compute) computes one
    int32 matrix G_d per digit shift d in a single call each (the digit pairs
    with i + j = d are laid out side by side along K), then gemm_combine_groups
    sums 256^d * G_d in int64 and rounds once.
  * "fused": one hand-written matrix-core kernel that keeps the G_d in registers and
    writes float32 directly (default bits only): on CUDA mma.sync, or wgmma on compute
    capability 9.0 (ops/gemm_fused.py picks the tile); on AMD's gfx942 and gfx90a the
    MFMA kernels (ops/gemm_mfma.py; HIP-CPU runs both under emulation).

Row-parallel layers (tensor parallelism) split the gemm in two around the
all-reduce: gemm_sums gives a rank's exact int64 sums of its K-shard (the blas
path's G_d, combined without rounding), round_sums rounds the all-reduced total
once; with the shards encoded with the MAX of their row exponents
(fixedpoint.row_exponents, encode_rows/encode_weight `exponents=`) the result
is bitwise the unsharded gemm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlportable.contract import exact, fixedpoint as fp
from rlportable.errors import InputError
from rlportable.ops.checks import require_bits, require_contiguous, require_matrix, shape_of
from rlportable.ops.fixedpoint import EncodedRows, empty_encoding, encode_rows, encode_rows_into, joined_integers
from rlportable.ops.gemm_fused import has_wgmma, launch_fused, pick_tile, tile_spec
from rlportable.ops.gemm_mfma import MFMA_TILES, launch_mfma, pick_mfma_tile
from rlportable.ops import residual
from rlportable.runtime.base import Backend

#: Chosen by measurement (docs/numerics.md, "Operand bits: 23-bit activations, 15-bit weights";
#: tests/test_gemm.py): 23-bit activations (3 int8 digits) keep rows with massive activations more
#: accurate than bf16; 15-bit weights are 2 int8 digits, the same bytes per weight as bf16.
DEFAULT_BITS_A = fp.ACTIVATION_BITS
DEFAULT_BITS_W = 15
METHODS = ("auto", "blas", "fused")
FUSED_DIGITS = (3, 2)  # (activation digits, weight digits) the fused kernel is built for
COMBINE_THREADS = 256
GROUP_BYTES_LIMIT = 1 << 30  # int32 G_d scratch per chunk of rows


@dataclass
class GemmWeight:
    """A weight matrix [N, K] encoded once: digits stored most significant first."""

    encoded: EncodedRows
    n: int
    k: int
    _host_integers: Any = field(default=None, repr=False, compare=False)

    @property
    def bits(self) -> int:
        return self.encoded.bits

    def host_integers(self) -> np.ndarray:
        """The weight's integers as float64 [N, K] (exact: below 2^53), joined once per weight version
        (an encoding is never changed in place: Model.reencode makes new GemmWeights). The cpu
        reference's products use it instead of joining the digits on every call."""
        if self._host_integers is None:
            self._host_integers = joined_integers(self.encoded).astype(np.float64)
        return self._host_integers


def encode_weight(backend: Backend, w, bits: int = DEFAULT_BITS_W, exponents=None) -> GemmWeight:
    """Encode W [N, K] once; `exponents` (int32 [N]) as in encode_rows: a K-shard of the weight rows
    encoded with the whole rows' exponents (row-parallel layers)."""
    n, k = require_matrix("w", w)
    return GemmWeight(encode_rows(backend, w, bits, descending=True, exponents=exponents), n, k)


def check_gemm_shapes(m_k: tuple[int, int], weight: GemmWeight, bits_a: int) -> None:
    m, k = m_k
    if k != weight.k:
        raise InputError(f"gemm: x has K={k} columns but the weight has K={weight.k}")
    limit = exact.gemm_max_k(bits_a, weight.bits)
    if k > limit:
        raise InputError(f"gemm: K={k} exceeds the contract's limit {limit} for {bits_a}x{weight.bits} bits")


def gemm(backend: Backend, x, weight: GemmWeight, bits_a: int = DEFAULT_BITS_A, method: str = "auto",
         tile: str | None = None, encoded: EncodedRows | None = None):
    """Y [M, N] float32 = X [M, K] @ W.T under the gemm contract.

    encoded: x already encoded at bits_a (encode_rows), shared by several products of the same
    activations (q, k and v; gate and up): the encoding is a function of x alone, so the bits are
    the same. tile: a fused kernel's tile (ops/gemm_fused.py, ops/gemm_mfma.py): it implies the fused
    method, and is refused with "blas"."""
    m, k = require_matrix("x", x)
    bits_a = require_bits("bits_a", bits_a)
    check_gemm_shapes((m, k), weight, bits_a)
    if method not in METHODS:
        raise InputError(f"gemm: unknown method {method!r}; choose one of {METHODS}")
    if tile is not None:
        if method == "blas":
            raise InputError(f"gemm: tile {tile!r} is a fused kernel's; method 'blas' takes none")
        method = "fused"
    _check_shared_encoding("gemm", encoded, m, k, bits_a)
    if backend.runs_reference:
        return _gemm_reference(backend.to_numpy(x), weight, bits_a, encoded)
    method = resolve_method(backend, m, bits_a, weight, method)
    if m == 0 or weight.n == 0 or k == 0:
        return backend.zeros((m, weight.n), np.float32)  # an empty sum is exactly +0
    if encoded is None:
        encoded = encode_rows(backend, x, bits_a)
    y = backend.empty((m, weight.n), np.float32)
    if method == "fused" and backend.kernel_vendor == "hip":
        launch_mfma(backend, tile or pick_mfma_tile(backend), encoded, weight, y, _scale_offset(bits_a, weight.bits))
    elif method == "fused":
        spec = tile_spec(tile or pick_tile(m, weight.n, has_wgmma(backend), k))
        launch_fused(backend, spec, encoded, weight, [y], _scale_offset(bits_a, weight.bits))
    else:
        _gemm_blas(backend, encoded, weight, y)
    return y


def gemm_columns(backend: Backend, x, stacked: "StackedWeight", encoded: EncodedRows | None = None,
                 tile: str | None = None) -> list:
    """[X @ W_0.T, X @ W_1.T, ...] for the parts of a stacked weight, each its own [M, N_i] array:
    the projections of the same activations (q, k and v; gate and up). Where the wgmma gemm runs,
    one launch writes all of them; elsewhere one gemm per part. The columns of the exact gemm are
    independent, so every part has the bits of its own gemm. `tile` forces a fused tile (for the
    one launch when it is a wgmma tile, else for each part's gemm)."""
    m, k = require_matrix("x", x)
    check_gemm_shapes((m, k), stacked.whole, DEFAULT_BITS_A)
    joint = (backend.kernel_vendor == "cuda" and m and k and
             resolve_method(backend, m, DEFAULT_BITS_A, stacked.whole, "auto") == "fused")
    spec = tile_spec(tile or pick_tile(m, stacked.whole.n, has_wgmma(backend), k)) if joint else None
    _check_shared_encoding("gemm_columns", encoded, m, k, DEFAULT_BITS_A)
    if backend.runs_reference:  # one product with the stacked weight, its columns split
        y = _gemm_reference(backend.to_numpy(x), stacked.whole, DEFAULT_BITS_A, encoded)
        bounds = np.cumsum([0] + [part.n for part in stacked.parts])
        return [np.ascontiguousarray(y[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if encoded is None and m and k:
        encoded = encode_rows(backend, x, DEFAULT_BITS_A)  # once for every part
    if spec is None or spec.kind != "wgmma":
        return [gemm(backend, x, part, encoded=encoded, tile=tile) for part in stacked.parts]
    outputs = [backend.empty((m, part.n), np.float32) for part in stacked.parts]
    launch_fused(backend, spec, encoded, stacked.whole, outputs, _scale_offset(DEFAULT_BITS_A, stacked.whole.bits))
    return outputs


@dataclass
class StackedWeight:
    """Weights of the same K stacked by rows, [W_0; W_1; ...], encoded once (`whole`), and each part
    as a view of that encoding (`parts`): encoding is row by row, so a part's view holds the bits of
    its own encode_weight."""

    whole: GemmWeight
    parts: list[GemmWeight]


def encode_stacked_weight(backend: Backend, weights: list, bits: int = DEFAULT_BITS_W) -> StackedWeight:
    """Encode W_0, W_1, ... ([N_i, K] each) into one stacked encoding."""
    shapes = [require_matrix(f"weights[{i}]", w) for i, w in enumerate(weights)]
    if not shapes or len({k for _, k in shapes}) != 1:
        raise InputError(f"encode_stacked_weight: the weights must share K; their shapes are {shapes}")
    k = shapes[0][1]
    starts = np.cumsum([0] + [rows for rows, _ in shapes])
    if backend.runs_reference:
        encoded = [encode_rows(backend, w, bits, descending=True) for w in weights]
        digits = np.concatenate([part.digits for part in encoded])
        exponents = np.concatenate([part.exponents for part in encoded])
    else:
        stacked = empty_encoding(backend, int(starts[-1]), k, bits, descending=True)
        digits, exponents = stacked.digits, stacked.exponents
        for start, stop, w in zip(starts[:-1], starts[1:], weights):
            encode_rows_into(backend, w, bits, True, digits[start:stop], exponents[start:stop])
    whole = GemmWeight(EncodedRows(digits, exponents, bits, k, True), int(starts[-1]), k)
    parts = [GemmWeight(EncodedRows(digits[start:stop], exponents[start:stop], bits, k, True), int(stop - start), k)
             for start, stop in zip(starts[:-1], starts[1:])]
    return StackedWeight(whole, parts)


def _check_shared_encoding(op: str, encoded: EncodedRows | None, m: int, k: int, bits_a: int) -> None:
    """A given encoding of x (shared by several products, or written by x's producer) must be x's."""
    if encoded is not None and (encoded.bits, encoded.rows, encoded.k) != (bits_a, m, k):
        raise InputError(f"{op}: the shared encoding is {encoded.rows}x{encoded.k} at {encoded.bits} bits; "
                         f"x is {m}x{k} at {bits_a} bits")


def _gemm_reference(x: np.ndarray, weight: GemmWeight, bits_a: int, x_encoded: EncodedRows | None = None) -> np.ndarray:
    """The cpu product; x_encoded: x's encoding when its producer made it (its integers, not quantized again)."""
    if x_encoded is not None:
        qa, ea = joined_integers(x_encoded), np.asarray(x_encoded.exponents)
    else:
        qa, ea = fp.quantize_rows(x, bits_a)
    encoded = weight.encoded
    return exact.gemm_from_encoded(qa, ea, bits_a, weight.host_integers(), np.asarray(encoded.exponents),
                                   weight.bits)


def gemm_sums(backend: Backend, x_encoded: EncodedRows, weight: GemmWeight):
    """S [M, N] int64 = the exact sum_k qa[m, k] qw[n, k], not rounded (K padding adds 0).

    The first half of a row-parallel gemm on one rank: x_encoded and weight hold the
    rank's K-shard, encoded with the all-reduced (MAX) row exponents; the ranks' S are
    all-reduced by SUM and round_sums rounds the total once.
    """
    _check_encoded_operands(x_encoded, weight)
    m, n = x_encoded.rows, weight.n
    if backend.runs_reference:
        return exact.exact_int_matmul(joined_integers(x_encoded), weight.host_integers())
    if m == 0 or n == 0 or weight.k == 0:
        return backend.zeros((m, n), np.int64)  # an empty sum is exactly 0
    sums = backend.empty((m, n), np.int64)
    for start, rows, groups in _shift_group_chunks(backend, x_encoded, weight):
        backend.launch(
            "gemm", "gemm_combine_groups_sums", _combine_grid(rows, n), (COMBINE_THREADS,),
            (groups, np.int32(groups.shape[0]), np.int64(rows), np.int64(n), sums[start:]),
        )
    return sums


def round_sums(backend: Backend, sums, exponents_a, bits_a: int, weight: GemmWeight):
    """Y [M, N] float32 = RNE_f32(S * 2^(ea + ew - (B_a-2) - (B_w-2))), the canonical NaN where
    exponents_a[m] or the weight's exponent n is the sentinel (exact.round_sums).

    The second half of a row-parallel gemm: S the all-reduced int64 sums of gemm_sums
    (|S| < 2^62), exponents_a the all-reduced activation exponents the shards were encoded with.
    """
    m, n = require_matrix("sums", sums, np.int64)
    bits_a = require_bits("bits_a", bits_a)
    if n != weight.n:
        raise InputError(f"round_sums: sums has N={n} columns but the weight has N={weight.n} rows")
    if shape_of(exponents_a) != (m,) or np.dtype(exponents_a.dtype) != np.int32:
        raise InputError(f"round_sums: exponents_a must be int32 [{m}], got {np.dtype(exponents_a.dtype).name} "
                         f"{list(shape_of(exponents_a))}")
    require_contiguous("exponents_a", exponents_a)
    exponents_w = weight.encoded.exponents
    if backend.runs_reference:
        return exact.round_sums(backend.to_numpy(sums), backend.to_numpy(exponents_a), bits_a,
                                backend.to_numpy(exponents_w), weight.bits)
    y = backend.empty((m, n), np.float32)
    if m and n:
        backend.launch(
            "gemm", "gemm_round_sums", _combine_grid(m, n), (COMBINE_THREADS,),
            (sums, np.int64(m), np.int64(n), exponents_a, exponents_w, np.int32(_scale_offset(bits_a, weight.bits)),
             y),
        )
    return y



# ---- the trainer's products: dX = dY W and dW = dY^T X, K cut at GEMM_K_CHUNK (contract: exact.GEMM_K_CHUNK)

def encode_transposed(backend: Backend, w, start: int, stop: int) -> GemmWeight:
    """(w[start:stop]).T encoded as a gemm weight: dX's second operand (Model.transposed_weight caches it)."""
    return encode_weight(backend, residual.transpose(backend, w[start:stop]))


def input_grad(backend: Backend, dy, w, transposed=None):
    """dX = dY W for y = x W^T (W [N, K]): dY's rows against W^T's, N cut into GEMM_K_CHUNK columns whose
    products are added in order. transposed(w, start, stop): the encoded (w[start:stop]).T, from a
    caller's cache; else encode_transposed."""
    if transposed is None:
        def transposed(w, start, stop):
            return encode_transposed(backend, w, start, stop)
    n = shape_of(dy)[1]
    if n <= exact.GEMM_K_CHUNK:
        return gemm(backend, dy, transposed(w, 0, n))
    dy_t = residual.transpose(backend, dy)
    total = None
    for start in range(0, n, exact.GEMM_K_CHUNK):
        stop = min(start + exact.GEMM_K_CHUNK, n)
        part = gemm(backend, residual.transpose(backend, dy_t[start:stop]), transposed(w, start, stop))
        total = part if total is None else residual.add(backend, total, part)
    return total


def weight_grad_operand(backend: Backend, x) -> list:
    """X^T [K, M] encoded at WEIGHT_GRAD_BITS as the weight gradient's second operand, one encoding per
    GEMM_K_CHUNK tokens: made once for every gradient that multiplies the same X."""
    m = shape_of(x)[0]
    return [encode_weight(backend, residual.transpose(backend, x[start:min(start + exact.GEMM_K_CHUNK, m)]),
                          bits=exact.WEIGHT_GRAD_BITS) for start in range(0, m, exact.GEMM_K_CHUNK)]


def weight_grad(backend: Backend, dy, x, x_operand: list | None = None):
    """dW = dY^T X [N, K] for y = x W^T over M tokens: dY^T's rows at the default 23 bits, X^T's at
    WEIGHT_GRAD_BITS, the token axis cut into GEMM_K_CHUNK chunks whose products are added in order.
    x_operand: weight_grad_operand(x), when the caller shares it between gradients."""
    (m, n), k = shape_of(dy), shape_of(x)[1]
    if m == 0:
        return backend.zeros((n, k), np.float32)
    chunks = weight_grad_operand(backend, x) if x_operand is None else x_operand
    total = None
    for index, start in enumerate(range(0, m, exact.GEMM_K_CHUNK)):
        part = gemm(backend, residual.transpose(backend, dy[start:min(start + exact.GEMM_K_CHUNK, m)]), chunks[index])
        total = part if total is None else residual.add(backend, total, part)
    return total

def _check_encoded_operands(a: EncodedRows, weight: GemmWeight) -> None:
    if a.descending or not weight.encoded.descending:
        raise InputError("gemm_sums: activations must be encoded ascending and the weight with encode_weight")
    if a.k != weight.k:
        raise InputError(f"gemm_sums: x_encoded has K={a.k} columns but the weight has K={weight.k}")
    limit = exact.gemm_max_k(a.bits, weight.bits)
    if a.k > limit:
        raise InputError(f"gemm_sums: K={a.k} exceeds the contract's limit {limit} for {a.bits}x{weight.bits} bits")


#: From M on, the vendor int8 GEMM + combine beats our mma.sync kernels; below it the fused kernels
#: are always taken (so decode steps can be captured in graphs)
BLAS_FROM_M = 1024
#: On wgmma devices the fused wgmma kernel also beats the vendor GEMM from BLAS_FROM_M on, up to this
#: K, the longest measured (bench/results/gemm_sweep_large_m_loads_h200.json; docs/gemm_performance.md)
WGMMA_LARGE_M_MAX_K = 3072


def resolve_method(backend: Backend, m: int, bits_a: int, weight: GemmWeight, method: str) -> str:
    digits_ok = (fp.slice_count(bits_a), weight.encoded.slices) == FUSED_DIGITS
    mfma = backend.kernel_vendor == "hip" and pick_mfma_tile(backend) is not None
    fused_ok = digits_ok and (backend.kernel_vendor == "cuda" or mfma)
    if method == "fused" and not fused_ok:
        raise InputError(
            f"gemm: the fused kernel exists for CUDA sources and for AMD's {sorted({t.arch for t in MFMA_TILES.values()})} "
            f"with {FUSED_DIGITS} digits; got {backend.label} with {fp.slice_count(bits_a)}x{weight.encoded.slices}"
        )
    if mfma:
        # An AMD GPU with MFMA kernels takes them at every M (no measurement says otherwise yet:
        # docs/rocm.md). HIP-CPU emulates each MFMA in software, so there `auto` keeps the vendor
        # product (NumPy's) and the MFMA kernels run when asked for (conform asks for each).
        return method if method != "auto" else ("fused" if fused_ok and not backend.on_host else "blas")
    if method == "auto":
        large_m_fused = has_wgmma(backend) and weight.k <= WGMMA_LARGE_M_MAX_K
        return "fused" if fused_ok and (m < BLAS_FROM_M or large_m_fused) else "blas"
    return method


def _scale_offset(bits_a: int, bits_w: int) -> int:
    return -(bits_a - 2) - (bits_w - 2)


def _gemm_blas(backend: Backend, a: EncodedRows, weight: GemmWeight, y) -> None:
    w = weight.encoded
    n = weight.n
    for start, rows, g in _shift_group_chunks(backend, a, weight):
        backend.launch(
            "gemm", "gemm_combine_groups", _combine_grid(rows, n), (COMBINE_THREADS,),
            (g, np.int32(g.shape[0]), np.int64(rows), np.int64(n),
             a.exponents[start:], w.exponents, np.int32(_scale_offset(a.bits, w.bits)), y[start:]),
        )


def _shift_group_chunks(backend: Backend, a: EncodedRows, weight: GemmWeight):
    """(first row, rows, int32 G_d [groups, rows, N]) per chunk of activation rows (the scratch stays
    under GROUP_BYTES_LIMIT)."""
    rows_per_chunk = _rows_per_chunk(a, weight)
    for start in range(0, a.rows, rows_per_chunk):
        rows = min(rows_per_chunk, a.rows - start)
        yield start, rows, _shift_groups(backend, a, weight, start, rows)


def _rows_per_chunk(a: EncodedRows, weight: GemmWeight) -> int:
    """Rows of X per vendor-GEMM round, so that the int32 G_d scratch stays under GROUP_BYTES_LIMIT."""
    return max(1, GROUP_BYTES_LIMIT // ((a.slices + weight.encoded.slices - 1) * weight.n * 4))


def _combine_grid(rows: int, n: int) -> tuple[int, int]:
    return (-(-n // COMBINE_THREADS), min(rows, 65535))


def _shift_groups(backend: Backend, a: EncodedRows, weight: GemmWeight, start: int, rows: int):
    """int32 [groups, rows, n]: G_d = sum_{i+j=d} X_i . W_j for rows start..start+rows of X, one
    vendor int8 GEMM per digit shift d (exact: gemm_max_k keeps every G_d inside int32)."""
    w = weight.encoded
    n_a, n_w, kp = a.slices, w.slices, a.k_padded
    groups = n_a + n_w - 1
    n = weight.n
    g = backend.empty((groups, rows, n), np.int32)
    for d in range(groups):
        i_lo, i_hi = max(0, d - (n_w - 1)), min(d, n_a - 1)
        pairs = i_hi - i_lo + 1
        # activation digits i_lo..i_hi meet weight digits d-i_lo..d-i_hi, which sit in
        # ascending slots from n_w-1-(d-i_lo) in the most-significant-first layout.
        backend.gemm_s8_s32(
            n, rows, pairs * kp,
            w.digits, (n_w - 1 - d + i_lo) * kp, n_w * kp,
            a.digits, (start * n_a + i_lo) * kp, n_a * kp,
            g, d * rows * n, n,
        )
    return g

