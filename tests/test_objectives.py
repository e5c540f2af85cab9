"""SFT and GRPO objectives (train/objectives.py): TRL's formulas and their per-token gradients."""

import numpy as np
import pytest

from rlportable.errors import InputError
from rlportable.train import objectives


def test_group_advantages_follow_trl():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = objectives.group_advantages(rewards, 4, "group")
    first = (rewards[:4] - 0.5) / (np.std(rewards[:4], ddof=1) + 1e-4)
    assert np.allclose(a[:4], first, rtol=0, atol=1e-15)
    assert np.array_equal(a[4:], np.zeros(4))  # equal rewards: no signal
    batch = objectives.group_advantages(rewards, 4, "batch")
    assert np.allclose(batch[:4], (rewards[:4] - 0.5) / (np.std(rewards, ddof=1) + 1e-4), rtol=0, atol=1e-15)
    assert np.array_equal(objectives.group_advantages(rewards, 4, "none")[:4], rewards[:4] - 0.5)
    with pytest.raises(InputError, match="groups of 3"):
        objectives.group_advantages(rewards, 3)
    with pytest.raises(InputError, match="scale_rewards"):
        objectives.group_advantages(rewards, 4, "sample")


def _samples(rng, lengths):
    logp = [rng.normal(-2, 0.5, n) for n in lengths]
    old = [x + rng.normal(0, 0.3, x.size) for x in logp]  # ratios on both sides of the clip range
    ref = [x + rng.normal(0, 0.2, x.size) for x in logp]
    return logp, old, ref


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_gradient_matches_finite_differences(loss_type, beta):
    rng = np.random.default_rng(0)
    lengths = [3, 5, 1, 4]
    logp, old, ref = _samples(rng, lengths)
    adv = rng.normal(size=len(lengths))
    settings = objectives.GRPOSettings(epsilon=0.2, epsilon_high=0.28, beta=beta, loss_type=loss_type,
                                       max_completion_length=6)
    counts = (8, 30)  # this micro-batch is part of a larger mini-batch
    result = objectives.grpo_token_loss(logp, old, adv, settings, ref, counts)
    flat = np.concatenate(logp)
    splits = np.cumsum(lengths)[:-1]
    h = 1e-6
    for t in range(flat.size):
        up, down = flat.copy(), flat.copy()
        up[t] += h
        down[t] -= h
        f_up = objectives.grpo_token_loss(np.split(up, splits), old, adv, settings, ref, counts).loss
        f_down = objectives.grpo_token_loss(np.split(down, splits), old, adv, settings, ref, counts).loss
        # central differences of a smooth piece (no token sits on a clip boundary here): O(h^2) + rounding
        assert abs((f_up - f_down) / (2 * h) - result.grad[t]) < 1e-6 * max(1.0, abs(result.grad[t])), t


def test_grpo_at_ratio_one_is_the_policy_gradient():
    logp = [np.array([-1.0, -2.0]), np.array([-0.5])]
    adv = np.array([1.0, -2.0])
    result = objectives.grpo_token_loss(logp, logp, adv, objectives.GRPOSettings(loss_type="grpo"))
    assert result.metrics["ratio_min"] == result.metrics["ratio_max"] == 1.0
    assert result.metrics["clip_fraction"] == 0.0
    # grpo: each sample's tokens averaged, then the samples: -A_i / (len_i * samples)
    assert np.array_equal(result.grad, np.array([-0.25, -0.25, 1.0], dtype=np.float32))


def test_loss_type_normalisers():
    logp = [np.zeros(2), np.zeros(4)]
    adv = np.array([1.0, 1.0])
    grads = {t: objectives.grpo_token_loss(logp, logp, adv, objectives.GRPOSettings(
        loss_type=t, max_completion_length=10), mini_batch=(4, 12)).grad for t in objectives.LOSS_TYPES}
    assert np.allclose(grads["bnpo"], -1 / 6)           # this micro-batch's 6 tokens
    assert np.allclose(grads["dapo"], -1 / 12)          # the mini-batch's 12 tokens
    assert np.allclose(grads["dr_grpo"], -1 / 40)       # 4 samples x max_completion_length 10
    assert np.allclose(grads["grpo"], [-1 / 8] * 2 + [-1 / 16] * 4)


def test_sft_loss_and_mismatch_check():
    loss = objectives.sft_token_loss([np.array([-1.0, -3.0])], batch_tokens=4)
    assert loss.loss == 1.0 and np.array_equal(loss.grad, np.full(2, -0.25, np.float32))
    a = [np.array([-1.0, -2.0], np.float32)]
    b = [np.array([-1.0, np.nextafter(np.float32(-2.0), np.float32(0))], np.float32)]
    assert objectives.logp_mismatch(a, a)["mismatches"] == 0
    check = objectives.logp_mismatch(a, b)
    assert check["mismatches"] == 1 and 0 < check["max_abs_dlogp"] < 1e-6
    zero = [np.array([0.0], np.float32)]
    assert objectives.logp_mismatch(zero, [np.array([-0.0], np.float32)])["mismatches"] == 1  # bits, not values


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
def test_masked_samples_leave_the_loss_as_trl_masks_them(loss_type):
    """mask_truncated_completions: an inactive sample's tokens get no loss and no gradient and are not
    counted (bnpo: this micro-batch's active tokens; dapo: the mini-batch's, which the caller counts);
    grpo still averages over every sample, dr_grpo over samples x max length, as TRL's completion mask."""
    rng = np.random.default_rng(3)
    lengths = [3, 5, 2]
    logp, old, _ = _samples(rng, lengths)
    adv = rng.normal(size=3)
    settings = objectives.GRPOSettings(loss_type=loss_type, max_completion_length=6)
    active = np.array([True, False, True])
    masked = objectives.grpo_token_loss(logp, old, adv, settings, mini_batch=(3, 5), active=active)
    assert not masked.grad[3:8].any()  # the inactive sample's tokens
    kept = [0, 2]
    alone = objectives.grpo_token_loss([logp[i] for i in kept], [old[i] for i in kept], adv[kept], settings,
                                       mini_batch=(3, 5))
    assert np.array_equal(masked.grad[np.r_[0:3, 8:10]], alone.grad)
    assert masked.loss == pytest.approx(alone.loss, rel=1e-15, abs=1e-15)
    every = objectives.grpo_token_loss(logp, old, adv, settings, mini_batch=(3, 10))
    assert np.array_equal(every.grad, objectives.grpo_token_loss(logp, old, adv, settings, mini_batch=(3, 10),
                                                                 active=np.ones(3, bool)).grad)


# ---- GSPO: TRL's GRPOTrainer._compute_loss with importance_sampling_level="sequence", re-implemented in
# torch on padded [samples, longest] tensors with a completion mask (TRL's layout), against ours.


def _trl_loss(logp, old, ref, adv, settings, level, num_items_in_batch):
    """(loss, d loss / d per-token log-prob as our flat list) by TRL's formulas and torch autograd."""
    import torch

    lengths = [x.size for x in logp]
    longest = max(lengths)

    def padded(arrays):
        out = torch.zeros(len(arrays), longest, dtype=torch.float64)
        for i, a in enumerate(arrays):
            out[i, :a.size] = torch.tensor(a)
        return out

    per_token_logps = padded(logp).requires_grad_(True)
    old_per_token_logps, ref_per_token_logps = padded(old), padded(ref)
    completion_mask = padded([np.ones(n) for n in lengths])
    advantages = torch.tensor(adv, dtype=torch.float64)
    log_ratio = per_token_logps - old_per_token_logps
    if level == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    coef_2 = torch.clamp(coef_1, 1 - settings.epsilon, 1 + settings.high)
    per_token_loss1 = coef_1 * advantages.unsqueeze(1)
    per_token_loss2 = coef_2 * advantages.unsqueeze(1)
    per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
    if settings.beta != 0.0:
        per_token_kl = (torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps)
                        - 1)
        per_token_loss = per_token_loss + settings.beta * per_token_kl
    if settings.loss_type == "grpo":
        loss = ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    elif settings.loss_type == "bnpo":
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    elif settings.loss_type == "dr_grpo":
        loss = (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * settings.max_completion_length)
    else:  # dapo
        loss = (per_token_loss * completion_mask).sum() / num_items_in_batch
    loss.backward()
    grad = per_token_logps.grad.numpy()
    return float(loss.detach()), np.concatenate([grad[i, :n] for i, n in enumerate(lengths)])


@pytest.mark.parametrize("loss_type", objectives.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", ["sequence", "token"])
def test_gspo_and_grpo_follow_trls_compute_loss(loss_type, beta, level):
    pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    lengths = [3, 5, 1, 4, 6, 2]
    logp, old, ref = _samples(rng, lengths)
    old = [x + rng.normal(0, 0.4, x.size) for x in old]  # sequence ratios on both sides of the clip range
    adv = rng.normal(size=len(lengths))
    settings = objectives.GRPOSettings(epsilon=0.2, epsilon_high=0.28, beta=beta, loss_type=loss_type,
                                       max_completion_length=6, importance_sampling_level=level)
    ours = objectives.grpo_token_loss(logp, old, adv, settings, ref if beta else None)
    want_loss, want_grad = _trl_loss(logp, old, ref, adv, settings, level, sum(lengths))
    assert ours.loss == pytest.approx(want_loss, rel=1e-12, abs=1e-14)
    # the gradient is handed to the backward as float32: one rounding of the float64 value
    assert np.allclose(ours.grad, want_grad, rtol=2.0**-23, atol=1e-12), (ours.grad, want_grad)
    if level == "sequence":  # one ratio per sample, the same for all of its tokens
        ratios = np.exp([np.mean(a - b) for a, b in zip(logp, old)])
        assert ours.metrics["ratio_min"] == pytest.approx(ratios.min(), rel=1e-14)
        clipped = (ratios < 0.8) | (ratios > 1.28)
        assert clipped.any() and not clipped.all()


def test_gspo_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    lengths = [4, 2, 5]
    logp, old, ref = _samples(rng, lengths)
    adv = rng.normal(size=3)
    settings = objectives.GRPOSettings(beta=0.04, loss_type="grpo", importance_sampling_level="sequence")
    result = objectives.grpo_token_loss(logp, old, adv, settings, ref)
    flat, splits, h = np.concatenate(logp), np.cumsum(lengths)[:-1], 1e-6
    for t in range(flat.size):
        up, down = flat.copy(), flat.copy()
        up[t] += h
        down[t] -= h
        slope = (objectives.grpo_token_loss(np.split(up, splits), old, adv, settings, ref).loss
                 - objectives.grpo_token_loss(np.split(down, splits), old, adv, settings, ref).loss) / (2 * h)
        assert abs(slope - result.grad[t]) < 1e-6 * max(1.0, abs(result.grad[t])), t
    with pytest.raises(InputError, match="importance_sampling_level"):
        objectives.GRPOSettings(importance_sampling_level="sample")
