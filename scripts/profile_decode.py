"""Where a decode step's time goes: device time per op (CUDA events), and whole steps with and without graphs.

    PYTHONPATH=$PWD python3 scripts/profile_decode.py [sequences=256] [kv_length=384] [layers=28]

The Qwen3-0.6B shape with random weights; `sequences` sequences each feed one token at position
kv_length - 1 (so every query attends to kv_length keys, its own included) over a KV cache filled
with random encoded rows. Prints one JSON object:
  * ops_ms: exclusive device time per op kind in one padded decode step (the graph's body: the
    forward and the LM head; then the device sampler's kernels), from CUDA events around every op
    call. A spin kernel holds the GPU while Python queues the whole step, so the ops then run back
    to back and the events measure device time, not launch gaps (`enqueue_s` must stay below
    `spin_s`; raise it with RLP_PROFILE_SPIN_S otherwise). gemm is split by weight (q, k, v, o,
    gate, up, down, lm_head) and into its activation encode and the fused kernel.
  * steps: ModelRunner.execute of the whole step (upload, forward, sampler, download), median
    of several calls, with CUDA graphs and without (exact-size eager step), with the runner's
    own split (host: planning + upload + launches; wait: the one download; finish: host work);
    graph_replay_ms: one replay of the captured forward alone.
  * RLP_PROFILE_NVTX=1: one more replay inside an NVTX range "replay", so that
    `ncu --nvtx --nvtx-include replay/` times the graph's kernels one by one.
  * bound_ms: the step's bytes (bench decode's step_bytes) over the measured copy bandwidth.
"""

import collections
import json
import os
import statistics
import sys
import time


from rlportable.bench.decode import copy_bandwidth, step_bytes
from rlportable.model.synthetic import qwen3_06b_config, random_weights
from rlportable.bench.timing import _SPIN_SOURCE, replay_ms
from rlportable.engine.runner import ModelRunner
from rlportable.engine.scheduler import SchedulerOutput
from rlportable.engine.step_inputs import plan_decode
from rlportable.model.forward import Model
from rlportable.ops import activation, attention, embedding, gemm, gemm_fused, norm, residual, rope
from rlportable.ops import sampling as sampling_op
from rlportable.runtime import get_backend

from decode_rows import decode_entries, fill_caches_randomly  # scripts/decode_rows.py

SEQUENCES = int(sys.argv[1]) if len(sys.argv) > 1 else 256
KV_LENGTH = int(sys.argv[2]) if len(sys.argv) > 2 else 384
LAYERS = int(sys.argv[3]) if len(sys.argv) > 3 else None
BLOCK_SIZE = 16
REPEATS = 10
SPIN_S = float(os.environ.get("RLP_PROFILE_SPIN_S", "0.5"))

backend = get_backend("cuda")
cupy = backend.cupy
config = qwen3_06b_config(LAYERS)
model = Model(backend, config, random_weights(config))
blocks_per_seq = -(-KV_LENGTH // BLOCK_SIZE)
max_model_len = blocks_per_seq * BLOCK_SIZE + BLOCK_SIZE


def runner(cuda_graphs: bool) -> ModelRunner:
    """A runner whose cache holds `SEQUENCES` sequences of KV_LENGTH random encoded K/V rows."""
    made = ModelRunner(model, SEQUENCES * blocks_per_seq, BLOCK_SIZE, sampler="device", cuda_graphs=cuda_graphs,
                       max_num_seqs=SEQUENCES, max_model_len=max_model_len)
    fill_caches_randomly(cupy, made.caches)
    return made


def decode_step() -> SchedulerOutput:
    """Every sequence decodes its token at position KV_LENGTH - 1 (execute does not change them, so
    the same output can run again)."""
    return SchedulerOutput(decode_entries(config.vocab_size, SEQUENCES, KV_LENGTH, blocks_per_seq), [], [], SEQUENCES)


# ---------------------------------------------------------------- per-op device time

calls = []  # [kind, start event, stop event, depth], in the order the calls started
depth = [0]


def timed(kind_of, function):
    def wrapper(*args, **kwargs):
        start = cupy.cuda.Event()
        start.record()
        depth[0] += 1
        record = [None, start, None, depth[0]]
        calls.append(record)
        result = function(*args, **kwargs)
        depth[0] -= 1
        stop = cupy.cuda.Event()
        stop.record()
        record[0], record[2] = kind_of(args), stop
        return result
    return wrapper


weight_names = {id(getattr(layer, name)): name for layer in model.layers
                for name in ("q", "k", "v", "o", "gate", "up", "down")}
weight_names[id(model.lm_head)] = "lm_head"
weight_names.update({id(getattr(layer, name)): name for layer in model.layers for name in ("qkv", "gate_up")})


def gemm_kind(args):
    weight = args[2]
    return f"gemm.{weight_names.get(id(weight), type(weight).__name__)}"


PATCHES = [
    (gemm, "gemm", gemm_kind),
    (gemm, "gemm_columns", gemm_kind),  # the stacked projections (q/k/v, gate/up): one launch each
    (gemm, "encode_rows", lambda a: "gemm.encode_activations"),  # the name gemm imported from ops.fixedpoint
    (gemm_fused, "launch_fused", lambda a: "gemm.fused_kernel"),
    (attention, "write_kv", lambda a: "attention.write_kv"),
    (attention, "attention_paged", lambda a: "attention.paged"),
    # rmsnorm_heads (QK-norm) calls rmsnorm on [tokens * heads, head_dim]: told apart by the weight
    (norm, "rmsnorm", lambda a: "norm.qk_norm" if a[2].shape[0] == config.head_dim else "norm.rmsnorm"),
    (rope, "apply", lambda a: "rope.apply"),
    (norm, "add_rmsnorm", lambda a: "norm.add_rmsnorm"),
    (norm, "rmsnorm_heads_rope", lambda a: "norm.rmsnorm_heads_rope"),
    (activation, "swiglu", lambda a: "activation.swiglu"),
    (activation, "swiglu_encode", lambda a: "activation.swiglu_encode"),
    (residual, "add", lambda a: "residual.add"),
    (residual, "add_bias", lambda a: "residual.add_bias"),
    (embedding, "gather", lambda a: "embedding.gather"),
    (sampling_op, "sample_on_device", lambda a: "sampling.sample_and_logprobs"),
]


def clock_hz() -> float:
    """The SM clock, for the spin kernel's cycle count (2 GHz if the runtime no longer reports it)."""
    try:
        return cupy.cuda.Device().attributes["ClockRate"] * 1e3
    except Exception:  # noqa: BLE001 - an attribute some CUDA versions dropped
        return 2.0e9


def profile_ops(run) -> dict:
    """Exclusive device ms per op kind of one run of the padded decode step and its sampler."""
    originals = [(module, name, getattr(module, name)) for module, name, _ in PATCHES]
    spin = cupy.RawKernel(_SPIN_SOURCE, "bench_spin")
    cycles = int(SPIN_S * clock_hz())
    with backend.engine_stream():
        run()  # warm-up
        cupy.cuda.get_current_stream().synchronize()
        calls.clear()
        for module, name, kind_of in PATCHES:
            setattr(module, name, timed(kind_of, getattr(module, name)))
        try:
            spin((1,), (1,), (cupy.int64(cycles),))
            begin, end = cupy.cuda.Event(), cupy.cuda.Event()
            host_start = time.perf_counter()
            begin.record()
            run()
            end.record()
            enqueue = time.perf_counter() - host_start
            end.synchronize()
        finally:
            for module, name, original in originals:
                setattr(module, name, original)
    inclusive = [cupy.cuda.get_elapsed_time(c[1], c[2]) for c in calls]
    exclusive, totals, counts = list(inclusive), collections.Counter(), collections.Counter()
    stack = []  # indices of open calls, to subtract each call from its parent
    for index, call in enumerate(calls):
        while stack and calls[stack[-1]][3] >= call[3]:
            stack.pop()
        if stack:
            exclusive[stack[-1]] -= inclusive[index]
        stack.append(index)
    for call, ms in zip(calls, exclusive):
        totals[call[0]] += ms
        counts[call[0]] += 1
    return {"ops_ms": dict(sorted(totals.items(), key=lambda kv: -kv[1])), "op_calls": dict(counts),
            "ops_total_ms": sum(totals.values()), "events_span_ms": cupy.cuda.get_elapsed_time(begin, end),
            "enqueue_s": enqueue, "spin_s": SPIN_S}


def whole_steps(made: ModelRunner, out: SchedulerOutput) -> dict:
    made.execute(out)  # warm-up (and the capture, with graphs)
    walls, events, parts = [], [], collections.defaultdict(list)
    stream = backend.engine_stream()
    for _ in range(REPEATS):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        wall = time.perf_counter()
        made.execute(out)
        walls.append(time.perf_counter() - wall)
        stop.record(stream)
        stop.synchronize()
        events.append(cupy.cuda.get_elapsed_time(start, stop))
        for key in ("host_s", "wait_s", "finish_s"):
            parts[key].append(made.last_step[key])
    return {"wall_ms": 1e3 * statistics.median(walls), "events_ms": statistics.median(events),
            "graph": made.last_step["graph"], "bucket": made.last_step["bucket"],
            **{f"{key[:-2]}_ms": 1e3 * statistics.median(values) for key, values in parts.items()}}


def graph_replay_ms(made: ModelRunner) -> float:
    graph = made.graphs[made.buckets[-1]][0]
    stream = backend.engine_stream()
    if os.environ.get("RLP_PROFILE_NVTX"):  # one replay in an NVTX range "replay", for ncu --nvtx-include replay/
        cupy.cuda.nvtx.RangePush("replay")
        graph.replay()
        stream.synchronize()
        cupy.cuda.nvtx.RangePop()
    return replay_ms(cupy, graph, stream, REPEATS)


out = decode_step()
with_graphs = runner(cuda_graphs=True)
plan = plan_decode(out.scheduled, with_graphs.buckets[-1], with_graphs.table_width, BLOCK_SIZE)
sampler = with_graphs._sampling(out.samples)


def padded_step():
    """The graph's body run eagerly (the forward and the LM head), then the device sampler's kernels."""
    views = with_graphs.uploader.upload(plan.graph_inputs(), sampler.uploads())
    logits = with_graphs._decode_logits(plan, views)[:SEQUENCES]
    sampler.launch(backend, logits, views)


ops = profile_ops(padded_step)
steps = {"graphs": whole_steps(with_graphs, out)}
replay = graph_replay_ms(with_graphs)
with_graphs.release_caches()
without = runner(cuda_graphs=False)
steps["no_graphs"] = whole_steps(without, out)
without.release_caches()
bandwidth = copy_bandwidth(backend)["bytes_per_s"]
bytes_read = step_bytes(config, [KV_LENGTH] * SEQUENCES)
print(json.dumps({
    "device": backend.info(), "layers": config.num_hidden_layers, "sequences": SEQUENCES, "kv_length": KV_LENGTH,
    **ops, "steps": steps, "graph_replay_ms": replay,
    "bound_ms": 1e3 * bytes_read["total"] / bandwidth, "step_bytes": bytes_read, "copy_bytes_per_s": bandwidth,
}, indent=1))
