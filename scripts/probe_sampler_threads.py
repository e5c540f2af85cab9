"""The device sampler (sampling_rows, one block per row) at a decode step's size over block sizes.

    PYTHONPATH=$PWD python3 scripts/probe_sampler_threads.py [results.json]

256 rows of Qwen3's 151,936 logits (a model-like spread: standard normal times 3), temperature 1, with the
log-probs, as bench decode samples; each block size's tokens and log-probs are compared bitwise with the
512-thread launch's (the contract's scan is exact: the bits must not depend on it), each timed by CUDA
events over repeated launches. Prints one JSON line per block size.
"""

import cupy as cp
import numpy as np

from rlportable.ops import sampling
from rlportable.runtime import get_backend

from kernel_variants import emit, mean_us, write  # scripts/kernel_variants.py

ROWS, VOCAB = 256, 151936
THREADS = (512, 256, 1024)


def main():
    backend = get_backend("cuda")
    rng = np.random.default_rng(0)
    logits = cp.asarray((3 * rng.standard_normal((ROWS, VOCAB))).astype(np.float32))
    temperature = cp.ones(ROWS, np.float64)
    seed = cp.full(ROWS, 7, np.uint64)
    request = cp.arange(ROWS, dtype=np.uint32)
    sample_index = cp.zeros(ROWS, np.uint32)
    position = cp.full(ROWS, 300, np.uint32)
    results, reference = [], None
    for threads in THREADS:
        run = lambda: sampling.sample_on_device(backend, logits, temperature, seed, request, sample_index, position,
                                                threads=threads, with_logprobs=True)
        tokens, logp = run()
        bits = (cp.asnumpy(tokens), cp.asnumpy(logp).view(np.uint32))
        reference = reference or bits
        same = all(np.array_equal(a, b) for a, b in zip(bits, reference))
        emit(results, dict(rows=ROWS, vocab=VOCAB, threads=threads, us=round(mean_us(run, 20), 1), same_bits=same))
    write(results)


if __name__ == "__main__":
    main()
