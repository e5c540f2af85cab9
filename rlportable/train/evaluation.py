"""Evaluation while GRPO trains: held-out prompts through the rollout engine, scored by the run's rewards.

At each evaluation every held-out prompt is completed once greedily (temperature 0) and K times at
the training temperature (the run's other sampling settings), in one engine call, and the run's
reward functions score the completions. A completion passes when its reward is at least
`eval_pass_threshold` (1: the built-in tasks' and math_answer's reward of a right answer). The record
(`eval/...`, TRL's and verl's style of names):

    eval/reward_mean, eval/pass@1, eval/pass@K      the K samples a prompt at the training temperature
    eval/greedy/reward_mean, eval/greedy/pass@1     the greedy completion

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on
Code"): for a prompt with c passing samples of n, 1 - C(n - c, k) / C(n, k), averaged over the
prompts; pass@1 is the mean fraction of passing samples, pass@n the fraction of prompts with any.

Evaluation changes nothing of the training run. The sampler is counter-based (Philox over (request,
sample, position) under a key, rlportable/contract/sampling.py), so generating more cannot shift a
training draw; and evaluation's requests take ids from EVAL_REQUEST_BASE = 2^31 up, where a training
rollout's ids are its prompts' indices within the step (below prompts_per_step < 2^31), so no
evaluation draw is ever a training draw, whatever the key. Its key is the same at every evaluation
(common random numbers: two evaluations differ by the weights alone). It reads the weights and writes
nothing but its own record, and it uses the rollout's engine and KV cache, between steps.
"""

from __future__ import annotations

import math
import time

import numpy as np

from rlportable.train.rewards import RewardSet, batch_from_records

#: the first request id of evaluation's requests; training rollouts use the ids below it
EVAL_REQUEST_BASE = 1 << 31


def eval_due(done: int, steps: int, every: int | None) -> bool:
    """Whether to evaluate after `done` steps (0: before the first) of `steps`: before the first step,
    every `every` steps and after the last; never when every is 0 or None."""
    if not every:
        return False
    return done % every == 0 or done == steps


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c passing samples of n (k <= n): 1 - C(n-c, k) / C(n, k),
    as the product 1 - prod_{i=n-c+1}^{n} (1 - k / i), which overflows nowhere."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def eval_metrics(sampled: np.ndarray, greedy: np.ndarray, threshold: float) -> dict[str, float]:
    """The eval/... numbers of rewards `sampled` [prompts, K] and `greedy` [prompts]."""
    sampled, greedy = np.asarray(sampled, dtype=np.float64), np.asarray(greedy, dtype=np.float64)
    prompts, k = sampled.shape
    passing = (sampled >= threshold).sum(axis=1)
    out = {"eval/reward_mean": float(sampled.mean()), "eval/reward_std": float(sampled.std()),
           "eval/pass@1": float(np.mean([pass_at_k(k, int(c), 1) for c in passing]))}
    out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(k, int(c), k) for c in passing]))
    out["eval/greedy/reward_mean"] = float(greedy.mean())
    out["eval/greedy/pass@1"] = float(np.mean(greedy >= threshold))
    return out


def evaluate(trainer, records: list[dict], done: int) -> dict:
    """The evaluation record after `done` training steps: every held-out record completed greedily and
    K times at the training temperature by the trainer's engine (its data-parallel replicas share the
    requests as a rollout's), scored by the trainer's rewards."""
    from rlportable.train.grpo import sampling_seed, truncated_prompt

    cfg, engine = trainer.config, trainer.engine
    started = time.perf_counter()
    sampled_params = cfg.sampling_params(n=cfg.eval_samples)
    greedy_params = cfg.sampling_params(n=1, temperature=0.0)
    count = len(records)
    # request i < count: record i sampled K times; request count + i: record i greedily
    mine = trainer.replicas.share(2 * count)
    prompts = [truncated_prompt(trainer.tokenizer, records[i % count]["prompt"], cfg.max_prompt_length) for i in mine]
    params = [sampled_params if i < count else greedy_params for i in mine]
    outputs = engine.generate(prompts, params, request_ids=[EVAL_REQUEST_BASE + i for i in mine],
                              seed=sampling_seed(cfg.seed, 0)) if mine else []
    requests = trainer.replicas.gather_in_order([[(list(c.token_ids), c.text) for c in request.outputs]
                                                 for request in outputs])
    sampled = _scores(trainer.rewards, records, requests[:count])
    greedy = _scores(trainer.rewards, records, requests[count:])
    return {"step": done, "eval/prompts": count, "eval/samples": cfg.eval_samples,
            **eval_metrics(sampled.reshape(count, cfg.eval_samples), greedy, cfg.eval_pass_threshold),
            "eval/completion_length": _mean_length(requests[:count]),
            "eval/greedy/completion_length": _mean_length(requests[count:]),
            "eval/time_s": time.perf_counter() - started}


def _scores(rewards: RewardSet, records: list[dict], requests: list[list[tuple[list[int], str]]]) -> np.ndarray:
    """The run's total reward of every completion, request by request."""
    grouped = [record for record, request in zip(records, requests) for _ in request]
    completions = [completion for request in requests for completion in request]
    total, _ = rewards.score(batch_from_records(grouped, [text for _, text in completions],
                                                [ids for ids, _ in completions]))
    return np.asarray(total, dtype=np.float64)


def _mean_length(requests: list[list[tuple[list[int], str]]]) -> float:
    lengths = [len(ids) for request in requests for ids, _ in request]
    return sum(lengths) / len(lengths) if lengths else 0.0


def is_eval(record: dict) -> bool:
    """Whether a metrics record is an evaluation's (its keys under eval/), not a training step's."""
    return any(key.startswith("eval/") for key in record)


def format_eval_line(record: dict) -> str:
    """'eval after step 10 (200 prompts) | greedy pass@1 0.8 | pass@1 0.5 | pass@8 0.9 | ...'."""
    k = record["eval/samples"]
    parts = [f"eval after step {record['step']} ({record['eval/prompts']} prompts)"]
    for key, label in (("eval/greedy/pass@1", "greedy pass@1"), ("eval/greedy/reward_mean", "greedy reward_mean"),
                       ("eval/pass@1", "pass@1"), (f"eval/pass@{k}", f"pass@{k}"),
                       ("eval/reward_mean", "reward_mean"), ("eval/time_s", "eval_s")):
        if key in record and not (key == f"eval/pass@{k}" and k == 1):
            parts.append(f"{label} {record[key]:.4g}")
    return " | ".join(parts)


def summary_line(evals: list[dict]) -> str | None:
    """The first and the last evaluation of a run, in one line (None without any)."""
    if not evals:
        return None
    first, last = evals[0], evals[-1]
    k = last["eval/samples"]
    keys = [("eval/greedy/pass@1", "greedy pass@1"), ("eval/pass@1", "pass@1")]
    if k > 1:
        keys.append((f"eval/pass@{k}", f"pass@{k}"))
    keys.append(("eval/reward_mean", "reward_mean"))
    if first is last:
        values = ", ".join(f"{label} {last[key]:.4g}" for key, label in keys if key in last)
        return f"eval ({last['eval/prompts']} held-out prompts) after step {last['step']}: {values}"
    values = ", ".join(f"{label} {first[key]:.4g} -> {last[key]:.4g}" for key, label in keys
                       if key in first and key in last and math.isfinite(first[key]))
    return (f"eval ({last['eval/prompts']} held-out prompts, {len(evals)} evaluations), step {first['step']} -> "
            f"step {last['step']}: {values}")
