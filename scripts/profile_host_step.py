"""Host (Python) time of one pure decode step of the rollout engine, on the cpu backend.

    PYTHONPATH=$PWD python3 scripts/profile_host_step.py [--sequences 256] [--prompt-len 128] [--new-tokens 512]
                                        [--layers N] [--sampler device|host] [--cprofile 30] [--json PATH]

`bench decode`'s workload (random token-id prompts, temperature 1, ignore_eos, every decode step
padded to its bucket and replayed as a graph, the device sampler) on the built-in tiny model, with
the device's work replaced by stand-ins ONLY in this script, so that what is timed is the host work
the GPU waits for between two steps on the H200:
  * the decode "graph" is captured once (one eager run gives its logits array, [bucket, V]); a
    replay does nothing, so the logits stay fixed;
  * the sampling and log-prob kernels run their host-side argument checks, then launch nothing
    (tokens 0, log-probs 0; nothing stops early: ignore_eos).
Prefill steps run for real (on the cpu reference) and are not counted.

Per pure decode step (every running sequence feeds its last token), medians over the steps:
  step_ms        from one progress callback of LLM.generate to the next: the whole host step
  step_cpu_ms    the same in this thread's CPU time (steadier on a busy machine)
  schedule_ms    Scheduler.schedule
  execute_ms     ModelRunner.execute (planning, upload, the no-op replay, sampler launches, download)
  postprocess_ms Scheduler.postprocess
--layers N gives the tiny model N layers (the graph-array identity check walks every layer's
arrays; Qwen3-0.6B has 28). --cprofile K prints cProfile's top K functions over the decode steps.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time

import numpy as np

from rlportable.engine import llm as llm_module
from rlportable.engine.runner import ModelRunner
from rlportable.engine.scheduler import Scheduler
from rlportable.engine.sequence import SamplingParams
from rlportable.model.tiny import tiny_config, tiny_weights
from rlportable.ops import sampling as sampling_op
from rlportable.runtime.cpu import CpuBackend


class FixedGraph:
    """A captured decode whose replay leaves its logits as they were (the device's work, skipped)."""

    def replay(self) -> None:
        pass


class HostOnlyBackend(CpuBackend):
    """The cpu backend with "graphs" that do nothing: the engine takes its decode path of the GPUs."""

    supports_graphs = True

    def capture_graph(self, function):
        return FixedGraph(), function()


class NoKernelBackend(CpuBackend):
    """Passed to the sampler's device functions: their host checks run, their launches do nothing."""

    kernel_vendor = "stand-in"

    def empty(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def launch(self, *args, **kwargs) -> None:
        pass


def stub_sampling_kernels() -> None:
    no_kernels = NoKernelBackend()
    sample = sampling_op.sample_on_device
    sampling_op.sample_on_device = lambda backend, *args, **kwargs: sample(no_kernels, *args, **kwargs)


class NoTokenizer:
    eos_token_id = None
    stop_token_ids: list[int] = []

    def decode(self, ids) -> str:
        return ""


def timed(owner, name: str, into: list):
    """Wrap owner.name (a method of a class) so that each call's seconds append to `into`."""
    function = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return result

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--sampler", choices=("device", "host"), default="device")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cprofile", type=int, default=0, metavar="K")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative, ...)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = tiny_config()
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    weights = tiny_weights(config)
    stub_sampling_kernels()
    sequences, max_len = args.sequences, args.prompt_len + args.new_tokens
    llm = llm_module.LLM(device=HostOnlyBackend(), block_size=args.block_size,
                         num_blocks=sequences * -(-max_len // args.block_size), max_num_seqs=sequences,
                         max_num_batched_tokens=4096, max_model_len=max_len,
                         loaded=(config, weights, NoTokenizer()), sampler=args.sampler)
    llm.runner.capture_graphs()
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (sequences, args.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)

    parts = {"schedule": [], "execute": [], "postprocess": []}
    timed(Scheduler, "schedule", parts["schedule"])
    timed(ModelRunner, "execute", parts["execute"])
    timed(Scheduler, "postprocess", parts["postprocess"])
    pure_decode: list[bool] = []  # per step
    real_schedule = Scheduler.schedule

    def schedule(self):
        out = real_schedule(self)
        pure_decode.append(len(out.scheduled) == out.num_batched_tokens == sequences)  # one token each
        return out

    Scheduler.schedule = schedule
    profiler = cProfile.Profile() if args.cprofile else None
    stamps: list[float] = []
    cpu_stamps: list[float] = []  # this thread's CPU time: what other processes on the machine do not change

    def progress(done: int, budget: int) -> None:
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.thread_time())
        if profiler is not None and pure_decode[-1]:
            profiler.enable()  # from the first pure decode step on: only decode steps follow

    start = time.perf_counter()
    llm.generate(prompts, params, progress=progress)
    total = time.perf_counter() - start
    if profiler is not None:
        profiler.disable()

    # step i is pure decode when it and the step before it were (the time between callbacks i-1, i)
    steps = [i for i in range(1, len(stamps)) if pure_decode[i] and pure_decode[i - 1]]
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    result = {
        "sequences": sequences, "layers": config.num_hidden_layers, "sampler": args.sampler,
        "steps": len(stamps), "pure_decode_steps": len(steps), "generate_s": total,
        "step_ms": ms([stamps[i] - stamps[i - 1] for i in steps]),
        "step_cpu_ms": ms([cpu_stamps[i] - cpu_stamps[i - 1] for i in steps]),
        **{f"{name}_ms": ms([values[i] for i in steps]) for name, values in parts.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.cprofile)
        print(text.getvalue())


if __name__ == "__main__":
    main()
