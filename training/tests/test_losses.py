"""The loss functions on hand-computed tensors, and one optimizer step on the tiny real model."""
import math

import pytest
import torch

from training import losses
from training.config import TrainingConfig


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ppo_loss_is_minus_advantage_when_policy_unchanged():
    lp = t([[-1.0, -2.0]])
    assert losses.ppo_clip_loss(lp, lp, t([1.0]), t([[1, 1]])).item() == pytest.approx(-1.0)
    assert losses.ppo_clip_loss(lp, lp, t([-1.0]), t([[1, 1]])).item() == pytest.approx(1.0)


def test_ppo_loss_clips_ratio_above_one_plus_eps_for_positive_advantage():
    old = t([[0.0]])
    new = t([[math.log(1.5)]])  # r = 1.5 > 1.2
    # min(1.5 * 1, 1.2 * 1) = 1.2
    assert losses.ppo_clip_loss(new, old, t([1.0]), t([[1]]), clip_eps=0.2).item() == pytest.approx(-1.2)


def test_ppo_loss_clips_ratio_below_one_minus_eps_for_negative_advantage():
    old = t([[0.0]])
    new = t([[math.log(0.5)]])  # r = 0.5 < 0.8
    # min(0.5 * -1, 0.8 * -1) = -0.8
    assert losses.ppo_clip_loss(new, old, t([-1.0]), t([[1]]), clip_eps=0.2).item() == pytest.approx(0.8)


def test_ppo_loss_does_not_clip_the_pessimistic_side():
    old = t([[0.0]])
    # r = 0.5 with A = +1: min(0.5, 0.8) = 0.5 (unclipped, the gradient still flows)
    assert losses.ppo_clip_loss(t([[math.log(0.5)]]), old, t([1.0]), t([[1]])).item() == pytest.approx(-0.5)
    # r = 1.5 with A = -1: min(-1.5, -1.2) = -1.5
    assert losses.ppo_clip_loss(t([[math.log(1.5)]]), old, t([-1.0]), t([[1]])).item() == pytest.approx(1.5)


def test_ppo_gradient_is_zero_once_clipped():
    new = torch.tensor([[math.log(1.5)]], requires_grad=True)
    losses.ppo_clip_loss(new, t([[0.0]]), t([1.0]), t([[1]])).backward()
    assert new.grad.abs().item() == 0.0


def test_padding_tokens_do_not_count():
    lp = t([[-1.0, -1.0, 5.0]])
    old = t([[-1.0, -1.0, -9.0]])
    assert losses.ppo_clip_loss(lp, old, t([1.0]), t([[1, 1, 0]])).item() == pytest.approx(-1.0)
    assert losses.opd_loss(t([[-2.0, -4.0, -100.0]]), t([[1, 1, 0]])).item() == pytest.approx(3.0)


def test_opd_loss_is_token_mean_over_the_batch():
    lp = t([[-1.0, 0.0], [-3.0, -5.0]])
    mask = t([[1, 0], [1, 1]])
    assert losses.opd_loss(lp, mask).item() == pytest.approx((1 + 3 + 5) / 3)


def test_empty_mask_gives_zero_not_nan():
    assert losses.opd_loss(t([[-1.0]]), t([[0]])).item() == 0.0


def test_combined_loss_weights_opd_by_alpha():
    assert losses.combined_loss(t(2.0), t(3.0), alpha=0.5).item() == pytest.approx(3.5)
    assert losses.combined_loss(t(2.0), t(3.0), alpha=0.0).item() == pytest.approx(2.0)


def test_kl_term_only_counts_with_a_coefficient():
    assert losses.combined_loss(t(1.0), t(0.0), kl=t(4.0), kl_coef=0.0).item() == pytest.approx(1.0)
    assert losses.combined_loss(t(1.0), t(0.0), kl=t(4.0), kl_coef=0.25).item() == pytest.approx(2.0)


def test_kl_penalty_is_zero_for_identical_policies_and_positive_otherwise():
    lp = t([[-1.0, -2.0]])
    assert losses.kl_penalty(lp, lp, t([[1, 1]])).item() == pytest.approx(0.0)
    assert losses.kl_penalty(lp, t([[-2.0, -1.0]]), t([[1, 1]])).item() > 0


def test_teacher_advantage_is_clipped_difference():
    adv = losses.teacher_advantages(t([[-0.5, -5.0, 0.0]]), t([[-1.0, -1.0, -3.0]]), t([[1, 1, 0]]), clip=1.0)
    assert adv.tolist() == [[pytest.approx(0.5), -1.0, 0.0]]


def test_the_reward_baseline_is_the_batch_mean_and_zero_for_a_lone_reply():
    assert losses.reward_baseline([1.0, 1.0, 1.0, -1.0]) == pytest.approx(0.5)
    assert losses.reward_baseline([-1.0, -1.0]) == -1.0  # the same thumb on every reply: no advantage
    assert losses.reward_baseline([-1.0]) == 0.0  # nothing to compare with: the reward is the advantage
    assert losses.reward_baseline([]) == 0.0


def test_gather_logprobs_matches_log_softmax():
    logits = t([[[0.0, math.log(3.0)]]])
    assert losses.gather_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))


def test_distribution_kl_is_zero_for_same_distribution():
    p = torch.log_softmax(torch.randn(1, 3, 5), -1)
    assert losses.distribution_kl(p, p, torch.ones(1, 3)).item() == pytest.approx(0.0, abs=1e-6)


# One step on the tiny real model
# ------------------------------------------------------------------------------


@pytest.fixture
def tiny(tiny_model_dir):
    from training.trainer import load_policy, template_ids

    config = TrainingConfig(lr=1e-2)
    tokenizer, model = load_policy(tiny_model_dir, None, config, torch.device("cpu"))
    prompt = template_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    return tokenizer, model, prompt


def _sample(model, prompt, n=6):
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=True, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    response = out.sequences[0, len(prompt):].tolist()
    old = [torch.log_softmax(s[0].float(), -1)[tok].item() for s, tok in zip(out.scores, response)]
    return response, old


def _logp(model, prompt, response):
    from training.trainer import response_logprobs

    with torch.no_grad():
        lp, mask = response_logprobs(model, [(prompt, response)], torch.device("cpu"), 0)
    return (lp * mask).sum().item()


def test_negative_reward_lowers_the_sampled_tokens_logprob(tiny):
    from training.trainer import response_logprobs

    _, model, prompt = tiny
    response, old = _sample(model, prompt)
    before = _logp(model, prompt, response)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lp, mask = response_logprobs(model, [(prompt, response)], torch.device("cpu"), 0)
    losses.ppo_clip_loss(lp, t([old]), t([-1.0]), mask).backward()
    optimizer.step()
    assert _logp(model, prompt, response) < before


def test_opd_step_raises_log_p_of_the_target(tiny):
    from training.trainer import response_logprobs

    tokenizer, model, prompt = tiny
    target = tokenizer("Paris.", add_special_tokens=False)["input_ids"]
    before = _logp(model, prompt, target)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    lp, mask = response_logprobs(model, [(prompt, target)], torch.device("cpu"), 0)
    losses.opd_loss(lp, mask).backward()
    optimizer.step()
    assert _logp(model, prompt, target) > before


def test_prompt_tokens_get_no_gradient_signal(tiny):
    """Only response positions enter the loss: changing a padded tail changes nothing."""
    from training.trainer import response_logprobs

    _, model, prompt = tiny
    a, mask_a = response_logprobs(model, [(prompt, [5, 6])], torch.device("cpu"), 0)
    b, mask_b = response_logprobs(model, [(prompt, [5, 6]), (prompt, [5, 6, 7, 8])], torch.device("cpu"), 0)
    assert mask_a.tolist() == [[1, 1]]
    assert mask_b[0].tolist() == [1, 1, 0, 0]
    assert torch.allclose(a[0], b[0, :2], atol=1e-5)


def test_opd_loss_holds_kept_tokens_to_the_base_instead_of_the_sample():
    lp = t([[-2.0, -4.0, -6.0]])
    mask, kept = t([[1, 1, 1]]), t([[0, 1, 0]])
    kl = t([[9.0, 0.5, 9.0]])
    # changed tokens: -log p; the kept one: its KL to the base; over all 3 target tokens
    assert losses.opd_loss(lp, mask, kept_mask=kept, kept_kl=kl).item() == pytest.approx((2 + 0.5 + 6) / 3)
    assert losses.opd_loss(lp, mask, kept_mask=t([[0, 0, 0]]), kept_kl=kl).item() == pytest.approx(4.0)


def test_position_kl_is_zero_only_where_distributions_agree():
    p = torch.log_softmax(t([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]]), -1)
    q = torch.log_softmax(t([[[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]]), -1)
    kl = losses.position_kl(p, q)
    assert kl.shape == (1, 2) and kl[0, 0].item() == pytest.approx(0.0, abs=1e-6) and kl[0, 1].item() > 0.5
