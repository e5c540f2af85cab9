"""Host (Python) time of one pure decode step of the rollout engine, on the cpu backend.

    PYTHONPATH=$PWD python3 scripts/profile_host_step.py [--sequences 256] [--prompt-len 128] [--new-tokens 512]
                                        [--layers N] [--sampler device|host] [--async-scheduling on|off|both]
                                        [--cprofile 30] [--json PATH]

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
  schedule_ms    planning the step: Scheduler.schedule, or Scheduler.schedule_ahead (asynchronous)
  launch_ms      ModelRunner.launch (planning, upload, the no-op replay, sampler launches, the download queued)
  wait_ms        ModelRunner.wait (the download's wait, here none, and the results to Python)
  postprocess_ms Scheduler.postprocess
  exposed_ms     host time the device would idle for between two steps, if its step is longer than the
                 host's: from the return of step k's wait (the device has finished k) to the end of step
                 k + 1's launch (the device has k + 1), 0 when k + 1 was launched before k's wait
                 (asynchronous scheduling); one value per pure decode step k whose successor is one too
With --async-scheduling both (the default) it runs the engine in turn ("off") and with asynchronous
scheduling ("on") and prints both. --layers N gives the tiny model N layers (the graph-array identity
check walks every layer's arrays; Qwen3-0.6B has 28). --cprofile K prints cProfile's top K functions
over the decode steps.
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


class StepTimes:
    """Per step (in launch order, which is the order LLM.generate records them in): which steps are
    pure decodes, the seconds of each part, and the launch and wait end times (for exposed_ms)."""

    def __init__(self, sequences: int):
        self.sequences = sequences
        self.pure: list[bool] = []
        self.parts = {name: {} for name in ("schedule", "launch", "wait", "postprocess")}
        self.launch_end: list[float] = []
        self.wait_end: dict[int, float] = {}
        self._planned = 0  # steps planned so far (the index of the next plan)
        self._recorded = 0  # steps postprocessed so far
        self._index_of: dict[int, int] = {}  # id(LaunchedStep) -> step index

    def install(self) -> None:
        """Wrap the scheduler's and runner's methods (class attributes: the engine's objects use them)."""
        times = self
        schedule, ahead = Scheduler.schedule, Scheduler.schedule_ahead
        launch, wait, postprocess = ModelRunner.launch, ModelRunner.wait, Scheduler.postprocess

        def planned(function):
            def call(self, *args):
                start = time.perf_counter()
                out = function(self, *args)
                if out is not None:  # a None plan ahead: the step after is planned by schedule() later
                    times.parts["schedule"][times._planned] = time.perf_counter() - start
                    times._planned += 1
                return out
            return call

        def launched(self, out, after=None):
            start = time.perf_counter()
            step = launch(self, out, after)
            end = time.perf_counter()
            index = len(times.launch_end)
            times._index_of[id(step)] = index
            times.parts["launch"][index] = end - start
            times.launch_end.append(end)
            times.pure.append(len(out.scheduled) == out.num_batched_tokens == times.sequences)
            return step

        def waited(self, step):
            start = time.perf_counter()
            result = wait(self, step)
            end = time.perf_counter()
            index = times._index_of.pop(id(step))
            times.parts["wait"][index], times.wait_end[index] = end - start, end
            return result

        def recorded(self, *args):
            start = time.perf_counter()
            result = postprocess(self, *args)
            times.parts["postprocess"][times._recorded] = time.perf_counter() - start
            times._recorded += 1
            return result

        Scheduler.schedule, Scheduler.schedule_ahead = planned(schedule), planned(ahead)
        ModelRunner.launch, ModelRunner.wait, Scheduler.postprocess = launched, waited, recorded
        self._originals = (schedule, ahead, launch, wait, postprocess)

    def uninstall(self) -> None:
        (Scheduler.schedule, Scheduler.schedule_ahead, ModelRunner.launch, ModelRunner.wait,
         Scheduler.postprocess) = self._originals

    def exposed(self, k: int) -> float:
        """Seconds between step k's wait returning and step k + 1's launch ending (0 if launched before)."""
        return max(0.0, self.launch_end[k + 1] - self.wait_end[k])


def run(args, mode: str) -> tuple[dict, cProfile.Profile | None]:
    """One generate call with asynchronous scheduling on or off; its medians per pure decode step."""
    config = tiny_config()
    if args.layers:
        config = dataclasses.replace(config, num_hidden_layers=args.layers)
    weights = tiny_weights(config)
    sequences, max_len = args.sequences, args.prompt_len + args.new_tokens
    llm = llm_module.LLM(device=HostOnlyBackend(), block_size=args.block_size,
                         num_blocks=sequences * -(-max_len // args.block_size), max_num_seqs=sequences,
                         max_num_batched_tokens=4096, max_model_len=max_len,
                         loaded=(config, weights, NoTokenizer()), sampler=args.sampler,
                         async_scheduling=mode == "on")
    llm.runner.capture_graphs()
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (sequences, args.prompt_len)).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)

    times = StepTimes(sequences)
    profiler = cProfile.Profile() if args.cprofile else None
    stamps: list[float] = []
    cpu_stamps: list[float] = []  # this thread's CPU time: what other processes on the machine do not change

    def progress(done: int, budget: int) -> None:
        stamps.append(time.perf_counter())
        cpu_stamps.append(time.thread_time())
        if profiler is not None and times.pure[len(stamps) - 1]:
            profiler.enable()  # from the first pure decode step on: only decode steps follow

    times.install()
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, progress=progress)
        total = time.perf_counter() - start
    finally:
        times.uninstall()
    if profiler is not None:
        profiler.disable()

    pure = times.pure
    # step i is pure decode when it and the step before it were (the time between callbacks i-1, i)
    steps = [i for i in range(1, len(stamps)) if pure[i] and pure[i - 1]]
    ms = lambda values: 1e3 * statistics.median(values)  # noqa: E731
    result = {
        "async_scheduling": mode, "sequences": sequences, "layers": config.num_hidden_layers,
        "sampler": args.sampler, "steps": len(stamps), "steps_ahead": llm.stats.steps_ahead,
        "pure_decode_steps": len(steps), "generate_s": total,
        "step_ms": ms([stamps[i] - stamps[i - 1] for i in steps]),
        "step_cpu_ms": ms([cpu_stamps[i] - cpu_stamps[i - 1] for i in steps]),
        **{f"{name}_ms": ms([values[i] for i in steps if i in values]) for name, values in times.parts.items()
           if any(i in values for i in steps)},
        "exposed_ms": ms([times.exposed(k) for k in steps if k + 1 < len(pure) and pure[k + 1]]),
    }
    return result, profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--sampler", choices=("device", "host"), default="device")
    parser.add_argument("--async-scheduling", choices=("on", "off", "both"), default="both",
                        help="asynchronous scheduling needs --sampler device")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cprofile", type=int, default=0, metavar="K")
    parser.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative, ...)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    stub_sampling_kernels()
    modes = ("off", "on") if args.async_scheduling == "both" else (args.async_scheduling,)
    results = {}
    for mode in modes:
        results[mode], profiler = run(args, mode)
        print(json.dumps(results[mode], indent=1))
        if profiler is not None:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(args.sort).print_stats(args.cprofile)
            print(text.getvalue())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results if len(results) > 1 else results[modes[0]], handle, indent=1)


if __name__ == "__main__":
    main()
