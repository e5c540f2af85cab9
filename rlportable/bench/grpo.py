"""`rlportable bench grpo`: wall time of one GRPO step, ours against TRL's GRPOTrainer.

Both sides, in the same process on the same device: a Qwen3-0.6B-shaped model with random
weights (model/synthetic.py), 8 prompts x 8 samples per step, prompts of 64 random token ids,
completions of exactly 256 tokens, temperature 1 with no top-k / top-p / min-p filter, loss
"dapo", beta 0 (no reference model), num_iterations 1, one optimiser step per rollout of 64
samples (learning rate 1e-6, AdamW betas (0.9, 0.99), gradient clipping at 1), and one reward
function, `hash_reward`: a deterministic pseudo-random number in [0, 1) from a hash of each
completion's token ids, so every group has distinct rewards and the advantages are non-zero.

Exactly 256 tokens on both sides (ignore_eos semantics):
  ours: GRPOConfig(ignore_eos=True) and a tokenizer with no eos (token-id prompts), so the
    engine stops every sequence at max_completion_length;
  TRL: its tokenizer's eos token (also its pad token) has the id vocab_size, one past the
    model's logits, so generate can never sample it: every sequence runs max_new_tokens steps,
    and TRL's completion mask (cut after the first eos) keeps all 256 tokens.
Each side records every step's shortest and longest completion (both must be 256).

Ours: rlportable.train.grpo.GRPOTrainer, engine and trainer sharing one Model (float32 master
weights, the contracts' exact kernels), the device sampler on cuda.
Peer: TRL's GRPOTrainer on HF transformers Qwen3ForCausalLM built from the same config, bf16
weights and bf16=True, sdpa attention, generation through transformers `generate` (no vLLM),
per_device_train_batch_size 32 x gradient_accumulation_steps 2 = 64 samples (TRL then generates
once per optimiser step, and with num_iterations 1 it skips the old log-prob pass, as we do),
gradient checkpointing off (TRL's default is on; off is faster when memory allows, as on an
H200), shuffle_dataset off, no logging integrations.

Per step: rollout = the generation call (token-id prompts to completion ids, after a device
sync on both ends); total = the step's wall time (device synced; for TRL from the end of the
previous optimiser step to the end of this one, so its logging and data loading count, as
everything in GRPOTrainer.step counts for ours); train = total - rollout (rewards, advantages,
log-probs, loss, backward, optimiser). Reported: every step, and the medians over `steps` steps
after `warmup` warm-up steps (kernel compilation, graph capture, allocator growth).
step_time_ratio = our median total / TRL's (target <= 0.2); rollout and train ratios likewise.
If the peer fails (not installed, out of memory), our numbers are kept and the failure is
recorded as `peer_error`; if ours fails (a log-prob mismatch, out of memory), the peer still
runs and the failure is `ours_error`. Either makes the command exit with status 1.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from rlportable.bench.decode import engine_sampler, hf_config, random_prompts
from rlportable.errors import InputError, RlpError
from rlportable.model.synthetic import IdsOnlyTokenizer, qwen3_06b_config, random_weights

TARGETS = {"step_time_ratio_at_most": 0.25, "train_s_at_most": 1.0}
TRL_MICRO_BATCH = 32  # per_device_train_batch_size; gradient accumulation makes up the 64 samples
#: TRL's logged metrics kept per step: {our key: TRL's key}
TRL_METRICS = {"reward_std": "reward_std", "loss": "loss", "grad_norm": "grad_norm",
               "trl_step_time_s": "step_time", "trl_clipped_ratio": "completions/clipped_ratio"}


@dataclass(frozen=True)
class Settings:
    prompts_per_step: int = 8
    num_generations: int = 8
    prompt_len: int = 64
    completion_len: int = 256
    steps: int = 3          # timed steps
    warmup: int = 1         # untimed steps before them
    learning_rate: float = 1e-6
    loss_type: str = "dapo"
    seed: int = 0

    def __post_init__(self):
        for name in ("prompts_per_step", "num_generations", "prompt_len", "completion_len", "steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"bench grpo: {name} must be a positive integer, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise InputError(f"bench grpo: warmup must be an integer >= 0, got {self.warmup!r}")

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.num_generations


def hash_reward(completion_ids, **kwargs) -> list[float]:
    """A reward in [0, 1) per completion, a function of its token ids alone (BLAKE2b of them as int64):
    deterministic, pseudo-random, the same on both sides. Called the TRL way (keywords)."""
    return [int.from_bytes(hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=8).digest(),
                           "little") / 2.0**64 for ids in completion_ids]


def bench_prompts(config, settings: Settings) -> np.ndarray:
    """A distinct prompt for every (step, prompt) of the run: [total_steps * prompts_per_step, prompt_len]."""
    return random_prompts(config, settings.total_steps * settings.prompts_per_step, settings.prompt_len,
                          seed=settings.seed + 1)


def summarize(steps: list[dict], warmup: int) -> dict:
    """Medians of rollout, train and total over the timed steps (those after the warm-up), and of
    each phase a step reports ("phases_s": {phase: seconds}; ours only)."""
    timed = steps[warmup:]
    out = {f"{key}_median": statistics.median(s[key] for s in timed) if timed else None
           for key in ("rollout_s", "train_s", "total_s")}
    phases = sorted({name for s in timed for name in s.get("phases_s", {})})
    if phases:
        out["phases_s_median"] = {name: statistics.median(s["phases_s"].get(name, 0.0) for s in timed)
                                  for name in phases}
    out["completion_lengths"] = [min(s["completion_min"] for s in steps), max(s["completion_max"] for s in steps)] \
        if steps else None
    out["steps"] = steps
    return out


# ---------------------------------------------------------------- ours

def measure_ours(backend, config, weights, prompts: np.ndarray, settings: Settings, sampler: str = "auto",
                 progress=None) -> dict:
    """rlportable's GRPOTrainer: `total_steps` steps, each timed between device syncs."""
    from rlportable.model.forward import Model
    from rlportable.train.grpo import GRPOConfig, GRPOTrainer
    from rlportable.train.rewards import RewardSet

    _, sampler = engine_sampler(backend.name, sampler)
    grpo_config = GRPOConfig(
        steps=settings.total_steps, prompts_per_step=settings.prompts_per_step,
        num_generations=settings.num_generations, max_completion_length=settings.completion_len,
        temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, ignore_eos=True, sampler=sampler,
        learning_rate=settings.learning_rate, beta=0.0, loss_type=settings.loss_type, scale_rewards="group",
        num_iterations=1, mini_batches=1, seed=settings.seed)
    if progress:
        progress("ours: building the model and the engine")
    model = Model(backend, config, weights, trainable=True)
    trainer = GRPOTrainer(model, IdsOnlyTokenizer(), [{"prompt": row.tolist()} for row in prompts],
                          RewardSet([(hash_reward, 1.0)]), grpo_config)
    lengths: list[list[int]] = []
    rollout = trainer._rollout

    def recorded_rollout(*args, **kwargs):  # every completion's length, as TRL's side records them
        samples, texts = rollout(*args, **kwargs)
        lengths.append([len(s.completion_ids) for s in samples])
        return samples, texts

    trainer._rollout = recorded_rollout
    steps = []
    for step in range(settings.total_steps):
        if progress:
            progress(f"ours: step {step + 1} of {settings.total_steps}" + (" (warm-up)" if step < settings.warmup
                                                                         else ""))
        backend.synchronize()
        start = time.perf_counter()
        metrics = trainer.step(step)
        backend.synchronize()
        total = time.perf_counter() - start
        steps.append({"rollout_s": metrics["rollout_s"], "train_s": total - metrics["rollout_s"], "total_s": total,
                      "completion_min": min(lengths[-1]), "completion_max": max(lengths[-1]),
                      "completion_mean": metrics["completion_length"], "samples": len(lengths[-1]),
                      "reward_std": metrics["reward_std"], "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                      "logp_mismatches": metrics["logp_mismatches"],
                      "phases_s": {key.removeprefix("time/").removesuffix("_s"): value
                                   for key, value in metrics.items() if key.startswith("time/")}})
    result = summarize(steps, settings.warmup)
    result["engine"] = {"sampler": sampler, "cuda_graphs": trainer.engine.runner.cuda_graphs,
                        "micro_batch_tokens": grpo_config.micro_batch_tokens}
    result["config"] = asdict(grpo_config)
    if backend.name == "cuda":
        result["memory_pool_bytes"] = int(backend.cupy.get_default_memory_pool().total_bytes())
    del trainer, model
    gc.collect()
    if backend.name == "cuda":
        backend.cupy.get_default_memory_pool().free_all_blocks()
    return result


# ---------------------------------------------------------------- peer: TRL

def id_tokenizer(vocab_size: int):
    """An HF tokenizer whose text is the token ids: "t17 t4" <-> [17, 4] (WordLevel over whitespace),
    with eos = pad = "<eos>" at id vocab_size, which the model cannot sample."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    vocab["<eos>"] = vocab_size
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>",
                                                padding_side="left")


def prompt_text(ids) -> str:
    return " ".join(f"t{int(t)}" for t in ids)


def trl_args(settings: Settings, output_dir: str, device: str, micro_batch: int = TRL_MICRO_BATCH) -> dict:
    """TRL GRPOConfig keywords: our settings, one optimiser step (and one generation) per rollout."""
    micro_batch = min(micro_batch, settings.samples)
    if settings.samples % micro_batch:
        raise InputError(f"bench grpo: {settings.samples} samples do not split into micro-batches of {micro_batch}")
    return dict(
        output_dir=output_dir, max_steps=settings.total_steps, per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=settings.samples // micro_batch, num_generations=settings.num_generations,
        max_completion_length=settings.completion_len, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type=settings.loss_type, scale_rewards="group",
        mask_truncated_completions=False, learning_rate=settings.learning_rate, adam_beta1=0.9, adam_beta2=0.99,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=0,
        bf16=device == "cuda", use_cpu=device == "cpu", gradient_checkpointing=False, shuffle_dataset=False,
        use_vllm=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        dataloader_num_workers=0, seed=settings.seed)


def measure_trl(config, prompts: np.ndarray, settings: Settings, device: str = "cuda", progress=None,
                micro_batch: int = TRL_MICRO_BATCH) -> dict:
    """TRL's GRPOTrainer on HF Qwen3ForCausalLM (bf16 on cuda, float32 on cpu), the same prompts as text."""
    try:
        import torch
        import transformers
    except ImportError as error:
        raise RlpError(f"bench grpo needs torch and transformers for the peer (or --peer none): {error}") from None
    try:
        import datasets
        import trl
    except ImportError as error:
        raise RlpError(f"bench grpo needs trl and datasets for the peer (or --peer none): {error}") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise RlpError("bench grpo: torch cannot see a CUDA device for the peer (or use --peer none)")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    transformers.logging.set_verbosity_error()
    if progress:
        progress("TRL: building the model and the trainer")
    torch.manual_seed(settings.seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(config), attn_implementation="sdpa",
                                                       dtype=dtype).to(device)
    hf.generation_config.eos_token_id = None  # the tokenizer's eos (out of the vocabulary) is the only one
    dataset = datasets.Dataset.from_list([{"prompt": prompt_text(row)} for row in prompts])
    clock = _TRLClock(transformers.TrainerCallback, sync, settings, progress)
    with tempfile.TemporaryDirectory(prefix="rlp-bench-grpo-") as folder:
        args = trl.GRPOConfig(**trl_args(settings, folder, device, micro_batch))
        trainer = trl.GRPOTrainer(model=hf, reward_funcs=[hash_reward], args=args, train_dataset=dataset,
                                  processing_class=id_tokenizer(config.vocab_size), callbacks=[clock.callback])
        trainer.remove_callback(transformers.PrinterCallback)  # its per-step dicts would flood stdout
        clock.wrap_generation(trainer)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        trainer.train()
        sync()
    steps = clock.steps()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "step" in entry]
    for step, entry in zip(steps, logged):  # TRL's own metrics of the step, beside our clock's
        step.update({key: entry.get(name) for key, name in TRL_METRICS.items()})
    result = summarize(steps, settings.warmup)
    result["trl"] = {"version": trl.__version__, "per_device_train_batch_size": args.per_device_train_batch_size,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "generation_batch_size": args.generation_batch_size, "gradient_checkpointing": False,
                     "dtype": str(dtype).removeprefix("torch."), "attn_implementation": "sdpa",
                     "eos_token_id": trainer.eos_token_ids}
    result["torch"], result["transformers"] = torch.__version__, transformers.__version__
    result["datasets"] = datasets.__version__
    result["max_memory_reserved_bytes"] = int(torch.cuda.max_memory_reserved()) if device == "cuda" else None
    del trainer, hf
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


class _TRLClock:
    """Timestamps of TRL's optimiser steps (a TrainerCallback, after a device sync) and the time of
    every generation call (its _generate_single_turn, wrapped on the trainer instance)."""

    def __init__(self, callback_base, sync, settings: Settings, progress=None):
        self.sync, self.settings, self.progress = sync, settings, progress
        self.begin: float | None = None
        self.ends: list[float] = []
        self.rollouts: list[tuple[float, list[int]]] = []
        clock = self

        class Callback(callback_base):
            def on_step_begin(self, args, state, control, **kwargs):
                if clock.begin is None:
                    clock.sync()
                    clock.begin = time.perf_counter()
                if clock.progress:
                    step = state.global_step
                    clock.progress(f"TRL: step {step + 1} of {settings.total_steps}"
                                   + (" (warm-up)" if step < settings.warmup else ""))

            def on_step_end(self, args, state, control, **kwargs):
                clock.sync()
                clock.ends.append(time.perf_counter())

        self.callback = Callback()

    def wrap_generation(self, trainer) -> None:
        generate = trainer._generate_single_turn

        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            self.sync()
            self.rollouts.append((time.perf_counter() - start, [len(ids) for ids in out[0]]))
            return out

        trainer._generate_single_turn = timed

    def steps(self) -> list[dict]:
        if len(self.ends) != len(self.rollouts):
            raise RlpError(f"bench grpo: TRL made {len(self.rollouts)} generation calls in {len(self.ends)} "
                           "optimiser steps; expected one per step")
        out, previous = [], self.begin
        for end, (rollout, lengths) in zip(self.ends, self.rollouts):
            total = end - previous
            out.append({"rollout_s": rollout, "train_s": total - rollout, "total_s": total,
                        "completion_min": min(lengths), "completion_max": max(lengths),
                        "completion_mean": sum(lengths) / len(lengths), "samples": len(lengths)})
            previous = end
        return out


# ---------------------------------------------------------------- the benchmark

def compare(ours: dict | None, trl: dict | None) -> dict:
    """Ours / TRL of the median rollout, train and total step times (< 1: ours is faster)."""
    if ours is None or trl is None:
        return {}
    return {f"{key}_ratio": ours[f"{key}_s_median"] / trl[f"{key}_s_median"]
            for key in ("rollout", "train", "total")
            if ours.get(f"{key}_s_median") is not None and trl.get(f"{key}_s_median")}


def measure(backend, config, weights, settings: Settings, peer: str = "trl", sampler: str = "auto",
            progress=None) -> dict:
    """The whole benchmark on any backend (run() checks for cuda): ours, then TRL unless peer is "none"."""
    if peer not in ("trl", "none"):
        raise InputError(f"bench grpo: unknown peer {peer!r} (trl, none)")
    prompts = bench_prompts(config, settings)
    ours, ours_error = None, None
    try:
        ours = measure_ours(backend, config, weights, prompts, settings, sampler=sampler, progress=progress)
    except (RlpError, MemoryError) as error:  # a log-prob mismatch, out of memory: still time the peer
        ours_error = f"{type(error).__name__}: {error}"
        gc.collect()
        if backend.name == "cuda":
            backend.cupy.get_default_memory_pool().free_all_blocks()
    trl, peer_error = None, None
    if peer == "trl":
        try:
            trl = measure_trl(config, prompts, settings, device="cuda" if backend.name == "cuda" else "cpu",
                              progress=progress)
        except (RlpError, RuntimeError, ValueError, TypeError, AttributeError, KeyError) as error:
            peer_error = f"{type(error).__name__}: {error}"  # OOM, API changes: keep ours
        gc.collect()
        if backend.name == "cuda":
            with contextlib.suppress(ImportError):
                import torch

                torch.cuda.empty_cache()
    ratios = compare(ours, trl)
    if "total_ratio" in ratios:
        ratios["step_time_ratio"] = ratios["total_ratio"]
    return {
        "device": backend.info(), "model": "Qwen3 shape, random weights", "layers": config.num_hidden_layers,
        "config": {key: getattr(config, key) for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim")},
        "settings": asdict(settings), "peer": peer,
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "ignore_eos": True},
        "reward": "hash_reward: BLAKE2b of the completion's token ids, scaled to [0, 1)",
        "ours": ours, "trl": trl, "ours_error": ours_error, "peer_error": peer_error, "ratios": ratios,
        "targets": dict(TARGETS),
    }


def run(backend, layers: int | None = None, steps: int = 3, peer: str = "trl", progress=None,
        prompt_len: int = Settings.prompt_len, completion_len: int = Settings.completion_len) -> dict:
    """`rlportable bench grpo`: the Qwen3-0.6B-shaped model on cuda."""
    if backend.name != "cuda":
        raise RlpError(f"bench grpo runs on the cuda backend (peer: TRL on CUDA); got {backend.label}")
    if layers is not None and layers < 1:
        raise InputError(f"bench grpo: --layers must be at least 1, got {layers}")
    config = qwen3_06b_config(layers)
    settings = Settings(steps=steps, prompt_len=prompt_len, completion_len=completion_len)
    if progress:
        progress("random weights")
    return measure(backend, config, random_weights(config), settings, peer, progress=progress)
