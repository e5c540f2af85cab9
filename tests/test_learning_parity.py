"""Our first GRPO step against TRL's on the same batch: same weights (tiny-sft), same completions, same
rewards; the loss and every weight's gradient compared.

Two forms of TRL's side:
- `trl_formula`: TRL 1.16's GRPO loss written out below in torch (its advantages, its token log-probs
  from the HF model, its clipped surrogate and its "dapo" aggregation), on transformers' Qwen3 in
  float32. It needs only torch and transformers (the test extra), so it runs in CI.
- `trl_own`: TRL's own code (GRPOTrainer._generate_and_score_completions and compute_loss, our
  completions handed over through its rollout_func); skipped where TRL is not installed
  (`pip install 'rlportable[trl]'`), and it checks that the formula above is still TRL's.
TRL (with datasets, pandas and pyarrow) stays out of the test extra, as pyarrow does for Parquet:
about 70 MB of wheels for one test whose arithmetic the formula form already checks.

test_objectives.py checks our objective's formulas and gradients per log-prob; this checks the whole
first step, through the model's backward, against a different implementation.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conftest import clean_exit
from rlportable.model.forward import Model  # noqa: E402
from rlportable.model.load import TINY_SFT_DIR, load_model  # noqa: E402
from rlportable.runtime import get_backend  # noqa: E402
from rlportable.train import objectives  # noqa: E402
from rlportable.train.grpo import GRPOConfig, GRPOTrainer, records_for_step  # noqa: E402
from rlportable.train.metrics import PhaseClock  # noqa: E402
from rlportable.train.rewards import RewardSet, batch_from_records  # noqa: E402
from rlportable.train.tasks import parse_task_spec  # noqa: E402
from rlportable.train.trainer import pack  # noqa: E402

TASK = "arithmetic:digits=1,ops=+"
PROMPTS, G, LENGTH = 8, 4, 8
# Tolerances. TRL's loss is a float32 sum of float32 advantages over ~150 tokens (each rounding 2^-24
# relative), ours a float64 one of float64 advantages: they agree to a few float32 ulps of the terms.
LOSS_ATOL = 1e-6
# Gradients: TRL's are float32 backprop through transformers' Qwen3 (relative rounding ~1e-7 a product,
# far below what follows); ours go through the contracts' exact products of encoded operands, the
# weights at 15 significant bits and the backward's activations at 23, and the attention backward's
# coefficients at 15 bits below the largest of their block of 64 (docs/training.md, "Gradients under the
# contracts"). A 2^-15 ~ 3e-5 relative step grows where a gradient is a small difference of large terms:
# q and k (and their norms) get theirs from dS = P * (dP - rowsum(P * dP)), which cancels. Measured on
# this batch: the loss 1e-8 apart; per tensor at most 3.4e-4 (layer 0's q_proj), most below 2e-4; the
# global norm 4.7e-6. The bounds keep a factor of about 3 over the worst tensor and 20 over the norm.
GRAD_RTOL = 1e-3
NORM_RTOL = 1e-4
# The formula against TRL's own code: both float32 torch on the same model and inputs; only the order of
# a few reductions may differ.
SAME_CODE_RTOL = 1e-5


@pytest.fixture(scope="module")
def ours():
    """Our first step: the engine's rollout of PROMPTS x G completions, the task's rewards and
    advantages, and the trainer's loss and gradients of that micro-batch (before any update)."""
    config, weights, tokenizer = load_model("tiny-sft")
    task = parse_task_spec(TASK)
    dataset = task.dataset(0, 1000)
    cfg = GRPOConfig(steps=1, prompts_per_step=PROMPTS, num_generations=G, max_completion_length=LENGTH,
                     learning_rate=4e-4, loss_type="dapo", scale_rewards="group", seed=0)
    trainer = GRPOTrainer(Model(get_backend("cpu"), config, weights, trainable=True), tokenizer, dataset,
                          RewardSet([(task, 1.0)]), cfg)
    records = records_for_step(dataset, 0, 0, PROMPTS)
    samples, texts = trainer._rollout(records, 0)
    grouped = [r for r in records for _ in range(G)]
    rewards, _ = trainer.rewards.score(batch_from_records(grouped, texts, [s.completion_ids for s in samples]))
    advantages = objectives.group_advantages(rewards, G, "group")
    assert np.any(advantages != 0)  # some group has different rewards: the step has a gradient
    for sample, advantage in zip(samples, advantages):
        sample.advantage = float(advantage)
    batches = pack(samples, cfg.micro_batch_tokens)
    assert len(batches) == 1
    counts = (len(samples), sum(len(s.completion_ids) for s in samples))
    metrics, grads = trainer._micro_batch(batches[0], cfg.settings(), counts, True, PhaseClock())
    assert metrics["check"]["mismatches"] == 0
    return {"records": records, "samples": samples, "rewards": rewards, "loss": metrics["loss"],
            "grads": {name: np.asarray(g, dtype=np.float64) for name, g in grads.items()}}


def _hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_SFT_DIR, dtype=torch.float32)
    model.train()  # as TRL trains it (the tiny model has no dropout: the same numbers as eval)
    return model


def _padded(samples):
    """TRL's batch layout: prompts left-padded, completions right-padded, with their masks."""
    prompt_len = max(len(s.prompt_ids) for s in samples)
    completion_len = max(len(s.completion_ids) for s in samples)
    prompt_ids = torch.zeros((len(samples), prompt_len), dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    completion_ids = torch.zeros((len(samples), completion_len), dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, s in enumerate(samples):
        prompt_ids[i, prompt_len - len(s.prompt_ids):] = torch.tensor(s.prompt_ids)
        prompt_mask[i, prompt_len - len(s.prompt_ids):] = 1
        completion_ids[i, :len(s.completion_ids)] = torch.tensor(s.completion_ids)
        completion_mask[i, :len(s.completion_ids)] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def trl_formula(ours):
    """TRL 1.16 GRPOTrainer's first step written out (num_iterations 1, beta 0, temperature 1, loss
    "dapo", scale_rewards "group", one process, no gradient accumulation): (loss, {name: gradient})."""
    model = _hf_model()
    prompt_ids, prompt_mask, completion_ids, completion_mask = _padded(ours["samples"])
    # advantages in float32: (r - group mean) / (group std, unbiased, + 1e-4)
    rewards = torch.tensor(ours["rewards"], dtype=torch.float32)
    grouped = rewards.view(-1, G)
    mean = grouped.mean(dim=1).repeat_interleave(G)
    std = grouped.std(dim=1).repeat_interleave(G)
    advantages = ((rewards - mean) / (std + 1e-4)).unsqueeze(1)
    # the completion tokens' log-probs: logits of the positions before them, / temperature (1)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    keep = completion_ids.size(1)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep + 1).logits[:, :-1, :]
    logps = torch.gather(logits, -1, completion_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    # the clipped surrogate at old = the same log-probs detached (num_iterations 1)
    ratio = torch.exp(logps - logps.detach())
    clipped = torch.clamp(ratio, 1 - 0.2, 1 + 0.2)
    token_loss = -torch.min(ratio * advantages, clipped * advantages)
    mask = completion_mask.float()
    loss = (token_loss * mask).sum() / mask.sum().clamp(min=1.0)  # dapo: over the batch's tokens
    loss.backward()
    return float(loss.detach()), {name: p.grad.double().numpy() for name, p in model.named_parameters()}


def trl_own(ours):
    """TRL's own GRPOTrainer code on our completions: (loss, {name: gradient})."""
    pytest.importorskip("trl", exc_type=ImportError)  # missing, or failing to import against these versions
    import tempfile
    from collections import defaultdict, deque

    from rlportable.bench import learning

    queues = defaultdict(deque)
    for s in ours["samples"]:
        queues[tuple(s.prompt_ids)].append(list(s.completion_ids))

    def rollout_func(prompts, trainer):
        ids = [list(trainer.processing_class(text=p, add_special_tokens=False)["input_ids"]) for p in prompts]
        return {"prompt_ids": ids, "completion_ids": [queues[tuple(p)].popleft() for p in ids], "logprobs": None}

    settings = learning.Settings(tasks=(TASK,), prompts_per_step=PROMPTS, num_generations=G,
                                 max_completion_length=LENGTH)
    with tempfile.TemporaryDirectory() as folder:
        trainer = learning._trl_trainer(TINY_SFT_DIR, TASK, ours["records"], settings, 0, "cpu", folder, 1,
                                        rollout_func=rollout_func)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by its training loop, read by the dapo loss
        inputs = trainer._generate_and_score_completions([r for r in ours["records"] for _ in range(G)])
        assert not any(queues.values())  # every completion of ours went in
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        return float(loss.detach()), {name: p.grad.double().numpy() for name, p in trainer.model.named_parameters()}


def _check_against(ours, loss, grads):
    assert abs(ours["loss"] - loss) <= LOSS_ATOL, (ours["loss"], loss)
    assert set(grads) == set(ours["grads"])  # the tied LM head is the embedding on both sides
    for name, theirs in grads.items():
        mine = ours["grads"][name].reshape(theirs.shape)
        scale = np.linalg.norm(theirs)
        assert scale > 0, name
        assert np.linalg.norm(mine - theirs) <= GRAD_RTOL * scale, (name, np.linalg.norm(mine - theirs) / scale)
    total = np.sqrt(sum(np.sum(g ** 2) for g in grads.values()))
    mine_total = np.sqrt(sum(np.sum(g ** 2) for g in ours["grads"].values()))
    assert abs(mine_total - total) <= NORM_RTOL * total


def test_first_step_matches_trl_formula(ours):
    _check_against(ours, *trl_formula(ours))


def test_first_step_matches_trl_own_code(ours):
    loss, grads = trl_own(ours)
    _check_against(ours, loss, grads)
    formula_loss, formula_grads = trl_formula(ours)  # the written-out formula is still TRL's
    assert abs(formula_loss - loss) <= SAME_CODE_RTOL * max(abs(loss), 1e-3)
    for name, g in grads.items():
        assert np.linalg.norm(formula_grads[name] - g) <= SAME_CODE_RTOL * np.linalg.norm(g), name


@pytest.mark.parametrize("args, flag", [
    (["--steps", "0"], "--steps"),
    (["--seeds", "1"], "--seeds"),
    (["--steps", "10", "--window", "20"], "--window"),
    (["--steps", "5"], "--steps"),  # no steps left after the 5 warm-up steps
    (["--prompts-per-step", "-1"], "--prompts-per-step"),
    (["--task", "arithmetic:digits=0"], "--task"),
    (["--task", "nope"], "--task"),
])
def test_bench_learning_inputs_are_one_line_naming_the_flag(args, flag):
    from click.testing import CliRunner

    from rlportable.cli import main

    result = CliRunner().invoke(main, ["bench", "learning", "--device", "cpu", *args])
    assert result.exit_code != 0 and clean_exit(result)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and flag in errors[0], result.output


def test_bench_learning_without_trl_names_the_extra(monkeypatch):
    import sys

    from click.testing import CliRunner

    from rlportable.cli import main

    monkeypatch.setitem(sys.modules, "trl", None)  # import trl raises ImportError
    result = CliRunner().invoke(main, ["bench", "learning", "--device", "cpu"])
    assert result.exit_code != 0 and "rlportable[trl]" in result.output and clean_exit(result)
