"""Where the engine's prefill steps spend their time (bench decode's first steps), on a device.

    PYTHONPATH=$PWD python3 scripts/profile_prefill.py [layers=28]

The Qwen3-0.6B shape with random weights, a KV cache of random encoded rows, and the steps bench
decode begins with (256 sequences, 128-token prompts, a 4096-token budget): a step of 32 whole
prompts, and mixed steps of D decodes (at position 160) followed by prompts filling the budget.
Prints one JSON object, per step:
  * step_ms: ModelRunner.execute of the step (no graphs: a mixed step has none), median of REPEATS;
  * ops_ms: exclusive device time per op kind, synchronising around every op call (so the sum is a
    little above step_ms);
  * step_ms_one_attention_call: the same step with the attention of all rows in one call (before
    ops.attention.attention_step cut it into decodes and prefill chunks).
"""

import json
import statistics
import sys
import time

import numpy as np

from profiling import op_timer
from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.engine.runner import ModelRunner
from rlportable.engine.scheduler import ScheduledSequence, SchedulerOutput
from rlportable.engine.sequence import SamplingParams, Sequence, SequenceStatus
from rlportable.model.forward import Model
from rlportable.ops import activation, attention, embedding, gemm, norm
from rlportable.ops import sampling as sampling_op
from rlportable.runtime import get_backend

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else None
PROMPT, BUDGET, DECODE_POSITION, BLOCK_SIZE, REPEATS = 128, 4096, 160, 16, 3
DECODES = (0, 128, 224)

backend = get_backend("cuda")
cupy = backend.cupy
config = qwen3_06b_config(LAYERS)
model = Model(backend, config, random_weights(config))
blocks_per_seq = -(-(DECODE_POSITION + 1) // BLOCK_SIZE)
SEQUENCES = max(DECODES) + BUDGET // PROMPT


def make_runner() -> ModelRunner:
    made = ModelRunner(model, SEQUENCES * blocks_per_seq, BLOCK_SIZE, sampler="device", cuda_graphs=False,
                       max_num_seqs=SEQUENCES, max_model_len=blocks_per_seq * BLOCK_SIZE)
    for cache in made.caches:
        for digits in (cache.k_digits, cache.v_digits):
            digits[...] = cupy.random.randint(-128, 128, digits.shape, dtype=np.int32).astype(np.int8)
    return made


def step(decodes: int) -> SchedulerOutput:
    """`decodes` sequences decoding at DECODE_POSITION, then whole prompts up to the token budget."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    entries = []
    prompts = (BUDGET - decodes) // PROMPT
    for index in range(decodes + prompts):
        decode = index < decodes
        length = DECODE_POSITION + 1 if decode else PROMPT
        seq = Sequence(index, rng.integers(0, config.vocab_size, length).tolist(), params)
        seq.status = SequenceStatus.RUNNING
        seq.block_table = list(range(index * blocks_per_seq, (index + 1) * blocks_per_seq))
        seq.num_computed_tokens = length - 1 if decode else 0
        start, count = (length - 1, 1) if decode else (0, length)
        entries.append(ScheduledSequence(seq, start, count, True, [seq]))
    return SchedulerOutput(entries, [], [], sum(e.num_new_tokens for e in entries))


def step_ms(made: ModelRunner, out: SchedulerOutput) -> float:
    made.execute(out)  # warm-up
    walls = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        made.execute(out)
        walls.append(time.perf_counter() - start)
    return 1e3 * statistics.median(walls)


PATCHES = [(gemm, "gemm"), (gemm, "gemm_columns"), (attention, "write_kv"), (attention, "attention_paged"),
           (norm, "rmsnorm"), (norm, "add_rmsnorm"), (norm, "rmsnorm_heads_rope"), (activation, "swiglu_encode"),
           (embedding, "gather"), (sampling_op, "sample_on_device")]


def ops_ms(made: ModelRunner, out: SchedulerOutput) -> dict:
    totals, calls, timed = op_timer(backend)
    originals = [(module, name, getattr(module, name)) for module, name in PATCHES]
    for module, name in PATCHES:
        setattr(module, name, timed(f"{module.__name__.split('.')[-1]}.{name}", getattr(module, name)))
    try:
        made.execute(out)
    finally:
        for module, name, original in originals:
            setattr(module, name, original)
    return {name: 1e3 * s for name, s in sorted(totals.items(), key=lambda kv: -kv[1])}


def one_attention_call(backend_, q, q_seq, q_pos, cache, block_tables, parts):
    return attention.attention_paged(backend_, q, q_seq, q_pos, cache, block_tables)


runner = make_runner()
results = []
for decodes in DECODES:
    out = step(decodes)
    row = {"decodes": decodes, "prompt_rows": out.num_batched_tokens - decodes, "step_ms": step_ms(runner, out),
           "ops_ms": ops_ms(runner, out)}
    if decodes:
        cut = attention.attention_step
        attention.attention_step = one_attention_call
        try:
            row["step_ms_one_attention_call"] = step_ms(runner, out)
        finally:
            attention.attention_step = cut
    results.append(row)
    print(json.dumps(row), file=sys.stderr)
print(json.dumps({"device": backend.info(), "layers": config.num_hidden_layers, "block_size": BLOCK_SIZE,
                  "steps": results}, indent=1))
