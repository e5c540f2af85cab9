"""The `rlportable` command: parse, call, print. No logic lives here."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import click
from tabulate import tabulate

from rlportable.errors import RlpError


class _NonNegativeFloat(click.ParamType):
    """A finite float >= 0: click's FloatRange lets NaN and inf through (their comparisons are false)."""

    name = "float"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number) or number < 0:
            self.fail(f"{value!r} is not a finite number >= 0.", param, ctx)
        return number


NON_NEGATIVE = _NonNegativeFloat()

DEVICE_OPTION = click.option("--device", default="auto", show_default=True,
                             type=click.Choice(["auto", "cpu", "cuda", "hip", "hip-cpu"]),
                             help="Backend to run on (hip-cpu: the HIP sources on the CPU through HIP-CPU, "
                                  "a 64-lane wavefront; never chosen by auto).")


# --tp and --emulate mean the same in every command that runs ranks (generate, conform, bench decode,
# sft, grpo): one declaration each (docs/parallelism.md, "One flag for ranks as threads")
TP_OPTION = click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1),
                         help="Tensor-parallel ranks, one process per GPU or under torchrun (sft, grpo: per "
                              "replica, --tp x --dp in all); bitwise the same results as --tp 1.")
EMULATE_OPTION = click.option("--emulate", is_flag=True,
                              help="Run the ranks (--tp, or --tp x --dp) as threads of this process on one device "
                                   "(always so on cpu).")


#: --ep: expert parallelism of a mixture-of-experts model (sft, grpo, generate): whole experts per rank
EP_OPTION = click.option("--ep", default=1, show_default=True, type=click.IntRange(min=1),
                         help="Expert-parallel ranks (Qwen3-MoE): each holds num_experts / EP whole experts, the "
                              "rows exchanged by all-to-all; --tp x --ep ranks a model (x --dp in all); bitwise "
                              "the same results as --ep 1.")


def tp_options(f):
    """--tp / --emulate: tensor parallelism (rlportable/launch.py)."""
    return TP_OPTION(EMULATE_OPTION(f))


def _launched(run, device: str, *args):
    """(reports, result) of rlportable.launch's run_ranks or run_layout on this rank; a bad option or device
    is a one-line error."""
    from rlportable.runtime import resolve_device

    try:
        if device == "auto":
            click.echo(f"device auto -> {resolve_device('auto')}", err=True)
        return run(device, *args)
    except RlpError as error:
        _fail(error)


def _run_ranks(device: str, world_size: int, emulate: bool, work, kernel_source: str = "native"):
    """(reports, result) of work(backend, world_group) on this rank of `world_size`."""
    from rlportable.launch import run_ranks

    return _launched(run_ranks, device, world_size, emulate, work, kernel_source)


def _fail(error: RlpError):
    click.echo(f"error: {error}", err=True)
    sys.exit(error.exit_code)


def _backend(device: str, kernel_source: str = "native"):
    from rlportable.runtime import get_backend, resolve_device

    try:
        backend = get_backend(device, kernel_source)
    except RlpError as error:
        _fail(error)
    if device == "auto":
        click.echo(f"device auto -> {resolve_device('auto')}", err=True)
    return backend


def _write_json(path: str | None, payload: dict) -> None:
    """Write a result with its provenance (commit, date); a bad path is a one-line error."""
    if not path:
        return
    from rlportable.provenance import provenance

    payload = {**payload, "provenance": payload.get("provenance") or provenance()}
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as error:
        _fail(RlpError(f"cannot write {target}: {error.strerror or error}"))
    click.echo(f"wrote {target}", err=True)


def _check_json_path(path: str | None) -> None:
    """Before a long run: the JSON's folder must exist (or be creatable) and be writable."""
    if not path:
        return
    folder = Path(path).resolve().parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
        _fail(RlpError(f"cannot write {path}: {existing or folder} is not a writable folder"))


@click.group()
@click.version_option(package_name="rlportable")
def main():
    """rlportable: the LLM RL loop on NVIDIA and AMD GPUs, bitwise reproducible."""


@main.command()
def info():
    """Each backend: available or not and why, versions, device name and architecture."""
    from rlportable.runtime import AUTO_ORDER, get_backend, probe

    rows = []
    for name in (*AUTO_ORDER, "hip-cpu"):
        available, reason = probe(name)
        details = ""
        if available:
            try:
                details = ", ".join(f"{k}={v}" for k, v in get_backend(name).info().items() if k != "backend")
            except RlpError as error:
                available, reason = False, str(error)
        rows.append([name, "yes" if available else "no", reason, details])
    click.echo(tabulate(rows, headers=["backend", "available", "status", "details"]))


@main.command()
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the results as JSON here.")
@click.option("--quick", is_flag=True, help="Small inputs only (under a minute on a 2-core CPU).")
@click.option("--kernel-source", default="native", type=click.Choice(["native", "hip"]),
              help="hip: run the HIP sources on a cuda device through the HIP-on-CUDA prelude.")
@click.option("--only", default=None, help="Run the checks whose name contains this text (or any of several, "
                                           "comma-separated).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--exhaustive", is_flag=True, help="Also grade exp and log on all 2^32 float32 inputs (GPU only).")
@click.option("--peer", default="none", show_default=True, type=click.Choice(["none", "hf"]),
              help="hf: also run the end-to-end comparison on HF transformers (fp32, bf16) and print it beside ours.")
@click.option("--repro-dir", default="rlportable-repro", show_default=True, type=click.Path(file_okay=False),
              help="Where a failing end-to-end check writes its reproducer (.npz + .json).")
@click.option("--write-golden", is_flag=True,
              help="Recompute the golden digests with the NumPy reference and write them (--device cpu only).")
@click.option("--golden-dir", type=click.Path(file_okay=False), default=None,
              help="Read (and with --write-golden write) the golden digests here, not in conformance/golden.")
@tp_options
def conform(device, json_path, quick, kernel_source, only, seed, exhaustive, peer, repro_dir, write_golden,
            golden_dir, tp, emulate):
    """Check every contract's kernels against the NumPy reference, bit for bit, and the engine against the trainer.

    With --tp N: the tensor-parallel checks instead, on N ranks, against one device (conform/tensor_parallel.py)."""
    _check_json_path(json_path)
    from rlportable import conform as suite
    from rlportable.conform import end_to_end, golden

    if tp > 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        _conform_tensor_parallel(device, kernel_source, tp, emulate, quick, seed, only, json_path)
        return
    backend = _backend(device, kernel_source)
    settings = suite.Settings(seed=seed, repro_dir=Path(repro_dir), golden_dir=Path(golden_dir) if golden_dir else None)
    if write_golden:
        try:
            written = golden.write_golden(backend, folder=settings.golden_dir,
                                          progress=lambda name: click.echo(f"  computing {name} ...", err=True))
        except RlpError as error:
            _fail(error)
        for path in written:
            click.echo(f"wrote {path}")
        return
    try:
        results = suite.run(backend, quick=quick, only=only, exhaustive=exhaustive, settings=settings,
                            progress=lambda name: click.echo(f"  checking {name} ...", err=True))
    except RlpError as error:
        _fail(error)
    table = [[r.name, r.compared, r.mismatches, "n/a" if end_to_end.not_applicable(r)
              else "pass" if r.passed else "FAIL"] for r in results]
    click.echo(tabulate(table, headers=["check", "compared", "mismatches", "verdict"]))
    e2e_rows, e2e_headers = end_to_end.metrics_table([r for r in results if r.name.startswith("e2e.")])
    if e2e_rows:
        click.echo("\nend to end: engine log-probs against the trainer's forward\n" + tabulate(e2e_rows, e2e_headers))
    for r in results:
        for model, part in ((r.details or {}).get("models") or {}).items():
            if part.get("reproducer"):
                click.echo(f"{r.name} ({model}): reproducer {' '.join(part['reproducer'])}", err=True)
    payload = suite.report(backend.label, backend.info(), results)
    for message in payload.get("golden_failures", {}).values():
        click.echo(message, err=True)
    if peer == "hf":
        from rlportable.conform import peer_hf

        try:
            payload["peer"] = peer_hf.run(backend, quick=quick, seed=seed,
                                          progress=lambda text: click.echo(f"  {text}", err=True))
        except RlpError as error:
            _fail(error)
        click.echo(f"\npeer: {payload['peer']['sequences']} sequences x {payload['peer']['new_tokens']} tokens, "
                   f"incremental decoding against the full forward\n" + tabulate(*peer_hf.peer_table(payload["peer"])))
    click.echo(f"\n{backend.label}: {payload['compared']} elements compared, {payload['mismatches']} mismatches: "
               f"{'PASS' if payload['passed'] else 'FAIL'}")
    _write_json(json_path, payload)
    sys.exit(0 if payload["passed"] else 1)


def _bench_decode_tensor_parallel(device, tp, emulate, sequences, prompt_len, new_tokens, layers, sampler,
                                  json_path):
    from rlportable.bench import decode as decode_bench

    def work(backend, tp_group):
        return decode_bench.run_tensor_parallel(backend, tp_group, sequences, prompt_len, new_tokens, layers, sampler,
                                                progress=lambda text: click.echo(f"  {text}", err=True))

    reports, result = _run_ranks(device, tp, emulate, work)
    if not reports:
        return
    rows = [[name, result[key]["tokens_per_s"], result[key].get("decode_step_s_median")]
            for name, key in ((f"TP={result['tp']} (eager)", "ours_tp"), ("TP=1 eager", "ours_tp1_eager"),
                              ("TP=1 CUDA graphs", "ours_tp1_graphs"))]
    click.echo(tabulate(rows, headers=["engine", "tokens/s", "s/decode step"], floatfmt=".4g"))
    click.echo(f"scaling TP={result['tp']} / TP=1: {result['scaling']['tp_over_tp1_eager']:.2f}x (eager), "
               f"{result['scaling']['tp_over_tp1_graphs']:.2f}x (against graphs)")
    _write_json(json_path, result)


def _conform_tensor_parallel(device, kernel_source, tp, emulate, quick, seed, only, json_path):
    from rlportable import conform as suite
    from rlportable.conform import tensor_parallel

    def work(backend, tp_group):
        results = tensor_parallel.run(backend, tp_group, quick=quick, seed=seed, only=only,
                                      progress=lambda name: click.echo(f"  checking {name} ...", err=True))
        return backend, tp_group.size, tp_group.label, results

    reports, (backend, size, label, results) = _run_ranks(device, tp, emulate, work, kernel_source)
    if not reports:
        return
    click.echo(tabulate([[r.name, r.compared, r.mismatches, "pass" if r.passed else "FAIL"] for r in results],
                        headers=["check", "compared", "mismatches", "verdict"]))
    payload = {**suite.report(backend.label, backend.info(), results), "tp": size, "group": label}
    click.echo(f"\n{backend.label}, TP={size} ({label}) against one device: {payload['compared']} elements "
               f"compared, {payload['mismatches']} mismatches: {'PASS' if payload['passed'] else 'FAIL'}")
    _write_json(json_path, payload)
    sys.exit(0 if payload["passed"] else 1)


@main.command()
@click.option("--model", "model_spec", default="tiny", show_default=True,
              help="'tiny', 'tiny-sft', 'tiny-moe' or a Hugging Face style directory.")
@DEVICE_OPTION
@click.option("--text", default=None, help="A text to score.")
@click.option("--jsonl", type=click.Path(dir_okay=False), default=None, help="Texts to score, one JSON object per line ('text').")
@click.option("--temperature", default=1.0, show_default=True, type=float, help="Log-probs of softmax(logits / T).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def logp(model_spec, device, text, jsonl, temperature, as_json):
    """Per-token log-probabilities of texts under a model."""
    from rlportable.model import logp as logp_command
    from rlportable.model.forward import Model
    from rlportable.model.load import load_model

    backend = _backend(device)
    try:
        texts = logp_command.read_texts(text, jsonl)
        config, weights, tokenizer = load_model(model_spec)
        results = logp_command.score(Model(backend, config, weights), tokenizer, texts, temperature)
    except RlpError as error:
        _fail(error)
    if as_json:
        click.echo(json.dumps({"model": model_spec, "device": backend.label, "temperature": temperature,
                               "results": results}))
        return
    for result in results:
        # the piece as a JSON string: a leading space stays visible, as in --json
        rows = [[i, t, json.dumps(p, ensure_ascii=False), "" if lp is None else f"{lp:.6f}"]
                for i, (t, p, lp) in enumerate(zip(result["tokens"], result["pieces"], result["logprobs"]))]
        click.echo(tabulate(rows, headers=["#", "token", "piece", "logprob"]))
        click.echo(f"sum of log-probs: {result['sum_logprob']:.6f}\n")


@main.command()
@click.option("--model", "model_spec", default="tiny", show_default=True,
              help="'tiny', 'tiny-sft', 'tiny-moe' or a Hugging Face style directory.")
@click.option("--prompt", "prompts", multiple=True, help="A prompt (repeatable).")
@click.option("--jsonl", type=click.Path(dir_okay=False), default=None, help="Prompts, one JSON object per line ('prompt').")
@click.option("-n", "n", default=1, show_default=True, type=int, help="Samples per prompt.")
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=1.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = off.")
@click.option("--min-p", default=0.0, show_default=True, type=float)
@click.option("--ignore-eos", is_flag=True)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1),
              help="The call's seed: with its index in the call, the key of each prompt without a JSONL "
                   "\"seed\" of its own (one with a seed samples the same alone or in any batch).")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(min=1), help="Sequences decoded together at most.")
@click.option("--block-size", default=16, show_default=True, type=click.IntRange(min=1), help="KV cache block size (tokens).")
@click.option("--prefix-caching", is_flag=True, help="Share cached prompt blocks across requests.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=None,
              help="Decode through CUDA / HIP graphs per batch-size bucket (default: on cuda and hip; on cpu "
                   "--cuda-graphs runs the same padded buckets eagerly). Same tokens and log-probs either way.")
@DEVICE_OPTION
@tp_options
@EP_OPTION
@click.option("--json", "as_json", is_flag=True, help="Per sample: token ids, text and log-probs, as JSON.")
def generate(model_spec, prompts, jsonl, n, max_tokens, temperature, top_p, top_k, min_p, ignore_eos, seed,
             max_batch, block_size, prefix_caching, cuda_graphs, device, tp, emulate, ep, as_json):
    """Sample completions with the rollout engine (paged KV cache, continuous batching)."""
    from rlportable.engine.llm import LLM
    from rlportable.engine.sequence import SamplingParams, SamplingParamsError
    from rlportable.model.logp import read_prompts

    try:
        records = read_prompts(list(prompts), jsonl)
        texts = [text for text, _ in records]
        try:
            params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                     max_tokens=max_tokens, ignore_eos=ignore_eos, seed=own) for _, own in records]
        except SamplingParamsError as error:
            raise error.in_terms_of({"n": "-n", "seed": "a JSONL record's \"seed\""}) from None
    except RlpError as error:
        _fail(error)

    def work(backend, tp_group, ep_group):
        llm = LLM(model_spec, device=backend, block_size=block_size, max_num_seqs=max_batch,
                  enable_prefix_caching=prefix_caching, cuda_graphs=cuda_graphs, tp_group=tp_group, ep_group=ep_group)
        if tp_group.rank or ep_group.rank:
            return llm, llm.generate(texts, params, seed=seed)
        with click.progressbar(length=len(texts) * n * max_tokens, label="generating", file=sys.stderr) as bar:
            done = [0]

            def progress(tokens, _budget):
                bar.update(tokens - done[0])
                done[0] = tokens

            return llm, llm.generate(texts, params, progress=progress, seed=seed)

    from rlportable.launch import run_model

    reports, (llm, outputs) = _launched(run_model, device, tp, ep, emulate, work)
    if not reports:
        return
    stats = llm.stats
    summary = (f"{stats.output_tokens} tokens in {stats.seconds:.2f} s ({stats.output_tokens_per_s:.1f} tokens/s), "
               f"{stats.steps} steps, {stats.preemptions} preemptions")
    if as_json:
        click.echo(json.dumps({"model": model_spec, "device": llm.backend.label, "results": [
            {"prompt": r.prompt, "prompt_token_ids": r.prompt_token_ids, "samples": [
                {"index": c.index, "token_ids": c.token_ids, "text": c.text, "logprobs": c.logprobs,
                 "finish_reason": c.finish_reason} for c in r.outputs]} for r in outputs]}))
    else:
        for r in outputs:
            for c in r.outputs:
                click.echo(f"[{r.request_id}.{c.index}] {r.prompt!r} -> {c.text!r} ({c.finish_reason}, "
                           f"sum logprob {sum(c.logprobs):.4f})")
    click.echo(summary, err=True)


#: the option defaults of sft and grpo have one home, the config dataclass (train/sft.py, train/grpo.py),
#: with the embedded default run's few changes for the built-in models (train/prepare.py EMBEDDED_*)
CONFIG_DEFAULT = " (default: the run config's; `--model tiny`/`tiny-sft`: the embedded run's; docs/training.md)"


#: options that say where and how a run executes, not what it computes: not part of a run's config file
RUN_PLACE = ("out", "resume", "config_file", "print_config", "device", "dp", "emulate", "tp", "ep", "log_jsonl",
             "plot")


def _option_names(command: click.Command) -> dict[str, str]:
    """Every spelling of the command's options (model, lr, num-generations, G, ...) -> its parameter."""
    names = {}
    for param in command.params:
        names[param.name] = param.name
        for opt in getattr(param, "opts", []):
            names[opt.lstrip("-").replace("-", "_")] = param.name
    return names


def _read_config(path: str, command: click.Command) -> dict:
    """A run config file (TOML; keys are the command's option names) as {parameter: value}."""
    import tomllib

    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as error:
        raise click.BadParameter(f"{path}: {error.strerror or error}", param_hint="--config") from None
    except tomllib.TOMLDecodeError as error:
        raise click.BadParameter(f"{path}: not TOML ({error})", param_hint="--config") from None
    names, out = _option_names(command), {}
    for key, value in data.items():
        name = names.get(key.replace("-", "_"))
        if name is None or name in RUN_PLACE:
            raise click.BadParameter(f"{path}: {key!r} is not an option of `rlportable {command.name}` that a "
                                     "config sets", param_hint="--config")
        out[name] = value
    return out


def _load_config(ctx: click.Context, param, value):
    """--config FILE (eager): the file's options become the defaults; flags on the command line win."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **_read_config(value, ctx.command)}
    return value


def _config_text(options: dict) -> str:
    """Run options as TOML (strings, numbers, booleans, lists of them; None is left out)."""
    import json

    lines = []
    for key, value in options.items():
        if value is None or value == ():
            continue
        lines.append(f"{key.replace('_', '-')} = {json.dumps(list(value) if isinstance(value, tuple) else value)}")
    return "\n".join(lines) + "\n"


def _resolved_options(command: click.Command, params: dict, config, resolved: dict) -> dict:
    """The run's options as a config file holds them, by their flags' names: every option's value (the
    config dataclass's as it resolved them; `resolved` for the others the command resolved itself),
    without the options that say where the run executes."""
    import dataclasses

    fields = dataclasses.asdict(config)
    out = {}
    for param in command.params:
        name, value = param.name, resolved.get(param.name, params.get(param.name))
        if name in RUN_PLACE:
            continue
        field = "learning_rate" if name == "lr" else name
        if field in fields:
            value = fields[field]
            if field == "max_grad_norm" and value is None:
                value = 0.0  # the flag's "no clipping"
        flag = max((opt for opt in param.opts if opt.startswith("--")), key=len, default=param.name)
        out[flag.lstrip("-")] = value
    return out


def _run_config_text(config, **resolved) -> str:
    """This command's options as the run resolves them, as TOML: --print-config prints it, and a run with
    --out writes it to OUT/run_config.toml (`--config` that file reruns the run, or resumes it)."""
    ctx = click.get_current_context()
    return _config_text(_resolved_options(ctx.command, ctx.params, config, resolved))


def _given(**options) -> dict:
    """The options given on the command line (click's None: not given); --max-grad-norm 0 means no clipping."""
    given = {name: value for name, value in options.items() if value is not None}
    if given.get("max_grad_norm") == 0:
        given["max_grad_norm"] = None
    return given


#: --report-to of sft and grpo: where the metrics go besides the printed lines and --log-jsonl
REPORT_TO_OPTION = click.option("--report-to", default=None, type=click.Choice(["none", "tensorboard"]),
                                help="tensorboard: the metrics as TensorBoard scalars, event files in --out "
                                     "(pip install 'rlportable[tensorboard]').")


def _run_options(f):
    """Options SFT and GRPO share."""
    options = [
        click.option("--task", default=None, help="A built-in task, e.g. 'arithmetic:digits=1,ops=+' or 'countdown' "
                                                  "(default: the embedded default task, unless --data is given)."),
        click.option("--data", type=click.Path(dir_okay=False), default=None, help="A JSONL or Parquet dataset."),
        click.option("--steps", default=None, type=click.IntRange(min=1), help="Optimiser steps." + CONFIG_DEFAULT),
        click.option("--out", default=None, type=click.Path(file_okay=False), help="Checkpoint folder."),
        click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint."),
        click.option("--save-every", default=10, show_default=True, type=click.IntRange(min=1), help="Checkpoint every N steps."),
        click.option("--log-jsonl", default=None, type=click.Path(dir_okay=False), help="Per-step metrics as JSONL."),
        click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Draw the curve to this PNG."),
        click.option("--seed", default=None, type=int, help="The run's seed (data order, sampling)." + CONFIG_DEFAULT),
        click.option("--lr", default=None, type=NON_NEGATIVE,
                     help="Peak learning rate (0: the weights stay as they are)." + CONFIG_DEFAULT),
        click.option("--warmup-steps", default=None, type=click.IntRange(min=0), help="Linear warmup." + CONFIG_DEFAULT),
        click.option("--weight-decay", default=None, type=NON_NEGATIVE, help="AdamW's decoupled decay." + CONFIG_DEFAULT),
        click.option("--max-grad-norm", default=None, type=NON_NEGATIVE, help="0 = no clipping." + CONFIG_DEFAULT),
        click.option("--micro-batch-tokens", default=None, type=click.IntRange(min=1),
                     help="Tokens per forward/backward pass at most (memory; part of the run: gradients add in "
                          "float32 micro-batch by micro-batch)." + CONFIG_DEFAULT),
        click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None, is_eager=True,
                     callback=_load_config,
                     help="A TOML file of this command's options (a run's own run_config.toml, say); flags win."),
        click.option("--print-config", is_flag=True, help="Print the options the run would use, as TOML, and stop."),
        DEVICE_OPTION,
        click.option("--dp", default=1, show_default=True, type=click.IntRange(min=1),
                     help="Data-parallel replicas: one process per GPU (or under torchrun); bitwise the same run as "
                          "--dp 1."),
        EMULATE_OPTION,
        TP_OPTION,
        EP_OPTION,
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _finished_or_resuming(kind: str, options, steps: int) -> bool:
    """Before any work: say where a --resume starts; True (and say so) when the run is already complete."""
    from rlportable.train import prepare

    point = prepare.resume_point(options)
    if point is None:
        return False
    if point.next_step >= steps:
        click.echo(f"{kind}: the run in {options.out} is complete at step {point.next_step} (--steps {steps}); to "
                   f"train further, start a new run from its weights: --model {point.path} --out NEW_DIR", err=True)
        return True
    click.echo(f"{kind}: resuming {point.path} at step {point.next_step} of {steps}", err=True)
    return False


def _train_on_replicas(kind: str, run, keys: list[str], steps: int, device: str, tp: int, dp: int, emulate: bool,
                       out: str | None = None, plot: str | None = None, ep: int = 1):
    """run(backend, on_step, dp_group, tp_group, ep_group) on every rank of tp x ep x dp (one without --tp,
    --ep and --dp); rank 0 prints."""
    from rlportable.launch import run_layout

    def work(backend, tp_group, dp_group, ep_group):
        if tp_group.rank == 0 and dp_group.rank == 0 and ep_group.rank == 0:
            _train(kind, lambda on_step: run(backend, on_step, dp_group, tp_group, ep_group), keys, steps, out, plot)
        else:
            run(backend, lambda record: None, dp_group, tp_group, ep_group)

    _launched(run_layout, device, tp, dp, emulate, work, "native", ep)


def _train(kind: str, run, keys: list[str], steps: int, out: str | None = None, plot: str | None = None):
    """Run with a progress bar and one printed line per step, then a summary; errors are one line, and
    an interrupt says which checkpoint survived. The last step's line goes to stdout too (for scripts)
    unless both streams are the same terminal, which has it already."""
    from rlportable.train import checkpoint
    from rlportable.train.evaluation import format_eval_line, is_eval
    from rlportable.train.metrics import format_line, summary_lines
    from rlportable.train.run import resume_flags

    done = []
    try:
        with click.progressbar(length=steps, label=kind, file=sys.stderr) as bar:
            def on_step(record):
                if is_eval(record):  # an evaluation on held-out prompts, not a step
                    click.echo("\n" + format_eval_line(record), err=True)
                    return
                bar.update(1)
                done.append(record["step"])
                click.echo("\n" + format_line(record, keys), err=True)
                for note in record.get("notes", []):
                    click.echo(f"note: {note}", err=True)

            records = run(on_step)
    except RlpError as error:
        _fail(error)
    except KeyboardInterrupt:
        where = f"after step {done[-1]}" if done else "before its first step ended"
        try:
            latest = checkpoint.latest_checkpoint(out) if out is not None else None
        except RlpError:
            latest = None
        kept = (f"the latest checkpoint is {latest}; continue with {resume_flags(out)}" if latest
                else "no checkpoint was saved" + ("" if out is not None else " (no --out)"))
        click.echo(f"\n{kind}: interrupted {where}; {kept}", err=True)
        sys.exit(130)
    for line in summary_lines(kind, records, out, plot):
        click.echo(line, err=True)
    if records and not (sys.stdout.isatty() and sys.stderr.isatty()):
        click.echo(format_line(records[-1], keys))


@main.command()
@click.option("--model", "model_spec", default=None,
              help="'tiny', 'tiny-sft', 'tiny-moe' or a directory (default: tiny; the built-in models run the "
                   "embedded default run).")
@_run_options
@click.option("--batch-size", default=None, type=click.IntRange(min=1), help="Examples per optimiser step." + CONFIG_DEFAULT)
@click.option("--max-length", default=None, type=click.IntRange(min=1), help="Longest prompt + completion." + CONFIG_DEFAULT)
@REPORT_TO_OPTION
def sft(model_spec, task, data, steps, out, resume, save_every, log_jsonl, plot, seed, lr, warmup_steps,
        weight_decay, max_grad_norm, micro_batch_tokens, config_file, print_config, device, dp, emulate, tp, ep,
        batch_size, max_length, report_to):
    """Supervised fine-tuning on completion tokens (JSONL prompt/completion or messages, or a task's answers)."""
    from rlportable.train import prepare

    try:
        model_spec = model_spec or prepare.DEFAULT_SFT_MODEL
        config = prepare.sft_config(model_spec, **_given(
            steps=steps, batch_size=batch_size, learning_rate=lr, warmup_steps=warmup_steps,
            weight_decay=weight_decay, max_grad_norm=max_grad_norm, micro_batch_tokens=micro_batch_tokens,
            max_length=max_length, seed=seed))
        resolved = {"model_spec": model_spec, "task": task if task or data else prepare.DEFAULT_TASK}
        if print_config:
            click.echo(_run_config_text(config, **resolved), nl=False)
            return
        options = prepare.RunOptions(model_spec, out, resume, save_every, log_jsonl, plot,
                                    task if task or data else prepare.DEFAULT_TASK, data, report_to=report_to)
        prepare.check_paths(options)
        prepare.check_data(options, "sft")
        if _finished_or_resuming("sft", options, config.steps):
            return
        prepare.write_run_config(options, _run_config_text(config, **resolved))
        click.echo(f"sft: {config.steps} steps of {config.batch_size} examples, lr {config.learning_rate:g}, "
                   f"warmup {config.warmup_steps}, max length {config.max_length}", err=True)
    except RlpError as error:
        _fail(error)
    _train_on_replicas("sft", lambda backend, on_step, dp_group, tp_group, ep_group: prepare.run_sft(
                           backend, options, config, on_step, dp_group, tp_group, ep_group),
                       ["loss", "grad_norm", "lr", "tokens_per_s"], config.steps, device, tp, dp, emulate, out, plot,
                       ep)


@main.command()
@click.option("--model", "model_spec", default=None,
              help="'tiny', 'tiny-sft' (the embedded SFT result), 'tiny-moe' (tiny-sft as a Qwen3-MoE) or a "
                   "directory (default: tiny-sft).")
@_run_options
@click.option("--reward", "rewards", multiple=True, help="A reward function 'module:function' or 'file.py:function' "
                                                        "(repeatable; default: the task's exact-answer reward).")
@click.option("--reward-weight", "reward_weights", multiple=True, type=float, help="One weight per --reward.")
@click.option("--prompts-per-step", default=None, type=click.IntRange(min=1), help="Prompts a step." + CONFIG_DEFAULT)
@click.option("--num-generations", "-G", default=None, type=click.IntRange(min=1), help="Samples per prompt." + CONFIG_DEFAULT)
@click.option("--max-completion-length", default=None, type=click.IntRange(min=1), help="Tokens a completion." + CONFIG_DEFAULT)
@click.option("--max-prompt-length", default=None, type=click.IntRange(min=1),
              help="Longer prompts keep their last tokens (default: none cut; every prompt must then fit the model).")
@click.option("--temperature", default=None, type=float, help="Sampling temperature." + CONFIG_DEFAULT)
@click.option("--top-p", default=None, type=float, help="Nucleus sampling." + CONFIG_DEFAULT)
@click.option("--top-k", default=None, type=int, help="0: off." + CONFIG_DEFAULT)
@click.option("--min-p", default=None, type=float, help="0: off." + CONFIG_DEFAULT)
@click.option("--epsilon", default=None, type=float, help="Lower clip of the ratio." + CONFIG_DEFAULT)
@click.option("--epsilon-high", default=None, type=float, help="Upper clip (default: --epsilon).")
@click.option("--beta", default=None, type=NON_NEGATIVE, help="k3 KL to the starting model." + CONFIG_DEFAULT)
@click.option("--loss-type", default=None, type=click.Choice(["grpo", "bnpo", "dr_grpo", "dapo"]),
              help="Loss aggregation, TRL's names." + CONFIG_DEFAULT)
@click.option("--scale-rewards", default=None, type=click.Choice(["group", "batch", "none"]),
              help="Advantage scaling." + CONFIG_DEFAULT)
@click.option("--mask-truncated-completions", is_flag=True, default=None,
              help="DAPO: completions cut at --max-completion-length leave the loss (TRL's option).")
@click.option("--importance-sampling-level", default=None, type=click.Choice(["token", "sequence"]),
              help="The ratio's level: per token (GRPO), or per sequence (GSPO, TRL's option)." + CONFIG_DEFAULT)
@click.option("--num-iterations", default=None, type=click.IntRange(min=1), help="Passes over each rollout." + CONFIG_DEFAULT)
@click.option("--mini-batches", default=None, type=click.IntRange(min=1), help="Optimiser steps per pass." + CONFIG_DEFAULT)
@click.option("--eval-data", type=click.Path(dir_okay=False), default=None,
              help="Held-out prompts to evaluate on, a file in --data's format (scored by the run's rewards).")
@click.option("--eval-task", default=None, help="Held-out prompts from a built-in task, as --task (200 records from "
                                                "a seed of their own).")
@click.option("--eval-every", default=None, type=click.IntRange(min=0),
              help="Evaluate before the first step, every N steps and after the last; 0: never (default: 10 with "
                   "--eval-data or --eval-task, else never).")
@click.option("--eval-samples", default=None, type=click.IntRange(min=1),
              help="K: samples a held-out prompt at the training temperature, for pass@1 and pass@K (besides one "
                   "greedy completion)." + CONFIG_DEFAULT)
@click.option("--eval-pass-threshold", default=None, type=float,
              help="A held-out completion passes (pass@k) when its reward is at least this." + CONFIG_DEFAULT)
@click.option("--prompt-column", default=None,
              help="--data's column of the prompts, a text or chat messages (default: 'prompt', else 'messages').")
@click.option("--answer-column", default=None,
              help="--data's column that reaches the reward functions as `answer` (math_answer's; default: "
                   "'answer' as it is).")
@REPORT_TO_OPTION
def grpo(model_spec, task, data, steps, out, resume, save_every, log_jsonl, plot, seed, lr, warmup_steps,
         weight_decay, max_grad_norm, micro_batch_tokens, config_file, print_config, device, dp, emulate, tp, ep,
         rewards, reward_weights,
         prompts_per_step, num_generations, max_completion_length, max_prompt_length, temperature, top_p, top_k, min_p,
         epsilon, epsilon_high, beta, loss_type, scale_rewards, mask_truncated_completions, importance_sampling_level,
         num_iterations, mini_batches, eval_data, eval_task, eval_every, eval_samples, eval_pass_threshold, prompt_column,
         answer_column, report_to):
    """GRPO: the engine samples, rewards rank each group, the trainer follows the clipped surrogate."""
    from rlportable.train import prepare

    try:
        if reward_weights and len(reward_weights) != len(rewards):
            raise RlpError(f"{len(reward_weights)} --reward-weight values for {len(rewards)} --reward functions")
        model_spec = model_spec or prepare.DEFAULT_GRPO_MODEL
        config = prepare.grpo_config(model_spec, held_out=eval_data is not None or eval_task is not None, **_given(
            eval_every=eval_every, eval_samples=eval_samples, eval_pass_threshold=eval_pass_threshold,
            steps=steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
            max_completion_length=max_completion_length, max_prompt_length=max_prompt_length,
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, learning_rate=lr,
            warmup_steps=warmup_steps, weight_decay=weight_decay, max_grad_norm=max_grad_norm, epsilon=epsilon,
            epsilon_high=epsilon_high, beta=beta, loss_type=loss_type, scale_rewards=scale_rewards,
            mask_truncated_completions=mask_truncated_completions or None,
            importance_sampling_level=importance_sampling_level, num_iterations=num_iterations, mini_batches=mini_batches, micro_batch_tokens=micro_batch_tokens,
            seed=seed))
        resolved = {"model_spec": model_spec, "task": task if task or data else prepare.DEFAULT_TASK}
        if print_config:
            click.echo(_run_config_text(config, **resolved), nl=False)
            return
        options = prepare.RunOptions(model_spec, out, resume, save_every, log_jsonl, plot,
                                    task if task or data else prepare.DEFAULT_TASK, data, eval_task, eval_data,
                                    prompt_column, answer_column, report_to)
        prepare.check_paths(options)
        prepare.check_data(options, "grpo")
        held_out = prepare.held_out_records(options, config)  # checked before any work
        specs = list(zip(rewards, reward_weights or [1.0] * len(rewards)))
        if _finished_or_resuming("grpo", options, config.steps):
            return
        prepare.write_run_config(options, _run_config_text(config, **resolved))
        click.echo(f"grpo: {config.steps} steps of {config.prompts_per_step} prompts x {config.num_generations} "
                   f"samples, completions up to {config.max_completion_length} tokens, lr {config.learning_rate:g}, "
                   f"warmup {config.warmup_steps}, loss {config.loss_type}", err=True)
        if held_out is not None and config.eval_every:
            first = "" if resume else "before the first step, "  # a resumed run had that evaluation
            click.echo(f"grpo: evaluating {len(held_out)} held-out prompts (greedy, and {config.eval_samples} samples "
                       f"at temperature {config.temperature:g}) {first}every {config.eval_every} steps and after the "
                       "last", err=True)
    except RlpError as error:
        _fail(error)
    _train_on_replicas("grpo", lambda backend, on_step, dp_group, tp_group, ep_group: prepare.run_grpo(
                           backend, options, config, specs, on_step, dp_group, tp_group, ep_group),
                       ["reward_mean", "reward_std", "loss", "kl", "clip_fraction", "logp_mismatches",
                        "max_abs_dlogp", "ratio_min", "ratio_max", "rollout_tokens_per_s", "step_s"],
                       config.steps, device, tp, dp, emulate, out, plot, ep)


@main.group()
def bench():
    """Benchmarks, as ratios against a peer measured in the same run."""


@bench.command("gemm")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--m", "m_values", multiple=True, type=int, help="M values (default: 1 16 64 256 4096 16384).")
@click.option("--sweep-tiles", is_flag=True, help="Also time every fused tile shape.")
def bench_gemm(device, json_path, m_values, sweep_tiles):
    """Exact GEMM (with activation encoding) against torch bf16 matmul on Qwen3-0.6B shapes."""
    _check_json_path(json_path)
    from rlportable.bench import gemm as gemm_bench

    backend = _backend(device)
    try:
        from rlportable.ops.gemm_fused import available_tiles

        methods = ["auto", "blas"] + ([f"fused:{tile}" for tile in available_tiles(backend)] if sweep_tiles else [])
        result = gemm_bench.run(backend, m_values=list(m_values) or None, methods=methods,
                                progress=lambda text: click.echo(f"  {text}", err=True))
    except RlpError as error:
        _fail(error)
    keys = [key for key in result["rows"][0] if key.endswith("_s") and key != "exact_s"]
    table = [[r["M"], r["K"], r["N"], *(f"{r[key] * 1e6:.1f}" for key in keys), f"{r['ratio']:.2f}"]
             for r in result["rows"]]
    click.echo(tabulate(table, headers=["M", "K", "N", *(key[:-2] + " us" for key in keys), "ratio"]))
    click.echo(json.dumps(result["targets"]))
    _write_json(json_path, result)


@bench.command("attention")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--length", "lengths", multiple=True, type=click.IntRange(1, 1 << 17),
              help="Sequence lengths (default: 1024 4096 16384).")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(1),
              help="Tokens per call (sequences = tokens // length, at least one).")
def bench_attention(device, json_path, lengths, tokens):
    """Exact attention forward, backward and decode against torch sdpa bf16 (causal, GQA)."""
    _check_json_path(json_path)
    from rlportable.bench import attention as attention_bench

    backend = _backend(device)
    try:
        result = attention_bench.run(backend, lengths=tuple(lengths) or attention_bench.LENGTHS, tokens=tokens,
                                     progress=lambda text: click.echo(f"  {text}", err=True))
    except RlpError as error:
        _fail(error)
    table = [[r["length"], r["sequences"], f"{r['hq']}/{r['hkv']}",
              f"{r['ours_forward_s'] * 1e3:.2f}", f"{r['sdpa_forward_s'] * 1e3:.2f}", f"{r['forward_ratio']:.1f}",
              f"{r['ours_backward_s'] * 1e3:.2f}", f"{r['sdpa_backward_s'] * 1e3:.2f}", f"{r['backward_ratio']:.1f}",
              f"{r['train_ratio']:.1f}", f"{r['decode_s'] * 1e6:.0f}", f"{r['decode_bound_fraction']:.2f}"]
             for r in result["rows"]]
    click.echo(tabulate(table, headers=["T", "seqs", "heads", "fwd ms", "sdpa fwd ms", "ratio", "bwd ms",
                                        "sdpa bwd ms", "ratio", "fwd+bwd ratio", "decode us", "decode bound"]))
    click.echo(json.dumps(result["targets"]))
    _write_json(json_path, result)


def _shapes(text: str):
    """"64x320,8x16448" -> ((64, 320), (8, 16448))."""
    try:
        shapes = tuple(tuple(int(n) for n in part.lower().split("x")) for part in text.split(",") if part.strip())
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 2 for s in shapes):
        raise click.BadParameter(f"expected sequences x length pairs such as 64x320,8x16448 (each at least 2), got {text!r}",
                                 param_hint="--shapes")
    return shapes


@bench.command("train")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--shapes", default="64x320,64x1088,64x4160,8x16448", show_default=True,
              help="Packed batches as sequences x tokens, comma-separated.")
@click.option("--layers", default=None, type=click.IntRange(1), help="Fewer layers than Qwen3-0.6B's 28 (quick runs).")
def bench_train(device, json_path, shapes, layers):
    """The training phase (forward, backward, AdamW) against HF transformers bf16 + torch AdamW."""
    _check_json_path(json_path)
    shapes = _shapes(shapes)
    from rlportable.bench import train as train_bench

    backend = _backend(device)
    try:
        result = train_bench.run(backend, shapes=shapes, layers=layers,
                                 progress=lambda text: click.echo(f"  {text}", err=True))
    except RlpError as error:
        _fail(error)
    table = [[f"{r['sequences']} x {r['length']}", f"{r['ours_s']:.2f}", f"{r['hf_s']:.2f}", f"{r['ratio']:.2f}",
              f"{r['ours_peak_bytes'] / 2**30:.1f}", f"{r['hf_peak_bytes'] / 2**30:.1f}",
              "on" if r["hf_gradient_checkpointing"] else "off"] for r in result["rows"]]
    click.echo(tabulate(table, headers=["batch", "ours s", "HF bf16 s", "ratio", "ours GiB", "HF GiB",
                                        "HF checkpointing"]))
    click.echo(json.dumps(result["targets"]))
    _write_json(json_path, result)


@bench.command("forward")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--sequences", default=16, show_default=True, type=int)
@click.option("--length", default=1024, show_default=True, type=int)
@click.option("--layers", default=None, type=int, help="Fewer layers than Qwen3-0.6B's 28 (quick runs).")
def bench_forward(device, json_path, sequences, length, layers):
    """Log-prob throughput and peak memory of a Qwen3-0.6B-shaped model against HF transformers bf16."""
    _check_json_path(json_path)
    from rlportable.bench import forward as forward_bench

    backend = _backend(device)
    try:
        result = forward_bench.run(backend, sequences, length, layers,
                                   progress=lambda text: click.echo(f"  {text}", err=True))
    except RlpError as error:
        _fail(error)
    rows = [["rlportable (contract)", f"{result['ours_tokens_per_s']:.0f}", f"{result['ours_peak_bytes'] / 2**30:.2f}"],
            ["HF transformers bf16 sdpa", f"{result['hf_tokens_per_s']:.0f}", f"{result['hf_peak_bytes'] / 2**30:.2f}"]]
    click.echo(tabulate(rows, headers=["forward + log-probs", "tokens/s", "peak GiB"]))
    click.echo(f"throughput ratio {result['throughput_ratio']:.3f} (target >= 0.25), "
               f"memory ratio {result['memory_ratio']:.3f} (target <= 1)")
    _write_json(json_path, result)


@bench.command("decode")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--sequences", default=256, show_default=True, type=int, help="Concurrent sequences.")
@click.option("--prompt-len", default=128, show_default=True, type=int, help="Random token-id prompt length.")
@click.option("--new-tokens", default=512, show_default=True, type=int, help="Tokens generated per sequence.")
@click.option("--layers", default=None, type=int, help="Fewer layers than Qwen3-0.6B's 28 (quick runs).")
@click.option("--peer", default="hf", show_default=True, type=click.Choice(["hf", "hf-static", "none"]),
              help="hf-static: HF generate with a static KV cache and torch.compile (the first call "
                   "compiles); none: skip HF transformers.")
@click.option("--time-limit", default=240.0, show_default=True, type=float,
              help="Seconds of generation after which a side is stopped (its decode steps still count); 0 = none.")
@click.option("--sampler", default="auto", show_default=True, type=click.Choice(["auto", "host", "device"]),
              help="The engine's sampler; auto: the device sampler on cuda when the engine has one.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
              help="Replay the engine's decode steps as CUDA graphs.")
@click.option("--async-scheduling/--no-async-scheduling", default=None,
              help="Plan and launch each decode step while the one before runs (default: the engine's, on "
                   "with the device sampler and graphs on cuda).")
@click.option("--runs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Measure ours and the peer this many times in turn; the table shows each side's median run.")
@tp_options
def bench_decode(device, json_path, sequences, prompt_len, new_tokens, layers, peer, time_limit, sampler,
                 cuda_graphs, async_scheduling, runs, tp, emulate):
    """Rollout output tokens/s of the engine against HF transformers generate (bf16), and the bandwidth bound.

    With --tp N: the engine at TP=N against TP=1 on the same workload (no HF peer, no time limit)."""
    _check_json_path(json_path)
    from rlportable.bench import decode as decode_bench

    if tp > 1 or os.environ.get("WORLD_SIZE", "1") != "1":
        _bench_decode_tensor_parallel(device, tp, emulate, sequences, prompt_len, new_tokens, layers, sampler,
                                      json_path)
        return

    backend = _backend(device)
    try:
        result = decode_bench.run(backend, sequences, prompt_len, new_tokens, layers, peer, time_limit or None,
                                  sampler, progress=lambda text: click.echo(f"  {text}", err=True),
                                  cuda_graphs=cuda_graphs, async_scheduling=async_scheduling, runs=runs)
    except RlpError as error:
        _fail(error)

    def number(value, scale=1.0, fmt="{:.0f}"):
        return "-" if value is None else fmt.format(value * scale)

    sides = [("rlportable engine", result["ours"])]
    if result["hf_bf16"] is not None:
        sides.append(("HF transformers bf16 sdpa", result["hf_bf16"]))
    rows = [[name, "yes" if side["complete"] else "no", number(side["tokens_per_s"]),
             number(side.get("decode_step_s_median"), 1e3, "{:.2f}"), number(side.get("decode_tokens_per_s")),
             number(side.get("bound_fraction"), 1.0, "{:.3f}"), number(side["peak_bytes"], 2**-30, "{:.2f}")]
            for name, side in sides]
    click.echo(tabulate(rows, headers=["decode", "complete", "tokens/s", "ms/decode step", "decode tokens/s",
                                       "bound fraction", "peak GiB"]))
    ours, ratios = result["ours"], result["ratios"]
    click.echo(f"copy bandwidth {result['copy_bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s (read + write); "
               f"bytes per decode step (mid-decode) {result['step_bytes_at_mid_decode']['ours']['total'] / 1e6:.1f} MB")
    if ours.get("decode_execute_s_median") is not None:
        parts = [f"{key[7:-9].replace('_', ' ')} {ours[key] * 1e3:.2f} ms" for key in
                 ("decode_execute_s_median", "decode_runner_host_s_median", "decode_runner_wait_s_median",
                  "decode_runner_finish_s_median", "decode_host_sampler_s_median")
                 if ours.get(key) is not None]
        engine = ours["engine"]
        graphs = f"CUDA graphs ({engine['graphs']} captured in {engine['graph_capture_s']:.2f} s)" \
            if engine.get("graphs") else "no graphs"
        overlap = f"async scheduling, {ours.get('steps_ahead')} steps ahead" if engine.get("async_scheduling") \
            else "steps in turn"
        click.echo(f"ours per decode step ({engine['sampler']} sampler, {graphs}, {overlap}): " + ", ".join(parts))
    if ratios:
        click.echo(f"throughput ratio {number(ratios.get('throughput_ratio'), 1.0, '{:.3f}')} (target >= 10), "
                   f"decode step ratio {number(ratios.get('decode_step_ratio'), 1.0, '{:.3f}')} "
                   f"over {ratios.get('decode_steps_compared', 0)} steps, "
                   f"memory ratio {number(ratios.get('memory_ratio'), 1.0, '{:.3f}')}")
    if ratios.get("throughput_ratio_first_call") is not None:
        first = result["hf_first_call"]
        click.echo(f"HF's first full-length call in the process (run 1's warm-up, not the peer): "
                   f"{number(first['tokens_per_s'])} tokens/s; ours / that {ratios['throughput_ratio_first_call']:.3f}")
    click.echo(f"bound fraction {number(ours.get('bound_fraction'), 1.0, '{:.3f}')} (target >= 0.3)")
    if len(result["runs"]) > 1:
        click.echo("runs (ours / HF tokens/s, throughput ratio): " + "; ".join(
            f"{number(run['ours_tokens_per_s'])} / {number(run['hf_tokens_per_s'])}, "
            f"{number(run['ratios'].get('throughput_ratio'), 1.0, '{:.3f}')}" for run in result["runs"]) +
            " (the table and the ratios above: each side's median run)")
    for name, side in sides:
        if not side["complete"]:
            click.echo(f"note: {name} stopped at the time limit after {side['steps']} steps "
                       f"({side['output_tokens']} tokens)", err=True)
    _write_json(json_path, result)
    if result["peer_error"]:
        click.echo(f"error: the HF transformers peer failed: {result['peer_error']}", err=True)
        sys.exit(1)


def _layouts(text: str):
    from rlportable.train.memory import parse_layouts

    try:
        return parse_layouts(text)
    except RlpError as error:
        raise click.BadParameter(str(error), param_hint="--layouts")


@bench.command("memory")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--model", "shapes", default="qwen3-8b", show_default=True,
              help="Model shapes, comma-separated: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-30b-a3b (MoE).")
@click.option("--layouts", default="1x1,8x1,4x2,1x8", show_default=True,
              help="TPxDP layouts, or TPxEPxDP with expert parallelism (MoE), comma-separated.")
@click.option("--tokens", default=16384, show_default=True, type=click.IntRange(min=2),
              help="Tokens of one training micro-batch.")
@click.option("--kv-tokens", default=65536, show_default=True, type=click.IntRange(min=0),
              help="Tokens the rollout's KV cache holds.")
@click.option("--measure", is_flag=True,
              help="Also train the first shape (--layers layers) at each layout, ranks emulated on this GPU, and "
                   "compare the measured peak with the model's.")
@click.option("--layers", default=4, show_default=True, type=click.IntRange(min=1), help="Layers for --measure.")
def bench_memory(device, json_path, shapes, layouts, tokens, kv_tokens, measure, layers):
    """Bytes per rank of training (weights, encodings, gradient, optimiser, activations, KV cache)."""
    _check_json_path(json_path)
    from rlportable.bench import memory as memory_bench
    from rlportable.train.memory import Workload

    chosen, names = _layouts(layouts), [s.strip() for s in shapes.split(",")]
    try:
        rows = memory_bench.model_rows(names, chosen, Workload(tokens, kv_tokens))
    except RlpError as error:
        _fail(error)
    keys = [k for k in rows[0] if k not in ("fits_80gb", "fits_141gb")]
    click.echo(f"GiB per rank; micro-batch {tokens} tokens, KV cache {kv_tokens} tokens")
    click.echo(tabulate([[row[k] for k in keys] + [("yes" if row["fits_80gb"] else "no"),
                                                     ("yes" if row["fits_141gb"] else "no")] for row in rows],
                        headers=keys + ["80 GB", "141 GB"]))
    result = {"model": rows, "measured": []}
    if measure:
        backend = _backend(device)
        for layout in chosen:
            try:
                found = memory_bench.measure(backend, names[0], layers, layout.tp, layout.dp, tokens, layout.ep)
            except RlpError as error:
                _fail(error)
            result["measured"].append(found)
            click.echo(f"measured {found['shape']} ({layers} layers) at TP {layout.tp} x DP {layout.dp}: peak "
                       f"{found['measured_peak_bytes'] / 2**30:.2f} GiB, model {found['model_peak_bytes'] / 2**30:.2f} "
                       f"GiB ({found['measured_over_model']:.2f}x); weights equal to one rank's: "
                       f"{found['weights_equal_one_rank']}")
    _write_json(json_path, result)


@bench.command("grpo")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--layers", default=None, type=int, help="Fewer layers than Qwen3-0.6B's 28 (quick runs).")
@click.option("--steps", default=3, show_default=True, type=int, help="Timed steps, after one warm-up step.")
@click.option("--peer", default="trl", show_default=True, type=click.Choice(["trl", "none"]),
              help="none: skip TRL's GRPOTrainer.")
@click.option("--prompt-len", default=64, show_default=True, type=int, help="Prompt tokens per sample.")
@click.option("--completion-len", default=256, show_default=True, type=int,
              help="Completion tokens per sample (every completion runs to this length).")
def bench_grpo(device, json_path, layers, steps, peer, prompt_len, completion_len):
    """Wall time per GRPO step (rollout, training, total) against TRL's GRPOTrainer (HF generate, bf16)."""
    _check_json_path(json_path)
    from rlportable.bench import grpo as grpo_bench

    backend = _backend(device)
    try:
        result = grpo_bench.run(backend, layers, steps, peer, progress=lambda text: click.echo(f"  {text}", err=True),
                                prompt_len=prompt_len, completion_len=completion_len)
    except RlpError as error:
        _fail(error)
    sides = [(name, side) for name, side in (("rlportable GRPOTrainer", result["ours"]),
                                             ("TRL GRPOTrainer", result["trl"])) if side is not None]
    rows = [[name, *(f"{side[f'{key}_s_median']:.3f}" for key in ("rollout", "train", "total")),
             "{}-{}".format(*side["completion_lengths"])] for name, side in sides]
    settings = result["settings"]
    click.echo(f"{settings['prompts_per_step']} prompts x {settings['num_generations']} samples, "
               f"{settings['prompt_len']} + {settings['completion_len']} tokens, {result['layers']} layers; "
               f"medians of {settings['steps']} steps after {settings['warmup']} warm-up")
    click.echo(tabulate(rows, headers=["GRPO step", "rollout s", "train s", "total s", "completion tokens"]))
    if result["ours"] is not None and result["ours"].get("phases_s_median"):
        phases = result["ours"]["phases_s_median"]
        click.echo("ours, median seconds per phase: " + ", ".join(f"{name} {value:.3f}"
                                                                  for name, value in phases.items()))
    if result["ours"] is not None:
        mismatches = sum(step["logp_mismatches"] for step in result["ours"]["steps"])
        click.echo(f"ours: log-prob mismatches {mismatches} over {len(result['ours']['steps'])} steps")
    if result["trl"] is not None:
        click.echo(f"TRL {result['trl']['trl']['version']}, transformers {result['trl']['transformers']}, "
                   f"torch {result['trl']['torch']}")
    ratios = result["ratios"]
    if ratios:
        click.echo(f"step time ratio ours/TRL {ratios['step_time_ratio']:.3f} "
                   f"(target <= {result['targets']['step_time_ratio_at_most']}); rollout "
                   f"{ratios['rollout_ratio']:.3f}, train {ratios['train_ratio']:.3f}")
    _write_json(json_path, result)
    for side, key in (("ours", "ours_error"), ("the TRL peer", "peer_error")):
        if result[key]:
            click.echo(f"error: {side} failed: {result[key]}", err=True)
    if result["ours_error"] or result["peer_error"]:
        sys.exit(1)


@bench.command("learning")
@DEVICE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Both sides' reward curves (PNG).")
@click.option("--task", "task_specs", multiple=True,
              help="A built-in task spec, repeatable (default: arithmetic:digits=1,ops=+ and "
                   "countdown:count=2,max_number=3).")
@click.option("--steps", default=50, show_default=True, type=int)
@click.option("--seeds", default=3, show_default=True, type=int, help="Seeds per side (0, 1, ...).")
@click.option("--window", default=20, show_default=True, type=int, help="Last steps the criterion averages.")
@click.option("--prompts-per-step", default=32, show_default=True, type=int)
def bench_learning(device, json_path, plot_path, task_specs, steps, seeds, window, prompts_per_step):
    """GRPO from tiny-sft, ours against TRL's GRPOTrainer: reward curves over seeds, first step on the same completions."""
    _check_json_path(json_path)
    from rlportable.bench import learning as learning_bench

    try:
        settings = learning_bench.Settings(tasks=tuple(task_specs) or learning_bench.TASKS, steps=steps, seeds=seeds,
                                           window=window, prompts_per_step=prompts_per_step)
        learning_bench.check_plot_path(plot_path)
    except RlpError as error:
        _fail(error)
    backend = _backend(device)
    try:
        result = learning_bench.run(backend, settings, progress=lambda text: click.echo(f"  {text}", err=True))
        if plot_path:
            learning_bench.plot(result, plot_path)
            click.echo(f"wrote {plot_path}", err=True)
    except RlpError as error:
        _fail(error)
    for line in learning_bench.summary_lines(result):
        click.echo(line)
    _write_json(json_path, result)
    if not result["pass"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
