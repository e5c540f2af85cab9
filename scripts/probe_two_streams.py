"""Does a decode step gain from two half batches on two streams (one's attention beside the other's gemm)?

    PYTHONPATH=$PWD python3 scripts/probe_two_streams.py [SEQUENCES] [KV_LENGTH] [path.json]

The Qwen3-0.6B shape with random weights, SEQUENCES sequences decoding at position KV_LENGTH - 1 (the
cache filled with random encoded rows, as scripts/profile_decode.py). Three CUDA graphs of the forward
and the LM head are captured and replayed:
  whole:       every row in one pass (what the engine's graphs do);
  halves:      the first and the second half of the rows one after the other on one stream;
  two_streams: the halves on two streams forked from and joined to the engine's stream, so the GPU may
               run one half's kernels beside the other's;
  two_streams_one_lm_head: the same for the layers, then one LM head over all rows.
The logits of the halves are compared bitwise with the whole pass's (each row's bits depend on that row
alone). Medians of REPEATS replays, milliseconds.
"""

import json
import sys

import numpy as np

from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.bench.timing import replay_ms
from rlportable.engine.runner import ModelRunner
from rlportable.engine.step_inputs import plan_decode
from rlportable.model.forward import Model, StepInputs
from rlportable.runtime import get_backend

from decode_rows import decode_entries, fill_caches_randomly  # scripts/decode_rows.py

SEQUENCES = int(sys.argv[1]) if len(sys.argv) > 1 else 256
KV_LENGTH = int(sys.argv[2]) if len(sys.argv) > 2 else 384
BLOCK_SIZE, REPEATS = 16, 10

backend = get_backend("cuda")
cupy = backend.cupy
config = qwen3_06b_config(None)
model = Model(backend, config, random_weights(config))
blocks_per_seq = -(-KV_LENGTH // BLOCK_SIZE)
runner = ModelRunner(model, SEQUENCES * blocks_per_seq, BLOCK_SIZE, sampler="device", cuda_graphs=False,
                     max_num_seqs=SEQUENCES, max_model_len=blocks_per_seq * BLOCK_SIZE + BLOCK_SIZE)
fill_caches_randomly(cupy, runner.caches)


def inputs(scheduled):
    plan = plan_decode(scheduled, len(scheduled), runner.table_width, BLOCK_SIZE)
    return plan, StepInputs(*(backend.asarray(np.asarray(getattr(plan, name))) for name in StepInputs._fields))


def hidden_of(plan, device):
    return model.step(plan.tokens, plan.positions, plan.q_seq, plan.block_tables, plan.slots, runner.caches,
                      device=device)


def logits_of(plan, device):
    return model.logits(hidden_of(plan, device))


scheduled = decode_entries(config.vocab_size, SEQUENCES, KV_LENGTH, blocks_per_seq)
half = SEQUENCES // 2
whole_in, first_in, second_in = inputs(scheduled), inputs(scheduled[:half]), inputs(scheduled[half:])


def whole():
    return [logits_of(*whole_in)]


def halves():
    return [logits_of(*first_in), logits_of(*second_in)]


def forked(first_half, second_half):
    """first_half() on the current stream, second_half() on a side stream forked from it, joined after."""
    main = cupy.cuda.get_current_stream()
    side = cupy.cuda.Stream(non_blocking=True)
    fork, join = cupy.cuda.Event(disable_timing=True), cupy.cuda.Event(disable_timing=True)
    fork.record(main)
    side.wait_event(fork)
    first = first_half()
    with side:
        second = second_half()
        join.record(side)
    main.wait_event(join)
    return first, second


def two_streams():
    return list(forked(lambda: logits_of(*first_in), lambda: logits_of(*second_in)))


def two_streams_one_lm_head():
    """The halves' layers on two streams, the LM head once over all rows after the join."""
    first, second = forked(lambda: hidden_of(*first_in), lambda: hidden_of(*second_in))
    return [model.logits(cupy.concatenate([first, second]))]


def warm_replay_ms(graph) -> float:
    stream = backend.engine_stream()
    graph.replay()
    stream.synchronize()
    return replay_ms(cupy, graph, stream, REPEATS)


def main():
    with backend.engine_stream():  # warm-up: compiles, allocates
        whole(), halves()
    backend.synchronize()
    results, reference = {}, None
    for name, body in (("whole", whole), ("halves", halves), ("two_streams", two_streams),
                       ("two_streams_one_lm_head", two_streams_one_lm_head)):
        graph, outputs = backend.capture_graph(body)
        ms = warm_replay_ms(graph)
        bits = np.concatenate([cupy.asnumpy(o).view(np.uint32) for o in outputs])
        reference = bits if reference is None else reference
        results[name] = {"replay_ms": round(ms, 3), "same_bits_as_whole": bool(np.array_equal(bits, reference))}
        print(name, results[name], flush=True)
    report = {"device": backend.info(), "sequences": SEQUENCES, "kv_length": KV_LENGTH, "results": results}
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
