"""Loss functions of OpenClaw-RL's two learning signals, as pure functions on tensors.

Shapes: B = sequences, T = positions (response tokens, left-aligned, right-padded). `mask` is
1.0 on the tokens that count (response or target tokens) and 0.0 on padding; prompt tokens
never appear in these tensors, the trainer gathers response positions first.

Normalisation: every loss is a *token mean* over the whole batch (sum over unmasked tokens /
number of unmasked tokens), as slime's token-level loss does. A long reply then weighs more
than a short one, but one long reply can't drown the per-token signal of a batch of short ones
the way a per-sequence mean would amplify them.
"""
import torch


def masked_mean(values, mask):
    """Sum of values where mask is 1, over the number of such entries (0 when the mask is empty).

    Args:
        values: (B, T) float tensor.
        mask: (B, T) float or bool tensor.
    Returns:
        A scalar tensor.
    """
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def gather_logprobs(logits, targets):
    """log softmax(logits)[targets] per position.

    Args:
        logits: (B, T, V) float tensor (the model's output at the positions *predicting* targets).
        targets: (B, T) long tensor of token ids.
    Returns:
        (B, T) float tensor of log-probabilities.
    """
    # log_softmax in float32: bf16 logits lose the tail of the distribution.
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def ppo_clip_loss(logprobs, old_logprobs, advantages, mask, *, clip_eps=0.2):
    """PPO's clipped surrogate (Schulman et al. 2017, Eq. 7) with a binary reward as advantage.

        r_t = exp(log pi_theta(a_t|c) - log pi_old(a_t|c))
        L   = -mean_t min(r_t A_t, clip(r_t, 1 - eps, 1 + eps) A_t)

    Args:
        logprobs: (B, T) log pi_theta of the sampled response tokens (requires grad).
        old_logprobs: (B, T) log pi_old of the same tokens, as stored at generation time.
        advantages: (B, T) per-token advantages, or (B,) per-sequence (the ±1 reward of Binary RL,
            broadcast to every response token).
        mask: (B, T) 1 on response tokens, 0 on padding.
        clip_eps: the clip range epsilon.
    Returns:
        Scalar loss (token mean over the batch).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -masked_mean(torch.minimum(unclipped, clipped), mask)


def ppo_clip_fraction(logprobs, old_logprobs, mask, *, clip_eps=0.2):
    """Share of response tokens whose ratio left [1 - eps, 1 + eps] (a diagnostic, no grad)."""
    with torch.no_grad():
        ratio = torch.exp(logprobs - old_logprobs)
        outside = ((ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)).float()
        return masked_mean(outside, mask)


def opd_loss(logprobs_of_targets, mask, *, kept_mask=None, kept_kl=None):
    """Hindsight on-policy distillation, token form: L = -sum_i log pi(a*_i | c', a*_<i) / N.

    a* is the user's corrected reply and c' the context with the hindsight hint appended. The
    sum runs over target tokens only (mask) and is divided by their count N, so the loss is in
    nats per target token and its scale doesn't grow with the correction's length.

    Tokens under `kept_mask` (those the user kept from the reply they corrected) contribute
    `kept_kl` instead: KL(pi_base || pi_theta) over the vocabulary there. They hold the model to its
    usual behaviour where the user changed nothing, rather than teaching the sampled tokens
    themselves (slips included) again.

    Args:
        logprobs_of_targets: (B, T) log pi_theta of each target token a*_i.
        mask: (B, T) 1 on target tokens, 0 on padding.
        kept_mask: optional (B, T) 1 on the kept target tokens (a subset of mask).
        kept_kl: (B, T) per-token KL to the base model; required with kept_mask.
    Returns:
        Scalar loss.
    """
    if kept_mask is None:
        return -masked_mean(logprobs_of_targets, mask)
    mask, kept_mask = mask.to(logprobs_of_targets.dtype), kept_mask.to(logprobs_of_targets.dtype)
    per_token = -logprobs_of_targets * (mask - kept_mask) + kept_kl * kept_mask
    return per_token.sum() / mask.sum().clamp(min=1.0)


def reward_baseline(rewards):
    """The baseline subtracted from each ±1 before PPO: the mean reward of the job's replies.

    A reply then teaches by how it compares with the others (REINFORCE with a baseline). A batch
    whose replies all got the same reward carries no such contrast: without the baseline, its +1s
    would train the model on its own samples, slips and wrong answers included, job after job.
    With fewer than two replies there is nothing to compare with, and the baseline is 0.

    Args:
        rewards: one reward per reply (floats; `trainer.reply_rewards` merges the samples of a reply).
    Returns:
        A float.
    """
    return sum(rewards) / len(rewards) if len(rewards) > 1 else 0.0


def teacher_advantages(teacher_logprobs, old_logprobs, mask, *, clip=1.0):
    """OPD teacher mode: A_t = clip(log pi_teacher(a_t | c') - log pi_old(a_t | c), -clip, clip).

    The teacher is the base model reading the hint-enhanced context c'; tokens it finds more
    likely than the student did get a positive advantage. The result feeds `ppo_clip_loss`.

    Args:
        teacher_logprobs, old_logprobs, mask: (B, T).
    Returns:
        (B, T) advantages, 0 on padding.
    """
    return torch.clamp(teacher_logprobs - old_logprobs, -clip, clip) * mask.to(teacher_logprobs.dtype)


def kl_penalty(logprobs, ref_logprobs, mask):
    """KL(pi_theta || pi_ref) per token with Schulman's k3 estimator, always >= 0.

        k3 = exp(ref - logp) - (ref - logp) - 1

    Args:
        logprobs: (B, T) log pi_theta of the sampled tokens.
        ref_logprobs: (B, T) log pi_ref of the same tokens (the base model, or the version the job
            started from).
        mask: (B, T).
    Returns:
        Scalar penalty (token mean).
    """
    delta = ref_logprobs - logprobs
    return masked_mean(torch.exp(delta) - delta - 1.0, mask)


def combined_loss(ppo, opd, *, alpha=0.5, kl=None, kl_coef=0.0):
    """OpenClaw-RL's combined objective: L = L_PPO + alpha * L_OPD (+ kl_coef * KL to a reference).

    Args:
        ppo: scalar PPO loss (0 when the batch has no evaluative sample).
        opd: scalar OPD loss (0 when the batch has no directive sample).
        alpha: weight of the OPD term.
        kl: optional scalar KL penalty; ignored when kl_coef is 0.
    Returns:
        Scalar loss.
    """
    loss = ppo + alpha * opd
    if kl is not None and kl_coef:
        loss = loss + kl_coef * kl
    return loss


def position_kl(logprobs_p, logprobs_q):
    """Exact KL(p || q) over the vocabulary at each position: (B, T, V) log-softmaxes -> (B, T)."""
    return (logprobs_p.exp() * (logprobs_p - logprobs_q)).sum(-1)


def distribution_kl(logprobs_p, logprobs_q, mask):
    """Exact KL(p || q) over the vocabulary per position, token-averaged (the probe guard).

    Args:
        logprobs_p, logprobs_q: (B, T, V) log-softmaxed distributions.
        mask: (B, T).
    Returns:
        Scalar tensor, nats per position.
    """
    return masked_mean(position_kl(logprobs_p, logprobs_q), mask)
