"""Golden digests: SHA-256 digests of canonical outputs, computed by the NumPy reference and committed under
conformance/golden/ (one file per group), that every backend must reproduce, so two backends that both
reproduce them agree bitwise through the reference. This module collects every family's cases, holds the
end-to-end ones (the tiny and Qwen3-0.6B-shaped models' log-probs and engine outputs, a training step,
short sft and grpo runs), writes the files (`rlportable conform --write-golden`, cpu only) and verifies
them: one check per digest, "golden.<group>.<case>"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np

from rlportable.conform.families import FAMILIES
from rlportable.conform.golden_case import Case, Cases
from rlportable.conform.golden_digest import DIGEST_RULE, canonical, digest, host, output_entries
from rlportable.conform.golden_stream import INPUT_RULE, Stream
from rlportable.conform.inputs import cu_seqlens
from rlportable.conform.tally import Settings, SettingsCheck, Tally
from rlportable.contract.adamw import Hyper
from rlportable.errors import RlpError
from rlportable.runtime.base import Backend

FORMAT = "rlportable-golden-v1"
REGENERATE = "rlportable conform --device cpu --write-golden"

# The end-to-end cases' inputs come from the Stream, their models' weights do not: the Qwen3-0.6B-shaped
# model's are rlportable.model.synthetic.random_weights(config, seed) and the tiny model's tiny_model()'s
# (NumPy normal streams, pinned by tests/test_tiny_model.py for the tiny model), as their recipes say.
TINY_CASES = Cases("tiny")
TRAINING_CASES = Cases("training")
QWEN3_CASES = Cases("qwen3-0.6b-shape")


class _Shared:
    """One expensive object at a time (a built model, a training step), kept while the next case of
    its group needs it: keyed by (name, backend), replaced when another key is asked for."""

    key = None
    value = None

    @classmethod
    def get(cls, name: str, backend: Backend, build: Callable):
        key = (name, id(backend))
        if cls.key != key:
            cls.key, cls.value = None, None  # free the previous object before building the next
            cls.value, cls.key = build(), key
        return cls.value

    @classmethod
    def clear(cls) -> None:
        cls.key, cls.value = None, None


def _packed_logprobs(model, s: Stream, r) -> list[tuple[str, np.ndarray]]:
    out = []
    for temperature in r["temperatures"]:
        tokens = s.ints((sum(r["lengths"]),), 0, model.config.vocab_size)
        logp, ent = model.logprobs(tokens, cu_seqlens(r["lengths"]), temperature, with_entropy=True)
        out += [(f"{temperature}.logp", canonical(np.concatenate(logp))),
                (f"{temperature}.entropy", canonical(np.concatenate(ent)))]
    return out


def _generated(outputs) -> list[tuple[str, np.ndarray]]:
    out = []
    for request in outputs:
        out.append((f"{request.request_id}.prompt", canonical(np.array(request.prompt_token_ids), "int32")))
        for c in request.outputs:
            out += [(f"{request.request_id}.{c.index}.tokens", canonical(np.array(c.token_ids), "int32")),
                    (f"{request.request_id}.{c.index}.logp", canonical(np.array(c.logprobs, np.float32)))]
    return out


def _sampling_params(r) -> list:
    from rlportable.engine.sequence import SamplingParams

    return [SamplingParams(**params) for params in r["params"]]


def _tiny(backend, trainable: bool = False):
    from rlportable.model.forward import Model
    from rlportable.model.tiny import tiny_model

    config, weights, tokenizer = tiny_model()
    return Model(backend, config, weights, trainable=trainable), tokenizer


@TINY_CASES.case("model.logprobs", seed=100, model="rlportable.model.tiny.tiny_model()",
       lengths=[1, 7, 33, 64], temperatures=[1.0, 0.7], tokens="ints in [0, vocab) per temperature")
def _tiny_logprobs(backend, s, r):
    model, _ = _tiny(backend)
    return _packed_logprobs(model, s, r)


_ENGINE = dict(max_num_seqs=64, block_size=16)


@TINY_CASES.case("engine.generate", seed=101, model="rlportable.model.tiny.tiny_model()",
       prompts=["12+34=", "a longer prompt that spans more than one block of the cache", "7"],
       params=[dict(n=3, temperature=1.0, max_tokens=16, seed=12345, ignore_eos=True),
               dict(n=2, temperature=0.6, top_p=0.9, top_k=50, max_tokens=16, seed=2**64 - 1, ignore_eos=True),
               dict(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)],
       engine=_ENGINE)
def _tiny_generate(backend, s, r):
    from rlportable.engine.llm import LLM

    llm = LLM(device=backend, loaded=_tiny(backend), **r["engine"])
    return _generated(llm.generate(r["prompts"], _sampling_params(r)))


TRAIN_RECIPE = dict(seed=102, model="rlportable.model.tiny.tiny_model(), Model(trainable=True)",
                    lengths=[12, 30], rows="every token followed by one of its sequence, except the first 4 of each",
                    temperature=1.0, grad_logp="uniform * 2^-4",
                    hyper={"lr": 1e-3, "weight_decay": 0.01, "max_norm": 1.0},
                    step="rlportable.model.backward.forward/backward, then train.optimizer.Optimizer "
                         "accumulate + step (Schedule(peak_lr=lr, warmup_steps=1, total_steps=1): the step's lr is lr)")


def _train_step(backend, r) -> dict:
    """One training step of the tiny model: gradients, then the weights after the optimiser."""
    from rlportable.model import backward
    from rlportable.train.optimizer import Optimizer, Schedule

    s = Stream(r["seed"])
    model, _ = _tiny(backend, trainable=True)
    config, cu = model.config, cu_seqlens(r["lengths"])
    tokens = s.ints((int(cu[-1]),), 0, config.vocab_size)
    rows = np.concatenate([np.arange(a + 4, b - 1) for a, b in zip(cu[:-1], cu[1:])]).astype(np.int64)
    fwd = backward.forward(model, tokens, cu, r["temperature"], rows=rows)
    grad_logp = np.ldexp(s.floats((rows.size,), "uniform"), -4).astype(np.float32)
    grads = backward.backward(model, fwd, grad_logp)
    named = grads.named_tensors(config)
    result = {"logp": [("logp", host(backend, fwd.logp))],
              "gradients": [(name, host(backend, g)) for name, g in named.items()]}
    hyper = Hyper(**r["hyper"])
    optimizer = Optimizer(model, hyper, Schedule(peak_lr=hyper.lr, warmup_steps=1, total_steps=1))
    optimizer.accumulate(grads)
    info = optimizer.step()
    result["updated_weights"] = ([("lr_norm_clip", np.array([info.lr, info.norm, info.clip], np.float64))]
                                 + [(name, host(backend, p)) for name, p in
                                    model.params.named_tensors(config).items()])
    return result


@TINY_CASES.case("train.gradients", **TRAIN_RECIPE)
def _tiny_train_gradients(backend, s, r):
    step = _Shared.get("tiny.train", backend, lambda: _train_step(backend, r))
    return step["logp"] + step["gradients"]


@TINY_CASES.case("train.updated_weights", **TRAIN_RECIPE)
def _tiny_train_updated(backend, s, r):
    step = _Shared.get("tiny.train", backend, lambda: _train_step(backend, r))
    _Shared.clear()
    return step["updated_weights"]


# ---- whole training runs: the weights and AdamW state after a few steps of `rlportable sft` and
# `rlportable grpo` as their defaults run them (the embedded models and task), shortened; matching these
# digests proves the whole loop on a device (sampling, rewards, log-probs, gradients, optimiser), not
# only its parts. The metrics that are functions of the bits (not of time) are recorded too.

TRAJECTORY_TASK = "arithmetic:digits=1,ops=+"  # train/prepare.py DEFAULT_TASK
SFT_RUN = dict(seed=120, model="tiny", task=TRAJECTORY_TASK,
               config=dict(steps=3, batch_size=8, learning_rate=3e-3, warmup_steps=1, seed=0),
               run="SFTTrainer(model, tokenizer, task_sft_records(task dataset), SFTConfig(**config)).step(i), "
                   "i < steps, as rlportable sft runs them")
GRPO_RUN = dict(seed=121, model="tiny-sft", task=TRAJECTORY_TASK,
                config=dict(steps=2, prompts_per_step=4, num_generations=4, max_completion_length=8,
                            learning_rate=4e-4, warmup_steps=1, seed=0),
                run="GRPOTrainer(model, tokenizer, task dataset, the task's reward, GRPOConfig(**config)).step(i), "
                    "i < steps, as rlportable grpo runs them")
# GRPO on the built-in Qwen3-MoE (tiny-sft upcycled, so the rewards have spread from the first step): the
# routers' and experts' training composed over steps, and the engine's recorded expert choices against the
# trainer's (0 mismatches, digested with their count). Two mini-batches a step, so the second trains on
# moved weights (ratios off 1, some clipped), and min_lr keeps the last of the 4 updates' lr above 0.
GRPO_MOE_RUN = dict(GRPO_RUN, seed=122, model="tiny-moe",
                    model_recipe="rlportable.model.tiny.tiny_moe_model(): tiny-sft with layer 1 sparse, "
                                 "4 experts (its MLP plus seeded noise), 2 active, renormalised",
                    config=dict(GRPO_RUN["config"], learning_rate=2e-3, min_lr=1e-4, mini_batches=2))
SFT_METRICS = ("loss", "grad_norm", "lr", "completion_tokens")
GRPO_METRICS = ("reward_mean", "reward_std", "loss", "kl", "clip_fraction", "logp_mismatches", "grad_norm", "lr")
GRPO_MOE_METRICS = (*GRPO_METRICS, "logp_compared", "routing_mismatches", "routing_compared", "ratio_min",
                    "ratio_max", "completion_length")


def _trajectory(optimizer, records: list[dict], keys) -> list[tuple[str, np.ndarray]]:
    out = [(f"step{i + 1}.{key}", np.array([float(record[key])], np.float64))
           for i, record in enumerate(records) for key in keys if key in record]
    # the whole tensors, gathered from the shards when the run is sharded (copies: AdamW updates in place)
    out += [(f"weights.{name}", canonical(np.array(a, copy=True))) for name, a in optimizer.whole_weights().items()]
    return out + [(f"optimizer.{name}", canonical(np.array(a, copy=True))) for name, a in optimizer.state().items()]


def _run_setup(backend, r, seed: int, tp_group=None, ep_group=None):
    """(model, tokenizer, task records, task) of a trajectory recipe: the embedded model, trainable."""
    from rlportable.model.forward import Model
    from rlportable.model.load import load_model
    from rlportable.train.prepare import task_records

    model_config, weights, tokenizer = load_model(r["model"])
    records, task = task_records(r["task"], None, seed)
    model = Model(backend, model_config, weights, trainable=True, tp_group=tp_group, ep_group=ep_group)
    return model, tokenizer, records, task


@TRAINING_CASES.case("sft.trajectory", **SFT_RUN)
def _sft_trajectory(backend, s, r, dp_group=None, tp_group=None):
    """dp_group: data-parallel ranks with a sharded optimiser; tp_group: tensor-parallel ranks sharing the
    model: any layout's run must give the same digest."""
    from rlportable.train.sft import SFTConfig, SFTTrainer, task_sft_records

    config = SFTConfig(**r["config"])
    model, tokenizer, records, _ = _run_setup(backend, r, config.seed, tp_group)
    trainer = SFTTrainer(model, tokenizer, task_sft_records(records), config, dp_group)
    steps = [trainer.step(i) for i in range(config.steps)]
    return _trajectory(trainer.optimizer, steps, SFT_METRICS)


@TRAINING_CASES.case("grpo.trajectory", **GRPO_RUN)
def _grpo_trajectory(backend, s, r, dp_group=None, tp_group=None):
    """dp_group, tp_group: as _sft_trajectory's."""
    return _grpo_run(backend, r, GRPO_METRICS, dp_group, tp_group)


@TRAINING_CASES.case("grpo_moe.trajectory", **GRPO_MOE_RUN)
def _grpo_moe_trajectory(backend, s, r, dp_group=None, tp_group=None, ep_group=None):
    """dp_group, tp_group: as _sft_trajectory's; ep_group: expert-parallel ranks, each holding its share of
    the experts (the digest gathers them whole)."""
    return _grpo_run(backend, r, GRPO_MOE_METRICS, dp_group, tp_group, ep_group)


def _grpo_run(backend, r, metrics, dp_group, tp_group, ep_group=None) -> list[tuple[str, np.ndarray]]:
    from rlportable.train.grpo import GRPOConfig, GRPOTrainer
    from rlportable.train.rewards import RewardSet

    config = GRPOConfig(**r["config"])
    model, tokenizer, records, task = _run_setup(backend, r, config.seed, tp_group, ep_group)
    trainer = GRPOTrainer(model, tokenizer, records, RewardSet([(task, 1.0)]), config, None, dp_group)
    steps = [trainer.step(i) for i in range(config.steps)]
    del trainer.engine  # its KV cache
    return _trajectory(trainer.optimizer, steps, metrics)


# Layers of the Qwen3-0.6B-shaped model: each has the full shape (hidden 1024, 16 / 8 heads of 128, MLP 3072,
# vocabulary 151,936), but 28 of them cost the NumPy reference about 140 s of CPU time here (the engine's
# every step re-reads all weights), too slow for CI; 4 keep the whole group near 50 s. The device check
# model.qwen3-0.6b-shape.logprobs runs all 28 against the reference.
QWEN3_LAYERS = 4


def _qwen3_model(backend, r):
    from rlportable.model.synthetic import qwen3_06b_config, random_weights
    from rlportable.model.forward import Model

    config = qwen3_06b_config(r["layers"])
    return Model(backend, config, random_weights(config, seed=r["weights_seed"]))


class _NoTokenizer:
    """Token-id prompts only: no stop tokens (random weights may sample any id), empty texts."""

    eos_token_id = None
    stop_token_ids: list = []

    def decode(self, _ids) -> str:
        return ""


QWEN3_RECIPE = dict(model="rlportable.model.synthetic.qwen3_06b_config(layers), random_weights(config, weights_seed)",
                    layers=QWEN3_LAYERS, weights_seed=7)


@QWEN3_CASES.case("model.logprobs", expensive=True, seed=110, lengths=[16, 16], temperatures=[1.0],
       tokens="ints in [0, vocab)", **QWEN3_RECIPE)
def _qwen3_logprobs(backend, s, r):
    model = _Shared.get("qwen3", backend, lambda: _qwen3_model(backend, r))
    return _packed_logprobs(model, s, r)


@QWEN3_CASES.case("engine.generate", expensive=True, seed=111, prompt_lengths=[16, 16],
       prompts="token ids: ints in [0, vocab)", tokenizer="none: no stop tokens",
       params=[dict(n=1, temperature=1.0, max_tokens=3, seed=2024, ignore_eos=True),
               dict(n=1, temperature=0.0, max_tokens=3, ignore_eos=True)],
       engine=dict(max_num_seqs=4, block_size=16, max_model_len=64), **QWEN3_RECIPE)
def _qwen3_generate(backend, s, r):
    from rlportable.engine.llm import LLM

    model = _Shared.get("qwen3", backend, lambda: _qwen3_model(backend, r))
    prompts = [s.ints((n,), 0, model.config.vocab_size).tolist() for n in r["prompt_lengths"]]
    llm = LLM(device=backend, loaded=(model, _NoTokenizer()), **r["engine"])
    outputs = llm.generate(prompts, _sampling_params(r))
    del llm
    _Shared.clear()
    return _generated(outputs)


# ----------------------------------------------------------------------------- every case

#: every family's cases, then the end-to-end ones: the order of the golden checks and, within a group,
#: of its file's digests
CASES: list[Case] = [*(case for family in FAMILIES for case in family.GOLDEN_CASES), *TINY_CASES, *TRAINING_CASES,
                     *QWEN3_CASES]


# ----------------------------------------------------------------------------- files

def directory(folder: Path | None = None) -> Path:
    """The golden digests' folder: `folder` (conform --golden-dir), else conformance/golden."""
    if folder is not None:
        return Path(folder)
    from rlportable.resources import resource_dir

    return resource_dir("conformance") / "golden"


def groups() -> list[str]:
    return list(dict.fromkeys(case.group for case in CASES))


def entry(case: Case, outputs: list[tuple[str, np.ndarray]]) -> dict:
    """A file's entry for a case; "function" names its compute (module.function)."""
    return {"name": case.name, "recipe": case.recipe, "function": f"{case.compute.__module__}.{case.compute.__name__}",
            "elements": int(sum(np.asarray(a).size for _, a in outputs)), "sha256": digest(outputs),
            "outputs": output_entries(outputs)}


def group_document(group: str, entries: list[dict]) -> str:
    """The file's text: indented JSON with each recipe on one line (readable, and a stable diff)."""
    placeholders = [dict(item, recipe=f"@recipe{i}@") for i, item in enumerate(entries)]
    document = {"format": FORMAT, "group": group, "computed_by": "the NumPy reference (--device cpu)",
                "regenerate": REGENERATE, "inputs": INPUT_RULE, "digest": DIGEST_RULE, "digests": placeholders}
    text = json.dumps(document, indent=1)
    for i, item in enumerate(entries):
        text = text.replace(f'"@recipe{i}@"', json.dumps(item["recipe"]))
    return text + "\n"


def write_golden(backend: Backend, folder=None, only_groups=None, progress=None) -> list[Path]:
    """Compute every case on the cpu backend (the reference) and write one file per group."""
    if backend.name != "cpu":
        raise RlpError(f"--write-golden computes the digests with the NumPy reference: use --device cpu, "
                       f"not {backend.label}")
    folder = Path(folder) if folder is not None else directory()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for group in groups():
        if only_groups is not None and group not in only_groups:
            continue
        entries = []
        for case in (c for c in CASES if c.group == group):
            if progress:
                progress(case.check_name)
            entries.append(entry(case, case.outputs(backend)))
        path = folder / f"{group}.json"
        path.write_text(group_document(group, entries))
        written.append(path)
    return written


def _expected(case: Case, folder: Path | None) -> tuple[dict | None, str | None]:
    """The committed entry of a case, or why there is none (a one-line message)."""
    path = directory(folder) / f"{case.group}.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return None, f"cannot read {path}: {error}"
    for item in document.get("digests", []):
        if item.get("name") == case.name:
            if item.get("recipe") != case.recipe:
                return None, f"{path} holds another recipe for {case.name}: regenerate with `{REGENERATE}`"
            return item, None
    return None, f"{path} has no digest {case.name}: regenerate with `{REGENERATE}`"


def verify(backend: Backend, case: Case, folder: Path | None = None) -> tuple[int, int, str | None]:
    """(compared, mismatches, message): the case's outputs on the backend against its committed digest.
    compared = the elements the digest covers; mismatches = the elements of the outputs whose own digests
    differ (a digest cannot say which elements); message: one line naming the digest and the first such
    output, or None."""
    expected, problem = _expected(case, folder)
    try:
        outputs = case.outputs(backend)
    except RlpError as error:
        outputs, problem = None, problem or f"raised: {error}"
    if outputs is None or expected is None:
        size = expected["elements"] if expected else sum(np.asarray(a).size for _, a in outputs or [])
        return size, max(size, 1), f"golden digest {case.check_name}: {problem}"
    got = entry(case, outputs)
    if got["sha256"] == expected["sha256"]:
        return got["elements"], 0, None
    wanted = set(expected["outputs"])
    differing = [(line, int(np.asarray(a).size)) for line, (_, a) in zip(got["outputs"], outputs)
                 if line not in wanted]
    bad = sum(size for _, size in differing)
    first = (f"first differing output: {differing[0][0].rsplit(' ', 1)[0]} (of {len(got['outputs'])})"
             if differing else "the outputs' order differs")
    message = (f"golden digest {case.check_name} differs: expected {expected['sha256'][:16]}..., got "
               f"{got['sha256'][:16]}... ({directory(folder) / (case.group + '.json')}); {first}")
    return got["elements"], max(bad, 1), message


def _check(case: Case) -> SettingsCheck:
    def check(backend: Backend, rng, quick: bool, settings: Settings) -> Tally:
        tally = Tally()
        tally.compared, tally.mismatches, tally.message = verify(backend, case, settings.golden_dir)
        return tally

    return SettingsCheck(check)


GOLDEN_CHECKS: list[tuple[str, Callable]] = [(case.check_name, _check(case)) for case in CASES]

#: the end-to-end digests that `--quick` skips (the per-kernel ones always run)
QUICK_SKIPPED = {case.check_name for case in CASES if case.expensive}
