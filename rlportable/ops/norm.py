"""Op family "norm": RMSNorm, and the per-head QK-norm (the same op on rows = tokens * heads).

Contract: contracts/norm.toml; reference: rlportable/contract/norm.py rmsnorm (and
rmsnorm_backward, the gradient); kernels: backends/portable/norm.hip.
"""

from __future__ import annotations

import math

import numpy as np

from rlportable.contract import norm as reference
from rlportable.errors import InputError
from rlportable.ops import fixedpoint, segments
from rlportable.ops.checks import NULL_POINTER, require_bits, require_contiguous, require_matrix, shape_of

NORM_THREADS = 256
#: the forward row kernels' blocks: the fastest of 256, 512 and 1024 threads a row at decode's rows on
#: the H200 (bench/results/row_threads_probe_h200.json)
ROW_THREADS = 512
MAX_GRID = 65535
#: rows up to these lengths run fused, longer ones as the ops in turn (the same bits): add_rmsnorm keeps
#: its row in shared memory; rmsnorm_heads_rope gives a head row to one segment of 32 lanes
MAX_FUSED_HEAD_DIM = 4096  # rmsnorm_heads_rope
MAX_FUSED_ROW = 8192  # add_rmsnorm (32 KB: with the static scratch, under the 48 KB a launch may take unasked)
#: add_rmsnorm with the gemm's encoding of y keeps y as a second shared row: 2 x 4096 floats, the same 32 KB
MAX_FUSED_ENCODED_ROW = 4096
#: the one encoding norm_add_rmsnorm computes (RLP_NORM_ENCODE_BITS/_SLICES in backends/portable/norm.hip):
#: gemm.DEFAULT_BITS_A, the activations' bits; other bits are encoded by a separate launch
FUSED_ENCODE_BITS = reference.ENCODE_BITS
def hip_dynamic_lds() -> dict[str, int]:
    """The dynamic shared memory this family's kernels take at most on hip (build/amd_resources.py)."""
    return {"norm_add_rmsnorm": max(2 * 4 * MAX_FUSED_ENCODED_ROW, 4 * MAX_FUSED_ROW)}


THREAD_SEGMENT = segments.SEGMENT  # the kernels' block reductions work on segments of 32 lanes (backends/portable/common.h)


def row_threads(h: int) -> int:
    """Threads of one row's block (norm_rmsnorm, norm_add_rmsnorm): enough for h up to ROW_THREADS, a
    multiple of THREAD_SEGMENT as the block reductions require. The bits do not depend on it."""
    return min(ROW_THREADS, -(-h // THREAD_SEGMENT) * THREAD_SEGMENT)


def check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)) or not math.isfinite(eps) \
            or eps < 0:
        raise InputError(f"rmsnorm: eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def rmsnorm(backend, x, weight, eps: float):
    """y [rows, H] float32 = RMSNorm of x [rows, H] float32 with weight [H] float32 under the contract."""
    rows, h = require_matrix("x", x)
    if shape_of(weight) != (h,) or np.dtype(weight.dtype) != np.float32:
        raise InputError(f"rmsnorm: weight must be float32 of shape ({h},) to match x {(rows, h)}, "
                         f"got {np.dtype(weight.dtype).name} of shape {shape_of(weight)}")
    if h > reference.MAX_ROW:
        raise InputError(f"rmsnorm: row length {h} exceeds the contract's limit {reference.MAX_ROW}")
    eps = check_eps(eps)
    if backend.runs_reference:
        if rows == 0 or h == 0:
            return np.empty((rows, h), dtype=np.float32)
        return reference.rmsnorm(backend.to_numpy(x), backend.to_numpy(weight), eps)
    y = backend.empty((rows, h), np.float32)
    if rows and h:
        backend.launch("norm", "norm_rmsnorm", (min(rows, MAX_GRID),), (row_threads(h),),
                       (x, weight, np.int64(rows), np.int32(h), np.float64(eps), y))
    return y


def rmsnorm_heads(backend, x, weight, eps: float):
    """QK-norm: x [tokens, heads, head_dim] float32, weight [head_dim]; each head's row normalised alone."""
    shape = shape_of(x)
    if len(shape) != 3:
        raise InputError(f"rmsnorm_heads: x must be [tokens, heads, head_dim], got shape {shape}")
    tokens, heads, head_dim = shape
    y = rmsnorm(backend, x.reshape(tokens * heads, head_dim), weight, eps)
    return y.reshape(tokens, heads, head_dim)


def add_rmsnorm(backend, a, b, weight, eps: float, encode_bits: int | None = None):
    """(s, y) = (residual.add(a, b), rmsnorm(s, weight)), bitwise (contracts/norm.toml add_rmsnorm): a
    layer's residual add and the next RMSNorm in one device launch. a, b [rows, H] float32.

    encode_bits: also return y's fixed-point encoding for the gemm, (s, y, fixedpoint.encode_rows(y,
    encode_bits)) (ascending digits): at FUSED_ENCODE_BITS (gemm.DEFAULT_BITS_A) the same launch writes
    it, saving the gemm's own encode launch; at other bits, for rows longer than MAX_FUSED_ENCODED_ROW
    or H = 0, encode_rows runs after it (the same bits either way)."""
    rows, h = require_matrix("add_rmsnorm: a", a)
    if shape_of(b) != (rows, h) or np.dtype(a.dtype) != np.float32 or np.dtype(b.dtype) != np.float32:
        raise InputError(f"add_rmsnorm: a {shape_of(a)} {np.dtype(a.dtype).name} and b {shape_of(b)} "
                         f"{np.dtype(b.dtype).name} must be float32 of one shape")
    require_contiguous("add_rmsnorm: b", b)
    if shape_of(weight) != (h,) or np.dtype(weight.dtype) != np.float32:
        raise InputError(f"add_rmsnorm: weight must be float32 of shape ({h},) to match a {(rows, h)}, "
                         f"got {np.dtype(weight.dtype).name} of shape {shape_of(weight)}")
    eps = check_eps(eps)
    if encode_bits is not None:
        encode_bits = require_bits("add_rmsnorm: encode_bits", encode_bits)
    fused_encoding = (encode_bits == FUSED_ENCODE_BITS and not backend.runs_reference
                      and 0 < h <= MAX_FUSED_ENCODED_ROW)
    if not fused_encoding:  # no encoding, or one the kernel does not write: encode_rows after (the reference on cpu)
        total, y = _add_rmsnorm(backend, a, b, weight, eps, rows, h)
        return (total, y) if encode_bits is None else (total, y, fixedpoint.encode_rows(backend, y, encode_bits))
    encoded = fixedpoint.empty_encoding(backend, rows, h, encode_bits)
    return (*_launch_add_rmsnorm(backend, a, b, weight, eps, encoded), encoded)


def _add_rmsnorm(backend, a, b, weight, eps: float, rows: int, h: int):
    """add_rmsnorm's (s, y) without an encoding: the reference on cpu, one launch on devices, the two ops in
    turn for rows the kernel cannot hold."""
    from rlportable.ops import residual

    if backend.runs_reference or h > MAX_FUSED_ROW:
        total = residual.add(backend, a, b)
        return total, rmsnorm(backend, total, weight, eps)
    return _launch_add_rmsnorm(backend, a, b, weight, eps, None)


def _launch_add_rmsnorm(backend, a, b, weight, eps: float, encoded):
    """(s, y) from one norm_add_rmsnorm launch; encoded (empty_encoding at FUSED_ENCODE_BITS) or None: the
    kernel also writes y's encoding there (y kept as a second shared row) or gets null pointers."""
    rows, h = shape_of(a)
    total, y = backend.empty((rows, h), np.float32), backend.empty((rows, h), np.float32)
    if encoded is None:
        outputs, shared_rows = (NULL_POINTER, NULL_POINTER, np.int32(0)), 1
    else:
        outputs, shared_rows = (encoded.digits, encoded.exponents, np.int32(encoded.k_padded)), 2
    if rows and h:
        backend.launch("norm", "norm_add_rmsnorm", (min(rows, MAX_GRID),), (row_threads(h),),
                       (a, b, weight, np.int64(rows), np.int32(h), np.float64(eps), total, y) + outputs,
                       shared_mem=shared_rows * 4 * h)  # the sum's row (and y's)
    return total, y


def _check_heads_rope(backend, q, k, q_weight, k_weight, eps, positions, cos, sin, host_positions, op: str):
    """rmsnorm_heads_rope's argument checks: (tokens, hq, hk, d, eps, host positions)."""
    from rlportable.ops import rope  # rope's argument checks; the kernel lives here, in the norm family

    tokens, hq, half, table_rows = rope._check(q, positions, cos, sin, op, "q")
    _, hk, _, _ = rope._check(k, positions, cos, sin, op, "k")  # q's tokens and head_dim
    d = 2 * half
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        if shape_of(weight) != (d,) or np.dtype(weight.dtype) != np.float32:
            raise InputError(f"{op}: {name} must be float32 of shape ({d},), got "
                             f"{np.dtype(weight.dtype).name} of shape {shape_of(weight)}")
    require_contiguous(f"{op}: q", q)
    require_contiguous(f"{op}: k", k)
    host_positions = rope._check_positions(backend, positions, host_positions, table_rows, op)
    return tokens, hq, hk, d, check_eps(eps), host_positions


def rmsnorm_heads_rope(backend, q, k, q_weight, k_weight, eps: float, positions, cos, sin, host_positions=None):
    """(q', k') = (rope.apply(rmsnorm_heads(q, q_weight)), rope.apply(rmsnorm_heads(k, k_weight))), bitwise
    (contracts/norm.toml rmsnorm_heads_rope): Qwen3's QK-norm and RoPE of both in one device launch.
    q [tokens, hq, D], k [tokens, hk, D] float32; the weights [D]; positions and tables as rope.apply."""
    from rlportable.ops import rope

    tokens, hq, hk, d, eps, host_positions = _check_heads_rope(backend, q, k, q_weight, k_weight, eps, positions,
                                                               cos, sin, host_positions, "rmsnorm_heads_rope")
    if d > MAX_FUSED_HEAD_DIM:  # rows the kernel cannot hold: the two ops in turn, the same bits
        return tuple(rope.apply(backend, rmsnorm_heads(backend, x, w, eps), positions, cos, sin, host_positions)
                     for x, w in ((q, q_weight), (k, k_weight)))
    if backend.runs_reference:
        cos_rows, sin_rows = (backend.to_numpy(table)[host_positions] for table in (cos, sin))
        return reference.rmsnorm_heads_rope(*(backend.to_numpy(a) for a in (q, k, q_weight, k_weight)), eps,
                                            cos_rows, sin_rows)
    q_out, k_out = backend.empty((tokens, hq, d), np.float32), backend.empty((tokens, hk, d), np.float32)
    rows = tokens * (hq + hk)
    if rows and d:
        backend.launch("norm", "norm_rmsnorm_heads_rope", *segments.segment_launch_shape(rows),
                       (q, k, q_weight, k_weight, np.int64(tokens), np.int32(hq), np.int32(hk), np.int32(d),
                        np.float64(eps), positions, cos, sin, q_out, k_out))
    return q_out, k_out


def rmsnorm_heads_rope_write_kv(backend, q, k, v, q_weight, k_weight, eps: float, positions, cos, sin, cache,
                                slots, host_positions=None):
    """rmsnorm_heads_rope(q, k), then attention.write_kv(cache, k', v, slots), bitwise (contracts/norm.toml,
    the family's extra kernel): the engine step's QK-norm, RoPE and KV cache write in one device launch.
    v [tokens, hk, D] float32; cache and slots as write_kv. Returns (q', k')."""
    from rlportable.ops import attention

    tokens, hq, hk, d, eps, host_positions = _check_heads_rope(backend, q, k, q_weight, k_weight, eps, positions,
                                                               cos, sin, host_positions, "rmsnorm_heads_rope_write_kv")
    # every cache's head_dim (at most attention.MAX_HEAD_DIM = 512) fits the kernel's registers (RLP_NORM_KV_PAIRS)
    if backend.runs_reference:  # the two ops in turn: the same bits
        q_out, k_out = rmsnorm_heads_rope(backend, q, k, q_weight, k_weight, eps, positions, cos, sin, host_positions)
        attention.write_kv(backend, cache, k_out, v, slots)
        return q_out, k_out
    attention.check_kv(cache, k, v, slots)
    if isinstance(slots, np.ndarray):
        slots = backend.asarray(slots)
    q_out, k_out = backend.empty((tokens, hq, d), np.float32), backend.empty((tokens, hk, d), np.float32)
    rows = tokens * (hq + 2 * hk)
    if rows and d:
        backend.launch("norm", "norm_rmsnorm_heads_rope_write_kv", *segments.segment_launch_shape(rows),
                       (q, k, v, q_weight, k_weight, np.int64(tokens), np.int32(hq), np.int32(hk), np.int32(d),
                        np.float64(eps), positions, cos, sin, q_out, k_out, slots, np.int64(cache.num_slots),
                        np.int32(cache.head_dim_padded), cache.k_digits, cache.k_exponents, cache.v_digits,
                        cache.v_exponents))
    return q_out, k_out


GRAD_COLUMNS = 256  # threads of the dweight kernels: one column each, consecutive columns for coalescing
GRAD_ROWS_PER_CHUNK = 256  # rows one dweight thread folds into one global atomic per column


def _check_backward(op: str, x, weight, eps, dy) -> tuple[int, int, float]:
    rows, h = require_matrix(f"{op}: x", x)
    if shape_of(dy) != (rows, h) or np.dtype(dy.dtype) != np.float32:
        raise InputError(f"{op}: dy must be float32 of shape {(rows, h)} to match x, "
                         f"got {np.dtype(dy.dtype).name} of shape {shape_of(dy)}")
    require_contiguous(f"{op}: dy", dy)
    if shape_of(weight) != (h,) or np.dtype(weight.dtype) != np.float32:
        raise InputError(f"{op}: weight must be float32 of shape ({h},) to match x {(rows, h)}, "
                         f"got {np.dtype(weight.dtype).name} of shape {shape_of(weight)}")
    if h > reference.MAX_ROW:
        raise InputError(f"{op}: row length {h} exceeds the contract's limit {reference.MAX_ROW}")
    if rows > reference.MAX_GRAD_ROWS:
        raise InputError(f"{op}: {rows} rows exceed the contract's limit {reference.MAX_GRAD_ROWS} "
                         f"(dweight's exact int64 sum over rows)")
    return rows, h, check_eps(eps)


def rmsnorm_backward(backend, x, weight, eps: float, dy):
    """(dx [rows, H], dweight [H]) float32: the gradient of rmsnorm(x, weight, eps) for the upstream dy,
    under contracts/norm.toml rmsnorm_backward (exact fixed-point sums over H and over rows)."""
    rows, h, eps = _check_backward("rmsnorm_backward", x, weight, eps, dy)
    if backend.runs_reference:
        return reference.rmsnorm_backward(backend.to_numpy(x), backend.to_numpy(weight), eps, backend.to_numpy(dy))
    dx = backend.empty((rows, h), np.float32)
    dweight = backend.zeros((h,), np.float32)  # rows = 0: the empty sums are +0
    if rows == 0 or h == 0:
        return dx, dweight
    row_scale = backend.empty((rows,), np.float64)
    # blocks no wider than the row (QK-norm's rows of 128 left half of 256 threads idle); the sums are
    # exact integers, so the bits do not depend on the block size
    backend.launch("norm", "norm_rmsnorm_backward", (min(rows, MAX_GRID),), (min(NORM_THREADS, row_threads(h)),),
                   (x, weight, dy, np.int64(rows), np.int32(h), np.float64(eps), dx, row_scale))
    largest = backend.zeros((h,), np.uint64)
    total = backend.zeros((h,), np.int64)
    columns = min(GRAD_COLUMNS, row_threads(h))
    grid = (min(-(-h // columns), MAX_GRID), min(-(-rows // GRAD_ROWS_PER_CHUNK), MAX_GRID))
    args = (dy, x, row_scale, np.int64(rows), np.int32(h), np.int32(GRAD_ROWS_PER_CHUNK))
    backend.launch("norm", "norm_rmsnorm_dweight_largest", grid, (columns,), args + (largest,))
    backend.launch("norm", "norm_rmsnorm_dweight_sum", grid, (columns,), args + (largest, total))
    backend.launch("norm", "norm_rmsnorm_dweight_round", (min(-(-h // columns), MAX_GRID),), (columns,),
                   (largest, total, np.int32(h), dweight))
    return dx, dweight


def rmsnorm_heads_backward(backend, x, weight, eps: float, dy):
    """QK-norm's gradient: x, dy [tokens, heads, head_dim]; dx like x, dweight [head_dim] summed over
    tokens and heads (rows = tokens * heads of rmsnorm_backward)."""
    shape = shape_of(x)
    if len(shape) != 3:
        raise InputError(f"rmsnorm_heads_backward: x must be [tokens, heads, head_dim], got shape {shape}")
    if shape_of(dy) != shape:
        raise InputError(f"rmsnorm_heads_backward: dy must have x's shape {shape}, got {shape_of(dy)}")
    tokens, heads, head_dim = shape
    dx, dweight = rmsnorm_backward(backend, x.reshape(tokens * heads, head_dim), weight, eps,
                                   dy.reshape(tokens * heads, head_dim))
    return dx.reshape(tokens, heads, head_dim), dweight
