"""Decode-step rows for the profiling scripts (scripts/profile_decode.py)."""

import numpy as np

from rlportable.engine.scheduler import ScheduledSequence
from rlportable.engine.sequence import SamplingParams, Sequence, SequenceStatus


def decode_entries(vocab_size: int, sequences: int, kv_length: int, blocks_per_seq: int) -> list:
    """`sequences` running sequences of random prompts, each decoding its token at position kv_length - 1
    over its own consecutive cache blocks (executing the step does not change them: it can run again)."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    entries = []
    for index in range(sequences):
        seq = Sequence(index, rng.integers(0, vocab_size, kv_length).tolist(), params)
        seq.status = SequenceStatus.RUNNING
        seq.block_table = list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq))
        seq.num_computed_tokens = kv_length - 1
        entries.append(ScheduledSequence(seq, kv_length - 1, 1, True, [seq]))
    return entries


def fill_caches_randomly(cupy, caches) -> None:
    """Random encoded K and V digits in every cache (the kernels' time does not depend on the values)."""
    for cache in caches:
        for digits in (cache.k_digits, cache.v_digits):
            digits[...] = cupy.random.randint(-128, 128, digits.shape, dtype=np.int32).astype(np.int8)
