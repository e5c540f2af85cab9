"""The block-per-row kernels at decode sizes (256 rows of a Qwen3-0.6B step) over block sizes.

    PYTHONPATH=$PWD [RLP_PROBE_ROWS=4096] python3 scripts/probe_row_kernels.py [results.json]

norm_add_rmsnorm with the encoding (H = 1024), fixedpoint_encode_rows (K = 2048, the o projection's
input) and activation_swiglu_encode (H = 3072), each launched with 128 to 1024 threads a row; every
launch's outputs are compared bitwise with the 256-thread launch's (the bits must not depend on it),
each timed by CUDA events over repeated launches. Prints one JSON line per measurement.

(The first version of this probe, at 115fd22, compared these kernels and the QK-norm + RoPE with
one segment of 32 lanes per row: bench/results/row_kernels_probe_h200.json.)
"""

import os

import cupy as cp
import numpy as np

from rlportable.runtime import get_backend

from kernel_variants import emit, load, mean_us, write  # scripts/kernel_variants.py

ROWS = int(os.environ.get("RLP_PROBE_ROWS", "256"))  # 256: a decode step; 4096: a prefill step's token budget
THREADS = (256, 128, 512, 1024)


def cases(backend, rng):
    """(op, launch(threads)) for each kernel, and the arrays it writes."""
    options = backend.compile_options()
    norm = load(backend.source("norm"), "norm", options).get_function("norm_add_rmsnorm")
    h = 1024
    a, b = (cp.asarray(rng.standard_normal((ROWS, h), np.float32)) for _ in range(2))
    w = cp.asarray(rng.standard_normal(h, np.float32))
    s, y = cp.empty((ROWS, h), np.float32), cp.empty((ROWS, h), np.float32)
    digits, exps = cp.zeros((ROWS, 3, h), np.int8), cp.zeros(ROWS, np.int32)
    args = (a, b, w, np.int64(ROWS), np.int32(h), np.float64(1e-6), s, y, digits, exps, np.int32(h))
    yield "add_rmsnorm_encode", lambda t: norm((ROWS,), (t,), args, shared_mem=8 * h), (s, y, digits, exps)

    encode = load(backend.source("fixedpoint"), "fixedpoint", options).get_function("fixedpoint_encode_rows")
    k = 2048
    x = cp.asarray(rng.standard_normal((ROWS, k), np.float32))
    digits2, exps2 = cp.zeros((ROWS, 3, k), np.int8), cp.zeros(ROWS, np.int32)
    args2 = (x, np.int64(ROWS), np.int32(k), np.int32(k), np.int32(23), np.int32(3), np.int32(0), digits2, exps2)
    yield "encode_rows", lambda t: encode((ROWS,), (t,), args2), (digits2, exps2)

    swiglu = load(backend.source("activation"), "activation", options).get_function("activation_swiglu_encode")
    h3 = 3072
    gate, up = (cp.asarray(rng.standard_normal((ROWS, h3), np.float32)) for _ in range(2))
    y3, digits3, exps3 = cp.empty((ROWS, h3), np.float32), cp.zeros((ROWS, 3, h3), np.int8), cp.zeros(ROWS, np.int32)
    args3 = (gate, up, np.int64(ROWS), np.int32(h3), np.int32(h3), y3, digits3, exps3)
    yield "swiglu_encode", lambda t: swiglu((ROWS,), (t,), args3, shared_mem=4 * h3), (y3, digits3, exps3)


def main():
    backend = get_backend("cuda")
    rng = np.random.default_rng(0)
    results = []
    for op, launch, outputs in cases(backend, rng):
        reference = None
        for threads in THREADS:
            launch(threads)
            bits = [o.view(np.uint8).copy() for o in outputs]
            reference = reference or bits
            same = all(bool(cp.array_equal(x, r)) for x, r in zip(bits, reference))
            emit(results, dict(op=op, rows=ROWS, threads=threads, us=round(mean_us(lambda: launch(threads), 50), 2),
                               same_bits=same))
    write(results)


if __name__ == "__main__":
    main()
