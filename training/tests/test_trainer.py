"""The numeric loop on the tiny real model: it learns, it guards, it cancels, it saves for vLLM."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from training import losses
from training.config import TrainingConfig
from training.trainer import Cancelled, Example, GuardFailed, load_policy, response_logprobs, template_ids, train

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def turn_data(tiny_model_dir):
    """A sampled reply with its stored ids and logprobs, as the engine would record them."""
    tokenizer, model = load_policy(tiny_model_dir, None, TrainingConfig(), torch.device("cpu"))
    prompt = template_ids(tokenizer, QUESTION)
    torch.manual_seed(1)
    with torch.no_grad(), model.disable_adapter():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=True, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    response = out.sequences[0, len(prompt):].tolist()
    old = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, response)]
    return prompt, response, old


def examples(turn_data, reward=-1.0):
    prompt, response, old = turn_data
    hinted = [{"role": "user", "content": QUESTION[0]["content"] + "\n\n[user's hint / instruction]\none word"}]
    return [
        Example(kind="eval", sample_id=1, prompt_ids=prompt, response_ids=response, old_logprobs=old, reward=reward),
        Example(kind="directive", sample_id=2, messages=hinted, target_text="Paris."),
        Example(kind="hint", sample_id=3, prompt_ids=prompt, response_ids=response, old_logprobs=old, messages=hinted),
    ]


def run(tiny_model_dir, tmp_path, exs, **overrides):
    config = TrainingConfig(**{"steps_per_job": 3, "lr": 1e-3, **overrides})
    return train(config, exs, base_model_path=tiny_model_dir, init_adapter_dir=None, out_dir=tmp_path / "out",
                 served_model_name="base", device="cpu")


def test_combined_job_raises_log_p_of_target_and_saves_vllm_safe_adapter(tiny_model_dir, tmp_path, turn_data):
    metrics = run(tiny_model_dir, tmp_path, examples(turn_data))
    assert metrics["logp_target_after"] > metrics["logp_target_before"]
    assert metrics["samples_used"] == 2 and metrics["samples_skipped"] == [3]  # hint needs teacher mode
    assert all(math.isfinite(metrics[k]) for k in ("loss", "loss_ppo", "loss_opd", "probe_kl"))
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "base"
    assert config["r"] == 8 and config["bias"] == "none" and not config.get("use_dora")
    assert not config.get("modules_to_save")
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert not (tmp_path / "out" / "adapter_model.bin").exists()


def test_teacher_mode_uses_hint_samples(tiny_model_dir, tmp_path, turn_data):
    metrics = run(tiny_model_dir, tmp_path, examples(turn_data), opd_mode="teacher", method="opd")
    assert metrics["hint_samples"] == 1 and metrics["eval_samples"] == 0
    assert math.isfinite(metrics["loss_teacher"])


def test_nan_loss_fails_the_guard_and_saves_nothing(tiny_model_dir, tmp_path, turn_data):
    with pytest.raises(GuardFailed, match="non-finite"):
        run(tiny_model_dir, tmp_path, examples(turn_data, reward=float("nan")))
    assert not (tmp_path / "out").exists()


def test_kl_guard_stops_a_runaway_update(tiny_model_dir, tmp_path, turn_data):
    with pytest.raises(GuardFailed, match="KL"):
        run(tiny_model_dir, tmp_path, examples(turn_data)[:1], method="binary", lr=0.05, kl_guard=1e-6, steps_per_job=2)
    assert not (tmp_path / "out").exists()


def test_a_step_past_the_kl_guard_is_undone_and_ends_the_job(tiny_model_dir, tmp_path, turn_data):
    """The guard is a trust region: the job publishes the last step whose probe KL was within it."""
    free = run(tiny_model_dir, tmp_path / "free", examples(turn_data)[:2], method="combined", lr=0.02,
               steps_per_job=8, kl_guard=100.0)
    assert free["steps"] == 8 and not free["stopped_early"]
    guard = free["probe_kl"] / 3  # reached within the 8 steps, the KL grows step by step
    bounded = run(tiny_model_dir, tmp_path / "bounded", examples(turn_data)[:2], method="combined", lr=0.02,
                  steps_per_job=8, kl_guard=guard)
    assert bounded["stopped_early"] and 1 <= bounded["steps"] < 8
    assert 0 < bounded["probe_kl"] <= guard
    assert (tmp_path / "bounded" / "out" / "adapter_model.safetensors").exists()


def test_cancel_stops_before_the_next_step(tiny_model_dir, tmp_path, turn_data):
    config = TrainingConfig(steps_per_job=5)
    calls = []
    with pytest.raises(Cancelled):
        train(config, examples(turn_data), base_model_path=tiny_model_dir, init_adapter_dir=None,
              out_dir=tmp_path / "out", served_model_name="base", device="cpu",
              should_stop=lambda: len(calls) >= 1, progress=lambda p, m: calls.append(p))
    assert calls == [20] and not (tmp_path / "out").exists()


def test_continues_from_an_existing_adapter(tiny_model_dir, tmp_path, turn_data):
    run(tiny_model_dir, tmp_path, examples(turn_data))
    config = TrainingConfig(steps_per_job=1)
    metrics = train(config, examples(turn_data), base_model_path=tiny_model_dir, init_adapter_dir=tmp_path / "out",
                    out_dir=tmp_path / "out2", served_model_name="base", device="cpu")
    assert metrics["steps"] == 1 and (tmp_path / "out2" / "adapter_model.safetensors").exists()


def test_the_kl_holds_thumbed_up_replies_to_the_starting_version_and_thumbed_down_to_the_base(
        tiny_model_dir, tmp_path, turn_data):
    """A thumbed-up style the adapter already learned is not pulled back toward the base model (the
    first step on a trained adapter starts at zero KL; kl_base_min_prob 0, every token held to the
    starting version), while a −1 stays anchored to the base."""
    run(tiny_model_dir, tmp_path, examples(turn_data)[:2], lr=0.02)
    prompt, response, _ = turn_data
    _, model = load_policy(tiny_model_dir, tmp_path / "out", TrainingConfig(), torch.device("cpu"))
    model.eval()
    with torch.no_grad():
        trained, mask = response_logprobs(model, [(prompt, response)], torch.device("cpu"), 0)
        with model.disable_adapter():
            base, _ = response_logprobs(model, [(prompt, response)], torch.device("cpu"), 0)
    kl_to_base = losses.kl_penalty(trained, base, mask).item()
    assert kl_to_base > 1e-3  # a KL held to the base would start here

    def kl_by_step(reward):
        steps = []
        sample = Example(kind="eval", sample_id=1, prompt_ids=prompt, response_ids=response, reward=reward)
        train(TrainingConfig(steps_per_job=2, lr=0.02, method="binary", kl_base_min_prob=0.0), [sample],
              base_model_path=tiny_model_dir,
              init_adapter_dir=tmp_path / "out", out_dir=tmp_path / f"out{reward}", served_model_name="base",
              device="cpu", progress=lambda percent, parts: steps.append(parts["kl"]))
        return steps

    thumbed_up = kl_by_step(1.0)
    assert thumbed_up[0] == pytest.approx(0.0, abs=1e-6) and thumbed_up[1] > 1e-6
    assert kl_by_step(-1.0)[0] == pytest.approx(kl_to_base, rel=1e-3)


def test_a_batch_of_thumbs_up_alone_leaves_the_adapter_where_it_was(tiny_model_dir, tmp_path, turn_data):
    """With the reward baseline, replies that all got the same thumb carry no advantage: the job
    doesn't train the model on its own samples. Without it, the same batch moves the adapter."""
    prompt, response, old = turn_data
    approved = [Example(kind="eval", sample_id=i, prompt_ids=prompt, response_ids=response, old_logprobs=old,
                        reward=1.0) for i in (1, 2)]

    def lora_b_norm(out, **overrides):
        metrics = run(tiny_model_dir, out, approved, method="binary", **overrides)
        weights = load_file(out / "out" / "adapter_model.safetensors")
        return metrics, sum(w.abs().sum().item() for name, w in weights.items() if "lora_B" in name)

    metrics, moved = lora_b_norm(tmp_path / "baseline")
    assert metrics["reward_baseline"] == 1.0 and moved == 0.0  # B starts at zero and stays there
    metrics, moved = lora_b_norm(tmp_path / "raw", reward_baseline=False)
    assert metrics["reward_baseline"] == 0.0 and moved > 0.0


def test_the_baseline_counts_a_corrected_reply_once(tiny_model_dir, tmp_path, turn_data):
    """A corrected reply carries two -1s (the thumb and the correction's). Counted per sample, a
    job on it and one thumbed-up reply had a baseline of -1/3; counted per reply it is 0, and a
    lone corrected reply keeps its -1 instead of losing it to its own double count."""
    prompt, response, old = turn_data

    def reply(turn_id, reward, copies):
        return [Example(kind="eval", sample_id=10 * turn_id + i, turn_id=turn_id, prompt_ids=prompt,
                        response_ids=response, old_logprobs=old, reward=reward) for i in range(copies)]

    metrics = run(tiny_model_dir, tmp_path / "two", reply(1, -1.0, 2) + reply(2, 1.0, 1), method="binary")
    assert metrics["reward_baseline"] == 0.0 and metrics["reward_mean"] == pytest.approx(-1 / 3)
    metrics = run(tiny_model_dir, tmp_path / "lone", reply(1, -1.0, 2), method="binary")
    assert metrics["reward_baseline"] == 0.0 and metrics["loss_ppo"] != 0.0


def test_config_rejects_ranks_vllm_cannot_serve():
    with pytest.raises(ValueError, match="lora_rank"):
        TrainingConfig(lora_rank=12)
    with pytest.raises(ValueError, match="method"):
        TrainingConfig(method="dpo")
    with pytest.raises(ValueError, match="replay_corrections"):
        TrainingConfig(replay_corrections=-1)
    with pytest.raises(ValueError, match="opd_slip_prob"):
        TrainingConfig(opd_slip_prob=1.0)


EOS = 2


@pytest.mark.parametrize("response, corrected, blamed", [
    ([5, 6, 7, EOS], [5, 6, 7, 9, 9], [0, 0, 0, 1]),  # a sign-off appended: only the premature end
    ([5, 6, 7], [5, 6, 7, 9], [0, 0, 1]),  # cut off by max_tokens: its last token takes the blame
    ([5, 6, 7, EOS], [4, 5, 6, 7], [1, 0, 0, 0]),  # a prefix added: the first token, not the answer
    ([5, 6, 7, 8, EOS], [9, 6, 3, 8], [1, 0, 1, 0, 0]),  # words recased here and there: those words
    ([5, 6, 7, 8, EOS], [5, 6], [0, 0, 1, 1, 0]),  # cut short: the words it should not have said
    ([5, 6, 7], [], [1, 1, 1]),
])
def test_a_corrections_minus_one_falls_on_the_tokens_it_changed(response, corrected, blamed):
    from training.trainer import blamed_tokens

    assert blamed_tokens(response, corrected, EOS) == blamed


def test_the_kl_to_base_leaves_the_tokens_a_correction_changed_free():
    from training.trainer import unblamed_mask

    corrected = Example(kind="eval", reward=-1.0, blamed=[1, 0, 0])
    thumbed = Example(kind="eval", reward=1.0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert unblamed_mask([corrected, thumbed], mask).tolist() == [[0, 1, 1, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize("original, target, weights", [
    # a sign-off appended: the kept reply weighs nothing, the sign-off and the end count
    ([5, 6, 7, EOS], [5, 6, 7, 8, 9, EOS], [0, 0, 0, 1, 1, 1]),
    # a prefix added: the kept reply after it weighs nothing
    ([5, 6, 7, EOS], [4, 5, 6, 7, EOS], [1, 0, 0, 0, 1]),
    # a word changed in the middle
    ([5, 6, 7, EOS], [5, 9, 7, EOS], [0, 1, 0, 1]),
    # cut short: only where it now stops is taught
    ([5, 6, 7, 8, EOS], [5, 6, EOS], [0, 0, 1]),
    # rewritten throughout (uppercase): everything counts
    ([5, 6, 7, EOS], [8, 9, EOS], [1, 1, 1]),
    # a repeated token is not counted twice, as kept opening and kept ending
    ([5, 5, EOS], [5, 5, 5, EOS], [0, 0, 1, 1]),
    # no stored reply (an a* written from scratch): plain SFT
    ([], [5, 6, EOS], [1, 1, 1]),
])
def test_opd_knows_which_tokens_the_correction_changed(original, target, weights):
    from training.trainer import edited_tokens

    assert edited_tokens(original, target, EOS) == weights


LOW, HIGH = math.log(0.01), math.log(0.9)


@pytest.mark.parametrize("original, logprobs, target, slips", [
    # a sign-off appended to a reply with one improbable draw: only that kept token is a slip
    ([5, 6, 7, EOS], [HIGH, LOW, HIGH, HIGH], [5, 6, 7, 8, 9, EOS], [0, 1, 0, 0, 0, 0]),
    # the user rewrote the improbable token: what they wrote is never a slip
    ([5, 6, 7, EOS], [HIGH, LOW, HIGH, HIGH], [5, 9, 7, EOS], [0, 0, 0, 0]),
    # a prefix added: kept tokens keep their own draw's probability
    ([5, 6, EOS], [LOW, HIGH, HIGH], [4, 5, 6, EOS], [0, 1, 0, 0]),
    # no stored logprobs (or torn ones): nothing is a slip
    ([5, 6, EOS], None, [5, 6, 8, EOS], [0, 0, 0, 0]),
    ([5, 6, EOS], [LOW], [5, 6, 8, EOS], [0, 0, 0, 0]),
])
def test_opd_finds_the_kept_tokens_the_sampler_drew_improbably(original, logprobs, target, slips):
    from training.trainer import slip_tokens

    assert slip_tokens(original, logprobs, target, EOS, 0.05) == slips
    assert slip_tokens(original, logprobs, target, EOS, 0.0) == [0] * len(target)  # off


def test_a_correction_keeps_the_blame_off_the_tokens_it_kept(tiny_model_dir, tmp_path, turn_data):
    """A -1 reply whose correction kept all but its end: its opening barely moves, unlike an
    uncorrected -1 reply whose every token is pushed down."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, response, old = turn_data
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    kept_text = tokenizer.decode(response) + " and that is all"

    def opening_logprob(out):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out).eval()
        with torch.no_grad():
            lp, _ = response_logprobs(model, [(prompt, response)], torch.device("cpu"), 0)
        return lp[0, : len(response) - 1].sum().item()

    blamed_all = Example(kind="eval", prompt_ids=prompt, response_ids=response, old_logprobs=old, reward=-1.0)
    blamed_end = Example(kind="eval", prompt_ids=prompt, response_ids=response, old_logprobs=old, reward=-1.0,
                         corrected_text=kept_text)
    before = sum(old[: len(response) - 1])
    for name, example in (("all", blamed_all), ("end", blamed_end)):
        train(TrainingConfig(method="binary", steps_per_job=4, lr=5e-3, kl_guard=100.0), [example],
              base_model_path=tiny_model_dir, init_adapter_dir=None, out_dir=tmp_path / name,
              served_model_name="base", device="cpu")
    drop_all = before - opening_logprob(tmp_path / "all")
    drop_end = before - opening_logprob(tmp_path / "end")
    assert drop_all > 0.5 and drop_end < drop_all / 2, (drop_all, drop_end)


def test_the_kl_guard_compares_distributions_along_the_greedy_probe_reply(tiny_model_dir):
    from training.trainer import PROBE_REPLY_TOKENS, end_token_id, probe_distributions, probe_replies

    tokenizer, model = load_policy(tiny_model_dir, None, TrainingConfig(), torch.device("cpu"))
    model.eval()
    prompt = template_ids(tokenizer, QUESTION)
    [(ids, reply)] = probe_replies(model, [prompt], torch.device("cpu"), end_token_id(tokenizer, model), 0)
    assert ids == prompt and 1 <= len(reply) <= PROBE_REPLY_TOKENS
    [dist] = probe_distributions(model, [(ids, reply)], torch.device("cpu"))
    assert dist.shape[:2] == (1, len(reply))
    # Each position is the distribution that produced the reply's token there (greedy: the argmax).
    assert dist[0].argmax(-1).tolist() == reply


def test_opd_holds_the_tokens_a_correction_kept_to_the_base_model(tiny_model_dir, tmp_path, turn_data):
    """A correction that appends to a sampled reply: both ways learn the appended words, but only
    plain -log p(a*) also drags the kept reply away from the base model's distribution."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.losses import position_kl
    from training.trainer import edited_tokens, end_token_id, response_logprobs

    prompt, response, _ = turn_data
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    reply = [t for t in response if t != 2]
    target_text = tokenizer.decode(reply) + " and that is all"

    def measure(out):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out).eval()
        target = tokenizer(target_text, add_special_tokens=False)["input_ids"] + [end_token_id(tokenizer, model)]
        edited = torch.tensor(edited_tokens(response, target, end_token_id(tokenizer, model)), dtype=torch.float32)
        with torch.no_grad():
            lp, _, dist = response_logprobs(model, [(prompt, target)], torch.device("cpu"), 0, distributions=True)
            with model.disable_adapter():
                _, _, base_dist = response_logprobs(model, [(prompt, target)], torch.device("cpu"), 0,
                                                    distributions=True)
        kept_kl = (position_kl(base_dist, dist)[0] * (1 - edited)).sum() / (1 - edited).sum()
        return (lp[0] * edited).sum().item() / edited.sum().item(), kept_kl.item()

    for name, distill in (("sft", False), ("distill", True)):
        directive = Example(kind="directive", messages=QUESTION, target_text=target_text, original_ids=response)
        train(TrainingConfig(method="opd", steps_per_job=6, lr=5e-3, kl_guard=100.0, distill_kept_tokens=distill,
                             distill_min_base_prob=0.0),
              [directive], base_model_path=tiny_model_dir, init_adapter_dir=None, out_dir=tmp_path / name,
              served_model_name="base", device="cpu")
    sft_logp, sft_kept_kl = measure(tmp_path / "sft")
    distill_logp, distill_kept_kl = measure(tmp_path / "distill")
    assert distill_logp > sft_logp - 0.5, (distill_logp, sft_logp)  # the edit is learned as well
    assert distill_kept_kl < sft_kept_kl / 2, (distill_kept_kl, sft_kept_kl)


def test_distill_holds_only_the_kept_tokens_the_base_model_finds_plausible(tiny_model_dir, turn_data):
    """mark_held_tokens: a kept token is held to the base model where the base gives it at least
    distill_min_base_prob, and stays in -log p(a*) below it; edited tokens are never held, and a
    held slip is no longer left out."""
    from training.trainer import edited_tokens, end_token_id, mark_held_tokens

    prompt, response, _ = turn_data
    tokenizer, model = load_policy(tiny_model_dir, None, TrainingConfig(), torch.device("cpu"))
    eos = end_token_id(tokenizer, model)
    target = tokenizer(tokenizer.decode([t for t in response if t != EOS]) + " and that is all",
                       add_special_tokens=False)["input_ids"] + [eos]
    with torch.no_grad(), model.disable_adapter():
        base_lp, _ = response_logprobs(model, [(prompt, target)], torch.device("cpu"), 0)
    base_p = base_lp[0].exp().tolist()
    edited = edited_tokens(response, target, eos)
    kept_p = sorted(p for p, e in zip(base_p, edited) if not e)
    assert len(kept_p) >= 2 and kept_p[0] < kept_p[-1]

    def held(min_base_prob):
        e = Example(kind="directive", prompt_ids=prompt, response_ids=target, edited=edited, slips=[1] * len(target))
        mark_held_tokens(model, [e], min_base_prob, torch.device("cpu"), 0, micro=8)
        assert all(not (h and s) for h, s in zip(e.held, e.slips))  # a held token is not a slip too
        return e.held

    assert held(0.0) == [1 - e for e in edited]  # every kept token, as before the threshold
    threshold = (kept_p[0] + kept_p[-1]) / 2
    gated = held(threshold)
    assert gated == [int(not e and p >= threshold) for e, p in zip(edited, base_p)]
    assert 0 < sum(gated) < sum(1 - e for e in edited)


def test_opd_reads_the_base_distributions_once_at_the_held_positions(tiny_model_dir, turn_data):
    """mark_held_tokens returns one (held tokens, vocabulary) block per micro-batch: the base
    model's log-softmax there and not the adapter's."""
    from training.trainer import mark_held_tokens

    prompt, response, _ = turn_data
    _, model = load_policy(tiny_model_dir, None, TrainingConfig(), torch.device("cpu"))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.5)  # an adapter whose distributions differ from the base's
    cpu = torch.device("cpu")
    held = [[1, 0] * (len(response) // 2) + [1] * (len(response) % 2), [0] * len(response), [1] * len(response)]
    directive = [Example(kind="directive", prompt_ids=prompt, response_ids=response, edited=[1 - h for h in row],
                         slips=[0] * len(response)) for row in held]
    blocks = mark_held_tokens(model, directive, 0.0, cpu, 0, micro=2)  # 0: every kept token is held
    assert [e.held for e in directive] == held
    assert [b.shape[0] for b in blocks] == [sum(held[0]) + sum(held[1]), sum(held[2])]
    with torch.no_grad():
        _, _, adapted = response_logprobs(model, [(prompt, response)], cpu, 0, distributions=True)
        with model.disable_adapter():
            _, _, base = response_logprobs(model, [(prompt, response)], cpu, 0, distributions=True)
    first = torch.tensor(held[0]).bool()
    assert torch.allclose(blocks[0], base[0][first], atol=1e-5) and torch.allclose(blocks[1], base[0], atol=1e-5)
    assert not torch.allclose(blocks[1], adapted[0])


def test_the_kl_holds_a_thumbed_up_reply_to_the_base_only_where_the_base_finds_it_plausible(tiny_model_dir,
                                                                                            turn_data):
    """kl_reference: a thumbed-down reply is held to the base model; a thumbed-up one to the
    version the job starts from, except on the tokens the base gives at least kl_base_min_prob."""
    from training.trainer import kl_reference

    prompt, response, _ = turn_data
    _, model = load_policy(tiny_model_dir, None, TrainingConfig(), torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.5)  # a started version that differs from the base
    cpu = torch.device("cpu")
    start = response_logprobs(model, [(prompt, response)], cpu, 0)[0][0].tolist()
    with torch.no_grad(), model.disable_adapter():
        base = response_logprobs(model, [(prompt, response)], cpu, 0)[0][0].tolist()
    assert max(abs(b - s) for b, s in zip(base, start)) > 0.1
    ranked = sorted(base)
    threshold = math.exp((ranked[0] + ranked[-1]) / 2)

    def reference(reward, min_base_prob):
        e = Example(kind="eval", prompt_ids=prompt, response_ids=response, reward=reward)
        return kl_reference(model, e, min_base_prob, cpu, 0)

    assert reference(-1.0, threshold) == pytest.approx(base)
    assert reference(1.0, 0.0) == pytest.approx(start)
    gated = reference(1.0, threshold)
    expected = [b if math.exp(b) >= threshold else s for b, s in zip(base, start)]
    assert gated == pytest.approx(expected)
    assert gated != pytest.approx(base) and gated != pytest.approx(start)


def test_opd_leaves_out_the_kept_tokens_the_sampler_drew_improbably(tiny_model_dir, tmp_path, turn_data):
    """A correction that appends to a reply whose every token was a slip of sampling: with
    opd_slip_prob the appended words are learned as before, and the slips are not taught."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.trainer import edited_tokens, end_token_id

    prompt, response, _ = turn_data
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    target_text = tokenizer.decode([t for t in response if t != EOS]) + " and that is all"
    improbable = [math.log(0.001)] * len(response)

    def mean_logprobs(out):
        """Mean log p of a*'s edited tokens and of its kept ones."""
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, out).eval() if out else base.eval()
        target = tokenizer(target_text, add_special_tokens=False)["input_ids"] + [end_token_id(tokenizer, model)]
        edited = torch.tensor(edited_tokens(response, target, end_token_id(tokenizer, model)), dtype=torch.float32)
        with torch.no_grad():
            lp, _ = response_logprobs(model, [(prompt, target)], torch.device("cpu"), 0)
        return ((lp[0] * edited).sum() / edited.sum()).item(), ((lp[0] * (1 - edited)).sum() / (1 - edited).sum()).item()

    for name, slip_prob in (("all", 0.0), ("filtered", 0.05)):
        directive = Example(kind="directive", messages=QUESTION, target_text=target_text, original_ids=response,
                            original_logprobs=improbable)
        metrics = train(TrainingConfig(method="opd", steps_per_job=6, lr=5e-3, kl_guard=100.0, opd_slip_prob=slip_prob),
                        [directive], base_model_path=tiny_model_dir, init_adapter_dir=None,
                        out_dir=tmp_path / name, served_model_name="base", device="cpu")
        assert (metrics["opd_slips_skipped"] > 0) == (slip_prob > 0)
    _, kept_before = mean_logprobs(None)
    all_edited, all_kept = mean_logprobs(tmp_path / "all")
    filtered_edited, filtered_kept = mean_logprobs(tmp_path / "filtered")
    assert filtered_edited > all_edited - 0.5, (filtered_edited, all_edited)  # the appended words are learned
    assert filtered_kept - kept_before < (all_kept - kept_before) / 2, (kept_before, all_kept, filtered_kept)
