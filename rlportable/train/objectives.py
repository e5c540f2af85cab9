"""The training objectives as functions of per-token log-probs: SFT and GRPO (TRL's semantics).

Everything here runs on the host in float64 over small per-token vectors (one
value per completion token), so it is the same on every backend; the result
handed to the model's backward is the float32 gradient of the loss with
respect to each token's log-prob.

GRPO, per completion token t of sample i (TRL's GRPOTrainer):
  ratio      = exp(logp - old_logp)
  surrogate  = min(ratio * A_i, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A_i)
  k3         = exp(ref_logp - logp) - (ref_logp - logp) - 1         (beta > 0 only)
  token loss = -surrogate + beta * k3
aggregated by `loss_type` over one optimiser step's mini-batch (which the trainer may
process in several micro-batches; TRL's per-device batch is our micro-batch):
  grpo     mean over each sample's tokens, then mean over the mini-batch's samples
  bnpo     sum over the micro-batch's tokens / its token count (TRL: per device batch)
  dr_grpo  sum over the tokens / (mini-batch samples * max_completion_length)
  dapo     sum over the tokens / the mini-batch's token count (TRL: the global batch)
Gradients: d surrogate / d logp = ratio * A where the unclipped term is the
minimum (ties and ratios inside the clip range included: clip passes its
gradient there), else 0; d k3 / d logp = 1 - exp(ref_logp - logp).

GSPO (importance_sampling_level "sequence", TRL's option of that name): every token of
sample i takes the sequence-level ratio exp(mean over its tokens of logp - old_logp) in
place of its own, clipped and aggregated as above; a token's gradient is then its
sample's summed surrogate gradient divided by the sample's token count (the mean's
derivative), plus its own k3 term.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlportable.errors import InputError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL adds 1e-4 to the std before dividing


def group_advantages(rewards: np.ndarray, group_size: int, scale_rewards: str = "group") -> np.ndarray:
    """A_i = r_i - mean of its group, divided by the (unbiased) std of the group, of the batch, or not."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if scale_rewards not in SCALE_REWARDS:
        raise InputError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, got {scale_rewards!r}")
    if group_size < 1 or rewards.size % group_size:
        raise InputError(f"{rewards.size} rewards do not split into groups of {group_size}")
    grouped = rewards.reshape(-1, group_size)
    centred = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = np.repeat(_std(grouped, axis=1), group_size)
    else:
        std = np.full(rewards.size, _std(rewards, axis=None))
    return centred / (std + STD_EPS)


def _std(values: np.ndarray, axis):
    """torch.std's default: the unbiased estimate; 0 for a single value (torch gives NaN: nothing to scale)."""
    count = values.shape[axis] if axis is not None else values.size
    if count < 2:
        return np.zeros(values.shape[0]) if axis is not None else 0.0
    return values.std(axis=axis, ddof=1)


@dataclass(frozen=True)
class GRPOSettings:
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon (symmetric clip)
    beta: float = 0.0
    loss_type: str = "dapo"
    max_completion_length: int = 256
    importance_sampling_level: str = "token"  # "sequence": GSPO's sequence-level ratio

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise InputError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise InputError(f"importance_sampling_level must be one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}, "
                             f"got {self.importance_sampling_level!r}")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise InputError(f"clip range needs 0 <= epsilon < 1 and epsilon_high >= 0, got "
                             f"{self.epsilon}, {self.epsilon_high}")
        if self.beta < 0:
            raise InputError(f"beta must be >= 0, got {self.beta}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class TokenLoss:
    """A mini-batch's loss, its gradient per token log-prob (float32), and its metrics."""

    loss: float
    grad: np.ndarray
    metrics: dict


def grpo_token_loss(logp: list[np.ndarray], old_logp: list[np.ndarray], advantages: np.ndarray,
                    settings: GRPOSettings, ref_logp: list[np.ndarray] | None = None,
                    mini_batch: tuple[int, int] | None = None, active: np.ndarray | None = None) -> TokenLoss:
    """GRPO over the samples of one micro-batch (one array of completion-token log-probs each);
    mini_batch = (samples, completion tokens) of the optimiser step's mini-batch (default: this one;
    tokens of active samples only). active: per sample, False where its tokens leave the loss (DAPO's
    mask_truncated_completions, as TRL's completion mask: no loss, not counted among the tokens)."""
    if len(logp) != len(old_logp) or len(logp) != len(advantages):
        raise InputError("grpo loss: logp, old_logp and advantages must have one entry per sample")
    lengths = np.array([x.size for x in logp])
    active = np.ones(lengths.size, dtype=bool) if active is None else np.asarray(active, dtype=bool)
    new, old = _flat(logp), _flat(old_logp)
    adv = np.repeat(np.asarray(advantages, dtype=np.float64), lengths)
    log_ratio = new - old
    sequence = settings.importance_sampling_level == "sequence"
    owner = np.repeat(np.arange(lengths.size), lengths)  # each token's sample
    if sequence:  # GSPO: each sample's mean log-ratio (TRL clamps the token count at 1)
        log_ratio = (np.bincount(owner, weights=log_ratio, minlength=lengths.size) / np.maximum(lengths, 1))[owner]
    ratio = np.exp(log_ratio)
    low, high = 1.0 - settings.epsilon, 1.0 + settings.high
    clipped = np.clip(ratio, low, high)
    unclipped_wins = ratio * adv <= clipped * adv
    surrogate = np.minimum(ratio * adv, clipped * adv)
    d_surrogate = np.where(unclipped_wins | ((ratio >= low) & (ratio <= high)), ratio * adv, 0.0)
    token_loss, d_token = -surrogate, -d_surrogate
    kl, d_kl = np.zeros_like(new), np.zeros_like(new)
    if settings.beta > 0:
        if ref_logp is None:
            raise InputError("grpo loss: beta > 0 needs the reference model's log-probs")
        delta = _flat(ref_logp) - new
        kl = np.exp(delta) - delta - 1.0
        token_loss = token_loss + settings.beta * kl
        d_kl = settings.beta * (1.0 - np.exp(delta))
    weights = _token_weights(lengths, active, settings, mini_batch or (lengths.size, int(lengths[active].sum())))
    if sequence:  # through the mean: the sample's summed surrogate gradient, over its token count, to each token
        grad = (np.bincount(owner, weights=weights * d_token, minlength=lengths.size)
                / np.maximum(lengths, 1))[owner] + weights * d_kl
    else:
        grad = weights * (d_token + d_kl if settings.beta > 0 else d_token)
    region = ((ratio < low) & (adv < 0)) | ((ratio > high) & (adv > 0))
    kept = np.repeat(active, lengths)
    metrics = {
        "kl": float(kl[kept].mean()) if kept.any() else 0.0,
        "clip_fraction": float(region[kept].mean()) if kept.any() else 0.0,
        "ratio_min": float(ratio.min()) if ratio.size else 1.0,
        "ratio_max": float(ratio.max()) if ratio.size else 1.0,
    }
    return TokenLoss(float((weights * token_loss).sum()), grad.astype(np.float32), metrics)


def _token_weights(lengths: np.ndarray, active: np.ndarray, settings: GRPOSettings,
                   mini_batch: tuple[int, int]) -> np.ndarray:
    """Each token's weight in the aggregated loss (loss = sum_t weight_t * token_loss_t); an inactive
    sample's tokens weigh 0 and are not counted (TRL's completion mask)."""
    samples, tokens = mini_batch
    if settings.loss_type == "grpo":
        per_sample = np.divide(1.0, lengths, out=np.zeros(lengths.size), where=lengths > 0) / max(samples, 1)
        return np.repeat(per_sample * active, lengths)
    denominator = {"bnpo": int(lengths[active].sum()), "dr_grpo": samples * settings.max_completion_length,
                   "dapo": tokens}[settings.loss_type]
    return np.repeat(active / max(denominator, 1), lengths).astype(np.float64)


def sft_token_loss(logp: list[np.ndarray], batch_tokens: int | None = None) -> TokenLoss:
    """Negative log-likelihood of the completion tokens, divided by the optimiser step's token count."""
    flat = _flat(logp)
    weight = 1.0 / max(batch_tokens if batch_tokens is not None else flat.size, 1)
    return TokenLoss(float(-flat.sum() * weight), np.full(flat.size, -weight, dtype=np.float32),
                     {"tokens": int(flat.size)})


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=np.float64) for a in arrays]) if arrays else np.zeros(0)


def routing_mismatch(recomputed: list[np.ndarray], recorded: list[np.ndarray]) -> dict:
    """The trainer's expert choices against the engine's (Qwen3-MoE), per completion token: how many
    tokens differ in any sparse layer's choice (the exact router logits make it 0), of how many."""
    if len(recomputed) != len(recorded):
        raise InputError(f"routing mismatch check: {len(recomputed)} recomputed against {len(recorded)} recorded "
                         "samples")
    mismatches = compared = 0
    for new, old in zip(recomputed, recorded):
        new, old = np.asarray(new), np.asarray(old)
        if new.shape != old.shape:
            raise InputError(f"routing mismatch check: recomputed {new.shape} against recorded {old.shape}")
        mismatches += int((new != old).reshape(new.shape[0], -1).any(axis=1).sum())
        compared += new.shape[0]
    return {"mismatches": mismatches, "compared": compared}


def logp_mismatch(recomputed: list[np.ndarray], recorded: list[np.ndarray]) -> dict:
    """Bitwise comparison of the trainer's log-probs with the engine's: count, max |dlogp|."""
    new = np.concatenate([np.asarray(a, np.float32) for a in recomputed]) if recomputed else np.zeros(0, np.float32)
    old = np.concatenate([np.asarray(a, np.float32) for a in recorded]) if recorded else np.zeros(0, np.float32)
    if new.shape != old.shape:
        raise InputError(f"log-prob mismatch check: {new.size} recomputed against {old.size} recorded tokens")
    differ = new.view(np.uint32) != old.view(np.uint32)
    with np.errstate(invalid="ignore"):
        gap = np.abs(new.astype(np.float64) - old.astype(np.float64))
    return {"mismatches": int(differ.sum()), "compared": int(new.size),
            "max_abs_dlogp": float(np.nanmax(gap)) if gap.size else 0.0}
